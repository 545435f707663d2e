// ShardedStorage: the storage policy that splits an EMA across the ranks of a c10d process group
// and decides which rank holds which tensor or slice. What it can do with the whole average
// (gather, swap, checkpoints) is declared here and defined in sharded/gather.hpp and
// sharded/checkpoint.hpp: include <emakit/sharded.hpp>.
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
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/state.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/collectives.hpp>
#include <emakit/storage.hpp>

#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/ordered_dict.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

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
  static std::int64_t flat_chunk_numel(std::int64_t numel, int rank, int world) {
    return dim0_chunk_rows(numel, rank, world);
  }

 private:
  static void check_rank(int rank, int world, const char* what) {
    if (world <= 0) detail::fail("{}: world must be > 0, got {}", what, world);
    if (rank < 0 || rank >= world) detail::fail("{}: rank must be in [0, {}), got {}", what, world, rank);
  }
};

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
      if (d < 0)
        detail::fail("ShardedStorage::local_shard('{}'): full_shape {} has a negative size", tensor_name,
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
      for (std::size_t k = 0; it == local_shards_.end() && k < s.aliases.size(); ++k)
        it = local_shards_.find(s.aliases[k]);
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
  // Two storages are equal when they shard over the same group with the same settings.
  bool operator==(const ShardedStorage& other) const noexcept {
    return group_.get() == other.group_.get() && timeout_ == other.timeout_ && comm_device_ == other.comm_device_;
  }

  // ---- collectives (every rank must call them together, in the same order) -----------------

  // The group, timeout and device of this storage's collectives (detail/collectives.hpp).
  detail::Communicator communicator() const { return {group_, timeout_, comm_device_, rank_, world_}; }

  // All ranks' rows of `mine` (each the same length), by rank.
  std::vector<std::vector<std::int64_t>> exchange(const std::vector<std::int64_t>& mine,
                                                  const std::string& what) const {
    return communicator().exchange(mine, what);
  }

  // Exchanges `ema`'s counters and this layout's fingerprint (and, from rank 0, `extra`); throws on
  // every rank, naming the ranks and values, when they disagree. Returns rank 0's `extra`. Every
  // collective on the whole average starts with it.
  template <class E>
  std::int64_t check_agreement(const E& ema, const std::string& what, std::int64_t extra = 0) const;

  // The whole tensors, in layout order, on rank `to` (all_ranks: on every rank); an empty vector
  // on the ranks that receive nothing. Defined in sharded/gather.hpp.
  std::vector<at::Tensor> gather_tensors(int to, const std::string& what) const;

  // ---- capabilities (concepts.hpp), called by Ema and emakit::save / load ----------------------

  // GatheringStorage: the whole average by name (each tied tensor under each of its names) on
  // rank `to`; empty elsewhere. Defined in sharded/gather.hpp.
  template <class E>
  torch::OrderedDict<std::string, at::Tensor> gather(const E& ema, int to) const;
  // CheckpointingStorage: save_sharded / load_sharded of `ema` in the folder `dir`; a sharded
  // checkpoint loads strictly only. Defined in sharded/checkpoint.hpp.
  template <class E>
  void save_checkpoint(const E& ema, const std::filesystem::path& dir) const;
  template <class E>
  void load_checkpoint(E& ema, const std::filesystem::path& dir, LoadMode mode) const;

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
      std::sort(e.pieces.begin(), e.pieces.end(), [](const auto& a, const auto& b) {
        return a.offset < b.offset || (a.offset == b.offset && a.rank < b.rank);
      });
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

template <class E>
std::int64_t ShardedStorage::check_agreement(const E& ema, const std::string& what, std::int64_t extra) const {
  const std::vector<std::int64_t> mine{static_cast<std::int64_t>(fingerprint_),
                                       ema.calls(),
                                       ema.step(),
                                       ema.num_updates(),
                                       ema.last_update_step(),
                                       extra};
  const auto rows = exchange(mine, what);
  std::vector<std::string> layout_diff, counter_diff;
  for (std::size_t r = 1; r < rows.size(); ++r) {
    if (rows[r][0] != rows[0][0]) layout_diff.push_back(fmt::format("{}", r));
    if (!std::equal(rows[r].begin() + 1, rows[r].begin() + 5, rows[0].begin() + 1))
      counter_diff.push_back(fmt::format("rank {}: calls {}, step {}, num_updates {}, last_update_step {}", r,
                                         rows[r][1], rows[r][2], rows[r][3], rows[r][4]));
  }
  if (!layout_diff.empty())
    detail::fail_runtime("{}: rank(s) {} hold an EMA of another model or layout than rank 0 (tensor names, shapes, "
                         "dtypes or slices differ); every rank must build the same model and EMA",
                         what, fmt::join(layout_diff, ", "));
  if (!counter_diff.empty())
    detail::fail_runtime("{}: the ranks' update counters disagree: rank 0: calls {}, step {}, num_updates {}, "
                         "last_update_step {}; {}. Every rank must call update() equally often with the same steps "
                         "(a skipped or extra update on one rank)",
                         what, rows[0][1], rows[0][2], rows[0][3], rows[0][4], fmt::join(counter_diff, "; "));
  return rows[0][5];
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
