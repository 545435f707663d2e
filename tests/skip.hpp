// The one way a test says it cannot run on this machine: EMAKIT_SKIP("why").
//
// EMAKIT_SKIP records the skip (the test case's name and why), reports a Catch2 warning
// "SKIPPED: why" and returns from the test case; the later test cases of the run still run. At the
// end, the test executable's main (exit_status below) lists every skipped test case and, when
// nothing failed, exits with EMAKIT_SKIP_EXIT: ctest runs each test file's cases as one test
// (tests/CMakeLists.txt, emakit_add_file_tests) with EMAKIT_SKIP_EXIT=77, and SKIP_RETURN_CODE 77
// makes it report that test as skipped, never as passed; scripts/test.sh names each skipped test
// in its summary and fails on any skip that this machine does not explain (EMAKIT_EXPECTED_SKIPS).
// Without EMAKIT_SKIP_EXIT (the binary run by hand, or by scripts/mutate.sh) a run with skips
// exits 0. A failure anywhere in the run exits 1, skips or not. Nothing after EMAKIT_SKIP runs in
// its test case, so put it before the checks it guards.
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace emakit_test {

struct Skipped {
  std::string test;
  std::string why;
};

// The test cases skipped in this process so far.
inline std::vector<Skipped>& skipped() {
  static std::vector<Skipped> list;
  return list;
}

// Records the skip of the running test case (the caller then returns from it).
inline void skip_test(const std::string& why) {
  skipped().push_back({Catch::getResultCapture().getCurrentTestName(), why});
  WARN("SKIPPED: " << why);
}

// EMAKIT_SKIP_EXIT as a number; 0 when it is not set.
inline int skip_exit_from_environment() {
  const char* code = std::getenv("EMAKIT_SKIP_EXIT");
  return code != nullptr && *code != '\0' ? std::atoi(code) : 0;
}

// The exit status of a test executable whose Catch2 session returned `failures` (the number of
// failed assertions, which Catch2 returns and which could be 77): 1 when anything failed; else,
// when a test case was skipped, `skip_code`, after naming each skipped case; else 0.
inline int exit_status(int failures, int skip_code = skip_exit_from_environment()) {
  const auto& list = skipped();
  if (!list.empty()) {
    std::printf("%zu test case(s) skipped, not run on this machine:\n", list.size());
    for (const auto& s : list) std::printf("  SKIPPED: %s: %s\n", s.test.c_str(), s.why.c_str());
    std::fflush(stdout);
  }
  if (failures != 0) return 1;
  return list.empty() ? 0 : skip_code;
}

}  // namespace emakit_test

// EMAKIT_SKIP(stream expression): e.g. EMAKIT_SKIP("no AVX2 on " << cpu). Returns from the caller.
#define EMAKIT_SKIP(why)                                 \
  do {                                                   \
    std::ostringstream emakit_skip_reason_;              \
    emakit_skip_reason_ << why;                          \
    ::emakit_test::skip_test(emakit_skip_reason_.str()); \
    return;                                              \
  } while (false)
