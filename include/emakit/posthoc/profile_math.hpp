// Post-hoc EMA math: power-function EMA profiles, their inner product, and the solve for the
// weights of the snapshots.
//
// The solve. For snapshot profiles p_i = (t_i, gamma_i), all with t_i <= the target time, and a
// target profile q, solve A x = b with A_ij = <p_i, p_j>, b_i = <p_i, q>, where
//   <(t_a, g_a), (t_b, g_b)> = (g_a+1)(g_b+1) (t_a/t_b)^e / ((g_a+g_b+1) max(t_a, t_b)),
//   e = g_b if t_a < t_b else -g_a
// (the L2 inner product of the two profiles), exactly (LU with partial pivoting, float64), check
// the 1-norm condition number and normalise x to sum 1 (as EDM2); synthesis.hpp combines the
// snapshots' averaged tensors with x.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/dense_solve.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace emakit {

// A power-function EMA profile: the EMA at time t (> 0) with exponent gamma (> 0).
struct Profile {
  double t = 0;
  double gamma = 0;
};

// The L2 inner product of two profiles (gamma+1) tau^gamma / t^(gamma+1) on [0, t].
EMAKIT_FUNC double profile_inner_product(Profile a, Profile b);

// The combination weights of the snapshots for a target profile.
struct PosthocWeights {
  std::vector<double> weights;  // normalised to sum 1, one per snapshot, in the snapshots' order
  double raw_sum = 0;           // the sum of the exact solution before normalisation (1 in exact arithmetic
                                // only when the target lies in the snapshots' span)
  double condition = 0;         // the 1-norm condition number of A
  double max_abs_weight = 0;    // the largest |weight| (1 or less when no snapshot is subtracted)
  double abs_sum = 0;           // the sum of |weight|: how much the snapshots' rounding is amplified
  double profile_error = 0;     // the relative L2 distance between the combined profile and the target's:
                                // |sum_i w_i p_i - q| / |q| (0: the target is reproduced exactly)
};

// The limit on the condition number above which a solve is refused: past it, float64 leaves
// fewer than ~4 correct digits in the weights.
inline constexpr double default_max_condition = 1e12;

// Solves the EDM2 system for `snapshots` and `target` (see the top of this file).
EMAKIT_FUNC PosthocWeights solve_posthoc_weights(std::span<const Profile> snapshots, Profile target,
                                                 double max_condition = default_max_condition);

}  // namespace emakit

#if EMAKIT_DEFINITIONS

namespace emakit {

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

}  // namespace emakit

#endif  // EMAKIT_DEFINITIONS
