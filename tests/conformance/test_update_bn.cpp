// Conformance: emakit::update_bn against torch.optim.swa_utils.update_bn, replaying
// tests/conformance/update_bn_peer.py: the same model (its C++ twin below: Conv2d, BatchNorm2d with
// momentum 0.3, relu, flatten, Linear, BatchNorm1d), the same weights, stale statistics, momenta,
// training modes and batches (the batches' bytes come from the data file); emakit::update_bn runs
// on them and every tensor of the model's state, every momentum and every module's training mode
// afterwards are compared with what torch's update_bn left. Scenarios: the model in eval mode over a
// DataLoader of (input, target) pairs (torch takes input[0]; here the forward is given the
// inputs), and the end of an SWA run: AveragedModel(model) over 8 steps (replayed through
// averaged_model_swa, replay.hpp), then update_bn on the averaged model.
//
// Tolerances, in ulps of float32 (replay.hpp's check_tensor):
//   - parameters: update_bn must leave them alone: bitwise;
//   - num_batches_tracked: exact (the number of batches);
//   - running_mean and running_var: the pass runs ATen's convolution, linear, relu and batch_norm
//     kernels in train mode, and both sides compute the factor 1/k of batch k in double. With the
//     torch the peer ran (the torch2 build links the venv's LibTorch: the same version, the same
//     kernels on the same CPU; meta.pt's torch_version says which) the statistics must be bitwise
//     equal: kSameTorch = 0. Another LibTorch (the torch1.13 build: Debian's 1.13 against the
//     venv's 2.x) sums the convolution (18 products and a bias per output), the linear layer (48
//     and a bias) and the batch statistics in its own order: the two sides' statistics differ by
//     at most some 70 float32 roundings of the terms summed (not of the result), which cancel in
//     part, typically to about sqrt(70) ~ 8. kAcrossTorch = 16 ulps of the tensor's largest
//     magnitude (normwise), twice that: an estimate, not a proof (here the terms are O(1), the
//     statistics 0.03 to 2.5). Measured (2026-12-03): 0 on torch2 (both scenarios); on torch1.13
//     1.5 (eval_loader, bn1.running_var) and 1 (swa). A wrong pass is far outside it: a momentum
//     left at 0.1, statistics not reset, or the samples weighted instead of
//     the batches (the batches are of unequal sizes) move the statistics by percents.
//   - the SWA steps before it: kSwa = 2.5 per update (test_peers.cpp's derivation); measured 1.
#include "replay.hpp"

#include <torch/nn/modules/conv.h>
#include <torch/version.h>

namespace test_update_bn {  // this file's names (unity batches: tests/CMakeLists.txt)

using namespace emakit_conformance;

namespace {

constexpr double kSameTorch = 0, kAcrossTorch = 16, kSwa = 2.5;  // kSwa: test_peers.cpp

// update_bn_peer.py's BnNet, its modules registered in the same order under the same names.
struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(3).momentum(0.3)));
    fc = register_module("fc", torch::nn::Linear(48, 5));
    bn1 = register_module("bn1", torch::nn::BatchNorm1d(5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return bn1->forward(fc->forward(torch::relu(bn2->forward(conv->forward(x))).flatten(1)));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn2{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn1{nullptr};
};
TORCH_MODULE(BnNet);

// The model's modules by the peer's names ("root": the model).
std::vector<std::pair<std::string, torch::nn::Module*>> modules_of(BnNet& model) {
  std::vector<std::pair<std::string, torch::nn::Module*>> out{{"root", model.get()}};
  for (const auto& child : model->named_children()) out.emplace_back(child.key(), child.value().get());
  return out;
}
std::vector<std::pair<std::string, torch::nn::BatchNormOptions*>> momenta_of(BnNet& model) {
  return {{"bn2", &model->bn2->options}, {"bn1", &model->bn1->options}};
}

// Whether this LibTorch is the torch that wrote the data (meta.pt's torch_version).
bool same_torch(const Dict& meta) {
  const auto version = meta.at("torch_version");
  return version[0].item<std::int64_t>() == TORCH_VERSION_MAJOR &&
         version[1].item<std::int64_t>() == TORCH_VERSION_MINOR;
}

struct Outcome {
  Tally tally;
  std::int64_t statistics_elements = 0;  // running_mean and running_var elements compared
  int flags = 0;                         // momenta and training modes compared
};

// Puts the peer's state before update_bn into `model` (tensors, momenta, training modes), runs
// emakit::update_bn over the peer's batches, and compares what it leaves with the peer's.
Outcome check_update_bn(const fs::path& dir, BnNet& model) {
  Outcome o;
  const Dict rec = load_dict(dir / "update_bn.pt");
  const Dict meta = load_dict(dir / "meta.pt");
  const bool same = same_torch(meta);
  const double bound = same ? kSameTorch : kAcrossTorch;
  load_into(*model, rec, "before.");
  for (auto& [name, options] : momenta_of(model)) {
    const auto it = rec.find("momentum_before." + name);
    options->momentum() = std::decay_t<decltype(options->momentum())>();  // None
    if (it != rec.end()) options->momentum(it->second.item<double>());
  }
  for (auto& [name, module] : modules_of(model))  // the root first: its train() sets its children
    module->train(rec.at("training_before." + name).item<std::int64_t>() != 0);
  std::vector<at::Tensor> batches;
  for (const auto& [key, tensor] : rec)
    if (key.rfind("batch.", 0) == 0) batches.push_back(tensor);  // batch.00, batch.01, ... in order
  std::int64_t calls = 0;
  const auto result = emakit::update_bn(*model, batches, [&](const at::Tensor& x) {
    ++calls;
    model->forward(x);
  });
  CHECK(result == emakit::UpdateBnResult{2, static_cast<std::int64_t>(batches.size())});
  CHECK(calls == rec.at("calls").item<std::int64_t>());
  const auto parameters = model->named_parameters();
  for (const auto& [name, ours] : tensors_of(*model)) {
    const at::Tensor& peer = rec.at("after." + name);
    const bool parameter = parameters.contains(name);
    // A parameter: the peer's is its value before (bitwise). A statistic: within the bound, at the
    // tensor's largest magnitude.
    std::vector<Operand> operands;
    if (parameter) operands.push_back({rec.at("before." + name), rec.at("before." + name)});
    check_tensor(o.tally, dir.filename().string() + ": " + name, ours.detach(), peer, operands, bound,
                 /*normwise=*/true);
    if (!parameter && peer.is_floating_point()) o.statistics_elements += peer.numel();
  }
  for (auto& [name, options] : momenta_of(model)) {
    INFO("momentum of " << name);
    const auto it = rec.find("momentum_after." + name);
    CHECK(options->momentum().has_value() == (it != rec.end()));
    if (it != rec.end() && options->momentum().has_value()) CHECK(*options->momentum() == it->second.item<double>());
    ++o.flags;
  }
  for (auto& [name, module] : modules_of(model)) {
    INFO("training mode of " << name);
    CHECK(module->is_training() == (rec.at("training_after." + name).item<std::int64_t>() != 0));
    ++o.flags;
  }
  std::cout << dir.filename().string() << ": " << batches.size() << " batches, " << o.tally.summary(bound) << ", "
            << o.statistics_elements << " running-statistics elements; " << o.flags << " momenta and training modes; "
            << (same ? "the peer's torch: bitwise" : "another torch than the peer's") << "\n";
  // Every tensor of the model's state (14: conv 2, bn2 5, fc 2, bn1 5), of which the 4 running
  // statistics (3 + 3 + 5 + 5 elements) within the bound, the 8 parameters bitwise (the peer left
  // them alone) and the 2 counters exactly; 2 momenta and 5 training modes.
  REQUIRE(o.tally.compared == 14);
  REQUIRE(o.tally.within == 4);
  REQUIRE(o.statistics_elements == 16);
  REQUIRE(o.flags == 7);
  return o;
}

}  // namespace

TEST_CASE("update_bn: a model in eval mode over a DataLoader's inputs, as torch.optim.swa_utils.update_bn",
          "[conformance][update_bn]") {
  const auto dir = scenario_dir("update_bn_peer", "eval_loader");
  if (!dir) return;
  BnNet model;
  check_update_bn(*dir, model);
  CHECK(model->bn2->num_batches_tracked.item<std::int64_t>() == 3);  // reset from the stale 5: 3 batches
  CHECK_FALSE(model->bn1->options.momentum().has_value());           // None before: None after
  CHECK_FALSE(model->is_training());
}

TEST_CASE("update_bn at the end of an SWA run: AveragedModel's averages, then update_bn on the averaged model",
          "[conformance][update_bn][averaged-model]") {
  const auto dir = scenario_dir("update_bn_peer", "swa");
  if (!dir) return;
  // The averaging steps, as test_peers.cpp replays AveragedModel's SWA.
  auto sources = sources_from(*dir);
  auto swa = emakit::averaged_model_swa(sources, {.use_buffers = false});
  const Replay r = replay(*dir, sources, swa, false, averaged_model_counters, kSwa);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.steps == 8);
  // update_bn ran on the last average (its parameters; its buffers the model's, use_buffers=False).
  const Dict last = load_dict(step_file(*dir, "step", r.steps));
  const Dict rec = load_dict(*dir / "update_bn.pt");
  for (const auto& [key, tensor] : last) {
    if (key.rfind("peer.", 0) != 0) continue;
    INFO(key);
    CHECK(torch::equal(rec.at("before." + key.substr(5)), tensor));
  }
  BnNet model;
  check_update_bn(*dir, model);
  CHECK(model->bn1->num_batches_tracked.item<std::int64_t>() == 4);
  CHECK(model->is_training());
}

}  // namespace test_update_bn
