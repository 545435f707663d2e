// The tensor operations whose spelling depends on the LibTorch version, chosen at compile time
// here and nowhere else: the foreach lerp (LibTorch >= 2.0; 1.13 gets _foreach_mul_ +
// _foreach_add_), the foreach copy (>= 2.1; a copy_ per tensor before), and a read-only data
// pointer that does not materialise a copy-on-write storage (>= 2.1); and the foreach update of
// each Arithmetic, built on them.
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sub.h>
#include <emakit/detail/simd.hpp>
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
#include <cstdint>
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

// Where a tensor's data lies: the memory of its storage and its offset into it (which also fix
// the device: a storage's memory is on one), read inline from the TensorImpl. What the kernel
// records when it plans and compares before each run (on_memory) to find a tensor that moved:
// set_data() to another tensor, a view at another offset, Module::to(). The same memory as
// read_ptr() says, without its checks, which LibTorch 1.13 makes in calls into libc10
// (TensorImpl::data(), has_storage(), and device() for the device: with the averages, 150
// instructions per tensor before 2026-12-07, benchmarks/cost).
struct Memory {
  const void* data = nullptr;  // the storage's; null without storage
  std::int64_t offset = 0;     // in elements
};
[[gnu::always_inline]] inline Memory memory_of(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) return {};
  return {storage->data_ptr().get(), impl->storage_offset()};
}
// Whether t still lies where memory_of() found it (m).
[[gnu::always_inline]] inline bool on_memory(const at::Tensor& t, const Memory& m) {
  const Memory now = memory_of(t);
  return now.data == m.data && now.offset == m.offset;
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

// a[i] = F(a[i], x[i]) for every i (F an Arithmetic, options.hpp), by the ATen ops of the peer
// the arithmetic comes from, so that a CUDA list or a rare CPU dtype rounds as that peer does.
// `x_scratch`: the inputs are the EMA's own staging copies, which the update may overwrite
// (weighted_sum and subtract then need no temporaries; otherwise they allocate one list).
// Arithmetic::lerp and fused_lerp are both ATen's lerp here (which fuses on CUDA and on CPUs with
// FMA): only the fused CPU pass has emakit's two-rounding lerp.
inline void foreach_average(Arithmetic f, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& x, Weights w,
                            bool x_scratch) {
  switch (f) {
    case Arithmetic::lerp:
    case Arithmetic::fused_lerp: foreach_lerp(a, x, w.weight); return;
    case Arithmetic::weighted_sum:  // decay * a + (1 - decay) * x
      at::_foreach_mul_(a, w.decay);
      if (x_scratch) {
        at::_foreach_mul_(x, w.weight);
        at::_foreach_add_(a, x);
      } else {
        at::_foreach_add_(a, at::_foreach_mul(x, w.weight));
      }
      return;
    case Arithmetic::scaled_fused_add:  // _foreach_mul_(a, decay); _foreach_add_(a, x, alpha = 1 - decay)
      at::_foreach_mul_(a, w.decay);
      at::_foreach_add_(a, x, w.weight);
      return;
    case Arithmetic::subtract:  // a -= (1 - decay) * (a - x); with scratch: a += (1 - decay) * (x - a), the same bits
      if (x_scratch) {
        at::_foreach_sub_(x, a);
        at::_foreach_mul_(x, w.weight);
        at::_foreach_add_(a, x);
      } else {
        auto d = at::_foreach_sub(a, x);
        at::_foreach_mul_(d, w.weight);
        at::_foreach_sub_(a, d);
      }
      return;
    case Arithmetic::fused_subtract:  // _foreach_sub_(a, _foreach_sub(a, x), alpha = 1 - decay)
      if (x_scratch) {                // a += (1 - decay) * (x - a) in one FMA, the same bits
        at::_foreach_sub_(x, a);
        at::_foreach_add_(a, x, w.weight);
      } else {
        at::_foreach_sub_(a, at::_foreach_sub(a, x), w.weight);
      }
      return;
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
