// ShardedStorage: an EMA split across the ranks of a c10d process group (Gloo on CPU, NCCL on GPU).
//
// Data-parallel training keeps the whole model on every rank, and a plain EMA keeps a whole copy
// on every rank too, computed identically N times. With ShardedStorage each rank keeps and
// updates only its share of the average (about 1/N of the bytes), with no communication per
// update; the whole average is gathered on demand, to every rank or to one.
//
//   #include <emakit/sharded.hpp>          // not in emakit.hpp: see "Why a header of its own"
//   #include <emakit/gloo.hpp>             // make_gloo_group, if the trainer has no group yet
//
//   auto group = emakit::make_gloo_group(store, rank, world, std::chrono::seconds(30));
//   emakit::ShardedWarmupEma ema(*model, {}, {}, {}, emakit::ShardedStorage(group, std::chrono::seconds(30)));
//   for (...) { ...; optimizer.step(); ema.update(); }              // local: no communication
//   emakit::StateDict full = emakit::gather_averages(ema);          // collective: every rank gets it all
//   emakit::StateDict on0 = emakit::gather_averages(ema, 0);        // only rank 0 gets it (others: empty)
//   { auto swapped = emakit::swap_gathered_into(ema, *model); evaluate(*model); }   // collective
//   emakit::save_sharded(ema, "ckpt/ema");     // collective: rank-<r>-of-<N>.pt per rank + index.pt
//   emakit::load_sharded(ema, "ckpt/ema");     // collective; any world size (resharding)
//
// Every decay and schedule policy works unchanged: the Ema runs the same update on the tensors
// this rank holds, and the storage only decides which those are.
//
// Replicated parameters (DDP): whole tensors, assigned by a greedy balance of bytes.
//   Every rank sees the same tensors in the same order, so every rank computes the same
//   assignment with no communication: tensors by decreasing size (ties: model order), each to
//   the rank that holds the fewest bytes so far (ties: the lowest rank). Whole tensors rather
//   than flat slices because (1) the update is then literally the single-process update of the
//   held tensors, so the gathered average equals a single-process EMA bit for bit; (2) a
//   checkpoint shard is an ordinary emakit state of whole named tensors; (3) nothing is split
//   mid-tensor, so CUDA averages keep one foreach call per (device, dtype). The cost: a model
//   dominated by one tensor larger than 1/N of the bytes balances no better than that tensor.
//   With more ranks than tensors some ranks hold nothing, which is fine.
//
// Already-sharded parameters (FSDP, ZeRO-3): each rank's model holds its own slice of a tensor.
//   Describe each such tensor with local_shard(name, LocalShard{full_shape, offset}): the local
//   tensor holds elements [offset, offset + local numel) of the row-major flattened full tensor.
//     - FSDP2 / DTensor Shard(0), torch.chunk(dim=0): LocalShard::dim0_chunk(full_shape, rank, world)
//     - FSDP1 / ZeRO-3 flat parameters: the slice of each original tensor that falls in this
//       rank's flat shard, i.e. LocalShard{shape, offset} with the offset FSDP reports
//       (flat_param._shard_param_infos); LocalShard::flat_chunk() splits one tensor evenly
//   The EMA of a slice is the slice of the EMA (the update is element-wise), so the rank keeps
//   the average of exactly its slices; Ema::swap_into() then swaps slices into the slices of the
//   sharded model, and gather_averages() assembles the whole tensors. Constructing an Ema with
//   local shards is a collective (the ranks exchange their slices once and check that they tile
//   every tensor exactly). Tensors without a local_shard are treated as replicated (above).
//
// Collectives. gather_averages, gather_state_dict, swap_gathered_into, save_sharded and
//   load_sharded must be called by every rank of the group, in the same order. Each first
//   exchanges the update counters (calls, step, num_updates, last_update_step) and a fingerprint
//   of the layout: ranks that disagree (a rank that updated once more, another model) make every
//   rank throw an error naming the ranks and their values. Each collective waits at most the
//   storage's timeout: a rank that died or stalled gives the others std::runtime_error, not a
//   hang. After such an error the process group is unusable (as in PyTorch); make the group with
//   the same timeout (make_gloo_group's argument), so that Gloo's own worker gives up too.
//
// On a sharded EMA, the Ema's own members see this rank's share only: averages(), state_dict(),
// copy_to(), swap_into(), torch::save(ema). Use the functions here for the whole average.
//
// Sharded checkpoints (save_sharded / load_sharded): in `dir`, each rank writes
//   rank-<r>-of-<N>.<id>.pt   what torch::save(ema) writes for its share (state + CRC-32 per
//                             tensor) plus the save id, its rank and N
// atomically, and after every rank succeeded rank 0 writes index.pt: the save id, N, the config
// and counters, and for each tensor its shape, dtype and which rank holds which flat range.
// The index is the commit point: a new save writes files under its own id and leaves those of
// the index in place, so a save that fails or is killed half-way leaves the previous checkpoint
// whole; once the new index is written, every rank removes the other saves' files.
// Loading with any world size reads the files that hold the ranges this rank now holds. A missing
// file, a file of another save (mixed set), a damaged file or another model is an error naming
// the file, on every rank; a failed load leaves the EMA unchanged on every rank.
//
// Why a header of its own: the c10d headers are only in LibTorch builds with USE_DISTRIBUTED,
// and they add to every translation unit's compile time; a trainer without processes should not
// pay for them. It needs nothing to link beyond LibTorch (c10d lives in libtorch_cpu).
#pragma once

#include <emakit/concepts.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/atomic_file.hpp>
#include <emakit/detail/c10d_compat.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/ema.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace emakit {

// This rank's slice of an already-sharded tensor: elements [offset, offset + local numel) of the
// row-major flattened tensor of shape `full_shape`.
struct LocalShard {
  std::vector<std::int64_t> full_shape;
  std::int64_t offset = 0;

  // torch.chunk(full, world, dim=0)[rank]: ceil(rows / world) rows per rank, the last ranks
  // fewer or none (DTensor Shard(0), FSDP2). The local tensor has shape [its rows, rest...].
  static LocalShard dim0_chunk(std::vector<std::int64_t> full_shape, int rank, int world) {
    check_rank(rank, world, "LocalShard::dim0_chunk");
    if (full_shape.empty()) detail::fail("LocalShard::dim0_chunk: a 0-d tensor has no dim 0 to split");
    const std::int64_t rows = full_shape[0];
    const std::int64_t chunk = (rows + world - 1) / world;
    std::int64_t inner = 1;
    for (std::size_t i = 1; i < full_shape.size(); ++i) inner *= full_shape[i];
    const std::int64_t first = std::min(rows, chunk * rank);
    return {std::move(full_shape), first * inner};
  }
  // ceil(numel / world) elements per rank of the flattened tensor, the last ranks fewer.
  static LocalShard flat_chunk(std::vector<std::int64_t> full_shape, int rank, int world) {
    check_rank(rank, world, "LocalShard::flat_chunk");
    std::int64_t n = 1;
    for (auto d : full_shape) n *= d;
    const std::int64_t chunk = (n + world - 1) / world;
    return {std::move(full_shape), std::min(n, chunk * rank)};
  }
  // The number of elements rank `rank` holds under dim0_chunk / flat_chunk.
  static std::int64_t dim0_chunk_rows(std::int64_t rows, int rank, int world) {
    const std::int64_t chunk = (rows + world - 1) / world;
    return std::max<std::int64_t>(0, std::min(rows, chunk * (rank + 1)) - std::min(rows, chunk * rank));
  }
  static std::int64_t flat_chunk_numel(std::int64_t numel, int rank, int world) { return dim0_chunk_rows(numel, rank, world); }

 private:
  static void check_rank(int rank, int world, const char* what) {
    if (world <= 0) detail::fail("{}: world must be > 0, got {}", what, world);
    if (rank < 0 || rank >= world) detail::fail("{}: rank must be in [0, {}), got {}", what, world, rank);
  }
};

// gather_averages(ema, all_ranks): every rank receives the whole average.
inline constexpr int all_ranks = -1;

// The file names of a sharded checkpoint.
inline constexpr std::string_view sharded_index_name = "index.pt";
// A rank's file carries the save's id, so a save never overwrites the files that the current
// index names: the index, written last, is the commit point of a save.
inline std::string sharded_file_name(int rank, int world, std::int64_t save_id) {
  return fmt::format("rank-{}-of-{}.{:016x}.pt", rank, world, static_cast<std::uint64_t>(save_id));
}
// The layout version of sharded checkpoints.
inline constexpr std::int64_t sharded_format_version = 1;

namespace detail {

// Flat range [offset, offset + length) of a tensor's elements, held by `rank`.
struct ShardPiece {
  int rank = 0;
  std::int64_t offset = 0;
  std::int64_t length = 0;
};

// One tensor of the EMA, as the whole group holds it.
struct ShardEntry {
  std::string name;
  std::vector<std::string> aliases;  // the tensor's other names in the model (tied), gathered under each
  std::vector<std::int64_t> full_shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
  c10::Device device{c10::kCPU};
  bool sliced = false;             // already sharded (local_shard), else a whole tensor on one rank
  std::vector<ShardPiece> pieces;  // by offset; pieces of length 0 are left out
  at::Tensor local;                // this rank's part (the Ema's own tensor); undefined if none

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : full_shape) n *= d;
    return n;
  }
  std::int64_t element_size() const { return static_cast<std::int64_t>(c10::elementSize(dtype)); }
  const ShardPiece* piece_of(int rank) const {
    for (const auto& p : pieces)
      if (p.rank == rank) return &p;
    return nullptr;
  }
};

// FNV-1a, for the layout fingerprint the ranks compare.
inline std::uint64_t fnv1a(const void* data, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A flat byte view of a contiguous tensor (aliases it).
inline at::Tensor byte_view(const at::Tensor& t) { return t.reshape({-1}).view(at::kByte); }

}  // namespace detail

// The average split across the ranks of a c10d process group. See the top of this file.
class ShardedStorage {
 public:
  static constexpr std::string_view name = "ShardedStorage";

  // `timeout`: how long each collective of a gather, save or load may take before it is an error.
  explicit ShardedStorage(c10::intrusive_ptr<c10d::ProcessGroup> group,
                          std::chrono::milliseconds timeout = std::chrono::minutes(5))
      : group_(std::move(group)), timeout_(timeout) {
    if (!group_) detail::fail("ShardedStorage: the process group is null; pass the c10d::ProcessGroup to shard over");
    if (timeout_.count() <= 0) detail::fail("ShardedStorage: timeout must be > 0 ms, got {}", timeout_.count());
  }

  // Declares tensor `tensor_name` already sharded: the model holds only this rank's slice.
  ShardedStorage& local_shard(std::string tensor_name, LocalShard shard) {
    for (auto d : shard.full_shape)
      if (d < 0) detail::fail("ShardedStorage::local_shard('{}'): full_shape {} has a negative size", tensor_name,
                              detail::shape_string(shard.full_shape));
    if (shard.offset < 0)
      detail::fail("ShardedStorage::local_shard('{}'): offset must be >= 0, got {}", tensor_name, shard.offset);
    local_shards_[std::move(tensor_name)] = std::move(shard);
    return *this;
  }
  // The device the gather buffers live on: CPU for Gloo (default), a CUDA device for NCCL.
  ShardedStorage& communication_device(c10::Device device) {
    comm_device_ = device;
    return *this;
  }

  std::vector<at::Tensor> create(const torch::nn::Module*, std::span<const TensorSpec> specs) {
    rank_ = group_->getRank();
    world_ = group_->getSize();
    entries_.clear();
    entries_.reserve(specs.size());
    for (const auto& item : local_shards_) {
      bool found = false;
      for (const auto& s : specs)
        found = found || s.name == item.first ||
                std::find(s.aliases.begin(), s.aliases.end(), item.first) != s.aliases.end();
      if (!found)
        detail::fail("ShardedStorage::local_shard names '{}', which the EMA does not hold (not in the model, or "
                     "ignored)",
                     item.first);
    }
    std::vector<std::size_t> whole;
    std::vector<std::size_t> sliced;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const auto& s = specs[i];
      detail::ShardEntry e;
      e.name = s.name;
      e.aliases = s.aliases;
      e.dtype = s.dtype;
      e.device = s.device;
      auto it = local_shards_.find(s.name);  // a tied tensor's slice may be given under any of its names
      for (std::size_t k = 0; it == local_shards_.end() && k < s.aliases.size(); ++k) it = local_shards_.find(s.aliases[k]);
      if (it != local_shards_.end()) {
        e.sliced = true;
        e.full_shape = it->second.full_shape;
        const std::int64_t n = e.numel(), here = s.source.numel();
        if (it->second.offset + here > n)
          detail::fail("ShardedStorage: the local slice of '{}' ({} elements at offset {}) does not fit in its full "
                       "shape {} ({} elements)",
                       s.name, here, it->second.offset, detail::shape_string(e.full_shape), n);
        e.pieces.push_back({rank_, it->second.offset, here});
        e.local = detail::detached_copy(s);
        sliced.push_back(i);
      } else {
        e.full_shape.assign(s.source.sizes().begin(), s.source.sizes().end());
        whole.push_back(i);
      }
      entries_.push_back(std::move(e));
    }
    // Whole tensors: greedy by bytes, the same on every rank.
    std::vector<std::size_t> order = whole;
    auto bytes = [&](std::size_t i) { return entries_[i].numel() * entries_[i].element_size(); };
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes(a) > bytes(b); });
    std::vector<std::int64_t> load(static_cast<std::size_t>(world_), 0);
    for (std::size_t i : order) {
      const auto best = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      load[static_cast<std::size_t>(best)] += bytes(i);
      auto& e = entries_[i];
      e.pieces.push_back({best, 0, e.numel()});
      if (best == rank_) e.local = detail::detached_copy(specs[i]);
    }
    if (!sliced.empty()) exchange_slices(sliced);
    fingerprint_ = layout_fingerprint();
    std::vector<at::Tensor> out;
    out.reserve(entries_.size());
    for (const auto& e : entries_) out.push_back(e.local);
    return out;
  }

  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const noexcept { return group_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  c10::Device communication_device() const noexcept { return comm_device_; }
  int rank() const noexcept { return rank_; }
  int world() const noexcept { return world_; }
  // Every tensor of the EMA with the ranks that hold it (empty before the Ema is made).
  const std::vector<detail::ShardEntry>& layout() const noexcept { return entries_; }
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }

  // Bytes of the average this rank keeps, and of the whole average over all ranks.
  std::int64_t held_bytes() const {
    std::int64_t n = 0;
    for (const auto& e : entries_)
      if (e.local.defined()) n += static_cast<std::int64_t>(e.local.nbytes());
    return n;
  }
  std::int64_t total_bytes() const {
    std::int64_t n = 0;
    for (const auto& e : entries_) n += e.numel() * e.element_size();
    return n;
  }
  // The rank that holds tensor `tensor_name` whole; -1 for an already-sharded tensor.
  int owner(const std::string& tensor_name) const {
    for (const auto& e : entries_)
      if (e.name == tensor_name) return e.sliced ? -1 : e.pieces.front().rank;
    detail::fail("ShardedStorage::owner: the EMA has no tensor '{}'", tensor_name);
  }

  // Two storages are equal when they shard over the same group with the same settings.
  bool operator==(const ShardedStorage& other) const noexcept {
    return group_.get() == other.group_.get() && timeout_ == other.timeout_ && comm_device_ == other.comm_device_;
  }

  // ---- collectives (used by the functions below; every rank must call them together) ------

  // All ranks' rows of `mine` (each the same length), by rank.
  std::vector<std::vector<std::int64_t>> exchange(const std::vector<std::int64_t>& mine, const std::string& what) const {
    if (world_ == 1) return {mine};
    const auto k = static_cast<std::int64_t>(mine.size());
    at::Tensor in = at::empty({k}, at::TensorOptions().dtype(at::kLong));
    std::copy(mine.begin(), mine.end(), in.data_ptr<std::int64_t>());
    std::vector<at::Tensor> inputs{in.to(comm_device_)};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < world_; ++r) outputs[0].push_back(at::empty({k}, inputs[0].options()));
    detail::wait_collective(group_->allgather(outputs, inputs), timeout_, what, rank_);
    std::vector<std::vector<std::int64_t>> rows;
    for (const auto& t : outputs[0]) {
      const at::Tensor c = t.cpu().contiguous();
      rows.emplace_back(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + k);
    }
    return rows;
  }

  // The whole tensors, in layout order, on rank `to` (all_ranks: on every rank); an empty vector
  // on the ranks that receive nothing.
  std::vector<at::Tensor> gather_tensors(int to, const std::string& what) const {
    if (to != all_ranks && (to < 0 || to >= world_))
      detail::fail("{}: the destination rank must be in [0, {}) or all_ranks, got {}", what, world_, to);
    std::vector<std::int64_t> bytes(static_cast<std::size_t>(world_), 0);
    for (const auto& e : entries_)
      for (const auto& p : e.pieces) bytes[static_cast<std::size_t>(p.rank)] += p.length * e.element_size();
    const std::int64_t longest = std::max<std::int64_t>(1, *std::max_element(bytes.begin(), bytes.end()));
    const auto byte_options = at::TensorOptions().dtype(at::kByte).device(comm_device_);
    at::Tensor send = at::empty({longest}, byte_options);
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
    std::vector<at::Tensor> received;  // by rank
    if (world_ == 1) {
      received.push_back(send);
    } else {
      std::vector<at::Tensor> inputs{send};
      std::vector<std::vector<at::Tensor>> outputs(1);
      const bool receiving = to == all_ranks || to == rank_;
      if (receiving)
        for (int r = 0; r < world_; ++r) outputs[0].push_back(at::empty({longest}, byte_options));
      if (to == all_ranks) {
        detail::wait_collective(group_->allgather(outputs, inputs), timeout_, what, rank_);
      } else {
        if (!receiving) outputs.clear();
        c10d::GatherOptions options;
        options.rootRank = to;
        options.timeout = timeout_;
        detail::wait_collective(group_->gather(outputs, inputs, options), timeout_, what, rank_);
      }
      if (!receiving) return {};
      received = std::move(outputs[0]);
    }
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

 private:
  // Every rank tells the others its slice of each already-sharded tensor; then each tensor's
  // slices must tile it exactly.
  void exchange_slices(const std::vector<std::size_t>& sliced) {
    std::uint64_t h = detail::fnv1a("sliced", 6);
    for (auto i : sliced) {
      h = detail::fnv1a(entries_[i].name.data(), entries_[i].name.size(), h);
      h = detail::fnv1a(entries_[i].full_shape.data(), entries_[i].full_shape.size() * sizeof(std::int64_t), h);
    }
    std::vector<std::int64_t> mine{static_cast<std::int64_t>(h)};
    for (auto i : sliced) {
      mine.push_back(entries_[i].pieces.front().offset);
      mine.push_back(entries_[i].pieces.front().length);
    }
    const auto rows = exchange(mine, "ShardedStorage (exchanging the local shards)");
    for (int r = 0; r < world_; ++r)
      if (rows[static_cast<std::size_t>(r)][0] != rows[0][0])
        detail::fail("ShardedStorage: rank {} declares other local shards (names or full shapes) than rank 0; "
                     "every rank must call local_shard() for the same tensors with the same full_shape",
                     r);
    for (std::size_t k = 0; k < sliced.size(); ++k) {
      auto& e = entries_[sliced[k]];
      e.pieces.clear();
      for (int r = 0; r < world_; ++r) {
        const auto& row = rows[static_cast<std::size_t>(r)];
        const std::int64_t length = row[2 * k + 2];
        if (length > 0) e.pieces.push_back({r, row[2 * k + 1], length});
      }
      std::sort(e.pieces.begin(), e.pieces.end(),
                [](const auto& a, const auto& b) { return a.offset < b.offset || (a.offset == b.offset && a.rank < b.rank); });
      std::int64_t next = 0;
      for (const auto& p : e.pieces) {
        if (p.offset < next)
          detail::fail("ShardedStorage: the slices of '{}' overlap: rank {} holds elements from {}, which an earlier "
                       "slice holds too (up to {})",
                       e.name, p.rank, p.offset, next);
        if (p.offset > next)
          detail::fail("ShardedStorage: the slices of '{}' leave elements [{}, {}) to no rank", e.name, next, p.offset);
        next = p.offset + p.length;
      }
      if (next != e.numel())
        detail::fail("ShardedStorage: the slices of '{}' cover {} of its {} elements (shape {})", e.name, next,
                     e.numel(), detail::shape_string(e.full_shape));
    }
  }

  std::uint64_t layout_fingerprint() const {
    std::uint64_t h = detail::fnv1a(&world_, sizeof(world_));
    for (const auto& e : entries_) {
      h = detail::fnv1a(e.name.data(), e.name.size(), h);
      h = detail::fnv1a(e.full_shape.data(), e.full_shape.size() * sizeof(std::int64_t), h);
      const auto type = static_cast<std::int32_t>(e.dtype);
      h = detail::fnv1a(&type, sizeof(type), h);
      for (const auto& p : e.pieces) {
        const std::int64_t v[3] = {p.rank, p.offset, p.length};
        h = detail::fnv1a(v, sizeof(v), h);
      }
    }
    return h;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  c10::Device comm_device_{c10::kCPU};
  std::map<std::string, LocalShard> local_shards_;
  int rank_ = 0;
  int world_ = 1;
  std::vector<detail::ShardEntry> entries_;
  std::uint64_t fingerprint_ = 0;
};

// Ready-made sharded EMAs.
using ShardedEma = Ema<Fixed, StepSchedule, ShardedStorage>;
using ShardedWarmupEma = Ema<InversePowerWarmup, StepSchedule, ShardedStorage>;

namespace detail {

// Exchanges the counters and the layout fingerprint (and, from rank 0, `extra`); throws on every
// rank, naming the ranks and values, when they disagree. Returns rank 0's `extra`.
template <class D, class S>
std::int64_t check_agreement(const Ema<D, S, ShardedStorage>& ema, const std::string& what, std::int64_t extra = 0) {
  const auto& st = ema.storage();
  const std::vector<std::int64_t> mine{static_cast<std::int64_t>(st.fingerprint()), ema.calls(), ema.step(),
                                       ema.num_updates(), ema.last_update_step(), extra};
  const auto rows = st.exchange(mine, what);
  std::vector<std::string> layout_diff, counter_diff;
  for (std::size_t r = 1; r < rows.size(); ++r) {
    if (rows[r][0] != rows[0][0]) layout_diff.push_back(fmt::format("{}", r));
    if (!std::equal(rows[r].begin() + 1, rows[r].begin() + 5, rows[0].begin() + 1))
      counter_diff.push_back(fmt::format("rank {}: calls {}, step {}, num_updates {}, last_update_step {}", r,
                                         rows[r][1], rows[r][2], rows[r][3], rows[r][4]));
  }
  if (!layout_diff.empty())
    fail_runtime("{}: rank(s) {} hold an EMA of another model or layout than rank 0 (tensor names, shapes, dtypes "
                 "or slices differ); every rank must build the same model and EMA",
                 what, fmt::join(layout_diff, ", "));
  if (!counter_diff.empty())
    fail_runtime("{}: the ranks' update counters disagree: rank 0: calls {}, step {}, num_updates {}, "
                 "last_update_step {}; {}. Every rank must call update() equally often with the same steps "
                 "(a skipped or extra update on one rank)",
                 what, rows[0][1], rows[0][2], rows[0][3], rows[0][4], fmt::join(counter_diff, "; "));
  return rows[0][5];
}

// Runs `body` on this rank, then tells every rank whether every rank succeeded: a rank whose
// body threw rethrows its own error, the others throw an error naming it. No rank goes on alone.
template <class F>
void all_or_none(const ShardedStorage& st, const std::string& what, F&& body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  const auto rows = st.exchange({error ? 1 : 0}, what);
  if (error) std::rethrow_exception(error);
  std::vector<int> failed;
  for (std::size_t r = 0; r < rows.size(); ++r)
    if (rows[r][0] != 0) failed.push_back(static_cast<int>(r));
  if (!failed.empty())
    fail_runtime("{}: failed on rank(s) {} (see the error there); nothing was done on any rank", what,
                 fmt::join(failed, ", "));
}

inline std::int64_t scalar_long(const std::vector<std::pair<std::string, at::Tensor>>& items, const std::string& key,
                                const std::string& where) {
  for (const auto& [k, t] : items)
    if (k == key) {
      if (t.numel() != 1 || c10::isFloatingType(t.scalar_type()))
        fail("{}: '{}' is not one integer; the checkpoint is damaged", where, key);
      return t.item<std::int64_t>();
    }
  fail("{}: the checkpoint has no '{}'; it is damaged or not a sharded emakit checkpoint", where, key);
}

// Reads a dictionary and checks each tensor against the archive's checksums under `sums_key`.
inline std::vector<std::pair<std::string, at::Tensor>> read_checked(torch::serialize::InputArchive& archive,
                                                                   const std::string& key, Checksums& sums,
                                                                   const std::string& prefix,
                                                                   const std::string& where) {
  auto items = read_tensor_dict(archive, key, where);
  if (!items) fail("{}: the checkpoint has no '{}'; it is not a sharded emakit checkpoint", where, key);
  for (const auto& [k, t] : *items) sums.check(prefix + k, t, where);
  return *items;
}

}  // namespace detail

// ---- gathering ------------------------------------------------------------------------------

// The whole average by name, in the model's order, on rank `to` (all_ranks: every rank); empty on
// the other ranks. Collective. The tensors are new (not the EMA's own).
template <DecayPolicy D, SchedulePolicy S>
StateDict gather_averages(const Ema<D, S, ShardedStorage>& ema, int to = all_ranks) {
  const std::string what = "emakit::gather_averages";
  detail::check_agreement(ema, what);
  const auto& st = ema.storage();
  auto full = st.gather_tensors(to, what);
  StateDict out;
  for (std::size_t i = 0; i < full.size(); ++i) {
    // A tied tensor is gathered once and listed under each of its names, as Ema::averages() does.
    out.insert(st.layout()[i].name, full[i]);
    for (const auto& alias : st.layout()[i].aliases) out.insert(alias, full[i]);
  }
  return out;
}

// What a single-process Ema's state_dict() holds (config, counters, every average) on rank `to`
// (all_ranks: every rank); empty elsewhere. A plain Ema with the same policies loads it.
template <DecayPolicy D, SchedulePolicy S>
StateDict gather_state_dict(const Ema<D, S, ShardedStorage>& ema, int to = all_ranks) {
  StateDict averages = gather_averages(ema, to);
  StateDict out;
  if (averages.is_empty() && !ema.storage().layout().empty()) return out;
  for (const auto& item : ema.state_dict())
    if (item.key().rfind("average.", 0) != 0) out.insert(item.key(), item.value());
  for (const auto& item : averages) out.insert("average." + item.key(), item.value());
  return out;
}

// Holds the whole EMA average in a model until its scope ends, then restores the model's own
// weights (also on an exception): a SwapGuard, so that the Ema refuses update() while it is open.
// Made by swap_gathered_into().
using GatheredSwap = SwapGuard;

// Gathers the whole average to every rank and puts it into `model` (matched by name) until the
// guard's scope ends. Collective. For a model of replicated parameters (for already-sharded ones,
// Ema::swap_into() swaps this rank's slices).
template <DecayPolicy D, SchedulePolicy S>
[[nodiscard]] GatheredSwap swap_gathered_into(const Ema<D, S, ShardedStorage>& ema, torch::nn::Module& model) {
  StateDict full = gather_averages(ema, all_ranks);
  auto theirs = detail::tensors_by_name(model);
  for (const auto& item : full) {
    auto it = theirs.find(item.key());
    if (it == theirs.end()) detail::fail("swap_gathered_into: the model has no tensor '{}' that the EMA holds", item.key());
    if (!it->second.sizes().equals(item.value().sizes()))
      detail::fail("swap_gathered_into: tensor '{}' has shape {} in the model but {} in the EMA", item.key(),
                   detail::shape_string(it->second.sizes()), detail::shape_string(item.value().sizes()));
  }
  auto state = std::make_shared<detail::SwapState>();
  c10::NoGradGuard no_grad;
  for (const auto& item : full) {
    at::Tensor& t = theirs.at(item.key());
    state->backup.push_back(t.detach().clone());
    state->targets.push_back(t);
  }
  if (detail::swap_registry().holder(state->targets, nullptr) != nullptr)
    detail::fail("swap_gathered_into: the model already holds an EMA's weights (a SwapGuard is open); end that "
                 "guard's scope first");
  GatheredSwap guard = detail::open_swap(state);
  for (std::size_t i = 0; i < full.size(); ++i) state->targets[i].copy_(full[i].value());
  return guard;
}

// ---- sharded checkpoints --------------------------------------------------------------------

// Writes `dir`/rank-<r>-of-<N>.pt on every rank and `dir`/index.pt on rank 0, each atomically.
// Collective; an error on any rank is an error on every rank (and then no new index is written).
template <DecayPolicy D, SchedulePolicy S>
void save_sharded(const Ema<D, S, ShardedStorage>& ema, const std::filesystem::path& dir) {
  const std::string what = fmt::format("emakit::save_sharded('{}')", dir.string());
  const auto& st = ema.storage();
  std::int64_t proposal = 0;
  if (st.rank() == 0) {
    std::random_device device;
    std::mt19937_64 gen((static_cast<std::uint64_t>(device()) << 32) ^ device() ^
                        static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
    proposal = static_cast<std::int64_t>(gen() >> 1) + 1;
  }
  const std::int64_t save_id = detail::check_agreement(ema, what, proposal);
  auto shard_info = [&](int rank) {
    return std::vector<std::pair<std::string, at::Tensor>>{
        {"format", at::scalar_tensor(sharded_format_version, at::kLong)},
        {"save_id", at::scalar_tensor(save_id, at::kLong)},
        {"rank", at::scalar_tensor(static_cast<std::int64_t>(rank), at::kLong)},
        {"world", at::scalar_tensor(static_cast<std::int64_t>(st.world()), at::kLong)}};
  };
  detail::all_or_none(st, what, [&] {
    std::filesystem::create_directories(dir);
    torch::serialize::OutputArchive archive;
    ema.save(archive);  // this rank's state, with a CRC-32 per tensor
    archive.write("emakit_shard", detail::tensor_dict(shard_info(st.rank()), /*copy=*/false));
    detail::write_archive(archive, dir / sharded_file_name(st.rank(), st.world(), save_id));
  });
  detail::all_or_none(st, what, [&] {
    if (st.rank() != 0) return;
    std::vector<std::pair<std::string, at::Tensor>> state, layout;
    detail::Checksums sums;
    for (const auto& item : ema.state_dict()) {
      if (item.key().rfind("average.", 0) == 0) continue;
      state.emplace_back(item.key(), item.value());
      sums.add("state/" + item.key(), item.value());
    }
    for (const auto& e : st.layout()) {
      at::Tensor shape = at::empty({static_cast<std::int64_t>(e.full_shape.size())}, at::kLong);
      std::copy(e.full_shape.begin(), e.full_shape.end(), shape.data_ptr<std::int64_t>());
      at::Tensor pieces = at::empty({static_cast<std::int64_t>(e.pieces.size()), 3}, at::kLong);
      auto* p = pieces.data_ptr<std::int64_t>();
      for (const auto& piece : e.pieces) {
        *p++ = piece.rank;
        *p++ = piece.offset;
        *p++ = piece.length;
      }
      layout.emplace_back("shape." + e.name, shape);
      layout.emplace_back("dtype." + e.name, detail::string_tensor(c10::toString(e.dtype)));
      layout.emplace_back("pieces." + e.name, pieces);
    }
    for (const auto& [k, t] : layout) sums.add("layout/" + k, t);
    torch::serialize::OutputArchive archive;
    archive.write("emakit_shard", detail::tensor_dict(shard_info(0), /*copy=*/false));
    archive.write("emakit_state", detail::tensor_dict(state, /*copy=*/false));
    archive.write("emakit_layout", detail::tensor_dict(layout, /*copy=*/false));
    archive.write("emakit_checksums", detail::tensor_dict(sums.saved, /*copy=*/false));
    detail::write_archive(archive, dir / std::string(sharded_index_name));
  });
  // Committed: the files of earlier saves (and of saves that failed half-way) can go. Every rank
  // removes what it sees, so a folder that is not shared between machines is cleaned as well.
  detail::all_or_none(st, what, [&] {
    const std::string keep = fmt::format(".{:016x}.pt", static_cast<std::uint64_t>(save_id));
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("rank-", 0) == 0 && name.ends_with(".pt") && !name.ends_with(keep)) {
        std::error_code ignored;  // another rank may have removed it already
        std::filesystem::remove(entry.path(), ignored);
      }
    }
  });
}

// Loads a checkpoint of save_sharded() written with any world size: each rank reads the index and
// the files holding the ranges it holds now. Collective. Everything is read and checked on every
// rank before anything is written: a failed load leaves the EMA unchanged on every rank.
template <DecayPolicy D, SchedulePolicy S>
void load_sharded(Ema<D, S, ShardedStorage>& ema, const std::filesystem::path& dir) {
  const std::string what = fmt::format("emakit::load_sharded('{}')", dir.string());
  const auto& st = ema.storage();
  StateDict state;
  detail::all_or_none(st, what, [&] {
    const auto index_path = dir / std::string(sharded_index_name);
    const std::string index_where = fmt::format("load_sharded: '{}'", index_path.string());
    if (!std::filesystem::exists(index_path))
      detail::fail("load_sharded: the checkpoint in '{}' is incomplete or missing: no index '{}' (written last by "
                   "rank 0 of save_sharded)",
                   dir.string(), index_path.string());
    torch::serialize::InputArchive index;
    detail::read_archive(index, index_path, "load_sharded");
    detail::Checksums sums;
    sums.load(index, "emakit_checksums", index_where);
    auto info = detail::read_tensor_dict(index, "emakit_shard", index_where);
    if (!info) detail::fail("{}: no 'emakit_shard'; it is not the index of a sharded emakit checkpoint", index_where);
    const auto format = detail::scalar_long(*info, "format", index_where);
    if (format != sharded_format_version)
      detail::fail("{}: sharded checkpoint format {}, this emakit reads format {}", index_where, format,
                   sharded_format_version);
    const std::int64_t save_id = detail::scalar_long(*info, "save_id", index_where);
    const std::int64_t old_world = detail::scalar_long(*info, "world", index_where);
    if (old_world <= 0) detail::fail("{}: world size {}; the index is damaged", index_where, old_world);
    const auto saved_state = detail::read_checked(index, "emakit_state", sums, "state/", index_where);
    const auto layout_items = detail::read_checked(index, "emakit_layout", sums, "layout/", index_where);
    std::map<std::string, at::Tensor> layout(layout_items.begin(), layout_items.end());
    auto layout_of = [&](const std::string& kind, const std::string& name) -> const at::Tensor* {
      auto it = layout.find(kind + "." + name);
      return it == layout.end() ? nullptr : &it->second;
    };
    // The same tensors, shapes and dtypes as this EMA.
    std::set<std::string> ours;
    for (const auto& e : st.layout()) {
      ours.insert(e.name);
      const at::Tensor* shape = layout_of("shape", e.name);
      if (shape == nullptr) detail::fail("{}: the checkpoint has no tensor '{}' that this EMA holds", index_where, e.name);
      if (shape->scalar_type() != at::kLong || shape->dim() != 1)
        detail::fail("{}: the shape of '{}' is damaged", index_where, e.name);
      const std::vector<std::int64_t> saved(shape->data_ptr<std::int64_t>(),
                                            shape->data_ptr<std::int64_t>() + shape->numel());
      if (saved != e.full_shape)
        detail::fail("{}: tensor '{}' has shape {} in the checkpoint, {} in this EMA", index_where, e.name,
                     detail::shape_string(saved), detail::shape_string(e.full_shape));
      const at::Tensor* dtype = layout_of("dtype", e.name);
      const std::string saved_dtype = dtype ? detail::tensor_string(*dtype) : std::string("<none>");
      if (saved_dtype != c10::toString(e.dtype))
        detail::fail("{}: tensor '{}' has dtype {} in the checkpoint, {} in this EMA", index_where, e.name, saved_dtype,
                     c10::toString(e.dtype));
    }
    for (const auto& [key, t] : layout_items)
      if (key.rfind("shape.", 0) == 0 && !ours.count(key.substr(6)))
        detail::fail("{}: the checkpoint holds tensor '{}', which this EMA does not", index_where, key.substr(6));

    // The files that hold what this rank holds now, each read and checked once.
    std::map<std::int64_t, std::map<std::string, at::Tensor>> files;
    auto file_of = [&](std::int64_t r) -> const std::map<std::string, at::Tensor>& {
      if (auto it = files.find(r); it != files.end()) return it->second;
      const auto path = dir / sharded_file_name(static_cast<int>(r), static_cast<int>(old_world), save_id);
      const std::string where = fmt::format("load_sharded: '{}'", path.string());
      if (!std::filesystem::exists(path))
        detail::fail("load_sharded: the checkpoint in '{}' is incomplete: '{}' is missing (the index names {} ranks)",
                     dir.string(), path.string(), old_world);
      torch::serialize::InputArchive archive;
      detail::read_archive(archive, path, "load_sharded");
      auto shard = detail::read_tensor_dict(archive, "emakit_shard", where);
      if (!shard) detail::fail("{}: no 'emakit_shard'; it is not a file of a sharded emakit checkpoint", where);
      const std::int64_t id = detail::scalar_long(*shard, "save_id", where);
      if (id != save_id)
        detail::fail("{}: belongs to another save than the index '{}' (save ids {} and {}): the folder mixes files "
                     "of different checkpoints",
                     where, index_path.string(), id, save_id);
      if (detail::scalar_long(*shard, "rank", where) != r || detail::scalar_long(*shard, "world", where) != old_world)
        detail::fail("{}: holds rank {} of {}, not what its name says", where, detail::scalar_long(*shard, "rank", where),
                     detail::scalar_long(*shard, "world", where));
      detail::Checksums file_sums;
      file_sums.load(archive, "emakit_checksums", where);
      auto items = detail::read_checked(archive, "emakit_state", file_sums, "", where);
      return files.emplace(r, std::map<std::string, at::Tensor>(items.begin(), items.end())).first->second;
    };

    for (const auto& item : saved_state) state.insert(item.first, item.second);
    c10::NoGradGuard no_grad;
    for (const auto& e : st.layout()) {
      if (!e.local.defined()) continue;
      const auto* mine = e.piece_of(st.rank());
      at::Tensor local = at::empty(e.local.sizes(), at::TensorOptions().dtype(e.dtype));
      if (mine != nullptr) {
        at::Tensor flat = detail::byte_view(local);
        const at::Tensor* pieces_entry = layout_of("pieces", e.name);
        if (pieces_entry == nullptr) detail::fail("{}: no pieces for '{}'; the index is damaged", index_where, e.name);
        const at::Tensor& saved_pieces = *pieces_entry;
        if (saved_pieces.dim() != 2 || saved_pieces.size(1) != 3 || saved_pieces.scalar_type() != at::kLong)
          detail::fail("{}: the pieces of '{}' are damaged", index_where, e.name);
        const auto* q = saved_pieces.data_ptr<std::int64_t>();
        std::int64_t covered = 0;
        for (std::int64_t k = 0; k < saved_pieces.size(0); ++k, q += 3) {
          const std::int64_t r = q[0], off = q[1], len = q[2];
          const std::int64_t lo = std::max(off, mine->offset), hi = std::min(off + len, mine->offset + mine->length);
          if (lo >= hi) continue;
          if (r < 0 || r >= old_world) detail::fail("{}: '{}' names rank {} of {}", index_where, e.name, r, old_world);
          const auto& file = file_of(r);
          const auto path = dir / sharded_file_name(static_cast<int>(r), static_cast<int>(old_world), save_id);
          auto it = file.find("average." + e.name);
          if (it == file.end())
            detail::fail("load_sharded: '{}' lacks 'average.{}', which the index says it holds", path.string(), e.name);
          if (it->second.numel() != len || it->second.scalar_type() != e.dtype)
            detail::fail("load_sharded: '{}' holds 'average.{}' with {} elements of {}, the index says {} of {}",
                         path.string(), e.name, it->second.numel(), c10::toString(it->second.scalar_type()), len,
                         c10::toString(e.dtype));
          const auto es = e.element_size();
          flat.narrow(0, (lo - mine->offset) * es, (hi - lo) * es)
              .copy_(detail::byte_view(it->second.contiguous()).narrow(0, (lo - off) * es, (hi - lo) * es));
          covered += hi - lo;
        }
        if (covered != mine->length)
          detail::fail("{}: the saved pieces of '{}' cover {} of the {} elements this rank holds", index_where, e.name,
                       covered, mine->length);
      }
      state.insert("average." + e.name, local);
    }
    ema.check_state_dict(state);
  });
  ema.load_state_dict(state);
}

}  // namespace emakit
