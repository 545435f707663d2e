// The tensor operations whose spelling depends on the LibTorch version, chosen at compile time
// here and nowhere else: the foreach lerp (LibTorch >= 2.0; 1.13 gets _foreach_mul_ +
// _foreach_add_), the foreach copy (>= 2.1; a copy_ per tensor before), and a read-only data
// pointer that does not materialise a copy-on-write storage (>= 2.1).
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <ATen/ops/_foreach_lerp.h>
#define EMAKIT_HAS_FOREACH_LERP 1
#else
#define EMAKIT_HAS_FOREACH_LERP 0
#endif

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#include <ATen/ops/_foreach_copy.h>
#define EMAKIT_HAS_FOREACH_COPY 1
#define EMAKIT_HAS_CONST_DATA_PTR 1
#else
#define EMAKIT_HAS_FOREACH_COPY 0
#define EMAKIT_HAS_CONST_DATA_PTR 0
#endif

#include <cstddef>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// The source's data for reading. LibTorch >= 2.1 has copy-on-write storage, whose data_ptr()
// would materialise a copy (an allocation) of a model tensor that is only read.
inline const void* read_ptr(const at::Tensor& t) {
#if EMAKIT_HAS_CONST_DATA_PTR
  return t.const_data_ptr();
#else
  return t.data_ptr();
#endif
}

// dst[i] = src[i] for every i: one _foreach_copy_ where LibTorch has it, a copy_ per tensor else.
inline void foreach_copy(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
#if EMAKIT_HAS_FOREACH_COPY
  at::_foreach_copy_(dst, src);
#else
  for (std::size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
#endif
}

// a[i] = lerp(a[i], x[i], w) for every i.
inline void foreach_lerp(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& x, double w) {
#if EMAKIT_HAS_FOREACH_LERP
  at::_foreach_lerp_(a, x, w);
#else
  at::_foreach_mul_(a, 1.0 - w);
  at::_foreach_add_(a, x, w);
#endif
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
