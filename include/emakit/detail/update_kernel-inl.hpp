// The non-template definitions of update_kernel.hpp: included at the end of update_kernel.hpp in header-only mode,
// compiled once into the emakit library (src/emakit.cpp) in compiled mode (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/update_kernel-inl.hpp holds definitions that the emakit library compiles in compiled mode (EMAKIT_COMPILED): include <emakit/detail/update_kernel.hpp> instead"
#endif

#include <emakit/detail/update_kernel.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC UpdateKernel& UpdateKernel::operator=(UpdateKernel&& other) noexcept {
  if (this == &other) return *this;
  wait_for_update_noexcept();
  other.wait_for_update_noexcept();
  slots_ = std::move(other.slots_);
  cpu_path_ = other.cpu_path_;
  side_stream_ = other.side_stream_;
  staging_bytes_ = other.staging_bytes_;
  plan_ = std::move(other.plan_);
  lanes_ = std::move(other.lanes_);
  finite_checks_[0] = std::move(other.finite_checks_[0]);
  finite_checks_[1] = std::move(other.finite_checks_[1]);
  return *this;
}

EMAKIT_FUNC UpdateKernel::Census UpdateKernel::census() const noexcept {
  Census c;
  for (const auto& l : plan_.lists)
    (l.kind == ListKind::lerp ? c.lerp : l.kind == ListKind::staged ? c.staged : c.copy) += 1;
  return c;
}

EMAKIT_FUNC void UpdateKernel::wait_for_update() const {
  sync_counts().settles += 1;
  join_host();
  wait_for_model_reads();
}

EMAKIT_FUNC void UpdateKernel::check_sources() {
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
    wait_for_update();
    plan();
  }
}

EMAKIT_FUNC void UpdateKernel::plan() {
  plan_ = UpdatePlan(slots_, cpu_path_, side_stream_, staging_bytes_);
  lanes_.clear();
  for (const auto& dev : plan_.lanes) lanes_.emplace_back(dev, side_stream_);
  finite_checks_[0] = NonFiniteCheck(slots_, /*copying=*/false, cpu_path_);
  finite_checks_[1] = NonFiniteCheck(slots_, /*copying=*/true, cpu_path_);
}

EMAKIT_FUNC void UpdateKernel::run(bool averaging, double weight) {
  c10::NoGradGuard no_grad;
  join_host();  // the previous offloaded pass must finish before this one touches its buffers
  for (std::size_t k = 0; k < lanes_.size(); ++k) {
    run_lists(averaging, weight, k, /*current=*/true);  // buffers, before the side stream starts
    Lane& lane = lanes_[k];
    auto guard = lane.begin();
    run_lists(averaging, weight, k, /*current=*/false);
    lane.finish();
  }
  run_lists(averaging, weight, no_lane, /*current=*/true);  // CPU foreach path, devices without streams
  run_lists(averaging, weight, no_lane, /*current=*/false);
  if (plan_.offload_lanes.empty()) {
    run_cpu(averaging, weight);
  } else if (side_stream_) {
    // The host waits for the device-to-host copies on a thread of its own, then runs the pass.
    host_ = std::async(std::launch::async, [this, averaging, weight] {
      c10::NoGradGuard no_grad_here;
      for (auto k : plan_.offload_lanes) lanes_[k].synchronize_host();
      run_cpu(averaging, weight);
    });
  } else {
    for (auto k : plan_.offload_lanes) lanes_[k].synchronize_host();
    run_cpu(averaging, weight);
  }
}

EMAKIT_FUNC void UpdateKernel::run_lists(bool averaging, double weight, std::size_t k, bool current) {
  for (auto i : plan_.staged) {
    Slot& s = slots_[i];
    if (plan_.lane_of(s) == k && plan_.on_current(s) == current) stage_copy(s);
  }
  for (auto& l : plan_.lists) {
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

EMAKIT_FUNC void UpdateKernel::run_cpu(bool averaging, double weight) {
  (averaging ? plan_.average_pass : plan_.copy_pass).run(weight, chunk_elements * 12);
  if (averaging) {
    for (auto i : plan_.generic) slots_[i].average.lerp_(slots_[i].input(), weight);
    for (auto i : plan_.generic_copies)
      if (slots_[i].follows_averages) slots_[i].average.copy_(slots_[i].input());
  } else {
    for (auto i : plan_.generic) slots_[i].average.copy_(slots_[i].input());
    for (auto i : plan_.generic_copies) slots_[i].average.copy_(slots_[i].input());
  }
}

EMAKIT_FUNC void UpdateKernel::run_together(std::span<const Work> work) {
  c10::NoGradGuard no_grad;
  std::vector<std::pair<const CpuPass*, double>> passes;
  for (const Work& w : work) {
    if (w.kernel->cpu_pass_only()) {
      w.kernel->join_host();
      passes.emplace_back(w.averaging ? &w.kernel->plan_.average_pass : &w.kernel->plan_.copy_pass, w.weight);
    } else {
      w.kernel->run(w.averaging, w.weight);
    }
  }
  if (passes.size() == 1) {
    passes.front().first->run(passes.front().second, chunk_elements * 12);
  } else if (passes.size() > 1) {
    thread_local GroupPass group;  // keeps its buffers' capacity from call to call
    group.build(passes);
    group.run(chunk_elements * 12);
    sync_counts().fused_calls += 1;
    sync_counts().fused_kernels += passes.size();
    sync_counts().fused_groupings += group.reused() ? 0 : 1;
  }
}

EMAKIT_FUNC void UpdateKernel::stage_copy(Slot& s) {
  // Non-blocking only into pinned memory: the host waits for the lane before reading it.
  const bool non_blocking = s.staging.is_cpu() && s.source.is_cuda() && s.staging.is_pinned();
  s.staging.copy_(s.source, non_blocking);
}

EMAKIT_FUNC void UpdateKernel::wait_for_update_noexcept() const noexcept {
  try {
    wait_for_update();
  } catch (...) {  // a failed pass was already reported by update(), or cannot be anymore
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
