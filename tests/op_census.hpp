// The aten ops an update dispatches, counted through ATen's RecordFunction callbacks: the one op
// census of the tests (tests/test_kernel.cpp on CPU tensors, tests/cuda/test_cuda_streams.cpp on
// the device), so that "which op runs, how often" is a count, never a guess from the values.
#pragma once

#include <ATen/record_function.h>

#include <map>
#include <memory>
#include <string>

namespace emakit_test {

// The aten ops dispatched while f() runs on this thread: `top` counts the ops emakit itself
// called, `all` every op (ATen's own slow paths call further ops).
struct OpCensus {
  std::map<std::string, int> top, all;
  int operator[](const std::string& op) const {
    auto it = top.find(op);
    return it == top.end() ? 0 : it->second;
  }
  int nested(const std::string& op) const {
    auto it = all.find(op);
    return it == all.end() ? 0 : it->second;
  }
  int total() const {
    int n = 0;
    for (const auto& [op, k] : top) n += k;
    return n;
  }
  // Tensors allocated by emakit itself, and by anything it called.
  int own_allocations() const {
    return (*this)["aten::empty"] + (*this)["aten::empty_strided"] + (*this)["aten::empty_like"];
  }
  int allocations() const { return nested("aten::empty") + nested("aten::empty_strided") + nested("aten::empty_like"); }
  std::string str() const {
    std::string out;
    for (const auto& [op, k] : top) out += op + " x" + std::to_string(k) + "; ";
    return out;
  }
};

inline thread_local OpCensus* active_census = nullptr;
inline thread_local int census_depth = 0;

template <class F>
OpCensus census_of(F&& f) {
  OpCensus census;
  active_census = &census;
  census_depth = 0;
  auto handle =
      at::addThreadLocalCallback(at::RecordFunctionCallback(
                                     [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                                       if (active_census != nullptr) {
                                         const std::string name = fn.name();
                                         active_census->all[name] += 1;
                                         if (census_depth == 0) active_census->top[name] += 1;
                                       }
                                       census_depth += 1;
                                       return nullptr;
                                     },
                                     [](const at::RecordFunction&, at::ObserverContext*) { census_depth -= 1; })
                                     .scopes({at::RecordScope::FUNCTION}));
  try {
    f();
  } catch (...) {
    at::removeCallback(handle);
    active_census = nullptr;
    throw;
  }
  at::removeCallback(handle);
  active_census = nullptr;
  return census;
}

}  // namespace emakit_test
