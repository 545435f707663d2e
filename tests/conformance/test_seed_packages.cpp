// Conformance with the seed packages emakit reproduces: luxonis-train (ModelEma, EMACallback in a
// real Lightning fit) and nvalchemi-toolkit (EMAHook, driven as its TrainingStrategy does). Data:
// tests/conformance/luxonis_peer.py and nvalchemi_peer.py, run in the seed venv
// (EMAKIT_SEED_PACKAGES=1 ./scripts/test.sh), or, by default, the recorded fixtures in
// tests/conformance/fixtures/ (package versions and the regenerating command beside them).
//
// Tolerances (replay.hpp: every update starts from the peer's previous state, so the bounds are
// for one update; ulps of float32 at M = max(|a|, |x|, |result|) elementwise, a the state before,
// x the source, w = 1 - d the weight):
//   kLerp = 1.5 ulps, both packages: nvalchemi's EMAHook averages through AveragedModel's
//     get_ema_multi_avg_fn, and luxonis-train 0.6.0's ModelEma (also inside EMACallback) through
//     torch._foreach_lerp_(ema, model, 1 - d) (its _foreach_mul_/_foreach_add_ fallback is for a
//     torch without _foreach_lerp_, not the pinned one): ATen's lerp, emakit's formula with one
//     rounding fewer (the fused product; the derivation is test_peers.cpp's).
//   The average swapped into the model (validation, train end, the checkpoint's weights) is a
//   copy of emakit's own average, bitwise; the weights restored after validation, the model's
//   own, bitwise; counters, copies, integer tensors and flags exact.
//
// Differences by design, asserted here (README "Coming from Python"):
//   - EMAHook with use_buffers=True averages integer buffers (num_batches_tracked) in integer
//     arithmetic through AveragedModel; emakit copies integers.
//   - After a load, emakit's EmaHook makes the EMA at the next call; EMAHook at its next eligible
//     step. The numbers are the same (the pending state is applied either way before an update).
//   - EMACallback's accumulation window is Lightning's batch_idx, which restarts every epoch;
//     StepSchedule::accumulate counts calls across epochs. Same when the epoch length is a
//     multiple of the window; otherwise the C++ trainer calls the hook at batch_idx % n == 0 with
//     accumulate = 1, which reproduces the callback exactly (both asserted).
#include "replay.hpp"

#include <emakit/interop.hpp>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <unistd.h>

namespace test_seed_packages {  // this file's names (unity batches: tests/CMakeLists.txt)

using namespace emakit_conformance;

namespace {

using Net = CommonNet;  // _common.Net's tensors under the same names (replay.hpp)

constexpr double kLerp = 1.5, kLuxonis = kLerp;  // see the top of the file

// Each rec[prefix + name] against ours_of(name) (check_tensor, with operands_of(name)): integers
// exact (except the names in `integer_differences_allowed`, which must then equal
// `copied_from[name]`), floats a copy of an operand or within `max_ulps`.
template <class Lookup, class Operands>
void compare(Lookup ours_of, const Dict& rec, const std::string& prefix, Tally& t, Operands operands_of,
             double max_ulps, const std::set<std::string>& integer_differences_allowed = {},
             const Dict* copied_from = nullptr) {
  int seen = 0;
  for (const auto& [key, peer] : rec) {
    if (key.rfind(prefix, 0) != 0) continue;
    const std::string name = key.substr(prefix.size());
    INFO(key);
    const at::Tensor* ours = ours_of(name);
    REQUIRE(ours != nullptr);
    ++seen;
    if (!peer.is_floating_point() && integer_differences_allowed.count(name) && !torch::equal(*ours, peer)) {
      REQUIRE(copied_from != nullptr);
      ++t.compared;
      ++t.bitwise;
      CHECK(torch::equal(*ours, copied_from->at("source." + name)));  // emakit copies integers
      continue;
    }
    check_tensor(t, key, *ours, peer, operands_of(name), max_ulps);
  }
  REQUIRE(seen > 0);
}

// Operands that are copies of the average: the peer's average (peer.* of `rec`) and emakit's.
auto average_operands(const Dict& rec, const emakit::StateDict& ours) {
  return [&rec, &ours](const std::string& name) {
    std::vector<Operand> out;
    const auto peer = rec.find("peer." + name);
    const at::Tensor* mine = ours.find(name);
    if (peer != rec.end() && mine != nullptr) out.push_back({peer->second, *mine});
    return out;
  };
}
// Operands that are the model's own tensors (source.* of `rec`).
auto source_operands(const Dict& rec) {
  return [&rec](const std::string& name) {
    std::vector<Operand> out;
    const auto source = rec.find("source." + name);
    if (source != rec.end()) out.push_back({source->second, source->second});
    return out;
  };
}

auto in_state(const emakit::StateDict& d) {
  return [&d](const std::string& name) { return d.find(name); };
}
auto in_module(torch::nn::Module& m) {
  auto tensors = std::make_shared<std::map<std::string, at::Tensor>>(tensors_of(m));
  return [tensors](const std::string& name) -> const at::Tensor* {
    auto it = tensors->find(name);
    return it == tensors->end() ? nullptr : &it->second;
  };
}

std::int64_t counter(const Dict& rec, const std::string& name) {
  return rec.at("counter." + name).item<std::int64_t>();
}

void report(const std::string& what, std::int64_t steps, const Tally& s, double bound) {
  std::cout << what << ": " << steps << " steps, " << s.summary(bound) << "\n";
}

using FixedEma = emakit::Ema<emakit::Fixed>;
using RampEma = emakit::Ema<emakit::ExponentialRamp>;

// Replays an nvalchemi scenario through emakit::EmaHook (at the first eligible step or at setup):
// the creation step, the averages, num_updates and n_averaged after every batch.
Tally replay_ema_hook(const fs::path& dir, const emakit::NvalchemiEmaOptions& o, emakit::Creation creation,
                      const std::set<std::string>& integer_differences = {}) {
  Tally s;
  Net net;
  load_into(*net, load_dict(dir / "step_0000.pt"), "source.");
  emakit::EmaHook hook;
  hook.add(*net, emakit::nvalchemi_ema_recipe(o), {.creation = creation});
  hook.setup();
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  Dict last_update, previous;
  std::int64_t updates = 0;
  for (std::int64_t step = 1; step <= steps; ++step) {
    INFO("batch " << step);
    const Dict rec = load_dict(step_file(dir, "step", step));
    load_into(*net, rec, "source.");
    std::map<std::string, at::Tensor> before;
    if (hook.created("model")) {
      const emakit::StateDict held = hook.ema<FixedEma>("model").averages();
      start_from(held, previous);
      before = clone_all(held);
    }
    hook.after_optimizer_step({.vetoed = rec.at("vetoed").item<std::int64_t>() != 0});
    CHECK(hook.created("model") == (counter(rec, "created") != 0));
    if (!hook.created("model")) continue;
    auto& ema = hook.ema<FixedEma>("model");
    if (ema.num_updates() != updates) last_update = rec;  // integers are copied at updates
    updates = ema.num_updates();
    CHECK(ema.num_updates() == counter(rec, "num_updates"));
    CHECK(ema.num_updates() == counter(rec, "n_averaged"));
    CHECK(ema.step() == counter(rec, "step_count"));
    const emakit::StateDict averages = ema.averages();
    compare(
        in_state(averages), rec, "peer.", s,
        [&](const std::string& name) { return update_operands(name, rec, previous, before); }, kLerp,
        integer_differences, &last_update);
    previous = rec;
  }
  report(dir.filename().string() + " (EmaHook)", steps, s, kLerp);
  return s;
}

// A luxonis EMACallback fit through emakit::EmaHook. `call_at_window_start`: the C++ trainer
// calls the hook only at batch_idx % accumulate == 0 (recipe accumulate 1), else every batch.
Tally replay_callback(const fs::path& dir, double decay, double tau, bool call_at_window_start) {
  Tally s;
  const Dict meta = load_dict(dir / "meta.pt");
  const auto steps = meta.at("steps").item<std::int64_t>();
  const auto accumulate = meta.at("accumulate").item<std::int64_t>();
  Net net;
  load_into(*net, load_dict(dir / "step_0000.pt"), "source.");
  emakit::EmaHook hook;
  hook.add(*net, emakit::luxonis_ema_callback_recipe(
                     {.decay = decay, .decay_tau = tau, .accumulate = call_at_window_start ? 1 : accumulate}));
  hook.setup();  // on_fit_start
  std::int64_t epoch = 0;
  const fs::path ckpt = fs::temp_directory_path() / ("emakit_luxonis_" + std::to_string(::getpid()) + ".pt");
  Dict previous, last;
  for (std::int64_t call = 1; call <= steps; ++call) {
    INFO("batch " << call);
    const Dict rec = load_dict(step_file(dir, "step", call));
    load_into(*net, rec, "source.");
    auto& ema = hook.ema<RampEma>("model");
    start_from(ema.averages(), previous);
    const auto before = clone_all(ema.averages());
    if (!call_at_window_start || counter(rec, "batch_idx") % accumulate == 0) hook.after_optimizer_step();
    CHECK(ema.num_updates() == counter(rec, "updates"));
    const emakit::StateDict averages = ema.averages();
    compare(
        in_state(averages), rec, "peer.", s,
        [&](const std::string& name) { return update_operands(name, rec, previous, before); }, kLuxonis);
    previous = last = rec;
    if (fs::exists(step_file(dir, "val", epoch + 1)) &&
        load_dict(step_file(dir, "val", epoch + 1)).at("calls").item<std::int64_t>() == call) {
      ++epoch;
      INFO("validation after epoch " << epoch);
      const Dict val = load_dict(step_file(dir, "val", epoch));
      {
        auto scope = hook.validation();  // on_validation_epoch_start: the average in the model
        compare(in_module(*net), val, "valid.", s, average_operands(rec, averages), kLuxonis);
      }
      // on_validation_end: the weights back
      compare(in_module(*net), val, "restored.", s, source_operands(rec), 0);
      const Dict cp = load_dict(step_file(dir, "ckpt", epoch));
      REQUIRE(cp.at("calls").item<std::int64_t>() == call);
      hook.save_checkpoint(ckpt);
      Net loaded;
      emakit::load_weights(*loaded, ckpt);  // the checkpoint's model weights: the average
      compare(in_module(*loaded), cp, "state_dict.", s, average_operands(rec, averages), kLuxonis);
      compare(in_state(averages), cp, "ema_state_dict.", s, average_operands(rec, averages), kLuxonis);
      CHECK(ema.num_updates() == cp.at("updates").item<std::int64_t>());
      // saving left the model's weights alone
      compare(in_module(*net), rec, "source.", s, source_operands(rec), 0);
    }
  }
  fs::remove(ckpt);
  CHECK(epoch == meta.at("epochs").item<std::int64_t>());
  hook.train_end();  // on_train_end: the model keeps the average
  const emakit::StateDict final_averages = hook.ema<RampEma>("model").averages();
  compare(in_module(*net), load_dict(dir / "end.pt"), "end.", s, average_operands(last, final_averages), kLuxonis);
  report(dir.filename().string() + (call_at_window_start ? " (hook at batch_idx % n == 0)" : " (hook, accumulate)"),
         steps, s, kLuxonis);
  return s;
}

// The batches at which the nvalchemi peer had made its averaged model (counter.created).
int count_created(const fs::path& dir) {
  const auto steps = load_dict(dir / "meta.pt").at("steps").item<std::int64_t>();
  int n = 0;
  for (std::int64_t step = 1; step <= steps; ++step)
    n += counter(load_dict(step_file(dir, "step", step)), "created") != 0;
  return n;
}

// The comparisons replay_callback makes: each recorded peer.* per batch, and per epoch the
// valid.*, restored.*, state_dict.*, ema_state_dict.* and the model's source.* after the save,
// and end.* once.
int callback_comparisons(const fs::path& dir) {
  const Dict meta = load_dict(dir / "meta.pt");
  int n = count_keys(dir, "peer.");
  for (std::int64_t epoch = 1; epoch <= meta.at("epochs").item<std::int64_t>(); ++epoch) {
    const Dict val = load_dict(step_file(dir, "val", epoch));
    const Dict cp = load_dict(step_file(dir, "ckpt", epoch));
    for (const auto& [key, _] : val) n += key.rfind("valid.", 0) == 0 || key.rfind("restored.", 0) == 0;
    for (const auto& [key, _] : cp) n += key.rfind("state_dict.", 0) == 0 || key.rfind("ema_state_dict.", 0) == 0;
    n += model_tensors(dir);  // the model's source.* after the save
  }
  for (const auto& [key, _] : load_dict(dir / "end.pt")) n += key.rfind("end.", 0) == 0;
  return n;
}

// A checkpoint of an EmaHook with nvalchemi's config `base` after one step, at a file of its own
// (named by `tag`); the caller removes it.
fs::path nvalchemi_checkpoint(const emakit::NvalchemiEmaOptions& base, const std::string& tag) {
  torch::manual_seed(3);
  Net net;
  emakit::EmaHook saver;
  saver.add(*net, emakit::nvalchemi_ema_recipe(base));
  saver.setup();
  saver.after_optimizer_step();
  const fs::path file =
      fs::temp_directory_path() / ("emakit_nvalchemi_" + tag + "_" + std::to_string(::getpid()) + ".pt");
  saver.save_checkpoint(file);
  return file;
}

}  // namespace

// ---- luxonis-train ---------------------------------------------------------------------------

TEST_CASE("luxonis-train ModelEma: ramped decay over the whole state dict", "[conformance][luxonis]") {
  const auto dir = scenario_dir("luxonis_peer", "dynamic_decay");
  if (!dir) return;
  auto sources = sources_from(*dir);
  auto ema = emakit::luxonis_model_ema(sources, {.decay = 0.99, .decay_tau = 5.0});
  const auto r = replay(
      *dir, sources, ema, false,
      [](const auto& e, const Dict& rec) {
        CHECK(e.num_updates() == rec.at("counter.updates").template item<std::int64_t>());
      },
      kLuxonis);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
}

TEST_CASE("luxonis-train ModelEma: use_dynamic_decay=False is FixedEma in the model's dtype",
          "[conformance][luxonis]") {
  const auto dir = scenario_dir("luxonis_peer", "fixed_decay");
  if (!dir) return;
  auto sources = sources_from(*dir);
  emakit::FixedEma ema(sources, emakit::Fixed(0.7), {},
                       emakit::EmaOptions().keep_model_dtype(true).arithmetic(emakit::Arithmetic::fused_lerp));
  const auto r = replay(
      *dir, sources, ema, false,
      [](const auto& e, const Dict& rec) {
        CHECK(e.num_updates() == rec.at("counter.updates").template item<std::int64_t>());
      },
      kLuxonis);
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * r.steps);
}

TEST_CASE("luxonis-train EMACallback in a Lightning fit: accumulation windows, validation swap, checkpoints, train end",
          "[conformance][luxonis]") {
  const auto dir = scenario_dir("luxonis_peer", "callback_accumulate");
  if (!dir) return;
  const Tally s = replay_callback(*dir, 0.9, 3.0, /*call_at_window_start=*/false);
  REQUIRE(s.compared == callback_comparisons(*dir));
}

TEST_CASE("luxonis-train EMACallback: windows restart each epoch (batch_idx), the preset's accumulate does not",
          "[conformance][luxonis]") {
  const auto dir = scenario_dir("luxonis_peer", "callback_epoch_restart");
  if (!dir) return;
  // The documented difference: with epochs of 5 batches and windows of 2, the callback updates at
  // batch_idx 0, 2, 4 of every epoch (6 updates); StepSchedule::accumulate(2) at calls 1, 3, 5, 7, 9.
  const Dict meta = load_dict(*dir / "meta.pt");
  const auto steps = meta.at("steps").item<std::int64_t>();
  REQUIRE(steps == 10);
  std::vector<std::int64_t> peer_updates, ours;
  std::vector<emakit::SourceTensor> sources = sources_from(*dir);
  auto schedule = emakit::luxonis_ema_callback_recipe({.decay = 0.9, .decay_tau = 3.0, .accumulate = 2}).schedule;
  std::int64_t previous = 0, n = 0;
  for (std::int64_t call = 1; call <= steps; ++call) {
    const Dict rec = load_dict(step_file(*dir, "step", call));
    const auto u = counter(rec, "updates");
    if (u != (peer_updates.empty() ? 0 : peer_updates.back())) peer_updates.push_back(u);
    const emakit::Decision d = schedule.decide(emakit::ScheduleInput{call, std::nullopt, previous, n, false});
    previous = d.step;
    if (d.action != emakit::Action::skipped) ours.push_back(++n);
  }
  CHECK(peer_updates.size() == 6);
  CHECK(ours.size() == 5);
  // The way to reproduce it: call the hook at the callback's own window starts, accumulate 1.
  const Tally s = replay_callback(*dir, 0.9, 3.0, /*call_at_window_start=*/true);
  REQUIRE(s.compared == callback_comparisons(*dir));
}

// ---- nvalchemi-toolkit -----------------------------------------------------------------------

TEST_CASE("nvalchemi EMAHook: start_step, update_every and vetoed steps (preset)", "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "vetoed_start_every");
  if (!dir) return;
  auto sources = sources_from(*dir);
  // The strategy advances ctx.step_count only when the optimizer step ran: a vetoed batch
  // (will_skip) completes no step, as emakit's update({.vetoed = true}).
  auto ema = emakit::nvalchemi_ema(sources, {.decay = 0.9, .update_every = 2, .start_step = 3, .use_buffers = false});
  const auto r = replay(
      *dir, sources, ema, /*pass_step=*/false,
      [](const auto& e, const Dict& rec) {
        CHECK(e.num_updates() == rec.at("counter.num_updates").template item<std::int64_t>());
        CHECK(e.step() == rec.at("counter.step_count").template item<std::int64_t>());
      },
      kLerp);
  // The peer records its state once it made its averaged model: every model tensor at those steps.
  REQUIRE(r.compared == expected_comparisons(*dir));
  REQUIRE(r.compared == model_tensors(*dir) * count_created(*dir));
}

TEST_CASE("nvalchemi EMAHook: lazy creation at the first eligible step (EmaHook)", "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "vetoed_start_every");
  if (!dir) return;
  const Tally s = replay_ema_hook(*dir, {.decay = 0.9, .update_every = 2, .start_step = 3, .use_buffers = false},
                                  emakit::Creation::at_first_eligible_step);
  REQUIRE(s.compared == expected_comparisons(*dir));
  REQUIRE(s.compared == model_tensors(*dir) * count_created(*dir));
}

TEST_CASE("nvalchemi EMAHook: use_buffers=True, made at SETUP", "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "buffers_at_setup");
  if (!dir) return;
  // AveragedModel averages num_batches_tracked in integer arithmetic; emakit copies integers.
  const Tally s =
      replay_ema_hook(*dir, {.decay = 0.8, .start_step = 2}, emakit::Creation::at_setup, {"bn.num_batches_tracked"});
  REQUIRE(s.compared == expected_comparisons(*dir));
  REQUIRE(s.compared == model_tensors(*dir) * count_created(*dir));
}

TEST_CASE("nvalchemi EMAHook: resume with pending state applied at creation, num_updates restored",
          "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "resume");
  if (!dir) return;
  const emakit::NvalchemiEmaOptions o{.decay = 0.85, .update_every = 3, .start_step = 4, .use_buffers = false};
  const auto steps = load_dict(*dir / "meta.pt").at("steps").item<std::int64_t>();
  Tally s;
  Net net;
  load_into(*net, load_dict(*dir / "step_0000.pt"), "source.");
  auto hook = std::make_unique<emakit::EmaHook>();
  hook->add(*net, emakit::nvalchemi_ema_recipe(o), {.creation = emakit::Creation::at_first_eligible_step});
  hook->setup();
  const fs::path file = fs::temp_directory_path() / ("emakit_nvalchemi_" + std::to_string(::getpid()) + ".pt");
  bool resumed_creation_checked = false;
  Dict previous;
  for (std::int64_t step = 1; step <= steps; ++step) {
    INFO("batch " << step);
    const Dict rec = load_dict(step_file(*dir, "step", step));
    load_into(*net, rec, "source.");
    std::map<std::string, at::Tensor> before;
    if (hook->created("model")) {
      const emakit::StateDict held = hook->ema<FixedEma>("model").averages();
      start_from(held, previous);
      before = clone_all(held);
    }
    hook->after_optimizer_step({.vetoed = rec.at("vetoed").item<std::int64_t>() != 0});
    if (counter(rec, "created") != 0) {
      auto& ema = hook->ema<FixedEma>("model");
      CHECK(ema.num_updates() == counter(rec, "num_updates"));
      CHECK(ema.step() == counter(rec, "step_count"));
      const emakit::StateDict averages = ema.averages();
      compare(
          in_state(averages), rec, "peer.", s,
          [&](const std::string& name) { return update_operands(name, rec, previous, before); }, kLerp);
    }
    previous = rec;
    if (step == 8) {  // the Python run saves hook.state_dict() here and a fresh hook loads it
      hook->save_checkpoint(file);
      hook = std::make_unique<emakit::EmaHook>();
      hook->add(*net, emakit::nvalchemi_ema_recipe(o), {.creation = emakit::Creation::at_first_eligible_step});
      hook->load_checkpoint(file);
      CHECK_FALSE(hook->created("model"));  // pending, as EMAHook's _pending_averaged_state
      continue;
    }
    if (step > 8 && !resumed_creation_checked) {
      // The difference by design: EmaHook makes the EMA at the first call after a load;
      // EMAHook at its first eligible step (the numbers are the same).
      resumed_creation_checked = true;
      CHECK(hook->created("model"));
    }
  }
  fs::remove(file);
  CHECK(resumed_creation_checked);
  report("resume (EmaHook, checkpoint at batch 8)", steps, s, kLerp);
  REQUIRE(s.compared == count_keys(*dir, "peer."));
  REQUIRE(s.compared == model_tensors(*dir) * count_created(*dir));

  // The state EMAHook saved at batch 8 (its AveragedModel's module.* and n_averaged), imported
  // into a fresh preset Ema, continues to the same numbers (steps given: ctx.step_count + 1).
  const Dict saved = load_dict(*dir / "hook_state_0008.pt");
  auto sources = sources_from(*dir);
  auto ema = emakit::nvalchemi_ema(sources, o);
  {
    Dict averaged_model;  // the AveragedModel's state_dict as Python saves it: module.<name>, n_averaged
    for (const auto& [k, v] : saved)
      if (k.rfind("averaged_model_state.", 0) == 0) averaged_model.emplace(k.substr(21), v);
    c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
    for (const auto& [k, v] : averaged_model) d.insert(k, v);
    const fs::path plain = fs::temp_directory_path() / ("emakit_nvalchemi_am_" + std::to_string(::getpid()) + ".pt");
    {
      const auto bytes = torch::pickle_save(c10::IValue(d));
      std::ofstream(plain, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    }
    emakit::import_state(ema, emakit::Peer::averaged_model, plain.string());
    fs::remove(plain);
  }
  CHECK(ema.num_updates() == saved.at("num_updates").item<std::int64_t>());
  std::int64_t step_count = saved.at("step_count").item<std::int64_t>();
  Tally s2;
  previous.clear();  // the first step after the import starts from the imported state
  for (std::int64_t step = 9; step <= steps; ++step) {
    INFO("batch " << step << " (imported)");
    const Dict rec = load_dict(step_file(*dir, "step", step));
    {
      torch::NoGradGuard no_grad;
      for (auto& t : sources) t.tensor.copy_(rec.at("source." + t.name));
    }
    start_from(ema.averages(), previous);
    const auto before = clone_all(ema.averages());
    const bool vetoed = rec.at("vetoed").item<std::int64_t>() != 0;
    emakit::StepInfo info{.vetoed = vetoed};
    if (!vetoed) info.step = ++step_count;
    ema.update(info);
    CHECK(ema.num_updates() == counter(rec, "num_updates"));
    if (counter(rec, "created") != 0) {
      const emakit::StateDict averages = ema.averages();
      compare(
          in_state(averages), rec, "peer.", s2,
          [&](const std::string& name) { return update_operands(name, rec, previous, before); }, kLerp);
    }
    previous = rec;
  }
  report("resume (preset, imported Python state)", steps - 8, s2, kLerp);
  REQUIRE(s2.compared == count_keys(*dir, "peer.", 9));
}

TEST_CASE("nvalchemi EMAHook: a state with another config is refused, naming the field, nothing loaded",
          "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "config_conflict");
  if (!dir) return;
  const Dict errors = load_dict(*dir / "errors.pt");
  CHECK(errors.at("pending_before_creation").item<std::int64_t>() == 1);
  const emakit::NvalchemiEmaOptions base{.decay = 0.85, .update_every = 3, .start_step = 4, .use_buffers = false};
  const fs::path file = nvalchemi_checkpoint(base, "cfg");
  struct Case {
    const char* field;
    emakit::NvalchemiEmaOptions options;
    const char* emakit_field;  // the name emakit's message uses
  };
  const Case cases[] = {
      {"decay", {.decay = 0.9, .update_every = 3, .start_step = 4, .use_buffers = false}, "decay"},
      {"update_every", {.decay = 0.85, .update_every = 2, .start_step = 4, .use_buffers = false}, "update_every"},
      {"start_step", {.decay = 0.85, .update_every = 3, .start_step = 0, .use_buffers = false}, "start_step"},
  };  // use_buffers: its own test below
  for (const auto& c : cases) {
    INFO(c.field);
    const at::Tensor msg = errors.at(std::string("message.") + c.field);
    const std::string python(reinterpret_cast<const char*>(msg.data_ptr<std::uint8_t>()),
                             static_cast<std::size_t>(msg.numel()));
    CHECK_THAT(python, Catch::Contains("EMAHook checkpoint conflict") && Catch::Contains(c.field));
    // A hook whose EMA exists (made at setup): refused at load, naming the field, nothing loaded.
    Net other;
    emakit::EmaHook hook;
    hook.add(*other, emakit::nvalchemi_ema_recipe(c.options));
    hook.setup();
    const auto before = other->lin->weight.clone();
    CHECK_THROWS_WITH(hook.load_checkpoint(file), Catch::Contains(c.emakit_field));
    CHECK(torch::equal(other->lin->weight, before));  // nothing loaded
  }
  fs::remove(file);
}

// EMAHook refuses a conflicting config at load_state_dict() also before its averaged model
// exists (the state would be pending). emakit's EmaHook, with the EMA not yet made
// (Creation::at_first_eligible_step), refuses it too, naming the field, and loads nothing.
TEST_CASE("nvalchemi EMAHook: a conflicting config is refused at load also before creation",
          "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "config_conflict");
  if (!dir) return;
  const Dict errors = load_dict(*dir / "errors.pt");
  REQUIRE(errors.at("message.decay").numel() > 0);  // EMAHook raised for a pending state too
  const fs::path file =
      nvalchemi_checkpoint({.decay = 0.85, .update_every = 3, .start_step = 4, .use_buffers = false}, "cfg2");
  Net other;
  emakit::EmaHook hook;
  hook.add(*other,
           emakit::nvalchemi_ema_recipe({.decay = 0.9, .update_every = 3, .start_step = 4, .use_buffers = false}),
           {.creation = emakit::Creation::at_first_eligible_step});
  const auto before = other->lin->weight.clone();
  CHECK_THROWS_WITH(hook.load_checkpoint(file), Catch::Contains("config.decay"));
  CHECK(torch::equal(other->lin->weight, before));  // nothing loaded
  fs::remove(file);
}

TEST_CASE("nvalchemi EMAHook: pending state aligned to the model's dtype at creation", "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "dtype_alignment");
  if (!dir) return;
  const Dict aligned = load_dict(*dir / "aligned.pt");
  const auto resume = scenario_dir("nvalchemi_peer", "resume");
  REQUIRE(resume);
  // The float32 run's state at batch 8, loaded into a hook whose model is float64, made at setup:
  // the averages are float64, with the float32 values (EMAHook: load_state_dict, then
  // _align_to_source_tensors).
  const emakit::NvalchemiEmaOptions o{.decay = 0.85, .update_every = 3, .start_step = 4, .use_buffers = false};
  Net net;
  load_into(*net, load_dict(*resume / "step_0000.pt"), "source.");
  emakit::EmaHook hook;
  hook.add(*net, emakit::nvalchemi_ema_recipe(o), {.creation = emakit::Creation::at_first_eligible_step});
  hook.setup();
  for (std::int64_t step = 1; step <= 8; ++step) {
    const Dict rec = load_dict(step_file(*resume, "step", step));
    load_into(*net, rec, "source.");
    hook.after_optimizer_step({.vetoed = rec.at("vetoed").item<std::int64_t>() != 0});
  }
  const fs::path file = fs::temp_directory_path() / ("emakit_nvalchemi_dt_" + std::to_string(::getpid()) + ".pt");
  hook.save_checkpoint(file);
  Net net64;  // model.double(): the floating tensors only (LibTorch's Module::to(dtype) converts all)
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, t] : tensors_of(*net64))
      if (t.is_floating_point()) t.set_data(t.to(at::kDouble));
  }
  emakit::EmaHook hook64;
  hook64.add(*net64, emakit::nvalchemi_ema_recipe(o), {.creation = emakit::Creation::at_first_eligible_step});
  hook64.load_checkpoint(file);
  hook64.setup();  // SETUP: made now, the pending state applied
  fs::remove(file);
  REQUIRE(hook64.created("model"));
  auto& ema = hook64.ema<FixedEma>("model");
  CHECK(ema.num_updates() == aligned.at("num_updates").item<std::int64_t>());
  CHECK(ema.num_updates() == aligned.at("n_averaged").item<std::int64_t>());
  const emakit::StateDict averages = ema.averages();
  // dtype checked (float64 both) and values: the float32 values widened, exactly (0 ulps).
  Tally s;
  compare(
      in_state(averages), aligned, "peer.", s, [](const std::string&) { return std::vector<Operand>{}; }, 0);
  REQUIRE(s.compared == static_cast<int>(averages.size()));
  report("dtype_alignment", 0, s, 0);
  CHECK(averages.find("lin.weight")->scalar_type() == at::kDouble);
}

// EMAHook refuses a state saved with another use_buffers. emakit's state carries
// EmaOptions::buffers (config.options.buffers), and a load into an EMA with another buffer mode
// is refused, naming it.
TEST_CASE("nvalchemi EMAHook: a state saved with another use_buffers is refused", "[conformance][nvalchemi]") {
  const auto dir = scenario_dir("nvalchemi_peer", "config_conflict");
  if (!dir) return;
  const Dict errors = load_dict(*dir / "errors.pt");
  REQUIRE(errors.at("message.use_buffers").numel() > 0);  // EMAHook raised
  const fs::path file =
      nvalchemi_checkpoint({.decay = 0.85, .update_every = 3, .start_step = 4, .use_buffers = false}, "cfg3");
  Net other;
  emakit::EmaHook hook;
  hook.add(*other,
           emakit::nvalchemi_ema_recipe({.decay = 0.85, .update_every = 3, .start_step = 4, .use_buffers = true}));
  hook.setup();
  const auto before = other->lin->weight.clone();
  CHECK_THROWS_WITH(hook.load_checkpoint(file), Catch::Contains("config.options.buffers"));
  CHECK(torch::equal(other->lin->weight, before));  // nothing loaded
  fs::remove(file);
}

}  // namespace test_seed_packages
