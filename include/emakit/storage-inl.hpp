// The non-template definitions of storage.hpp (ModuleStorage's work that does not depend on its
// module type): included at the end of storage.hpp in the all-inline mode (EMAKIT_HEADER_ONLY),
// else compiled once per program by implementation.hpp (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/storage-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/storage.hpp> instead"
#endif

#include <emakit/storage.hpp>

#include <emakit/detail/errors.hpp>
#include <emakit/detail/module_tensors.hpp>

#include <ATen/core/grad_mode.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC std::vector<std::pair<at::Tensor, at::Tensor>> model_data(const torch::nn::Module* model) {
  std::vector<std::pair<at::Tensor, at::Tensor>> before;  // the model's tensor, a view of its data now
  if (model != nullptr) {
    for (const auto& t : model->parameters(/*recurse=*/true)) before.emplace_back(t, t.detach());
    for (const auto& t : model->buffers(/*recurse=*/true)) before.emplace_back(t, t.detach());
  }
  return before;
}

EMAKIT_FUNC void restore_model_data(const std::vector<std::pair<at::Tensor, at::Tensor>>& before) {
  for (const auto& [t, data] : before) {
    at::Tensor tensor = t;  // a handle: set_data changes the model's tensor
    if (tensor.defined() && tensor.has_storage() && data.has_storage() && !tensor.is_alias_of(data))
      tensor.set_data(data);
  }
}

// Fails, before anything is written, if a tensor of the EMA module shares memory with the model.
EMAKIT_FUNC void refuse_shared(const torch::nn::Module& made, const std::unordered_map<std::string, at::Tensor>& own,
                               const torch::nn::Module* model, std::span<const TensorSpec> specs, bool from_factory) {
  ModelMemory model_memory;
  if (model != nullptr) {
    for (const auto& item : model->named_parameters(/*recurse=*/true)) model_memory.add(item.key(), item.value());
    for (const auto& item : model->named_buffers(/*recurse=*/true)) model_memory.add(item.key(), item.value());
  }
  for (const auto& spec : specs) model_memory.add(spec.name, spec.source);
  for (const auto& [name, t] : own) {
    const std::string* shared = model_memory.owner(t);
    if (shared == nullptr) continue;
    fail("ModuleStorage: tensor '{}' of the EMA module ({}) is the model's own tensor '{}' (or shares its "
         "memory): {} a tensor it was given instead of making its own, and the EMA would take over "
         "the model's weight. Nothing was changed. Make the module create its own tensors in reset() "
         "(and tie them there), or give ModuleStorage a factory that builds a fresh model, or use "
         "FlatStorage",
         name, made.name(), *shared,
         from_factory ? "the factory's module holds" : "the module's clone() (its reset()) re-registers");
  }
}

EMAKIT_FUNC std::vector<at::Tensor> adopt_module_tensors(torch::nn::Module& made, const torch::nn::Module* model,
                                                         std::span<const TensorSpec> specs, bool from_factory) {
  std::unordered_map<std::string, at::Tensor> own;
  for (auto& item : made.named_parameters(/*recurse=*/true)) own.emplace(item.key(), item.value());
  for (auto& item : made.named_buffers(/*recurse=*/true)) own.emplace(item.key(), item.value());
  // Nothing below may write a tensor of the model: a module whose clone() (or a factory that)
  // hands back a tensor it was given would otherwise let the EMA take over the model's weight.
  refuse_shared(made, own, model, specs, from_factory);

  auto find = [&](const std::string& name, const TensorSpec& spec) -> at::Tensor& {
    auto it = own.find(name);
    if (it == own.end())
      fail("ModuleStorage: the EMA module ({}) has no tensor '{}' that the model has; the factory must "
           "build the model's architecture",
           made.name(), name);
    if (it->second.sizes() != spec.source.sizes())
      fail("ModuleStorage: tensor '{}' has shape {} in the EMA module but {} in the model", name,
           shape_string(it->second.sizes()), shape_string(spec.source.sizes()));
    return it->second;
  };
  std::vector<at::Tensor> out;
  out.reserve(specs.size());
  at::NoGradGuard no_grad;
  for (const auto& spec : specs) {
    at::Tensor& t = find(spec.name, spec);
    t.set_data(detached_copy(spec));
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
  for (auto& p : made.parameters(/*recurse=*/true)) p.set_requires_grad(false);
  made.eval();
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
