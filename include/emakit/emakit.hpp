// emakit: exponential moving averages of LibTorch model weights. The umbrella header.
// See fwd.hpp for the whole vocabulary.
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
#include <emakit/posthoc.hpp>
#include <emakit/update_bn.hpp>
#include <emakit/format.hpp>

// The one file of a program that defines EMAKIT_IMPLEMENTATION compiles emakit's non-template
// code (detail/config.hpp).
#if defined(EMAKIT_IMPLEMENTATION)
#include <emakit/implementation.hpp>
#endif
