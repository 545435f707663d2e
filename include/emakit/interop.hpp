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
// | luxonis_callback| ema_state_dict: a dict of  | updates (a Python int: the callback keeps |
// |                 | <name> (the model's        | only an int), = num_updates               |
// |                 | state_dict() keys)         |                                           |
// | diffusers       | shadow_params: a list, by  | optimization_step (step() calls), and the |
// |                 | position (see below)       | config: decay, min_decay,                 |
// |                 |                            | update_after_step, use_ema_warmup,        |
// |                 |                            | inv_gamma, power                          |
//
// The Python files carry no config (diffusers' aside): the EMA you import into must be made with
// the peer's options (the presets in presets.hpp). Tensors the Python peer holds and emakit does
// not (ema-pytorch's integer buffers, its online model) are left out of the export and ignored on
// import. Messages name the keys as the peer's file holds them (module.0.weight), never emakit's.
//
// diffusers: EMAModel.state_dict() is a plain dict whose shadow_params is a list of tensors, one
// per parameter in the order of model.parameters() (EMAModel(model.parameters())), with no names.
// emakit matches them by position to the EMA's averaged tensors in the order it holds them, which
// for diffusers_ema_model / diffusers_ema_model_warmup (parameters only) is the model's own
// parameters() order: shadow_params[i] is the i-th parameter. A list of another length, or a
// tensor whose shape or dtype differs from the one at its position, is an error naming the
// position, the name it was matched to and both shapes; so is a config entry that differs from the
// EMA's decay (RationalRamp: decay = decay_max, min_decay, update_after_step, use_ema_warmup
// False, inv_gamma and power not used; InversePowerWarmup: decay = beta, min_decay = min_value,
// update_after_step, use_ema_warmup True, inv_gamma, power), naming the field. No lenient reading
// of a positional list: each of these errors loads nothing in either LoadMode. optimization_step
// becomes the EMA's step, and its update count is recounted with the EMA's own schedule. The
// export writes the same dict, the config as Python floats, ints and a bool (EMAModel's
// load_state_dict checks min_decay is a float, optimization_step and update_after_step ints,
// use_ema_warmup a bool), the shadow params as a plain list:
//
//   emakit::export_state(ema, emakit::Peer::diffusers, "ema.pt");
//   # Python: ema.load_state_dict(torch.load("ema.pt"))
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
#include <type_traits>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

enum class Peer : std::uint8_t { ema_pytorch, timm_v3, averaged_model, diffusers, luxonis_callback };

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

// luxonis-train's EMACallback.state_dict(): {"ema_state_dict": {<name>: tensor}, "updates": int}.
// Returns the inner dict (where the tensors are) and sets `updates`; throws naming the file when
// either entry is absent or of another type.
EMAKIT_FUNC c10::impl::GenericDict luxonis_tensors(const c10::impl::GenericDict& dict, const std::string& path,
                                                   std::int64_t& updates);

// `found` (this EMA's check of the file's tensors) in the peer's keys. Strict mode: throws when it
// is not clean, naming each key the file should hold and what it holds instead. Lenient: warns.
EMAKIT_FUNC LoadReport peer_report(const LoadReport& found, const PeerFile& file, const c10::impl::GenericDict& dict,
                                   Peer peer, const std::string& path, LoadMode mode);

// For each key `found` lists as missing or mismatched, this EMA's current value (from `state`):
// what a lenient load keeps, so that the load itself is clean.
EMAKIT_FUNC void keep_current(StateDict& out, const LoadReport& found, const StateDict& state);

EMAKIT_FUNC const at::Tensor* entry(const c10::impl::GenericDict& dict, const std::string& key);

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
template <class E>
DiffusersConfig diffusers_config(const E& ema, const char* what) {
  using D = std::decay_t<decltype(ema.decay_policy())>;
  const D& d = ema.decay_policy();
  if constexpr (std::is_same_v<D, RationalRamp>) {
    return {d.decay_max(), d.min_decay(), d.update_after_step(), false, 1.0, 2.0 / 3.0, "RationalRamp"};
  } else if constexpr (std::is_same_v<D, InversePowerWarmup>) {
    if (!d.warmup() || d.single_precision())
      fail("{}: Peer::diffusers with an InversePowerWarmup needs warmup(true) and single_precision(false), as "
           "diffusers_ema_model_warmup makes it (EMAModel(use_ema_warmup=True) computes the warmup in float64)",
           what);
    return {d.beta(), d.min_value(), d.update_after_step(), true, d.inv_gamma(), d.power(), "InversePowerWarmup"};
  } else {
    fail("{}: Peer::diffusers needs an EMA made by diffusers_ema_model (RationalRamp) or "
         "diffusers_ema_model_warmup (InversePowerWarmup): a diffusers EMAModel file describes no other decay",
         what);
  }
}

// EMAModel.state_dict()'s dict: the config as Python floats, ints and a bool, `step` as
// optimization_step, the averages as the list shadow_params (in the EMA's order).
EMAKIT_FUNC c10::impl::GenericDict diffusers_dict(const StateDict& averages, const DiffusersConfig& config,
                                                  std::int64_t step);

// What import_state takes from an EMAModel.state_dict() file: shadow_params matched by position to
// the averages of `state`, after the config is checked against `config`; `step`:
// optimization_step. Throws (nothing loaded) on a missing entry, a config that differs, a list of
// another length, or a tensor whose shape or dtype differs from the one at its position.
EMAKIT_FUNC PeerFile read_diffusers_file(const c10::impl::GenericDict& dict, const std::string& path,
                                         const StateDict& state, const DiffusersConfig& config);

}  // namespace detail::interop

// Writes the EMA's tensors and counters with `peer`'s key names to `path`, readable by Python's
// torch.load (weights_only) as a plain dict.
template <class E>
void export_state(const E& ema, Peer peer, const std::filesystem::path& path) {
  if (peer == Peer::diffusers) {
    const auto config = detail::interop::diffusers_config(ema, "export_state");
    detail::write_tensor_dict(path, detail::interop::diffusers_dict(ema.averages(), config, ema.step()));
    return;
  }
  if (peer == Peer::luxonis_callback) {  // what EMACallback.state_dict() returns
    c10::impl::GenericDict outer(c10::StringType::get(), c10::AnyType::get());
    c10::impl::GenericDict inner(c10::StringType::get(), c10::TensorType::get());
    for (const auto& item : ema.averages()) inner.insert(item.key(), item.value().detach().cpu().contiguous());
    outer.insert("ema_state_dict", inner);
    outer.insert("updates", ema.num_updates());  // a Python int: EMACallback ignores any other type
    detail::write_tensor_dict(path, outer);
    return;
  }
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
// peer's: ema-pytorch's step and diffusers' optimization_step count update calls, and the number
// of updates applied is recounted with this EMA's own schedule. Strict: every tensor this EMA holds must be in the
// file with its shape and dtype; a missing one is named by the key the file should hold. The file
// is checked before LibTorch's unpickler reads it (detail/serial/archive_scan.hpp): a dict of
// tensors and plain values, nothing else. A failed import changes nothing.
template <class E>
LoadReport import_state(E& ema, Peer peer, const std::filesystem::path& file, LoadMode mode = LoadMode::strict) {
  const auto file_dict = detail::read_pickle_dict(file, "import_state");
  const std::string path = file.string();    // for messages
  const StateDict state = ema.state_dict();  // this EMA's own config, counters and keys
  std::int64_t luxonis_updates = -1;
  const auto dict =
      peer == Peer::luxonis_callback ? detail::interop::luxonis_tensors(file_dict, path, luxonis_updates) : file_dict;
  detail::interop::PeerFile peer_file =
      peer == Peer::diffusers ? detail::interop::read_diffusers_file(
                                    dict, path, state, detail::interop::diffusers_config(ema, "import_state"))
                              : detail::interop::read_peer_file(dict, peer, path, state);
  std::int64_t step = ema.step(), updates = ema.num_updates(), last = ema.last_update_step();
  if (peer == Peer::ema_pytorch || peer == Peer::diffusers) {
    step = peer_file.step;
    updates = 0;
    last = 0;
    if (peer_file.initted) {
      // Recount what the schedule did over `step` calls (ema-pytorch's and diffusers' calls are
      // never vetoed).
      for (std::int64_t call = 1, previous = 0; call <= step; ++call) {
        const Decision d = ema.schedule().decide({call, std::nullopt, previous, updates, false});
        previous = d.step;
        if (d.action != Action::skipped) {
          ++updates;
          last = d.step;
        }
      }
    }
  } else if (peer == Peer::averaged_model || peer == Peer::luxonis_callback) {
    updates = peer == Peer::averaged_model ? peer_file.n_averaged : luxonis_updates;
    step = last = updates;  // ModelEma: one update per call, its decay from `updates`
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
