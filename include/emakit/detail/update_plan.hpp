// The plan of an update: which path each tensor pair (Slot) takes, decided once at bind time and
// again only when a source moves device, changes dtype, stops being contiguous or gets new memory
// (UpdateKernel::check_sources()). Making the plan is the only work here; running it is
// detail/update_kernel.hpp's.
//   - CPU averages: segments of the fused passes (detail/cpu_pass.hpp), one pass for averaging
//     updates and one for copies. Averages of 2 MiB and more get huge pages (detail/huge_pages.hpp).
//     A source the pass cannot read in place (another device, not contiguous, a dtype pair it has
//     no loop for) gets a full-size staging copy, pinned when the source is on CUDA (CPU offload:
//     it crosses PCIe in its own dtype). Pairs without a fused loop (complex, rare dtypes) use
//     ATen's lerp_/copy_.
//   - other devices (and CPU averages with CpuPath::foreach): foreach lists, one per (device,
//     dtype, stream). Sources in the average's dtype, contiguous, on its device are read in place;
//     the others go through a bounded staging pool: their tensors are cut into pieces that fill
//     the pool chunk by chunk, each chunk one staged list (a foreach copy into the pool, a foreach
//     lerp from it). The pool holds at most max(staging_bytes, the largest piece) bytes; a piece is
//     a flat range of a contiguous source, or rows (dim 0) of a strided one.
//   - lanes: the CUDA devices the update touches (detail/device_sync.hpp); with a side stream,
//     buffers (Slot::buffer) stay on the current stream and their lists are marked `current`.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/aten_compat.hpp>
#include <emakit/detail/cpu_pass.hpp>
#include <emakit/detail/huge_pages.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace emakit::detail {

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

// How CPU averages are updated: the fused pass, or the foreach lists used on other devices
// (chosen by tests and benchmarks, which exercise the device path on a machine without a GPU).
enum class CpuPath : std::uint8_t { fused, foreach };

// A foreach list: tensors of one device and dtype, updated by one foreach call on one stream.
enum class ListKind : std::uint8_t {
  lerp,    // averages = lerp(averages, inputs): inputs are the sources
  staged,  // one chunk: inputs (views of a staging pool) = sources, then the lerp from inputs
  copy,    // averages = inputs (the sources)
};

// No lane: the work runs on no CUDA device's stream.
inline constexpr std::size_t no_lane = static_cast<std::size_t>(-1);

struct ForeachList {
  ListKind kind;
  c10::Device device{c10::kCPU};
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::size_t lane = no_lane;     // the lane whose stream runs it
  bool current = false;           // on the current stream even with a side stream (buffers)
  bool follows_averages = true;   // copy lists: also written by averaging updates
  std::vector<at::Tensor> averages;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> sources;  // staged lists only
};

class UpdatePlan {
 public:
  // Staging pieces start on multiples of this many elements (256 bytes of fp32): the foreach
  // kernels' vectorised loads need aligned addresses.
  static constexpr std::int64_t staging_align = 64;

  UpdatePlan() = default;
  // Plans `slots`, writing what it binds into them (Slot::source_device ... staging). The CPU
  // passes hold pointers to the slots' tensors: the vector must not be resized while the plan
  // is used (moving it is fine, it moves its buffer, not the slots).
  UpdatePlan(std::vector<Slot>& slots, CpuPath cpu_path, bool side_stream, std::int64_t staging_bytes);

  // ---- what the plan holds -------------------------------------------------------------------
  CpuPass average_pass;                      // CPU averages and the copies that follow them
  CpuPass copy_pass;                         // every CPU slot, for copy()
  std::vector<ForeachList> lists;            // the foreach path, in plan order
  std::vector<std::size_t> staged;           // CPU averages read from a staging copy
  std::vector<std::size_t> generic;          // CPU averages the pass cannot read: lerp_ / copy_
  std::vector<std::size_t> generic_copies;   // CPU copied slots the pass cannot copy: copy_
  std::vector<c10::Device> lanes;            // one per CUDA device the update touches
  std::vector<std::size_t> offload_lanes;    // lanes whose device-to-host copies the CPU pass reads
  std::int64_t pool_bytes = 0;               // bytes of the staging pools

  // With a side stream, a buffer's work stays on the current stream (a forward pass writes it).
  bool on_current(const Slot& s) const noexcept { return side_stream_ && s.buffer; }

  // The lane of a device (no_lane: none; only CUDA devices have lanes).
  std::size_t lane_of(c10::Device dev) const;
  // The lane a slot's work runs on: the CUDA device of its average, else of its source, if any.
  std::size_t lane_of(const Slot& s) const {
    return lane_of(s.average.is_cuda() ? s.average.device() : s.source.device());
  }

 private:
  std::size_t lane_for(c10::Device dev);

  ForeachList& list_for(ListKind kind, const Slot& s, bool follows_averages = true);

  // Averaged slots whose sources the foreach lerp cannot read in place, by (device, dtype,
  // stream) of the average: cut into pieces that fill a pool of the bound chunk by chunk, each
  // chunk a staged list. A piece is a flat range when source and average are contiguous, else a
  // range of rows (dim 0); the pool grows past the bound only to hold the largest row.
  void plan_staging(const std::vector<Slot>& slots, const std::vector<std::size_t>& to_stage,
                    std::int64_t staging_bytes);

  static bool flat_pieces(const Slot& s) { return s.source_contiguous && s.average.is_contiguous(); }
  static std::int64_t row_elements(const Slot& s) { return s.average.numel() / s.average.size(0); }
  static std::int64_t align_up(std::int64_t n) { return (n + staging_align - 1) / staging_align * staging_align; }

  void plan_pool(const std::vector<Slot>& slots, const std::vector<std::size_t>& group, std::int64_t staging_bytes);

  // A CPU average: a segment of the fused passes when the pass can read its input (the source
  // itself, or a staging copy of it), else ATen's own lerp_/copy_ (complex and rare dtypes).
  void plan_cpu_slot(std::vector<Slot>& slots, std::size_t i);

  // A full-size staging copy of one source, for a CPU average (pinned for offload).
  void stage(Slot& s, std::size_t i, c10::ScalarType dtype, bool pinned);

  bool side_stream_ = false;
};

}  // namespace emakit::detail

#if EMAKIT_DEFINITIONS

namespace emakit::detail {

EMAKIT_FUNC UpdatePlan::UpdatePlan(std::vector<Slot>& slots, CpuPath cpu_path, bool side_stream, std::int64_t staging_bytes)
    : side_stream_(side_stream) {
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
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
      if (std::find(offload_lanes.begin(), offload_lanes.end(), k) == offload_lanes.end())
        offload_lanes.push_back(k);
    }
  }
  std::vector<std::size_t> to_stage;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
    if (s.average.device().is_cpu() && (cpu_path == CpuPath::fused || !s.averaged)) {
      plan_cpu_slot(slots, i);
    } else if (!s.averaged) {
      ForeachList& l = list_for(ListKind::copy, s, s.follows_averages);
      l.averages.push_back(s.average);
      l.inputs.push_back(s.source);
    } else if (s.source_device == s.average.device() && s.source_contiguous &&
               s.source_dtype == s.average.scalar_type()) {
      ForeachList& l = list_for(ListKind::lerp, s);
      l.averages.push_back(s.average);
      l.inputs.push_back(s.source);
    } else if (s.average.numel() > 0) {
      to_stage.push_back(i);
    }
  }
  plan_staging(slots, to_stage, staging_bytes);
}

EMAKIT_FUNC std::size_t UpdatePlan::lane_of(c10::Device dev) const {
  for (std::size_t k = 0; k < lanes.size(); ++k)
    if (lanes[k] == dev) return k;
  return no_lane;
}

EMAKIT_FUNC std::size_t UpdatePlan::lane_for(c10::Device dev) {
  const std::size_t k = lane_of(dev);
  if (k != no_lane) return k;
  lanes.push_back(dev);
  return lanes.size() - 1;
}

EMAKIT_FUNC ForeachList& UpdatePlan::list_for(ListKind kind, const Slot& s, bool follows_averages) {
  const auto dev = s.average.device();
  const auto type = s.average.scalar_type();
  const std::size_t k = lane_of(s);
  const bool current = on_current(s);
  for (auto& l : lists)
    if (l.kind == kind && l.device == dev && l.dtype == type && l.lane == k && l.current == current &&
        l.follows_averages == follows_averages)
      return l;
  lists.push_back(ForeachList{kind, dev, type, k, current, follows_averages, {}, {}, {}});
  return lists.back();
}

EMAKIT_FUNC void UpdatePlan::plan_staging(const std::vector<Slot>& slots, const std::vector<std::size_t>& to_stage,
                  std::int64_t staging_bytes) {
  std::vector<bool> done(to_stage.size(), false);
  for (std::size_t first = 0; first < to_stage.size(); ++first) {
    if (done[first]) continue;
    const Slot& head = slots[to_stage[first]];
    std::vector<std::size_t> group;  // the slots sharing head's pool
    for (std::size_t j = first; j < to_stage.size(); ++j) {
      const Slot& s = slots[to_stage[j]];
      if (!done[j] && s.average.device() == head.average.device() &&
          s.average.scalar_type() == head.average.scalar_type() && lane_of(s) == lane_of(head) &&
          on_current(s) == on_current(head)) {
        group.push_back(to_stage[j]);
        done[j] = true;
      }
    }
    plan_pool(slots, group, staging_bytes);
  }
}

EMAKIT_FUNC void UpdatePlan::plan_pool(const std::vector<Slot>& slots, const std::vector<std::size_t>& group, std::int64_t staging_bytes) {
  const Slot& head = slots[group.front()];
  const auto esize = static_cast<std::int64_t>(head.average.element_size());
  std::int64_t capacity = std::max<std::int64_t>(1, staging_bytes / esize);
  for (auto i : group)
    if (!flat_pieces(slots[i])) capacity = std::max(capacity, row_elements(slots[i]));
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
    const Slot& s = slots[i];
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
  pool_bytes += static_cast<std::int64_t>(pool.nbytes());
  ForeachList* list = nullptr;
  std::size_t list_chunk = static_cast<std::size_t>(-1);
  for (const auto& p : pieces) {
    const Slot& s = slots[p.slot];
    if (p.chunk != list_chunk) {
      lists.push_back(ForeachList{ListKind::staged, s.average.device(), s.average.scalar_type(), lane_of(s),
                                  on_current(s), true, {}, {}, {}});
      list = &lists.back();
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

EMAKIT_FUNC void UpdatePlan::plan_cpu_slot(std::vector<Slot>& slots, std::size_t i) {
  Slot& s = slots[i];
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
  if (!readable || in_type != s.source_dtype) stage(s, i, in_type, /*pinned=*/offload);
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
  // Addresses of the slot's tensors: stable, the slots are not resized after planning (and a move
  // of the kernel moves the vector's buffer, not the slots).
  const at::Tensor* average = &s.average;
  const at::Tensor* input = &s.input();
  if (s.averaged) {
    if (lerp != nullptr) {
      average_pass.add(lerp, i, n, cost, average, input);
      copy_pass.add(copy, i, n, copy_cost, average, input);
    } else {
      generic.push_back(i);
    }
  } else if (copy != nullptr) {
    if (s.follows_averages) average_pass.add(copy, i, n, copy_cost, average, input);
    copy_pass.add(copy, i, n, copy_cost, average, input);
  } else {
    generic_copies.push_back(i);
  }
}

EMAKIT_FUNC void UpdatePlan::stage(Slot& s, std::size_t i, c10::ScalarType dtype, bool pinned) {
  auto options = s.average.options().dtype(dtype);
  if (pinned) options = options.pinned_memory(true);
  s.staging = at::empty(s.source.sizes(), options);
  staged.push_back(i);
}

}  // namespace emakit::detail

#endif  // EMAKIT_DEFINITIONS
