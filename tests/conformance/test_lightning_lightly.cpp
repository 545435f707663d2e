// Conformance with Lightning's EMAWeightAveraging (in a real Lightning fit) and lightly's momentum
// teacher (cosine_schedule + update_momentum on a BYOL pair, and DINO's cosine_scheduler). Data:
// tests/conformance/lightning_peer.py and lightly_peer.py, run in the seed venv
// (EMAKIT_SEED_PACKAGES=1 ./scripts/test.sh), or, by default, the recorded fixtures in
// tests/conformance/fixtures/ (package versions and the regenerating command beside them).
//
// Tolerances (replay.hpp: every update starts from the peer's previous state, so the bounds are
// for one update). Neither peer lerps: Lightning's avg_fn (get_ema_avg_fn) is
// decay * e + (1 - decay) * x, lightly's update_momentum _foreach_mul_(e, m) then
// _foreach_add_(e, x, alpha=1 - m), DINO's e.mul_(m).add_((1 - m) * x): all three round
// p1 = fl(d_f e), p2 = fl(w_f x) (or fuse it into the add) and fl(p1 + p2), with d_f = float(d)
// and w_f = float(1 - d) rounded apart (d_f + w_f is not 1). emakit runs e + w_f * fl(x - e)
// with the same w_f. In ulps of float32 at M = max(|e|, |x|, |peer's result|) elementwise
// (ulp(M) > 2^-24 M), for d in [1/2, 1] and w = 1 - d:
//   the peer: d_f's rounding |d_f - d| <= 2^-25 moves d e by < 0.5 ulp(M); p1 0.5; w_f's relative
//     rounding 2^-24 moves w x by < w ulp(M); p2 0.5 ulp(w x) < w ulp(M); the sum 0.5: 1.5 + 2w.
//   emakit: fl(x - e) (|x - e| <= 2M) 0.5 ulp(2M) = ulp(M), times w; w_f's rounding on
//     |x - e| <= 2M: < 2w ulp(M); the product's rounding < 2w ulp(M); the add 0.5: 0.5 + 5w.
//   So |emakit - peer| <= 2 + 7w ulps (avg_fn_ulps below): 2.007 at Lightning's default 0.999,
//   2.7 at 0.9, 3.4 at 0.8; 2.028 for lightly's 0.996 -> 1, 2.7 for 0.9 -> 0.99.
//   Copies (the first update, use_buffers=False buffers, the teacher's untouched buffers, the
//   average copied into the model at the end, the checkpoint's tensors) and counters: exact.
//
// The momentum m per step: emakit's CosineMomentum and lightly's cosine_schedule compute the same
// double formula, end - (end - start) * (cos(pi k / K') + 1) / 2; DINO's array
// final + 0.5 (base - final)(1 + cos(pi k / K)) rounds the same way (0.5 * (base - final) is exact,
// one product rounded, then end - t: negation commutes with rounding to nearest). The one
// operation that can differ is cos (numpy's float64 cos, where it ran, against this machine's
// libm) and the argument's rounding; their differences move t = (end - start)(c + 1)/2 by far
// less than one ulp of m, and the final subtraction rounds to nearest on both sides, so the m
// compared are within 1 ulp of double. Asserted: <= 1 ulp for every step, bitwise where both
// return `end` by their branch (k >= K' on both sides); the number of bitwise steps is printed.
//
// Differences by design, asserted here (README "Coming from Python"):
//   - EMAWeightAveraging (use_buffers=True, its default) averages num_batches_tracked through
//     the per-tensor avg_fn: decay * n + (1 - decay) * m is a float32 tensor and copy_ into the
//     long buffer truncates it (with decay 0.999 it stays at its first copy). emakit copies
//     integer tensors at each update. Both are asserted exactly: emakit's value is the model's at
//     its last update, the peer's is the float32 formula truncated (computed here with ATen).
#include "replay.hpp"

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cmath>

namespace test_lightning_lightly {  // this file's names (unity batches: tests/CMakeLists.txt)

using namespace emakit_conformance;

namespace {

using Net = CommonNet;  // _common.Net's tensors (LitNet in lightning_peer.py holds the same; replay.hpp)

// The bound derived at the top of the file, for decays d >= min_decay >= 1/2.
double avg_fn_ulps(double min_decay) {
  REQUIRE(min_decay >= 0.5);
  return 2.0 + 7.0 * (1.0 - min_decay);
}

std::int64_t counter(const Dict& rec, const std::string& name) {
  return rec.at("counter." + name).item<std::int64_t>();
}

// The model's tensors as replay()'s sources: the record's values are copied into the module.
std::vector<emakit::SourceTensor> aliases_of(torch::nn::Module& m) {
  std::vector<emakit::SourceTensor> out;
  for (auto& p : m.named_parameters()) out.push_back({p.key(), p.value(), false});
  for (auto& b : m.named_buffers()) out.push_back({b.key(), b.value(), true});
  return out;
}

// ---- Lightning -------------------------------------------------------------------------------

struct LightningReplay {
  Tally tally;
  int integer_checks = 0;                     // integer tensors checked (emakit's and the peer's value, exactly)
  int peer_truncations = 0;                   // of which the peer's value was its avg_fn's truncated float32 average
  std::set<std::string> integer_differences;  // integer tensors where the peer's value differs from emakit's
  int checkpoint_compared = 0, end_compared = 0;
};

// Replays a Lightning fit of lightning_peer.py through emakit::lightning_ema_weight_averaging,
// one update() per optimizer step (Lightning's global_step), then the checkpoint saved at the
// last epoch's end and the average copied into the model at the end.
LightningReplay replay_lightning(const fs::path& dir, const emakit::LightningEmaWeightAveragingOptions& o) {
  LightningReplay r;
  const double bound = avg_fn_ulps(o.decay);
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  const Dict first = load_dict(dir / "step_0000.pt");
  Net net;
  load_into(*net, first, "source.");
  auto ema = emakit::lightning_ema_weight_averaging(*net, o);
  Dict previous, last_update = first;
  std::int64_t last_update_step = 0;
  for (std::int64_t step = 1; step <= steps; ++step) {
    INFO("optimizer step " << step);
    const Dict rec = load_dict(step_file(dir, "step", step));
    load_into(*net, rec, "source.");
    const emakit::StateDict held = ema.averages();
    start_from(held, previous);
    const auto before = clone_all(held);
    const auto updates_before = ema.num_updates();
    ema.update();
    const bool updated = ema.num_updates() != updates_before;
    CHECK(ema.num_updates() == counter(rec, "n_averaged"));
    CHECK(ema.step() == counter(rec, "global_step"));
    if (updated) {
      last_update = rec;
      last_update_step = step;
    }
    CHECK(counter(rec, "latest_update_step") == last_update_step);
    for (const auto& [key, peer] : rec) {
      if (key.rfind("peer.", 0) != 0) continue;
      const std::string name = key.substr(5);
      const std::string what = fmt::format("{} at step {}", name, step);
      INFO(what);
      const at::Tensor* ours = held.find(name);
      REQUIRE(ours != nullptr);  // every tensor is held: averaged, or copied (use_buffers=False)
      if (peer.is_floating_point()) {
        check_tensor(r.tally, what, *ours, peer, update_operands(name, rec, previous, before), bound);
        continue;
      }
      ++r.tally.compared;
      ++r.tally.bitwise;
      ++r.integer_checks;
      // emakit copies an integer tensor at each update (before the first: its construction copy).
      CHECK(torch::equal(*ours, last_update.at("source." + name)));
      // The peer: unchanged without an update; copied at its first update and, with
      // use_buffers=False, at every update; else avg_fn in float32, truncated by copy_.
      const at::Tensor peer_before = previous.empty() ? first.at("source." + name) : previous.at(key);
      const at::Tensor& source = rec.at("source." + name);
      at::Tensor expected = peer_before;
      if (updated && (updates_before == 0 || !o.use_buffers)) {
        expected = source;
      } else if (updated) {
        const at::Tensor average = peer_before.mul(o.decay).add(source.mul(1.0 - o.decay));
        REQUIRE(average.scalar_type() == at::kFloat);  // Python: long tensor * float -> float32
        expected = average.to(peer.scalar_type());     // copy_ into the long tensor truncates
        ++r.peer_truncations;
      }
      CHECK(torch::equal(peer, expected));
      if (!torch::equal(peer, *ours)) r.integer_differences.insert(name);
    }
    previous = rec;
  }
  std::cout << dir.filename().string() << " (preset): " << steps << " optimizer steps, " << r.tally.summary(bound)
            << "; integers: " << r.integer_checks << " checked, " << r.peer_truncations
            << " peer truncations, different in " << r.integer_differences.size() << " tensors\n";

  // The checkpoint trainer.save_checkpoint wrote at the last epoch's end (after the last step):
  // state_dict holds the average, current_model_state the model, averaging_state n_averaged, the
  // callback's entry latest_update_step. The same names as emakit's averages.
  const Dict cp = load_dict(dir / "checkpoint.pt");
  const emakit::StateDict averages = ema.averages();
  std::set<std::string> cp_names;
  for (const auto& [key, value] : cp) {
    INFO("checkpoint " << key);
    if (key.rfind("state_dict.", 0) == 0) {
      cp_names.insert(key.substr(11));
      ++r.checkpoint_compared;
      CHECK(torch::equal(value, previous.at("peer." + key.substr(11))));
    } else if (key.rfind("current_model_state.", 0) == 0) {
      ++r.checkpoint_compared;
      CHECK(torch::equal(value, previous.at("source." + key.substr(20))));
    }
  }
  std::set<std::string> our_names;
  for (const auto& item : averages) our_names.insert(item.key());
  CHECK(cp_names == our_names);
  CHECK(cp.at("averaging_state.n_averaged").item<std::int64_t>() == ema.num_updates());
  CHECK(cp.at("callback.latest_update_step").item<std::int64_t>() == last_update_step);
  CHECK(cp.at("global_step").item<std::int64_t>() == steps);
  std::ifstream structure(dir / "checkpoint_structure.txt");
  const std::string text((std::istreambuf_iterator<char>(structure)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("averaging_state: n_averaged\n") &&
                       Catch::Contains("callbacks: EMAWeightAveraging -> ['latest_update_step']\n") &&
                       Catch::Contains("checkpoint: averaging_state, callbacks, current_model_state,"));

  // on_train_end: the callback copies the average into the model; emakit's copy_to copies its own.
  const Dict end = load_dict(dir / "end.pt");
  ema.copy_to(*net);
  const auto model = tensors_of(*net);
  for (const auto& [key, value] : end) {
    const std::string name = key.substr(4);
    INFO("end " << name);
    ++r.end_compared;
    CHECK(torch::equal(value, previous.at("peer." + name)));    // Lightning: a copy of its average
    CHECK(torch::equal(model.at(name), *averages.find(name)));  // emakit: a copy of its own
  }
  return r;
}

void require_lightning_counts(const LightningReplay& r, const fs::path& dir) {
  REQUIRE(r.tally.compared == count_keys(dir, "peer."));
  REQUIRE(r.tally.compared == model_tensors(dir) * load_dict(dir / "meta.pt").at("steps").item<std::int64_t>());
  REQUIRE(r.checkpoint_compared == 2 * model_tensors(dir));
  REQUIRE(r.end_compared == model_tensors(dir));
}

// ---- lightly ---------------------------------------------------------------------------------

struct MomentumTally {
  int compared = 0, bitwise = 0, at_end = 0, warned = 0;
  double max_ulps = 0;
};

// Replays a lightly_peer.py scenario through emakit::cosine_momentum_teacher: the teacher's
// parameters within the bound, its buffers untouched (emakit holds none: lightly updates
// parameters only), and m per step against emakit's decay.
Replay replay_teacher(const fs::path& dir, emakit::CosineEnd endpoint, MomentumTally& m) {
  const Dict meta = load_dict(dir / "meta.pt");
  const double start = meta.at("start").item<double>(), end = meta.at("end").item<double>();
  const auto total = meta.at("max_steps").item<std::int64_t>();
  const std::int64_t last_k = endpoint == emakit::CosineEnd::at_last_step ? total - 1 : total;  // K'
  Net net;
  load_into(*net, load_dict(dir / "step_0000.pt"), "source.");
  auto ema =
      emakit::cosine_momentum_teacher(*net, {.start = start, .end = end, .total_steps = total, .endpoint = endpoint});
  std::int64_t parameters = 0;
  for (const auto& p : net->named_parameters()) parameters += ema.averages().find(p.key()) != nullptr;
  CHECK(parameters == static_cast<std::int64_t>(net->parameters().size()));
  CHECK(ema.averages().size() == net->parameters().size());  // parameters only
  auto sources = aliases_of(*net);
  const auto r = replay(
      dir, sources, ema, /*pass_step=*/false,
      [&](const auto& e, const Dict& rec) {
        const auto k = counter(rec, "k");
        const double peer_m = rec.at("counter.m").item<double>();
        INFO("k " << k << ": lightly m " << fmt::format("{:.17g}", peer_m) << ", emakit "
                  << fmt::format("{:.17g}", e.decay()));
        CHECK(e.num_updates() == k + 1);  // every update averages; step k + 1 is lightly's k
        ++m.compared;
        const double u = std::abs(e.decay() - peer_m) / emakit_test::ulp_of(std::max(peer_m, e.decay()), at::kDouble);
        m.max_ulps = std::max(m.max_ulps, u);
        m.bitwise += e.decay() == peer_m;
        CHECK(u <= 1.0);
        if (k >= last_k) {  // both return `end` by their branch
          ++m.at_end;
          CHECK(e.decay() == end);
          CHECK(peer_m == end);
        }
        m.warned += counter(rec, "warned");
        CHECK((counter(rec, "warned") != 0) == (k > total));  // lightly warns past max_steps
      },
      avg_fn_ulps(std::min(start, end)));
  std::cout << dir.filename().string() << ": m at " << m.compared << " steps, " << m.bitwise << " bitwise, max "
            << fmt::format("{:g}", m.max_ulps) << " ulps of double; " << m.at_end << " at `end` by the branch\n";
  return r;
}

}  // namespace

TEST_CASE("lightning EMAWeightAveraging: update_every_n_steps=3 from step 4, buffers copied (preset)",
          "[conformance][lightning]") {
  const auto dir = scenario_dir("lightning_peer", "every3_from4");
  if (!dir) return;
  const auto r = replay_lightning(
      *dir, {.decay = 0.9, .use_buffers = false, .update_every_n_steps = 3, .update_starting_at_step = 4});
  require_lightning_counts(r, *dir);
  // 16 steps, updates at step_idx 6, 9, 12, 15 (the first a copy); integers copied on both sides.
  CHECK(load_dict(step_file(*dir, "step", 16)).at("counter.n_averaged").item<std::int64_t>() == 4);
  CHECK(r.peer_truncations == 0);
  CHECK(r.integer_differences.empty());
}

TEST_CASE("lightning EMAWeightAveraging: the defaults, num_batches_tracked truncated by the peer, copied by emakit",
          "[conformance][lightning]") {
  const auto dir = scenario_dir("lightning_peer", "defaults");
  if (!dir) return;
  const auto r = replay_lightning(*dir, {});
  require_lightning_counts(r, *dir);
  // Every step updates; the 9 after the first copy average num_batches_tracked: 0.999 * 1 +
  // 0.001 * n truncates to 1, while emakit's is the model's n.
  CHECK(r.integer_checks == 10);
  CHECK(r.peer_truncations == 9);
  CHECK(r.integer_differences == std::set<std::string>{"bn.num_batches_tracked"});
  const Dict last = load_dict(step_file(*dir, "step", 10));
  CHECK(last.at("peer.bn.num_batches_tracked").item<std::int64_t>() == 1);
  CHECK(last.at("source.bn.num_batches_tracked").item<std::int64_t>() == 10);
}

TEST_CASE("lightning EMAWeightAveraging: accumulate_grad_batches=2, one update() per optimizer step",
          "[conformance][lightning]") {
  const auto dir = scenario_dir("lightning_peer", "accumulate2_buffers");
  if (!dir) return;
  const Dict meta = load_dict(*dir / "meta.pt");
  REQUIRE(meta.at("accumulate").item<std::int64_t>() == 2);
  // 3 epochs of 6 batches: 9 optimizer steps (global_step), one record each.
  REQUIRE(meta.at("steps").item<std::int64_t>() == 9);
  const auto r = replay_lightning(*dir, {.decay = 0.8, .update_every_n_steps = 2, .update_starting_at_step = 1});
  require_lightning_counts(r, *dir);
  // Updates at step_idx 2, 4, 6, 8 (steps 3, 5, 7, 9; the first a copy): num_batches_tracked
  // (two forward passes per step) 6, then 0.8 * 6 + 0.2 * 10 = 6.8 -> 6, 0.8 * 6 + 0.2 * 14 =
  // 7.6 -> 7, 0.8 * 7 + 0.2 * 18 = 9.2 -> 9 on the peer; 6, 10, 14, 18 in emakit.
  CHECK(r.peer_truncations == 3);
  std::vector<std::int64_t> peer, ours;
  for (std::int64_t step : {3, 5, 7, 9}) {
    const Dict rec = load_dict(step_file(*dir, "step", step));
    peer.push_back(rec.at("peer.bn.num_batches_tracked").item<std::int64_t>());
    ours.push_back(rec.at("source.bn.num_batches_tracked").item<std::int64_t>());
  }
  CHECK(peer == std::vector<std::int64_t>{6, 6, 7, 9});
  CHECK(ours == std::vector<std::int64_t>{6, 10, 14, 18});
  CHECK(r.integer_differences == std::set<std::string>{"bn.num_batches_tracked"});
}

TEST_CASE("lightly cosine_schedule and update_momentum: BYOL teacher, past max_steps", "[conformance][lightly]") {
  const auto dir = scenario_dir("lightly_peer", "byol_cosine");
  if (!dir) return;
  MomentumTally m;
  const auto r = replay_teacher(*dir, emakit::CosineEnd::at_last_step, m);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
  REQUIRE(m.compared == 34);
  CHECK(m.at_end == 5);  // k = 29 .. 33: K' = K - 1 = 29
  CHECK(m.warned == 3);  // k = 31 .. 33
}

TEST_CASE("lightly cosine_schedule and update_momentum: other start and end", "[conformance][lightly]") {
  const auto dir = scenario_dir("lightly_peer", "cosine_other_ends");
  if (!dir) return;
  MomentumTally m;
  const auto r = replay_teacher(*dir, emakit::CosineEnd::at_last_step, m);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
  REQUIRE(m.compared == 22);
  CHECK(m.at_end == 3);  // k = 19 .. 21
  CHECK(m.warned == 1);  // k = 21
}

TEST_CASE("DINO cosine_scheduler momentum (K' = K, lightly_peer.py): CosineEnd::after_last_step",
          "[conformance][lightly]") {
  const auto dir = scenario_dir("lightly_peer", "dino_cosine");
  if (!dir) return;
  MomentumTally m;
  const auto r = replay_teacher(*dir, emakit::CosineEnd::after_last_step, m);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
  REQUIRE(m.compared == 30);
  CHECK(m.at_end == 0);  // DINO's array ends at k = K - 1 < K'
  // The last step is below `end`, unlike lightly's at K - 1: K' = K, not K - 1.
  CHECK(load_dict(step_file(*dir, "step", 30)).at("counter.m").item<double>() < 1.0);
}

}  // namespace test_lightning_lightly
