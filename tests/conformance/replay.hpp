// Shared by the conformance tests: reading the Python peers' files and replaying a scenario.
#pragma once

#include <emakit/emakit.hpp>

#include <torch/serialize.h>

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace emakit_conformance {
namespace fs = std::filesystem;


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

// The folder of a scenario, or nullopt after printing why it is skipped.
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

// max |ours - peer| / max(|peer|, 1), in double.
inline double rel_diff(const at::Tensor& ours, const at::Tensor& peer) {
  return ((ours.to(at::kDouble) - peer.to(at::kDouble)).abs() / peer.to(at::kDouble).abs().clamp_min(1.0))
      .max()
      .item<double>();
}

inline std::optional<fs::path> scenario_dir(const std::string& peer, const std::string& scenario) {
  const char* root = std::getenv("EMAKIT_CONFORMANCE_DIR");
  if (root == nullptr) {
    std::cout << "SKIPPED: EMAKIT_CONFORMANCE_DIR is not set (run through ctest)\n";
    return std::nullopt;
  }
  const fs::path base = fs::path(root) / peer;
  const fs::path marker = fs::path(root) / (peer + ".skipped");
  if (fs::exists(marker)) {
    std::ifstream in(marker);
    std::string reason((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::cout << "SKIPPED: " << reason << "\n";
    return std::nullopt;
  }
  if (!fs::exists(base / scenario / "meta.pt")) {
    std::cout << "SKIPPED: no conformance data for " << peer << "/" << scenario
              << " (no Python with the package: PyPI unreachable?)\n";
    return std::nullopt;
  }
  return base / scenario;
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

struct Replay {
  double max_rel = 0;      // largest |emakit - peer| / max(1, |peer|) over averaged tensors
  int compared = 0;        // tensors compared
  std::set<std::string> integer_differences;  // integer tensors the peer averages and emakit copies
};

// Replays the scenario in `dir` through `ema`, bound to `sources`. `pass_step`: give update() the
// step, as timm's train.py does. `check_counters(ema, record)` compares the peer's counters.
template <class E, class Counters>
Replay replay(const fs::path& dir, std::vector<emakit::SourceTensor>& sources, E& ema, bool pass_step,
              Counters check_counters, bool peer_averages_integers = false, std::int64_t first_step = 1) {
  Replay r;
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  const Dict first = load_dict(dir / "step_0000.pt");
  const emakit::StateDict held = ema.averages();
  for (std::int64_t step = first_step; step <= steps; ++step) {
    const Dict rec = load_dict(step_file(dir, "step", step));
    {
      torch::NoGradGuard no_grad;
      for (auto& s : sources) s.tensor.copy_(rec.at("source." + s.name));
    }
    const bool called = rec.at("called").item<std::int64_t>() != 0;
    const auto vetoed = rec.find("vetoed");
    emakit::StepInfo info;
    info.vetoed = !called || (vetoed != rec.end() && vetoed->second.item<std::int64_t>() != 0);
    if (pass_step) info.step = step;
    ema.update(info);
    INFO("step " << step);
    for (const auto& [key, peer] : rec) {
      if (key.rfind("peer.", 0) != 0) continue;
      const std::string name = key.substr(5);
      INFO(name);
      const at::Tensor* ours = held.find(name);
      if (ours == nullptr) {  // emakit does not hold it: the peer must not have touched it either
        CHECK(torch::equal(peer, first.at("source." + name)));
        continue;
      }
      if (!peer.is_floating_point()) {
        if (peer_averages_integers && !torch::equal(*ours, peer)) {
          r.integer_differences.insert(name);
          CHECK(torch::equal(*ours, rec.at("source." + name)));  // emakit copies integers
        } else {
          CHECK(torch::equal(*ours, peer));
        }
        continue;
      }
      REQUIRE(ours->scalar_type() == peer.scalar_type());
      const at::Tensor diff = (ours->to(at::kDouble) - peer.to(at::kDouble)).abs();
      const at::Tensor scale = peer.to(at::kDouble).abs().clamp_min(1.0);
      const double rel = (diff / scale).max().item<double>();
      r.max_rel = std::max(r.max_rel, rel);
      ++r.compared;
      CHECK(rel <= 1e-6);
    }
    check_counters(ema, rec);
    for (const auto& s : sources) {
      const auto after = rec.find("after." + s.name);
      if (after != rec.end()) {
        INFO("model after the update: " << s.name);
        const double rel = ((s.tensor.to(at::kDouble) - after->second.to(at::kDouble)).abs() /
                            after->second.to(at::kDouble).abs().clamp_min(1.0))
                               .max()
                               .item<double>();
        CHECK(rel <= 1e-6);
      }
    }
  }
  std::cout << dir.parent_path().filename().string() << "/" << dir.filename().string() << ": " << steps
            << " steps, " << r.compared << " tensor comparisons, max relative difference " << r.max_rel << "\n";
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
