// emakit: exponential moving averages of LibTorch model weights. The umbrella header: the Ema,
// its policies and aliases, the presets, checkpoints, hooks, the teacher, update_bn, printing.
// See fwd.hpp for the whole vocabulary. Two parts have headers of their own, each compiled in a
// file of its own, so that a trainer that does not use them does not compile them
// (detail/config.hpp): the post-hoc EMA, <emakit/posthoc.hpp> (CMake: link emakit::posthoc), and
// the Python peers' state dicts, <emakit/interop.hpp> (emakit::interop).
#pragma once

#include <emakit/version.hpp>
#include <emakit/fwd.hpp>
#include <emakit/concepts.hpp>
#include <emakit/decay.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>
#include <emakit/options.hpp>
#include <emakit/state.hpp>
#include <emakit/swap.hpp>
#include <emakit/ema.hpp>
#include <emakit/together.hpp>
#include <emakit/recipe.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/aliases.hpp>
#include <emakit/presets.hpp>
#include <emakit/hooks.hpp>
#include <emakit/teacher.hpp>
#include <emakit/update_bn.hpp>
#include <emakit/format.hpp>

// The one file of a program that defines EMAKIT_IMPLEMENTATION compiles emakit's non-template
// code, every part (detail/config.hpp); a part's own file (implementation/*.hpp, which defines
// EMAKIT_BUILDING_LIBRARY first) compiles only its part.
#if defined(EMAKIT_IMPLEMENTATION) && !defined(EMAKIT_BUILDING_LIBRARY)
#include <emakit/implementation.hpp>
#endif
