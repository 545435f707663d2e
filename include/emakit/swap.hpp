// emakit::SwapGuard: the EMA weights in the model for a scope, the model's own weights back when
// it ends (Ema::swap_into(), Ema::swap_gathered_into()), and the process-wide registry of the
// model memory that open swaps hold, so that every Ema bound to a model sees that it holds an
// EMA's weights.
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

namespace detail {

// The state of one Ema's swap: the model's tensors that hold the EMA weights, a copy of their
// own weights, and how many SwapGuards are open on it. The weights go back when the last guard
// ends, in whatever order the guards end. While open, the tensors' memory is registered
// (swap_registry), so that every Ema bound to the same model sees that the model holds an EMA's
// weights, not its own.
struct SwapState {
  int guards = 0;
  std::vector<at::Tensor> targets;
  std::vector<at::Tensor> backup;
};

// The model memory that open swaps hold, across every Ema of the process: storage -> the
// SwapState holding it. `open` counts entries, read without the lock so that an update with no
// swap anywhere costs one atomic load.
struct SwapRegistry {
  std::mutex mutex;
  std::unordered_map<const void*, const SwapState*> holders;
  std::atomic<std::size_t> open{0};

  static const void* key(const at::Tensor& t) {
    return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  }
  // The swap (other than `self`) that holds one of `tensors`, or null.
  template <class Tensors>
  const SwapState* holder(const Tensors& tensors, const SwapState* self) {
    if (open.load(std::memory_order_acquire) == 0) return nullptr;
    std::lock_guard lock(mutex);
    for (const at::Tensor& t : tensors) {
      auto it = holders.find(key(t));
      if (it != holders.end() && it->second != self) return it->second;
    }
    return nullptr;
  }
  void add(const SwapState* s) {
    std::lock_guard lock(mutex);
    for (const auto& t : s->targets)
      if (const void* k = key(t)) holders.emplace(k, s);
    open.store(holders.size(), std::memory_order_release);
  }
  void remove(const SwapState* s) noexcept {
    std::lock_guard lock(mutex);
    for (auto it = holders.begin(); it != holders.end();) it = it->second == s ? holders.erase(it) : std::next(it);
    open.store(holders.size(), std::memory_order_release);
  }
};

inline SwapRegistry& swap_registry() {
  static SwapRegistry registry;
  return registry;
}

}  // namespace detail

class SwapGuard;
class EmaBase;
namespace detail {
SwapGuard open_swap(std::shared_ptr<SwapState> state);
}  // namespace detail

// Holds the EMA weights in the model for its scope and restores the model's own weights when the
// scope ends, also when it ends by an exception. Made by Ema::swap_into() (and by
// swap_gathered_into() for a sharded EMA). Guards of one Ema may nest and may end in any order: the
// model gets its own weights back when the last one ends.
class SwapGuard {
 public:
  SwapGuard(const SwapGuard&) = delete;
  SwapGuard& operator=(const SwapGuard&) = delete;
  SwapGuard(SwapGuard&& other) noexcept : state_(std::move(other.state_)) {}
  SwapGuard& operator=(SwapGuard&&) = delete;
  ~SwapGuard() { restore(); }

  // Ends this guard now (the destructor then does nothing); the model's own weights come back if
  // it was the last open guard of its Ema.
  void restore() noexcept {
    if (!state_) return;
    auto state = std::move(state_);
    if (--state->guards > 0) return;
    c10::NoGradGuard no_grad;
    for (std::size_t i = 0; i < state->targets.size(); ++i) {
      try {
        state->targets[i].copy_(state->backup[i]);
      } catch (...) {  // a destructor must not throw; the copy of a same-shaped tensor cannot fail short of OOM
      }
    }
    detail::swap_registry().remove(state.get());
    state->targets.clear();
    state->backup.clear();
  }

  bool active() const noexcept { return static_cast<bool>(state_); }

 private:
  friend class EmaBase;
  friend SwapGuard detail::open_swap(std::shared_ptr<detail::SwapState> state);
  explicit SwapGuard(std::shared_ptr<detail::SwapState> state) : state_(std::move(state)) { ++state_->guards; }

  std::shared_ptr<detail::SwapState> state_;
};

namespace detail {
// The first guard of a swap whose targets are about to receive EMA weights (their own weights are
// in `backup`): registers the targets' memory, so that every Ema bound to them sees the swap.
inline SwapGuard open_swap(std::shared_ptr<SwapState> state) {
  SwapGuard guard(state);
  swap_registry().add(state.get());
  return guard;
}
}  // namespace detail

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
