// interop's implementation file (<emakit/interop.hpp>, implementation/interop.hpp): compiled once
// per program that includes the part. emakit::interop adds it to the target that links it
// (installed as share/emakit/interop.cpp); libemakit.a (emakit::compiled) compiles the same part
// with the others, through src/all.cpp.
#define EMAKIT_IMPLEMENTATION 1
#include <emakit/implementation/interop.hpp>
