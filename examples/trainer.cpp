// A small C++ trainer with two EMAs: noisy SGD on a synthetic regression task, printing the test
// loss of the online weights and of each EMA as training goes.
//
//   emakit_example_trainer [steps] [seed]
//
// The noise in the labels and the large learning rate make the online weights jitter around the
// optimum; an EMA of them averages the jitter out and gets a lower test loss.
#include <emakit/emakit.hpp>

#include <torch/nn/cloneable.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <fmt/core.h>

#include <cstdlib>
#include <string>

namespace {

struct MlpImpl : torch::nn::Cloneable<MlpImpl> {
  MlpImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

struct Task {
  torch::Tensor direction;
  torch::Tensor target(const torch::Tensor& x) const { return torch::sin(x.matmul(direction)).unsqueeze(1); }
};

double test_loss(Mlp& model, const torch::Tensor& x, const torch::Tensor& y) {
  torch::NoGradGuard no_grad;
  return torch::mse_loss(model->forward(x), y).item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  const long steps = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 3000;
  const long seed = argc > 2 ? std::strtol(argv[2], nullptr, 10) : 0;
  if (steps <= 0) {
    fmt::print(stderr, "usage: {} [steps > 0] [seed]\n", argv[0]);
    return 2;
  }
  torch::manual_seed(seed);
  const Task task{torch::randn({16}) / 4.0};
  const auto x_test = torch::randn({4096, 16});
  const auto y_test = task.target(x_test);

  Mlp model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.2));
  emakit::FixedEma fixed(*model, emakit::Fixed(0.995));
  emakit::WarmupEma warmup(*model, emakit::InversePowerWarmup(0.999).power(0.75));

  fmt::print("{}\n{}\n\n", fixed, warmup);
  fmt::print("{:>6}  {:>12}  {:>12}  {:>12}\n", "step", "online", "fixed EMA", "warmup EMA");
  auto row = [&](long step) {
    const double online = test_loss(model, x_test, y_test);
    double with_fixed, with_warmup;
    {
      auto swapped = fixed.swap_into();
      with_fixed = test_loss(model, x_test, y_test);
    }
    {
      auto swapped = warmup.swap_into();
      with_warmup = test_loss(model, x_test, y_test);
    }
    fmt::print("{:>6}  {:>12.6f}  {:>12.6f}  {:>12.6f}\n", step, online, with_fixed, with_warmup);
    return std::array<double, 3>{online, with_fixed, with_warmup};
  };

  std::array<double, 3> last{};
  for (long step = 1; step <= steps; ++step) {
    const auto x = torch::randn({32, 16});
    const auto y = task.target(x) + 0.5 * torch::randn({32, 1});  // noisy labels
    optimizer.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    optimizer.step();
    fixed.update();
    warmup.update();
    if (step % (steps / 10 > 0 ? steps / 10 : 1) == 0 || step == steps) last = row(step);
  }
  fmt::print("\ntest loss at the end: online {:.6f}, fixed EMA {:.6f} ({:+.1f}%), warmup EMA {:.6f} ({:+.1f}%)\n",
             last[0], last[1], 100.0 * (last[1] / last[0] - 1.0), last[2], 100.0 * (last[2] / last[0] - 1.0));
  return 0;
}
