// CRC-32 (IEEE 802.3, the polynomial of zlib and PNG), slicing-by-8: the checksum of post-hoc EMA
// snapshot files. It equals Python's zlib.crc32, so a file can be checked without emakit.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace emakit::detail {

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

// Continues a CRC-32: crc32(data, n, crc32(prefix, m)) == crc32 of prefix followed by data.
inline std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0) noexcept {
  const auto& t = crc32_tables;
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {  // the format is little-endian; so is every supported host
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFFU] ^ t[6][(lo >> 8) & 0xFFU] ^ t[5][(lo >> 16) & 0xFFU] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFFU] ^ t[2][(hi >> 8) & 0xFFU] ^ t[1][(hi >> 16) & 0xFFU] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = t[0][(c ^ *p) & 0xFFU] ^ (c >> 8);
  return ~c;
}

}  // namespace emakit::detail
