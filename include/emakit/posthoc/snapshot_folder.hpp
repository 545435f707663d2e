// Post-hoc EMA snapshot folders: the snapshot file names, writing one snapshot, reading and
// listing a folder's. One file per profile and snapshot, "<folder>/phema-<step, 10
// digits>-<profile>.emkit", written atomically (detail/serial/atomic_file.hpp): a crash
// leaves every earlier snapshot readable. The file format (formats::snapshot) is described
// once, in detail/serial/snapshot_file.hpp.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/posthoc/part.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/snapshot_file.hpp>
#include <emakit/state.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// "phema-<step, 10 digits>-<profile>.emkit"
EMAKIT_FUNC std::string snapshot_file_name(std::int64_t step, std::uint32_t profile);

EMAKIT_FUNC bool is_snapshot_file_name(const std::string& name);

// The header of one snapshot file (checked; the tensors' data is not read).
EMAKIT_FUNC SnapshotInfo read_snapshot_info(const std::filesystem::path& path);

// Every tensor of a snapshot file, on the CPU in its stored dtype, each checked against its CRC.
EMAKIT_FUNC StateDict load_snapshot(const std::filesystem::path& path);

namespace detail {
// The table entry of one tensor; with `dtype`, an averaged real floating tensor is stored in it.
EMAKIT_FUNC SnapshotTensor snapshot_entry(const std::string& name, const at::Tensor& tensor, bool averaged,
                                          std::optional<c10::ScalarType> dtype);
}  // namespace detail

// Writes `tensors` as a snapshot of profile (t, gamma) atomically. Without a tensor table in the
// header, floating and complex tensors are marked averaged and the others copied; with `dtype`,
// averaged real floating tensors are stored in that dtype. For importing snapshots made elsewhere
// (ema-pytorch, EDM2) into a folder that plan_synthesis() reads; PostHocEma writes its own. The
// header's run fields are written as given: leave them unset ("no run recorded") for the
// snapshots of one imported run, or set run, profiles and previous_step so that the synthesis
// can check the set is complete.
EMAKIT_FUNC void write_snapshot(const std::filesystem::path& path, SnapshotInfo header, const StateDict& tensors,
                                std::optional<c10::ScalarType> dtype = std::nullopt);

// The snapshot files of a folder (names "phema-*.emkit"), headers checked, sorted by (t, gamma).
// Temporary files of interrupted writes are never listed (see interrupted_writes()).
EMAKIT_FUNC std::vector<SnapshotInfo> list_snapshots(const std::filesystem::path& folder);

// The runs that wrote a set of snapshots: one entry per run id, in order of their first snapshot.
struct SnapshotRun {
  RunId id;
  std::int64_t started = 0;  // Unix seconds (0: not recorded)
  std::size_t snapshots = 0;
  std::int64_t first_t = 0, last_t = 0;
  std::filesystem::path example;  // one of its files (the latest)

  // "run 3f2a9c1d (started 2026-12-01 18:51:03 UTC): 40 snapshots, t = 100 to 2000, e.g. '<file>'"
  std::string describe() const;
};

EMAKIT_FUNC std::vector<SnapshotRun> snapshot_runs(const std::vector<SnapshotInfo>& snapshots);

// Temporary files that writes interrupted by a crash left in `folder` (safe to delete when no
// process is writing there).
EMAKIT_FUNC std::vector<std::filesystem::path> interrupted_writes(const std::filesystem::path& folder);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/posthoc/snapshot_folder-inl.hpp>
#endif
