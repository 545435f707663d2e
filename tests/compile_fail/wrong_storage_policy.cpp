// A type that is not a storage policy is rejected, and the compiler names the concept.
// The constraint is on Ema's declaration (fwd.hpp); decay.hpp and schedule.hpp complete the other
// two arguments, so that only the storage can fail: a quarter of emakit.hpp's parse (6 s of CPU
// instead of 22 s, LibTorch 1.13, g++ 12). The second line pins the reason: NotAStorage, as the
// Storage argument, fails StoragePolicy (g++'s note, or clang's).
// expect-error: StoragePolicy
// expect-error: StoragePolicy<Storage>[^ ]* \[with Storage = NotAStorage\]|'NotAStorage' does not satisfy
#include <emakit/decay.hpp>
#include <emakit/fwd.hpp>
#include <emakit/schedule.hpp>

struct NotAStorage {};

emakit::Ema<emakit::Fixed, emakit::StepSchedule, NotAStorage>* wrong = nullptr;
