// Packaging test: a one-file trainer that took emakit in by FetchContent (CMakeLists.txt).
#include <emakit/emakit.hpp>
#include <torch/nn/modules/linear.h>

int main() {
  torch::nn::Linear model(4, 2);
  torch::NoGradGuard no_grad;
  model->weight.fill_(1.0);
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  model->weight.fill_(3.0);
  ema.update();  // halfway, exactly: 1 + 0.5 * (3 - 1)
  return torch::equal(ema.average("weight"), torch::full({2, 4}, 2.0)) ? 0 : 1;
}
