// emakit::Ema: the update, counters, selection, precision, swap guard, copies, state and errors.
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <torch/serialize.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <utility>
#include <vector>

namespace test_ema {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::Action;
using emakit_test::TinyNet;
using emakit_test::TinyNetImpl;

using emakit_test::same_averages;
using emakit_test::snapshot;

TEST_CASE("An update averages every floating tensor with ema = d*ema + (1-d)*x", "[ema]") {
  torch::manual_seed(0);
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.9));
  const auto before = model->fc->weight.detach().clone();
  emakit_test::perturb(*model);
  const auto result = ema.update();
  CHECK(result.action == Action::averaged);
  CHECK(result.step == 1);
  CHECK(emakit_test::reported_decay_is(result.decay, 0.9));
  // In ulps of fp32 at max(|before|, |x|) (helpers.hpp): the update is 3 from the exact lerp;
  // d*ema + (1-d)*x in fp32 is too (0.9 and 0.1 rounded: < 1 together, two products 1/2 each, the
  // sum 1): 6 apart. ATen's own lerp is the same formula but for a fused product (FMA): 1.5.
  const auto x = model->fc->weight.detach();
  const auto magnitude = emakit_test::operand_magnitude(before, x);
  const auto expected = before * 0.9 + x * 0.1;
  CHECK(emakit_test::max_ulps_at(ema.average("fc.weight"), expected, magnitude, torch::kFloat) <= 6);
  CHECK(emakit_test::max_ulps_at(ema.average("fc.weight"), before.lerp(x, 0.1), magnitude, torch::kFloat) <= 1.5);
  CHECK(ema.num_updates() == 1);
  CHECK(ema.calls() == 1);
  CHECK(ema.step() == 1);
  CHECK(ema.decay() == result.decay);
}

TEST_CASE("Non-floating tensors are copied, never averaged", "[ema]") {
  TinyNet model;
  emakit::FixedEma ema(*model);
  model->bn->num_batches_tracked.fill_(7);
  ema.update();
  CHECK(ema.average("bn.num_batches_tracked").item<std::int64_t>() == 7);
  CHECK(ema.average("bn.num_batches_tracked").scalar_type() == torch::kLong);
  CHECK(ema.names(emakit::Role::copy) == std::vector<std::string>{"bn.num_batches_tracked"});
}

TEST_CASE("Selection: copy-only names, ignored names and prefixes, buffer modes", "[ema][selection]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 1.0);
  emakit::FixedEma ema(*model, emakit::Fixed(0.5), {},
                       emakit::EmaOptions().copy_only({"fc.bias"}).ignore({"scale"}).ignore_prefixes({"bn.running"}));
  emakit_test::fill_floats(*model, 3.0);
  ema.update();
  CHECK(torch::equal(ema.average("fc.weight"), torch::full({4, 3}, 2.0)));  // averaged
  CHECK(torch::equal(ema.average("fc.bias"), torch::full({4}, 3.0)));       // copied
  CHECK_THROWS_WITH(ema.average("scale"), Contains("no tensor 'scale'"));
  CHECK_THROWS_WITH(ema.average("bn.running_mean"), Contains("running_mean"));
  CHECK(ema.averages().size() == 5);

  emakit_test::fill_floats(*model, 1.0);
  emakit::FixedEma copy_buffers(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().buffers(emakit::TensorMode::copy));
  emakit_test::fill_floats(*model, 3.0);
  copy_buffers.update();
  CHECK(torch::equal(copy_buffers.average("bn.running_mean"), torch::full({4}, 3.0)));
  CHECK(torch::equal(copy_buffers.average("bn.weight"), torch::full({4}, 2.0)));

  emakit::FixedEma no_buffers(*model, {}, {}, emakit::EmaOptions().buffers(emakit::TensorMode::ignore));
  CHECK(no_buffers.averages().size() == 4);
}

TEST_CASE("Options that name nothing in the model are errors", "[ema][selection][errors]") {
  TinyNet model;
  CHECK_THROWS_WITH(emakit::FixedEma(*model, {}, {}, emakit::EmaOptions().ignore({"fc.wieght"})),
                    Contains("'fc.wieght'") && Contains("does not have"));
  CHECK_THROWS_WITH(emakit::FixedEma(*model, {}, {}, emakit::EmaOptions().copy_only({"head.bias"})),
                    Contains("'head.bias'"));
  CHECK_THROWS_WITH(emakit::FixedEma(*model, {}, {}, emakit::EmaOptions().ignore_prefixes({"decoder."})),
                    Contains("'decoder.'"));
  CHECK_THROWS_WITH(emakit::EmaOptions().dtype(torch::kInt), Contains("floating") && Contains("Int"));
  CHECK_THROWS_WITH(emakit::EmaOptions().ignore_prefixes({""}), Contains("empty prefix"));
}

TEST_CASE("A bf16 model gets an fp32 average that follows it, a bf16 average stays put", "[ema][precision]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 1.0);
  emakit_test::cast_floats(*model, torch::kBFloat16);
  emakit::FixedEma fp32(*model);  // default dtype for a bf16 model: fp32
  emakit::FixedEma bf16(*model, {}, {}, emakit::EmaOptions().dtype(torch::kBFloat16));
  CHECK(fp32.average("fc.weight").scalar_type() == torch::kFloat);
  CHECK(bf16.average("fc.weight").scalar_type() == torch::kBFloat16);
  emakit_test::fill_floats(*model, 1.5);
  for (int i = 0; i < 100; ++i) {
    fp32.update();
    bf16.update();
  }
  const double expected = 1.0 + 0.5 * (1.0 - std::pow(0.9999, 100));  // 1.004975...
  // Each of the 100 updates rounds its sum once (1/2 ulp of 1: 2^-24; x - a is exact and the
  // product's rounding is an ulp of 5e-5), and w's rounding to fp32 moves the result by < 1e-9.
  const double got = fp32.average("fc.weight").max().item<double>();
  CHECK(std::abs(got - expected) <= 100 * std::ldexp(1.0, -24) + 1e-9);
  CHECK(fp32.average("fc.weight").min().item<double>() == got);                           // every element alike
  CHECK(torch::equal(bf16.average("fc.weight"), torch::ones({4, 3}, torch::kBFloat16)));  // stuck at 1
}

TEST_CASE("The average's dtype and device are chosen apart from the model's", "[ema][precision]") {
  TinyNet model;
  emakit::FixedEma f64(*model, {}, {}, emakit::EmaOptions().dtype(torch::kDouble).device(torch::kCPU));
  CHECK(f64.average("fc.weight").scalar_type() == torch::kDouble);
  CHECK(f64.average("bn.num_batches_tracked").scalar_type() == torch::kLong);
  const auto before = model->fc->weight.detach().to(torch::kDouble);
  emakit_test::perturb(*model);
  f64.update();
  const auto x = model->fc->weight.detach().to(torch::kDouble);
  const auto expected = before * 0.9999 + x * (1.0 - 0.9999);
  // Both are 3 double ulps at max(|before|, |x|) from the exact lerp (helpers.hpp): 6 apart.
  CHECK(emakit_test::max_ulps_at(f64.average("fc.weight"), expected, emakit_test::operand_magnitude(before, x),
                                 torch::kDouble) <= 6);
}

TEST_CASE("The swap guard puts the EMA weights in the model and restores the model's own", "[ema][swap]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 1.0);
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::fill_floats(*model, 3.0);
  ema.update();  // average: 2.0
  {
    auto guard = ema.swap_into();
    CHECK(torch::equal(model->fc->weight, torch::full({4, 3}, 2.0)));
    CHECK_THROWS_WITH(ema.update(), Contains("SwapGuard"));
    CHECK(ema.num_updates() == 1);
  }
  CHECK(torch::equal(model->fc->weight, torch::full({4, 3}, 3.0)));
  CHECK(model->fc->weight.requires_grad());

  try {
    auto guard = ema.swap_into();
    CHECK(torch::equal(model->bn->running_mean, torch::full({4}, 2.0)));
    throw std::runtime_error("validation failed");
  } catch (const std::runtime_error&) {
  }
  CHECK(torch::equal(model->fc->weight, torch::full({4, 3}, 3.0)));
  CHECK(torch::equal(model->bn->running_mean, torch::full({4}, 3.0)));

  auto guard = ema.swap_into();
  guard.restore();
  CHECK_FALSE(guard.active());
  CHECK(torch::equal(model->fc->weight, torch::full({4, 3}, 3.0)));
  CHECK(ema.update().action == Action::averaged);
}

TEST_CASE("copy_to and copy_from move weights by name", "[ema]") {
  TinyNet model, other;
  emakit_test::fill_floats(*model, 1.0);
  emakit::FixedEma ema(*model);
  emakit_test::fill_floats(*other, 5.0);
  ema.copy_from(*other);
  CHECK(torch::equal(ema.average("fc.weight"), torch::full({4, 3}, 5.0)));
  CHECK(ema.num_updates() == 0);
  ema.copy_to(*model);
  CHECK(torch::equal(model->fc->weight, torch::full({4, 3}, 5.0)));

  struct Smaller : torch::nn::Module {
    Smaller() { register_module("fc", torch::nn::Linear(3, 4)); }
  } smaller;
  CHECK_THROWS_WITH(ema.copy_to(smaller), Contains("no tensor 'bn.weight'"));
}

TEST_CASE("State dict round trip is bitwise, counters included, and continues identically", "[ema][state]") {
  torch::manual_seed(3);
  TinyNet model;
  emakit::WarmupEma a(*model, emakit::InversePowerWarmup(0.99));
  for (int i = 0; i < 7; ++i) {
    emakit_test::perturb(*model);
    a.update();
  }
  emakit::WarmupEma b(*model, emakit::InversePowerWarmup(0.99));
  const auto report = b.load_state_dict(a.state_dict());
  CHECK(report.clean());
  CHECK(same_averages(b.averages(), snapshot(a.averages())));
  CHECK(b.calls() == 7);
  CHECK(b.step() == 7);
  CHECK(b.num_updates() == 7);
  CHECK(b.decay() == a.decay());
  emakit_test::perturb(*model);
  a.update();
  b.update();
  CHECK(same_averages(b.averages(), snapshot(a.averages())));
}

TEST_CASE("torch::save and torch::load write and read the whole EMA", "[ema][state]") {
  torch::manual_seed(4);
  TinyNet model;
  emakit::RampEma a(*model, emakit::ExponentialRamp(0.999, 10));
  for (int i = 0; i < 5; ++i) {
    emakit_test::perturb(*model);
    a.update();
  }
  const auto path = (std::filesystem::temp_directory_path() / "emakit_test_save.pt").string();
  torch::save(a, path);
  emakit::RampEma b(*model, emakit::ExponentialRamp(0.999, 10));
  torch::load(b, path);
  std::remove(path.c_str());
  CHECK(same_averages(b.averages(), snapshot(a.averages())));
  CHECK(b.num_updates() == 5);
  CHECK(b.decay() == a.decay());
}

TEST_CASE("Loading a state of another config is an error naming the field and both values", "[ema][state][errors]") {
  TinyNet model;
  emakit::FixedEma a(*model, emakit::Fixed(0.999));
  emakit::FixedEma b(*model, emakit::Fixed(0.9));
  CHECK_THROWS_WITH(b.load_state_dict(a.state_dict()),
                    Contains("config differs: config.decay.beta is 0.999 in the state, 0.9 in this EMA"));
  emakit::RampEma c(*model);
  CHECK_THROWS_WITH(c.load_state_dict(a.state_dict()),
                    Contains("config differs: decay policy is Fixed in the state, ExponentialRamp in this EMA"));
  emakit::FixedEma d(*model, emakit::Fixed(0.999), emakit::StepSchedule().update_every(3));
  CHECK_THROWS_WITH(d.load_state_dict(a.state_dict()),
                    Contains("config differs: config.schedule.update_every is 1 in the state, 3 in this EMA"));
  // The buffer mode is part of the config (nvalchemi's EMAHook refuses another use_buffers too).
  emakit::FixedEma e(*model, emakit::Fixed(0.999), {}, emakit::EmaOptions().buffers(emakit::TensorMode::copy));
  const auto before = snapshot(e.averages());
  CHECK_THROWS_WITH(
      e.load_state_dict(a.state_dict()),
      Contains("config differs: config.options.buffers (EmaOptions::buffers) is average in the state, copy "
               "in this EMA"));
  CHECK(same_averages(e.averages(), before));
  // A state written before the buffer mode was saved has no such key: it loads, unchecked.
  emakit::StateDict older;
  for (const auto& item : a.state_dict())
    if (item.key() != "config.options.buffers") older.insert(item.key(), item.value());
  CHECK(e.load_state_dict(older).clean());
  // So is the arithmetic, by name: averages computed another way are another EMA's numbers.
  emakit::FixedEma f(*model, emakit::Fixed(0.999), {},
                     emakit::EmaOptions().arithmetic(emakit::Arithmetic::weighted_sum));
  const auto f_before = snapshot(f.averages());
  CHECK_THROWS_WITH(f.load_state_dict(a.state_dict()),
                    Contains("config differs: config.options.arithmetic (EmaOptions::arithmetic) is lerp in the "
                             "state, weighted_sum in this EMA"));
  CHECK(same_averages(f.averages(), f_before));
  CHECK_THROWS_WITH(a.load_state_dict(f.state_dict()), Contains("is weighted_sum in the state, lerp in this EMA"));
  emakit::FixedEma g(*model, emakit::Fixed(0.999), {},
                     emakit::EmaOptions().arithmetic(emakit::Arithmetic::weighted_sum));
  CHECK(g.load_state_dict(f.state_dict()).clean());
  // A state from before the arithmetic was saved has no such key: it loads into any (a preset's EMA
  // resumed from an older checkpoint goes on with its own arithmetic).
  emakit::StateDict before_arithmetic;
  for (const auto& item : a.state_dict())
    if (item.key() != "config.options.arithmetic") before_arithmetic.insert(item.key(), item.value());
  CHECK(a.load_state_dict(before_arithmetic).clean());
  CHECK(f.load_state_dict(before_arithmetic).clean());
  CHECK(same_averages(f.averages(), snapshot(a.averages())));
  CHECK_THROWS_WITH(emakit::EmaOptions().arithmetic(static_cast<emakit::Arithmetic>(6)),  // one past the last
                    Contains("EmaOptions::arithmetic") && Contains("fused_subtract") && Contains("got 6"));
  CHECK(emakit::EmaOptions().arithmetic(emakit::Arithmetic::fused_subtract).arithmetic() ==
        emakit::Arithmetic::fused_subtract);
}

TEST_CASE("decay() and UpdateResult::decay are the policy's d in every bit, whatever the arithmetic", "[ema][decay]") {
  TinyNet model;
  // d where 1 - (1 - d) is not d (what an EMA that kept only w = 1 - d would report)
  for (const double d : {0.1, 0.9999, 0.3}) {
    for (const auto f : {emakit::Arithmetic::lerp, emakit::Arithmetic::weighted_sum, emakit::Arithmetic::subtract}) {
      INFO("d " << d << ", " << emakit::arithmetic_name(f));
      emakit::FixedEma ema(*model, emakit::Fixed(d), {}, emakit::EmaOptions().arithmetic(f));
      const auto r = ema.update();
      REQUIRE(r.action == Action::averaged);
      CHECK(r.decay == d);
      CHECK(ema.decay() == d);
    }
  }
  CHECK(1.0 - (1.0 - 0.1) != 0.1);  // the test can tell the two apart
}

TEST_CASE("Strict load rejects missing, unexpected and mismatched tensors and changes nothing",
          "[ema][state][errors]") {
  torch::manual_seed(5);
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::perturb(*model);
  ema.update();
  const auto before = snapshot(ema.averages());

  auto state = ema.state_dict();
  auto fresh = [&] {
    emakit::StateDict copy;
    for (const auto& item : state) copy.insert(item.key(), item.value().clone());
    return copy;
  };
  {
    auto s = fresh();
    s.erase("average.fc.bias");
    s["counters.num_updates"].fill_(99);
    CHECK_THROWS_WITH(ema.load_state_dict(s), Contains("missing key 'average.fc.bias'"));
  }
  {
    auto s = fresh();
    s.insert("average.head.weight", torch::zeros({2}));
    CHECK_THROWS_WITH(ema.load_state_dict(s), Contains("unexpected key 'average.head.weight'"));
  }
  {
    auto s = fresh();
    s["average.fc.weight"] = torch::zeros({3, 4});
    CHECK_THROWS_WITH(ema.load_state_dict(s),
                      Contains("average.fc.weight") && Contains("[3, 4]") && Contains("[4, 3]"));
  }
  {
    auto s = fresh();
    s["average.fc.weight"] = torch::zeros({4, 3}, torch::kDouble);
    CHECK_THROWS_WITH(ema.load_state_dict(s), Contains("average.fc.weight") && Contains("dtype Double"));
  }
  {
    auto s = fresh();
    s.insert("config.storage", torch::zeros({1}));
    CHECK_THROWS_WITH(ema.load_state_dict(s), Contains("unexpected key 'config.storage'"));
  }
  {
    auto s = fresh();
    s.erase("counters.step");
    CHECK_THROWS_WITH(ema.load_state_dict(s), Contains("counters.step"));
  }
  {
    auto s = fresh();
    s["counters.calls"] = torch::scalar_tensor(-3, torch::kLong);
    CHECK_THROWS_WITH(ema.load_state_dict(s), Contains("counters.calls") && Contains("-3"));
  }
  {
    auto s = fresh();
    s["emakit.format"] = torch::scalar_tensor(42, torch::kLong);
    CHECK_THROWS_WITH(ema.load_state_dict(s), Contains("emakit EMA state version 42"));
  }
  CHECK(same_averages(ema.averages(), before));
  CHECK(ema.num_updates() == 1);
  CHECK(ema.calls() == 1);
}

TEST_CASE("Lenient load warns per key and keeps current values for those keys", "[ema][state]") {
  torch::manual_seed(6);
  TinyNet model;
  emakit::FixedEma source(*model, emakit::Fixed(0.5));
  emakit_test::perturb(*model);
  source.update();
  auto state = source.state_dict();
  state.erase("average.fc.bias");
  state["average.fc.weight"] = torch::zeros({2, 2});
  state.insert("average.extra", torch::zeros({1}));

  TinyNet other;
  emakit::FixedEma target(*other, emakit::Fixed(0.5));
  const auto fc_weight = target.average("fc.weight").clone();
  const auto fc_bias = target.average("fc.bias").clone();
  emakit_test::WarningCapture warnings;
  const auto report = target.load_state_dict(state, emakit::LoadMode::lenient);
  CHECK(report.missing == std::vector<std::string>{"average.fc.bias"});
  CHECK(report.unexpected == std::vector<std::string>{"average.extra"});
  REQUIRE(report.mismatched.size() == 1);
  CHECK_THAT(report.mismatched[0], Contains("average.fc.weight"));
  CHECK(warnings.messages.size() == 3);
  CHECK(torch::equal(target.average("fc.weight"), fc_weight));
  CHECK(torch::equal(target.average("fc.bias"), fc_bias));
  CHECK(torch::equal(target.average("bn.weight"), source.average("bn.weight")));
  CHECK(target.num_updates() == 1);

  // The same state in a file: emakit::load reports what load_state_dict does.
  emakit_test::TempDir dir;
  torch::serialize::OutputArchive archive;
  emakit::detail::ema_state::save_archive(archive, state);
  emakit::detail::write_archive(archive, dir.path / "partial.pt");
  TinyNet third;
  emakit::FixedEma from_file(*third, emakit::Fixed(0.5));
  const auto file_report = emakit::load(from_file, dir.path / "partial.pt", emakit::LoadMode::lenient);
  CHECK(file_report.missing == report.missing);
  CHECK(file_report.unexpected == report.unexpected);
  CHECK(file_report.mismatched == report.mismatched);
  CHECK(from_file.num_updates() == 1);
  CHECK(emakit::load(from_file, dir.path / "partial.pt", emakit::LoadMode::lenient).mismatched.size() == 1);
  emakit::save(source, dir.path / "whole.pt");
  CHECK(emakit::load(from_file, dir.path / "whole.pt").clean());
}

TEST_CASE("A moved-from Ema refuses every call, the moved-into one works", "[ema][errors]") {
  TinyNet model;
  emakit::FixedEma a(*model);
  emakit::FixedEma b(std::move(a));
  CHECK_THROWS_WITH(a.update(), Contains("moved-from"));
  CHECK_THROWS_WITH(a.state_dict(), Contains("moved-from"));
  CHECK(b.update().action == Action::averaged);
}

// An Ema computes its arithmetic (EmaOptions::arithmetic) on each path its tensors take (the fused
// pass; a transposed source, staged; a bf16 average of an fp32 source, ATen's ops), before and
// after a re-plan (a tensor given new memory): bitwise what a bare kernel made with that
// arithmetic computes from the same start (the kernel is checked against references in
// test_kernel.cpp); and so do an Ema moved from it and one move-assigned from it. (The Ema's
// kernel was move-assigned at bind without its arithmetic: every Ema averaged its staged and
// generic tensors, and every tensor after a re-plan, by lerp.)
TEST_CASE("An Ema, moved or not, averages by its arithmetic on every path, before and after a re-plan", "[ema]") {
  std::size_t compared = 0, differ_from_lerp = 0;
  for (int f = 0; f < 5; ++f) {
    const auto arithmetic = static_cast<emakit::Arithmetic>(f);
    for (const bool bf16 : {false, true}) {
      INFO(emakit::arithmetic_name(arithmetic) << (bf16 ? ", bf16 averages" : ""));
      torch::manual_seed(f);
      at::Tensor w = torch::randn({64, 48}), t = torch::randn({48, 32}).t(), b = torch::randn({3000});
      const std::vector<emakit::SourceTensor> sources = {{"w", w, false}, {"t", t, false}, {"b", b, false}};
      emakit::EmaOptions options = emakit::EmaOptions().arithmetic(arithmetic);
      if (bf16) options.dtype(torch::kBFloat16);
      const auto average_dtype = bf16 ? torch::kBFloat16 : torch::kFloat;
      std::vector<emakit::detail::Slot> slots, lerp_slots;
      for (const auto& src : sources) {
        emakit::detail::Slot slot;
        slot.name = src.name;
        slot.source = src.tensor;
        slot.average = src.tensor.clone(at::MemoryFormat::Contiguous).to(average_dtype);  // not the source itself
        lerp_slots.push_back(slot);
        lerp_slots.back().average = slot.average.clone();
        slots.push_back(std::move(slot));
      }
      emakit::detail::UpdateKernel reference(std::move(slots), emakit::detail::CpuPath::fused,
                                             emakit::detail::SideStream::off, emakit::EmaOptions::default_staging_bytes,
                                             arithmetic);
      emakit::detail::UpdateKernel lerp(std::move(lerp_slots));
      emakit::FixedEma original(sources, emakit::Fixed(0.9), {}, options);
      emakit::FixedEma source(sources, emakit::Fixed(0.9), {}, options);
      emakit::FixedEma moved(std::move(source));
      emakit::FixedEma assigned(sources, emakit::Fixed(0.5), {}, emakit::EmaOptions().dtype(torch::kDouble));
      emakit::FixedEma other(sources, emakit::Fixed(0.9), {}, options);
      assigned = std::move(other);
      for (int step = 0; step < 6; ++step) {
        INFO("step " << step);
        {
          torch::NoGradGuard no_grad;
          for (at::Tensor x : {w, t, b}) x.add_(torch::randn(x.sizes()), 0.5);
          if (step == 3) w.set_data(w.clone());  // new memory: every kernel re-plans
        }
        const auto r = original.update();
        REQUIRE(r.action == Action::averaged);
        moved.update();
        assigned.update();
        reference.average(emakit::detail::Weights{1.0 - r.decay, r.decay});
        lerp.average(emakit::detail::Weights{1.0 - r.decay, r.decay});
        for (std::size_t i = 0; i < sources.size(); ++i) {
          const auto& name = sources[i].name;
          INFO(name);
          const at::Tensor& want = reference.settled_slots()[i].average;
          CHECK(emakit::detail::bitwise_equal(original.average(name), want));
          CHECK(emakit::detail::bitwise_equal(moved.average(name), want));
          CHECK(emakit::detail::bitwise_equal(assigned.average(name), want));
          differ_from_lerp += emakit::detail::bitwise_equal(lerp.settled_slots()[i].average, want) ? 0 : 1;
          ++compared;
        }
      }
    }
  }
  CHECK(compared == 5 * 2 * 6 * 3);
  // The arithmetics part from lerp on most tensors and steps (lerp itself and fused_lerp's rare
  // agreements aside): the comparison above could tell a lost arithmetic.
  CHECK(differ_from_lerp >= 3 * 2 * 6 * 3);
}

TEST_CASE("After Module::to() the average stays where it is and keeps following the model", "[ema][placement]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 1.0);
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  model->to(torch::kDouble);  // the handles stay valid: Module::to uses set_data
  emakit_test::fill_floats(*model, 3.0);
  CHECK(ema.update().action == Action::averaged);
  CHECK(ema.average("fc.weight").scalar_type() == torch::kFloat);
  CHECK(torch::equal(ema.average("fc.weight"), torch::full({4, 3}, 2.0)));
}

// Every way a model tensor can be given other memory and keep its shape (set_data): a view at an
// offset of another tensor, the same storage at another offset only, the same offset with other
// strides only, another dtype, a new tensor. Each update must read the tensor where it is then:
// the EMA against ATen's lerp of the tensor as it is, bitwise, after every move.
TEST_CASE("A model tensor given other memory in any way is read where it is at the next update", "[ema][placement]") {
  torch::NoGradGuard no_grad;
  const auto values = [](std::int64_t n, double scale) { return torch::arange(n, torch::kFloat).mul_(scale).sin_(); };
  at::Tensor w = values(24, 0.5).view({4, 6});
  const std::vector<emakit::SourceTensor> sources{{"w", w, false}};
  emakit::FixedEma ema(sources, emakit::Fixed(0.75));
  at::Tensor expected = w.clone();
  const at::Tensor big = values(48, 0.3);
  const std::vector<std::pair<const char*, std::function<void()>>> moves = {
      {"none", [] {}},
      {"a view at offset 12 of another tensor",
       [&] {
         w.set_data(big.narrow(0, 12, 24).view({4, 6}));
       }},
      {"the same storage at offset 20",
       [&] {
         w.set_data(big.narrow(0, 20, 24).view({4, 6}));
       }},
      {"the same storage at offset 0",
       [&] {
         w.set_data(big.narrow(0, 0, 24).view({4, 6}));
       }},
      {"the same storage and offset, transposed",
       [&] {
         w.set_data(big.narrow(0, 0, 24).view({6, 4}).t());
       }},
      {"bf16",
       [&] {
         w.set_data(values(24, 0.7).view({4, 6}).to(torch::kBFloat16));
       }},
      {"a new tensor",
       [&] {
         w.set_data(values(24, 0.9).view({4, 6}));
       }},
  };
  int compared = 0;
  for (const auto& [what, move] : moves) {
    INFO(what);
    move();
    REQUIRE(w.sizes() == at::IntArrayRef({4, 6}));
    REQUIRE(ema.update().action == Action::averaged);
    expected.lerp_(w.to(torch::kFloat), 0.25);
    CHECK(emakit::detail::bitwise_equal(ema.average("w"), expected));
    ++compared;
    big.add_(0.125);  // the views of big change: an update that read an old place would differ
  }
  CHECK(compared == 7);
}

TEST_CASE("A tensor that changes shape after binding is an error and nothing changes", "[ema][errors]") {
  TinyNet model;
  emakit::FixedEma ema(*model);
  const auto before = snapshot(ema.averages());
  {
    torch::NoGradGuard no_grad;
    model->fc->weight.set_data(torch::zeros({8, 3}));
  }
  CHECK_THROWS_WITH(ema.update(), Contains("fc.weight") && Contains("[4, 3]") && Contains("[8, 3]"));
  CHECK(ema.calls() == 0);
  CHECK(same_averages(ema.averages(), before));
}

TEST_CASE("An Ema binds to a list of named tensors without a module", "[ema]") {
  auto w = torch::ones({3});
  auto steps = torch::zeros({}, torch::kLong);
  emakit::FixedEma ema({{"w", w, false}, {"steps", steps, true}}, emakit::Fixed(0.75));
  w.fill_(5.0);
  steps.fill_(2);
  ema.update();
  CHECK(torch::equal(ema.average("w"), torch::full({3}, 2.0)));
  CHECK(ema.average("steps").item<std::int64_t>() == 2);
  CHECK_THROWS_WITH(emakit::FixedEma({{"w", w, false}, {"w", w, false}}), Contains("'w' appears twice"));
}

namespace {
struct QuarterDecay {
  double decay(const emakit::DecayInput&) const { return 0.25; }
};
struct BrokenDecay {
  double decay(const emakit::DecayInput& in) const { return in.step > 1 ? 1.5 : 0.5; }
};
}  // namespace

TEST_CASE("A user-written decay policy works, one that leaves [0, 1] is caught", "[ema]") {
  auto w = torch::zeros({2});
  emakit::Ema<QuarterDecay> ema({{"w", w, false}});
  w.fill_(4.0);
  ema.update();
  CHECK(torch::equal(ema.average("w"), torch::full({2}, 3.0)));
  CHECK(fmt::format("{}", ema.decay_policy().decay({})) == "0.25");

  emakit::Ema<BrokenDecay> broken({{"w", w, false}});
  broken.update();
  CHECK_THROWS_WITH(broken.update(), Contains("d = 1.5") && Contains("step 2") && Contains("custom"));
  CHECK(broken.num_updates() == 1);
}

// A nameless policy whose type mentions an emakit type (here a wrapper of Fixed).
template <class Inner>
struct WrapDecay {
  Inner inner{0.5};
  double decay(const emakit::DecayInput& in) const { return inner.decay(in); }
};

TEST_CASE("A nameless policy's checkpoint name leaves out emakit's mode namespace", "[ema][state]") {
  // Types live in the mode's namespace (emakit::header_only, emakit::compiled, and in this test
  // build their _testing twins: detail/config.hpp); the name a state records must not depend on
  // the mode, or a checkpoint of one mode would not load in the other.
  auto w = torch::zeros({2});
  emakit::Ema<WrapDecay<emakit::Fixed>> ema({{"w", w, false}});
  const auto state = ema.state_dict();
  const at::Tensor& bytes = state["config.decay"];
  const std::string name(static_cast<const char*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel()));
  CHECK_THAT(name, Catch::Matchers::StartsWith("custom:") && Contains("WrapDecay<emakit::Fixed>"));
  CHECK_THAT(name, !Contains("header_only") && !Contains("compiled"));
  emakit::Ema<WrapDecay<emakit::Fixed>> other({{"w", torch::zeros({2}), false}});
  CHECK(other.load_state_dict(state).clean());
}

TEST_CASE("A vetoed step and a caller-supplied step reach the schedule", "[ema]") {
  TinyNet model;
  emakit::WarmupEma ema(*model, {}, emakit::StepSchedule().update_every(5));
  CHECK(ema.update({.step = 10, .vetoed = true}).action == Action::skipped);
  CHECK(ema.num_updates() == 0);
  CHECK(ema.step() == 10);
  const auto r = ema.update({.step = 15});
  CHECK(r.action == Action::averaged);
  CHECK(emakit_test::reported_decay_is(r.decay, emakit::InversePowerWarmup().decay({15, 1, 15})));
}

TEST_CASE("PowerFunction through an Ema: the first update copies, then (1 - dt/t)^(gamma+1)", "[ema][posthoc]") {
  auto w = torch::zeros({2});
  emakit::PowerEma ema({{"w", w, false}}, emakit::PowerFunction::from_sigma_rel(0.10),
                       emakit::StepSchedule().update_every(2));
  w.fill_(1.0);
  CHECK(ema.update().action == Action::skipped);  // step 1
  auto r = ema.update();                          // step 2: t = dt = 2
  CHECK(r.decay == 0.0);
  CHECK(torch::equal(ema.average("w"), torch::ones({2})));
  ema.update();
  r = ema.update();  // step 4, dt 2
  CHECK(emakit_test::reported_decay_is(r.decay, std::pow(0.5, emakit::sigma_rel_to_gamma(0.10) + 1)));
}

// A checkpoint's config is compared exactly: a decay policy field that differs from this EMA's in
// its last bit is another config, refused naming the field (a float32 comparison would let it load).
TEST_CASE("A state whose config field differs in the last bit of a double is refused", "[ema][state][errors]") {
  emakit_test::TinyNet model;
  const double beta = 0.999;
  const double next = std::nextafter(beta, 1.0);  // one ulp above: the same float32, another double
  REQUIRE(static_cast<float>(next) == static_cast<float>(beta));
  emakit::FixedEma saved(*model, emakit::Fixed(beta));
  emakit::FixedEma other(*model, emakit::Fixed(next));
  const auto before = emakit_test::snapshot(other.averages());
  CHECK_THROWS_WITH(other.load_state_dict(saved.state_dict()), Contains("config.decay.beta"));
  CHECK(emakit_test::same_averages(other.averages(), before));
  // A field of another policy: InversePowerWarmup's power.
  const double power = 2.0 / 3.0;
  emakit::WarmupEma warm(*model, emakit::InversePowerWarmup().power(power));
  emakit::WarmupEma warm_next(*model, emakit::InversePowerWarmup().power(std::nextafter(power, 1.0)));
  CHECK_THROWS_WITH(warm_next.load_state_dict(warm.state_dict()), Contains("config.decay.power"));
  // Exactly equal configs load.
  emakit::FixedEma same(*model, emakit::Fixed(beta));
  CHECK(same.load_state_dict(saved.state_dict()).clean());
}

// Uniform gives the lerp weight 1/n itself (Uniform::weight), and an Ema averages with exactly that
// weight, as torch's AveragedModel (SWA) does: 1 - decay() = 1 - (1 - 1/n) rounds differently.
namespace {

// ema = lerp(ema, x, w) in the update's formula (detail/simd.hpp, ATen's lerp), in double.
torch::Tensor lerp_formula(const torch::Tensor& ema, const torch::Tensor& x, double w) {
  torch::Tensor out = ema.clone();
  auto o = out.accessor<double, 1>();
  auto s = x.accessor<double, 1>();
  for (std::int64_t i = 0; i < out.size(0); ++i)
    o[i] = std::abs(w) < 0.5 ? o[i] + w * (s[i] - o[i]) : s[i] + (w - 1.0) * (s[i] - o[i]);
  return out;
}

}  // namespace

TEST_CASE("An Ema with Uniform lerps with the weight 1/n exactly, not 1 - (1 - 1/n)", "[ema][decay]") {
  torch::manual_seed(11);
  torch::Tensor w = torch::randn({64}, torch::kDouble);
  emakit::Ema<emakit::Uniform, emakit::StepSchedule, emakit::FlatStorage> ema(
      std::vector<emakit::SourceTensor>{{"w", w}});
  torch::Tensor reference = w.clone();  // the average starts as a copy of the model
  int told_apart = 0;                   // updates at which the weight 1 - d would give another average
  for (int n = 1; n <= 6; ++n) {
    {
      torch::NoGradGuard no_grad;
      w.copy_(torch::randn({64}, torch::kDouble));
    }
    const double weight = n == 1 ? 1.0 : 1.0 / n;
    const torch::Tensor with_decay = lerp_formula(reference, w, 1.0 - (1.0 - weight));
    reference = lerp_formula(reference, w, weight);
    if (!emakit_test::bitwise_equal(with_decay, reference)) ++told_apart;
    const auto r = ema.update();
    REQUIRE(r.action == emakit::Action::averaged);
    INFO("update " << n << ", weight " << weight);
    CHECK(emakit_test::bitwise_equal(ema.average("w"), reference));
  }
  CHECK(told_apart >= 2);  // n = 3 and n = 5 at least: the comparison can tell the two weights apart
}

}  // namespace test_ema
