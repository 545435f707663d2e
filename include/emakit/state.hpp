// emakit's vocabulary for state: the types that an Ema, its storage, its checkpoints, the trainer
// hooks and the post-hoc tools exchange. A leaf header (LibTorch's tensor and ordered dict,
// nothing of emakit but its configuration and the concepts), so that every layer, detail/
// included, can name them without including the Ema.
//
//   StateDict     name -> tensor, the layout of Ema::state_dict() and of the averages (declared
//                 in concepts.hpp, which names it without LibTorch's headers)
//   LoadMode      strict (any mismatch is an error, nothing loads) or lenient (reported, kept)
//   LoadReport    what a load found besides the tensors it loaded
//   SourceTensor  a tensor to average, for an Ema bound to tensors rather than a module
//   TensorSpec    one tensor a storage policy makes the EMA's copy of
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>  // StateDict

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <string>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

enum class LoadMode : std::uint8_t {
  strict,   // any missing, unexpected or mismatched tensor is an error and nothing is loaded
  lenient,  // such tensors are reported (and warned about) and keep their current values
};

// What load_state_dict() found besides the tensors it loaded.
struct LoadReport {
  std::vector<std::string> missing;     // keys this EMA has and the state lacks
  std::vector<std::string> unexpected;  // keys the state has and this EMA lacks
  std::vector<std::string> mismatched;  // "key: why" for shape or dtype mismatches
  bool clean() const noexcept { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

// A tensor to average, for an Ema bound to tensors rather than a module (a TorchScript model,
// a hand-made list). `is_buffer` decides whether EmaOptions::buffers applies to it.
struct SourceTensor {
  std::string name;
  at::Tensor tensor;
  bool is_buffer = false;
};

// One tensor a storage policy must hold a copy of (StoragePolicy, concepts.hpp).
struct TensorSpec {
  std::string name;       // state-dict name, e.g. "encoder.0.weight"
  at::Tensor source;      // the model's tensor
  c10::ScalarType dtype;  // the dtype the EMA keeps it in
  c10::Device device;     // the device the EMA keeps it on
  // Other names of the same tensor in the model (a tied weight): the storage holds one tensor
  // for all of them; a module-backed storage makes its module's tensors of these names that one.
  std::vector<std::string> aliases = {};
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
