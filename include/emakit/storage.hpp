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
    std::shared_ptr<ModuleType> made = make_module_leaving_model_alone(model);
    std::unordered_map<std::string, at::Tensor> own;
    for (auto& item : made->named_parameters(/*recurse=*/true)) own.emplace(item.key(), item.value());
    for (auto& item : made->named_buffers(/*recurse=*/true)) own.emplace(item.key(), item.value());
    // Nothing below may write a tensor of the model: a module whose clone() (or a factory that)
    // hands back a tensor it was given would otherwise let the EMA take over the model's weight.
    refuse_shared(made, own, model, specs);

    auto find = [&](const std::string& name, const TensorSpec& spec) -> at::Tensor& {
      auto it = own.find(name);
      if (it == own.end())
        detail::fail("ModuleStorage: the EMA module ({}) has no tensor '{}' that the model has; the factory must "
                     "build the model's architecture",
                     made->name(), name);
      if (it->second.sizes() != spec.source.sizes())
        detail::fail("ModuleStorage: tensor '{}' has shape {} in the EMA module but {} in the model", name,
                     detail::shape_string(it->second.sizes()), detail::shape_string(spec.source.sizes()));
      return it->second;
    };
    std::vector<at::Tensor> out;
    out.reserve(specs.size());
    at::NoGradGuard no_grad;
    for (const auto& spec : specs) {
      at::Tensor& t = find(spec.name, spec);
      t.set_data(detail::detached_copy(spec));
      t.set_requires_grad(false);
      // A tied weight is one tensor in the EMA module too, whether or not its clone kept the tie.
      for (const auto& alias : spec.aliases) {
        at::Tensor& a = find(alias, spec);
        if (!a.is_same(t)) {
          a.set_data(t);
          a.set_requires_grad(false);
        }
      }
      out.push_back(t);
    }
    for (auto& p : made->parameters(/*recurse=*/true)) p.set_requires_grad(false);
    made->eval();
    module_ = std::move(made);
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

  // LibTorch's Cloneable::clone() ends with set_data() on the copy's tensors; for a module whose
  // reset() re-registers a tensor it was given, that tensor is the model's, whose data then moves
  // to a new buffer. Binding an EMA must not change the model: its tensors get their data back.
  std::shared_ptr<ModuleType> make_module_leaving_model_alone(const torch::nn::Module* model) const {
    std::vector<std::pair<at::Tensor, at::Tensor>> before;  // the model's tensor, a view of its data now
    if (model != nullptr) {
      for (const auto& t : model->parameters(/*recurse=*/true)) before.emplace_back(t, t.detach());
      for (const auto& t : model->buffers(/*recurse=*/true)) before.emplace_back(t, t.detach());
    }
    std::shared_ptr<ModuleType> made = make_module(model);
    for (auto& [t, data] : before)
      if (t.defined() && t.has_storage() && data.has_storage() && !t.is_alias_of(data)) t.set_data(data);
    return made;
  }

  // Fails, before anything is written, if a tensor of the EMA module shares memory with the model.
  void refuse_shared(const std::shared_ptr<ModuleType>& made, const std::unordered_map<std::string, at::Tensor>& own,
                     const torch::nn::Module* model, std::span<const TensorSpec> specs) const {
    std::unordered_map<const void*, std::string> model_storage;  // storage -> a model name using it
    auto note = [&](const std::string& name, const at::Tensor& t) {
      if (t.defined() && t.has_storage()) model_storage.emplace(t.storage().unsafeGetStorageImpl(), name);
    };
    if (model != nullptr) {
      for (const auto& item : model->named_parameters(/*recurse=*/true)) note(item.key(), item.value());
      for (const auto& item : model->named_buffers(/*recurse=*/true)) note(item.key(), item.value());
    }
    for (const auto& spec : specs) note(spec.name, spec.source);
    for (const auto& [name, t] : own) {
      if (!t.defined() || !t.has_storage()) continue;
      auto it = model_storage.find(t.storage().unsafeGetStorageImpl());
      if (it == model_storage.end()) continue;
      detail::fail("ModuleStorage: tensor '{}' of the EMA module ({}) is the model's own tensor '{}' (or shares its "
                   "memory): {} a tensor it was given instead of making its own, and the EMA would take over "
                   "the model's weight. Nothing was changed. Make the module create its own tensors in reset() "
                   "(and tie them there), or give ModuleStorage a factory that builds a fresh model, or use "
                   "FlatStorage",
                   name, made->name(), it->second,
                   factory_ ? "the factory's module holds" : "the module's clone() (its reset()) re-registers");
    }
  }

  Factory factory_;
  std::shared_ptr<ModuleType> module_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
