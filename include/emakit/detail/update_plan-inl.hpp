// The non-template definitions of update_plan.hpp: included at the end of
// update_plan.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/update_plan-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/update_plan.hpp> instead"
#endif

#include <emakit/detail/update_plan.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC UpdatePlan::UpdatePlan(std::vector<Slot>& slots, CpuPath cpu_path, SideStream side_stream,
                                   std::int64_t staging_bytes, Arithmetic arithmetic)
    : side_stream_(side_stream == SideStream::on), arithmetic_(arithmetic) {
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Slot& s = slots[i];
    s.source_device = s.source.device();
    s.source_dtype = s.source.scalar_type();
    s.source_contiguous = s.source.is_contiguous();
    s.source_memory = memory_of(s.source);
    s.average_memory = memory_of(s.average);
    s.staging = at::Tensor();
    const auto a_dev = s.average.device();
    if (a_dev.is_cuda()) lane_for(a_dev);
    if (s.source_device.is_cuda() && !a_dev.is_cuda()) {
      const std::size_t k = lane_for(s.source_device);
      if (std::find(offload_lanes.begin(), offload_lanes.end(), k) == offload_lanes.end()) offload_lanes.push_back(k);
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

EMAKIT_FUNC void UpdatePlan::plan_pool(const std::vector<Slot>& slots, const std::vector<std::size_t>& group,
                                       std::int64_t staging_bytes) {
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
      lists.push_back(ForeachList{
          ListKind::staged, s.average.device(), s.average.scalar_type(), lane_of(s), on_current(s), true, {}, {}, {}});
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
      std::tie(lerp, copy) = segment_fns<A, S>(arithmetic_);
    });
  } else if (in_type == a_type) {
    copy = byte_copy_fn(s.average.element_size());
  }
  // Where the slot's data is now: the kernel re-plans before a run if it moves
  // (check_sources_and_replan).
  void* average = n == 0 ? nullptr : s.average.data_ptr();
  const void* input = n == 0 ? nullptr : read_ptr(s.input());
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
