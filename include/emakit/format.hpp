// fmt formatters for every emakit policy, for Action, Warmup, UpdateResult and for an Ema
// (config and counters on one line):
//
//   fmt::print("{}\n", ema);
//   // Ema(decay=InversePowerWarmup(beta=0.9999, inv_gamma=1, power=0.6666666666666666, min_value=0,
//   //     update_after_step=0), schedule=StepSchedule(start_step=0, warmup=none, ...),
//   //     storage=FlatStorage, tensors=4 averaged + 1 copied, calls=10, step=10, updates=10, decay_now=0.77)
#pragma once

#include <emakit/aliases.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/config.hpp>
#include <emakit/ema.hpp>
#include <emakit/schedule.hpp>

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

inline std::string_view to_string(Action a) noexcept {
  switch (a) {
    case Action::skipped: return "skipped";
    case Action::copied: return "copied";
    case Action::averaged: return "averaged";
  }
  return "?";
}

inline std::string_view to_string(Warmup w) noexcept {
  switch (w) {
    case Warmup::none: return "none";
    case Warmup::copy_before_start: return "copy_before_start";
    case Warmup::skip_before_start: return "skip_before_start";
  }
  return "?";
}

inline std::string_view to_string(WindowEdge e) noexcept { return e == WindowEdge::end ? "end" : "start"; }

namespace detail {
// A policy that emakit prints: it satisfies one of the policy concepts and names itself.
template <class P>
concept PrintablePolicy = (DecayPolicy<P> || SchedulePolicy<P> || StoragePolicy<P>)&&requires {
  P::name;
};

// The text of a policy's description, and of an Ema's (format-inl.hpp): compiled once, not per
// policy or Ema type.
EMAKIT_FUNC std::string describe_fields(std::string_view name, const std::vector<Field>& fields);
EMAKIT_FUNC std::string describe_step_schedule(const StepSchedule& s);
struct EmaSummary {
  std::string decay, schedule, storage;
  std::size_t averaged = 0, copied = 0;
  std::size_t frozen = 0;  // parameters EmaOptions::frozen_parameters() applied to
  TensorMode frozen_mode = TensorMode::average;
  std::int64_t calls = 0, step = 0, updates = 0;
  double decay_now = 0;
  std::optional<Drift> drift;  // the last measured (EmaOptions::drift_every)
};
EMAKIT_FUNC std::string describe_ema(const EmaSummary& e);

template <class P>
std::string describe_policy(const P& p) {
  if constexpr (std::is_same_v<P, StepSchedule>) {
    return describe_step_schedule(p);
  } else if constexpr (DescribedPolicy<P>) {
    return describe_fields(P::name, p.fields());
  } else {
    return std::string(policy_name<P>());  // P::name, or "custom:<type>" as checkpoints name it
  }
}
}  // namespace detail

// What fmt::print("{}", ema) prints: config and counters on one line (see the top of this file).
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
std::string describe(const Ema<D, S, St>& ema) {
  return detail::describe_ema({detail::describe_policy(ema.decay_policy()), detail::describe_policy(ema.schedule()),
                               detail::describe_policy(ema.storage()), ema.names(Role::average).size(),
                               ema.names(Role::copy).size(), ema.frozen_parameters().size(),
                               ema.options().frozen_parameters(), ema.calls(), ema.step(), ema.num_updates(),
                               ema.decay(), ema.last_drift()});
}

// EMAKIT_COMPILED (emakit::compiled, detail/config.hpp): the flat aliases' descriptions come from
// libemakit.a.
#if EMAKIT_EXTERN_ALIASES
#define EMAKIT_EXTERN_DESCRIBE(Decay) \
  extern template std::string describe(const Ema<Decay, StepSchedule, FlatStorage>&);
EMAKIT_FOR_EACH_FLAT_ALIAS_DECAY(EMAKIT_EXTERN_DESCRIBE)
#undef EMAKIT_EXTERN_DESCRIBE
#endif

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

template <class P>
  requires emakit::detail::PrintablePolicy<P>
struct fmt::formatter<P, char> {
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  template <class Context>
  auto format(const P& p, Context& ctx) const {
    return fmt::format_to(ctx.out(), "{}", emakit::detail::describe_policy(p));
  }
};

template <>
struct fmt::formatter<emakit::Action, char> : fmt::formatter<std::string_view, char> {
  template <class Context>
  auto format(emakit::Action a, Context& ctx) const {
    return fmt::formatter<std::string_view, char>::format(emakit::to_string(a), ctx);
  }
};

template <>
struct fmt::formatter<emakit::Warmup, char> : fmt::formatter<std::string_view, char> {
  template <class Context>
  auto format(emakit::Warmup w, Context& ctx) const {
    return fmt::formatter<std::string_view, char>::format(emakit::to_string(w), ctx);
  }
};

template <>
struct fmt::formatter<emakit::UpdateResult, char> {
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  template <class Context>
  auto format(const emakit::UpdateResult& r, Context& ctx) const {
    auto out = fmt::format_to(ctx.out(), "{} at step {} (decay {})", emakit::to_string(r.action), r.step, r.decay);
    if (r.drift)
      out = fmt::format_to(out, ", drift {:.4g} (farthest '{}' {:.4g})", r.drift->relative, r.drift->farthest,
                           r.drift->farthest_relative);
    return out;
  }
};

template <emakit::DecayPolicy D, emakit::SchedulePolicy S, emakit::StoragePolicy St>
struct fmt::formatter<emakit::Ema<D, S, St>, char> {
  constexpr auto parse(fmt::format_parse_context& ctx) { return ctx.begin(); }
  template <class Context>
  auto format(const emakit::Ema<D, S, St>& ema, Context& ctx) const {
    const std::string text = emakit::describe(ema);
    return std::copy(text.begin(), text.end(), ctx.out());
  }
};

#if !defined(EMAKIT_COMPILED)
#include <emakit/format-inl.hpp>
#endif
