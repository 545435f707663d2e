// Post-hoc EMA options: what a PostHocEma tracks (PostHocOptions) and which EMA to synthesize
// (SynthesisOptions).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/posthoc/part.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/posthoc/profile_math.hpp>
#include <emakit/posthoc/target.hpp>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <fmt/core.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// What a PostHocEma does with another run's snapshots in its folder (PostHocOptions).
enum class ExistingSnapshots : std::uint8_t {
  refuse,      // throw at the first update or snapshot, naming the other run
  move_aside,  // move them into "<folder>/previous-run-<id>", then go on
};

// What a PostHocEma tracks and where it writes its snapshots.
class PostHocOptions {
 public:
  // `folder` is created if missing; it must be writable.
  explicit PostHocOptions(std::filesystem::path folder) : folder_(std::move(folder)) {
    if (folder_.empty()) detail::fail("PostHocOptions: the snapshot folder is empty; give a path");
    sigma_rels({0.05, 0.10});
  }

  const std::filesystem::path& folder() const noexcept { return folder_; }

  // The tracked profiles by sigma_rel, each in (0, 0.2887), at least two, all different.
  PostHocOptions& sigma_rels(const std::vector<double>& values);
  // The tracked profiles by gamma, each > 0, at least two, all different.
  PostHocOptions& gammas(const std::vector<double>& values);
  const std::vector<double>& gammas() const noexcept { return gammas_; }
  std::vector<double> sigma_rels() const;

  // Steps between EMA updates (dt): updates at steps dt, 2dt, ... Default 1 (every step, as EDM2).
  std::int64_t update_every() const noexcept { return update_every_; }
  PostHocOptions& update_every(std::int64_t value);
  // A snapshot at every step that is a multiple of this (a multiple of update_every); 0: only on
  // demand (PostHocEma::snapshot()). Default 1000.
  std::int64_t snapshot_every() const noexcept { return snapshot_every_; }
  PostHocOptions& snapshot_every(std::int64_t value);
  // The dtype averaged tensors are stored in (e.g. torch::kBFloat16 to halve the files); default:
  // the averages' own dtype. Copied tensors (integer buffers) keep theirs.
  std::optional<c10::ScalarType> snapshot_dtype() const noexcept { return snapshot_dtype_; }
  PostHocOptions& snapshot_dtype(c10::ScalarType value);
  // What to do when the folder holds snapshots of another run (a snapshot records its run):
  // refuse (default), unless this PostHocEma resumes that run (load_state_dict of its state), or
  // move them aside, into a new sub-folder "<folder>/previous-run-<id>" (never deleted).
  ExistingSnapshots existing_snapshots() const noexcept { return existing_snapshots_; }
  PostHocOptions& existing_snapshots(ExistingSnapshots value) {
    existing_snapshots_ = value;
    return *this;
  }

 private:
  PostHocOptions& set_gammas(std::vector<double> g, const char* option, const std::vector<double>& given);

  std::filesystem::path folder_;
  std::vector<double> gammas_;
  std::int64_t update_every_ = 1;
  std::int64_t snapshot_every_ = 1000;
  std::optional<c10::ScalarType> snapshot_dtype_;
  ExistingSnapshots existing_snapshots_ = ExistingSnapshots::refuse;
};

// The EMA to synthesize: a power-function profile (by gamma, or by sigma_rel: EDM2's solve) or any
// EMA (an EmaTarget: its weighting of the past, fitted over the updates), the time (a snapshot
// time; default the latest), and the result's dtype and device.
class SynthesisOptions {
 public:
  explicit SynthesisOptions(double gamma) {
    if (!(gamma > 0.0 && std::isfinite(gamma))) detail::fail("SynthesisOptions: gamma must be > 0, got {}", gamma);
    gamma_ = gamma;
  }
  static SynthesisOptions from_sigma_rel(double sigma_rel) {
    if (!(sigma_rel > 0.0 && sigma_rel < max_sigma_rel))
      detail::fail("SynthesisOptions: sigma_rel must be in (0, {:.4f}), got {}", max_sigma_rel, sigma_rel);
    return SynthesisOptions(sigma_rel_to_gamma(sigma_rel));
  }
  // Any EMA: e.g. SynthesisOptions(EmaTarget(Fixed(0.999))),
  // SynthesisOptions(preset_target("timm_model_ema_v3")).
  explicit SynthesisOptions(EmaTarget target) : target_(std::move(target)) {}

  // The EMA target, if this synthesis has one (else the power function of gamma()).
  const std::optional<EmaTarget>& ema_target() const noexcept { return target_; }
  // The power-function target's gamma and sigma_rel (0 for an EMA target).
  double gamma() const noexcept { return gamma_; }
  double sigma_rel() const { return target_ ? 0.0 : gamma_to_sigma_rel(gamma_); }
  // What the synthesis makes, in words: "sigma_rel 0.07 (gamma 6.94)", or the EMA target's
  // policies.
  std::string describe_target() const;

  // The target time: the t of some snapshot. Default: the latest.
  std::optional<std::int64_t> step() const noexcept { return step_; }
  SynthesisOptions& step(std::int64_t value) {
    detail::check_positive_int(value, "SynthesisOptions::step");
    step_ = value;
    return *this;
  }
  double max_condition() const noexcept { return max_condition_; }
  SynthesisOptions& max_condition(double value) {
    if (!(value >= 1.0)) detail::fail("SynthesisOptions::max_condition must be >= 1, got {}", value);
    max_condition_ = value;
    return *this;
  }
  // The dtype of the synthesized (real floating) tensors; default: the dtype the EMA averaged in.
  std::optional<c10::ScalarType> dtype() const noexcept { return dtype_; }
  SynthesisOptions& dtype(c10::ScalarType value) {
    if (!c10::isFloatingType(value))
      detail::fail("SynthesisOptions::dtype must be a floating dtype, got {}", c10::toString(value));
    dtype_ = value;
    return *this;
  }
  c10::Device device() const noexcept { return device_; }
  SynthesisOptions& device(c10::Device value) {
    device_ = value;
    return *this;
  }

  // What a synthesis refuses (SynthesisRefused) unless told otherwise:
  // - a snapshot set with gaps: every profile of the run must have a snapshot at every snapshot
  //   step up to the target (the files record how many profiles and which step came before);
  //   allow_partial(true) synthesizes from what is there and lists the gaps in plan.missing.
  bool allow_partial() const noexcept { return allow_partial_; }
  SynthesisOptions& allow_partial(bool value) {
    allow_partial_ = value;
    return *this;
  }
  // - a target sigma_rel below the shortest tracked one / factor or above the longest x factor:
  //   far outside, the combination cannot reproduce the profile (default 2.5: with 0.05 and 0.10
  //   tracked, 0.02 to 0.25; infinity: no limit). plan.solution.profile_error says how far the
  //   combination is from the profile asked for.
  double max_extrapolation() const noexcept { return max_extrapolation_; }
  SynthesisOptions& max_extrapolation(double factor) {
    if (!(factor >= 1.0)) detail::fail("SynthesisOptions::max_extrapolation must be >= 1, got {}", factor);
    max_extrapolation_ = factor;
    return *this;
  }
  // - a weight larger than this in magnitude (default 10; in-range targets stay near 1): large
  //   weights of both signs amplify the snapshots' rounding (bf16 snapshots above all).
  double max_weight() const noexcept { return max_weight_; }
  SynthesisOptions& max_weight(double value) {
    if (!(value > 0.0)) detail::fail("SynthesisOptions::max_weight must be > 0, got {}", value);
    max_weight_ = value;
    return *this;
  }
  // - an ill-conditioned system: max_condition() above.
  // - a fit whose weighting of the past is farther than this from the target's (plan.solution's
  //   fit_error, relative L2 over the updates; default 0.5; infinity: no limit): the snapshots
  //   cannot represent that EMA (a short half-life from sparse snapshots, most of an EMA's weight
  //   on the model before the first update).
  double max_fit_error() const noexcept { return max_fit_error_; }
  SynthesisOptions& max_fit_error(double value) {
    if (!(value > 0.0)) detail::fail("SynthesisOptions::max_fit_error must be > 0, got {}", value);
    max_fit_error_ = value;
    return *this;
  }

  // Keep the fitted and the target weight of each update in plan.solution (fitted, target),
  // for a plot.
  bool keep_weights() const noexcept { return keep_weights_; }
  SynthesisOptions& keep_weights(bool value) {
    keep_weights_ = value;
    return *this;
  }

  static constexpr double default_max_extrapolation = 2.5;
  static constexpr double default_max_weight = 10.0;
  static constexpr double default_max_fit_error = 0.5;

 private:
  double gamma_ = 0;
  std::optional<std::int64_t> step_;
  double max_condition_ = default_max_condition;
  bool allow_partial_ = false;
  double max_extrapolation_ = default_max_extrapolation;
  double max_weight_ = default_max_weight;
  double max_fit_error_ = default_max_fit_error;
  bool keep_weights_ = false;
  std::optional<EmaTarget> target_;
  std::optional<c10::ScalarType> dtype_;
  c10::Device device_{c10::kCPU};
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/posthoc/options-inl.hpp>
#endif
