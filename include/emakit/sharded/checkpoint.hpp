// Sharded checkpoints: save_sharded / load_sharded (and emakit::save / emakit::load of a sharded
// EMA, through ShardedStorage's checkpoint hooks). Collectives.
//
// In `dir`, each rank writes
//   rank-<r>-of-<N>.<id>.pt   what torch::save(ema) writes for its share (state + CRC-32 per
//                             tensor) plus the save id, its rank and N; <id> is the save id in
//                             16 hex digits (sharded_file_name)
// atomically, and after every rank succeeded rank 0 writes index.pt: the save id, N, the config
// and counters, and for each tensor its shape, dtype and which rank holds which flat range.
// The index is the commit point: a new save writes files under its own id and leaves those of
// the index in place, so a save that fails or is killed half-way leaves the previous checkpoint
// whole; once the new index is written, every rank removes the other saves' files.
// Loading with any world size reads the files that hold the ranges this rank now holds. A missing
// file, a file of another save (mixed set), a damaged file or another model is an error naming
// the file, on every rank; a failed load leaves the EMA unchanged on every rank.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/concepts.hpp>
#include <emakit/detail/serial/archive_file.hpp>
#include <emakit/detail/serial/checksum.hpp>
#include <emakit/detail/serial/formats.hpp>
#include <emakit/detail/serial/state_reader.hpp>
#include <emakit/detail/serial/tensor_dict.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/collectives.hpp>
#include <emakit/ema.hpp>
#include <emakit/sharded/storage.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// The file names of a sharded checkpoint.
inline constexpr std::string_view sharded_index_name = "index.pt";
// A rank's file, rank-<r>-of-<N>.<id>.pt, carries the save's id (16 hex digits), so a save never
// overwrites the files that the current index names: the index, written last, is the commit point.
inline std::string sharded_file_name(int rank, int world, std::int64_t save_id) {
  return fmt::format("rank-{}-of-{}.{:016x}.pt", rank, world, static_cast<std::uint64_t>(save_id));
}
// The layout version of sharded checkpoints.
inline constexpr std::int64_t sharded_format_version = detail::formats::sharded.version;

namespace detail {

// Reads a dictionary and checks each tensor against the archive's checksums under `sums_key`.
inline std::vector<std::pair<std::string, at::Tensor>> read_checked(torch::serialize::InputArchive& archive,
                                                                    const std::string& key, Checksums& sums,
                                                                    const std::string& prefix,
                                                                    const std::string& where) {
  auto items = read_checked_dict(archive, key, sums, prefix, where);
  if (!items) fail("{}: the checkpoint has no '{}'; it is not a sharded emakit checkpoint", where, key);
  return *items;
}

}  // namespace detail

// Writes `dir`/rank-<r>-of-<N>.<id>.pt on every rank and `dir`/index.pt on rank 0, each atomically.
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
  const std::int64_t save_id = st.check_agreement(ema, what, proposal);
  auto shard_info = [&](int rank) {
    return std::vector<std::pair<std::string, at::Tensor>>{
        {"format", at::scalar_tensor(sharded_format_version, at::kLong)},
        {"save_id", at::scalar_tensor(save_id, at::kLong)},
        {"rank", at::scalar_tensor(static_cast<std::int64_t>(rank), at::kLong)},
        {"world", at::scalar_tensor(static_cast<std::int64_t>(st.world()), at::kLong)}};
  };
  detail::all_or_none(st.communicator(), what, [&] {
    std::filesystem::create_directories(dir);
    torch::serialize::OutputArchive archive;
    ema.save(archive);  // this rank's state, with a CRC-32 per tensor
    archive.write("emakit_shard", detail::tensor_dict(shard_info(st.rank()), /*copy=*/false));
    detail::write_archive(archive, dir / sharded_file_name(st.rank(), st.world(), save_id));
  });
  detail::all_or_none(st.communicator(), what, [&] {
    if (st.rank() != 0) return;
    std::vector<std::pair<std::string, at::Tensor>> state, layout;
    detail::Checksums sums;
    for (const auto& item : ema.state_dict()) {
      if (detail::ema_state::is_average_key(item.key())) continue;
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
  detail::all_or_none(st.communicator(), what, [&] {
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

namespace detail::sharded {

// What index.pt holds, read and checked against its CRC-32s.
struct Index {
  std::filesystem::path dir;
  std::string where;  // "load_sharded: '<dir>/index.pt'", for messages
  std::int64_t save_id = 0;
  std::int64_t world = 0;                                 // the world size that saved
  std::vector<std::pair<std::string, at::Tensor>> state;  // config and counters
  std::map<std::string, at::Tensor> layout;               // shape.<name>, dtype.<name>, pieces.<name>

  const at::Tensor* layout_of(const std::string& kind, const std::string& name) const {
    const auto it = layout.find(kind + "." + name);
    return it == layout.end() ? nullptr : &it->second;
  }
  std::filesystem::path file_of(std::int64_t rank) const {
    return dir / sharded_file_name(static_cast<int>(rank), static_cast<int>(world), save_id);
  }
};

// What each file of a sharded checkpoint opens with: its archive, its CRC-32s, and its
// 'emakit_shard' header (a file without one is not `what`, "the index of a sharded emakit
// checkpoint"), each read and checked.
struct ShardFile {
  torch::serialize::InputArchive archive;
  Checksums sums;
  torch::OrderedDict<std::string, at::Tensor> header;
};

inline ShardFile open_shard_file(const std::filesystem::path& path, const std::string& where, const char* what) {
  ShardFile file;
  read_archive(file.archive, path, "load_sharded");
  file.sums.load(file.archive, "emakit_checksums", where);
  auto header = read_tensor_dict(file.archive, "emakit_shard", where);
  if (!header) fail("{}: no 'emakit_shard'; it is not {}", where, what);
  file.header = as_state(*header, where);
  return file;
}

inline Index read_index(const std::filesystem::path& dir) {
  Index index;
  index.dir = dir;
  const auto path = dir / std::string(sharded_index_name);
  index.where = fmt::format("load_sharded: '{}'", path.string());
  if (!std::filesystem::exists(path))
    fail("load_sharded: the checkpoint in '{}' is incomplete or missing: no index '{}' (written last by rank 0 of "
         "save_sharded)",
         dir.string(), path.string());
  ShardFile file = open_shard_file(path, index.where, "the index of a sharded emakit checkpoint");
  const StateReader info_in(file.header, index.where);
  formats::check_version(formats::sharded, info_in.counter("format"), index.where);
  index.save_id = info_in.counter("save_id");
  index.world = info_in.counter("world");
  if (index.world <= 0) fail("{}: world size {}; the index is damaged", index.where, index.world);
  index.state = read_checked(file.archive, "emakit_state", file.sums, "state/", index.where);
  for (auto& [key, t] : read_checked(file.archive, "emakit_layout", file.sums, "layout/", index.where))
    index.layout.emplace(key, std::move(t));
  return index;
}

// The index names the same tensors, shapes and dtypes as this EMA holds.
inline void check_layout(const Index& index, const ShardedStorage& st) {
  std::set<std::string> ours;
  for (const auto& e : st.layout()) {
    ours.insert(e.name);
    const at::Tensor* shape = index.layout_of("shape", e.name);
    if (shape == nullptr) fail("{}: the checkpoint has no tensor '{}' that this EMA holds", index.where, e.name);
    if (shape->scalar_type() != at::kLong || shape->dim() != 1)
      fail("{}: the shape of '{}' is damaged", index.where, e.name);
    const std::vector<std::int64_t> saved(shape->data_ptr<std::int64_t>(),
                                          shape->data_ptr<std::int64_t>() + shape->numel());
    if (saved != e.full_shape)
      fail("{}: tensor '{}' has shape {} in the checkpoint, {} in this EMA", index.where, e.name, shape_string(saved),
           shape_string(e.full_shape));
    const at::Tensor* dtype = index.layout_of("dtype", e.name);
    const std::string saved_dtype = dtype ? tensor_string(*dtype) : std::string("<none>");
    if (saved_dtype != c10::toString(e.dtype))
      fail("{}: tensor '{}' has dtype {} in the checkpoint, {} in this EMA", index.where, e.name, saved_dtype,
           c10::toString(e.dtype));
  }
  for (const auto& [key, t] : index.layout)
    if (key.rfind("shape.", 0) == 0 && !ours.count(key.substr(6)))
      fail("{}: the checkpoint holds tensor '{}', which this EMA does not", index.where, key.substr(6));
}

// The saved ranks' files this rank reads, each read and checked once: its averages by key.
class RankFiles {
 public:
  explicit RankFiles(const Index& index) : index_(index) {}

  const std::map<std::string, at::Tensor>& of(std::int64_t rank) {
    if (const auto it = files_.find(rank); it != files_.end()) return it->second;
    const auto path = index_.file_of(rank);
    const std::string where = fmt::format("load_sharded: '{}'", path.string());
    if (!std::filesystem::exists(path))
      fail("load_sharded: the checkpoint in '{}' is incomplete: '{}' is missing (the index names {} ranks)",
           index_.dir.string(), path.string(), index_.world);
    ShardFile file = open_shard_file(path, where, "a file of a sharded emakit checkpoint");
    const StateReader shard_in(file.header, where);
    const std::int64_t id = shard_in.counter("save_id");
    if (id != index_.save_id)
      fail("{}: belongs to another save than the index '{}' (save ids {} and {}): the folder mixes files of "
           "different checkpoints",
           where, (index_.dir / std::string(sharded_index_name)).string(), id, index_.save_id);
    if (shard_in.counter("rank") != rank || shard_in.counter("world") != index_.world)
      fail("{}: holds rank {} of {}, not what its name says", where, shard_in.counter("rank"),
           shard_in.counter("world"));
    auto items = read_checked(file.archive, "emakit_state", file.sums, "", where);
    return files_.emplace(rank, std::map<std::string, at::Tensor>(items.begin(), items.end())).first->second;
  }

 private:
  const Index& index_;
  std::map<std::int64_t, std::map<std::string, at::Tensor>> files_;
};

// This rank's share of tensor `e` now, from the saved pieces that overlap it (any world size).
inline at::Tensor read_local(const Index& index, RankFiles& files, const ShardEntry& e, int rank) {
  at::Tensor local = at::empty(e.local.sizes(), at::TensorOptions().dtype(e.dtype));
  const auto* mine = e.piece_of(rank);
  if (mine == nullptr) return local;
  at::Tensor flat = byte_view(local);
  const at::Tensor* pieces = index.layout_of("pieces", e.name);
  if (pieces == nullptr) fail("{}: no pieces for '{}'; the index is damaged", index.where, e.name);
  if (pieces->dim() != 2 || pieces->size(1) != 3 || pieces->scalar_type() != at::kLong)
    fail("{}: the pieces of '{}' are damaged", index.where, e.name);
  const auto* q = pieces->data_ptr<std::int64_t>();
  std::int64_t covered = 0;
  for (std::int64_t k = 0; k < pieces->size(0); ++k, q += 3) {
    const std::int64_t r = q[0], off = q[1], len = q[2];
    const std::int64_t lo = std::max(off, mine->offset), hi = std::min(off + len, mine->offset + mine->length);
    if (lo >= hi) continue;
    if (r < 0 || r >= index.world) fail("{}: '{}' names rank {} of {}", index.where, e.name, r, index.world);
    const auto& file = files.of(r);
    const auto it = file.find(ema_state::average_key(e.name));
    if (it == file.end())
      fail("load_sharded: '{}' lacks 'average.{}', which the index says it holds", index.file_of(r).string(), e.name);
    if (it->second.numel() != len || it->second.scalar_type() != e.dtype)
      fail("load_sharded: '{}' holds 'average.{}' with {} elements of {}, the index says {} of {}",
           index.file_of(r).string(), e.name, it->second.numel(), c10::toString(it->second.scalar_type()), len,
           c10::toString(e.dtype));
    const auto es = e.element_size();
    flat.narrow(0, (lo - mine->offset) * es, (hi - lo) * es)
        .copy_(byte_view(it->second.contiguous()).narrow(0, (lo - off) * es, (hi - lo) * es));
    covered += hi - lo;
  }
  if (covered != mine->length)
    fail("{}: the saved pieces of '{}' cover {} of the {} elements this rank holds", index.where, e.name, covered,
         mine->length);
  return local;
}

// The state this rank loads from the checkpoint in `dir`: the index's config and counters and
// this rank's share of every tensor, every part checked.
inline StateDict read_state(const ShardedStorage& st, const std::filesystem::path& dir) {
  const Index index = read_index(dir);
  check_layout(index, st);
  StateDict state;
  for (const auto& item : index.state) state.insert(item.first, item.second);
  RankFiles files(index);
  c10::NoGradGuard no_grad;
  for (const auto& e : st.layout())
    if (e.local.defined()) state.insert(ema_state::average_key(e.name), read_local(index, files, e, st.rank()));
  return state;
}

}  // namespace detail::sharded

// Loads a checkpoint of save_sharded() written with any world size: each rank reads the index and
// the files holding the ranges it holds now. Collective. Everything is read and checked on every
// rank before anything is written: a failed load leaves the EMA unchanged on every rank.
template <DecayPolicy D, SchedulePolicy S>
void load_sharded(Ema<D, S, ShardedStorage>& ema, const std::filesystem::path& dir) {
  StateDict state;
  detail::all_or_none(ema.storage().communicator(), fmt::format("emakit::load_sharded('{}')", dir.string()), [&] {
    state = detail::sharded::read_state(ema.storage(), dir);
    ema.check_state_dict(state);
  });
  ema.load_state_dict(state);
}

template <class E>
void ShardedStorage::save_checkpoint(const E& ema, const std::filesystem::path& dir) const {
  save_sharded(ema, dir);
}

template <class E>
void ShardedStorage::load_checkpoint(E& ema, const std::filesystem::path& dir, LoadMode mode) const {
  if (mode != LoadMode::strict)
    detail::fail("emakit::load('{}'): a sharded checkpoint loads strictly only; LoadMode::lenient is not supported",
                 dir.string());
  load_sharded(ema, dir);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
