// The one checksum of emakit's files: CRC-32 (IEEE 802.3, the polynomial of zlib and PNG),
// slicing-by-8. It equals Python's zlib.crc32, so a snapshot file can be checked without emakit.
// Archives keep one per tensor (Checksums): LibTorch's archive reader does not check the zip
// format's own CRC-32s, so a damaged file would otherwise load as different weights.
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/serialize/input-archive.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// Continues a CRC-32: crc32(data, n, crc32(prefix, m)) == crc32 of prefix followed by data.
EMAKIT_FUNC std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0) noexcept;

// The checksum of a tensor as saved: CRC-32 of its dtype, shape and bytes.
EMAKIT_FUNC std::int64_t tensor_checksum(const at::Tensor& t);

// Checksums by name: collected while saving (written with tensor_dict()), read back and checked
// while loading, before anything is written.
struct Checksums {
  std::vector<std::pair<std::string, at::Tensor>> saved;
  std::unordered_map<std::string, std::int64_t> read;

  void add(const std::string& name, const at::Tensor& t) {
    saved.emplace_back(name, at::scalar_tensor(tensor_checksum(t), at::kLong));
  }
  void load(torch::serialize::InputArchive& archive, const std::string& key, const std::string& where);
  void check(const std::string& name, const at::Tensor& t, const std::string& where) const;
  // Every tensor of a dictionary read back, each under `prefix` + its name.
  void check_all(const std::vector<std::pair<std::string, at::Tensor>>& items, const std::string& prefix,
                 const std::string& where) const {
    for (const auto& [name, t] : items) check(prefix + name, t, where);
  }
};

// The one read of a dictionary of tensors with its checksums: the tensor_dict() under `key`
// (tensor_dict.hpp), each tensor checked against `sums` under `prefix` + its name before any is
// returned; nullopt when the archive has no `key`. What the EMA state, the hook checkpoint and
// the sharded checkpoint read their tensors with.
EMAKIT_FUNC std::optional<std::vector<std::pair<std::string, at::Tensor>>> read_checked_dict(
    torch::serialize::InputArchive& archive, const std::string& key, const Checksums& sums, const std::string& prefix,
    const std::string& where);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/serial/checksum-inl.hpp>
#endif
