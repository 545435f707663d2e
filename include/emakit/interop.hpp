// Moving an EMA between Python and C++: export the average as a file that Python's
// `torch.load(path)` reads as a plain dict (with the keys the Python peer uses), and import the
// EMA state a Python peer saved, with its counters, so a run continues in the other language.
//
//   emakit::export_state(ema, emakit::Peer::ema_pytorch, "ema.pt");
//   # Python: ema.load_state_dict(torch.load("ema.pt"), strict=False)
//
//   # Python: torch.save(dict(ema.state_dict()), "ema.pt")   (a plain dict: LibTorch 1.13
//   #         cannot read an OrderedDict)
//   emakit::import_state(ema, emakit::Peer::ema_pytorch, "ema.pt");
//
// | Peer            | keys of the tensors        | counters                                  |
// |-----------------|----------------------------|-------------------------------------------|
// | ema_pytorch     | ema_model.<name>           | step (update calls), initted              |
// | timm_v3         | module.<name>              | none (timm's caller passes the step)      |
// | averaged_model  | module.<name>              | n_averaged (= num_updates)                |
//
// The Python files carry no config: the EMA you import into must be made with the peer's
// options (the presets in presets.hpp). Tensors the Python peer holds and emakit does not
// (ema-pytorch's integer buffers) are left out of the export and ignored on import.
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

namespace detail {

inline std::string_view peer_prefix(Peer peer) {
  switch (peer) {
    case Peer::ema_pytorch: return "ema_model.";
    case Peer::timm_v3:
    case Peer::averaged_model: return "module.";
  }
  return "";
}

inline const at::Tensor* entry(const c10::impl::GenericDict& dict, const std::string& key) {
  const auto it = dict.find(key);
  if (it == dict.end() || !it->value().isTensor()) return nullptr;
  return &it->value().toTensor();
}

}  // namespace detail

// Writes the EMA's tensors and counters with `peer`'s key names to `path`, readable by Python's
// torch.load (weights_only) as a plain dict.
template <class E>
void export_state(const E& ema, Peer peer, const std::filesystem::path& path) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  const std::string prefix(detail::peer_prefix(peer));
  for (const auto& item : ema.averages()) dict.insert(prefix + item.key(), item.value().detach().cpu().contiguous());
  if (peer == Peer::ema_pytorch) {
    dict.insert("step", at::scalar_tensor(ema.step(), at::kLong));
    dict.insert("initted", at::scalar_tensor(ema.num_updates() > 0, at::kBool));
  } else if (peer == Peer::averaged_model) {
    dict.insert("n_averaged", at::scalar_tensor(ema.num_updates(), at::kLong));
  }
  detail::write_tensor_dict(path, dict);  // atomic, untagged: torch.load(weights_only=True) reads it
}

// Loads the EMA state a Python `peer` saved (torch.save of a plain dict) into `ema`, which must
// be made with the peer's options. The counters are rebuilt from the peer's: ema-pytorch's step
// counts update calls, and the number of updates it applied is recounted with this EMA's own
// schedule. Strict: every tensor this EMA holds must be in the file with its shape and dtype.
// The file is checked before LibTorch's unpickler reads it (detail/serial/archive_scan.hpp): a
// dict of tensors and plain values, nothing else.
template <class E>
LoadReport import_state(E& ema, Peer peer, const std::filesystem::path& file, LoadMode mode = LoadMode::strict) {
  const auto dict = detail::read_pickle_dict(file, "import_state");
  const std::string path = file.string();  // for messages
  StateDict state = ema.state_dict();  // this EMA's own config, counters and keys
  StateDict out;
  const std::string prefix(detail::peer_prefix(peer));
  for (const auto& item : state) {
    const std::string& key = item.key();
    if (key.rfind("average.", 0) == 0) {
      const at::Tensor* t = detail::entry(dict, prefix + key.substr(8));
      if (t != nullptr) out.insert(key, *t);  // missing ones are reported by load_state_dict
    } else if (key.rfind("counters.", 0) != 0) {
      out.insert(key, item.value());
    }
  }
  std::int64_t step = ema.step(), updates = ema.num_updates(), last = ema.last_update_step();
  if (peer == Peer::ema_pytorch) {
    const at::Tensor* s = detail::entry(dict, "step");
    const at::Tensor* initted = detail::entry(dict, "initted");
    if (s == nullptr || initted == nullptr) detail::fail("'{}' has no 'step' and 'initted': not an ema-pytorch EMA state", path);
    step = s->item<std::int64_t>();
    if (step < 0) detail::fail("'{}': step must be >= 0, got {}", path, step);
    updates = 0;
    last = 0;
    if (initted->item<bool>()) {
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
    const at::Tensor* n = detail::entry(dict, "n_averaged");
    if (n == nullptr) detail::fail("'{}' has no 'n_averaged': not an AveragedModel state", path);
    updates = n->item<std::int64_t>();
    if (updates < 0) detail::fail("'{}': n_averaged must be >= 0, got {}", path, updates);
    step = last = updates;
  }
  out.insert("counters.calls", at::scalar_tensor(step, at::kLong));
  out.insert("counters.step", at::scalar_tensor(step, at::kLong));
  out.insert("counters.num_updates", at::scalar_tensor(updates, at::kLong));
  out.insert("counters.last_update_step", at::scalar_tensor(last, at::kLong));
  out.insert("counters.last_decay", at::scalar_tensor(ema.decay(), at::kDouble));
  return ema.load_state_dict(out, mode);
}

}  // namespace emakit
