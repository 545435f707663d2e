// emakit's implementation file (detail/config.hpp, implementation.hpp): compiled once per
// program. emakit::emakit adds it to the target that links it (installed as share/emakit/emakit.cpp);
// emakit::compiled compiles it into libemakit.a. Without CMake, a program compiles this file, or
// defines EMAKIT_IMPLEMENTATION in one of its own files before including <emakit/emakit.hpp>.
#define EMAKIT_IMPLEMENTATION 1
#include <emakit/emakit.hpp>
