// emakit version: the one source of the version numbers (CMake reads them with a regex).
#pragma once

#include <emakit/detail/config.hpp>

#define EMAKIT_VERSION_MAJOR 0
#define EMAKIT_VERSION_MINOR 1
#define EMAKIT_VERSION_PATCH 0

// EMAKIT_VERSION: major * 10000 + minor * 100 + patch, for #if comparisons.
#define EMAKIT_VERSION (EMAKIT_VERSION_MAJOR * 10000 + EMAKIT_VERSION_MINOR * 100 + EMAKIT_VERSION_PATCH)

namespace emakit::inline EMAKIT_ABI_NAMESPACE {
inline constexpr int version_major = EMAKIT_VERSION_MAJOR;
inline constexpr int version_minor = EMAKIT_VERSION_MINOR;
inline constexpr int version_patch = EMAKIT_VERSION_PATCH;
inline constexpr const char* version_string = "0.1.0";
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
