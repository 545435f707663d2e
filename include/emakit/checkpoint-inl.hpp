// The non-template definitions of checkpoint.hpp: included at the end of checkpoint.hpp in the all-inline mode
// (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/checkpoint-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/checkpoint.hpp> instead"
#endif

#include <emakit/checkpoint.hpp>

#include <fmt/format.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void save_ema_file(FunctionRef<void(torch::serialize::OutputArchive&)> save,
                               const std::filesystem::path& path) {
  torch::serialize::OutputArchive archive;
  save(archive);
  write_archive(archive, path);
}

EMAKIT_FUNC void load_ema_file(FunctionRef<void(torch::serialize::InputArchive&)> load,
                               const std::filesystem::path& path) {
  torch::serialize::InputArchive archive;
  read_archive(archive, path, "emakit::load");
  try {
    load(archive);
  } catch (const std::exception&) {
    rethrow_with_context(fmt::format(" (file '{}')", path.string()));
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
