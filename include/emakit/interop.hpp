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

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

// interop is a part of emakit compiled in a file of its own (implementation/interop.hpp): a
// program that includes this header and lacks the part fails to link on a name that says what to
// do (link emakit::interop, or define EMAKIT_IMPLEMENTATION in one file; detail/config.hpp).
EMAKIT_LINK_CHECK(define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_interop)

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// Each peer is one codec in interop-inl.hpp's table (detail::interop::codecs: its name, its file
// layout both ways, its counters) and one preset in presets.hpp.
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

// export_state and import_state (below) take an EmaBase: what a peer's config is read from
// (diffusers' EMAModel and nvalchemi's EMAHook write theirs) are the EMA's own policies
// (EmaBase::find_policy), its counters and options.

// ---- the codec of a peer ------------------------------------------------------------------

struct Codec;
class PeerDict;  // typed reads from a peer's file, and every refusal of one (interop-inl.hpp)

// What a codec's read is given: the whole file, this EMA's state and policies, ImportOptions::step.
struct ReadContext {
  const Codec& codec;
  const c10::impl::GenericDict& file;
  const std::string& path;  // for messages
  const StateDict& state;   // this EMA's own config, counters and keys
  const EmaBase& ema;       // its policies and options
  std::optional<std::int64_t> step;
};

// How import_state sets the EMA's counters from a peer's file.
enum class Count : std::uint8_t {
  kept,       // the file holds none (timm): the EMA keeps its own
  given,      // the file holds the update count (`updates`): step = last update step = updates
  recounted,  // the file holds the update calls (`step`): the EMA's schedule recounts the updates
};

// What a codec's read takes from a peer's file: the tensors under this EMA's keys
// (average.<name>, with the config entries of this EMA's own state), where they are and the
// peer's counters.
struct PeerFile {
  StateDict state;
  std::string prefix;  // of the file's keys, for messages
  std::string inside;  // the dict of the file that holds them, as Python indexes it (empty: the file itself)
  c10::impl::GenericDict tensors{c10::StringType::get(), c10::AnyType::get()};  // the dict that holds them
  Count count = Count::kept;
  std::int64_t step = -1;              // recounted: update calls (completed steps)
  bool initted = false;                // recounted: the peer made its average (else no update counts)
  std::int64_t updates = -1;           // given: the update count; recounted: the file's, for `check`
  std::int64_t last_update_step = -1;  // recounted: the file's (-1: none), for `check`
};

// One Python peer: its name, its file layout both ways and its counters. Adding a peer is one
// codec in interop-inl.hpp's table (in Peer's order) and its preset in presets.hpp.
struct Codec {
  Peer peer;
  std::string_view id;           // the enumerator's name, as messages write it: Peer::<id>
  std::string_view prefix;       // of the keys of its tensors (module.)
  std::string_view name;         // in messages: "an ema-pytorch EMA"
  std::string_view save_call;    // the Python call that saves the state import_state wants
  std::string_view inner_call;   // the one that saves only its averaged model (keys without the prefix)
  std::string_view preset = {};  // what makes an EMA of the file's config, for a config that differs
  bool takes_step = false;       // its file holds no step: ImportOptions::step gives it
  // The dict export_state writes: what the peer's torch.load and load_state_dict read.
  c10::impl::GenericDict (*write)(const Codec& self, const EmaBase& ema);
  // The tensors and counters of a file (`file`: its dict, read through PeerDict), or throws
  // naming the file and what it lacks.
  PeerFile (*read)(const ReadContext& in, const PeerDict& file);
  // Count::recounted: throws (nothing loaded) when the file's own counts differ from the
  // `updates` and `last` update step the EMA's schedule makes over found.step steps (`file`: the
  // file read, for the message); may be null.
  void (*check)(const PeerFile& found, std::int64_t updates, std::int64_t last, const PeerDict& file) = nullptr;
};

// The codec of `peer`; throws for a value that names no Peer.
EMAKIT_FUNC const Codec& codec(Peer peer);

}  // namespace detail::interop

// Writes the EMA's tensors and counters with `peer`'s key names to `path`, readable by Python's
// torch.load (weights_only) as a plain dict.
EMAKIT_FUNC void export_state(const EmaBase& ema, Peer peer, const std::filesystem::path& path);

// Loads the EMA state a Python `peer` saved (torch.save(peer.state_dict()), or of a plain dict)
// into `ema`, which must be made with the peer's options. The counters are rebuilt from the
// peer's: ema-pytorch's step and diffusers' optimization_step count update calls, and the number
// of updates applied is recounted with this EMA's own schedule; an nvalchemi EMAHook's file holds
// no step, options.step gives it. Strict: every tensor this EMA holds must be in the file with its
// shape and dtype; a missing one is named by the key the file should hold. The file is checked
// (detail/serial/archive_scan.hpp: a dict of tensors and plain values, nothing else) and the dict
// is built from the values the check ran; LibTorch's unpickler never reads it. A failed import
// changes nothing.
EMAKIT_FUNC LoadReport import_state(EmaBase& ema, Peer peer, const std::filesystem::path& file,
                                    const ImportOptions& options);

inline LoadReport import_state(EmaBase& ema, Peer peer, const std::filesystem::path& file,
                               LoadMode mode = LoadMode::strict) {
  return import_state(ema, peer, file, ImportOptions{.mode = mode});
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/interop-inl.hpp>
#endif
