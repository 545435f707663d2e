// Conformance: the emakit presets replay the trajectories that the real Python packages
// (ema-pytorch, timm, torch's AveragedModel) went through, and must end up with the same averaged
// tensors and counters at every step. The data comes from tests/conformance/*_peer.py (run by
// ctest before these tests); missing data is a failure (replay.hpp), skipped only in a build
// without Python.
//
// Tolerances (replay.hpp: each update starts from the peer's previous state, so these are for
// one update; ulps of float32 at M = max(|a|, |x|, |result|) elementwise, a the state before, x
// the source, w the weight 1 - decay):
//   kLerp = 1.5 ulps: ema-pytorch (lerp_ / _foreach_lerp_), timm ModelEmaV3 (_foreach_lerp_) and
//     AveragedModel's get_ema_multi_avg_fn (_foreach_lerp_) run ATen's lerp, the formula emakit
//     runs: d = x - a (the same rounding on both sides), then a + w*d for |w| < 0.5, else
//     x - (1-w)*d (1-w exact for w >= 0.5). ATen's vectorised kernel fuses w*d into the add
//     (one rounding), emakit's portable pass does not (two): the exact values before the last
//     rounding differ by at most the product's rounding, 0.5 ulp(w*d) <= 0.5 ulp(M) (|w*d| <= M),
//     and the two last roundings add 0.5 ulp(M) each: 1.5. The weight is the same float on both
//     sides (the same double formula, rounded once to float).
//   kSwa = 2.5 ulps: AveragedModel's SWA adds d / (n+1) (a division: 0.5 ulp of the quotient);
//     emakit multiplies d by w = float(1/(n+1)) (0.5 ulp for w's rounding, 0.5 for the product):
//     1.5 ulp of |d|/(n+1) <= ulp(M), plus the two last roundings.
//   kSwitch = 2.25 ulps (after.*, the switch EMA: the model lerped to the average with weight
//     1 - beta = 0.5): the same lerp (1.5) of operands one of which, emakit's average, is itself
//     within kLerp of the peer's, weighted 0.5: 1.5 + 0.5 * 1.5.
//   Copies (warmup, first update, copy-only buffers, the switch copy), untouched tensors, integer
//   tensors and counters: bitwise / exact.
#include "replay.hpp"

namespace test_peers {  // this file's names (unity batches: tests/CMakeLists.txt)

using namespace emakit_conformance;

namespace {
constexpr double kLerp = 1.5, kSwa = 2.5, kSwitch = 2.25;

// The replay compared each tensor the peer recorded, and the peer recorded every model tensor at
// every step replayed (plus the model's after.* where the scenario writes the model).
void require_counts(const Replay& r, const fs::path& dir, std::int64_t first_step = 1) {
  REQUIRE(r.compared == expected_comparisons(dir, first_step));
  REQUIRE(count_keys(dir, "peer.", first_step) == model_tensors(dir) * r.steps);
}
}  // namespace

TEST_CASE("ema-pytorch EMA: name sets, warmup copies, update_every, min_value", "[conformance][ema-pytorch]") {
  const auto dir = scenario_dir("ema_pytorch_peer", "names_and_warmup");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::ema_pytorch(sources, {.beta = 0.99,
                                           .update_after_step = 5,
                                           .update_every = 3,
                                           .power = 0.75,
                                           .min_value = 0.2,
                                           .param_or_buffer_names_no_ema = {"mask"},
                                           .ignore_names = {"emb.weight"},
                                           .ignore_startswith_names = {"conv."}});
  require_counts(replay(*dir, sources, ema, false, ema_pytorch_counters, kLerp, false, 1, kSwitch), *dir);
}

TEST_CASE("ema-pytorch EMA: defaults, with steps the trainer skipped", "[conformance][ema-pytorch]") {
  const auto dir = scenario_dir("ema_pytorch_peer", "defaults_with_skips");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::ema_pytorch(sources);
  require_counts(replay(*dir, sources, ema, false, ema_pytorch_counters, kLerp, false, 1, kSwitch), *dir);
}

TEST_CASE("ema-pytorch EMA: switch EMA pulls the model to the average (lerp and copy)", "[conformance][ema-pytorch]") {
  for (const char* scenario : {"switch_lerp", "switch_copy"}) {
    const auto dir = scenario_dir("ema_pytorch_peer", scenario);
    if (!dir) return;
    auto sources = sources_from(*dir);
    const bool lerp = std::string(scenario) == "switch_lerp";
    emakit::EmaPytorchOptions o{.beta = 0.9, .update_after_step = 2, .update_every = lerp ? 1 : 2};
    o.update_model_with_ema_every = lerp ? 4 : 3;
    o.update_model_with_ema_beta = lerp ? 0.5 : 0.0;
    auto ema = emakit::ema_pytorch(sources, o);
    require_counts(replay(*dir, sources, ema, false, ema_pytorch_counters, kLerp, false, 1, kSwitch), *dir);
  }
}

TEST_CASE("timm ModelEmaV3: warmup with min_decay and update_after_step, step passed", "[conformance][timm]") {
  const auto dir = scenario_dir("timm_peer", "warmup_with_step");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::timm_model_ema_v3(
      sources, {.decay = 0.99, .min_decay = 0.1, .update_after_step = 2, .use_warmup = true, .warmup_power = 0.75});
  require_counts(replay(*dir, sources, ema, true, no_counters, kLerp), *dir);
}

TEST_CASE("timm ModelEmaV3: no warmup, exclude_buffers, step passed", "[conformance][timm]") {
  const auto dir = scenario_dir("timm_peer", "no_warmup_exclude_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::timm_model_ema_v3(sources, {.decay = 0.95, .update_after_step = 3, .exclude_buffers = true});
  require_counts(replay(*dir, sources, ema, true, no_counters, kLerp), *dir);
}

TEST_CASE("timm ModelEmaV3: update without a step is FixedEma", "[conformance][timm]") {
  const auto dir = scenario_dir("timm_peer", "no_step");
  if (!dir) return;
  auto sources = sources_from(*dir);
  // coming-from-python.md's row: _foreach_lerp_'s arithmetic too (with emakit's two-rounding lerp
  // this replay measured 1 ulp)
  emakit::FixedEma ema(sources, emakit::Fixed(0.9), {},
                       emakit::EmaOptions().keep_model_dtype(true).arithmetic(emakit::Arithmetic::fused_lerp));
  require_counts(replay(*dir, sources, ema, false, no_counters, kLerp), *dir);
}

TEST_CASE("AveragedModel with get_ema_multi_avg_fn and use_buffers", "[conformance][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "ema_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_ema(sources, {.decay = 0.9, .use_buffers = true});
  const auto r = replay(*dir, sources, ema, false, averaged_model_counters, kLerp, /*peer_averages_integers=*/true);
  require_counts(r, *dir);
  // AveragedModel averages num_batches_tracked in integer arithmetic (the result truncates, so
  // the count stays at its first copy); emakit copies integers. The only difference allowed:
  for (const auto& name : r.integer_differences) CHECK(name == "bn.num_batches_tracked");
}

TEST_CASE("AveragedModel EMA without buffers, with skipped steps", "[conformance][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "ema_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_ema(sources, {.decay = 0.95, .use_buffers = false});
  require_counts(replay(*dir, sources, ema, false, averaged_model_counters, kLerp), *dir);
}

TEST_CASE("AveragedModel SWA (equal-weight mean) without buffers", "[conformance][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "swa_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_swa(sources, {.use_buffers = false});
  require_counts(replay(*dir, sources, ema, false, averaged_model_counters, kSwa), *dir);
}

// luxonis-train and nvalchemi-toolkit: test_seed_packages.cpp.

}  // namespace test_peers
