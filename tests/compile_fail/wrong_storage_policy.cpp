// A type that is not a storage policy is rejected, and the compiler names the concept.
// expect-error: StoragePolicy
#include <emakit/emakit.hpp>

struct NotAStorage {};

emakit::Ema<emakit::Fixed, emakit::StepSchedule, NotAStorage>* wrong = nullptr;
