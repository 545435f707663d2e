// Trainer hooks: EMAs for a hand-written C++ training loop, driven by the points every trainer
// already has. What nvalchemi's EMAHook and luxonis-train's EMACallback do for Python trainers.
//
//   emakit::EmaHook hook;
//   hook.add(*model, emakit::Recipe(emakit::Fixed(0.999)));       // key "model"; or add("gen", ...)
//   hook.setup();                                                  // makes the EMA (or later, see Creation)
//   for (...) {
//     hook.before_optimizer_step();                                 // optional: see Side streams
//     optimizer.step();
//     hook.after_optimizer_step({.vetoed = scaler_skipped_the_step});
//     if (validate_now) {
//       auto scope = hook.validation();                            // the model holds the EMA weights ...
//       evaluate(model);
//     }                                                            // ... and its own again, also on a throw
//     if (save_now) hook.save_checkpoint("last.pt");              // or into your own archive
//   }
//   hook.train_end();                                              // the model keeps the EMA weights
//
// Side streams. An EMA with EmaOptions::side_stream updates on a stream of its own, which must
// not be still reading the model when the next optimizer step writes it
// (Ema::wait_for_model_reads()). A trainer that calls before_optimizer_step() gets the overlap
// the side stream is for; one that never calls it is safe all the same: after_optimizer_step()
// then waits right after each update (no overlap).
//
// Checkpoints (the layout: detail/serial/hook_state.hpp). save_checkpoint(archive) writes, for each
// model key K:
//   K                    the model's weights in Module::save's layout: the EMA weights when
//                        HookOptions::checkpoint_ema_weights (the default, as luxonis-train), so
//                        emakit::load_weights(model, path) or a plain Module::load of that
//                        sub-archive gives a deployable model; the online weights otherwise
//   emakit_hook/K        the EMA's state (config, counters, averages), the hook's own counters,
//                        and the online weights (when K holds the EMA's), so that a run resumed
//                        from the checkpoint continues bitwise as if it had never stopped
// Every tensor of a checkpoint has a CRC-32 in emakit_hook/K/checksums (LibTorch's archive reader
// does not check the zip format's own), so a damaged file is an error, never different weights.
// load_checkpoint() checks every model first and writes nothing unless all of them fit.
//
// A model owned by a shared_ptr (a ModuleHolder's, or make_shared's) that is destroyed while
// the hook lives: every call that would use it refuses, naming its key, before anything
// changes (docs/ema.md, "The bound model's lifetime"). A model that no shared_ptr owns must
// outlive the hook.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/archive_file.hpp>
#include <emakit/detail/serial/hook_state.hpp>
#include <emakit/ema.hpp>
#include <emakit/options.hpp>
#include <emakit/recipe.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// When the hook makes a model's EMA.
enum class Creation : std::uint8_t {
  at_setup = 0,                // setup() makes it (or the first step, if setup() was never called)
  at_first_eligible_step = 1,  // the first after_optimizer_step() that the schedule would copy or
                               // average on: no memory is used before start_step (nvalchemi
                               // EMAHook)
};

// What the hook does with one model at each stage.
struct HookOptions {
  Creation creation = Creation::at_setup;
  bool validate_with_ema = true;       // validation runs with the EMA weights, restored afterwards
  bool test_with_ema = true;           // the same for test
  bool keep_ema_at_train_end = true;   // train_end() leaves the EMA weights in the model
  bool checkpoint_ema_weights = true;  // a checkpoint's model weights are the EMA's
};

// The hook's state layout version (detail::formats::hook), stored as emakit_hook/format.
inline constexpr std::int64_t hook_format_version = detail::formats::hook.version;

namespace detail {

EMAKIT_FUNC void check_hook_key(const std::string& key);

// The error of a hook call that would use model `key` after that model was destroyed.
[[noreturn]] EMAKIT_FUNC void fail_hook_model_destroyed(const std::string& key, bool created, const char* what);

// One model of a hook and its EMA, whatever the EMA's policies: `recipe` is an Ema bound to
// nothing (Ema(detail::unbound, ...)) that holds the policies and options; the EMA itself is made
// from it (EmaAccess::bound_like) at setup or at the first eligible step.
class HookEntry {
 public:
  using Publish = std::function<void(const EmaBase&)>;

  HookEntry(std::string key, torch::nn::Module& model, std::unique_ptr<EmaBase> recipe, HookOptions options,
            Publish publish)
      : key_(std::move(key)),
        model_(&model),
        watch_(model),
        options_(options),
        recipe_(std::move(recipe)),
        publish_(std::move(publish)) {}
  HookEntry(const HookEntry&) = delete;
  HookEntry& operator=(const HookEntry&) = delete;

  const std::string& key() const noexcept { return key_; }
  const torch::nn::Module* model() const noexcept { return model_; }
  const HookOptions& options() const noexcept { return options_; }
  // The unbound Ema the EMA is made like: its type, policies and options.
  const EmaBase& recipe() const noexcept { return *recipe_; }
  EmaBase* ema() noexcept { return ema_.get(); }

  // The model, once checked to still exist: every use of the model goes through here. model_ is a
  // raw pointer (the hook does not own the model); when a shared_ptr owns it (watch_ was set), a
  // destroyed model is an error naming the key and `what` (the hook's call) instead of a dangling
  // dereference. One atomic load. A model no shared_ptr owns cannot be checked (add(): it must
  // outlive the hook).
  torch::nn::Module& live_model(const char* what) const {
    if (model_destroyed()) fail_hook_model_destroyed(key_, created(), what);
    return *model_;
  }
  bool model_destroyed() const noexcept { return watch_.destroyed(); }

  bool created() const noexcept { return ema_ != nullptr; }
  bool pending() const noexcept { return pending_.has_value(); }
  // Makes the EMA (once): bound to the model, advanced to the hook's counters, with a pending
  // checkpoint's state loaded; a load that throws leaves the entry as it was.
  EMAKIT_FUNC void create(const char* what);
  EMAKIT_FUNC UpdateResult step(const StepInfo& info);
  // Ema::epoch_end(); an EMA not made yet is made first when its options update at this epoch's
  // end.
  EMAKIT_FUNC UpdateResult epoch_end(std::int64_t epoch);
  void wait_for_model_reads() {
    if (ema_) ema_->wait_for_model_reads();
  }
  EMAKIT_FUNC void swap_in(const char* what);
  void swap_out() noexcept { swap_.reset(); }
  // train_end() would write the EMA weights into the model.
  bool keeps() const noexcept { return created() && options_.keep_ema_at_train_end; }
  void keep() {
    if (keeps()) ema_->copy_to(live_model("train_end"));
  }
  EMAKIT_FUNC void save(torch::serialize::OutputArchive& archive, torch::serialize::OutputArchive& hook);
  // Checks what load would do and returns the function that does it (it does not throw).
  EMAKIT_FUNC std::function<void()> plan_load(torch::serialize::InputArchive& archive,
                                              torch::serialize::InputArchive& hook, LoadMode mode);

 private:
  // The state's averaged tensors moved to the device and floating dtype of this EMA's tensors
  // (a checkpoint written on another device or in another precision).
  EMAKIT_FUNC static StateDict aligned(const StateDict& state, const EmaBase& ema);

  std::string key_;
  torch::nn::Module* model_;  // use through live_model()
  detail::ModelWatch watch_;  // the model (watched when a shared_ptr owns it)
  HookOptions options_;
  std::unique_ptr<EmaBase> recipe_;
  Publish publish_;
  std::unique_ptr<EmaBase> ema_;
  std::optional<SwapGuard> swap_;
  std::int64_t calls_ = 0;  // update() calls and completed steps seen before the EMA was made
  std::int64_t step_ = 0;
  std::optional<StateDict> pending_;  // a checkpoint's EMA state loaded before the EMA was made
  LoadMode pending_mode_ = LoadMode::strict;
};

}  // namespace detail

class EmaHook;

// Ends a validation or test stage when it goes out of scope, also by an exception: the models
// get their own weights back. Made by EmaHook::validation() and EmaHook::test().
class StageScope {
 public:
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;
  StageScope(StageScope&& other) noexcept : hook_(std::exchange(other.hook_, nullptr)) {}
  StageScope& operator=(StageScope&&) = delete;
  inline ~StageScope();
  // Ends the stage now (the destructor then does nothing).
  inline void end() noexcept;

 private:
  friend class EmaHook;
  explicit StageScope(EmaHook* hook) : hook_(hook) {}
  EmaHook* hook_;
};

// EMAs of one or several models (by key, each with its own policies), driven by a trainer's
// stages. See the top of this file.
class EmaHook {
 public:
  EmaHook() = default;
  EmaHook(const EmaHook&) = delete;
  EmaHook& operator=(const EmaHook&) = delete;
  ~EmaHook() { end_stage(); }

  // Adds a model under `key` (letters, digits, '_'). The model must outlive the hook. `publish`,
  // if given, is called with the EMA after each update that changed it (e.g. to hand the EMA
  // module to an inference thread).
  template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
  EmaHook& add(std::string key, torch::nn::Module& model, Recipe<D, S, St> recipe, HookOptions options = {},
               std::type_identity_t<std::function<void(const Ema<D, S, St>&)>> publish = {}) {
    detail::check_hook_key(key);
    if (stage_ != Stage::training)
      detail::fail("add('{}') during {}: add models while no validation or test stage is running", key, stage_name());
    for (const auto& e : entries_) {
      if (e->key() == key) detail::fail("model key '{}' is already in this hook", key);
      const bool both_swap = (e->options().validate_with_ema && options.validate_with_ema) ||
                             (e->options().test_with_ema && options.test_with_ema);
      if (e->model() == &model && !e->model_destroyed() && both_swap)  // a new model where one was destroyed
        detail::fail("model '{}' is the same module as model '{}' and both would swap their EMA weights into it for "
                     "validation or test; set validate_with_ema / test_with_ema to false for one of them",
                     key, e->key());
    }
    using E = Ema<D, S, St>;
    auto unbound = std::make_unique<E>(detail::unbound, std::move(recipe.decay), std::move(recipe.schedule),
                                       std::move(recipe.options), std::move(recipe.storage));
    detail::HookEntry::Publish call;
    if (publish) call = [publish = std::move(publish)](const EmaBase& e) { publish(static_cast<const E&>(e)); };
    entries_.push_back(
        std::make_unique<detail::HookEntry>(std::move(key), model, std::move(unbound), options, std::move(call)));
    return *this;
  }
  // The same under the key "model".
  template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
  EmaHook& add(torch::nn::Module& model, Recipe<D, S, St> recipe, HookOptions options = {},
               std::type_identity_t<std::function<void(const Ema<D, S, St>&)>> publish = {}) {
    return add(std::string("model"), model, std::move(recipe), options, std::move(publish));
  }

  // ---- stages ------------------------------------------------------------------------------

  // Makes the EMAs created at setup (and those with a checkpoint loaded before).
  void setup();

  // Before each optimizer step: the side-stream EMAs' Ema::wait_for_model_reads() (the step must
  // not write the model while an update still reads it). Optional; once called, the hook leaves
  // that wait to it.
  void before_optimizer_step();

  // After each optimizer step (each micro-batch with an accumulation window); `vetoed` when the
  // optimizer skipped the step. Returns what each model's EMA did, in the order of add(). Without
  // before_optimizer_step(), a side-stream update is waited for here.
  std::vector<UpdateResult> after_optimizer_step(StepInfo info = {}) {
    return update_each("after_optimizer_step", info, std::nullopt);
  }

  // At the end of each training epoch (0-based `epoch`): Ema::epoch_end() of every model's EMA,
  // which updates only where its options ask for it (EmaOptions::update_at_epoch_ends: Lightning's
  // update_starting_at_epoch, lightning_ema_weight_averaging_recipe). Returns what each did.
  std::vector<UpdateResult> train_epoch_end(std::int64_t epoch) { return update_each("train_epoch_end", {}, epoch); }

  void validation_start() { start(Stage::validation); }
  void validation_end() { finish(Stage::validation); }
  void test_start() { start(Stage::test); }
  void test_end() { finish(Stage::test); }
  // validation_start() now and validation_end() when the scope ends, also by an exception.
  [[nodiscard]] StageScope validation() {
    validation_start();
    return StageScope(this);
  }
  [[nodiscard]] StageScope test() {
    test_start();
    return StageScope(this);
  }

  // The models keep their EMA weights (HookOptions::keep_ema_at_train_end).
  void train_end() {
    require_training("train_end");
    for (auto& e : entries_)  // a destroyed model is refused before any model changes
      if (e->keeps()) (void)e->live_model("train_end");
    for (auto& e : entries_) e->keep();
  }

  // ---- checkpoints -------------------------------------------------------------------------

  // Writes every model's weights and the hook's state into `archive` (add the optimizer's and
  // your own beside them). Tensors are copied: the archive does not change as training goes on.
  void save_checkpoint(torch::serialize::OutputArchive& archive);
  // The same into a file, atomically: a crash mid-write leaves the previous file readable.
  void save_checkpoint(const std::filesystem::path& path);

  // Restores every model's online weights and EMA state from a checkpoint of save_checkpoint().
  // A model whose EMA is not made yet keeps the state and applies it when the EMA is made.
  // Strict: another model's checkpoint (a missing, extra or differently shaped tensor), another
  // config, or a model key the checkpoint lacks is an error naming the first mismatch, and
  // nothing is loaded. Lenient: such tensors are warned about and keep their current values.
  void load_checkpoint(torch::serialize::InputArchive& archive, LoadMode mode = LoadMode::strict);
  // A file that is not a readable archive (truncated, damaged) or that holds anything but tensors
  // and plain values (code, unknown records: see checkpoint.hpp) is an error naming it, before
  // anything is loaded.
  void load_checkpoint(const std::filesystem::path& path, LoadMode mode = LoadMode::strict);

  // ---- access ------------------------------------------------------------------------------

  std::vector<std::string> keys() const;
  bool created(const std::string& key) const { return entry(key).created(); }

  // The EMA of model `key`, e.g. hook.ema<emakit::FixedEma>("model") (or hook.ema<emakit::EmaBase>,
  // whatever its policies). It must have been made.
  template <std::derived_from<EmaBase> E>
  E& ema(const std::string& key) {
    detail::HookEntry& e = entry(key);
    if (dynamic_cast<const E*>(&e.recipe()) == nullptr)
      detail::fail("model '{}' has an EMA of another type than the one asked for", key);
    if (e.ema() == nullptr)
      detail::fail("model '{}' has no EMA yet: it is made at {}", key,
                   e.options().creation == Creation::at_setup ? "setup()" : "its first eligible step");
    return static_cast<E&>(*e.ema());
  }

 private:
  friend class StageScope;
  enum class Stage : std::uint8_t { training, validation, test };

  const char* stage_name() const noexcept {
    return stage_ == Stage::validation ? "validation" : stage_ == Stage::test ? "test" : "training";
  }
  void require_training(const char* what) const;
  // after_optimizer_step() (each EMA's update(info)) or train_epoch_end() (its epoch_end(epoch)):
  // every model checked alive first, each side-stream update waited for unless
  // before_optimizer_step() does it.
  std::vector<UpdateResult> update_each(const char* what, const StepInfo& info, std::optional<std::int64_t> epoch);

  detail::HookEntry& entry(const std::string& key) const;

  void start(Stage stage);

  void finish(Stage stage);

  void end_stage() noexcept {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) (*it)->swap_out();
    stage_ = Stage::training;
  }

  std::vector<std::unique_ptr<detail::HookEntry>> entries_;
  Stage stage_ = Stage::training;
  bool waits_before_step_ = false;  // the trainer calls before_optimizer_step()
};

StageScope::~StageScope() { end(); }
void StageScope::end() noexcept {
  if (hook_ != nullptr) std::exchange(hook_, nullptr)->end_stage();
}

// Loads the model weights of `key` from a file of EmaHook::save_checkpoint() into `model` (the
// EMA weights, with the default HookOptions): what an inference program does. Checks every
// tensor first; a checkpoint of another model is an error naming the first mismatch.
EMAKIT_FUNC void load_weights(torch::nn::Module& model, const std::filesystem::path& path,
                              const std::string& key = "model");

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/hooks-inl.hpp>
#endif
