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
#include <cstdint>
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
                                // |sum_i w_i p_i - q| / |q| (0: the target is reproduced exactly); for a
                                // power-function target only (0 for an EMA target)
  // The fit over the updates themselves (every target): snapshot i puts weight w_i[s] on the model
  // of step s (tracker.hpp), the combination u[s] = sum_i weights[i] w_i[s], the target v[s], each
  // summed over the intervals that end at the target's updates (fit_target_weights):
  double fit_error = 0;       // |u - v| / |v| over those intervals (the L2 norm of the weights): 0 when the
                              // combination weighs the past as the target does,
                              // interval by interval
  double initial_weight = 0;  // v's weight on the model before the first tracked update (an EMA's starting
                              // copy): no snapshot holds that model, so it counts in fit_error
                              // whole
  std::size_t intervals = 0;  // how many intervals the error was measured over (0: not measured, for a power
                              // function from snapshots off their updates' grid, which
                              // PostHocEma never writes)
  // With SynthesisOptions::keep_weights: per interval, the step it ends at and the weight of u and
  // v on it; index 0 is the model before the first update (interval_ends[0] = 0).
  std::vector<std::int64_t> interval_ends;
  std::vector<double> fitted, target;
};

// The limit on the condition number above which a solve is refused: past it, float64 leaves
// fewer than ~4 correct digits in the weights.
inline constexpr double default_max_condition = 1e12;

// Solves the EDM2 system for `snapshots` and `target` (see the top of this file).
EMAKIT_FUNC PosthocWeights solve_posthoc_weights(std::span<const Profile> snapshots, Profile target,
                                                 double max_condition = default_max_condition);

// A target's weighting of the past: weights[s] on the model after step s = 0..T (weights[0]: the
// model before step 1), and the steps at which it updates, ascending (EmaTarget::weights).
struct TargetWeights {
  std::vector<double> weights;
  std::vector<std::int64_t> updates;
};

// The fit of any target's weighting of the past (DESIGN.md, "Post-hoc synthesis of any EMA").
// Snapshot i, of the profile (t_i, gamma_i) tracked with updates at steps dt, 2dt, ..., puts
// w_i[s] = (s/t_i)^(gamma_i+1) - ((s-dt)/t_i)^(gamma_i+1) on the model of step s (tracker.hpp:
// exact, not an approximation of the continuous profile). The fit compares weights summed over
// intervals of steps: each ends at a step where the target updates (moved up to the next tracked
// update, when the tracker updates less often), at a snapshot time, or at T (the latest t); a
// target that averages every 10th model then asks for its weight on each 10 steps, not for zero
// weight in between. The weights minimise that distance subject to sum_i x_i = 1 (an average stays
// an average): x = y + z (1 - sum y) / sum z with A y = b, A z = 1, A_ij and b_i the inner
// products of the interval sums, computed in one pass over the intervals (O(intervals x distinct
// gammas^2)), in float64. Where the intervals are coarser than the tracked updates, combinations
// equally close interval by interval are told apart by their distance update by update (added with
// weight 1e-4: the tie-break, which changes nothing when the target updates at every tracked
// update). Refuses (SynthesisRefused) snapshots whose system over the tracked updates is above
// max_condition, as solve_posthoc_weights.
EMAKIT_FUNC PosthocWeights fit_target_weights(std::span<const Profile> snapshots, std::int64_t update_every,
                                              const TargetWeights& target, double max_condition = default_max_condition,
                                              bool keep_weights = false);

// Fills `weights`' fit_error, initial_weight, intervals (and interval_ends, fitted, target with
// keep_weights) for its weights against `target`, as fit_target_weights measures them: how a
// solve made otherwise (EDM2's, for a power-function target) does over the updates.
EMAKIT_FUNC void measure_fit(std::span<const Profile> snapshots, std::int64_t update_every, const TargetWeights& target,
                             PosthocWeights& weights, bool keep_weights = false);

// The power-function EMA (t, gamma) tracked with updates every `update_every` steps, as a target:
// its weight on each step's model (0..t) and its updates.
EMAKIT_FUNC TargetWeights power_function_weights(std::int64_t t, double gamma, std::int64_t update_every);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/posthoc/profile_math-inl.hpp>
#endif
