// What every part of emakit's implementation (implementation/*.hpp) begins with: the checks that
// it is compiled where it belongs, EMAKIT_BUILDING_LIBRARY (which lets it include the -inl.hpp
// files), and EMAKIT_DEFINE_LINK_CHECK, with which each part defines the variable its headers
// refer to (detail/config.hpp's EMAKIT_LINK_CHECK).
#pragma once

#if !defined(EMAKIT_IMPLEMENTATION)
#error \
    "emakit/implementation/*.hpp are emakit's compiled code: compile src/emakit.cpp, src/posthoc.cpp or src/interop.cpp (emakit::emakit, emakit::posthoc and emakit::interop do), or define EMAKIT_IMPLEMENTATION in one file before including <emakit/emakit.hpp>"
#endif
#if defined(EMAKIT_HEADER_ONLY)
#error "emakit: EMAKIT_IMPLEMENTATION with EMAKIT_HEADER_ONLY: the all-inline mode has no implementation file"
#endif

#if !defined(EMAKIT_BUILDING_LIBRARY)
#define EMAKIT_BUILDING_LIBRARY 1
#endif

#include <emakit/detail/config.hpp>

#define EMAKIT_DEFINE_LINK_CHECK(symbol)                      \
  namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check { \
  extern const int symbol;                                    \
  const int symbol = 1;                                       \
  }
