// The one Catch2 main of emakit_tests and emakit_conformance_tests (built without the tests'
// precompiled header). Exit status: 0, 1 when anything failed, or EMAKIT_SKIP_EXIT (77 under
// ctest) when a test case was skipped and nothing failed (tests/skip.hpp).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "skip.hpp"

int main(int argc, char** argv) { return emakit_test::exit_status(Catch::Session().run(argc, argv)); }
