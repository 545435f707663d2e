// A model's tensors: walking a module (its parameters, then its buffers, by full name), and
// telling tensors apart (the same tensor, shared memory, the same bytes). What an Ema binds to,
// and what the trainer hooks and the post-hoc synthesis look models up by.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/state.hpp>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// Whether a model still exists: the one watch of an Ema, a trainer hook's entry and a
// TeacherStudent wrapper on the model they were given by reference. A model owned by a shared_ptr
// (a ModuleHolder's, make_shared's) is watched, and destroyed() says when it is gone (one atomic
// load); one owned otherwise (on the stack, a member) cannot be, and destroyed() stays false.
class ModelWatch {
 public:
  ModelWatch() = default;
  explicit ModelWatch(const torch::nn::Module& model)
      : model_(model.weak_from_this()), watched_(!model_.expired()) {}  // alive here: expired iff not owned
  bool watched() const noexcept { return watched_; }
  bool destroyed() const noexcept { return watched_ && model_.expired(); }
  // The model, while a shared_ptr owns it; null if gone or never watched.
  std::shared_ptr<const torch::nn::Module> lock() const noexcept { return model_.lock(); }
  // Both watch one model (both watched).
  bool same_model(const ModelWatch& other) const noexcept {
    return watched_ && other.watched_ && !model_.owner_before(other.model_) && !other.model_.owner_before(model_);
  }

 private:
  std::weak_ptr<const torch::nn::Module> model_;
  bool watched_ = false;
};

// The parameters (is_buffer false), then the buffers, of `model` and its children, by full name.
EMAKIT_FUNC std::vector<SourceTensor> collect(const torch::nn::Module& model);

EMAKIT_FUNC std::unordered_map<std::string, at::Tensor> tensors_by_name(const torch::nn::Module& model);

// Whether two tensors are the same tensor of the model (one TensorImpl, or the same view of one
// storage), and whether they share memory at all (their byte ranges in one storage overlap).
EMAKIT_FUNC bool same_view(const at::Tensor& a, const at::Tensor& b);
EMAKIT_FUNC std::pair<std::int64_t, std::int64_t> byte_extent(const at::Tensor& t);
EMAKIT_FUNC bool overlap(const at::Tensor& a, const at::Tensor& b);

// For each tensor, the index of the first one that is the same tensor (same_view), or its own: a
// tied weight is one tensor under several names. What an Ema makes one slot of, and what an export
// lists once (diffusers' shadow_params).
EMAKIT_FUNC std::vector<std::size_t> first_same_view(std::span<const at::Tensor> tensors);

// The model's memory, by storage: the one lookup by which an EMA refuses a tensor of its own that
// shares memory with the model (ModuleStorage before it writes its module's tensors, every storage
// once it has made them).
class ModelMemory {
 public:
  // Notes t's storage under `name` (the first name given for a storage stays).
  void add(const std::string& name, const at::Tensor& t) {
    if (t.defined() && t.has_storage()) names_.emplace(t.storage().unsafeGetStorageImpl(), name);
  }
  // The name of the model's tensor whose storage t uses; null if none.
  const std::string* owner(const at::Tensor& t) const {
    if (!t.defined() || !t.has_storage()) return nullptr;
    const auto it = names_.find(t.storage().unsafeGetStorageImpl());
    return it == names_.end() ? nullptr : &it->second;
  }

 private:
  std::unordered_map<const void*, std::string> names_;
};

// The same dtype, shape and bytes (NaNs compare by their bits).
EMAKIT_FUNC bool bitwise_equal(const at::Tensor& a, const at::Tensor& b);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

#if !defined(EMAKIT_COMPILED)
#include <emakit/detail/module_tensors-inl.hpp>
#endif
