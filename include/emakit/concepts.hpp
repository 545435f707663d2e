// The three policy axes of emakit::Ema, each a C++20 concept, and the values a policy sees.
//
// A policy is a small value type. The concepts ask for the one call the Ema needs; anything
// more (a name, a list of fields for checkpoints and printing) is optional and detected:
//
//   struct HalfLife {                       // a user-written decay policy
//     double steps = 1000;
//     double decay(const emakit::DecayInput& in) const { return std::exp2(-1.0 / steps); }
//   };
//   static_assert(emakit::DecayPolicy<HalfLife>);
//   emakit::Ema<HalfLife> ema(*model);
#pragma once

// Standard headers only (LibTorch's types are declared, not included: the concepts name them, and
// an Ema's header, which checks them, has them whole), so that fwd.hpp stays light
// (house.fwd_without_libtorch compiles it with no LibTorch on the include path).
#include <emakit/detail/config.hpp>

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace at {
class Tensor;
}
namespace torch {
template <typename Key, typename Value>
class OrderedDict;
}
namespace torch::nn {
class Module;
}

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// name -> tensor: the layout of Ema::state_dict() and of the averages (state.hpp has the rest of
// the state's vocabulary).
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// What an update did. `skipped`: nothing changed; `copied`: the average was overwritten with
// the model; `averaged`: ema = d * ema + (1 - d) * model for every averaged tensor.
enum class Action : std::uint8_t { skipped, copied, averaged };

// ---- decay ------------------------------------------------------------------------------

// What a decay policy is told when an update averages.
struct DecayInput {
  std::int64_t step = 0;                     // the completed optimizer step, counting from 1
  std::int64_t update = 0;                   // this update's number among applied updates (copies count), from 1
  std::int64_t steps_since_last_update = 0;  // step - step of the previous applied update (dt)
};

// d, the weight kept on the old average: ema = d * ema + (1 - d) * x. Must lie in [0, 1].
template <class P>
concept DecayPolicy = std::copy_constructible<P> && requires(const P& p, const DecayInput& in) {
  { p.decay(in) } -> std::convertible_to<double>;
};

// Optional: a decay policy may also give the lerp weight w = 1 - d directly, when computing
// 1 - d would round differently from the reference it follows (Uniform: w = 1/n exactly).
template <class P>
concept HasLerpWeight = requires(const P& p, const DecayInput& in) {
  { p.weight(in) } -> std::convertible_to<double>;
};

// ---- schedule ---------------------------------------------------------------------------

// What a schedule policy is told at each call of Ema::update().
struct ScheduleInput {
  std::int64_t call = 0;                   // this call's number, counting from 1
  std::optional<std::int64_t> given_step;  // the step the caller supplied, if any
  std::int64_t previous_step = 0;          // the step of the previous call (0 before any)
  std::int64_t num_updates = 0;            // updates applied before this call (copies count)
  bool vetoed = false;                     // the optimizer step was skipped (e.g. AMP overflow)
};

// A schedule's answer: what to do, and which optimizer step this call completes.
struct Decision {
  Action action = Action::skipped;
  std::int64_t step = 0;
};

template <class P>
concept SchedulePolicy = std::copy_constructible<P> && requires(const P& p, const ScheduleInput& in) {
  { p.decide(in) } -> std::same_as<Decision>;
};

// ---- storage ----------------------------------------------------------------------------

struct TensorSpec;  // one tensor the storage must hold a copy of (state.hpp)

// A storage policy creates the EMA's own tensors, one per spec and in the same order, each
// initialised with a copy of its source. `model` is null when the EMA was bound to a flat list
// of named tensors rather than a module. An undefined tensor in the result means "not held
// here": the Ema then neither updates, saves nor loads that spec (ShardedStorage returns one
// for each tensor another rank of its process group holds).
template <class S>
concept StoragePolicy = std::move_constructible<S> &&
    requires(S& s, const torch::nn::Module* model, std::span<const TensorSpec> specs) {
  { s.create(model, specs) } -> std::same_as<std::vector<at::Tensor>>;
};

// ---- optional capabilities of a storage policy ----------------------------------------------

// A storage that holds only part of the average in this process (ShardedStorage: this rank's
// share) may say how to reach the whole. Ema and emakit::save / emakit::load detect each
// capability and call it instead of their single-process path; `E` is the Ema type. Each call may
// be a collective (every process of the group calls it).
//
//   s.gather(ema, to)                    the whole average by name on rank `to` (all_ranks: on
//                                        every rank), empty elsewhere; Ema::swap_gathered_into()
//                                        puts it into a model under the Ema's own SwapGuard
//   s.save_checkpoint(ema, path)         what emakit::save(ema, path) writes: the whole EMA
//   s.load_checkpoint(ema, path, mode)   what emakit::load(ema, path, mode) reads

// gather(ema, all_ranks), gather_averages(ema, all_ranks): every rank receives the whole average.
inline constexpr int all_ranks = -1;
enum class LoadMode : std::uint8_t;  // strict or lenient (state.hpp)

template <class S, class E>
concept GatheringStorage = requires(const S& s, const E& ema, int to) {
  { s.gather(ema, to) } -> std::same_as<StateDict>;
};

template <class S, class E>
concept CheckpointingStorage = requires(const S& s, const E& saved, E& loaded, const std::filesystem::path& path,
                                        LoadMode mode) {
  s.save_checkpoint(saved, path);
  s.load_checkpoint(loaded, path, mode);
};

// ---- optional parts of a policy -----------------------------------------------------------

// One option of a policy, as written into checkpoints and printed by fmt.
struct Field {
  std::string_view name;
  double value = 0;
  bool is_integer = false;
};

// A policy that names itself and lists its options gets checkpoint config checks and a
// formatter: `static constexpr std::string_view name`, `std::vector<Field> fields() const`.
template <class P>
concept DescribedPolicy = requires(const P& p) {
  { P::name } -> std::convertible_to<std::string_view>;
  { p.fields() } -> std::same_as<std::vector<Field>>;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
