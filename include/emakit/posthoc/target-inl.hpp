// The non-template definitions of target.hpp: included at the end of target.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/posthoc/target-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/posthoc/target.hpp> instead"
#endif

#include <emakit/posthoc/target.hpp>

#include <emakit/detail/check.hpp>
#include <emakit/presets.hpp>

#include <fmt/core.h>
#include <fmt/ranges.h>  // fmt::join

#include <array>
#include <limits>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC std::vector<TargetUpdate> EmaTarget::updates(std::int64_t last_step) const {
  detail::check_positive_int(last_step, "EmaTarget::updates last_step");
  // The counters of EmaBase (ema-inl.hpp: prepare, prepare_decided, and the update's end), for a
  // run whose every call completes as the schedule decides: no step supplied, none vetoed.
  std::int64_t calls = 0, step = 0, num_updates = 0, last_update_step = 0;
  std::vector<TargetUpdate> out;
  // A schedule that completes a step at least every 1024 calls reaches last_step; one that does not
  // never would.
  const std::int64_t max_calls = last_step > std::numeric_limits<std::int64_t>::max() / 1024
                                     ? std::numeric_limits<std::int64_t>::max()
                                     : last_step * 1024;
  while (true) {
    if (calls == max_calls)
      detail::fail("EmaTarget ({}): the schedule completed {} steps in {} calls, not the {} the target needs; a "
                   "synthesis target's schedule must complete a step every call, or every few (accumulate)",
                   description_, step, calls, last_step);
    const Decision decision = decide_(ScheduleInput{calls + 1, std::nullopt, step, num_updates, false});
    if (decision.step > last_step) break;
    if (decision.step < step)
      detail::fail("EmaTarget ({}): the schedule went back from step {} to step {}", description_, step, decision.step);
    if (decision.action == Action::copied) {
      out.push_back({decision.step, 0.0});
    } else if (decision.action == Action::averaged) {
      const DecayInput in{decision.step, num_updates + 1, decision.step - last_update_step};
      const detail::Weights w = weights_(in);
      if (!(w.decay >= 0.0 && w.decay <= 1.0 && w.weight >= 0.0 && w.weight <= 1.0))
        detail::fail("EmaTarget: decay policy {} gave d = {} at step {} (update {}); d must be in [0, 1]", decay_name_,
                     w.decay, in.step, in.update);
      out.push_back({decision.step, w.decay});
    }
    calls += 1;
    step = decision.step;
    if (decision.action != Action::skipped) {
      num_updates += 1;
      last_update_step = decision.step;
    }
  }
  return out;
}

EMAKIT_FUNC TargetWeights EmaTarget::weights(std::int64_t last_step) const {
  const std::vector<TargetUpdate> ups = updates(last_step);
  TargetWeights out;
  out.weights.assign(static_cast<std::size_t>(last_step) + 1, 0.0);
  double kept = 1.0;  // prod of the decays after the update at hand
  for (auto it = ups.rbegin(); it != ups.rend(); ++it) {
    out.weights[static_cast<std::size_t>(it->step)] += (1.0 - it->decay) * kept;
    kept *= it->decay;
  }
  out.weights[0] += kept;
  for (const TargetUpdate& u : ups) out.updates.push_back(u.step);
  return out;
}

namespace detail {
struct PresetTarget {
  std::string_view name;
  EmaTarget (*make)();
};
EMAKIT_FUNC const std::array<PresetTarget, 9>& preset_targets() {
  static const std::array<PresetTarget, 9> table = {{
      {"ema_pytorch",
       [] { return EmaTarget(ema_pytorch_decay(EmaPytorchOptions()), ema_pytorch_schedule(EmaPytorchOptions())); }},
      {"timm_model_ema_v3", [] { return EmaTarget(timm_v3_decay(TimmModelEmaV3Options()), StepSchedule()); }},
      {"averaged_model_ema", [] { return EmaTarget(Fixed(AveragedModelOptions().decay), averaged_model_schedule()); }},
      {"averaged_model_swa", [] { return EmaTarget(Uniform(), averaged_model_schedule()); }},
      {"nvalchemi_ema",
       [] { return EmaTarget(Fixed(NvalchemiEmaOptions().decay), nvalchemi_ema_schedule(NvalchemiEmaOptions())); }},
      {"luxonis_model_ema",
       [] {
         const LuxonisModelEmaOptions o;
         return EmaTarget(ExponentialRamp(o.decay, o.decay_tau), StepSchedule());
       }},
      {"diffusers_ema_model", [] { return EmaTarget(diffusers_decay(DiffusersEmaModelOptions()), StepSchedule()); }},
      {"diffusers_ema_model_warmup",
       [] { return EmaTarget(diffusers_warmup_decay(DiffusersEmaModelOptions()), StepSchedule()); }},
      {"lightning_ema_weight_averaging",
       [] {
         const LightningEmaWeightAveragingOptions o;
         return EmaTarget(Fixed(o.decay), lightning_ema_schedule(o));
       }},
  }};
  return table;
}
}  // namespace detail

EMAKIT_FUNC std::vector<std::string_view> preset_target_names() {
  std::vector<std::string_view> out;
  for (const auto& p : detail::preset_targets()) out.push_back(p.name);
  return out;
}

EMAKIT_FUNC EmaTarget preset_target(std::string_view preset) {
  for (const auto& p : detail::preset_targets())
    if (p.name == preset) return p.make();
  detail::fail("preset_target: no preset named '{}'; the presets are {}", preset,
               fmt::join(preset_target_names(), ", "));
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
