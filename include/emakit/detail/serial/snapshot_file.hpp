// The post-hoc EMA snapshot file (formats::snapshot): reading and writing. This comment is the
// format's description and this file its only implementation (docs/posthoc.md repeats the table
// for readers outside C++; keep the two in step).
//
// Everything is little-endian. A file is
//
//   offset 0    "EMAKITPH"                     8 bytes, the magic
//          8    u32 format version (2; version 1 is still read)
//          12   u32 H, the size of the header body
//          16   header body (H bytes):
//                 i64 step          the trainer's step when the snapshot was written
//                 i64 t             the profile's time: the step of the EMA's last update
//                 f64 gamma         the power-function exponent
//                 f64 sigma_rel     the same profile as a relative width (for readers of the file)
//                 i64 update_every  steps between the EMA's updates (dt)
//                 u32 profile       the profile's index in the PostHocEma that wrote it
//                 u32 profiles      how many profiles that PostHocEma tracks (0: not recorded;
//                                   version 1 has 0 here)
//                 u64 file_size     the size of the whole file (a shorter file is truncated)
//               version 2 only, the run that wrote it:
//                 16 bytes run id   random, one per training run (all zero: no run recorded, as
//                                   every version 1 file and write_snapshot() without one)
//                 i64 run_started   when the run started, Unix seconds (0: not recorded)
//                 i64 previous_step the step of the run's snapshot before this one (0: this is
//                                   its first; -1: not recorded)
//                 u64 fingerprint   the model's fingerprint (model_fingerprint()): FNV-1a 64
//                                   over each tensor's u64 name length, name, u64 ndim, i64
//                                   sizes, u8 dtype code of the EMA's tensor, u8 role
//               both versions:
//                 u32 n             the number of tensors, then n records:
//                   u16 name length, the name (UTF-8, the model's state-dict name)
//                   u8  stored dtype, u8 dtype of the EMA's tensor, u8 role (0 averaged, 1 copied)
//                   u8  ndim, then ndim x i64 sizes
//                   u64 offset of the data in the file, u64 its size in bytes
//                   u32 CRC-32 of the data (zlib.crc32)
//          16+H u32 CRC-32 of bytes [0, 16+H)
//   then each tensor's data, contiguous and row-major in its stored dtype, at its offset
//   (64-byte aligned; the gaps are zeros).
//
// dtype codes: 1 float32, 2 float64, 3 float16, 4 bfloat16, 5 complex64, 6 complex128, 7 int64,
// 8 int32, 9 int16, 10 int8, 11 uint8, 12 bool.
#pragma once

#include <emakit/detail/check.hpp>
#include <emakit/detail/config.hpp>
#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/serial/checksum.hpp>
#include <emakit/detail/serial/formats.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

static_assert(std::endian::native == std::endian::little,
              "emakit's snapshot files are little-endian and are read and written without byte swapping");

namespace emakit {

// One tensor of a snapshot file.
struct SnapshotTensor {
  std::string name;                                      // the model's state-dict name
  c10::ScalarType stored_dtype = c10::ScalarType::Float;  // its dtype in the file
  c10::ScalarType dtype = c10::ScalarType::Float;         // the dtype of the EMA tensor it was written from
  bool averaged = true;                                   // false: a copied tensor (integer buffer, copy_only)
  std::vector<std::int64_t> sizes;
  std::uint64_t offset = 0;  // where its data starts in the file
  std::uint64_t nbytes = 0;
  std::uint32_t crc32 = 0;
};

// The identity of one training run of a PostHocEma: 16 random bytes, all zero for "not recorded"
// (snapshots of format 1, and those write_snapshot() writes without one).
struct RunId {
  std::array<std::uint8_t, 16> bytes{};

  // A new random id (std::random_device).
  static RunId random();
  bool recorded() const noexcept {
    return std::any_of(bytes.begin(), bytes.end(), [](std::uint8_t b) { return b != 0; });
  }
  // 32 hex digits, or "none" when not recorded.
  std::string hex() const;
  // The first 8 hex digits (what messages and posthoc_tool print), or "none".
  std::string short_hex() const { return recorded() ? hex().substr(0, 8) : std::string("none"); }
  friend bool operator==(const RunId&, const RunId&) = default;
  friend auto operator<=>(const RunId&, const RunId&) = default;
};

// A snapshot file's header: which profile it holds, when, of which run, and its tensors.
struct SnapshotInfo {
  std::filesystem::path path;
  std::uint32_t format_version = 0;  // the file's (1 or 2); 0 for a header not read from a file
  std::int64_t step = 0;          // the trainer's step when it was written
  std::int64_t t = 0;             // the profile's time (the step of the EMA's last update)
  double gamma = 0;               // the power-function exponent
  double sigma_rel = 0;           // the same, as a relative width
  std::int64_t update_every = 1;  // steps between the EMA's updates
  std::uint32_t profile = 0;      // the profile's index in the PostHocEma that wrote it
  std::uint32_t profiles = 0;     // how many profiles that PostHocEma tracks (0: not recorded)
  RunId run;                      // the run that wrote it (not recorded: all zero)
  std::int64_t run_started = 0;   // when that run started, Unix seconds (0: not recorded)
  std::int64_t previous_step = -1;  // the step of the run's previous snapshot (0: none before; -1: not recorded)
  std::uint64_t fingerprint = 0;  // model_fingerprint(tensors), filled in when written and when read
  std::uint64_t file_size = 0;
  std::vector<SnapshotTensor> tensors;
};

// The model's fingerprint: FNV-1a 64 over each tensor's name, sizes, dtype and role, in order.
// Snapshots of one model have the same one.
EMAKIT_FUNC std::uint64_t model_fingerprint(const std::vector<SnapshotTensor>& tensors);

namespace detail {

inline constexpr std::array<char, 8> snapshot_magic = {'E', 'M', 'A', 'K', 'I', 'T', 'P', 'H'};
inline constexpr auto snapshot_format_version = static_cast<std::uint32_t>(formats::snapshot.version);
inline constexpr std::uint32_t snapshot_oldest_version = 1;  // the oldest version read
inline constexpr std::uint64_t snapshot_alignment = 64;
inline constexpr std::uint32_t snapshot_max_header = 1U << 30;

inline constexpr std::array<c10::ScalarType, 13> snapshot_dtypes = {
    c10::ScalarType::Undefined, c10::ScalarType::Float,   c10::ScalarType::Double, c10::ScalarType::Half,
    c10::ScalarType::BFloat16,  c10::ScalarType::ComplexFloat, c10::ScalarType::ComplexDouble,
    c10::ScalarType::Long,      c10::ScalarType::Int,     c10::ScalarType::Short,  c10::ScalarType::Char,
    c10::ScalarType::Byte,      c10::ScalarType::Bool};

}  // namespace detail
}  // namespace emakit

// The reader and writer: used by the post-hoc functions' definitions only (compiled once in
// compiled mode: detail/config.hpp).
#if EMAKIT_DEFINITIONS

#include <random>

namespace emakit {

EMAKIT_FUNC RunId RunId::random() {
  std::random_device device;
  RunId id;
  for (std::size_t i = 0; i < id.bytes.size(); i += 4) {
    const auto word = static_cast<std::uint32_t>(device());
    for (std::size_t k = 0; k < 4; ++k) id.bytes[i + k] = static_cast<std::uint8_t>(word >> (8 * k));
  }
  if (!id.recorded()) id.bytes[0] = 1;  // all zero means "not recorded"
  return id;
}

EMAKIT_FUNC std::string RunId::hex() const {
  if (!recorded()) return "none";
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (auto b : bytes) {
    out.push_back(digits[b >> 4]);
    out.push_back(digits[b & 15]);
  }
  return out;
}

EMAKIT_FUNC std::uint64_t model_fingerprint(const std::vector<SnapshotTensor>& tensors) {
  std::uint64_t h = 14695981039346656037ULL;  // FNV-1a 64
  const auto mix = [&h](const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ULL;
  };
  for (const auto& t : tensors) {
    const auto length = static_cast<std::uint64_t>(t.name.size());
    mix(&length, sizeof length);
    mix(t.name.data(), t.name.size());
    const auto ndim = static_cast<std::uint64_t>(t.sizes.size());
    mix(&ndim, sizeof ndim);
    for (const std::int64_t size : t.sizes) mix(&size, sizeof size);
    // The dtype as the file's code (0 if it has none), so that readers outside C++ can recompute it.
    const auto code = static_cast<std::uint8_t>(
        std::find(detail::snapshot_dtypes.begin(), detail::snapshot_dtypes.end(), t.dtype) - detail::snapshot_dtypes.begin());
    const std::uint8_t role = t.averaged ? 0 : 1;
    mix(&code, sizeof code);
    mix(&role, sizeof role);
  }
  return h;
}

}  // namespace emakit

namespace emakit::detail {

inline std::uint8_t dtype_code(c10::ScalarType type, const std::string& name) {
  for (std::size_t i = 1; i < snapshot_dtypes.size(); ++i)
    if (snapshot_dtypes[i] == type) return static_cast<std::uint8_t>(i);
  fail("tensor '{}' has dtype {}, which a snapshot file cannot hold", name, c10::toString(type));
}

inline std::uint64_t align_up(std::uint64_t n) { return (n + snapshot_alignment - 1) / snapshot_alignment * snapshot_alignment; }

// Appends little-endian values to a byte string.
class ByteWriter {
 public:
  template <class T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const char*>(&value);
    bytes_.append(p, sizeof(T));
  }
  void put_bytes(std::string_view s) { bytes_.append(s); }
  std::string& bytes() noexcept { return bytes_; }

 private:
  std::string bytes_;
};

// Reads little-endian values from a header body; running past its end means a corrupt header.
class ByteReader {
 public:
  ByteReader(const std::string& bytes, const std::filesystem::path& path) : bytes_(bytes), path_(path) {}
  template <class T>
  T get() {
    T value;
    need(sizeof(T));
    std::memcpy(&value, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string get_bytes(std::size_t n) {
    need(n);
    std::string out = bytes_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  bool done() const noexcept { return pos_ == bytes_.size(); }

 private:
  void need(std::size_t n) const {
    if (n > bytes_.size() - pos_)
      fail_runtime("snapshot '{}' is corrupt: its header ends in the middle of a field", path_.string());
  }
  const std::string& bytes_;
  const std::filesystem::path& path_;
  std::size_t pos_ = 0;
};

// The bytes [0, 16 + H + 4): magic, version, H, header body, CRC.
inline std::string encode_snapshot_header(const SnapshotInfo& info) {
  ByteWriter body;
  body.put<std::int64_t>(info.step);
  body.put<std::int64_t>(info.t);
  body.put<double>(info.gamma);
  body.put<double>(info.sigma_rel);
  body.put<std::int64_t>(info.update_every);
  body.put<std::uint32_t>(info.profile);
  body.put<std::uint32_t>(info.profiles);
  body.put<std::uint64_t>(info.file_size);
  body.put_bytes(std::string_view(reinterpret_cast<const char*>(info.run.bytes.data()), info.run.bytes.size()));
  body.put<std::int64_t>(info.run_started);
  body.put<std::int64_t>(info.previous_step);
  body.put<std::uint64_t>(info.fingerprint);
  body.put<std::uint32_t>(static_cast<std::uint32_t>(info.tensors.size()));
  for (const auto& t : info.tensors) {
    if (t.name.size() > std::numeric_limits<std::uint16_t>::max())
      fail("tensor name '{}...' is longer than a snapshot file allows (65535 bytes)", t.name.substr(0, 64));
    if (t.sizes.size() > std::numeric_limits<std::uint8_t>::max())
      fail("tensor '{}' has {} dimensions; a snapshot file allows 255", t.name, t.sizes.size());
    body.put<std::uint16_t>(static_cast<std::uint16_t>(t.name.size()));
    body.put_bytes(t.name);
    body.put<std::uint8_t>(dtype_code(t.stored_dtype, t.name));
    body.put<std::uint8_t>(dtype_code(t.dtype, t.name));
    body.put<std::uint8_t>(t.averaged ? 0 : 1);
    body.put<std::uint8_t>(static_cast<std::uint8_t>(t.sizes.size()));
    for (auto s : t.sizes) body.put<std::int64_t>(s);
    body.put<std::uint64_t>(t.offset);
    body.put<std::uint64_t>(t.nbytes);
    body.put<std::uint32_t>(t.crc32);
  }
  ByteWriter out;
  out.put_bytes(std::string_view(snapshot_magic.data(), snapshot_magic.size()));
  out.put<std::uint32_t>(snapshot_format_version);
  out.put<std::uint32_t>(static_cast<std::uint32_t>(body.bytes().size()));
  out.put_bytes(body.bytes());
  out.put<std::uint32_t>(crc32(out.bytes().data(), out.bytes().size()));
  return std::move(out.bytes());
}

inline std::uint64_t element_count(const std::vector<std::int64_t>& sizes) {
  std::uint64_t n = 1;
  for (auto s : sizes) n *= static_cast<std::uint64_t>(s);
  return n;
}

// Writes one snapshot file atomically, one tensor at a time: only one tensor is ever staged on
// the CPU. Give the header with every tensor's name, dtypes and sizes; offsets, sizes in bytes,
// checksums and the file size are filled in here.
class SnapshotWriter {
 public:
  SnapshotWriter(const std::filesystem::path& path, SnapshotInfo info) : info_(std::move(info)), file_(path) {
    info_.path = path;
    info_.format_version = snapshot_format_version;
    info_.fingerprint = model_fingerprint(info_.tensors);
    if (info_.previous_step < -1 || info_.previous_step >= info_.step)
      fail("snapshot '{}': previous_step must be -1 (not recorded), 0 (the run's first) or an earlier step than "
           "{}, got {}",
           path.string(), info_.step, info_.previous_step);
    std::uint64_t end = align_up(encode_snapshot_header(info_).size());
    for (auto& t : info_.tensors) {
      t.offset = end;
      t.nbytes = element_count(t.sizes) * c10::elementSize(t.stored_dtype);
      end = align_up(end + t.nbytes);
    }
    info_.file_size = info_.tensors.empty() ? end : info_.tensors.back().offset + info_.tensors.back().nbytes;
    written_.assign(info_.tensors.size(), false);
    file_.resize(info_.file_size);
  }

  const SnapshotInfo& info() const noexcept { return info_; }

  // Writes tensor i (any device and dtype; converted to its stored dtype on the CPU).
  void write(std::size_t i, const at::Tensor& tensor) {
    auto& entry = info_.tensors.at(i);
    if (!tensor.sizes().equals(entry.sizes))
      fail("snapshot '{}': tensor '{}' has shape {}, the header says {}", info_.path.string(), entry.name,
           shape_string(tensor.sizes()), shape_string(entry.sizes));
    const at::Tensor cpu = tensor.detach().to(c10::kCPU, entry.stored_dtype).contiguous();
    const auto* data = static_cast<const char*>(cpu.data_ptr());
    entry.crc32 = crc32(data, entry.nbytes);
    file_.write_at(entry.offset, data, entry.nbytes);
    written_[i] = true;
  }

  void commit() {
    for (std::size_t i = 0; i < written_.size(); ++i)
      if (!written_[i]) fail("internal: snapshot '{}': tensor '{}' was not written", info_.path.string(), info_.tensors[i].name);
    const std::string header = encode_snapshot_header(info_);
    file_.write_at(0, header.data(), header.size());
    file_.commit();
  }

 private:
  SnapshotInfo info_;
  AtomicFile file_;
  std::vector<bool> written_;
};

// Reads a snapshot file: the header when opened (checked against its CRC and the file's size),
// each tensor on request (checked against its CRC).
class SnapshotReader {
 public:
  // With keep_open = false the file is closed after the header and reopened for each read().
  explicit SnapshotReader(std::filesystem::path path, bool keep_open = true) {
    info_.path = std::move(path);
    const auto& p = info_.path;
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec))
      fail_runtime("'{}' is a directory, not a snapshot file (a folder of snapshots is read with list_snapshots() "
                   "or plan_synthesis())",
                   p.string());
    fd_ = open_file();
    struct ::stat st {};
    if (::fstat(fd_.get(), &st) != 0) fail_runtime("cannot stat snapshot '{}': {}", p.string(), errno_text(errno));
    const auto actual_size = static_cast<std::uint64_t>(st.st_size);

    std::array<char, 16> fixed{};
    if (read_at(fd_.get(), 0, fixed.data(), fixed.size(), p) != fixed.size())
      fail_runtime("snapshot '{}' is truncated: {} bytes, shorter than the 16-byte preamble", p.string(), actual_size);
    if (!std::equal(snapshot_magic.begin(), snapshot_magic.end(), fixed.begin()))
      fail_runtime("'{}' is not an emakit snapshot file (it does not start with \"EMAKITPH\")", p.string());
    std::uint32_t version, header_size;
    std::memcpy(&version, fixed.data() + 8, 4);
    std::memcpy(&header_size, fixed.data() + 12, 4);
    if (version < snapshot_oldest_version || version > snapshot_format_version)
      fail_runtime("snapshot '{}' has format version {}; this emakit reads versions {} to {}{}", p.string(), version,
                   snapshot_oldest_version, snapshot_format_version,
                   version > snapshot_format_version ? " (written by a newer emakit: update emakit)" : "");
    info_.format_version = version;
    if (header_size > snapshot_max_header)
      fail_runtime("snapshot '{}' is corrupt: its header claims {} bytes", p.string(), header_size);

    std::string head(16 + std::size_t{header_size} + 4, '\0');
    if (read_at(fd_.get(), 0, head.data(), head.size(), p) != head.size())
      fail_runtime("snapshot '{}' is truncated: {} bytes, shorter than its {}-byte header", p.string(), actual_size,
                   head.size());
    std::uint32_t stored_crc;
    std::memcpy(&stored_crc, head.data() + head.size() - 4, 4);
    if (crc32(head.data(), head.size() - 4) != stored_crc)
      fail_runtime("snapshot '{}' is corrupt: its header fails the CRC-32 check", p.string());
    parse_body(head.substr(16, header_size));
    if (actual_size < info_.file_size)
      fail_runtime("snapshot '{}' is truncated: {} bytes, its header says {}", p.string(), actual_size, info_.file_size);
    if (actual_size > info_.file_size)
      fail_runtime("snapshot '{}' is corrupt: {} bytes, its header says {}", p.string(), actual_size, info_.file_size);
    if (!keep_open) fd_.reset();
  }

  const SnapshotInfo& info() const noexcept { return info_; }

  // Tensor i on the CPU in its stored dtype, after checking its CRC-32.
  at::Tensor read(std::size_t i) const {
    const auto& entry = info_.tensors.at(i);
    at::Tensor out = at::empty(entry.sizes, at::TensorOptions().dtype(entry.stored_dtype));
    auto* data = static_cast<char*>(out.data_ptr());
    FileDescriptor reopened;
    if (!fd_) reopened = open_file();
    if (read_at(fd_ ? fd_.get() : reopened.get(), entry.offset, data, entry.nbytes, info_.path) != entry.nbytes)
      fail_runtime("snapshot '{}' is truncated in tensor '{}'", info_.path.string(), entry.name);
    if (crc32(data, entry.nbytes) != entry.crc32)
      fail_runtime("snapshot '{}' is corrupt: tensor '{}' fails the CRC-32 check", info_.path.string(), entry.name);
    return out;
  }

 private:
  FileDescriptor open_file() const {
    FileDescriptor fd(::open(info_.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) fail_runtime("cannot open snapshot '{}': {}", info_.path.string(), errno_text(errno));
    return fd;
  }

  void parse_body(const std::string& body) {
    const auto& p = info_.path;
    ByteReader r(body, p);
    info_.step = r.get<std::int64_t>();
    info_.t = r.get<std::int64_t>();
    info_.gamma = r.get<double>();
    info_.sigma_rel = r.get<double>();
    info_.update_every = r.get<std::int64_t>();
    info_.profile = r.get<std::uint32_t>();
    info_.profiles = r.get<std::uint32_t>();  // 0 in version 1
    info_.file_size = r.get<std::uint64_t>();
    std::uint64_t stored_fingerprint = 0;
    if (info_.format_version >= 2) {
      const std::string run = r.get_bytes(info_.run.bytes.size());
      std::copy(run.begin(), run.end(), info_.run.bytes.begin());
      info_.run_started = r.get<std::int64_t>();
      info_.previous_step = r.get<std::int64_t>();
      stored_fingerprint = r.get<std::uint64_t>();
    }
    const auto n = r.get<std::uint32_t>();
    auto dtype = [&](std::uint8_t code, const std::string& name) {
      if (code == 0 || code >= snapshot_dtypes.size())
        fail_runtime("snapshot '{}' is corrupt: tensor '{}' has the unknown dtype code {}", p.string(), name, code);
      return snapshot_dtypes[code];
    };
    for (std::uint32_t k = 0; k < n; ++k) {
      SnapshotTensor t;
      t.name = r.get_bytes(r.get<std::uint16_t>());
      t.stored_dtype = dtype(r.get<std::uint8_t>(), t.name);
      t.dtype = dtype(r.get<std::uint8_t>(), t.name);
      const auto role = r.get<std::uint8_t>();
      if (role > 1) fail_runtime("snapshot '{}' is corrupt: tensor '{}' has the role code {}", p.string(), t.name, role);
      t.averaged = role == 0;
      const auto ndim = r.get<std::uint8_t>();
      for (std::uint8_t d = 0; d < ndim; ++d) {
        t.sizes.push_back(r.get<std::int64_t>());
        if (t.sizes.back() < 0) fail_runtime("snapshot '{}' is corrupt: tensor '{}' has a negative size", p.string(), t.name);
      }
      t.offset = r.get<std::uint64_t>();
      t.nbytes = r.get<std::uint64_t>();
      t.crc32 = r.get<std::uint32_t>();
      const auto expected = element_count(t.sizes) * c10::elementSize(t.stored_dtype);
      if (t.nbytes != expected || t.offset > info_.file_size || t.nbytes > info_.file_size - t.offset)
        fail_runtime("snapshot '{}' is corrupt: tensor '{}' does not fit the file", p.string(), t.name);
      info_.tensors.push_back(std::move(t));
    }
    if (!r.done()) fail_runtime("snapshot '{}' is corrupt: its header has trailing bytes", p.string());
    if (!(info_.gamma > 0) || info_.t <= 0 || info_.update_every <= 0)
      fail_runtime("snapshot '{}' is corrupt: profile t = {}, gamma = {}, update_every = {}", p.string(), info_.t,
                   info_.gamma, info_.update_every);
    info_.fingerprint = model_fingerprint(info_.tensors);
    if (info_.format_version >= 2 && stored_fingerprint != info_.fingerprint)
      fail_runtime("snapshot '{}' is corrupt: its model fingerprint {:016x} is not that of its tensor table ({:016x})",
                   p.string(), stored_fingerprint, info_.fingerprint);
    if (info_.profiles != 0 && info_.profile >= info_.profiles)
      fail_runtime("snapshot '{}' is corrupt: profile {} of {}", p.string(), info_.profile, info_.profiles);
    if (info_.previous_step < -1 || info_.previous_step >= info_.step)
      fail_runtime("snapshot '{}' is corrupt: its previous snapshot's step {} is not before its step {}", p.string(),
                   info_.previous_step, info_.step);
  }

  SnapshotInfo info_;
  FileDescriptor fd_;
};

}  // namespace emakit::detail

#endif  // EMAKIT_DEFINITIONS
