// Checks of options and tensors, with messages that name the bad value and what was expected
// (the errors themselves: detail/errors.hpp).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/errors.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <fmt/core.h>

#include <cstdint>
#include <string>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// `what` is the option's full name, e.g. "Fixed::beta".
inline void check_unit_interval(double value, const char* what) {  // [0, 1)
  if (!(value >= 0.0 && value < 1.0)) fail("{} must be in [0, 1), got {}", what, value);
}

inline void check_positive(double value, const char* what) {
  if (!(value > 0.0)) fail("{} must be > 0, got {}", what, value);
}

template <class Int>
void check_positive_int(Int value, const char* what) {
  if (value <= 0) fail("{} must be > 0, got {}", what, value);
}

template <class Int>
void check_non_negative_int(Int value, const char* what) {
  if (value < 0) fail("{} must be >= 0, got {}", what, value);
}

// True when every element of a floating tensor is finite (integer tensors always are). Contiguous
// CPU float, double, bfloat16 and half tensors are scanned in place by their exponent bits, with
// no allocation; anything else asks ATen.
inline bool all_finite(const at::Tensor& t) {
  const auto type = t.scalar_type();
  if (!c10::isFloatingType(type) && !c10::isComplexType(type)) return true;
  if (t.is_cpu() && t.is_contiguous()) {
    auto scan = [&](auto bits_type, auto mask) {
      using Bits = decltype(bits_type);
      const auto* p = static_cast<const Bits*>(t.data_ptr());
      const std::int64_t n = t.numel();
      bool bad = false;
      for (std::int64_t i = 0; i < n; ++i) bad |= (p[i] & mask) == mask;  // exponent all ones: Inf or NaN
      return !bad;
    };
    switch (type) {
      case at::kFloat: return scan(std::uint32_t{}, std::uint32_t{0x7F800000u});
      case at::kDouble: return scan(std::uint64_t{}, std::uint64_t{0x7FF0000000000000ull});
      case at::kBFloat16: return scan(std::uint16_t{}, std::uint16_t{0x7F80u});
      case at::kHalf: return scan(std::uint16_t{}, std::uint16_t{0x7C00u});
      default: break;
    }
  }
  return at::isfinite(t).all().item<bool>();
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
