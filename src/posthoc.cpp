// The post-hoc EMA's implementation file (<emakit/posthoc.hpp>, implementation/posthoc.hpp):
// compiled once per program that includes the part. emakit::posthoc adds it to the target that
// links it (installed as share/emakit/posthoc.cpp); libemakit.a (emakit::compiled) compiles the
// same part with the others, through src/all.cpp.
#define EMAKIT_IMPLEMENTATION 1
#include <emakit/implementation/posthoc.hpp>
