// A part of emakit's implementation compiled in a file of its own: the post-hoc EMA
// (<emakit/posthoc.hpp>: PostHocEma, the snapshot files, the synthesis). A program that includes
// the part's headers links its target, emakit::posthoc, which adds src/posthoc.cpp (this file's one
// includer) beside emakit::emakit's src/emakit.cpp; a program that does not include them compiles
// none of it. The plain-include file (EMAKIT_IMPLEMENTATION before <emakit/emakit.hpp>,
// src/all.cpp) and libemakit.a compile every part (implementation.hpp).
#pragma once

#include <emakit/detail/implementation_part.hpp>

#include <emakit/posthoc.hpp>

#include <emakit/detail/serial/snapshot_file-inl.hpp>
#include <emakit/posthoc/options-inl.hpp>
#include <emakit/posthoc/profile_math-inl.hpp>
#include <emakit/posthoc/snapshot_folder-inl.hpp>
#include <emakit/posthoc/synthesis-inl.hpp>
#include <emakit/posthoc/target-inl.hpp>
#include <emakit/posthoc/tracker-inl.hpp>

// The one definition of what the part's headers refer to (detail/config.hpp's EMAKIT_LINK_CHECK).
EMAKIT_DEFINE_LINK_CHECK(define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_posthoc)
