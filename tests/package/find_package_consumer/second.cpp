// The consumer's second translation unit: it includes emakit and updates the EMA too, so that a
// mode which compiled emakit's code in every file that includes it would show it twice
// (cmake/emakit_check_consumer.cmake counts the objects that define the update kernel).
#include <emakit/aliases.hpp>

emakit::UpdateResult update_elsewhere(emakit::WarmupEma& ema) { return ema.update(); }
