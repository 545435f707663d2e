// A part of emakit's implementation compiled in a file of its own: the post-hoc EMA
// (<emakit/posthoc.hpp>: PostHocEma, the snapshot files, the synthesis). A program that includes
// the part's headers links its target, emakit::posthoc, which adds src/posthoc.cpp (this file's one
// includer) beside emakit::emakit's src/emakit.cpp; a program that does not include them compiles
// none of it. The plain-include file (EMAKIT_IMPLEMENTATION before <emakit/emakit.hpp>,
// src/all.cpp) and libemakit.a compile every part (implementation.hpp).
#pragma once

#if !defined(EMAKIT_IMPLEMENTATION)
#error \
    "emakit/implementation/posthoc.hpp is emakit's compiled code: compile src/posthoc.cpp (emakit::posthoc does), or define EMAKIT_IMPLEMENTATION in one file before including <emakit/emakit.hpp>"
#endif
#if defined(EMAKIT_HEADER_ONLY)
#error "emakit: EMAKIT_IMPLEMENTATION with EMAKIT_HEADER_ONLY: the all-inline mode has no implementation file"
#endif

#if !defined(EMAKIT_BUILDING_LIBRARY)
#define EMAKIT_BUILDING_LIBRARY 1
#endif

#include <emakit/posthoc.hpp>

#include <emakit/detail/serial/snapshot_file-inl.hpp>
#include <emakit/posthoc/options-inl.hpp>
#include <emakit/posthoc/profile_math-inl.hpp>
#include <emakit/posthoc/snapshot_folder-inl.hpp>
#include <emakit/posthoc/synthesis-inl.hpp>
#include <emakit/posthoc/tracker-inl.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check {
// The one definition of what the part's headers refer to (detail/config.hpp's EMAKIT_LINK_CHECK).
extern const int define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_posthoc;
const int define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_posthoc = 1;
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check
