// Decay policies: the reference values of DESIGN.md, validation, sigma_rel <-> gamma, and a
// user-written policy.
#include <emakit/decay.hpp>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <cmath>
#include <stdexcept>

namespace test_decay {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;

namespace {
emakit::DecayInput at_step(std::int64_t step) { return {step, step, 1}; }
emakit::DecayInput at_update(std::int64_t update) { return {update, update, 1}; }
}  // namespace

TEST_CASE("Fixed decay is beta at every update", "[decay]") {
  emakit::Fixed fixed(0.999);
  CHECK(fixed.decay(at_step(1)) == 0.999);
  CHECK(fixed.decay(at_step(100000)) == 0.999);
  CHECK(emakit::Fixed().beta() == 0.9999);
  CHECK(fixed == emakit::Fixed(0.999));
  CHECK_FALSE(fixed == emakit::Fixed(0.99));
}

TEST_CASE("ExponentialRamp reproduces the reference values", "[decay]") {
  emakit::ExponentialRamp ramp(0.9999, 2000);
  CHECK(ramp.decay(at_update(1)) == Approx(0.0004998250).margin(1e-10));
  CHECK(ramp.decay(at_update(100)) == Approx(0.0487656984).margin(1e-10));
  CHECK(ramp.decay(at_update(2000)) == Approx(0.6320573468).margin(1e-10));
}

TEST_CASE("ExponentialRamp counts updates, not steps", "[decay]") {
  emakit::ExponentialRamp ramp(0.9999, 2000);
  CHECK(ramp.decay({500, 1, 500}) == ramp.decay(at_update(1)));
}

TEST_CASE("InversePowerWarmup reproduces the reference values", "[decay]") {
  emakit::InversePowerWarmup warmup;  // inv_gamma 1, power 2/3, update_after_step 0
  CHECK(warmup.decay(at_step(1)) == 0.0);
  CHECK(warmup.decay(at_step(2)) == Approx(0.3700394751).margin(1e-10));
  CHECK(warmup.decay(at_step(3)) == Approx(0.5192501432).margin(1e-10));
  CHECK(warmup.decay(at_step(10)) == Approx(0.7845565310).margin(1e-10));
  CHECK(warmup.decay(at_step(100)) == Approx(0.9535841117).margin(1e-10));
}

TEST_CASE("InversePowerWarmup waits update_after_step and clamps to [min_value, beta]", "[decay]") {
  auto warmup = emakit::InversePowerWarmup(0.99).update_after_step(100).min_value(0.5);
  CHECK(warmup.decay(at_step(101)) == 0.0);  // e = 0
  CHECK(warmup.decay(at_step(102)) == 0.5);  // 0.37 clamped up to min_value
  CHECK(warmup.decay(at_step(110)) == Approx(0.7845565310).margin(1e-10));
  CHECK(warmup.decay(at_step(1000000)) == 0.99);  // clamped down to beta
}

TEST_CASE("InversePowerWarmup without warmup jumps to beta, in single precision it rounds as float32", "[decay]") {
  auto flat = emakit::InversePowerWarmup(0.95).update_after_step(2).warmup(false);
  CHECK(flat.decay(at_step(3)) == 0.0);
  CHECK(flat.decay(at_step(4)) == 0.95);
  auto single = emakit::InversePowerWarmup().single_precision(true);
  const double d = single.decay(at_step(10));
  CHECK(d == static_cast<double>(static_cast<float>(d)));  // a float32 value
  CHECK(d == Approx(0.7845565310).epsilon(1e-6));
  CHECK(d == static_cast<double>(1.0f - std::pow(10.0f, -2.0f / 3.0f)));
}

TEST_CASE("sigma_rel converts to gamma and back", "[decay][posthoc]") {
  const std::pair<double, double> reference[] = {
      {0.05, 16.9721986023}, {0.10, 6.9372039376}, {0.15, 3.5578687749}, {0.20, 1.8262137799}, {0.28, 0.1693439938}};
  for (const auto& [sigma_rel, gamma] : reference) {
    INFO("sigma_rel " << sigma_rel);
    CHECK(emakit::sigma_rel_to_gamma(sigma_rel) == Approx(gamma).margin(1e-9));
    CHECK(emakit::gamma_to_sigma_rel(emakit::sigma_rel_to_gamma(sigma_rel)) == Approx(sigma_rel).margin(1e-12));
  }
  for (double gamma : {0.01, 0.5, 3.0, 50.0, 1000.0})
    CHECK(emakit::sigma_rel_to_gamma(emakit::gamma_to_sigma_rel(gamma)) == Approx(gamma).epsilon(1e-10));
}

TEST_CASE("PowerFunction reproduces the reference value and copies first", "[decay][posthoc]") {
  auto power = emakit::PowerFunction::from_sigma_rel(0.10);
  CHECK(power.gamma() == Approx(6.9372039376).margin(1e-9));
  CHECK(power.decay({5, 5, 1}) == Approx(0.1701396218).margin(1e-10));
  CHECK(power.decay({1, 1, 1}) == 0.0);    // t = dt: the first update copies
  CHECK(power.decay({10, 1, 10}) == 0.0);  // first update at step 10 with update_every 10
  CHECK(power.decay({20, 2, 10}) == Approx(std::pow(0.5, power.gamma() + 1)).epsilon(1e-14));
  CHECK(power.sigma_rel() == Approx(0.10).margin(1e-11));
}

TEST_CASE("Uniform gives an equal-weight mean, with the lerp weight 1/n exactly", "[decay]") {
  emakit::Uniform uniform;
  CHECK(uniform.decay(at_update(1)) == 0.0);
  CHECK(uniform.weight(at_update(1)) == 1.0);
  CHECK(uniform.weight(at_update(3)) == 1.0 / 3.0);
  CHECK(uniform.decay(at_update(4)) == 0.75);
}

namespace {
// |a - b| in ulps of double at b's magnitude: the reference values below are printed to 16-17
// significant digits (one rounding of the exact value), so a value computed the same way is
// within 1 ulp of them, and a different formula (a K' off by one, 9 for 10) is ~1e9 ulps away.
double double_ulps(double a, double b) {
  const double u = std::nextafter(std::abs(b), INFINITY) - std::abs(b);
  return std::abs(a - b) / u;
}
}  // namespace

TEST_CASE("RationalRamp reproduces the reference values of the TensorFlow / diffusers ramp", "[decay]") {
  const emakit::RationalRamp ramp(0.9999);
  CHECK(ramp.decay(at_step(1)) == 0.0);  // t = 0: the first step copies
  CHECK(double_ulps(ramp.decay(at_step(2)), 0.18181818181818182) <= 1);
  CHECK(double_ulps(ramp.decay(at_step(11)), 0.55) <= 1);
  CHECK(double_ulps(ramp.decay(at_step(101)), 0.9181818181818182) <= 1);
  CHECK(ramp.decay(at_step(1000000)) == 0.9999);  // capped at decay
  // It counts steps, not updates, and waits update_after_step more steps.
  const auto later = emakit::RationalRamp(0.9999).update_after_step(5);
  CHECK(later.decay(at_step(6)) == 0.0);
  CHECK(double_ulps(later.decay({7, 1, 1}), 0.18181818181818182) <= 1);
  // min_decay floors it, also at t = 1 (diffusers clamps after the ramp); still 0 while t <= 0.
  const auto floored = emakit::RationalRamp(0.9).min_decay(0.5);
  CHECK(floored.decay(at_step(1)) == 0.0);
  CHECK(floored.decay(at_step(2)) == 0.5);
  CHECK(floored.decay(at_step(11)) == 0.55);
  CHECK(floored.decay(at_step(5000)) == 0.9);
  CHECK(floored == emakit::RationalRamp(0.9).min_decay(0.5));
  CHECK_FALSE(floored == emakit::RationalRamp(0.9));
  const auto fields = later.fields();
  REQUIRE(fields.size() == 3);
  CHECK((fields[2].name == "update_after_step" && fields[2].value == 5 && fields[2].is_integer));
}

TEST_CASE("CosineMomentum reproduces lightly's and DINO's cosine schedules", "[decay]") {
  // k = step - 1: lightly's cosine_schedule(k, 100, 0.996, 1.0) and DINO's cosine_scheduler.
  const emakit::CosineMomentum lightly(0.996, 1.0, 100);
  CHECK(lightly.endpoint() == emakit::CosineEnd::at_last_step);
  CHECK(lightly.decay(at_step(1)) == 0.996);  // k = 0: start
  CHECK(double_ulps(lightly.decay(at_step(2)), 0.9960010069152336) <= 1);
  CHECK(double_ulps(lightly.decay(at_step(51)), 0.9980317319276696) <= 1);
  CHECK(lightly.decay(at_step(100)) == 1.0);  // k = 99 = K - 1: the end
  CHECK(lightly.decay(at_step(500)) == 1.0);  // and after
  const auto dino = emakit::CosineMomentum(0.996, 1.0, 100).endpoint(emakit::CosineEnd::after_last_step);
  CHECK(double_ulps(dino.decay(at_step(2)), 0.9960009868792685) <= 1);
  CHECK(double_ulps(dino.decay(at_step(51)), 0.998) <= 1);
  CHECK(dino.decay(at_step(100)) < 1.0);  // k = 99 < K: not yet the end
  CHECK(dino.decay(at_step(101)) == 1.0);
  // It rises monotonically from start to end.
  double previous = 0.0;
  for (std::int64_t s = 1; s <= 120; ++s) {
    const double d = lightly.decay(at_step(s));
    CHECK(d >= previous);
    previous = d;
  }
  CHECK_FALSE(lightly == dino);
  const auto fields = dino.fields();
  REQUIRE(fields.size() == 4);
  CHECK((fields[2].name == "total_steps" && fields[2].value == 100 && fields[2].is_integer));
  CHECK((fields[3].name == "endpoint" && fields[3].value == 1));
  // start > end is possible through the constructor in either order of checks.
  CHECK(emakit::CosineMomentum(0.9, 0.99, 10).end() == 0.99);
}

TEST_CASE("InversePowerWarmup in single precision is ema-pytorch's float32 decay, ATen's pow included", "[decay]") {
  // ema-pytorch: epoch = (step - update_after_step - 1).clamp(min=0.) as a float32 tensor, then
  // value = 1 - (1 + epoch / inv_gamma) ** -power, clamped to [min_value, beta]: those ATen ops
  // here, on 0-d float tensors, against the policy, at every step.
  int powf_differs = 0;  // steps at which powf (the exponent in float) gives another decay
  for (const double power : {2.0 / 3.0, 0.75}) {
    const double inv_gamma = 1.0, beta = 0.9999;
    const std::int64_t after = 10;
    const auto policy =
        emakit::InversePowerWarmup(beta).inv_gamma(inv_gamma).power(power).update_after_step(after).single_precision(
            true);
    int compared = 0;
    for (std::int64_t step = 1; step <= 3000; ++step) {
      const auto epoch = at::scalar_tensor(static_cast<double>(step - after - 1), at::kFloat).clamp_min(0.0);
      if (epoch.item<float>() <= 0.0f) continue;  // the copy: no decay
      const auto base = epoch / inv_gamma + 1.0;
      const auto aten = (1.0 - base.pow(-power)).clamp(0.0, beta).item<float>();
      INFO("power " << power << ", step " << step);
      CHECK(policy.decay(at_step(step)) == static_cast<double>(aten));
      const float powf_value = 1.0f - std::pow(base.item<float>(), static_cast<float>(-power));
      powf_differs += powf_value != aten ? 1 : 0;
      ++compared;
    }
    CHECK(compared == 3000 - after - 1);
  }
  CHECK(powf_differs > 0);  // the test tells ATen's pow from powf (2/3: 35 of the first 1000 steps)
}

TEST_CASE("CosineMomentum per epoch: the index is the epoch of the step, total_steps counts epochs", "[decay]") {
  // lightly's BYOL example: cosine_schedule(epoch, max_epochs, 0.996, 1) at each epoch's start,
  // the teacher updated after every batch. Here 6 epochs of 4 steps: steps 1-4 are epoch 0.
  const auto per_epoch = emakit::CosineMomentum(0.996, 1.0, 6).steps_per_epoch(4);
  const emakit::CosineMomentum per_step(0.996, 1.0, 6);
  for (std::int64_t step = 1; step <= 30; ++step) {
    const std::int64_t epoch = (step - 1) / 4;
    INFO("step " << step << ", epoch " << epoch);
    CHECK(per_epoch.decay(at_step(step)) == per_step.decay(at_step(epoch + 1)));  // bitwise: the same k
  }
  CHECK(per_epoch.decay(at_step(4)) == 0.996);
  CHECK(per_epoch.decay(at_step(5)) > 0.996);
  CHECK(per_epoch.decay(at_step(21)) == 1.0);  // epoch 5 = max_epochs - 1: the end
  // The field is written only when set: a per-step schedule's checkpoints are those of before.
  CHECK(per_step.fields().size() == 4);
  const auto fields = per_epoch.fields();
  REQUIRE(fields.size() == 5);
  CHECK((fields[4].name == "steps_per_epoch" && fields[4].value == 4 && fields[4].is_integer));
  CHECK_FALSE(per_epoch == per_step);
  CHECK_THROWS_WITH(emakit::CosineMomentum().steps_per_epoch(0),
                    Contains("CosineMomentum::steps_per_epoch must be > 0, got 0"));
}

TEST_CASE("Decay options out of range are rejected with the value", "[decay][errors]") {
  CHECK_THROWS_AS(emakit::Fixed(1.0), std::invalid_argument);
  CHECK_THROWS_WITH(emakit::Fixed(1.0), Contains("Fixed::beta must be in [0, 1), got 1"));
  CHECK_THROWS_WITH(emakit::Fixed(-0.5), Contains("Fixed::beta must be in [0, 1), got -0.5"));
  CHECK_THROWS_WITH(emakit::Fixed(std::nan("")), Contains("Fixed::beta"));
  CHECK_THROWS_WITH(emakit::ExponentialRamp(0.9999, 0.0), Contains("ExponentialRamp::tau must be > 0, got 0"));
  CHECK_THROWS_WITH(emakit::ExponentialRamp(0.9999, -3), Contains("ExponentialRamp::tau must be > 0, got -3"));
  CHECK_THROWS_WITH(emakit::ExponentialRamp(1.5, 10),
                    Contains("ExponentialRamp::decay_max must be in [0, 1), got 1.5"));
  CHECK_THROWS_WITH(emakit::InversePowerWarmup().inv_gamma(0),
                    Contains("InversePowerWarmup::inv_gamma must be > 0, got 0"));
  CHECK_THROWS_WITH(emakit::InversePowerWarmup().power(-1), Contains("InversePowerWarmup::power must be > 0, got -1"));
  CHECK_THROWS_WITH(emakit::InversePowerWarmup(0.9).min_value(0.95), Contains("min_value") && Contains("0.95"));
  CHECK_THROWS_WITH(emakit::InversePowerWarmup().update_after_step(-2),
                    Contains("update_after_step") && Contains("-2"));
  CHECK_THROWS_WITH(emakit::PowerFunction(-1.0), Contains("gamma") && Contains("-1"));
  CHECK_THROWS_WITH(emakit::PowerFunction::from_sigma_rel(0.3), Contains("sigma_rel") && Contains("0.3"));
  CHECK_THROWS_WITH(emakit::PowerFunction::from_sigma_rel(0.0), Contains("sigma_rel") && Contains("(0, 0.2887)"));
  CHECK_THROWS_WITH(emakit::sigma_rel_to_gamma(-0.1), Contains("-0.1"));
  CHECK_THROWS_WITH(emakit::RationalRamp(1.0), Contains("RationalRamp::decay_max must be in [0, 1), got 1"));
  CHECK_THROWS_WITH(emakit::RationalRamp(0.9).min_decay(0.95),
                    Contains("RationalRamp::min_decay must be in [0, decay_max = 0.9], got 0.95"));
  CHECK_THROWS_WITH(emakit::RationalRamp().update_after_step(-1), Contains("update_after_step") && Contains("-1"));
  CHECK_THROWS_WITH(emakit::CosineMomentum(0.996, 1.5), Contains("CosineMomentum::end must be in") && Contains("1.5"));
  CHECK_THROWS_WITH(emakit::CosineMomentum(0.999, 0.99),
                    Contains("CosineMomentum::start must be in [0, end = 0.99], got 0.999"));
  CHECK_THROWS_WITH(
      emakit::CosineMomentum(0.996, 1.0, 1),
      Contains("CosineMomentum::total_steps must be >= 2 with CosineEnd::at_last_step") && Contains("got 1"));
  CHECK_THROWS_WITH(emakit::CosineMomentum(0.996, 1.0, 0), Contains("CosineMomentum::total_steps must be > 0, got 0"));
  CHECK(emakit::CosineMomentum().endpoint(emakit::CosineEnd::after_last_step).total_steps(1).decay(at_step(2)) == 1.0);
}

namespace {
// A user-written policy: only decay() is required.
struct HalvingEveryStep {
  double decay(const emakit::DecayInput&) const { return 0.5; }
};
struct NotADecay {
  double decay(int) const { return 0.5; }
};
}  // namespace

static_assert(emakit::DecayPolicy<emakit::Fixed>);
static_assert(emakit::DecayPolicy<emakit::ExponentialRamp>);
static_assert(emakit::DecayPolicy<emakit::InversePowerWarmup>);
static_assert(emakit::DecayPolicy<emakit::PowerFunction>);
static_assert(emakit::DecayPolicy<emakit::Uniform>);
static_assert(emakit::DecayPolicy<emakit::RationalRamp>);
static_assert(emakit::DecayPolicy<emakit::CosineMomentum>);
static_assert(emakit::DescribedPolicy<emakit::RationalRamp>);
static_assert(emakit::DescribedPolicy<emakit::CosineMomentum>);
static_assert(emakit::DecayPolicy<HalvingEveryStep>);
static_assert(!emakit::DecayPolicy<NotADecay>);
static_assert(!emakit::DecayPolicy<int>);
static_assert(emakit::DescribedPolicy<emakit::Fixed>);
static_assert(!emakit::DescribedPolicy<HalvingEveryStep>);
static_assert(emakit::HasLerpWeight<emakit::Uniform>);
static_assert(!emakit::HasLerpWeight<emakit::Fixed>);

TEST_CASE("Policies list their options for checkpoints", "[decay]") {
  const auto fields = emakit::InversePowerWarmup(0.99).update_after_step(7).fields();
  REQUIRE(fields.size() == 7);
  CHECK(fields[0].name == "beta");
  CHECK(fields[0].value == 0.99);
  CHECK(fields[4].name == "update_after_step");
  CHECK(fields[4].value == 7);
  CHECK(fields[4].is_integer);
}

}  // namespace test_decay
