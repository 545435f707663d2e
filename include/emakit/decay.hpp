// Decay policies: d, the weight an update keeps on the old average (ema = d*ema + (1-d)*x).
//
// | policy             | d at an update                                        | used by                    |
// |--------------------|-------------------------------------------------------|----------------------------|
// | Fixed              | beta                                                  | the plain loop, NeMo, SWA-EMA|
// | ExponentialRamp    | decay * (1 - exp(-update / tau))                      | timm ModelEma, YOLO, luxonis|
// | InversePowerWarmup | 0 if e <= 0, else clamp(1 - (1 + e/inv_gamma)^-power, | ema-pytorch, diffusers,    |
// |                    |   min_value, beta), e = step - update_after_step - 1  | timm ModelEmaV3 warmup     |
// | PowerFunction      | (1 - dt / step)^(gamma + 1); the first update copies   | Karras et al. post-hoc EMA |
// | Uniform            | 1 - 1 / update (an equal-weight mean of every update)  | SWA, AveragedModel default |
// | RationalRamp       | 0 if t <= 0, else max(min_decay, min(decay,           | TensorFlow's num_updates,  |
// |                    |   (1 + t) / (10 + t))), t = step - update_after_step - 1 | diffusers EMAModel       |
// | CosineMomentum     | end - (end - start) (cos(pi k / K') + 1) / 2, k = step - 1 | SSL teachers: BYOL,    |
// |                    |   K' = total_steps - 1 (lightly) or total_steps (DINO) | DINO, MoCo v3, I-JEPA      |
//
// Every policy validates its options when they are set and throws std::invalid_argument that
// names the option and the bad value. Policies compare with ==, print with fmt (format.hpp) and
// write their options into checkpoints through fields().
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/check.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// d = beta at every update.
class Fixed {
 public:
  static constexpr std::string_view name = "Fixed";

  Fixed() = default;  // not explicit: `{}` means the default policy
  explicit Fixed(double beta) { this->beta(beta); }

  double beta() const noexcept { return beta_; }
  Fixed& beta(double value) {
    detail::check_unit_interval(value, "Fixed::beta");
    beta_ = value;
    return *this;
  }

  double decay(const DecayInput&) const noexcept { return beta_; }
  std::vector<Field> fields() const { return {{"beta", beta_}}; }
  bool operator==(const Fixed&) const = default;

 private:
  double beta_ = 0.9999;
};

// d = decay * (1 - exp(-t / tau)), t = the update's number (from 1). timm ModelEma, YOLO and
// luxonis-train: the average follows the model closely at first and slows down over ~tau updates.
class ExponentialRamp {
 public:
  static constexpr std::string_view name = "ExponentialRamp";

  ExponentialRamp() = default;
  explicit ExponentialRamp(double decay, double tau = 2000.0) {
    this->decay_max(decay);
    this->tau(tau);
  }

  double decay_max() const noexcept { return decay_; }
  ExponentialRamp& decay_max(double value) {
    detail::check_unit_interval(value, "ExponentialRamp::decay_max");
    decay_ = value;
    return *this;
  }
  double tau() const noexcept { return tau_; }
  ExponentialRamp& tau(double value) {
    detail::check_positive(value, "ExponentialRamp::tau");
    tau_ = value;
    return *this;
  }

  double decay(const DecayInput& in) const noexcept {
    return decay_ * (1.0 - std::exp(-static_cast<double>(in.update) / tau_));
  }
  std::vector<Field> fields() const { return {{"decay", decay_}, {"tau", tau_}}; }
  bool operator==(const ExponentialRamp&) const = default;

 private:
  double decay_ = 0.9999;
  double tau_ = 2000.0;
};

// The warmup of ema-pytorch, diffusers and timm ModelEmaV3: with e = step - update_after_step - 1,
// d = 0 while e <= 0, then clamp(1 - (1 + e / inv_gamma)^(-power), min_value, beta).
// inv_gamma = 1, power = 2/3 reaches 0.999 near 31.6K steps; power = 3/4 near 10K steps.
class InversePowerWarmup {
 public:
  static constexpr std::string_view name = "InversePowerWarmup";

  InversePowerWarmup() = default;
  explicit InversePowerWarmup(double beta) { this->beta(beta); }

  double beta() const noexcept { return beta_; }
  InversePowerWarmup& beta(double value) {
    detail::check_unit_interval(value, "InversePowerWarmup::beta");
    if (value < min_value_)
      detail::fail("InversePowerWarmup::beta must be >= min_value ({}), got {}", min_value_, value);
    beta_ = value;
    return *this;
  }
  double inv_gamma() const noexcept { return inv_gamma_; }
  InversePowerWarmup& inv_gamma(double value) {
    detail::check_positive(value, "InversePowerWarmup::inv_gamma");
    inv_gamma_ = value;
    return *this;
  }
  double power() const noexcept { return power_; }
  InversePowerWarmup& power(double value) {
    detail::check_positive(value, "InversePowerWarmup::power");
    power_ = value;
    return *this;
  }
  double min_value() const noexcept { return min_value_; }
  InversePowerWarmup& min_value(double value) {
    if (!(value >= 0.0 && value <= beta_))
      detail::fail("InversePowerWarmup::min_value must be in [0, beta = {}], got {}", beta_, value);
    min_value_ = value;
    return *this;
  }
  std::int64_t update_after_step() const noexcept { return update_after_step_; }
  InversePowerWarmup& update_after_step(std::int64_t value) {
    detail::check_non_negative_int(value, "InversePowerWarmup::update_after_step");
    update_after_step_ = value;
    return *this;
  }
  // false: no warmup curve, d = beta as soon as e > 0 (timm ModelEmaV3 with use_warmup=False
  // and a step).
  bool warmup() const noexcept { return warmup_; }
  InversePowerWarmup& warmup(bool value) {
    warmup_ = value;
    return *this;
  }
  // true: compute d in float32, as ema-pytorch does (its step and decay are float32 tensors; the
  // power in double, rounded to float, as ATen's pow); the weight 1 - d then differs from the
  // float64 one in the 8th digit.
  bool single_precision() const noexcept { return single_precision_; }
  InversePowerWarmup& single_precision(bool value) {
    single_precision_ = value;
    return *this;
  }

  double decay(const DecayInput& in) const noexcept {
    if (single_precision_) return decay_as<float>(in);
    return decay_as<double>(in);
  }
  std::vector<Field> fields() const {
    return {{"beta", beta_},
            {"inv_gamma", inv_gamma_},
            {"power", power_},
            {"min_value", min_value_},
            {"update_after_step", static_cast<double>(update_after_step_), true},
            {"warmup", warmup_ ? 1.0 : 0.0, true},
            {"single_precision", single_precision_ ? 1.0 : 0.0, true}};
  }
  bool operator==(const InversePowerWarmup&) const = default;

 private:
  double beta_ = 0.9999;
  double inv_gamma_ = 1.0;
  double power_ = 2.0 / 3.0;
  double min_value_ = 0.0;
  std::int64_t update_after_step_ = 0;
  bool warmup_ = true;
  bool single_precision_ = false;

  template <class T>
  double decay_as(const DecayInput& in) const noexcept {
    const auto e = static_cast<T>(in.step - update_after_step_ - 1);
    if (e <= T(0)) return 0.0;
    if (!warmup_) return beta_;
    // The power in double, rounded to T: ATen's pow of a float tensor by a Python float does so
    // (ema-pytorch's single precision; powf with the exponent in float differed from it by one
    // float ulp in 35 of 1000 steps, and the averages parted from there).
    const T value =
        T(1) - static_cast<T>(std::pow(static_cast<double>(T(1) + e / static_cast<T>(inv_gamma_)), -power_));
    return static_cast<double>(std::clamp(value, static_cast<T>(min_value_), static_cast<T>(beta_)));
  }
};

// ---- the power-function EMA of Karras et al. 2024 -----------------------------------------

// The largest sigma_rel a power-function EMA can have (gamma -> 0): sqrt(1/12).
inline constexpr double max_sigma_rel = 0.28867513459481287;

// sigma_rel = sqrt((gamma + 1) / ((gamma + 2)^2 (gamma + 3))), the EMA's relative width.
inline double gamma_to_sigma_rel(double gamma) {
  detail::check_positive(gamma, "gamma");
  return std::sqrt((gamma + 1.0) / ((gamma + 2.0) * (gamma + 2.0) * (gamma + 3.0)));
}

// The inverse: the largest real root of g^3 + 7g^2 + (16 - s^-2) g + (12 - s^-2) = 0,
// for 0 < sigma_rel < sqrt(1/12) ~ 0.2887. The cubic is (g+2)^2 (g+3) - s^-2 (g+1), which has
// exactly one positive root there; bisection brackets it and Newton polishes to full precision.
inline double sigma_rel_to_gamma(double sigma_rel) {
  if (!(sigma_rel > 0.0 && sigma_rel < max_sigma_rel))
    detail::fail("sigma_rel must be in (0, {:.4f}), got {}", max_sigma_rel, sigma_rel);
  const double t = 1.0 / (sigma_rel * sigma_rel);
  auto f = [t](double g) { return (g + 2.0) * (g + 2.0) * (g + 3.0) - t * (g + 1.0); };
  double lo = 0.0, hi = std::sqrt(t) + 1.0;  // f(0) = 12 - t < 0 < f(sqrt(t) + 1)
  for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (f(mid) < 0.0 ? lo : hi) = mid;
  }
  double g = 0.5 * (lo + hi);
  for (int i = 0; i < 3; ++i) {
    const double df = 3.0 * g * g + 14.0 * g + 16.0 - t;
    if (df == 0.0) break;
    g -= f(g) / df;
  }
  return g;
}

// d = (1 - dt / t)^(gamma + 1) with t = the step and dt = steps since the previous update; the
// first update (t = dt) copies. Averages the model's history with weights that grow as t^gamma,
// the profile that post-hoc EMA synthesis assumes.
class PowerFunction {
 public:
  static constexpr std::string_view name = "PowerFunction";

  PowerFunction() = default;  // sigma_rel 0.10
  explicit PowerFunction(double gamma) { this->gamma(gamma); }
  static PowerFunction from_sigma_rel(double sigma_rel) { return PowerFunction(sigma_rel_to_gamma(sigma_rel)); }

  double gamma() const noexcept { return gamma_; }
  PowerFunction& gamma(double value) {
    detail::check_positive(value, "PowerFunction::gamma");
    gamma_ = value;
    return *this;
  }
  double sigma_rel() const { return gamma_to_sigma_rel(gamma_); }

  double decay(const DecayInput& in) const noexcept {
    const auto t = static_cast<double>(in.step);
    const auto dt = static_cast<double>(in.steps_since_last_update);
    if (t <= dt) return 0.0;
    return std::pow(1.0 - dt / t, gamma_ + 1.0);
  }
  std::vector<Field> fields() const { return {{"gamma", gamma_}}; }
  bool operator==(const PowerFunction&) const = default;

 private:
  double gamma_ = 6.9372039376;
};

// d = 1 - 1/n at the n-th update: the running mean of every update (SWA). The first update copies.
class Uniform {
 public:
  static constexpr std::string_view name = "Uniform";

  double decay(const DecayInput& in) const noexcept { return 1.0 - weight(in); }
  // The lerp weight 1/n itself, so the update uses exactly what torch's SWA uses (1 - d would
  // round differently).
  double weight(const DecayInput& in) const noexcept {
    return in.update <= 1 ? 1.0 : 1.0 / static_cast<double>(in.update);
  }
  std::vector<Field> fields() const { return {}; }
  bool operator==(const Uniform&) const = default;
};

// ---- the TensorFlow / diffusers ramp ------------------------------------------------------

// TensorFlow's ExponentialMovingAverage with num_updates, and diffusers' EMAModel without
// use_ema_warmup: with t = step - update_after_step - 1, d = 0 while t <= 0, then the rational
// ramp (1 + t) / (10 + t), capped at `decay` and floored at `min_decay`. d reaches 0.9 at t = 81,
// 0.99 at t = 891; computed in double, as diffusers' Python floats are.
class RationalRamp {
 public:
  static constexpr std::string_view name = "RationalRamp";

  RationalRamp() = default;
  explicit RationalRamp(double decay) { this->decay_max(decay); }

  double decay_max() const noexcept { return decay_; }
  RationalRamp& decay_max(double value) {
    detail::check_unit_interval(value, "RationalRamp::decay_max");
    if (value < min_decay_)
      detail::fail("RationalRamp::decay_max must be >= min_decay ({}), got {}", min_decay_, value);
    decay_ = value;
    return *this;
  }
  double min_decay() const noexcept { return min_decay_; }
  RationalRamp& min_decay(double value) {
    if (!(value >= 0.0 && value <= decay_))
      detail::fail("RationalRamp::min_decay must be in [0, decay_max = {}], got {}", decay_, value);
    min_decay_ = value;
    return *this;
  }
  std::int64_t update_after_step() const noexcept { return update_after_step_; }
  RationalRamp& update_after_step(std::int64_t value) {
    detail::check_non_negative_int(value, "RationalRamp::update_after_step");
    update_after_step_ = value;
    return *this;
  }

  double decay(const DecayInput& in) const noexcept {
    const auto t = static_cast<double>(in.step - update_after_step_ - 1);
    if (t <= 0.0) return 0.0;
    return std::max(min_decay_, std::min(decay_, (1.0 + t) / (10.0 + t)));
  }
  std::vector<Field> fields() const {
    return {{"decay", decay_},
            {"min_decay", min_decay_},
            {"update_after_step", static_cast<double>(update_after_step_), true}};
  }
  bool operator==(const RationalRamp&) const = default;

 private:
  double decay_ = 0.9999;
  double min_decay_ = 0.0;
  std::int64_t update_after_step_ = 0;
};

// ---- the cosine momentum of self-supervised teachers ---------------------------------------

// Where a cosine momentum schedule reaches its end value. lightly's cosine_schedule(step,
// max_steps, ...) reaches it at the last step (K' = total_steps - 1); DINO's cosine_scheduler,
// an array of total_steps values, one step after the last (K' = total_steps).
enum class CosineEnd : std::uint8_t { at_last_step = 0, after_last_step = 1 };

// The teacher momentum of BYOL, DINO, MoCo v3, iBOT and I-JEPA: with k = step - 1 (the first
// update has k = 0), d = end - (end - start) (cos(pi k / K') + 1) / 2, rising from `start` to
// `end` over K' steps and staying at `end` after. The average starts as the model (the teacher is
// a copy of the student) and every update averages with this d. With steps_per_epoch(n) > 1 the
// schedule's index is the epoch, k = (step - 1) / n, and total_steps counts epochs: the momentum
// set once per epoch while the teacher updates after every batch (lightly's BYOL example,
// cosine_schedule(epoch, max_epochs, ...) at each epoch's start).
class CosineMomentum {
 public:
  static constexpr std::string_view name = "CosineMomentum";

  CosineMomentum() = default;
  explicit CosineMomentum(double start, double end = 1.0, std::int64_t total_steps = 1000) {
    start_ = 0.0;  // so that end() checks only its own range; start() then checks start <= end
    this->end(end);
    this->start(start);
    this->total_steps(total_steps);
  }

  double start() const noexcept { return start_; }
  CosineMomentum& start(double value) {
    if (!(value >= 0.0 && value <= end_))
      detail::fail("CosineMomentum::start must be in [0, end = {}], got {}", end_, value);
    start_ = value;
    return *this;
  }
  double end() const noexcept { return end_; }
  CosineMomentum& end(double value) {
    if (!(value >= start_ && value <= 1.0))
      detail::fail("CosineMomentum::end must be in [start = {}, 1], got {}", start_, value);
    end_ = value;
    return *this;
  }
  std::int64_t total_steps() const noexcept { return total_steps_; }
  CosineMomentum& total_steps(std::int64_t value) {
    detail::check_positive_int(value, "CosineMomentum::total_steps");
    if (endpoint_ == CosineEnd::at_last_step && value < 2)
      detail::fail("CosineMomentum::total_steps must be >= 2 with CosineEnd::at_last_step (K' = total_steps - 1 "
                   "must be positive), got {}",
                   value);
    total_steps_ = value;
    return *this;
  }
  CosineEnd endpoint() const noexcept { return endpoint_; }
  CosineMomentum& endpoint(CosineEnd value) {
    if (value != CosineEnd::at_last_step && value != CosineEnd::after_last_step)
      detail::fail("CosineMomentum::endpoint must be at_last_step or after_last_step, got {}", static_cast<int>(value));
    if (value == CosineEnd::at_last_step && total_steps_ < 2)
      detail::fail("CosineMomentum::endpoint at_last_step needs total_steps >= 2, got {}", total_steps_);
    endpoint_ = value;
    return *this;
  }

  // Optimizer steps per index of the schedule (its epoch length); 1 (default): one per step.
  std::int64_t steps_per_epoch() const noexcept { return steps_per_epoch_; }
  CosineMomentum& steps_per_epoch(std::int64_t value) {
    detail::check_positive_int(value, "CosineMomentum::steps_per_epoch");
    steps_per_epoch_ = value;
    return *this;
  }

  double decay(const DecayInput& in) const noexcept {
    const std::int64_t span = endpoint_ == CosineEnd::at_last_step ? total_steps_ - 1 : total_steps_;
    const std::int64_t k = std::max<std::int64_t>(in.step - 1, 0) / steps_per_epoch_;
    if (k >= span) return end_;
    constexpr double pi = 3.141592653589793;
    return end_ - (end_ - start_) * (std::cos(pi * static_cast<double>(k) / static_cast<double>(span)) + 1.0) / 2.0;
  }
  std::vector<Field> fields() const {
    std::vector<Field> out = {{"start", start_},
                              {"end", end_},
                              {"total_steps", static_cast<double>(total_steps_), true},
                              {"endpoint", static_cast<double>(endpoint_), true}};
    // Only when set: the checkpoints of a per-step schedule are those written before it existed.
    if (steps_per_epoch_ != 1) out.push_back({"steps_per_epoch", static_cast<double>(steps_per_epoch_), true});
    return out;
  }
  bool operator==(const CosineMomentum&) const = default;

 private:
  double start_ = 0.996;
  double end_ = 1.0;
  std::int64_t total_steps_ = 1000;
  CosineEnd endpoint_ = CosineEnd::at_last_step;
  std::int64_t steps_per_epoch_ = 1;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
