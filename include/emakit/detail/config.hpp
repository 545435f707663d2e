// Header-only or compiled: where emakit's non-template code is compiled, and the one macro that
// picks it, EMAKIT_COMPILED.
//
// emakit is header-only by default (the `emakit::emakit` CMake target): every translation unit
// that includes it compiles what it uses. The `emakit::compiled` target links a small static
// library (src/) instead and defines EMAKIT_COMPILED for its users (without CMake: link
// libemakit.a and define EMAKIT_COMPILED yourself). This is the "separate compilation" of
// spdlog and Boost.Asio (a library .cpp that includes the definition files once):
//
// | part                                                   | header-only  | compiled mode       |
// |--------------------------------------------------------|--------------|---------------------|
// | archive check, checkpoint and snapshot I/O, CRC,       | inline, in   | declared here,      |
// | CPU update pass and plan, post-hoc solver, interop     | every TU     | defined once in lib |
// | Ema<...> of the aliases that need no user type          | instantiated | extern template,    |
// | (FixedEma, WarmupEma, RampEma, PowerEma, SwaAverage...) | per TU       | instantiated in lib |
// | the core under every Ema<...> (detail::EmaCore),        | inline, once | defined once in lib |
// | ModuleStorage's and save/load/describe's untyped parts  | per TU       |                     |
// | Ema<...> with your own policies or ModuleStorage<M>:    | instantiated per TU, in both modes |
// | its thin layer (the calls into the policies)            |                                    |
// | sharded/*, gloo.hpp, jit.hpp                           | inline, per TU, in both modes      |
//
// The library compiles the umbrella header <emakit/emakit.hpp> and interop.hpp. The sharded EMA,
// gloo.hpp and jit.hpp stay inline in both modes: they need c10d, Gloo and TorchScript, which the
// library would otherwise impose on every user.
//
// A header <name>.hpp with code that moves to the library declares its entry points with
// EMAKIT_FUNC and keeps the definitions (and the includes only they need) in <name>-inl.hpp,
// which the header includes at its end in header-only mode; in compiled mode src/emakit.cpp
// includes every -inl.hpp (a configure-time check in CMakeLists.txt keeps its list complete) and
// a user's translation unit that includes one is refused with an #error.
//
// Mixing the modes in one program is a link error, not undefined behaviour: every emakit name
// lives in the inline namespace emakit::EMAKIT_ABI_NAMESPACE, `compiled` or `header_only`
// (written `emakit::X` as ever), so a function that takes an emakit type, defined in a
// translation unit of one mode and called from one of the other, does not link, and the
// linker's message names both ("undefined reference to `f(emakit::header_only::Ema<...>&)'").
#pragma once

// Every header opens `namespace emakit::inline EMAKIT_ABI_NAMESPACE {` (scripts/abi_namespace.sed
// rewrites a plain `namespace emakit {`).
#if defined(EMAKIT_COMPILED)
#define EMAKIT_ABI_NAMESPACE compiled
#else
#define EMAKIT_ABI_NAMESPACE header_only
#endif

// The library's own translation units define their macros themselves: src/emakit.cpp
// EMAKIT_BUILDING_LIBRARY (it compiles the -inl.hpp files), src/aliases.cpp EMAKIT_INSTANTIATING.

// Functions defined in an -inl.hpp: external linkage in the library, inline in header-only mode.
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
