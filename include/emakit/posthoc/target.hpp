// Any EMA as a post-hoc synthesis target: the weight an EMA of given decay and schedule policies
// puts on each past step's model, computed by running the policies themselves.
//
// An EMA made before step 1 from the model theta_0 and updated once per optimizer step holds, after
// step T, sum_s v[s] theta_s: each update at step s with decay d_s (0 for a copy) gives
// v[s] = (1 - d_s) prod_{r > s} d_r and v[0] = prod_r d_r, and the v sum to 1. EmaTarget runs the
// schedule's decide() and the decay's weights exactly as Ema::update() does (the same counters,
// detail::update_weights), so the target is the live EMA's weighting of the past, whatever the
// policies: a preset's, a user's own.
//
//   auto plan = emakit::plan_synthesis("runs/a/phema",
//                                      emakit::SynthesisOptions(emakit::EmaTarget(emakit::Fixed(0.999))));
//   auto timm = emakit::EmaTarget::of(live_ema);                 // the policies of an Ema or a Recipe
//   auto diffusers = emakit::preset_target("diffusers_ema_model"); // a preset with the peer's defaults
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/posthoc/part.hpp>
#include <emakit/concepts.hpp>
#include <emakit/ema.hpp>
#include <emakit/format.hpp>
#include <emakit/posthoc/profile_math.hpp>
#include <emakit/schedule.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// One update an EMA applies: at `step`, ema = decay * ema + (1 - decay) * model (decay 0: a copy).
struct TargetUpdate {
  std::int64_t step = 0;
  double decay = 0;
};

// An EMA's decay and schedule policies, erased: what a synthesis fits (SynthesisOptions).
class EmaTarget {
 public:
  template <DecayPolicy D, SchedulePolicy S = StepSchedule>
  explicit EmaTarget(D decay, S schedule = S())
      : description_(detail::describe_policy(decay) + ", " + detail::describe_policy(schedule)),
        decay_name_(detail::policy_name<D>()),
        decide_([schedule = std::move(schedule)](const ScheduleInput& in) { return schedule.decide(in); }),
        weights_([decay = std::move(decay)](const DecayInput& in) { return detail::update_weights(decay, in); }) {}

  // The policies of an Ema (decay_policy(), schedule()) or of a Recipe (decay, schedule).
  template <class E>
  static EmaTarget of(const E& ema_or_recipe) {
    if constexpr (requires { ema_or_recipe.decay_policy(); })
      return EmaTarget(ema_or_recipe.decay_policy(), ema_or_recipe.schedule());
    else
      return EmaTarget(ema_or_recipe.decay, ema_or_recipe.schedule);
  }

  // "Fixed(decay=0.999), StepSchedule(...)": the policies, as fmt prints an Ema's.
  const std::string& description() const noexcept { return description_; }

  // The updates an Ema of these policies makes over steps 1..last_step when it is made before step
  // 1 and update() is called once per optimizer step (accumulate calls per step for a schedule
  // that accumulates), no step supplied and none vetoed. Throws if a decay lies outside [0, 1],
  // naming it, or if the schedule does not reach last_step.
  EMAKIT_FUNC std::vector<TargetUpdate> updates(std::int64_t last_step) const;

  // The weight of each step's model in that EMA after last_step: weights[s] for the model after
  // step s, weights[0] for the model the EMA was made from (they sum to 1), and the steps of its
  // updates (copies included).
  EMAKIT_FUNC TargetWeights weights(std::int64_t last_step) const;

 private:
  std::string description_;
  std::string_view decay_name_;
  std::function<Decision(const ScheduleInput&)> decide_;
  std::function<detail::Weights(const DecayInput&)> weights_;
};

// A preset's EMA with its peer's defaults (presets.hpp), by the preset's name: "ema_pytorch",
// "timm_model_ema_v3", "averaged_model_ema", "averaged_model_swa", "nvalchemi_ema",
// "luxonis_model_ema", "diffusers_ema_model", "diffusers_ema_model_warmup",
// "lightning_ema_weight_averaging". For other options, EmaTarget(emakit::timm_v3_decay({...})) or
// EmaTarget::of(a recipe or an Ema). Throws for another name, listing these.
EMAKIT_FUNC EmaTarget preset_target(std::string_view preset);

// The names preset_target() takes.
EMAKIT_FUNC std::vector<std::string_view> preset_target_names();

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/posthoc/target-inl.hpp>
#endif
