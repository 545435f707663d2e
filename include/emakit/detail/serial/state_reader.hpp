// Typed reads from a state dict (name -> tensor): the counters and config values of every emakit
// state are read here, each checked for its shape and type, with errors that name the key.
//
//   const StateReader in(state);
//   const std::int64_t calls = in.counter("counters.calls");      // one integer, >= 0
//   const auto decay = in.optional_text("config.decay");           // uint8 UTF-8 bytes, or nullopt
//
// integer_value() and number_value() check one tensor the same way, for the scalars of files that
// are not state dicts (the hook's header; a peer's torch.save dict has its own reader, interop's
// PeerDict, with the same rules).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <torch/ordered_dict.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

// A string as a state stores it: a 1-d uint8 tensor of its UTF-8 bytes.
inline at::Tensor string_tensor(std::string_view s) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(s.size())}, at::TensorOptions().dtype(at::kByte));
  std::copy(s.begin(), s.end(), reinterpret_cast<char*>(t.data_ptr<std::uint8_t>()));
  return t;
}

// The string of string_tensor(), or "<not a string>".
inline std::string tensor_string(const at::Tensor& t) {
  if (t.scalar_type() != at::kByte || t.dim() != 1) return "<not a string>";
  const auto c = t.contiguous();
  const auto* p = c.data_ptr<std::uint8_t>();
  return std::string(p, p + c.numel());
}

// `where` (a file, a profile) leads an error message when it is given.
inline std::string message_lead(std::string_view where) {
  return where.empty() ? std::string() : std::string(where) + ": ";
}

// A tensor that holds one integer (of an integer or bool dtype), or one real number (any real
// dtype): what integer_value() and number_value() read, and interop's PeerDict.
inline bool holds_one_integer(const at::Tensor& t) {
  return t.numel() == 1 && !c10::isFloatingType(t.scalar_type()) && !c10::isComplexType(t.scalar_type());
}
inline bool holds_one_number(const at::Tensor& t) { return t.numel() == 1 && !c10::isComplexType(t.scalar_type()); }

// The one integer `t` holds (named `key` in errors): a floating-point tensor, or more or fewer
// than one element, is an error naming the key, the dtype and the shape.
inline std::int64_t integer_value(const at::Tensor& t, std::string_view key, std::string_view where = {}) {
  if (!holds_one_integer(t))
    fail("{}'{}' must be one integer, got a {} tensor of shape {}", message_lead(where), key,
         c10::toString(t.scalar_type()), shape_string(t.sizes()));
  return t.item<std::int64_t>();
}

// The one real number `t` holds, of any real dtype; more or fewer than one element is an error.
inline double number_value(const at::Tensor& t, std::string_view key, std::string_view where = {}) {
  if (!holds_one_number(t))
    fail("{}'{}' must be one number, got a {} tensor of shape {}", message_lead(where), key,
         c10::toString(t.scalar_type()), shape_string(t.sizes()));
  return t.item<double>();
}

class StateReader {
 public:
  using State = torch::OrderedDict<std::string, at::Tensor>;

  // `where` (a file, a profile) leads every error message when it is given.
  explicit StateReader(const State& state, std::string where = {}) : state_(state), where_(std::move(where)) {}

  const at::Tensor* find(const std::string& key) const { return state_.find(key); }

  // One integer; nullopt when the key is absent. A float tensor or another shape is an error.
  std::optional<std::int64_t> optional_integer(const std::string& key) const {
    const at::Tensor* t = state_.find(key);
    if (t == nullptr) return std::nullopt;
    return integer_value(*t, key, where_);
  }

  // One integer >= 0 that must be there (a counter).
  std::int64_t counter(const std::string& key) const {
    const auto v = optional_integer(key);
    if (!v) fail("{}the state has no '{}'", lead(), key);
    if (*v < 0) fail("{}'{}' must be >= 0, got {}", lead(), key, *v);
    return *v;
  }

  // One number of any dtype that must be there.
  double number(const std::string& key) const {
    const at::Tensor* t = state_.find(key);
    if (t == nullptr) fail("{}the state has no '{}'", lead(), key);
    return number_value(*t, key, where_);
  }

  // A string_tensor(), nullopt when the key is absent.
  std::optional<std::string> optional_text(const std::string& key) const {
    const at::Tensor* t = state_.find(key);
    if (t == nullptr) return std::nullopt;
    return tensor_string(*t);
  }

 private:
  std::string lead() const { return message_lead(where_); }

  const State& state_;
  std::string where_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
