// Conformance: the emakit presets replay the trajectories that the real Python packages
// (ema-pytorch, timm, torch's AveragedModel) went through, and must end up with the same averaged
// tensors and counters at every step. The data comes from tests/conformance/*_peer.py (run by
// ctest before these tests); without it a test prints SKIPPED and ctest counts it as skipped.
//
// Tolerance, per peer (measured figures in the README's conformance section):
//   every peer: |emakit - peer| <= 1e-6 * max(1, |peer|) for float32. Not bitwise: PyTorch's CPU
//   lerp kernels use fused multiply-add where emakit's portable pass does a multiply and an add
//   (unless compiled with FMA), so single updates differ by up to one ulp.
//   Copies, copy-only tensors and counters: bitwise / exact.
#include "replay.hpp"

using namespace emakit_conformance;

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
  replay(*dir, sources, ema, false, ema_pytorch_counters);
}

TEST_CASE("ema-pytorch EMA: defaults, with steps the trainer skipped", "[conformance][ema-pytorch]") {
  const auto dir = scenario_dir("ema_pytorch_peer", "defaults_with_skips");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::ema_pytorch(sources);
  replay(*dir, sources, ema, false, ema_pytorch_counters);
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
    replay(*dir, sources, ema, false, ema_pytorch_counters);
  }
}

TEST_CASE("timm ModelEmaV3: warmup with min_decay and update_after_step, step passed", "[conformance][timm]") {
  const auto dir = scenario_dir("timm_peer", "warmup_with_step");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::timm_model_ema_v3(
      sources, {.decay = 0.99, .min_decay = 0.1, .update_after_step = 2, .use_warmup = true, .warmup_power = 0.75});
  replay(*dir, sources, ema, true, no_counters);
}

TEST_CASE("timm ModelEmaV3: no warmup, exclude_buffers, step passed", "[conformance][timm]") {
  const auto dir = scenario_dir("timm_peer", "no_warmup_exclude_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::timm_model_ema_v3(sources, {.decay = 0.95, .update_after_step = 3, .exclude_buffers = true});
  replay(*dir, sources, ema, true, no_counters);
}

TEST_CASE("timm ModelEmaV3: update without a step is FixedEma", "[conformance][timm]") {
  const auto dir = scenario_dir("timm_peer", "no_step");
  if (!dir) return;
  auto sources = sources_from(*dir);
  emakit::FixedEma ema(sources, emakit::Fixed(0.9), {}, emakit::EmaOptions().keep_model_dtype(true));
  replay(*dir, sources, ema, false, no_counters);
}

TEST_CASE("AveragedModel with get_ema_multi_avg_fn and use_buffers", "[conformance][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "ema_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_ema(sources, {.decay = 0.9, .use_buffers = true});
  const auto r = replay(*dir, sources, ema, false, averaged_model_counters, /*peer_averages_integers=*/true);
  // AveragedModel averages num_batches_tracked in integer arithmetic (the result truncates, so
  // the count stays at its first copy); emakit copies integers. The only difference allowed:
  for (const auto& name : r.integer_differences) CHECK(name == "bn.num_batches_tracked");
}

TEST_CASE("AveragedModel EMA without buffers, with skipped steps", "[conformance][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "ema_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_ema(sources, {.decay = 0.95, .use_buffers = false});
  replay(*dir, sources, ema, false, averaged_model_counters);
}

TEST_CASE("AveragedModel SWA (equal-weight mean) without buffers", "[conformance][averaged-model]") {
  const auto dir = scenario_dir("averaged_model_peer", "swa_no_buffers");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::averaged_model_swa(sources, {.use_buffers = false});
  replay(*dir, sources, ema, false, averaged_model_counters);
}

// luxonis-train and nvalchemi-toolkit: test_seed_packages.cpp.
