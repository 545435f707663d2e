// The non-template definitions of archive_file.hpp: included at the end of archive_file.hpp in the all-inline mode
// (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/archive_file-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/archive_file.hpp> instead"
#endif

#include <emakit/detail/serial/archive_file.hpp>

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
#include <cstddef>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

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

// Removes nested_placeholder's key from every dict inside `v` (see plain_root).
inline void drop_nested_placeholders(const c10::IValue& v) {
  if (v.isGenericDict()) {
    auto d = v.toGenericDict();
    static_cast<void>(d.erase(c10::IValue(std::string(archive_scan::nested_placeholder))));  // absent in most dicts
    for (const auto& item : d) drop_nested_placeholders(item.value());
  } else if (v.isList()) {
    for (const auto& item : v.toListRef()) drop_nested_placeholders(item);
  } else if (v.isTuple()) {
    for (const auto& item : v.toTupleRef().elements()) drop_nested_placeholders(item);
  }
}

}  // namespace archive_file

EMAKIT_FUNC void read_archive(torch::serialize::InputArchive& archive, const std::filesystem::path& path,
                              const char* what) {
  check_checkpoint_path(path, what);
  const std::vector<char> bytes = read_scanned_file(path, what);
  try {
    archive.load_from(bytes.data(), bytes.size());
  } catch (const std::exception& e) {
    fail("{}: '{}' is not a readable checkpoint (truncated or damaged?): {}", what, path.string(),
         first_line(e.what()));
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
  const std::vector<char> bytes = read_scanned_file(path, what, archive_scan::Root::dict);
  const std::string plain_dict = "save a plain dict: torch.save(dict(ema.state_dict()), path)";
  c10::IValue value;
  bool ordered = false;  // the root was an OrderedDict, read as a plain dict
  try {
    caffe2::serialize::PyTorchStreamReader zip(std::make_shared<archive_scan::SpanReader>(bytes));
    auto [data, size] = zip.getRecord("data.pkl");
    const std::string_view saved(static_cast<const char*>(data.get()), size);
    const std::optional<std::string> plain = plain_root(saved);
    const bool ordered_root = saved.substr(0, 27) == archive_scan::ordered_dict_root.substr(0, 27);
    if (!plain && ordered_root)
      fail("{}: '{}' holds an OrderedDict that emakit cannot read (torch.save's protocol 2 expected); {}", what,
           path.string(), plain_dict);
    ordered = plain.has_value() && ordered_root;
    // torch::jit::pickle_load's steps (readArchiveAndTensors), on the bytes the scan checked.
    const std::string_view pickle = plain ? std::string_view(*plain) : saved;
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
      fail("{}: '{}' holds an OrderedDict inside its dict, which LibTorch cannot read; {}", what, path.string(),
           plain_dict);
    fail("{}: '{}' is not a file torch.save wrote with a dict of tensors: {}; {}", what, path.string(), first_line(e),
         plain_dict);
  }
  if (!value.isGenericDict())  // the scan accepts a dict only; kept for a reader that changes
    fail("{}: '{}' holds a {}, not a dict", what, path.string(), value.tagKind());
  auto dict = value.toGenericDict();
  if (ordered) {
    const c10::IValue placeholder{std::string(archive_scan::placeholder)};
    const auto it = dict.find(placeholder);
    if (it == dict.end() || !it->value().isNone())  // the file held a key equal to the placeholder
      fail("{}: '{}' holds a key emakit reserves for reading an OrderedDict; {}", what, path.string(), plain_dict);
    dict.erase(it);
  }
  archive_file::drop_nested_placeholders(value);
  return dict;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
