// Streams and events for the update kernel on CUDA (and any other device with streams), through
// c10's device-generic API: c10::Stream, c10::Event, c10::StreamGuard and the guard
// implementation LibTorch registers for the device at run time (c10::impl::VirtualGuardImpl).
// Nothing here includes a CUDA header or links a CUDA library, so it compiles against a
// CPU-only LibTorch (Debian's 1.13) as well as a CUDA one; without a CUDA runtime, using a lane
// throws LibTorch's own "not linked with support for cuda devices" error.
//
// A Lane is the update's work on one device:
//   begin()  the side stream (when on) waits for the device's current stream, i.e. for the
//            optimizer step that produced the weights; the returned guard makes the side stream
//            current, so every ATen op in its scope (foreach lerps, staging copies) runs there.
//   finish() records `done` on the side stream.
//   wait()   makes the device's current stream wait for `done`: call it before anything on the
//            current stream writes the model (the next optimizer step) or reads the average.
// Without a side stream, begin() returns an empty guard and wait() does nothing: the work ran on
// the current stream, in order.
#pragma once

#include <emakit/detail/config.hpp>

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <optional>
#include <utility>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

class Lane {
 public:
  Lane(c10::Device device, bool side_stream)
      : device_(device), ready_(device.type()), done_(device.type()), use_side_(side_stream) {}

  c10::Device device() const noexcept { return device_; }

  // The stream the lane's work runs on: the side stream, or the device's current stream.
  c10::Stream stream() {
    if (!use_side_) return impl().getStream(device_);
    if (!side_) side_ = impl().getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
    return *side_;
  }

  // Orders the side stream after the current stream and makes it current for the guard's scope.
  std::optional<c10::StreamGuard> begin() {
    if (!use_side_) return std::nullopt;
    const c10::Stream side = stream();
    ready_.record(impl().getStream(device_));
    ready_.block(side);
    return std::optional<c10::StreamGuard>(std::in_place, side);
  }

  void finish() {
    if (!use_side_) return;
    done_.record(*side_);
    pending_ = true;
  }

  // The current stream waits for the lane's last update (asynchronous for the host).
  void wait() {
    if (!pending_) return;
    done_.block(impl().getStream(device_));
    pending_ = false;
  }

  // Blocks the host until the lane's stream has run everything queued on it so far (used before
  // the CPU reads staging buffers filled by non-blocking device-to-host copies).
  void synchronize_host() { impl().synchronizeStream(stream()); }

 private:
  c10::impl::VirtualGuardImpl impl() const { return c10::impl::VirtualGuardImpl(device_.type()); }

  c10::Device device_;
  c10::Event ready_;
  c10::Event done_;
  std::optional<c10::Stream> side_;
  bool use_side_ = false;
  bool pending_ = false;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
