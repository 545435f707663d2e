// A TorchScript model (torch::jit::Module) as the source of an Ema: its parameters and buffers
// by their state-dict names. Separate from the umbrella header: it brings in the JIT headers.
//
//   torch::jit::Module model = torch::jit::load("model.pt");
//   emakit::WarmupEma ema(emakit::tensors_of(model));
//   // ... train the model's parameters ...
//   ema.update();
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/ema.hpp>

#include <torch/csrc/jit/api/module.h>

#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

inline std::vector<SourceTensor> tensors_of(const torch::jit::Module& model) {
  std::vector<SourceTensor> out;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) out.push_back({p.name, p.value, false});
  for (const auto& b : model.named_buffers(/*recurse=*/true)) out.push_back({b.name, b.value, true});
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
