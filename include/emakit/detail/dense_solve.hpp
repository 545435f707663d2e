// Small dense linear systems in float64: LU with partial pivoting, and the 1-norm condition
// number through the explicit inverse. For the post-hoc EMA solve, where n is the number of
// snapshots (tens to hundreds), so O(n^3) is nothing next to reading one snapshot.
#pragma once

#include <emakit/detail/config.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// A row-major n x n matrix factored as P A = L U (L unit lower, both stored in `lu`).
class LuFactors {
 public:
  LuFactors(std::vector<double> a, std::size_t n) : lu_(std::move(a)), perm_(n), n_(n) {
    for (std::size_t i = 0; i < n; ++i) perm_[i] = i;
    for (std::size_t k = 0; k < n; ++k) {
      std::size_t p = k;
      for (std::size_t i = k + 1; i < n; ++i)
        if (std::abs(at(i, k)) > std::abs(at(p, k))) p = i;
      if (at(p, k) == 0.0 || !std::isfinite(at(p, k))) {
        singular_ = true;
        return;
      }
      if (p != k) {
        for (std::size_t j = 0; j < n; ++j) std::swap(at(p, j), at(k, j));
        std::swap(perm_[p], perm_[k]);
      }
      for (std::size_t i = k + 1; i < n; ++i) {
        const double f = at(i, k) / at(k, k);
        at(i, k) = f;
        for (std::size_t j = k + 1; j < n; ++j) at(i, j) -= f * at(k, j);
      }
    }
  }

  bool singular() const noexcept { return singular_; }
  std::size_t size() const noexcept { return n_; }

  // x with A x = b (requires !singular()).
  std::vector<double> solve(const std::vector<double>& b) const {
    std::vector<double> x(n_);
    for (std::size_t i = 0; i < n_; ++i) {
      double s = b[perm_[i]];
      for (std::size_t j = 0; j < i; ++j) s -= at(i, j) * x[j];
      x[i] = s;
    }
    for (std::size_t i = n_; i-- > 0;) {
      double s = x[i];
      for (std::size_t j = i + 1; j < n_; ++j) s -= at(i, j) * x[j];
      x[i] = s / at(i, i);
    }
    return x;
  }

 private:
  double& at(std::size_t i, std::size_t j) { return lu_[i * n_ + j]; }
  double at(std::size_t i, std::size_t j) const { return lu_[i * n_ + j]; }

  std::vector<double> lu_;
  std::vector<std::size_t> perm_;
  std::size_t n_;
  bool singular_ = false;
};

// max over columns of the column's absolute sum.
inline double norm1(const std::vector<double>& a, std::size_t n) {
  double best = 0.0;
  for (std::size_t j = 0; j < n; ++j) {
    double s = 0.0;
    for (std::size_t i = 0; i < n; ++i) s += std::abs(a[i * n + j]);
    best = std::max(best, s);
  }
  return best;
}

// ||A||_1 ||A^-1||_1; infinity for a singular A.
inline double condition_number_1(const std::vector<double>& a, const LuFactors& lu) {
  if (lu.singular()) return std::numeric_limits<double>::infinity();
  const std::size_t n = lu.size();
  double inverse_norm = 0.0;
  std::vector<double> e(n, 0.0);
  for (std::size_t j = 0; j < n; ++j) {  // column j of A^-1
    e[j] = 1.0;
    const auto column = lu.solve(e);
    e[j] = 0.0;
    double s = 0.0;
    for (double v : column) s += std::abs(v);
    inverse_norm = std::max(inverse_norm, s);
  }
  return norm1(a, n) * inverse_norm;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
