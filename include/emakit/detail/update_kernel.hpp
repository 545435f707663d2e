// The update kernel: the one place where averaged tensors change. It owns the tensor pairs
// (Slot), plans them (detail/update_plan.hpp), runs the plan on each update and is the only door
// through which anything waits for an update to finish.
//   - each update: the fused CPU pass (detail/cpu_pass.hpp) for CPU averages; for other devices one
//     foreach call per list (detail/aten_compat.hpp), staged lists through their pool.
//   - the side stream (EmaOptions::side_stream): a CUDA device's work on parameters runs on a
//     stream of its own that first waits for the current stream (the optimizer step). Buffers
//     (Slot::buffer: BatchNorm statistics, written by the next forward pass) stay on the current
//     stream, so only the next optimizer step has to wait (wait_for_model_reads()). See
//     detail/device_sync.hpp.
//   - CPU offload (CUDA model, CPU average): each source is copied into a pinned staging tensor in
//     its own dtype, with non-blocking copies the host waits for once. With the side stream as
//     well, the CPU pass runs on a host thread after the copies land, so update() returns at once;
//     wait_for_model_reads() orders the device after the copies only, wait_for_update() joins the host pass too.
// Waiting is always a named call: slots() hands out the slots as they are, wait_for_update() (or
// settled_slots(), which is wait_for_update() then slots()) waits for the last update first. Every
// reader of the averages, and every writer of them outside an update, calls one of the two once. An
// update looks up no names. What it allocates: nothing in the fused CPU pass, nor in a foreach
// list's lerp (or 1.13's mul_ + add_) and scaled_fused_add; a foreach list's weighted_sum, subtract
// and fused_subtract without scratch allocate a temporary list (detail/aten_compat.hpp); a
// skip_non_finite check, a few scalars (one flag per foreach list, reduced on the device, read with
// one host sync); a drift measurement outside the CPU pass, its norms.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/aten_compat.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/device_sync.hpp>
#include <emakit/detail/non_finite.hpp>
#include <emakit/detail/testing.hpp>
#include <emakit/detail/update_plan.hpp>
#include <emakit/options.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// The CPU pass of an offloaded side-stream update, on a thread of its own: defined with the
// kernel's definitions (update_kernel-inl.hpp), so that a translation unit that includes this
// header does not parse <future>.
struct HostPass;

class UpdateKernel {
 public:
  // The parallel grain of the CPU pass, in elements of fp32 <- fp32 (12 bytes each): below it an
  // update runs on one thread.
  static constexpr std::int64_t chunk_elements = std::int64_t{1} << 15;
  // The same grain in the CPU pass's cost units (bytes moved).
  static constexpr std::int64_t pass_grain = chunk_elements * 12;
  // Staging pieces start on multiples of this many elements (see UpdatePlan).
  static constexpr std::int64_t staging_align = UpdatePlan::staging_align;
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  using CpuPath = detail::CpuPath;
  using SideStream = detail::SideStream;

  UpdateKernel() = default;
  // side_stream: run the work of each CUDA device on a side stream (see the top of this file).
  // staging_bytes: the bound of each staging pool. arithmetic: how an average is computed.
  explicit UpdateKernel(std::vector<Slot> slots, CpuPath cpu_path = CpuPath::fused,
                        SideStream side_stream = SideStream::off,
                        std::int64_t staging_bytes = EmaOptions::default_staging_bytes,
                        Arithmetic arithmetic = Arithmetic::lerp)
      : slots_(std::move(slots)),
        cpu_path_(cpu_path),
        side_stream_(side_stream),
        staging_bytes_(staging_bytes),
        arithmetic_(arithmetic) {
    if (staging_bytes_ < 1) fail("the staging bound must be at least 1 byte, got {}", staging_bytes_);
    for (auto& s : slots_) s.shape.assign(s.source.sizes().begin(), s.source.sizes().end());
    plan();
  }
  // Moves settle pending side-stream or host work first: it refers to the tensors being moved.
  UpdateKernel(UpdateKernel&& other) noexcept { *this = std::move(other); }
  UpdateKernel& operator=(UpdateKernel&& other) noexcept;
  UpdateKernel(const UpdateKernel&) = delete;
  UpdateKernel& operator=(const UpdateKernel&) = delete;
  // Pending side-stream work writes tensors this kernel holds: the current stream waits for it
  // before they can be freed and reused.
  ~UpdateKernel() { wait_for_update_noexcept(); }

  // The slots as they are: waits for nothing. Their names, roles and model tensors (source) can
  // be read at any time; an average read or written through them may race with an update still
  // running: readers of the averages use settled_slots().
  const std::vector<Slot>& slots() const noexcept { return slots_; }
  // wait_for_update(), then the slots: whatever reads or writes the averages through them is
  // ordered after the last update. Call it once per read, not per tensor.
  const std::vector<Slot>& settled_slots() const {
    wait_for_update();
    return slots_;
  }
  std::size_t size() const noexcept { return slots_.size(); }
  const std::string& name(std::size_t i) const { return slots_.at(i).name; }

  // Bytes of the staging pools (the bounded conversion area of the foreach path).
  std::int64_t pool_bytes() const noexcept { return plan_.pool_bytes; }
  // Foreach lists of the last plan by kind, for tests: lerp (sources read in place), staged
  // (chunks through a pool), copy.
  struct Census {
    std::size_t lerp = 0, staged = 0, copy = 0;
  };
  Census census() const noexcept;

  // What must finish before anything writes what the last update reads, i.e. before the next
  // optimizer step writes the model: each CUDA device's current stream waits for its side
  // stream (asynchronous for the host). An offloaded update's host pass is not waited for: it
  // reads pinned copies, which the side stream has made by then. A no-op without a side stream.
  void wait_for_model_reads() const {
    EMAKIT_TEST_HOOK(testing::sync_counts().waits += 1);
    for (auto& lane : lanes_) lane.wait();
  }

  // Everything of the last update has finished: joins the host pass of an offloaded update
  // (rethrowing its error) and orders each device's current stream after the side stream. Every
  // read or write of the averages outside an update goes through it (or settled_slots()).
  void wait_for_update() const;

  // Throws if a source changed shape since bind; re-plans (after wait_for_update()) if one moved,
  // changed dtype or got new memory.
  void check_sources_and_replan();

  // What one update asks of the kernel (update() and update_together() alike): Kind::copy, ema =
  // model for every slot; Kind::average, ema = F(ema, model) for averaged slots (F the kernel's
  // Arithmetic, with `weights`) and a copy for the copied ones, measuring how far each averaged
  // slot ends from its source (drift_sums()) with DriftMeasure::measure.
  enum class Kind : std::uint8_t { copy, average };
  enum class DriftMeasure : std::uint8_t { skip, measure };
  struct Job {
    Kind kind = Kind::copy;
    Weights weights{1.0, 0.0};
    DriftMeasure drift = DriftMeasure::skip;
    bool measures_drift() const noexcept { return kind == Kind::average && drift == DriftMeasure::measure; }
  };
  void run(const Job& job);
  void average(Weights weights, DriftMeasure drift = DriftMeasure::skip) { run(Job{Kind::average, weights, drift}); }
  // The same with w = weight and d = 1 - weight (the lerps need only w).
  void average(double weight, DriftMeasure drift = DriftMeasure::skip) {
    average(Weights{weight, 1.0 - weight}, drift);
  }
  void copy() { run(Job{}); }

  Arithmetic arithmetic() const noexcept { return arithmetic_; }

  // One kernel's job in update_together().
  struct Work {
    UpdateKernel* kernel;
    Job job;
  };
  // Each kernel's average() or copy(), as if run one after another: the kernels whose whole
  // update is the fused CPU pass run as one GroupPass (each input read once for all of them);
  // the others (foreach lists on CUDA, staged or generic CPU slots, offload) run their own.
  // What run_together keeps from call to call (its owner, a GroupCore, keeps it): the fused
  // passes of a call and their grouping, reused while no member's plan changed.
  struct TogetherScratch {
    std::vector<GroupPass::Input> passes;
    GroupPass group;
  };
  static void run_together(std::span<const Work> work, TogetherScratch& scratch);
  // Whether this kernel's whole update is its fused CPU pass.
  bool cpu_pass_only() const noexcept {
    return plan_.lists.empty() && plan_.staged.empty() && plan_.generic.empty() && plan_.generic_copies.empty() &&
           plan_.offload_lanes.empty() && lanes_.empty();
  }

  // The drift sums of the last update that measured them, two per slot: [2i] = sum((average -
  // source)^2) and [2i + 1] = sum(source^2) over slot i's elements, for averaged slots (0 for the
  // others), the average as stored after the update, both in opmath (float; double for double
  // averages). Slots of the fused CPU pass are measured inside it, as it writes them (arithmetic
  // only: no extra read of memory); the others (foreach lists, generic CPU slots, and a pass slot
  // that reads its source converted to a narrower average's dtype) by ATen ops in chunks of at most
  // staging_bytes of float temporaries, after the update is waited for (one host sync per device).
  std::span<const double> drift_sums() const noexcept { return drift_sums_; }

  // The first slot, in slot order, whose source the next update of `kind` reads (copying: every
  // slot; averaging: averaged slots and copies that follow averages) and that holds a NaN or an
  // infinity; npos if none. Call after check_sources_and_replan(): the checks are those of the last
  // plan (see detail/non_finite.hpp).
  std::size_t first_non_finite(Kind kind) const { return finite_checks_[kind == Kind::copy ? 1 : 0].first(slots_); }

 private:
  void plan();

  // Zeroes the drift sums before an update that measures them (and sizes the fused pass's chunk
  // sums: an allocation at the first such update after a plan).
  void begin_drift() {
    std::fill(drift_sums_.begin(), drift_sums_.end(), 0.0);
    drift_chunks_.assign(static_cast<std::size_t>(2 * plan_.average_pass.drift_chunks()), 0.0);
  }
  // Adds the fused pass's drift chunk sums up into drift_sums_, each slot's in chunk order: the
  // same sums for update() and update_together(), with any number of threads.
  void fold_drift() noexcept;
  // The drift sums of the averaged slots that the fused CPU pass does not write (drift_outside_),
  // once the update is finished.
  void measure_drift_outside();

  // On the current stream or the lane's side stream: offload staging copies and the foreach lists
  // of lane k (no_lane: of no lane).
  enum class Stream : std::uint8_t { current, side };
  void run_lists(const Job& job, std::size_t k, Stream stream);

  void run_cpu(const Job& job);
  // What run() does first, and update_together() for the kernels it runs as one pass: uses up
  // the source check, joins an offloaded pass, zeroes the drift sums if the job measures them.
  void begin_run(const Job& job);
  CpuPass& pass_of(Kind kind) noexcept { return kind == Kind::average ? plan_.average_pass : plan_.copy_pass; }

  static void stage_copy(Slot& s);

  // Waits for the host pass of an offloaded update, if one is running, and rethrows its error.
  EMAKIT_FUNC void join_host() const;
  void wait_for_update_noexcept() const noexcept;

  // The plan's CPU passes hold data pointers: a run is preceded by check_sources_and_replan()
  // (Ema's update does it; a run without it does it first) and uses up that check.
  void check_before_run() {
    if (!sources_checked_) check_sources_and_replan();
    sources_checked_ = false;
  }

  std::vector<Slot> slots_;
  // check_sources_and_replan() since the last run (not plan() alone: the tensors may move between
  // the plan and the first run, as between runs).
  bool sources_checked_ = false;
  CpuPath cpu_path_ = CpuPath::fused;
  SideStream side_stream_ = SideStream::off;
  std::int64_t staging_bytes_ = EmaOptions::default_staging_bytes;
  Arithmetic arithmetic_ = Arithmetic::lerp;
  UpdatePlan plan_;
  mutable std::vector<Lane> lanes_;         // one per CUDA device of the plan (plan_.lanes), in its order
  mutable std::shared_ptr<HostPass> host_;  // the CPU pass of an offloaded side-stream update
  NonFiniteCheck finite_checks_[2];         // [0] for averaging updates, [1] for copies
  std::vector<double> drift_sums_;          // two per slot (drift_sums()); sized by plan()
  std::vector<double> drift_chunks_;        // two per drift chunk of the fused average pass (CpuPass::run)
  std::vector<std::size_t> drift_outside_;  // averaged slots whose drift the fused CPU pass does not measure
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/update_kernel-inl.hpp>
#endif
