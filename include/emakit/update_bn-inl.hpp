// The non-template definitions of update_bn.hpp: included at the end of update_bn.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/update_bn-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/update_bn.hpp> instead"
#endif

#include <emakit/update_bn.hpp>

#include <torch/nn/modules/batchnorm.h>

#include <algorithm>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

namespace update_bn_impl {
template <class BatchNorm>
void reset_running_stats(torch::nn::Module& m) {
  dynamic_cast<BatchNorm&>(m).reset_running_stats();
}
struct Found {
  torch::nn::Module* module;
  torch::nn::BatchNormOptions* options;
  void (*reset)(torch::nn::Module&);
};
// Appends `m` to `out` when it is a `BatchNorm` (or derived from it).
template <class BatchNorm>
bool find(torch::nn::Module* m, std::vector<Found>& out) {
  auto* bn = dynamic_cast<BatchNorm*>(m);
  if (bn != nullptr) out.push_back({m, &bn->options, &reset_running_stats<BatchNorm>});
  return bn != nullptr;
}
}  // namespace update_bn_impl

EMAKIT_FUNC BatchNormPass::BatchNormPass(torch::nn::Module& model) {
  // Every module once (a module registered under two names is visited twice), parents first.
  std::vector<torch::nn::Module*> modules;
  model.apply([&modules](torch::nn::Module& m) {
    if (std::find(modules.begin(), modules.end(), &m) == modules.end()) modules.push_back(&m);
  });
  // torch: isinstance(module, _BatchNorm), i.e. BatchNorm1d/2d/3d (and classes derived from them).
  std::vector<update_bn_impl::Found> batch_norms;
  for (torch::nn::Module* m : modules) {
    using namespace torch::nn;
    update_bn_impl::find<BatchNorm1dImpl>(m, batch_norms) || update_bn_impl::find<BatchNorm2dImpl>(m, batch_norms) ||
        update_bn_impl::find<BatchNorm3dImpl>(m, batch_norms);
  }
  if (batch_norms.empty()) return;  // torch returns before touching anything

  // Everything that is put back, kept before anything changes.
  momenta_.reserve(batch_norms.size());
  for (const auto& found : batch_norms) momenta_.push_back({found.options, found.options->momentum()});
  modes_.reserve(modules.size());
  for (torch::nn::Module* m : modules) modes_.emplace_back(m, m->is_training());

  try {
    for (const auto& found : batch_norms) found.reset(*found.module);  // mean 0, var 1, count 0
    model.train(true);
    for (auto& saved : momenta_) saved.options->momentum() = Momentum();  // none: the cumulative average
    grad_.emplace(false);
  } catch (...) {
    restore();
    throw;
  }
}

EMAKIT_FUNC BatchNormPass::~BatchNormPass() { restore(); }

EMAKIT_FUNC void BatchNormPass::restore() noexcept {
  grad_.reset();
  for (auto& saved : momenta_) saved.options->momentum() = saved.momentum;
  // Parents first: a module's train() sets its sub-modules too, whose own modes come after it.
  for (const auto& [m, training] : modes_) {
    try {
      m->train(training);
    } catch (...) {  // a user's train() override that throws: the other modules are still put back
    }
  }
  momenta_.clear();
  modes_.clear();
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
