// Mode mixing (tests/CMakeLists.txt): this file and main.cpp each call a function the other
// defines, taking an emakit type. Built in the same mode they link and run; built in different
// modes (emakit::compiled and emakit::emakit) their link must fail, naming both namespaces.
#include <emakit/aliases.hpp>

#include <cstdint>

std::int64_t count_calls(const emakit::WarmupEma& ema);  // main.cpp

std::int64_t advance(emakit::WarmupEma& ema, int steps) {
  for (int i = 0; i < steps; ++i) ema.update();
  return count_calls(ema);
}
