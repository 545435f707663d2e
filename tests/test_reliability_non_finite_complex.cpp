// The non-finite guard (EmaOptions::skip_non_finite) reads every tensor an update would read,
// complex ones included: a NaN or an infinity in a real or an imaginary part skips the update.
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <limits>
#include <string>
#include <vector>

using emakit::Action;

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
