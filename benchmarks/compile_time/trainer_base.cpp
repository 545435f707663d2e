// The compile-time benchmark's reference TU (benchmarks/compile_time.sh): a small trainer with
// LibTorch only. trainer_ema.cpp is this file plus one EMA; keep the two in step.
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
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({8, 784})), torch::randint(10, {8}));
    loss.backward();
    opt.step();
  }
  torch::save(model, "model.pt");
  torch::load(model, "model.pt");
  std::cout << *model << '\n';
}
