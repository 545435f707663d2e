// A part of emakit's implementation compiled in a file of its own: interop (<emakit/interop.hpp>:
// import_state and export_state, each Python peer's codec). A program that includes the part's
// headers links its target, emakit::interop, which adds src/interop.cpp (this file's one includer)
// beside emakit::emakit's src/emakit.cpp; a program that does not include them compiles none of it.
// The plain-include file (EMAKIT_IMPLEMENTATION before <emakit/emakit.hpp>, src/all.cpp) and
// libemakit.a compile every part (implementation.hpp).
#pragma once

#if !defined(EMAKIT_IMPLEMENTATION)
#error \
    "emakit/implementation/interop.hpp is emakit's compiled code: compile src/interop.cpp (emakit::interop does), or define EMAKIT_IMPLEMENTATION in one file before including <emakit/emakit.hpp>"
#endif
#if defined(EMAKIT_HEADER_ONLY)
#error "emakit: EMAKIT_IMPLEMENTATION with EMAKIT_HEADER_ONLY: the all-inline mode has no implementation file"
#endif

#if !defined(EMAKIT_BUILDING_LIBRARY)
#define EMAKIT_BUILDING_LIBRARY 1
#endif

#include <emakit/interop.hpp>

#include <emakit/interop-inl.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check {
// The one definition of what the part's headers refer to (detail/config.hpp's EMAKIT_LINK_CHECK).
extern const int define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_interop;
const int define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_interop = 1;
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check
