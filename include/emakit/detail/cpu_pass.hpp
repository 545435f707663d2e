// The fused CPU pass: every CPU tensor of an update in one parallel region. The tensors are laid
// end to end as segments, weighted by the bytes each element moves (12 for fp32 <- fp32, 10 for
// fp32 <- bf16, ...), and at::parallel_for splits that line into one equal share per thread,
// cutting tensors where it falls: balanced for one huge tensor and for thousands of small ones.
// Each segment runs one of the loops of detail/simd.hpp, typed for its (average, source) dtypes;
// copied tensors are segments too (memcpy). No temporaries, no allocation.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/aten_compat.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/simd.hpp>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

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

// Work on one tensor: fn(a, x, begin, end, weights, drift) over elements [begin, end). An average
// given `drift` (not null) also stores the drift sums of what it wrote, two per drift_chunk
// elements from `begin`, in drift[0], drift[1], ... (average_drift_range); copies ignore it.
using SegmentFn = void (*)(void*, const void*, std::int64_t, std::int64_t, Weights, double*) noexcept;

// The segment functions, once per instruction set: average_segment<F, A, S> (F an Arithmetic) /
// copy_segment<A, S> for the build's baseline, and the _avx2 and _avx512 copies where
// detail/simd.hpp builds them; average_segment_for<A, S>(f) picks F at plan time.
#define EMAKIT_SEGMENT_FNS(suffix, target)                                                                             \
  template <Arithmetic F, class A, class S>                                                                            \
  __attribute__((noinline)) target EMAKIT_NO_CONTRACT void average_drift_segment##suffix(                              \
      void* a, const void* x, std::int64_t begin, std::int64_t end, Weights w, double* drift) noexcept {               \
    average_drift_range<F, A, S>(static_cast<A*>(a) + begin, static_cast<const S*>(x) + begin, end - begin, w, drift); \
  }                                                                                                                    \
  template <Arithmetic F, class A, class S>                                                                            \
  target EMAKIT_NO_CONTRACT void average_segment##suffix(void* a, const void* x, std::int64_t begin, std::int64_t end, \
                                                         Weights w, double* drift) noexcept {                          \
    if (drift != nullptr) return average_drift_segment##suffix<F, A, S>(a, x, begin, end, w, drift);                   \
    average_range<F, A, S>(static_cast<A*>(a) + begin, static_cast<const S*>(x) + begin, end - begin, w);              \
  }                                                                                                                    \
  template <class A, class S>                                                                                          \
  target EMAKIT_OPTIMIZE_SEGMENT void copy_segment##suffix(void* a, const void* x, std::int64_t begin,                 \
                                                           std::int64_t end, Weights, double*) noexcept {              \
    copy_range<A, S>(static_cast<A*>(a) + begin, static_cast<const S*>(x) + begin, end - begin);                       \
  }                                                                                                                    \
  template <class A, class S>                                                                                          \
  SegmentFn average_segment_for##suffix(Arithmetic f) noexcept {                                                       \
    switch (f) {                                                                                                       \
      case Arithmetic::lerp: return &average_segment##suffix<Arithmetic::lerp, A, S>;                                  \
      case Arithmetic::fused_lerp: return &average_segment##suffix<Arithmetic::fused_lerp, A, S>;                      \
      case Arithmetic::weighted_sum: return &average_segment##suffix<Arithmetic::weighted_sum, A, S>;                  \
      case Arithmetic::scaled_fused_add: return &average_segment##suffix<Arithmetic::scaled_fused_add, A, S>;          \
      case Arithmetic::subtract: return &average_segment##suffix<Arithmetic::subtract, A, S>;                          \
      case Arithmetic::fused_subtract: return &average_segment##suffix<Arithmetic::fused_subtract, A, S>;              \
    }                                                                                                                  \
    return nullptr;                                                                                                    \
  }

EMAKIT_SEGMENT_FNS(, )
#if EMAKIT_AVX2_CLONES
EMAKIT_SEGMENT_FNS(_avx2, __attribute__((target("avx2,fma"))))
#endif
#if EMAKIT_AVX512_CLONES
EMAKIT_SEGMENT_FNS(_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
#endif
#undef EMAKIT_SEGMENT_FNS

// The segment functions of a fused pair (the average's, for the arithmetic f, and the copy's), for
// the best instruction set this CPU runs.
template <class A, class S>
std::pair<SegmentFn, SegmentFn> segment_fns(Arithmetic f = Arithmetic::lerp) noexcept {
#if EMAKIT_AVX512_CLONES
  if (use_avx512()) return {average_segment_for_avx512<A, S>(f), &copy_segment_avx512<A, S>};
#endif
#if EMAKIT_AVX2_CLONES
  if (use_avx2()) return {average_segment_for_avx2<A, S>(f), &copy_segment_avx2<A, S>};
#endif
  return {average_segment_for<A, S>(f), &copy_segment<A, S>};
}

// Same-dtype copy of any element type, as bytes (element size E).
template <std::size_t E>
void byte_copy_segment(void* a, const void* x, std::int64_t begin, std::int64_t end, Weights, double*) noexcept {
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
  // Elements per cut: shares start on multiples of this within a segment, a whole drift chunk
  // (average_drift_range), so that a chunk's drift sums are one thread's and the same however the
  // pass is cut (and two threads never write one cache line).
  static constexpr std::int64_t align_elements = drift_chunk;

  struct Segment {
    SegmentFn fn;
    std::size_t slot;        // index into the kernel's slots
    std::int64_t n;          // elements
    std::int64_t cost;       // bytes moved per element
    std::int64_t begin = 0;  // first cost unit (prefix sum)
    std::int64_t chunk = 0;  // its first drift chunk among the pass's (prefix sum of drift_chunk_count(n))
    // The data the segment writes and reads, taken when the plan is made: UpdateKernel runs a
    // pass only after check_sources_and_replan() found every tensor on the memory it was planned
    // on (or re-planned). Reading each tensor's data pointer in the pass instead costs small
    // tensors measurably (docs/performance.md).
    void* a = nullptr;
    const void* x = nullptr;
  };

  void add(SegmentFn fn, std::size_t slot, std::int64_t n, std::int64_t cost, void* a = nullptr,
           const void* x = nullptr);
  bool empty() const noexcept { return segments_.empty(); }
  // Changes whenever the segments do (add), unique across every pass of the process: what
  // a GroupPass built from this pass checks before it reuses its grouping.
  std::uint64_t generation() const noexcept { return generation_; }
  std::int64_t total_cost() const noexcept { return total_; }
  // The drift chunks of all segments: the size of run()'s `drift` is twice this.
  std::int64_t drift_chunks() const noexcept { return chunks_; }
  std::vector<Segment>& segments() noexcept { return segments_; }
  const std::vector<Segment>& segments() const noexcept { return segments_; }

  // Runs every segment, split over at::parallel_for's threads; below `grain` cost units it runs
  // on the calling thread (a parallel region costs a few microseconds).
  // (Compiled with emakit::base's OpenMP flags wherever it is compiled, the implementation file or,
  // with EMAKIT_HEADER_ONLY, every translation unit: at::parallel_for's `#pragma omp parallel` is
  // expanded where this is compiled.)
  // `drift` (null: not measured): two sums per drift chunk (average_drift_range), those of segment
  // s from drift[2 * s.chunk]; fold_drift_chunks() adds up a segment's. Each chunk is written by
  // the one thread whose share holds it, so the sums do not depend on the threads.
  void run(Weights weights, std::int64_t grain, double* drift = nullptr) const;

  // The segments' work between cost units [c0, c1).
  void run_share(std::int64_t c0, std::int64_t c1, Weights weights, double* drift = nullptr) const;

  // The first element at or after cost unit c of n elements of `cost` units each that start at
  // cost unit `begin` (a segment, or GroupPass's group), rounded up to align_elements: the same
  // function on both sides of a cut, so shares never overlap and never leave a gap.
  static std::int64_t element_at(std::int64_t begin, std::int64_t cost, std::int64_t n, std::int64_t c) noexcept;

 private:
  static std::uint64_t next_generation() noexcept {
    static std::atomic<std::uint64_t> counter{0};
    return ++counter;
  }

  std::vector<Segment> segments_;
  std::int64_t total_ = 0;
  std::int64_t chunks_ = 0;
  std::uint64_t generation_ = next_generation();
};

// Several CPU passes over the tensors of one model, as one (update_together): the segments of
// every pass that read the same input tensor form a group, and a thread runs its share of a group
// in blocks, each block through every segment of the group in turn, so the input is read from
// memory once and from cache by the others. A block is sized to the group: `block_bytes` of
// traffic (12 bytes per fp32 element and member), so that the input and the members' averages of
// one block stay in L1 together (2048 elements for one fp32 EMA, 672 for four; with 2048 for four,
// 40 KB, the input falls out of a 32 KB L1: docs/performance.md measures it). Each element is
// computed by the segment function and weight of its own pass, independently of where blocks and
// shares are cut: bitwise the result of running the passes one after another. So are the drift
// sums: when a member measures them, blocks are whole drift chunks, each chunk's sums computed as
// its own pass computes them (average_drift_range).
class GroupPass {
 public:
  static constexpr std::int64_t block_bytes = 32 * 1024;
  static constexpr std::int64_t min_block_elements = 256, max_block_elements = 2048;

  // Groups the segments of `passes`, each run with its weight, in time linear in the segments
  // (by position when every pass reads the same inputs in the same order, else a hash of the
  // inputs); keeps its buffers' capacity. Given the same passes again, unchanged
  // (their generations), it keeps the grouping and only takes the new weights: a GroupPass kept
  // from call to call (UpdateKernel::TogetherScratch, owned by the group's GroupCore) neither
  // allocates nor hashes once it has seen the members.
  // A pass's drift sums (CpuPass::run's `drift`; null: not measured) may change from call to call
  // like its weight.
  struct Input {
    const CpuPass* pass;
    Weights weights;
    double* drift = nullptr;
  };
  void build(std::span<const Input> passes);
  // Whether the last build() kept the grouping of the one before (for tests).
  bool reused() const noexcept { return reused_; }
  void run(std::int64_t grain) const;

 private:
  struct Entry {
    SegmentFn fn;
    void* a;
    Weights weights;
    double* drift;       // the drift chunk sums of this segment (from its first chunk), or null
    std::int64_t chunk;  // the segment's first drift chunk in its pass (CpuPass::Segment::chunk)
    std::size_t pass;    // index into build()'s passes, whose weight and drift sums it takes
  };
  struct Group {
    const void* x;
    std::int64_t n, cost, begin;
    std::size_t first, count;  // entries_[first, first + count)
    std::int64_t block;        // elements per block
  };
  // A group's input: where its data starts, and its element count (grouped through the hash, two
  // slots reading the same memory read the same elements: one group).
  struct Key {
    const void* input;
    std::int64_t n;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept {
      return std::hash<const void*>()(k.input) ^ (std::hash<std::int64_t>()(k.n) * 0x9e3779b97f4a7c15ull);
    }
  };
  void run_share(std::int64_t c0, std::int64_t c1) const;
  // Whether every pass reads the same inputs in the same order (then grouped by position).
  static bool same_inputs(std::span<const Input> passes) noexcept;

  std::vector<Group> groups_;
  std::vector<Entry> entries_;
  std::unordered_map<Key, std::size_t, KeyHash> index_;               // input -> its group
  std::vector<std::size_t> group_of_;                                 // per segment, in the order of `passes`
  std::vector<std::pair<const CpuPass*, std::uint64_t>> built_from_;  // the passes and generations
  std::int64_t total_ = 0;
  bool reused_ = false;
  bool drift_ = false;  // an input measures its drift: blocks are whole drift chunks
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/cpu_pass-inl.hpp>
#endif
