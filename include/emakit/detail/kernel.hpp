// The update kernel: the one place where averaged tensors change.
//
// Planned once at bind time (and again only if a source tensor moves device, changes dtype or
// stops being contiguous), then each update:
//   - CPU averages: one fused pass per tensor chunk, parallel over chunks with at::parallel_for,
//     reading the source in its own dtype (bf16/fp16 model into an fp32 average in the same pass),
//     with no temporaries. The arithmetic is ATen's lerp: a + w*(x-a) for w < 0.5, else
//     x + (w-1)*(x-a), in float for float/half/bf16 averages and double for double averages.
//   - other devices: tensors grouped by (device, dtype); one torch::_foreach_lerp_ per group
//     (LibTorch >= 2.0) or _foreach_mul_ + _foreach_add_ (LibTorch 1.13, which lacks it).
//   - a source on another device or in a dtype the pass cannot read is first copied into a
//     staging tensor allocated at plan time (CPU offload of the average, complex tensors).
//   - non-floating tensors and copy-only names: copy_.
// An update allocates nothing and looks up no names.
#pragma once

#include <emakit/detail/check.hpp>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/empty.h>
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

#include <cmath>
#include <cstdint>
#include <string>
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

template <class A>
using opmath_t = std::conditional_t<std::is_same_v<A, double>, double, float>;

// a = lerp(a, x, w) over n elements, in ATen's formula, as one pass.
template <class A, class S>
void lerp_range(A* __restrict a, const S* __restrict x, std::int64_t n, opmath_t<A> w) noexcept {
  using T = opmath_t<A>;
  if (std::abs(w) < T(0.5)) {
    EMAKIT_SIMD
    for (std::int64_t i = 0; i < n; ++i) {
      const T ai = static_cast<T>(a[i]);
      a[i] = static_cast<A>(ai + w * (static_cast<T>(x[i]) - ai));
    }
  } else {
    const T c = w - T(1);
    EMAKIT_SIMD
    for (std::int64_t i = 0; i < n; ++i) {
      const T xi = static_cast<T>(x[i]);
      a[i] = static_cast<A>(xi + c * (xi - static_cast<T>(a[i])));
    }
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

// One averaged or copied tensor pair.
struct Slot {
  std::string name;
  at::Tensor average;   // the EMA's tensor
  at::Tensor source;    // the model's tensor (a handle: follows Module::to())
  bool averaged = true; // false: copied at every update
  // Bound at plan time; a change of any of these makes the next update re-plan.
  c10::Device source_device{c10::kCPU};
  c10::ScalarType source_dtype{c10::ScalarType::Undefined};
  bool source_contiguous = true;
  std::vector<std::int64_t> shape;  // a change of shape is an error, not a re-plan
  at::Tensor staging;   // defined when the source must be copied before averaging
  const at::Tensor& input() const noexcept { return staging.defined() ? staging : source; }
};

class UpdateKernel {
 public:
  static constexpr std::int64_t chunk_elements = std::int64_t{1} << 15;

  // How CPU averages are updated: the fused pass, or the foreach ops used on other devices
  // (chosen for tests and benchmarks, which compare the two on a machine without a GPU).
  enum class CpuPath : std::uint8_t { fused, foreach };

  UpdateKernel() = default;
  explicit UpdateKernel(std::vector<Slot> slots, CpuPath cpu_path = CpuPath::fused)
      : slots_(std::move(slots)), cpu_path_(cpu_path) {
    for (auto& s : slots_) s.shape.assign(s.source.sizes().begin(), s.source.sizes().end());
    plan();
  }

  const std::vector<Slot>& slots() const noexcept { return slots_; }
  std::vector<Slot>& slots() noexcept { return slots_; }

  // Throws if a source changed shape since bind; re-plans if one moved or changed dtype.
  // Returns true when it re-planned.
  bool check_sources() {
    bool stale = false;
    for (const auto& s : slots_) {
      if (!s.source.defined())
        fail("tensor '{}' of the model is no longer defined; make a new Ema for the changed model", s.name);
      if (!s.source.sizes().equals(s.shape))
        fail("tensor '{}' changed shape from {} to {} since the EMA was bound; make a new Ema for the changed model",
             s.name, shape_string(s.shape), shape_string(s.source.sizes()));
      stale = stale || s.source.device() != s.source_device || s.source.scalar_type() != s.source_dtype ||
              s.source.is_contiguous() != s.source_contiguous;
    }
    if (stale) plan();
    return stale;
  }

  // ema = lerp(ema, model, weight) for averaged slots; copy for the others.
  void average(double weight) {
    c10::NoGradGuard no_grad;
    for (auto i : staged_) slots_[i].staging.copy_(slots_[i].source);
    for (auto& g : cpu_groups_) run_cpu_group(g, weight);
    for (auto& g : device_groups_) run_device_group(g, weight);
    for (auto i : generic_) slots_[i].average.lerp_(slots_[i].input(), weight);
    for (auto i : copied_) slots_[i].average.copy_(slots_[i].source);
  }

  // ema = model for every slot.
  void copy() {
    c10::NoGradGuard no_grad;
    for (auto& s : slots_) s.average.copy_(s.source);
  }

 private:
  struct Chunk {
    std::int32_t group_slot;  // index into the group's pointer table
    std::int64_t begin;
    std::int64_t end;
  };
  struct CpuGroup {
    c10::ScalarType average_dtype;
    c10::ScalarType input_dtype;
    std::vector<std::size_t> slots;
    std::vector<std::pair<void*, const void*>> pointers;  // refreshed per update, sized at plan
    std::vector<Chunk> chunks;
  };
  struct DeviceGroup {
    c10::Device device{c10::kCPU};
    c10::ScalarType dtype;
    std::vector<at::Tensor> averages;
    std::vector<at::Tensor> inputs;
  };

  void plan() {
    cpu_groups_.clear();
    device_groups_.clear();
    staged_.clear();
    generic_.clear();
    copied_.clear();
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      s.source_device = s.source.device();
      s.source_dtype = s.source.scalar_type();
      s.source_contiguous = s.source.is_contiguous();
      s.staging = at::Tensor();
      if (!s.averaged) {
        copied_.push_back(i);
        continue;
      }
      const auto a_dev = s.average.device();
      const auto a_type = s.average.scalar_type();
      const bool same_place = s.source_device == a_dev && s.source_contiguous;
      if (a_dev.is_cpu() && cpu_path_ == CpuPath::fused) {
        if (same_place && fused_pair(a_type, s.source_dtype)) {
          cpu_group(a_type, s.source_dtype).slots.push_back(i);
          continue;
        }
        if (!(same_place && s.source_dtype == a_type)) stage(i, a_type);
        if (fused_pair(a_type, a_type)) {
          cpu_group(a_type, a_type).slots.push_back(i);
        } else {
          generic_.push_back(i);  // complex and other rare dtypes: ATen's own lerp_
        }
      } else {
        if (!(same_place && s.source_dtype == a_type)) stage(i, a_type);
        device_group(a_dev, a_type, s.average, s.input());
      }
    }
    for (auto& g : cpu_groups_) {
      g.pointers.assign(g.slots.size(), {nullptr, nullptr});
      g.chunks.clear();
      for (std::size_t k = 0; k < g.slots.size(); ++k) {
        const std::int64_t n = slots_[g.slots[k]].average.numel();
        for (std::int64_t b = 0; b < n; b += chunk_elements)
          g.chunks.push_back({static_cast<std::int32_t>(k), b, std::min(n, b + chunk_elements)});
      }
    }
  }

  void stage(std::size_t i, c10::ScalarType dtype) {
    Slot& s = slots_[i];
    s.staging = at::empty(s.source.sizes(), s.average.options().dtype(dtype));
    staged_.push_back(i);
  }

  CpuGroup& cpu_group(c10::ScalarType a, c10::ScalarType in) {
    for (auto& g : cpu_groups_)
      if (g.average_dtype == a && g.input_dtype == in) return g;
    cpu_groups_.push_back(CpuGroup{a, in, {}, {}, {}});
    return cpu_groups_.back();
  }

  void device_group(c10::Device dev, c10::ScalarType dtype, const at::Tensor& avg, const at::Tensor& in) {
    for (auto& g : device_groups_) {
      if (g.device == dev && g.dtype == dtype) {
        g.averages.push_back(avg);
        g.inputs.push_back(in);
        return;
      }
    }
    device_groups_.push_back(DeviceGroup{dev, dtype, {avg}, {in}});
  }

  void run_cpu_group(CpuGroup& g, double weight) {
    for (std::size_t k = 0; k < g.slots.size(); ++k) {
      const Slot& s = slots_[g.slots[k]];
      g.pointers[k] = {s.average.data_ptr(), s.input().data_ptr()};
    }
    dispatch_pair(g.average_dtype, g.input_dtype, [&](auto* a_tag, auto* s_tag) {
      using A = std::remove_pointer_t<decltype(a_tag)>;
      using S = std::remove_const_t<std::remove_pointer_t<decltype(s_tag)>>;
      const auto w = static_cast<opmath_t<A>>(weight);
      const auto& chunks = g.chunks;
      const auto& ptrs = g.pointers;
      at::parallel_for(0, static_cast<std::int64_t>(chunks.size()), 1, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t c = begin; c < end; ++c) {
          const Chunk& ch = chunks[static_cast<std::size_t>(c)];
          auto* a = static_cast<A*>(ptrs[static_cast<std::size_t>(ch.group_slot)].first) + ch.begin;
          const auto* x = static_cast<const S*>(ptrs[static_cast<std::size_t>(ch.group_slot)].second) + ch.begin;
          lerp_range<A, S>(a, x, ch.end - ch.begin, w);
        }
      });
    });
  }

  static void run_device_group(DeviceGroup& g, double weight) {
#if EMAKIT_HAS_FOREACH_LERP
    at::_foreach_lerp_(g.averages, g.inputs, weight);
#else
    at::_foreach_mul_(g.averages, 1.0 - weight);
    at::_foreach_add_(g.averages, g.inputs, weight);
#endif
  }

  std::vector<Slot> slots_;
  CpuPath cpu_path_ = CpuPath::fused;
  std::vector<CpuGroup> cpu_groups_;
  std::vector<DeviceGroup> device_groups_;
  std::vector<std::size_t> staged_;
  std::vector<std::size_t> generic_;
  std::vector<std::size_t> copied_;
};

}  // namespace emakit::detail
