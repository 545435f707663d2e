// Archive files, the one read path and the one write path of every emakit checkpoint: a file is
// written atomically (atomic_file.hpp) and read only after archive_scan.hpp has checked it, so
// LibTorch's loader never runs on a file that holds code, unknown records or oversized tensors.
//
//   read_archive(archive, path, "emakit::load")      // an OutputArchive file: scan, then load
//   write_archive(archive, path)                      // atomically
//   read_pickle_dict(path, "import_state")            // a torch.save file of a plain dict
//
// A path that is missing or a directory is refused by name before anything is opened.
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
// same scan: a dict of tensors and plain values, nothing else. A torch.save(model.state_dict())
// file, an OrderedDict, is refused with the fix (torch.save(dict(...))): LibTorch cannot read it.
EMAKIT_FUNC c10::impl::GenericDict read_pickle_dict(const std::filesystem::path& path, const char* what);

// Refuses a checkpoint path that does not exist or is not a regular file (a directory), by name.
EMAKIT_FUNC void check_checkpoint_path(const std::filesystem::path& path, const char* what);

}  // namespace emakit::detail

#if EMAKIT_DEFINITIONS

#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/archive_scan.hpp>
#include <emakit/detail/serial/atomic_file.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>

namespace emakit::detail {

EMAKIT_FUNC void check_checkpoint_path(const std::filesystem::path& path, const char* what) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (status.type() == std::filesystem::file_type::not_found)
    fail("{}: no file '{}': the path does not exist", what, path.string());
  if (ec) fail("{}: cannot read '{}': {}", what, path.string(), ec.message());
  if (status.type() == std::filesystem::file_type::directory)
    fail("{}: '{}' is a directory, not a checkpoint file; give the path of the file in it", what, path.string());
  if (status.type() != std::filesystem::file_type::regular)
    fail("{}: '{}' is not a regular file, not a checkpoint file", what, path.string());
}

namespace archive_file {

// Whether data.pkl pickles an OrderedDict at its root: torch.save(model.state_dict()), protocol 2
// (torch.save's), begins PROTO 2, GLOBAL 'collections OrderedDict'. LibTorch's unpickler (1.13
// and 2.x alike) makes OrderedDict() None (it knows the global only as a tensor's empty backward
// hooks), then fails on the items with an internal assert that asks to report a bug to PyTorch;
// and state_dict()'s OrderedDict also carries its _metadata, set with opcodes that unpickler
// does not read (SETITEM, BUILD on a dict).
inline bool ordered_dict_root(std::string_view pickle) {
  constexpr std::string_view global{"ccollections\nOrderedDict\n"};
  return pickle.size() > 2 + global.size() && pickle[0] == '\x80' && pickle.substr(2, global.size()) == global;
}

}  // namespace archive_file

EMAKIT_FUNC void read_archive(torch::serialize::InputArchive& archive, const std::filesystem::path& path, const char* what) {
  check_checkpoint_path(path, what);
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
  check_checkpoint_path(path, what);
  scan_archive_file(path, what, archive_scan::Root::dict);
  const std::string plain = "save a plain dict: torch.save(dict(ema.state_dict()), path)";
  c10::IValue value;
  try {
    caffe2::serialize::PyTorchStreamReader zip(path.string());
    auto [data, size] = zip.getRecord("data.pkl");
    if (archive_file::ordered_dict_root(std::string_view(static_cast<const char*>(data.get()), size)))
      fail("{}: '{}' holds an OrderedDict (torch.save(ema.state_dict(), path)), which LibTorch cannot read; {}", what,
           path.string(), plain);
    // torch::jit::pickle_load's steps (readArchiveAndTensors), on the reader the check opened.
    const std::string_view pickle(static_cast<const char*>(data.get()), size);
    std::size_t at = 0;
    std::function<std::size_t(char*, std::size_t)> reader = [&](char* buffer, std::size_t n) {
      n = std::min(n, pickle.size() - at);
      std::memcpy(buffer, pickle.data() + at, n);
      at += n;
      return n;
    };
    std::function<at::DataPtr(const std::string&)> record = [&](const std::string& name) {
      return std::get<0>(zip.getRecord("data/" + name));
    };
    torch::jit::Unpickler unpickler(std::move(reader), torch::jit::TypeResolver{}, torch::jit::ObjLoader{},
                                    std::move(record), {});
    unpickler.set_version(zip.version());
    value = unpickler.parse_ivalue();
  } catch (const c10::Error& e) {
    // A nested OrderedDict (a dict whose value is a state_dict()) is None to LibTorch: its items
    // then fail on an internal assert.
    if (std::string_view(e.what_without_backtrace()).find("isGenericDict()") != std::string_view::npos)
      fail("{}: '{}' holds an OrderedDict inside its dict, which LibTorch cannot read; {}", what, path.string(), plain);
    fail("{}: '{}' is not a file torch.save wrote with a dict of tensors: {}; {}", what, path.string(), first_line(e),
         plain);
  }
  if (!value.isGenericDict())  // the scan accepts a dict only; kept for a reader that changes
    fail("{}: '{}' holds a {}, not a dict", what, path.string(), value.tagKind());
  return value.toGenericDict();
}

}  // namespace emakit::detail

#endif  // EMAKIT_DEFINITIONS
