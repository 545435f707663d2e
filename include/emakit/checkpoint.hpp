// An Ema in a file of its own: written atomically, read only after the file is checked.
//
//   emakit::save(ema, "ema.pt");     // temporary file beside it, fsync, rename: a crash mid-write
//                                    // leaves the previous "ema.pt" readable
//   emakit::load(ema, "ema.pt");     // refuses a file that holds code or anything but tensors and
//                                    // plain values, before LibTorch's loader runs; then checks
//                                    // each tensor's CRC-32; a failed load leaves `ema` as it was
//
// torch::save(ema, path) / torch::load(ema, path) write and read the same layout, but
// torch::load hands the file to LibTorch's TorchScript loader as it is, and torch::save writes
// in place. Use emakit::load for files you did not write yourself. EmaHook::load_checkpoint(path)
// and emakit::load_weights(model, path) check their files the same way (hooks.hpp).
//
// What the check accepts is listed in detail/serial/archive_scan.hpp; everything else is an error
// "emakit: <what>: refusing '<path>': <record> ... <what was found>".
#pragma once

#include <emakit/aliases.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/config.hpp>
#include <emakit/detail/serial/archive_file.hpp>
#include <emakit/ema.hpp>

#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>
#include <stdexcept>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

namespace detail {
// The file of emakit::save (an Ema whose storage holds the whole average here, or a
// PostHocEma): `state` as Ema::save writes it into an archive (a CRC-32 per tensor), written
// atomically.
EMAKIT_FUNC void save_state_file(const StateDict& state, const std::filesystem::path& path);
// Reads a file of save_state_file(), checked (read_archive, then every checksum), and hands its
// state to `load`, whose result it returns; an error names the file.
template <class Load>
auto load_state_file(const std::filesystem::path& path, const Load& load) {
  torch::serialize::InputArchive archive;
  read_archive(archive, path, "emakit::load");
  try {
    return ema_state::load_archive(archive, load);
  } catch (const std::exception&) {
    rethrow_with_context(" (file '" + path.string() + "')");
  }
}
EMAKIT_FUNC LoadReport load_ema_file(EmaBase& ema, const std::filesystem::path& path, LoadMode mode);
}  // namespace detail

// Writes the EMA (the layout of torch::save(ema, path)) to `path` atomically.
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
void save(const Ema<D, S, St>& ema, const std::filesystem::path& path) {
  // A storage that holds part of the average here (ShardedStorage) writes the whole EMA
  // its own way.
  if constexpr (CheckpointingStorage<St, Ema<D, S, St>>) return ema.storage().save_checkpoint(ema, path);
  detail::save_state_file(ema.state_dict(), path);
}

// Reads an EMA that save() or torch::save wrote, after checking the file (see above). Strict: a
// file of another model or config is an error naming the first mismatch; lenient: warns and
// keeps the current values, and the report lists them (Ema::load_state_dict's). On any error the
// EMA is unchanged. A sharded checkpoint loads strictly only: its report is clean.
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
LoadReport load(Ema<D, S, St>& ema, const std::filesystem::path& path, LoadMode mode = LoadMode::strict) {
  if constexpr (CheckpointingStorage<St, Ema<D, S, St>>) {
    ema.storage().load_checkpoint(ema, path, mode);
    return {};
  } else {
    return detail::load_ema_file(ema, path, mode);
  }
}

// EMAKIT_COMPILED (emakit::compiled, detail/config.hpp): save and load of the flat aliases
// come from libemakit.a.
#if EMAKIT_EXTERN_ALIASES
#define EMAKIT_EXTERN_CHECKPOINT(Decay)                                                                  \
  extern template void save(const Ema<Decay, StepSchedule, FlatStorage>&, const std::filesystem::path&); \
  extern template LoadReport load(Ema<Decay, StepSchedule, FlatStorage>&, const std::filesystem::path&, LoadMode);
EMAKIT_FOR_EACH_FLAT_ALIAS_DECAY(EMAKIT_EXTERN_CHECKPOINT)
#undef EMAKIT_EXTERN_CHECKPOINT
#endif

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/checkpoint-inl.hpp>
#endif
