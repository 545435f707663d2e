// The non-template definitions of profile_math.hpp: included at the end of
// profile_math.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/posthoc/profile_math-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/posthoc/profile_math.hpp> instead"
#endif

#include <emakit/posthoc/profile_math.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

namespace detail {

// The 1-norm condition number of A (factored as lu), refused above max_condition.
EMAKIT_FUNC double checked_condition(const std::vector<double>& a, const LuFactors& lu, double max_condition) {
  const double condition = condition_number_1(a, lu);
  if (!(condition <= max_condition))
    refuse_synthesis("the post-hoc EMA system of {} snapshots is ill-conditioned: condition number {:.3g} > {:.3g} "
                     "(max_condition); snapshots with (nearly) the same t and gamma make the weights meaningless: use "
                     "fewer, farther apart snapshots, profiles with more different sigma_rel, or raise max_condition "
                     "(SynthesisOptions::max_condition, posthoc_tool --max-condition)",
                     lu.size(), condition, max_condition);
  return condition;
}

// The snapshots' discrete profiles over intervals of steps (see fit_target_weights): the interval
// ends e_1 < ... < e_K (e_0 = 0), among them every distinct snapshot time tau_1 < ... < tau_M, cut
// into blocks (tau_{m-1}, tau_m]. Within block m, phi_{m,p}(k) = (e_k/tau_m)^(g_p+1) -
// (e_{k-1}/tau_m)^(g_p+1) is the weight of profile p at time tau_m on interval k (the tracker's
// weights on the steps of the interval, summed: they telescope), and a later time tau_l only scales
// it: w_{l,p}(k) = (tau_m/tau_l)^(g_p+1) phi_{m,p}(k). So every sum over intervals is one pass,
// with per-block sums carried from block to block (O(K x gammas^2), not O(K x snapshots^2)).
class IntervalGrid {
 public:
  IntervalGrid(std::span<const Profile> snapshots, std::int64_t update_every, std::span<const std::int64_t> updates)
      : dt_(update_every) {
    check_positive_int(update_every, "the snapshots' update_every");
    if (snapshots.empty()) fail("fit_target_weights: no snapshot profiles");
    std::vector<std::int64_t> times;
    for (std::size_t i = 0; i < snapshots.size(); ++i) {
      const Profile& s = snapshots[i];
      const double k = s.t / static_cast<double>(dt_);
      if (!(s.gamma > 0) || !(k >= 1) || k != std::floor(k) || !(s.t < 9.0e15))
        fail("snapshot profile {} (t = {}, gamma = {}) is not a tracked profile on updates every {} steps: t must be "
             "a positive multiple of update_every, gamma > 0",
             i, s.t, s.gamma, dt_);
      times.push_back(static_cast<std::int64_t>(s.t));
      gammas_.push_back(s.gamma);
    }
    std::sort(gammas_.begin(), gammas_.end());
    gammas_.erase(std::unique(gammas_.begin(), gammas_.end()), gammas_.end());
    ends_ = times;
    const std::int64_t last = *std::max_element(times.begin(), times.end());
    for (const std::int64_t s : updates)
      if (s >= 1 && s <= last) ends_.push_back((s + dt_ - 1) / dt_ * dt_);  // the tracked update it falls to
    ends_.push_back(0);
    std::sort(ends_.begin(), ends_.end());
    ends_.erase(std::unique(ends_.begin(), ends_.end()), ends_.end());
    std::sort(times.begin(), times.end());
    times.erase(std::unique(times.begin(), times.end()), times.end());
    for (const std::int64_t t : times) blocks_.push_back(index_of(t));
    for (const Profile& s : snapshots)
      slots_.push_back(
          {static_cast<std::size_t>(std::lower_bound(times.begin(), times.end(), static_cast<std::int64_t>(s.t)) -
                                    times.begin()),
           static_cast<std::size_t>(std::lower_bound(gammas_.begin(), gammas_.end(), s.gamma) - gammas_.begin())});
  }

  std::size_t intervals() const noexcept { return ends_.size() - 1; }  // K
  std::int64_t last_step() const noexcept { return ends_.back(); }
  const std::vector<std::int64_t>& ends() const noexcept { return ends_; }

  // The target's weights over steps 0..T summed per interval: g[0] the model before step 1, g[k]
  // the steps (e_{k-1}, e_k].
  std::vector<double> sums(std::span<const double> v) const {
    if (v.size() != static_cast<std::size_t>(last_step()) + 1)
      fail("the target's weights cover steps 0 to {}, the snapshots' updates steps 0 to {}", v.size() - 1, last_step());
    std::vector<double> g(ends_.size(), 0.0);
    g[0] = v[0];
    std::size_t k = 1;
    for (std::int64_t s = 1; s <= last_step(); ++s) {
      while (ends_[k] < s) ++k;
      g[k] += v[static_cast<std::size_t>(s)];
    }
    return g;
  }

  // A_ij = sum_k w_i(k) w_j(k), row-major.
  std::vector<double> gram() const {
    const std::size_t p = gammas_.size();
    std::vector<double> block(blocks_.size() * p * p, 0.0);  // G_pq(m) = sum_{k in blocks <= m} w_{m,p} w_{m,q}
    for_each_interval([&](std::size_t m, std::size_t, const double* phi) {
      double* g = &block[m * p * p];
      for (std::size_t a = 0; a < p; ++a)
        for (std::size_t b = 0; b < p; ++b) g[a * p + b] += phi[a] * phi[b];
    });
    for (std::size_t m = 1; m < blocks_.size(); ++m)
      for (std::size_t a = 0; a < p; ++a)
        for (std::size_t b = 0; b < p; ++b)
          block[m * p * p + a * p + b] += scale(m - 1, m, a) * scale(m - 1, m, b) * block[(m - 1) * p * p + a * p + b];
    const std::size_t n = slots_.size();
    std::vector<double> out(n * n);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        const Slot& x = slots_[i].m <= slots_[j].m ? slots_[i] : slots_[j];  // the earlier time
        const Slot& y = slots_[i].m <= slots_[j].m ? slots_[j] : slots_[i];
        out[i * n + j] = scale(x.m, y.m, y.p) * block[x.m * p * p + x.p * p + y.p];
      }
    return out;
  }

  // b_i = sum_k w_i(k) g[k].
  std::vector<double> inner(const std::vector<double>& g) const {
    const std::size_t p = gammas_.size();
    std::vector<double> block(blocks_.size() * p, 0.0);  // B_p(m) = sum_{k in blocks <= m} w_{m,p}(k) g[k]
    for_each_interval([&](std::size_t m, std::size_t k, const double* phi) {
      for (std::size_t a = 0; a < p; ++a) block[m * p + a] += phi[a] * g[k];
    });
    for (std::size_t m = 1; m < blocks_.size(); ++m)
      for (std::size_t a = 0; a < p; ++a) block[m * p + a] += scale(m - 1, m, a) * block[(m - 1) * p + a];
    std::vector<double> out;
    for (const Slot& s : slots_) out.push_back(block[s.m * p + s.p]);
    return out;
  }

  // u[k] = sum_i x_i w_i(k), k = 0..K (u[0] = 0: no snapshot holds the model before step 1).
  std::vector<double> combine(std::span<const double> x) const {
    const std::size_t p = gammas_.size();
    std::vector<double> c(blocks_.size() * p,
                          0.0);  // C_p(m) = sum_{i of gamma p, m_i >= m} x_i (tau_m/tau_{m_i})^(g_p+1)
    for (std::size_t i = 0; i < slots_.size(); ++i) c[slots_[i].m * p + slots_[i].p] += x[i];
    for (std::size_t m = blocks_.size() - 1; m-- > 0;)
      for (std::size_t a = 0; a < p; ++a) c[m * p + a] += scale(m, m + 1, a) * c[(m + 1) * p + a];
    std::vector<double> u(ends_.size(), 0.0);
    for_each_interval([&](std::size_t m, std::size_t k, const double* phi) {
      double sum = 0;
      for (std::size_t a = 0; a < p; ++a) sum += phi[a] * c[m * p + a];
      u[k] = sum;
    });
    return u;
  }

 private:
  struct Slot {
    std::size_t m, p;  // the snapshot's time (block) and gamma, as indices
  };

  std::size_t index_of(std::int64_t end) const {
    return static_cast<std::size_t>(std::lower_bound(ends_.begin(), ends_.end(), end) - ends_.begin());
  }
  double time(std::size_t m) const { return static_cast<double>(ends_[blocks_[m]]); }
  // (tau_m / tau_l)^(g_p + 1): what the profile p at time tau_l puts on the intervals up to tau_m,
  // relative to the profile at tau_m.
  double scale(std::size_t m, std::size_t l, std::size_t p) const {
    return std::pow(time(m) / time(l), gammas_[p] + 1.0);
  }

  // fn(m, k, phi): phi[p] = phi_{m,p}(k) for each interval k = 1..K, m its block.
  template <class Fn>
  void for_each_interval(Fn&& fn) const {
    const std::size_t p = gammas_.size();
    std::vector<double> phi(p), below(p);
    std::size_t start = 0;
    for (std::size_t m = 0; m < blocks_.size(); ++m) {
      const double end = time(m);
      for (std::size_t a = 0; a < p; ++a)
        below[a] = std::pow(static_cast<double>(ends_[start]) / end, gammas_[a] + 1.0);
      for (std::size_t k = start + 1; k <= blocks_[m]; ++k) {
        for (std::size_t a = 0; a < p; ++a) {
          const double up = k == blocks_[m] ? 1.0 : std::pow(static_cast<double>(ends_[k]) / end, gammas_[a] + 1.0);
          phi[a] = up - below[a];
          below[a] = up;
        }
        fn(m, k, phi.data());
      }
      start = blocks_[m];
    }
  }

  std::int64_t dt_;
  std::vector<std::int64_t> ends_;   // e_0 = 0 < e_1 < ... < e_K, steps
  std::vector<std::size_t> blocks_;  // the distinct snapshot times, as indices into ends_, ascending
  std::vector<double> gammas_;       // the distinct gammas, ascending
  std::vector<Slot> slots_;          // per snapshot, in the caller's order
};

EMAKIT_FUNC void measure_on_grid(const IntervalGrid& grid, std::vector<double> g, PosthocWeights& out,
                                 bool keep_weights) {
  std::vector<double> u = grid.combine(out.weights);
  double error = g[0] * g[0], own = g[0] * g[0];
  for (std::size_t k = 1; k < g.size(); ++k) {
    error += (u[k] - g[k]) * (u[k] - g[k]);
    own += g[k] * g[k];
  }
  out.fit_error = own > 0 ? std::sqrt(error / own) : 0.0;
  out.initial_weight = g[0];
  out.intervals = grid.intervals();
  if (keep_weights) {
    out.interval_ends = grid.ends();
    out.fitted = std::move(u);
    out.target = std::move(g);
  }
}

}  // namespace detail

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
  out.condition = detail::checked_condition(a, lu, max_condition);
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

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC PosthocWeights fit_target_weights(std::span<const Profile> snapshots, std::int64_t update_every,
                                              const TargetWeights& target, double max_condition, bool keep_weights) {
  // Two grids: the target's intervals (what the fit is measured on), and every tracked update
  // (the snapshots' own resolution: what tells them apart, and breaks the ties that coarse
  // intervals leave: among combinations equally close interval by interval, the one closest
  // update by update).
  const detail::IntervalGrid coarse(snapshots, update_every, target.updates);
  std::vector<std::int64_t> every;
  for (std::int64_t s = update_every; s <= coarse.last_step(); s += update_every) every.push_back(s);
  const detail::IntervalGrid fine(snapshots, update_every, every);
  std::vector<double> g = coarse.sums(target.weights);
  const std::size_t n = snapshots.size();
  const std::vector<double> a_fine = fine.gram();
  PosthocWeights out;
  out.condition = detail::checked_condition(a_fine, detail::LuFactors(a_fine, n), max_condition);
  constexpr double tie_break = 1e-4;
  std::vector<double> a = coarse.gram();
  std::vector<double> b = coarse.inner(g);
  const std::vector<double> b_fine = fine.inner(fine.sums(target.weights));
  for (std::size_t i = 0; i < n * n; ++i) a[i] += tie_break * a_fine[i];
  for (std::size_t i = 0; i < n; ++i) b[i] += tie_break * b_fine[i];
  const detail::LuFactors lu(a, n);
  if (lu.singular()) detail::fail_runtime("the post-hoc EMA fit of {} snapshots is singular", n);
  const std::vector<double> y = lu.solve(b);
  const std::vector<double> z = lu.solve(std::vector<double>(n, 1.0));
  double sum_y = 0, sum_z = 0;
  for (std::size_t i = 0; i < n; ++i) {
    sum_y += y[i];
    sum_z += z[i];
  }
  if (!(std::abs(sum_z) > 0 && std::isfinite(sum_z)))
    detail::fail_runtime("the post-hoc EMA fit of {} snapshots has no average of them (1' A^-1 1 = {:.3g})", n, sum_z);
  out.raw_sum = sum_y;
  out.weights.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    out.weights[i] = y[i] + z[i] * (1.0 - sum_y) / sum_z;
    out.max_abs_weight = std::max(out.max_abs_weight, std::abs(out.weights[i]));
    out.abs_sum += std::abs(out.weights[i]);
  }
  detail::measure_on_grid(coarse, std::move(g), out, keep_weights);
  return out;
}

EMAKIT_FUNC void measure_fit(std::span<const Profile> snapshots, std::int64_t update_every, const TargetWeights& target,
                             PosthocWeights& weights, bool keep_weights) {
  if (weights.weights.size() != snapshots.size())
    detail::fail("measure_fit: {} weights for {} snapshots", weights.weights.size(), snapshots.size());
  const detail::IntervalGrid grid(snapshots, update_every, target.updates);
  detail::measure_on_grid(grid, grid.sums(target.weights), weights, keep_weights);
}

EMAKIT_FUNC TargetWeights power_function_weights(std::int64_t t, double gamma, std::int64_t update_every) {
  detail::check_positive_int(update_every, "power_function_weights update_every");
  if (!(t > 0 && t % update_every == 0 && gamma > 0))
    detail::fail("power_function_weights: t = {} must be a positive multiple of update_every = {}, gamma = {} > 0", t,
                 update_every, gamma);
  TargetWeights out;
  out.weights.assign(static_cast<std::size_t>(t) + 1, 0.0);
  const std::int64_t updates = t / update_every;
  double below = 0;
  for (std::int64_t k = 1; k <= updates; ++k) {
    const double up = std::pow(static_cast<double>(k) / static_cast<double>(updates), gamma + 1.0);
    out.weights[static_cast<std::size_t>(k * update_every)] = up - below;
    out.updates.push_back(k * update_every);
    below = up;
  }
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
