// Presets: one factory per Python peer, with the peer's defaults, so a run moves from Python to
// C++ without changing its numbers. Each returns an ordinary emakit::Ema.
//
// | Python                                                     | emakit                                          |
// |------------------------------------------------------------|-------------------------------------------------|
// | ema_pytorch.EMA(model, beta=..., ...)                      | ema_pytorch(*model, {.beta = ...})              |
// | timm ModelEmaV3(model, decay=..., use_warmup=...)          | timm_model_ema_v3(*model, {...})                |
// |   ema.update(model, step=step)                             |   ema.update({.step = step})                    |
// | AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(d)) | averaged_model_ema(*model, {.decay = d})        |
// | AveragedModel(model) (SWA)                                 | averaged_model_swa(*model, {...})               |
// | nvalchemi EMAHook(decay=..., start_step=..., ...)          | nvalchemi_ema(*model, {...})                    |
// |   hook(ctx, AFTER_OPTIMIZER_STEP, will_skip=s)             |   ema.update({.vetoed = s})                     |
// |   (as a hook, lazily made)                                 |   hook.add(*model, nvalchemi_ema_recipe({...})) |
// | luxonis-train ModelEma(model, decay=..., decay_tau=...)    | luxonis_model_ema(*model, {...})                |
// | luxonis-train EMACallback(decay=..., decay_tau=...)        |   hook.add(*model, luxonis_ema_callback_recipe) |
// | diffusers EMAModel(model.parameters(), decay=...)          | diffusers_ema_model(*model, {...})              |
// | diffusers EMAModel(..., use_ema_warmup=True)               | diffusers_ema_model_warmup(*model, {...})       |
// | Lightning EMAWeightAveraging(decay=..., ...)               | lightning_ema_weight_averaging(*model, {...})   |
// | lightly update_momentum(..., cosine_schedule(k, K, m0, 1)) | cosine_momentum_teacher(*model, {...})          |
// (every name in the emakit column is in namespace emakit)
//
// Every preset keeps the average in the model's dtype, as its peer does; emakit's own default
// (an fp32 average of a bf16/fp16 model) differs on purpose. Set `.dtype` to get it back.
// Every preset also computes each element as its peer does (EmaOptions::arithmetic): torch's
// fused lerp for ema-pytorch, timm, AveragedModel's EMA and nvalchemi; d*ema + (1-d)*x for
// Lightning; lightly's scaled fused add; diffusers' subtraction (fused with foreach=True). Over a
// whole run the average is then the peer's bit for bit on CPU, where a plain lerp would drift from
// the weighted sums by up to (D + W - 1) / W relative (1.3e-5 at d = 0.999 in float32).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/decay.hpp>
#include <emakit/ema.hpp>
#include <emakit/options.hpp>
#include <emakit/recipe.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// ---- ema-pytorch EMA ----------------------------------------------------------------------

struct EmaPytorchOptions {
  double beta = 0.9999;
  std::int64_t update_after_step = 100;
  std::int64_t update_every = 10;
  double inv_gamma = 1.0;
  double power = 2.0 / 3.0;
  double min_value = 0.0;
  std::vector<std::string> param_or_buffer_names_no_ema = {};
  std::vector<std::string> ignore_names = {};
  std::vector<std::string> ignore_startswith_names = {};
  std::int64_t update_model_with_ema_every = 0;  // 0: off (ema-pytorch's None)
  double update_model_with_ema_beta = 0.0;
  std::optional<c10::ScalarType> dtype = std::nullopt;  // default: the model's (deepcopy)
};

using EmaPytorchEma = Ema<InversePowerWarmup, StepSchedule, FlatStorage>;

// The parts of an ema-pytorch EMA: decay computed in float32 from the update counter; the first
// update copies, then every update_every-th call (counted from the first) copies until
// update_after_step has passed and averages after; integer tensors untouched; ignored names
// still copied by those copies; optional switch of the model to the EMA.
inline InversePowerWarmup ema_pytorch_decay(const EmaPytorchOptions& o) {
  return InversePowerWarmup(o.beta)
      .min_value(o.min_value)
      .inv_gamma(o.inv_gamma)
      .power(o.power)
      .update_after_step(o.update_after_step)
      .single_precision(true);
}
inline StepSchedule ema_pytorch_schedule(const EmaPytorchOptions& o) {
  // ema-pytorch averages when (step - 1) % update_every == 0 and step - 1 > update_after_step.
  return StepSchedule()
      .warmup(Warmup::copy_before_start)
      .start_step(o.update_after_step + 2)
      .update_every(o.update_every)
      .every_offset(1);
}
inline EmaOptions ema_pytorch_options(const EmaPytorchOptions& o) {
  auto out = EmaOptions()
                 .keep_model_dtype(true)
                 .arithmetic(Arithmetic::fused_lerp)
                 .copy_only(o.param_or_buffer_names_no_ema)
                 .ignore(o.ignore_names)
                 .ignore_prefixes(o.ignore_startswith_names)
                 .ignored_follow_copies(true)
                 .non_floating(TensorMode::ignore);
  if (o.update_model_with_ema_every > 0)
    out.switch_model(o.update_model_with_ema_every, o.update_model_with_ema_beta, 1);
  if (o.dtype) out.dtype(*o.dtype);
  return out;
}

template <StoragePolicy Storage = FlatStorage>
Ema<InversePowerWarmup, StepSchedule, Storage> ema_pytorch(const torch::nn::Module& model,
                                                           const EmaPytorchOptions& o = {}, Storage storage = {}) {
  return Ema<InversePowerWarmup, StepSchedule, Storage>(model, ema_pytorch_decay(o), ema_pytorch_schedule(o),
                                                        ema_pytorch_options(o), std::move(storage));
}
inline EmaPytorchEma ema_pytorch(std::vector<SourceTensor> tensors, const EmaPytorchOptions& o = {}) {
  return EmaPytorchEma(std::move(tensors), ema_pytorch_decay(o), ema_pytorch_schedule(o), ema_pytorch_options(o));
}

// ---- timm ModelEmaV3 --------------------------------------------------------------------

// For `ema.update(model, step=step)`, timm's train.py way: pass the step to update(). timm's
// `update(model)` without a step uses the plain decay at every call: that is FixedEma.
struct TimmModelEmaV3Options {
  double decay = 0.9999;
  double min_decay = 0.0;
  std::int64_t update_after_step = 0;
  bool use_warmup = false;
  double warmup_gamma = 1.0;
  double warmup_power = 2.0 / 3.0;
  bool exclude_buffers = false;
  std::optional<c10::ScalarType> dtype = std::nullopt;
  std::optional<c10::Device> device = std::nullopt;
};

inline InversePowerWarmup timm_v3_decay(const TimmModelEmaV3Options& o) {
  return InversePowerWarmup(o.decay)
      .min_value(o.min_decay)
      .inv_gamma(o.warmup_gamma)
      .power(o.warmup_power)
      .update_after_step(o.update_after_step)
      .warmup(o.use_warmup);
}
inline EmaOptions timm_v3_options(const TimmModelEmaV3Options& o) {
  auto out = EmaOptions()
                 .keep_model_dtype(true)
                 .arithmetic(Arithmetic::fused_lerp)
                 .buffers(o.exclude_buffers ? TensorMode::copy : TensorMode::average);
  if (o.dtype) out.dtype(*o.dtype);
  if (o.device) out.device(*o.device);
  return out;
}

template <StoragePolicy Storage = FlatStorage>
Ema<InversePowerWarmup, StepSchedule, Storage> timm_model_ema_v3(const torch::nn::Module& model,
                                                                 const TimmModelEmaV3Options& o = {},
                                                                 Storage storage = {}) {
  return Ema<InversePowerWarmup, StepSchedule, Storage>(model, timm_v3_decay(o), StepSchedule(), timm_v3_options(o),
                                                        std::move(storage));
}
inline Ema<InversePowerWarmup> timm_model_ema_v3(std::vector<SourceTensor> tensors,
                                                 const TimmModelEmaV3Options& o = {}) {
  return Ema<InversePowerWarmup>(std::move(tensors), timm_v3_decay(o), StepSchedule(), timm_v3_options(o));
}

// ---- torch AveragedModel, and nvalchemi's EMAHook on top of it ------------------------------

struct AveragedModelOptions {
  double decay = 0.999;  // get_ema_multi_avg_fn's default (not used by the SWA preset)
  bool use_buffers = false;
};

// AveragedModel's options: its multi_avg_fn EMA (get_ema_multi_avg_fn: _foreach_lerp_) and SWA
// lerp; `arithmetic` is Arithmetic::weighted_sum for an avg_fn of get_ema_avg_fn (Lightning).
inline EmaOptions averaged_model_options(bool use_buffers, Arithmetic arithmetic = Arithmetic::fused_lerp) {
  return EmaOptions()
      .keep_model_dtype(true)
      .arithmetic(arithmetic)
      .buffers(use_buffers ? TensorMode::average : TensorMode::copy);
}
inline StepSchedule averaged_model_schedule() { return StepSchedule().warmup(Warmup::skip_before_start); }

// AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=...): the first
// update_parameters copies, later ones lerp with weight 1 - decay.
template <StoragePolicy Storage = FlatStorage>
Ema<Fixed, StepSchedule, Storage> averaged_model_ema(const torch::nn::Module& model, const AveragedModelOptions& o = {},
                                                     Storage storage = {}) {
  return Ema<Fixed, StepSchedule, Storage>(model, Fixed(o.decay), averaged_model_schedule(),
                                           averaged_model_options(o.use_buffers), std::move(storage));
}
inline Ema<Fixed> averaged_model_ema(std::vector<SourceTensor> tensors, const AveragedModelOptions& o = {}) {
  return Ema<Fixed>(std::move(tensors), Fixed(o.decay), averaged_model_schedule(),
                    averaged_model_options(o.use_buffers));
}

// AveragedModel(model, use_buffers=...): stochastic weight averaging, the equal-weight mean.
template <StoragePolicy Storage = FlatStorage>
Ema<Uniform, StepSchedule, Storage> averaged_model_swa(const torch::nn::Module& model,
                                                       const AveragedModelOptions& o = {}, Storage storage = {}) {
  return Ema<Uniform, StepSchedule, Storage>(model, Uniform(), averaged_model_schedule(),
                                             averaged_model_options(o.use_buffers), std::move(storage));
}
inline Ema<Uniform> averaged_model_swa(std::vector<SourceTensor> tensors, const AveragedModelOptions& o = {}) {
  return Ema<Uniform>(std::move(tensors), Uniform(), averaged_model_schedule(), averaged_model_options(o.use_buffers));
}

// nvalchemi EMAHook: AveragedModel's EMA on completed steps >= start_step with
// step % update_every == 0; a vetoed step (will_skip) does nothing.
struct NvalchemiEmaOptions {
  double decay = 0.999;
  std::int64_t update_every = 1;
  std::int64_t start_step = 0;
  bool use_buffers = true;
};

inline StepSchedule nvalchemi_ema_schedule(const NvalchemiEmaOptions& o) {
  return StepSchedule().warmup(Warmup::skip_before_start).start_step(o.start_step).update_every(o.update_every);
}

template <StoragePolicy Storage = FlatStorage>
Ema<Fixed, StepSchedule, Storage> nvalchemi_ema(const torch::nn::Module& model, const NvalchemiEmaOptions& o = {},
                                                Storage storage = {}) {
  return Ema<Fixed, StepSchedule, Storage>(model, Fixed(o.decay), nvalchemi_ema_schedule(o),
                                           averaged_model_options(o.use_buffers), std::move(storage));
}
inline Ema<Fixed> nvalchemi_ema(std::vector<SourceTensor> tensors, const NvalchemiEmaOptions& o = {}) {
  return Ema<Fixed>(std::move(tensors), Fixed(o.decay), nvalchemi_ema_schedule(o),
                    averaged_model_options(o.use_buffers));
}
// For emakit::EmaHook (hooks.hpp), which makes the EMA at setup or at the first eligible step:
//   hook.add("model", *model, emakit::nvalchemi_ema_recipe({.decay = 0.999, .start_step = 100}),
//            {.creation = emakit::Creation::at_first_eligible_step});
inline Recipe<Fixed> nvalchemi_ema_recipe(const NvalchemiEmaOptions& o = {}) {
  return Recipe<Fixed>(Fixed(o.decay), nvalchemi_ema_schedule(o), averaged_model_options(o.use_buffers));
}

// Earlier names of 0.1 development, deprecated (removed in 0.2): ema_hook() returned an Ema, not a
// hook (EmaHook is the trainer hook), so the preset is named after its peer like the others.
using EmaHookOptions [[deprecated("renamed emakit::NvalchemiEmaOptions")]] = NvalchemiEmaOptions;
template <StoragePolicy Storage = FlatStorage>
[[deprecated("renamed emakit::nvalchemi_ema()")]] Ema<Fixed, StepSchedule, Storage> ema_hook(
    const torch::nn::Module& model, const NvalchemiEmaOptions& o = {}, Storage storage = {}) {
  return nvalchemi_ema(model, o, std::move(storage));
}
[[deprecated("renamed emakit::nvalchemi_ema()")]] inline Ema<Fixed> ema_hook(std::vector<SourceTensor> tensors,
                                                                             const NvalchemiEmaOptions& o = {}) {
  return nvalchemi_ema(std::move(tensors), o);
}
[[deprecated("renamed emakit::nvalchemi_ema_recipe()")]] inline Recipe<Fixed> ema_hook_recipe(
    const NvalchemiEmaOptions& o = {}) {
  return nvalchemi_ema_recipe(o);
}

// ---- luxonis-train ModelEma -----------------------------------------------------------------

// ModelEma(model, decay, use_dynamic_decay=True, decay_tau): d = decay * (1 - exp(-updates/tau))
// over the whole state dict, non-floats copied. use_dynamic_decay=False is FixedEma with
// luxonis_options() (keep_model_dtype(true), Arithmetic::fused_lerp). luxonis-train's ModelEma and
// EMACallback update with torch._foreach_lerp_ (Arithmetic::fused_lerp).
inline EmaOptions luxonis_options() { return EmaOptions().keep_model_dtype(true).arithmetic(Arithmetic::fused_lerp); }

struct LuxonisModelEmaOptions {
  double decay = 0.9999;
  double decay_tau = 2000.0;
};

template <StoragePolicy Storage = FlatStorage>
Ema<ExponentialRamp, StepSchedule, Storage> luxonis_model_ema(const torch::nn::Module& model,
                                                              const LuxonisModelEmaOptions& o = {},
                                                              Storage storage = {}) {
  return Ema<ExponentialRamp, StepSchedule, Storage>(model, ExponentialRamp(o.decay, o.decay_tau), StepSchedule(),
                                                     luxonis_options(), std::move(storage));
}
inline Ema<ExponentialRamp> luxonis_model_ema(std::vector<SourceTensor> tensors, const LuxonisModelEmaOptions& o = {}) {
  return Ema<ExponentialRamp>(std::move(tensors), ExponentialRamp(o.decay, o.decay_tau), StepSchedule(),
                              luxonis_options());
}

// luxonis-train EMACallback(decay=0.5, decay_tau=2000), for emakit::EmaHook: made at setup (fit
// start), one update per accumulation window at the window's first micro-batch
// (batch_idx % accumulate == 0), the EMA weights swapped in for validation and test and kept at
// train end, checkpoints holding the EMA weights: the defaults of HookOptions. Lightning's
// batch_idx restarts every epoch and `accumulate` counts calls across epochs: with an epoch length
// that is not a multiple of the window, use accumulate = 1 and call the hook only at
// batch_idx % window == 0 (checked against the real callback, tests/conformance).
struct LuxonisEmaCallbackOptions {
  double decay = 0.5;
  double decay_tau = 2000.0;
  std::int64_t accumulate = 1;  // the trainer's accumulate_grad_batches
};

inline Recipe<ExponentialRamp> luxonis_ema_callback_recipe(const LuxonisEmaCallbackOptions& o = {}) {
  return Recipe<ExponentialRamp>(ExponentialRamp(o.decay, o.decay_tau),
                                 StepSchedule().accumulate(o.accumulate).window_edge(WindowEdge::start),
                                 luxonis_options());
}

// ---- diffusers EMAModel -------------------------------------------------------------------

// EMAModel(model.parameters(), decay=..., min_decay=..., update_after_step=..., use_ema_warmup=...,
// inv_gamma=..., power=...): the shadow parameters start as clones of the model's, every step()
// (optimization_step += 1) computes d from the TensorFlow ramp (RationalRamp) or, with
// use_ema_warmup, the inverse-power warmup, both clamped to [min_decay, decay]; parameters that
// require grad are averaged, the others copied. Buffers are not held (diffusers takes
// parameters()). Each step is diffusers' s - (1 - d)(s - p) (Arithmetic::subtract), or with
// foreach=True its _foreach_sub_(s, s - p, alpha=1 - d) (Arithmetic::fused_subtract). The
// difference: diffusers decides frozen or not at every step, emakit once, when the EMA is made
// (Ema::frozen_parameters() names them).
struct DiffusersEmaModelOptions {
  double decay = 0.9999;
  double min_decay = 0.0;
  std::int64_t update_after_step = 0;
  bool use_ema_warmup = false;  // true: use diffusers_ema_model_warmup()
  double inv_gamma = 1.0;
  double power = 2.0 / 3.0;
  bool foreach = false;  // diffusers' foreach=True: its fused subtraction (Arithmetic::fused_subtract)
};

namespace detail {
// Refuses options the preset cannot honour: use_ema_warmup with diffusers_ema_model() (whose type
// is the TensorFlow ramp's), and diffusers' own ranges, each named.
EMAKIT_FUNC void check_diffusers_options(const DiffusersEmaModelOptions& o, bool warmup);
}  // namespace detail
inline EmaOptions diffusers_options(bool foreach = false) {
  return EmaOptions()
      .keep_model_dtype(true)
      .arithmetic(foreach ? Arithmetic::fused_subtract : Arithmetic::subtract)
      .buffers(TensorMode::ignore)
      .frozen_parameters(TensorMode::copy);
}
inline RationalRamp diffusers_decay(const DiffusersEmaModelOptions& o) {
  detail::check_diffusers_options(o, false);
  return RationalRamp(o.decay).min_decay(o.min_decay).update_after_step(o.update_after_step);
}
inline InversePowerWarmup diffusers_warmup_decay(const DiffusersEmaModelOptions& o) {
  detail::check_diffusers_options(o, true);
  return InversePowerWarmup(o.decay)
      .min_value(o.min_decay)
      .inv_gamma(o.inv_gamma)
      .power(o.power)
      .update_after_step(o.update_after_step);
}

// use_ema_warmup=False (diffusers' default): d from the TensorFlow ramp.
template <StoragePolicy Storage = FlatStorage>
Ema<RationalRamp, StepSchedule, Storage> diffusers_ema_model(const torch::nn::Module& model,
                                                             const DiffusersEmaModelOptions& o = {},
                                                             Storage storage = {}) {
  return Ema<RationalRamp, StepSchedule, Storage>(model, diffusers_decay(o), StepSchedule(),
                                                  diffusers_options(o.foreach), std::move(storage));
}
inline Ema<RationalRamp> diffusers_ema_model(std::vector<SourceTensor> tensors,
                                             const DiffusersEmaModelOptions& o = {}) {
  return Ema<RationalRamp>(std::move(tensors), diffusers_decay(o), StepSchedule(), diffusers_options(o.foreach));
}
// use_ema_warmup=True: d from the inverse-power warmup (inv_gamma, power).
template <StoragePolicy Storage = FlatStorage>
Ema<InversePowerWarmup, StepSchedule, Storage> diffusers_ema_model_warmup(const torch::nn::Module& model,
                                                                          const DiffusersEmaModelOptions& o = {},
                                                                          Storage storage = {}) {
  return Ema<InversePowerWarmup, StepSchedule, Storage>(model, diffusers_warmup_decay(o), StepSchedule(),
                                                        diffusers_options(o.foreach), std::move(storage));
}
inline Ema<InversePowerWarmup> diffusers_ema_model_warmup(std::vector<SourceTensor> tensors,
                                                          const DiffusersEmaModelOptions& o = {}) {
  return Ema<InversePowerWarmup>(std::move(tensors), diffusers_warmup_decay(o), StepSchedule(),
                                 diffusers_options(o.foreach));
}

// ---- Lightning EMAWeightAveraging ------------------------------------------------------------

// EMAWeightAveraging(decay=0.999, use_buffers=True, update_every_n_steps=1,
// update_starting_at_step=None): an AveragedModel updated after optimizer steps whose 0-based
// index i = global_step - 1 has i >= update_starting_at_step and i % update_every_n_steps == 0;
// its first update copies, later ones average. Call update() once per optimizer step (Lightning's
// global_step: with accumulate_grad_batches = N, once per N batches). update_starting_at_epoch:
// call ema.epoch_end(current_epoch) at the end of each training epoch (on_train_epoch_end; the
// hook's train_epoch_end()); from that epoch on it updates once more with the weights as they
// are, an update that is not an optimizer step (EmaOptions::update_at_epoch_ends), so that the
// step schedule goes on as Lightning's. Each update is get_ema_avg_fn's decay * ema + (1 - decay)
// * x (Arithmetic::weighted_sum), not a lerp. Averaging and swapping into the model for validation,
//   as the callback does, is emakit::EmaHook with lightning_ema_weight_averaging_recipe().
struct LightningEmaWeightAveragingOptions {
  double decay = 0.999;
  bool use_buffers = true;
  std::int64_t update_every_n_steps = 1;
  std::optional<std::int64_t> update_starting_at_step = std::nullopt;
  std::optional<std::int64_t> update_starting_at_epoch = std::nullopt;
};

inline EmaOptions lightning_ema_options(const LightningEmaWeightAveragingOptions& o) {
  auto out = averaged_model_options(o.use_buffers, Arithmetic::weighted_sum);
  if (o.update_starting_at_epoch) out.update_at_epoch_ends(*o.update_starting_at_epoch);
  return out;
}

EMAKIT_FUNC StepSchedule lightning_ema_schedule(const LightningEmaWeightAveragingOptions& o);

template <StoragePolicy Storage = FlatStorage>
Ema<Fixed, StepSchedule, Storage> lightning_ema_weight_averaging(const torch::nn::Module& model,
                                                                 const LightningEmaWeightAveragingOptions& o = {},
                                                                 Storage storage = {}) {
  return Ema<Fixed, StepSchedule, Storage>(model, Fixed(o.decay), lightning_ema_schedule(o), lightning_ema_options(o),
                                           std::move(storage));
}
inline Ema<Fixed> lightning_ema_weight_averaging(std::vector<SourceTensor> tensors,
                                                 const LightningEmaWeightAveragingOptions& o = {}) {
  return Ema<Fixed>(std::move(tensors), Fixed(o.decay), lightning_ema_schedule(o), lightning_ema_options(o));
}
inline Recipe<Fixed> lightning_ema_weight_averaging_recipe(const LightningEmaWeightAveragingOptions& o = {}) {
  return Recipe<Fixed>(Fixed(o.decay), lightning_ema_schedule(o), lightning_ema_options(o));
}

// ---- self-supervised teachers ----------------------------------------------------------------

// The momentum teacher of BYOL / DINO / MoCo v3 / iBOT / I-JEPA: teacher = m teacher + (1 - m)
// student after every optimizer step, m following CosineMomentum from `start` to `end` over
// `total_steps`. lightly: momentum = cosine_schedule(k, total_steps, start, end) then
// update_momentum(student, teacher, momentum), k from 0 (the default endpoint); DINO's
// cosine_scheduler: CosineEnd::after_last_step. Parameters only (both take parameters()), kept in
// the model's dtype; the average starts as the student (the teacher is its deepcopy).
struct CosineTeacherOptions {
  double start = 0.996;
  double end = 1.0;
  std::int64_t total_steps = 1000;
  CosineEnd endpoint = CosineEnd::at_last_step;
  // > 1: the momentum is set per epoch of this many optimizer steps and total_steps counts epochs
  // (lightly's BYOL example: cosine_schedule(epoch, max_epochs, 0.996, 1) once per epoch, the
  // update once per batch, at its start as the example does or after the step, the same point of
  // every batch: {.total_steps = max_epochs, .steps_per_epoch = len(dataloader)}).
  std::int64_t steps_per_epoch = 1;
  // lightly's update_momentum (_foreach_mul_ then _foreach_add_ with alpha); DINO's
  // mul_(m).add_((1 - m) * x) is Arithmetic::weighted_sum.
  Arithmetic arithmetic = Arithmetic::scaled_fused_add;
};

inline CosineMomentum cosine_teacher_decay(const CosineTeacherOptions& o) {
  return CosineMomentum(o.start, o.end, 2)
      .endpoint(o.endpoint)
      .total_steps(o.total_steps)
      .steps_per_epoch(o.steps_per_epoch);
}
inline EmaOptions cosine_teacher_options(Arithmetic arithmetic = Arithmetic::scaled_fused_add) {
  return EmaOptions().keep_model_dtype(true).arithmetic(arithmetic).buffers(TensorMode::ignore);
}

template <StoragePolicy Storage = FlatStorage>
Ema<CosineMomentum, StepSchedule, Storage> cosine_momentum_teacher(const torch::nn::Module& model,
                                                                   const CosineTeacherOptions& o = {},
                                                                   Storage storage = {}) {
  return Ema<CosineMomentum, StepSchedule, Storage>(model, cosine_teacher_decay(o), StepSchedule(),
                                                    cosine_teacher_options(o.arithmetic), std::move(storage));
}
inline Ema<CosineMomentum> cosine_momentum_teacher(std::vector<SourceTensor> tensors,
                                                   const CosineTeacherOptions& o = {}) {
  return Ema<CosineMomentum>(std::move(tensors), cosine_teacher_decay(o), StepSchedule(),
                             cosine_teacher_options(o.arithmetic));
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/presets-inl.hpp>
#endif
