// emakit::Ema: an exponential moving average of a LibTorch model's weights.
//
//   #include <emakit/emakit.hpp>
//
//   Net model;
//   torch::optim::SGD optimizer(model->parameters(), 0.1);
//   emakit::WarmupEma ema(*model);                  // = Ema<InversePowerWarmup, StepSchedule, FlatStorage>
//   for (auto& batch : loader) {
//     ... loss.backward(); optimizer.step();
//     ema.update();                                  // after each optimizer step
//   }
//   {
//     auto swapped = ema.swap_into();                // the model now holds the EMA weights
//     evaluate(model);
//   }                                                // ... and its own weights again
//   torch::save(ema, "ema.pt");                      // config, counters and averages
//
// The Ema binds once: it keeps handles to the model's tensors and its own, grouped for the update
// kernel, so update() does no name lookups and allocates nothing. Module::to() keeps the handles
// valid (it uses set_data), but the average does not move with the model: it stays on its own
// device and in its own dtype, and the next update reads the model from wherever it went (the
// kernel re-plans once). A tensor that changes shape after binding is an error. A model owned by
// a shared_ptr (a ModuleHolder's) that is destroyed before its Ema: update() and swap_into()
// refuse, naming it; the EMA's own state still reads (docs/ema.md, "The bound model's lifetime").
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/ema_state.hpp>
#include <emakit/detail/serial/match.hpp>
#include <emakit/detail/update_kernel.hpp>
#include <emakit/fwd.hpp>
#include <emakit/options.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>
#include <emakit/version.hpp>

#include <ATen/Context.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace emakit {

// A tensor to average, for an Ema bound to tensors rather than a module (a TorchScript model,
// a hand-made list). `is_buffer` decides whether EmaOptions::buffers applies to it.
struct SourceTensor {
  std::string name;
  at::Tensor tensor;
  bool is_buffer = false;
};

// What the caller tells update(): `step` when the trainer counts steps itself (timm passes its
// optimizer step), `vetoed` when the optimizer skipped this step (gradient-scaler overflow).
struct StepInfo {
  std::optional<std::int64_t> step = std::nullopt;
  bool vetoed = false;
};

// What update() did, the step it completed, and the decay it used (0 for a copy, NaN for a skip).
// With EmaOptions::skip_non_finite, `non_finite` names the first source tensor that held a NaN or
// an infinity; the update was then skipped.
struct UpdateResult {
  Action action = Action::skipped;
  std::int64_t step = 0;
  double decay = std::nan("");
  std::string non_finite = {};
};

// LoadMode, LoadReport and StateDict: detail/serial/ema_state.hpp, with the state's layout.

// The version of the state-dict layout (detail::formats::ema_state); stored as "emakit.format".
inline constexpr std::int64_t state_format_version = detail::formats::ema_state.version;

namespace detail {

// The state of one Ema's swap: the model's tensors that hold the EMA weights, a copy of their
// own weights, and how many SwapGuards are open on it. The weights go back when the last guard
// ends, in whatever order the guards end. While open, the tensors' memory is registered
// (swap_registry), so that every Ema bound to the same model sees that the model holds an EMA's
// weights, not its own.
struct SwapState {
  int guards = 0;
  std::vector<at::Tensor> targets;
  std::vector<at::Tensor> backup;
};

// The model memory that open swaps hold, across every Ema of the process: storage -> the
// SwapState holding it. `open` counts entries, read without the lock so that an update with no
// swap anywhere costs one atomic load.
struct SwapRegistry {
  std::mutex mutex;
  std::unordered_map<const void*, const SwapState*> holders;
  std::atomic<std::size_t> open{0};

  static const void* key(const at::Tensor& t) {
    return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  }
  // The swap (other than `self`) that holds one of `tensors`, or null.
  template <class Tensors>
  const SwapState* holder(const Tensors& tensors, const SwapState* self) {
    if (open.load(std::memory_order_acquire) == 0) return nullptr;
    std::lock_guard lock(mutex);
    for (const at::Tensor& t : tensors) {
      auto it = holders.find(key(t));
      if (it != holders.end() && it->second != self) return it->second;
    }
    return nullptr;
  }
  void add(const SwapState* s) {
    std::lock_guard lock(mutex);
    for (const auto& t : s->targets)
      if (const void* k = key(t)) holders.emplace(k, s);
    open.store(holders.size(), std::memory_order_release);
  }
  void remove(const SwapState* s) noexcept {
    std::lock_guard lock(mutex);
    for (auto it = holders.begin(); it != holders.end();) it = it->second == s ? holders.erase(it) : std::next(it);
    open.store(holders.size(), std::memory_order_release);
  }
};

inline SwapRegistry& swap_registry() {
  static SwapRegistry registry;
  return registry;
}

}  // namespace detail

class SwapGuard;
namespace detail {
SwapGuard open_swap(std::shared_ptr<SwapState> state);
}

// Holds the EMA weights in the model for its scope and restores the model's own weights when the
// scope ends, also when it ends by an exception. Made by Ema::swap_into() (and by
// swap_gathered_into() for a sharded EMA). Guards of one Ema may
// nest and may end in any order: the model gets its own weights back when the last one ends.
class SwapGuard {
 public:
  SwapGuard(const SwapGuard&) = delete;
  SwapGuard& operator=(const SwapGuard&) = delete;
  SwapGuard(SwapGuard&& other) noexcept : state_(std::move(other.state_)) {}
  SwapGuard& operator=(SwapGuard&&) = delete;
  ~SwapGuard() { restore(); }

  // Ends this guard now (the destructor then does nothing); the model's own weights come back if
  // it was the last open guard of its Ema.
  void restore() noexcept {
    if (!state_) return;
    auto state = std::move(state_);
    if (--state->guards > 0) return;
    c10::NoGradGuard no_grad;
    for (std::size_t i = 0; i < state->targets.size(); ++i) {
      try {
        state->targets[i].copy_(state->backup[i]);
      } catch (...) {  // a destructor must not throw; the copy of a same-shaped tensor cannot fail short of OOM
      }
    }
    detail::swap_registry().remove(state.get());
    state->targets.clear();
    state->backup.clear();
  }

  bool active() const noexcept { return static_cast<bool>(state_); }

 private:
  template <DecayPolicy, SchedulePolicy, StoragePolicy>
  friend class Ema;
  friend SwapGuard detail::open_swap(std::shared_ptr<detail::SwapState> state);
  explicit SwapGuard(std::shared_ptr<detail::SwapState> state) : state_(std::move(state)) { ++state_->guards; }

  std::shared_ptr<detail::SwapState> state_;
};

namespace detail {
// The first guard of a swap whose targets are about to receive EMA weights (their own weights are
// in `backup`): registers the targets' memory, so that every Ema bound to them sees the swap.
inline SwapGuard open_swap(std::shared_ptr<SwapState> state) {
  SwapGuard guard(state);
  swap_registry().add(state.get());
  return guard;
}
}  // namespace detail

namespace detail {

EMAKIT_FUNC std::vector<SourceTensor> collect(const torch::nn::Module& model);

EMAKIT_FUNC std::unordered_map<std::string, at::Tensor> tensors_by_name(const torch::nn::Module& model);

// true while an Ema is bound; a move leaves false behind, so a moved-from Ema is detected.
struct BoundFlag {
  bool value = false;
  BoundFlag() = default;
  BoundFlag(BoundFlag&& other) noexcept : value(std::exchange(other.value, false)) {}
  BoundFlag& operator=(BoundFlag&& other) noexcept {
    value = std::exchange(other.value, false);
    return *this;
  }
  BoundFlag& operator=(bool v) noexcept {
    value = v;
    return *this;
  }
  explicit operator bool() const noexcept { return value; }
};

// Set while an update() runs: a second update() that overlaps it (another thread) is refused.
// Moves make a fresh flag (an Ema is not moved while it updates).
struct BusyFlag {
  std::atomic<bool> value{false};
  BusyFlag() = default;
  BusyFlag(BusyFlag&&) noexcept {}
  BusyFlag& operator=(BusyFlag&&) noexcept { return *this; }
};

class BusyScope {
 public:
  BusyScope(BusyFlag& flag, const char* what) : flag_(flag) {
    if (flag_.value.exchange(true, std::memory_order_acquire))
      fail("{}() was called while another update() of this Ema is running (from another thread); an Ema is not "
           "thread-safe: call it from one thread at a time, or behind a mutex",
           what);
  }
  BusyScope(const BusyScope&) = delete;
  BusyScope& operator=(const BusyScope&) = delete;
  ~BusyScope() { flag_.value.store(false, std::memory_order_release); }

 private:
  BusyFlag& flag_;
};

// Whether two tensors are the same tensor of the model (one TensorImpl, or the same view of one
// storage), and whether they share memory at all (their byte ranges in one storage overlap).
EMAKIT_FUNC bool same_view(const at::Tensor& a, const at::Tensor& b);
EMAKIT_FUNC std::pair<std::int64_t, std::int64_t> byte_extent(const at::Tensor& t);
EMAKIT_FUNC bool overlap(const at::Tensor& a, const at::Tensor& b);

// The same dtype, shape and bytes (NaNs compare by their bits).
EMAKIT_FUNC bool bitwise_equal(const at::Tensor& a, const at::Tensor& b);

// The error of a call that would use the bound model after that model was destroyed.
[[noreturn]] EMAKIT_FUNC void fail_model_destroyed(const char* what);


}  // namespace detail

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
class Ema {
 public:
  using decay_type = Decay;
  using schedule_type = Schedule;
  using storage_type = Storage;

  // Binds to every parameter and buffer of `model` (names as in its state dict).
  explicit Ema(const torch::nn::Module& model, Decay decay = Decay(), Schedule schedule = Schedule(),
               EmaOptions options = EmaOptions(), Storage storage = Storage())
      : Ema(&model, detail::collect(model), std::move(decay), std::move(schedule), std::move(options),
            std::move(storage)) {}

  // Binds to a list of named tensors (e.g. a TorchScript module's parameters).
  explicit Ema(std::vector<SourceTensor> tensors, Decay decay = Decay(), Schedule schedule = Schedule(),
               EmaOptions options = EmaOptions(), Storage storage = Storage())
      : Ema(nullptr, std::move(tensors), std::move(decay), std::move(schedule), std::move(options),
            std::move(storage)) {}

  Ema(const Ema&) = delete;
  Ema& operator=(const Ema&) = delete;
  // Moving is allowed (a SwapGuard stays valid: it refers to the same tensors); the moved-from
  // Ema refuses every call with an error that says so.
  Ema(Ema&&) noexcept = default;
  Ema& operator=(Ema&&) noexcept = default;
  ~Ema();

  // ---- the update ------------------------------------------------------------------------

  // Call after each optimizer step (each micro-batch with an accumulation window). The schedule
  // decides whether this call skips, copies the model, or averages; the decay policy gives d.
  //
  // An Ema is not thread-safe, like a torch::nn::Module: use it from one thread at a time (or
  // behind a mutex). Two update() calls that overlap are detected and the second is refused.
  UpdateResult update(StepInfo info = {});

  // The side-stream protocol (EmaOptions::side_stream): update() may return before the update has
  // run. Call wait() before the next optimizer step writes the model; it is asynchronous for the
  // host (the device's current stream waits for the side stream). Nothing else is needed:
  // buffers, which the next forward pass may write (BatchNorm statistics), are read on the
  // current stream, and every read of the EMA (average(), averages(), state_dict(), module(),
  // storage(), swap_into(), copy_to(), and what is built on them) settles by itself. With a CPU
  // average of a CUDA model, wait() orders only the device-to-host copies; the host pass goes on
  // until something reads the average. Without a side stream, both do nothing.
  void wait() const;
  // Everything of the last update has finished (the host pass of an offloaded update too). For
  // tensors taken from averages() or module() before an update and read after it; the EMA's own
  // accessors call it.
  void settle() const;

  // ---- counters and parts -------------------------------------------------------------------

  std::int64_t calls() const noexcept { return calls_; }                // update() calls seen
  std::int64_t step() const noexcept { return step_; }                  // last completed step
  std::int64_t num_updates() const noexcept { return num_updates_; }    // copies + averages applied
  std::int64_t last_update_step() const noexcept { return last_update_step_; }
  double decay() const noexcept { return last_decay_; }                 // d of the last applied update
  // Updates skipped because the model held a NaN or an infinity (EmaOptions::skip_non_finite),
  // and the tensor named by the last of them.
  std::int64_t non_finite_updates() const noexcept { return non_finite_updates_; }
  const std::string& last_non_finite() const noexcept { return last_non_finite_; }

  const Decay& decay_policy() const noexcept { return decay_; }
  const Schedule& schedule() const noexcept { return schedule_; }
  // The storage policy and the tensors it holds, settled (see wait()).
  const Storage& storage() const {
    kernel_.settle();
    return storage_;
  }
  const EmaOptions& options() const noexcept { return options_; }

  // The EMA module, for a module-backed storage, settled (see wait()): its parameters and buffers
  // are the averages.
  decltype(auto) module() const
    requires requires(const Storage& s) { s.module(); }
  {
    ensure_bound("module");
    kernel_.settle();
    return storage_.module();
  }

  // The averaged and copied tensors by name, in the model's order. They are the EMA's own tensors.
  // A tied tensor is there under each of its names, as one tensor.
  StateDict averages() const;

  // The EMA tensor named `name` (as in the model's state dict).
  const at::Tensor& average(const std::string& name) const;

  // Names of the tensors the EMA holds in a role (Role::ignore: none, it holds no such tensor).
  std::vector<std::string> names(Role role) const;

  // ---- moving weights between the EMA and a model ------------------------------------------

  // Writes the EMA weights into `model` (matched by name; every EMA tensor must be there).
  void copy_to(torch::nn::Module& model) const { transfer(model, /*into_model=*/true); }
  // Overwrites the EMA weights with `model`'s; counters are unchanged.
  void copy_from(const torch::nn::Module& model) { transfer(model, /*into_model=*/false); }

  // Pulls the bound model towards the EMA ("switch EMA"): model = lerp(model, ema, 1 - beta) for
  // averaged tensors, model = ema for copied ones; beta = 0 copies every tensor the EMA holds.
  // update() calls it by itself when EmaOptions::switch_model is set.
  void switch_model(double beta);

  // Puts the EMA weights into the bound model until the guard's scope ends.
  // Guards of one Ema nest (the later ones hold nothing of their own) and may end in any order.
  // Refused while another Ema's guard holds this model, and when the model changed since bind
  // (a tensor of another shape, or a sub-module replaced: the model's tensors are not the ones
  // bound), naming the tensor.
  [[nodiscard]] SwapGuard swap_into();

  // For a storage that holds only part of the average here (GatheringStorage: ShardedStorage):
  // gathers the whole average (a collective) and puts it into `model`, matched by name, until the
  // guard's scope ends. This Ema's own swap, as swap_into(): update() is refused while it is open.
  [[nodiscard]] SwapGuard swap_gathered_into(torch::nn::Module& model) const
    requires GatheringStorage<Storage, Ema>;

  // ---- state ------------------------------------------------------------------------------

  // Config, counters and averaged tensors (the keys: detail/serial/ema_state.hpp). The averages
  // are the EMA's tensors (shared, not copied).
  StateDict state_dict() const;

  // Loads a state_dict() of an EMA with the same config. A config that differs is an error that
  // names the field and both values. Everything is checked before anything is written: a failed
  // load leaves the EMA exactly as it was.
  LoadReport load_state_dict(const StateDict& state, LoadMode mode = LoadMode::strict);

  // Every check of load_state_dict() and nothing written: throws where it would throw, returns
  // the report it would return. Lets a caller that loads several things check them all first.
  LoadReport check_state_dict(const StateDict& state, LoadMode mode = LoadMode::strict) const;

  // The checks of a state's format and config (policies, fields, buffer mode) against these
  // policies and options, without an Ema: a hook that has not made its EMA yet checks a
  // checkpoint with them. Throws naming the first difference.
  static void check_state_config(const StateDict& state, const Decay& decay, const Schedule& schedule,
                                 const EmaOptions& options) {
    detail::ema_state::check_config(state, decay, schedule, options);
  }

  // For an EMA made after its trainer had already run (a hook that creates it lazily): counts
  // `calls` update() calls and `step` completed steps as already seen, so that update_every,
  // start_step and accumulation windows continue where the trainer is. Only before any update.
  void advance(std::int64_t calls, std::int64_t step);

  // Archive operators (torch::save(ema, path) / torch::load(ema, path)) live below the class.
  // The archive holds the state dict and a CRC-32 per tensor ("emakit_checksums"), checked by
  // load(): a damaged file is an error, never a different average.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive, LoadMode mode = LoadMode::strict);

 private:
  // The one way a swap opens (swap_into, swap_gathered_into): backs up `targets`, opens this
  // Ema's swap over them (update() is refused until its guards end) and writes `values` into them.
  SwapGuard open_swap_over(std::vector<at::Tensor> targets, const std::vector<at::Tensor>& values) const;

  detail::ema_state::Plan plan_load(const StateDict& state, LoadMode mode) const;

  Ema(const torch::nn::Module* model, std::vector<SourceTensor> tensors, Decay decay, Schedule schedule,
      EmaOptions options, Storage storage);

  // Binds the EMA. What it holds is decided by identity, not by name: a tensor registered under
  // several names (a tied weight, a sub-module registered twice) is one average, updated once,
  // reachable and saved under each of its names. The storage makes the EMA's own tensors, which
  // must not share memory with the model; the model is not changed.
  void bind(const torch::nn::Module* model, std::vector<SourceTensor> tensors);

  // For each tensor, the index of the first tensor that is the same tensor (itself if none).
  // Different views of one storage that overlap cannot be averaged independently: an error,
  // unless one of them is ignored.
  static std::vector<std::size_t> identity_groups(const std::vector<SourceTensor>& tensors,
                                                  const std::vector<Role>& roles);

  // The role of one tensor of the model, from the roles of its names: the role they agree on
  // (names that ignore it do not count while another name holds it).
  static Role group_role(const std::vector<SourceTensor>& tensors, const std::vector<Role>& roles,
                         const std::vector<std::size_t>& names);

  static void check_dense(const std::string& name, const at::Tensor& t);

  // The EMA owns its memory: no tensor a storage made may share memory with the model, and two
  // tensors the model keeps apart must not overlap in the EMA (a factory's module that ties what
  // the model does not tie would average one tensor twice).
  static void check_owned(const std::vector<SourceTensor>& tensors, const std::vector<TensorSpec>& specs,
                          const std::vector<at::Tensor>& own);

  // update() refuses while the model holds EMA weights: this Ema's own SwapGuard (it would average
  // the EMA with itself) or another Ema's (it would average that EMA's weights).
  void check_model_not_swapped(const char* what) const;

  // What the schedule may compute from: no counter about to overflow, no negative given step.
  // Checked before anything changes, so that every state update() reaches can be saved and loaded;
  // check_decision() checks what the schedule decided (a backward step, a step applied twice).
  void check_step_in(const StepInfo& info) const;

  // The schedule's decision, checked like a given step (a schedule of your own may count steps
  // its own way): no step backwards, and no update applied twice at one step.
  void check_decision(const Decision& d, const StepInfo& info) const;

  void ensure_bound(const char* what) const {
    if (!bound_) detail::fail("{}() on a moved-from Ema; use the Ema it was moved into", what);
  }

  double lerp_weight(const DecayInput& in) const;

  // The model's tensors are handles: writing into them through a const Module is what
  // Module::load does too.
  // Into the model: every name the EMA holds is written (a model that does not tie what the bound
  // model ties gets the tensor under each name). From the model: the first name of each tensor.
  void transfer(const torch::nn::Module& model, bool into_model) const;

  // The bound module still holds the tensors the EMA was bound to (a sub-module replaced with
  // replace_module(), or a parameter registered anew, leaves the EMA bound to tensors the model
  // no longer uses). Checked where it would go unnoticed: swap_into().
  void check_model_unchanged(const char* what) const;

  // The bound module still exists, for a module owned by a shared_ptr (a ModuleHolder's, or
  // make_shared's): the Ema keeps handles to the model's tensors, so after the model is destroyed
  // (a model rebuilt for a new run) update() would go on averaging tensors nothing uses, and
  // swap_into() would write the average into them. Checked by the calls that use the bound
  // model's tensors: update(), switch_model(), swap_into(). Not by those that read the EMA's own
  // state (averages, state_dict, save), nor by copy_to/copy_from, whose model is an argument. One
  // atomic load per call. A module not owned by a shared_ptr, or a list of tensors, cannot be
  // checked: model_owned_ is false.
  void check_model_alive(const char* what) const {
    if (model_owned_ && model_.expired()) detail::fail_model_destroyed(what);
  }

  Decay decay_;
  Schedule schedule_;
  Storage storage_;
  EmaOptions options_;
  detail::UpdateKernel kernel_;
  struct Entry {
    std::string name;
    std::size_t slot;
  };
  std::vector<Entry> entries_;         // every name the EMA holds, in the model's order (tied: several per slot)
  std::vector<at::Tensor> sources_;    // the model's tensors, one per slot (handles)
  std::weak_ptr<const torch::nn::Module> model_;  // the bound module, when it is owned by a shared_ptr
  bool model_owned_ = false;                      // model_ was set (expired() then means destroyed)
  std::shared_ptr<detail::SwapState> swap_;
  detail::BusyFlag busy_;
  std::int64_t calls_ = 0;
  std::int64_t step_ = 0;
  std::int64_t num_updates_ = 0;
  std::int64_t last_update_step_ = 0;
  double last_decay_ = std::nan("");
  std::int64_t non_finite_updates_ = 0;
  std::string last_non_finite_;
  detail::BoundFlag bound_;
};

// ---- Ema's members, defined out of the class ---------------------------------------------------
// Not inline: in compiled mode the aliases' Ema<...> are extern templates (aliases.hpp), and an
// extern template keeps out of its users' objects only the members that are not inline.

// The destructor too (defaulted, but out of the class for that reason).
template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
Ema<Decay, Schedule, Storage>::~Ema() = default;

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
UpdateResult Ema<Decay, Schedule, Storage>::update(StepInfo info) {
  ensure_bound("update");
  check_model_alive("update");
  detail::BusyScope busy(busy_, "update");
  check_model_not_swapped("update");
  check_step_in(info);
  const ScheduleInput in{calls_ + 1, info.step, step_, num_updates_, info.vetoed};
  const Decision decision = schedule_.decide(in);
  check_decision(decision, info);
  UpdateResult result{decision.action, decision.step, std::nan(""), {}};
  if (decision.action != Action::skipped) kernel_.check_sources();  // re-plans if a source moved
  if (decision.action != Action::skipped && options_.skip_non_finite()) {
    const std::size_t bad = kernel_.first_non_finite(decision.action == Action::copied);
    if (bad != detail::UpdateKernel::npos) result.non_finite = kernel_.name(bad);
    if (!result.non_finite.empty()) {
      TORCH_WARN("emakit: update at step ", decision.step, " skipped: '", result.non_finite,
                 "' holds a NaN or an infinity (EmaOptions::skip_non_finite); the average is unchanged");
      calls_ += 1;
      step_ = decision.step;
      non_finite_updates_ += 1;
      last_non_finite_ = result.non_finite;
      result.action = Action::skipped;
      return result;
    }
  }
  if (decision.action == Action::copied) {
    kernel_.copy();
    result.decay = 0.0;
  } else if (decision.action == Action::averaged) {
    const DecayInput d_in{decision.step, num_updates_ + 1, decision.step - last_update_step_};
    const double weight = lerp_weight(d_in);
    kernel_.average(weight);
    result.decay = 1.0 - weight;
  }
  if (options_.switch_every() > 0 && decision.action != Action::copied && !info.vetoed &&
      (decision.step - options_.switch_offset()) % options_.switch_every() == 0)
    switch_model(options_.switch_beta());
  // Counters change only after the kernel succeeded: a failed update leaves the EMA as it was.
  calls_ += 1;
  step_ = decision.step;
  if (decision.action != Action::skipped) {
    num_updates_ += 1;
    last_update_step_ = decision.step;
    last_decay_ = result.decay;
  }
  return result;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::wait() const {
  ensure_bound("wait");
  kernel_.wait_sources();
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::settle() const {
  ensure_bound("settle");
  kernel_.settle();
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
StateDict Ema<Decay, Schedule, Storage>::averages() const {
  ensure_bound("averages");
  const auto& slots = kernel_.settled_slots();
  StateDict out;
  for (const auto& e : entries_) out.insert(e.name, slots[e.slot].average);
  return out;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
const at::Tensor& Ema<Decay, Schedule, Storage>::average(const std::string& name) const {
  ensure_bound("average");
  const auto& slots = kernel_.settled_slots();
  for (const auto& e : entries_)
    if (e.name == name) return slots[e.slot].average;
  detail::fail("the EMA has no tensor '{}' (ignored, or not in the model)", name);
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
std::vector<std::string> Ema<Decay, Schedule, Storage>::names(Role role) const {
  std::vector<std::string> out;
  const auto& slots = kernel_.settled_slots();
  for (const auto& e : entries_) {
    const auto& s = slots[e.slot];
    const Role r = s.averaged ? Role::average : s.follows_averages ? Role::copy : Role::follow_copies;
    if (r == role) out.push_back(e.name);
  }
  return out;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::switch_model(double beta) {
  ensure_bound("switch_model");
  detail::check_unit_interval(beta, "switch_model beta");
  check_model_alive("switch_model");
  check_model_not_swapped("switch_model");
  c10::NoGradGuard no_grad;
  for (const auto& s : kernel_.settled_slots()) {
    if (beta == 0.0) {
      s.source.copy_(s.average);
    } else if (s.averaged) {
      s.source.lerp_(s.average.to(s.source.options()), 1.0 - beta);
    } else if (s.follows_averages) {
      s.source.copy_(s.average);
    }
  }
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
SwapGuard Ema<Decay, Schedule, Storage>::swap_into() {
  ensure_bound("swap_into");
  check_model_alive("swap_into");
  if (swap_->guards > 0) return SwapGuard(swap_);
  const auto& slots = kernel_.settled_slots();
  kernel_.check_sources();
  check_model_unchanged("swap_into");
  if (detail::swap_registry().holder(sources_, swap_.get()) != nullptr)
    detail::fail("swap_into(): the model holds another Ema's weights (a SwapGuard of another Ema bound to this "
                 "model is open); end that guard's scope first");
  std::vector<at::Tensor> targets, values;
  for (const auto& s : slots) {
    targets.push_back(s.source);
    values.push_back(s.average);
  }
  return open_swap_over(std::move(targets), values);
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
SwapGuard Ema<Decay, Schedule, Storage>::swap_gathered_into(torch::nn::Module& model) const
  requires GatheringStorage<Storage, Ema>
{
  ensure_bound("swap_gathered_into");
  const StateDict full = storage_.gather(*this, all_ranks);
  std::vector<std::pair<std::string, at::Tensor>> ours;
  for (const auto& item : full) ours.emplace_back(item.key(), item.value());
  const auto match = detail::match_by_name(ours, detail::tensors_by_name(model));
  detail::require_model_match(match, "swap_gathered_into: ");
  std::vector<at::Tensor> targets;
  for (const auto& p : match.pairs) targets.push_back(p.theirs);
  if (swap_->guards > 0 || detail::swap_registry().holder(targets, nullptr) != nullptr)
    detail::fail("swap_gathered_into: the model already holds an EMA's weights (a SwapGuard is open); end that "
                 "guard's scope first");
  std::vector<at::Tensor> values;
  for (const auto& p : match.pairs) values.push_back(p.ours);
  return open_swap_over(std::move(targets), values);
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
StateDict Ema<Decay, Schedule, Storage>::state_dict() const {
  ensure_bound("state_dict");
  StateDict out = detail::ema_state::encode(
      decay_, schedule_, options_,
      {calls_, step_, num_updates_, last_update_step_, last_decay_, non_finite_updates_});
  const auto& slots = kernel_.settled_slots();
  for (const auto& e : entries_) out.insert(detail::ema_state::average_key(e.name), slots[e.slot].average);
  return out;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
LoadReport Ema<Decay, Schedule, Storage>::load_state_dict(const StateDict& state, LoadMode mode) {
  ensure_bound("load_state_dict");
  detail::ema_state::Plan plan = plan_load(state, mode);
  if (mode == LoadMode::lenient) {
    for (const auto& k : plan.report.missing) TORCH_WARN("emakit: load_state_dict: missing key '", k, "', kept the current value");
    for (const auto& k : plan.report.unexpected) TORCH_WARN("emakit: load_state_dict: unexpected key '", k, "', ignored");
    for (const auto& k : plan.report.mismatched) TORCH_WARN("emakit: load_state_dict: ", k, "; kept the current value");
  }
  {
    c10::NoGradGuard no_grad;
    const auto& slots = kernel_.settled_slots();
    for (const auto& [i, t] : plan.loads) slots[i].average.copy_(*t);
  }
  calls_ = plan.counters.calls;
  step_ = plan.counters.step;
  num_updates_ = plan.counters.num_updates;
  last_update_step_ = plan.counters.last_update_step;
  last_decay_ = plan.counters.last_decay;
  non_finite_updates_ = plan.counters.non_finite_updates;
  return plan.report;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
LoadReport Ema<Decay, Schedule, Storage>::check_state_dict(const StateDict& state, LoadMode mode) const {
  ensure_bound("check_state_dict");
  return plan_load(state, mode).report;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::advance(std::int64_t calls, std::int64_t step) {
  ensure_bound("advance");
  if (calls_ != 0 || num_updates_ != 0)
    detail::fail("advance() on an EMA that has already seen {} update() calls; it is only for a new EMA", calls_);
  detail::check_non_negative_int(calls, "advance() calls");
  detail::check_non_negative_int(step, "advance() step");
  calls_ = calls;
  step_ = step;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::save(torch::serialize::OutputArchive& archive) const {
detail::ema_state::save_archive(archive, state_dict());
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::load(torch::serialize::InputArchive& archive, LoadMode mode) {
  detail::ema_state::load_archive(archive, [&](const StateDict& state) { load_state_dict(state, mode); });
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
SwapGuard Ema<Decay, Schedule, Storage>::open_swap_over(std::vector<at::Tensor> targets,
                                                        const std::vector<at::Tensor>& values) const {
  c10::NoGradGuard no_grad;
  swap_->backup.clear();
  for (const auto& t : targets) swap_->backup.push_back(t.detach().clone());
  swap_->targets = std::move(targets);
  SwapGuard guard = detail::open_swap(swap_);
  for (std::size_t i = 0; i < values.size(); ++i) swap_->targets[i].copy_(values[i]);
  return guard;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
detail::ema_state::Plan Ema<Decay, Schedule, Storage>::plan_load(const StateDict& state, LoadMode mode) const {
  std::vector<at::Tensor> averages;
  for (const auto& slot : kernel_.slots()) averages.push_back(slot.average);
  return detail::ema_state::plan_load(
      state, mode, decay_, schedule_, options_, entries_, averages,
      [](const at::Tensor& a, const at::Tensor& b) { return detail::same_view(a, b) || detail::bitwise_equal(a, b); });
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
Ema<Decay, Schedule, Storage>::Ema(const torch::nn::Module* model, std::vector<SourceTensor> tensors, Decay decay,
                                   Schedule schedule, EmaOptions options, Storage storage)
    : decay_(std::move(decay)),
      schedule_(std::move(schedule)),
      storage_(std::move(storage)),
      options_(std::move(options)),
      swap_(std::make_shared<detail::SwapState>()) {
  bind(model, std::move(tensors));
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::bind(const torch::nn::Module* model, std::vector<SourceTensor> tensors) {
  if (model != nullptr) model_ = model->weak_from_this();
  model_owned_ = !model_.expired();  // the model is alive here: set iff a shared_ptr owns it
  const std::size_t n = tensors.size();
  std::vector<std::string> all_names;
  all_names.reserve(n);
  std::unordered_set<std::string> seen;
  for (const auto& t : tensors) {
    if (!t.tensor.defined()) detail::fail("tensor '{}' is undefined; bind an Ema to defined tensors", t.name);
    if (!seen.insert(t.name).second) detail::fail("tensor name '{}' appears twice", t.name);
    all_names.push_back(t.name);
  }
  options_.check_names(all_names);
  if (const auto dev = options_.device(); dev && dev->is_cuda() && !at::globalContext().hasCUDA())
    detail::fail("EmaOptions::device is {}, but this LibTorch has no CUDA support or sees no CUDA device; use "
                 "a CPU device or leave device() unset (the model's device)",
                 dev->str());

  std::vector<Role> roles(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto dtype = tensors[i].tensor.scalar_type();
    const bool floating = c10::isFloatingType(dtype) || c10::isComplexType(dtype);
    roles[i] = options_.role(tensors[i].name, tensors[i].is_buffer, floating);
  }
  const std::vector<std::size_t> first = identity_groups(tensors, roles);
  std::vector<std::vector<std::size_t>> members(n);  // by first index: every name of that tensor
  for (std::size_t i = 0; i < n; ++i) members[first[i]].push_back(i);
  std::vector<Role> group(n, Role::ignore);
  for (std::size_t g = 0; g < n; ++g)
    if (first[g] == g) group[g] = group_role(tensors, roles, members[g]);

  // One spec per held tensor, at the position of its first name; every held name is an entry.
  std::vector<TensorSpec> specs;
  std::vector<Role> spec_roles;
  std::vector<char> spec_buffer;  // a buffer under any of its names: a forward pass may write it
  std::vector<std::size_t> spec_of(n, static_cast<std::size_t>(-1));
  std::vector<std::pair<std::string, std::size_t>> entries;  // name -> spec
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t g = first[i];
    const Role role = group[g];
    if (role == Role::ignore || roles[i] != role) continue;  // ignored, or an ignored name of a held tensor
    if (spec_of[g] == static_cast<std::size_t>(-1)) {
      const at::Tensor& t = tensors[i].tensor;
      check_dense(tensors[i].name, t);
      const auto device = options_.device().value_or(t.device());
      const auto dtype = role == Role::average ? options_.average_dtype(t.scalar_type()) : t.scalar_type();
      spec_of[g] = specs.size();
      specs.push_back({tensors[i].name, t, dtype, device, {}});
      spec_roles.push_back(role);
      spec_buffer.push_back(tensors[i].is_buffer ? 1 : 0);
    } else {
      specs[spec_of[g]].aliases.push_back(tensors[i].name);
      spec_buffer[spec_of[g]] |= tensors[i].is_buffer ? 1 : 0;
    }
    entries.emplace_back(tensors[i].name, spec_of[g]);
  }
  if (n > 0 && specs.empty())
    detail::fail("every tensor of the model is ignored (EmaOptions ignore / ignore_prefixes / buffers); the EMA "
                 "would hold nothing");

  std::vector<at::Tensor> own = storage_.create(model, std::span<const TensorSpec>(specs));
  if (own.size() != specs.size())
    detail::fail("storage {} made {} tensors for {} specs", detail::policy_name<Storage>(), own.size(), specs.size());
  check_owned(tensors, specs, own);

  std::vector<detail::Slot> slots;
  std::vector<std::size_t> slot_of(specs.size(), static_cast<std::size_t>(-1));
  slots.reserve(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (!own[i].defined()) continue;  // held elsewhere (ShardedStorage: by another rank)
    detail::Slot slot;
    slot.name = specs[i].name;
    slot.average = own[i];
    slot.source = specs[i].source;
    slot.averaged = spec_roles[i] == Role::average;
    slot.follows_averages = spec_roles[i] != Role::follow_copies;
    slot.buffer = spec_buffer[i] != 0;
    slot_of[i] = slots.size();
    slots.push_back(std::move(slot));
  }
  entries_.clear();
  for (auto& [name, spec] : entries)
    if (slot_of[spec] != static_cast<std::size_t>(-1)) entries_.push_back({std::move(name), slot_of[spec]});
  sources_.clear();
  for (const auto& slot : slots) sources_.push_back(slot.source);
  kernel_ = detail::UpdateKernel(std::move(slots), detail::UpdateKernel::CpuPath::fused, options_.side_stream(),
                                 options_.staging_bytes());
  bound_ = true;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
std::vector<std::size_t> Ema<Decay, Schedule, Storage>::identity_groups(const std::vector<SourceTensor>& tensors,
                                                                        const std::vector<Role>& roles) {
  std::vector<std::size_t> first(tensors.size());
  std::unordered_map<const void*, std::vector<std::size_t>> by_memory;  // storage (or impl) -> firsts
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    first[i] = i;
    const at::Tensor& t = tensors[i].tensor;
    const void* key = t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl())
                                      : static_cast<const void*>(t.unsafeGetTensorImpl());
    auto& seen = by_memory[key];
    for (const std::size_t j : seen) {
      if (detail::same_view(tensors[j].tensor, t)) {
        first[i] = j;
        break;
      }
      if (roles[i] != Role::ignore && roles[j] != Role::ignore && detail::overlap(tensors[j].tensor, t))
        detail::fail("tensors '{}' and '{}' of the model are different views of overlapping memory; an EMA cannot "
                     "average them independently. Leave one out (EmaOptions::ignore)",
                     tensors[j].name, tensors[i].name);
    }
    if (first[i] == i) seen.push_back(i);
  }
  return first;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
Role Ema<Decay, Schedule, Storage>::group_role(const std::vector<SourceTensor>& tensors, const std::vector<Role>& roles,
                                               const std::vector<std::size_t>& names) {
  std::optional<std::size_t> held;
  bool follows = false;
  for (const std::size_t i : names) {
    if (roles[i] == Role::follow_copies) follows = true;
    if (roles[i] != Role::average && roles[i] != Role::copy) continue;
    if (!held) {
      held = i;
    } else if (roles[*held] != roles[i]) {
      detail::fail("'{}' and '{}' are one tensor of the model (tied), but the options average one name and copy "
                   "the other (EmaOptions::copy_only or buffers); give both names the same role",
                   tensors[*held].name, tensors[i].name);
    }
  }
  if (held) return roles[*held];
  return follows ? Role::follow_copies : Role::ignore;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::check_dense(const std::string& name, const at::Tensor& t) {
  if (t.layout() != c10::kStrided)
    detail::fail("tensor '{}' is {}; an EMA averages dense (strided) tensors only. Leave it out with "
                 "EmaOptions::ignore({{\"{}\"}})",
                 name, t.is_sparse() ? "sparse (COO)" : t.is_mkldnn() ? "an MKL-DNN tensor" : "not strided (sparse?)",
                 name);
  if (c10::isQIntType(t.scalar_type()))
    detail::fail("tensor '{}' is quantized ({}); an EMA averages float, complex and integer tensors only. Leave "
                 "it out with EmaOptions::ignore({{\"{}\"}})",
                 name, c10::toString(t.scalar_type()), name);
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::check_owned(const std::vector<SourceTensor>& tensors,
                                                const std::vector<TensorSpec>& specs,
                                                const std::vector<at::Tensor>& own) {
  std::unordered_map<const void*, const std::string*> model_memory;
  for (const auto& t : tensors)
    if (t.tensor.has_storage()) model_memory.emplace(t.tensor.storage().unsafeGetStorageImpl(), &t.name);
  std::unordered_map<const void*, std::vector<std::size_t>> own_memory;
  for (std::size_t i = 0; i < own.size(); ++i) {
    if (!own[i].defined() || !own[i].has_storage()) continue;
    const void* key = own[i].storage().unsafeGetStorageImpl();
    auto it = model_memory.find(key);
    if (it != model_memory.end())
      detail::fail("storage {} made, for '{}', a tensor that shares memory with the model's '{}'; an EMA must own "
                   "its averages",
                   detail::policy_name<Storage>(), specs[i].name, *it->second);
    auto& same_storage = own_memory[key];
    for (const std::size_t j : same_storage)
      if (detail::overlap(own[j], own[i]))
        detail::fail("storage {} made one tensor for '{}' and '{}', which the model keeps apart (does the module "
                     "its factory builds tie them?); the EMA would average it twice. Make the EMA module tie "
                     "exactly what the model ties",
                     detail::policy_name<Storage>(), specs[j].name, specs[i].name);
    same_storage.push_back(i);
  }
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::check_model_not_swapped(const char* what) const {
  if (swap_->guards > 0)
    detail::fail("{}() while a SwapGuard holds the EMA weights in the model would average the EMA with itself; "
                 "end the guard's scope (or call restore()) first",
                 what);
  if (detail::swap_registry().holder(sources_, swap_.get()) != nullptr)
    detail::fail("{}() while the model holds another Ema's weights (a SwapGuard of another Ema bound to this "
                 "model is open) would average that EMA's weights; end that guard's scope first",
                 what);
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::check_step_in(const StepInfo& info) const {
  constexpr auto max = std::numeric_limits<std::int64_t>::max();
  if (calls_ == max) detail::fail("update(): the call counter is at its maximum ({}); it cannot count another call", max);
  if (info.step) {
    if (*info.step < 0) detail::fail("update({{.step = {}}}): a step must be >= 0", *info.step);
  } else if (step_ == max) {
    detail::fail("update(): the step counter is at its maximum ({}); it cannot count another step", max);
  }
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::check_decision(const Decision& d, const StepInfo& info) const {
  auto source = [&] {
    return info.step ? fmt::format("update({{.step = {}}})", *info.step)
                     : fmt::format("update() (schedule {})", detail::policy_name<Schedule>());
  };
  if (d.step < 0) detail::fail("{}: a step must be >= 0, got {}", source(), d.step);
  if (d.step < step_)
    detail::fail("{}: the step went backwards, to {} (the last step was {})", source(), d.step, step_);
  if (d.action != Action::skipped && num_updates_ > 0 && d.step <= last_update_step_)
    detail::fail("{}: step {} was already applied (the last update was at step {}); an update at a step must "
                 "come once",
                 source(), d.step, last_update_step_);
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
double Ema<Decay, Schedule, Storage>::lerp_weight(const DecayInput& in) const {
  double w;
  if constexpr (HasLerpWeight<Decay>)
    w = static_cast<double>(decay_.weight(in));
  else
    w = 1.0 - static_cast<double>(decay_.decay(in));
  if (!(w >= 0.0 && w <= 1.0))
    detail::fail("decay policy {} gave d = {} at step {} (update {}); d must be in [0, 1]",
                 detail::policy_name<Decay>(), 1.0 - w, in.step, in.update);
  return w;
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::transfer(const torch::nn::Module& model, bool into_model) const {
  ensure_bound(into_model ? "copy_to" : "copy_from");
  const auto& slots = kernel_.settled_slots();
  std::vector<std::pair<std::string, at::Tensor>> ours;
  for (const auto& e : entries_) ours.emplace_back(e.name, slots[e.slot].average);
  const auto match = detail::match_by_name(ours, detail::tensors_by_name(model));
  detail::require_model_match(match);  // no problem: match.pairs[i] is entries_[i]
  std::vector<std::pair<const detail::Slot*, at::Tensor>> pairs;
  std::vector<bool> seen(slots.size(), false);
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const std::size_t slot = entries_[i].slot;
    if (into_model || !seen[slot]) pairs.emplace_back(&slots[slot], match.pairs[i].theirs);
    seen[slot] = true;
  }
  c10::NoGradGuard no_grad;
  for (auto& [s, t] : pairs) {
    if (into_model)
      t.copy_(s->average);
    else
      s->average.copy_(t);
  }
}

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
void Ema<Decay, Schedule, Storage>::check_model_unchanged(const char* what) const {
  const auto model = model_.lock();
  if (!model) return;  // bound to tensors, or a module not owned by a shared_ptr (destroyed: check_model_alive)
  const auto theirs = detail::tensors_by_name(*model);
  const auto& slots = kernel_.slots();
  for (const auto& e : entries_) {
    auto it = theirs.find(e.name);
    if (it == theirs.end())
      detail::fail("{}(): the model no longer has tensor '{}' that the EMA was bound to (was a sub-module "
                   "replaced?); make a new Ema for the changed model",
                   what, e.name);
    if (it->second.unsafeGetTensorImpl() != slots[e.slot].source.unsafeGetTensorImpl())
      detail::fail("{}(): the model's tensor '{}' is not the one the EMA was bound to (a sub-module replaced with "
                   "replace_module(), or the parameter registered anew, after the Ema was made); the EMA weights "
                   "would not reach the model. Make a new Ema for the changed model",
                   what, e.name);
  }
}

// The policies and options of an Ema before it exists: what a trainer hook (hooks.hpp) keeps
// until it makes the EMA, and what it asks the schedule before then.
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
struct Recipe {
  using ema_type = Ema<D, S, St>;

  explicit Recipe(D d = D(), S s = S(), EmaOptions o = EmaOptions(), St st = St())
      : decay(std::move(d)), schedule(std::move(s)), options(std::move(o)), storage(std::move(st)) {}

  ema_type make(const torch::nn::Module& model) const { return ema_type(model, decay, schedule, options, storage); }

  D decay;
  S schedule;
  EmaOptions options;
  St storage;
};

// torch::save(ema, path) and torch::load(ema, path).
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const Ema<D, S, St>& ema) {
  ema.save(archive);
  return archive;
}
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, Ema<D, S, St>& ema) {
  ema.load(archive);
  return archive;
}

}  // namespace emakit

#if EMAKIT_DEFINITIONS

namespace emakit::detail {

EMAKIT_FUNC std::vector<SourceTensor> collect(const torch::nn::Module& model) {
  std::vector<SourceTensor> out;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) out.push_back({item.key(), item.value(), false});
  for (const auto& item : model.named_buffers(/*recurse=*/true)) out.push_back({item.key(), item.value(), true});
  return out;
}

EMAKIT_FUNC std::unordered_map<std::string, at::Tensor> tensors_by_name(const torch::nn::Module& model) {
  std::unordered_map<std::string, at::Tensor> out;
  for (auto& t : collect(model)) out.emplace(std::move(t.name), std::move(t.tensor));
  return out;
}

EMAKIT_FUNC bool same_view(const at::Tensor& a, const at::Tensor& b) {
  if (a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl()) return true;
  return a.has_storage() && b.has_storage() && a.storage().is_alias_of(b.storage()) &&
         a.storage_offset() == b.storage_offset() && a.scalar_type() == b.scalar_type() &&
         a.sizes().equals(b.sizes()) && a.strides().equals(b.strides());
}

EMAKIT_FUNC std::pair<std::int64_t, std::int64_t> byte_extent(const at::Tensor& t) {
  std::int64_t last = t.storage_offset();
  for (std::int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  const auto item = static_cast<std::int64_t>(t.element_size());
  return {t.storage_offset() * item, (last + 1) * item};
}

EMAKIT_FUNC bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (!a.has_storage() || !b.has_storage() || a.numel() == 0 || b.numel() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto [a0, a1] = byte_extent(a);
  const auto [b0, b1] = byte_extent(b);
  return a0 < b1 && b0 < a1;
}

[[noreturn]] EMAKIT_FUNC void fail_model_destroyed(const char* what) {
  fail("{}(): the model this Ema was bound to has been destroyed (a rebuilt model?), so the EMA would average, "
       "or write into, tensors that no model uses; make a new Ema for the new model, or load this EMA's state "
       "into it (new_ema.load_state_dict(ema.state_dict()), or ema.copy_to(new_model) for the weights). This "
       "EMA's own state still reads: averages(), state_dict(), save()",
       what);
}

EMAKIT_FUNC bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || !a.sizes().equals(b.sizes())) return false;
  const at::Tensor x = a.detach().cpu().contiguous();
  const at::Tensor y = b.detach().cpu().contiguous();
  return x.nbytes() == y.nbytes() && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

}  // namespace emakit::detail

#endif  // EMAKIT_DEFINITIONS
