// Moving an EMA between Python and C++: export the average as a file that Python's
// `torch.load(path)` reads as a plain dict (with the keys the Python peer uses), and import the
// EMA state a Python peer saved, with its counters, so a run continues in the other language.
//
//   emakit::export_state(ema, emakit::Peer::ema_pytorch, "ema.pt");
//   # Python: ema.load_state_dict(torch.load("ema.pt"), strict=False)
//   #   (strict=False: ema-pytorch's EMA also holds the online model, include_online_model=True,
//   #   which the export does not carry; docs/coming-from-python.md)
//
//   # Python: torch.save(ema.state_dict(), "ema.pt")   (the OrderedDict, which LibTorch's own
//   #         unpickler cannot read: detail/serial/archive_file.hpp reads it; a plain dict too)
//   emakit::import_state(ema, emakit::Peer::ema_pytorch, "ema.pt");
//
// | Peer            | keys of the tensors        | counters                                  |
// |-----------------|----------------------------|-------------------------------------------|
// | ema_pytorch     | ema_model.<name>           | step (update calls), initted              |
// | timm_v3         | module.<name>, or <name>   | none (timm's caller passes the step)      |
// |                 | (ema.module.state_dict())  |                                           |
// | averaged_model  | module.<name>              | n_averaged (= num_updates)                |
//
// The Python files carry no config: the EMA you import into must be made with the peer's
// options (the presets in presets.hpp). Tensors the Python peer holds and emakit does not
// (ema-pytorch's integer buffers, its online model) are left out of the export and ignored on
// import. Messages name the keys as the peer's file holds them (module.0.weight), never emakit's.
#pragma once

#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/archive_file.hpp>
#include <emakit/detail/serial/torch_pickle.hpp>
#include <emakit/ema.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/scalar_tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace emakit {

enum class Peer : std::uint8_t { ema_pytorch, timm_v3, averaged_model };

namespace detail::interop {

// What emakit says and writes about one peer: the prefix of its keys, its name in messages
// ("an ema-pytorch EMA"), the Python call that saves the state import_state wants, and the one
// that saves only its averaged model (keys without the prefix).
struct PeerText {
  std::string_view prefix, name, save_call, inner_call;
};
EMAKIT_FUNC const PeerText& peer_text(Peer peer);

// What import_state takes from a peer's file: the tensors under this EMA's keys (average.<name>,
// with the config entries of `state`, this EMA's own), the prefix the file's keys have and the
// peer's counters. Throws, naming the file, when the counters the peer writes are absent.
struct PeerFile {
  StateDict state;
  std::string prefix;
  std::int64_t step = -1;        // ema_pytorch: update calls
  bool initted = false;          // ema_pytorch
  std::int64_t n_averaged = -1;  // averaged_model
};
EMAKIT_FUNC PeerFile read_peer_file(const c10::impl::GenericDict& dict, Peer peer, const std::string& path,
                                    const StateDict& state);

// `found` (this EMA's check of the file's tensors) in the peer's keys. Strict mode: throws when it
// is not clean, naming each key the file should hold and what it holds instead. Lenient: warns.
EMAKIT_FUNC LoadReport peer_report(const LoadReport& found, const PeerFile& file, const c10::impl::GenericDict& dict,
                                   Peer peer, const std::string& path, LoadMode mode);

// For each key `found` lists as missing or mismatched, this EMA's current value (from `state`):
// what a lenient load keeps, so that the load itself is clean.
EMAKIT_FUNC void keep_current(StateDict& out, const LoadReport& found, const StateDict& state);

EMAKIT_FUNC const at::Tensor* entry(const c10::impl::GenericDict& dict, const std::string& key);

}  // namespace detail::interop

// Writes the EMA's tensors and counters with `peer`'s key names to `path`, readable by Python's
// torch.load (weights_only) as a plain dict.
template <class E>
void export_state(const E& ema, Peer peer, const std::filesystem::path& path) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  const std::string prefix(detail::interop::peer_text(peer).prefix);
  for (const auto& item : ema.averages()) dict.insert(prefix + item.key(), item.value().detach().cpu().contiguous());
  if (peer == Peer::ema_pytorch) {
    dict.insert("step", at::scalar_tensor(ema.step(), at::kLong));
    dict.insert("initted", at::scalar_tensor(ema.num_updates() > 0, at::kBool));
  } else if (peer == Peer::averaged_model) {
    dict.insert("n_averaged", at::scalar_tensor(ema.num_updates(), at::kLong));
  }
  detail::write_tensor_dict(path, dict);  // atomic, untagged: torch.load(weights_only=True) reads it
}

// Loads the EMA state a Python `peer` saved (torch.save(peer.state_dict()), or of a plain dict)
// into `ema`, which must be made with the peer's options. The counters are rebuilt from the
// peer's: ema-pytorch's step counts update calls, and the number of updates it applied is
// recounted with this EMA's own schedule. Strict: every tensor this EMA holds must be in the
// file with its shape and dtype; a missing one is named by the key the file should hold. The file
// is checked before LibTorch's unpickler reads it (detail/serial/archive_scan.hpp): a dict of
// tensors and plain values, nothing else. A failed import changes nothing.
template <class E>
LoadReport import_state(E& ema, Peer peer, const std::filesystem::path& file, LoadMode mode = LoadMode::strict) {
  const auto dict = detail::read_pickle_dict(file, "import_state");
  const std::string path = file.string();  // for messages
  const StateDict state = ema.state_dict();  // this EMA's own config, counters and keys
  detail::interop::PeerFile peer_file = detail::interop::read_peer_file(dict, peer, path, state);
  std::int64_t step = ema.step(), updates = ema.num_updates(), last = ema.last_update_step();
  if (peer == Peer::ema_pytorch) {
    step = peer_file.step;
    updates = 0;
    last = 0;
    if (peer_file.initted) {
      // Recount what the schedule did over `step` calls (ema-pytorch calls are never vetoed).
      for (std::int64_t call = 1, previous = 0; call <= step; ++call) {
        const Decision d = ema.schedule().decide({call, std::nullopt, previous, updates, false});
        previous = d.step;
        if (d.action != Action::skipped) {
          ++updates;
          last = d.step;
        }
      }
    }
  } else if (peer == Peer::averaged_model) {
    updates = peer_file.n_averaged;
    step = last = updates;
  }
  StateDict& out = peer_file.state;
  out.insert("counters.calls", at::scalar_tensor(step, at::kLong));
  out.insert("counters.step", at::scalar_tensor(step, at::kLong));
  out.insert("counters.num_updates", at::scalar_tensor(updates, at::kLong));
  out.insert("counters.last_update_step", at::scalar_tensor(last, at::kLong));
  out.insert("counters.last_decay", at::scalar_tensor(ema.decay(), at::kDouble));
  const LoadReport found = ema.check_state_dict(out, LoadMode::lenient);
  LoadReport report = detail::interop::peer_report(found, peer_file, dict, peer, path, mode);
  if (!found.clean()) detail::interop::keep_current(out, found, state);
  ema.load_state_dict(out, mode);
  return report;
}

}  // namespace emakit

#if EMAKIT_DEFINITIONS

#include <fmt/format.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <vector>

namespace emakit::detail::interop {

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

namespace {}  // (no internal linkage: the helpers below are EMAKIT_FUNC)

EMAKIT_FUNC const at::Tensor* entry(const c10::impl::GenericDict& dict, const std::string& key) {
  const auto it = dict.find(key);
  if (it == dict.end() || !it->value().isTensor()) return nullptr;
  return &it->value().toTensor();
}


EMAKIT_FUNC std::vector<std::string> average_names(const StateDict& state) {
  std::vector<std::string> names;
  for (const auto& item : state)
    if (item.key().rfind(ema_state::average_prefix, 0) == 0) names.push_back(item.key().substr(ema_state::average_prefix.size()));
  return names;
}

EMAKIT_FUNC bool holds_prefixed(const c10::impl::GenericDict& dict, std::string_view prefix) {
  for (const auto& item : dict)
    if (item.key().isString() && item.key().toStringRef().rfind(prefix, 0) == 0) return true;
  return false;
}

// Every name is in `dict` without a prefix: the peer's inner model saved alone.
EMAKIT_FUNC bool holds_unprefixed(const c10::impl::GenericDict& dict, const std::vector<std::string>& names) {
  return !names.empty() && std::all_of(names.begin(), names.end(), [&](const auto& n) { return entry(dict, n) != nullptr; });
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
                               ? fmt::format(": its keys are the model's own ('{}'): saved from {}? Save {}", *unprefixed,
                                             peer_text(peer).inner_call, peer_text(peer).save_call)
                               : std::string();
  if (peer == Peer::ema_pytorch) {
    const at::Tensor* s = entry(dict, "step");
    const at::Tensor* initted = entry(dict, "initted");
    if (s == nullptr || initted == nullptr)
      fail("import_state: '{}' has no 'step' and 'initted': not an ema-pytorch EMA state{}", path, hint);
    f.step = s->item<std::int64_t>();
    if (f.step < 0) fail("import_state: '{}': step must be >= 0, got {}", path, f.step);
    f.initted = initted->item<bool>();
  } else if (peer == Peer::averaged_model) {
    const at::Tensor* n = entry(dict, "n_averaged");
    if (n == nullptr) fail("import_state: '{}' has no 'n_averaged': not an AveragedModel state{}", path, hint);
    f.n_averaged = n->item<std::int64_t>();
    if (f.n_averaged < 0) fail("import_state: '{}': n_averaged must be >= 0, got {}", path, f.n_averaged);
  }
  for (const auto& item : state) {
    const std::string& key = item.key();
    if (key.rfind(ema_state::average_prefix, 0) == 0) {
      const at::Tensor* t = entry(dict, f.prefix + key.substr(ema_state::average_prefix.size()));
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
  if (const auto at = text.find(state_word); at != std::string::npos) text.replace(at, state_word.size(), " in the file,");
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
  for (std::size_t i = 0; i < report.missing.size() && i < shown; ++i) parts.push_back(fmt::format("no '{}'", report.missing[i]));
  if (report.missing.size() > shown) parts.push_back(fmt::format("and {} more missing", report.missing.size() - shown));
  for (const auto& k : report.unexpected) parts.push_back(fmt::format("unexpected '{}'", k));
  for (const auto& k : report.mismatched) parts.push_back(k);
  std::vector<std::string> missing;
  for (const auto& k : found.missing) missing.push_back(k.substr(ema_state::average_prefix.size()));
  std::size_t matched = 0;
  for (const auto& item : file.state) matched += item.key().rfind(ema_state::average_prefix, 0) == 0 ? 1 : 0;
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
      if (out.contains(key)) out[key] = *t;
      else out.insert(key, *t);
    }
  };
  for (const auto& k : found.missing) keep(k);
  for (const auto& k : found.mismatched) keep(k.substr(0, k.find(": ")));
}

}  // namespace emakit::detail::interop

#endif  // EMAKIT_DEFINITIONS
