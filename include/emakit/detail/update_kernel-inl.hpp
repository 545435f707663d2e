// The non-template definitions of update_kernel.hpp: included at the end of
// update_kernel.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/update_kernel-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/update_kernel.hpp> instead"
#endif

#include <emakit/detail/update_kernel.hpp>

#include <future>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

struct HostPass {
  std::future<void> done;
};

EMAKIT_FUNC void UpdateKernel::join_host() const {
  if (host_ && host_->done.valid()) host_->done.get();  // rethrows an error of the host pass
}

EMAKIT_FUNC UpdateKernel& UpdateKernel::operator=(UpdateKernel&& other) noexcept {
  if (this == &other) return *this;
  wait_for_update_noexcept();
  other.wait_for_update_noexcept();
  slots_ = std::move(other.slots_);
  cpu_path_ = other.cpu_path_;
  side_stream_ = other.side_stream_;
  staging_bytes_ = other.staging_bytes_;
  arithmetic_ = other.arithmetic_;
  plan_ = std::move(other.plan_);
  lanes_ = std::move(other.lanes_);
  finite_checks_[0] = std::move(other.finite_checks_[0]);
  finite_checks_[1] = std::move(other.finite_checks_[1]);
  drift_sums_ = std::move(other.drift_sums_);
  drift_chunks_ = std::move(other.drift_chunks_);
  drift_outside_ = std::move(other.drift_outside_);
  sources_checked_ = other.sources_checked_ = false;  // the next run of either checks first
  return *this;
}

EMAKIT_FUNC UpdateKernel::Census UpdateKernel::census() const noexcept {
  Census c;
  for (const auto& l : plan_.lists)
    (l.kind == ListKind::lerp ? c.lerp : l.kind == ListKind::staged ? c.staged : c.copy) += 1;
  return c;
}

EMAKIT_FUNC void UpdateKernel::wait_for_update() const {
  EMAKIT_TEST_HOOK(testing::sync_counts().settles += 1);
  join_host();
  wait_for_model_reads();
}

EMAKIT_FUNC EMAKIT_OPTIMIZE_SEGMENT void UpdateKernel::check_sources_and_replan() {
  // Once per update and tensor: inline reads only (the cost model's many_small case counts them).
  const auto same_shape = [](c10::IntArrayRef sizes, const std::vector<std::int64_t>& shape) {
    if (sizes.size() != shape.size()) return false;
    for (std::size_t d = 0; d < shape.size(); ++d)
      if (sizes[d] != shape[d]) return false;
    return true;
  };
  // The TensorImpl's own accessors: at::Tensor's sizes() stays a call at -O1.
  bool stale = false;
  for (const auto& s : slots_) {
    if (!s.source.defined())
      fail("tensor '{}' of the model is no longer defined; make a new Ema for the changed model", s.name);
    const c10::TensorImpl* impl = s.source.unsafeGetTensorImpl();
    if (!same_shape(impl->sizes(), s.shape))
      fail("tensor '{}' changed shape from {} to {} since the EMA was bound; make a new Ema for the changed model",
           s.name, shape_string(s.shape), shape_string(s.source.sizes()));
    // The device is the storage's (on_memory): TensorImpl::device() is a call into libc10.
    stale = stale || impl->dtype() != caffe2::TypeMeta::fromScalarType(s.source_dtype) ||
            impl->is_contiguous() != s.source_contiguous || !on_memory(s.source, s.source_memory) ||
            !on_memory(s.average, s.average_memory);
  }
  if (stale) {
    wait_for_update();
    plan();
  }
  sources_checked_ = true;
}

EMAKIT_FUNC void UpdateKernel::plan() {
  plan_ = UpdatePlan(slots_, cpu_path_, side_stream_, staging_bytes_, arithmetic_);
  lanes_.clear();
  for (const auto& dev : plan_.lanes) lanes_.emplace_back(dev, side_stream_ == SideStream::on);
  finite_checks_[0] = NonFiniteCheck(slots_, /*copying=*/false, cpu_path_);
  finite_checks_[1] = NonFiniteCheck(slots_, /*copying=*/true, cpu_path_);
  drift_sums_.assign(2 * slots_.size(), 0.0);
  std::vector<bool> in_pass(slots_.size(), false);
  // The pass measures a slot against what it reads: the source itself, or a staging copy in the
  // source's dtype (strided, offloaded). A copy converted to a narrower average's dtype (an fp32
  // model with a bf16 average) is not the model: such slots are measured against the source after.
  for (const auto& seg : plan_.average_pass.segments())
    in_pass[seg.slot] = slots_[seg.slot].input().scalar_type() == slots_[seg.slot].source.scalar_type();
  drift_outside_.clear();
  for (std::size_t i = 0; i < slots_.size(); ++i)
    if (slots_[i].averaged && !in_pass[i] && slots_[i].average.numel() > 0) drift_outside_.push_back(i);
}

EMAKIT_FUNC void UpdateKernel::begin_run(const Job& job) {
  check_before_run();
  join_host();  // the previous offloaded pass must finish before this one touches its buffers
  if (job.measures_drift()) begin_drift();
}

EMAKIT_FUNC void UpdateKernel::run(const Job& job) {
  c10::NoGradGuard no_grad;
  begin_run(job);
  for (std::size_t k = 0; k < lanes_.size(); ++k) {
    run_lists(job, k, Stream::current);  // buffers, before the side stream starts
    Lane& lane = lanes_[k];
    auto guard = lane.begin();
    run_lists(job, k, Stream::side);
    lane.finish();
  }
  run_lists(job, no_lane, Stream::current);  // CPU foreach path, devices without streams
  run_lists(job, no_lane, Stream::side);
  if (plan_.offload_lanes.empty()) {
    run_cpu(job);
  } else if (side_stream_ == SideStream::on) {
    // The host waits for the device-to-host copies on a thread of its own, then runs the pass.
    host_ = std::make_shared<HostPass>(HostPass{std::async(std::launch::async, [this, job] {
      c10::NoGradGuard no_grad_here;
      for (auto k : plan_.offload_lanes) lanes_[k].synchronize_host();
      run_cpu(job);
    })});
  } else {
    for (auto k : plan_.offload_lanes) lanes_[k].synchronize_host();
    run_cpu(job);
  }
  if (job.measures_drift()) measure_drift_outside();
}

EMAKIT_FUNC void UpdateKernel::measure_drift_outside() {
  wait_for_update();  // the sums of the pass (a host thread's, offloaded) and the averages the others wrote
  if (drift_outside_.empty()) return;
  // Per slot, chunks of whole rows (flat for a 0-d tensor) of at most staging_bytes of the four
  // float temporaries (average, source, difference, its square); each chunk's two sums stay on the
  // device until one copy per device brings them all.
  std::vector<std::pair<std::size_t, at::Tensor>> parts;  // slot, [2] in double on the average's device
  for (auto i : drift_outside_) {
    const Slot& s = slots_[i];
    drift_sums_[2 * i] = drift_sums_[2 * i + 1] = 0.0;  // what the pass summed against a converted copy
    const auto type = s.average.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const std::int64_t rows = s.average.dim() == 0 ? 1 : s.average.size(0);
    const std::int64_t row = rows == 0 ? 1 : std::max<std::int64_t>(1, s.average.numel() / rows);
    const std::int64_t per_chunk = std::max<std::int64_t>(1, staging_bytes_ / (4 * 4) / row);
    for (std::int64_t r = 0; r < rows; r += per_chunk) {
      const std::int64_t count = std::min(per_chunk, rows - r);
      const at::Tensor a = s.average.dim() == 0 ? s.average : s.average.narrow(0, r, count);
      const at::Tensor x = s.source.dim() == 0 ? s.source : s.source.narrow(0, r, count);
      const at::Tensor xs = x.to(a.device(), type);
      const at::Tensor d = a.to(type) - xs;
      parts.emplace_back(i, at::stack({(d * d).sum(at::kDouble), (xs * xs).sum(at::kDouble)}));
    }
  }
  std::vector<bool> done(parts.size(), false);
  for (std::size_t p = 0; p < parts.size(); ++p) {
    if (done[p]) continue;
    const c10::Device dev = parts[p].second.device();
    std::vector<at::Tensor> same;
    std::vector<std::size_t> which;
    for (std::size_t q = p; q < parts.size(); ++q) {
      if (!done[q] && parts[q].second.device() == dev) {
        same.push_back(parts[q].second);
        which.push_back(q);
        done[q] = true;
      }
    }
    const at::Tensor host = at::stack(same).cpu().contiguous();
    const double* v = host.data_ptr<double>();
    for (std::size_t k = 0; k < which.size(); ++k) {
      const std::size_t slot = parts[which[k]].first;
      drift_sums_[2 * slot] += v[2 * k];
      drift_sums_[2 * slot + 1] += v[2 * k + 1];
    }
  }
}

EMAKIT_FUNC void UpdateKernel::run_lists(const Job& job, std::size_t k, Stream stream) {
  const bool averaging = job.kind == Kind::average, current = stream == Stream::current;
  const Weights& weights = job.weights;
  for (auto i : plan_.staged) {
    Slot& s = slots_[i];
    if (plan_.lane_of(s) == k && plan_.on_current(s) == current) stage_copy(s);
  }
  for (auto& l : plan_.lists) {
    if (l.lane != k || l.current != current) continue;
    switch (l.kind) {
      case ListKind::lerp:
        if (averaging) {
          foreach_average(arithmetic_, l.averages, l.inputs, weights, /*x_scratch=*/false);
        } else {
          foreach_copy(l.averages, l.inputs);
        }
        break;
      case ListKind::staged:
        if (averaging) {
          foreach_copy(l.inputs, l.sources);
          foreach_average(arithmetic_, l.averages, l.inputs, weights, /*x_scratch=*/true);
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

EMAKIT_FUNC void UpdateKernel::run_cpu(const Job& job) {
  const Weights& weights = job.weights;
  pass_of(job.kind).run(weights, pass_grain, job.measures_drift() ? drift_chunks_.data() : nullptr);
  if (job.measures_drift()) fold_drift();
  if (job.kind == Kind::average) {
    for (auto i : plan_.generic) {
      if (arithmetic_ == Arithmetic::lerp || arithmetic_ == Arithmetic::fused_lerp) {
        slots_[i].average.lerp_(slots_[i].input(), weights.weight);  // ATen's lerp (LibTorch 1.13 too)
      } else {
        const std::vector<at::Tensor> a{slots_[i].average}, x{slots_[i].input()};
        foreach_average(arithmetic_, a, x, weights, /*x_scratch=*/false);
      }
    }
    for (auto i : plan_.generic_copies)
      if (slots_[i].follows_averages) slots_[i].average.copy_(slots_[i].input());
  } else {
    for (auto i : plan_.generic) slots_[i].average.copy_(slots_[i].input());
    for (auto i : plan_.generic_copies) slots_[i].average.copy_(slots_[i].input());
  }
}

EMAKIT_FUNC void UpdateKernel::run_together(std::span<const Work> work, TogetherScratch& scratch) {
  c10::NoGradGuard no_grad;
  std::vector<GroupPass::Input>& passes = scratch.passes;  // keeps its capacity from call to call
  passes.clear();
  for (const Work& w : work) {
    UpdateKernel& k = *w.kernel;
    if (!k.sources_checked_) k.check_sources_and_replan();  // may re-plan: before asking the plan
    if (k.cpu_pass_only()) {
      k.begin_run(w.job);
      passes.push_back(
          {&k.pass_of(w.job.kind), w.job.weights, w.job.measures_drift() ? k.drift_chunks_.data() : nullptr});
    } else {
      k.run(w.job);
    }
  }
  if (passes.size() == 1) {
    passes.front().pass->run(passes.front().weights, pass_grain, passes.front().drift);
  } else if (passes.size() > 1) {
    GroupPass& group = scratch.group;  // keeps its grouping while the passes are the same
    group.build(passes);
    group.run(pass_grain);
    EMAKIT_TEST_HOOK({
      testing::SyncCounts& counts = testing::sync_counts();
      counts.fused_calls += 1;
      counts.fused_kernels += passes.size();
      counts.fused_groupings += group.reused() ? 0 : 1;
    });
  }
  for (const Work& w : work)
    if (w.job.measures_drift() && w.kernel->cpu_pass_only()) w.kernel->fold_drift();
}

EMAKIT_FUNC void UpdateKernel::fold_drift() noexcept {
  for (const auto& seg : plan_.average_pass.segments())
    fold_drift_chunks(drift_chunks_.data() + 2 * seg.chunk, drift_chunk_count(seg.n),
                      drift_sums_.data() + 2 * seg.slot);
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
