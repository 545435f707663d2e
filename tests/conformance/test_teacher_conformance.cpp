// Conformance: emakit::TeacherStudent against ema-pytorch's EMAModuleWrapper
// (ema_pytorch/ema_module_kwargs.py), replaying tests/conformance/ema_module_wrapper_peer.py:
// the same model (its C++ twin below), the same noisy steps, the routes in the reference's two
// mapping formats; the student outputs, the model's state after the forward (BatchNorm's running
// stats), the EMA state and its step counter compared at every step, and the eval-mode output.
//
// Differences by design (asserted, and in the README's "Coming from Python"):
//   - EMAModuleWrapper.forward() in eval mode, or in train mode with
//     forward_online_during_train=False, returns the EMA model's output; TeacherStudent::forward()
//     always runs the teacher pass then the student: the C++ caller calls the teacher
//     (wrapper.teacher().forward(x)) for that, which gives the reference's numbers.
//   - Receivers in C++ ask for their input in their own forward (emakit::teacher_input); there are
//     no forward hooks in LibTorch. The numbers are the same.
#include "replay.hpp"

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>

using namespace emakit_conformance;

namespace {

struct EncoderImpl : torch::nn::Cloneable<EncoderImpl> {
  EncoderImpl() { reset(); }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(6, 5));
    bn = register_module("bn", torch::nn::BatchNorm1d(5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = torch::tanh(bn->forward(fc->forward(x)));
    emakit::record_teacher_output(*this, y);
    return y;
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Encoder);

// Adds 0.5 * the teacher input named `kwarg` when it gets one, as the Python Receiver does.
struct ReceiverImpl : torch::nn::Cloneable<ReceiverImpl> {
  ReceiverImpl(std::int64_t in, std::int64_t out, std::string kwarg) : in_(in), out_(out), kwarg_(std::move(kwarg)) {
    reset();
  }
  void reset() override { fc = register_module("fc", torch::nn::Linear(in_, out_)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc->forward(x);
    if (auto injected = emakit::teacher_input(*this, kwarg_)) y = y + 0.5 * *injected;
    emakit::record_teacher_output(*this, y);
    return y;
  }
  std::int64_t in_, out_;
  std::string kwarg_;
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Receiver);

struct ModelImpl : torch::nn::Cloneable<ModelImpl> {
  ModelImpl() { reset(); }
  void reset() override {
    encoder = register_module("encoder", Encoder());
    projector = register_module("projector", Receiver(5, 4, "ema_output"));
    predictor = register_module("predictor", Receiver(4, 4, "ema_output"));
    head = register_module("head", Receiver(4, 3, "target"));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head->forward(predictor->forward(projector->forward(encoder->forward(x))));
  }
  Encoder encoder{nullptr};
  Receiver projector{nullptr}, predictor{nullptr}, head{nullptr};
};
TORCH_MODULE(Model);

using ModuleEmaPytorch = emakit::Ema<emakit::InversePowerWarmup, emakit::StepSchedule, emakit::ModuleStorage<ModelImpl>>;

// Every tensor of `m` against rec[prefix + name]: integers exact, floats within 1e-6 relative.
double compare_module(torch::nn::Module& m, const Dict& rec, const std::string& prefix) {
  double worst = 0;
  for (auto& [name, t] : tensors_of(m)) {
    INFO(prefix << name);
    const at::Tensor& peer = rec.at(prefix + name);
    if (!peer.is_floating_point()) {
      CHECK(torch::equal(t, peer));
      continue;
    }
    const double rel = rel_diff(t, peer);
    worst = std::max(worst, rel);
    CHECK(rel <= 1e-6);
  }
  return worst;
}

struct Outcome {
  double max_rel = 0;
  int forwards = 0, evals = 0;
};

Outcome replay_wrapper(const fs::path& dir, const emakit::TeacherRoutes& routes, bool online_in_train) {
  Outcome o;
  Model model;
  load_into(*model, load_dict(dir / "step_0000.pt"), "source.");
  model->train();
  ModuleEmaPytorch ema = emakit::ema_pytorch<emakit::ModuleStorage<ModelImpl>>(
      *model, {.beta = 0.9, .update_after_step = 2, .update_every = 1});
  emakit::TeacherStudent wrapper(*model, ema, routes);
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  for (std::int64_t step = 1; step <= steps; ++step) {
    INFO("step " << step);
    const Dict rec = load_dict(step_file(dir, "step", step));
    load_into(*model, rec, "source.");
    const at::Tensor x = rec.at("input");
    model->train();
    at::Tensor out;
    if (online_in_train) {
      out = wrapper.forward(x);
    } else {
      // The reference returns the EMA model's output, the EMA model in its own (train) mode.
      torch::NoGradGuard no_grad;
      wrapper.teacher().train();  // ema-pytorch's EMA model is a deepcopy of the training model
      out = wrapper.teacher().forward(x);
      o.max_rel = std::max(o.max_rel, compare_module(wrapper.teacher(), rec, "after_ema."));
    }
    REQUIRE(out.sizes() == rec.at("out").sizes());
    o.max_rel = std::max(o.max_rel, rel_diff(out.detach(), rec.at("out")));
    CHECK(rel_diff(out.detach(), rec.at("out")) <= 1e-6);
    ++o.forwards;
    o.max_rel = std::max(o.max_rel, compare_module(*model, rec, "after."));  // the student's BatchNorm moved
    wrapper.update();
    // The EMA (teacher) module's tensors are the averages; ema-pytorch's integer buffers are
    // never updated, as the preset's non_floating(ignore): the teacher keeps its first copy.
    o.max_rel = std::max(o.max_rel, compare_module(wrapper.teacher(), rec, "peer."));
    CHECK(ema.step() == rec.at("counter.step").item<std::int64_t>());
    if (rec.count("eval_out")) {
      // EMAModuleWrapper in eval mode returns the EMA model's output: the teacher, in eval mode.
      model->eval();
      wrapper.teacher().eval();
      torch::NoGradGuard no_grad;
      const at::Tensor teacher_out = wrapper.teacher().forward(x);
      CHECK(rel_diff(teacher_out, rec.at("eval_out")) <= 1e-6);
      CHECK(rel_diff(teacher_out, rec.at("ema_eval_direct")) <= 1e-6);
      // The difference by design: TeacherStudent::forward() in eval mode still runs the student
      // (with the teacher's outputs routed in), which is not what the reference returns.
      const at::Tensor student_out = wrapper.forward(x);
      CHECK_FALSE(torch::allclose(student_out, rec.at("eval_out"), 1e-4, 1e-4));
      o.max_rel = std::max(o.max_rel, rel_diff(teacher_out, rec.at("eval_out")));
      ++o.evals;
      model->train();
      wrapper.teacher().train();
    }
  }
  std::cout << dir.filename().string() << ": " << steps << " steps, " << o.forwards << " student forwards, "
            << o.evals << " eval forwards, max relative difference " << o.max_rel << "\n";
  return o;
}

}  // namespace

TEST_CASE("EMAModuleWrapper: routes as a map (module path and name), student outputs and EMA state",
          "[conformance][ema-module-wrapper]") {
  const auto dir = scenario_dir("ema_module_wrapper_peer", "map_routes");
  if (!dir) return;
  // {"predictor": "projector"}: a module path, so the teacher's projector as "ema_output";
  // {"head": "target"}: not a path, so the name, from the teacher's head.
  const auto o = replay_wrapper(*dir, emakit::TeacherRoutes::map({{"predictor", "projector"}, {"head", "target"}}), true);
  CHECK(o.forwards == 12);
  CHECK(o.evals == 3);
}

TEST_CASE("EMAModuleWrapper: routes as a list of paths, with the default name", "[conformance][ema-module-wrapper]") {
  const auto dir = scenario_dir("ema_module_wrapper_peer", "list_routes");
  if (!dir) return;
  const auto o = replay_wrapper(*dir, emakit::TeacherRoutes::paths({"projector"}), true);
  CHECK(o.forwards == 8);
}

TEST_CASE("EMAModuleWrapper: forward_online_during_train=False returns the EMA model's output",
          "[conformance][ema-module-wrapper]") {
  const auto dir = scenario_dir("ema_module_wrapper_peer", "not_online_in_train");
  if (!dir) return;
  const auto o = replay_wrapper(*dir, emakit::TeacherRoutes::map({{"predictor", "projector"}, {"head", "target"}}), false);
  CHECK(o.forwards == 6);
}
