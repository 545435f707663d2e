// The non-template definitions of cpu_pass.hpp: included at the end of cpu_pass.hpp in header-only mode,
// compiled once into the emakit library (src/emakit.cpp) in compiled mode (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/cpu_pass-inl.hpp holds definitions that the emakit library compiles in compiled mode (EMAKIT_COMPILED): include <emakit/detail/cpu_pass.hpp> instead"
#endif

#include <emakit/detail/cpu_pass.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void CpuPass::add(SegmentFn fn, std::size_t slot, std::int64_t n, std::int64_t cost,
                              const at::Tensor* average, const at::Tensor* input) {
  if (n == 0) return;
  segments_.push_back(Segment{fn, slot, n, cost, total_, average, input});
  total_ += n * cost;
}

EMAKIT_FUNC void CpuPass::run(double weight, std::int64_t grain) const {
  if (segments_.empty()) return;
  at::parallel_for(0, total_, grain, [&](std::int64_t begin, std::int64_t end) { run_share(begin, end, weight); });
}

EMAKIT_FUNC void CpuPass::run_share(std::int64_t c0, std::int64_t c1, double weight) const {
  auto it = std::upper_bound(segments_.begin(), segments_.end(), c0,
                             [](std::int64_t c, const Segment& s) { return c < s.begin; });
  if (it != segments_.begin()) --it;
  for (; it != segments_.end() && it->begin < c1; ++it) {
    const std::int64_t lo = element_at(*it, c0);
    const std::int64_t hi = element_at(*it, c1);
    if (lo >= hi) continue;
    void* a = it->average != nullptr ? it->average->data_ptr() : it->a;
    const void* x = it->input != nullptr ? read_ptr(*it->input) : it->x;
    it->fn(a, x, lo, hi, weight);
  }
}

EMAKIT_FUNC std::int64_t CpuPass::element_at(const Segment& s, std::int64_t c) noexcept {
  if (c <= s.begin) return 0;
  const std::int64_t e = (c - s.begin + s.cost - 1) / s.cost;
  const std::int64_t aligned = (e + align_elements - 1) / align_elements * align_elements;
  return std::min(s.n, aligned);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
