// emakit's core implementation file (implementation/core.hpp, detail/config.hpp): compiled once per
// program. emakit::emakit adds it to the target that links it (installed as
// share/emakit/emakit.cpp); libemakit.a (emakit::compiled) compiles the same part with the others,
// through src/all.cpp. Without CMake, a program defines EMAKIT_IMPLEMENTATION in one of its own
// files before including <emakit/emakit.hpp>, which compiles every part, this one included.
#define EMAKIT_IMPLEMENTATION 1
#include <emakit/implementation/core.hpp>
