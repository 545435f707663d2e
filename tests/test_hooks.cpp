// emakit::EmaHook: stages step by step, lazy creation, swaps, train end, checkpoints and resume.
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace test_hooks {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::Action;
using emakit::Creation;
using emakit::EmaHook;
using emakit::HookOptions;
using emakit::Recipe;
using emakit_test::bitwise_equal;
using emakit_test::TempDir;
using emakit_test::TinyNet;

namespace {

using Weights = std::map<std::string, torch::Tensor>;

Weights weights_of(const torch::nn::Module& m) { return emakit_test::model_snapshot(m); }
bool same(const Weights& a, const Weights& b) { return emakit_test::same_snapshot(a, b); }
Weights averages_of(const emakit::StateDict& averages) {
  Weights out;
  for (const auto& item : averages) out.emplace(item.key(), item.value().detach().clone());
  return out;
}
// The EMA's tensors as the model names them (ignoring nothing: the presets here hold every tensor).
bool model_holds(const torch::nn::Module& m, const emakit::StateDict& averages) {
  const Weights w = weights_of(m);
  for (const auto& item : averages)
    if (!bitwise_equal(w.at(item.key()), item.value().to(w.at(item.key()).scalar_type()))) return false;
  return true;
}

// A different architecture, for "a checkpoint of another model".
struct OtherNetImpl : torch::nn::Module {
  OtherNetImpl() {
    fc = register_module("fc", torch::nn::Linear(3, 5));
    head = register_module("head", torch::nn::Linear(5, 2));
  }
  torch::nn::Linear fc{nullptr}, head{nullptr};
};
TORCH_MODULE(OtherNet);

// A TinyNet with a Fixed(0.5) EMA in a hook, made at setup and trained for `steps` noisy steps.
struct Trained {
  TinyNet model;
  EmaHook hook;
  explicit Trained(int steps) {
    hook.add(*model, Recipe(emakit::Fixed(0.5)));
    hook.setup();
    train(steps);
  }
  void train(int steps) {
    for (int i = 0; i < steps; ++i) {
      emakit_test::perturb(*model);
      hook.after_optimizer_step();
    }
  }
  emakit::FixedEma& ema() { return hook.ema<emakit::FixedEma>("model"); }
};

}  // namespace

TEST_CASE("Hook: setup makes the EMA and each step updates it as a plain Ema would, vetoed steps too", "[hooks]") {
  torch::manual_seed(1);
  TinyNet model;
  EmaHook hook;
  hook.add(*model, Recipe(emakit::Fixed(0.75)));
  CHECK_FALSE(hook.created("model"));
  hook.setup();
  REQUIRE(hook.created("model"));
  emakit::FixedEma plain(*model, emakit::Fixed(0.75));  // made at the same moment, from the same weights

  const std::vector<bool> vetoes = {false, true, false, false, true, false};
  for (bool veto : vetoes) {
    emakit_test::perturb(*model);
    const auto results = hook.after_optimizer_step({.vetoed = veto});
    const auto expected = plain.update({.vetoed = veto});
    REQUIRE(results.size() == 1);
    CHECK(results[0].action == expected.action);
    CHECK(results[0].step == expected.step);
    CHECK(results[0].action == (veto ? Action::skipped : Action::averaged));
  }
  auto& ema = hook.ema<emakit::FixedEma>("model");
  CHECK(ema.num_updates() == 4);
  CHECK(ema.step() == 4);
  CHECK(same(averages_of(ema.averages()), averages_of(plain.averages())));
}

TEST_CASE("Hook: lazy creation at the first eligible step (nvalchemi EMAHook) uses no EMA before it", "[hooks]") {
  torch::manual_seed(2);
  TinyNet model;
  const emakit::NvalchemiEmaOptions o{.decay = 0.5, .update_every = 2, .start_step = 3};
  EmaHook hook;
  hook.add(*model, emakit::nvalchemi_ema_recipe(o), {.creation = Creation::at_first_eligible_step});
  hook.setup();
  CHECK_FALSE(hook.created("model"));
  REQUIRE_THROWS_WITH(hook.ema<emakit::FixedEma>("model"), Contains("no EMA yet") && Contains("first eligible step"));

  // A plain ema_hook Ema made at the start sees the same calls: the same decisions and numbers.
  auto plain = emakit::nvalchemi_ema(*model, o);
  struct Call {
    bool veto;
    bool created_after;
    Action action;
  };
  const std::vector<Call> calls = {
      {false, false, Action::skipped},  // step 1 < start_step
      {false, false, Action::skipped},  // step 2 < start_step
      {false, false, Action::skipped},  // step 3: 3 % 2 != 0
      {true, false, Action::skipped},   // vetoed: completes no step
      {false, true, Action::copied},    // step 4: first eligible, made here, copies
      {false, true, Action::skipped},   // step 5
      {false, true, Action::averaged},  // step 6
  };
  for (const auto& c : calls) {
    emakit_test::perturb(*model);
    const auto r = hook.after_optimizer_step({.vetoed = c.veto});
    const auto expected = plain.update({.vetoed = c.veto});
    CHECK(r[0].action == c.action);
    CHECK(expected.action == c.action);
    CHECK(r[0].step == expected.step);
    CHECK(hook.created("model") == c.created_after);
  }
  auto& ema = hook.ema<emakit::FixedEma>("model");
  CHECK(ema.step() == plain.step());
  CHECK(ema.calls() == plain.calls());
  CHECK(ema.num_updates() == 2);
  CHECK(same(averages_of(ema.averages()), averages_of(plain.averages())));
}

TEST_CASE("Hook: train_epoch_end() runs the epoch-end updates of Lightning's recipe, also making a lazy EMA",
          "[hooks]") {
  torch::manual_seed(3);
  TinyNet model;
  const emakit::LightningEmaWeightAveragingOptions o{
      .decay = 0.75, .update_every_n_steps = 2, .update_starting_at_step = 10, .update_starting_at_epoch = 1};
  EmaHook eager, lazy;
  eager.add(*model, emakit::lightning_ema_weight_averaging_recipe(o));
  lazy.add(*model, emakit::lightning_ema_weight_averaging_recipe(o), {.creation = Creation::at_first_eligible_step});
  eager.setup();
  lazy.setup();
  auto plain = emakit::lightning_ema_weight_averaging(*model, o);  // the preset, driven by hand
  int epoch_updates = 0;
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
    for (int b = 0; b < 3; ++b) {
      emakit_test::perturb(*model);
      const auto expected = plain.update();
      CHECK(eager.after_optimizer_step()[0].action == expected.action);
      CHECK(lazy.after_optimizer_step()[0].action == expected.action);
    }
    INFO("end of epoch " << epoch);
    const auto expected = plain.epoch_end(epoch);
    CHECK(expected.action == (epoch == 0 ? Action::skipped : epoch == 1 ? Action::copied : Action::averaged));
    CHECK(eager.train_epoch_end(epoch)[0].action == expected.action);
    CHECK(lazy.train_epoch_end(epoch)[0].action == expected.action);
    CHECK(lazy.created("model") == (epoch >= 1));  // no step was eligible (from step index 10): made at epoch 1's end
    epoch_updates += expected.action != Action::skipped ? 1 : 0;
  }
  CHECK(epoch_updates == 2);
  for (auto* hook : {&eager, &lazy}) {
    const auto& ema = hook->ema<emakit::FixedEma>("model");
    CHECK(ema.num_updates() == plain.num_updates());
    CHECK(ema.step() == plain.step());
    CHECK(ema.step() == 9);  // the optimizer steps only
    CHECK(same(averages_of(ema.averages()), averages_of(plain.averages())));
  }
  // Without epoch-end updates in its options, an EMA ignores the stage.
  EmaHook plain_hook;
  plain_hook.add(*model, Recipe(emakit::Fixed(0.75)));
  plain_hook.setup();
  CHECK(plain_hook.train_epoch_end(0)[0].action == Action::skipped);
  CHECK(plain_hook.ema<emakit::FixedEma>("model").num_updates() == 0);
}

TEST_CASE("Hook: an accumulation window updates once per window, at its first micro-batch (luxonis-train)", "[hooks]") {
  TinyNet model;
  EmaHook hook;
  hook.add(*model, emakit::luxonis_ema_callback_recipe({.decay = 0.9, .decay_tau = 10.0, .accumulate = 3}));
  hook.setup();
  std::vector<Action> actions;
  for (int call = 0; call < 7; ++call) {
    emakit_test::perturb(*model);
    actions.push_back(hook.after_optimizer_step()[0].action);
  }
  // batch_idx 0..6: updates where batch_idx % 3 == 0
  std::vector<std::string> names;
  for (Action a : actions) names.emplace_back(emakit::to_string(a));
  CHECK(names ==
        std::vector<std::string>{"averaged", "skipped", "skipped", "averaged", "skipped", "skipped", "averaged"});
  auto& ema = hook.ema<emakit::RampEma>("model");
  CHECK(ema.num_updates() == 3);
  CHECK(ema.step() == 3);
  // luxonis-train's ramp: d = decay * (1 - exp(-updates / tau)) at the third update
  CHECK(emakit_test::reported_decay_is(ema.decay(), 0.9 * (1.0 - std::exp(-3.0 / 10.0))));
}

TEST_CASE("Hook: validation and test run with the EMA weights and the model weights come back, also on an exception",
          "[hooks]") {
  torch::manual_seed(3);
  Trained t(3);
  TinyNet& model = t.model;
  EmaHook& hook = t.hook;
  const Weights online = weights_of(*model);
  auto& ema = hook.ema<emakit::FixedEma>("model");
  REQUIRE_FALSE(model_holds(*model, ema.averages()));

  {
    auto scope = hook.validation();
    CHECK(model_holds(*model, ema.averages()));
    REQUIRE_THROWS_WITH(hook.after_optimizer_step(), Contains("during validation") && Contains("validation_end"));
    REQUIRE_THROWS_WITH(hook.test_start(), Contains("during validation"));
  }
  CHECK(same(weights_of(*model), online));

  REQUIRE_THROWS_AS(
      [&] {
        auto scope = hook.test();
        CHECK(model_holds(*model, ema.averages()));
        throw std::runtime_error("evaluation failed");
      }(),
      std::runtime_error);
  CHECK(same(weights_of(*model), online));

  hook.validation_start();
  CHECK(model_holds(*model, ema.averages()));
  hook.validation_end();
  CHECK(same(weights_of(*model), online));
  REQUIRE_THROWS_WITH(hook.validation_end(), Contains("validation_end() without validation_start()"));
  hook.after_optimizer_step();  // training goes on after the stages
  CHECK(ema.num_updates() == 4);
}

TEST_CASE("Hook: validate_with_ema = false validates the online weights", "[hooks]") {
  torch::manual_seed(4);
  TinyNet model;
  EmaHook hook;
  hook.add(*model, Recipe(emakit::Fixed(0.5)), {.validate_with_ema = false});
  hook.setup();
  emakit_test::perturb(*model);
  hook.after_optimizer_step();
  const Weights online = weights_of(*model);
  {
    auto scope = hook.validation();
    CHECK(same(weights_of(*model), online));
  }
  {
    auto scope = hook.test();  // test_with_ema is still on
    CHECK(model_holds(*model, hook.ema<emakit::FixedEma>("model").averages()));
  }
}

TEST_CASE("Hook: at train end the model keeps the EMA weights, unless told otherwise", "[hooks]") {
  for (bool keep : {true, false}) {
    torch::manual_seed(5);
    TinyNet model;
    EmaHook hook;
    hook.add(*model, Recipe(emakit::Fixed(0.5)), {.keep_ema_at_train_end = keep});
    hook.setup();
    for (int i = 0; i < 2; ++i) {
      emakit_test::perturb(*model);
      hook.after_optimizer_step();
    }
    const Weights online = weights_of(*model);
    hook.train_end();
    CHECK(model_holds(*model, hook.ema<emakit::FixedEma>("model").averages()) == keep);
    CHECK(same(weights_of(*model), online) == !keep);
  }
}

TEST_CASE("Hook: the publish callback gets the EMA after each update that changed it", "[hooks]") {
  using M = emakit::ModuleEma<emakit_test::TinyNetImpl>;
  TinyNet model;
  EmaHook hook;
  std::vector<std::int64_t> seen;
  torch::Tensor published_weight;
  hook.add(*model,
           Recipe<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<emakit_test::TinyNetImpl>>(
               emakit::Fixed(0.5), emakit::StepSchedule().update_every(2)),
           {}, [&](const M& ema) {
             seen.push_back(ema.num_updates());
             published_weight = ema.module()->fc->weight.detach().clone();  // the EMA module, callable
           });
  hook.setup();
  for (int i = 0; i < 5; ++i) {
    emakit_test::perturb(*model);
    hook.after_optimizer_step();
  }
  CHECK(seen == std::vector<std::int64_t>{1, 2});  // steps 2 and 4
  CHECK(bitwise_equal(published_weight, hook.ema<M>("model").average("fc.weight")));
}

TEST_CASE("Hook: several models by key, each with its own policies", "[hooks]") {
  torch::manual_seed(6);
  TinyNet generator, discriminator;
  EmaHook hook;
  hook.add("generator", *generator, Recipe(emakit::Fixed(0.5)));
  hook.add("discriminator", *discriminator, Recipe(emakit::ExponentialRamp(0.9, 2.0)),
           {.creation = Creation::at_first_eligible_step});
  CHECK(hook.keys() == std::vector<std::string>{"generator", "discriminator"});
  hook.setup();
  CHECK(hook.created("generator"));
  CHECK_FALSE(hook.created("discriminator"));
  emakit_test::perturb(*generator);
  emakit_test::perturb(*discriminator);
  const auto r = hook.after_optimizer_step();
  REQUIRE(r.size() == 2);
  CHECK(r[0].decay == 0.5);                // 1 - (1 - 0.5): exact
  CHECK(r[1].action == Action::averaged);  // Warmup::none: made as a copy at this step, then averaged
  CHECK(emakit_test::reported_decay_is(hook.ema<emakit::RampEma>("discriminator").decay(), 0.9 * (1 - std::exp(-0.5))));
  REQUIRE_THROWS_WITH(hook.ema<emakit::RampEma>("generator"), Contains("another type"));
  // Whatever its policies, a model's EMA is an EmaBase: the same object as the typed one.
  CHECK(&hook.ema<emakit::EmaBase>("discriminator") == &hook.ema<emakit::RampEma>("discriminator"));
  CHECK(hook.ema<emakit::EmaBase>("generator").decay() == 0.5);
  REQUIRE_THROWS_WITH(hook.ema<emakit::FixedEma>("critic"), Contains("no model 'critic'"));
  REQUIRE_THROWS_WITH(hook.add("generator", *generator, Recipe(emakit::Fixed(0.5))), Contains("already"));
  REQUIRE_THROWS_WITH(hook.add("gen.ema", *generator, Recipe(emakit::Fixed(0.5))), Contains("'gen.ema'"));
  REQUIRE_THROWS_WITH(hook.add("emakit_hook", *generator, Recipe(emakit::Fixed(0.5))), Contains("emakit_hook"));
  REQUIRE_THROWS_WITH(hook.add("second", *generator, Recipe(emakit::Fixed(0.9))),
                      Contains("same module as model 'generator'"));
  hook.add("second", *generator, Recipe(emakit::Fixed(0.9)), {.validate_with_ema = false, .test_with_ema = false});
}

namespace {

// A seeded training run of `total` steps with SGD + momentum, an EMA hook with lazy creation,
// update_every 3 and a veto every 7th step; interrupted after `stop_at` steps (0: never) and
// resumed from a checkpoint file by fresh objects, as a new process would.
struct RunResult {
  Weights model, ema;
  std::int64_t step, num_updates, calls;
};

RunResult train(int total, int stop_at, const std::filesystem::path& dir) {
  const auto recipe = emakit::nvalchemi_ema_recipe({.decay = 0.8, .update_every = 3, .start_step = 4});
  const HookOptions options{.creation = Creation::at_first_eligible_step};
  auto make = [&](TinyNet& model, std::unique_ptr<torch::optim::SGD>& opt, std::unique_ptr<EmaHook>& hook) {
    torch::manual_seed(7);
    model = TinyNet();
    opt = std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    hook = std::make_unique<EmaHook>();
    hook->add(*model, recipe, options);
    hook->setup();
  };
  TinyNet model{nullptr};
  std::unique_ptr<torch::optim::SGD> opt;
  std::unique_ptr<EmaHook> hook;
  make(model, opt, hook);
  for (int step = 1; step <= total; ++step) {
    torch::manual_seed(1000 + step);  // the data of a step depends on the step only
    const auto x = torch::randn({8, 3});
    const auto y = torch::randn({8, 4});
    opt->zero_grad();
    torch::nn::functional::mse_loss(model->forward(x), y).backward();
    opt->step();
    hook->after_optimizer_step({.vetoed = step % 7 == 0});
    if (step == stop_at) {
      torch::serialize::OutputArchive archive;
      hook->save_checkpoint(archive);
      torch::serialize::OutputArchive opt_archive;
      opt->save(opt_archive);
      archive.write("optimizer", opt_archive);
      archive.save_to((dir / "ckpt.pt").string());
      // A new process: fresh model, optimizer and hook, then the checkpoint.
      make(model, opt, hook);
      torch::serialize::InputArchive in;
      in.load_from((dir / "ckpt.pt").string());
      hook->load_checkpoint(in);
      torch::serialize::InputArchive opt_in;
      in.read("optimizer", opt_in);
      opt->load(opt_in);
    }
  }
  auto& ema = hook->ema<emakit::FixedEma>("model");
  return {weights_of(*model), averages_of(ema.averages()), ema.step(), ema.num_updates(), ema.calls()};
}

}  // namespace

TEST_CASE("Hook: an interrupted and resumed run gives bitwise the EMA of an uninterrupted one", "[hooks]") {
  TempDir dir;
  const RunResult whole = train(30, 0, dir.path);
  // Calls 7, 14, 21, 28 are vetoed, so the 30 calls complete steps 1..26; steps 6, 9, ..., 24 update
  // (from start_step 4, every 3rd), the first (step 6, call 6) copies.
  CHECK(whole.num_updates == 7);
  CHECK(whole.step == 26);
  // Interrupted before the EMA exists (call 3), after a call that did not update (call 11, step 10)
  // and after one that did (call 13, step 12).
  for (int stop_at : {3, 11, 13}) {
    INFO("interrupted after step " << stop_at);
    const RunResult resumed = train(30, stop_at, dir.path);
    CHECK(same(resumed.model, whole.model));
    CHECK(same(resumed.ema, whole.ema));
    CHECK(resumed.step == whole.step);
    CHECK(resumed.calls == whole.calls);
    CHECK(resumed.num_updates == whole.num_updates);
  }
}

TEST_CASE("Hook: a checkpoint holds the EMA weights as the model's, and the online ones for resuming", "[hooks]") {
  TempDir dir;
  torch::manual_seed(8);
  Trained t(3);
  TinyNet& model = t.model;
  EmaHook& hook = t.hook;
  const auto file = dir.path / "hook.pt";
  hook.save_checkpoint(file);
  const Weights ema_weights = averages_of(hook.ema<emakit::FixedEma>("model").averages());
  emakit_test::perturb(*model);  // training goes on: the file does not change
  hook.after_optimizer_step();

  TinyNet deployed;
  emakit::load_weights(*deployed, file);
  CHECK(same(weights_of(*deployed), ema_weights));
  // And Module::load of the "model" sub-archive, what torch::load would do.
  TinyNet plain;
  torch::serialize::InputArchive in, sub;
  in.load_from(file.string());
  in.read("model", sub);
  plain->load(sub);
  CHECK(same(weights_of(*plain), ema_weights));

  // checkpoint_ema_weights = false: the model weights are the online ones.
  TinyNet model2;
  EmaHook hook2;
  hook2.add(*model2, Recipe(emakit::Fixed(0.5)), {.checkpoint_ema_weights = false});
  hook2.setup();
  emakit_test::perturb(*model2);
  hook2.after_optimizer_step();
  hook2.save_checkpoint(dir.path / "online.pt");
  TinyNet deployed2;
  emakit::load_weights(*deployed2, dir.path / "online.pt");
  CHECK(same(weights_of(*deployed2), weights_of(*model2)));
}

TEST_CASE("Hook: a checkpoint loaded before the EMA exists is kept and applied when it is made", "[hooks]") {
  TempDir dir;
  torch::manual_seed(9);
  Trained t(4);
  TinyNet& model = t.model;
  EmaHook& hook = t.hook;
  hook.save_checkpoint(dir.path / "a.pt");
  const auto& saved = hook.ema<emakit::FixedEma>("model");
  const Weights saved_avg = averages_of(saved.averages());
  const Weights online = weights_of(*model);

  TinyNet fresh;
  EmaHook later;
  later.add(*fresh, Recipe(emakit::Fixed(0.5)));
  later.load_checkpoint(dir.path / "a.pt");  // before setup(): nothing to load into yet
  CHECK_FALSE(later.created("model"));
  CHECK(same(weights_of(*fresh), online));  // the online weights are back at once
  later.setup();
  REQUIRE(later.created("model"));
  auto& ema = later.ema<emakit::FixedEma>("model");
  CHECK(same(averages_of(ema.averages()), saved_avg));
  CHECK(ema.num_updates() == 4);
  CHECK(ema.step() == 4);
}

TEST_CASE("Hook: loading a checkpoint of another model or config fails naming the mismatch and loads nothing",
          "[hooks]") {
  TempDir dir;
  torch::manual_seed(10);
  OtherNet other;
  EmaHook other_hook;
  other_hook.add(*other, Recipe(emakit::Fixed(0.5)));
  other_hook.setup();
  other_hook.save_checkpoint(dir.path / "other.pt");

  Trained t(1);
  TinyNet& model = t.model;
  EmaHook& hook = t.hook;
  const Weights before = weights_of(*model);
  const Weights avg_before = averages_of(hook.ema<emakit::FixedEma>("model").averages());
  auto unchanged = [&] {
    CHECK(same(weights_of(*model), before));
    CHECK(same(averages_of(hook.ema<emakit::FixedEma>("model").averages()), avg_before));
    CHECK(hook.ema<emakit::FixedEma>("model").num_updates() == 1);
  };

  REQUIRE_THROWS_WITH(
      hook.load_checkpoint(dir.path / "other.pt"),
      Contains("not of this model") && Contains("'fc.weight' has shape [5, 3] in the checkpoint, [4, 3]"));
  unchanged();
  REQUIRE_THROWS_WITH(emakit::load_weights(*model, dir.path / "other.pt"), Contains("fc.weight"));
  unchanged();

  // Same model, another decay: the config check names the field.
  TinyNet same_arch;
  EmaHook other_config;
  other_config.add(*same_arch, Recipe(emakit::Fixed(0.7)));
  other_config.setup();
  other_config.save_checkpoint(dir.path / "config.pt");
  REQUIRE_THROWS_WITH(hook.load_checkpoint(dir.path / "config.pt"), Contains("beta"));
  unchanged();

  // A checkpoint with another model beside this one, a missing file, an archive without hook state.
  EmaHook two;
  TinyNet t_model, s_model;
  two.add(*t_model, Recipe(emakit::Fixed(0.5)));
  two.add("student", *s_model, Recipe(emakit::Fixed(0.5)));
  two.setup();
  emakit_test::perturb(*t_model);
  two.after_optimizer_step();
  two.save_checkpoint(dir.path / "two.pt");
  REQUIRE_THROWS_WITH(hook.load_checkpoint(dir.path / "two.pt"), Contains("model 'student'"));
  unchanged();
  REQUIRE_THROWS_WITH(hook.load_checkpoint(dir.path / "nope.pt"), Contains("nope.pt"));
  torch::save(model, (dir.path / "plain.pt").string());
  REQUIRE_THROWS_WITH(hook.load_checkpoint(dir.path / "plain.pt"), Contains("no 'emakit_hook'"));
  unchanged();

  // Lenient: the extra model is warned about and ignored, the rest is loaded.
  {
    emakit_test::WarningCapture warnings;
    hook.load_checkpoint(dir.path / "two.pt", emakit::LoadMode::lenient);
    CHECK(warnings.messages.size() == 1);
    CHECK_THAT(warnings.messages.at(0), Contains("'student'"));
  }
  CHECK(same(weights_of(*model), weights_of(*t_model)));
  CHECK(same(averages_of(hook.ema<emakit::FixedEma>("model").averages()),
             averages_of(two.ema<emakit::FixedEma>("model").averages())));
  // Lenient with another architecture: every mismatch warned about, the model keeps its values.
  const Weights now = weights_of(*model);
  const Weights avg_now = averages_of(hook.ema<emakit::FixedEma>("model").averages());
  {
    emakit_test::WarningCapture warnings;
    hook.load_checkpoint(dir.path / "other.pt", emakit::LoadMode::lenient);
    CHECK(warnings.messages.size() >= 4);
    CHECK_THAT(warnings.messages.at(0), Contains("fc.weight"));
  }
  CHECK(same(weights_of(*model), now));
  CHECK(same(averages_of(hook.ema<emakit::FixedEma>("model").averages()), avg_now));
}

TEST_CASE("Hook: a loaded EMA state is aligned to the EMA's dtype", "[hooks]") {
  TempDir dir;
  torch::manual_seed(11);
  Trained t(1);
  t.hook.save_checkpoint(dir.path / "f32.pt");
  const Weights saved = averages_of(t.ema().averages());

  TinyNet wide;
  emakit_test::cast_floats(*wide, torch::kDouble);
  EmaHook wide_hook;
  wide_hook.add(*wide, Recipe(emakit::Fixed(0.5)));
  wide_hook.setup();
  wide_hook.load_checkpoint(dir.path / "f32.pt");
  const auto& avg = wide_hook.ema<emakit::FixedEma>("model").average("fc.weight");
  CHECK(avg.scalar_type() == torch::kDouble);
  CHECK(bitwise_equal(avg, saved.at("fc.weight").to(torch::kDouble)));
  CHECK(wide->fc->weight.scalar_type() == torch::kDouble);
}

namespace {

// The lines of the first ```cpp block of a Markdown file from the first line holding `first` to
// the next holding `last`, with their // comments dropped; empty if there is no such range.
std::string doc_example(const std::filesystem::path& file, const std::string& first, const std::string& last) {
  std::ifstream in(file);
  std::string line, out;
  bool in_block = false, inside = false;
  while (std::getline(in, line)) {
    if (!in_block) {
      in_block = line == "```cpp";
      continue;
    }
    if (line == "```") break;
    if (!inside && line.find(first) == std::string::npos) continue;
    inside = true;
    const auto comment = line.find("//");
    out += line.substr(0, comment) + "\n";
    if (line.find(last) != std::string::npos) return out;
  }
  return {};
}

// The working folder for its lifetime (the example writes "last.pt" where it runs).
struct WorkingFolder {
  std::filesystem::path previous = std::filesystem::current_path();
  explicit WorkingFolder(const std::filesystem::path& p) { std::filesystem::current_path(p); }
  ~WorkingFolder() { std::filesystem::current_path(previous); }
};

}  // namespace

// Runs the code and keeps its text (the preprocessor's spelling, compared squeezed) in `text`.
#define EMAKIT_EXAMPLE(text, ...) \
  text = #__VA_ARGS__;            \
  __VA_ARGS__

TEST_CASE("Hook: the example of docs/hooks.md compiles and does what it says", "[hooks]") {
  // The example's hook calls are written here once, run, and their text compared with the page's
  // (its comments dropped): an edit to either fails here. The model, optimizer and step count
  // around them are this test's (a smaller run).
  const std::string page =
      doc_example(emakit_test::repo_file("docs/hooks.md"), "emakit::EmaHook hook;", "hook.train_end();");
  REQUIRE_FALSE(page.empty());
  TempDir dir;
  WorkingFolder here(dir.path);
  torch::manual_seed(12);
  TinyNet model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  auto train_step = [](TinyNet& m, torch::optim::SGD& opt) {
    opt.zero_grad();
    m->forward(torch::randn({4, 3})).pow(2).mean().backward();
    opt.step();
  };
  int validations = 0;
  auto validate = [&](TinyNet&) { ++validations; };
  const std::int64_t steps = 2000;
  const bool scaler_skipped_step = false;

  std::string text;
  EMAKIT_EXAMPLE(
      text, emakit::EmaHook hook; hook.add(*model, emakit::Recipe(emakit::Fixed(0.999))); hook.setup();
      for (std::int64_t step = 1; step <= steps; ++step) {
        train_step(model, optimizer);
        hook.after_optimizer_step({.vetoed = scaler_skipped_step});
        if (step % 1000 == 0) {
          {
            auto scope = hook.validation();
            validate(model);
          }
          hook.save_checkpoint("last.pt");
        }
      } hook.train_end();)
  CHECK(emakit_test::squeeze_code(text) == emakit_test::squeeze_code(page));

  CHECK(validations == steps / 1000);
  auto& ema = hook.ema<emakit::FixedEma>("model");
  CHECK(ema.decay_policy() == emakit::Fixed(0.999));
  CHECK(ema.num_updates() == steps);
  CHECK(model_holds(*model, ema.averages()));
  TinyNet deployed;
  emakit::load_weights(*deployed, dir.path / "last.pt");
  CHECK(same(weights_of(*deployed), averages_of(ema.averages())));  // saved at the last step
}

#undef EMAKIT_EXAMPLE

TEST_CASE("Hook: a truncated or bit-flipped checkpoint file is an error naming it, and nothing is loaded", "[hooks]") {
  TempDir dir;
  torch::manual_seed(13);
  Trained t(1);
  TinyNet& model = t.model;
  EmaHook& hook = t.hook;
  const auto good = dir.path / "good.pt";
  hook.save_checkpoint(good);
  const Weights model_good = weights_of(*model);
  const Weights avg_good = averages_of(hook.ema<emakit::FixedEma>("model").averages());
  emakit_test::perturb(*model);
  hook.after_optimizer_step();
  Weights model_now = weights_of(*model);
  Weights avg_now = averages_of(hook.ema<emakit::FixedEma>("model").averages());
  auto state_is = [&](const Weights& m, const Weights& a) {
    return same(weights_of(*model), m) && same(averages_of(hook.ema<emakit::FixedEma>("model").averages()), a);
  };

  const auto truncated = dir.path / "truncated.pt";
  const std::string bytes = emakit_test::read_bytes(good);
  emakit_test::write_bytes(truncated, bytes.substr(0, bytes.size() / 2));
  REQUIRE_THROWS_WITH(hook.load_checkpoint(truncated), Contains("truncated.pt") && Contains("truncated or damaged"));
  CHECK(state_is(model_now, avg_now));

  // One flipped byte at many places: either the load fails naming the file and changes nothing,
  // or it succeeds and loads exactly the good file's values (the flip hit bytes no record reads).
  // Never a silently different model or EMA.
  int failed = 0, tried = 0;
  for (const auto& [file, at] : emakit_test::flipped_copies(good, dir.path)) {
    ++tried;
    INFO("byte " << at << " of " << bytes.size());
    bool loaded = true;
    try {
      hook.load_checkpoint(file);
    } catch (const std::invalid_argument& e) {
      loaded = false;
      ++failed;
      CHECK_THAT(e.what(), Contains(file.filename().string()));
    }
    if (loaded) {
      CHECK(state_is(model_good, avg_good));
      model_now = model_good;
      avg_now = avg_good;
    } else {
      CHECK(state_is(model_now, avg_now));
    }
  }
  CHECK(tried >= 40);
  // Many bytes of a file are zip headers, 64-byte alignment padding and records nothing reads
  // (17 of 41 flips failed when this was written); every flip into tensor data or the state's
  // structure must fail, which the per-flip checks above hold for.
  CHECK(failed >= tried / 4);
}

TEST_CASE("Hook: a side-stream EMA is waited for before the optimizer step, or right after the update",
          "[hooks][sync]") {
  // Without before_optimizer_step() the hook waits right after each update (safe, no overlap);
  // once the trainer calls it, the wait happens there, before the step writes the model.
  torch::manual_seed(9);
  TinyNet model;
  EmaHook hook;
  hook.add(*model, Recipe(emakit::Fixed(0.9), emakit::StepSchedule(), emakit::EmaOptions().side_stream(true)));
  hook.setup();
  auto& counts = emakit::detail::testing::sync_counts();
  auto waits = counts.waits;
  hook.after_optimizer_step();
  CHECK(counts.waits == waits + 1);  // waited right after the update

  hook.before_optimizer_step();
  CHECK(counts.waits == waits + 2);
  waits = counts.waits;
  emakit_test::perturb(*model);
  hook.after_optimizer_step();
  CHECK(counts.waits == waits);  // left to before_optimizer_step()
  hook.before_optimizer_step();
  CHECK(counts.waits == waits + 1);

  // The same averages as a plain Ema, whichever way it waited.
  torch::manual_seed(9);
  TinyNet twin;
  emakit::FixedEma plain(*twin, emakit::Fixed(0.9));
  plain.update();
  emakit_test::perturb(*twin);
  plain.update();
  CHECK(same(averages_of(plain.averages()), averages_of(hook.ema<emakit::FixedEma>("model").averages())));
}

TEST_CASE("Hook: a checkpoint of another config is refused also before the EMA is made, and nothing loads",
          "[hooks][errors]") {
  torch::manual_seed(10);
  TempDir dir;
  TinyNet saved_model;
  EmaHook saver;
  saver.add(*saved_model, Recipe(emakit::Fixed(0.85)));
  saver.setup();
  saver.after_optimizer_step();
  saver.save_checkpoint(dir.path / "a.pt");

  TinyNet model;
  const Weights before = weights_of(*model);
  EmaHook hook;  // its EMA is made at the first eligible step: the state would be pending
  hook.add(*model, Recipe(emakit::Fixed(0.9)), {.creation = Creation::at_first_eligible_step});
  CHECK_THROWS_WITH(hook.load_checkpoint(dir.path / "a.pt"),
                    Contains("config.decay.beta") && Contains("0.85") && Contains("0.9"));
  CHECK(same(weights_of(*model), before));  // the model's weights were not loaded either
  EmaHook other_buffers;
  other_buffers.add(
      *model,
      Recipe(emakit::Fixed(0.85), emakit::StepSchedule(), emakit::EmaOptions().buffers(emakit::TensorMode::copy)),
      {.creation = Creation::at_first_eligible_step});
  CHECK_THROWS_WITH(other_buffers.load_checkpoint(dir.path / "a.pt"), Contains("config.options.buffers"));
  CHECK(same(weights_of(*model), before));
}

#undef EMAKIT_EXAMPLE

}  // namespace test_hooks
