// The definitions of presets.hpp that do not depend on a storage type: included at the end
// of presets.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program
// by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/presets-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/presets.hpp> instead"
#endif

#include <emakit/presets.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC void detail::check_diffusers_options(const DiffusersEmaModelOptions& o, bool warmup) {
  if (o.use_ema_warmup && !warmup)
    detail::fail("diffusers_ema_model: use_ema_warmup is true, but this preset computes the TensorFlow ramp "
                 "(RationalRamp); call emakit::diffusers_ema_model_warmup() for diffusers' use_ema_warmup=True");
  if (!(o.min_decay >= 0.0 && o.min_decay <= o.decay))
    detail::fail("diffusers EMAModel: min_decay must be in [0, decay = {}], got {}", o.decay, o.min_decay);
}

EMAKIT_FUNC StepSchedule lightning_ema_schedule(const LightningEmaWeightAveragingOptions& o) {
  detail::check_positive_int(o.update_every_n_steps, "EMAWeightAveraging update_every_n_steps");
  const std::int64_t first = o.update_starting_at_step.value_or(0);
  detail::check_non_negative_int(first, "EMAWeightAveraging update_starting_at_step");
  // Lightning's index i = global_step - 1 is eligible when i >= first and i % n == 0: emakit's
  // step s = i + 1, so s >= first + 1 and (s - 1) % n == 0; the first eligible update copies.
  return StepSchedule()
      .warmup(Warmup::skip_before_start)
      .start_step(first + 1)
      .update_every(o.update_every_n_steps)
      .every_offset(1);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
