// emakit's non-template code, every part of it, compiled once per program (detail/config.hpp):
// the one translation unit that defines EMAKIT_IMPLEMENTATION before including <emakit/emakit.hpp>
// gets it here, and libemakit.a (emakit::compiled) is the same parts compiled into a library.
// With CMake, emakit::emakit adds only the core's file (src/emakit.cpp) to the target that links
// it, and emakit::posthoc and emakit::interop add their parts' (src/posthoc.cpp,
// src/interop.cpp): a trainer compiles what it includes.
#pragma once

#if !defined(EMAKIT_IMPLEMENTATION)
#error \
    "emakit/implementation.hpp is emakit's compiled code: include it only through <emakit/emakit.hpp> in the one file that defines EMAKIT_IMPLEMENTATION"
#endif

#include <emakit/implementation/core.hpp>
#include <emakit/implementation/interop.hpp>
#include <emakit/implementation/posthoc.hpp>
