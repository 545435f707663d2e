// What a CUDA test does when a check cannot run on this machine (no allocator statistics in this
// LibTorch, ...): EMAKIT_CUDA_UNAVAILABLE("why").
//
// All CUDA tests run in one process (ctest's cuda.all, benchmarks/gpu_check.sh):
//   - with EMAKIT_EXPECT_CUDA=1 in the environment (a machine that must run every CUDA check:
//     benchmarks/gpu_check.sh sets it), the test FAILS, naming what was missing;
//   - otherwise it is EMAKIT_SKIP (tests/skip.hpp): a named skip, and the test returns;
//     tests/cuda/main.cpp lists every skip after the run and exits 77 when nothing failed, so
//     ctest reports cuda.all as skipped (not passed) when part of it did not run.
#pragma once

#include <catch2/catch.hpp>

#include "../skip.hpp"

#include <cstdlib>
#include <sstream>
#include <string_view>

namespace emakit_cuda_test {

// EMAKIT_EXPECT_CUDA=1: every CUDA check must run here.
inline bool expect_cuda() {
  const char* v = std::getenv("EMAKIT_EXPECT_CUDA");
  return v != nullptr && std::string_view(v) == "1";
}

}  // namespace emakit_cuda_test

// Fails the test under EMAKIT_EXPECT_CUDA=1, else records a named skip; either way returns.
#define EMAKIT_CUDA_UNAVAILABLE(why)                                                                           \
  do {                                                                                                         \
    std::ostringstream emakit_unavailable_;                                                                    \
    emakit_unavailable_ << why;                                                                                \
    if (::emakit_cuda_test::expect_cuda())                                                                     \
      FAIL(emakit_unavailable_.str() << " (EMAKIT_EXPECT_CUDA=1: every CUDA check must run on this machine)"); \
    EMAKIT_SKIP(emakit_unavailable_.str());                                                                    \
  } while (false)
