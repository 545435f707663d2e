// Decay policies: the reference values of DESIGN.md, validation, sigma_rel <-> gamma, and a
// user-written policy.
#include <emakit/decay.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <stdexcept>

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

TEST_CASE("Decay options out of range are rejected with the value", "[decay][errors]") {
  CHECK_THROWS_AS(emakit::Fixed(1.0), std::invalid_argument);
  CHECK_THROWS_WITH(emakit::Fixed(1.0), Contains("Fixed::beta must be in [0, 1), got 1"));
  CHECK_THROWS_WITH(emakit::Fixed(-0.5), Contains("Fixed::beta must be in [0, 1), got -0.5"));
  CHECK_THROWS_WITH(emakit::Fixed(std::nan("")), Contains("Fixed::beta"));
  CHECK_THROWS_WITH(emakit::ExponentialRamp(0.9999, 0.0), Contains("ExponentialRamp::tau must be > 0, got 0"));
  CHECK_THROWS_WITH(emakit::ExponentialRamp(0.9999, -3), Contains("ExponentialRamp::tau must be > 0, got -3"));
  CHECK_THROWS_WITH(emakit::ExponentialRamp(1.5, 10), Contains("ExponentialRamp::decay must be in [0, 1), got 1.5"));
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
