// emakit::compiled's (EMAKIT_COMPILED) instantiations of the aliases that need no user type
// (aliases.hpp): their users see these declared `extern template` (aliases.hpp, checkpoint.hpp,
// format.hpp) and compile none of it. This unit defines its own macros (detail/config.hpp):
// EMAKIT_INSTANTIATING turns the `extern template` declarations off here.
#define EMAKIT_INSTANTIATING 1
#if !defined(EMAKIT_COMPILED)
#define EMAKIT_COMPILED 1
#endif

#include <emakit/aliases.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/format.hpp>

// Expanded for each flat alias (aliases.hpp's one list): the class, its checkpoint file
// functions, its description.
#define EMAKIT_INSTANTIATE(Decay)                                                                           \
  template class Ema<Decay, StepSchedule, FlatStorage>;                                                     \
  template void save(const Ema<Decay, StepSchedule, FlatStorage>&, const std::filesystem::path&);           \
  template LoadReport load(Ema<Decay, StepSchedule, FlatStorage>&, const std::filesystem::path&, LoadMode); \
  template std::string describe(const Ema<Decay, StepSchedule, FlatStorage>&);

namespace emakit::inline EMAKIT_ABI_NAMESPACE {
EMAKIT_FOR_EACH_FLAT_ALIAS_DECAY(EMAKIT_INSTANTIATE)
}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
