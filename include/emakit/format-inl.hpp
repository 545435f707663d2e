// The non-template definitions of format.hpp: included at the end of format.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/format-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/format.hpp> instead"
#endif

#include <emakit/format.hpp>

#include <fmt/format.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC std::string describe_fields(std::string_view name, const std::vector<Field>& fields) {
  std::string out(name);
  out += '(';
  bool first = true;
  for (const auto& f : fields) {
    if (!first) out += ", ";
    first = false;
    out += fmt::format("{}={}", f.name, value_string(f.value, f.is_integer));
  }
  out += ')';
  return out;
}

EMAKIT_FUNC std::string describe_step_schedule(const StepSchedule& p) {
  return fmt::format("StepSchedule(start_step={}, warmup={}, update_every={}, every_offset={}, accumulate={}, "
                     "window_edge={})",
                     p.start_step(), to_string(p.warmup()), p.update_every(), p.every_offset(), p.accumulate(),
                     to_string(p.window_edge()));
}

EMAKIT_FUNC std::string describe_ema(const EmaSummary& e) {
  // Frozen parameters are named only when an option changed what happens to them.
  std::string frozen;
  if (e.frozen_mode != TensorMode::average)
    frozen = fmt::format(" ({} frozen parameter{} {})", e.frozen, e.frozen == 1 ? "" : "s",
                         e.frozen_mode == TensorMode::copy ? "copied" : "left out");
  // The window: an average over about 1/(1 - d) steps (after an update; d = 1 never forgets).
  std::string window;
  if (e.updates > 0 && e.decay_now >= 0.0 && e.decay_now <= 1.0)
    window = fmt::format(", window={:.4g} steps", 1.0 / (1.0 - e.decay_now));
  std::string drift;
  if (e.drift)
    drift = fmt::format(", drift={:.4g} at step {} (farthest '{}' {:.4g})", e.drift->relative, e.drift->step,
                        e.drift->farthest, e.drift->farthest_relative);
  return fmt::format(
      "Ema(decay={}, schedule={}, storage={}, tensors={} averaged + {} copied{}, calls={}, step={}, updates={}, "
      "decay_now={}{}{})",
      e.decay, e.schedule, e.storage, e.averaged, e.copied, frozen, e.calls, e.step, e.updates, e.decay_now, window,
      drift);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
