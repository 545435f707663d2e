// The non-template definitions of hooks.hpp: included at the end of hooks.hpp in the all-inline mode
// (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp (detail/config.hpp).
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC void load_weights(torch::nn::Module& model, const std::filesystem::path& path, const std::string& key) {
  torch::serialize::InputArchive archive;
  detail::read_archive(archive, path, "load_weights");
  const detail::TensorMap found = detail::hook_state::read_weights(archive, model, key, path.string());
  const auto copies =
      detail::plan_weights(model, found, false, LoadMode::strict, fmt::format("load_weights '{}'", path.string()));
  c10::NoGradGuard no_grad;
  for (const auto& [model_tensor, saved] : copies) model_tensor.copy_(saved);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC void EmaHook::setup() {
  require_training("setup");
  const auto makes = [](const detail::HookEntryBase& e) {
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

EMAKIT_FUNC detail::HookEntryBase& EmaHook::entry(const std::string& key) const {
  for (const auto& e : entries_)
    if (e->key() == key) return *e;
  detail::fail("the hook has no model '{}'{}", key, entries_.empty() ? "; add() it first" : "");
}

EMAKIT_FUNC void EmaHook::start(Stage stage) {
  require_training(stage == Stage::validation ? "validation_start" : "test_start");
  std::vector<detail::HookEntryBase*> done;
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
