// The non-template definitions of checksum.hpp: included at the end of checksum.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/serial/checksum-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/serial/checksum.hpp> instead"
#endif

#include <emakit/detail/serial/checksum.hpp>

#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/tensor_dict.hpp>

#include <array>
#include <cstring>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

using Crc32Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Crc32Tables make_crc32_tables() {
  Crc32Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1U) ? 0xEDB88320U ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t i = 0; i < 256; ++i)
    for (std::size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFU];
  return t;
}

inline constexpr Crc32Tables crc32_tables = make_crc32_tables();

EMAKIT_FUNC std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc) noexcept {
  const auto& t = crc32_tables;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {  // the format is little-endian; so is every supported host
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFFU] ^ t[6][(lo >> 8) & 0xFFU] ^ t[5][(lo >> 16) & 0xFFU] ^ t[4][lo >> 24] ^ t[3][hi & 0xFFU] ^
        t[2][(hi >> 8) & 0xFFU] ^ t[1][(hi >> 16) & 0xFFU] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = t[0][(c ^ *p) & 0xFFU] ^ (c >> 8);
  return ~c;
}

EMAKIT_FUNC std::int64_t tensor_checksum(const at::Tensor& t) {
  const at::Tensor c = t.detach().cpu().contiguous();
  std::uint32_t crc = 0;
  const auto type = static_cast<std::int32_t>(c.scalar_type());
  crc = crc32(&type, sizeof(type), crc);
  for (const std::int64_t d : c.sizes()) crc = crc32(&d, sizeof(d), crc);
  crc = crc32(c.data_ptr(), c.nbytes(), crc);
  return static_cast<std::int64_t>(crc);
}

EMAKIT_FUNC void Checksums::load(torch::serialize::InputArchive& archive, const std::string& key,
                                 const std::string& where) {
  auto items = read_tensor_dict(archive, key, where);
  if (!items)
    fail("{}: the checkpoint has no '{}'; it is damaged, or was written before emakit kept checksums", where, key);
  for (const auto& [name, t] : *items) {
    if (t.numel() != 1 || t.scalar_type() != at::kLong)
      fail("{}: checksum '{}' is not one int64; the checkpoint is damaged", where, name);
    read.emplace(name, t.item<std::int64_t>());
  }
}

EMAKIT_FUNC void Checksums::check(const std::string& name, const at::Tensor& t, const std::string& where) const {
  auto it = read.find(name);
  if (it == read.end())
    fail("{}: the checkpoint has no checksum for '{}'; it is damaged or was not written by emakit", where, name);
  if (it->second != tensor_checksum(t))
    fail("{}: '{}' does not match its checksum; the checkpoint is damaged", where, name);
}

EMAKIT_FUNC std::optional<std::vector<std::pair<std::string, at::Tensor>>> read_checked_dict(
    torch::serialize::InputArchive& archive, const std::string& key, const Checksums& sums, const std::string& prefix,
    const std::string& where) {
  auto items = read_tensor_dict(archive, key, where);
  if (items) sums.check_all(*items, prefix, where);
  return items;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
