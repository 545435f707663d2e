// The non-template definitions of cpu_pass.hpp: included at the end of cpu_pass.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/cpu_pass-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/cpu_pass.hpp> instead"
#endif

#include <emakit/detail/cpu_pass.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void CpuPass::add(SegmentFn fn, std::size_t slot, std::int64_t n, std::int64_t cost, void* a,
                              const void* x) {
  if (n == 0) return;
  segments_.push_back(Segment{fn, slot, n, cost, total_, chunks_, a, x});
  total_ += n * cost;
  chunks_ += drift_chunk_count(n);
}

EMAKIT_FUNC void CpuPass::run(Weights weights, std::int64_t grain, double* drift) const {
  if (segments_.empty()) return;
  at::parallel_for(0, total_, grain,
                   [&](std::int64_t begin, std::int64_t end) { run_share(begin, end, weights, drift); });
}

EMAKIT_FUNC EMAKIT_OPTIMIZE_SEGMENT void CpuPass::run_share(std::int64_t c0, std::int64_t c1, Weights weights,
                                                            double* drift) const {
  if (c0 <= 0 && c1 >= total_) {  // the whole pass (one thread): no cuts to find
    if (drift == nullptr) {
      for (const Segment& s : segments_) s.fn(s.a, s.x, 0, s.n, weights, nullptr);
    } else {
      for (const Segment& s : segments_) s.fn(s.a, s.x, 0, s.n, weights, drift + 2 * s.chunk);
    }
    return;
  }
  auto it = std::upper_bound(segments_.begin(), segments_.end(), c0,
                             [](std::int64_t c, const Segment& s) { return c < s.begin; });
  if (it != segments_.begin()) --it;
  for (; it != segments_.end() && it->begin < c1; ++it) {
    // A segment inside the share (all but its first and last) needs no division.
    const std::int64_t lo = c0 <= it->begin ? 0 : element_at(it->begin, it->cost, it->n, c0);
    const std::int64_t hi = c1 >= it->begin + it->n * it->cost ? it->n : element_at(it->begin, it->cost, it->n, c1);
    if (lo >= hi) continue;
    // lo is a whole number of drift chunks into the segment (element_at)
    it->fn(it->a, it->x, lo, hi, weights, drift == nullptr ? nullptr : drift + 2 * (it->chunk + lo / drift_chunk));
  }
}

EMAKIT_FUNC std::int64_t CpuPass::element_at(std::int64_t begin, std::int64_t cost, std::int64_t n,
                                             std::int64_t c) noexcept {
  if (c <= begin) return 0;
  const std::int64_t e = (c - begin + cost - 1) / cost;
  const std::int64_t aligned = (e + align_elements - 1) / align_elements * align_elements;
  return std::min(n, aligned);
}

EMAKIT_FUNC bool GroupPass::same_inputs(std::span<const Input> passes) noexcept {
  if (passes.empty()) return false;
  const auto& first = passes.front().pass->segments();
  for (const Input& p : passes.subspan(1)) {
    const auto& segments = p.pass->segments();
    if (segments.size() != first.size()) return false;
    for (std::size_t i = 0; i < segments.size(); ++i)
      if (segments[i].x != first[i].x || segments[i].n != first[i].n) return false;
  }
  return true;
}

EMAKIT_FUNC void GroupPass::build(std::span<const Input> passes) {
  reused_ = passes.size() == built_from_.size() &&
            std::equal(passes.begin(), passes.end(), built_from_.begin(), [](const Input& p, const auto& b) {
              return p.pass == b.first && p.pass->generation() == b.second;
            });
  drift_ = std::any_of(passes.begin(), passes.end(), [](const Input& p) { return p.drift != nullptr; });
  if (reused_) {
    for (Entry& e : entries_) {
      e.weights = passes[e.pass].weights;
      e.drift = passes[e.pass].drift != nullptr ? passes[e.pass].drift + 2 * e.chunk : nullptr;
    }
    return;
  }
  built_from_.clear();
  for (const Input& p : passes) built_from_.emplace_back(p.pass, p.pass->generation());
  groups_.clear();
  entries_.clear();
  index_.clear();
  group_of_.clear();
  total_ = 0;
  // Groups in the order their input first appears; a segment joins the group of its input. Members
  // of one model read its tensors in the same order (the usual case): the i-th segment of every
  // pass is then the i-th group, found without the hash of the inputs, whose 2000 nodes for 2000
  // tensors were most of an update_together's cost, allocated anew at every call (the cost model:
  // together2/many_small). A tensor that one pass reads twice (the same tensor under two names)
  // is then two groups: it is read twice, with the same results.
  const bool by_position = same_inputs(passes);
  if (by_position) {
    const auto& first_segments = passes.front().pass->segments();
    groups_.reserve(first_segments.size());
    for (const auto& seg : first_segments) groups_.push_back(Group{seg.x, seg.n, 0, 0, 0, 0, 0});
    for (const Input& p : passes) {
      std::size_t i = 0;
      for (const auto& seg : p.pass->segments()) {
        groups_[i].cost += seg.cost;
        ++groups_[i++].count;
      }
    }
  } else {
    for (const Input& p : passes) {
      for (const auto& seg : p.pass->segments()) {
        const auto [it, added] = index_.try_emplace(Key{seg.x, seg.n}, groups_.size());
        if (added) groups_.push_back(Group{seg.x, seg.n, 0, 0, 0, 0, 0});
        Group& g = groups_[it->second];
        g.cost += seg.cost;
        ++g.count;
        group_of_.push_back(it->second);
      }
    }
  }
  // Each group's entries side by side, in the order of `passes`.
  std::size_t first = 0;
  for (Group& g : groups_) {
    g.begin = total_;
    g.first = first;
    first += g.count;
    g.count = 0;
    total_ += g.n * g.cost;
    const std::int64_t fit = block_bytes / g.cost / CpuPass::align_elements * CpuPass::align_elements;
    g.block = std::clamp(fit, min_block_elements, max_block_elements);
  }
  entries_.resize(first);
  std::size_t k = 0;
  for (std::size_t p = 0; p < passes.size(); ++p) {
    std::size_t i = 0;  // the segment's index in its pass: its group, by position
    for (const auto& seg : passes[p].pass->segments()) {
      Group& g = groups_[by_position ? i++ : group_of_[k++]];
      double* drift = passes[p].drift != nullptr ? passes[p].drift + 2 * seg.chunk : nullptr;
      entries_[g.first + g.count++] = Entry{seg.fn, seg.a, passes[p].weights, drift, seg.chunk, p};
    }
  }
}

EMAKIT_FUNC void GroupPass::run(std::int64_t grain) const {
  if (groups_.empty()) return;
  at::parallel_for(0, total_, grain, [&](std::int64_t begin, std::int64_t end) { run_share(begin, end); });
}

EMAKIT_FUNC EMAKIT_OPTIMIZE_SEGMENT void GroupPass::run_share(std::int64_t c0, std::int64_t c1) const {
  auto it =
      std::upper_bound(groups_.begin(), groups_.end(), c0, [](std::int64_t c, const Group& g) { return c < g.begin; });
  if (it != groups_.begin()) --it;
  for (; it != groups_.end() && it->begin < c1; ++it) {
    const std::int64_t lo = c0 <= it->begin ? 0 : CpuPass::element_at(it->begin, it->cost, it->n, c0);
    const std::int64_t hi =
        c1 >= it->begin + it->n * it->cost ? it->n : CpuPass::element_at(it->begin, it->cost, it->n, c1);
    if (lo >= hi) continue;
    const void* x = it->x;
    // lo and every block start are whole drift chunks into the group's tensor (element_at, and
    // blocks of whole chunks when a member measures drift): each chunk's sums are one call's.
    const std::int64_t block = drift_ ? (it->block + drift_chunk - 1) / drift_chunk * drift_chunk : it->block;
    for (std::int64_t b = lo; b < hi; b += block) {
      const std::int64_t e = std::min(hi, b + block);
      for (std::size_t k = it->first; k < it->first + it->count; ++k) {
        const Entry& entry = entries_[k];
        entry.fn(entry.a, x, b, e, entry.weights,
                 entry.drift == nullptr ? nullptr : entry.drift + 2 * (b / drift_chunk));
      }
    }
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
