// The non-template definitions of hooks.hpp: included at the end of hooks.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/hooks-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/hooks.hpp> instead"
#endif

#include <emakit/hooks.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void check_hook_key(const std::string& key) {
  bool ok = !key.empty() && !(key[0] >= '0' && key[0] <= '9') && key != "emakit_hook";
  for (char c : key)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_');
  if (!ok)
    fail("model key '{}' is not usable: a key is letters, digits and '_', does not start with a digit and is "
         "not 'emakit_hook' (it names a part of the checkpoint)",
         key);
}

EMAKIT_FUNC void fail_hook_model_destroyed(const std::string& key, bool created, const char* what) {
  if (created)
    fail("{0}(): model '{1}' of this EmaHook has been destroyed (a rebuilt model?), so the hook would use a module "
         "that no longer exists; nothing was changed. Make a new EmaHook for the new model and carry this EMA over: "
         "new_hook.ema<E>(\"{1}\").load_state_dict(hook.ema<E>(\"{1}\").state_dict()) once the new hook has made "
         "its EMA (or load_checkpoint a checkpoint saved before the model went). This EMA's own state still reads: "
         "hook.ema<E>(\"{1}\").averages(), state_dict(), emakit::save",
         what, key);
  fail("{0}(): model '{1}' of this EmaHook has been destroyed (a rebuilt model?) before its EMA was made, so the "
       "hook would use a module that no longer exists; nothing was changed. Make a new EmaHook for the new model "
       "(and load_checkpoint a checkpoint saved before the model went, to carry the run over)",
       what, key);
}

// ---- HookEntry ------------------------------------------------------------------------------

EMAKIT_FUNC void HookEntry::create(const char* what) {
  if (ema_) return;
  std::unique_ptr<EmaBase> made = EmaAccess::bound_like(*recipe_, live_model(what));
  if (calls_ > 0 || step_ > 0) made->advance(calls_, step_);
  if (pending_) made->load_state_dict(aligned(*pending_, *made), pending_mode_);  // throws: nothing changed
  ema_ = std::move(made);
  pending_.reset();
}

EMAKIT_FUNC UpdateResult HookEntry::step(const StepInfo& info) {
  if (!ema_) {
    if (!pending_ && options_.creation == Creation::at_first_eligible_step) {
      const Decision d = EmaAccess::decide(*recipe_, ScheduleInput{calls_ + 1, info.step, step_, 0, info.vetoed});
      if (d.action == Action::skipped) {
        calls_ += 1;
        step_ = d.step;
        return {Action::skipped, d.step, std::nan("")};
      }
    }
    create("after_optimizer_step");
  }
  const UpdateResult r = ema_->update(info);
  if (r.action != Action::skipped && publish_) publish_(*ema_);
  return r;
}

EMAKIT_FUNC UpdateResult HookEntry::epoch_end(std::int64_t epoch) {
  if (!ema_) {
    const auto from = recipe_->options().epoch_end_updates_from();
    if (!from || epoch < *from) return {Action::skipped, step_, std::nan("")};
    create("train_epoch_end");
  }
  const UpdateResult r = ema_->epoch_end(epoch);
  if (r.action != Action::skipped && publish_) publish_(*ema_);
  return r;
}

EMAKIT_FUNC void HookEntry::swap_in(const char* what) {
  (void)live_model(what);  // the EMA's own check would not name the key
  if (!ema_ && pending_) create(what);
  if (ema_) swap_.emplace(ema_->swap_into());
}

EMAKIT_FUNC void HookEntry::save(torch::serialize::OutputArchive& archive, torch::serialize::OutputArchive& hook) {
  torch::nn::Module& model = live_model("save_checkpoint");
  // While the model holds the EMA weights (a checkpoint during validation) its own weights are
  // in the swap guard: put them back for the save and the EMA's in again after.
  const bool was_swapped = swap_.has_value();
  swap_.reset();
  struct Reswap {
    HookEntry* self;
    bool on;
    ~Reswap() {
      if (on) self->swap_.emplace(self->ema_->swap_into());
    }
  } reswap{this, was_swapped && ema_ != nullptr};

  const bool ema_weights = ema_ && options_.checkpoint_ema_weights;
  const StateDict* state = nullptr;
  StateDict ema_state;
  if (ema_) {
    ema_state = ema_->state_dict();
    state = &ema_state;
  } else if (pending_) {
    state = &*pending_;
  }
  TensorMap replace;
  if (ema_weights)
    for (const auto& item : ema_->averages()) replace.emplace(item.key(), item.value());
  hook_state::write_entry(archive, hook, key_, model,
                          {ema_ != nullptr, pending_.has_value(), calls_, step_, ema_weights}, state, replace);
}

// A checkpoint's weights written into the model (load_checkpoint, load_weights).
EMAKIT_FUNC void write_model_weights(const std::vector<std::pair<at::Tensor, at::Tensor>>& copies) {
  c10::NoGradGuard no_grad;
  for (const auto& [model_tensor, saved] : copies) model_tensor.copy_(saved);
}

EMAKIT_FUNC std::function<void()> HookEntry::plan_load(torch::serialize::InputArchive& archive,
                                                       torch::serialize::InputArchive& hook, LoadMode mode) {
  const std::string where = fmt::format("load_checkpoint, model '{}'", key_);
  if (swap_) fail("{}: the model holds the EMA weights (validation or test); end that stage first", where);
  auto read = hook_state::read_entry(archive, hook, key_, live_model("load_checkpoint"), mode, where);
  if (!read) return [] {};
  const bool was_created = read->meta.created;
  const std::int64_t calls = read->meta.calls;
  const std::int64_t step = read->meta.step;
  auto copies = std::move(read->copies);
  std::optional<StateDict> state = std::move(read->state);

  if (was_created && ema_) {
    auto state_aligned = std::make_shared<StateDict>(aligned(*state, *ema_));
    ema_->check_state_dict(*state_aligned, mode);
    return [this, copies = std::move(copies), state_aligned, mode] {
      write_model_weights(copies);
      ema_->load_state_dict(*state_aligned, mode);
      pending_.reset();
    };
  }
  // No EMA here yet (it is made at creation, with this state applied), or none in the run that
  // saved the checkpoint: this model goes back to "not made yet" with that run's counters. A
  // state of another config is refused now, as with an EMA (nvalchemi's EMAHook does the same).
  if (state) EmaAccess::check_config(*recipe_, *state);
  return [this, copies = std::move(copies), state = std::move(state), calls, step, mode]() mutable {
    write_model_weights(copies);
    ema_.reset();
    pending_ = std::move(state);
    pending_mode_ = mode;
    calls_ = calls;
    step_ = step;
  };
}

EMAKIT_FUNC StateDict HookEntry::aligned(const StateDict& state, const EmaBase& ema) {
  const StateDict ours = ema.averages();
  StateDict out;
  for (const auto& item : state) {
    at::Tensor t = item.value();
    const std::string& key = item.key();
    if (detail::ema_state::is_average_key(key)) {
      if (const at::Tensor* mine = ours.find(detail::ema_state::average_name(key)); mine != nullptr) {
        const bool both_floating = c10::isFloatingType(t.scalar_type()) && c10::isFloatingType(mine->scalar_type());
        if (both_floating && (t.scalar_type() != mine->scalar_type() || t.device() != mine->device()))
          t = t.to(mine->options());
        else if (t.device() != mine->device())
          t = t.to(mine->device());
      }
    }
    out.insert(key, t);
  }
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC void load_weights(torch::nn::Module& model, const std::filesystem::path& path, const std::string& key) {
  torch::serialize::InputArchive archive;
  detail::read_archive(archive, path, "load_weights");
  const detail::TensorMap found = detail::hook_state::read_weights(archive, model, key, path.string());
  const auto copies =
      detail::plan_weights(model, found, false, LoadMode::strict, fmt::format("load_weights '{}'", path.string()));
  detail::write_model_weights(copies);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC void EmaHook::setup() {
  require_training("setup");
  const auto makes = [](const detail::HookEntry& e) {
    return !e.created() && (e.options().creation == Creation::at_setup || e.pending());
  };
  for (auto& e : entries_)  // a destroyed model is refused before any EMA is made
    if (makes(*e)) (void)e->live_model("setup");
  for (auto& e : entries_)
    if (makes(*e)) e->create("setup");
}

EMAKIT_FUNC void EmaHook::before_optimizer_step() {
  require_training("before_optimizer_step");
  waits_before_step_ = true;
  for (auto& e : entries_) e->wait_for_model_reads();
}

EMAKIT_FUNC std::vector<UpdateResult> EmaHook::update_each(const char* what, const StepInfo& info,
                                                           std::optional<std::int64_t> epoch) {
  require_training(what);
  for (auto& e : entries_) (void)e->live_model(what);  // before any model's EMA updates
  std::vector<UpdateResult> out;
  out.reserve(entries_.size());
  for (auto& e : entries_) {
    out.push_back(epoch ? e->epoch_end(*epoch) : e->step(info));
    if (!waits_before_step_) e->wait_for_model_reads();
  }
  return out;
}

EMAKIT_FUNC void EmaHook::save_checkpoint(torch::serialize::OutputArchive& archive) {
  torch::serialize::OutputArchive hook(archive.compilation_unit());
  detail::hook_state::write_header(hook);
  for (auto& e : entries_) (void)e->live_model("save_checkpoint");  // before anything is written
  for (auto& e : entries_) e->save(archive, hook);
  archive.write("emakit_hook", hook);
}

EMAKIT_FUNC void EmaHook::save_checkpoint(const std::filesystem::path& path) {
  torch::serialize::OutputArchive archive;
  save_checkpoint(archive);
  detail::write_archive(archive, path);
}

EMAKIT_FUNC void EmaHook::load_checkpoint(torch::serialize::InputArchive& archive, LoadMode mode) {
  require_training("load_checkpoint");
  torch::serialize::InputArchive hook;
  detail::hook_state::read_header(archive, hook);
  for (const auto& k : hook.keys()) {
    if (detail::hook_state::is_header_key(k)) continue;
    bool ours = false;
    for (const auto& e : entries_) ours = ours || e->key() == k;
    if (ours) continue;
    if (mode == LoadMode::strict)
      detail::fail("load_checkpoint: the checkpoint holds model '{}', which this hook does not have; nothing was "
                   "loaded",
                   k);
    TORCH_WARN("emakit: load_checkpoint: the checkpoint holds model '", k, "', which this hook does not have; ignored");
  }
  std::vector<std::function<void()>> commits;
  for (auto& e : entries_) commits.push_back(e->plan_load(archive, hook, mode));
  for (auto& commit : commits) commit();
}

EMAKIT_FUNC void EmaHook::load_checkpoint(const std::filesystem::path& path, LoadMode mode) {
  torch::serialize::InputArchive archive;
  detail::read_archive(archive, path, "load_checkpoint");
  try {
    load_checkpoint(archive, mode);
  } catch (const std::invalid_argument&) {
    detail::rethrow_with_context(fmt::format(" (file '{}')", path.string()));
  }
}

EMAKIT_FUNC std::vector<std::string> EmaHook::keys() const {
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e->key());
  return out;
}

EMAKIT_FUNC void EmaHook::require_training(const char* what) const {
  if (stage_ != Stage::training)
    detail::fail("{}() during {}: the models hold their EMA weights; call {}_end() (or let the scope of {}() end) "
                 "first",
                 what, stage_name(), stage_name(), stage_name());
}

EMAKIT_FUNC detail::HookEntry& EmaHook::entry(const std::string& key) const {
  for (const auto& e : entries_)
    if (e->key() == key) return *e;
  detail::fail("the hook has no model '{}'{}", key, entries_.empty() ? "; add() it first" : "");
}

EMAKIT_FUNC void EmaHook::start(Stage stage) {
  require_training(stage == Stage::validation ? "validation_start" : "test_start");
  std::vector<detail::HookEntry*> done;
  try {
    for (auto& e : entries_) {
      const bool wanted = stage == Stage::validation ? e->options().validate_with_ema : e->options().test_with_ema;
      if (!wanted) continue;
      e->swap_in(stage == Stage::validation ? "validation_start" : "test_start");
      done.push_back(e.get());
    }
  } catch (...) {
    for (auto it = done.rbegin(); it != done.rend(); ++it) (*it)->swap_out();
    throw;
  }
  stage_ = stage;
}

EMAKIT_FUNC void EmaHook::finish(Stage stage) {
  if (stage_ != stage)
    detail::fail("{}_end() without {}_start() (the hook is in {})", stage == Stage::validation ? "validation" : "test",
                 stage == Stage::validation ? "validation" : "test", stage_name());
  end_stage();
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
