// The compiled mode's one definition of emakit's non-template code (detail/config.hpp): built
// with EMAKIT_BUILDING_LIBRARY, so every header's `#if EMAKIT_DEFINITIONS` block is compiled
// here, once, with external linkage, instead of inline in each user's translation unit.
#include <emakit/emakit.hpp>
#include <emakit/interop.hpp>
