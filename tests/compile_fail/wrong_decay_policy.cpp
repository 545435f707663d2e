// A type that is not a decay policy is rejected, and the compiler names the concept.
// expect-error: DecayPolicy
#include <emakit/emakit.hpp>

struct NotADecay {
  double beta = 0.9;  // no decay(const DecayInput&)
};

emakit::Ema<NotADecay>* wrong = nullptr;
