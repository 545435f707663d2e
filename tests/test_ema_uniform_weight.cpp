// Uniform gives the lerp weight 1/n itself (Uniform::weight), and an Ema averages with exactly that
// weight, as torch's AveragedModel (SWA) does: 1 - decay() = 1 - (1 - 1/n) rounds differently.
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

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
  int told_apart = 0;  // updates at which the weight 1 - d would give another average
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
