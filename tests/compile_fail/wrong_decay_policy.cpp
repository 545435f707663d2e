// A type that is not a decay policy is rejected, and the compiler names the concept.
// The constraint is on Ema's declaration, which fwd.hpp holds (emakit.hpp includes it, and a
// redeclaration cannot change it): naming Ema<NotADecay> there fails the same way as after
// emakit.hpp, with no LibTorch header parsed (fwd.hpp reaches none: under 1 s of CPU instead of
// 23 s, LibTorch 1.13, g++ 12).
// The second line pins the reason: NotADecay, as the Decay argument, fails DecayPolicy (g++'s
// note, or clang's), not another argument or a missing declaration.
// expect-error: DecayPolicy
// expect-error: DecayPolicy<Decay>[^ ]* \[with Decay = NotADecay\]|'NotADecay' does not satisfy 'DecayPolicy'
#include <emakit/fwd.hpp>

struct NotADecay {
  double beta = 0.9;  // no decay(const DecayInput&)
};

emakit::Ema<NotADecay>* wrong = nullptr;
