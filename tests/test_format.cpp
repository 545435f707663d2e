// fmt formatters: every policy, Action, UpdateResult and an Ema on one line.
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <fmt/format.h>

#include <catch2/catch.hpp>

namespace test_format {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

TEST_CASE("Every policy prints its name and options", "[format]") {
  CHECK(fmt::format("{}", emakit::Fixed(0.999)) == "Fixed(beta=0.999)");
  CHECK(fmt::format("{}", emakit::ExponentialRamp(0.9999, 2000)) == "ExponentialRamp(decay=0.9999, tau=2000)");
  CHECK(fmt::format("{}", emakit::InversePowerWarmup(0.99).power(0.75).update_after_step(100)) ==
        "InversePowerWarmup(beta=0.99, inv_gamma=1, power=0.75, min_value=0, update_after_step=100, warmup=1, "
        "single_precision=0)");
  CHECK(fmt::format("{}", emakit::PowerFunction(7.0)) == "PowerFunction(gamma=7)");
  CHECK(fmt::format("{}", emakit::Uniform()) == "Uniform()");
  CHECK(fmt::format("{}", emakit::StepSchedule().warmup(emakit::Warmup::copy_before_start).update_every(10)) ==
        "StepSchedule(start_step=0, warmup=copy_before_start, update_every=10, every_offset=0, accumulate=1, "
        "window_edge=end)");
  CHECK(fmt::format("{}", emakit::FlatStorage()) == "FlatStorage");
  CHECK(fmt::format("{}", emakit::ModuleStorage<emakit_test::TinyNetImpl>()) == "ModuleStorage");
  CHECK(fmt::format("{}", emakit::Action::averaged) == "averaged");
  CHECK(fmt::format("{:>8}", emakit::Action::copied) == "  copied");
}

TEST_CASE("An Ema prints config and counters on one line", "[format]") {
  emakit_test::TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  const auto r = ema.update();
  CHECK(fmt::format("{}", r) == "averaged at step 1 (decay 0.5)");
  const auto line = fmt::format("{}", ema);
  CHECK(line.find('\n') == std::string::npos);
  CHECK_THAT(line, Contains("decay=Fixed(beta=0.5)") && Contains("storage=FlatStorage") &&
                       Contains("tensors=7 averaged + 1 copied") && Contains("calls=1") && Contains("updates=1") &&
                       Contains("decay_now=0.5"));
}

struct HalfDecay {  // a user's decay policy without a name
  double decay(const emakit::DecayInput&) const { return 0.5; }
};

TEST_CASE("A custom policy has one name: describe() prints what its checkpoints record", "[format]") {
  emakit_test::TinyNet model;
  emakit::Ema<HalfDecay> ema(*model, HalfDecay{});
  const std::string name(emakit::detail::policy_name<HalfDecay>());
  CHECK_THAT(name, StartsWith("custom:") && Contains("HalfDecay"));
  CHECK_THAT(fmt::format("{}", ema), Contains("decay=" + name));
  const auto state = ema.state_dict();
  const at::Tensor* recorded = state.find("config.decay");
  REQUIRE(recorded != nullptr);
  CHECK(emakit::detail::tensor_string(*recorded) == name);
}

}  // namespace test_format
