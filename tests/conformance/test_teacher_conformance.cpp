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

namespace test_teacher_conformance {  // this file's names (unity batches: tests/CMakeLists.txt)

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

using ModuleEmaPytorch =
    emakit::Ema<emakit::InversePowerWarmup, emakit::StepSchedule, emakit::ModuleStorage<ModelImpl>>;

// Tolerances (ulps of float32; replay.hpp):
//   kLerp = 1.5 ulps per update, elementwise: ema-pytorch's EMA lerps with ATen's lerp, emakit
//     with its own pass (derivation in test_peers.cpp). Each update starts from the same state
//     on both sides: the teacher's averages are reset to the peer's previous ones, and the
//     BatchNorm statistics a forward moved are aligned to the peer's after being compared.
//   kForward = 8 ulps of the tensor's largest magnitude (normwise): the forward passes (the
//     outputs, BatchNorm's running statistics) run the kernels of two LibTorch builds (this one
//     and the venv's torch) on the same weights and inputs, each summing in its own order. Not a
//     count per element (a sum's error is relative to its terms, not to its result): each output
//     is a dot product of at most 6 products and a bias (Linear 6->5, 5->4, 4->4, 4->3), at most
//     7 roundings on each side of partial sums that stay within the largest output here: 7 ulps
//     between the two; one more for tanh and the batch normalisation. Measured: 2.
constexpr double kLerp = 1.5, kForward = 8;

// Every tensor of `m` against rec[prefix + name] (replay.hpp's check_tensor with the operands
// `operands_of(name)`): integers exact, copies of an operand bitwise, the rest within `max_ulps`.
template <class Operands>
void compare_module(torch::nn::Module& m, const Dict& rec, const std::string& prefix, Tally& t, Operands operands_of,
                    double max_ulps, bool normwise) {
  for (auto& [name, tensor] : tensors_of(m))
    check_tensor(t, prefix + name, tensor, rec.at(prefix + name), operands_of(name), max_ulps, normwise);
}

// Operands that are the model's own tensors in `rec` under `prefix` (as both sides saw them).
auto operands_from(const Dict& rec, const std::string& prefix) {
  return [&rec, prefix](const std::string& name) {
    std::vector<Operand> out;
    const auto it = rec.find(prefix + name);
    if (it != rec.end()) out.push_back({it->second, it->second});
    return out;
  };
}

struct Outcome {
  Tally averages, forwards_tally;
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
  Dict previous;
  for (std::int64_t step = 1; step <= steps; ++step) {
    INFO("step " << step);
    const Dict rec = load_dict(step_file(dir, "step", step));
    load_into(*model, rec, "source.");
    start_from(ema.averages(), previous);  // the teacher starts from the peer's previous state
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
      // Its BatchNorm statistics moved (normwise); its parameters are what they were (bitwise).
      const Dict* was = previous.empty() ? nullptr : &previous;
      compare_module(
          wrapper.teacher(), rec, "after_ema.", o.forwards_tally,
          [&](const std::string& name) {
            std::vector<Operand> ops;
            if (was != nullptr && was->count("peer." + name))
              ops.push_back({was->at("peer." + name), was->at("peer." + name)});
            return ops;
          },
          kForward, true);
      load_into(wrapper.teacher(), rec, "after_ema.");  // aligned for the update
    }
    REQUIRE(out.sizes() == rec.at("out").sizes());
    check_tensor(o.forwards_tally, "out", out.detach(), rec.at("out"), {}, kForward, true);
    ++o.forwards;
    // The student's BatchNorm moved (normwise); its parameters are the source's (bitwise).
    compare_module(*model, rec, "after.", o.forwards_tally, operands_from(rec, "source."), kForward, true);
    load_into(*model, rec, "after.");  // aligned for the update
    const auto before = [&] {
      std::map<std::string, at::Tensor> b;
      for (const auto& item : ema.averages()) b.emplace(item.key(), item.value().clone());
      return b;
    }();
    wrapper.update();
    // The EMA (teacher) module's tensors are the averages; ema-pytorch's integer buffers are
    // never updated, as the preset's non_floating(ignore): the teacher keeps its first copy.
    compare_module(
        wrapper.teacher(), rec, "peer.", o.averages,
        [&](const std::string& name) {
          std::vector<Operand> ops;
          if (!before.count(name)) return ops;  // not an average (integers: compared bitwise)
          const at::Tensor& mine = before.at(name);
          at::Tensor theirs = mine;  // at the first step, emakit's own start
          if (rec.count("after_ema." + name))
            theirs = rec.at("after_ema." + name);
          else if (previous.count("peer." + name))
            theirs = previous.at("peer." + name);
          ops.push_back({theirs, mine});
          ops.push_back({rec.at("after." + name), rec.at("after." + name)});
          return ops;
        },
        kLerp, false);
    CHECK(ema.step() == rec.at("counter.step").item<std::int64_t>());
    if (rec.count("eval_out")) {
      // EMAModuleWrapper in eval mode returns the EMA model's output: the teacher, in eval mode.
      model->eval();
      wrapper.teacher().eval();
      torch::NoGradGuard no_grad;
      start_from(ema.averages(), rec);  // the peer's EMA model of this step
      const at::Tensor teacher_out = wrapper.teacher().forward(x);
      check_tensor(o.forwards_tally, "eval_out", teacher_out, rec.at("eval_out"), {}, kForward, true);
      check_tensor(o.forwards_tally, "ema_eval_direct", teacher_out, rec.at("ema_eval_direct"), {}, kForward, true);
      // The difference by design: TeacherStudent::forward() in eval mode still runs the student
      // (with the teacher's outputs routed in), which is not what the reference returns.
      const at::Tensor student_out = wrapper.forward(x);
      CHECK_FALSE(torch::allclose(student_out, rec.at("eval_out"), 1e-4, 1e-4));
      ++o.evals;
      model->train();
      wrapper.teacher().train();
    }
    previous = rec;
  }
  std::cout << dir.filename().string() << ": " << steps << " steps, " << o.forwards << " student forwards, " << o.evals
            << " eval forwards; averages: " << o.averages.summary(kLerp)
            << "; forward passes: " << o.forwards_tally.summary(kForward) << "\n";
  // Every step compares each teacher tensor (peer.*), each model tensor after the forward
  // (after.*), the output, and the EMA model's state after its forward when it runs in train mode
  // (after_ema.*); every eval step two outputs.
  const int tensors = model_tensors(dir);
  REQUIRE(o.averages.compared == tensors * static_cast<int>(steps));
  REQUIRE(o.forwards_tally.compared ==
          static_cast<int>(steps) * (tensors + 1 + (online_in_train ? 0 : tensors)) + 2 * o.evals);
  return o;
}

}  // namespace

TEST_CASE("EMAModuleWrapper: routes as a map (module path and name), student outputs and EMA state",
          "[conformance][ema-module-wrapper]") {
  const auto dir = scenario_dir("ema_module_wrapper_peer", "map_routes");
  if (!dir) return;
  // {"predictor": "projector"}: a module path, so the teacher's projector as "ema_output";
  // {"head": "target"}: not a path, so the name, from the teacher's head.
  const auto o =
      replay_wrapper(*dir, emakit::TeacherRoutes::map({{"predictor", "projector"}, {"head", "target"}}), true);
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
  const auto o =
      replay_wrapper(*dir, emakit::TeacherRoutes::map({{"predictor", "projector"}, {"head", "target"}}), false);
  CHECK(o.forwards == 6);
}

}  // namespace test_teacher_conformance
