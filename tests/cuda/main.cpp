// Main of emakit_cuda_tests: runs the CUDA tests when a CUDA device is present. Exit status:
//   0   every CUDA test ran and passed;
//   1   a test failed, or EMAKIT_EXPECT_CUDA=1 and LibTorch sees no CUDA device (a GPU machine
//       whose build or driver cannot reach its GPU must not pass as "skipped");
//   77  no CUDA device (without EMAKIT_EXPECT_CUDA=1), or every test that ran passed but some
//       check could not run here (EMAKIT_CUDA_UNAVAILABLE, tests/cuda/expect.hpp; listed by name):
//       ctest's SKIP_RETURN_CODE 77 reports cuda.all as skipped, never as passed.
// Catch2 returns the number of failed assertions: 77 of them must not read as a skip.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "expect.hpp"

#include <torch/cuda.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

int main(int argc, char** argv) {
  const char* expect = std::getenv("EMAKIT_EXPECT_CUDA");
  if (expect != nullptr && *expect != '\0' && std::string_view(expect) != "0" && std::string_view(expect) != "1") {
    std::printf("FAILED: EMAKIT_EXPECT_CUDA is '%s'; it is 1 (a CUDA device must be there) or 0/unset\n", expect);
    return 1;
  }
  if (!torch::cuda::is_available()) {
    if (emakit_cuda_test::expect_cuda()) {
      std::printf("FAILED: EMAKIT_EXPECT_CUDA=1 but LibTorch sees no CUDA device (device_count() = %d): the CUDA "
                  "tests did not run\n",
                  static_cast<int>(torch::cuda::device_count()));
      return 1;
    }
    std::printf("SKIPPED: no CUDA device here, so the CUDA tests did not run (EMAKIT_EXPECT_CUDA=1 makes this a "
                "failure)\n");
    return 77;
  }
  Catch::Session session;
  if (const int bad = session.applyCommandLine(argc, argv); bad != 0) return bad;
  const auto& config = session.configData();
  if (config.showHelp || config.listTests || config.listTestNamesOnly || config.listTags || config.listReporters)
    return session.run();  // a listing: Catch2's own exit status (the number listed)
  // 77 after a skip whatever EMAKIT_SKIP_EXIT says: benchmarks/gpu_check.sh runs it outside ctest.
  return emakit_test::exit_status(session.run(), 77);
}
