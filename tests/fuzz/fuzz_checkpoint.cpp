// libFuzzer target for the readers of untrusted files: any bytes, as a file emakit is given.
// The first bytes choose the reader, as the file itself would:
//   0x80 (a pickle's PROTO)   the data.pkl of a torch.save dict (import_state): the scan's checker
//                             and, for a dict root it accepts, its check of the values
//                             (dict_values: kinds, cycles, depth), then the dict built from them as
//                             read_pickle_dict builds it (build_pickle_dict)
//   "EMAKITPH"                a post-hoc snapshot (SnapshotReader: the header, then each tensor)
//   anything else             a checkpoint given to emakit::load(ema, path) or
//                             EmaHook::load_checkpoint(path): the archive check first
//                             (detail/serial/archive_scan.hpp), then, for the archives it accepts,
//                             LibTorch's loader and emakit's own checks (names, shapes, config, CRC-32s)
// Any crash, sanitizer report, leak or timeout fails the run.
//
//   scripts/fuzz.sh                         build, make the seed corpus, run 60 s
//   EMAKIT_FUZZ_SECONDS=1800 scripts/fuzz.sh
//
// Two compilers: this file is built with clang (libFuzzer's coverage, AddressSanitizer,
// UndefinedBehaviorSanitizer), so the archive check and the pickle checker, which stand between
// the bytes and LibTorch, are instrumented. The rest (fuzz_glue.cpp: LibTorch's loaders, the dict
// builder and the snapshot reader, whose headers need c10's IValue) is built with g++ without
// instrumentation, like
// LibTorch itself: clang 14 cannot compile LibTorch 1.13's IValue headers in C++20 with
// libstdc++ 12 (std::vector<c10::IValue> of an incomplete type). The snapshot reader is therefore
// fuzzed blind (no coverage feedback): from valid seeds, with the header's CRC-32 made right
// (fuzz_glue.cpp), so that mutated headers reach the parser.
//
// With EMAKIT_FUZZ_MAKE_CORPUS=<folder> the target writes its seed corpus there and exits.
#include <emakit/detail/serial/archive_scan.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string_view>

// fuzz_glue.cpp
void emakit_fuzz_make_corpus(const char* folder);
void emakit_fuzz_load(const char* data, std::size_t size);
void emakit_fuzz_build_dict(const emakit::detail::archive_scan::PickleValues& values);
void emakit_fuzz_snapshot(const char* data, std::size_t size);

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* folder = std::getenv("EMAKIT_FUZZ_MAKE_CORPUS")) {
    emakit_fuzz_make_corpus(folder);
    std::exit(0);
  }
  return 0;
}

namespace {

// read_pickle_dict's steps on data.pkl, with every data/<n> record 256 bytes long.
void fuzz_pickle(std::span<const char> bytes) {
  namespace scan = emakit::detail::archive_scan;
  scan::PickleValues values;
  try {
    const scan::PickleRules rules{"the input", nullptr, [](const std::string&) { return std::int64_t{256}; }};
    scan::PickleChecker checker(bytes, rules, scan::Refuse{});
    if (checker.run().first != scan::Value::Kind::dict) return;
    values = std::move(checker).dict_values();
  } catch (const std::invalid_argument&) {
    return;  // the scan refuses it: nothing is built
  }
  emakit_fuzz_build_dict(values);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const char> bytes(reinterpret_cast<const char*>(data), size);
  const std::string_view text(bytes.data(), bytes.size());
  if (text.starts_with('\x80')) {
    fuzz_pickle(bytes);
    return 0;
  }
  if (text.starts_with("EMAKITPH")) {
    emakit_fuzz_snapshot(bytes.data(), bytes.size());
    return 0;
  }
  try {
    emakit::detail::scan_archive_bytes(bytes, "the input");
  } catch (const std::invalid_argument&) {
    return 0;  // refused: the expected outcome for most inputs
  }
  emakit_fuzz_load(bytes.data(), bytes.size());
  return 0;
}
