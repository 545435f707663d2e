// The compile-time benchmark's trainer TU (benchmarks/compile_time.sh): a small trainer, built as
// three variants of this one file so that they differ in the EMA lines only:
//   EMAKIT_CT_EMA=0  LibTorch only: the reference
//   EMAKIT_CT_EMA=1  plus one WarmupEma through the umbrella header <emakit/emakit.hpp>
//   EMAKIT_CT_EMA=2  the same through the three headers it uses (aliases, checkpoint, format)
// Variants 1 and 2 are built against emakit::emakit (header-only) and emakit::compiled.
#if EMAKIT_CT_EMA == 1
#include <emakit/emakit.hpp>
#elif EMAKIT_CT_EMA == 2
#include <emakit/aliases.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/format.hpp>
#endif
#if EMAKIT_CT_EMA != 0
#include <fmt/core.h>
#define WITH_EMA(...) __VA_ARGS__
#else
#define WITH_EMA(...)
#endif
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
  WITH_EMA(emakit::WarmupEma ema(*model);)
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({8, 784})), torch::randint(10, {8}));
    loss.backward();
    opt.step();
    WITH_EMA(ema.update();)
  }
  WITH_EMA({ auto guard = ema.swap_into(); })
  WITH_EMA(emakit::save(ema, "ema.pt");)
  WITH_EMA(emakit::load(ema, "ema.pt");)
  WITH_EMA(fmt::print("{}\n", ema);)
  torch::save(model, "model.pt");
  torch::load(model, "model.pt");
  std::cout << *model << '\n';
}
