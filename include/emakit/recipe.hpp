// emakit::Recipe: an Ema's policies and options before the Ema exists, for the trainer hooks
// (hooks.hpp) and the presets' *_recipe() functions.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/ema.hpp>
#include <emakit/options.hpp>

#include <torch/nn/module.h>

#include <utility>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// The policies and options of an Ema before it exists: what a trainer hook (hooks.hpp) keeps
// until it makes the EMA, and what it asks the schedule before then.
template <DecayPolicy D, SchedulePolicy S, StoragePolicy St>
struct Recipe {
  using ema_type = Ema<D, S, St>;

  explicit Recipe(D d = D(), S s = S(), EmaOptions o = EmaOptions(), St st = St())
      : decay(std::move(d)), schedule(std::move(s)), options(std::move(o)), storage(std::move(st)) {}

  ema_type make(const torch::nn::Module& model) const { return ema_type(model, decay, schedule, options, storage); }

  D decay;
  S schedule;
  EmaOptions options;
  St storage;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
