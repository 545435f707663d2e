// The element loops of the fused CPU pass: a = F(a, x) (F an Arithmetic) and a = x over one
// range, written so that the compiler vectorises them (`omp simd`), reading a bf16/fp16 source
// through branch-free integer widening (no F16C needed), and the choice of an AVX2 or AVX-512
// copy at run time. The arithmetic is the EMA's Arithmetic (options.hpp), by default ATen's lerp:
// a + w*(x-a) for
// |w| < 0.5, else x + (w-1)*(x-a), in float for float/half/bf16 averages and double for double ones.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/options.hpp>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// The fused loops are vectorised at any optimisation level: GCC's -O2 cost model refuses loops
// that need a scalar epilogue, and `omp simd` (the target builds with -fopenmp) lifts that.
#if defined(_OPENMP)
#define EMAKIT_SIMD _Pragma("omp simd")
#define EMAKIT_SIMD_REDUCE(a, b) _Pragma(EMAKIT_STRINGIFY(omp simd reduction(+ : a, b)))
#else
#define EMAKIT_SIMD
#define EMAKIT_SIMD_REDUCE(a, b)
#endif
#define EMAKIT_STRINGIFY(x) #x

#if defined(__GNUC__) || defined(__clang__)
#define EMAKIT_ALWAYS_INLINE [[gnu::always_inline]] inline
#else
#define EMAKIT_ALWAYS_INLINE inline
#endif

// x86-64 builds also compile each segment loop for the instruction sets above their baseline
// (the default -march=x86-64 has SSE2 only): AVX2, and AVX-512 (F, BW, VL), and the kernel picks
// the best copy this CPU runs at plan time: widening a bf16 source in cache runs twice as fast
// with AVX2, and AVX-512 moves a cache line per instruction. Every copy rounds identically: no
// FMA, which AVX-512F brings with it and which GCC (any -std) and clang (-ffp-contract=on, its
// default) would otherwise fuse a*b + c into (EMAKIT_NO_CONTRACT below, and the pragma in the
// loops). A build whose baseline already has a set compiles no copy for it.
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX2__)
#define EMAKIT_AVX2_CLONES 1
#else
#define EMAKIT_AVX2_CLONES 0
#endif
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#define EMAKIT_AVX512_CLONES 1
#else
#define EMAKIT_AVX512_CLONES 0
#endif

// GCC contracts a*b + c into an FMA whenever the target has one (-ffp-contract=fast is its
// default for C++ in every -std); this keeps each segment function's arithmetic as written, so
// that all copies, and ATen's lerp, round alike. (clang: the pragma inside the loops.)
// EMAKIT_OPTIMIZE_KERNELS (GCC): the implementation file is compiled at -O1, which generates its
// cold code (checkpoints, interop, post-hoc) a quarter faster than -O2, and the segment functions
// ask for -O2 themselves: the copies through EMAKIT_OPTIMIZE_SEGMENT, the averages through
// EMAKIT_NO_CONTRACT, which then carries both options in its one optimize attribute. At -O1 their
// loops run at half speed on small tensors (cmake/emakit_implementation.cmake sets both;
// docs/performance.md has the figures). The per-tensor work of every update asks for -O2 too
// (UpdateKernel::check_sources_and_replan, the passes' run_share): at -O1 its inline LibTorch
// accessors stay calls (the cost model, benchmarks/cost: many_small).
#if defined(__GNUC__) && !defined(__clang__) && defined(EMAKIT_OPTIMIZE_KERNELS)
#define EMAKIT_OPTIMIZE_SEGMENT __attribute__((optimize("O2")))
#define EMAKIT_NO_CONTRACT __attribute__((optimize("O2", "fp-contract=off")))
#elif defined(__GNUC__) && !defined(__clang__)
#define EMAKIT_OPTIMIZE_SEGMENT
#define EMAKIT_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define EMAKIT_OPTIMIZE_SEGMENT
#define EMAKIT_NO_CONTRACT
#endif
#if defined(__clang__)
#define EMAKIT_PRAGMA_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define EMAKIT_PRAGMA_NO_CONTRACT
#endif

// Whether the AVX2 copies of the segment loops are built and this CPU can run them (AVX2 and FMA,
// which the fused arithmetics use: every CPU with AVX2 that x86-64-v3 names has both).
inline bool use_avx2() noexcept {
#if EMAKIT_AVX2_CLONES
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0;
  }();
  return has;
#else
  return false;
#endif
}

// Whether the AVX-512 copies are built and this CPU (and its OS, which must save the zmm
// registers: __builtin_cpu_supports checks that too) runs them.
inline bool use_avx512() noexcept {
#if EMAKIT_AVX512_CLONES
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bw") != 0 &&
           __builtin_cpu_supports("avx512vl") != 0;
  }();
  return has;
#else
  return false;
#endif
}

template <class A>
using opmath_t = std::conditional_t<std::is_same_v<A, double>, double, float>;

// ---- widening loads that vectorise ---------------------------------------------------------

// bf16 -> fp32 is exact: the 16 bits are the top half of the float.
EMAKIT_ALWAYS_INLINE float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(std::uint32_t{b} << 16);
}

// fp16 -> fp32, exact for every input (normals, subnormals, zeros, infinities, NaN payloads),
// without branches so that the loop around it vectorises on plain SSE2.
EMAKIT_ALWAYS_INLINE float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16;
  const std::uint32_t body = (std::uint32_t{h} & 0x7fffu) << 13;  // exponent and mantissa, float-aligned
  const std::uint32_t exponent = body & 0x0f800000u;
  std::uint32_t bits = body + (112u << 23);                     // rebias 15 -> 127
  bits = exponent == 0x0f800000u ? bits + (112u << 23) : bits;  // inf / NaN: exponent 255
  // Zero and subnormals: 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, computed by the FPU.
  const float subnormal = std::bit_cast<float>(body + (113u << 23)) - std::bit_cast<float>(113u << 23);
  bits = exponent == 0 ? std::bit_cast<std::uint32_t>(subnormal) : bits;
  return std::bit_cast<float>(bits | sign);
}

// The element type a segment reads: bf16/fp16 as their raw bits (c10::BFloat16 and c10::Half are
// standard-layout structs whose only member is the uint16_t), everything else as itself.
template <class S>
struct Load {
  using raw = S;
  template <class T>
  static T at(const raw* p, std::int64_t i) noexcept {
    return static_cast<T>(p[i]);
  }
};
template <>
struct Load<c10::BFloat16> {
  using raw = std::uint16_t;
  template <class T>
  static T at(const raw* p, std::int64_t i) noexcept {
    return static_cast<T>(bf16_bits_to_float(p[i]));
  }
};
template <>
struct Load<c10::Half> {
  using raw = std::uint16_t;
  template <class T>
  static T at(const raw* p, std::int64_t i) noexcept {
    return static_cast<T>(half_bits_to_float(p[i]));
  }
};

// The weights of one update as the decay policy gave them, in double: w = 1 - d and d (a policy
// with a weight of its own, Uniform's exact 1/n, gives w, and d = 1 - w). Each Arithmetic takes
// what its peer takes: the lerps w, the others both.
struct Weights {
  double weight = 0.0;
  double decay = 1.0;
};

// Weights rounded once to the opmath type T, as ATen rounds a Python scalar for a tensor op; c =
// W - 1 and `low` (|W| < 0.5) for the lerps' two forms.
template <class T>
struct OpWeights {
  T w, d, c;
  bool low;
};
template <class A>
EMAKIT_ALWAYS_INLINE OpWeights<opmath_t<A>> op_weights(Weights k) noexcept {
  using T = opmath_t<A>;
  const T w = static_cast<T>(k.weight);
  return {w, static_cast<T>(k.decay), w - T(1), std::abs(w) < T(0.5)};
}

// v rounded to the average's dtype A and back: the result of one ATen op on an A tensor.
template <class A, class T>
EMAKIT_ALWAYS_INLINE T round_to(T v) noexcept {
  return static_cast<T>(static_cast<A>(v));
}

// One averaged element, a' from a and x (both in opmath T), by the arithmetic F (see Arithmetic in
// options.hpp); `Low` selects the lerps' form (OpWeights::low), the others ignore it. Every
// intermediate result is rounded to A as ATen's op would, and nothing is contracted but the
// explicit fma of the fused forms (std::fma: one rounding on every build, an instruction where
// the target has FMA, a libm call on the baseline without it).
template <Arithmetic F, bool Low, class A, class T>
EMAKIT_ALWAYS_INLINE A combine(T a, T x, const OpWeights<T>& k) noexcept {
  EMAKIT_PRAGMA_NO_CONTRACT  // first in the body: clang takes the pragma only there
      const T w = k.w;
  if constexpr (F == Arithmetic::lerp) {
    return Low ? static_cast<A>(a + w * (x - a)) : static_cast<A>(x + k.c * (x - a));
  } else if constexpr (F == Arithmetic::fused_lerp) {
    return Low ? static_cast<A>(std::fma(w, x - a, a)) : static_cast<A>(std::fma(k.c, x - a, x));
  } else if constexpr (F == Arithmetic::weighted_sum) {
    return static_cast<A>(round_to<A>(k.d * a) + round_to<A>(w * x));
  } else if constexpr (F == Arithmetic::scaled_fused_add) {
    return static_cast<A>(std::fma(x, w, round_to<A>(k.d * a)));
  } else if constexpr (F == Arithmetic::subtract) {
    return static_cast<A>(a - round_to<A>(w * round_to<A>(a - x)));
  } else {
    static_assert(F == Arithmetic::fused_subtract);
    return static_cast<A>(std::fma(-w, round_to<A>(a - x), a));
  }
}

// Whether F has the lerps' two forms.
template <Arithmetic F>
inline constexpr bool two_forms = F == Arithmetic::lerp || F == Arithmetic::fused_lerp;

template <Arithmetic F, bool Low, class A, class S>
EMAKIT_ALWAYS_INLINE void average_loop(A* __restrict a, const typename Load<S>::raw* __restrict xr, std::int64_t n,
                                       const OpWeights<opmath_t<A>> k) noexcept {
  using T = opmath_t<A>;
  EMAKIT_SIMD
  for (std::int64_t i = 0; i < n; ++i)
    a[i] = combine<F, Low, A>(static_cast<T>(a[i]), Load<S>::template at<T>(xr, i), k);
}

// a = F(a, x) over n elements, as one pass. Inlined into each segment function, so that the AVX2
// and AVX-512 copies compile the loop for their instruction set.
template <Arithmetic F, class A, class S>
EMAKIT_ALWAYS_INLINE void average_range(A* __restrict a, const S* __restrict x, std::int64_t n, Weights w) noexcept {
  const auto* __restrict xr = reinterpret_cast<const typename Load<S>::raw*>(x);
  const auto k = op_weights<A>(w);
  if (!two_forms<F> || k.low) {
    average_loop<F, true, A, S>(a, xr, n, k);
  } else {
    average_loop<F, false, A, S>(a, xr, n, k);
  }
}

// One chunk of average_drift_range: the averages as average_loop writes them, and the chunk's
// drift sums in opmath, reduced in vector lanes.
template <Arithmetic F, bool Low, class A, class S>
EMAKIT_ALWAYS_INLINE void average_drift_chunk(A* __restrict a, const typename Load<S>::raw* __restrict xr,
                                              std::int64_t b, std::int64_t e, const OpWeights<opmath_t<A>> k,
                                              opmath_t<A>& d2_out, opmath_t<A>& x2_out) noexcept {
  EMAKIT_PRAGMA_NO_CONTRACT  // first in the body: clang takes the pragma only there
      using T = opmath_t<A>;
  T d2 = 0, x2 = 0;
  EMAKIT_SIMD_REDUCE(d2, x2)
  for (std::int64_t i = b; i < e; ++i) {
    const T xi = Load<S>::template at<T>(xr, i);
    const A r = combine<F, Low, A>(static_cast<T>(a[i]), xi, k);
    a[i] = r;
    const T d = static_cast<T>(r) - xi;
    d2 += d * d;
    x2 += xi * xi;
  }
  d2_out = d2;
  x2_out = x2;
}

// average_range, and the drift of the result, per chunk of drift_chunk elements: chunk k (elements
// [k * drift_chunk, (k + 1) * drift_chunk) of the n) stores sum((a' - x)^2) in partials[2k] and
// sum(x^2) in partials[2k + 1] (a' the average as stored, in its dtype). The averages are computed
// by the same combine() as average_range's, so they are bitwise the same; each chunk's sums are
// taken in opmath_t<A> (`omp simd` reduces them in vector lanes): within drift_chunk + 3 roundings
// of opmath_t<A> of the exact ones, relative to them (each term: the difference and the square;
// then the chunk's sum). A chunk's sums depend only on its elements and where they lie, never on
// how a pass cut the tensor between threads or blocks (the cuts fall on chunk boundaries): the
// caller adds the chunks up in order (fold_drift_chunks).
inline constexpr std::int64_t drift_chunk = 1024;
constexpr std::int64_t drift_chunk_count(std::int64_t n) noexcept { return (n + drift_chunk - 1) / drift_chunk; }
template <Arithmetic F, class A, class S>
EMAKIT_ALWAYS_INLINE void average_drift_range(A* __restrict a, const S* __restrict x, std::int64_t n, Weights w,
                                              double* __restrict partials) noexcept {
  using T = opmath_t<A>;
  const auto* __restrict xr = reinterpret_cast<const typename Load<S>::raw*>(x);
  const auto k = op_weights<A>(w);
  const bool low = !two_forms<F> || k.low;
  for (std::int64_t b = 0; b < n; b += drift_chunk) {
    const std::int64_t e = std::min(n, b + drift_chunk);
    T d2 = 0, x2 = 0;
    if (low) {
      average_drift_chunk<F, true, A, S>(a, xr, b, e, k, d2, x2);
    } else {
      average_drift_chunk<F, false, A, S>(a, xr, b, e, k, d2, x2);
    }
    partials[2 * (b / drift_chunk)] = static_cast<double>(d2);
    partials[2 * (b / drift_chunk) + 1] = static_cast<double>(x2);
  }
}

// The drift sums of one tensor from its chunks' (average_drift_range): added in chunk order, so
// the same chunks give the same sums however the pass was cut.
inline void fold_drift_chunks(const double* partials, std::int64_t chunks, double* sums) noexcept {
  double dd = 0, xx = 0;
  for (std::int64_t k = 0; k < chunks; ++k) {
    dd += partials[2 * k];
    xx += partials[2 * k + 1];
  }
  sums[0] += dd;
  sums[1] += xx;
}

// a = x over n elements (a conversion when the dtypes differ).
template <class A, class S>
EMAKIT_ALWAYS_INLINE void copy_range(A* __restrict a, const S* __restrict x, std::int64_t n) noexcept {
  if constexpr (std::is_same_v<A, S>) {
    std::memcpy(a, x, static_cast<std::size_t>(n) * sizeof(A));
  } else {
    using L = Load<S>;
    const auto* __restrict xr = reinterpret_cast<const typename L::raw*>(x);
    EMAKIT_SIMD
    for (std::int64_t i = 0; i < n; ++i) a[i] = static_cast<A>(L::template at<opmath_t<A>>(xr, i));
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
