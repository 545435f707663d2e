// The non-template definitions of profile_math.hpp: included at the end of profile_math.hpp in the all-inline mode
// (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/posthoc/profile_math-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/posthoc/profile_math.hpp> instead"
#endif

#include <emakit/posthoc/profile_math.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC double profile_inner_product(Profile a, Profile b) {
  const double e = a.t < b.t ? b.gamma : -a.gamma;
  return (a.gamma + 1.0) * (b.gamma + 1.0) * std::pow(a.t / b.t, e) / ((a.gamma + b.gamma + 1.0) * std::max(a.t, b.t));
}

EMAKIT_FUNC PosthocWeights solve_posthoc_weights(std::span<const Profile> snapshots, Profile target,
                                                 double max_condition) {
  const std::size_t n = snapshots.size();
  if (n == 0) detail::fail("solve_posthoc_weights: no snapshot profiles");
  if (!(target.t > 0 && target.gamma > 0))
    detail::fail("the target profile needs t > 0 and gamma > 0, got t = {}, gamma = {}", target.t, target.gamma);
  for (std::size_t i = 0; i < n; ++i)
    if (!(snapshots[i].t > 0 && snapshots[i].gamma > 0))
      detail::fail("snapshot profile {} needs t > 0 and gamma > 0, got t = {}, gamma = {}", i, snapshots[i].t,
                   snapshots[i].gamma);
  std::vector<double> a(n * n), b(n);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) a[i * n + j] = profile_inner_product(snapshots[i], snapshots[j]);
    b[i] = profile_inner_product(snapshots[i], target);
  }
  const detail::LuFactors lu(a, n);
  PosthocWeights out;
  out.condition = detail::condition_number_1(a, lu);
  if (!(out.condition <= max_condition))
    detail::refuse_synthesis("the post-hoc EMA system of {} snapshots is ill-conditioned: condition number {:.3g} > "
                             "{:.3g} (max_condition); snapshots with (nearly) the same t and gamma make the weights "
                             "meaningless: use fewer, farther apart snapshots, profiles with more different sigma_rel, "
                             "or raise max_condition (SynthesisOptions::max_condition, posthoc_tool --max-condition)",
                             n, out.condition, max_condition);
  out.weights = lu.solve(b);
  for (double w : out.weights) out.raw_sum += w;
  if (!(std::abs(out.raw_sum) > 1e-12))
    detail::fail_runtime("the post-hoc EMA weights sum to {:.3g}; they cannot be normalised", out.raw_sum);
  for (double& w : out.weights) {
    w /= out.raw_sum;
    out.max_abs_weight = std::max(out.max_abs_weight, std::abs(w));
    out.abs_sum += std::abs(w);
  }
  // |sum w_i p_i - q|^2 = w'Aw - 2 w'b + <q, q>, relative to <q, q>.
  double quadratic = 0, linear = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double row = 0;
    for (std::size_t j = 0; j < n; ++j) row += a[i * n + j] * out.weights[j];
    quadratic += out.weights[i] * row;
    linear += out.weights[i] * b[i];
  }
  const double own = profile_inner_product(target, target);
  out.profile_error = std::sqrt(std::max(0.0, quadratic - 2.0 * linear + own) / own);
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
