// Every on-disk format emakit writes, with its one name, the version it writes and the oldest
// version it reads. A format's version is stored in its files; every reader checks it with
// check_version() below (one message shape, one exception type: emakit::FormatVersionError). A
// change to a format bumps `version` here; `oldest` stays where it was while the reader keeps
// reading the older versions (today: the snapshot and the post-hoc state read version 1 too;
// the others read only the version they write).
//
//   format            files                                   version stored as
//   ema_state         emakit::save / torch::save(ema): an     "emakit.format" in the state dict
//                     archive with emakit_state, _checksums
//   hook              EmaHook::save_checkpoint: emakit_hook/   emakit_hook/format
//   sharded           save_sharded: index.pt (emakit_shard,   emakit_shard "format" (index and
//                     _state, _layout) + one file per rank     every rank file)
//   snapshot          post-hoc EMA snapshots (phema-*.emkit)  u32 after the magic "EMAKITPH"
//                     (layout: detail/serial/snapshot_file.hpp)
//   posthoc_state     PostHocEma::state_dict: its profiles'    "posthoc.format"
//                     ema_state dicts under profile.<i>.
//
// Not versioned by emakit: the torch.save dicts of tensors (torch_pickle.hpp) that interop.hpp
// exports and imports and posthoc.hpp writes for a synthesized EMA; their layout is Python's.
//
// The serialization layer (detail/serial/), one job per header:
//   formats.hpp        this registry, and the one version check (check_version)
//   checksum.hpp       CRC-32, the per-tensor checksums of archives, the one checked dict read
//   atomic_file.hpp    the one write path: a temporary file, fsync, rename
//   archive_scan.hpp   refuses an untrusted archive before LibTorch's loader runs
//   archive_file.hpp   the one checked read path (scan, then load) and the archive write
//   tensor_dict.hpp    name -> tensor dictionaries inside archives
//   state_reader.hpp   typed reads of counters and config values from a state dict
//   match.hpp          tensors matched by name, then by shape
//   ema_state.hpp      the Ema state dict and its archive (ema_state)
//   hook_state.hpp     the EmaHook checkpoint (hook)
//   snapshot_file.hpp  the post-hoc snapshot file (snapshot)
//   torch_pickle.hpp   a dict of tensors written as torch.save does
#pragma once

#include <emakit/detail/config.hpp>

#include <cstdint>
#include <string_view>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::formats {

// A file format: the name messages use, the version this emakit writes and the oldest it reads.
struct Format {
  std::string_view name;
  std::int64_t version;
  std::int64_t oldest;
  constexpr bool reads(std::int64_t found) const noexcept { return found >= oldest && found <= version; }
};

inline constexpr Format ema_state{"emakit EMA state", 1, 1};
inline constexpr Format hook{"emakit hook checkpoint", 1, 1};
inline constexpr Format sharded{"emakit sharded EMA", 1, 1};
inline constexpr Format snapshot{"emakit post-hoc snapshot", 2, 1};        // 2: the run identity
inline constexpr Format posthoc_state{"emakit post-hoc EMA state", 2, 1};  // 2: the run identity

// The check of a version read from a file of `format`: throws emakit::FormatVersionError unless
// oldest <= found <= version, as "emakit: <where>: <format> version <found> (written by emakit
// <writer>); this emakit (<version>) reads version(s) ...", and says to update emakit when the
// file is newer. `writer`: the writing emakit's version where the file records it, else empty.
EMAKIT_FUNC void check_version(const Format& format, std::int64_t found, std::string_view where,
                               std::string_view writer = {});

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::formats

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/formats-inl.hpp>
#endif
