// The non-template definitions of snapshot_folder.hpp: included at the end of
// snapshot_folder.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/posthoc/snapshot_folder-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/posthoc/snapshot_folder.hpp> instead"
#endif

#include <emakit/posthoc/snapshot_folder.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC std::string snapshot_file_name(std::int64_t step, std::uint32_t profile) {
  return fmt::format("phema-{:010}-{}.emkit", step, profile);
}

EMAKIT_FUNC bool is_snapshot_file_name(const std::string& name) {
  constexpr std::string_view prefix = "phema-", suffix = ".emkit";
  return name.size() > prefix.size() + suffix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

EMAKIT_FUNC SnapshotInfo read_snapshot_info(const std::filesystem::path& path) {
  return detail::SnapshotReader(path).info();
}

EMAKIT_FUNC StateDict load_snapshot(const std::filesystem::path& path) {
  const detail::SnapshotReader reader(path);
  StateDict out;
  for (std::size_t i = 0; i < reader.info().tensors.size(); ++i)
    out.insert(reader.info().tensors[i].name, reader.read(i));
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
