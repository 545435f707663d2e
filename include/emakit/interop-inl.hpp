// The non-template definitions of interop.hpp: included at the end of interop.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp). The helpers every peer uses, then one section per peer (its config, its file
// both ways), then the codec table (one codec per peer, in Peer's order) and the core of
// export_state and import_state.
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
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::interop {

// No anonymous namespace: the helpers below are EMAKIT_FUNC (external linkage unless
// EMAKIT_HEADER_ONLY).

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

// For the refusal of a file that lacks an entry: when `dict` holds no key under the peer's prefix
// but one of this EMA's names without it, the file is the peer's averaged model saved alone; says
// so and how to save the state.
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

// A value of a peer's file as Python's repr writes it (True, 3, 0.5, 'text', None), or what it is
// (a list of 3, a dict of 2 entries, a Long tensor of shape [3]), for messages.
EMAKIT_FUNC std::string python_value(const c10::IValue& v) {
  if (v.isNone()) return "None";
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isInt()) return fmt::format("{}", v.toInt());
  if (v.isDouble()) {
    std::string text = fmt::format("{}", v.toDouble());
    if (text.find_first_of(".en") == std::string::npos) text += ".0";  // Python's 1.0 (fmt writes 1); inf, nan, 1e+20
    return text;
  }
  if (v.isString()) {
    constexpr std::size_t shown = 40;
    const std::string& text = v.toStringRef();
    return text.size() <= shown ? fmt::format("'{}'", text) : fmt::format("'{}...'", text.substr(0, shown));
  }
  if (v.isTensor())
    return fmt::format("a {} tensor of shape {}", c10::toString(v.toTensor().scalar_type()),
                       shape_string(v.toTensor().sizes()));
  if (v.isList()) return fmt::format("a list of {}", v.toListRef().size());
  if (v.isTuple()) return fmt::format("a tuple of {}", v.toTuple()->elements().size());
  if (v.isGenericDict()) return fmt::format("a dict of {} entries", v.toGenericDict().size());
  return fmt::format("a {}", v.tagKind());
}

// Typed reads from a peer's torch.save dict, or from a dict inside it: the twin of StateReader
// (detail/serial/state_reader.hpp) for the files of Python peers. Every refusal of a peer's file
// is made here, led by "import_state: '<path>'" and ended by "; nothing was loaded". An entry is
// named as Python indexes it ('step', averaging_state['n_averaged']); a missing one with what the
// file then is not, and how the peer saves the file it should be.
//
//   const PeerDict file(in);                                  // import_state makes it, a codec reads it
//   file.require({"step", "initted"});                        // "... has no 'step' and 'initted': ..."
//   f.step = file.integer("optimization_step", 0);            // a Python int >= 0
//   const PeerDict averaging = file.dict("averaging_state");  // its misses: "has no ... in averaging_state"
//   f.updates = averaging.integer_tensor("n_averaged", 0);    // a tensor of one integer >= 0
//   file.same("decay", file.number("decay"), beta, "Fixed::beta");  // else "config differs: decay is ..."
class PeerDict {
 public:
  explicit PeerDict(const ReadContext& in) : in_(in), dict_(in.file) {}

  const c10::impl::GenericDict& raw() const { return dict_; }
  const std::string& inside() const { return inside_; }  // empty: the file itself
  const Codec& codec() const { return in_.codec; }

  const c10::IValue* find(std::string_view key) const {
    const auto it = dict_.find(std::string(key));
    return it == dict_.end() ? nullptr : &it->value();
  }

  // Refuses the file unless it holds every one of `keys`, naming each it lacks.
  void require(std::initializer_list<std::string_view> keys) const {
    std::vector<std::string> missing;
    for (const std::string_view key : keys)
      if (find(key) == nullptr) missing.push_back(fmt::format("'{}'", key));
    if (missing.empty()) return;
    const std::string last = missing.back();
    missing.pop_back();
    refuse_file("has no {}{}{}{}: {}", fmt::join(missing, ", "), missing.empty() ? "" : " and ", last,
                inside_.empty() ? std::string() : " in " + inside_, not_the_file());
  }

  const c10::IValue& value(std::string_view key) const {
    const c10::IValue* v = find(key);
    if (v == nullptr) require({key});  // refuses
    return *v;
  }

  // A Python int, >= `min` when given.
  std::int64_t integer(std::string_view key, std::optional<std::int64_t> min = std::nullopt) const {
    const c10::IValue& v = value(key);
    if (!v.isInt()) refuse("{} must be an int, got {}", name(key), python_value(v));
    return at_least(key, v.toInt(), min);
  }

  // A tensor of one integer (an integer or bool dtype), >= `min` when given.
  std::int64_t integer_tensor(std::string_view key, std::optional<std::int64_t> min = std::nullopt) const {
    const at::Tensor& t = tensor(key);
    if (!holds_one_integer(t)) refuse("{} must be one integer, got {}", name(key), python_value(t));
    return at_least(key, t.item<std::int64_t>(), min);
  }

  // A Python float, or an int (EMAModel(decay=1) keeps the int).
  double number(std::string_view key) const {
    const c10::IValue& v = value(key);
    if (v.isDouble()) return v.toDouble();
    if (v.isInt()) return static_cast<double>(v.toInt());
    refuse("{} must be a number, got {}", name(key), python_value(v));
  }

  // A tensor of one real number (any real dtype: ema-pytorch's initted is a bool tensor).
  double number_tensor(std::string_view key) const {
    const at::Tensor& t = tensor(key);
    if (!holds_one_number(t)) refuse("{} must be one number, got {}", name(key), python_value(t));
    return t.item<double>();
  }

  bool boolean(std::string_view key) const {
    const c10::IValue& v = value(key);
    if (!v.isBool()) refuse("{} must be a bool, got {}", name(key), python_value(v));
    return v.toBool();
  }

  const at::Tensor& tensor(std::string_view key) const {
    const c10::IValue& v = value(key);
    if (!v.isTensor()) refuse("{} must be a tensor, got {}", name(key), python_value(v));
    return v.toTensor();
  }

  c10::ArrayRef<c10::IValue> list(std::string_view key) const {
    const c10::IValue& v = value(key);
    if (!v.isList()) refuse("{} must be a list, got {}", name(key), python_value(v));
    return v.toListRef();
  }

  // The dict at `key`, read as this one: its messages name it (averaging_state['n_averaged']).
  PeerDict dict(std::string_view key) const {
    const c10::IValue& v = value(key);
    if (!v.isGenericDict()) refuse("{} must be a dict, got {}", name(key), python_value(v));
    return PeerDict(in_, v.toGenericDict(), inside_.empty() ? std::string(key) : name(key));
  }
  std::optional<PeerDict> optional_dict(std::string_view key) const {
    if (find(key) == nullptr) return std::nullopt;
    return dict(key);
  }

  // A config entry of the file (`in_file`) equals this EMA's (`ours`, from its `option`), or the
  // file is refused naming the field, both values and the preset that makes an EMA of the file's.
  void same(std::string_view field, double in_file, double ours, std::string_view option) const {
    if (in_file != ours) differs(field, python_value(in_file), python_value(ours), option);
  }
  void same(std::string_view field, std::int64_t in_file, std::int64_t ours, std::string_view option) const {
    if (in_file != ours) differs(field, python_value(in_file), python_value(ours), option);
  }
  void same(std::string_view field, bool in_file, bool ours, std::string_view option) const {
    if (in_file != ours) differs(field, python_value(in_file), python_value(ours), option);
  }

  // "import_state: '<path>': <what>; nothing was loaded"
  template <class... Args>
  [[noreturn]] void refuse(MessageFormat<Args...> what, Args&&... args) const {
    refuse_text(": " + fmt::vformat(what, fmt::make_format_args(args...)));
  }
  // "import_state: '<path>' <what>; nothing was loaded", where `what` says what the file is not,
  // or has not: "is not ...", "has no ..."
  template <class... Args>
  [[noreturn]] void refuse_file(MessageFormat<Args...> what, Args&&... args) const {
    refuse_text(" " + fmt::vformat(what, fmt::make_format_args(args...)));
  }
  // A lenient import's warning: "emakit: import_state: '<path>': <what>".
  void warn(const std::string& what) const { TORCH_WARN("emakit: ", lead(), ": ", what); }

 private:
  PeerDict(const ReadContext& in, c10::impl::GenericDict dict, std::string inside)
      : in_(in), dict_(std::move(dict)), inside_(std::move(inside)) {}

  std::string lead() const { return fmt::format("import_state: '{}'", in_.path); }
  [[noreturn]] void refuse_text(const std::string& what) const { fail("{}{}; nothing was loaded", lead(), what); }

  std::string name(std::string_view key) const {
    return inside_.empty() ? fmt::format("'{}'", key) : fmt::format("{}['{}']", inside_, key);
  }
  std::int64_t at_least(std::string_view key, std::int64_t v, std::optional<std::int64_t> min) const {
    if (min && v < *min) refuse("{} must be >= {}, got {}", name(key), *min, v);
    return v;
  }
  // What a file that lacks an entry is not: the peer's state (and how to save it), or its
  // averaged model saved alone.
  std::string not_the_file() const {
    const std::string hint = inner_model_hint(in_, dict_);
    return fmt::format("not {} state{}", in_.codec.name,
                       hint.empty() ? fmt::format(" (save it with {})", in_.codec.save_call) : hint);
  }
  [[noreturn]] void differs(std::string_view field, const std::string& in_file, const std::string& ours,
                            std::string_view option) const {
    refuse("config differs: {} is {} in the file, {} in this EMA ({}); make the EMA with the file's options ({})",
           field, in_file, ours, option, in_.codec.preset);
  }

  const ReadContext& in_;
  c10::impl::GenericDict dict_;
  std::string inside_;  // empty: the file itself; else how Python indexes this dict in it
};

// The tensors of `tensors` (the file, or a dict in it) under this EMA's keys (prefix + name) as
// average.<name>, with the config entries of this EMA's own state: a file whose tensors are named
// as the model names them.
EMAKIT_FUNC PeerFile read_named(const ReadContext& in, const PeerDict& tensors, std::string_view prefix) {
  PeerFile f;
  f.prefix = std::string(prefix);
  f.tensors = tensors.raw();
  f.inside = tensors.inside();
  for (const auto& item : in.state) {
    const std::string& key = item.key();
    if (ema_state::is_average_key(key)) {
      const at::Tensor* t = entry(f.tensors, f.prefix + ema_state::average_name(key));
      if (t != nullptr) f.state.insert(key, *t);  // a missing one: peer_report names it
    } else if (!ema_state::is_counter_key(key)) {
      f.state.insert(key, item.value());
    }
  }
  return f;
}

// `found` (this EMA's check of the file's tensors) in the peer's keys. Strict mode: refuses when it
// is not clean, naming each key the file should hold and what it holds instead. Lenient: warns.
EMAKIT_FUNC LoadReport peer_report(const LoadReport& found, const PeerFile& f, const PeerDict& file, LoadMode mode) {
  LoadReport report;
  for (const auto& k : found.missing) report.missing.push_back(to_peer_key(k, f.prefix));
  for (const auto& k : found.unexpected) report.unexpected.push_back(to_peer_key(k, f.prefix));
  for (const auto& k : found.mismatched) report.mismatched.push_back(to_peer_key(k, f.prefix));
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
  for (const auto& item : f.state) matched += ema_state::is_average_key(item.key()) ? 1 : 0;
  std::string instead = missing.empty() ? std::string() : holds_instead(f.tensors, file.codec(), missing, matched);
  if (!instead.empty()) instead.insert(0, "; ");
  const std::string where = f.inside.empty() ? std::string() : fmt::format("in {}, ", f.inside);
  if (mode == LoadMode::strict)
    file.refuse_file("is not {} state of this EMA's model: {}{}{}", file.codec().name, where, fmt::join(parts, "; "),
                     instead);
  file.warn(fmt::format("{}{}{}; kept the current values of those", where, fmt::join(parts, "; "), instead));
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

// ---- ema-pytorch EMA: ema_model.<name>, step (update calls) and initted ---------------------

EMAKIT_FUNC c10::impl::GenericDict write_ema_pytorch(const Codec& self, const EmaBase& ema) {
  c10::impl::GenericDict dict = tensor_dict(ema.averages(), self.prefix);
  dict.insert("step", at::scalar_tensor(ema.step(), at::kLong));
  dict.insert("initted", at::scalar_tensor(ema.num_updates() > 0, at::kBool));
  return dict;
}

EMAKIT_FUNC PeerFile read_ema_pytorch(const ReadContext& in, const PeerDict& file) {
  file.require({"step", "initted"});
  PeerFile f = read_named(in, file, in.codec.prefix);
  f.count = Count::recounted;
  f.step = file.integer_tensor("step", 0);
  f.initted = file.number_tensor("initted") != 0;
  return f;
}

// ---- timm ModelEmaV3: module.<name> (ema.state_dict()) or <name> (ema.module.state_dict()) --

EMAKIT_FUNC c10::impl::GenericDict write_timm(const Codec& self, const EmaBase& ema) {
  return tensor_dict(ema.averages(), self.prefix);
}

// timm's ModelEmaV3 has no counters (Count::kept): its own checkpoints hold
// ema.module.state_dict(), which is the whole state. The other peers' inner model lacks
// their counters: refused.
EMAKIT_FUNC PeerFile read_timm(const ReadContext& in, const PeerDict& file) {
  const bool inner =
      !holds_prefixed(file.raw(), in.codec.prefix) && holds_unprefixed(file.raw(), average_names(in.state));
  return read_named(in, file, inner ? std::string_view() : in.codec.prefix);
}

// ---- torch AveragedModel: module.<name> and n_averaged (= num_updates) ---------------------

EMAKIT_FUNC c10::impl::GenericDict write_averaged_model(const Codec& self, const EmaBase& ema) {
  c10::impl::GenericDict dict = tensor_dict(ema.averages(), self.prefix);
  dict.insert("n_averaged", at::scalar_tensor(ema.num_updates(), at::kLong));
  return dict;
}

EMAKIT_FUNC PeerFile read_averaged_model(const ReadContext& in, const PeerDict& file) {
  PeerFile f = read_named(in, file, in.codec.prefix);
  f.count = Count::given;
  f.updates = file.integer_tensor("n_averaged", 0);
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

// The config entries of an EMAModel file: each must equal this EMA's (`config`).
EMAKIT_FUNC void check_diffusers_config(const PeerDict& file, const DiffusersConfig& config) {
  const auto option = [&](std::string_view name) { return fmt::format("{}::{}", config.policy, name); };
  file.same("use_ema_warmup", file.boolean("use_ema_warmup"), config.use_ema_warmup,
            config.use_ema_warmup ? "InversePowerWarmup, made by diffusers_ema_model_warmup"
                                  : "RationalRamp, made by diffusers_ema_model: no warmup");
  const bool ramp = !config.use_ema_warmup;
  file.same("decay", file.number("decay"), config.decay, option(ramp ? "decay_max" : "beta"));
  file.same("min_decay", file.number("min_decay"), config.min_decay, option(ramp ? "min_decay" : "min_value"));
  file.same("update_after_step", file.integer("update_after_step"), config.update_after_step,
            option("update_after_step"));
  // inv_gamma and power shape the warmup only: EMAModel without it never reads them.
  const double inv_gamma = file.number("inv_gamma"), power = file.number("power");
  if (!config.use_ema_warmup) return;
  file.same("inv_gamma", inv_gamma, config.inv_gamma, option("inv_gamma"));
  file.same("power", power, config.power, option("power"));
}

// This EMA's averages as shadow_params lists them: its distinct averaged tensors in its order
// (`keys`), and each tied name (`aliases`) with the position of the tensor it is tied to.
struct ShadowOrder {
  std::vector<std::string> keys;
  std::vector<std::pair<std::string, std::size_t>> aliases;
};

EMAKIT_FUNC ShadowOrder shadow_order(const StateDict& state) {
  std::vector<std::string> all_keys;
  std::vector<at::Tensor> held;
  for (const auto& item : state) {
    if (!ema_state::is_average_key(item.key())) continue;
    all_keys.push_back(item.key());
    held.push_back(item.value());
  }
  const std::vector<std::size_t> first = first_same_view(held);
  ShadowOrder order;
  std::vector<std::size_t> position(all_keys.size());
  for (std::size_t i = 0; i < all_keys.size(); ++i) {
    if (first[i] == i) {
      position[i] = order.keys.size();
      order.keys.push_back(all_keys[i]);
    } else {
      position[i] = position[first[i]];
      order.aliases.emplace_back(all_keys[i], position[i]);
    }
  }
  return order;
}

// The file's shadow_params: one tensor per distinct average of `state`, each of its shape and
// dtype, or the file is refused naming the position, the name it was matched to and both.
EMAKIT_FUNC c10::ArrayRef<c10::IValue> read_shadow_params(const PeerDict& file, const StateDict& state,
                                                          const ShadowOrder& order) {
  const auto shadow = file.list("shadow_params");
  const std::string_view by_position =
      "shadow_params is matched by position to this EMA's averaged tensors, the model's parameters() order for "
      "diffusers_ema_model, as EMAModel(model.parameters()) holds them, a tied weight once";
  const std::size_t tied = order.aliases.size();
  if (shadow.size() != order.keys.size())
    file.refuse(
        "shadow_params holds {} tensors, this EMA averages {}{} ({}): a state of another model, or of "
        "EMAModel(...) given other parameters?",
        shadow.size(), order.keys.size(),
        tied == 0 ? std::string() : fmt::format(" distinct ones (and {} tied name{})", tied, tied == 1 ? "" : "s"),
        by_position);
  for (std::size_t i = 0; i < order.keys.size(); ++i) {
    const std::string name = ema_state::average_name(order.keys[i]);
    if (!shadow[i].isTensor())
      file.refuse("shadow_params[{}] (matched to '{}') is {}, not a tensor", i, name, python_value(shadow[i]));
    const at::Tensor& t = shadow[i].toTensor();
    const at::Tensor& ours = *state.find(order.keys[i]);
    if (!t.sizes().equals(ours.sizes()))
      file.refuse("shadow_params[{}] (matched to '{}' by position) has shape {} in the file, {} in this EMA ({})", i,
                  name, shape_string(t.sizes()), shape_string(ours.sizes()), by_position);
    if (t.scalar_type() != ours.scalar_type())
      file.refuse("shadow_params[{}] (matched to '{}' by position) has dtype {} in the file, {} in this EMA "
                  "(EMAModel.to(dtype=...)?)",
                  i, name, c10::toString(t.scalar_type()), c10::toString(ours.scalar_type()));
  }
  return shadow;
}

EMAKIT_FUNC c10::impl::GenericDict write_diffusers(const Codec&, const EmaBase& ema) {
  return diffusers_dict(ema.averages(), diffusers_config(ema, "export_state"), ema.step());
}

// What import_state takes from an EMAModel.state_dict() file: the config checked against this
// EMA's decay, optimization_step as the step, shadow_params matched by position to its averages.
EMAKIT_FUNC PeerFile read_diffusers(const ReadContext& in, const PeerDict& file) {
  check_diffusers_config(file, diffusers_config(in.ema, "import_state"));
  PeerFile f;
  f.tensors = file.raw();
  f.count = Count::recounted;
  f.step = file.integer("optimization_step", 0);
  f.initted = true;  // EMAModel holds its shadow params from construction on
  const ShadowOrder order = shadow_order(in.state);
  const auto shadow = read_shadow_params(file, in.state, order);
  for (const auto& item : in.state)
    if (!ema_state::is_average_key(item.key()) && !ema_state::is_counter_key(item.key()))
      f.state.insert(item.key(), item.value());
  for (std::size_t i = 0; i < order.keys.size(); ++i) f.state.insert(order.keys[i], shadow[i].toTensor());
  for (const auto& [key, i] : order.aliases) f.state.insert(key, shadow[i].toTensor());
  return f;
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

EMAKIT_FUNC c10::impl::GenericDict write_luxonis(const Codec&, const EmaBase& ema) {
  return luxonis_dict(ema.averages(), ema.num_updates());
}

// EMACallback.state_dict(): {"ema_state_dict": {<name>: tensor}, "updates": int}; an updates
// tensor (of one integer) is read too.
EMAKIT_FUNC PeerFile read_luxonis(const ReadContext& in, const PeerDict& file) {
  file.require({"ema_state_dict", "updates"});
  const PeerDict tensors = file.dict("ema_state_dict");
  PeerFile f = read_named(in, tensors, in.codec.prefix);
  f.count = Count::given;  // ModelEma: one update per call, its decay from `updates`
  f.updates = file.value("updates").isTensor() ? file.integer_tensor("updates", 0) : file.integer("updates", 0);
  return f;
}

// ---- Lightning EMAWeightAveraging: a checkpoint's state_dict, averaging_state, callbacks -----

// Throws (nothing loaded) when the file's n_averaged or latest_update_step differ from the
// `updates` and `last` update step this EMA's schedule gives over global_step steps.
EMAKIT_FUNC void check_lightning(const PeerFile& found, std::int64_t updates, std::int64_t last, const PeerDict& file) {
  const std::string_view options =
      "made with other EMAWeightAveraging options (update_every_n_steps, update_starting_at_step) than this EMA's, or "
      "by a callback that also updated at epoch ends (update_starting_at_epoch)?";
  if (found.updates != updates)
    file.refuse("n_averaged is {} in the file, but this EMA's schedule makes {} updates in global_step {} steps: {}",
                found.updates, updates, found.step, options);
  if (found.last_update_step >= 0 && found.last_update_step != last)
    file.refuse("callbacks['EMAWeightAveraging'] latest_update_step is {} in the file, but this EMA's schedule last "
                "updates at step {} of {}: {}",
                found.last_update_step, last, found.step, options);
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

// A Lightning checkpoint: its state_dict (the averages), averaging_state's n_averaged, global_step
// and, when the checkpoint holds callback states, callbacks['EMAWeightAveraging']'s
// latest_update_step (else not checked).
EMAKIT_FUNC PeerFile read_lightning(const ReadContext& in, const PeerDict& file) {
  const PeerDict tensors = file.dict("state_dict");
  if (file.find("averaging_state") == nullptr)
    file.refuse_file("has no 'averaging_state': not written with Lightning's EMAWeightAveraging callback (whose "
                     "on_save_checkpoint puts the averages in state_dict and n_averaged in averaging_state), so its "
                     "state_dict is the model's own weights, not an average");
  PeerFile f = read_named(in, tensors, in.codec.prefix);
  f.count = Count::recounted;
  f.updates = file.dict("averaging_state").integer_tensor("n_averaged", 0);
  f.step = file.integer("global_step", 0);
  f.initted = true;
  if (const auto callbacks = file.optional_dict("callbacks"))
    if (const auto own = callbacks->optional_dict("EMAWeightAveraging"))
      f.last_update_step = own->integer("latest_update_step", 0);
  return f;
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
// The config entries of an EMAHook file: each must equal this EMA's (`config`).
EMAKIT_FUNC void check_nvalchemi_config(const PeerDict& file, const NvalchemiConfig& config) {
  file.same("decay", file.number("decay"), config.decay, "Fixed::beta");
  file.same("update_every", file.integer("update_every"), config.update_every, "update_every");
  file.same("start_step", file.integer("start_step"), config.start_step, "start_step");
  file.same("use_buffers", file.boolean("use_buffers"), config.use_buffers,
            config.use_buffers ? "buffers averaged" : "buffers copied");
}

EMAKIT_FUNC c10::impl::GenericDict write_nvalchemi(const Codec& self, const EmaBase& ema) {
  return nvalchemi_dict(ema.averages(), self.prefix, nvalchemi_config(ema, "export_state"), ema.num_updates());
}

// An EMAHook.state_dict() file: its config checked against this EMA's, num_updates, and
// averaged_model_state (the tensors, and n_averaged, which must equal num_updates); the step is
// ImportOptions::step, which must be given. A state saved before the hook's first update (no
// averaged_model_state) is refused.
EMAKIT_FUNC PeerFile read_nvalchemi(const ReadContext& in, const PeerDict& file) {
  check_nvalchemi_config(file, nvalchemi_config(in.ema, "import_state"));
  const std::int64_t num_updates = file.integer("num_updates", 0);
  if (file.find("averaged_model_state") == nullptr)
    file.refuse_file("has no 'averaged_model_state': the hook had not made its averaged model yet (saved before its "
                     "first eligible step, num_updates {}), so there is no average to import; start the EMA afresh",
                     num_updates);
  const PeerDict averaged = file.dict("averaged_model_state");
  const std::int64_t n_averaged = averaged.integer_tensor("n_averaged", 0);
  if (num_updates != n_averaged)
    file.refuse("num_updates is {} but averaged_model_state's n_averaged is {}: an EMAHook updates both together, so "
                "the file was edited or mixes two states",
                num_updates, n_averaged);
  if (!in.step)
    file.refuse("an nvalchemi EMAHook state holds no step, and the hook's update_every and start_step count the "
                "trainer's completed optimizer steps: pass the trainer's step_count when the state was saved, "
                "import_state(ema, Peer::nvalchemi_hook, path, {{.step = step_count}})");
  if (*in.step < 0) file.refuse("ImportOptions::step must be >= 0, got {}", *in.step);
  PeerFile f = read_named(in, averaged, in.codec.prefix);
  f.count = Count::recounted;
  f.step = *in.step;
  f.initted = true;
  f.updates = num_updates;
  return f;
}

// Throws (nothing loaded) when this EMA's schedule makes `updates` != num_updates updates over
// the `step` completed steps given.
EMAKIT_FUNC void check_nvalchemi(const PeerFile& found, std::int64_t updates, std::int64_t, const PeerDict& file) {
  if (found.updates != updates)
    file.refuse("num_updates is {} in the file, but this EMA's schedule makes {} updates in {} completed steps "
                "(ImportOptions::step): the step is not the trainer's step_count when the hook was saved, or the hook "
                "had other options",
                found.updates, updates, found.step);
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
     .preset = "diffusers_ema_model, or diffusers_ema_model_warmup for use_ema_warmup=True",
     .write = write_diffusers, .read = read_diffusers},
    {.peer = Peer::luxonis_callback, .id = "luxonis_callback", .prefix = "", .name = "a luxonis-train EMACallback",
     .save_call = "torch.save(callback.state_dict(), path), or checkpoint[\"callbacks\"][key] of a Lightning checkpoint",
     .inner_call = "callback.ema.state_dict_ema",
     .write = write_luxonis, .read = read_luxonis},
    {.peer = Peer::lightning, .id = "lightning", .prefix = "", .name = "a Lightning EMAWeightAveraging checkpoint",
     .save_call = "trainer.save_checkpoint(path)", .inner_call = "the model's own state_dict()",
     .write = write_lightning, .read = read_lightning, .check = check_lightning},
    {.peer = Peer::nvalchemi_hook, .id = "nvalchemi_hook", .prefix = "module.", .name = "an nvalchemi EMAHook",
     .save_call = "torch.save(hook.state_dict(), path)", .inner_call = "hook.get_averaged_model().state_dict()",
     .preset = "nvalchemi_ema", .takes_step = true, .write = write_nvalchemi, .read = read_nvalchemi, .check = check_nvalchemi},
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
  const StateDict own = ema.state_dict();  // this EMA's config, counters and keys
  const ReadContext in{c, file_dict, path, own, ema, options.step};
  const PeerDict whole(in);
  if (options.step && !c.takes_step) {
    std::vector<std::string> takers;
    for (const Codec& taker : codecs)
      if (taker.takes_step) takers.push_back(fmt::format("Peer::{}", taker.id));
    whole.refuse("ImportOptions::step ({}) is for {}, whose file holds no step; {} file holds its own counters",
                 *options.step, fmt::join(takers, ", "), c.name);
  }
  PeerFile f = c.read(in, whole);
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
    if (c.check != nullptr) c.check(f, updates, last, whole);
  }
  StateDict& out = f.state;
  detail::ema_state::write_counters(
      out, {.calls = step, .step = step, .num_updates = updates, .last_update_step = last, .last_decay = ema.decay()});
  const LoadReport found = ema.check_state_dict(out, LoadMode::lenient);
  LoadReport report = peer_report(found, f, whole, options.mode);
  if (!found.clean()) keep_current(out, found, own);
  ema.load_state_dict(out, options.mode);
  return report;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
