// Several EMAs of one model updated in one pass: a fast and a slow EMA, the profiles of post-hoc
// EMA, a fixed and a warmup EMA side by side. Each keeps its own decay, schedule, options,
// counters and checkpoint, and decides for itself whether this step skips, copies or averages;
// the result is exactly (bitwise, with the same UpdateResults, drift included) that of calling
// each one's update() in turn, but on CPU the model is read once for all of them instead of once
// each:
//
//   emakit::Ema<emakit::Fixed> fast(*model, emakit::Fixed(0.99)), slow(*model, emakit::Fixed(0.9999));
//   ...
//   optimizer.step();
//   emakit::update_together(fast, slow);                 // or (emakit::StepInfo{.vetoed = true}, fast, slow)
//
// An fp32 update reads 4 bytes of the model and reads and writes 8 of the average per element: K
// EMAs updated apart move 12K bytes per element, together 4 + 8K (1.2x less for K = 2, 1.33x for K
// = 4; a bf16 model into fp32 averages: 10K against 2 + 8K; docs/performance.md). The members whose
// whole update is the fused CPU pass (CPU averages of the dtype pairs it reads) share the pass; any
// other member (CUDA: ATen has no op that writes several outputs from one read; offloaded, staged
// or rare-dtype CPU tensors) runs its own update's kernel in the same call, with the same result.
// Refused, before anything changes: an Ema given twice, members bound to different models, a member
// with EmaOptions::switch_model (it writes the model the others read), and what update() refuses
// for any member (a swap open, an update running, a step going back).
//
// A trainer that updates the same EMAs every step keeps them in an EmaGroup: it checks its members
// once, keeps what a call needs from call to call, and then allocates nothing per update:
//
//   emakit::EmaGroup group(fast, slow);                  // or (std::span(emas)) for a std::vector of EMAs
//   group.update();                                      // each step; group.update({.vetoed = true})
//
// EMAs of several types held by their base (std::vector<std::unique_ptr<emakit::EmaBase>>) make a
// group by pointer: EmaGroup(std::vector<emakit::EmaBase*>{...}).
//
// The members must outlive the group and stay where they are (a std::vector of EMAs is not resized
// while a group holds its elements); a member moved from is refused by name at the next update.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/ema.hpp>

#include <array>
#include <concepts>
#include <span>
#include <type_traits>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// K EMAs of one model, updated together at every step (see the top of this file).
class EmaGroup {
 public:
  template <std::derived_from<EmaBase>... E>
    requires(sizeof...(E) >= 1)
  explicit EmaGroup(E&... emas) : core_(std::vector<EmaBase*>{&emas...}), results_(sizeof...(E)) {}
  // The EMAs of a range (a std::vector<Ema<...>>); an empty range updates nothing.
  template <std::derived_from<EmaBase> E>
  explicit EmaGroup(std::span<E> emas) : core_(members_of(emas)), results_(emas.size()) {}
  // EMAs of any types, by pointer (the elements of a std::vector<std::unique_ptr<EmaBase>>, say);
  // a null pointer is refused, naming it.
  explicit EmaGroup(std::vector<EmaBase*> emas) : core_(std::move(emas)), results_(core_.size()) {}

  // Each member's update(info), in one pass: one UpdateResult per member, in the order given
  // (valid until the next update()).
  std::span<const UpdateResult> update(const StepInfo& info = {}) {
    core_.update(info, results_);
    return results_;
  }
  std::size_t size() const noexcept { return results_.size(); }

 private:
  template <class E>
  static std::vector<EmaBase*> members_of(std::span<E> emas) {
    std::vector<EmaBase*> members;
    members.reserve(emas.size());
    for (E& e : emas) members.push_back(&e);
    return members;
  }

  detail::GroupCore core_;
  std::vector<UpdateResult> results_;
};

// update_together(info, a, b, ...): each EMA's update(info), in one pass (an EmaGroup for this
// call; keep an EmaGroup to update the same EMAs every step without allocating).
template <std::derived_from<EmaBase>... E>
  requires(sizeof...(E) >= 1)
std::array<UpdateResult, sizeof...(E)> update_together(const StepInfo& info, E&... emas) {
  detail::GroupCore group(std::vector<EmaBase*>{&emas...});
  std::array<UpdateResult, sizeof...(E)> out;
  group.update(info, out);
  return out;
}

// update_together(a, b, ...): each EMA's update(), in one pass.
template <std::derived_from<EmaBase>... E>
  requires(sizeof...(E) >= 1)
std::array<UpdateResult, sizeof...(E)> update_together(E&... emas) { return update_together(StepInfo{}, emas...); }

// A range of EMAs of one type (a std::vector<Ema<...>>): each one's update(info), in one pass. An
// empty range updates nothing and returns an empty vector.
template <std::derived_from<EmaBase> E>
std::vector<UpdateResult> update_together(std::span<E> emas, const StepInfo& info = {}) {
  EmaGroup group(emas);
  const auto results = group.update(info);
  return std::vector<UpdateResult>(results.begin(), results.end());
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
