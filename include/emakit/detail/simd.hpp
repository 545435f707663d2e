// The element loops of the fused CPU pass: a = lerp(a, x, w) and a = x over one range, written
// so that the compiler vectorises them (`omp simd`), reading a bf16/fp16 source through
// branch-free integer widening (no F16C needed), and the choice of an AVX2 or AVX-512 copy at run time.
// The arithmetic is ATen's lerp: a + w*(x-a) for |w| < 0.5, else x + (w-1)*(x-a), in float for
// float/half/bf16 averages and double for double averages.
#pragma once

#include <emakit/detail/config.hpp>

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
#if defined(__GNUC__) && !defined(__clang__)
#define EMAKIT_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define EMAKIT_NO_CONTRACT
#endif
#if defined(__clang__)
#define EMAKIT_PRAGMA_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define EMAKIT_PRAGMA_NO_CONTRACT
#endif

// Whether the AVX2 copies of the segment loops are built and this CPU can run them.
inline bool use_avx2() noexcept {
#if EMAKIT_AVX2_CLONES
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
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

// a = lerp(a, x, w) over n elements, in ATen's formula, as one pass. Inlined into each segment
// function, so that the AVX2 and AVX-512 copies compile the loop for their instruction set.
template <class A, class S>
EMAKIT_ALWAYS_INLINE void lerp_range(A* __restrict a, const S* __restrict x, std::int64_t n, opmath_t<A> w) noexcept {
  EMAKIT_PRAGMA_NO_CONTRACT  // first in the body: clang takes the pragma only there
      using T = opmath_t<A>;
  using L = Load<S>;
  const auto* __restrict xr = reinterpret_cast<const typename L::raw*>(x);
  if (std::abs(w) < T(0.5)) {
    EMAKIT_SIMD
    for (std::int64_t i = 0; i < n; ++i) {
      const T ai = static_cast<T>(a[i]);
      a[i] = static_cast<A>(ai + w * (L::template at<T>(xr, i) - ai));
    }
  } else {
    const T c = w - T(1);
    EMAKIT_SIMD
    for (std::int64_t i = 0; i < n; ++i) {
      const T xi = L::template at<T>(xr, i);
      a[i] = static_cast<A>(xi + c * (xi - static_cast<T>(a[i])));
    }
  }
}

// lerp_range, and the drift of the result: adds sum((a' - x)^2) and sum(x^2) over the n elements
// (a' the average as stored, in its dtype) to sums[0] and sums[1]. The averages are computed by
// the same expressions as lerp_range's, so they are bitwise the same; the sums are taken in
// opmath_t<A> over chunks of drift_chunk elements (`omp simd` reduces them in vector lanes), each
// chunk's sum added in double: a sum is within drift_chunk + 3 roundings of opmath_t<A> of the
// exact one, relative to it (each term: the difference and the square; then the chunk's sum).
inline constexpr std::int64_t drift_chunk = 1024;
template <class A, class S>
EMAKIT_ALWAYS_INLINE void lerp_drift_range(A* __restrict a, const S* __restrict x, std::int64_t n, opmath_t<A> w,
                                           double* __restrict sums) noexcept {
  EMAKIT_PRAGMA_NO_CONTRACT  // first in the body: clang takes the pragma only there
      using T = opmath_t<A>;
  using L = Load<S>;
  const auto* __restrict xr = reinterpret_cast<const typename L::raw*>(x);
  const bool low = std::abs(w) < T(0.5);
  const T c = w - T(1);
  double dd = 0, xx = 0;
  for (std::int64_t b = 0; b < n; b += drift_chunk) {
    const std::int64_t e = std::min(n, b + drift_chunk);
    T d2 = 0, x2 = 0;
    if (low) {
      EMAKIT_SIMD_REDUCE(d2, x2)
      for (std::int64_t i = b; i < e; ++i) {
        const T ai = static_cast<T>(a[i]);
        const T xi = L::template at<T>(xr, i);
        const A r = static_cast<A>(ai + w * (xi - ai));
        a[i] = r;
        const T d = static_cast<T>(r) - xi;
        d2 += d * d;
        x2 += xi * xi;
      }
    } else {
      EMAKIT_SIMD_REDUCE(d2, x2)
      for (std::int64_t i = b; i < e; ++i) {
        const T xi = L::template at<T>(xr, i);
        const A r = static_cast<A>(xi + c * (xi - static_cast<T>(a[i])));
        a[i] = r;
        const T d = static_cast<T>(r) - xi;
        d2 += d * d;
        x2 += xi * xi;
      }
    }
    dd += static_cast<double>(d2);
    xx += static_cast<double>(x2);
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
