// Instrumentation, not part of the update: how often this thread went through UpdateKernel's two
// doors (wait_for_update(), wait_for_model_reads()) and how many update_together() calls ran one
// fused pass. The tests read it to check that every accessor of the averages settles, and that the
// members of a group were fused; each event costs one increment of a thread_local.
#pragma once

#include <emakit/detail/config.hpp>

#include <cstdint>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
