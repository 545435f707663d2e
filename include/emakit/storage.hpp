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

#include <emakit/concepts.hpp>
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

namespace emakit {

namespace detail {
// A copy of `source` with the EMA's dtype and device, never sharing memory with it.
inline at::Tensor detached_copy(const TensorSpec& spec) {
  at::Tensor out = at::empty(spec.source.sizes(), spec.source.options().dtype(spec.dtype).device(spec.device));
  out.copy_(spec.source.detach());
  return out;
}
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

  // Clone the model. Without a factory the module type must be Cloneable.
  ModuleStorage() = default;
  // Build the EMA module with `factory`; the EMA copies the model's weights into it by name.
  explicit ModuleStorage(Factory factory) : factory_(std::move(factory)) {
    if (!factory_) detail::fail("ModuleStorage: the factory is empty; pass a callable that returns a new module");
  }

  std::vector<at::Tensor> create(const torch::nn::Module* model, std::span<const TensorSpec> specs) {
    module_ = make_module(model);
    std::unordered_map<std::string, at::Tensor> own;
    for (auto& item : module_->named_parameters(/*recurse=*/true)) own.emplace(item.key(), item.value());
    for (auto& item : module_->named_buffers(/*recurse=*/true)) own.emplace(item.key(), item.value());

    std::vector<at::Tensor> out;
    out.reserve(specs.size());
    at::NoGradGuard no_grad;
    for (const auto& spec : specs) {
      auto it = own.find(spec.name);
      if (it == own.end())
        detail::fail("ModuleStorage: the EMA module ({}) has no tensor '{}' that the model has; the factory must "
                     "build the model's architecture",
                     module_->name(), spec.name);
      at::Tensor& t = it->second;
      if (t.sizes() != spec.source.sizes())
        detail::fail("ModuleStorage: tensor '{}' has shape {} in the EMA module but {} in the model", spec.name,
                     detail::shape_string(t.sizes()), detail::shape_string(spec.source.sizes()));
      t.set_data(detail::detached_copy(spec));
      t.set_requires_grad(false);
      out.push_back(t);
    }
    for (auto& p : module_->parameters(/*recurse=*/true)) p.set_requires_grad(false);
    module_->eval();
    return out;
  }

  // The EMA module; null before the Ema is made.
  const std::shared_ptr<ModuleType>& module() const noexcept { return module_; }
  bool has_factory() const noexcept { return static_cast<bool>(factory_); }
  // Two storages are equal when they make their module the same way (not when they hold the same one).
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
                   model ? model->name() : std::string("the module type"),
                   model ? model->name() : std::string("M"));
    }
  }

  Factory factory_;
  std::shared_ptr<ModuleType> module_;
};

}  // namespace emakit
