// Reliability: the non-finite guard (off by default, as the Python peers), misuse that would
// corrupt the average refused, and damaged checkpoint files that fail instead of loading wrong values.
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <unistd.h>

#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace test_reliability {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::Action;
using emakit_test::bitwise_equal;
using emakit_test::TinyNet;

TEST_CASE("Non-finite guard off (the default, as the peers): a NaN in the model reaches the average", "[reliability]") {
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  model->fc->weight.data()[0][0] = std::numeric_limits<float>::quiet_NaN();
  const auto r = ema.update();
  CHECK(r.action == Action::averaged);
  CHECK(r.non_finite.empty());
  CHECK(std::isnan(ema.average("fc.weight")[0][0].item<float>()));
  CHECK(ema.non_finite_updates() == 0);
}

TEST_CASE("Non-finite guard on: the update changes nothing, is counted and names the tensor", "[reliability]") {
  torch::manual_seed(1);
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().skip_non_finite(true));
  emakit_test::perturb(*model);
  REQUIRE(ema.update().action == Action::averaged);
  const auto before = emakit_test::snapshot(ema.averages());

  model->bn->running_var.data()[2] = std::numeric_limits<float>::infinity();  // a buffer, averaged too
  emakit_test::WarningCapture warnings;
  const auto r = ema.update();
  CHECK(r.action == Action::skipped);
  CHECK(r.non_finite == "bn.running_var");
  CHECK(r.step == 2);
  CHECK(emakit_test::same_averages(ema.averages(), before));
  CHECK(ema.non_finite_updates() == 1);
  CHECK(ema.last_non_finite() == "bn.running_var");
  CHECK(ema.num_updates() == 1);
  CHECK(ema.step() == 2);  // the optimizer's step happened; only the average refused it
  REQUIRE(warnings.messages.size() == 1);
  CHECK_THAT(warnings.messages[0], Contains("bn.running_var") && Contains("step 2"));

  // The first offending tensor in the model's order is named.
  model->fc->weight.data()[1][1] = std::numeric_limits<float>::quiet_NaN();
  CHECK(ema.update().non_finite == "fc.weight");
  CHECK(ema.non_finite_updates() == 2);

  // Finite again: averaging resumes, and the counter survives a state round trip.
  {
    torch::NoGradGuard no_grad;
    model->fc->weight.data()[1][1] = 0.25f;
    model->bn->running_var.fill_(1.0);
  }
  CHECK(ema.update().action == Action::averaged);
  CHECK(ema.num_updates() == 2);
  emakit::FixedEma other(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().skip_non_finite(true));
  other.load_state_dict(ema.state_dict());
  CHECK(other.non_finite_updates() == 2);
  // A state written before the guard existed has no such counter: it loads as 0.
  auto old_state = ema.state_dict();
  old_state.erase("counters.non_finite_updates");
  other.load_state_dict(old_state);
  CHECK(other.non_finite_updates() == 0);
}

TEST_CASE("Non-finite guard on: copies are guarded too, and a bf16 model is scanned in place", "[reliability]") {
  TinyNet model;
  emakit_test::cast_floats(*model, torch::kBFloat16);
  emakit::WarmupEma ema(*model, emakit::InversePowerWarmup(0.999),
                        emakit::StepSchedule().warmup(emakit::Warmup::copy_before_start),
                        emakit::EmaOptions().skip_non_finite(true));
  const auto before = emakit_test::snapshot(ema.averages());
  model->fc->bias.data()[0] = -std::numeric_limits<float>::infinity();
  emakit_test::WarningCapture warnings;
  const auto r = ema.update();  // would be the first update: a copy
  CHECK(warnings.messages.size() == 1);
  CHECK(r.non_finite == "fc.bias");
  CHECK(emakit_test::same_averages(ema.averages(), before));
  CHECK(ema.num_updates() == 0);
}

TEST_CASE("all_finite agrees with ATen's isfinite for every float type, contiguous or not", "[reliability]") {
  torch::manual_seed(2);
  for (auto type : {torch::kFloat, torch::kDouble, torch::kBFloat16, torch::kHalf}) {
    for (int trial = 0; trial < 20; ++trial) {
      auto t = torch::randn({37, 11}).to(type) * 100;
      const int kind = trial % 4;  // 0: finite, 1: NaN, 2: +Inf, 3: -Inf
      const auto at = torch::randint(0, t.numel(), {1}).item<std::int64_t>();
      if (kind == 1) t.view(-1)[at] = std::numeric_limits<double>::quiet_NaN();
      if (kind == 2) t.view(-1)[at] = std::numeric_limits<double>::infinity();
      if (kind == 3) t.view(-1)[at] = -std::numeric_limits<double>::infinity();
      INFO("dtype " << t.scalar_type() << ", kind " << kind);
      CHECK(emakit::detail::all_finite(t) == torch::isfinite(t).all().item<bool>());
      CHECK(emakit::detail::all_finite(t.t()) == torch::isfinite(t).all().item<bool>());  // non-contiguous
      CHECK(emakit::detail::all_finite(t) == (kind == 0));
    }
  }
  CHECK(emakit::detail::all_finite(torch::arange(10)));  // integers are always finite
}

TEST_CASE("Misuse that would corrupt the average is an error and changes nothing", "[reliability]") {
  torch::manual_seed(3);
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::perturb(*model);
  ema.update();
  const auto before = emakit_test::snapshot(ema.averages());
  {
    auto swapped = ema.swap_into();  // the model holds the EMA weights: averaging would average the EMA with itself
    REQUIRE_THROWS_WITH(ema.update(), Contains("SwapGuard") && Contains("itself"));
  }
  CHECK(emakit_test::same_averages(ema.averages(), before));
  CHECK(ema.num_updates() == 1);

  {  // the model's tensor replaced by one of another shape (a rebuilt layer)
    torch::NoGradGuard no_grad;
    model->fc->weight.set_data(torch::randn({5, 3}));
  }
  REQUIRE_THROWS_WITH(ema.update(), Contains("'fc.weight' changed shape from [4, 3] to [5, 3]"));
  CHECK(emakit_test::same_averages(ema.averages(), before));
  CHECK(ema.num_updates() == 1);
  CHECK(ema.calls() == 1);
}

namespace {
std::int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * static_cast<std::int64_t>(::sysconf(_SC_PAGESIZE));
}
}  // namespace

// Soak: many updates with flat resident memory, exact counters, and an fp32 average of constant
// weights that stays bit-identical. 20000 updates here; the long version:
//   EMAKIT_SOAK_UPDATES=1000000 build/torch1.13/tests/emakit_tests "[soak]"
TEST_CASE("Soak: many updates keep memory flat, counters exact and a constant average bit-identical",
          "[reliability][soak]") {
  const char* env = std::getenv("EMAKIT_SOAK_UPDATES");
  const std::int64_t updates = env != nullptr ? std::max<std::int64_t>(1, std::atoll(env)) : 20000;
  TinyNet model;
  emakit_test::fill_floats(*model, 0.3);  // constant weights: lerp(x, x, w) must stay x exactly
  emakit::FixedEma ema(*model, emakit::Fixed(0.999), emakit::StepSchedule().update_every(3));
  for (int i = 0; i < 1000; ++i) ema.update();  // warm up allocator caches and the kernel's plan
  const auto rss_before = resident_bytes();
  for (std::int64_t i = 0; i < updates; ++i) ema.update();
  const auto rss_after = resident_bytes();
  INFO("resident memory " << rss_before << " -> " << rss_after << " bytes over " << updates << " updates");
  CHECK(rss_after - rss_before < 256 * 1024);
  CHECK(ema.calls() == 1000 + updates);
  CHECK(ema.step() == 1000 + updates);
  CHECK(ema.num_updates() == (1000 + updates) / 3);
  CHECK(ema.last_update_step() == (1000 + updates) / 3 * 3);
  for (const auto& item : ema.averages()) {
    INFO(item.key());
    if (item.value().is_floating_point()) CHECK(bitwise_equal(item.value(), torch::full_like(item.value(), 0.3)));
  }
}

// The non-finite guard (EmaOptions::skip_non_finite) reads every tensor an update would read,
// complex ones included: a NaN or an infinity in a real or an imaginary part skips the update.
TEST_CASE("Non-finite guard on: a complex tensor with a NaN or an infinity skips the update, naming it",
          "[reliability]") {
  struct Bad {
    const char* what;
    int part;  // 0: real, 1: imaginary
    float value;
  };
  for (const Bad& bad : {Bad{"a NaN real part", 0, std::numeric_limits<float>::quiet_NaN()},
                         Bad{"an infinite imaginary part", 1, std::numeric_limits<float>::infinity()}}) {
    INFO(bad.what);
    torch::manual_seed(3);
    torch::Tensor weight = torch::randn({5});
    torch::Tensor spectrum = torch::complex(torch::randn({4}), torch::randn({4}));
    REQUIRE(spectrum.scalar_type() == torch::kComplexFloat);
    emakit::FixedEma ema(std::vector<emakit::SourceTensor>{{"weight", weight}, {"spectrum", spectrum}},
                         emakit::Fixed(0.5), {}, emakit::EmaOptions().skip_non_finite(true));
    {
      torch::NoGradGuard no_grad;
      weight.mul_(3.0);
      spectrum.mul_(3.0);
    }
    REQUIRE(ema.update().action == Action::averaged);  // finite: the guard lets it through
    const auto before = emakit_test::snapshot(ema.averages());

    torch::view_as_real(spectrum).select(0, 2).select(0, bad.part).fill_(bad.value);
    emakit_test::WarningCapture warnings;
    const auto r = ema.update();
    CHECK(r.action == Action::skipped);
    CHECK(r.non_finite == "spectrum");
    CHECK(ema.non_finite_updates() == 1);
    CHECK(ema.num_updates() == 1);
    CHECK(emakit_test::same_averages(ema.averages(), before));  // bitwise: nothing was written
    CHECK(warnings.messages.size() == 1);
  }
}

}  // namespace test_reliability
