// Transparent huge pages for the EMA's own large CPU averages (Linux madvise; a no-op
// elsewhere): the fused pass streams through them with fewer page-table walks.
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Tensor.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstddef>
#include <cstdint>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// CPU averages of 2 MiB and more ask Linux for transparent huge pages: a streaming pass then walks
// the page tables once per 2 MiB instead of once per 4 KiB (docs/performance.md measures it). The
// EMA owns its averages, so it may; the model's tensors are left alone.
inline constexpr std::size_t huge_page_min_bytes = std::size_t{2} << 20;

// Marks the 2 MiB-aligned interior of t's memory MADV_HUGEPAGE (what THP's default 'madvise'
// mode waits for) and collapses the pages already written with MADV_COLLAPSE (Linux >= 6.1; not
// named by glibc < 2.37). Failures are ignored: the pass is correct on pages of any size.
// Only dense CPU tensors with storage qualify: nbytes() throws for sparse ones, and this must not
// throw (the Ema refuses non-strided tensors at bind; this stays safe for any tensor anyway).
inline void advise_huge_pages(const at::Tensor& t) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t huge = std::uintptr_t{1} << 21;
  constexpr int madv_collapse = 25;
  if (!t.defined() || t.layout() != c10::kStrided || !t.is_cpu() || !t.has_storage() ||
      t.nbytes() < huge_page_min_bytes)
    return;
  const auto begin = reinterpret_cast<std::uintptr_t>(t.data_ptr());  // the EMA's own tensor: never copy-on-write
  const std::uintptr_t lo = (begin + huge - 1) & ~(huge - 1);
  const std::uintptr_t hi = (begin + t.nbytes()) & ~(huge - 1);
  if (hi <= lo) return;
  void* p = reinterpret_cast<void*>(lo);
  if (madvise(p, hi - lo, MADV_HUGEPAGE) == 0) (void)madvise(p, hi - lo, madv_collapse);
#else
  (void)t;
#endif
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
