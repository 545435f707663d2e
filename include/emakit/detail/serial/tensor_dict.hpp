// Name -> tensor dictionaries inside archives: how every emakit archive stores a set of named
// tensors (a state, its checksums, a shard's layout).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/input-archive.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// A name -> tensor dictionary for an archive; `copy`: the archive keeps copies, unchanged when
// training goes on (else it refers to the tensors themselves, fine for an immediate save).
inline c10::IValue tensor_dict(const std::vector<std::pair<std::string, at::Tensor>>& items, bool copy = true) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [k, t] : items) dict.insert(k, copy ? t.detach().clone() : t);
  return c10::IValue(dict);
}

// The dictionary of tensor_dict() under `key`; nullopt when the archive has no such key.
inline std::optional<std::vector<std::pair<std::string, at::Tensor>>> read_tensor_dict(
    torch::serialize::InputArchive& archive, const std::string& key, const std::string& where) {
  c10::IValue value;
  if (!archive.try_read(key, value)) return std::nullopt;
  if (!value.isGenericDict()) fail("{}: '{}' is not a dictionary of tensors; the checkpoint is damaged", where, key);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor())
      fail("{}: '{}' holds a non-tensor entry; the checkpoint is damaged", where, key);
    out.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return out;
}

// The same items as a state dict, for StateReader. A name given twice is an error.
inline torch::OrderedDict<std::string, at::Tensor> as_state(
    const std::vector<std::pair<std::string, at::Tensor>>& items, const std::string& where) {
  torch::OrderedDict<std::string, at::Tensor> state;
  for (const auto& [k, t] : items) {
    if (state.contains(k)) fail("{}: '{}' appears twice; the checkpoint is damaged", where, k);
    state.insert(k, t);
  }
  return state;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
