// Self-supervised learning with an EMA teacher (BYOL-style) on Fashion-MNIST, without labels:
// the student sees one augmented view, the EMA teacher another, and the teacher's projection
// reaches the student's predictor through emakit::TeacherStudent. The teacher's momentum follows
// BYOL's cosine schedule (emakit::CosineMomentum: --decay at the first step, rising to 1 at the last,
// as lightly's cosine_schedule + update_momentum do). After training, a linear probe
// (a logistic regression on frozen features, with labels) measures what the encoder learned. The
// same run with a teacher that is a copy of the student (decay 0) shows what the EMA adds, and the
// probe of the untrained encoder is the floor: random ReLU features are strong on this data, and
// a few CPU epochs of an MLP are a demonstration of the mechanism, not a tuned SSL recipe.
//
//   ./scripts/demo.sh ssl                    # installs the data, builds, runs this (~1.5 min on 2 cores)
//   emakit_example_ssl_byol --data build/data/fashion-mnist [--epochs 2] [--train-subset 20000]
//
// The routed sub-modules say so in their own forward: the projector records its output when it
// runs as the teacher, the predictor asks for it when it runs as the student.
#include <emakit/decay.hpp>
#include <emakit/ema.hpp>
#include <emakit/format.hpp>
#include <emakit/storage.hpp>
#include <emakit/teacher.hpp>

#include <ATen/Parallel.h>
#include <torch/data/datasets/mnist.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/functional/normalization.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace F = torch::nn::functional;

// Encoder -> projector -> predictor (BatchNorm in the projector and predictor, as BYOL needs to
// keep its representations from collapsing). The teacher (the EMA of this module) runs the same forward;
// its projector output is the target of the student's predictor.
struct ByolNetImpl : torch::nn::Cloneable<ByolNetImpl> {
  ByolNetImpl() { reset(); }
  void reset() override {
    encoder = register_module(
        "encoder", torch::nn::Sequential(torch::nn::Linear(784, 256), torch::nn::ReLU(), torch::nn::Linear(256, 128)));
    projector = register_module("projector", Projector());
    predictor = register_module("predictor", Predictor());
  }
  torch::Tensor features(const torch::Tensor& x) { return encoder->forward(x.flatten(1)); }
  torch::Tensor forward(const torch::Tensor& x) { return predictor->forward(projector->forward(features(x))); }

  struct ProjectorImpl : torch::nn::Cloneable<ProjectorImpl> {
    ProjectorImpl() { reset(); }
    void reset() override {
      body = register_module("body", torch::nn::Sequential(torch::nn::Linear(128, 256), torch::nn::BatchNorm1d(256),
                                                           torch::nn::ReLU(), torch::nn::Linear(256, 64)));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      auto z = body->forward(x);
      emakit::record_teacher_output(*this, z);  // kept when this runs as the teacher
      return z;
    }
    torch::nn::Sequential body{nullptr};
  };
  TORCH_MODULE(Projector);

  struct PredictorImpl : torch::nn::Cloneable<PredictorImpl> {
    PredictorImpl() { reset(); }
    void reset() override {
      body = register_module("body", torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::BatchNorm1d(256),
                                                           torch::nn::ReLU(), torch::nn::Linear(256, 64)));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      auto p = body->forward(x);
      if (auto t = emakit::teacher_input(*this, emakit::default_teacher_input, p)) target = *t;  // as the student
      return p;
    }
    torch::nn::Sequential body{nullptr};
    torch::Tensor target;  // the teacher's projection of the other view, for the loss
  };
  TORCH_MODULE(Predictor);

  torch::nn::Sequential encoder{nullptr};
  Projector projector{nullptr};
  Predictor predictor{nullptr};
};
TORCH_MODULE(ByolNet);

// Two random views of a batch [B, 1, 28, 28] in [0, 1]: a shift of up to 3 pixels, a horizontal
// flip for half the images, a contrast change and noise.
torch::Tensor augment(const torch::Tensor& x) {
  const auto b = x.size(0);
  auto padded = F::pad(x, F::PadFuncOptions({3, 3, 3, 3}));
  const auto shifts = torch::randint(0, 7, {b, 2}, torch::kLong);
  const auto span = torch::arange(28, torch::kLong);
  const auto rows = (shifts.select(1, 0).unsqueeze(1) + span).view({b, 28, 1});
  const auto cols = (shifts.select(1, 1).unsqueeze(1) + span).view({b, 1, 28});
  auto out = padded.squeeze(1).index({torch::arange(b, torch::kLong).view({b, 1, 1}), rows, cols}).unsqueeze(1);
  const auto flip = torch::rand({b, 1, 1, 1}) < 0.5;
  out = torch::where(flip, out.flip({3}), out);
  out = out * (0.6 + 0.8 * torch::rand({b, 1, 1, 1})) + 0.1 * torch::randn_like(out);
  return out;
}

// BYOL's loss: 2 - 2 cos(p, t), averaged over the batch.
torch::Tensor byol_loss(const torch::Tensor& p, const torch::Tensor& t) {
  return (2.0 -
          2.0 * (F::normalize(p, F::NormalizeFuncOptions().dim(1)) * F::normalize(t, F::NormalizeFuncOptions().dim(1)))
                    .sum(1))
      .mean();
}

// A logistic regression on frozen features: test accuracy.
double linear_probe(const torch::Tensor& train_f, const torch::Tensor& train_y, const torch::Tensor& test_f,
                    const torch::Tensor& test_y) {
  const auto mean = train_f.mean(0), std = train_f.std(0) + 1e-6;
  const auto xtr = (train_f - mean) / std, xte = (test_f - mean) / std;
  torch::nn::Linear probe(train_f.size(1), 10);
  torch::optim::Adam opt(probe->parameters(), torch::optim::AdamOptions(1e-2));
  const std::int64_t n = xtr.size(0), batch = 512;
  for (int epoch = 0; epoch < 15; ++epoch) {
    const auto order = torch::randperm(n, torch::kLong);
    for (std::int64_t i = 0; i < n; i += batch) {
      const auto idx = order.narrow(0, i, std::min(batch, n - i));
      opt.zero_grad();
      F::cross_entropy(probe->forward(xtr.index_select(0, idx)), train_y.index_select(0, idx)).backward();
      opt.step();
    }
  }
  torch::NoGradGuard no_grad;
  return probe->forward(xte).argmax(1).eq(test_y).to(torch::kDouble).mean().item<double>();
}

torch::Tensor features(ByolNetImpl& net, const torch::Tensor& images) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;
  for (std::int64_t i = 0; i < images.size(0); i += 1000)
    parts.push_back(net.features(images.narrow(0, i, std::min<std::int64_t>(1000, images.size(0) - i))));
  return torch::cat(parts);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"BYOL-style self-supervised learning with an EMA teacher (emakit::TeacherStudent) on Fashion-MNIST"};
  std::string data = "build/data/fashion-mnist";
  int epochs = 2, batch_size = 128, threads = 0;
  std::int64_t train_subset = 20000;
  std::uint64_t seed = 0;
  bool smoke = false;
  double decay = 0.99, lr = 1e-3;
  app.add_option("--data", data, "folder with the four uncompressed Fashion-MNIST IDX files");
  app.add_option("--epochs", epochs, "passes over the training images")->check(CLI::Range(1, 1000));
  app.add_option("--batch-size", batch_size, "images per step")->check(CLI::Range(2, 65536));
  app.add_option("--lr", lr, "Adam's learning rate")->check(CLI::PositiveNumber);
  app.add_option("--decay", decay, "the teacher's momentum at the first step (it rises to 1 along a half cosine)")
      ->check(CLI::Range(0.0, 0.999999));
  app.add_option("--seed", seed, "seed of the initialisation, the views and the order");
  app.add_option("--threads", threads, "LibTorch threads (0: its default)")->check(CLI::NonNegativeNumber);
  app.add_option("--train-subset", train_subset, "use only the first N training images (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--smoke", smoke, "a test run: exit 77 (ctest: skipped) when the data is missing");
  CLI11_PARSE(app, argc, argv);

  for (const char* name :
       {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    const auto file = std::filesystem::path(data) / name;
    if (!std::filesystem::exists(file)) {
      fmt::print(stderr,
                 "error: missing {}\n  install the data with `sudo apt-get install dataset-fashion-mnist`, then run "
                 "./scripts/demo.sh ssl, which decompresses it into build/data/fashion-mnist\n",
                 file.string());
      return smoke ? 77 : 2;
    }
  }
  if (threads > 0) at::set_num_threads(threads);
  torch::manual_seed(seed);

  using torch::data::datasets::MNIST;
  MNIST train_set(data, MNIST::Mode::kTrain), test_set(data, MNIST::Mode::kTest);
  auto train_x = train_set.images(), train_y = train_set.targets();
  if (train_subset > 0 && train_subset < train_x.size(0)) {
    train_x = train_x.narrow(0, 0, train_subset);
    train_y = train_y.narrow(0, 0, train_subset);
  }
  const auto test_x = test_set.images(), test_y = test_set.targets();
  const std::int64_t probe_n = std::min<std::int64_t>(10000, train_x.size(0));

  const auto probe = [&](ByolNetImpl& net) {
    return linear_probe(features(net, train_x.narrow(0, 0, probe_n)), train_y.narrow(0, 0, probe_n),
                        features(net, test_x), test_y);
  };
  // The same run twice from the same initialisation and views: with the EMA teacher, and with a
  // teacher that is a copy of the student at every step (decay 0: stop-gradient only, SimSiam's
  // way), which shows what the EMA itself contributes.
  struct Outcome {
    double decay, loss, student, teacher;
  };
  std::vector<Outcome> outcomes;
  double probe_before = 0;
  const std::int64_t total_steps = epochs * (train_x.size(0) / batch_size);
  using CosineTeacher = emakit::Ema<emakit::CosineMomentum, emakit::StepSchedule, emakit::ModuleStorage<ByolNetImpl>>;
  for (const double d : {decay, 0.0}) {
    torch::manual_seed(seed);
    ByolNet model;
    if (d == decay) probe_before = probe(*model);
    // d > 0: momentum d at the first step, 1 at the last (BYOL); d = 0: 0 throughout (the copy).
    emakit::TeacherStudent wrapper(*model,
                                   CosineTeacher(*model, emakit::CosineMomentum(d, d > 0 ? 1.0 : 0.0, total_steps)),
                                   emakit::TeacherRoutes::map({{"predictor", "projector"}}));
    torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(lr));
    fmt::print("BYOL on {} unlabelled images, {} epochs, batch {}, teacher momentum {} -> {} (cosine, {} steps)\n",
               train_x.size(0), epochs, batch_size, d, d > 0 ? 1.0 : 0.0, total_steps);
    torch::manual_seed(seed + 1);
    const auto start = std::chrono::steady_clock::now();
    const std::int64_t n = train_x.size(0);
    double last_loss = 0;
    for (int epoch = 1; epoch <= epochs; ++epoch) {
      const auto order = torch::randperm(n, torch::kLong);
      double loss_sum = 0;
      std::int64_t steps = 0;
      for (std::int64_t i = 0; i + batch_size <= n; i += batch_size) {
        const auto x = train_x.index_select(0, order.narrow(0, i, batch_size));
        const auto a = augment(x), b = augment(x);
        optimizer.zero_grad();
        // The student sees one view and predicts the teacher's projection of the other, both ways.
        const auto p_a = wrapper.forward_views(std::make_tuple(b), std::make_tuple(a));
        const auto t_b = model->predictor->target;
        const auto p_b = wrapper.forward_views(std::make_tuple(a), std::make_tuple(b));
        const auto t_a = model->predictor->target;
        const auto loss = byol_loss(p_a, t_b) + byol_loss(p_b, t_a);
        loss.backward();
        optimizer.step();
        wrapper.update();
        loss_sum += loss.item<double>();
        ++steps;
      }
      last_loss = loss_sum / static_cast<double>(steps);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      fmt::print("  epoch {}: BYOL loss {:.4f}, {} steps, {:.0f} s\n", epoch, last_loss, steps, secs);
    }
    outcomes.push_back({d, last_loss, probe(*model), probe(wrapper.teacher())});
  }

  fmt::print("\nlinear probe accuracy on frozen encoder features ({} labelled training images, 10000 test images)\n",
             probe_n);
  fmt::print("  {:<40} {:>8} {:>8}\n", "", "student", "teacher");
  fmt::print("  {:<40} {:>7.2f}%\n", "encoder at initialisation (no training)", 100.0 * probe_before);
  for (const auto& o : outcomes)
    fmt::print("  {:<40} {:>7.2f}% {:>7.2f}%   (final BYOL loss {:.4f})\n",
               o.decay > 0 ? fmt::format("BYOL, EMA teacher (momentum {} -> 1)", o.decay)
                           : std::string("BYOL, teacher = student (no EMA)"),
               100.0 * o.student, 100.0 * o.teacher, o.loss);
  return 0;
}
