// Tensors matched by name, then checked for shape: what every load of named tensors into named
// tensors does (a checkpoint into a model, a state into an EMA).
//
//   auto m = match_by_name(ours, theirs);   // (name, tensor) ranges; theirs has find(name)
//   for (auto& p : m.pairs) p.ours.copy_(p.theirs);
//   for (auto& p : m.problems) ...             // missing, shape or unexpected, in the order found
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string_view>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

struct NameMatch {
  struct Pair {
    std::string name;
    at::Tensor ours;
    at::Tensor theirs;
  };
  struct Problem {
    enum class Kind : std::uint8_t { missing, shape, unexpected };
    Kind kind;
    std::string name;
    std::string ours_shape = {};    // Kind::shape
    std::string theirs_shape = {};  // Kind::shape
  };
  std::vector<Pair> pairs;        // in the order of `ours`
  std::vector<Problem> problems;  // in the order of `ours`, then the unexpected ones
};

// `ours` and `theirs`: ranges of (name, tensor) pairs (a map, a vector of pairs); `theirs` must
// have find(name) returning an iterator to such a pair. With `want_unexpected`, the names of
// `theirs` that `ours` lacks are problems too, in the order of `theirs`.
template <class Ours, class Theirs>
NameMatch match_by_name(const Ours& ours, const Theirs& theirs, bool want_unexpected = false) {
  using Kind = NameMatch::Problem::Kind;
  NameMatch m;
  std::unordered_set<std::string> seen;
  for (const auto& [name, mine] : ours) {
    if (want_unexpected) seen.insert(name);
    const auto it = theirs.find(name);
    if (it == theirs.end()) {
      m.problems.push_back({Kind::missing, name});
    } else if (!it->second.sizes().equals(mine.sizes())) {
      m.problems.push_back({Kind::shape, name, shape_string(mine.sizes()), shape_string(it->second.sizes())});
    } else {
      m.pairs.push_back({name, mine, it->second});
    }
  }
  if (want_unexpected)
    for (const auto& [name, t] : theirs)
      if (!seen.count(name)) m.problems.push_back({Kind::unexpected, name});
  return m;
}

// Throws for the first problem of a match of an EMA's tensors (ours) with a model's (theirs), in
// the words every copy between them uses; `prefix` leads the message (the call, or empty).
inline void require_model_match(const NameMatch& m, std::string_view prefix = {}) {
  using Kind = NameMatch::Problem::Kind;
  for (const auto& p : m.problems) {
    if (p.kind == Kind::missing) fail("{}the model has no tensor '{}' that the EMA holds", prefix, p.name);
    if (p.kind == Kind::shape)
      fail("{}tensor '{}' has shape {} in the model but {} in the EMA", prefix, p.name, p.theirs_shape, p.ours_shape);
  }
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail
