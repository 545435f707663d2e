// Storage policies: where the EMA keeps its tensors.
//
// | policy            | the average is                                   | use it when                     |
// |-------------------|--------------------------------------------------|---------------------------------|
// | FlatStorage       | an ordered name -> tensor dictionary             | you only save or load weights   |
// | ModuleStorage<M>  | a module of type M (forward() works on it)       | you evaluate or serve the EMA   |
//
// ModuleStorage needs a second module of the model's architecture. LibTorch's C++ modules can
// only be copied when they derive from torch::nn::Cloneable<M>; for any other module, give a
// factory that builds a fresh one, and the EMA copies the weights in by name:
//
//   struct NetImpl : torch::nn::Cloneable<NetImpl> { ... };           // clone() works
//   emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<NetImpl>> a(*net);
//
//   struct PlainImpl : torch::nn::Module { ... };                    // no clone()
//   emakit::ModuleStorage<PlainImpl> storage([] { return std::make_shared<PlainImpl>(); });
//   emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<PlainImpl>>
//       b(*plain, {}, {}, {}, std::move(storage));
//
// The EMA module is put in eval() mode and none of its parameters require grad.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/concepts.hpp>
#include <emakit/state.hpp>
#include <emakit/detail/check.hpp>

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

namespace detail {
// A copy of `source` with the EMA's dtype and device, never sharing memory with it.
inline at::Tensor detached_copy(const TensorSpec& spec) {
  at::Tensor out = at::empty(spec.source.sizes(), spec.source.options().dtype(spec.dtype).device(spec.device));
  out.copy_(spec.source.detach());
  return out;
}

// ModuleStorage's work that does not depend on its module type, compiled once (storage-inl.hpp).
// The model's tensors with a view of their data now, taken before a clone (null model: none).
EMAKIT_FUNC std::vector<std::pair<at::Tensor, at::Tensor>> model_data(const torch::nn::Module* model);
// LibTorch's Cloneable::clone() ends with set_data() on the copy's tensors; for a module whose
// reset() re-registers a tensor it was given, that tensor is the model's, whose data then moves
// to a new buffer. Binding an EMA must not change the model: its tensors get their data back.
EMAKIT_FUNC void restore_model_data(const std::vector<std::pair<at::Tensor, at::Tensor>>& before);
// Makes the tensors of `made` (the EMA module) the EMA's: each spec's tensor (and its aliases, one
// tensor) gets a detached copy of the model's, no parameter requires grad, the module is put in
// eval(). Refused, before anything is written, when a tensor of `made` shares memory with the
// model (`from_factory`: the message names the factory rather than clone()).
EMAKIT_FUNC std::vector<at::Tensor> adopt_module_tensors(torch::nn::Module& made, const torch::nn::Module* model,
                                                         std::span<const TensorSpec> specs, bool from_factory);
}  // namespace detail

// The average as an ordered dictionary of tensors, created with the EMA's dtype and device.
class FlatStorage {
 public:
  static constexpr std::string_view name = "FlatStorage";

  std::vector<at::Tensor> create(const torch::nn::Module*, std::span<const TensorSpec> specs) {
    std::vector<at::Tensor> out;
    out.reserve(specs.size());
    for (const auto& spec : specs) out.push_back(detail::detached_copy(spec));
    return out;
  }
  bool operator==(const FlatStorage&) const = default;
};

template <class ModuleType>
concept CloneableModule = std::is_base_of_v<torch::nn::Cloneable<ModuleType>, ModuleType>;

// The average as a module of type ModuleType: a clone of the model (ModuleType must derive from
// torch::nn::Cloneable<ModuleType>), or a module made by a user factory.
template <class ModuleType>
class ModuleStorage {
  static_assert(std::is_base_of_v<torch::nn::Module, ModuleType>,
                "ModuleStorage<M>: M must be a module type (derived from torch::nn::Module), e.g. "
                "NetImpl, not the holder Net");

 public:
  static constexpr std::string_view name = "ModuleStorage";
  using Factory = std::function<std::shared_ptr<ModuleType>()>;

  // Clone the model: the module type must be Cloneable, which the compiler checks here (a module
  // that is not needs a factory: the constructor below, or emakit::module_ema in aliases.hpp).
  ModuleStorage() {
    static_assert(CloneableModule<ModuleType>,
                  "ModuleStorage<M> without a factory clones the model, and M is not Cloneable (derived from "
                  "torch::nn::Cloneable<M>): give a factory that makes a new M, "
                  "emakit::module_ema(model, [] { return std::make_shared<M>(); }) or ModuleStorage<M>(factory)");
  }
  // Build the EMA module with `factory`; the EMA copies the model's weights into it by name.
  explicit ModuleStorage(Factory factory) : factory_(std::move(factory)) {
    if (!factory_) detail::fail("ModuleStorage: the factory is empty; pass a callable that returns a new module");
  }

  std::vector<at::Tensor> create(const torch::nn::Module* model, std::span<const TensorSpec> specs) {
    const auto before = detail::model_data(model);
    std::shared_ptr<ModuleType> made = make_module(model);
    detail::restore_model_data(before);
    std::vector<at::Tensor> out = detail::adopt_module_tensors(*made, model, specs, has_factory());
    module_ = std::move(made);
    return out;
  }

  // The EMA module; null before the Ema is made.
  const std::shared_ptr<ModuleType>& module() const noexcept { return module_; }
  bool has_factory() const noexcept { return static_cast<bool>(factory_); }
  // Two storages are equal when they make their module the same way (not when they hold
  // the same one).
  bool operator==(const ModuleStorage& other) const noexcept { return has_factory() == other.has_factory(); }

 private:
  std::shared_ptr<ModuleType> make_module(const torch::nn::Module* model) const {
    if (factory_) {
      auto made = factory_();
      if (!made) detail::fail("ModuleStorage: the factory returned a null module");
      return made;
    }
    if constexpr (CloneableModule<ModuleType>) {
      if (model == nullptr)
        detail::fail("ModuleStorage: the EMA was bound to a list of tensors, not a module; give a factory");
      const auto* typed = dynamic_cast<const ModuleType*>(model);
      if (typed == nullptr)
        detail::fail("ModuleStorage: the model is a {}, not the storage's module type; use ModuleStorage of the "
                     "model's own type",
                     model->name());
      return std::dynamic_pointer_cast<ModuleType>(typed->clone());
    } else {
      detail::fail("ModuleStorage: {} is not Cloneable (derive it from torch::nn::Cloneable<{}>) and no factory "
                   "was given; pass ModuleStorage<M>(factory)",
                   model ? model->name() : std::string("the module type"), model ? model->name() : std::string("M"));
    }
  }

  Factory factory_;
  std::shared_ptr<ModuleType> module_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/storage-inl.hpp>
#endif
