// The post-hoc EMA is a part of emakit compiled in a file of its own (implementation/posthoc.hpp):
// every header under posthoc/ includes this one, whose link check (detail/config.hpp) makes a
// program that includes them and lacks the part fail to link on a name that says what to do
// (link emakit::posthoc, or define EMAKIT_IMPLEMENTATION in one file).
#pragma once

#include <emakit/detail/config.hpp>

EMAKIT_LINK_CHECK(define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_posthoc)
