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

#include <emakit/detail/config.hpp>
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

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

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
  const std::string path = file.string();    // for messages
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/interop-inl.hpp>
#endif
