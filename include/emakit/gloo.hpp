// A c10d Gloo process group on one machine or a cluster, made the same way on LibTorch 1.13 and
// 2.x, for ShardedStorage (sharded.hpp) when the trainer has no process group of its own yet.
//
//   #include <emakit/gloo.hpp>
//   auto store = c10::make_intrusive<c10d::FileStore>("/tmp/run-42/store", world);  // or c10d::TCPStore
//   auto group = emakit::make_gloo_group(store, rank, world, std::chrono::seconds(30));
//
// `timeout` is Gloo's own limit for every collective and for the rendezvous: a collective that a
// dead or stalled rank never joins fails after it instead of hanging. Give ShardedStorage the
// same value (a shorter one there ends the wait, but Gloo's worker thread stays blocked until
// this one passes, and the group's destructor waits for it).
//
// Needs the Gloo headers, which c10d's ProcessGroupGloo.hpp includes: Debian's libtorch-dev needs
// libgloo-dev for them, and the PyPI torch wheel ships none (its libtorch_cpu.so has Gloo built
// in); emakit's tests compile against libgloo-dev's headers for both, which works because
// ProcessGroupGloo.hpp only uses Gloo types through pointers and guards the newer Gloo store
// API (GLOO_STORE_HAS_STORE_V2). The umbrella header emakit.hpp does not include this one.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/c10d_compat.hpp>
#include <emakit/detail/check.hpp>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <string>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// A Gloo process group of `world` ranks, this process being `rank`, that meets through `store`
// and talks over TCP on `hostname` ("127.0.0.1": loopback, all ranks on this machine).
inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                              int world, std::chrono::milliseconds timeout,
                                                              const std::string& hostname = "127.0.0.1") {
  if (world <= 0) detail::fail("make_gloo_group: world must be > 0, got {}", world);
  if (rank < 0 || rank >= world) detail::fail("make_gloo_group: rank must be in [0, {}), got {}", world, rank);
  if (timeout.count() <= 0) detail::fail("make_gloo_group: timeout must be > 0 ms, got {}", timeout.count());
  store->setTimeout(timeout);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  options->threads = 2;
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
  return detail::as_process_group(std::move(backend), store, rank, world, c10::DeviceType::CPU);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
