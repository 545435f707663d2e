// Post-hoc EMA snapshot folders: the snapshot file names, writing one snapshot, reading and listing
// a folder's. One file per profile and snapshot, "<folder>/phema-<step, 10 digits>-<profile>.emkit",
// written atomically (detail/serial/atomic_file.hpp): a crash leaves every earlier snapshot
// readable. The file format (formats::snapshot) is described once, in detail/serial/snapshot_file.hpp.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/snapshot_file.hpp>
#include <emakit/ema.hpp>

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

namespace emakit {

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

}  // namespace emakit

#if EMAKIT_DEFINITIONS

namespace emakit {

EMAKIT_FUNC std::string snapshot_file_name(std::int64_t step, std::uint32_t profile) {
  return fmt::format("phema-{:010}-{}.emkit", step, profile);
}

EMAKIT_FUNC bool is_snapshot_file_name(const std::string& name) {
  constexpr std::string_view prefix = "phema-", suffix = ".emkit";
  return name.size() > prefix.size() + suffix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

EMAKIT_FUNC SnapshotInfo read_snapshot_info(const std::filesystem::path& path) { return detail::SnapshotReader(path).info(); }

EMAKIT_FUNC StateDict load_snapshot(const std::filesystem::path& path) {
  const detail::SnapshotReader reader(path);
  StateDict out;
  for (std::size_t i = 0; i < reader.info().tensors.size(); ++i) out.insert(reader.info().tensors[i].name, reader.read(i));
  return out;
}

}  // namespace emakit

namespace emakit::detail {

EMAKIT_FUNC SnapshotTensor snapshot_entry(const std::string& name, const at::Tensor& tensor, bool averaged,
                                          std::optional<c10::ScalarType> dtype) {
  SnapshotTensor t;
  t.name = name;
  t.dtype = tensor.scalar_type();
  t.stored_dtype = (averaged && dtype && c10::isFloatingType(t.dtype)) ? *dtype : t.dtype;
  t.averaged = averaged;
  t.sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  return t;
}

}  // namespace emakit::detail

namespace emakit {

EMAKIT_FUNC void write_snapshot(const std::filesystem::path& path, SnapshotInfo header, const StateDict& tensors,
                                std::optional<c10::ScalarType> dtype) {
  if (!(header.gamma > 0) || header.t <= 0 || header.update_every <= 0)
    detail::fail("write_snapshot '{}': needs t > 0, gamma > 0 and update_every > 0, got t = {}, gamma = {}, "
                 "update_every = {}",
                 path.string(), header.t, header.gamma, header.update_every);
  header.sigma_rel = gamma_to_sigma_rel(header.gamma);
  if (header.tensors.empty()) {  // floating and complex tensors are averaged, others copied
    for (const auto& item : tensors) {
      const auto type = item.value().scalar_type();
      header.tensors.push_back(detail::snapshot_entry(item.key(), item.value(),
                                                      c10::isFloatingType(type) || c10::isComplexType(type), dtype));
    }
  }
  if (header.tensors.size() != tensors.size())
    detail::fail("write_snapshot '{}': the header lists {} tensors, {} given", path.string(), header.tensors.size(),
                 tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (header.tensors[i].name != tensors[i].key())
      detail::fail("write_snapshot '{}': tensor {} is '{}' in the header but '{}' in the tensors", path.string(), i,
                   header.tensors[i].name, tensors[i].key());
  detail::SnapshotWriter writer(path, std::move(header));
  for (std::size_t i = 0; i < tensors.size(); ++i) writer.write(i, tensors[i].value());
  writer.commit();
}

EMAKIT_FUNC std::vector<SnapshotInfo> list_snapshots(const std::filesystem::path& folder) {
  std::error_code ec;
  if (!std::filesystem::is_directory(folder, ec))
    detail::fail_runtime("the snapshot folder '{}' does not exist or is not a folder", folder.string());
  std::vector<SnapshotInfo> out;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (!is_snapshot_file_name(name) || !entry.is_regular_file()) continue;
    out.push_back(read_snapshot_info(entry.path()));
  }
  std::sort(out.begin(), out.end(), [](const SnapshotInfo& a, const SnapshotInfo& b) {
    return std::tie(a.t, a.gamma, a.profile, a.path) < std::tie(b.t, b.gamma, b.profile, b.path);
  });
  return out;
}

EMAKIT_FUNC std::string SnapshotRun::describe() const {
  std::string when;
  if (started > 0) {
    const auto seconds = static_cast<std::time_t>(started);
    std::tm utc{};
    ::gmtime_r(&seconds, &utc);
    when = fmt::format(" (started {:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC)", utc.tm_year + 1900, utc.tm_mon + 1,
                       utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec);
  }
  return fmt::format("{}{}: {} snapshot{}, t = {} to {}, e.g. '{}'",
                     id.recorded() ? "run " + id.short_hex() : std::string("snapshots without a run id"), when,
                     snapshots, snapshots == 1 ? "" : "s", first_t, last_t, example.string());
}

EMAKIT_FUNC std::vector<SnapshotRun> snapshot_runs(const std::vector<SnapshotInfo>& snapshots) {
  std::vector<SnapshotRun> runs;
  for (const auto& s : snapshots) {
    auto it = std::find_if(runs.begin(), runs.end(), [&](const SnapshotRun& r) { return r.id == s.run; });
    if (it == runs.end()) {
      runs.push_back({s.run, s.run_started, 0, s.t, s.t, s.path});
      it = runs.end() - 1;
    }
    ++it->snapshots;
    it->started = std::max(it->started, s.run_started);
    it->first_t = std::min(it->first_t, s.t);
    if (s.t >= it->last_t) {
      it->last_t = s.t;
      it->example = s.path;
    }
  }
  return runs;
}

EMAKIT_FUNC std::vector<std::filesystem::path> interrupted_writes(const std::filesystem::path& folder) {
  std::vector<std::filesystem::path> out;
  for (const auto& entry : std::filesystem::directory_iterator(folder))
    if (detail::is_temporary_name(entry.path().filename().string())) out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace emakit

#endif  // EMAKIT_DEFINITIONS
