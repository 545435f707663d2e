// The non-template definitions of checkpoint.hpp: included at the end of checkpoint.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/checkpoint-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/checkpoint.hpp> instead"
#endif

#include <emakit/checkpoint.hpp>

#include <fmt/format.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void save_state_file(const StateDict& state, const std::filesystem::path& path) {
  torch::serialize::OutputArchive archive;
  ema_state::save_archive(archive, state);
  write_archive(archive, path);
}

EMAKIT_FUNC LoadReport load_ema_file(EmaBase& ema, const std::filesystem::path& path, LoadMode mode) {
  return load_state_file(path, [&](const StateDict& state) { return ema.load_state_dict(state, mode); });
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
