// The plan of an update: which path each tensor pair (Slot) takes, decided once at bind time and
// again only when a source moves device, changes dtype, stops being contiguous or gets new memory
// (UpdateKernel::check_sources_and_replan()). Making the plan is the only work here; running it is
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

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// One averaged or copied tensor pair. The fields every update's check reads (UpdateKernel::
// check_sources_and_replan) come first: the tensors' handles to source_contiguous, 74 bytes.
struct Slot {
  at::Tensor average;  // the EMA's tensor
  at::Tensor source;   // the model's tensor (a handle: follows Module::to())
  // Bound at plan time; a change of any of these makes the next update re-plan (the device
  // changes with the memory).
  Memory source_memory;             // where the data lies (memory_of): the plan holds views of it, which
  Memory average_memory;            // set_data() of the tensor would leave on the old memory
  std::vector<std::int64_t> shape;  // a change of shape is an error, not a re-plan
  c10::ScalarType source_dtype{c10::ScalarType::Undefined};
  bool source_contiguous = true;
  bool averaged = true;                  // false: copied, not averaged
  bool follows_averages = true;          // for a copied slot: false = written by copy() only (ema-pytorch's
                                         // ignored names, which its copies still write)
  bool buffer = false;                   // a forward pass may write it in place (BatchNorm statistics): with a side
                                         // stream it is read on the current stream, before
                                         // the next forward
  bool huge_pages_advised = false;       // advise_huge_pages() ran on the average (once per slot)
  c10::Device source_device{c10::kCPU};  // bound at plan time too: it changes with source_memory
  std::string name;
  at::Tensor staging;  // CPU averages: defined when the source must be copied before the pass reads it
  const at::Tensor& input() const noexcept { return staging.defined() ? staging : source; }
};

// How CPU averages are updated: the fused pass, or the foreach lists used on other devices
// (chosen by tests and benchmarks, which exercise the device path on a machine without a GPU).
enum class CpuPath : std::uint8_t { fused, foreach };

// Whether a CUDA device's work on parameters runs on a side stream (EmaOptions::side_stream).
enum class SideStream : std::uint8_t { off, on };

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
  std::size_t lane = no_lane;    // the lane whose stream runs it
  bool current = false;          // on the current stream even with a side stream (buffers)
  bool follows_averages = true;  // copy lists: also written by averaging updates
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
  // passes hold slot indices and the tensors' data pointers as they are now: a tensor given
  // new memory (or a slot list changed) needs a new plan, which
  // UpdateKernel::check_sources_and_replan() makes. `arithmetic`: the formula of the CPU
  // pass's average segments.
  UpdatePlan(std::vector<Slot>& slots, CpuPath cpu_path, SideStream side_stream, std::int64_t staging_bytes,
             Arithmetic arithmetic = Arithmetic::lerp);

  // ---- what the plan holds -------------------------------------------------------------------
  CpuPass average_pass;                     // CPU averages and the copies that follow them
  CpuPass copy_pass;                        // every CPU slot, for copy()
  std::vector<ForeachList> lists;           // the foreach path, in plan order
  std::vector<std::size_t> staged;          // CPU averages read from a staging copy
  std::vector<std::size_t> generic;         // CPU averages the pass cannot read: ATen ops / copy_
  std::vector<std::size_t> generic_copies;  // CPU copied slots the pass cannot copy: copy_
  std::vector<c10::Device> lanes;           // one per CUDA device the update touches
  std::vector<std::size_t> offload_lanes;   // lanes whose device-to-host copies the CPU pass reads
  std::int64_t pool_bytes = 0;              // bytes of the staging pools

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
  Arithmetic arithmetic_ = Arithmetic::lerp;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/update_plan-inl.hpp>
#endif
