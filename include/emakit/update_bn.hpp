// emakit::update_bn: BatchNorm running statistics recomputed for averaged weights, by one pass over
// training data: torch.optim.swa_utils.update_bn for C++. An average of weights (SWA, an EMA with
// TensorMode::copy or ignore) has running statistics that belong to no set of weights it averaged;
// torch's SWA recipe, AveragedModel then update_bn(loader, swa_model), recomputes them:
//
//   auto swa = emakit::averaged_model_swa(*model);     // AveragedModel(model)
//   for (...) { ...; optimizer.step(); swa.update(); }  // swa_model.update_parameters(model)
//   swa.copy_to(*model);                                // the model holds the SWA weights
//   emakit::update_bn(model, batches);                  // update_bn(loader, swa_model)
//
// What it does, as torch's update_bn: every BatchNorm1d/2d/3d of `model` (the model itself
// included; InstanceNorm is not a BatchNorm) has its running statistics reset (mean 0, var 1,
// num_batches_tracked 0) and its momentum set to none (a cumulative average: the factor of batch k
// is 1/k, so running_mean ends as the mean of the batches' means, running_var the mean of their
// unbiased variances); the model runs in train mode over every batch, without grad (torch's
// update_bn is decorated with @torch.no_grad()); then every momentum is put back. A model without
// a BatchNorm is left alone: nothing is reset and the batches are not read (torch returns early).
// A module with track_running_stats = false counts as a BatchNorm (torch's isinstance), and the
// pass leaves it as it was.
//
// Differences from torch, by design:
//   - the training mode of every module is put back as it was, module by module; torch's
//     model.train(was_training) sets every sub-module to the model's mode (the same result unless
//     sub-modules were in other modes than the model, e.g. a backbone kept in eval mode);
//   - momenta and training modes are put back also when the forward throws (the exception goes on
//     unchanged); torch leaves the model in train mode with momenta None then;
//   - `forward` calls the model: there is no `device` argument (move the batch in `forward`), and
//     no guess at a batch's input (torch takes input[0] of a list or tuple batch), except in the
//     overload without `forward`, which takes a tensor batch or an example's `.data`
//     (torch::data::Example, what a DataLoader with the Stack transform yields).
// An empty set of batches leaves the statistics reset, as torch does: the result's `batches` says
// how many batches ran (0 there).
//
// The work that does not depend on the batches' type (finding the BatchNorm modules, resetting,
// momenta, training modes, grad mode) is detail::BatchNormPass, compiled once (update_bn-inl.hpp);
// the templates below only loop.
#pragma once

#include <emakit/detail/config.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// What update_bn() did: the BatchNorm modules it found (0: it changed nothing and read no batch)
// and the batches it ran the model on (0 with BatchNorm modules: their statistics are reset).
struct UpdateBnResult {
  std::size_t batch_norms = 0;
  std::int64_t batches = 0;
  bool operator==(const UpdateBnResult&) const = default;
};

namespace detail {

// The state of one update_bn() pass, for its lifetime. Its constructor finds the BatchNorm1d/2d/3d
// modules of `model` (the model included, each module once), and, when there is one: resets their
// running statistics, keeps every module's training mode and every BatchNorm's momentum, puts the
// model in train mode, sets the momenta to none (cumulative average) and turns grad off. Its
// destructor puts back momenta, training modes (module by module) and the grad mode, also on an
// exception. With no BatchNorm it changes nothing.
class BatchNormPass {
 public:
  EMAKIT_FUNC explicit BatchNormPass(torch::nn::Module& model);
  EMAKIT_FUNC ~BatchNormPass();
  BatchNormPass(const BatchNormPass&) = delete;
  BatchNormPass& operator=(const BatchNormPass&) = delete;

  std::size_t batch_norms() const noexcept { return momenta_.size(); }

 private:
  EMAKIT_FUNC void restore() noexcept;  // what the destructor does, also for a constructor that throws

  using Momentum = std::decay_t<decltype(std::declval<const torch::nn::BatchNormOptions&>().momentum())>;
  struct SavedMomentum {
    torch::nn::BatchNormOptions* options;
    Momentum momentum;
  };
  std::vector<SavedMomentum> momenta_;
  std::vector<std::pair<torch::nn::Module*, bool>> modes_;  // pre-order, each module once
  std::optional<c10::AutoGradMode> grad_;                   // grad off while the pass runs
};

// A range of batches: what a range-for takes (a std::vector, a torch::data DataLoader, a view).
template <class R>
concept BatchRange = requires(R& r) {
  std::begin(r);
  std::end(r);
};
// A batch of the range R, as the loop hands it to `forward` (an lvalue).
template <class R>
using range_batch_t = std::remove_reference_t<decltype(*std::begin(std::declval<R&>()))>;

// A callable that yields the next batch, or an empty optional at the end.
template <class F>
concept YieldsOptional = requires(F& f) {
  static_cast<bool>(f());
  *f();
};
template <class F>
concept BatchSource = YieldsOptional<F> && !BatchRange<F>;
template <class F>
using source_batch_t = std::remove_reference_t<decltype(*std::declval<F&>()())>;

// A forward that takes each batch of the range R, or of the batch source S.
template <class F, class R>
concept ForwardOverRange = std::invocable<F&, std::add_lvalue_reference_t<range_batch_t<R>>>;
template <class F, class S>
concept ForwardOverSource = std::invocable<F&, std::add_lvalue_reference_t<source_batch_t<S>>>;

// The model's input of a batch, for update_bn() without `forward`: the batch itself when it is a
// tensor, else its `.data` (torch::data::Example).
template <class B>
decltype(auto) batch_input(B& batch) {
  if constexpr (std::is_convertible_v<B&, const at::Tensor&>)
    return static_cast<const at::Tensor&>(batch);
  else
    return (batch.data);
}
template <class B>
concept InputBatch = std::is_convertible_v<B&, const at::Tensor&> || requires(B& b) {
  { b.data } -> std::convertible_to<const at::Tensor&>;
};
// A range of tensors or examples.
template <class R>
concept InputRange = BatchRange<R> && InputBatch<range_batch_t<R>>;
// A module whose forward takes a tensor.
template <class M>
concept TensorModule = requires(M& m, const at::Tensor& x) {
  m.forward(x);
};

}  // namespace detail

// Recomputes the running statistics of every BatchNorm1d/2d/3d of `model` by one pass:
// `forward(batch)` for each batch of `batches`, in train mode, without grad (see the top of this
// file). `forward` runs the model on a batch, e.g. [&](const torch::Tensor& x) {
// model->forward(x); } or, for a DataLoader's examples, [&](auto& batch) {
// model->forward(batch.data.to(device)); }; what it returns is dropped. Momenta, training modes
// and the grad mode are put back, also when `forward` throws.
template <detail::BatchRange Batches, detail::ForwardOverRange<Batches> Forward>
UpdateBnResult update_bn(torch::nn::Module& model, Batches&& batches, Forward&& forward) {
  detail::BatchNormPass pass(model);
  UpdateBnResult result{pass.batch_norms(), 0};
  if (result.batch_norms == 0) return result;
  for (auto&& batch : batches) {
    std::invoke(forward, batch);
    ++result.batches;
  }
  return result;
}

// The same, with batches from `next_batch()` until it returns an empty optional (a reader, a
// generator): e.g. [&]() -> std::optional<torch::Tensor> { ... }.
template <detail::BatchSource NextBatch, detail::ForwardOverSource<NextBatch> Forward>
UpdateBnResult update_bn(torch::nn::Module& model, NextBatch&& next_batch, Forward&& forward) {
  detail::BatchNormPass pass(model);
  UpdateBnResult result{pass.batch_norms(), 0};
  if (result.batch_norms == 0) return result;
  while (auto batch = next_batch()) {
    std::invoke(forward, *batch);
    ++result.batches;
  }
  return result;
}

// torch's update_bn(loader, model) for a module holder whose forward takes a tensor: each batch
// is a tensor, or an example whose `.data` is the input (torch::data::Example).
template <detail::TensorModule Impl, detail::InputRange Batches>
UpdateBnResult update_bn(torch::nn::ModuleHolder<Impl>& model, Batches&& batches) {
  Impl& module = *model;
  return update_bn(module, std::forward<Batches>(batches),
                   [&module](auto& batch) { (void)module.forward(detail::batch_input(batch)); });
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/update_bn-inl.hpp>
#endif
