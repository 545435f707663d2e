// EmaOptions: which tensors an Ema averages, copies or ignores, and where and in what dtype it
// keeps them. Shared by every Ema, whatever its policies.
//
//   emakit::EmaOptions()
//       .dtype(torch::kFloat32)              // the average's dtype (default: fp32 for bf16/fp16 models)
//       .device(torch::kCPU)                 // the average's device (default: the model's): CPU offload
//       .side_stream(true)                   // CUDA: update on a side stream (see wait_for_model_reads())
//       .staging_bytes(std::int64_t{16} << 20)  // GPU memory to convert a bf16 model's weights through
//       .copy_only({"pos_embedding"})        // copied at every update, never averaged
//       .ignore({"head.weight"})             // left out of the EMA
//       .ignore_prefixes({"teacher."})       // every name starting with one of these is left out
//       .buffers(emakit::TensorMode::copy)   // buffers: averaged (default), copied or left out
//       .frozen_parameters(emakit::TensorMode::copy)   // requires_grad == false: copied (diffusers)
//       .arithmetic(emakit::Arithmetic::weighted_sum); // d*ema + (1-d)*x as Lightning computes it
//
// Non-floating tensors (e.g. BatchNorm's num_batches_tracked) are always copied, never averaged.
// A name or prefix that matches nothing in the model is an error: a typo would otherwise
// silently average a tensor you meant to exclude.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// What an Ema does with a class of tensors (EmaOptions::buffers, frozen_parameters, non_floating):
// averaged, copied at every update, or left alone.
enum class TensorMode : std::uint8_t { average = 0, copy = 1, ignore = 2 };
using BufferMode [[deprecated("renamed emakit::TensorMode: it also sets frozen parameters and non-floating tensors")]] =
    TensorMode;

// What an Ema does with one tensor of the model: averaged; copied at every update; left alone;
// or `ignore_except_copies`: left out of averages but written when an update copies the whole
// model (what ema-pytorch does with its ignored names; EmaOptions::ignored_follow_copies).
// `follow_copies` is an earlier name, deprecated: removed in 0.2.
enum class Role : std::uint8_t {
  average,
  copy,
  ignore,
  ignore_except_copies,
  follow_copies [[deprecated("renamed Role::ignore_except_copies")]] = ignore_except_copies,
};

// How an update computes each averaged element from the average a, the model's x, the decay d and
// the weight w = 1 - d (both as the decay policy gave them, in double; D and W below are them
// rounded to the opmath type: float for float/half/bf16 averages, double for double ones). Each
// operation's result is rounded to the average's dtype, as ATen rounds the result of each op, and
// nothing else is fused: the fused CPU pass, the foreach lists and the generic path compute the
// same thing. The weights sum to one only for the lerps; the others drift from a lerp by up to
// (D + W - 1) / W of the average over a run (1.3e-5 relative at d = 0.999 in float32), which is
// why a preset uses its peer's own formula.
//   lerp              a + W(x - a) for |W| < 0.5, else x + (W - 1)(x - a), two roundings: ATen's
//                     lerp formula without FMA. emakit's default (every build and CPU rounds alike).
//   fused_lerp        the same with one rounding, fma(W, x - a, a) / fma(W - 1, x - a, x): torch's
//                     lerp_ / _foreach_lerp_ on CPUs with FMA (AVX2, AVX-512) and on CUDA.
//                     ema-pytorch, timm ModelEmaV3, AveragedModel(multi_avg_fn=get_ema_multi_avg_fn),
//                     nvalchemi EMAHook.
//   weighted_sum      D a + W x, the two products rounded, then their sum: get_ema_avg_fn's
//                     `decay * ema + (1 - decay) * x` (Lightning EMAWeightAveraging,
//                     AveragedModel(avg_fn=...)), DINO's `mul_(m).add_((1 - m) * x)`.
//   scaled_fused_add  fma(x, W, D a) after D a is rounded: lightly's update_momentum
//                     (`_foreach_mul_(ema, m)` then `_foreach_add_(ema, x, alpha=1 - m)`).
//   subtract          a - W(a - x), three roundings: diffusers EMAModel (`s.sub_((1 - d) * (s - x))`).
//   fused_subtract    fma(-W, a - x, a) after a - x is rounded, two roundings: diffusers
//                     EMAModel(foreach=True) (`_foreach_sub_(s, _foreach_sub(s, x), alpha=1 - d)`,
//                     ATen's sub with alpha: one FMA on CPUs with FMA and on CUDA). fused_lerp's
//                     bits while W < 0.5, as subtract is lerp's.
// A checkpoint records it by name and loads only into an EMA with the same one.
enum class Arithmetic : std::uint8_t {
  lerp = 0,
  fused_lerp = 1,
  weighted_sum = 2,
  scaled_fused_add = 3,
  subtract = 4,
  fused_subtract = 5,
};

// Every Arithmetic, in the order of their values.
inline constexpr Arithmetic all_arithmetics[] = {Arithmetic::lerp,         Arithmetic::fused_lerp,
                                                 Arithmetic::weighted_sum, Arithmetic::scaled_fused_add,
                                                 Arithmetic::subtract,     Arithmetic::fused_subtract};

// The name of an Arithmetic, as checkpoints and messages spell it ("lerp", "fused_lerp", ...).
inline const char* arithmetic_name(Arithmetic a) noexcept {
  switch (a) {
    case Arithmetic::lerp: return "lerp";
    case Arithmetic::fused_lerp: return "fused_lerp";
    case Arithmetic::weighted_sum: return "weighted_sum";
    case Arithmetic::scaled_fused_add: return "scaled_fused_add";
    case Arithmetic::subtract: return "subtract";
    case Arithmetic::fused_subtract: return "fused_subtract";
  }
  return "unknown";
}

class EmaOptions {
 public:
  std::optional<c10::ScalarType> dtype() const noexcept { return dtype_; }
  EmaOptions& dtype(c10::ScalarType value) {
    if (!c10::isFloatingType(value))
      detail::fail("EmaOptions::dtype must be a floating dtype (the dtype of averaged tensors), got {}",
                   c10::toString(value));
    dtype_ = value;
    return *this;
  }
  // Keep every averaged tensor in its model tensor's dtype, as every Python peer does (a bf16
  // model gets a bf16 average, which stops moving at d = 0.9999). Off by default.
  bool keep_model_dtype() const noexcept { return keep_model_dtype_; }
  EmaOptions& keep_model_dtype(bool value) {
    keep_model_dtype_ = value;
    return *this;
  }
  std::optional<c10::Device> device() const noexcept { return device_; }
  EmaOptions& device(c10::Device value) {
    device_ = value;
    return *this;
  }
  // CUDA: run each update on a side stream, so that it overlaps the next forward and backward
  // (NeMo's EMA does this). The side stream waits for the optimizer step before it reads the
  // parameters; call Ema::wait_for_model_reads() before the next optimizer step writes them.
  // Buffers are averaged on the current stream (the next forward may write them), and every read of
  // the EMA waits by itself (Ema::wait_for_model_reads() says the whole protocol). With a CPU
  // average of a CUDA model, the CPU half of the update also runs off the caller's thread. No
  // effect on CPU-only models.
  bool side_stream() const noexcept { return side_stream_; }
  EmaOptions& side_stream(bool value) {
    side_stream_ = value;
    return *this;
  }
  // The bound, per device and dtype, of the staging pool through which the update converts source
  // tensors it cannot average in place (a bf16/fp16 model with an fp32 average on the GPU): GPU
  // memory of such an EMA is its average plus at most this (or the largest row of a strided
  // source, if larger), never a second full copy. A smaller pool means more, smaller chunks
  // (two foreach launches each). Default 64 MiB.
  static constexpr std::int64_t default_staging_bytes = std::int64_t{64} << 20;
  std::int64_t staging_bytes() const noexcept { return staging_bytes_; }
  EmaOptions& staging_bytes(std::int64_t value) {
    if (value < 1) detail::fail("EmaOptions::staging_bytes must be at least 1, got {}", value);
    staging_bytes_ = value;
    return *this;
  }
  // Off by default, as in the Python peers (a NaN in the model then reaches the average). On: an
  // update whose source tensors hold a NaN or an infinity changes nothing, is counted
  // (Ema::non_finite_updates()) and names the first such tensor (UpdateResult::non_finite,
  // Ema::last_non_finite(), and a warning). It costs one read of the model per update; on a GPU,
  // one _foreach_norm per (device, dtype) and one host sync.
  bool skip_non_finite() const noexcept { return skip_non_finite_; }
  EmaOptions& skip_non_finite(bool value) {
    skip_non_finite_ = value;
    return *this;
  }
  // Measure how far the EMA is from the model (emakit::Drift) at every applied update that makes
  // num_updates() a multiple of n (copies count towards it) and averages (a copy is not
  // measured); 0 = never (default). The result is in UpdateResult::drift and
  // Ema::last_drift(), and describe() prints it. On the fused CPU pass it costs arithmetic only
  // (the pass holds both values as it writes the average); elsewhere (GPU foreach lists), ATen
  // ops over the averaged tensors in chunks of at most staging_bytes() and one host sync.
  std::int64_t drift_every() const noexcept { return drift_every_; }
  // Also update at the end of every training epoch from epoch `from` on (0-based; Lightning's
  // EMAWeightAveraging(update_starting_at_epoch=from)): Ema::epoch_end(epoch) then averages the
  // model as it is (a copy if the EMA holds nothing yet). Such an update is not an optimizer step:
  // it counts as an applied update (num_updates(), the decay policy's update number), not as a
  // call or a step, so the schedule's steps (update_every, start_step) go on as without it. Off
  // (nullopt) by default: epoch_end() then does nothing.
  std::optional<std::int64_t> epoch_end_updates_from() const noexcept { return epoch_end_from_; }
  EmaOptions& update_at_epoch_ends(std::int64_t from) {
    detail::check_non_negative_int(from, "EmaOptions::update_at_epoch_ends");
    epoch_end_from_ = from;
    return *this;
  }
  // How each averaged element is computed (see Arithmetic); default Arithmetic::lerp. The presets
  // set their peer's.
  Arithmetic arithmetic() const noexcept { return arithmetic_; }
  EmaOptions& arithmetic(Arithmetic value) {
    if (static_cast<int>(value) > static_cast<int>(Arithmetic::fused_subtract))
      detail::fail("EmaOptions::arithmetic must be lerp, fused_lerp, weighted_sum, scaled_fused_add, subtract or "
                   "fused_subtract, got {}",
                   static_cast<int>(value));
    arithmetic_ = value;
    return *this;
  }
  EmaOptions& drift_every(std::int64_t n) {
    detail::check_non_negative_int(n, "EmaOptions::drift_every");
    drift_every_ = n;
    return *this;
  }
  const std::vector<std::string>& copy_only() const noexcept { return copy_only_; }
  EmaOptions& copy_only(std::vector<std::string> names) {
    copy_only_ = std::move(names);
    return *this;
  }
  const std::vector<std::string>& ignore() const noexcept { return ignore_; }
  EmaOptions& ignore(std::vector<std::string> names) {
    ignore_ = std::move(names);
    return *this;
  }
  const std::vector<std::string>& ignore_prefixes() const noexcept { return ignore_prefixes_; }
  EmaOptions& ignore_prefixes(std::vector<std::string> prefixes) {
    for (const auto& p : prefixes)
      if (p.empty()) detail::fail("EmaOptions::ignore_prefixes: an empty prefix would ignore every tensor");
    ignore_prefixes_ = std::move(prefixes);
    return *this;
  }
  // Non-floating tensors (integer buffers): copied at every update (default, as timm and
  // luxonis-train), or left out (ema-pytorch, which never touches them).
  TensorMode non_floating() const noexcept { return non_floating_; }
  EmaOptions& non_floating(TensorMode value) {
    if (value != TensorMode::copy && value != TensorMode::ignore)
      detail::fail("EmaOptions::non_floating must be copy or ignore (integers cannot be averaged), got {}",
                   static_cast<int>(value));
    non_floating_ = value;
    return *this;
  }
  // Ignored names are still written when an update copies the whole model (ema-pytorch's copies
  // at init and during warmup do this); off by default: ignored means untouched.
  bool ignored_follow_copies() const noexcept { return ignored_follow_copies_; }
  EmaOptions& ignored_follow_copies(bool value) {
    ignored_follow_copies_ = value;
    return *this;
  }
  // "Switch EMA" (Li et al. 2024): at steps with (step - offset) % every == 0 that did not copy,
  // the model is pulled to the EMA: model = lerp(model, ema, 1 - beta), or a copy for beta = 0
  // (ema-pytorch's update_model_with_ema_every / update_model_with_ema_beta). 0 = off.
  std::int64_t switch_every() const noexcept { return switch_every_; }
  std::int64_t switch_offset() const noexcept { return switch_offset_; }
  double switch_beta() const noexcept { return switch_beta_; }
  EmaOptions& switch_model(std::int64_t every, double beta = 0.0, std::int64_t offset = 0) {
    detail::check_non_negative_int(every, "EmaOptions::switch_model every");
    detail::check_non_negative_int(offset, "EmaOptions::switch_model offset");
    detail::check_unit_interval(beta, "EmaOptions::switch_model beta");
    switch_every_ = every;
    switch_beta_ = beta;
    switch_offset_ = offset;
    return *this;
  }

  TensorMode buffers() const noexcept { return buffers_; }
  EmaOptions& buffers(TensorMode value) {
    if (static_cast<int>(value) > 2)
      detail::fail("EmaOptions::buffers must be average, copy or ignore, got {}", static_cast<int>(value));
    buffers_ = value;
    return *this;
  }

  // Parameters that do not require grad when the EMA is bound (a frozen backbone, a fixed
  // embedding): averaged like the others (default, as every peer but diffusers), copied at every
  // update (diffusers' EMAModel) or left out. Decided once, at bind, from the module; the names it
  // applied to are Ema::frozen_parameters(), and describe() counts them.
  TensorMode frozen_parameters() const noexcept { return frozen_; }
  EmaOptions& frozen_parameters(TensorMode value) {
    if (static_cast<int>(value) > 2)
      detail::fail("EmaOptions::frozen_parameters must be average, copy or ignore, got {}", static_cast<int>(value));
    frozen_ = value;
    return *this;
  }

  // The role of a tensor named `name`; `floating` says whether its dtype can be averaged, `frozen`
  // whether it is a parameter that does not require grad.
  Role role(const std::string& name, bool is_buffer, bool floating, bool frozen = false) const {
    if (contains(ignore_, name) || starts_with_any(name))
      return ignored_follow_copies_ && floating ? Role::ignore_except_copies : Role::ignore;
    if (is_buffer && buffers_ == TensorMode::ignore) return Role::ignore;
    if (frozen && !is_buffer && frozen_ == TensorMode::ignore) return Role::ignore;
    if (!floating) return non_floating_ == TensorMode::ignore ? Role::ignore : Role::copy;
    if (contains(copy_only_, name) || (is_buffer && buffers_ == TensorMode::copy)) return Role::copy;
    if (frozen && !is_buffer && frozen_ == TensorMode::copy) return Role::copy;
    return Role::average;
  }

  // The dtype the EMA keeps an averaged tensor in.
  c10::ScalarType average_dtype(c10::ScalarType source) const {
    if (!c10::isFloatingType(source)) return source;  // complex stays complex
    if (dtype_) return *dtype_;
    if (keep_model_dtype_) return source;
    return (source == c10::ScalarType::Half || source == c10::ScalarType::BFloat16) ? c10::ScalarType::Float : source;
  }

  // Fails if a name or prefix of these options matches none of `names`.
  void check_names(const std::vector<std::string>& names) const {
    auto known = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
    for (const auto& n : ignore_)
      if (!known(n)) detail::fail("EmaOptions::ignore names '{}', which the model does not have", n);
    for (const auto& n : copy_only_) {
      if (!known(n)) detail::fail("EmaOptions::copy_only names '{}', which the model does not have", n);
      if (contains(ignore_, n)) detail::fail("EmaOptions: '{}' is in both ignore and copy_only; choose one", n);
      for (const auto& p : ignore_prefixes_)
        if (n.rfind(p, 0) == 0)
          detail::fail("EmaOptions: '{}' is in copy_only, but ignore_prefixes has '{}', which ignores it; choose one",
                       n, p);
    }
    for (const auto& p : ignore_prefixes_) {
      const bool any =
          std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.rfind(p, 0) == 0; });
      if (!any) detail::fail("EmaOptions::ignore_prefixes has '{}', which starts no tensor name of the model", p);
    }
  }

 private:
  static bool contains(const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  }
  bool starts_with_any(const std::string& name) const {
    return std::any_of(ignore_prefixes_.begin(), ignore_prefixes_.end(),
                       [&](const std::string& p) { return name.rfind(p, 0) == 0; });
  }

  std::optional<c10::ScalarType> dtype_;
  bool keep_model_dtype_ = false;
  std::optional<c10::Device> device_;
  std::vector<std::string> copy_only_;
  std::vector<std::string> ignore_;
  std::vector<std::string> ignore_prefixes_;
  TensorMode buffers_ = TensorMode::average;
  TensorMode frozen_ = TensorMode::average;
  bool side_stream_ = false;
  std::int64_t staging_bytes_ = default_staging_bytes;
  bool skip_non_finite_ = false;
  TensorMode non_floating_ = TensorMode::copy;
  bool ignored_follow_copies_ = false;
  std::int64_t switch_every_ = 0;
  std::int64_t drift_every_ = 0;
  std::int64_t switch_offset_ = 0;
  double switch_beta_ = 0.0;
  Arithmetic arithmetic_ = Arithmetic::lerp;
  std::optional<std::int64_t> epoch_end_from_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
