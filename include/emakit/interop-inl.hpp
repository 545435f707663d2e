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
  };
  static_assert(static_cast<int>(Peer::ema_pytorch) == 0 && static_cast<int>(Peer::timm_v3) == 1 &&
                static_cast<int>(Peer::averaged_model) == 2);
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
  } else if (peer == Peer::averaged_model) {
    const at::Tensor* n = entry(dict, "n_averaged");
    if (n == nullptr) fail("import_state: '{}' has no 'n_averaged': not an AveragedModel state{}", path, hint);
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::interop
