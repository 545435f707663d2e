// The references of the benchmarks: what a hand-written fused EMA loop over the same buffers
// costs, per instruction set, and ATen's foreach update. emakit_bench_ema_update times them (its roofline cases) and
// the cost model (benchmarks/cost/cost_model.cpp) counts them, so both compare emakit with one loop.
#pragma once

#include <emakit/detail/simd.hpp>
#include <emakit/detail/update_kernel.hpp>
#include <emakit/state.hpp>

#include <algorithm>
#include <memory>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace emakit_bench {

// One tensor's buffers: its average (fp32) and the model's tensor (fp32, or bf16 as uint16).
struct Span {
  float* a;
  const void* x;
  std::int64_t n;
};

inline float widen(const float* x, std::int64_t i) { return x[i]; }
inline float widen(const std::uint16_t* x, std::int64_t i) {
  std::uint32_t bits = std::uint32_t{x[i]} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <class S, bool Average>
[[gnu::always_inline]] inline void plain_loop(float* __restrict a, const S* __restrict x, std::int64_t n, float w) {
  if constexpr (Average) {
#pragma omp simd
    for (std::int64_t i = 0; i < n; ++i) a[i] = a[i] + w * (widen(x, i) - a[i]);
  } else {
#pragma omp simd
    for (std::int64_t i = 0; i < n; ++i) a[i] = widen(x, i);
  }
}

// The roofline is the best of several plain loops, one per instruction set this CPU runs (the
// build's baseline, and on x86-64 copies for AVX2 and AVX-512, as emakit's segments have), and
// of ATen's own ops on the same buffers: each is a case of its own (roofline_<isa>), and
// report.py takes the fastest of them and of aten_lerp / aten_copy / aten_foreach for that row.
// The cost model (benchmarks/cost/) counts the same loops.
template <class S>
using PlainLoop = void (*)(float*, const S*, std::int64_t, float);

template <class S, bool Average>
void plain_loop_baseline(float* a, const S* x, std::int64_t n, float w) {
  plain_loop<S, Average>(a, x, n, w);
}
#if EMAKIT_AVX2_CLONES
template <class S, bool Average>
__attribute__((target("avx2"))) void plain_loop_avx2(float* a, const S* x, std::int64_t n, float w) {
  plain_loop<S, Average>(a, x, n, w);
}
#endif
#if EMAKIT_AVX512_CLONES
template <class S, bool Average>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void plain_loop_avx512(float* a, const S* x, std::int64_t n,
                                                                            float w) {
  plain_loop<S, Average>(a, x, n, w);
}
#endif

// The instruction sets with a plain loop that this CPU runs, by the name of their case: those
// emakit builds copies of its segment loops for and picks (detail/simd.hpp).
inline std::vector<std::string> roofline_isas() {
  std::vector<std::string> out = {"baseline"};
  if (emakit::detail::use_avx2()) out.push_back("avx2");
  if (emakit::detail::use_avx512()) out.push_back("avx512");
  return out;
}

template <class S, bool Average>
PlainLoop<S> plain_loop_for(const std::string& isa) {
#if EMAKIT_AVX2_CLONES
  if (isa == "avx2") return &plain_loop_avx2<S, Average>;
#endif
#if EMAKIT_AVX512_CLONES
  if (isa == "avx512") return &plain_loop_avx512<S, Average>;
#endif
  return &plain_loop_baseline<S, Average>;
}

// The calling OpenMP thread's contiguous share [begin, end) of `total` elements.
inline std::pair<std::int64_t, std::int64_t> thread_share(std::int64_t total) {
#if defined(_OPENMP)
  const std::int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
  const std::int64_t t = 0, nt = 1;
#endif
  return {total * t / nt, total * (t + 1) / nt};
}

// Each thread takes one contiguous share of the concatenated elements.
template <class S>
void roofline(PlainLoop<S> loop, const std::vector<Span>& spans, std::int64_t total, int threads, float w) {
#pragma omp parallel num_threads(threads)
  {
    const auto [begin, end] = thread_share(total);
    std::int64_t offset = 0;
    for (const auto& s : spans) {
      const std::int64_t lo = std::max(begin, offset), hi = std::min(end, offset + s.n);
      if (lo < hi) loop(s.a + (lo - offset), static_cast<const S*>(s.x) + (lo - offset), hi - lo, w);
      offset += s.n;
      if (offset >= end) break;
    }
  }
}

// K averages of one model in one pass: each block of the model is read once, then lerped into
// every average while it is in cache. A block holds 32 KB of the group's traffic (the rule of
// emakit's GroupPass, detail/cpu_pass-inl.hpp): with 2048-element blocks four fp32 averages no
// longer fit a 32 KB L1, and the loop took 19.3 ms against 18.2 with 672 (16M fp32, K = 4, 1
// thread, 2026-12-03; the same at 2 threads): a roofline below what a plain loop reaches.
template <class S>
void group_roofline(PlainLoop<S> loop, const std::vector<std::vector<Span>>& members, std::int64_t total, int threads,
                    float w) {
  const auto per_element = static_cast<std::int64_t>(members.size() * (sizeof(S) + 2 * sizeof(float)));
  const std::int64_t block = std::clamp<std::int64_t>(32 * 1024 / per_element / 16 * 16, 256, 2048);
#pragma omp parallel num_threads(threads)
  {
    const auto [begin, end] = thread_share(total);
    std::int64_t offset = 0;
    for (std::size_t i = 0; i < members.front().size(); ++i) {
      const std::int64_t n = members.front()[i].n;
      const std::int64_t lo = std::max(begin, offset), hi = std::min(end, offset + n);
      for (std::int64_t b = lo; b < hi; b += block) {
        const std::int64_t e = std::min(hi, b + block);
        for (const auto& m : members)
          loop(m[i].a + (b - offset), static_cast<const S*>(m[i].x) + (b - offset), e - b, w);
      }
      offset += n;
      if (offset >= end) break;
    }
  }
}

// ATen's foreach update on the same buffers: emakit's device path (UpdateKernel's foreach CPU
// path: _foreach_lerp_ on LibTorch >= 2, _foreach_mul_ + _foreach_add_ on 1.13) over the model's
// tensors and the given averages.
inline std::unique_ptr<emakit::detail::UpdateKernel> foreach_reference(const std::vector<emakit::SourceTensor>& model,
                                                                       const std::vector<at::Tensor>& averages) {
  std::vector<emakit::detail::Slot> slots;
  for (std::size_t i = 0; i < averages.size(); ++i) {
    emakit::detail::Slot s;
    s.name = model[i].name;
    s.average = averages[i];
    s.source = model[i].tensor;
    slots.push_back(std::move(s));
  }
  return std::make_unique<emakit::detail::UpdateKernel>(std::move(slots),
                                                        emakit::detail::UpdateKernel::CpuPath::foreach);
}

}  // namespace emakit_bench
