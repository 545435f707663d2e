// Archives taken apart into their records and put together again, for the tests that edit
// checkpoint files (test_checkpoint_files.cpp, test_optimizer_archives.cpp).
#pragma once

#include <emakit/detail/serial/archive_scan.hpp>

#include <caffe2/serialize/inline_container.h>

#include "helpers.hpp"

#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace emakit_test {

using Records = std::vector<std::pair<std::string, std::string>>;

// The records of a zip archive, without the archive's folder prefix and without the ones that
// LibTorch's writer adds by itself (version, byteorder, serialization id).
inline Records read_records(caffe2::serialize::PyTorchStreamReader& reader) {
  Records out;
  for (const auto& name : reader.getAllRecords()) {
    if (name == "version" || name == ".data/version" || name == "byteorder" || name == ".data/serialization_id")
      continue;
    auto [data, size] = reader.getRecord(name);
    out.emplace_back(name, std::string(static_cast<const char*>(data.get()), size));
  }
  return out;
}
inline Records read_records(const std::filesystem::path& path) {
  caffe2::serialize::PyTorchStreamReader reader(path.string());
  return read_records(reader);
}
inline Records read_records_from_bytes(const std::string& zip) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<emakit::detail::archive_scan::SpanReader>(std::span<const char>(zip.data(), zip.size())));
  return read_records(reader);
}

inline std::string zip_bytes(const Records& records) {
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t n) {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  for (const auto& [name, bytes] : records) writer.writeRecord(name, bytes.data(), bytes.size());
  writer.writeEndOfFile();
  return out;
}

inline void write_records(const std::filesystem::path& path, const Records& records) {
  write_bytes(path, zip_bytes(records));
}

}  // namespace emakit_test
