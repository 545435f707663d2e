// The update kernel: the one place where averaged tensors change.
//
// Planned once at bind time (and again only if a source tensor moves device, changes dtype,
// stops being contiguous or gets new memory), then each update:
//   - CPU averages: one fused pass over every CPU tensor of the EMA at once. The tensors are laid
//     end to end as segments, weighted by the bytes each element moves (12 for fp32 <- fp32, 10
//     for fp32 <- bf16, ...), and at::parallel_for splits that line into one equal share per
//     thread, cutting tensors where it falls: one parallel region per update, balanced for one
//     huge tensor and for thousands of small ones. Each segment is a vectorised loop (`omp simd`)
//     that reads the source in its own dtype (bf16/fp16 model into an fp32 average: the 16 bits
//     are widened with integer shifts, so the loop vectorises without F16C), with no temporaries.
//     The arithmetic is ATen's lerp: a + w*(x-a) for w < 0.5, else x + (w-1)*(x-a), in float for
//     float/half/bf16 averages and double for double averages. Copied tensors (integer buffers,
//     copy-only names) are segments of the same pass (memcpy), and copy() is one such pass too.
//     Averages of 2 MiB and more are backed by transparent huge pages where Linux allows.
//   - other devices: foreach lists, one per (device, dtype, stream). Sources in the average's
//     dtype are averaged in place: one torch::_foreach_lerp_ per list (LibTorch >= 2.0) or
//     _foreach_mul_ + _foreach_add_ (LibTorch 1.13, which lacks it). Sources in another dtype
//     (a bf16 model with an fp32 average), not contiguous or on another device go through a
//     bounded staging pool instead of a full-size copy: their tensors are cut into pieces that
//     fill the pool chunk by chunk, and each chunk is one _foreach_copy_ (LibTorch >= 2.1; it
//     converts dtypes on its CUDA fast path in current LibTorch, older ones take its per-tensor
//     path) into the pool and one _foreach_lerp_ from it. The pool holds at most
//     max(staging_bytes, the largest piece) bytes; a piece is a flat range of a contiguous source,
//     or rows (dim 0) of a strided one. Copied tensors are one _foreach_copy_ per list.
//   - the side stream (EmaOptions::side_stream): a CUDA device's work on parameters runs on a
//     stream of its own that first waits for the current stream (the optimizer step). Buffers
//     (Slot::buffer: BatchNorm statistics, written by the next forward pass) stay on the current
//     stream, so only the next optimizer step has to wait (wait_sources()). Every read of the
//     averages goes through settle() (slots() calls it), see detail/device_sync.hpp.
//   - CPU offload (CUDA model, CPU average): each source is copied into a pinned staging tensor
//     in its own dtype when the pass reads it (a bf16 model moves half the bytes over PCIe), with
//     non-blocking copies the host waits for once. With the side stream as well, the CPU pass runs
//     on a host thread after the copies land, so update() returns at once; wait_sources() orders
//     the device after the copies only, settle() joins the host pass too.
// An update allocates nothing and looks up no names (a skip_non_finite check allocates a few
// scalars: one flag per foreach list, reduced on the device, read with one host sync).
#pragma once

#include <emakit/detail/check.hpp>
#include <emakit/detail/device_sync.hpp>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <c10/core/GradMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
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
#else
#define EMAKIT_HAS_FOREACH_COPY 0
#endif

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace emakit::detail {

// The fused loops are vectorised at any optimisation level: GCC's -O2 cost model refuses loops
// that need a scalar epilogue, and `omp simd` (the target builds with -fopenmp) lifts that.
#if defined(_OPENMP)
#define EMAKIT_SIMD _Pragma("omp simd")
#else
#define EMAKIT_SIMD
#endif

#if defined(__GNUC__) || defined(__clang__)
#define EMAKIT_ALWAYS_INLINE [[gnu::always_inline]] inline
#else
#define EMAKIT_ALWAYS_INLINE inline
#endif

// x86-64 builds for a baseline below AVX2 (the default -march=x86-64 has SSE2 only) also compile
// each segment loop for AVX2, and the kernel picks that copy at plan time when the CPU has it:
// widening a bf16 source in cache runs twice as fast. No FMA: both copies round identically.
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX2__)
#define EMAKIT_AVX2_CLONES 1
#else
#define EMAKIT_AVX2_CLONES 0
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

template <class A>
using opmath_t = std::conditional_t<std::is_same_v<A, double>, double, float>;

// ---- widening loads that vectorise ---------------------------------------------------------

// bf16 -> fp32 is exact: the 16 bits are the top half of the float.
EMAKIT_ALWAYS_INLINE float bf16_bits_to_float(std::uint16_t b) noexcept { return std::bit_cast<float>(std::uint32_t{b} << 16); }

// fp16 -> fp32, exact for every input (normals, subnormals, zeros, infinities, NaN payloads),
// without branches so that the loop around it vectorises on plain SSE2.
EMAKIT_ALWAYS_INLINE float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (std::uint32_t{h} & 0x8000u) << 16;
  const std::uint32_t body = (std::uint32_t{h} & 0x7fffu) << 13;  // exponent and mantissa, float-aligned
  const std::uint32_t exponent = body & 0x0f800000u;
  std::uint32_t bits = body + (112u << 23);                        // rebias 15 -> 127
  bits = exponent == 0x0f800000u ? bits + (112u << 23) : bits;     // inf / NaN: exponent 255
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
  static T at(const raw* p, std::int64_t i) noexcept { return static_cast<T>(p[i]); }
};
template <>
struct Load<c10::BFloat16> {
  using raw = std::uint16_t;
  template <class T>
  static T at(const raw* p, std::int64_t i) noexcept { return static_cast<T>(bf16_bits_to_float(p[i])); }
};
template <>
struct Load<c10::Half> {
  using raw = std::uint16_t;
  template <class T>
  static T at(const raw* p, std::int64_t i) noexcept { return static_cast<T>(half_bits_to_float(p[i])); }
};

// a = lerp(a, x, w) over n elements, in ATen's formula, as one pass. Inlined into each segment
// function, so that the AVX2 copies compile the loop for AVX2.
template <class A, class S>
EMAKIT_ALWAYS_INLINE void lerp_range(A* __restrict a, const S* __restrict x, std::int64_t n, opmath_t<A> w) noexcept {
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

// Which (average dtype, source dtype) pairs the fused CPU pass reads directly.
inline bool fused_pair(c10::ScalarType a, c10::ScalarType s) {
  using c10::ScalarType;
  switch (a) {
    case ScalarType::Float: return s == ScalarType::Float || s == ScalarType::BFloat16 || s == ScalarType::Half;
    case ScalarType::Double: return s == ScalarType::Double || s == ScalarType::Float;
    case ScalarType::BFloat16: return s == ScalarType::BFloat16;
    case ScalarType::Half: return s == ScalarType::Half;
    default: return false;
  }
}

// Calls f(A*, S*) typed for a fused pair.
template <class F>
void dispatch_pair(c10::ScalarType a, c10::ScalarType s, F&& f) {
  using c10::ScalarType;
  if (a == ScalarType::Float) {
    if (s == ScalarType::Float) return f(static_cast<float*>(nullptr), static_cast<const float*>(nullptr));
    if (s == ScalarType::BFloat16) return f(static_cast<float*>(nullptr), static_cast<const c10::BFloat16*>(nullptr));
    if (s == ScalarType::Half) return f(static_cast<float*>(nullptr), static_cast<const c10::Half*>(nullptr));
  } else if (a == ScalarType::Double) {
    if (s == ScalarType::Double) return f(static_cast<double*>(nullptr), static_cast<const double*>(nullptr));
    if (s == ScalarType::Float) return f(static_cast<double*>(nullptr), static_cast<const float*>(nullptr));
  } else if (a == ScalarType::BFloat16 && s == ScalarType::BFloat16) {
    return f(static_cast<c10::BFloat16*>(nullptr), static_cast<const c10::BFloat16*>(nullptr));
  } else if (a == ScalarType::Half && s == ScalarType::Half) {
    return f(static_cast<c10::Half*>(nullptr), static_cast<const c10::Half*>(nullptr));
  }
  fail("internal: no fused CPU pass for {} from {}", c10::toString(a), c10::toString(s));
}

// ---- the fused CPU pass ----------------------------------------------------------------------

// The source's data for reading. LibTorch >= 2.1 has copy-on-write storage, whose data_ptr()
// would materialise a copy (an allocation) of a model tensor that is only read.
inline const void* read_ptr(const at::Tensor& t) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return t.const_data_ptr();
#else
  return t.data_ptr();
#endif
}

// Work on one tensor: fn(a, x, begin, end, weight) over elements [begin, end).
using SegmentFn = void (*)(void*, const void*, std::int64_t, std::int64_t, double) noexcept;

template <class A, class S>
void lerp_segment(void* a, const void* x, std::int64_t begin, std::int64_t end, double w) noexcept {
  lerp_range<A, S>(static_cast<A*>(a) + begin, static_cast<const S*>(x) + begin, end - begin,
                   static_cast<opmath_t<A>>(w));
}

template <class A, class S>
void copy_segment(void* a, const void* x, std::int64_t begin, std::int64_t end, double) noexcept {
  copy_range<A, S>(static_cast<A*>(a) + begin, static_cast<const S*>(x) + begin, end - begin);
}

#if EMAKIT_AVX2_CLONES
template <class A, class S>
__attribute__((target("avx2"))) void lerp_segment_avx2(void* a, const void* x, std::int64_t begin, std::int64_t end,
                                                       double w) noexcept {
  lerp_range<A, S>(static_cast<A*>(a) + begin, static_cast<const S*>(x) + begin, end - begin,
                   static_cast<opmath_t<A>>(w));
}

template <class A, class S>
__attribute__((target("avx2"))) void copy_segment_avx2(void* a, const void* x, std::int64_t begin, std::int64_t end,
                                                       double) noexcept {
  copy_range<A, S>(static_cast<A*>(a) + begin, static_cast<const S*>(x) + begin, end - begin);
}
#endif

// The segment functions of a fused pair, for the best ISA this CPU runs.
template <class A, class S>
std::pair<SegmentFn, SegmentFn> segment_fns() noexcept {
#if EMAKIT_AVX2_CLONES
  if (use_avx2()) return {&lerp_segment_avx2<A, S>, &copy_segment_avx2<A, S>};
#endif
  return {&lerp_segment<A, S>, &copy_segment<A, S>};
}

// Same-dtype copy of any element type, as bytes (element size E).
template <std::size_t E>
void byte_copy_segment(void* a, const void* x, std::int64_t begin, std::int64_t end, double) noexcept {
  std::memcpy(static_cast<char*>(a) + begin * static_cast<std::int64_t>(E),
              static_cast<const char*>(x) + begin * static_cast<std::int64_t>(E),
              static_cast<std::size_t>(end - begin) * E);
}

inline SegmentFn byte_copy_fn(std::size_t element_size) {
  switch (element_size) {
    case 1: return &byte_copy_segment<1>;
    case 2: return &byte_copy_segment<2>;
    case 4: return &byte_copy_segment<4>;
    case 8: return &byte_copy_segment<8>;
    case 16: return &byte_copy_segment<16>;
    default: return nullptr;
  }
}

// The CPU tensors of one update laid end to end. `cost` is bytes moved per element; a thread's
// share is a range of the summed cost, mapped back to element ranges of the segments it covers.
class CpuPass {
 public:
  // Elements per cut: shares start on multiples of this (64 bytes of fp32), so that two threads
  // write the same cache line at most once per cut.
  static constexpr std::int64_t align_elements = 16;

  struct Segment {
    SegmentFn fn;
    std::size_t slot;        // index into the kernel's slots
    std::int64_t n;          // elements
    std::int64_t cost;       // bytes moved per element
    std::int64_t begin = 0;  // first cost unit (prefix sum)
    // The tensors whose data the segment reads and writes: each thread takes the data pointers
    // of the segments it runs, so that refreshing them is parallel too. Without tensors (tests),
    // the raw pointers a and x are used.
    const at::Tensor* average = nullptr;
    const at::Tensor* input = nullptr;
    void* a = nullptr;
    const void* x = nullptr;
  };

  void clear() {
    segments_.clear();
    total_ = 0;
  }
  void add(SegmentFn fn, std::size_t slot, std::int64_t n, std::int64_t cost, const at::Tensor* average = nullptr,
           const at::Tensor* input = nullptr) {
    if (n == 0) return;
    segments_.push_back(Segment{fn, slot, n, cost, total_, average, input});
    total_ += n * cost;
  }
  bool empty() const noexcept { return segments_.empty(); }
  std::int64_t total_cost() const noexcept { return total_; }
  std::vector<Segment>& segments() noexcept { return segments_; }

  // Runs every segment, split over at::parallel_for's threads; below `grain` cost units it runs
  // on the calling thread (a parallel region costs a few microseconds).
  void run(double weight, std::int64_t grain) const {
    if (segments_.empty()) return;
    at::parallel_for(0, total_, grain, [&](std::int64_t begin, std::int64_t end) { run_share(begin, end, weight); });
  }

  // The segments' work between cost units [c0, c1).
  void run_share(std::int64_t c0, std::int64_t c1, double weight) const {
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

 private:
  // The first element of `s` at or after cost unit c, rounded up to align_elements: the same
  // function on both sides of a cut, so shares never overlap and never leave a gap.
  static std::int64_t element_at(const Segment& s, std::int64_t c) noexcept {
    if (c <= s.begin) return 0;
    const std::int64_t e = (c - s.begin + s.cost - 1) / s.cost;
    const std::int64_t aligned = (e + align_elements - 1) / align_elements * align_elements;
    return std::min(s.n, aligned);
  }

  std::vector<Segment> segments_;
  std::int64_t total_ = 0;
};

// CPU averages of 2 MiB and more ask Linux for transparent huge pages: a streaming pass then walks the page
// tables once per 2 MiB instead of once per 4 KiB (measured here: +12-18% bandwidth for the fused
// loop). The EMA owns its averages, so it may; the model's tensors are left alone.
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

// ---- slots and the kernel --------------------------------------------------------------------

// One averaged or copied tensor pair.
struct Slot {
  std::string name;
  at::Tensor average;   // the EMA's tensor
  at::Tensor source;    // the model's tensor (a handle: follows Module::to())
  bool averaged = true; // false: copied, not averaged
  bool follows_averages = true;  // for a copied slot: false = written by copy() only (ema-pytorch's
                                 // ignored names, which its copies still write)
  bool buffer = false;  // a forward pass may write it in place (BatchNorm statistics): with a side
                        // stream it is read on the current stream, before the next forward
  // Bound at plan time; a change of any of these makes the next update re-plan.
  c10::Device source_device{c10::kCPU};
  c10::ScalarType source_dtype{c10::ScalarType::Undefined};
  bool source_contiguous = true;
  const void* source_memory = nullptr;   // where the data starts: the plan holds views of it, which a
  const void* average_memory = nullptr;  // set_data() of the tensor would leave on the old memory
  std::vector<std::int64_t> shape;  // a change of shape is an error, not a re-plan
  at::Tensor staging;   // CPU averages: defined when the source must be copied before the pass reads it
  bool huge_pages_advised = false;  // advise_huge_pages() ran on the average (once per slot)
  const at::Tensor& input() const noexcept { return staging.defined() ? staging : source; }
};

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

// How often this thread went through the kernel's two doors, settle() and wait_sources(): tests
// check with it that every accessor of the averages settles.
struct SyncCounts {
  std::uint64_t settles = 0;
  std::uint64_t waits = 0;
};
inline SyncCounts& sync_counts() noexcept {
  thread_local SyncCounts counts;
  return counts;
}

class UpdateKernel {
 public:
  // The parallel grain of the CPU pass, in elements of fp32 <- fp32 (12 bytes each): below it an
  // update runs on one thread.
  static constexpr std::int64_t chunk_elements = std::int64_t{1} << 15;
  // The default bound of a staging pool (EmaOptions::staging_bytes).
  static constexpr std::int64_t default_staging_bytes = std::int64_t{64} << 20;
  // Staging pieces start on multiples of this many elements (256 bytes of fp32): the foreach
  // kernels' vectorised loads need aligned addresses.
  static constexpr std::int64_t staging_align = 64;

  // How CPU averages are updated: the fused pass, or the foreach lists used on other devices
  // (chosen by tests and benchmarks, which exercise the device path on a machine without a GPU).
  enum class CpuPath : std::uint8_t { fused, foreach };

  UpdateKernel() = default;
  // side_stream: run the work of each CUDA device on a side stream (see the top of this file).
  // staging_bytes: the bound of each staging pool.
  explicit UpdateKernel(std::vector<Slot> slots, CpuPath cpu_path = CpuPath::fused, bool side_stream = false,
                        std::int64_t staging_bytes = default_staging_bytes)
      : slots_(std::move(slots)), cpu_path_(cpu_path), side_stream_(side_stream), staging_bytes_(staging_bytes) {
    if (staging_bytes_ < 1) fail("the staging bound must be at least 1 byte, got {}", staging_bytes_);
    for (auto& s : slots_) s.shape.assign(s.source.sizes().begin(), s.source.sizes().end());
    plan();
  }
  // Moves settle pending side-stream or host work first: it refers to the tensors being moved.
  UpdateKernel(UpdateKernel&& other) noexcept { *this = std::move(other); }
  UpdateKernel& operator=(UpdateKernel&& other) noexcept {
    if (this == &other) return *this;
    settle_noexcept();
    other.settle_noexcept();
    slots_ = std::move(other.slots_);
    cpu_path_ = other.cpu_path_;
    side_stream_ = other.side_stream_;
    staging_bytes_ = other.staging_bytes_;
    pool_bytes_ = other.pool_bytes_;
    average_pass_ = std::move(other.average_pass_);
    copy_pass_ = std::move(other.copy_pass_);
    lists_ = std::move(other.lists_);
    staged_ = std::move(other.staged_);
    generic_ = std::move(other.generic_);
    generic_copies_ = std::move(other.generic_copies_);
    lanes_ = std::move(other.lanes_);
    offload_lanes_ = std::move(other.offload_lanes_);
    finite_checks_[0] = std::move(other.finite_checks_[0]);
    finite_checks_[1] = std::move(other.finite_checks_[1]);
    return *this;
  }
  UpdateKernel(const UpdateKernel&) = delete;
  UpdateKernel& operator=(const UpdateKernel&) = delete;
  // Pending side-stream work writes tensors this kernel holds: the current stream waits for it
  // before they can be freed and reused.
  ~UpdateKernel() { settle_noexcept(); }

  // The slots, after settle(): whatever reads or writes the averages through them is ordered
  // after the last update. This is the one door to the averages.
  const std::vector<Slot>& slots() const {
    settle();
    return slots_;
  }
  std::vector<Slot>& slots() {
    settle();
    return slots_;
  }
  std::size_t size() const noexcept { return slots_.size(); }
  const std::string& name(std::size_t i) const { return slots_.at(i).name; }

  bool side_stream() const noexcept { return side_stream_; }
  // Bytes of the staging pools (the bounded conversion area of the foreach path).
  std::int64_t pool_bytes() const noexcept { return pool_bytes_; }
  // Foreach lists of the last plan by kind, for tests: lerp (sources read in place), staged
  // (chunks through a pool), copy.
  struct Census {
    std::size_t lerp = 0, staged = 0, copy = 0;
  };
  Census census() const noexcept {
    Census c;
    for (const auto& l : lists_) (l.kind == ListKind::lerp ? c.lerp : l.kind == ListKind::staged ? c.staged : c.copy) += 1;
    return c;
  }

  // What must finish before anything writes what the last update reads, i.e. before the next
  // optimizer step writes the model: each CUDA device's current stream waits for its side
  // stream (asynchronous for the host). An offloaded update's host pass is not waited for: it
  // reads pinned copies, which the side stream has made by then. A no-op without a side stream.
  void wait_sources() const {
    sync_counts().waits += 1;
    for (auto& lane : lanes_) lane.wait();
  }

  // Everything of the last update has finished: joins the host pass of an offloaded update
  // (rethrowing its error) and orders each device's current stream after the side stream. Every
  // read or write of the averages goes through it (slots()).
  void settle() const {
    sync_counts().settles += 1;
    join_host();
    wait_sources();
  }

  // Throws if a source changed shape since bind; re-plans if one moved, changed dtype or got new
  // memory. Returns true when it re-planned.
  bool check_sources() {
    bool stale = false;
    for (const auto& s : slots_) {
      if (!s.source.defined())
        fail("tensor '{}' of the model is no longer defined; make a new Ema for the changed model", s.name);
      if (!s.source.sizes().equals(s.shape))
        fail("tensor '{}' changed shape from {} to {} since the EMA was bound; make a new Ema for the changed model",
             s.name, shape_string(s.shape), shape_string(s.source.sizes()));
      stale = stale || s.source.device() != s.source_device || s.source.scalar_type() != s.source_dtype ||
              s.source.is_contiguous() != s.source_contiguous || read_ptr(s.source) != s.source_memory ||
              read_ptr(s.average) != s.average_memory;
    }
    if (stale) {
      settle();
      plan();
    }
    return stale;
  }

  // ema = lerp(ema, model, weight) for averaged slots; copy for the copied ones.
  void average(double weight) { run(/*averaging=*/true, weight); }

  // ema = model for every slot.
  void copy() { run(/*averaging=*/false, 1.0); }

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  // The first slot, in slot order, whose source the next update reads (copying: every slot;
  // averaging: averaged slots and copies that follow averages) and that holds a NaN or an
  // infinity; npos if none. Call after check_sources(): the groups are those of the last plan.
  // Sources on a device (or every source, on the foreach CPU path) are checked together: one
  // _foreach_norm(inf) per (device, dtype), a max-abs that cannot overflow, reduced to one flag on
  // the device and read with one host sync. CPU sources of the fused path are scanned on the
  // host. Only when something is found are the per-tensor flags read (one more sync per group),
  // to name the first.
  std::size_t first_non_finite(bool copying) const {
    const FiniteChecks& checks = finite_checks_[copying ? 1 : 0];
    std::size_t first = npos;  // of the host-scanned sources
    for (const std::size_t i : checks.scanned)
      if (!all_finite(slots_[i].source)) {
        first = i;
        break;
      }
    if (checks.groups.empty()) return first;
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> finite;  // per group, per source
    at::Tensor all;                  // every source of every group is finite
    for (const auto& g : checks.groups) {
      finite.push_back(at::stack(at::_foreach_norm(g.sources, std::numeric_limits<double>::infinity())).isfinite());
      const at::Tensor f = finite.back().all();
      all = all.defined() ? all.logical_and(f.to(all.device())) : f;
    }
    if (all.item<bool>()) return first;
    for (std::size_t k = 0; k < checks.groups.size(); ++k) {
      const at::Tensor flags = finite[k].to(at::kCPU);
      const bool* ok = flags.data_ptr<bool>();
      const auto& slots = checks.groups[k].slots;
      for (std::size_t j = 0; j < slots.size(); ++j)
        if (!ok[j]) {
          first = std::min(first, slots[j]);
          break;
        }
    }
    return first;
  }

 private:
  // A foreach list: tensors of one device and dtype, updated by one foreach call on one stream.
  enum class ListKind : std::uint8_t {
    lerp,    // averages = lerp(averages, inputs): inputs are the sources
    staged,  // one chunk: inputs (views of a staging pool) = sources, then the lerp from inputs
    copy,    // averages = inputs (the sources)
  };
  struct List {
    ListKind kind;
    c10::Device device{c10::kCPU};
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::size_t lane = npos;        // the lane whose stream runs it (npos: no lane)
    bool current = false;           // on the current stream even with a side stream (buffers)
    bool follows_averages = true;   // copy lists: also written by averaging updates
    std::vector<at::Tensor> averages;
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> sources;  // staged lists only
  };

  // What first_non_finite() reads, planned: sources scanned on the host, and the others grouped by
  // (device, dtype) for one _foreach_norm each.
  struct FiniteGroup {
    c10::Device device;
    c10::ScalarType dtype;
    std::vector<at::Tensor> sources;
    std::vector<std::size_t> slots;
  };
  struct FiniteChecks {
    std::vector<std::size_t> scanned;
    std::vector<FiniteGroup> groups;
  };

  // finite_checks_[0] for averaging updates, [1] for copies.
  void plan_finite_checks() {
    for (int copying = 0; copying < 2; ++copying) {
      FiniteChecks& checks = finite_checks_[copying];
      checks = FiniteChecks{};
      for (std::size_t i = 0; i < slots_.size(); ++i) {
        const Slot& s = slots_[i];
        const auto type = s.source.scalar_type();
        const bool read = (copying == 1 || s.averaged || s.follows_averages) && s.source.numel() > 0 &&
                          (c10::isFloatingType(type) || c10::isComplexType(type));
        if (!read) continue;
        if (s.source.is_cpu() && cpu_path_ == CpuPath::fused) {
          checks.scanned.push_back(i);
          continue;
        }
        auto g = std::find_if(checks.groups.begin(), checks.groups.end(), [&](const FiniteGroup& x) {
          return x.device == s.source.device() && x.dtype == type;
        });
        if (g == checks.groups.end()) g = checks.groups.insert(checks.groups.end(), FiniteGroup{s.source.device(), type, {}, {}});
        g->sources.push_back(s.source);
        g->slots.push_back(i);
      }
    }
  }

  void run(bool averaging, double weight) {
    c10::NoGradGuard no_grad;
    join_host();  // the previous offloaded pass must finish before this one touches its buffers
    for (std::size_t k = 0; k < lanes_.size(); ++k) {
      run_lists(averaging, weight, k, /*current=*/true);  // buffers, before the side stream starts
      Lane& lane = lanes_[k];
      auto guard = lane.begin();
      run_lists(averaging, weight, k, /*current=*/false);
      lane.finish();
    }
    run_lists(averaging, weight, npos, /*current=*/true);  // CPU foreach path, devices without streams
    run_lists(averaging, weight, npos, /*current=*/false);
    if (offload_lanes_.empty()) {
      run_cpu(averaging, weight);
    } else if (side_stream_) {
      // The host waits for the device-to-host copies on a thread of its own, then runs the pass.
      host_ = std::async(std::launch::async, [this, averaging, weight] {
        c10::NoGradGuard no_grad_here;
        for (auto k : offload_lanes_) lanes_[k].synchronize_host();
        run_cpu(averaging, weight);
      });
    } else {
      for (auto k : offload_lanes_) lanes_[k].synchronize_host();
      run_cpu(averaging, weight);
    }
  }

  // On the current stream (current = true) or the lane's stream: offload staging copies and the
  // foreach lists of lane k (npos: of no lane).
  void run_lists(bool averaging, double weight, std::size_t k, bool current) {
    for (auto i : staged_) {
      Slot& s = slots_[i];
      if (lane_of(s) == k && on_current(s) == current) stage_copy(s);
    }
    for (auto& l : lists_) {
      if (l.lane != k || l.current != current) continue;
      switch (l.kind) {
        case ListKind::lerp:
          if (averaging) {
            foreach_lerp(l.averages, l.inputs, weight);
          } else {
            foreach_copy(l.averages, l.inputs);
          }
          break;
        case ListKind::staged:
          if (averaging) {
            foreach_copy(l.inputs, l.sources);
            foreach_lerp(l.averages, l.inputs, weight);
          } else {
            foreach_copy(l.averages, l.sources);  // copy_ converts: the pool is not needed
          }
          break;
        case ListKind::copy:
          if (!averaging || l.follows_averages) foreach_copy(l.averages, l.inputs);
          break;
      }
    }
  }

  void run_cpu(bool averaging, double weight) {
    (averaging ? average_pass_ : copy_pass_).run(weight, chunk_elements * 12);
    if (averaging) {
      for (auto i : generic_) slots_[i].average.lerp_(slots_[i].input(), weight);
      for (auto i : generic_copies_)
        if (slots_[i].follows_averages) slots_[i].average.copy_(slots_[i].input());
    } else {
      for (auto i : generic_) slots_[i].average.copy_(slots_[i].input());
      for (auto i : generic_copies_) slots_[i].average.copy_(slots_[i].input());
    }
  }

  void stage_copy(Slot& s) {
    // Non-blocking only into pinned memory: the host waits for the lane before reading it.
    const bool non_blocking = s.staging.is_cpu() && s.source.is_cuda() && s.staging.is_pinned();
    s.staging.copy_(s.source, non_blocking);
  }

  void join_host() const {
    if (host_.valid()) host_.get();  // rethrows an error of the host pass
  }
  void settle_noexcept() const noexcept {
    try {
      settle();
    } catch (...) {  // a failed pass was already reported by update(), or cannot be anymore
    }
  }

  bool on_current(const Slot& s) const noexcept { return side_stream_ && s.buffer; }

  // The lane of a device (npos: none; only CUDA devices have lanes).
  std::size_t lane_of(c10::Device dev) const {
    for (std::size_t k = 0; k < lanes_.size(); ++k)
      if (lanes_[k].device() == dev) return k;
    return npos;
  }
  // The lane a slot's work runs on: the CUDA device of its average, else of its source, if any.
  std::size_t lane_of(const Slot& s) const {
    return lane_of(s.average.is_cuda() ? s.average.device() : s.source.device());
  }

  std::size_t lane_for(c10::Device dev) {
    for (std::size_t k = 0; k < lanes_.size(); ++k)
      if (lanes_[k].device() == dev) return k;
    lanes_.emplace_back(dev, side_stream_);
    return lanes_.size() - 1;
  }

  List& list_for(ListKind kind, const Slot& s, bool follows_averages = true) {
    const auto dev = s.average.device();
    const auto type = s.average.scalar_type();
    const std::size_t k = lane_of(s);
    const bool current = on_current(s);
    for (auto& l : lists_)
      if (l.kind == kind && l.device == dev && l.dtype == type && l.lane == k && l.current == current &&
          l.follows_averages == follows_averages)
        return l;
    lists_.push_back(List{kind, dev, type, k, current, follows_averages, {}, {}, {}});
    return lists_.back();
  }

  void plan() {
    average_pass_.clear();
    copy_pass_.clear();
    lists_.clear();
    staged_.clear();
    generic_.clear();
    generic_copies_.clear();
    lanes_.clear();
    offload_lanes_.clear();
    pool_bytes_ = 0;
    std::vector<std::size_t> to_stage;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      s.source_device = s.source.device();
      s.source_dtype = s.source.scalar_type();
      s.source_contiguous = s.source.is_contiguous();
      s.source_memory = read_ptr(s.source);
      s.average_memory = read_ptr(s.average);
      s.staging = at::Tensor();
      const auto a_dev = s.average.device();
      if (a_dev.is_cuda()) lane_for(a_dev);
      if (s.source_device.is_cuda() && !a_dev.is_cuda()) {
        const std::size_t k = lane_for(s.source_device);
        if (std::find(offload_lanes_.begin(), offload_lanes_.end(), k) == offload_lanes_.end())
          offload_lanes_.push_back(k);
      }
    }
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (s.average.device().is_cpu() && (cpu_path_ == CpuPath::fused || !s.averaged)) {
        plan_cpu_slot(i);
      } else if (!s.averaged) {
        List& l = list_for(ListKind::copy, s, s.follows_averages);
        l.averages.push_back(s.average);
        l.inputs.push_back(s.source);
      } else if (s.source_device == s.average.device() && s.source_contiguous &&
                 s.source_dtype == s.average.scalar_type()) {
        List& l = list_for(ListKind::lerp, s);
        l.averages.push_back(s.average);
        l.inputs.push_back(s.source);
      } else if (s.average.numel() > 0) {
        to_stage.push_back(i);
      }
    }
    plan_staging(to_stage);
    plan_finite_checks();
  }

  // Averaged slots whose sources the foreach lerp cannot read in place, by (device, dtype,
  // stream) of the average: cut into pieces that fill a pool of the bound chunk by chunk, each
  // chunk a staged list. A piece is a flat range when source and average are contiguous, else a
  // range of rows (dim 0); the pool grows past the bound only to hold the largest row.
  void plan_staging(const std::vector<std::size_t>& to_stage) {
    std::vector<bool> done(to_stage.size(), false);
    for (std::size_t first = 0; first < to_stage.size(); ++first) {
      if (done[first]) continue;
      const Slot& head = slots_[to_stage[first]];
      std::vector<std::size_t> group;  // the slots sharing head's pool
      for (std::size_t j = first; j < to_stage.size(); ++j) {
        const Slot& s = slots_[to_stage[j]];
        if (!done[j] && s.average.device() == head.average.device() &&
            s.average.scalar_type() == head.average.scalar_type() && lane_of(s) == lane_of(head) &&
            on_current(s) == on_current(head)) {
          group.push_back(to_stage[j]);
          done[j] = true;
        }
      }
      plan_pool(group);
    }
  }

  static bool flat_pieces(const Slot& s) { return s.source_contiguous && s.average.is_contiguous(); }
  static std::int64_t row_elements(const Slot& s) { return s.average.numel() / s.average.size(0); }
  static std::int64_t align_up(std::int64_t n) { return (n + staging_align - 1) / staging_align * staging_align; }

  void plan_pool(const std::vector<std::size_t>& group) {
    const Slot& head = slots_[group.front()];
    const auto esize = static_cast<std::int64_t>(head.average.element_size());
    std::int64_t capacity = std::max<std::int64_t>(1, staging_bytes_ / esize);
    for (auto i : group)
      if (!flat_pieces(slots_[i])) capacity = std::max(capacity, row_elements(slots_[i]));
    // Pieces: (slot, first element or row, count, offset in the pool, chunk).
    struct Piece {
      std::size_t slot;
      std::int64_t begin, count, offset;
      std::size_t chunk;
    };
    std::vector<Piece> pieces;
    std::size_t chunk = 0;
    std::int64_t offset = 0, used = 0;
    for (auto i : group) {
      const Slot& s = slots_[i];
      const bool flat = flat_pieces(s);
      const std::int64_t unit = flat ? 1 : row_elements(s);
      const std::int64_t units = flat ? s.average.numel() : s.average.size(0);
      for (std::int64_t b = 0; b < units;) {
        if ((capacity - offset) / unit <= 0) {  // the chunk is full: the next one reuses the pool
          chunk += 1;
          offset = 0;
        }
        const std::int64_t n = std::min(units - b, (capacity - offset) / unit);
        pieces.push_back(Piece{i, b, n, offset, chunk});
        used = std::max(used, offset + n * unit);
        offset = align_up(offset + n * unit);
        b += n;
      }
    }
    const at::Tensor pool = at::empty({used}, head.average.options());
    pool_bytes_ += static_cast<std::int64_t>(pool.nbytes());
    List* list = nullptr;
    std::size_t list_chunk = npos;
    for (const auto& p : pieces) {
      const Slot& s = slots_[p.slot];
      if (p.chunk != list_chunk) {
        lists_.push_back(List{ListKind::staged, s.average.device(), s.average.scalar_type(), lane_of(s),
                              on_current(s), true, {}, {}, {}});
        list = &lists_.back();
        list_chunk = p.chunk;
      }
      at::Tensor avg, src;
      if (flat_pieces(s)) {
        avg = s.average.view({-1}).narrow(0, p.begin, p.count);
        src = s.source.view({-1}).narrow(0, p.begin, p.count);
      } else {
        avg = s.average.narrow(0, p.begin, p.count);
        src = s.source.narrow(0, p.begin, p.count);
      }
      list->averages.push_back(avg);
      list->sources.push_back(src);
      list->inputs.push_back(pool.narrow(0, p.offset, avg.numel()).view(avg.sizes()));
    }
  }

  // A CPU average: a segment of the fused passes when the pass can read its input (the source
  // itself, or a staging copy of it), else ATen's own lerp_/copy_ (complex and rare dtypes).
  void plan_cpu_slot(std::size_t i) {
    Slot& s = slots_[i];
    if (!s.huge_pages_advised) {
      advise_huge_pages(s.average);
      s.huge_pages_advised = true;
    }
    const auto a_type = s.average.scalar_type();
    const bool offload = s.source_device.is_cuda();
    const bool readable = s.source_device.is_cpu() && s.source_contiguous;
    // The dtype the pass will read: the source's own when the pair is fused (so an offloaded bf16
    // model crosses PCIe in bf16), else the average's.
    c10::ScalarType in_type = s.source_dtype;
    const bool pair = s.averaged ? fused_pair(a_type, in_type) : (in_type == a_type || fused_pair(a_type, in_type));
    if (!pair) in_type = a_type;
    if (!readable || in_type != s.source_dtype) stage(i, in_type, /*pinned=*/offload);
    const std::int64_t n = s.average.numel();
    const std::int64_t cost = static_cast<std::int64_t>(s.average.element_size() * 2 + c10::elementSize(in_type));
    const std::int64_t copy_cost = static_cast<std::int64_t>(s.average.element_size() + c10::elementSize(in_type));
    SegmentFn lerp = nullptr, copy = nullptr;
    if (fused_pair(a_type, in_type)) {
      dispatch_pair(a_type, in_type, [&](auto* a_tag, auto* s_tag) {
        using A = std::remove_pointer_t<decltype(a_tag)>;
        using S = std::remove_const_t<std::remove_pointer_t<decltype(s_tag)>>;
        std::tie(lerp, copy) = segment_fns<A, S>();
      });
    } else if (in_type == a_type) {
      copy = byte_copy_fn(s.average.element_size());
    }
    // Addresses of the slot's tensors: stable, slots_ is not resized after planning (and a move
    // of the kernel moves the vector's buffer, not the slots).
    const at::Tensor* average = &s.average;
    const at::Tensor* input = &s.input();
    if (s.averaged) {
      if (lerp != nullptr) {
        average_pass_.add(lerp, i, n, cost, average, input);
        copy_pass_.add(copy, i, n, copy_cost, average, input);
      } else {
        generic_.push_back(i);
      }
    } else if (copy != nullptr) {
      if (s.follows_averages) average_pass_.add(copy, i, n, copy_cost, average, input);
      copy_pass_.add(copy, i, n, copy_cost, average, input);
    } else {
      generic_copies_.push_back(i);
    }
  }

  // A full-size staging copy of one source, for a CPU average (pinned for offload).
  void stage(std::size_t i, c10::ScalarType dtype, bool pinned) {
    Slot& s = slots_[i];
    auto options = s.average.options().dtype(dtype);
    if (pinned) options = options.pinned_memory(true);
    s.staging = at::empty(s.source.sizes(), options);
    staged_.push_back(i);
  }

  std::vector<Slot> slots_;
  CpuPath cpu_path_ = CpuPath::fused;
  bool side_stream_ = false;
  std::int64_t staging_bytes_ = default_staging_bytes;
  std::int64_t pool_bytes_ = 0;
  CpuPass average_pass_;
  CpuPass copy_pass_;
  std::vector<List> lists_;                  // the foreach path, in plan order
  std::vector<std::size_t> staged_;          // CPU averages read from a staging copy
  std::vector<std::size_t> generic_;         // CPU averages the pass cannot read: lerp_ / copy_
  std::vector<std::size_t> generic_copies_;  // CPU copied slots the pass cannot copy: copy_
  mutable std::vector<Lane> lanes_;          // one per CUDA device the update touches
  std::vector<std::size_t> offload_lanes_;   // lanes whose device-to-host copies the CPU pass reads
  mutable std::future<void> host_;           // the CPU pass of an offloaded side-stream update
  FiniteChecks finite_checks_[2];            // see first_non_finite()
};

}  // namespace emakit::detail
