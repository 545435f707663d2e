// The one Catch2 main of emakit_tests (built without the tests' precompiled header).
// Catch2 returns the number of failed assertions; ctest reads exit status 77 as "skipped"
// (SKIP_RETURN_CODE, tests/skip.hpp), so a test case with exactly 77 failures would pass as a
// skip. Any failure exits 1.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

int main(int argc, char** argv) { return Catch::Session().run(argc, argv) == 0 ? 0 : 1; }
