// libFuzzer target for emakit's checkpoint loader: any bytes, as a file given to
// emakit::load(ema, path) or EmaHook::load_checkpoint(path) would be. The bytes go through the
// archive check first (detail/serial/archive_scan.hpp); those it accepts go on to LibTorch's loader
// and emakit's own checks (names, shapes, config, CRC-32s: fuzz_glue.cpp). Any crash,
// sanitizer report, leak or timeout fails the run.
//
//   scripts/fuzz.sh                         build, make the seed corpus, run 60 s
//   EMAKIT_FUZZ_SECONDS=1800 scripts/fuzz.sh
//
// Two compilers: this file is built with clang (libFuzzer's coverage, AddressSanitizer,
// UndefinedBehaviorSanitizer), so the archive check, which stands between the bytes and
// LibTorch, is instrumented. The loading after it (fuzz_glue.cpp) is built with g++ without
// instrumentation, like LibTorch itself: clang 14 cannot compile LibTorch 1.13's IValue headers
// in C++20 with libstdc++ 12 (std::vector<c10::IValue> of an incomplete type).
//
// With EMAKIT_FUZZ_MAKE_CORPUS=<folder> the target writes its seed corpus there and exits.
#include <emakit/detail/serial/archive_scan.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <stdexcept>

// fuzz_glue.cpp
void emakit_fuzz_make_corpus(const char* folder);
void emakit_fuzz_load(const char* data, std::size_t size);

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* folder = std::getenv("EMAKIT_FUZZ_MAKE_CORPUS")) {
    emakit_fuzz_make_corpus(folder);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const char> bytes(reinterpret_cast<const char*>(data), size);
  try {
    emakit::detail::scan_archive_bytes(bytes, "the input");
  } catch (const std::invalid_argument&) {
    return 0;  // refused: the expected outcome for most inputs
  }
  emakit_fuzz_load(bytes.data(), bytes.size());
  return 0;
}
