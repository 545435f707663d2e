// A checkpoint's config is compared exactly: a decay policy field that differs from this EMA's in
// its last bit is another config, refused naming the field (a float32 comparison would let it load).
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <cmath>

using Catch::Matchers::Contains;

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
