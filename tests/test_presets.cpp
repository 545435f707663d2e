// Presets for the Python peers, their options, and the README's migration table (which must
// compile: it is written out here). Numerical equality with the real packages is checked by the
// conformance tests (tests/conformance/).
#include <emakit/emakit.hpp>
#include <emakit/interop.hpp>
#include <emakit/jit.hpp>

#include "helpers.hpp"

#include <filesystem>

#include <catch2/catch.hpp>

using Catch::Matchers::Contains;
using emakit::Action;
using emakit_test::TinyNet;

TEST_CASE("The README's migration table compiles and makes the EMA it says", "[presets]") {
  TinyNet model;
  // ema_pytorch.EMA(model, beta=0.9999, update_after_step=100, update_every=10)
  auto a = emakit::ema_pytorch(*model, {.beta = 0.9999, .update_after_step = 100, .update_every = 10});
  // timm ModelEmaV3(model, decay=0.9998, use_warmup=True); ema.update(model, step=step)
  auto b = emakit::timm_model_ema_v3(*model, {.decay = 0.9998, .use_warmup = true});
  b.update({.step = 1});
  // AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
  auto c = emakit::averaged_model_ema(*model, {.decay = 0.999, .use_buffers = true});
  // AveragedModel(model)   (SWA)
  auto d = emakit::averaged_model_swa(*model);
  // EMAHook(decay=0.999, update_every=2, start_step=100); hook(ctx, AFTER_OPTIMIZER_STEP, will_skip)
  auto e = emakit::ema_hook(*model, {.decay = 0.999, .update_every = 2, .start_step = 100});
  e.update({.vetoed = true});
  // luxonis-train ModelEma(model, decay=0.9999, decay_tau=2000)
  auto f = emakit::luxonis_model_ema(*model, {.decay = 0.9999, .decay_tau = 2000});
  // nvalchemi EMAHook registered with a trainer: lazy creation, pending state, config check
  emakit::EmaHook hook;
  hook.add(*model, emakit::ema_hook_recipe({.decay = 0.999, .start_step = 100}),
           {.creation = emakit::Creation::at_first_eligible_step});
  hook.after_optimizer_step({.vetoed = true});
  // luxonis-train EMACallback(decay=0.5, decay_tau=2000), accumulate_grad_batches=4
  TinyNet other;
  emakit::EmaHook callback;
  callback.add(*other, emakit::luxonis_ema_callback_recipe({.decay = 0.5, .decay_tau = 2000, .accumulate = 4}));
  callback.setup();

  CHECK(a.decay_policy() == emakit::InversePowerWarmup(0.9999).update_after_step(100).single_precision(true));
  CHECK(a.schedule() == emakit::StepSchedule()
                            .warmup(emakit::Warmup::copy_before_start)
                            .start_step(102)
                            .update_every(10)
                            .every_offset(1));
  CHECK(b.decay_policy().warmup());
  CHECK(c.decay_policy() == emakit::Fixed(0.999));
  CHECK(d.schedule().warmup() == emakit::Warmup::skip_before_start);
  CHECK(e.schedule().start_step() == 100);
  CHECK(e.step() == 0);  // the vetoed step completed nothing
  CHECK(f.decay_policy() == emakit::ExponentialRamp(0.9999, 2000));
  CHECK_FALSE(hook.created("model"));  // nothing eligible yet: no EMA, no memory
  CHECK(callback.ema<emakit::RampEma>("model").decay_policy() == emakit::ExponentialRamp(0.5, 2000));
  CHECK(callback.ema<emakit::RampEma>("model").schedule().accumulate() == 4);
}

TEST_CASE("ema-pytorch preset: integers untouched, ignored names follow copies only", "[presets]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 1.0);
  auto ema = emakit::ema_pytorch(*model, {.beta = 0.5, .update_after_step = 0, .update_every = 1,
                                          .ignore_names = {"scale"}});
  CHECK(ema.names(emakit::Role::follow_copies) == std::vector<std::string>{"scale"});
  CHECK_THROWS_WITH(ema.average("bn.num_batches_tracked"), Contains("no tensor"));
  emakit_test::fill_floats(*model, 3.0);
  CHECK(ema.update().action == Action::copied);  // the first update copies, ignored names too
  CHECK(torch::equal(ema.average("scale"), torch::full({4}, 3.0)));
  emakit_test::fill_floats(*model, 5.0);
  CHECK(ema.update().action == Action::averaged);
  CHECK(torch::equal(ema.average("scale"), torch::full({4}, 3.0)));  // not averaged, not copied
}

TEST_CASE("Presets keep the model's dtype, as their peers do, emakit's default does not", "[presets][precision]") {
  TinyNet model;
  emakit_test::cast_floats(*model, torch::kBFloat16);
  CHECK(emakit::ema_pytorch(*model).average("fc.weight").scalar_type() == torch::kBFloat16);
  CHECK(emakit::averaged_model_ema(*model).average("fc.weight").scalar_type() == torch::kBFloat16);
  CHECK(emakit::timm_model_ema_v3(*model, {.dtype = torch::kFloat}).average("fc.weight").scalar_type() ==
        torch::kFloat);
  CHECK(emakit::FixedEma(*model).average("fc.weight").scalar_type() == torch::kFloat);
}

TEST_CASE("Switch EMA pulls the model towards the average on its steps", "[presets][options]") {
  auto w = torch::zeros({2});
  emakit::FixedEma ema({{"w", w, false}}, emakit::Fixed(0.5), {}, emakit::EmaOptions().switch_model(2, 0.25));
  w.fill_(4.0);
  ema.update();  // step 1: ema 2, no switch
  CHECK(torch::equal(w, torch::full({2}, 4.0)));
  ema.update();  // step 2: ema 3, then model = lerp(4, 3, 0.75) = 3.25
  CHECK(torch::equal(ema.average("w"), torch::full({2}, 3.0)));
  CHECK(torch::allclose(w, torch::full({2}, 3.25)));
  ema.switch_model(0.0);
  CHECK(torch::equal(w, torch::full({2}, 3.0)));
  CHECK_THROWS_WITH(emakit::EmaOptions().switch_model(2, 1.0), Contains("beta") && Contains("1"));
  CHECK_THROWS_WITH(emakit::EmaOptions().switch_model(-1), Contains("-1"));
  CHECK_THROWS_WITH(emakit::EmaOptions().non_floating(emakit::BufferMode::average), Contains("copy or ignore"));
}

TEST_CASE("A TorchScript module is a source like any other", "[presets][jit]") {
  torch::jit::Module scripted("Scripted");
  scripted.register_parameter("weight", torch::ones({3}), false);
  scripted.register_buffer("steps", torch::zeros({}, torch::kLong));
  emakit::FixedEma ema(emakit::tensors_of(scripted), emakit::Fixed(0.5));
  scripted.attr("weight").toTensor().fill_(3.0);
  scripted.attr("steps").toTensor().fill_(4);
  ema.update();
  CHECK(torch::equal(ema.average("weight"), torch::full({3}, 2.0)));
  CHECK(ema.average("steps").item<std::int64_t>() == 4);
}

TEST_CASE("An export round trip through the Python file format is exact", "[presets][interop]") {
  torch::manual_seed(9);
  TinyNet model;
  auto a = emakit::averaged_model_ema(*model, {.decay = 0.9});
  for (int i = 0; i < 4; ++i) {
    emakit_test::perturb(*model);
    a.update();
  }
  const auto path = (std::filesystem::temp_directory_path() / "emakit_presets_export.pt").string();
  emakit::export_state(a, emakit::Peer::averaged_model, path);
  auto b = emakit::averaged_model_ema(*model, {.decay = 0.9});
  CHECK(emakit::import_state(b, emakit::Peer::averaged_model, path).clean());
  std::filesystem::remove(path);
  for (const auto& item : a.averages()) CHECK(torch::equal(item.value(), b.average(item.key())));
  CHECK(b.num_updates() == 4);
}
