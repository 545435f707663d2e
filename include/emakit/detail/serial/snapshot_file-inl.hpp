// The non-template definitions of snapshot_file.hpp: included at the end of
// snapshot_file.hpp in the all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per
// program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/snapshot_file-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/snapshot_file.hpp> instead"
#endif

#include <emakit/detail/serial/snapshot_file.hpp>
#include <emakit/detail/serial/posix_file.hpp>

#include <random>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

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
    // The dtype as the file's code (0 if it has none), so that readers outside C++ can recompute
    // it.
    const auto code =
        static_cast<std::uint8_t>(std::find(detail::snapshot_dtypes.begin(), detail::snapshot_dtypes.end(), t.dtype) -
                                  detail::snapshot_dtypes.begin());
    const std::uint8_t role = t.averaged ? 0 : 1;
    mix(&code, sizeof code);
    mix(&role, sizeof role);
  }
  return h;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

inline std::uint8_t dtype_code(c10::ScalarType type, const std::string& name) {
  for (std::size_t i = 1; i < snapshot_dtypes.size(); ++i)
    if (snapshot_dtypes[i] == type) return static_cast<std::uint8_t>(i);
  fail("tensor '{}' has dtype {}, which a snapshot file cannot hold", name, c10::toString(type));
}

inline std::uint64_t align_up(std::uint64_t n) {
  return (n + snapshot_alignment - 1) / snapshot_alignment * snapshot_alignment;
}

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
      if (!written_[i])
        fail("internal: snapshot '{}': tensor '{}' was not written", info_.path.string(), info_.tensors[i].name);
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
    formats::check_version(formats::snapshot, version, fmt::format("snapshot '{}'", p.string()));
    info_.format_version = version;
    if (header_size > snapshot_max_header)
      fail_runtime("snapshot '{}' is corrupt: its header claims {} bytes", p.string(), header_size);
    // Against the file's size before anything is allocated: a short file claiming a large header
    // costs nothing.
    const std::size_t head_size = 16 + std::size_t{header_size} + 4;
    const auto truncated = [&] {
      fail_runtime("snapshot '{}' is truncated: {} bytes, shorter than its {}-byte header", p.string(), actual_size,
                   head_size);
    };
    if (actual_size < head_size) truncated();

    std::string head(head_size, '\0');
    if (read_at(fd_.get(), 0, head.data(), head.size(), p) != head.size()) truncated();  // cut after the fstat
    std::uint32_t stored_crc;
    std::memcpy(&stored_crc, head.data() + head.size() - 4, 4);
    if (crc32(head.data(), head.size() - 4) != stored_crc)
      fail_runtime("snapshot '{}' is corrupt: its header fails the CRC-32 check", p.string());
    parse_body(head.substr(16, header_size));
    if (actual_size < info_.file_size)
      fail_runtime("snapshot '{}' is truncated: {} bytes, its header says {}", p.string(), actual_size,
                   info_.file_size);
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
      if (role > 1)
        fail_runtime("snapshot '{}' is corrupt: tensor '{}' has the role code {}", p.string(), t.name, role);
      t.averaged = role == 0;
      const auto ndim = r.get<std::uint8_t>();
      for (std::uint8_t d = 0; d < ndim; ++d) {
        t.sizes.push_back(r.get<std::int64_t>());
        if (t.sizes.back() < 0)
          fail_runtime("snapshot '{}' is corrupt: tensor '{}' has a negative size", p.string(), t.name);
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
