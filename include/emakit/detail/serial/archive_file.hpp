// Archive files, the one read path and the one write path of every emakit checkpoint: a file is
// written atomically (atomic_file.hpp) and read only after archive_scan.hpp has checked it, so
// LibTorch's loader never runs on a file that holds code, unknown records or oversized tensors.
//
//   read_archive(archive, path, "emakit::load")      // an OutputArchive file: scan, then load
//   write_archive(archive, path)                      // atomically
//   read_pickle_dict(path, "import_state")            // a torch.save file of a plain dict
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Dict.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>

namespace emakit::detail {

// Opens an archive file for reading. The file is scanned first: one that holds code, unknown
// records or tensors larger than their data is refused before LibTorch's loader runs anything
// in it; a missing, truncated or damaged file is an error that names it.
EMAKIT_FUNC void read_archive(torch::serialize::InputArchive& archive, const std::filesystem::path& path,
                              const char* what);

// Writes an archive to `path` atomically.
EMAKIT_FUNC void write_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path);

// Reads a file of Python's torch.save(dict) (or torch_pickle.hpp's write_tensor_dict), after the
// same scan: a dict of tensors and plain values, nothing else.
EMAKIT_FUNC c10::impl::GenericDict read_pickle_dict(const std::filesystem::path& path, const char* what);

}  // namespace emakit::detail

#if EMAKIT_DEFINITIONS

#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/archive_scan.hpp>
#include <emakit/detail/serial/atomic_file.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace emakit::detail {

EMAKIT_FUNC void read_archive(torch::serialize::InputArchive& archive, const std::filesystem::path& path, const char* what) {
  if (!std::filesystem::exists(path)) fail("{}: no file '{}'", what, path.string());
  scan_archive_file(path, what);
  try {
    archive.load_from(path.string());
  } catch (const std::exception& e) {
    fail("{}: '{}' is not a readable checkpoint (truncated or damaged?): {}", what, path.string(), first_line(e.what()));
  }
}

EMAKIT_FUNC void write_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path) {
  std::ostringstream bytes;
  archive.save_to(bytes);
  const std::string data = bytes.str();
  write_file_atomically(path, std::span<const char>(data.data(), data.size()));
}

EMAKIT_FUNC c10::impl::GenericDict read_pickle_dict(const std::filesystem::path& path, const char* what) {
  if (!std::filesystem::exists(path)) fail("{}: no file '{}'", what, path.string());
  scan_archive_file(path, what, archive_scan::Root::dict);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open '{}'", what, path.string());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const c10::Error& e) {
    fail("{}: '{}' is not a file torch.save wrote with a plain dict of tensors: {}", what, path.string(), first_line(e));
  }
  if (!value.isGenericDict())  // the scan accepts a dict only; kept for a reader that changes
    fail("{}: '{}' holds a {}, not a dict", what, path.string(), value.tagKind());
  return value.toGenericDict();
}

}  // namespace emakit::detail

#endif  // EMAKIT_DEFINITIONS
