// Conformance with Lightning's EMAWeightAveraging (in a real Lightning fit) and lightly's momentum
// teacher (cosine_schedule + update_momentum on a BYOL pair, per step and per epoch as lightly's
// BYOL example, and DINO's cosine_scheduler). Data: tests/conformance/lightning_peer.py and
// lightly_peer.py, run in the seed venv (EMAKIT_SEED_PACKAGES=1 ./scripts/test.sh), or, by default,
// the recorded fixtures in tests/conformance/fixtures/ (package versions and the regenerating
// command beside them).
//
// Tolerances (replay.hpp: every update starts from the peer's previous state, so a bound is for
// one update): 0 ulps, every averaged element bitwise. Each preset computes an element with its
// peer's own operations (EmaOptions::arithmetic), on the same float32 operands e (the average
// before, the peer's previous state) and x (the model), with the same float32 weights:
//   - Lightning (get_ema_avg_fn: decay * e + (1 - decay) * x, per tensor, Arithmetic::weighted_sum):
//     ATen's mul by a Python scalar casts it to the float32 opmath type, so D = float(decay) and
//     W = float(1 - decay) (1 - decay computed in double by Python, as emakit's w = 1 - d); then
//     fl(D e), fl(W x) (two kernels, nothing to fuse) and fl(fl(D e) + fl(W x)). emakit's
//     weighted_sum is that sequence with the same D and W, rounded the same way after each op.
//   - lightly (update_momentum: _foreach_mul_(e, m) then _foreach_add_(e, x, alpha=1 - m),
//     Arithmetic::scaled_fused_add): fl(D e), then ATen's CPU add with alpha, a + alpha * b, which
//     its vectorized kernel computes with one fused multiply-add (the fixture's CPU capability is
//     AVX512, recorded in lightly_peer.txt): fl(fma(x, W, fl(D e))). emakit: the same fma.
//   - DINO (e.mul_(m).add_((1 - m) * x)): fl(D e), fl(W x), their sum: Arithmetic::weighted_sum,
//     which the replay sets (CosineTeacherOptions::arithmetic).
// IEEE operations on equal operands give equal results, so any difference is a difference in what
// emakit computes (the weight, the branch, a copy instead of an average, a skipped or extra
// update), never rounding. Copies (the first update, use_buffers=False buffers, the teacher's
// untouched buffers, the average copied into the model at the end, the checkpoint's tensors) and
// counters: exact as well.
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
// The per-epoch scenarios (a handful of epochs, k = the epoch) also assert every m bitwise: at
// their few arguments numpy's cos and libm's agree (a libm that rounded one of them the other way
// would fail there, naming the epoch; the averages' 0 ulps need only float(m) and float(1 - m),
// which one ulp of double does not move at these m).
//
// Lightning's update_starting_at_epoch (the epoch_* scenarios): the callback's on_train_epoch_end
// updates once more from that epoch on, an update that is not an optimizer step. Replayed with
// update() after each optimizer step and epoch_end(epoch) at each epoch's end (the preset, and
// EmaHook's after_optimizer_step() / train_epoch_end() with the preset's recipe): n_averaged ==
// num_updates() and global_step == step() == calls() at every record, so the step trigger
// (update_every_n_steps, update_starting_at_step) stays Lightning's. Every scenario's replay calls
// epoch_end() at each epoch end (after the epoch's last optimizer step, the records' epoch); without
// update_starting_at_epoch it must do nothing.
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

// The bound derived at the top of the file: each preset's arithmetic is its peer's.
constexpr double peer_arithmetic_ulps = 0.0;

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

// What drives emakit in a Lightning replay: the preset itself, or an EmaHook with the preset's
// recipe (its EMA made at setup(), or lazily at its first eligible step or epoch end).
enum class Driver { preset, hook, lazy_hook };

struct LightningReplay {
  Tally tally;
  int step_records = 0, epoch_records = 0;    // records replayed (each: every tensor compared)
  int epoch_ends = 0, epoch_updates = 0;      // epoch_end() calls, and those that updated
  int integer_checks = 0;                     // integer tensors checked (emakit's and the peer's value, exactly)
  int peer_truncations = 0;                   // of which the peer's value was its avg_fn's truncated float32 average
  std::set<std::string> integer_differences;  // integer tensors where the peer's value differs from emakit's
  int checkpoint_compared = 0, end_compared = 0;
};

// One event of a fit: the optimizer step `index` (global_step), or the end of epoch `index`.
struct FitEvent {
  bool epoch_end = false;
  std::int64_t index = 0;
};

// The fit's events in order: each optimizer step, and each epoch's end after its last step (the
// step records' counter.epoch).
std::vector<FitEvent> fit_events(const fs::path& dir) {
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  std::vector<FitEvent> out;
  std::int64_t epoch = -1;
  for (std::int64_t step = 1; step <= steps; ++step) {
    const std::int64_t e = counter(load_dict(step_file(dir, "step", step)), "epoch");
    if (epoch >= 0 && e != epoch) out.push_back({true, epoch});
    REQUIRE(e >= epoch);
    epoch = e;
    out.push_back({false, step});
  }
  if (epoch >= 0) out.push_back({true, epoch});
  return out;
}

bool has_epoch_records(const fs::path& dir) { return load_dict(dir / "meta.pt").count("epoch_records") > 0; }

// Replays a Lightning fit of lightning_peer.py through emakit::lightning_ema_weight_averaging (or
// an EmaHook with its recipe): one update() per optimizer step (Lightning's global_step) and
// epoch_end(epoch) at each epoch's end, then the checkpoint saved at the last epoch's end and the
// average copied into the model at the end.
LightningReplay replay_lightning(const fs::path& dir, const emakit::LightningEmaWeightAveragingOptions& o,
                                 Driver driver = Driver::preset) {
  LightningReplay r;
  const double bound = peer_arithmetic_ulps;
  const Dict meta = load_dict(dir / "meta.pt");
  const bool epoch_records = has_epoch_records(dir);
  const Dict first = load_dict(dir / "step_0000.pt");
  Net net;
  load_into(*net, first, "source.");
  std::optional<emakit::FixedEma> preset;
  emakit::EmaHook hook;
  if (driver == Driver::preset) {
    preset.emplace(emakit::lightning_ema_weight_averaging(*net, o));
  } else {
    hook.add(
        *net, emakit::lightning_ema_weight_averaging_recipe(o),
        {.creation = driver == Driver::hook ? emakit::Creation::at_setup : emakit::Creation::at_first_eligible_step});
    hook.setup();
  }
  const auto ema = [&]() -> emakit::FixedEma* {
    if (preset) return &*preset;
    return hook.created("model") ? &hook.ema<emakit::FixedEma>("model") : nullptr;
  };
  Dict previous, last_update = first;
  std::int64_t last_step_update = 0, last_epoch_update = -1, global_step = 0;
  for (const FitEvent& event : fit_events(dir)) {
    const std::string where =
        fmt::format("{} {}", event.epoch_end ? "the end of epoch" : "optimizer step", event.index);
    INFO(where);
    std::optional<Dict> rec;
    if (!event.epoch_end) {
      rec = load_dict(step_file(dir, "step", event.index));
      global_step = event.index;
    } else if (epoch_records) {
      rec = load_dict(step_file(dir, "epoch", event.index));
      CHECK(counter(*rec, "epoch") == event.index);
      CHECK(counter(*rec, "global_step") == global_step);  // after the epoch's last optimizer step
    }
    if (rec) load_into(*net, *rec, "source.");
    std::map<std::string, at::Tensor> before;
    std::int64_t updates_before = 0;
    if (emakit::FixedEma* e = ema()) {
      start_from(e->averages(), previous);
      before = clone_all(e->averages());
      updates_before = e->num_updates();
    }
    emakit::UpdateResult result;
    if (event.epoch_end) {
      result = preset ? preset->epoch_end(event.index) : hook.train_epoch_end(event.index).at(0);
      ++r.epoch_ends;
    } else {
      result = preset ? preset->update() : hook.after_optimizer_step().at(0);
    }
    emakit::FixedEma* const e = ema();
    const std::int64_t updates = e != nullptr ? e->num_updates() : 0;
    const bool updated = updates != updates_before;
    CHECK(updated == (result.action != emakit::Action::skipped));
    CHECK(updates - updates_before == (updated ? 1 : 0));
    if (e != nullptr) {  // an epoch-end update is not a step: the counters stay Lightning's global_step
      CHECK(e->step() == global_step);
      CHECK(e->calls() == global_step);
    }
    if (updated) {
      if (rec) last_update = *rec;
      if (event.epoch_end) {
        last_epoch_update = event.index;
        ++r.epoch_updates;
      } else {
        last_step_update = event.index;
      }
    }
    if (!rec) {  // an epoch end without a record (the scenarios without update_starting_at_epoch)
      CHECK_FALSE(o.update_starting_at_epoch.has_value());
      CHECK_FALSE(updated);
      continue;
    }
    ++(event.epoch_end ? r.epoch_records : r.step_records);
    CHECK(updates == counter(*rec, "n_averaged"));
    CHECK(counter(*rec, "global_step") == global_step);
    CHECK(counter(*rec, "latest_update_step") == last_step_update);
    if (event.epoch_end) CHECK(counter(*rec, "latest_update_epoch") == last_epoch_update);
    std::optional<emakit::StateDict> held;
    if (e != nullptr) held = e->averages();
    for (const auto& [key, peer] : *rec) {
      if (key.rfind("peer.", 0) != 0) continue;
      const std::string name = key.substr(5);
      const std::string what = fmt::format("{} at {}", name, where);
      INFO(what);
      if (!held) {  // no EMA made yet (a lazy hook): the peer's average is still its copy at setup
        ++r.tally.compared;
        ++r.tally.bitwise;
        CHECK(updates == 0);
        CHECK(torch::equal(peer, first.at("source." + name)));
        continue;
      }
      const at::Tensor* ours = held->find(name);
      REQUIRE(ours != nullptr);  // every tensor is held: averaged, or copied (use_buffers=False)
      if (peer.is_floating_point()) {
        check_tensor(r.tally, what, *ours, peer, update_operands(name, *rec, previous, before), bound);
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
      const at::Tensor& source = rec->at("source." + name);
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
    previous = *rec;
  }
  const char* label = driver == Driver::preset ? "preset" : driver == Driver::hook ? "EmaHook" : "lazy EmaHook";
  std::cout << dir.filename().string() << " (" << label << "): " << r.step_records << " optimizer steps, "
            << r.epoch_records << " epoch-end records (" << r.epoch_updates << " of " << r.epoch_ends
            << " epoch ends updated), " << r.tally.summary(bound) << "; integers: " << r.integer_checks << " checked, "
            << r.peer_truncations << " peer truncations, different in " << r.integer_differences.size() << " tensors\n";

  // The checkpoint trainer.save_checkpoint wrote at the last epoch's end (after the last step and
  // the callback's epoch-end update): state_dict holds the average, current_model_state the
  // model, averaging_state n_averaged, the callback's entry latest_update_step. The same names as
  // emakit's averages.
  emakit::FixedEma* const e = ema();
  REQUIRE(e != nullptr);
  const Dict cp = load_dict(dir / "checkpoint.pt");
  const emakit::StateDict averages = e->averages();
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
  CHECK(cp.at("averaging_state.n_averaged").item<std::int64_t>() == e->num_updates());
  CHECK(cp.at("callback.latest_update_step").item<std::int64_t>() == last_step_update);
  CHECK(cp.at("global_step").item<std::int64_t>() == meta.at("steps").item<std::int64_t>());
  std::ifstream structure(dir / "checkpoint_structure.txt");
  const std::string text((std::istreambuf_iterator<char>(structure)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("averaging_state: n_averaged\n") &&
                       Catch::Contains("callbacks: EMAWeightAveraging -> ['latest_update_step']\n") &&
                       Catch::Contains("checkpoint: averaging_state, callbacks, current_model_state,"));

  // on_train_end: the callback copies the average into the model; emakit's copy_to (the hook's
  // train_end()) copies its own.
  const Dict end = load_dict(dir / "end.pt");
  if (preset) {
    preset->copy_to(*net);
  } else {
    hook.train_end();
  }
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

// The exact counts a replay of `dir` must reach: every tensor of every record (the step records'
// and, where the scenario has them, one epoch record per epoch), the checkpoint's two copies of
// the model's tensors, end.pt's.
void require_lightning_counts(const LightningReplay& r, const fs::path& dir) {
  const Dict meta = load_dict(dir / "meta.pt");
  const auto steps = meta.at("steps").item<std::int64_t>();
  const auto epochs = meta.at("epochs").item<std::int64_t>();
  const std::int64_t epoch_records = has_epoch_records(dir) ? epochs : 0;
  int epoch_keys = 0;
  for (std::int64_t epoch = 0; epoch < epoch_records; ++epoch)
    for (const auto& [key, _] : load_dict(step_file(dir, "epoch", epoch))) epoch_keys += key.rfind("peer.", 0) == 0;
  REQUIRE(r.step_records == steps);
  REQUIRE(r.epoch_records == epoch_records);
  REQUIRE(r.epoch_ends == epochs);
  REQUIRE(r.tally.compared == count_keys(dir, "peer.") + epoch_keys);
  REQUIRE(r.tally.compared == model_tensors(dir) * (steps + epoch_records));
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
// parameters only), and m per update against emakit's decay. A per-epoch scenario (meta
// steps_per_epoch) replays with .total_steps = max_epochs and .steps_per_epoch = the batches per
// epoch, one update() per batch, and wants every m bitwise.
Replay replay_teacher(const fs::path& dir, emakit::CosineEnd endpoint, MomentumTally& m,
                      emakit::Arithmetic arithmetic = emakit::Arithmetic::scaled_fused_add) {
  const Dict meta = load_dict(dir / "meta.pt");
  const double start = meta.at("start").item<double>(), end = meta.at("end").item<double>();
  const auto total = meta.at("max_steps").item<std::int64_t>();
  const bool per_epoch = meta.count("steps_per_epoch") > 0;
  const std::int64_t steps_per_epoch = per_epoch ? meta.at("steps_per_epoch").item<std::int64_t>() : 1;
  const std::int64_t last_k = endpoint == emakit::CosineEnd::at_last_step ? total - 1 : total;  // K'
  Net net;
  load_into(*net, load_dict(dir / "step_0000.pt"), "source.");
  auto ema = emakit::cosine_momentum_teacher(*net, {.start = start,
                                                    .end = end,
                                                    .total_steps = total,
                                                    .endpoint = endpoint,
                                                    .steps_per_epoch = steps_per_epoch,
                                                    .arithmetic = arithmetic});
  std::int64_t parameters = 0;
  for (const auto& p : net->named_parameters()) parameters += ema.averages().find(p.key()) != nullptr;
  CHECK(parameters == static_cast<std::int64_t>(net->parameters().size()));
  CHECK(ema.averages().size() == net->parameters().size());  // parameters only
  auto sources = aliases_of(*net);
  const auto r = replay(
      dir, sources, ema, /*pass_step=*/false,
      [&](const auto& e, const Dict& rec) {
        const auto k = counter(rec, "k");
        // The schedule's step: the update's index, or its epoch (cosine_schedule(epoch, ...)).
        const auto index = per_epoch ? counter(rec, "epoch") : k;
        if (per_epoch) CHECK(index == k / steps_per_epoch);
        const double peer_m = rec.at("counter.m").item<double>();
        INFO("k " << k << ", schedule step " << index << ": lightly m " << fmt::format("{:.17g}", peer_m) << ", emakit "
                  << fmt::format("{:.17g}", e.decay()));
        CHECK(e.num_updates() == k + 1);  // every update averages; update k + 1 is lightly's k
        ++m.compared;
        const double u = std::abs(e.decay() - peer_m) / emakit_test::ulp_of(std::max(peer_m, e.decay()), at::kDouble);
        m.max_ulps = std::max(m.max_ulps, u);
        m.bitwise += e.decay() == peer_m;
        CHECK(u <= 1.0);
        if (per_epoch) CHECK(e.decay() == peer_m);  // see the top of the file
        if (index >= last_k) {                      // both return `end` by their branch
          ++m.at_end;
          CHECK(e.decay() == end);
          CHECK(peer_m == end);
        }
        m.warned += counter(rec, "warned");
        CHECK((counter(rec, "warned") != 0) == (index > total));  // lightly warns past max_steps
      },
      peer_arithmetic_ulps);
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
  CHECK(r.epoch_updates == 0);
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

namespace {

// lightning_peer.py's epoch_ends_every3_from2: 4 epochs of 5 optimizer steps, every third step
// from step_idx 2, and update_starting_at_epoch = 1.
const emakit::LightningEmaWeightAveragingOptions epoch_ends_every3_from2{
    .decay = 0.9, .update_every_n_steps = 3, .update_starting_at_step = 2, .update_starting_at_epoch = 1};

// The step indices where the record says the callback updated at that optimizer step (its
// n_averaged moved since the record before, step or epoch end).
std::vector<std::int64_t> steps_that_updated(const fs::path& dir) {
  std::vector<std::int64_t> out;
  std::int64_t n = 0;
  for (const FitEvent& event : fit_events(dir)) {
    const Dict rec = load_dict(step_file(dir, event.epoch_end ? "epoch" : "step", event.index));
    const auto now = counter(rec, "n_averaged");
    if (!event.epoch_end && now != n) out.push_back(event.index);
    n = now;
  }
  return out;
}

void check_epoch_ends_every3_from2(const LightningReplay& r, const fs::path& dir) {
  require_lightning_counts(r, dir);  // 20 step records and 4 epoch records, every tensor of each
  // What Lightning did: step updates at global_step 4, 7, .., 19 (step_idx 3, 6, .., 18: the
  // trigger of the steps alone, unshifted by the epoch-end updates), epoch-end updates at the end
  // of epochs 1, 2, 3 (global_step 10, 15, 20); n_averaged 9 at the end, global_step 20. emakit
  // replayed the same (num_updates() == n_averaged, step() == global_step at every record).
  CHECK(steps_that_updated(dir) == std::vector<std::int64_t>{4, 7, 10, 13, 16, 19});
  CHECK(r.epoch_ends == 4);
  CHECK(r.epoch_updates == 3);  // epochs 1, 2, 3; not epoch 0
  const Dict last = load_dict(step_file(dir, "epoch", 3));
  CHECK(counter(last, "n_averaged") == 9);
  CHECK(counter(last, "global_step") == 20);
  CHECK(counter(last, "latest_update_epoch") == 3);
  // Epoch 1 ends at global_step 10, right after that step's own update: the epoch-end update
  // averaged the same weights once more.
  CHECK(counter(load_dict(step_file(dir, "step", 10)), "n_averaged") == 3);
  CHECK(counter(load_dict(step_file(dir, "epoch", 1)), "n_averaged") == 4);
  CHECK(r.integer_differences == std::set<std::string>{"bn.num_batches_tracked"});  // use_buffers=True
}

}  // namespace

TEST_CASE("lightning EMAWeightAveraging: update_starting_at_epoch=1 with every 3rd step from step_idx 2, "
          "epoch_end() at each epoch end (preset)",
          "[conformance][lightning]") {
  const auto dir = scenario_dir("lightning_peer", "epoch_ends_every3_from2");
  if (!dir) return;
  REQUIRE(has_epoch_records(*dir));
  check_epoch_ends_every3_from2(replay_lightning(*dir, epoch_ends_every3_from2), *dir);
}

TEST_CASE("lightning EMAWeightAveraging: update_starting_at_epoch=1 through EmaHook (after_optimizer_step, "
          "train_epoch_end)",
          "[conformance][lightning]") {
  const auto dir = scenario_dir("lightning_peer", "epoch_ends_every3_from2");
  if (!dir) return;
  check_epoch_ends_every3_from2(replay_lightning(*dir, epoch_ends_every3_from2, Driver::hook), *dir);
}

TEST_CASE("lightning EMAWeightAveraging: the first update at epoch 0's end (a copy), use_buffers=False, "
          "accumulate_grad_batches=2 (preset, EmaHook made lazily)",
          "[conformance][lightning]") {
  const auto dir = scenario_dir("lightning_peer", "epoch_end_first_accumulate2");
  if (!dir) return;
  REQUIRE(has_epoch_records(*dir));
  REQUIRE(load_dict(*dir / "meta.pt").at("accumulate").item<std::int64_t>() == 2);
  const emakit::LightningEmaWeightAveragingOptions o{.decay = 0.8,
                                                     .use_buffers = false,
                                                     .update_every_n_steps = 4,
                                                     .update_starting_at_step = 5,
                                                     .update_starting_at_epoch = 0};
  for (const Driver driver : {Driver::preset, Driver::lazy_hook}) {
    INFO((driver == Driver::preset ? "preset" : "lazy EmaHook"));
    const auto r = replay_lightning(*dir, o, driver);
    require_lightning_counts(r, *dir);  // 9 step records, 3 epoch records
    // Lightning: the end of epoch 0 (global_step 3) copies, epochs 1 and 2 (global_step 6, 9)
    // average, and the step trigger at step_idx 8 (global_step 9, before epoch 2's end); the
    // lazy hook makes its EMA at epoch 0's end.
    CHECK(steps_that_updated(*dir) == std::vector<std::int64_t>{9});
    CHECK(r.epoch_updates == 3);
    CHECK(counter(load_dict(step_file(*dir, "epoch", 0)), "n_averaged") == 1);
    CHECK(counter(load_dict(step_file(*dir, "epoch", 2)), "n_averaged") == 4);
    CHECK(counter(load_dict(step_file(*dir, "epoch", 2)), "latest_update_step") == 9);
    CHECK(r.peer_truncations == 0);  // use_buffers=False: integers copied on both sides
    CHECK(r.integer_differences.empty());
  }
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
  // DINO's mul_(m).add_((1 - m) * x): two products rounded, then the sum (the top of the file).
  const auto r = replay_teacher(*dir, emakit::CosineEnd::after_last_step, m, emakit::Arithmetic::weighted_sum);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
  REQUIRE(m.compared == 30);
  CHECK(m.at_end == 0);  // DINO's array ends at k = K - 1 < K'
  // The last step is below `end`, unlike lightly's at K - 1: K' = K, not K - 1.
  CHECK(load_dict(step_file(*dir, "step", 30)).at("counter.m").item<double>() < 1.0);
}

TEST_CASE("lightly BYOL example: cosine_schedule(epoch, max_epochs) once per epoch, update_momentum at each "
          "batch's start (steps_per_epoch)",
          "[conformance][lightly]") {
  const auto dir = scenario_dir("lightly_peer", "byol_epoch_momentum");
  if (!dir) return;
  const Dict meta = load_dict(*dir / "meta.pt");
  REQUIRE(meta.at("max_steps").item<std::int64_t>() == 6);  // max_epochs
  REQUIRE(meta.at("steps_per_epoch").item<std::int64_t>() == 4);
  REQUIRE(meta.at("update_first").item<std::int64_t>() == 1);  // the example's order
  MomentumTally m;
  const auto r = replay_teacher(*dir, emakit::CosineEnd::at_last_step, m);
  REQUIRE(r.steps == 24);  // 6 epochs of 4 batches, one update each
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
  REQUIRE(m.compared == 24);
  CHECK(m.bitwise == 24);
  CHECK(m.at_end == 4);  // epoch 5 = max_epochs - 1: m = end, the teacher stops
  CHECK(m.warned == 0);
  // One momentum per epoch: the 4 updates of an epoch share it, and it changes at every epoch.
  for (std::int64_t epoch = 0; epoch < 6; ++epoch) {
    INFO("epoch " << epoch);
    const double first_m = load_dict(step_file(*dir, "step", 4 * epoch + 1)).at("counter.m").item<double>();
    for (std::int64_t b = 1; b < 4; ++b)
      CHECK(load_dict(step_file(*dir, "step", 4 * epoch + 1 + b)).at("counter.m").item<double>() == first_m);
    if (epoch > 0) CHECK(load_dict(step_file(*dir, "step", 4 * epoch)).at("counter.m").item<double>() < first_m);
  }
}

TEST_CASE("lightly BYOL loop with the update after the optimizer step: momentum per epoch of 3 batches, other ends",
          "[conformance][lightly]") {
  const auto dir = scenario_dir("lightly_peer", "byol_epoch_momentum_after_step");
  if (!dir) return;
  const Dict meta = load_dict(*dir / "meta.pt");
  REQUIRE(meta.at("max_steps").item<std::int64_t>() == 5);
  REQUIRE(meta.at("steps_per_epoch").item<std::int64_t>() == 3);
  REQUIRE(meta.at("update_first").item<std::int64_t>() == 0);
  MomentumTally m;
  const auto r = replay_teacher(*dir, emakit::CosineEnd::at_last_step, m);
  REQUIRE(r.steps == 15);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
  REQUIRE(m.compared == 15);
  CHECK(m.bitwise == 15);
  CHECK(m.at_end == 3);  // epoch 4
  CHECK(m.warned == 0);
}

}  // namespace test_lightning_lightly
