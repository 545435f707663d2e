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
//   auto plain = emakit::module_ema(*model, [] { return std::make_shared<PlainImpl>(); });  // not Cloneable
#pragma once

#include <emakit/decay.hpp>
#include <emakit/detail/config.hpp>
#include <emakit/ema.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>

#include <concepts>
#include <memory>
#include <type_traits>
#include <utility>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

using FixedEma = Ema<Fixed, StepSchedule, FlatStorage>;
using WarmupEma = Ema<InversePowerWarmup, StepSchedule, FlatStorage>;
using RampEma = Ema<ExponentialRamp, StepSchedule, FlatStorage>;
using PowerEma = Ema<PowerFunction, StepSchedule, FlatStorage>;
using SwaAverage = Ema<Uniform, StepSchedule, FlatStorage>;
using RationalRampEma = Ema<RationalRamp, StepSchedule, FlatStorage>;
using CosineEma = Ema<CosineMomentum, StepSchedule, FlatStorage>;

// The decay policies of the seven flat aliases above, the one list of them: with EMAKIT_COMPILED
// (emakit::compiled, detail/config.hpp) these come instantiated from the library (src/aliases.cpp),
// with their emakit::save, emakit::load (checkpoint.hpp) and emakit::describe (format.hpp).
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

namespace detail {
// A std::shared_ptr<M> for some M (false, not an error, for a type without element_type).
template <class T>
concept SharedPointer = std::same_as<T, std::shared_ptr<typename T::element_type>>;
}  // namespace detail

// An Ema whose average is a module made by `factory` (a callable that returns a
// std::shared_ptr<M> to a new M), for a model whose module type is not Cloneable; the EMA copies
// the model's weights into it by name. M comes from the factory, and the policies and options
// that follow are Ema's, with its defaults (a ModuleEma<M>; with an InversePowerWarmup, a
// ModuleWarmupEma<M>):
//   auto ema = emakit::module_ema(*model, [] { return std::make_shared<PlainImpl>(); });
//   auto slow = emakit::module_ema(*model, factory, emakit::InversePowerWarmup(0.9999));
template <class Factory, DecayPolicy Decay = Fixed, SchedulePolicy Schedule = StepSchedule>
  requires std::is_invocable_v<Factory&>
auto module_ema(const torch::nn::Module& model, Factory factory, Decay decay = Decay(), Schedule schedule = Schedule(),
                EmaOptions options = EmaOptions()) {
  using Made = std::remove_cvref_t<std::invoke_result_t<Factory&>>;
  static_assert(detail::SharedPointer<Made>,
                "emakit::module_ema: the factory must return a std::shared_ptr<M> to a new module M, e.g. "
                "[] { return std::make_shared<NetImpl>(); }");
  using Module = typename Made::element_type;
  return Ema<Decay, Schedule, ModuleStorage<Module>>(model, std::move(decay), std::move(schedule), std::move(options),
                                                     ModuleStorage<Module>(std::move(factory)));
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
