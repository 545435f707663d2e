// Presets for the Python peers, their options, and the migration table of
// docs/coming-from-python.md (its code is written out here, compiled, and compared with the page). Numerical equality
// with the real packages is checked by the conformance tests (tests/conformance/).
#include <emakit/emakit.hpp>
#include <emakit/interop.hpp>
#include <emakit/jit.hpp>

#include "helpers.hpp"

#include <c10/core/GradMode.h>
#include <torch/data.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/functional/instancenorm.h>  // before the module, which LibTorch 1.13 does not include it in
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace test_presets {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::Action;
using emakit_test::TinyNet;

namespace {

// The rows of the migration table in docs/coming-from-python.md (the table under "| Python |
// emakit |"): per row, the Python cell's code spans and the emakit cell's code spans joined by a
// space.
struct TableRow {
  std::vector<std::string> python;
  std::string cpp;
};
std::vector<TableRow> migration_table() {
  std::ifstream in(emakit_test::repo_file("docs/coming-from-python.md"));
  std::vector<TableRow> rows;
  std::string line;
  bool inside = false;
  auto spans = [](const std::string& cell) {
    std::vector<std::string> out;
    for (std::size_t at = cell.find('`'); at != std::string::npos; at = cell.find('`', at)) {
      const auto close = cell.find('`', at + 1);
      if (close == std::string::npos) break;
      out.push_back(cell.substr(at + 1, close - at - 1));
      at = close + 1;
    }
    return out;
  };
  while (std::getline(in, line)) {
    if (line.rfind("| Python | emakit |", 0) == 0) {
      inside = true;
      continue;
    }
    if (!inside || line.rfind("|---", 0) == 0) continue;
    if (line.rfind("| ", 0) != 0) break;  // the table's end
    const auto mid = line.find(" | ", 2);
    REQUIRE(mid != std::string::npos);
    TableRow row{spans(line.substr(2, mid - 2)), ""};
    for (const auto& code : spans(line.substr(mid + 3))) row.cpp += (row.cpp.empty() ? "" : " ") + code;
    rows.push_back(std::move(row));
  }
  return rows;
}

// The numbers of a Python snippet: keyword arguments ("EMA(model, beta=0.9999, update_every=10)"
// -> {beta: 0.9999, update_every: 10}; True/False -> 1/0) and the single arguments of calls
// ("get_ema_multi_avg_fn(0.999)" -> {get_ema_multi_avg_fn: 0.999}).
std::map<std::string, double> python_kwargs(const std::string& call) {
  std::map<std::string, double> out;
  static const std::regex kwarg(R"(([A-Za-z_]+)[=(]([-+0-9.eE]+|True|False)(?=[,)]|$))");
  for (auto it = std::sregex_iterator(call.begin(), call.end(), kwarg); it != std::sregex_iterator(); ++it) {
    const std::string value = (*it)[2];
    out[(*it)[1]] = value == "True" ? 1.0 : value == "False" ? 0.0 : std::stod(value);
  }
  return out;
}

}  // namespace

// Runs the code and keeps its text (the preprocessor's spelling, compared squeezed) in `text`.
#define EMAKIT_ROW(text, ...) \
  text = #__VA_ARGS__;        \
  __VA_ARGS__

TEST_CASE("The migration table of docs/coming-from-python.md compiles and makes the EMA its Python column says",
          "[presets]") {
  // Each row's emakit code is written here once, run, and its text compared with the table's; the
  // numbers the checks expect are read from the table's Python column. An edit to the table, to
  // this code or to a preset fails here.
  const auto rows = migration_table();
  REQUIRE(rows.size() == 13);
  std::vector<std::string> code(rows.size());
  const std::int64_t step = 1;
  const bool will_skip = true;
  auto py = [&](std::size_t row, const std::string& key) {
    const auto args = python_kwargs(rows[row].python.at(0));
    INFO("row " << row << " (" << rows[row].python.at(0) << ") has no " << key);
    REQUIRE(args.count(key) == 1);
    return args.at(key);
  };
  auto whole = [](double v) { return static_cast<std::int64_t>(v); };
  {
    TinyNet model;
    EMAKIT_ROW(code[0],
               auto ema = emakit::ema_pytorch(*model, {.beta = 0.9999, .update_after_step = 100, .update_every = 10});)
    CHECK(ema.decay_policy() == emakit::InversePowerWarmup(py(0, "beta"))
                                    .update_after_step(whole(py(0, "update_after_step")))
                                    .single_precision(true));
    CHECK(ema.schedule() == emakit::StepSchedule()
                                .warmup(emakit::Warmup::copy_before_start)
                                .start_step(whole(py(0, "update_after_step")) + 2)
                                .update_every(whole(py(0, "update_every")))
                                .every_offset(1));
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::fused_lerp);  // lerp_ (torch's, fused)
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[1], auto ema = emakit::timm_model_ema_v3(*model, {.decay = 0.9998, .use_warmup = true});
               ema.update({.step = step});)
    CHECK(ema.decay_policy() == emakit::InversePowerWarmup(py(1, "decay")).warmup(py(1, "use_warmup") == 1.0));
    CHECK(ema.step() == step);
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::fused_lerp);  // _foreach_lerp_
  }
  {
    TinyNet model;
    emakit_test::cast_floats(*model, torch::kBFloat16);
    EMAKIT_ROW(code[2], emakit::FixedEma ema(
                            *model, emakit::Fixed(0.9), {},
                            emakit::EmaOptions().keep_model_dtype(true).arithmetic(emakit::Arithmetic::fused_lerp));)
    CHECK(ema.decay_policy() == emakit::Fixed(py(2, "decay")));
    CHECK(ema.average("fc.weight").scalar_type() == torch::kBFloat16);  // timm keeps the model's dtype
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[3], auto ema = emakit::averaged_model_ema(*model, {.decay = 0.999, .use_buffers = true});)
    CHECK(ema.decay_policy() == emakit::Fixed(py(3, "get_ema_multi_avg_fn")));
    CHECK(ema.schedule().warmup() == emakit::Warmup::skip_before_start);
    CHECK(ema.options().buffers() ==
          (py(3, "use_buffers") == 1.0 ? emakit::TensorMode::average : emakit::TensorMode::copy));
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::fused_lerp);  // get_ema_multi_avg_fn: _foreach_lerp_
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[4], auto swa = emakit::averaged_model_swa(*model);)
    CHECK(rows[4].python.at(0) == "AveragedModel(model)");
    CHECK(swa.schedule().warmup() == emakit::Warmup::skip_before_start);
    CHECK(swa.options().buffers() == emakit::TensorMode::copy);  // use_buffers=False, AveragedModel's default
  }
  {
    TinyNet model;
    auto swa = emakit::averaged_model_swa(*model);
    emakit_test::fill_floats(*model, 2.0);
    swa.update();                           // the first update copies: the average is 2 everywhere
    emakit_test::fill_floats(*model, 0.0);  // and the model's own weights something else
    const std::vector<torch::Tensor> loader{torch::randn({4, 3}), torch::randn({5, 3})};
    model->eval();
    EMAKIT_ROW(code[5], swa.copy_to(*model); emakit::update_bn(model, loader);)
    CHECK(rows[5].python.at(0) == "update_bn(loader, swa_model)");
    CHECK(torch::equal(model->fc->weight, torch::full_like(model->fc->weight, 2.0)));  // the SWA weights
    CHECK(model->bn->num_batches_tracked.item<std::int64_t>() == 2);  // recomputed over the two batches
    CHECK_FALSE(torch::equal(model->bn->running_mean, torch::full_like(model->bn->running_mean, 2.0)));
    CHECK(model->bn->options.momentum() == 0.1);
    CHECK_FALSE(model->is_training());
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[6],
               auto ema = emakit::nvalchemi_ema(*model, {.decay = 0.999, .update_every = 2, .start_step = 100});
               ema.update({.vetoed = will_skip});)
    CHECK(ema.decay_policy() == emakit::Fixed(py(6, "decay")));
    CHECK(ema.schedule().update_every() == whole(py(6, "update_every")));
    CHECK(ema.schedule().start_step() == whole(py(6, "start_step")));
    CHECK(ema.step() == 0);                                               // the vetoed step completed nothing
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::fused_lerp);  // AveragedModel's multi_avg_fn
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[7], auto ema = emakit::luxonis_model_ema(*model, {.decay = 0.9999, .decay_tau = 2000});)
    CHECK(ema.decay_policy() == emakit::ExponentialRamp(py(7, "decay"), py(7, "decay_tau")));
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::fused_lerp);  // _foreach_lerp_
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[8], emakit::EmaHook hook;
               hook.add(*model, emakit::nvalchemi_ema_recipe({.decay = 0.999, .start_step = 100}),
                        {.creation = emakit::Creation::at_first_eligible_step});
               hook.after_optimizer_step({.vetoed = will_skip});)
    CHECK(rows[8].python.at(0) == "EMAHook(...)");
    CHECK_FALSE(hook.created("model"));  // nothing eligible yet: no EMA, no memory
  }
  {
    TinyNet model;
    emakit::EmaHook hook;
    EMAKIT_ROW(
        code[9],
        hook.add(*model, emakit::luxonis_ema_callback_recipe({.decay = 0.5, .decay_tau = 2000, .accumulate = 4}));)
    hook.setup();
    const auto& ema = hook.ema<emakit::RampEma>("model");
    CHECK(ema.decay_policy() == emakit::ExponentialRamp(py(9, "decay"), py(9, "decay_tau")));
    REQUIRE(rows[9].python.size() == 2);
    const auto lightning = python_kwargs(rows[9].python[1]);
    REQUIRE(lightning.count("accumulate_grad_batches") == 1);
    CHECK(ema.schedule().accumulate() == whole(lightning.at("accumulate_grad_batches")));
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::fused_lerp);
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[10], auto ema = emakit::diffusers_ema_model(
                             *model, {.decay = 0.9999, .min_decay = 0.0, .update_after_step = 0});
               ema.update();)
    CHECK(ema.decay_policy() == emakit::RationalRamp(py(10, "decay"))
                                    .min_decay(py(10, "min_decay"))
                                    .update_after_step(whole(py(10, "update_after_step"))));
    CHECK(ema.options().buffers() == emakit::TensorMode::ignore);  // EMAModel takes parameters()
    CHECK(ema.options().frozen_parameters() == emakit::TensorMode::copy);
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::subtract);  // s.sub_((1 - d) * (s - p))
    CHECK(ema.step() == 1);
    // EMAModel(..., foreach=True): _foreach_sub_(s, s - p, alpha=1 - d), with either decay
    CHECK(emakit::diffusers_ema_model(*model, {.foreach = true}).options().arithmetic() ==
          emakit::Arithmetic::fused_subtract);
    CHECK(
        emakit::diffusers_ema_model_warmup(*model, {.use_ema_warmup = true, .foreach = true}).options().arithmetic() ==
        emakit::Arithmetic::fused_subtract);
  }
  {
    TinyNet model;
    const std::int64_t epoch = 0;
    EMAKIT_ROW(code[11], auto ema = emakit::lightning_ema_weight_averaging(*model, {.decay = 0.999,
                                                                                    .update_every_n_steps = 2,
                                                                                    .update_starting_at_step = 100,
                                                                                    .update_starting_at_epoch = 1});
               ema.update(); ema.epoch_end(epoch);)
    CHECK(ema.decay_policy() == emakit::Fixed(py(11, "decay")));
    CHECK(ema.schedule().update_every() == whole(py(11, "update_every_n_steps")));
    CHECK(ema.schedule().start_step() == whole(py(11, "update_starting_at_step")) + 1);  // 0-based index -> step
    CHECK(ema.options().epoch_end_updates_from() == whole(py(11, "update_starting_at_epoch")));
    CHECK(ema.num_updates() == 0);                              // epoch 0 is before update_starting_at_epoch
    CHECK(ema.epoch_end(1).action != emakit::Action::skipped);  // from epoch 1 on (the first one copies)
    CHECK(ema.num_updates() == 1);
    CHECK(ema.options().arithmetic() == emakit::Arithmetic::weighted_sum);  // get_ema_avg_fn
  }
  {
    TinyNet model;
    EMAKIT_ROW(code[12], auto teacher =
                             emakit::cosine_momentum_teacher(*model, {.start = 0.996, .end = 1.0, .total_steps = 1000});
               teacher.update();)
    CHECK(teacher.decay_policy() ==
          emakit::CosineMomentum(py(12, "start_value"), py(12, "end_value"), whole(py(12, "max_steps"))));
    CHECK(teacher.decay() == py(12, "start_value"));                                // lightly's step 0
    CHECK(teacher.options().arithmetic() == emakit::Arithmetic::scaled_fused_add);  // update_momentum
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    INFO("row " << i << " of the table: " << rows[i].cpp);
    CHECK(emakit_test::squeeze_code(rows[i].cpp) == emakit_test::squeeze_code(code[i]));
  }
}

#undef EMAKIT_ROW

TEST_CASE("ema-pytorch preset: integers untouched, ignored names follow copies only", "[presets]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 1.0);
  auto ema =
      emakit::ema_pytorch(*model, {.beta = 0.5, .update_after_step = 0, .update_every = 1, .ignore_names = {"scale"}});
  CHECK(ema.names(emakit::Role::ignore_except_copies) == std::vector<std::string>{"scale"});
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
  CHECK(torch::equal(w, torch::full({2}, 3.25)));  // 3 + (0.75 - 1) * (3 - 4): every step exact
  ema.switch_model(0.0);
  CHECK(torch::equal(w, torch::full({2}, 3.0)));
  CHECK_THROWS_WITH(emakit::EmaOptions().switch_model(2, 1.0),
                    Contains("EmaOptions::switch_model beta must be in [0, 1), got 1"));
  CHECK_THROWS_WITH(emakit::EmaOptions().switch_model(-1),
                    Contains("EmaOptions::switch_model every must be >= 0, got -1"));
  CHECK_THROWS_WITH(emakit::EmaOptions().switch_model(2, 0.5, -3),
                    Contains("EmaOptions::switch_model offset must be >= 0, got -3"));
  CHECK_THROWS_WITH(emakit::EmaOptions().non_floating(emakit::TensorMode::average), Contains("copy or ignore"));
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

// The names before 0.2 still compile, with a deprecation warning, and are the new ones.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
TEST_CASE("Renamed API: the old names are deprecated aliases of the new ones", "[presets][deprecated]") {
  torch::manual_seed(21);
  emakit_test::TinyNet model;
  const emakit::EmaHookOptions o{.decay = 0.8, .update_every = 2, .start_step = 1};
  STATIC_REQUIRE(std::is_same_v<emakit::EmaHookOptions, emakit::NvalchemiEmaOptions>);
  auto old_ema = emakit::ema_hook(*model, o);
  auto new_ema = emakit::nvalchemi_ema(*model, o);
  STATIC_REQUIRE(std::is_same_v<decltype(old_ema), decltype(new_ema)>);
  const auto old_recipe = emakit::ema_hook_recipe(o);
  CHECK(old_recipe.decay.decay({}) == new_ema.decay_policy().decay({}));
  CHECK(emakit::Role::follow_copies == emakit::Role::ignore_except_copies);
  for (int i = 0; i < 5; ++i) {
    emakit_test::perturb(*model);
    const auto a = old_ema.update();
    const auto b = new_ema.update();
    CHECK(a.action == b.action);
    old_ema.wait();
    old_ema.settle();
  }
  CHECK(old_ema.num_updates() == new_ema.num_updates());
  CHECK(old_ema.num_updates() > 0);
  for (const auto& item : new_ema.averages()) CHECK(torch::equal(item.value(), old_ema.average(item.key())));
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

TEST_CASE("diffusers preset: the TensorFlow ramp, parameters only, frozen parameters copied", "[presets]") {
  TinyNet model;
  model->fc->bias.set_requires_grad(false);  // frozen: diffusers copies it at every step()
  emakit_test::fill_floats(*model, 1.0);
  auto ema = emakit::diffusers_ema_model(*model, {.decay = 0.9, .min_decay = 0.1});
  CHECK(ema.names(emakit::Role::average) == std::vector<std::string>{"fc.weight", "bn.weight", "bn.bias"});
  CHECK(ema.names(emakit::Role::copy) == std::vector<std::string>{"fc.bias"});
  CHECK(ema.frozen_parameters() == std::vector<std::string>{"fc.bias"});
  CHECK_THROWS_WITH(ema.average("bn.running_mean"), Contains("no tensor"));  // buffers are not held
  CHECK_THAT(fmt::format("{}", ema), Contains("3 averaged + 1 copied (1 frozen parameter copied)"));
  // A plain reference of diffusers' step(): d = clamp((1 + t) / (10 + t), min_decay, decay).
  double ref = 1.0;
  for (int step = 1; step <= 30; ++step) {
    emakit_test::fill_floats(*model, 1.0 + step);
    const double t = step - 1;
    const double d = t <= 0 ? 0.0 : std::max(0.1, std::min(0.9, (1 + t) / (10 + t)));
    ref = d * ref + (1 - d) * (1.0 + step);
    ema.update();
    CHECK(emakit_test::reported_decay_is(ema.decay(), d));
    // float32 lerp vs the double reference: within 4 float ulps at this magnitude per update,
    // accumulated over <= 30 updates (the average never leaves [1, 31]): 1e-4 relative is ~100x that.
    CHECK(std::abs(ema.average("fc.weight")[0][0].item<double>() - ref) <= 1e-4 * ref);
    CHECK(ema.average("fc.bias")[0].item<double>() == 1.0 + step);  // copied, bitwise
  }
  // The warmup preset, and the option that belongs to it refused by the other one.
  CHECK_THROWS_WITH(emakit::diffusers_ema_model(*model, {.use_ema_warmup = true}),
                    Contains("use_ema_warmup is true") && Contains("diffusers_ema_model_warmup"));
  auto warm = emakit::diffusers_ema_model_warmup(*model, {.decay = 0.999, .use_ema_warmup = true, .power = 0.75});
  CHECK(warm.decay_policy() ==
        emakit::InversePowerWarmup(0.999).power(0.75).inv_gamma(1.0).min_value(0.0).update_after_step(0));
  CHECK(warm.frozen_parameters() == std::vector<std::string>{"fc.bias"});
  // Frozen parameters can also be left out, and the default averages them (every other peer).
  auto left_out = emakit::FixedEma(*model, emakit::Fixed(0.5), {},
                                   emakit::EmaOptions().frozen_parameters(emakit::TensorMode::ignore));
  CHECK_THROWS_WITH(left_out.average("fc.bias"), Contains("no tensor"));
  CHECK_THAT(fmt::format("{}", left_out), Contains("(1 frozen parameter left out)"));
  CHECK(emakit::FixedEma(*model).names(emakit::Role::average).size() == 7);  // fc.bias averaged; 3 float buffers
  CHECK(emakit::FixedEma(*model).frozen_parameters().empty());
}

TEST_CASE("Lightning preset updates on the steps EMAWeightAveraging.should_update picks, the first one copies",
          "[presets]") {
  // A plain reference of the callback: after optimizer step i (0-based), update when
  // i >= update_starting_at_step (None: 0) and i % update_every_n_steps == 0; the first copies.
  for (const std::int64_t every : {1, 2, 3, 7}) {
    for (const std::optional<std::int64_t> start : {std::optional<std::int64_t>{}, std::optional<std::int64_t>{0},
                                                    std::optional<std::int64_t>{4}, std::optional<std::int64_t>{9}}) {
      TinyNet model;
      auto ema = emakit::lightning_ema_weight_averaging(
          *model, {.decay = 0.5, .update_every_n_steps = every, .update_starting_at_step = start});
      bool first = true;
      int updates = 0;
      for (std::int64_t i = 0; i < 40; ++i) {
        const bool due = i >= start.value_or(0) && i % every == 0;
        const auto expected = !due ? Action::skipped : first ? Action::copied : Action::averaged;
        INFO("every " << every << ", start " << start.value_or(-1) << ", step index " << i);
        CHECK(ema.update().action == expected);
        if (due) first = false, ++updates;
      }
      CHECK(ema.num_updates() == updates);
    }
  }
  TinyNet model;
  CHECK(emakit::lightning_ema_weight_averaging(*model).average("bn.running_mean").defined());  // use_buffers=True
  CHECK_THROWS_WITH(emakit::lightning_ema_weight_averaging(*model, {.update_every_n_steps = 0}),
                    Contains("update_every_n_steps must be > 0, got 0"));
  CHECK_THROWS_WITH(emakit::lightning_ema_weight_averaging(*model, {.update_starting_at_step = -2}),
                    Contains("update_starting_at_step") && Contains("-2"));
}

TEST_CASE("Lightning preset's update_starting_at_epoch: epoch_end() updates once more, not as a step", "[presets]") {
  // A plain reference of the callback over 4 epochs of 5 optimizer steps: after step index i
  // (0-based, global_step - 1), update when i >= 2 and i % 3 == 0; at the end of epoch e >= 1,
  // update once more (on_train_epoch_end). n_averaged counts both; global_step only the steps.
  const std::int64_t epochs = 4, batches = 5, every = 3, start = 2, from_epoch = 1;
  TinyNet model;
  auto ema = emakit::lightning_ema_weight_averaging(*model, {.decay = 0.5,
                                                             .update_every_n_steps = every,
                                                             .update_starting_at_step = start,
                                                             .update_starting_at_epoch = from_epoch});
  CHECK(ema.options().epoch_end_updates_from() == from_epoch);
  CHECK(ema.options().arithmetic() == emakit::Arithmetic::weighted_sum);
  std::int64_t n_averaged = 0, global_step = 0, epoch_updates = 0;
  for (std::int64_t epoch = 0; epoch < epochs; ++epoch) {
    for (std::int64_t b = 0; b < batches; ++b) {
      emakit_test::fill_floats(*model, static_cast<double>(global_step + 1));
      const std::int64_t i = global_step++;
      const bool due = i >= start && i % every == 0;
      const auto expected = !due ? Action::skipped : n_averaged == 0 ? Action::copied : Action::averaged;
      INFO("epoch " << epoch << ", step index " << i);
      CHECK(ema.update().action == expected);
      n_averaged += due ? 1 : 0;
    }
    INFO("end of epoch " << epoch);
    const auto r = ema.epoch_end(epoch);
    const bool due = epoch >= from_epoch;
    CHECK(r.action == (!due ? Action::skipped : n_averaged == 0 ? Action::copied : Action::averaged));
    n_averaged += due ? 1 : 0;
    epoch_updates += due ? 1 : 0;
    CHECK(ema.epoch_end(epoch).action == Action::skipped);  // once per epoch, as the callback
    CHECK(ema.num_updates() == n_averaged);
    CHECK(ema.step() == global_step);  // an epoch-end update is not a step
    CHECK(ema.calls() == global_step);
    if (due) CHECK(ema.decay() == 0.5);
  }
  CHECK(epoch_updates == 3);
  // The average: the epoch-end update averages the weights as they are (those of the last step).
  TinyNet plain_model;
  auto plain = emakit::lightning_ema_weight_averaging(*plain_model, {.decay = 0.5});
  CHECK(plain.epoch_end(5).action == Action::skipped);  // no update_starting_at_epoch: nothing
  CHECK(plain.num_updates() == 0);
  CHECK_THROWS_WITH(ema.epoch_end(-1), Contains("epoch_end(epoch)") && Contains("-1"));
  CHECK_THROWS_WITH(emakit::EmaOptions().update_at_epoch_ends(-3),
                    Contains("EmaOptions::update_at_epoch_ends") && Contains("-3"));
}

TEST_CASE("Cosine teacher preset: parameters only, every update averages with the cosine momentum", "[presets]") {
  TinyNet model;
  emakit_test::fill_floats(*model, 0.0);
  auto teacher = emakit::cosine_momentum_teacher(*model, {.start = 0.9, .end = 1.0, .total_steps = 5});
  CHECK(teacher.names(emakit::Role::average).size() == 4);  // fc and bn parameters; no buffers
  CHECK_THROWS_WITH(teacher.average("bn.running_var"), Contains("no tensor"));
  const emakit::CosineMomentum m(0.9, 1.0, 5);
  for (std::int64_t step = 1; step <= 6; ++step) {
    emakit_test::fill_floats(*model, static_cast<double>(step));
    const auto result = teacher.update();
    CHECK(result.action == Action::averaged);  // the teacher starts as the student: no copy
    CHECK(emakit_test::reported_decay_is(teacher.decay(), m.decay({step, step, 1})));
  }
  CHECK(teacher.decay() == 1.0);  // k = 5 > K' = 4: the end value, the teacher stops moving
}

// ---- update_bn (torch.optim.swa_utils.update_bn) -------------------------------------------

namespace {

// Conv2d(2 -> 3, 3x3) -> BatchNorm2d(3, momentum 0.3) -> flatten -> Linear(48 -> 5) ->
// BatchNorm1d(5): two BatchNorms in nested Sequentials. Input [N, 2, 6, 6].
struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    torch::manual_seed(7);
    conv = torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 3, 3));
    bn2 = torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(3).momentum(0.3));
    fc = torch::nn::Linear(48, 5);
    bn1 = torch::nn::BatchNorm1d(5);
    body = register_module("body", torch::nn::Sequential(conv, bn2, torch::nn::Flatten()));
    head = register_module("head", torch::nn::Sequential(fc, bn1));
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.add_(torch::randn_like(p) * 0.2);  // weight and bias away from 1 and 0
    for (auto* running : {&bn2->running_mean, &bn1->running_mean}) running->fill_(5);  // stale statistics
    for (auto* running : {&bn2->running_var, &bn1->running_var}) running->fill_(7);
    bn2->num_batches_tracked.fill_(42);
    bn1->num_batches_tracked.fill_(42);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head->forward(body->forward(x)); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn2{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d bn1{nullptr};
  torch::nn::Sequential body{nullptr}, head{nullptr};
};
TORCH_MODULE(BnNet);

// Batches of unequal sizes (6, 6, 3), so that the mean of the batches' means is not the mean of
// all the samples: torch's cumulative average weighs batches, not samples.
std::vector<torch::Tensor> bn_batches() {
  torch::manual_seed(11);
  return {torch::randn({6, 2, 6, 6}) * 2 + 1, torch::randn({6, 2, 6, 6}) - 0.5, torch::randn({3, 2, 6, 6}) * 3};
}

// Per batch, the batch's mean and unbiased variance over every dimension but `channel` (1).
struct BatchStats {
  torch::Tensor mean, unbiased_var, biased_var;
};
BatchStats batch_stats(const torch::Tensor& x) {
  std::vector<std::int64_t> dims{0};
  for (std::int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  const auto mean = x.mean(dims, /*keepdim=*/true);
  const auto squares = (x - mean).pow(2).sum(dims);
  const double n = static_cast<double>(x.numel() / x.size(1));
  return {mean.flatten(), squares / (n - 1), squares / n};
}

// The statistics update_bn must leave, computed here in double from the weights and the batches
// alone: BatchNorm2d sees conv(x); BatchNorm1d sees linear(flatten(BatchNorm2d in train mode,
// normalised by the batch's own mean and biased variance)). running = the mean over the batches of
// each batch's mean / unbiased variance (momentum None: factor 1/k at batch k).
struct BnReference {
  torch::Tensor mean2, var2, mean1, var1;
  torch::Tensor all_samples_mean2;  // the mean over all samples, which is NOT what torch keeps
};
BnReference bn_reference(BnNet& model, const std::vector<torch::Tensor>& batches) {
  torch::NoGradGuard no_grad;
  auto d = [](const torch::Tensor& t) { return t.detach().to(torch::kDouble); };
  BnReference r{torch::zeros({3}, torch::kDouble),
                torch::zeros({3}, torch::kDouble),
                torch::zeros({5}, torch::kDouble),
                torch::zeros({5}, torch::kDouble),
                {}};
  std::vector<torch::Tensor> convs;
  for (const auto& x : batches) {
    const auto c = torch::conv2d(d(x), d(model->conv->weight), d(model->conv->bias));
    convs.push_back(c);
    const auto s2 = batch_stats(c);
    const auto eps2 = model->bn2->options.eps();
    const auto y = (c - s2.mean.view({1, 3, 1, 1})) / (s2.biased_var.view({1, 3, 1, 1}) + eps2).sqrt() *
                       d(model->bn2->weight).view({1, 3, 1, 1}) +
                   d(model->bn2->bias).view({1, 3, 1, 1});
    const auto z = y.flatten(1).matmul(d(model->fc->weight).t()) + d(model->fc->bias);
    const auto s1 = batch_stats(z);
    r.mean2 += s2.mean;
    r.var2 += s2.unbiased_var;
    r.mean1 += s1.mean;
    r.var1 += s1.unbiased_var;
  }
  const double k = static_cast<double>(batches.size());
  for (auto* t : {&r.mean2, &r.var2, &r.mean1, &r.var1}) *t /= k;
  r.all_samples_mean2 = batch_stats(torch::cat(convs)).mean;
  return r;
}

bool near(const torch::Tensor& ours, const torch::Tensor& reference) {
  return torch::allclose(ours.to(torch::kDouble), reference, /*rtol=*/1e-5, /*atol=*/1e-5);
}

// Every module's training flag, in apply()'s order.
std::vector<bool> training_flags(torch::nn::Module& m) {
  std::vector<bool> out;
  m.apply([&out](torch::nn::Module& sub) { out.push_back(sub.is_training()); });
  return out;
}

}  // namespace

TEST_CASE("update_bn: BatchNorm1d and BatchNorm2d statistics are the mean of the batches' means and unbiased variances",
          "[update_bn]") {
  BnNet model;
  model->eval();
  const auto batches = bn_batches();
  const auto reference = bn_reference(model, batches);
  const auto parameters_before = emakit_test::model_snapshot(*model);
  int calls = 0;
  const auto result = emakit::update_bn(*model, batches, [&](const torch::Tensor& x) {
    ++calls;
    return model->forward(x);
  });
  CHECK(result == emakit::UpdateBnResult{2, 3});
  CHECK(calls == 3);
  CHECK(model->bn2->num_batches_tracked.item<std::int64_t>() == 3);  // reset from 42, one per batch
  CHECK(model->bn1->num_batches_tracked.item<std::int64_t>() == 3);
  CHECK(near(model->bn2->running_mean, reference.mean2));
  CHECK(near(model->bn2->running_var, reference.var2));
  CHECK(near(model->bn1->running_mean, reference.mean1));
  CHECK(near(model->bn1->running_var, reference.var1));
  // The reference has teeth: the batches are weighted equally, not their samples.
  CHECK_FALSE(near(model->bn2->running_mean, reference.all_samples_mean2));
  // Parameters untouched; only the running statistics changed.
  for (const auto& p : model->named_parameters()) {
    INFO(p.key());
    CHECK(emakit_test::bitwise_equal(p.value(), parameters_before.at(p.key())));
  }
  CHECK(model->bn2->options.momentum() == 0.3);
  CHECK(model->bn1->options.momentum() == 0.1);
  CHECK_FALSE(model->is_training());
}

TEST_CASE("update_bn: the pass runs in train mode without grad, with momenta none, and puts modes and momenta back",
          "[update_bn]") {
  const auto batches = bn_batches();
  BnNet model;
  model->bn1->options.momentum(c10::nullopt);  // None before: None after
  auto pass = [&] {
    int calls = 0;
    emakit::update_bn(*model, batches, [&](const torch::Tensor& x) {
      ++calls;
      CHECK(training_flags(*model) == std::vector<bool>(training_flags(*model).size(), true));
      CHECK_FALSE(c10::GradMode::is_enabled());
      CHECK_FALSE(model->bn2->options.momentum().has_value());
      CHECK_FALSE(model->bn1->options.momentum().has_value());
      CHECK_FALSE(model->forward(x).requires_grad());
    });
    CHECK(calls == 3);
    CHECK(c10::GradMode::is_enabled());
    CHECK(model->bn2->options.momentum() == 0.3);
    CHECK_FALSE(model->bn1->options.momentum().has_value());
  };
  SECTION("eval before: eval after") {
    model->eval();
    pass();
    CHECK(training_flags(*model) == std::vector<bool>(training_flags(*model).size(), false));
  }
  SECTION("train before: train after") {
    model->train();
    pass();
    CHECK(training_flags(*model) == std::vector<bool>(training_flags(*model).size(), true));
  }
  SECTION("modes mixed: each module's own (torch's model.train(was_training) would set them all to train)") {
    model->train();
    model->body->eval();  // body, conv, bn2, flatten in eval; the model, head, fc, bn1 in train
    const auto before = training_flags(*model);
    REQUIRE(std::count(before.begin(), before.end(), false) == 4);
    pass();
    CHECK(training_flags(*model) == before);
  }
  SECTION("the caller's no-grad mode is kept") {
    torch::NoGradGuard no_grad;
    emakit::update_bn(*model, batches, [&](const torch::Tensor& x) { model->forward(x); });
    CHECK_FALSE(c10::GradMode::is_enabled());
  }
}

TEST_CASE("update_bn: momenta, modes and grad are put back when the forward throws, whose exception goes on unchanged",
          "[update_bn]") {
  BnNet model;
  model->eval();
  const auto batches = bn_batches();
  SECTION("the caller's exception, at the second batch") {
    int calls = 0;
    CHECK_THROWS_WITH(emakit::update_bn(*model, batches,
                                        [&](const torch::Tensor& x) {
                                          if (++calls == 2) throw std::logic_error("the caller's own error");
                                          model->forward(x);
                                        }),
                      "the caller's own error");
    CHECK(calls == 2);
    CHECK(model->bn1->num_batches_tracked.item<std::int64_t>() == 1);  // reset, then one batch
  }
  SECTION("LibTorch's: a batch of one sample in BatchNorm1d's train mode") {
    const std::vector<torch::Tensor> one{torch::randn({1, 2, 6, 6})};
    CHECK_THROWS_AS(emakit::update_bn(model, one), c10::Error);
    CHECK_THROWS_WITH(emakit::update_bn(model, one), Contains("Expected more than 1 value per channel"));
  }
  CHECK(model->bn2->options.momentum() == 0.3);
  CHECK(model->bn1->options.momentum() == 0.1);
  CHECK(training_flags(*model) == std::vector<bool>(training_flags(*model).size(), false));
  CHECK(c10::GradMode::is_enabled());
}

TEST_CASE("update_bn: a model without BatchNorm is left alone and its forward never called (InstanceNorm is none)",
          "[update_bn]") {
  torch::nn::Sequential model(torch::nn::Linear(4, 3),
                              torch::nn::InstanceNorm1d(torch::nn::InstanceNorm1dOptions(3).track_running_stats(true)));
  {
    torch::NoGradGuard no_grad;
    for (auto& b : model->buffers())
      if (b.is_floating_point()) b.fill_(3);
  }
  model->eval();
  const auto before = emakit_test::model_snapshot(*model);
  int calls = 0, reads = 0;
  const std::vector<torch::Tensor> batches{torch::randn({2, 3, 4})};
  CHECK(emakit::update_bn(*model, batches, [&](const torch::Tensor&) { ++calls; }) == emakit::UpdateBnResult{0, 0});
  CHECK(emakit::update_bn(
            *model,
            [&]() -> std::optional<torch::Tensor> { return ++reads < 3 ? batches[0] : std::optional<torch::Tensor>(); },
            [&](const torch::Tensor&) { ++calls; }) == emakit::UpdateBnResult{0, 0});
  CHECK(calls == 0);
  CHECK(reads == 0);  // the batches are not even read
  CHECK(emakit_test::same_snapshot(emakit_test::model_snapshot(*model), before));
  CHECK(training_flags(*model) == std::vector<bool>(training_flags(*model).size(), false));
}

TEST_CASE("update_bn: a BatchNorm with track_running_stats=false counts, runs the pass and keeps its state",
          "[update_bn]") {
  torch::nn::Sequential model(torch::nn::Linear(4, 3),
                              torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(3).track_running_stats(false)));
  model->eval();
  const auto before = emakit_test::model_snapshot(*model);
  int calls = 0;
  const std::vector<torch::Tensor> batches{torch::randn({5, 4}), torch::randn({5, 4})};
  CHECK(emakit::update_bn(*model, batches, [&](const torch::Tensor& x) {
          ++calls;
          model->forward(x);
        }) == emakit::UpdateBnResult{1, 2});
  CHECK(calls == 2);  // torch's update_bn runs the model too: the module is a _BatchNorm
  CHECK(emakit_test::same_snapshot(emakit_test::model_snapshot(*model), before));
  CHECK_FALSE(model->is_training());
}

TEST_CASE("update_bn: no batches leave the statistics reset, as torch does", "[update_bn]") {
  BnNet model;
  const std::vector<torch::Tensor> none;
  CHECK(emakit::update_bn(model, none) == emakit::UpdateBnResult{2, 0});
  CHECK(torch::equal(model->bn2->running_mean, torch::zeros({3})));
  CHECK(torch::equal(model->bn2->running_var, torch::ones({3})));
  CHECK(model->bn2->num_batches_tracked.item<std::int64_t>() == 0);
  CHECK(torch::equal(model->bn1->running_mean, torch::zeros({5})));
  CHECK(model->bn2->options.momentum() == 0.3);
  CHECK(model->is_training());
}

TEST_CASE("update_bn: a DataLoader, a batch source, a model that is a BatchNorm, a BatchNorm registered twice",
          "[update_bn]") {
  const auto batches = bn_batches();
  // Reference: the range overload with a forward.
  BnNet expected;
  emakit::update_bn(*expected, batches, [&](const torch::Tensor& x) { expected->forward(x); });
  auto same_statistics = [&](BnNet& m) {
    for (const auto& [name, t] : emakit_test::model_snapshot(*expected)) {
      INFO(name);
      CHECK(emakit_test::bitwise_equal(emakit_test::model_snapshot(*m).at(name), t));
    }
  };
  SECTION("the overload without forward: tensors, and a DataLoader's stacked examples (.data)") {
    BnNet model;
    CHECK(emakit::update_bn(model, batches) == emakit::UpdateBnResult{2, 3});
    same_statistics(model);
    // The same samples through a DataLoader, batch size 6: batches of 6, 6 and 3.
    auto dataset = torch::data::datasets::TensorDataset(torch::cat(batches))
                       .map(torch::data::transforms::Stack<torch::data::TensorExample>());
    auto loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
        std::move(dataset), torch::data::DataLoaderOptions().batch_size(6));
    BnNet from_loader;
    CHECK(emakit::update_bn(from_loader, *loader) == emakit::UpdateBnResult{2, 3});
    same_statistics(from_loader);
  }
  SECTION("a batch source: batches until an empty optional") {
    BnNet model;
    std::size_t next = 0;
    auto source = [&]() -> std::optional<torch::Tensor> {
      if (next == batches.size()) return std::nullopt;
      return batches[next++];
    };
    CHECK(emakit::update_bn(*model, source, [&](torch::Tensor& x) { model->forward(x); }) ==
          emakit::UpdateBnResult{2, 3});
    same_statistics(model);
  }
  SECTION("the model itself a BatchNorm3d, registered twice in a Sequential: one BatchNorm") {
    torch::nn::BatchNorm3d bn(torch::nn::BatchNorm3dOptions(2).momentum(0.5));
    const std::vector<torch::Tensor> cubes{torch::randn({2, 2, 3, 3, 3}) + 4, torch::randn({4, 2, 3, 3, 3}) * 2};
    CHECK(emakit::update_bn(bn, cubes) == emakit::UpdateBnResult{1, 2});
    const auto mean = (batch_stats(cubes[0]).mean + batch_stats(cubes[1]).mean) / 2;
    const auto var = (batch_stats(cubes[0]).unbiased_var + batch_stats(cubes[1]).unbiased_var) / 2;
    CHECK(torch::allclose(bn->running_mean, mean, 1e-5, 1e-5));
    CHECK(torch::allclose(bn->running_var, var, 1e-5, 1e-5));
    CHECK(bn->options.momentum() == 0.5);
    torch::nn::Sequential twice(bn, bn);
    CHECK(emakit::update_bn(*twice, cubes, [&](const torch::Tensor& x) { twice->forward(x); }) ==
          emakit::UpdateBnResult{1, 2});
    CHECK(bn->num_batches_tracked.item<std::int64_t>() == 4);  // two calls per batch
    CHECK(bn->options.momentum() == 0.5);
  }
}

#undef EMAKIT_ROW

}  // namespace test_presets
