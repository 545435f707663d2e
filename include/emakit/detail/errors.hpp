// Every emakit error is thrown from here: std::invalid_argument (fail) for bad input,
// std::runtime_error (fail_runtime) for what the system refused (a file, a collective),
// FormatVersionError (fail_format_version) and SynthesisRefused (refuse_synthesis), each
// "emakit: " and a message that names the bad value. Light on purpose (fmt and c10's Exception
// only): the archive scan includes it, and is built by a compiler that cannot take ATen headers.
#pragma once

#include <emakit/detail/config.hpp>

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// A post-hoc synthesis refused because its result would not be the EMA asked for: a snapshot set
// with gaps, a target far outside the tracked profiles, weights past their bound, an
// ill-conditioned system. The message names the option that accepts it anyway
// (SynthesisOptions). A std::runtime_error.
class SynthesisRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file in a format version this emakit does not read (detail/serial/formats.hpp lists the
// formats): the message names the format, the version found, the emakit that wrote it where the
// file records that, and the versions this emakit reads. Every reader throws it the same way
// (formats::check_version). A std::invalid_argument.
class FormatVersionError : public std::invalid_argument {
 public:
  FormatVersionError(const std::string& message, std::int64_t found) : std::invalid_argument(message), found_(found) {}
  std::int64_t found() const noexcept { return found_; }  // the version the file holds

 private:
  std::int64_t found_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// Re-throws the exception being handled with context added to its message, keeping its type
// (FormatVersionError, SynthesisRefused, std::invalid_argument, std::runtime_error; anything else
// unchanged): `suffix` after it (a file's name, the emakit that wrote it), `prefix` after its
// "emakit: " (the part of a whole that failed). Call it in a catch block.
[[noreturn]] EMAKIT_FUNC void rethrow_with_context(std::string_view suffix, std::string_view prefix = {});

// The format string of an emakit message. In the all-inline mode it is fmt's own
// (fmt::format_string: every replacement field checked against its argument's type at compile
// time); the test suite builds every message that way (the torch1.13 variant is all-inline). In
// the default and library modes, where a user's translation unit parses the same inline code, it
// is only counted: the fields must number the arguments (a compile error at the call otherwise),
// and fmt's per-call check templates, which cost a trainer's translation unit ~12 MB of the
// compiler's memory for code it never calls, are not instantiated (docs/performance.md). The two
// modes live in different namespaces (detail/config.hpp), so no function has two definitions.
#if defined(EMAKIT_HEADER_ONLY)
template <class... Args>
using MessageFormat = fmt::format_string<Args...>;
#else
// Not constexpr: reaching it in CountedFormat's constructor makes the call's format string a
// compile error that names the problem.
void message_format_does_not_match_its_arguments();

template <std::size_t N>
class CountedFormat {
 public:
  template <std::size_t M>
  consteval CountedFormat(const char (&format)[M]) : text_(format, M - 1) {
    std::size_t automatic = 0;   // fields "{}" or "{:spec}": the next argument each
    std::size_t positional = 0;  // fields "{k}" or "{k:spec}": argument k
    for (std::size_t i = 0; i + 1 < M; ++i) {
      const bool doubled = i + 2 < M && format[i + 1] == format[i];
      if ((format[i] == '{' || format[i] == '}') && doubled) {
        ++i;  // "{{" or "}}": a literal brace
      } else if (format[i] == '{') {
        ++i;
        if (format[i] >= '0' && format[i] <= '9') {
          std::size_t index = 0;
          for (; format[i] >= '0' && format[i] <= '9'; ++i)
            index = index * 10 + static_cast<std::size_t>(format[i] - '0');
          if (index >= N) message_format_does_not_match_its_arguments();
          ++positional;
        } else {
          ++automatic;
        }
        while (i + 1 < M && format[i] != '}') ++i;
        if (format[i] != '}') message_format_does_not_match_its_arguments();
      } else if (format[i] == '}') {
        message_format_does_not_match_its_arguments();
      }
    }
    // Every argument is used by the automatic fields, or positional fields only (fmt
    // refuses a mix).
    if (positional == 0 ? automatic != N : automatic != 0) message_format_does_not_match_its_arguments();
  }
  operator fmt::string_view() const noexcept { return {text_.data(), text_.size()}; }

 private:
  std::string_view text_;
};
template <class... Args>
using MessageFormat = CountedFormat<sizeof...(Args)>;
#endif

// Throws SynthesisRefused with a formatted message, prefixed by "emakit: ".
template <class... Args>
[[noreturn]] void refuse_synthesis(MessageFormat<Args...> format, Args&&... args) {
  throw SynthesisRefused("emakit: " + fmt::vformat(format, fmt::make_format_args(args...)));
}

// Throws std::invalid_argument with a formatted message, prefixed by "emakit: ".
template <class... Args>
[[noreturn]] void fail(MessageFormat<Args...> format, Args&&... args) {
  throw std::invalid_argument("emakit: " + fmt::vformat(format, fmt::make_format_args(args...)));
}

// Throws FormatVersionError (the file holds version `found`) with a formatted message, prefixed
// by "emakit: ".
template <class... Args>
[[noreturn]] void fail_format_version(std::int64_t found, MessageFormat<Args...> format, Args&&... args) {
  throw FormatVersionError("emakit: " + fmt::vformat(format, fmt::make_format_args(args...)), found);
}

// Throws std::runtime_error with a formatted message, prefixed by "emakit: ".
template <class... Args>
[[noreturn]] void fail_runtime(MessageFormat<Args...> format, Args&&... args) {
  throw std::runtime_error("emakit: " + fmt::vformat(format, fmt::make_format_args(args...)));
}

// The system's text for an errno value.
inline std::string errno_text(int error) { return std::strerror(error); }

// The first line of an error message: c10::Error appends a C++ backtrace (and LibTorch's
// messages their context) on the lines after it.
inline std::string first_line(std::string_view message) { return std::string(message.substr(0, message.find('\n'))); }
inline std::string first_line(const c10::Error& e) { return first_line(e.what_without_backtrace()); }

// Formats a shape as [2, 3].
EMAKIT_FUNC std::string shape_string(c10::IntArrayRef sizes);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/errors-inl.hpp>
#endif
