// The free-running conformance tests' model and synthetic trajectory: _free_run.py's, in C++ (the
// definition is there). The model's tensors at step k are a function of (tensor number t in
// state_dict() order, flat element i, k), computed with integer arithmetic only, so Python and C++
// write the same bits without recording them; test_free_running.cpp checks Python's recorded
// steps 0, 1 and kTotal against this function.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/utils.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace emakit_free_run {

// Every free run's last step (_free_run.TOTAL): at least 1000 averaging updates for every peer.
inline constexpr std::int64_t kTotal = 1011;

constexpr std::uint64_t splitmix64(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
// SplitMix64's published first output for the state 0 (Vigna's splitmix64.c, Java's SplittableRandom).
static_assert(splitmix64(0) == 0xe220a8397b1dcdafULL);

// Element i of tensor number t at step k (k = 0: the model a peer is made from).
constexpr float synthetic_value(std::uint64_t t, std::uint64_t i, std::uint64_t k) noexcept {
  const auto base = static_cast<std::int64_t>(splitmix64((t << 20) | i) >> 41) - (std::int64_t{1} << 22);
  const auto noise =
      static_cast<std::int64_t>(splitmix64(((k + 1) << 32) | (t << 20) | i) >> 43) - (std::int64_t{1} << 20);
  return static_cast<float>(static_cast<double>(base + noise) * 0x1p-24);  // |base + noise| < 2^23: exact
}

// _free_run.FreeNet: a Linear(9, 4) and a BatchNorm1d(4), under the same names.
struct FreeNetImpl : torch::nn::Module {
  torch::nn::Linear lin{register_module("lin", torch::nn::Linear(9, 4))};
  torch::nn::BatchNorm1d bn{register_module("bn", torch::nn::BatchNorm1d(4))};
};
TORCH_MODULE(FreeNet);

// One entry of the module's state dict: its number t, its name, the tensor itself.
struct Entry {
  std::int64_t t;
  std::string name;
  at::Tensor tensor;
};

// The module's tensors in Python's state_dict() order: the modules in pre-order, each one's own
// parameters, then its own buffers (LibTorch's named_parameters() would list every parameter
// before every buffer).
inline std::vector<Entry> state_dict_entries(torch::nn::Module& model) {
  std::vector<Entry> out;
  std::int64_t t = 0;
  for (const auto& item : model.named_modules()) {
    const std::string prefix = item.key().empty() ? std::string() : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false))
      out.push_back({t++, prefix + p.key(), p.value()});
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false))
      out.push_back({t++, prefix + b.key(), b.value()});
  }
  return out;
}

// Tensor number t's values at step k, in the shape `sizes` (float32).
inline at::Tensor synthetic_tensor(std::int64_t t, at::IntArrayRef sizes, std::int64_t k) {
  at::Tensor out = at::empty(sizes, at::kFloat);
  float* data = out.data_ptr<float>();
  for (std::int64_t i = 0; i < out.numel(); ++i)
    data[i] =
        synthetic_value(static_cast<std::uint64_t>(t), static_cast<std::uint64_t>(i), static_cast<std::uint64_t>(k));
  return out;
}

// Writes step k's values into every floating tensor of the model (integer ones keep theirs).
inline void write_step(torch::nn::Module& model, std::int64_t k) {
  torch::NoGradGuard no_grad;
  for (auto& e : state_dict_entries(model)) {
    if (!e.tensor.is_floating_point()) continue;
    if (e.tensor.scalar_type() != at::kFloat) throw std::invalid_argument("free_run: " + e.name + " is not float32");
    e.tensor.copy_(synthetic_tensor(e.t, e.tensor.sizes(), k));
  }
}

}  // namespace emakit_free_run
