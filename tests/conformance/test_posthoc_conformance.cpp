// Conformance of emakit's post-hoc EMA with ema-pytorch's PostHocEMA, on the data that
// tests/conformance/posthoc_ema_pytorch.py writes (a seeded trajectory of _common.Net, two
// profiles sigma_rel 0.05 and 0.10, update_every 1, fp32 checkpoints every 10 of 40 calls, and
// its synthesis of sigma_rel 0.07 at call 40 and at call 20).
//
// What differs, and what these tests pin down:
//   - Tracking: ema-pytorch uses beta = (1 - 1/(k+1))^(gamma+1) at its k-th call, emakit
//     (1 - dt/t)^(gamma+1) at step t. ema-pytorch's EMA after k calls is emakit's EMA after k+1
//     steps of the same trajectory with its first state given twice: a profile one step longer
//     than the step it is labelled with. On the plain trajectory the two differ.
//   - Solve: the same A x = b; ema-pytorch does not normalise x (here it sums to 1.0115 at call 40).
//     emakit's weights are its weights divided by their sum, to 1e-9.
//   - Synthesis: on the same snapshots, emakit's result is ema-pytorch's divided by that sum.
//     ema-pytorch also uses the snapshots after an earlier target time; their weights come out
//     ~1e-16 (a later profile adds nothing on [0, target] that the target-time snapshot of its
//     gamma lacks), so that makes no difference beyond rounding.
//
// Tolerances, in ulps of float32 (tests/helpers.hpp's max_ulps_at), each derived where it is checked:
//   tracking: the EMA is carried over k updates (no per-step reference to restart from: the peer
//     records its checkpoints every 10 calls), each within kLerp = 1.5 ulps of ATen's lerp
//     (test_peers.cpp) plus 1 ulp for the weight, which the two compute with different formulas in
//     double and round to float (|w_f - w'_f| |x - a| <= ulp(w) 2M <= ulp(M) for w < 0.5). An
//     error carried into a lerp is scaled by 1 - w <= 1: after k updates at most 2.5 k ulps of the
//     largest magnitude the element took on the trajectory.
//   synthesis: a weighted sum of K snapshots, on each side K products and K sums rounded in float
//     (emakit may hold the sum wider: fewer), each within 0.5 ulp of M = sum_i |w_i s_i|
//     elementwise, plus the scaling by the weights' sum: 2K + 1 ulps of M.
// Missing data is a failure (replay.hpp), skipped only in a build without Python.
#include "replay.hpp"

#include <emakit/emakit.hpp>
#include <emakit/posthoc.hpp>

#include <torch/serialize.h>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace test_posthoc_conformance {  // this file's names (unity batches: tests/CMakeLists.txt)

namespace fs = std::filesystem;

namespace {

using Dict = std::map<std::string, at::Tensor>;

// The generator's data, or nullopt when the test is skipped (replay.hpp's peer_file).
std::optional<Dict> posthoc_data() {
  const auto file = emakit_conformance::peer_file("posthoc_ema_pytorch", "posthoc.pt");
  if (!file) return std::nullopt;
  std::ifstream in(*file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Dict out;
  for (const auto& item : torch::pickle_load(bytes).toGenericDict())
    out.emplace(item.key().toStringRef(), item.value().toTensor());
  REQUIRE(!out.empty());
  return out;
}

struct TempFolder {
  fs::path path;
  explicit TempFolder(const std::string& name)
      : path(fs::temp_directory_path() / fmt::format("emakit-conformance-{}-{}", name, static_cast<long>(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Names of the model's tensors, from the trajectory.
std::vector<std::string> names_of(const Dict& data) {
  std::vector<std::string> out;
  for (const auto& [key, _] : data)
    if (key.rfind("traj.", 0) == 0) out.push_back(key.substr(5));
  return out;
}

// max |a - b| / max(1, |b|) over the floating tensors named `names`.
double max_relative(const emakit::StateDict& ours, const Dict& data, const std::string& prefix,
                    const std::vector<std::string>& names, double scale = 1.0) {
  double worst = 0;
  for (const auto& name : names) {
    const auto& theirs = data.at(prefix + name);
    if (!theirs.is_floating_point() || !ours[name].is_floating_point()) continue;
    const auto a = ours[name].to(torch::kDouble) * scale, b = theirs.to(torch::kDouble);
    worst = std::max(worst, ((a - b).abs() / b.abs().clamp_min(1.0)).max().item<double>());
  }
  return worst;
}

// max over the floating tensors `names` of |ours * scale - theirs| in ulps of float32 at
// magnitude_of(name) (elementwise); each tensor compared counts in `compared`.
template <class Magnitude>
double max_ulps(const emakit::StateDict& ours, const Dict& data, const std::string& prefix,
                const std::vector<std::string>& names, Magnitude magnitude_of, int& compared, double scale = 1.0) {
  double worst = 0;
  for (const auto& name : names) {
    const auto& theirs = data.at(prefix + name);
    if (!theirs.is_floating_point() || !ours[name].is_floating_point()) continue;  // integers: not averaged
    REQUIRE(ours[name].scalar_type() == theirs.scalar_type());
    const at::Tensor a = ours[name].to(torch::kDouble) * scale;
    worst = std::max(worst, emakit_test::max_ulps_at(a, theirs, magnitude_of(name), theirs.scalar_type()));
    ++compared;
  }
  return worst;
}

// The checkpoints as (t, gamma) profiles, in the order ema-pytorch's synthesis used them.
std::vector<emakit::Profile> their_order(const Dict& data) {
  std::vector<emakit::Profile> out;
  const auto inds = data.at("order_ind"), steps = data.at("order_step"), gammas = data.at("gammas");
  for (std::int64_t i = 0; i < inds.numel(); ++i)
    out.push_back(
        {static_cast<double>(steps[i].item<std::int64_t>()), gammas[inds[i].item<std::int64_t>()].item<double>()});
  return out;
}

}  // namespace

TEST_CASE("Post-hoc weights: emakit's are ema-pytorch's normalised to sum 1", "[conformance][posthoc]") {
  const auto data = posthoc_data();
  if (!data) return;
  const auto profiles = their_order(*data);
  const double target_gamma = data->at("target_gamma").item<double>();
  CHECK(emakit::sigma_rel_to_gamma(data->at("target_sigma_rel").item<double>()) == Approx(target_gamma).epsilon(1e-10));
  for (const auto& [key, t] :
       {std::pair{"weights", data->at("steps")}, std::pair{"weights_mid", data->at("mid_step")}}) {
    const auto theirs = data->at(key);
    const auto ours =
        emakit::solve_posthoc_weights(profiles, {static_cast<double>(t.item<std::int64_t>()), target_gamma});
    REQUIRE(theirs.numel() == static_cast<std::int64_t>(ours.weights.size()));
    double their_sum = theirs.sum().item<double>();
    INFO(key << ": ema-pytorch's weights sum to " << their_sum);
    CHECK(ours.raw_sum == Approx(their_sum).epsilon(1e-9));
    CHECK(std::abs(their_sum - 1.0) > 1e-3);  // it does not normalise
    for (std::int64_t i = 0; i < theirs.numel(); ++i) {
      CHECK(ours.weights[i] * ours.raw_sum == Approx(theirs[i].item<double>()).margin(1e-9));
      if (profiles[i].t > t.item<std::int64_t>())
        CHECK(std::abs(theirs[i].item<double>()) < 1e-12);  // after the target
    }
  }
}

TEST_CASE("Post-hoc synthesis on ema-pytorch's snapshots: its result divided by its weights' sum",
          "[conformance][posthoc]") {
  const auto data = posthoc_data();
  if (!data) return;
  const auto names = names_of(*data);
  const auto gammas = data->at("gammas");
  // Import its checkpoints as emakit snapshot files.
  TempFolder folder("posthoc-import");
  const auto steps = data->at("ckpt_steps");
  for (std::int64_t i = 0; i < gammas.numel(); ++i) {
    for (std::int64_t k = 0; k < steps.numel(); ++k) {
      const auto step = steps[k].item<std::int64_t>();
      emakit::StateDict tensors;
      for (const auto& name : names)
        if (data->at(fmt::format("traj.{}", name)).is_floating_point())
          tensors.insert(name, data->at(fmt::format("ckpt.{}.{}.{}", i, step, name)));
      emakit::SnapshotInfo header;
      header.step = header.t = step;
      header.gamma = gammas[i].item<double>();
      header.profile = static_cast<std::uint32_t>(i);
      emakit::write_snapshot(folder.path / emakit::snapshot_file_name(step, header.profile), header, tensors);
    }
  }
  const double target_gamma = data->at("target_gamma").item<double>();
  for (const auto& [suffix, t] : {std::pair{"", data->at("steps")}, std::pair{"_mid", data->at("mid_step")}}) {
    const auto plan =
        emakit::plan_synthesis(folder.path, emakit::SynthesisOptions(target_gamma).step(t.item<std::int64_t>()));
    const auto ours = emakit::synthesize(plan);
    const at::Tensor weights = data->at(fmt::format("weights{}", suffix));
    const double their_sum = weights.sum().item<double>();
    std::vector<std::string> floats;
    for (const auto& item : ours) floats.push_back(item.key());
    // M = sum_i |w_i s_i| over ema-pytorch's snapshots in its order (the magnitude of the terms).
    const auto order_ind = data->at("order_ind"), order_step = data->at("order_step");
    const std::int64_t terms = order_ind.numel();
    REQUIRE(terms == weights.numel());
    auto magnitude = [&](const std::string& name) {
      at::Tensor m = at::zeros_like(data->at("synth." + name), at::kDouble);
      for (std::int64_t i = 0; i < terms; ++i)
        m += data->at(fmt::format("ckpt.{}.{}.{}", order_ind[i].item<std::int64_t>(),
                                  order_step[i].item<std::int64_t>(), name))
                 .to(at::kDouble)
                 .abs() *
             std::abs(weights[i].item<double>());
      return m;
    };
    int compared = 0;
    const double scaled =
        max_ulps(ours, *data, fmt::format("synth{}.", suffix), floats, magnitude, compared, their_sum);
    const double plain = max_relative(ours, *data, fmt::format("synth{}.", suffix), floats);
    const double bound = 2.0 * static_cast<double>(terms) + 1;  // K products and K sums a side, the scaling
    std::cout << fmt::format("posthoc conformance (target t = {}): |emakit * {:.6f} - ema-pytorch| max {:.3g} ulps of "
                             "sum |w_i s_i| (bound {:g}, {} tensors); without the factor max rel {:.3g}\n",
                             t.item<std::int64_t>(), their_sum, scaled, bound, compared, plain);
    REQUIRE(compared == static_cast<int>(floats.size()));
    REQUIRE(compared > 0);
    CHECK(scaled <= bound);
    CHECK(plain > 1e-3);  // the normalisation is a visible difference (by design, not a tolerance)
  }
}

TEST_CASE("Post-hoc tracking: ema-pytorch's EMA after k calls is emakit's after k+1 steps with the first state twice",
          "[conformance][posthoc]") {
  const auto data = posthoc_data();
  if (!data) return;
  const auto names = names_of(*data);
  const auto gammas = data->at("gammas");
  const auto steps = data->at("ckpt_steps");
  const std::int64_t calls = data->at("steps").item<std::int64_t>();

  // Per update: kLerp (1.5) plus 1 ulp for the weight's two formulas (top of the file).
  constexpr double kPerUpdate = 2.5;
  struct Tracked {
    int compared = 0;
    double max_ulps = 0, max_per_update = 0, worst_rel = 0;
  };
  // Replays the trajectory (optionally with its first state twice) and compares every checkpoint.
  auto replay = [&](bool first_twice) {
    std::vector<emakit::SourceTensor> sources;
    for (const auto& name : names)
      sources.push_back({name, data->at("traj." + name)[0].clone(), data->count("buffer." + name) > 0});
    TempFolder folder(first_twice ? "posthoc-shifted" : "posthoc-plain");
    emakit::PostHocEma posthoc(sources, emakit::PostHocOptions(folder.path)
                                            .gammas({gammas[0].item<double>(), gammas[1].item<double>()})
                                            .snapshot_every(0));
    Tracked r;
    const std::int64_t shift = first_twice ? 1 : 0;
    for (std::int64_t step = 1; step <= calls + shift; ++step) {
      const std::int64_t k = std::max<std::int64_t>(step - shift, 1);  // ema-pytorch's call number
      for (auto& s : sources) s.tensor.copy_(data->at("traj." + s.name)[k - 1]);
      posthoc.update();
      const bool checkpoint = step > shift && (k % (steps[0].item<std::int64_t>())) == 0;
      if (!checkpoint) continue;
      // M: the largest magnitude the element took on the trajectory so far (the EMA is a convex
      // combination of those states); emakit ran `step` updates.
      auto magnitude = [&](const std::string& name) { return data->at("traj." + name).narrow(0, 0, k).abs().amax(0); };
      for (std::size_t i = 0; i < posthoc.size(); ++i) {
        const auto averages = posthoc.ema(i).averages();
        const double u = max_ulps(averages, *data, fmt::format("ckpt.{}.{}.", i, k), names, magnitude, r.compared);
        r.max_ulps = std::max(r.max_ulps, u);
        r.max_per_update = std::max(r.max_per_update, u / static_cast<double>(step));
        r.worst_rel = std::max(r.worst_rel, max_relative(averages, *data, fmt::format("ckpt.{}.{}.", i, k), names));
        if (first_twice) CHECK(u <= kPerUpdate * static_cast<double>(step));
      }
    }
    return r;
  };
  const Tracked shifted = replay(true), plain = replay(false);
  std::cout << fmt::format(
      "posthoc conformance tracking: with the first state twice max {:.3g} ulps ({:.3g} per update, "
      "bound {:g} per update, {} tensors); on the plain trajectory max rel {:.3g}\n",
      shifted.max_ulps, shifted.max_per_update, kPerUpdate, shifted.compared, plain.worst_rel);
  int floats = 0;
  for (const auto& name : names) floats += data->at("traj." + name).is_floating_point() ? 1 : 0;
  REQUIRE(shifted.compared == floats * static_cast<int>(gammas.numel() * steps.numel()));
  CHECK(plain.worst_rel > 1e-3);  // the plain trajectory differs, by design (not a tolerance)
}

}  // namespace test_posthoc_conformance
