// A part of emakit's implementation compiled in a file of its own: interop (<emakit/interop.hpp>:
// import_state and export_state, each Python peer's codec). A program that includes the part's
// headers links its target, emakit::interop, which adds src/interop.cpp (this file's one includer)
// beside emakit::emakit's src/emakit.cpp; a program that does not include them compiles none of it.
// The plain-include file (EMAKIT_IMPLEMENTATION before <emakit/emakit.hpp>, src/all.cpp) and
// libemakit.a compile every part (implementation.hpp).
#pragma once

#include <emakit/detail/implementation_part.hpp>

#include <emakit/interop.hpp>

#include <emakit/interop-inl.hpp>

// The one definition of what the part's headers refer to (detail/config.hpp's EMAKIT_LINK_CHECK).
EMAKIT_DEFINE_LINK_CHECK(define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_interop)
