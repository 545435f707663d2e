// An Ema's two guard flags: whether it is bound (a moved-from Ema is detected), and whether an
// update() is running (a second one from another thread is refused).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>

#include <atomic>
#include <utility>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// true while an Ema is bound; a move leaves false behind, so a moved-from Ema is detected.
struct BoundFlag {
  bool value = false;
  BoundFlag() = default;
  BoundFlag(BoundFlag&& other) noexcept : value(std::exchange(other.value, false)) {}
  BoundFlag& operator=(BoundFlag&& other) noexcept {
    value = std::exchange(other.value, false);
    return *this;
  }
  BoundFlag& operator=(bool v) noexcept {
    value = v;
    return *this;
  }
  explicit operator bool() const noexcept { return value; }
};

// Set while an update() runs: a second update() that overlaps it (another thread) is refused.
// Moves make a fresh flag (an Ema is not moved while it updates).
struct BusyFlag {
  std::atomic<bool> value{false};
  BusyFlag() = default;
  BusyFlag(BusyFlag&&) noexcept {}
  BusyFlag& operator=(BusyFlag&&) noexcept { return *this; }
  // Takes the flag for the call `what`, or fails if an update holds it.
  void take(const char* what) {
    if (value.exchange(true, std::memory_order_acquire))
      fail("{}() was called while another update() of this Ema is running (from another thread); an Ema is not "
           "thread-safe: call it from one thread at a time, or behind a mutex",
           what);
  }
  void give_back() noexcept { value.store(false, std::memory_order_release); }
};

class BusyScope {
 public:
  BusyScope(BusyFlag& flag, const char* what) : flag_(flag) { flag_.take(what); }
  BusyScope(const BusyScope&) = delete;
  BusyScope& operator=(const BusyScope&) = delete;
  ~BusyScope() { flag_.give_back(); }

 private:
  BusyFlag& flag_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
