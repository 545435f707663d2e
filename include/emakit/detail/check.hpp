// Errors and checks: every emakit error is thrown from here, with a message that names the bad
// value and what was expected. std::invalid_argument (fail) for bad input, std::runtime_error
// (fail_runtime) for what the system refused (a file, a collective).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/isfinite.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>

namespace emakit::detail {

// Throws std::invalid_argument with a formatted message, prefixed by "emakit: ".
template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw std::invalid_argument("emakit: " + fmt::format(format, std::forward<Args>(args)...));
}

// Throws std::runtime_error with a formatted message, prefixed by "emakit: ".
template <class... Args>
[[noreturn]] void fail_runtime(fmt::format_string<Args...> format, Args&&... args) {
  throw std::runtime_error("emakit: " + fmt::format(format, std::forward<Args>(args)...));
}

// The system's text for an errno value.
inline std::string errno_text(int error) { return std::strerror(error); }

// The first line of an error message: c10::Error appends a C++ backtrace (and LibTorch's
// messages their context) on the lines after it.
inline std::string first_line(std::string_view message) { return std::string(message.substr(0, message.find('\n'))); }
inline std::string first_line(const c10::Error& e) { return first_line(e.what_without_backtrace()); }

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

// Formats a shape as [2, 3].
inline std::string shape_string(c10::IntArrayRef sizes) { return fmt::format("[{}]", fmt::join(sizes, ", ")); }

}  // namespace emakit::detail
