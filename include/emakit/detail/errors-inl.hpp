// The non-template definitions of errors.hpp: included at the end of errors.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/errors-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/detail/errors.hpp> instead"
#endif

#include <emakit/detail/errors.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in ranges.h from fmt 11 on)

EMAKIT_FUNC std::string emakit::detail::shape_string(c10::IntArrayRef sizes) {
  return fmt::format("[{}]", fmt::join(sizes, ", "));
}

EMAKIT_FUNC void emakit::detail::rethrow_with_context(std::string_view suffix, std::string_view prefix) {
  const auto with_context = [&](const std::exception& e) {
    std::string_view message = e.what();
    if (prefix.empty()) return fmt::format("{}{}", message, suffix);
    constexpr std::string_view lead = "emakit: ";  // detail::fail's, kept in front of the prefix
    if (message.substr(0, lead.size()) == lead) message.remove_prefix(lead.size());
    return fmt::format("{}{}{}{}", lead, prefix, message, suffix);
  };
  try {
    throw;
  } catch (const FormatVersionError& e) {
    throw FormatVersionError(with_context(e), e.found());
  } catch (const SynthesisRefused& e) {
    throw SynthesisRefused(with_context(e));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(with_context(e));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(with_context(e));
  }
}
