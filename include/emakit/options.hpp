// EmaOptions: which tensors an Ema averages, copies or ignores, and where and in what dtype it
// keeps them. Shared by every Ema, whatever its policies.
//
//   emakit::EmaOptions()
//       .dtype(torch::kFloat32)              // the average's dtype (default: fp32 for bf16/fp16 models)
//       .device(torch::kCPU)                 // the average's device (default: the model's): CPU offload
//       .copy_only({"pos_embedding"})        // copied at every update, never averaged
//       .ignore({"head.weight"})             // left out of the EMA
//       .ignore_prefixes({"teacher."})       // every name starting with one of these is left out
//       .buffers(emakit::BufferMode::copy);  // buffers: averaged (default), copied or left out
//
// Non-floating tensors (e.g. BatchNorm's num_batches_tracked) are always copied, never averaged.
// A name or prefix that matches nothing in the model is an error: a typo would otherwise
// silently average a tensor you meant to exclude.
#pragma once

#include <emakit/detail/check.hpp>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace emakit {

enum class BufferMode : std::uint8_t { average = 0, copy = 1, ignore = 2 };

// What an Ema does with one tensor of the model.
enum class Role : std::uint8_t { average, copy, ignore };

class EmaOptions {
 public:
  std::optional<c10::ScalarType> dtype() const noexcept { return dtype_; }
  EmaOptions& dtype(c10::ScalarType value) {
    if (!c10::isFloatingType(value))
      detail::fail("EmaOptions::dtype must be a floating dtype (the dtype of averaged tensors), got {}",
                   c10::toString(value));
    dtype_ = value;
    return *this;
  }
  std::optional<c10::Device> device() const noexcept { return device_; }
  EmaOptions& device(c10::Device value) {
    device_ = value;
    return *this;
  }
  const std::vector<std::string>& copy_only() const noexcept { return copy_only_; }
  EmaOptions& copy_only(std::vector<std::string> names) {
    copy_only_ = std::move(names);
    return *this;
  }
  const std::vector<std::string>& ignore() const noexcept { return ignore_; }
  EmaOptions& ignore(std::vector<std::string> names) {
    ignore_ = std::move(names);
    return *this;
  }
  const std::vector<std::string>& ignore_prefixes() const noexcept { return ignore_prefixes_; }
  EmaOptions& ignore_prefixes(std::vector<std::string> prefixes) {
    for (const auto& p : prefixes)
      if (p.empty()) detail::fail("EmaOptions::ignore_prefixes: an empty prefix would ignore every tensor");
    ignore_prefixes_ = std::move(prefixes);
    return *this;
  }
  BufferMode buffers() const noexcept { return buffers_; }
  EmaOptions& buffers(BufferMode value) {
    if (static_cast<int>(value) > 2)
      detail::fail("EmaOptions::buffers must be average, copy or ignore, got {}", static_cast<int>(value));
    buffers_ = value;
    return *this;
  }

  // The role of a tensor named `name`; `floating` says whether its dtype can be averaged.
  Role role(const std::string& name, bool is_buffer, bool floating) const {
    if (contains(ignore_, name) || starts_with_any(name)) return Role::ignore;
    if (is_buffer && buffers_ == BufferMode::ignore) return Role::ignore;
    if (!floating || contains(copy_only_, name) || (is_buffer && buffers_ == BufferMode::copy)) return Role::copy;
    return Role::average;
  }

  // The dtype the EMA keeps an averaged tensor in.
  c10::ScalarType average_dtype(c10::ScalarType source) const {
    if (!c10::isFloatingType(source)) return source;  // complex stays complex
    if (dtype_) return *dtype_;
    return (source == c10::ScalarType::Half || source == c10::ScalarType::BFloat16) ? c10::ScalarType::Float
                                                                                     : source;
  }

  // Fails if a name or prefix of these options matches none of `names`.
  void check_names(const std::vector<std::string>& names) const {
    auto known = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
    for (const auto& n : ignore_)
      if (!known(n)) detail::fail("EmaOptions::ignore names '{}', which the model does not have", n);
    for (const auto& n : copy_only_)
      if (!known(n)) detail::fail("EmaOptions::copy_only names '{}', which the model does not have", n);
    for (const auto& p : ignore_prefixes_) {
      const bool any = std::any_of(names.begin(), names.end(), [&](const std::string& n) { return n.rfind(p, 0) == 0; });
      if (!any) detail::fail("EmaOptions::ignore_prefixes has '{}', which starts no tensor name of the model", p);
    }
  }

 private:
  static bool contains(const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  }
  bool starts_with_any(const std::string& name) const {
    return std::any_of(ignore_prefixes_.begin(), ignore_prefixes_.end(),
                       [&](const std::string& p) { return name.rfind(p, 0) == 0; });
  }

  std::optional<c10::ScalarType> dtype_;
  std::optional<c10::Device> device_;
  std::vector<std::string> copy_only_;
  std::vector<std::string> ignore_;
  std::vector<std::string> ignore_prefixes_;
  BufferMode buffers_ = BufferMode::average;
};

}  // namespace emakit
