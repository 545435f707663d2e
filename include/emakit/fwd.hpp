// emakit vocabulary: every public template with its defaults, and the ready-made aliases.
//
// Read this file to see the whole library at a glance:
//
//   Ema<Decay, Schedule, Storage>   the one class template (ema.hpp), derived from EmaBase,
//                                   what code that takes an EMA of any policies names
//
//   Decay policies (decay.hpp): how much of the old average an update keeps
//     Fixed               d = beta
//     ExponentialRamp     d = decay * (1 - exp(-t / tau))            timm ModelEma, YOLO, luxonis-train
//     InversePowerWarmup  d = 1 - (1 + e / inv_gamma)^-power, clamped  ema-pytorch, diffusers, timm V3
//     PowerFunction       d = (1 - dt / t)^(gamma + 1)               Karras et al. post-hoc EMA
//     Uniform             d = 1 - 1 / n                              SWA, AveragedModel default
//     RationalRamp        d = min(decay, (1 + t) / (10 + t)), floored  TensorFlow, diffusers EMAModel
//     CosineMomentum      d from start to end along a half cosine     SSL teachers (BYOL, DINO, ...)
//
//   Schedule policies (schedule.hpp): when an update averages, copies or does nothing
//     StepSchedule        start step (two warmup conventions), update_every, accumulation window, veto
//
//   Storage policies (storage.hpp): where the average lives
//     FlatStorage         an ordered name -> tensor dictionary, no module needed
//     ModuleStorage<M>    a module of type M you can call forward() on (Cloneable M, or a factory)
//     ShardedStorage      split across the ranks of a c10d process group (sharded.hpp, not in emakit.hpp)
//
//   Trainer hooks (hooks.hpp): EmaHook, called at setup, after each optimizer step, around
//     validation and test, at train end and at checkpoints, for one or several models by key
//
//   State (state.hpp): StateDict, LoadMode, LoadReport, SourceTensor, TensorSpec; what
//     state_dict(), load_state_dict(), the storage policies and the checkpoints exchange
//
//   Aliases (aliases.hpp): FixedEma, WarmupEma, RampEma, PowerEma, SwaAverage, RationalRampEma,
//     CosineEma, ModuleEma<M>, ...
//
// This header reaches no LibTorch header (house.fwd_without_libtorch): a header of your own can
// declare functions over emakit's classes and state types, and check policies of its own against
// the concepts, without LibTorch. Naming a specialization (Ema<>, Recipe<Fixed>) checks its
// policies against the concepts, so it needs the policies' headers (decay.hpp, schedule.hpp,
// storage.hpp), which include LibTorch.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>  // the policy concepts, StateDict; LoadMode and TensorSpec declared

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// State (state.hpp).
struct LoadReport;
struct SourceTensor;

// Decay policies.
class Fixed;
class ExponentialRamp;
class InversePowerWarmup;
class PowerFunction;
class Uniform;
class RationalRamp;
class CosineMomentum;

// Schedule policies.
class StepSchedule;

// Storage policies.
class FlatStorage;
template <class ModuleType>
class ModuleStorage;
class ShardedStorage;  // sharded.hpp

// Options shared by every Ema (selection, precision, placement).
class EmaOptions;

// What every Ema derives from: an EMA of any policies (ema.hpp).
class EmaBase;

// The one class template. The defaults give the "30-line loop" most C++ trainers copy:
// a fixed decay of 0.9999, every step, the average kept as a flat state dict.
template <DecayPolicy Decay = Fixed, SchedulePolicy Schedule = StepSchedule, StoragePolicy Storage = FlatStorage>
class Ema;

// An Ema's policies and options before it exists (recipe.hpp), and the trainer hook that makes
// EMAs from them at setup or at the first eligible step (hooks.hpp).
template <DecayPolicy Decay, SchedulePolicy Schedule = StepSchedule, StoragePolicy Storage = FlatStorage>
struct Recipe;
class EmaHook;

// Post-hoc EMA: several PowerFunction Emas, snapshots, synthesis after training (posthoc.hpp).
class PostHocEma;

// The RAII guard of Ema::swap_into() (swap.hpp).
class SwapGuard;

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
