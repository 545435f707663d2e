// Post-hoc synthesis of any EMA (EmaTarget, fit_target_weights): the target's weights are the live
// EMA's, the fit is the least squares it claims (against an independent float64 solve from the
// snapshot files), and on a training run the synthesized EMA is the live one within the bound that
// its fit error gives.
#include <emakit/emakit.hpp>
#include <emakit/posthoc.hpp>

#include "helpers.hpp"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace test_posthoc_targets {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit_test::TempDir;
constexpr double inf = std::numeric_limits<double>::infinity();

// A user's own decay policy (concepts.hpp's example): a half-life in steps.
struct HalfLife {
  double steps = 40;
  double decay(const emakit::DecayInput&) const { return std::exp2(-1.0 / steps); }
};

// The live EMAs the tests compare against: each target's policies, updated as a trainer would.
struct Live {
  std::string name;
  emakit::EmaTarget target;
  std::function<emakit::UpdateResult()> update;
  std::function<emakit::StateDict()> averages;
  at::Tensor average() const { return averages().begin()->value(); }  // the first averaged tensor
};

template <class D>
Live live(const std::string& name, std::vector<emakit::SourceTensor> tensors, D decay,
          emakit::StepSchedule schedule = {}) {
  auto ema = std::make_shared<emakit::Ema<D>>(tensors, decay, schedule, emakit::EmaOptions());
  return {name, emakit::EmaTarget::of(*ema), [ema] { return ema->update(); }, [ema] { return ema->averages(); }};
}

// Every kind of target the issue names: each decay policy, a schedule with update_every and a start
// step (both warmups that skip or copy before it), a preset's schedule, a user's own policy.
std::vector<Live> live_targets(const std::vector<emakit::SourceTensor>& tensors, std::int64_t dt) {
  using emakit::StepSchedule;
  using emakit::Warmup;
  std::vector<Live> out;
  out.push_back(live("Fixed(0.99)", tensors, emakit::Fixed(0.99)));
  out.push_back(live("InversePowerWarmup(0.999, power 3/4)", tensors, emakit::InversePowerWarmup(0.999).power(0.75)));
  out.push_back(live("RationalRamp(0.999) after 20", tensors, emakit::RationalRamp(0.999).update_after_step(20)));
  out.push_back(live("ExponentialRamp(0.995, tau 100)", tensors, emakit::ExponentialRamp(0.995, 100)));
  out.push_back(live("Fixed(0.98) every 5 from 300, skip before", tensors, emakit::Fixed(0.98),
                     StepSchedule().update_every(5).start_step(300).warmup(Warmup::skip_before_start)));
  out.push_back(live("Fixed(0.98) every 4*dt from 200, copy before", tensors, emakit::Fixed(0.98),
                     StepSchedule().update_every(4 * dt).start_step(200).warmup(Warmup::copy_before_start)));
  out.push_back(live("ema_pytorch's schedule", tensors, emakit::ema_pytorch_decay({.beta = 0.999}),
                     emakit::ema_pytorch_schedule({.beta = 0.999})));
  out.push_back(live("Uniform (SWA) from 600", tensors, emakit::Uniform(),
                     StepSchedule().start_step(600).warmup(Warmup::skip_before_start)));
  out.push_back(live("HalfLife(40) (own policy)", tensors, HalfLife()));
  return out;
}

// A one-hot trajectory: the model of step s is e_s, so an EMA of it is its weighting of the past.
struct OneHot {
  at::Tensor w;
  explicit OneHot(std::int64_t steps) : w(torch::zeros({steps + 1}, torch::kDouble)) { w[0] = 1.0; }
  void step(std::int64_t s) {
    w.zero_();
    w[s] = 1.0;
  }
  std::vector<emakit::SourceTensor> tensors() const { return {{"w", w}}; }
};

std::vector<double> values(const at::Tensor& t) {
  const auto c = t.to(torch::kDouble).contiguous();
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

// The interval ends fit_target_weights measures on: each step where the target updated, moved up to
// a tracked update (a multiple of dt), every snapshot time up to T, and T; with 0 first.
std::vector<std::int64_t> interval_ends(const std::set<std::int64_t>& updates, const std::set<std::int64_t>& times,
                                        std::int64_t dt, std::int64_t last) {
  std::set<std::int64_t> ends{0, last};
  for (auto s : updates)
    if (s <= last) ends.insert((s + dt - 1) / dt * dt);
  for (auto t : times)
    if (t <= last) ends.insert(t);
  return {ends.begin(), ends.end()};
}

// sum of x over each interval (ends[k-1], ends[k]], index 0 the step-0 entry.
std::vector<double> interval_sums(const std::vector<double>& x, const std::vector<std::int64_t>& ends) {
  std::vector<double> out(ends.size(), 0.0);
  out[0] = x[0];
  for (std::size_t k = 1; k < ends.size(); ++k)
    for (auto s = ends[k - 1] + 1; s <= ends[k]; ++s) out[k] += x[static_cast<std::size_t>(s)];
  return out;
}

TEST_CASE("An EmaTarget's weights are the live EMA's, for every decay, schedule and a user's own policy",
          "[posthoc][target]") {
  const std::int64_t steps = 900;
  OneHot model(steps);
  auto targets = live_targets(model.tensors(), 2);
  std::vector<std::set<std::int64_t>> updated(targets.size());
  for (std::int64_t s = 1; s <= steps; ++s) {
    model.step(s);
    for (std::size_t i = 0; i < targets.size(); ++i)
      if (targets[i].update().action != emakit::Action::skipped) updated[i].insert(s);
  }
  for (std::size_t i = 0; i < targets.size(); ++i) {
    INFO(targets[i].name << ": " << targets[i].target.description());
    const auto expected = values(targets[i].average());  // the live EMA of e_s: its weight on each step
    const auto got = targets[i].target.weights(steps);
    REQUIRE(got.weights.size() == expected.size());
    REQUIRE(got.weights.size() == static_cast<std::size_t>(steps) + 1);
    double worst = 0, sum = 0;
    for (std::size_t s = 0; s < expected.size(); ++s) {
      worst = std::max(worst, std::abs(got.weights[s] - expected[s]));
      sum += got.weights[s];
    }
    // 1e-13: the live EMA's float64 lerps (one rounding each, at most 900 of them, on values <= 1).
    CHECK(worst <= 1e-13);
    CHECK(std::abs(sum - 1.0) <= 1e-12);
    CHECK(std::set<std::int64_t>(got.updates.begin(), got.updates.end()) == updated[i]);
    CHECK(got.updates.size() == updated[i].size());
  }
}

TEST_CASE("Any EMA from the snapshots: the weights are the least squares over the target's intervals, as an "
          "independent float64 solve from the snapshot files finds them",
          "[posthoc][target]") {
  const std::int64_t dt = GENERATE(1, 2);
  const std::int64_t steps = 1200;
  INFO("update_every " << dt);
  TempDir folder;
  OneHot model(steps);
  emakit::PostHocEma posthoc(
      model.tensors(),
      emakit::PostHocOptions(folder.path).sigma_rels({0.05, 0.10}).update_every(dt).snapshot_every(100));
  auto targets = live_targets(model.tensors(), dt);
  // The tracked profile of sigma_rel 0.10 itself, as an EmaTarget: its snapshot is the answer, exactly.
  const emakit::PowerFunction tracked = emakit::PowerFunction::from_sigma_rel(0.10);
  targets.push_back(live("PowerFunction(sigma_rel 0.10) as tracked", model.tensors(), tracked,
                         emakit::StepSchedule().update_every(dt).warmup(emakit::Warmup::skip_before_start)));
  std::vector<std::set<std::int64_t>> updated(targets.size());
  for (std::int64_t s = 1; s <= steps; ++s) {
    model.step(s);
    posthoc.update();
    for (std::size_t i = 0; i < targets.size(); ++i)
      if (targets[i].update().action != emakit::Action::skipped) updated[i].insert(s);
  }
  const auto files = emakit::list_snapshots(folder.path);
  REQUIRE(files.size() == 2 * static_cast<std::size_t>(steps / posthoc.options().snapshot_every()));
  std::set<std::int64_t> times;
  for (const auto& f : files) times.insert(f.t);

  for (std::size_t i = 0; i < targets.size(); ++i) {
    INFO(targets[i].name);
    const auto plan = emakit::plan_synthesis(
        folder.path, emakit::SynthesisOptions(targets[i].target).max_fit_error(inf).max_weight(inf).keep_weights(true));
    const std::size_t n = plan.snapshots.size();
    REQUIRE(n == files.size());
    const auto v = values(targets[i].average());
    const auto ends = interval_ends(updated[i], times, dt, steps);
    // The snapshots' weights on each step, read from the files (not from the closed form).
    std::vector<std::vector<double>> w;
    for (const auto& s : plan.snapshots) w.push_back(values(emakit::load_snapshot(s.path).begin()->value()));
    // The objective: |P (W x - v)|^2 + 1e-4 |F (W x - v)|^2, P the target's interval sums, F the sums
    // over the tracked updates; subject to sum x = 1. Eliminate the constraint (x_n = 1 - sum of
    // the others) and solve the rest with torch's least squares, in float64.
    std::vector<std::int64_t> every{0};
    for (std::int64_t s = dt; s <= steps; s += dt) every.push_back(s);
    const std::vector<double> pv = interval_sums(v, ends), fv = interval_sums(v, every);
    const std::size_t rows = pv.size() + fv.size();
    std::vector<double> cm(rows * n), dm(rows);
    for (std::size_t j = 0; j < n; ++j) {
      const auto pw = interval_sums(w[j], ends), fw = interval_sums(w[j], every);
      for (std::size_t r = 0; r < pw.size(); ++r) cm[r * n + j] = pw[r];
      for (std::size_t r = 0; r < fw.size(); ++r) cm[(pw.size() + r) * n + j] = 1e-2 * fw[r];  // sqrt(1e-4)
    }
    for (std::size_t r = 0; r < pv.size(); ++r) dm[r] = pv[r];
    for (std::size_t r = 0; r < fv.size(); ++r) dm[pv.size() + r] = 1e-2 * fv[r];
    const auto c =
        torch::tensor(cm, torch::kDouble).reshape({static_cast<std::int64_t>(rows), static_cast<std::int64_t>(n)});
    const auto d = torch::tensor(dm, torch::kDouble);
    const auto last = c.select(1, static_cast<std::int64_t>(n) - 1);
    const auto reduced = c.narrow(1, 0, static_cast<std::int64_t>(n) - 1) - last.unsqueeze(1);
    const auto z = std::get<0>(torch::linalg_lstsq(reduced, (d - last).unsqueeze(1), c10::nullopt, "gelsd")).squeeze(1);
    const auto x = torch::cat(std::vector<at::Tensor>{z, (1.0 - z.sum()).unsqueeze(0)});
    const auto xs = values(x);
    double worst = 0;
    for (std::size_t j = 0; j < n; ++j) worst = std::max(worst, std::abs(xs[j] - plan.solution.weights[j]));
    // 1e-5: the plan solves the normal equations, whose condition (up to ~1e9 where the target's
    // intervals are coarse and only the 1e-4 tie-break tells snapshots apart) costs that many digits.
    CHECK(worst <= 1e-5);
    // The fit error the plan states is that of the independent solution, interval by interval.
    std::vector<double> u(static_cast<std::size_t>(steps) + 1, 0.0);
    for (std::size_t j = 0; j < n; ++j)
      for (std::size_t s = 0; s < u.size(); ++s) u[s] += xs[j] * w[j][s];
    const auto pu = interval_sums(u, ends);
    double e2 = 0, v2 = 0;
    for (std::size_t k = 0; k < pu.size(); ++k) {
      e2 += (pu[k] - pv[k]) * (pu[k] - pv[k]);
      v2 += pv[k] * pv[k];
    }
    const double independent = std::sqrt(e2 / v2);
    CHECK(plan.solution.fit_error == Approx(independent).epsilon(1e-6).margin(1e-9));
    CHECK(plan.solution.intervals == ends.size() - 1);
    CHECK(plan.solution.initial_weight == Approx(v[0]).margin(1e-15));
    // The synthesized tensor is the plan's combination of the files, and what was kept for a plot
    // is its interval sums and the target's (1e-13: float64 sums of <= 24 terms <= 1).
    const auto synthesized = values(emakit::synthesize(plan).begin()->value());
    std::vector<double> planned(u.size(), 0.0);
    double combined = 0;
    for (std::size_t s = 0; s < u.size(); ++s) {
      for (std::size_t j = 0; j < n; ++j) planned[s] += plan.solution.weights[j] * w[j][s];
      combined = std::max(combined, std::abs(synthesized[s] - planned[s]));
    }
    CHECK(combined <= 1e-13);
    const auto planned_sums = interval_sums(planned, ends);
    REQUIRE(plan.solution.interval_ends == ends);
    REQUIRE(plan.solution.fitted.size() == pu.size());
    double kept = 0;
    for (std::size_t k = 0; k < pu.size(); ++k)
      kept = std::max(
          {kept, std::abs(plan.solution.fitted[k] - planned_sums[k]), std::abs(plan.solution.target[k] - pv[k])});
    CHECK(kept <= 1e-12);
    WARN(fmt::format("dt {} {}: fit error {:.3g} over {} intervals, initial weight {:.3g}, condition {:.3g}", dt,
                     targets[i].name, plan.solution.fit_error, plan.solution.intervals, plan.solution.initial_weight,
                     plan.solution.condition));
    if (i + 1 == targets.size()) {  // the tracked profile: its own snapshot at T, nothing else
      CHECK(plan.solution.fit_error <= 1e-9);
      for (std::size_t j = 0; j < n; ++j) {
        const bool own = plan.snapshots[j].t == steps && std::abs(plan.snapshots[j].gamma - tracked.gamma()) < 1e-12;
        CHECK(plan.solution.weights[j] == Approx(own ? 1.0 : 0.0).margin(1e-6));
      }
    }
  }
}

TEST_CASE("On a training run, each synthesized EMA is the live one within the bound its fit error gives",
          "[posthoc][target]") {
  // 3000 steps of SGD (float64, so that rounding stays far below the bound), two profiles
  // snapshotted every 100 steps, the live EMAs beside them, and the trajectory of every weight.
  // With U, V the fitted and the target weights summed per interval (ends e_b, where the target
  // updates: V lies on the ends), synth - live = sum_b (U_b - V_b)(theta_{e_b} - c) - v_0 (theta_0 - c)
  // + sum_b sum_{s in b} u_s (theta_s - theta_{e_b}) for any c (both weightings sum to 1), so by
  // Cauchy-Schwarz, per weight: |synth - live| <= fit_error |V| |theta_e - c| + |within-interval sum|.
  torch::manual_seed(3);
  const std::int64_t steps = 3000;
  TempDir folder;
  torch::nn::Sequential net(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 1));
  net->to(torch::kDouble);
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05));
  emakit::PostHocEma posthoc(*net, emakit::PostHocOptions(folder.path).sigma_rels({0.05, 0.10}).snapshot_every(100));
  auto flat = [&] {
    std::vector<at::Tensor> parts;
    for (const auto& p : net->parameters()) parts.push_back(p.detach().flatten());
    return torch::cat(parts);
  };
  std::vector<emakit::SourceTensor> params;
  for (const auto& item : net->named_parameters()) params.push_back({item.key(), item.value()});
  auto targets = live_targets(params, 1);
  std::vector<std::set<std::int64_t>> updated(targets.size());
  std::vector<at::Tensor> trajectory{flat().clone()};
  const auto direction = torch::randn({8}, torch::kDouble);
  for (std::int64_t s = 1; s <= steps; ++s) {
    const auto x = torch::randn({16, 8}, torch::kDouble);
    const auto y = torch::sin(x.matmul(direction)).unsqueeze(1) + 0.3 * torch::randn({16, 1}, torch::kDouble);
    optimizer.zero_grad();
    torch::mse_loss(net->forward(x), y).backward();
    optimizer.step();
    posthoc.update();
    for (std::size_t i = 0; i < targets.size(); ++i)
      if (targets[i].update().action != emakit::Action::skipped) updated[i].insert(s);
    trajectory.push_back(flat().clone());
  }
  const auto theta = torch::stack(trajectory);  // (steps + 1) x weights
  std::set<std::int64_t> times;
  for (const auto& f : emakit::list_snapshots(folder.path)) times.insert(f.t);
  std::size_t representable = 0;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    INFO(targets[i].name);
    const auto plan = emakit::plan_synthesis(
        folder.path, emakit::SynthesisOptions(targets[i].target).max_fit_error(inf).max_weight(inf));
    const auto synthesized = emakit::synthesize(plan);
    std::vector<at::Tensor> s_parts, l_parts;
    const auto averages = targets[i].averages();
    for (const auto& p : params) {
      s_parts.push_back(synthesized[p.name].flatten());
      l_parts.push_back(averages[p.name].flatten());
    }
    const auto synth = torch::cat(s_parts);
    const auto live_value = torch::cat(l_parts);
    // The live EMA is the target's weighting of the trajectory (1e-12: the float64 lerps' rounding).
    const auto tw = targets[i].target.weights(steps);
    CHECK((torch::tensor(tw.weights, torch::kDouble).matmul(theta) - live_value).abs().max().item<double>() <= 1e-12);
    // u per step from the snapshots' closed-form weights (tracker.hpp; test_posthoc checks the files).
    std::vector<double> u(static_cast<std::size_t>(steps) + 1, 0.0);
    for (std::size_t j = 0; j < plan.snapshots.size(); ++j) {
      const auto& sn = plan.snapshots[j];
      for (std::int64_t s = 1; s <= sn.t; ++s)
        u[static_cast<std::size_t>(s)] +=
            plan.solution.weights[j] *
            (std::pow(double(s) / double(sn.t), sn.gamma + 1) - std::pow(double(s - 1) / double(sn.t), sn.gamma + 1));
    }
    CHECK((torch::tensor(u, torch::kDouble).matmul(theta) - synth).abs().max().item<double>() <= 1e-10);
    const auto ends = interval_ends(updated[i], times, 1, steps);
    const auto pv = interval_sums(tw.weights, ends);
    double v_norm = 0;
    for (double x : pv) v_norm += x * x;
    v_norm = std::sqrt(v_norm);
    auto spread = (theta[0] - live_value).pow(2);
    auto within = torch::zeros_like(live_value);
    for (std::size_t k = 1; k < ends.size(); ++k) {
      const auto end = theta[ends[k]];
      spread += (end - live_value).pow(2);
      for (auto s = ends[k - 1] + 1; s < ends[k]; ++s) within += u[static_cast<std::size_t>(s)] * (theta[s] - end);
    }
    const auto bound = plan.solution.fit_error * v_norm * spread.sqrt() + within.abs();
    const auto diff = (synth - live_value).abs();
    const double online_gap = (theta[steps] - live_value).norm().item<double>();
    WARN(fmt::format("{}: fit error {:.3g}, |synth - live| {:.3g}, bound {:.3g}, |online - live| {:.3g}",
                     targets[i].name, plan.solution.fit_error, diff.norm().item<double>(), bound.norm().item<double>(),
                     online_gap));
    // Per weight, with 1e-12 for the float64 sums' rounding.
    CHECK((diff - bound).max().item<double>() <= 1e-12);
    if (plan.solution.fit_error < 0.05) {
      ++representable;
      CHECK(diff.norm().item<double>() < 0.2 * online_gap);
    }
  }
  CHECK(representable >= 5);
}

TEST_CASE("A target the snapshots cannot represent is refused with its fit error, and other misuse is named",
          "[posthoc][target][errors]") {
  const std::int64_t steps = 1200;
  TempDir folder;
  OneHot model(steps);
  emakit::PostHocEma posthoc(model.tensors(),
                             emakit::PostHocOptions(folder.path).sigma_rels({0.05, 0.10}).snapshot_every(100));
  for (std::int64_t s = 1; s <= steps; ++s) {
    model.step(s);
    posthoc.update();
  }
  // Fixed(0.9999) after 1200 steps still weighs the starting model 0.89: no snapshot holds it.
  const emakit::SynthesisOptions slow(emakit::EmaTarget(emakit::Fixed(0.9999)));
  CHECK_THROWS_AS(emakit::plan_synthesis(folder.path, slow), emakit::SynthesisRefused);
  CHECK_THROWS_WITH(emakit::plan_synthesis(folder.path, slow),
                    Contains("cannot represent Fixed(beta=0.9999)") && Contains("max_fit_error 0.5") &&
                        Contains("0.887 of its weight is on the model before the first update") &&
                        Contains("--max-fit-error"));
  const auto accepted = emakit::plan_synthesis(folder.path, emakit::SynthesisOptions(slow).max_fit_error(inf));
  CHECK(accepted.solution.fit_error > 0.5);
  CHECK(accepted.solution.initial_weight == Approx(std::pow(0.9999, 1200)).epsilon(1e-9));
  // A bound the fit meets is no refusal; one just below its error is.
  const emakit::SynthesisOptions quick(emakit::EmaTarget(emakit::Fixed(0.99)));
  const auto ok = emakit::plan_synthesis(folder.path, quick);
  CHECK(ok.solution.fit_error < 0.5);
  CHECK_THROWS_AS(
      emakit::plan_synthesis(folder.path, emakit::SynthesisOptions(quick).max_fit_error(ok.solution.fit_error * 0.99)),
      emakit::SynthesisRefused);
  CHECK_NOTHROW(
      emakit::plan_synthesis(folder.path, emakit::SynthesisOptions(quick).max_fit_error(ok.solution.fit_error * 1.01)));
  // An emkit snapshot file records a power function: an EMA target's result goes to a .pt file.
  const auto out = folder.path / "fixed.emkit";
  CHECK_THROWS_WITH(emakit::synthesize_to_file(ok, out, emakit::OutputFormat::snapshot),
                    Contains("power-function profile") && Contains("Fixed(beta=0.99)") && Contains("torch_pickle"));
  CHECK_FALSE(std::filesystem::exists(out));
  emakit::synthesize_to_file(ok, folder.path / "fixed.pt");
  CHECK(std::filesystem::exists(folder.path / "fixed.pt"));
  // Profiles too close to tell apart: refused for an EMA target as for a power function.
  TempDir close_folder;
  OneHot other(200);
  emakit::PostHocEma close(
      other.tensors(), emakit::PostHocOptions(close_folder.path).sigma_rels({0.05, 0.0500000001}).snapshot_every(100));
  for (std::int64_t s = 1; s <= 200; ++s) {
    other.step(s);
    close.update();
  }
  CHECK_THROWS_WITH(emakit::plan_synthesis(close_folder.path, quick),
                    Contains("ill-conditioned") && Contains("max_condition"));
}

TEST_CASE("preset_target names each preset with its peer's defaults, and bad targets are named",
          "[posthoc][target][errors]") {
  const auto names = emakit::preset_target_names();
  CHECK(names.size() == 9);
  for (const auto name : names) {
    INFO(name);
    const auto w = emakit::preset_target(name).weights(500);
    double sum = 0;
    for (double x : w.weights) sum += x;
    CHECK(std::abs(sum - 1.0) <= 1e-12);
    CHECK_FALSE(w.updates.empty());
  }
  // The preset's own policies: timm's target is an Ema made by the preset, step for step.
  OneHot model(300);
  auto timm = emakit::timm_model_ema_v3(model.tensors(), {.decay = 0.99});
  CHECK(emakit::EmaTarget::of(timm).description() ==
        emakit::EmaTarget(emakit::timm_v3_decay({.decay = 0.99})).description());
  CHECK_THROWS_WITH(emakit::preset_target("timm"),
                    Contains("no preset named 'timm'") && Contains("timm_model_ema_v3") && Contains("ema_pytorch"));
  struct TooLarge {
    double decay(const emakit::DecayInput& in) const { return in.update > 3 ? 1.5 : 0.5; }
  };
  CHECK_THROWS_WITH(emakit::EmaTarget(TooLarge()).weights(10),
                    Contains("gave d = 1.5 at step 4") && Contains("must be in [0, 1]"));
  struct Stuck {
    emakit::Decision decide(const emakit::ScheduleInput&) const { return {emakit::Action::averaged, 1}; }
  };
  CHECK_THROWS_WITH(emakit::EmaTarget(emakit::Fixed(0.9), Stuck()).weights(2),
                    Contains("completed 1 steps") && Contains("not the 2"));
}

}  // namespace test_posthoc_targets
