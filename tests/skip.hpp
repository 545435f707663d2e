// The one way a test says it cannot run on this machine: EMAKIT_SKIP("why").
//
// Under ctest (which runs one Catch2 test case per process and sets EMAKIT_SKIP_EXIT=77 for
// every test it registers, tests/CMakeLists.txt), EMAKIT_SKIP prints "SKIPPED: why" and ends the
// process with exit status 77. SKIP_RETURN_CODE 77 makes ctest report the test as skipped, never
// as passed, and scripts/test.sh names each skipped test in its summary and fails on any skip
// that this machine does not explain (EMAKIT_EXPECTED_SKIPS).
//
// Run outside ctest (the whole binary at once, as scripts/mutate.sh does), ending the process
// would hide every later test case, so there EMAKIT_SKIP reports a Catch2 WARN and returns from
// the test case. Either way nothing after it runs, so put it before the checks it guards.
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

namespace emakit_test {

// True when the caller should return (outside ctest); does not return under ctest.
inline bool skip_test(const std::string& why) {
  const char* code = std::getenv("EMAKIT_SKIP_EXIT");
  if (code != nullptr && *code != '\0') {
    std::cout << "SKIPPED: " << why << std::endl;
    std::fflush(nullptr);
    std::_Exit(std::atoi(code));
  }
  WARN("SKIPPED: " << why);
  return true;
}

}  // namespace emakit_test

// EMAKIT_SKIP(stream expression): e.g. EMAKIT_SKIP("no AVX2 on " << cpu). Returns from the caller.
#define EMAKIT_SKIP(why)                                             \
  do {                                                               \
    std::ostringstream emakit_skip_reason_;                          \
    emakit_skip_reason_ << why;                                      \
    if (::emakit_test::skip_test(emakit_skip_reason_.str())) return; \
  } while (false)
