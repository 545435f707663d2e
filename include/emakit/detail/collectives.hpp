// The collectives of a sharded EMA over a c10d process group: each waits at most a timeout and
// turns a dead, stalled or failing rank into std::runtime_error on the others, never a hang.
//
//   detail::Communicator comm{group, timeout, device, rank, world};
//   auto rows = comm.exchange({a, b}, "what");          // every rank's row, by rank
//   auto bytes = comm.gather_bytes(send, to, "what");    // every rank's buffer, on rank `to` / all
//   detail::all_or_none(comm, "what", [&] { ... });      // an error on one rank is one on every rank
//
// Every rank of the group must call each of them, in the same order.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/check.hpp>

#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// Waits for a collective, at most `timeout`; a timeout or a failure of the collective (a peer
// that died closes its connections) throws std::runtime_error naming `what` and this rank.
inline void wait_collective(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout,
                            const std::string& what, int rank) {
  try {
    work->wait(timeout);
  } catch (const std::exception& e) {
    fail_runtime("{}: the collective failed on rank {} within the timeout of {} ms (a rank died, stalled or "
                 "left the group; the process group cannot be used any more): {}",
                 what, rank, timeout.count(), first_line(e.what()));
  }
}

// A process group with the timeout of every collective and the device its buffers live on (CPU
// for Gloo, a CUDA device for NCCL), seen from rank `rank` of `world`.
struct Communicator {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::chrono::milliseconds timeout{0};
  c10::Device device{c10::kCPU};
  int rank = 0;
  int world = 1;

  // All ranks' rows of `mine` (each the same length), by rank.
  std::vector<std::vector<std::int64_t>> exchange(const std::vector<std::int64_t>& mine,
                                                  const std::string& what) const {
    if (world == 1) return {mine};
    const auto k = static_cast<std::int64_t>(mine.size());
    at::Tensor in = at::empty({k}, at::TensorOptions().dtype(at::kLong));
    std::copy(mine.begin(), mine.end(), in.data_ptr<std::int64_t>());
    std::vector<at::Tensor> inputs{in.to(device)};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world; ++r) outputs[0].push_back(at::empty({k}, inputs[0].options()));
    wait_collective(group->allgather(outputs, inputs), timeout, what, rank);
    std::vector<std::vector<std::int64_t>> rows;
    for (const auto& t : outputs[0]) {
      const at::Tensor c = t.cpu().contiguous();
      rows.emplace_back(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + k);
    }
    return rows;
  }

  // Every rank's byte buffer `send` (each the same length, on `device`), by rank, on rank `to`
  // (all_ranks: on every rank); an empty vector on the ranks that receive nothing.
  std::vector<at::Tensor> gather_bytes(const at::Tensor& send, int to, const std::string& what) const {
    if (world == 1) return {send};
    std::vector<at::Tensor> inputs{send};
    std::vector<std::vector<at::Tensor>> outputs(1);
    const bool receiving = to == all_ranks || to == rank;
    if (receiving)
      for (int r = 0; r < world; ++r) outputs[0].push_back(at::empty_like(send));
    if (to == all_ranks) {
      wait_collective(group->allgather(outputs, inputs), timeout, what, rank);
    } else {
      if (!receiving) outputs.clear();
      c10d::GatherOptions options;
      options.rootRank = to;
      options.timeout = timeout;
      wait_collective(group->gather(outputs, inputs, options), timeout, what, rank);
    }
    if (!receiving) return {};
    return std::move(outputs[0]);
  }
};

// Runs `body` on this rank, then tells every rank whether every rank succeeded: a rank whose
// body threw rethrows its own error, the others throw an error naming it. No rank goes on alone.
template <class F>
void all_or_none(const Communicator& comm, const std::string& what, F&& body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  const auto rows = comm.exchange({error ? 1 : 0}, what);
  if (error) std::rethrow_exception(error);
  std::vector<int> failed;
  for (std::size_t r = 0; r < rows.size(); ++r)
    if (rows[r][0] != 0) failed.push_back(static_cast<int>(r));
  if (!failed.empty())
    fail_runtime("{}: failed on rank(s) {} (see the error there); nothing was done on any rank", what,
                 fmt::join(failed, ", "));
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
