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
#include <emakit/posthoc/part.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/dense_solve.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/posthoc/profile_math-inl.hpp>
#endif
