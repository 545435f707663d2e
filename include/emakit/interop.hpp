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
// | lightning       | state_dict: a dict of      | global_step (= step), averaging_state's   |
// |                 | <name> (the averages: a    | n_averaged (= num_updates), callbacks'    |
// |                 | checkpoint written with    | EMAWeightAveraging latest_update_step     |
// |                 | EMAWeightAveraging)        | (= last_update_step)                      |
// | nvalchemi_hook  | averaged_model_state: a    | num_updates and averaged_model_state's    |
// |                 | dict of module.<name> (an  | n_averaged (= num_updates); the config:   |
// |                 | AveragedModel's state)     | decay, update_every, start_step,          |
// |                 |                            | use_buffers. No step: you pass it         |
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
// parameters() order: shadow_params[i] is the i-th parameter. A tied weight (one tensor under two
// names, head.weight IS emb.weight) is one entry, at its first name, as parameters() lists it once;
// the import gives it to both names, the export writes it once. A list of another length, or a
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
//
// lightning: the checkpoint trainer.save_checkpoint(path) writes while Lightning's
// EMAWeightAveraging callback runs (lightning 2.6). The callback's on_save_checkpoint moves the
// model's weights to current_model_state, puts its AveragedModel's averages in state_dict (names
// without module.) and its n_averaged in averaging_state; callbacks["EMAWeightAveraging"] holds
// {"latest_update_step": int} and global_step the optimizer steps. import_state reads state_dict
// into an EMA made by lightning_ema_weight_averaging with the callback's options: global_step
// becomes the step, n_averaged the update count, and the update count the EMA's schedule gives
// over global_step steps must equal n_averaged (and its last update step latest_update_step),
// else the options differ (or the callback also updated at epoch ends, update_starting_at_epoch)
// and nothing is loaded. A checkpoint without averaging_state (saved without the callback: its
// state_dict is the model's weights, not an average) is refused naming the key. Everything else
// (current_model_state, optimizer_states, loops, ...) is ignored, but the whole file still passes
// the archive scan (plain data only): a LightningModule that called save_hyperparameters() adds
// hyper_parameters, pickled as Lightning's AttributeDict class, which the scan refuses (it runs
// no Python class and allows none by name: a global is code the loader would call). For such a
// checkpoint, save the keys import_state reads as a plain dict in Python first:
//   ckpt = torch.load("last.ckpt", weights_only=False)
//   torch.save({k: ckpt[k] for k in ("state_dict", "averaging_state", "callbacks", "global_step")}, "ema.ckpt")
// The export writes those four keys, with the same types (n_averaged a long tensor,
// latest_update_step and global_step Python ints). It is not a checkpoint Trainer.fit(ckpt_path=)
// resumes from: the callback restores its average only from a checkpoint that also holds
// current_model_state (else it warns and starts its average from state_dict with n_averaged 0,
// so its next update copies the model), and the Trainer needs Lightning's own entries
// (optimizer_states, loops, epoch: it restores global_step from loops, not from global_step).
// Merge the export into a checkpoint of the run, whose current_model_state is the model's weights:
//   ckpt = torch.load("last.ckpt", weights_only=False); ema = torch.load("ema.ckpt")
//   ckpt["state_dict"], ckpt["averaging_state"] = ema["state_dict"], ema["averaging_state"]
//   ckpt["callbacks"]["EMAWeightAveraging"] = ema["callbacks"]["EMAWeightAveraging"]
//   torch.save(ckpt, "resume.ckpt")
//
// nvalchemi_hook: torch.save(hook.state_dict(), path) of nvalchemi's EMAHook (nvalchemi-toolkit
// 0.2): its config (model_key, decay, update_every, start_step, use_buffers), num_updates, and
// averaged_model_state, its AveragedModel's state_dict() (module.<name>, n_averaged). import_state
// reads it into an EMA made by nvalchemi_ema with the hook's options: each config entry must equal
// the EMA's (decay = Fixed::beta, update_every, start_step, use_buffers = buffers averaged), else
// the error names the field; model_key (the trainer's name for the model) is not read. The file
// holds no step: the hook's eligible steps count the trainer's completed optimizer steps
// (ctx.step_count), which the trainer's own checkpoint keeps. Pass it:
//   emakit::import_state(ema, emakit::Peer::nvalchemi_hook, "hook.pt", {.step = step_count});
// import_state refuses the file without it, and refuses a step at which this EMA's schedule makes
// another number of updates than num_updates (a vetoed batch completes no step, so every eligible
// step is an update), or a file whose num_updates differs from its n_averaged; nothing loads. A
// state saved before the hook's first update (no averaged_model_state) has no average to import
// and is refused. The export writes the same dict without model_key (EMAHook.load_state_dict
// checks every config entry present against its own, and model_key is the trainer's, not the
// EMA's); the hook loads it before or after it made its averaged model:
//   emakit::export_state(ema, emakit::Peer::nvalchemi_hook, "hook.pt");
//   # Python: hook.load_state_dict(torch.load("hook.pt")); ctx.step_count = ema.step() in C++
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
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

enum class Peer : std::uint8_t {
  ema_pytorch,
  timm_v3,
  averaged_model,
  diffusers,
  luxonis_callback,
  lightning,
  nvalchemi_hook,
};

// What import_state needs besides the file. step: the trainer's completed optimizer steps when
// the state was saved, for a peer whose file holds none (nvalchemi_hook, where it is required);
// a peer whose file holds its own counters refuses it.
struct ImportOptions {
  LoadMode mode = LoadMode::strict;
  std::optional<std::int64_t> step = std::nullopt;
};

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
                                                     LightningCounters& counters);

// The entries of a Lightning checkpoint EMAWeightAveraging's on_load_checkpoint reads from the
// callback's side: state_dict, averaging_state {n_averaged}, callbacks {EMAWeightAveraging:
// {latest_update_step}}, and global_step.
EMAKIT_FUNC c10::impl::GenericDict lightning_dict(const StateDict& averages, std::int64_t global_step,
                                                  std::int64_t n_averaged, std::int64_t latest_update_step);

// Throws (nothing loaded) when the file's n_averaged or latest_update_step differ from the
// `updates` and `last` update step this EMA's schedule gives over global_step steps.
EMAKIT_FUNC void check_lightning_counters(const LightningCounters& file, std::int64_t updates, std::int64_t last,
                                          const std::string& path);

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
template <class E>
NvalchemiConfig nvalchemi_config(const E& ema, const char* what) {
  using D = std::decay_t<decltype(ema.decay_policy())>;
  using S = std::decay_t<decltype(ema.schedule())>;
  const auto refuse = [&](std::string_view why) {
    fail("{}: Peer::nvalchemi_hook needs an EMA made by nvalchemi_ema (an EMAHook's AveragedModel EMA): {}", what, why);
  };
  if constexpr (!std::is_same_v<D, Fixed> || !std::is_same_v<S, StepSchedule>) {
    refuse("this EMA's decay or schedule is another policy (EMAHook's is Fixed with a StepSchedule)");
    return {};
  } else {
    const StepSchedule& s = ema.schedule();
    if (s.warmup() != Warmup::skip_before_start || s.every_offset() != 0 || s.accumulate() != 1)
      refuse(fmt::format("its StepSchedule has warmup {}, every_offset {}, accumulate {} (EMAHook: skip_before_start, "
                         "0, 1)",
                         static_cast<int>(s.warmup()), s.every_offset(), s.accumulate()));
    const BufferMode buffers = ema.options().buffers();
    if (buffers != BufferMode::average && buffers != BufferMode::copy)
      refuse("its buffers are ignored (EMAHook's AveragedModel averages them, use_buffers=True, or keeps them, False)");
    return {ema.decay_policy().beta(), s.update_every(), s.start_step(), buffers == BufferMode::average};
  }
}

// EMAHook.state_dict()'s dict without model_key: the config as Python float, ints and a bool,
// num_updates a Python int, averaged_model_state the averages as module.<name> with n_averaged
// (AveragedModel's long tensor, = num_updates).
EMAKIT_FUNC c10::impl::GenericDict nvalchemi_dict(const StateDict& averages, const NvalchemiConfig& config,
                                                  std::int64_t num_updates);

// An EMAHook.state_dict() file: checks its config against `config` and returns its
// averaged_model_state (where the tensors are), setting `num_updates`; throws (nothing loaded) on
// a missing or mistyped entry, a config that differs, or a state saved before the hook's first
// update.
EMAKIT_FUNC c10::impl::GenericDict nvalchemi_tensors(const c10::impl::GenericDict& dict, const std::string& path,
                                                     const NvalchemiConfig& config, std::int64_t& num_updates);

// The step import_state gives an EMAHook file: `step`, which must be given and >= 0; throws
// (nothing loaded) without it, or when the file's num_updates differs from its n_averaged.
EMAKIT_FUNC std::int64_t nvalchemi_step(const std::optional<std::int64_t>& step, std::int64_t num_updates,
                                        std::int64_t n_averaged, const std::string& path);

// Throws (nothing loaded) when this EMA's schedule makes `updates` != num_updates updates over
// `step` completed steps.
EMAKIT_FUNC void check_nvalchemi_updates(std::int64_t num_updates, std::int64_t updates, std::int64_t step,
                                         const std::string& path);

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

// The averages as a name -> tensor dict (CPU, contiguous), each name after `prefix`: what every
// export writes its tensors as.
EMAKIT_FUNC c10::impl::GenericDict tensor_dict(const StateDict& averages, std::string_view prefix = {});

// What EMACallback.state_dict() returns: {"ema_state_dict": the averages, "updates": a Python int
// (EMACallback ignores any other type)}.
EMAKIT_FUNC c10::impl::GenericDict luxonis_dict(const StateDict& averages, std::int64_t updates);

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
  if (peer == Peer::lightning) {
    detail::write_tensor_dict(
        path, detail::interop::lightning_dict(ema.averages(), ema.step(), ema.num_updates(), ema.last_update_step()));
    return;
  }
  if (peer == Peer::luxonis_callback) {
    detail::write_tensor_dict(path, detail::interop::luxonis_dict(ema.averages(), ema.num_updates()));
    return;
  }
  if (peer == Peer::nvalchemi_hook) {
    const auto config = detail::interop::nvalchemi_config(ema, "export_state");
    detail::write_tensor_dict(path, detail::interop::nvalchemi_dict(ema.averages(), config, ema.num_updates()));
    return;
  }
  c10::impl::GenericDict dict = detail::interop::tensor_dict(ema.averages(), detail::interop::peer_text(peer).prefix);
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
// of updates applied is recounted with this EMA's own schedule; an nvalchemi EMAHook's file holds
// no step, options.step gives it. Strict: every tensor this EMA holds must be in the file with its
// shape and dtype; a missing one is named by the key the file should hold. The file is checked
// before LibTorch's unpickler reads it (detail/serial/archive_scan.hpp): a dict of tensors and
// plain values, nothing else. A failed import changes nothing.
template <class E>
LoadReport import_state(E& ema, Peer peer, const std::filesystem::path& file, const ImportOptions& options) {
  const auto file_dict = detail::read_pickle_dict(file, "import_state");
  const std::string path = file.string();    // for messages
  const StateDict state = ema.state_dict();  // this EMA's own config, counters and keys
  if (options.step && peer != Peer::nvalchemi_hook)
    detail::fail("import_state: ImportOptions::step ({}) is for Peer::nvalchemi_hook, whose file holds no step; {} "
                 "file holds its own counters",
                 *options.step, detail::interop::peer_text(peer).name);
  std::int64_t luxonis_updates = -1, hook_updates = -1;
  detail::interop::LightningCounters lightning;
  const auto dict = peer == Peer::luxonis_callback ? detail::interop::luxonis_tensors(file_dict, path, luxonis_updates)
                    : peer == Peer::lightning      ? detail::interop::lightning_tensors(file_dict, path, lightning)
                    : peer == Peer::nvalchemi_hook
                        ? detail::interop::nvalchemi_tensors(
                              file_dict, path, detail::interop::nvalchemi_config(ema, "import_state"), hook_updates)
                        : file_dict;
  detail::interop::PeerFile peer_file =
      peer == Peer::diffusers ? detail::interop::read_diffusers_file(
                                    dict, path, state, detail::interop::diffusers_config(ema, "import_state"))
                              : detail::interop::read_peer_file(dict, peer, path, state);
  std::int64_t step = ema.step(), updates = ema.num_updates(), last = ema.last_update_step();
  if (peer == Peer::lightning) {
    peer_file.step = lightning.global_step;
    peer_file.initted = true;
  } else if (peer == Peer::nvalchemi_hook) {
    peer_file.step = detail::interop::nvalchemi_step(options.step, hook_updates, peer_file.n_averaged, path);
    peer_file.initted = true;
  }
  if (peer == Peer::ema_pytorch || peer == Peer::diffusers || peer == Peer::lightning || peer == Peer::nvalchemi_hook) {
    step = peer_file.step;
    updates = 0;
    last = 0;
    if (peer_file.initted) {
      // Recount what the schedule did over `step` calls (ema-pytorch's and diffusers' calls are
      // never vetoed; a vetoed batch completes no step of nvalchemi's trainer).
      for (std::int64_t call = 1, previous = 0; call <= step; ++call) {
        const Decision d = ema.schedule().decide({call, std::nullopt, previous, updates, false});
        previous = d.step;
        if (d.action != Action::skipped) {
          ++updates;
          last = d.step;
        }
      }
    }
    if (peer == Peer::lightning) detail::interop::check_lightning_counters(lightning, updates, last, path);
    if (peer == Peer::nvalchemi_hook) detail::interop::check_nvalchemi_updates(hook_updates, updates, step, path);
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
  LoadReport report = detail::interop::peer_report(found, peer_file, dict, peer, path, options.mode);
  if (!found.clean()) detail::interop::keep_current(out, found, state);
  ema.load_state_dict(out, options.mode);
  return report;
}

template <class E>
LoadReport import_state(E& ema, Peer peer, const std::filesystem::path& file, LoadMode mode = LoadMode::strict) {
  return import_state(ema, peer, file, ImportOptions{.mode = mode});
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/interop-inl.hpp>
#endif
