// Shared by the conformance tests: reading the Python peers' files, replaying a scenario, and
// comparing emakit's tensors with the peer's in ulps.
//
// What a comparison asserts (check_tensor): a tensor that is, on the peer's side, a copy of one
// of the operation's operands (a warmup or first-update copy, a copy-only buffer, a tensor the
// update left alone, the average swapped into the model) must be bitwise equal to emakit's copy
// of the same operand; integer tensors bitwise; every other (averaged) tensor within a stated
// number of ulps of its dtype at the magnitude of the operation's operands, elementwise
// max(|peer's state before|, |source|, |peer's result|). Each caller states its bound and derives
// it from the roundings of the two formulas next to the check.
//
// A replay starts each update (after the first one it replays) from the peer's state before that
// update: emakit's averages are overwritten with the peer's previous ones. So the bound is for
// one update, not an accumulation over the run: the error of step k is what step k's arithmetic
// does, and any difference in what emakit computes (the weight, the branch, a copy instead of a
// lerp, a skipped or extra update) shows at the step where it happens. The first step replayed
// starts from emakit's own state (its construction copy, or the state it imported), which tests
// that too.
//
// Every replay counts what it compared and REQUIREs at least one comparison; callers REQUIRE the
// exact count that the recorded files imply. A scenario whose data is missing fails, except in a
// build without Python (EMAKIT_CONFORMANCE_PYTHON empty), where the replays of the generators
// that need Python are skipped (EMAKIT_SKIP's mechanism, exit 77); the seed packages' recorded
// fixtures replay there too.
#pragma once

#include <emakit/emakit.hpp>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/serialize.h>

#include <catch2/catch.hpp>

#include "../helpers.hpp"
#include "../skip.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#ifndef EMAKIT_CONFORMANCE_PYTHON
#define EMAKIT_CONFORMANCE_PYTHON ""
#endif

namespace emakit_conformance {
namespace fs = std::filesystem;

// tests/conformance/_common.py's Net in C++: its tensors under the same names, registered in the
// same order, so that named_parameters() lists them as Python's model.parameters() does (the
// order diffusers' shadow_params list follows). Cloneable, for module storage.
struct CommonNetImpl : torch::nn::Cloneable<CommonNetImpl> {
  CommonNetImpl() { reset(); }
  void reset() override {
    lin = register_module("lin", torch::nn::Linear(8, 6));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(3));
    emb = register_module("emb", torch::nn::Embedding(10, 4));
    mask = register_buffer("mask", torch::ones({6}));
  }
  torch::nn::Linear lin{nullptr};
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Embedding emb{nullptr};
  at::Tensor mask;
};
TORCH_MODULE(CommonNet);

using Dict = std::map<std::string, at::Tensor>;

inline Dict load_dict(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto value = torch::pickle_load(bytes);
  REQUIRE(value.isGenericDict());
  Dict out;
  for (const auto& item : value.toGenericDict()) out.emplace(item.key().toStringRef(), item.value().toTensor());
  return out;
}

// Every parameter and buffer of a module, by its full name.
inline std::map<std::string, at::Tensor> tensors_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& p : m.named_parameters()) out.emplace(p.key(), p.value());
  for (auto& b : m.named_buffers()) out.emplace(b.key(), b.value());
  return out;
}

// Writes rec[prefix + name] into each tensor of the module.
inline void load_into(torch::nn::Module& m, const Dict& rec, const std::string& prefix) {
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : tensors_of(m)) t.copy_(rec.at(prefix + name));
}

// Whether this build has the Python of the generators (configured EMAKIT_PYTHON).
inline bool have_python() { return !std::string_view(EMAKIT_CONFORMANCE_PYTHON).empty(); }

// Whether `peer` replays a recorded fixture when its package's Python is not configured.
inline bool has_fixture(const std::string& peer) {
  return fs::exists(fs::path(EMAKIT_CONFORMANCE_SCRIPTS) / "fixtures" / (peer + ".tar.xz"));
}

// The file `relative` of `peer`'s data, or nullopt when the test is skipped: outside ctest (no
// EMAKIT_CONFORMANCE_DIR), or in a build without Python for a generator that needs it. Missing
// data otherwise fails the test: its generator failed or did not write it.
inline std::optional<fs::path> peer_file(const std::string& peer, const std::string& relative) {
  const char* root = std::getenv("EMAKIT_CONFORMANCE_DIR");
  if (root == nullptr) {
    emakit_test::skip_test("EMAKIT_CONFORMANCE_DIR is not set (run the conformance tests through ctest)");
    return std::nullopt;
  }
  const fs::path path = fs::path(root) / peer / relative;
  if (fs::exists(path)) return path;
  if (!have_python() && !has_fixture(peer)) {
    emakit_test::skip_test("no Python in this build (EMAKIT_PYTHON is empty: PyPI unreachable?), so " + peer +
                           ".py did not run and " + path.string() + " does not exist");
    return std::nullopt;
  }
  FAIL("no conformance data " << path << ": its generator (ctest conformance.generate." << peer
                              << ") failed or did not write it; its output says why");
  return std::nullopt;
}

// The folder of a scenario (its meta.pt must exist), as peer_file.
inline std::optional<fs::path> scenario_dir(const std::string& peer, const std::string& scenario) {
  const auto meta = peer_file(peer, scenario + "/meta.pt");
  if (!meta) return std::nullopt;
  return meta->parent_path();
}

// ---- ulps ------------------------------------------------------------------------------------

// max over the elements of |ours - peer| in ulps of the dtype at `magnitude`.
inline double ulp_distance(const at::Tensor& ours, const at::Tensor& peer, const at::Tensor& magnitude) {
  REQUIRE(ours.scalar_type() == peer.scalar_type());
  REQUIRE(ours.sizes() == peer.sizes());
  REQUIRE_FALSE(peer.isnan().any().item<bool>());
  return emakit_test::max_ulps_at(ours, peer, magnitude, peer.scalar_type());  // the tests' one ulp measure
}

// What the comparisons of a test saw.
struct Tally {
  int compared = 0;     // tensors compared
  int bitwise = 0;      // of which required bitwise equal: copies, integers, untouched tensors
  int within = 0;       // of which within the ulp bound: averaged tensors
  double max_ulps = 0;  // the largest ulp distance of an averaged tensor
  std::string worst;    // and where

  void add(const Tally& o) {
    compared += o.compared;
    bitwise += o.bitwise;
    within += o.within;
    if (o.max_ulps > max_ulps || worst.empty()) {
      max_ulps = std::max(max_ulps, o.max_ulps);
      if (!o.worst.empty()) worst = o.worst;
    }
  }
  std::string summary(double bound) const {
    return std::to_string(compared) + " tensor comparisons (" + std::to_string(bitwise) + " bitwise, " +
           std::to_string(within) + " within " + fmt::format("{:g}", bound) + " ulps; max " +
           fmt::format("{:g}", max_ulps) + " ulps" + (worst.empty() ? std::string() : " at " + worst) + ")";
  }
};

// One operand of the peer's operation, as the peer and as emakit saw it.
struct Operand {
  at::Tensor peer, ours;
};

// `ours` against `peer` (see the top of this file): integers bitwise; a peer value that is
// bitwise one of the operands (a copy, or left alone) wants emakit's same operand bitwise;
// otherwise within `max_ulps` ulps of the dtype at max(|peer|, |each operand's peer side|),
// elementwise, or with `normwise` at the largest such magnitude in the tensor (for results of
// reductions, such as a forward pass, whose error scales with the terms summed, not the result).
inline void check_tensor(Tally& t, const std::string& what, const at::Tensor& ours, const at::Tensor& peer,
                         const std::vector<Operand>& operands, double max_ulps, bool normwise = false) {
  INFO(what);
  ++t.compared;
  REQUIRE(ours.scalar_type() == peer.scalar_type());
  REQUIRE(ours.sizes() == peer.sizes());
  if (!peer.is_floating_point()) {
    ++t.bitwise;
    CHECK(torch::equal(ours, peer));
    return;
  }
  at::Tensor magnitude = peer.to(at::kDouble).abs();
  for (const auto& op : operands) {
    if (!op.peer.defined() || op.peer.scalar_type() != peer.scalar_type() || op.peer.sizes() != peer.sizes()) continue;
    if (torch::equal(op.peer, peer)) {  // the peer copied this operand (or left its state alone)
      ++t.bitwise;
      REQUIRE(op.ours.defined());
      CHECK(torch::equal(ours, op.ours));
      return;
    }
    magnitude = at::maximum(magnitude, op.peer.to(at::kDouble).abs());
  }
  ++t.within;
  if (normwise && magnitude.numel() > 0) magnitude = at::full_like(magnitude, magnitude.max().item<double>());
  const double u = ulp_distance(ours, peer, magnitude);
  if (u > t.max_ulps || t.worst.empty()) {
    t.max_ulps = std::max(t.max_ulps, u);
    t.worst = what;
  }
  CHECK(u <= max_ulps);
}

inline fs::path step_file(const fs::path& dir, const char* kind, std::int64_t step) {
  char file[40];
  std::snprintf(file, sizeof file, "%s_%04lld.pt", kind, static_cast<long long>(step));
  return dir / file;
}

inline std::vector<emakit::SourceTensor> sources_from(const fs::path& dir) {
  const Dict meta = load_dict(dir / "meta.pt");
  const Dict first = load_dict(dir / "step_0000.pt");
  std::vector<emakit::SourceTensor> out;
  for (const auto& [key, tensor] : first) {
    if (key.rfind("source.", 0) != 0) continue;
    const std::string name = key.substr(7);
    out.push_back({name, tensor.clone(), meta.count("buffer." + name) > 0});
  }
  return out;
}

// The number of keys starting with `prefix` in the step files first_step..steps of `dir`: what a
// replay of those steps must compare.
inline int count_keys(const fs::path& dir, const std::string& prefix, std::int64_t first_step = 1) {
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  int n = 0;
  for (std::int64_t step = first_step; step <= steps; ++step)
    for (const auto& [key, _] : load_dict(step_file(dir, "step", step))) n += key.rfind(prefix, 0) == 0 ? 1 : 0;
  return n;
}

// The comparisons a replay of `dir` from `first_step` must make: each peer.* and after.* recorded.
inline int expected_comparisons(const fs::path& dir, std::int64_t first_step = 1) {
  return count_keys(dir, "peer.", first_step) + count_keys(dir, "after.", first_step);
}

// The number of the model's tensors (source.* of step 0).
inline int model_tensors(const fs::path& dir) {
  int n = 0;
  for (const auto& [key, _] : load_dict(dir / "step_0000.pt")) n += key.rfind("source.", 0) == 0 ? 1 : 0;
  return n;
}

struct Replay : Tally {                       // counts: all comparisons; max_ulps: the averages
  Tally after;                                // the model's after.* (switch EMA), also counted above
  std::int64_t steps = 0;                     // steps replayed
  std::set<std::string> integer_differences;  // integer tensors the peer averages and emakit copies
};

// Clones of emakit's averages before an update.
inline std::map<std::string, at::Tensor> clone_all(const emakit::StateDict& held) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : held) out.emplace(item.key(), item.value().clone());
  return out;
}

// The operands of the update of `name` at a step (check_tensor), for a replay loop of its own: the
// state before (the peer's previous one, which emakit started from; before the peer's first
// recorded state, emakit's own, `ours_before`) and the source.
inline std::vector<Operand> update_operands(const std::string& name, const Dict& rec, const Dict& previous,
                                            const std::map<std::string, at::Tensor>& ours_before) {
  std::vector<Operand> out;
  const auto ours = ours_before.find(name);
  if (ours != ours_before.end()) {
    const auto peer = previous.find("peer." + name);
    out.push_back({peer != previous.end() ? peer->second : ours->second, ours->second});
  }
  const auto source = rec.find("source." + name);
  if (source != rec.end()) out.push_back({source->second, source->second});
  return out;
}

// Resets emakit's average `name` to the peer's state before this update (see the top).
inline void start_from(const emakit::StateDict& held, const Dict& previous) {
  torch::NoGradGuard no_grad;
  for (const auto& [key, peer] : previous) {
    if (key.rfind("peer.", 0) != 0 || !peer.is_floating_point()) continue;
    const at::Tensor* ours = held.find(key.substr(5));
    if (ours != nullptr && ours->scalar_type() == peer.scalar_type() && ours->sizes() == peer.sizes())
      const_cast<at::Tensor&>(*ours).copy_(peer);
  }
}

// Replays the scenario in `dir` through `ema`, bound to `sources`, from `first_step`. `pass_step`:
// give update() the step, as timm's train.py does. `check_counters(ema, record)` compares the
// peer's counters. Averaged tensors within `max_ulps` ulps per update (the caller's derivation),
// the model's tensors after the update (after.*, the switch EMA) within `after_max_ulps`.
template <class E, class Counters>
Replay replay(const fs::path& dir, std::vector<emakit::SourceTensor>& sources, E& ema, bool pass_step,
              Counters check_counters, double max_ulps, bool peer_averages_integers = false,
              std::int64_t first_step = 1, double after_max_ulps = 0) {
  Replay r;
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  const Dict first = load_dict(dir / "step_0000.pt");
  const emakit::StateDict held = ema.averages();
  Dict previous;
  for (std::int64_t step = first_step; step <= steps; ++step) {
    const Dict rec = load_dict(step_file(dir, "step", step));
    {
      torch::NoGradGuard no_grad;
      for (auto& s : sources) s.tensor.copy_(rec.at("source." + s.name));
    }
    start_from(held, previous);
    std::map<std::string, at::Tensor> before;
    for (const auto& item : held) before.emplace(item.key(), item.value().clone());
    const bool called = rec.at("called").item<std::int64_t>() != 0;
    const auto vetoed = rec.find("vetoed");
    emakit::StepInfo info;
    info.vetoed = !called || (vetoed != rec.end() && vetoed->second.item<std::int64_t>() != 0);
    if (pass_step) info.step = step;
    ema.update(info);
    ++r.steps;
    INFO("step " << step);
    const Dict* before_peer = previous.empty() ? nullptr : &previous;
    for (const auto& [key, peer] : rec) {
      if (key.rfind("peer.", 0) != 0) continue;
      const std::string name = key.substr(5);
      const std::string what = fmt::format("{} at step {}", name, step);
      const at::Tensor* ours = held.find(name);
      if (ours == nullptr) {  // emakit does not hold it: the peer must not have touched it either
        INFO(what);
        ++r.compared;
        ++r.bitwise;
        CHECK(torch::equal(peer, first.at("source." + name)));
        continue;
      }
      if (!peer.is_floating_point()) {
        INFO(what);
        ++r.compared;
        ++r.bitwise;
        if (peer_averages_integers && !torch::equal(*ours, peer)) {
          r.integer_differences.insert(name);
          CHECK(torch::equal(*ours, rec.at("source." + name)));  // emakit copies integers
        } else {
          CHECK(torch::equal(*ours, peer));
        }
        continue;
      }
      // The operands: the state before (the peer's previous one, which emakit started from; at
      // the first step replayed, emakit's own) and the source.
      const at::Tensor& was = before.at(name);
      const at::Tensor peer_was = before_peer != nullptr && before_peer->count(key) ? before_peer->at(key) : was;
      const at::Tensor& source = rec.at("source." + name);
      check_tensor(r, what, *ours, peer, {{peer_was, was}, {source, source}}, max_ulps);
    }
    check_counters(ema, rec);
    for (const auto& s : sources) {
      const auto after = rec.find("after." + s.name);
      if (after == rec.end()) continue;
      // The model pulled to the average: operands the model's tensor (source) and the average.
      const at::Tensor* avg = held.find(s.name);
      const auto peer_avg = rec.find("peer." + s.name);
      std::vector<Operand> operands{{rec.at("source." + s.name), rec.at("source." + s.name)}};
      if (avg != nullptr && peer_avg != rec.end()) operands.push_back({peer_avg->second, *avg});
      Tally one;
      check_tensor(one, fmt::format("the model's {} after the update at step {}", s.name, step), s.tensor,
                   after->second, operands, after_max_ulps);
      r.compared += one.compared;  // counted with the rest; its ulps reported apart
      r.bitwise += one.bitwise;
      r.within += one.within;
      r.after.add(one);
    }
    previous = rec;
  }
  std::cout << dir.parent_path().filename().string() << "/" << dir.filename().string() << ": " << r.steps << " steps, "
            << r.summary(max_ulps);
  if (r.after.compared > 0) std::cout << "; of which the model after the update: " << r.after.summary(after_max_ulps);
  std::cout << "\n";
  REQUIRE(r.compared > 0);
  return r;
}

inline auto ema_pytorch_counters = [](const auto& ema, const Dict& rec) {
  CHECK(ema.step() == rec.at("counter.step").item<std::int64_t>());
  CHECK((ema.num_updates() > 0) == (rec.at("counter.initted").item<std::int64_t>() != 0));
};
inline auto averaged_model_counters = [](const auto& ema, const Dict& rec) {
  CHECK(ema.num_updates() == rec.at("counter.n_averaged").item<std::int64_t>());
};
inline auto no_counters = [](const auto&, const Dict&) {};

}  // namespace emakit_conformance
