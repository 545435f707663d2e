// Schedule policies: at each call of Ema::update(), skip, copy the model, or average.
//
// StepSchedule covers every reference behaviour with six options:
//
// | option        | meaning                                                                   |
// |---------------|---------------------------------------------------------------------------|
// | start_step    | the first step that may average                                           |
// | warmup        | what happens before start_step and at the first update (see Warmup)       |
// | update_every  | only steps with (step - every_offset) % update_every == 0 are eligible     |
// | every_offset  | 0: steps N, 2N, ... (EMAHook); 1: steps 1, N+1, 2N+1, ... (ema-pytorch)    |
// | accumulate    | update() is called per micro-batch; one optimizer step per `accumulate`    |
// |               | calls                                                                      |
// | window_edge   | where in an accumulation window the step happens: end (default) or start   |
// |               | (luxonis-train)                                                            |
//
// A call with `vetoed` set (the optimizer skipped its step, e.g. a gradient-scaler overflow)
// never changes the average and completes no step.
//
// Steps count completed optimizer steps from 1: each call that is not vetoed completes one,
// unless the caller supplies the step (timm passes its optimizer step) or an accumulation
// window groups calls into steps (one step per window).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/check.hpp>

#include <cstdint>
#include <string_view>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

enum class Warmup : std::uint8_t {
  // The average starts as a copy of the model when the EMA is made; steps before start_step
  // do nothing; eligible steps from start_step on average (timm, luxonis-train, the plain loop).
  none = 0,
  // ema-pytorch: the very first update copies; eligible steps before start_step copy; eligible
  // steps from start_step on average.
  copy_before_start = 1,
  // torch AveragedModel, nvalchemi EMAHook: steps before start_step do nothing; the first
  // eligible update copies; later eligible updates average.
  skip_before_start = 2,
};

enum class WindowEdge : std::uint8_t { end = 0, start = 1 };

class StepSchedule {
 public:
  static constexpr std::string_view name = "StepSchedule";

  StepSchedule() = default;

  std::int64_t start_step() const noexcept { return start_step_; }
  StepSchedule& start_step(std::int64_t value) {
    detail::check_non_negative_int(value, "StepSchedule::start_step");
    start_step_ = value;
    return *this;
  }
  Warmup warmup() const noexcept { return warmup_; }
  StepSchedule& warmup(Warmup value) {
    if (static_cast<int>(value) > 2)
      detail::fail("StepSchedule::warmup must be none, copy_before_start or skip_before_start, got {}",
                   static_cast<int>(value));
    warmup_ = value;
    return *this;
  }
  std::int64_t update_every() const noexcept { return update_every_; }
  StepSchedule& update_every(std::int64_t value) {
    detail::check_positive_int(value, "StepSchedule::update_every");
    update_every_ = value;
    return *this;
  }
  std::int64_t every_offset() const noexcept { return every_offset_; }
  StepSchedule& every_offset(std::int64_t value) {
    detail::check_non_negative_int(value, "StepSchedule::every_offset");
    every_offset_ = value;
    return *this;
  }
  std::int64_t accumulate() const noexcept { return accumulate_; }
  StepSchedule& accumulate(std::int64_t value) {
    detail::check_positive_int(value, "StepSchedule::accumulate (accumulation window)");
    accumulate_ = value;
    return *this;
  }
  WindowEdge window_edge() const noexcept { return window_edge_; }
  StepSchedule& window_edge(WindowEdge value) {
    if (static_cast<int>(value) > 1)
      detail::fail("StepSchedule::window_edge must be end or start, got {}", static_cast<int>(value));
    window_edge_ = value;
    return *this;
  }

  Decision decide(const ScheduleInput& in) const noexcept {
    const std::int64_t n = accumulate_;
    const bool at_edge = n == 1 || (window_edge_ == WindowEdge::end ? in.call % n == 0 : (in.call - 1) % n == 0);
    // An optimizer step completes at the window's edge, unless it was vetoed (skipped).
    // (Counted only without a given step: a given step may follow a previous step of INT64_MAX.)
    const std::int64_t step = in.given_step ? *in.given_step : in.previous_step + (at_edge && !in.vetoed ? 1 : 0);
    if (in.vetoed || !at_edge) return {Action::skipped, step};

    const std::int64_t phase = (step - every_offset_) % update_every_;
    const bool eligible = phase == 0;
    const bool started = step >= start_step_;
    switch (warmup_) {
      case Warmup::copy_before_start:
        if (in.num_updates == 0) return {Action::copied, step};
        if (!eligible) return {Action::skipped, step};
        return {started ? Action::averaged : Action::copied, step};
      case Warmup::skip_before_start:
        if (!started || !eligible) return {Action::skipped, step};
        return {in.num_updates == 0 ? Action::copied : Action::averaged, step};
      case Warmup::none:
      default: return {started && eligible ? Action::averaged : Action::skipped, step};
    }
  }

  std::vector<Field> fields() const {
    return {{"start_step", static_cast<double>(start_step_), true},
            {"warmup", static_cast<double>(warmup_), true},
            {"update_every", static_cast<double>(update_every_), true},
            {"every_offset", static_cast<double>(every_offset_), true},
            {"accumulate", static_cast<double>(accumulate_), true},
            {"window_edge", static_cast<double>(window_edge_), true}};
  }
  bool operator==(const StepSchedule&) const = default;

 private:
  std::int64_t start_step_ = 0;
  Warmup warmup_ = Warmup::none;
  std::int64_t update_every_ = 1;
  std::int64_t every_offset_ = 0;
  std::int64_t accumulate_ = 1;
  WindowEdge window_edge_ = WindowEdge::end;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
