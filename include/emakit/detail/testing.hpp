// Instrumentation for emakit's own tests, compiled only where EMAKIT_TESTING is defined: the test
// build defines it for its test programs and for the library they link (tests/CMakeLists.txt),
// and detail/config.hpp gives such a build ABI namespaces of their own (compiled_testing,
// header_only_testing), so that an instrumented translation unit and an uninstrumented one do not
// link together. In a user's program EMAKIT_TEST_HOOK(statement) expands to nothing and none of
// the names below exist.
//
// What the tests read: how often this thread went through UpdateKernel's two doors
// (wait_for_update(), wait_for_model_reads()) and how many update_together() calls ran one fused
// pass, to check that every accessor of the averages settles and that the members of a group were
// fused; and a seam in read_scanned_file, after the scan and before the bytes are returned, where a
// test replaces the file to check that what loads is what was scanned.
#pragma once

#include <emakit/detail/config.hpp>

#if defined(EMAKIT_TESTING)

#include <cstdint>
#include <filesystem>

#define EMAKIT_TEST_HOOK(...) __VA_ARGS__

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::testing {

struct SyncCounts {
  std::uint64_t settles = 0;          // wait_for_update()
  std::uint64_t waits = 0;            // wait_for_model_reads()
  std::uint64_t fused_calls = 0;      // update_together() calls that ran a GroupPass
  std::uint64_t fused_kernels = 0;    // the kernels those calls fused
  std::uint64_t fused_groupings = 0;  // of those calls, the ones that grouped the segments anew
};
inline SyncCounts& sync_counts() noexcept {
  thread_local SyncCounts counts;
  return counts;
}

// Called, when set, with the path read_scanned_file has just scanned.
using AfterScan = void (*)(const std::filesystem::path&);
inline AfterScan& after_scan() noexcept {
  static AfterScan hook = nullptr;
  return hook;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail::testing

#else

#define EMAKIT_TEST_HOOK(...)

#endif
