// The compiled mode's instantiations of the aliases that need no user type (aliases.hpp):
// their users see them declared `extern template` and compile none of Ema's members.
#include <emakit/aliases.hpp>
#include <emakit/checkpoint.hpp>

namespace emakit {
template class Ema<Fixed, StepSchedule, FlatStorage>;
template class Ema<InversePowerWarmup, StepSchedule, FlatStorage>;
template class Ema<ExponentialRamp, StepSchedule, FlatStorage>;
template class Ema<PowerFunction, StepSchedule, FlatStorage>;
template class Ema<Uniform, StepSchedule, FlatStorage>;
}  // namespace emakit
