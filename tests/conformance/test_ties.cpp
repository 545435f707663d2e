// Conformance with a tied weight: each peer's generator runs a scenario on _common.TiedNet, whose
// head.weight IS emb.weight (one Parameter, one storage, two names; meta.pt lists both as
// tied.<name>). emakit is bound to the same tie (the sources under both names are one tensor) and
// averages the tied tensor once per update, as one tensor held under both names.
//
// The peers differ (their sources, as installed; README "Coming from Python", the tie row):
//   once:  ema-pytorch EMA (named_parameters()), torch AveragedModel and nvalchemi EMAHook, which
//          uses it (parameters() and buffers()), timm ModelEmaV3 with exclude_buffers
//          (parameters()): these list a tied Parameter once.
//   twice: timm ModelEmaV3 (state_dict().values()) and luxonis-train ModelEma (a deep copy of
//          state_dict(), whose entries keep the tie): the tied tensor is listed under both names
//          and lerped twice per update, the second lerp starting from the first one's result, so
//          decay d moves it like d^2 (a + (1 - d^2) (x - a)).
//
// What each test asserts, per update (replay.hpp: every update starts from the peer's previous
// state, so the bounds are for one update; ulps of float32 at M = max of the magnitudes of the
// operands and the result, elementwise):
//   - every untied tensor: emakit equals the peer as in test_peers.cpp (copies and integers
//     bitwise, averages within kLerp = 1.5 ulps, derived there);
//   - the tied tensor, both names: emakit holds one tensor for both, and it equals the plain
//     once-per-update reference lerp(a, x, 1 - d), ATen's lerp here (kLerp: the same formula, the
//     fused product or not);
//   - once peers: the peer's tied tensor equals emakit's within kLerp;
//   - twice peers: the peer's tied tensor equals lerp(lerp(a, x, w), x, w) (w = 1 - d, the same
//     float on both sides) within kTwice = 3 ulps: the inner lerp's 1.5 ulps reach the result
//     scaled by d <= 1 (the outer lerp is a + w (x - a), a function of a with slope 1 - w = d),
//     plus the outer lerp's own 1.5 ulps; M includes the inner result. And it is not within
//     kTwice of the once reference at any averaging step: the difference is real, not rounding.
// A copy (w = 1) is a copy under both readings: bitwise.
//
// The measured figure: a second emakit EMA runs free over the scenario (not reset to the peer's
// state), as a user who moved from the peer would compare the two. The test prints, for the tied
// tensor and the largest of the untied ones, ||peer - emakit|| / ||emakit|| (Frobenius) at the last
// step and the largest over the steps; for the twice peers it is the documented difference
// (docs/coming-from-python.md), for the once peers rounding.
#include "replay.hpp"

#include <cmath>

namespace test_ties {  // this file's names (unity batches: tests/CMakeLists.txt)

using namespace emakit_conformance;

namespace {

constexpr double kLerp = 1.5, kTwice = 3.0;

enum class Ties { once, twice };

// The scenario's tied names (meta.pt: tied.<name>), which must be emb.weight and head.weight.
std::vector<std::string> tied_names(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& [key, _] : load_dict(dir / "meta.pt"))
    if (key.rfind("tied.", 0) == 0) out.push_back(key.substr(5));
  REQUIRE(out == std::vector<std::string>{"emb.weight", "head.weight"});
  return out;
}

// The sources of `dir` with the tie of the peer's model: every tied name is the first one's tensor.
std::vector<emakit::SourceTensor> tied_sources(const fs::path& dir) {
  auto sources = sources_from(dir);
  const auto tied = tied_names(dir);
  const at::Tensor* held = nullptr;
  int bound = 0;
  for (auto& s : sources) {
    if (std::find(tied.begin(), tied.end(), s.name) == tied.end()) continue;
    if (held == nullptr) {
      held = &s.tensor;
    } else {
      REQUIRE(torch::equal(s.tensor, *held));  // the peer recorded one tensor under both names
      s.tensor = *held;
    }
    ++bound;
  }
  REQUIRE(bound == 2);
  return sources;
}

double rel_diff(const at::Tensor& peer, const at::Tensor& ours) {
  const double scale = ours.to(at::kDouble).norm().item<double>();
  REQUIRE(scale > 0);
  return (peer.to(at::kDouble) - ours.to(at::kDouble)).norm().item<double>() / scale;
}

struct TieReplay {
  Tally untied;            // the untied tensors against the peer
  Tally tied_peer;         // once peers: the tied tensor against the peer
  Tally tied_once;         // emakit's tied tensor against the once reference
  Tally tied_twice;        // twice peers: the peer's tied tensor against the twice reference
  int tied_compared = 0;   // tied names compared (both, at each step the peer recorded)
  int tied_updated = 0;    // of which at an update (a copy or an average)
  int recorded_steps = 0;  // steps at which the peer recorded its state
  int moving_steps = 0;    // steps at which emakit averaged with 0 < d < 1
  double min_twice_gap = std::numeric_limits<double>::infinity();  // twice: min over steps of the max-ulp gap
  int gaps = 0;                                                    // gaps measured
  double free_tied_last = 0, free_tied_max = 0;                    // ||peer - free|| / ||free||, tied tensor
  double free_untied_last = 0, free_untied_max = 0;                // the same, the largest over untied tensors
  std::int64_t steps = 0;
};

// Replays `dir` through `ema` (and `free`, the same preset, never reset) with the peer's tie.
template <class E, class Counters>
TieReplay replay_ties(const fs::path& dir, std::vector<emakit::SourceTensor>& sources, E& ema, E& free, Ties ties,
                      bool pass_step, Counters check_counters, bool peer_averages_integers = false) {
  TieReplay r;
  const auto tied = tied_names(dir);
  const auto is_tied = [&](const std::string& n) { return std::find(tied.begin(), tied.end(), n) != tied.end(); };
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  const Dict first = load_dict(dir / "step_0000.pt");
  const emakit::StateDict held = ema.averages();
  {
    // One tensor under both names, in the EMA as in the model.
    const at::Tensor* a = held.find(tied[0]);
    const at::Tensor* b = held.find(tied[1]);
    REQUIRE(a != nullptr);
    REQUIRE(b != nullptr);
    CHECK(a->is_same(*b));
  }
  Dict previous;
  for (std::int64_t step = 1; step <= steps; ++step) {
    INFO("step " << step);
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
    const emakit::UpdateResult result = ema.update(info);
    const emakit::UpdateResult free_result = free.update(info);
    CHECK(free_result.action == result.action);
    ++r.steps;
    const bool averaged = result.action == emakit::Action::averaged;
    const bool moving = averaged && result.decay > 0 && result.decay < 1;
    r.moving_steps += moving ? 1 : 0;
    bool recorded = false;
    const emakit::StateDict free_held = free.averages();
    for (const auto& [key, peer] : rec) {
      if (key.rfind("peer.", 0) != 0) continue;
      const std::string name = key.substr(5);
      const std::string what = fmt::format("{} at step {}", name, step);
      INFO(what);
      recorded = true;
      const at::Tensor* ours = held.find(name);
      if (ours == nullptr) {  // emakit does not hold it: the peer must not have touched it either
        ++r.untied.compared;
        ++r.untied.bitwise;
        CHECK(torch::equal(peer, first.at("source." + name)));
        continue;
      }
      if (!peer.is_floating_point()) {
        ++r.untied.compared;
        ++r.untied.bitwise;
        if (peer_averages_integers && !torch::equal(*ours, peer))
          CHECK(torch::equal(*ours, rec.at("source." + name)));  // emakit copies integers
        else
          CHECK(torch::equal(*ours, peer));
        continue;
      }
      const at::Tensor& was = before.at(name);
      const auto prev = previous.find(key);
      const at::Tensor peer_was = prev != previous.end() ? prev->second : was;
      const at::Tensor& source = rec.at("source." + name);
      const at::Tensor* free_ours = free_held.find(name);
      REQUIRE(free_ours != nullptr);
      const double free_rel = averaged ? rel_diff(peer, *free_ours) : 0.0;
      if (!is_tied(name)) {
        check_tensor(r.untied, what, *ours, peer, {{peer_was, was}, {source, source}}, kLerp);
        r.free_untied_max = std::max(r.free_untied_max, free_rel);
        if (step == steps) r.free_untied_last = std::max(r.free_untied_last, free_rel);
        continue;
      }
      ++r.tied_compared;
      r.free_tied_max = std::max(r.free_tied_max, free_rel);
      if (step == steps) r.free_tied_last = free_rel;
      if (result.action == emakit::Action::skipped) {  // left alone on both sides
        check_tensor(r.tied_peer, what, *ours, peer, {{peer_was, was}}, 0);
        continue;
      }
      ++r.tied_updated;
      // w = 1 - d as the update used it (1 for a copy), rounded to float by ATen's lerp as by emakit.
      const double w = result.action == emakit::Action::copied ? 1.0 : 1.0 - result.decay;
      const at::Tensor once = at::lerp(was, source, w);
      check_tensor(r.tied_once, what + " (emakit against the once reference)", *ours, once,
                   {{was, was}, {source, source}}, kLerp);
      if (ties == Ties::once) {
        check_tensor(r.tied_peer, what + " (the peer, once)", *ours, peer, {{peer_was, was}, {source, source}}, kLerp);
        continue;
      }
      const at::Tensor inner = at::lerp(peer_was, source, w);
      const at::Tensor twice = at::lerp(inner, source, w);
      check_tensor(r.tied_twice, what + " (the peer against the twice reference)", twice, peer,
                   {{peer_was, peer_was}, {source, source}, {inner, inner}}, kTwice);
      if (moving) {
        ++r.gaps;
        const at::Tensor peer_once = at::lerp(peer_was, source, w);
        const double gap =
            emakit_test::max_ulps_at(peer_once, peer, emakit_test::operand_magnitude(peer_was, source), at::kFloat);
        r.min_twice_gap = std::min(r.min_twice_gap, gap);
        CHECK(gap > kTwice);
      }
    }
    r.recorded_steps += recorded ? 1 : 0;
    check_counters(ema, rec);
    previous = rec;
  }
  std::cout << dir.parent_path().filename().string() << "/" << dir.filename().string() << ": " << r.steps << " steps ("
            << r.moving_steps << " averaging with 0 < d < 1); untied: " << r.untied.summary(kLerp)
            << "; tied, emakit vs once reference: " << r.tied_once.summary(kLerp);
  if (ties == Ties::once)
    std::cout << "; tied, emakit vs the peer: " << r.tied_peer.summary(kLerp);
  else
    std::cout << "; tied, the peer vs twice reference: " << r.tied_twice.summary(kTwice)
              << "; smallest gap peer vs once reference " << fmt::format("{:g}", r.min_twice_gap) << " ulps";
  std::cout << "\n  free run, ||peer - emakit|| / ||emakit||: tied " << fmt::format("{:.3g}", r.free_tied_last)
            << " at the last step (max " << fmt::format("{:.3g}", r.free_tied_max) << "), untied "
            << fmt::format("{:.3g}", r.free_untied_last) << " (max " << fmt::format("{:.3g}", r.free_untied_max)
            << ")\n";
  // Both tied names at every step, every other tensor the peer recorded.
  REQUIRE(r.tied_compared == 2 * r.recorded_steps);
  REQUIRE(r.untied.compared + r.tied_compared == count_keys(dir, "peer."));
  REQUIRE(r.tied_once.compared == r.tied_updated);
  if (ties == Ties::once) {
    REQUIRE(r.tied_peer.compared == r.tied_compared);
    REQUIRE(r.tied_twice.compared == 0);
  } else {
    REQUIRE(r.tied_twice.compared == r.tied_updated);
    REQUIRE(r.tied_peer.compared == r.tied_compared - r.tied_updated);
    REQUIRE(r.gaps == 2 * r.moving_steps);
  }
  REQUIRE(r.moving_steps > 0);
  return r;
}

// The free-run figures: for a once peer the tied tensor stays at rounding like the rest; for a
// twice peer it is far from emakit's while the untied tensors stay at rounding.
void require_figures(const TieReplay& r, Ties ties) {
  CHECK(r.free_untied_max < 1e-5);
  if (ties == Ties::once)
    CHECK(r.free_tied_max < 1e-5);
  else
    CHECK(r.free_tied_last > 1e-3);
}

int count_created(const fs::path& dir) {
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  int n = 0;
  for (std::int64_t step = 1; step <= steps; ++step)
    n += load_dict(step_file(dir, "step", step)).at("counter.created").item<std::int64_t>() != 0;
  return n;
}

}  // namespace

TEST_CASE("ties: ema-pytorch EMA averages a tied weight once (named_parameters)", "[conformance][ties][ema-pytorch]") {
  const auto dir = scenario_dir("ema_pytorch_peer", "tied");
  if (!dir) return;
  auto sources = tied_sources(*dir);
  const emakit::EmaPytorchOptions o{.beta = 0.9, .update_after_step = 2, .update_every = 1, .power = 0.75};
  auto ema = emakit::ema_pytorch(sources, o);
  auto free = emakit::ema_pytorch(sources, o);
  const auto r = replay_ties(*dir, sources, ema, free, Ties::once, false, ema_pytorch_counters);
  REQUIRE(r.untied.compared + r.tied_compared == model_tensors(*dir) * r.steps);
  require_figures(r, Ties::once);
}

TEST_CASE("ties: timm ModelEmaV3 averages a tied weight twice (state_dict walk)", "[conformance][ties][timm]") {
  const auto dir = scenario_dir("timm_peer", "tied");
  if (!dir) return;
  auto sources = tied_sources(*dir);
  const emakit::TimmModelEmaV3Options o{.decay = 0.9, .update_after_step = 2};
  auto ema = emakit::timm_model_ema_v3(sources, o);
  auto free = emakit::timm_model_ema_v3(sources, o);
  const auto r = replay_ties(*dir, sources, ema, free, Ties::twice, true, no_counters);
  REQUIRE(r.untied.compared + r.tied_compared == model_tensors(*dir) * r.steps);
  require_figures(r, Ties::twice);
}

TEST_CASE("ties: timm ModelEmaV3 with exclude_buffers averages a tied weight once (parameters)",
          "[conformance][ties][timm]") {
  const auto dir = scenario_dir("timm_peer", "tied_exclude_buffers");
  if (!dir) return;
  auto sources = tied_sources(*dir);
  const emakit::TimmModelEmaV3Options o{.decay = 0.9, .update_after_step = 2, .exclude_buffers = true};
  auto ema = emakit::timm_model_ema_v3(sources, o);
  auto free = emakit::timm_model_ema_v3(sources, o);
  const auto r = replay_ties(*dir, sources, ema, free, Ties::once, true, no_counters);
  REQUIRE(r.untied.compared + r.tied_compared == model_tensors(*dir) * r.steps);
  require_figures(r, Ties::once);
}

TEST_CASE("ties: AveragedModel averages a tied weight once (parameters and buffers)",
          "[conformance][ties][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "tied_ema");
  if (!dir) return;
  auto sources = tied_sources(*dir);
  const emakit::AveragedModelOptions o{.decay = 0.9, .use_buffers = true};
  auto ema = emakit::averaged_model_ema(sources, o);
  auto free = emakit::averaged_model_ema(sources, o);
  const auto r = replay_ties(*dir, sources, ema, free, Ties::once, false, averaged_model_counters,
                             /*peer_averages_integers=*/true);
  REQUIRE(r.untied.compared + r.tied_compared == model_tensors(*dir) * r.steps);
  require_figures(r, Ties::once);
}

TEST_CASE("ties: luxonis-train ModelEma averages a tied weight twice (state_dict copy)",
          "[conformance][ties][luxonis]") {
  const auto dir = scenario_dir("luxonis_peer", "tied_dynamic_decay");
  if (!dir) return;
  auto sources = tied_sources(*dir);
  const emakit::LuxonisModelEmaOptions o{.decay = 0.9, .decay_tau = 3.0};
  auto ema = emakit::luxonis_model_ema(sources, o);
  auto free = emakit::luxonis_model_ema(sources, o);
  const auto r = replay_ties(*dir, sources, ema, free, Ties::twice, false, [](const auto& e, const Dict& rec) {
    CHECK(e.num_updates() == rec.at("counter.updates").template item<std::int64_t>());
  });
  REQUIRE(r.untied.compared + r.tied_compared == model_tensors(*dir) * r.steps);
  require_figures(r, Ties::twice);
}

TEST_CASE("ties: nvalchemi EMAHook averages a tied weight once (AveragedModel)", "[conformance][ties][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "tied");
  if (!dir) return;
  auto sources = tied_sources(*dir);
  const emakit::NvalchemiEmaOptions o{.decay = 0.9, .start_step = 2, .use_buffers = false};
  auto ema = emakit::nvalchemi_ema(sources, o);
  auto free = emakit::nvalchemi_ema(sources, o);
  const auto r = replay_ties(*dir, sources, ema, free, Ties::once, false, [](const auto& e, const Dict& rec) {
    CHECK(e.num_updates() == rec.at("counter.num_updates").template item<std::int64_t>());
    CHECK(e.step() == rec.at("counter.step_count").template item<std::int64_t>());
  });
  // The peer records its state once it made its averaged model: every model tensor at those steps.
  REQUIRE(r.untied.compared + r.tied_compared == model_tensors(*dir) * count_created(*dir));
  require_figures(r, Ties::once);
}

}  // namespace test_ties
