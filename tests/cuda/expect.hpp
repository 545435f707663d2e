// What a CUDA test does when a check cannot run on this machine (no allocator statistics in this
// LibTorch, ...): EMAKIT_CUDA_UNAVAILABLE("why").
//
// All CUDA tests run in one process (ctest's cuda.all, benchmarks/gpu_check.sh), so a test cannot
// end the process to report itself skipped (tests/skip.hpp's exit 77 would also end every later
// test). Instead:
//   - with EMAKIT_EXPECT_CUDA=1 in the environment (a machine that must run every CUDA check:
//     benchmarks/gpu_check.sh sets it), the test FAILS, naming what was missing;
//   - otherwise the test records a named skip and returns; tests/cuda/main.cpp lists every
//     recorded skip after the run and exits 77 when nothing failed, so ctest reports cuda.all as
//     skipped (not passed) when part of it did not run.
#pragma once

#include <catch2/catch.hpp>

#include <cstdlib>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace emakit_cuda_test {

// EMAKIT_EXPECT_CUDA=1: every CUDA check must run here.
inline bool expect_cuda() {
  const char* v = std::getenv("EMAKIT_EXPECT_CUDA");
  return v != nullptr && std::string_view(v) == "1";
}

struct Skip {
  std::string test, why;
};

inline std::vector<Skip>& skips() {
  static std::vector<Skip> recorded;
  return recorded;
}

}  // namespace emakit_cuda_test

// Fails the test under EMAKIT_EXPECT_CUDA=1, else records a named skip; either way returns.
#define EMAKIT_CUDA_UNAVAILABLE(why)                                                                           \
  do {                                                                                                         \
    std::ostringstream emakit_unavailable_;                                                                    \
    emakit_unavailable_ << why;                                                                                \
    if (::emakit_cuda_test::expect_cuda())                                                                     \
      FAIL(emakit_unavailable_.str() << " (EMAKIT_EXPECT_CUDA=1: every CUDA check must run on this machine)"); \
    ::emakit_cuda_test::skips().push_back(                                                                     \
        {Catch::getResultCapture().getCurrentTestName(), emakit_unavailable_.str()});                          \
    WARN("SKIPPED: " << emakit_unavailable_.str());                                                            \
    return;                                                                                                    \
  } while (false)
