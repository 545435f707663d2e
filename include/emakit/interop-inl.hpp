// The non-template definitions of interop.hpp: included at the end of interop.hpp in the all-inline mode
// (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp (detail/config.hpp).
// The helpers every peer uses, then one section per peer (its config, its file both ways), then the
// codec table (one codec per peer, in Peer's order) and the core of export_state and import_state.
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/interop-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/interop.hpp> instead"
#endif

#include <emakit/interop.hpp>

#include <emakit/detail/module_tensors.hpp>

#include <fmt/format.h>

#include <c10/util/Exception.h>

#include <ATen/core/List.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::interop {

// No anonymous namespace: the helpers below are EMAKIT_FUNC (external linkage unless EMAKIT_HEADER_ONLY).

// ---- what every peer uses -----------------------------------------------------------------

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
EMAKIT_FUNC std::string holds_instead(const c10::impl::GenericDict& dict, const Codec& peer,
                                      const std::vector<std::string>& missing, std::size_t matched) {
  for (const auto& name : missing)
    if (entry(dict, name) != nullptr)
      return fmt::format("it holds '{}' instead: saved from {}? Save the whole {} state ({})", name, peer.inner_call,
                         peer.name.substr(peer.name.find(' ') + 1), peer.save_call);
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

// The tensors of `dict` under this EMA's keys (prefix + name) as average.<name>, with the config
// entries of this EMA's own state: a file whose tensors are named as the model names them.
EMAKIT_FUNC PeerFile read_named(const ReadContext& in, const c10::impl::GenericDict& dict, std::string_view prefix) {
  PeerFile f;
  f.prefix = std::string(prefix);
  f.tensors = dict;
  for (const auto& item : in.state) {
    const std::string& key = item.key();
    if (ema_state::is_average_key(key)) {
      const at::Tensor* t = entry(dict, f.prefix + ema_state::average_name(key));
      if (t != nullptr) f.state.insert(key, *t);  // a missing one: peer_report names it
    } else if (!ema_state::is_counter_key(key)) {
      f.state.insert(key, item.value());
    }
  }
  return f;
}

// For a message on missing counters: when `dict` holds no key under the peer's prefix but one of
// this EMA's names without it, the peer's averaged model saved alone, and how to save the state.
EMAKIT_FUNC std::string inner_model_hint(const ReadContext& in, const c10::impl::GenericDict& dict) {
  if (holds_prefixed(dict, in.codec.prefix)) return {};
  const std::vector<std::string> names = average_names(in.state);
  const auto unprefixed =
      std::find_if(names.begin(), names.end(), [&](const auto& n) { return entry(dict, n) != nullptr; });
  if (unprefixed == names.end()) return {};
  return fmt::format(": its keys are the model's own ('{}'): saved from {}? Save {}", *unprefixed, in.codec.inner_call,
                     in.codec.save_call);
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

// `found` (this EMA's check of the file's tensors) in the peer's keys. Strict mode: throws when it
// is not clean, naming each key the file should hold and what it holds instead. Lenient: warns.
EMAKIT_FUNC LoadReport peer_report(const LoadReport& found, const PeerFile& file, const Codec& peer,
                                   const std::string& path, LoadMode mode) {
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
  std::string instead = missing.empty() ? std::string() : holds_instead(file.tensors, peer, missing, matched);
  if (!instead.empty()) instead.insert(0, "; ");
  if (mode == LoadMode::strict)
    fail("import_state: '{}' is not {} state of this EMA's model: {}{}; nothing was loaded", path, peer.name,
         fmt::join(parts, "; "), instead);
  TORCH_WARN("emakit: import_state: '", path, "': ", fmt::format("{}", fmt::join(parts, "; ")), instead,
             "; kept the current values of those");
  return report;
}

// For each key `found` lists as missing or mismatched, this EMA's current value (from `state`):
// what a lenient load keeps, so that the load itself is clean.
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

// The averages as a name -> tensor dict (CPU, contiguous), each name after `prefix`: what every
// export writes its tensors as.
EMAKIT_FUNC c10::impl::GenericDict tensor_dict(const StateDict& averages, std::string_view prefix = {}) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  for (const auto& item : averages)
    dict.insert(std::string(prefix) + item.key(), item.value().detach().cpu().contiguous());
  return dict;
}

// dict[key] of a peer's file, or an error naming the file, the key and how such a file is written.
EMAKIT_FUNC const c10::IValue& required_entry(const c10::impl::GenericDict& dict, const char* key,
                                              const std::string& where, const char* written_how) {
  const auto it = dict.find(key);
  if (it == dict.end()) fail("{} has no '{}': {}; nothing was loaded", where, key, written_how);
  return it->value();
}

// A file's value as Python writes it (True, 3, 0.5), or its kind, for messages.
EMAKIT_FUNC std::string python_value(const c10::IValue& v) {
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isInt()) return fmt::format("{}", v.toInt());
  if (v.isDouble()) return fmt::format("{}", v.toDouble());
  return fmt::format("a {}", v.tagKind());
}

// ---- ema-pytorch EMA: ema_model.<name>, step (update calls) and initted ---------------------

EMAKIT_FUNC c10::impl::GenericDict write_ema_pytorch(const Codec& self, const EmaBase& ema) {
  c10::impl::GenericDict dict = tensor_dict(ema.averages(), self.prefix);
  dict.insert("step", at::scalar_tensor(ema.step(), at::kLong));
  dict.insert("initted", at::scalar_tensor(ema.num_updates() > 0, at::kBool));
  return dict;
}

EMAKIT_FUNC PeerFile read_ema_pytorch(const ReadContext& in) {
  const at::Tensor* s = entry(in.file, "step");
  const at::Tensor* initted = entry(in.file, "initted");
  if (s != nullptr && initted != nullptr) {
    PeerFile f = read_named(in, in.file, in.codec.prefix);
    f.count = Count::recounted;
    const std::string where = fmt::format("import_state: '{}'", in.path);
    f.step = integer_value(*s, "step", where);
    if (f.step < 0) fail("{}: step must be >= 0, got {}", where, f.step);
    f.initted = number_value(*initted, "initted", where) != 0;
    return f;
  }
  fail("import_state: '{}' has no 'step' and 'initted': not an ema-pytorch EMA state{}", in.path,
       inner_model_hint(in, in.file));
}

// ---- timm ModelEmaV3: module.<name> (ema.state_dict()) or <name> (ema.module.state_dict()) --

EMAKIT_FUNC c10::impl::GenericDict write_timm(const Codec& self, const EmaBase& ema) {
  return tensor_dict(ema.averages(), self.prefix);
}

// timm's ModelEmaV3 has no counters (Count::kept): its own checkpoints hold ema.module.state_dict(),
// which is the whole state. The other peers' inner model lacks their counters: refused.
EMAKIT_FUNC PeerFile read_timm(const ReadContext& in) {
  const bool inner = !holds_prefixed(in.file, in.codec.prefix) && holds_unprefixed(in.file, average_names(in.state));
  return read_named(in, in.file, inner ? std::string_view() : in.codec.prefix);
}

// ---- torch AveragedModel: module.<name> and n_averaged (= num_updates) ---------------------

// The n_averaged of an AveragedModel's state_dict() (`inside`: where it is, for messages).
EMAKIT_FUNC std::int64_t read_n_averaged(const ReadContext& in, const c10::impl::GenericDict& dict,
                                         std::string_view inside) {
  const at::Tensor* n = entry(dict, "n_averaged");
  if (n == nullptr)
    fail("import_state: '{}' has no 'n_averaged'{}: not an AveragedModel state{}", in.path, inside,
         inner_model_hint(in, dict));
  const std::int64_t n_averaged = integer_value(*n, "n_averaged", fmt::format("import_state: '{}'", in.path));
  if (n_averaged < 0) fail("import_state: '{}': n_averaged must be >= 0, got {}", in.path, n_averaged);
  return n_averaged;
}

EMAKIT_FUNC c10::impl::GenericDict write_averaged_model(const Codec& self, const EmaBase& ema) {
  c10::impl::GenericDict dict = tensor_dict(ema.averages(), self.prefix);
  dict.insert("n_averaged", at::scalar_tensor(ema.num_updates(), at::kLong));
  return dict;
}

EMAKIT_FUNC PeerFile read_averaged_model(const ReadContext& in) {
  const std::int64_t n_averaged = read_n_averaged(in, in.file, "");
  PeerFile f = read_named(in, in.file, in.codec.prefix);
  f.count = Count::given;
  f.updates = n_averaged;
  return f;
}

// ---- diffusers EMAModel: shadow_params (a list, by position), optimization_step, the config ---

// The config a diffusers EMAModel writes in its state_dict(), as this EMA's decay holds it.
struct DiffusersConfig {
  double decay = 0.9999;
  double min_decay = 0.0;
  std::int64_t update_after_step = 0;
  bool use_ema_warmup = false;
  double inv_gamma = 1.0;    // only used (and checked) with use_ema_warmup
  double power = 2.0 / 3.0;  // only used (and checked) with use_ema_warmup
  std::string_view policy;   // "RationalRamp" or "InversePowerWarmup", for messages
};

// The config of an EMA made by diffusers_ema_model (RationalRamp) or diffusers_ema_model_warmup
// (InversePowerWarmup); throws for any other decay, which no EMAModel file describes.
EMAKIT_FUNC DiffusersConfig diffusers_config(const EmaBase& ema, const char* what) {
  if (const auto* d = ema.find_policy<RationalRamp>())
    return {d->decay_max(), d->min_decay(), d->update_after_step(), false, 1.0, 2.0 / 3.0, "RationalRamp"};
  if (const auto* d = ema.find_policy<InversePowerWarmup>()) {
    if (!d->warmup() || d->single_precision())
      fail("{}: Peer::diffusers with an InversePowerWarmup needs warmup(true) and single_precision(false), as "
           "diffusers_ema_model_warmup makes it (EMAModel(use_ema_warmup=True) computes the warmup in float64)",
           what);
    return {d->beta(), d->min_value(), d->update_after_step(), true, d->inv_gamma(), d->power(), "InversePowerWarmup"};
  }
  fail("{}: Peer::diffusers needs an EMA made by diffusers_ema_model (RationalRamp) or "
       "diffusers_ema_model_warmup (InversePowerWarmup): a diffusers EMAModel file describes no other decay",
       what);
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
  // A tied weight (one average under two names, head.weight IS emb.weight) once: model.parameters()
  // lists a tied Parameter once, so EMAModel's shadow_params hold the distinct tensors.
  const std::vector<std::size_t> first = first_same_view(tensors);
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (first[i] == i) shadow.push_back(tensors[i].detach().cpu().contiguous());
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

// What import_state takes from an EMAModel.state_dict() file: shadow_params matched by position to
// the averages of `state`, after the config is checked against `config`; `step`:
// optimization_step. Throws (nothing loaded) on a missing entry, a config that differs, a list of
// another length, or a tensor whose shape or dtype differs from the one at its position.
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
  f.tensors = dict;
  f.count = Count::recounted;
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
  const std::vector<std::size_t> first = first_same_view(held);
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
    if (!ema_state::is_counter_key(item.key())) f.state.insert(item.key(), item.value());
  }
  for (std::size_t i = 0; i < keys.size(); ++i) f.state.insert(keys[i], shadow[i].toTensor());
  for (const auto& [key, i] : aliases) f.state.insert(key, shadow[i].toTensor());
  return f;
}

EMAKIT_FUNC c10::impl::GenericDict write_diffusers(const Codec&, const EmaBase& ema) {
  return diffusers_dict(ema.averages(), diffusers_config(ema, "export_state"), ema.step());
}

EMAKIT_FUNC PeerFile read_diffusers(const ReadContext& in) {
  return read_diffusers_file(in.file, in.path, in.state, diffusers_config(in.ema, "import_state"));
}

// ---- luxonis-train EMACallback: ema_state_dict (<name>) and updates (= num_updates) ----------

// What EMACallback.state_dict() returns: {"ema_state_dict": the averages, "updates": a Python int
// (EMACallback ignores any other type)}.
EMAKIT_FUNC c10::impl::GenericDict luxonis_dict(const StateDict& averages, std::int64_t updates) {
  c10::impl::GenericDict outer(c10::StringType::get(), c10::AnyType::get());
  outer.insert("ema_state_dict", tensor_dict(averages));
  outer.insert("updates", updates);
  return outer;
}

// luxonis-train's EMACallback.state_dict(): {"ema_state_dict": {<name>: tensor}, "updates": int}.
// Returns the inner dict (where the tensors are) and sets `updates`; throws naming the file when
// either entry is absent or of another type.
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

EMAKIT_FUNC c10::impl::GenericDict write_luxonis(const Codec&, const EmaBase& ema) {
  return luxonis_dict(ema.averages(), ema.num_updates());
}

EMAKIT_FUNC PeerFile read_luxonis(const ReadContext& in) {
  std::int64_t updates = -1;
  const c10::impl::GenericDict inner = luxonis_tensors(in.file, in.path, updates);
  PeerFile f = read_named(in, inner, in.codec.prefix);
  f.count = Count::given;  // ModelEma: one update per call, its decay from `updates`
  f.updates = updates;
  return f;
}

// ---- Lightning EMAWeightAveraging: a checkpoint's state_dict, averaging_state, callbacks -----

// The counters of a Lightning checkpoint written with EMAWeightAveraging.
struct LightningCounters {
  std::int64_t global_step = -1;
  std::int64_t n_averaged = -1;
  std::int64_t latest_update_step = -1;  // -1: the file holds no callback entry
};

// A Lightning checkpoint: returns its state_dict (the averages) and sets `counters`; throws naming
// the file and the key when state_dict, averaging_state (a checkpoint saved without
// EMAWeightAveraging), its n_averaged or global_step is absent or of another type.
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
// Throws (nothing loaded) when the file's n_averaged or latest_update_step differ from the
// `updates` and `last` update step this EMA's schedule gives over global_step steps.
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

// The entries of a Lightning checkpoint EMAWeightAveraging's on_load_checkpoint reads from the
// callback's side: state_dict, averaging_state {n_averaged}, callbacks {EMAWeightAveraging:
// {latest_update_step}}, and global_step.
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

EMAKIT_FUNC c10::impl::GenericDict write_lightning(const Codec&, const EmaBase& ema) {
  return lightning_dict(ema.averages(), ema.step(), ema.num_updates(), ema.last_update_step());
}

EMAKIT_FUNC PeerFile read_lightning(const ReadContext& in) {
  LightningCounters counters;
  const c10::impl::GenericDict inner = lightning_tensors(in.file, in.path, counters);
  PeerFile f = read_named(in, inner, in.codec.prefix);
  f.count = Count::recounted;
  f.step = counters.global_step;
  f.initted = true;
  f.updates = counters.n_averaged;
  f.last_update_step = counters.latest_update_step;
  return f;
}

EMAKIT_FUNC void check_lightning(const PeerFile& file, std::int64_t updates, std::int64_t last,
                                 const std::string& path) {
  check_lightning_counters(
      {.global_step = file.step, .n_averaged = file.updates, .latest_update_step = file.last_update_step}, updates,
      last, path);
}

// ---- nvalchemi EMAHook: its config, num_updates, averaged_model_state (module.<name>) -------

// The config an nvalchemi EMAHook writes in its state_dict(), as this EMA holds it.
struct NvalchemiConfig {
  double decay = 0.999;
  std::int64_t update_every = 1;
  std::int64_t start_step = 0;
  bool use_buffers = true;
};

// The config of an EMA made by nvalchemi_ema (Fixed decay, StepSchedule skip_before_start with
// every_offset 0 and no accumulation, buffers averaged or copied); throws for any other EMA, which
// no EMAHook file describes.
EMAKIT_FUNC NvalchemiConfig nvalchemi_config(const EmaBase& ema, const char* what) {
  const auto refuse = [&](std::string_view why) {
    fail("{}: Peer::nvalchemi_hook needs an EMA made by nvalchemi_ema (an EMAHook's AveragedModel EMA): {}", what, why);
  };
  const auto* fixed = ema.find_policy<Fixed>();
  const auto* schedule = ema.find_policy<StepSchedule>();
  if (fixed == nullptr || schedule == nullptr)
    refuse("this EMA's decay or schedule is another policy (EMAHook's is Fixed with a StepSchedule)");
  const StepSchedule& s = *schedule;
  if (s.warmup() != Warmup::skip_before_start || s.every_offset() != 0 || s.accumulate() != 1)
    refuse(fmt::format("its StepSchedule has warmup {}, every_offset {}, accumulate {} (EMAHook: skip_before_start, "
                       "0, 1)",
                       static_cast<int>(s.warmup()), s.every_offset(), s.accumulate()));
  const TensorMode buffers = ema.options().buffers();
  if (buffers != TensorMode::average && buffers != TensorMode::copy)
    refuse("its buffers are ignored (EMAHook's AveragedModel averages them, use_buffers=True, or keeps them, False)");
  return {fixed->beta(), s.update_every(), s.start_step(), buffers == TensorMode::average};
}

// EMAHook.state_dict()'s dict without model_key: the config as Python float, ints and a bool,
// num_updates a Python int, averaged_model_state the averages as <prefix><name> with n_averaged
// (AveragedModel's long tensor, = num_updates).
EMAKIT_FUNC c10::impl::GenericDict nvalchemi_dict(const StateDict& averages, std::string_view prefix,
                                                  const NvalchemiConfig& config, std::int64_t num_updates) {
  // Values of type Any: a double, ints and a bool pickle as Python float, int and bool, what
  // EMAHook's pydantic fields compare equal to in its load_state_dict.
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("decay", config.decay);
  dict.insert("update_every", config.update_every);
  dict.insert("start_step", config.start_step);
  dict.insert("use_buffers", config.use_buffers);
  dict.insert("num_updates", num_updates);
  c10::impl::GenericDict averaged = tensor_dict(averages, prefix);
  averaged.insert("n_averaged", at::scalar_tensor(num_updates, at::kLong));  // AveragedModel's long buffer
  dict.insert("averaged_model_state", averaged);
  return dict;
}
// An EMAHook.state_dict() file: checks its config against `config` and returns its
// averaged_model_state (where the tensors are), setting `num_updates`; throws (nothing loaded) on
// a missing or mistyped entry, a config that differs, or a state saved before the hook's first
// update.
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
// The step import_state gives an EMAHook file: `step`, which must be given and >= 0; throws
// (nothing loaded) without it, or when the file's num_updates differs from its n_averaged.
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
// Throws (nothing loaded) when this EMA's schedule makes `updates` != num_updates updates over
// `step` completed steps.
EMAKIT_FUNC void check_nvalchemi_updates(std::int64_t num_updates, std::int64_t updates, std::int64_t step,
                                         const std::string& path) {
  if (num_updates != updates)
    fail("import_state: '{}': num_updates is {} in the file, but this EMA's schedule makes {} updates in {} completed "
         "steps (ImportOptions::step): the step is not the trainer's step_count when the hook was saved, or the hook "
         "had other options; nothing was loaded",
         path, num_updates, updates, step);
}

EMAKIT_FUNC c10::impl::GenericDict write_nvalchemi(const Codec& self, const EmaBase& ema) {
  return nvalchemi_dict(ema.averages(), self.prefix, nvalchemi_config(ema, "export_state"), ema.num_updates());
}

EMAKIT_FUNC PeerFile read_nvalchemi(const ReadContext& in) {
  std::int64_t num_updates = -1;
  const c10::impl::GenericDict inner =
      nvalchemi_tensors(in.file, in.path, nvalchemi_config(in.ema, "import_state"), num_updates);
  const std::int64_t n_averaged = read_n_averaged(in, inner, " in averaged_model_state");
  PeerFile f = read_named(in, inner, in.codec.prefix);
  f.count = Count::recounted;
  f.step = nvalchemi_step(in.step, num_updates, n_averaged, in.path);
  f.initted = true;
  f.updates = num_updates;
  return f;
}

EMAKIT_FUNC void check_nvalchemi(const PeerFile& file, std::int64_t updates, std::int64_t, const std::string& path) {
  check_nvalchemi_updates(file.updates, updates, file.step, path);
}

// ---- the codecs: one per peer, in Peer's order ----------------------------------------------

// One codec a block (clang-format would give each field a line).
// clang-format off
inline constexpr Codec codecs[] = {
    {.peer = Peer::ema_pytorch, .id = "ema_pytorch", .prefix = "ema_model.", .name = "an ema-pytorch EMA",
     .save_call = "torch.save(ema.state_dict(), path)", .inner_call = "ema.ema_model.state_dict()",
     .write = write_ema_pytorch, .read = read_ema_pytorch},
    {.peer = Peer::timm_v3, .id = "timm_v3", .prefix = "module.", .name = "a timm ModelEmaV3",
     .save_call = "torch.save(ema.state_dict(), path)", .inner_call = "ema.module.state_dict()",
     .write = write_timm, .read = read_timm},
    {.peer = Peer::averaged_model, .id = "averaged_model", .prefix = "module.", .name = "a torch AveragedModel",
     .save_call = "torch.save(averaged_model.state_dict(), path)", .inner_call = "averaged_model.module.state_dict()",
     .write = write_averaged_model, .read = read_averaged_model},
    {.peer = Peer::diffusers, .id = "diffusers", .prefix = "", .name = "a diffusers EMAModel",
     .save_call = "torch.save(ema.state_dict(), path)", .inner_call = "ema.shadow_params",
     .write = write_diffusers, .read = read_diffusers},
    {.peer = Peer::luxonis_callback, .id = "luxonis_callback", .prefix = "", .name = "a luxonis-train EMACallback",
     .save_call = "torch.save(callback.state_dict(), path)", .inner_call = "callback.ema.state_dict_ema",
     .write = write_luxonis, .read = read_luxonis},
    {.peer = Peer::lightning, .id = "lightning", .prefix = "", .name = "a Lightning EMAWeightAveraging checkpoint",
     .save_call = "trainer.save_checkpoint(path)", .inner_call = "the model's own state_dict()",
     .write = write_lightning, .read = read_lightning, .check = check_lightning},
    {.peer = Peer::nvalchemi_hook, .id = "nvalchemi_hook", .prefix = "module.", .name = "an nvalchemi EMAHook",
     .save_call = "torch.save(hook.state_dict(), path)", .inner_call = "hook.get_averaged_model().state_dict()",
     .takes_step = true, .write = write_nvalchemi, .read = read_nvalchemi, .check = check_nvalchemi},
};
// clang-format on

// codec() finds a codec by its position: each one sits at its Peer's value.
constexpr bool codecs_in_peer_order() {
  for (std::size_t i = 0; i < std::size(codecs); ++i)
    if (static_cast<std::size_t>(codecs[i].peer) != i) return false;
  return true;
}
static_assert(codecs_in_peer_order(), "interop: the codecs must be listed in Peer's order, one per enumerator");

EMAKIT_FUNC const Codec& codec(Peer peer) {
  const auto i = static_cast<std::size_t>(peer);
  if (i >= std::size(codecs)) {
    std::vector<std::string> known;
    for (const Codec& c : codecs) known.push_back(fmt::format("Peer::{} ({})", c.id, static_cast<int>(c.peer)));
    fail("interop: unknown Peer value {}; emakit has a codec for {}", i, fmt::join(known, ", "));
  }
  return codecs[i];
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::interop

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// ---- the core of export_state and import_state ----------------------------------------------

EMAKIT_FUNC void export_state(const EmaBase& ema, Peer peer, const std::filesystem::path& path) {
  using namespace detail;
  using namespace detail::interop;
  const Codec& c = codec(peer);
  write_tensor_dict(path, c.write(c, ema));  // atomic, untagged: torch.load(weights_only=True) reads it
}

EMAKIT_FUNC LoadReport import_state(EmaBase& ema, Peer peer, const std::filesystem::path& file,
                                    const ImportOptions& options) {
  using namespace detail;
  using namespace detail::interop;
  const auto file_dict = read_pickle_dict(file, "import_state");
  const std::string path = file.string();  // for messages
  const Codec& c = codec(peer);
  if (options.step && !c.takes_step) {
    std::vector<std::string> takers;
    for (const Codec& taker : codecs)
      if (taker.takes_step) takers.push_back(fmt::format("Peer::{}", taker.id));
    fail("import_state: ImportOptions::step ({}) is for {}, whose file holds no step; {} file holds its own counters",
         *options.step, fmt::join(takers, ", "), c.name);
  }
  const StateDict own = ema.state_dict();  // this EMA's config, counters and keys
  PeerFile f = c.read({c, file_dict, path, own, ema, options.step});
  std::int64_t step = ema.step(), updates = ema.num_updates(), last = ema.last_update_step();
  if (f.count == Count::given) {
    updates = f.updates;
    step = last = updates;  // one update per call (luxonis-train's ModelEma: its decay from `updates`)
  } else if (f.count == Count::recounted) {
    step = f.step;
    updates = 0;
    last = 0;
    if (f.initted) {
      // Recount what the schedule did over `step` calls (ema-pytorch's and diffusers' calls are
      // never vetoed; a vetoed batch completes no step of nvalchemi's trainer).
      for (std::int64_t call = 1, previous = 0; call <= step; ++call) {
        const Decision d = detail::EmaAccess::decide(ema, {call, std::nullopt, previous, updates, false});
        previous = d.step;
        if (d.action != Action::skipped) {
          ++updates;
          last = d.step;
        }
      }
    }
    if (c.check != nullptr) c.check(f, updates, last, path);
  }
  StateDict& out = f.state;
  detail::ema_state::write_counters(
      out, {.calls = step, .step = step, .num_updates = updates, .last_update_step = last, .last_decay = ema.decay()});
  const LoadReport found = ema.check_state_dict(out, LoadMode::lenient);
  LoadReport report = peer_report(found, f, c, path, options.mode);
  if (!found.clean()) keep_current(out, found, own);
  ema.load_state_dict(out, options.mode);
  return report;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
