// The one Catch2 main of emakit_tests (built without the tests' precompiled header).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
