// The definitions of detail/module_tensors.hpp: included at the end of
// module_tensors.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/module_tensors-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/module_tensors.hpp> instead"
#endif

#include <emakit/detail/module_tensors.hpp>

#include <cstring>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC std::vector<SourceTensor> collect(const torch::nn::Module& model) {
  std::vector<SourceTensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) out.push_back({item.key(), item.value(), false});
  for (const auto& item : model.named_buffers(/*recurse=*/true)) out.push_back({item.key(), item.value(), true});
  return out;
}

EMAKIT_FUNC std::unordered_map<std::string, at::Tensor> tensors_by_name(const torch::nn::Module& model) {
  std::unordered_map<std::string, at::Tensor> out;
  for (auto& t : collect(model)) out.emplace(std::move(t.name), std::move(t.tensor));
  return out;
}

EMAKIT_FUNC bool same_view(const at::Tensor& a, const at::Tensor& b) {
  if (a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl()) return true;
  return a.has_storage() && b.has_storage() && a.storage().is_alias_of(b.storage()) &&
         a.storage_offset() == b.storage_offset() && a.scalar_type() == b.scalar_type() &&
         a.sizes().equals(b.sizes()) && a.strides().equals(b.strides());
}

EMAKIT_FUNC std::pair<std::int64_t, std::int64_t> byte_extent(const at::Tensor& t) {
  std::int64_t last = t.storage_offset();
  for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto item = static_cast<std::int64_t>(t.element_size());
  return {t.storage_offset() * item, (last + 1) * item};
}

EMAKIT_FUNC bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (!a.has_storage() || !b.has_storage() || a.numel() == 0 || b.numel() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto [a0, a1] = byte_extent(a);
  const auto [b0, b1] = byte_extent(b);
  return a0 < b1 && b0 < a1;
}

EMAKIT_FUNC std::vector<std::size_t> first_same_view(std::span<const at::Tensor> tensors) {
  std::vector<std::size_t> first(tensors.size());
  std::unordered_map<const void*, std::vector<std::size_t>> by_memory;  // storage (or impl) -> firsts
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    first[i] = i;
    const at::Tensor& t = tensors[i];
    const void* key = t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl())
                                      : static_cast<const void*>(t.unsafeGetTensorImpl());
    auto& seen = by_memory[key];
    for (const std::size_t j : seen) {
      if (same_view(tensors[j], t)) {
        first[i] = j;
        break;
      }
    }
    if (first[i] == i) seen.push_back(i);
  }
  return first;
}

EMAKIT_FUNC bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  const at::Tensor x = a.detach().cpu().contiguous();
  const at::Tensor y = b.detach().cpu().contiguous();
  // memcmp's pointers must not be null, even for 0 bytes: an empty tensor may have none.
  return x.nbytes() == y.nbytes() && (x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
