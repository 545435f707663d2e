// Mode mixing (tests/CMakeLists.txt): the other half of advance.cpp.
#include <emakit/aliases.hpp>

#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <cstdio>

std::int64_t advance(emakit::WarmupEma& ema, int steps);  // advance.cpp

std::int64_t count_calls(const emakit::WarmupEma& ema) { return ema.calls(); }

int main() {
  torch::nn::Linear model(4, 2);
  emakit::WarmupEma ema(*model);
  const std::int64_t seen = advance(ema, 3);
  if (seen != 3 || ema.calls() != 3) {
    std::fprintf(stderr, "mode_mix: advance(ema, 3) saw %lld update() calls and main %lld, expected 3 in both\n",
                 static_cast<long long>(seen), static_cast<long long>(ema.calls()));
    return 1;
  }
  std::puts("mode_mix: both translation units agree on 3 update() calls");
  return 0;
}
