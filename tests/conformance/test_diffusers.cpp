// Conformance: emakit::diffusers_ema_model / diffusers_ema_model_warmup replay the trajectories
// that diffusers' EMAModel went through (tests/conformance/diffusers_peer.py, run by ctest before
// these tests): the same shadow parameters (diffusers holds parameters only), the same counters
// (optimization_step is emakit's step and num_updates: every step() averages, d = 0 included), and
// the same decay, bitwise.
//
// Tolerance (replay.hpp: each update starts from the peer's previous state, so the bound is for
// one update; ulps of float32 at M = max(|a|, |x|, |result|) elementwise, a the shadow before, x
// the parameter, w = 1 - d the same float on both sides: 1 - d in double, rounded once):
//   diffusers computes a - w*(a - x), not a lerp: D = fl(a - x) (|D| <= 2M, so its rounding error
//   e0 <= 0.5 ulp(2M) = 1 ulp(M)), then fl(w*D) (foreach=False; e1 <= 0.5 ulp(w*D)) or a fused
//   a - w*D (foreach=True's sub_ with alpha; e1 = 0), then the last rounding (0.5 ulp(M)).
//   emakit runs ATen's lerp (detail/simd.hpp) on fl(x - a) = -D exactly (rounding is symmetric):
//   - w < 0.5: a + w*(-D), the product's rounding e2 <= 0.5 ulp(w*D) <= 0.5 ulp(M) (|w*D| <= M),
//     then the last rounding: exact values before the last roundings differ by e1 + e2 <= 1 ulp,
//     plus the two last roundings: 2 ulps;
//   - w >= 0.5: x + (w-1)*(-D) (w-1 exact), which is a + w*(x-a) only up to -D's rounding error:
//     e0 (1 ulp) + the product's rounding (0.5 ulp: |(1-w) D| <= M) + e1 (0.5 ulp(w*D) <= 1 ulp
//     at |w*D| <= 2M), plus the two last roundings (1 ulp): 3.5 ulps.
//   kDiffusers = 3.5 ulps covers both. The foreach scenarios run the preset with foreach = true
//   (Arithmetic::fused_subtract, diffusers' fused form: 0 on a CPU whose ATen fuses, which
//   test_free_running.cpp requires over a whole run; the bound stays for one that does not). Copies (a frozen
//   parameter, which diffusers copy_()s) and counters: bitwise / exact.
#include "replay.hpp"

#include <bit>
#include <string_view>

namespace test_diffusers {  // this file's names (unity batches: tests/CMakeLists.txt)

using namespace emakit_conformance;

namespace {
constexpr double kDiffusers = 3.5;

// _common.Net's parameters (lin, conv and bn weight and bias, emb.weight): what EMAModel holds.
constexpr int kParameters = 7;

// The model's tensors as EMAModel(model.parameters()) saw them: parameters require grad, except
// the `frozen` ones (and the buffers, which the presets ignore).
std::vector<emakit::SourceTensor> parameters_of(const fs::path& dir, const std::set<std::string>& frozen = {}) {
  auto sources = sources_from(dir);
  int frozen_seen = 0;
  for (auto& s : sources) {
    if (s.is_buffer) continue;
    const bool is_frozen = frozen.count(s.name) > 0;
    frozen_seen += is_frozen ? 1 : 0;
    s.tensor.set_requires_grad(!is_frozen);
  }
  REQUIRE(frozen_seen == static_cast<int>(frozen.size()));
  return sources;
}

// diffusers' cur_decay_value after step K (its float64 bits, -1 before the first step()).
std::optional<double> peer_decay(const Dict& rec) {
  const auto bits = rec.at("counter.decay_bits").item<std::int64_t>();
  if (bits < 0) return std::nullopt;
  return std::bit_cast<double>(bits);
}

auto diffusers_counters = [](const auto& ema, const Dict& rec) {
  const auto optimization_step = rec.at("counter.optimization_step").item<std::int64_t>();
  CHECK(ema.step() == optimization_step);
  CHECK(ema.num_updates() == optimization_step);  // every step() is an update (d = 0 averages with w = 1)
  const auto d = peer_decay(rec);
  REQUIRE(d.has_value() == (optimization_step > 0));
  // The weight that both applied, bitwise: diffusers' one_minus_decay = 1 - d (double). emakit
  // keeps 1 - w as its decay(), which is d itself only where 1 - d is exact (d >= 0.5).
  if (d) CHECK(1.0 - ema.decay() == 1.0 - *d);
  if (d && *d >= 0.5) CHECK(ema.decay() == *d);
};

// The replay compared each shadow diffusers recorded at every step (`per_step` names: kParameters,
// one more where a tied weight is recorded under its second name), and every step ran.
void require_counts(const Replay& r, const fs::path& dir, int per_step) {
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  REQUIRE(r.steps == steps);
  REQUIRE(r.compared == expected_comparisons(dir));
  REQUIRE(count_keys(dir, "peer.") == per_step * steps);
  REQUIRE(r.compared == per_step * steps);
}

// The steps of `dir` at which the trainer called step().
int called_steps(const fs::path& dir) {
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  int n = 0;
  for (std::int64_t k = 1; k <= steps; ++k) n += load_dict(step_file(dir, "step", k)).at("called").item<std::int64_t>();
  return n;
}

// get_decay(optimization_step) as diffusers recorded it, against the preset's decay policy at the
// same step, bitwise (both double); returns the number of steps compared.
template <class Policy>
int check_decay_policy(const fs::path& dir, const Policy& policy) {
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  int compared = 0;
  for (std::int64_t k = 1; k <= steps; ++k) {
    const Dict rec = load_dict(step_file(dir, "step", k));
    if (rec.at("called").item<std::int64_t>() == 0) continue;
    const auto optimization_step = rec.at("counter.optimization_step").item<std::int64_t>();
    const auto d = peer_decay(rec);
    REQUIRE(d.has_value());
    const double ours = policy.decay(emakit::DecayInput{optimization_step, optimization_step, 1});
    INFO(dir.filename().string() << " optimization_step " << optimization_step << ": diffusers "
                                 << fmt::format("{:.17g}", *d) << ", emakit " << fmt::format("{:.17g}", ours));
    CHECK(std::bit_cast<std::uint64_t>(ours) == std::bit_cast<std::uint64_t>(*d));
    ++compared;
  }
  return compared;
}
}  // namespace

TEST_CASE("diffusers EMAModel: the TF ramp with every default", "[conformance][diffusers]") {
  const auto dir = scenario_dir("diffusers_peer", "ramp_defaults");
  if (!dir) return;
  auto sources = parameters_of(*dir);
  auto ema = emakit::diffusers_ema_model(sources);
  REQUIRE(ema.frozen_parameters().empty());
  require_counts(replay(*dir, sources, ema, false, diffusers_counters, kDiffusers), *dir, kParameters);
  REQUIRE(ema.averages().size() == static_cast<std::size_t>(kParameters));  // parameters only
}

TEST_CASE("diffusers EMAModel: foreach, the ramp reaching decay, trainer steps without step()",
          "[conformance][diffusers]") {
  const auto dir = scenario_dir("diffusers_peer", "ramp_foreach_with_skips");
  if (!dir) return;
  auto sources = parameters_of(*dir);
  auto ema = emakit::diffusers_ema_model(sources, {.decay = 0.9, .foreach = true});
  require_counts(replay(*dir, sources, ema, false, diffusers_counters, kDiffusers), *dir, kParameters);
  REQUIRE(ema.step() == 100 - 4);  // 4 trainer steps did not call step()
  REQUIRE(ema.decay() == 0.9);     // the ramp reached decay at step 82
}

TEST_CASE("diffusers EMAModel: min_decay with update_after_step", "[conformance][diffusers]") {
  const auto dir = scenario_dir("diffusers_peer", "min_decay_after_step");
  if (!dir) return;
  auto sources = parameters_of(*dir);
  auto ema = emakit::diffusers_ema_model(sources, {.decay = 0.95, .min_decay = 0.5, .update_after_step = 5});
  require_counts(replay(*dir, sources, ema, false, diffusers_counters, kDiffusers), *dir, kParameters);
}

TEST_CASE("diffusers EMAModel: use_ema_warmup with inv_gamma and power, foreach and not", "[conformance][diffusers]") {
  for (const char* scenario : {"warmup", "warmup_foreach"}) {
    const auto dir = scenario_dir("diffusers_peer", scenario);
    if (!dir) return;
    auto sources = parameters_of(*dir);
    const bool foreach = std::string_view(scenario).ends_with("_foreach");
    auto ema = emakit::diffusers_ema_model_warmup(sources, {.decay = 0.99,
                                                            .update_after_step = 2,
                                                            .use_ema_warmup = true,
                                                            .inv_gamma = 2.0,
                                                            .power = 0.75,
                                                            .foreach = foreach});
    require_counts(replay(*dir, sources, ema, false, diffusers_counters, kDiffusers), *dir, kParameters);
  }
}

TEST_CASE("diffusers EMAModel: a frozen parameter is copied, not averaged, foreach and not",
          "[conformance][diffusers]") {
  for (const char* scenario : {"frozen", "frozen_foreach"}) {
    const auto dir = scenario_dir("diffusers_peer", scenario);
    if (!dir) return;
    auto sources = parameters_of(*dir, {"lin.bias"});
    auto ema = emakit::diffusers_ema_model(sources,
                                           {.decay = 0.9, .foreach = std::string_view(scenario).ends_with("_foreach")});
    const auto r = replay(*dir, sources, ema, false, diffusers_counters, kDiffusers);
    require_counts(r, *dir, kParameters);
    REQUIRE(ema.frozen_parameters() == std::vector<std::string>{"lin.bias"});  // decided at bind
    // lin.bias, moved by every trainer step, was diffusers' copy at each of the 30 steps, and a
    // bitwise one on emakit's side (replay.hpp's check_tensor): at least those 30 comparisons.
    REQUIRE(r.bitwise >= 30);
    const Dict last = load_dict(step_file(*dir, "step", 30));
    REQUIRE(torch::equal(ema.average("lin.bias"), last.at("peer.lin.bias")));
    REQUIRE(torch::equal(ema.average("lin.bias"), last.at("source.lin.bias")));
    REQUIRE_FALSE(torch::equal(ema.average("lin.weight"), last.at("source.lin.weight")));  // averaged
  }
}

TEST_CASE("diffusers EMAModel: a head tied to the embedding is one shadow, averaged once", "[conformance][diffusers]") {
  const auto dir = scenario_dir("diffusers_peer", "tied");
  if (!dir) return;
  auto sources = parameters_of(*dir);
  // The head's weight is the embedding's tensor, as in the Python model (head.weight = emb.weight).
  const auto emb = std::find_if(sources.begin(), sources.end(), [](const auto& s) { return s.name == "emb.weight"; });
  const auto head = std::find_if(sources.begin(), sources.end(), [](const auto& s) { return s.name == "head.weight"; });
  REQUIRE(emb != sources.end());
  REQUIRE(head != sources.end());
  head->tensor = emb->tensor;
  auto ema = emakit::diffusers_ema_model(sources, {.decay = 0.9});
  // Both names recorded at each step: averaging the tie twice per step would miss by far more than
  // kDiffusers at every step; two averages would fail the identity below.
  require_counts(replay(*dir, sources, ema, false, diffusers_counters, kDiffusers), *dir, kParameters + 1);
  const auto held = ema.averages();
  REQUIRE(held.size() == static_cast<std::size_t>(kParameters + 1));
  REQUIRE(held.find("head.weight") != nullptr);
  REQUIRE(held.find("head.weight")->unsafeGetTensorImpl() == held.find("emb.weight")->unsafeGetTensorImpl());
}

TEST_CASE("diffusers EMAModel: get_decay per step equals the presets' decay policies bitwise",
          "[conformance][diffusers]") {
  struct Case {
    const char* scenario;
    emakit::DiffusersEmaModelOptions options;
  };
  const Case ramps[] = {{"ramp_defaults", {}},
                        {"ramp_foreach_with_skips", {.decay = 0.9}},
                        {"min_decay_after_step", {.decay = 0.95, .min_decay = 0.5, .update_after_step = 5}},
                        {"frozen", {.decay = 0.9}},
                        {"tied", {.decay = 0.9}}};
  int compared = 0, expected = 0;
  for (const auto& c : ramps) {
    const auto dir = scenario_dir("diffusers_peer", c.scenario);
    if (!dir) return;
    auto sources = parameters_of(*dir);
    compared += check_decay_policy(*dir, emakit::diffusers_ema_model(sources, c.options).decay_policy());
    expected += called_steps(*dir);
  }
  const auto dir = scenario_dir("diffusers_peer", "warmup");
  if (!dir) return;
  auto sources = parameters_of(*dir);
  const emakit::DiffusersEmaModelOptions warmup{
      .decay = 0.99, .update_after_step = 2, .use_ema_warmup = true, .inv_gamma = 2.0, .power = 0.75};
  compared += check_decay_policy(*dir, emakit::diffusers_ema_model_warmup(sources, warmup).decay_policy());
  expected += called_steps(*dir);
  // 60 + 96 + 40 + 30 + 30 ramp steps, 50 warmup steps.
  REQUIRE(expected == 306);
  REQUIRE(compared == expected);
}

TEST_CASE("RationalRamp: the reference values, as diffusers' get_decay computes them", "[conformance][diffusers]") {
  // (1 + t) / (10 + t) in double, t = step - 1 (DESIGN.md's table); the same doubles diffusers
  // recorded (ramp_defaults) at these steps.
  const emakit::RationalRamp ramp;
  CHECK(ramp.decay({1, 1, 1}) == 0.0);
  CHECK(ramp.decay({2, 2, 1}) == 0.18181818181818182);
  CHECK(ramp.decay({11, 11, 1}) == 0.55);
  CHECK(ramp.decay({101, 101, 1}) == 0.9181818181818182);
}

}  // namespace test_diffusers
