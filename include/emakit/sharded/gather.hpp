// The whole average of a sharded EMA, assembled from every rank's share: gathered by name
// (gather_averages, gather_state_dict) or swapped into a model for evaluation (swap_gathered_into,
// through the Ema's own SwapGuard). Each call is a collective.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/collectives.hpp>
#include <emakit/ema.hpp>
#include <emakit/sharded/storage.hpp>

#include <ATen/ops/empty.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

inline std::vector<at::Tensor> ShardedStorage::gather_tensors(int to, const std::string& what) const {
  if (to != all_ranks && (to < 0 || to >= world_))
    detail::fail("{}: the destination rank must be in [0, {}) or all_ranks, got {}", what, world_, to);
  std::vector<std::int64_t> bytes(static_cast<std::size_t>(world_), 0);
  for (const auto& e : entries_)
    for (const auto& p : e.pieces) bytes[static_cast<std::size_t>(p.rank)] += p.length * e.element_size();
  const std::int64_t longest = std::max<std::int64_t>(1, *std::max_element(bytes.begin(), bytes.end()));
  at::Tensor send = at::empty({longest}, at::TensorOptions().dtype(at::kByte).device(comm_device_));
  {
    c10::NoGradGuard no_grad;
    std::int64_t cursor = 0;
    for (const auto& e : entries_) {
      const auto* p = e.piece_of(rank_);
      if (p == nullptr) continue;
      const std::int64_t n = p->length * e.element_size();
      send.narrow(0, cursor, n).copy_(detail::byte_view(e.local.contiguous()));
      cursor += n;
    }
  }
  const std::vector<at::Tensor> received = communicator().gather_bytes(send, to, what);  // by rank
  if (received.empty()) return {};
  std::vector<at::Tensor> out;
  out.reserve(entries_.size());
  std::vector<std::int64_t> cursor(static_cast<std::size_t>(world_), 0);
  c10::NoGradGuard no_grad;
  for (const auto& e : entries_) {
    at::Tensor full = at::empty(e.full_shape, at::TensorOptions().dtype(e.dtype).device(e.device));
    at::Tensor full_bytes = detail::byte_view(full);
    for (const auto& p : e.pieces) {
      const std::int64_t n = p.length * e.element_size();
      auto& c = cursor[static_cast<std::size_t>(p.rank)];
      full_bytes.narrow(0, p.offset * e.element_size(), n)
          .copy_(received[static_cast<std::size_t>(p.rank)].narrow(0, c, n));
      c += n;
    }
    out.push_back(std::move(full));
  }
  return out;
}

template <class E>
torch::OrderedDict<std::string, at::Tensor> ShardedStorage::gather(const E& ema, int to) const {
  const std::string what = "emakit::gather_averages";
  check_agreement(ema, what);
  auto full = gather_tensors(to, what);
  torch::OrderedDict<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < full.size(); ++i) {
    // A tied tensor is gathered once and listed under each of its names, as Ema::averages() does.
    out.insert(entries_[i].name, full[i]);
    for (const auto& alias : entries_[i].aliases) out.insert(alias, full[i]);
  }
  return out;
}

// The whole average by name, in the model's order, on rank `to` (all_ranks: every rank); empty on
// the other ranks. Collective. The tensors are new (not the EMA's own).
template <DecayPolicy D, SchedulePolicy S>
StateDict gather_averages(const Ema<D, S, ShardedStorage>& ema, int to = all_ranks) {
  return ema.storage().gather(ema, to);
}

// What a single-process Ema's state_dict() holds (config, counters, every average) on rank `to`
// (all_ranks: every rank); empty elsewhere. A plain Ema with the same policies loads it.
template <DecayPolicy D, SchedulePolicy S>
StateDict gather_state_dict(const Ema<D, S, ShardedStorage>& ema, int to = all_ranks) {
  StateDict averages = gather_averages(ema, to);
  StateDict out;
  if (averages.is_empty() && !ema.storage().layout().empty()) return out;
  for (const auto& item : ema.state_dict())
    if (!detail::ema_state::is_average_key(item.key())) out.insert(item.key(), item.value());
  for (const auto& item : averages) out.insert(detail::ema_state::average_key(item.key()), item.value());
  return out;
}

// Holds the whole EMA average in a model until its scope ends, then restores the model's own
// weights (also on an exception): the Ema's own SwapGuard, so the Ema refuses update() while it
// is open, as after swap_into(). Made by swap_gathered_into().
using GatheredSwap = SwapGuard;

// Gathers the whole average to every rank and puts it into `model` (matched by name) until the
// guard's scope ends: Ema::swap_gathered_into(). Collective. For a model of replicated parameters
// (for already-sharded ones, Ema::swap_into() swaps this rank's slices).
template <DecayPolicy D, SchedulePolicy S>
[[nodiscard]] GatheredSwap swap_gathered_into(const Ema<D, S, ShardedStorage>& ema, torch::nn::Module& model) {
  return ema.swap_gathered_into(model);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
