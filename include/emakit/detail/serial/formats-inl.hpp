// The definitions of detail/serial/formats.hpp: included at the end of formats.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/formats-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/formats.hpp> instead"
#endif

#include <emakit/detail/serial/formats.hpp>

#include <emakit/detail/errors.hpp>
#include <emakit/version.hpp>

#include <fmt/format.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::formats {

EMAKIT_FUNC void check_version(const Format& format, std::int64_t found, std::string_view where,
                               std::string_view writer) {
  if (format.reads(found)) return;
  const std::string by = writer.empty() ? std::string() : fmt::format(" (written by emakit {})", writer);
  const std::string reads = format.oldest == format.version
                                ? fmt::format("version {}", format.version)
                                : fmt::format("versions {} to {}", format.oldest, format.version);
  const char* hint = found > format.version ? "; a newer emakit wrote it: update emakit to read it"
                     : found < 1            ? "; no emakit writes that version: the file is damaged"
                                            : "; an older emakit wrote it, which this emakit no longer reads";
  fail_format_version(found, "{}: {} version {}{}; this emakit ({}) reads {}{}", where, format.name, found, by,
                      version_string, reads, hint);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::formats
