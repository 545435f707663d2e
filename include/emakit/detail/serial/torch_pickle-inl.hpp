// The non-template definitions of torch_pickle.hpp: included at the end of
// torch_pickle.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/torch_pickle-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/torch_pickle.hpp> instead"
#endif

#include <emakit/detail/serial/torch_pickle.hpp>

#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/serial/posix_file.hpp>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <exception>
#include <filesystem>
#include <string>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void write_tensor_dict(const std::filesystem::path& path, const c10::impl::GenericDict& dict) {
  AtomicFile file(path);
  std::exception_ptr write_error;
  {
    // The zip writer calls back from C code: an exception must not cross it. A short write makes
    // the writer throw c10::Error, and the file's own error is rethrown below.
    caffe2::serialize::PyTorchStreamWriter zip([&](const void* data, std::size_t n) -> std::size_t {
      try {
        file.write(data, n);
        return n;
      } catch (...) {
        write_error = std::current_exception();
        return 0;
      }
    });
    try {
      std::vector<char> pickle;
      torch::jit::Pickler pickler(
          [&](const char* bytes, std::size_t n) { pickle.insert(pickle.end(), bytes, bytes + n); },
          /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
          /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
      pickler.protocol();
      pickler.pushIValue(c10::IValue(dict));
      pickler.stop();
      const auto& tensors = pickler.tensorData();
      for (std::size_t i = 0; i < tensors.size(); ++i) {
        const auto data = torch::jit::getWriteableTensorData(tensors[i]);
        zip.writeRecord("data/" + std::to_string(i), data.data(), data.sizeInBytes());
      }
      zip.writeRecord("data.pkl", pickle.data(), pickle.size());
      zip.writeEndOfFile();
    } catch (const c10::Error& e) {
      if (write_error) std::rethrow_exception(write_error);
      fail_runtime("cannot write '{}': {}", path.string(), e.what_without_backtrace());
    }
  }
  if (write_error) std::rethrow_exception(write_error);
  file.commit();
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
