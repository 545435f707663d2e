// house.fwd_without_libtorch: compiled with include/ as the only include path besides the standard
// library's (no LibTorch, no fmt), so it fails as soon as <emakit/fwd.hpp> reaches a LibTorch header.
// What it uses is what a header of a user's own does with fwd.hpp: name the templates and the
// state's types in declarations, and check a policy of its own against the concepts.
#include <emakit/fwd.hpp>

#include <cmath>
#include <concepts>

namespace user {

struct HalfLife {  // a user's decay policy, checked without LibTorch
  double steps = 1000;
  double decay(const emakit::DecayInput&) const { return std::exp2(-1.0 / steps); }
};
static_assert(emakit::DecayPolicy<HalfLife>);
static_assert(!emakit::DecayPolicy<int>);

struct EveryOther {
  emakit::Decision decide(const emakit::ScheduleInput& in) const {
    return {in.call % 2 == 0 ? emakit::Action::averaged : emakit::Action::skipped, in.call};
  }
};
static_assert(emakit::SchedulePolicy<EveryOther>);

// Declarations over the library's types (defined where LibTorch is included). A specialization
// of Ema or Recipe is not named here: naming one checks its policies against the concepts, which
// needs the policies' own headers (decay.hpp, schedule.hpp, storage.hpp), as fwd.hpp says.
void add_models(emakit::EmaHook& hook);
emakit::LoadReport restore(emakit::PostHocEma& posthoc, const emakit::StateDict& state, emakit::LoadMode mode);
emakit::SwapGuard evaluate_with(emakit::PostHocEma& posthoc, const emakit::StateDict& averages);
template <class EmaType>
void train(EmaType& ema, int steps);

}  // namespace user

int main() { return 0; }
