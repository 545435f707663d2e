// The non-template definitions of interop.hpp: included at the end of interop.hpp in header-only mode,
// compiled once into the emakit library (src/emakit.cpp) in compiled mode (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/interop-inl.hpp holds definitions that the emakit library compiles in compiled mode (EMAKIT_COMPILED): include <emakit/interop.hpp> instead"
#endif

#include <emakit/interop.hpp>

#include <fmt/format.h>

#include <c10/util/Exception.h>

#include <ATen/core/List.h>

#include <algorithm>
#include <iterator>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::interop {

EMAKIT_FUNC const PeerText& peer_text(Peer peer) {
  static constexpr PeerText table[] = {
      {"ema_model.", "an ema-pytorch EMA", "torch.save(ema.state_dict(), path)", "ema.ema_model.state_dict()"},
      {"module.", "a timm ModelEmaV3", "torch.save(ema.state_dict(), path)", "ema.module.state_dict()"},
      {"module.", "a torch AveragedModel", "torch.save(averaged_model.state_dict(), path)",
       "averaged_model.module.state_dict()"},
      {"", "a diffusers EMAModel", "torch.save(ema.state_dict(), path)", "ema.shadow_params"},
      {"", "a luxonis-train EMACallback", "torch.save(callback.state_dict(), path)", "callback.ema.state_dict_ema"},
      {"", "a Lightning EMAWeightAveraging checkpoint", "trainer.save_checkpoint(path)",
       "the model's own state_dict()"},
      {"module.", "an nvalchemi EMAHook", "torch.save(hook.state_dict(), path)",
       "hook.get_averaged_model().state_dict()"},
  };
  static_assert(static_cast<int>(Peer::ema_pytorch) == 0 && static_cast<int>(Peer::timm_v3) == 1 &&
                static_cast<int>(Peer::averaged_model) == 2 && static_cast<int>(Peer::diffusers) == 3 &&
                static_cast<int>(Peer::luxonis_callback) == 4 && static_cast<int>(Peer::lightning) == 5 &&
                static_cast<int>(Peer::nvalchemi_hook) == 6);
  const auto i = static_cast<std::size_t>(peer);
  if (i >= std::size(table)) fail("interop: unknown Peer value {}", i);
  return table[i];
}

// No anonymous namespace: the helpers below are EMAKIT_FUNC (external linkage in compiled mode).

EMAKIT_FUNC const at::Tensor* entry(const c10::impl::GenericDict& dict, const std::string& key) {
  const auto it = dict.find(key);
  if (it == dict.end() || !it->value().isTensor()) return nullptr;
  return &it->value().toTensor();
}

EMAKIT_FUNC std::vector<std::string> average_names(const StateDict& state) {
  std::vector<std::string> names;
  for (const auto& item : state)
    if (ema_state::is_average_key(item.key())) names.push_back(ema_state::average_name(item.key()));
  return names;
}

EMAKIT_FUNC bool holds_prefixed(const c10::impl::GenericDict& dict, std::string_view prefix) {
  for (const auto& item : dict)
    if (item.key().isString() && item.key().toStringRef().rfind(prefix, 0) == 0) return true;
  return false;
}

// Every name is in `dict` without a prefix: the peer's inner model saved alone.
EMAKIT_FUNC bool holds_unprefixed(const c10::impl::GenericDict& dict, const std::vector<std::string>& names) {
  return !names.empty() &&
         std::all_of(names.begin(), names.end(), [&](const auto& n) { return entry(dict, n) != nullptr; });
}

// What the file holds where it should hold the `missing` names (under the peer's prefix), as a
// sentence for a message; `matched`: how many of this EMA's tensors it does hold. Empty when it
// holds none of them under another key and some of this EMA's tensors under the peer's.
EMAKIT_FUNC std::string holds_instead(const c10::impl::GenericDict& dict, Peer peer,
                                      const std::vector<std::string>& missing, std::size_t matched) {
  for (const auto& name : missing)
    if (entry(dict, name) != nullptr)
      return fmt::format("it holds '{}' instead: saved from {}? Save the whole {} state ({})", name,
                         peer_text(peer).inner_call, peer_text(peer).name.substr(peer_text(peer).name.find(' ') + 1),
                         peer_text(peer).save_call);
  for (const auto& name : missing) {
    for (const auto& item : dict) {
      if (!item.key().isString()) continue;
      const std::string& key = item.key().toStringRef();
      if (key.size() > name.size() && key.compare(key.size() - name.size(), name.size(), name) == 0 &&
          key[key.size() - name.size() - 1] == '.')
        return fmt::format("it holds '{}' instead: a state of another peer, or of a model wrapped differently?", key);
    }
  }
  if (matched > 0) return {};
  std::vector<std::string> keys;
  for (const auto& item : dict)
    if (item.key().isString() && keys.size() < 4) keys.push_back("'" + item.key().toStringRef() + "'");
  return fmt::format("it holds {} entries ({}{}), none named like this EMA's tensors: a state of another model?",
                     dict.size(), fmt::join(keys, ", "), dict.size() > keys.size() ? ", ..." : "");
}

EMAKIT_FUNC PeerFile read_peer_file(const c10::impl::GenericDict& dict, Peer peer, const std::string& path,
                                    const StateDict& state) {
  PeerFile f;
  f.prefix = std::string(peer_text(peer).prefix);
  const std::vector<std::string> names = average_names(state);
  const bool prefixed = holds_prefixed(dict, f.prefix);
  // timm's ModelEmaV3 has no counters: its own checkpoints hold ema.module.state_dict(), which is
  // the whole state. The other peers' inner model lacks their counters: refused below.
  if (peer == Peer::timm_v3 && !prefixed && holds_unprefixed(dict, names)) f.prefix.clear();
  const auto unprefixed =
      std::find_if(names.begin(), names.end(), [&](const auto& n) { return entry(dict, n) != nullptr; });
  const std::string hint = !prefixed && unprefixed != names.end()
                               ? fmt::format(": its keys are the model's own ('{}'): saved from {}? Save {}",
                                             *unprefixed, peer_text(peer).inner_call, peer_text(peer).save_call)
                               : std::string();
  if (peer == Peer::ema_pytorch) {
    const at::Tensor* s = entry(dict, "step");
    const at::Tensor* initted = entry(dict, "initted");
    if (s == nullptr || initted == nullptr)
      fail("import_state: '{}' has no 'step' and 'initted': not an ema-pytorch EMA state{}", path, hint);
    const std::string where = fmt::format("import_state: '{}'", path);
    f.step = integer_value(*s, "step", where);
    if (f.step < 0) fail("{}: step must be >= 0, got {}", where, f.step);
    f.initted = number_value(*initted, "initted", where) != 0;
  } else if (peer == Peer::averaged_model || peer == Peer::nvalchemi_hook) {
    const at::Tensor* n = entry(dict, "n_averaged");
    if (n == nullptr)
      fail("import_state: '{}' has no 'n_averaged'{}: not an AveragedModel state{}", path,
           peer == Peer::nvalchemi_hook ? " in averaged_model_state" : "", hint);
    f.n_averaged = integer_value(*n, "n_averaged", fmt::format("import_state: '{}'", path));
    if (f.n_averaged < 0) fail("import_state: '{}': n_averaged must be >= 0, got {}", path, f.n_averaged);
  }
  for (const auto& item : state) {
    const std::string& key = item.key();
    if (ema_state::is_average_key(key)) {
      const at::Tensor* t = entry(dict, f.prefix + ema_state::average_name(key));
      if (t != nullptr) f.state.insert(key, *t);  // a missing one: peer_report names it
    } else if (key.rfind("counters.", 0) != 0) {
      f.state.insert(key, item.value());
    }
  }
  return f;
}

// emakit's key (average.<name>) in a report line, as the peer's file names it.
EMAKIT_FUNC std::string to_peer_key(std::string text, const std::string& prefix) {
  const std::string ours(ema_state::average_prefix);
  if (text.rfind(ours, 0) == 0) text.replace(0, ours.size(), prefix);
  for (std::size_t at = text.find("'" + ours); at != std::string::npos; at = text.find("'" + ours, at + 1))
    text.replace(at + 1, ours.size(), prefix);
  const std::string state_word = " in the state,";
  if (const auto at = text.find(state_word); at != std::string::npos)
    text.replace(at, state_word.size(), " in the file,");
  return text;
}

EMAKIT_FUNC LoadReport peer_report(const LoadReport& found, const PeerFile& file, const c10::impl::GenericDict& dict,
                                   Peer peer, const std::string& path, LoadMode mode) {
  LoadReport report;
  for (const auto& k : found.missing) report.missing.push_back(to_peer_key(k, file.prefix));
  for (const auto& k : found.unexpected) report.unexpected.push_back(to_peer_key(k, file.prefix));
  for (const auto& k : found.mismatched) report.mismatched.push_back(to_peer_key(k, file.prefix));
  if (report.clean()) return report;
  std::vector<std::string> parts;
  constexpr std::size_t shown = 4;
  for (std::size_t i = 0; i < report.missing.size() && i < shown; ++i)
    parts.push_back(fmt::format("no '{}'", report.missing[i]));
  if (report.missing.size() > shown) parts.push_back(fmt::format("and {} more missing", report.missing.size() - shown));
  for (const auto& k : report.unexpected) parts.push_back(fmt::format("unexpected '{}'", k));
  for (const auto& k : report.mismatched) parts.push_back(k);
  std::vector<std::string> missing;
  for (const auto& k : found.missing) missing.push_back(ema_state::average_name(k));
  std::size_t matched = 0;
  for (const auto& item : file.state) matched += ema_state::is_average_key(item.key()) ? 1 : 0;
  std::string instead = missing.empty() ? std::string() : holds_instead(dict, peer, missing, matched);
  if (!instead.empty()) instead.insert(0, "; ");
  if (mode == LoadMode::strict)
    fail("import_state: '{}' is not {} state of this EMA's model: {}{}; nothing was loaded", path, peer_text(peer).name,
         fmt::join(parts, "; "), instead);
  TORCH_WARN("emakit: import_state: '", path, "': ", fmt::format("{}", fmt::join(parts, "; ")), instead,
             "; kept the current values of those");
  return report;
}

EMAKIT_FUNC void keep_current(StateDict& out, const LoadReport& found, const StateDict& state) {
  auto keep = [&](const std::string& key) {
    if (const at::Tensor* t = state.find(key)) {
      if (out.contains(key))
        out[key] = *t;
      else
        out.insert(key, *t);
    }
  };
  for (const auto& k : found.missing) keep(k);
  for (const auto& k : found.mismatched) keep(k.substr(0, k.find(": ")));
}

EMAKIT_FUNC c10::impl::GenericDict tensor_dict(const StateDict& averages, std::string_view prefix) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : averages)
    dict.insert(std::string(prefix) + item.key(), item.value().detach().cpu().contiguous());
  return dict;
}

// ---- luxonis-train EMACallback -------------------------------------------------------------

EMAKIT_FUNC c10::impl::GenericDict luxonis_dict(const StateDict& averages, std::int64_t updates) {
  c10::impl::GenericDict outer(c10::StringType::get(), c10::AnyType::get());
  outer.insert("ema_state_dict", tensor_dict(averages));
  outer.insert("updates", updates);
  return outer;
}

EMAKIT_FUNC c10::impl::GenericDict luxonis_tensors(const c10::impl::GenericDict& dict, const std::string& path,
                                                   std::int64_t& updates) {
  const std::string save = "save torch.save(callback.state_dict(), path), or checkpoint[\"callbacks\"][key] of a "
                           "Lightning checkpoint";
  const auto inner = dict.find("ema_state_dict");
  const auto count = dict.find("updates");
  if (inner == dict.end() || count == dict.end())
    fail("import_state: '{}' has no 'ema_state_dict' and 'updates': not a luxonis-train EMACallback state; {}", path,
         save);
  if (!inner->value().isGenericDict())
    fail("import_state: '{}': 'ema_state_dict' must be a dict of tensors, got a {}", path, inner->value().tagKind());
  const c10::IValue& u = count->value();
  if (u.isInt()) {
    updates = u.toInt();
  } else if (u.isTensor()) {
    updates = integer_value(u.toTensor(), "updates", fmt::format("import_state: '{}'", path));
  } else {
    fail("import_state: '{}': 'updates' must be an int, got a {}", path, u.tagKind());
  }
  if (updates < 0) fail("import_state: '{}': updates must be >= 0, got {}", path, updates);
  return inner->value().toGenericDict();
}

// dict[key] of a peer's file, or an error naming the file, the key and how such a file is written.
EMAKIT_FUNC const c10::IValue& required_entry(const c10::impl::GenericDict& dict, const char* key,
                                              const std::string& where, const char* written_how) {
  const auto it = dict.find(key);
  if (it == dict.end()) fail("{} has no '{}': {}; nothing was loaded", where, key, written_how);
  return it->value();
}

// ---- Lightning EMAWeightAveraging ----------------------------------------------------------

EMAKIT_FUNC c10::impl::GenericDict lightning_tensors(const c10::impl::GenericDict& dict, const std::string& path,
                                                     LightningCounters& counters) {
  const std::string where = fmt::format("import_state: '{}'", path);
  const auto value = [&](const char* key) -> const c10::IValue& {
    return required_entry(dict, key, where,
                          "not a Lightning checkpoint (save it with trainer.save_checkpoint(path) while the "
                          "EMAWeightAveraging callback runs)");
  };
  const c10::IValue& state = value("state_dict");
  if (!state.isGenericDict())
    fail("{}: 'state_dict' must be a dict of tensors, got a {}; nothing was loaded", where, state.tagKind());
  if (dict.find("averaging_state") == dict.end())
    fail("{} has no 'averaging_state': not written with Lightning's EMAWeightAveraging callback (whose "
         "on_save_checkpoint puts the averages in state_dict and n_averaged in averaging_state), so its state_dict is "
         "the model's own weights, not an average; nothing was loaded",
         where);
  const c10::IValue& averaging = value("averaging_state");
  if (!averaging.isGenericDict())
    fail("{}: 'averaging_state' must be a dict, got a {}; nothing was loaded", where, averaging.tagKind());
  const at::Tensor* n = entry(averaging.toGenericDict(), "n_averaged");
  if (n == nullptr)
    fail("{}: 'averaging_state' has no tensor 'n_averaged' (the AveragedModel's update count); nothing was loaded",
         where);
  counters.n_averaged = integer_value(*n, "n_averaged", where);
  if (counters.n_averaged < 0)
    fail("{}: n_averaged must be >= 0, got {}; nothing was loaded", where, counters.n_averaged);
  const c10::IValue& step = value("global_step");
  if (!step.isInt()) fail("{}: 'global_step' must be an int, got a {}; nothing was loaded", where, step.tagKind());
  counters.global_step = step.toInt();
  if (counters.global_step < 0)
    fail("{}: global_step must be >= 0, got {}; nothing was loaded", where, counters.global_step);
  // The callback's own entry (its state_key: the class name); absent when the checkpoint was saved
  // without callback states, then not checked.
  if (const auto callbacks = dict.find("callbacks"); callbacks != dict.end() && callbacks->value().isGenericDict()) {
    const auto all = callbacks->value().toGenericDict();
    if (const auto own = all.find("EMAWeightAveraging"); own != all.end() && own->value().isGenericDict()) {
      const auto fields = own->value().toGenericDict();
      const auto latest = fields.find("latest_update_step");
      if (latest == fields.end() || !latest->value().isInt())
        fail("{}: callbacks['EMAWeightAveraging'] has no int 'latest_update_step'; nothing was loaded", where);
      counters.latest_update_step = latest->value().toInt();
    }
  }
  return state.toGenericDict();
}

EMAKIT_FUNC void check_lightning_counters(const LightningCounters& file, std::int64_t updates, std::int64_t last,
                                          const std::string& path) {
  const std::string options =
      "made with other EMAWeightAveraging options (update_every_n_steps, update_starting_at_step) than this EMA's, or "
      "by a callback that also updated at epoch ends (update_starting_at_epoch)?";
  if (file.n_averaged != updates)
    fail("import_state: '{}': n_averaged is {} in the file, but this EMA's schedule makes {} updates in global_step "
         "{} steps: {}; nothing was loaded",
         path, file.n_averaged, updates, file.global_step, options);
  if (file.latest_update_step >= 0 && file.latest_update_step != last)
    fail("import_state: '{}': callbacks['EMAWeightAveraging'] latest_update_step is {} in the file, but this EMA's "
         "schedule last updates at step {} of {}: {}; nothing was loaded",
         path, file.latest_update_step, last, file.global_step, options);
}

EMAKIT_FUNC c10::impl::GenericDict lightning_dict(const StateDict& averages, std::int64_t global_step,
                                                  std::int64_t n_averaged, std::int64_t latest_update_step) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("state_dict", tensor_dict(averages));
  c10::impl::GenericDict averaging(c10::StringType::get(), c10::TensorType::get());
  averaging.insert("n_averaged", at::scalar_tensor(n_averaged, at::kLong));  // AveragedModel's long buffer
  dict.insert("averaging_state", averaging);
  c10::impl::GenericDict fields(c10::StringType::get(), c10::AnyType::get());
  fields.insert("latest_update_step", latest_update_step);  // a Python int, as the callback's state_dict()
  c10::impl::GenericDict callbacks(c10::StringType::get(), c10::AnyType::get());
  callbacks.insert("EMAWeightAveraging", fields);
  dict.insert("callbacks", callbacks);
  dict.insert("global_step", global_step);
  return dict;
}

// A file's value as Python writes it (True, 3, 0.5), or its kind, for messages.
EMAKIT_FUNC std::string python_value(const c10::IValue& v) {
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isInt()) return fmt::format("{}", v.toInt());
  if (v.isDouble()) return fmt::format("{}", v.toDouble());
  return fmt::format("a {}", v.tagKind());
}

// ---- nvalchemi EMAHook --------------------------------------------------------------------

EMAKIT_FUNC c10::impl::GenericDict nvalchemi_dict(const StateDict& averages, const NvalchemiConfig& config,
                                                  std::int64_t num_updates) {
  // Values of type Any: a double, ints and a bool pickle as Python float, int and bool, what
  // EMAHook's pydantic fields compare equal to in its load_state_dict.
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("decay", config.decay);
  dict.insert("update_every", config.update_every);
  dict.insert("start_step", config.start_step);
  dict.insert("use_buffers", config.use_buffers);
  dict.insert("num_updates", num_updates);
  c10::impl::GenericDict averaged = tensor_dict(averages, "module.");
  averaged.insert("n_averaged", at::scalar_tensor(num_updates, at::kLong));  // AveragedModel's long buffer
  dict.insert("averaged_model_state", averaged);
  return dict;
}

EMAKIT_FUNC c10::impl::GenericDict nvalchemi_tensors(const c10::impl::GenericDict& dict, const std::string& path,
                                                     const NvalchemiConfig& config, std::int64_t& num_updates) {
  const std::string where = fmt::format("import_state: '{}'", path);
  const auto value = [&](const char* key) -> const c10::IValue& {
    return required_entry(dict, key, where,
                          "not an nvalchemi EMAHook state (save it with torch.save(hook.state_dict(), path))");
  };
  const auto integer = [&](const char* key) {
    const c10::IValue& v = value(key);
    if (!v.isInt()) fail("{}: '{}' must be an int, got {}; nothing was loaded", where, key, python_value(v));
    return v.toInt();
  };
  const auto differs = [&](const char* field, const std::string& file, const std::string& ours, const char* option) {
    fail("{}: config differs: {} is {} in the file, {} in this EMA ({}); make the EMA with the hook's options "
         "(nvalchemi_ema); nothing was loaded",
         where, field, file, ours, option);
  };
  const c10::IValue& decay = value("decay");
  if (!decay.isDouble() && !decay.isInt())
    fail("{}: 'decay' must be a number, got {}; nothing was loaded", where, python_value(decay));
  if (const double d = decay.isDouble() ? decay.toDouble() : static_cast<double>(decay.toInt()); d != config.decay)
    differs("decay", fmt::format("{}", d), fmt::format("{}", config.decay), "Fixed::beta");
  if (const std::int64_t v = integer("update_every"); v != config.update_every)
    differs("update_every", fmt::format("{}", v), fmt::format("{}", config.update_every), "update_every");
  if (const std::int64_t v = integer("start_step"); v != config.start_step)
    differs("start_step", fmt::format("{}", v), fmt::format("{}", config.start_step), "start_step");
  const c10::IValue& buffers = value("use_buffers");
  if (!buffers.isBool())
    fail("{}: 'use_buffers' must be a bool, got {}; nothing was loaded", where, python_value(buffers));
  if (buffers.toBool() != config.use_buffers)
    differs("use_buffers", python_value(buffers), config.use_buffers ? "True" : "False",
            config.use_buffers ? "buffers averaged" : "buffers copied");
  num_updates = integer("num_updates");
  if (num_updates < 0) fail("{}: num_updates must be >= 0, got {}; nothing was loaded", where, num_updates);
  const auto averaged = dict.find("averaged_model_state");
  if (averaged == dict.end())
    fail("{} has no 'averaged_model_state': the hook had not made its averaged model yet (saved before its first "
         "eligible step, num_updates {}), so there is no average to import; start the EMA afresh; nothing was loaded",
         where, num_updates);
  if (!averaged->value().isGenericDict())
    fail("{}: 'averaged_model_state' must be a dict of tensors, got {}; nothing was loaded", where,
         python_value(averaged->value()));
  return averaged->value().toGenericDict();
}

EMAKIT_FUNC std::int64_t nvalchemi_step(const std::optional<std::int64_t>& step, std::int64_t num_updates,
                                        std::int64_t n_averaged, const std::string& path) {
  if (num_updates != n_averaged)
    fail("import_state: '{}': num_updates is {} but averaged_model_state's n_averaged is {}: an EMAHook updates both "
         "together, so the file was edited or mixes two states; nothing was loaded",
         path, num_updates, n_averaged);
  if (!step)
    fail("import_state: '{}': an nvalchemi EMAHook state holds no step, and the hook's update_every and start_step "
         "count the trainer's completed optimizer steps: pass the trainer's step_count when the state was saved, "
         "import_state(ema, Peer::nvalchemi_hook, path, {{.step = step_count}}); nothing was loaded",
         path);
  if (*step < 0) fail("import_state: '{}': ImportOptions::step must be >= 0, got {}; nothing was loaded", path, *step);
  return *step;
}

EMAKIT_FUNC void check_nvalchemi_updates(std::int64_t num_updates, std::int64_t updates, std::int64_t step,
                                         const std::string& path) {
  if (num_updates != updates)
    fail("import_state: '{}': num_updates is {} in the file, but this EMA's schedule makes {} updates in {} completed "
         "steps (ImportOptions::step): the step is not the trainer's step_count when the hook was saved, or the hook "
         "had other options; nothing was loaded",
         path, num_updates, updates, step);
}

// ---- diffusers EMAModel ------------------------------------------------------------------

// For each tensor, the index of the first one it is (a tied weight: one average under two names,
// head.weight IS emb.weight), or its own index. model.parameters() lists a tied Parameter once, so
// EMAModel's shadow_params hold it once: the list matches the distinct tensors.
EMAKIT_FUNC std::vector<std::size_t> first_of_each(const std::vector<at::Tensor>& tensors) {
  std::vector<std::size_t> first(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    first[i] = i;
    const at::Tensor& t = tensors[i];
    for (std::size_t j = 0; j < i; ++j) {
      const at::Tensor& u = tensors[j];
      if (first[j] == j &&
          (t.is_same(u) || (t.numel() > 0 && t.data_ptr() == u.data_ptr() && t.sizes().equals(u.sizes()) &&
                            t.strides().equals(u.strides()) && t.scalar_type() == u.scalar_type()))) {
        first[i] = j;
        break;
      }
    }
  }
  return first;
}

EMAKIT_FUNC c10::impl::GenericDict diffusers_dict(const StateDict& averages, const DiffusersConfig& config,
                                                  std::int64_t step) {
  // Values of type Any: doubles, ints and a bool pickle as Python float, int and bool. The list
  // is a generic one (element type Any): a list typed Tensor pickles as
  // torch.jit._pickle.build_tensorlist, a global torch.load(weights_only=True) refuses.
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("decay", config.decay);
  dict.insert("min_decay", config.min_decay);
  dict.insert("optimization_step", step);
  dict.insert("update_after_step", config.update_after_step);
  dict.insert("use_ema_warmup", config.use_ema_warmup);
  dict.insert("inv_gamma", config.inv_gamma);
  dict.insert("power", config.power);
  c10::impl::GenericList shadow(c10::AnyType::get());
  std::vector<at::Tensor> tensors;
  for (const auto& item : averages) tensors.push_back(item.value());
  const std::vector<std::size_t> first = first_of_each(tensors);
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (first[i] == i) shadow.push_back(tensors[i].detach().cpu().contiguous());  // a tied tensor once
  dict.insert("shadow_params", shadow);
  return dict;
}

// The value of `key` in an EMAModel dict, or throws naming it.
EMAKIT_FUNC const c10::IValue& diffusers_entry(const c10::impl::GenericDict& dict, const std::string& key,
                                               const std::string& path) {
  const auto it = dict.find(key);
  if (it == dict.end())
    fail("import_state: '{}' has no '{}': not a diffusers EMAModel state (save it with "
         "torch.save(ema.state_dict(), path)); nothing was loaded",
         path, key);
  return it->value();
}

EMAKIT_FUNC PeerFile read_diffusers_file(const c10::impl::GenericDict& dict, const std::string& path,
                                         const StateDict& state, const DiffusersConfig& config) {
  const std::string where = fmt::format("import_state: '{}'", path);
  const auto differs = [&](const std::string& field, const std::string& file, const std::string& ours,
                           std::string_view option) {
    fail("{}: config differs: {} is {} in the file, {} in this EMA ({}::{}); make the EMA with the file's "
         "EMAModel options; nothing was loaded",
         where, field, file, ours, config.policy, option);
  };
  // A Python float field may hold an int (EMAModel(decay=1)); an int field must hold an int.
  const auto number = [&](const std::string& key) {
    const c10::IValue& v = diffusers_entry(dict, key, path);
    if (v.isDouble()) return v.toDouble();
    if (v.isInt()) return static_cast<double>(v.toInt());
    fail("{}: '{}' must be a number, got {}; nothing was loaded", where, key, python_value(v));
  };
  const auto integer = [&](const std::string& key) {
    const c10::IValue& v = diffusers_entry(dict, key, path);
    if (!v.isInt()) fail("{}: '{}' must be an int, got {}; nothing was loaded", where, key, python_value(v));
    return v.toInt();
  };
  const c10::IValue& warmup = diffusers_entry(dict, "use_ema_warmup", path);
  if (!warmup.isBool())
    fail("{}: 'use_ema_warmup' must be a bool, got {}; nothing was loaded", where, python_value(warmup));
  if (warmup.toBool() != config.use_ema_warmup)
    differs("use_ema_warmup", python_value(warmup), config.use_ema_warmup ? "True" : "False",
            config.use_ema_warmup ? "warmup (made by diffusers_ema_model_warmup)"
                                  : "(made by diffusers_ema_model, no warmup)");
  const bool ramp = !config.use_ema_warmup;
  if (const double v = number("decay"); v != config.decay)
    differs("decay", fmt::format("{}", v), fmt::format("{}", config.decay), ramp ? "decay_max" : "beta");
  if (const double v = number("min_decay"); v != config.min_decay)
    differs("min_decay", fmt::format("{}", v), fmt::format("{}", config.min_decay), ramp ? "min_decay" : "min_value");
  if (const std::int64_t v = integer("update_after_step"); v != config.update_after_step)
    differs("update_after_step", fmt::format("{}", v), fmt::format("{}", config.update_after_step),
            "update_after_step");
  // inv_gamma and power shape the warmup only: EMAModel without it never reads them.
  const double inv_gamma = number("inv_gamma"), power = number("power");
  if (config.use_ema_warmup && inv_gamma != config.inv_gamma)
    differs("inv_gamma", fmt::format("{}", inv_gamma), fmt::format("{}", config.inv_gamma), "inv_gamma");
  if (config.use_ema_warmup && power != config.power)
    differs("power", fmt::format("{}", power), fmt::format("{}", config.power), "power");

  PeerFile f;
  f.step = integer("optimization_step");
  if (f.step < 0) fail("{}: optimization_step must be >= 0, got {}; nothing was loaded", where, f.step);
  f.initted = true;  // EMAModel holds its shadow params from construction on

  const c10::IValue& list = diffusers_entry(dict, "shadow_params", path);
  if (!list.isList()) fail("{}: 'shadow_params' must be a list of tensors, got {}", where, python_value(list));
  const auto shadow = list.toListRef();
  // This EMA's distinct averaged tensors, in its order; a tied name (`aliases`) takes the tensor of
  // the name it is tied to.
  std::vector<std::string> all_keys, keys;
  std::vector<at::Tensor> held;
  for (const auto& item : state) {
    if (!ema_state::is_average_key(item.key())) continue;
    all_keys.push_back(item.key());
    held.push_back(item.value());
  }
  const std::vector<std::size_t> first = first_of_each(held);
  std::vector<std::pair<std::string, std::size_t>> aliases;  // tied key, position in shadow_params
  std::vector<std::size_t> position(all_keys.size());
  for (std::size_t i = 0; i < all_keys.size(); ++i) {
    if (first[i] == i) {
      position[i] = keys.size();
      keys.push_back(all_keys[i]);
    } else {
      position[i] = position[first[i]];
      aliases.emplace_back(all_keys[i], position[i]);
    }
  }
  const std::string order =
      "shadow_params is matched by position to this EMA's averaged tensors, the model's parameters() order for "
      "diffusers_ema_model, as EMAModel(model.parameters()) holds them, a tied weight once";
  if (shadow.size() != keys.size())
    fail("{}: shadow_params holds {} tensors, this EMA averages {}{} ({}): a state of another model, or of "
         "EMAModel(...) given other parameters?; nothing was loaded",
         where, shadow.size(), keys.size(),
         aliases.empty()
             ? std::string()
             : fmt::format(" distinct ones (and {} tied name{})", aliases.size(), aliases.size() == 1 ? "" : "s"),
         order);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::string name = ema_state::average_name(keys[i]);
    if (!shadow[i].isTensor())
      fail("{}: shadow_params[{}] (matched to '{}') is {}, not a tensor; nothing was loaded", where, i, name,
           python_value(shadow[i]));
    const at::Tensor& t = shadow[i].toTensor();
    const at::Tensor& ours = *state.find(keys[i]);
    if (!t.sizes().equals(ours.sizes()))
      fail("{}: shadow_params[{}] (matched to '{}' by position) has shape {} in the file, {} in this EMA ({}); "
           "nothing was loaded",
           where, i, name, shape_string(t.sizes()), shape_string(ours.sizes()), order);
    if (t.scalar_type() != ours.scalar_type())
      fail("{}: shadow_params[{}] (matched to '{}' by position) has dtype {} in the file, {} in this EMA "
           "(EMAModel.to(dtype=...)?"
           "); nothing was loaded",
           where, i, name, c10::toString(t.scalar_type()), c10::toString(ours.scalar_type()));
  }
  for (const auto& item : state) {
    if (ema_state::is_average_key(item.key())) continue;
    if (item.key().rfind("counters.", 0) != 0) f.state.insert(item.key(), item.value());
  }
  for (std::size_t i = 0; i < keys.size(); ++i) f.state.insert(keys[i], shadow[i].toTensor());
  for (const auto& [key, i] : aliases) f.state.insert(key, shadow[i].toTensor());
  return f;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::interop
