// Main of emakit_cuda_tests: runs the CUDA tests when a CUDA device is present, and otherwise
// says so and exits with 77, which ctest counts as skipped.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <torch/cuda.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::printf("SKIPPED: no CUDA device here, so the CUDA tests did not run\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
