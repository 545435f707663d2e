// The non-template definitions of errors.hpp: included at the end of errors.hpp in header-only mode,
// compiled once into the emakit library (src/emakit.cpp) in compiled mode (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/detail/errors-inl.hpp holds definitions that the emakit library compiles in compiled mode (EMAKIT_COMPILED): include <emakit/detail/errors.hpp> instead"
#endif

#include <emakit/detail/errors.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in ranges.h from fmt 11 on)

EMAKIT_FUNC std::string emakit::detail::shape_string(c10::IntArrayRef sizes) {
  return fmt::format("[{}]", fmt::join(sizes, ", "));
}

EMAKIT_FUNC void emakit::detail::rethrow_with_context(std::string_view suffix) {
  try {
    throw;
  } catch (const FormatVersionError& e) {
    throw FormatVersionError(fmt::format("{}{}", e.what(), suffix), e.found());
  } catch (const SynthesisRefused& e) {
    throw SynthesisRefused(fmt::format("{}{}", e.what(), suffix));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}{}", e.what(), suffix));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(fmt::format("{}{}", e.what(), suffix));
  }
}
