// The non-template definitions of archive_file.hpp: included at the end of
// archive_file.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
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
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
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

namespace archive_file {

using archive_scan::Value;

// The dtype of a storage class the scan accepts ("FloatStorage": c10's name of the dtype, then
// "Storage"), whose element size the scan held the record to.
inline c10::ScalarType storage_dtype(const std::string& storage_class) {
  for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
    const auto type = static_cast<c10::ScalarType>(i);
    if (storage_class == std::string(c10::toString(type)) + "Storage") return type;
  }
  fail("the storage class torch.{} is not a dtype of this LibTorch", storage_class);
}

// build_pickle_dict's walk: each value built once, depth first (the scan held the depth to
// PickleValues::max_depth and refused cycles).
class DictBuilder {
 public:
  DictBuilder(const archive_scan::PickleValues& values, const ReadRecord& record)
      : values_(values.values), record_(record), built_(values.values.size()) {}

  c10::IValue build(std::size_t id) {
    if (!built_[id]) built_[id] = make(values_[id]);
    return *built_[id];
  }

 private:
  c10::IValue make(const Value& v) {
    switch (v.kind) {
      case Value::Kind::none: return {};
      case Value::Kind::boolean: return v.integer != 0;
      case Value::Kind::integer: return v.integer;
      case Value::Kind::real: return v.real;
      case Value::Kind::string: return v.text;
      case Value::Kind::tuple: {
        std::vector<c10::IValue> items;
        items.reserve(v.items.size());
        for (const std::size_t item : v.items) items.push_back(build(item));
        return c10::ivalue::Tuple::create(std::move(items));
      }
      case Value::Kind::list: return list(v);
      case Value::Kind::dict: {
        c10::impl::GenericDict dict(c10::AnyType::get(), c10::AnyType::get());
        dict.reserve(v.items.size() / 2);
        for (std::size_t i = 0; i + 1 < v.items.size(); i += 2)
          dict.insert_or_assign(build(v.items[i]), build(v.items[i + 1]));
        return dict;
      }
      case Value::Kind::tensor: return tensor(v);
      default:  // global, object, storage: the scan refused them inside a dict
        fail("read_pickle_dict: a {} inside the dict", archive_scan::kind_name(v.kind));
    }
  }
  c10::IValue list(const Value& v) {
    std::vector<c10::IValue> items;
    items.reserve(v.items.size());
    for (const std::size_t item : v.items) items.push_back(build(item));
    switch (v.element) {  // the scan held a typed list to its kind
      case Value::Kind::integer: {
        c10::List<std::int64_t> out;
        for (const auto& item : items) out.push_back(item.toInt());
        return out;
      }
      case Value::Kind::real: {
        c10::List<double> out;
        for (const auto& item : items) out.push_back(item.toDouble());
        return out;
      }
      case Value::Kind::boolean: {
        c10::List<bool> out;
        for (const auto& item : items) out.push_back(item.toBool());
        return out;
      }
      case Value::Kind::tensor: {
        c10::List<at::Tensor> out;
        for (const auto& item : items) out.push_back(item.toTensor());
        return out;
      }
      default: {
        c10::impl::GenericList out(c10::AnyType::get());
        for (auto& item : items) out.push_back(std::move(item));
        return out;
      }
    }
  }
  at::Tensor tensor(const Value& v) {
    const Value& storage = values_[v.items.at(0)];
    const c10::ScalarType dtype = storage_dtype(storage.storage_class);
    auto [it, added] = storages_.try_emplace(storage.text);
    if (added) {  // the whole record: every view the scan checked lies inside it
      auto [data, size] = record_(storage.text);
      it->second = c10::Storage(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, false);
    }
    const auto rank = static_cast<std::ptrdiff_t>(v.dims.size() / 2);
    const c10::IntArrayRef sizes(v.dims.data(), static_cast<std::size_t>(rank));
    const c10::IntArrayRef strides(v.dims.data() + rank, static_cast<std::size_t>(rank));
    at::Tensor t = at::empty({0}, at::TensorOptions().dtype(dtype)).set_(it->second, v.integer, sizes, strides);
    if (v.requires_grad) t.set_requires_grad(true);
    return t;
  }

  const std::vector<Value>& values_;
  const ReadRecord& record_;
  std::vector<std::optional<c10::IValue>> built_;
  std::map<std::string, c10::Storage> storages_;  // by record key
};

}  // namespace archive_file

EMAKIT_FUNC c10::impl::GenericDict build_pickle_dict(const archive_scan::PickleValues& values,
                                                     const ReadRecord& record) {
  return archive_file::DictBuilder(values, record).build(values.root).toGenericDict();
}

EMAKIT_FUNC c10::impl::GenericDict read_pickle_dict(const std::filesystem::path& path, const char* what) {
  check_checkpoint_path(path, what);
  archive_scan::PickleValues values;
  const std::vector<char> bytes = read_scanned_file(path, what, archive_scan::Root::dict, &values);
  try {
    caffe2::serialize::PyTorchStreamReader zip(std::make_shared<archive_scan::SpanReader>(bytes));
    return build_pickle_dict(values, [&](const std::string& key) { return zip.getRecord("data/" + key); });
  } catch (const c10::Error& e) {  // a record that does not inflate, a tensor LibTorch refuses
    fail("{}: '{}' is not a file torch.save wrote with a dict of tensors: {}", what, path.string(), first_line(e));
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
