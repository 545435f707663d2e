// A hand-written C++ training loop with emakit::EmaHook: noisy SGD on a synthetic regression
// task, validation with the EMA weights, a checkpoint every fifth of the run, and resuming.
//
//   emakit_example_trainer [steps] [seed] [checkpoint] [phema folder]
//
// With a checkpoint path, the run saves to it as it goes and, when the file is already there,
// resumes from it: model, optimizer, EMA and step counter, so that an interrupted run ends with
// the same weights as an uninterrupted one. With a phema folder (checkpoint "" for none), a
// post-hoc EMA (emakit::PostHocEma, two profiles) runs alongside and snapshots into the folder
// five times in the run, for emakit_example_posthoc_tool; it is not in the checkpoint, so a
// resumed run cannot take one. The noise in the labels and the large learning rate
// make the online weights jitter around the optimum; the EMA averages the jitter out.
#include <emakit/emakit.hpp>
#include <emakit/posthoc.hpp>

#include <torch/nn/cloneable.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
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

int train(int argc, char** argv) {
  const long steps = argc > 1 ? std::strtol(argv[1], nullptr, 10) : 3000;
  const long seed = argc > 2 ? std::strtol(argv[2], nullptr, 10) : 0;
  const std::string checkpoint = argc > 3 ? argv[3] : "";
  const std::string phema = argc > 4 ? argv[4] : "";
  if (steps <= 0 || argc > 5) {
    fmt::print(stderr, "usage: {} [steps > 0] [seed] [checkpoint file or \"\"] [post-hoc snapshot folder]\n", argv[0]);
    return 2;
  }
  torch::manual_seed(seed);
  const Task task{torch::randn({16}) / 4.0};
  const auto x_test = torch::randn({4096, 16});
  const auto y_test = task.target(x_test);

  Mlp model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.2));
  emakit::EmaHook hook;
  hook.add(*model, emakit::Recipe(emakit::InversePowerWarmup(0.999).power(0.75)));
  hook.setup();

  long first = 1;
  if (!checkpoint.empty() && std::filesystem::exists(checkpoint)) {
    torch::serialize::InputArchive in;
    in.load_from(checkpoint);
    hook.load_checkpoint(in);  // the online weights and the EMA; checked before anything is written
    torch::serialize::InputArchive opt;
    in.read("optimizer", opt);
    optimizer.load(opt);
    torch::Tensor step;
    in.read("step", step);
    first = step.item<long>() + 1;
    fmt::print("resumed from {} after step {}\n", checkpoint, first - 1);
  }
  std::optional<emakit::PostHocEma> posthoc;
  if (!phema.empty()) {
    if (first != 1) {
      fmt::print(stderr,
                 "a resumed run cannot take a post-hoc snapshot folder (the post-hoc EMA is not in the checkpoint)\n");
      return 2;
    }
    posthoc.emplace(*model, emakit::PostHocOptions(phema).snapshot_every(std::max(1L, steps / 5)));
  }
  fmt::print("{}\n\n{:>6}  {:>12}  {:>12}\n", hook.ema<emakit::WarmupEma>("model"), "step", "online", "EMA");

  const long every = steps / 10 > 0 ? steps / 10 : 1;
  double online = 0, with_ema = 0;
  for (long step = first; step <= steps; ++step) {
    torch::manual_seed(seed * 1000003 + step);  // the batch of a step depends on the step only
    const auto x = torch::randn({32, 16});
    const auto y = task.target(x) + 0.5 * torch::randn({32, 1});  // noisy labels
    optimizer.zero_grad();
    torch::mse_loss(model->forward(x), y).backward();
    optimizer.step();
    hook.after_optimizer_step();
    if (posthoc) posthoc->update();  // snapshots at multiples of steps / 5
    if (step % every == 0 || step == steps) {
      online = test_loss(model, x_test, y_test);
      {
        auto scope = hook.validation();  // the EMA weights in the model, the online ones back after
        with_ema = test_loss(model, x_test, y_test);
      }
      fmt::print("{:>6}  {:>12.6f}  {:>12.6f}\n", step, online, with_ema);
    }
    if (!checkpoint.empty() && (step % (2 * every) == 0 || step == steps)) {
      torch::serialize::OutputArchive out;
      hook.save_checkpoint(out);  // the EMA weights as "model", plus what resuming needs
      torch::serialize::OutputArchive opt;
      optimizer.save(opt);
      out.write("optimizer", opt);
      out.write("step", torch::tensor(static_cast<std::int64_t>(step)));
      out.save_to(checkpoint + ".tmp");  // then renamed: a crash mid-write keeps the previous file
      std::filesystem::rename(checkpoint + ".tmp", checkpoint);
    }
  }
  hook.train_end();  // the model keeps the EMA weights
  if (posthoc) fmt::print("post-hoc EMA: {} snapshots in {}\n", emakit::list_snapshots(phema).size(), phema);
  fmt::print(
      "\ntest loss at the end: online {:.6f}, EMA {:.6f} ({:+.1f}%); the model now holds the EMA weights: {:.6f}\n",
      online, with_ema, 100.0 * (with_ema / online - 1.0), test_loss(model, x_test, y_test));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return train(argc, argv);
  } catch (const std::exception& e) {  // emakit's errors say what was wrong and what to do
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
