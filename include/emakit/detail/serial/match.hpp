// Tensors matched by name, then checked for shape: what every load of named tensors into named
// tensors does (a checkpoint into a model, a state into an EMA).
//
//   auto m = match_by_name(ours, theirs);   // (name, tensor) ranges; theirs has find(name)
//   for (auto& p : m.pairs) p.ours.copy_(p.theirs);
//   for (auto& p : m.problems) ...             // missing, shape or unexpected, in the order found
#pragma once

#include <emakit/detail/check.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace emakit::detail {

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

}  // namespace emakit::detail
