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

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// One tensor of a snapshot file.
struct SnapshotTensor {
  std::string name;                                       // the model's state-dict name
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
  std::int64_t step = 0;             // the trainer's step when it was written
  std::int64_t t = 0;                // the profile's time (the step of the EMA's last update)
  double gamma = 0;                  // the power-function exponent
  double sigma_rel = 0;              // the same, as a relative width
  std::int64_t update_every = 1;     // steps between the EMA's updates
  std::uint32_t profile = 0;         // the profile's index in the PostHocEma that wrote it
  std::uint32_t profiles = 0;        // how many profiles that PostHocEma tracks (0: not recorded)
  RunId run;                         // the run that wrote it (not recorded: all zero)
  std::int64_t run_started = 0;      // when that run started, Unix seconds (0: not recorded)
  std::int64_t previous_step = -1;   // the step of the run's previous snapshot (0: none before; -1: not recorded)
  std::uint64_t fingerprint = 0;     // model_fingerprint(tensors), filled in when written and when read
  std::uint64_t file_size = 0;
  std::vector<SnapshotTensor> tensors;
};

// The model's fingerprint: FNV-1a 64 over each tensor's name, sizes, dtype and role, in order.
// Snapshots of one model have the same one.
EMAKIT_FUNC std::uint64_t model_fingerprint(const std::vector<SnapshotTensor>& tensors);

namespace detail {

inline constexpr std::array<char, 8> snapshot_magic = {'E', 'M', 'A', 'K', 'I', 'T', 'P', 'H'};
inline constexpr auto snapshot_format_version = static_cast<std::uint32_t>(formats::snapshot.version);
inline constexpr std::uint64_t snapshot_alignment = 64;
inline constexpr std::uint32_t snapshot_max_header = 1U << 30;

inline constexpr std::array<c10::ScalarType, 13> snapshot_dtypes = {
    c10::ScalarType::Undefined, c10::ScalarType::Float,        c10::ScalarType::Double,        c10::ScalarType::Half,
    c10::ScalarType::BFloat16,  c10::ScalarType::ComplexFloat, c10::ScalarType::ComplexDouble, c10::ScalarType::Long,
    c10::ScalarType::Int,       c10::ScalarType::Short,        c10::ScalarType::Char,          c10::ScalarType::Byte,
    c10::ScalarType::Bool};

}  // namespace detail
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

// The reader and writer: used by the post-hoc functions' definitions only (compiled once per
// program, in the implementation file, unless EMAKIT_HEADER_ONLY: detail/config.hpp).

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/snapshot_file-inl.hpp>
#endif
