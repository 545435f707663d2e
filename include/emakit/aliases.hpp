// Ready-made Ema types: one line per experiment.
//
// | alias            | decay              | schedule (default)  | storage          |
// |------------------|--------------------|---------------------|------------------|
// | FixedEma         | Fixed(0.9999)      | every step          | FlatStorage      |
// | WarmupEma        | InversePowerWarmup | every step          | FlatStorage      |
// | RampEma          | ExponentialRamp    | every step          | FlatStorage      |
// | PowerEma         | PowerFunction      | every step          | FlatStorage      |
// | SwaAverage       | Uniform            | every step          | FlatStorage      |
// | RationalRampEma  | RationalRamp       | every step          | FlatStorage      |
// | CosineEma        | CosineMomentum     | every step          | FlatStorage      |
// | ModuleEma<M>     | Fixed(0.9999)      | every step          | ModuleStorage<M> |
// | ModuleWarmupEma<M> | InversePowerWarmup | every step        | ModuleStorage<M> |
//
//   emakit::WarmupEma ema(*model, emakit::InversePowerWarmup(0.999).power(0.75));
//   emakit::ModuleEma<NetImpl> teacher(*model);   teacher.module()->forward(x);
#pragma once

#include <emakit/decay.hpp>
#include <emakit/detail/config.hpp>
#include <emakit/ema.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

using FixedEma = Ema<Fixed, StepSchedule, FlatStorage>;
using WarmupEma = Ema<InversePowerWarmup, StepSchedule, FlatStorage>;
using RampEma = Ema<ExponentialRamp, StepSchedule, FlatStorage>;
using PowerEma = Ema<PowerFunction, StepSchedule, FlatStorage>;
using SwaAverage = Ema<Uniform, StepSchedule, FlatStorage>;
using RationalRampEma = Ema<RationalRamp, StepSchedule, FlatStorage>;
using CosineEma = Ema<CosineMomentum, StepSchedule, FlatStorage>;

// The decay policies of the seven flat aliases above, the one list of them: with EMAKIT_COMPILED
// (emakit::compiled, detail/config.hpp) these come instantiated from the library (src/aliases.cpp), with their
// emakit::save, emakit::load (checkpoint.hpp) and emakit::describe (format.hpp).
#define EMAKIT_FOR_EACH_FLAT_ALIAS_DECAY(X) \
  X(Fixed) X(InversePowerWarmup) X(ExponentialRamp) X(PowerFunction) X(Uniform) X(RationalRamp) X(CosineMomentum)

#if EMAKIT_EXTERN_ALIASES
#define EMAKIT_EXTERN_EMA(Decay) extern template class Ema<Decay, StepSchedule, FlatStorage>;
EMAKIT_FOR_EACH_FLAT_ALIAS_DECAY(EMAKIT_EXTERN_EMA)
#undef EMAKIT_EXTERN_EMA
#endif

template <class ModuleType>
using ModuleEma = Ema<Fixed, StepSchedule, ModuleStorage<ModuleType>>;
template <class ModuleType>
using ModuleWarmupEma = Ema<InversePowerWarmup, StepSchedule, ModuleStorage<ModuleType>>;

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
