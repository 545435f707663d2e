// The one place where emakit's use of c10d differs between LibTorch versions.
//
//   LibTorch 1.13  c10d::ProcessGroup has virtual collectives; ProcessGroupGloo (and NCCL) derive
//                  from it, so a backend *is* a process group.
//   LibTorch 2.x   c10d::ProcessGroup dispatches each collective to a c10d::Backend registered
//                  for the tensor's device type; ProcessGroupGloo is a Backend and must be wrapped.
//
// Everything else emakit calls (broadcast, allgather, gather, Work::wait with a timeout, Store)
// has the same signature in both (detail/collectives.hpp uses it directly). This header needs no
// Gloo headers.
#pragma once

#include <emakit/detail/config.hpp>

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#define EMAKIT_C10D_BACKENDS 1
#else
#define EMAKIT_C10D_BACKENDS 0
#endif

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// A process group made of one backend object (a ProcessGroupGloo, ProcessGroupNCCL, ...) whose
// tensors live on devices of type `device`: LibTorch 2.x wraps it in a ProcessGroup and registers
// it for that device type under its own name ("gloo", "nccl"); in 1.13 it is the group itself.
template <class BackendT>
c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(c10::intrusive_ptr<BackendT> backend,
                                                        const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                        int world, c10::DeviceType device) {
#if EMAKIT_C10D_BACKENDS
  const auto type = c10d::ProcessGroup::strToBackendType(backend->getBackendName());
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  group->setDefaultBackend(type);
  group->setBackend(device, type, c10::static_intrusive_pointer_cast<c10d::Backend>(backend));
  return group;
#else
  (void)store, (void)rank, (void)world, (void)device;
  return c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(backend);
#endif
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
