// Header-only or compiled: where emakit's non-template code is compiled.
//
// emakit is header-only by default (the `emakit::emakit` CMake target): every translation unit
// that includes it compiles what it uses. The `emakit::compiled` target links a small static
// library (src/) instead and defines EMAKIT_COMPILED for its users, the way fmt does:
//
// | part                                                   | header-only  | compiled mode       |
// |--------------------------------------------------------|--------------|---------------------|
// | archive check, checkpoint and snapshot I/O, CRC,       | inline, in   | declared here,      |
// | CPU update pass and plan, post-hoc solver               | every TU     | defined once in lib |
// | Ema<...> of the aliases that need no user type          | instantiated | extern template,    |
// | (FixedEma, WarmupEma, RampEma, PowerEma, SwaAverage...) | per TU       | instantiated in lib |
// | Ema<...> with your own policies or ModuleStorage<M>     | instantiated per TU, in both modes |
//
// A header with code that moves to the library declares its entry points with EMAKIT_FUNC and
// keeps the definitions (and the internals only they use) in an `#if EMAKIT_DEFINITIONS` block:
// compiled in every TU in header-only mode, in src/emakit.cpp only in compiled mode.
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#define EMAKIT_DEFINITIONS 0
#else
#define EMAKIT_DEFINITIONS 1
#endif

#if defined(EMAKIT_COMPILED)
#define EMAKIT_FUNC
#else
#define EMAKIT_FUNC inline
#endif

// The aliases' Ema instantiations are declared `extern template` in compiled mode, except in
// the library's own instantiation unit (src/aliases.cpp), which defines them.
#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_INSTANTIATING)
#define EMAKIT_EXTERN_ALIASES 1
#else
#define EMAKIT_EXTERN_ALIASES 0
#endif
