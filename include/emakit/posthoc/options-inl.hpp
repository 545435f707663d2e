// The non-template definitions of options.hpp: included at the end of options.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/posthoc/options-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/posthoc/options.hpp> instead"
#endif

#include <emakit/posthoc/options.hpp>

#include <fmt/format.h>  // fmt::join
#include <fmt/ranges.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC PostHocOptions& PostHocOptions::sigma_rels(const std::vector<double>& values) {
  for (double s : values)
    if (!(s > 0.0 && s < max_sigma_rel))
      detail::fail("PostHocOptions::sigma_rels: each sigma_rel must be in (0, {:.4f}), got {}", max_sigma_rel, s);
  std::vector<double> g;
  for (double s : values) g.push_back(sigma_rel_to_gamma(s));
  return set_gammas(std::move(g), "sigma_rels", values);
}

EMAKIT_FUNC PostHocOptions& PostHocOptions::gammas(const std::vector<double>& values) {
  for (double g : values)
    if (!(g > 0.0 && std::isfinite(g))) detail::fail("PostHocOptions::gammas: each gamma must be > 0, got {}", g);
  return set_gammas(values, "gammas", values);
}

EMAKIT_FUNC std::vector<double> PostHocOptions::sigma_rels() const {
  std::vector<double> out;
  for (double g : gammas_) out.push_back(gamma_to_sigma_rel(g));
  return out;
}

EMAKIT_FUNC PostHocOptions& PostHocOptions::update_every(std::int64_t value) {
  detail::check_positive_int(value, "PostHocOptions::update_every");
  update_every_ = value;
  return *this;
}

EMAKIT_FUNC PostHocOptions& PostHocOptions::snapshot_every(std::int64_t value) {
  detail::check_non_negative_int(value, "PostHocOptions::snapshot_every");
  snapshot_every_ = value;
  return *this;
}

EMAKIT_FUNC PostHocOptions& PostHocOptions::snapshot_dtype(c10::ScalarType value) {
  if (!c10::isFloatingType(value))
    detail::fail("PostHocOptions::snapshot_dtype must be a floating dtype, got {}", c10::toString(value));
  snapshot_dtype_ = value;
  return *this;
}

EMAKIT_FUNC PostHocOptions& PostHocOptions::set_gammas(std::vector<double> g, const char* option,
                                                       const std::vector<double>& given) {
  if (g.size() < 2)
    detail::fail("PostHocOptions::{} needs at least two profiles to synthesize from, got {} ([{}])", option,
                 given.size(), fmt::join(given, ", "));
  for (std::size_t i = 0; i < g.size(); ++i)
    for (std::size_t j = i + 1; j < g.size(); ++j)
      if (g[i] == g[j])
        detail::fail("PostHocOptions::{}: the value {} appears twice; profiles must differ", option, given[i]);
  gammas_ = std::move(g);
  return *this;
}

EMAKIT_FUNC std::string SynthesisOptions::describe_target() const {
  if (target_) return target_->description();
  return fmt::format("sigma_rel {:.5g} (gamma {:.6g})", sigma_rel(), gamma_);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
