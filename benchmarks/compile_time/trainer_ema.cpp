// The compile-time benchmark's emakit TU (benchmarks/compile_time.sh): trainer_base.cpp plus one
// EMA through the umbrella header. Built twice: against emakit::emakit (header-only) and
// emakit::compiled (compiled mode).
#include <emakit/emakit.hpp>
#include <fmt/core.h>
#include <torch/torch.h>

#include <iostream>

struct NetImpl : torch::nn::Module {
  torch::nn::Linear fc1{register_module("fc1", torch::nn::Linear(784, 128))};
  torch::nn::Linear fc2{register_module("fc2", torch::nn::Linear(128, 10))};
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
};
TORCH_MODULE(Net);

int main() {
  Net model;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  emakit::WarmupEma ema(*model);
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({8, 784})), torch::randint(10, {8}));
    loss.backward();
    opt.step();
    ema.update();
  }
  { auto guard = ema.swap_into(); }
  emakit::save(ema, "ema.pt");
  emakit::load(ema, "ema.pt");
  fmt::print("{}\n", ema);
  torch::save(model, "model.pt");
  torch::load(model, "model.pt");
  std::cout << *model << '\n';
}
