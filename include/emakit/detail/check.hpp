// Checks with messages that name the bad value and what was expected.
#pragma once

#include <c10/util/ArrayRef.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>
#include <string>

namespace emakit::detail {

// Throws std::invalid_argument with a formatted message, prefixed by "emakit: ".
template <class... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw std::invalid_argument("emakit: " + fmt::format(format, std::forward<Args>(args)...));
}

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

// Formats a shape as [2, 3].
inline std::string shape_string(c10::IntArrayRef sizes) { return fmt::format("[{}]", fmt::join(sizes, ", ")); }

}  // namespace emakit::detail
