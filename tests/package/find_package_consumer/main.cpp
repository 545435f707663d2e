// Packaging test: a consumer declares an EMA in one line through an alias and updates it.
#include <emakit/emakit.hpp>
#include <torch/nn/modules/linear.h>
#include <fmt/core.h>

int main() {
  torch::nn::Linear model(4, 2);
  emakit::WarmupEma ema(*model);  // alias: inverse-power warmup decay, flat storage
  torch::NoGradGuard no_grad;
  model->weight.add_(1.0);
  [[maybe_unused]] emakit::UpdateResult r = ema.update();
  fmt::print("{}\n", ema);  // an fmt formatter exists for every Ema
  return ema.num_updates() == 1 ? 0 : 1;
}
