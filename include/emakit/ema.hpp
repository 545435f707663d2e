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
//   emakit::save(ema, "ema.pt");                     // config, counters and averages, written
//                                                    // atomically (checkpoint.hpp)
//
// The Ema binds once: it keeps handles to the model's tensors and its own, grouped for the update
// kernel, so update() does no name lookups, and on the fused CPU pass allocates nothing (but the
// drift's chunk sums, once per plan; drift measured outside the pass takes ATen temporaries).
// Module::to() keeps the handles valid (it uses set_data), but the average does not move with the
// model: it stays on its own device and in its own dtype, and the next update reads the model from
// wherever it went (the kernel re-plans once). A tensor that changes shape after binding is an
// error. A model owned by a shared_ptr (a ModuleHolder's) that is destroyed before its Ema:
// update() and swap_into() refuse, naming it; the EMA's own state still reads (docs/ema.md, "The
// bound model's lifetime").
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/busy.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/module_tensors.hpp>
#include <emakit/detail/serial/ema_state.hpp>
#include <emakit/detail/serial/match.hpp>
#include <emakit/detail/update_kernel.hpp>
#include <emakit/fwd.hpp>
#include <emakit/options.hpp>
#include <emakit/schedule.hpp>
#include <emakit/state.hpp>
#include <emakit/storage.hpp>
#include <emakit/swap.hpp>
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
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// What the caller tells update(): `step` when the trainer counts steps itself (timm passes its
// optimizer step), `vetoed` when the optimizer skipped this step (gradient-scaler overflow).
struct StepInfo {
  std::optional<std::int64_t> step = std::nullopt;
  bool vetoed = false;
};

// How far the EMA is from the model (EmaOptions::drift_every), measured right after an averaging
// update: `relative` = ||average - model|| / ||model|| over every averaged tensor together (the
// 2-norm of all their elements, the average as stored), and the averaged tensor whose own relative
// distance is largest. A relative distance with ||model|| = 0 is 0 if the average is 0 too, else
// infinity. A healthy EMA sits near a level set by its window (about 1/(1 - d) steps of the
// model's movement); one that grows without bound, or a NaN, means the EMA is diverging from the
// model (a sign error, a wrong decay, a model that jumps).
struct Drift {
  std::int64_t step = 0;           // the step of the update that measured it
  double relative = 0.0;           // ||average - model|| / ||model||, every averaged tensor
  std::string farthest = {};       // the averaged tensor farthest from its model tensor (relative)
  double farthest_relative = 0.0;  // its ||average - model|| / ||model||
};

// What update() did, the step it completed, and the decay it used (0 for a copy, NaN
// for a skip). With EmaOptions::skip_non_finite, `non_finite` names the first source
// tensor that held a NaN or an infinity; the update was then skipped. `drift`: measured
// by this update (EmaOptions::drift_every).
struct UpdateResult {
  Action action = Action::skipped;
  std::int64_t step = 0;
  double decay = std::nan("");
  std::string non_finite = {};
  std::optional<Drift> drift = std::nullopt;
};

// The version of the state-dict layout (detail::formats::ema_state); stored as "emakit.format".
inline constexpr std::int64_t state_format_version = detail::formats::ema_state.version;

namespace detail {

// The error of a call that would use the bound model after that model was destroyed.
[[noreturn]] EMAKIT_FUNC void fail_model_destroyed(const char* what);

}  // namespace detail

// ---- EmaBase: an EMA of any policies ------------------------------------------------------
//
// Everything of an Ema that does not depend on its policies' types lives in EmaBase, one
// non-template class the way torch::optim::Optimizer is the base of every optimizer: binding and
// the model's identity, the update, the reads, the swap, the state and its checks. It is compiled
// once (once per program in the implementation file, once per translation unit with
// EMAKIT_HEADER_ONLY, however many Ema types there are); Ema<Decay, Schedule, Storage> derives
// from it and adds only its policies: the schedule's decision, the decay's weight, the storage's
// create(), and their names and fields for messages and checkpoints (the private virtual calls
// below). Code that works with an EMA of any policies takes an EmaBase: update_together and
// EmaGroup, export_state and import_state, the hooks (and emakit::save / load within); so can a
// trainer's own code (a std::vector<std::unique_ptr<emakit::EmaBase>> of EMAs of several types).
class EmaBase;

namespace detail {
class GroupCore;
class BusyAll;
struct EmaAccess;

// The weights of an update: d from the decay policy and w = 1 - d, or the policy's own w
// (HasLerpWeight: exact 1/n) and d = 1 - w. What every Ema applies, and what a post-hoc synthesis
// of an EMA target (posthoc/target.hpp) assumes it applied.
template <class Decay>
Weights update_weights(const Decay& decay, const DecayInput& in) {
  if constexpr (HasLerpWeight<Decay>) {
    const auto w = static_cast<double>(decay.weight(in));
    return {w, 1.0 - w};
  } else {
    const auto d = static_cast<double>(decay.decay(in));
    return {1.0 - d, d};
  }
}

// The tag of an Ema made without binding it (the hooks' recipe of an EMA made later, EmaHook::add).
struct Unbound {
  explicit Unbound() = default;
};
inline constexpr Unbound unbound{};
}  // namespace detail

class EmaBase {
 public:
  EmaBase(const EmaBase&) = delete;
  EmaBase& operator=(const EmaBase&) = delete;
  EMAKIT_FUNC virtual ~EmaBase();

  // ---- the update ------------------------------------------------------------------------

  // Call after each optimizer step (each micro-batch with an accumulation window). The schedule
  // decides whether this call skips, copies the model, or averages; the decay policy gives d.
  //
  // An Ema is not thread-safe, like a torch::nn::Module: use it from one thread at a time (or
  // behind a mutex). Two update() calls that overlap are detected and the second is refused.
  EMAKIT_FUNC UpdateResult update(const StepInfo& info = {});

  // Call at the end of each training epoch (0-based `epoch`) when the options ask for epoch-end
  // updates (EmaOptions::update_at_epoch_ends, the Lightning preset's update_starting_at_epoch):
  // from that epoch on, averages the model as it is now (a copy if the EMA holds nothing yet),
  // once per epoch, as one more applied update that is not an optimizer step (calls() and step()
  // do not move, so the schedule's steps are unchanged). Without the option, or before its epoch,
  // it does nothing and returns Action::skipped.
  EMAKIT_FUNC UpdateResult epoch_end(std::int64_t epoch);

  // The side-stream protocol (EmaOptions::side_stream): update() may return before the update has
  // run. Call wait_for_model_reads() before the next optimizer step writes the model; it is
  // asynchronous for the host (the device's current stream waits for the side stream). Nothing
  // else is needed: buffers, which the next forward pass may write (BatchNorm statistics), are
  // read on the current stream, and every read of the EMA (average(), averages(), state_dict(),
  // module(), storage(), swap_into(), copy_to(), and what is built on them) settles by itself.
  // With a CPU average of a CUDA model, wait_for_model_reads() orders only the device-to-host
  // copies; the host pass goes on until something reads the average. Without a side stream, both
  // do nothing.
  EMAKIT_FUNC void wait_for_model_reads() const;
  // Everything of the last update has finished (the host pass of an offloaded update too). For
  // tensors taken from averages() or module() before an update and read after it; the EMA's own
  // accessors call it.
  EMAKIT_FUNC void wait_for_update() const;
  // Earlier names of 0.1 development, deprecated: removed in 0.2.
  [[deprecated("renamed wait_for_model_reads()")]] void wait() const { wait_for_model_reads(); }
  [[deprecated("renamed wait_for_update()")]] void settle() const { wait_for_update(); }

  // ---- counters and parts -------------------------------------------------------------------

  std::int64_t calls() const noexcept { return counters_.calls; }              // update() calls seen
  std::int64_t step() const noexcept { return counters_.step; }                // last completed step
  std::int64_t num_updates() const noexcept { return counters_.num_updates; }  // copies + averages applied
  std::int64_t last_update_step() const noexcept { return counters_.last_update_step; }
  double decay() const noexcept { return counters_.last_decay; }  // d of the last applied update
  // Updates skipped because the model held a NaN or an infinity (EmaOptions::skip_non_finite),
  // and the tensor named by the last of them.
  std::int64_t non_finite_updates() const noexcept { return counters_.non_finite_updates; }
  const std::string& last_non_finite() const noexcept { return last_non_finite_; }
  // The drift measured by the last update that measured it (EmaOptions::drift_every); empty before
  // the first. Not saved: a loaded EMA has none until it measures again.
  const std::optional<Drift>& last_drift() const noexcept { return last_drift_; }
  const EmaOptions& options() const noexcept { return options_; }

  // The Ema's decay, schedule or storage policy if it is of type `Policy`, else null (as
  // std::function::target): e.g. ema.find_policy<emakit::Fixed>(). The typed accessors are
  // Ema's decay_policy(), schedule() and storage().
  template <class Policy>
  const Policy* find_policy() const noexcept {
    return static_cast<const Policy*>(policy_of_type(typeid(Policy)));
  }

  // The averaged and copied tensors by name, in the model's order. They are the EMA's own tensors.
  // A tied tensor is there under each of its names, as one tensor.
  EMAKIT_FUNC StateDict averages() const;
  // The EMA tensor named `name` (as in the model's state dict).
  EMAKIT_FUNC const at::Tensor& average(const std::string& name) const;
  // Names of the tensors the EMA holds in a role (Role::ignore: none, it holds no such tensor).
  EMAKIT_FUNC std::vector<std::string> names(Role role) const;
  // The parameters that did not require grad at bind and that EmaOptions::frozen_parameters()
  // therefore copies or leaves out (empty with the default, which averages them).
  const std::vector<std::string>& frozen_parameters() const noexcept { return frozen_; }

  // ---- moving weights between the EMA and a model ------------------------------------------

  // Writes the EMA weights into `model` (matched by name; every EMA tensor must be there). Every
  // name the EMA holds is written (a model that does not tie what the bound model ties gets the
  // tensor under each name).
  void copy_to(torch::nn::Module& model) const { transfer(model, Direction::into_model); }
  // Overwrites the EMA weights with `model`'s (the first name of each tensor); counters are
  // unchanged.
  void copy_from(const torch::nn::Module& model) { transfer(model, Direction::from_model); }

  // Pulls the bound model towards the EMA ("switch EMA"): model = lerp(model, ema, 1 - beta) for
  // averaged tensors, model = ema for copied ones; beta = 0 copies every tensor the EMA holds.
  // update() calls it by itself when EmaOptions::switch_model is set.
  EMAKIT_FUNC void switch_model(double beta);

  // Puts the EMA weights into the bound model until the guard's scope ends.
  // Guards of one Ema nest (the later ones hold nothing of their own) and may end in any order.
  // Refused while another Ema's guard holds this model, and when the model changed since bind
  // (a tensor of another shape, or a sub-module replaced: the model's tensors are not the ones
  // bound), naming the tensor.
  [[nodiscard]] EMAKIT_FUNC SwapGuard swap_into();

  // ---- state ------------------------------------------------------------------------------

  // Config, counters and averaged tensors (the keys: detail/serial/ema_state.hpp). The averages
  // are the EMA's tensors (shared, not copied).
  EMAKIT_FUNC StateDict state_dict() const;

  // Loads a state_dict() of an EMA with the same config. A config that differs is an error that
  // names the field and both values. Everything is checked before anything is written: a failed
  // load leaves the EMA exactly as it was.
  EMAKIT_FUNC LoadReport load_state_dict(const StateDict& state, LoadMode mode = LoadMode::strict);

  // Every check of load_state_dict() and nothing written: throws where it would throw, returns
  // the report it would return. Lets a caller that loads several things check them all first.
  EMAKIT_FUNC LoadReport check_state_dict(const StateDict& state, LoadMode mode = LoadMode::strict) const;

  // For an EMA made after its trainer had already run (a hook that creates it lazily): counts
  // `calls` update() calls and `step` completed steps as already seen, so that update_every,
  // start_step and accumulation windows continue where the trainer is. Only before any update.
  EMAKIT_FUNC void advance(std::int64_t calls, std::int64_t step);

  // Archive operators (torch::save(ema, path) / torch::load(ema, path)) live below the class.
  // The archive holds the state dict and a CRC-32 per tensor ("emakit_checksums"), checked by
  // load(): a damaged file is an error, never a different average.
  EMAKIT_FUNC void save(torch::serialize::OutputArchive& archive) const;
  // What load_state_dict() reports (lenient: what was missing, unexpected or mismatched).
  EMAKIT_FUNC LoadReport load(torch::serialize::InputArchive& archive, LoadMode mode = LoadMode::strict);

 protected:
  // An EMA with these options, bound to nothing yet: the derived Ema binds it once its policies
  // exist (bind() calls create_averages()).
  EMAKIT_FUNC explicit EmaBase(EmaOptions options);
  // Moving is allowed (a SwapGuard stays valid: it refers to the same tensors); the moved-from
  // Ema refuses every call with an error that says so.
  EmaBase(EmaBase&&) noexcept = default;
  EmaBase& operator=(EmaBase&&) noexcept = default;

  // Binds to `tensors` of `model` (null: a list of tensors). What it holds is decided by
  // identity, not by name: a tensor registered under several names (a tied weight, a sub-module
  // registered twice) is one average, updated once, reachable and saved under each of its names.
  // The storage makes the EMA's own tensors (create_averages), which must not share memory with
  // the model; the model is not changed.
  EMAKIT_FUNC void bind(const torch::nn::Module* model, std::vector<SourceTensor> tensors,
                        std::string_view storage_name);

  void ensure_bound(const char* what) const {
    if (!bound_) fail_moved_from(what);
  }
  // wait_for_update() without the moved-from check (storage() of a moved-from Ema reads its
  // policy).
  void wait_for_update_kernel() const { kernel_.wait_for_update(); }
  // The swap of a gathered average (Ema::swap_gathered_into): `full` is the whole average by name.
  EMAKIT_FUNC SwapGuard swap_gathered(const StateDict& full, torch::nn::Module& model) const;

 private:
  friend class detail::GroupCore;
  friend class detail::BusyAll;
  friend struct detail::EmaAccess;

  // ---- what the derived Ema gives: the calls into its policies -------------------------------
  virtual Decision decide(const ScheduleInput& in) const = 0;
  virtual detail::Weights weights(const DecayInput& in) const = 0;  // w = 1 - d and d, unchecked
  // The policies' names and fields (messages, the state's config).
  virtual detail::ema_state::PolicyConfig policy_config() const = 0;
  // The storage's create(): the EMA's own tensors, one per spec.
  virtual std::vector<at::Tensor> create_averages(const torch::nn::Module* model,
                                                  std::span<const TensorSpec> specs) = 0;
  // find_policy(): the policy of that type, or null.
  virtual const void* policy_of_type(const std::type_info& type) const noexcept = 0;
  // An Ema of the same type, policies and options, bound to `model` (the hooks' lazily made EMA).
  virtual std::unique_ptr<EmaBase> bound_like(const torch::nn::Module& model) const = 0;

  [[noreturn]] EMAKIT_FUNC static void fail_moved_from(const char* what);

  // The parts of bind(): what it will hold (plan_bind), then holding what the storage made.
  struct BindPlan;
  // The checks of the tensors' names and of the options' device, and each tensor's role (frozen_
  // set).
  EMAKIT_FUNC std::vector<Role> roles_of(const std::vector<SourceTensor>& tensors);
  EMAKIT_FUNC BindPlan plan_bind(const std::vector<SourceTensor>& tensors);
  // The plan's tensors held: the slots of the update kernel, the entries, the model's tensors.
  EMAKIT_FUNC void hold(BindPlan plan, std::vector<at::Tensor> own);

  enum class Direction : std::uint8_t { into_model, from_model };
  // The model's tensors are handles: writing into them through a const Module is what
  // Module::load does too.
  EMAKIT_FUNC void transfer(const torch::nn::Module& model, Direction direction) const;

  // An update in three parts, for update() and update_together(): prepare() checks and decides and
  // changes nothing; apply() runs the kernel (for a copy or an average); finish() moves the
  // counters (and switches the model, EmaOptions::switch_model). A failed part leaves the counters
  // as they were.
  struct Prepared {
    UpdateResult result;              // action, step, decay; non_finite: the tensor that skips it
    detail::UpdateKernel::Job job{};  // what the kernel does if it applies: copy, or average with
                                      // w = 1 - d and d, measuring the drift
                                      // (EmaOptions::drift_every)
    bool vetoed = false;
    bool off_schedule = false;  // an epoch-end update: not a call, not a step
  };
  EMAKIT_FUNC Prepared prepare(const StepInfo& info);
  // prepare() once the schedule has decided (or epoch_end() has, for itself).
  EMAKIT_FUNC Prepared prepare_decided(Prepared p);
  bool applies(const Prepared& p) const noexcept {
    return p.result.action != Action::skipped && p.result.non_finite.empty();
  }
  EMAKIT_FUNC UpdateResult finish(const Prepared& p);
  // The Drift of the kernel's drift sums.
  EMAKIT_FUNC Drift drift_of_kernel(std::int64_t step) const;

  // Whether `other` is bound to the model this EMA is bound to: the same owned module, or, for a
  // module not owned by a shared_ptr or a list of tensors, a model tensor in common.
  EMAKIT_FUNC bool same_model(const EmaBase& other) const;
  // The name (in `other`) of a model tensor that both EMAs read; empty if none.
  EMAKIT_FUNC std::string shared_tensor(const EmaBase& other) const;

  // The one way a swap opens (swap_into, swap_gathered): backs up `targets`, opens this
  // Ema's swap over them (update() is refused until its guards end) and writes `values` into them.
  EMAKIT_FUNC SwapGuard open_swap_over(std::vector<at::Tensor> targets, const std::vector<at::Tensor>& values) const;

  EMAKIT_FUNC detail::ema_state::Plan plan_load(const StateDict& state, LoadMode mode) const;

  // update() refuses while the model holds EMA weights: this Ema's own SwapGuard (it would average
  // the EMA with itself) or another Ema's (it would average that EMA's weights). `member`: the
  // index of this EMA in update_together's list, named in the message.
  EMAKIT_FUNC void check_model_not_swapped(const char* what, std::size_t member = no_member) const;
  static constexpr std::size_t no_member = static_cast<std::size_t>(-1);

  // What the schedule may compute from: no counter about to overflow, no negative given step.
  // Checked before anything changes, so that every state update() reaches can be saved and loaded;
  // check_decision() checks what the schedule decided (a backward step, a step applied twice).
  EMAKIT_FUNC void check_step_in(const StepInfo& info) const;

  // The schedule's decision, checked like a given step (a schedule of your own may count steps
  // its own way): no step backwards, and no update applied twice at one step.
  EMAKIT_FUNC void check_decision(const Decision& d, const StepInfo& info) const;

  // The bound module still holds the tensors the EMA was bound to (a sub-module replaced with
  // replace_module(), or a parameter registered anew, leaves the EMA bound to tensors the model
  // no longer uses). Checked where it would go unnoticed: swap_into().
  EMAKIT_FUNC void check_model_unchanged(const char* what) const;

  // The bound module still exists, for a module owned by a shared_ptr (a ModuleHolder's, or
  // make_shared's): the Ema keeps handles to the model's tensors, so after the model is destroyed
  // (a model rebuilt for a new run) update() would go on averaging tensors nothing uses, and
  // swap_into() would write the average into them. Checked by the calls that use the bound
  // model's tensors: update(), switch_model(), swap_into(). Not by those that read the EMA's own
  // state (averages, state_dict, save), nor by copy_to/copy_from, whose model is an argument. One
  // atomic load per call. A module not owned by a shared_ptr, or a list of tensors, cannot be
  // checked (ModelWatch).
  void check_model_alive(const char* what) const {
    if (model_.destroyed()) detail::fail_model_destroyed(what);
  }

  EmaOptions options_;
  detail::UpdateKernel kernel_;
  std::vector<std::string> frozen_;  // names frozen_parameters() applied to, at bind
  std::vector<detail::ema_state::Entry>
      entries_;                      // every name the EMA holds, in the model's order (tied: several per slot)
  std::vector<at::Tensor> sources_;  // the model's tensors, one per slot (handles)
  detail::ModelWatch model_;         // the bound module (watched when a shared_ptr owns it)
  std::shared_ptr<detail::SwapState> swap_;
  detail::BusyFlag busy_;
  detail::ema_state::Counters counters_;
  std::string last_non_finite_;
  std::optional<Drift> last_drift_;
  std::int64_t last_epoch_end_ = -1;  // the epoch of the last epoch_end() that updated (not saved, as Lightning's)
  detail::BoundFlag bound_;
};

namespace detail {

// The members of update_together(), checked once, and the scratch of their updates kept from
// call to call: emakit::EmaGroup owns one; update_together(a, b, ...) makes one for its call.
// The members must stay where they are while the group lives (a group of a std::vector's EMAs:
// the vector is not resized).
class GroupCore {
 public:
  // Refuses, naming the member: a null member, an unbound (moved-from) Ema, an Ema given twice,
  // members bound to different models, a member whose update writes the model
  // (EmaOptions::switch_model).
  EMAKIT_FUNC explicit GroupCore(std::vector<EmaBase*> members);
  // Each member's update(info) as its own update() would, one after another, with each CPU source
  // tensor read once for all of them (the members whose whole update is the fused CPU pass):
  // bitwise the same averages, counters and results, to `out` (one per member). Refuses before
  // anything changes what update() refuses (a destroyed model, a swap open, an update running, a
  // step going back). After its first call it allocates nothing of its own (a member's kernel
  // does when it re-plans: a source given new memory).
  EMAKIT_FUNC void update(const StepInfo& info, std::span<UpdateResult> out);
  std::size_t size() const noexcept { return members_.size(); }

 private:
  std::vector<EmaBase*> members_;
  std::vector<EmaBase::Prepared> prepared_;
  std::vector<UpdateKernel::Work> work_;
  UpdateKernel::TogetherScratch scratch_;
};

// What emakit's own code asks of an EmaBase beyond its public face: the hooks (an EMA made later
// from an unbound one, the config check before it exists) and import_state (its schedule's
// decisions, to recount a peer's updates).
struct EmaAccess {
  static Decision decide(const EmaBase& ema, const ScheduleInput& in) { return ema.decide(in); }
  static std::unique_ptr<EmaBase> bound_like(const EmaBase& ema, const torch::nn::Module& model) {
    return ema.bound_like(model);
  }
  // The checks of a state's format and config against the EMA's policies and options
  // (bound or not).
  static void check_config(const EmaBase& ema, const StateDict& state) {
    ema_state::check_config(state, ema.policy_config(), ema.options_);
  }
};

}  // namespace detail

template <DecayPolicy Decay, SchedulePolicy Schedule, StoragePolicy Storage>
class Ema : public EmaBase {
 public:
  using decay_type = Decay;
  using schedule_type = Schedule;
  using storage_type = Storage;

  // Binds to every parameter and buffer of `model` (names as in its state dict).
  explicit Ema(const torch::nn::Module& model, Decay decay = Decay(), Schedule schedule = Schedule(),
               EmaOptions options = EmaOptions(), Storage storage = Storage())
      : Ema(detail::unbound, std::move(decay), std::move(schedule), std::move(options), std::move(storage)) {
    bind(&model, detail::collect(model), detail::policy_name<Storage>());
  }

  // Binds to a list of named tensors (e.g. a TorchScript module's parameters).
  explicit Ema(std::vector<SourceTensor> tensors, Decay decay = Decay(), Schedule schedule = Schedule(),
               EmaOptions options = EmaOptions(), Storage storage = Storage())
      : Ema(detail::unbound, std::move(decay), std::move(schedule), std::move(options), std::move(storage)) {
    bind(nullptr, std::move(tensors), detail::policy_name<Storage>());
  }

  // An Ema bound to nothing, for emakit's hooks (EmaHook::add: the EMA made later); every call
  // that reads or updates it refuses, as on a moved-from Ema.
  Ema(detail::Unbound, Decay decay, Schedule schedule, EmaOptions options, Storage storage)
      : EmaBase(std::move(options)),
        decay_(std::move(decay)),
        schedule_(std::move(schedule)),
        storage_(std::move(storage)) {}

  // Moving is allowed (a SwapGuard stays valid: it refers to the same tensors); the moved-from
  // Ema refuses every call with an error that says so.
  Ema(Ema&&) noexcept = default;
  Ema& operator=(Ema&&) noexcept = default;
  ~Ema() override = default;

  // ---- the policies ---------------------------------------------------------------------------

  const Decay& decay_policy() const noexcept { return decay_; }
  const Schedule& schedule() const noexcept { return schedule_; }
  // The storage policy and the tensors it holds, settled (see wait_for_update()).
  const Storage& storage() const {
    wait_for_update_kernel();
    return storage_;
  }

  // The EMA module, for a module-backed storage, settled (see wait_for_update()): its parameters
  // and buffers are the averages.
  decltype(auto) module() const requires requires(const Storage& s) { s.module(); }
  {
    ensure_bound("module");
    wait_for_update_kernel();
    return storage_.module();
  }

  // For a storage that holds only part of the average here (GatheringStorage: ShardedStorage):
  // gathers the whole average (a collective) and puts it into `model`, matched by name, until the
  // guard's scope ends. This Ema's own swap, as swap_into(): update() is refused while it is open.
  [[nodiscard]] SwapGuard swap_gathered_into(torch::nn::Module& model) const requires GatheringStorage<Storage, Ema> {
    ensure_bound("swap_gathered_into");
    return swap_gathered(storage_.gather(*this, all_ranks), model);
  }

 private:
  Decision decide(const ScheduleInput& in) const override { return schedule_.decide(in); }
  detail::Weights weights(const DecayInput& in) const override { return detail::update_weights(decay_, in); }
  detail::ema_state::PolicyConfig policy_config() const override {
    return {detail::policy_name<Decay>(), detail::policy_fields(decay_), detail::policy_name<Schedule>(),
            detail::policy_fields(schedule_)};
  }
  std::vector<at::Tensor> create_averages(const torch::nn::Module* model, std::span<const TensorSpec> specs) override {
    return storage_.create(model, specs);
  }
  const void* policy_of_type(const std::type_info& type) const noexcept override {
    if (type == typeid(Decay)) return &decay_;
    if (type == typeid(Schedule)) return &schedule_;
    if (type == typeid(Storage)) return &storage_;
    return nullptr;
  }
  std::unique_ptr<EmaBase> bound_like(const torch::nn::Module& model) const override {
    if constexpr (std::is_copy_constructible_v<Storage>) {
      return std::make_unique<Ema>(model, decay_, schedule_, options(), storage_);
    } else {
      detail::fail("storage {} cannot be copied, so no Ema like this one can be made for another model",
                   detail::policy_name<Storage>());
    }
  }

  Decay decay_;
  Schedule schedule_;
  Storage storage_;
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/ema-inl.hpp>
#endif
