// Where emakit's non-template code is compiled, and the macros that pick it.
//
// emakit is used from its headers alone, with nothing to build or install first, but its
// non-template code (the update kernel's ISA copies, the CPU pass, serialization, interop, the
// post-hoc solver) is compiled once per program, in one translation unit, instead of in every
// translation unit that includes it (the stb/doctest pattern):
//
// | mode                       | how                                          | the non-template code        |
// |----------------------------|----------------------------------------------|------------------------------|
// | default                    | CMake: link `emakit::emakit`. Without CMake: | one file of your program:    |
// |                            | in ONE .cpp, `#define EMAKIT_IMPLEMENTATION` | emakit::emakit adds it to    |
// |                            | before `#include <emakit/emakit.hpp>`        | your target, optimized      |
// |                            |                                              | whatever your build type     |
// | compiled library           | link `emakit::compiled` (libemakit.a)        | the library, with the flat   |
// |                            | (macro: EMAKIT_COMPILED)                     | aliases' Ema instantiated    |
// | all inline (the old mode)  | `emakit::header_only`, or define             | inline, in every TU that     |
// |                            | EMAKIT_HEADER_ONLY in every TU               | includes emakit              |
//
// In the default mode the implementation comes in parts (implementation/*.hpp): the core, which
// emakit::emakit adds (src/emakit.cpp: everything <emakit/emakit.hpp> declares), and the parts
// with headers of their own outside the umbrella, the post-hoc EMA (<emakit/posthoc.hpp>,
// emakit::posthoc, src/posthoc.cpp) and interop (<emakit/interop.hpp>, emakit::interop,
// src/interop.cpp), so that a trainer compiles only what it includes. The one-macro file and
// libemakit.a compile every part (implementation.hpp, src/all.cpp).
//
// In all three, Ema<...> with your own policies or ModuleStorage<M> (its thin layer) is
// instantiated in your translation units, and sharded/*, gloo.hpp and jit.hpp stay inline: they
// need c10d, Gloo and TorchScript, which the implementation would otherwise impose on every user.
//
// A header <name>.hpp with code that is compiled once declares its entry points with EMAKIT_FUNC
// and keeps the definitions (and the includes only they need) in <name>-inl.hpp, which the header
// includes at its end in the all-inline mode; otherwise one part of the implementation includes it
// (a configure-time check in CMakeLists.txt keeps the parts' lists complete, each -inl.hpp in one
// part) and a translation unit that includes one elsewhere is refused with an #error.
//
// Mixing the modes in one program is a link error, not undefined behaviour: every emakit name
// lives in the inline namespace emakit::EMAKIT_ABI_NAMESPACE, `compiled` (the default and the
// library) or `header_only` (all inline), written `emakit::X` as ever, so a function that takes
// an emakit type, defined in a translation unit of one mode and called from one of the other,
// does not link, and the linker's message names both ("undefined reference to
// `f(emakit::header_only::Ema<...>&)'"). A program in the default mode whose implementation is
// missing fails to link on a symbol that says what to do
// (link_check::define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_emakit), and one
// that includes the post-hoc EMA or interop without its part on the part's own
// (..._or_link_emakit_posthoc, ..._or_link_emakit_interop).
#pragma once

#if defined(EMAKIT_HEADER_ONLY) && (defined(EMAKIT_COMPILED) || defined(EMAKIT_IMPLEMENTATION))
#error \
    "emakit: EMAKIT_HEADER_ONLY (everything inline, emakit::header_only) cannot be combined with EMAKIT_COMPILED (emakit::compiled) or EMAKIT_IMPLEMENTATION (the one file that compiles emakit's code): pick one mode for the whole program"
#endif

// The aliases' Ema instantiations are declared `extern template` when the program links the
// compiled library (EMAKIT_COMPILED given by emakit::compiled or by the user), except in the
// library's own instantiation unit (src/aliases.cpp), which defines them. The default mode
// (EMAKIT_COMPILED implied below) instantiates them where they are used.
#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_INSTANTIATING)
#define EMAKIT_EXTERN_ALIASES 1
#else
#define EMAKIT_EXTERN_ALIASES 0
#endif

// The default mode compiles like the library's users: the non-template code is declared here and
// defined in one place (implementation.hpp), with the same mangled names as libemakit.a's.
#if !defined(EMAKIT_HEADER_ONLY) && !defined(EMAKIT_COMPILED)
#define EMAKIT_COMPILED 1
#endif

// Every header opens `namespace emakit::inline EMAKIT_ABI_NAMESPACE {` (scripts/abi_namespace.sed
// rewrites a plain `namespace emakit {`). emakit's own test build, EMAKIT_TESTING, compiles the
// tests' instrumentation in (detail/testing.hpp) and has namespaces of its own, so that a test
// object linked with an uninstrumented implementation, or the reverse, is a link error too.
// EMAKIT_ABI_NAMESPACE_NAME spells it, for the names of types that a checkpoint records without it.
#if defined(EMAKIT_COMPILED) && defined(EMAKIT_TESTING)
#define EMAKIT_ABI_NAMESPACE compiled_testing
#define EMAKIT_ABI_NAMESPACE_NAME "compiled_testing"
#elif defined(EMAKIT_COMPILED)
#define EMAKIT_ABI_NAMESPACE compiled
#define EMAKIT_ABI_NAMESPACE_NAME "compiled"
#elif defined(EMAKIT_TESTING)
#define EMAKIT_ABI_NAMESPACE header_only_testing
#define EMAKIT_ABI_NAMESPACE_NAME "header_only_testing"
#else
#define EMAKIT_ABI_NAMESPACE header_only
#define EMAKIT_ABI_NAMESPACE_NAME "header_only"
#endif

// Functions defined in an -inl.hpp: external linkage where compiled once, inline in the all-inline
// mode.
#if defined(EMAKIT_COMPILED)
#define EMAKIT_FUNC
#else
#define EMAKIT_FUNC inline
#endif

// The link checks. In the default and the library modes every translation unit refers to a
// variable that only the implementation defines (implementation/core.hpp): a program that lacks
// the implementation fails to link with the variable's name as the message, instead of on the
// first of emakit's functions it calls. Each part compiled in a file of its own
// (implementation/*.hpp: the post-hoc EMA, interop) is checked the same way by its own headers,
// with its CMake target in the name, so that only a program that includes the part needs it.
#if defined(EMAKIT_COMPILED)
#define EMAKIT_LINK_CHECK(symbol)                                     \
  namespace emakit::inline EMAKIT_ABI_NAMESPACE::link_check {         \
  extern const int symbol;                                            \
  [[gnu::used]] inline const int* const symbol##_reference = &symbol; \
  }
#else
#define EMAKIT_LINK_CHECK(symbol)
#endif
EMAKIT_LINK_CHECK(define_EMAKIT_IMPLEMENTATION_in_one_source_file_or_link_emakit_emakit)
