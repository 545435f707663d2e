// Every part of emakit's implementation in one file (implementation.hpp): libemakit.a's
// (emakit::compiled), and exactly the two lines that docs/building.md tells a user without CMake to
// write in one file of their program (compile_fail.mode_mix_control_default links it so).
#define EMAKIT_IMPLEMENTATION
#include <emakit/emakit.hpp>
