// Free-running conformance: every Python peer runs a whole trajectory on its own, from the same
// start, and emakit runs the same trajectory on its own through the peer's preset; the averages
// are compared BITWISE (torch::equal, every tensor the peer holds, integers too) after every
// recorded step. Unlike the replays of replay.hpp, nothing restarts from the peer's state, so one
// rounding that differs anywhere in the run stays in the average and shows.
//
// The trajectory is synthetic (free_run.hpp, _free_run.py: integer arithmetic only, the same bits
// in both languages, checked below against Python's recorded steps 0, 1 and 1011); the model is
// FreeNet (a Linear and a BatchNorm1d: its weight runs through ATen's vector loops and their scalar
// tail, the others through the tail; num_batches_tracked stays 0). Every run is 1011 steps with at
// least 1000 averaging updates, at the peer's default decay and at 0.9999 (or another), each peer
// set to average at every step. Data: free_run_peer.py (ema-pytorch, timm, AveragedModel,
// diffusers, DINO: every step recorded) and free_run_seed_peer.py (Lightning, lightly,
// luxonis-train, nvalchemi: every 10th step and the last, replayed from
// tests/conformance/fixtures/free_run_seed_peer.tar.xz without the seed venv).
//
// Each preset computes its peer's own per-element arithmetic (EmaOptions::arithmetic, asserted
// here for each one): fused_lerp (ATen's lerp, one rounding) for ema-pytorch, timm, AveragedModel
// with get_ema_multi_avg_fn, nvalchemi and luxonis-train; weighted_sum for Lightning and
// AveragedModel with get_ema_avg_fn (built by hand: averaged_model_ema is the multi_avg_fn one)
// and DINO (cosine_momentum_teacher with .arithmetic = weighted_sum and CosineEnd::after_last_step);
// scaled_fused_add for lightly (cosine_momentum_teacher's default); subtract for diffusers,
// fused_subtract for its foreach=True. The
// timm peer without a step (ModelEmaV3.update(model)) is a FixedEma built by hand with fused_lerp,
// coming-from-python.md's table row.
//
// Where the peer exposes the decay it used (counter.decay: ema-pytorch, timm, diffusers, lightly,
// DINO), emakit's decay() at each recorded averaging update must be that double, bitwise: a
// difference in the decay shows there, before it shows in the averages.
//
// Negative controls, the test's teeth: the same policies and options with each of the five other
// arithmetics run the same trajectory beside the preset, and each must differ from the peer at some
// recorded step and end NOT bitwise equal to it (each peer's formula differs from the five others;
// the exceptions, a lerp and the subtraction with its roundings, are explained at twin());
// the largest relative difference at the end, max |ours - peer| / max |peer| over each tensor,
// is printed for each, emakit's default `lerp` first (how far a run with emakit's own arithmetic
// ends from the peer: about 1e-5 for the weighted sums at 0.999 and 0.9999, 1e-7 for the lerps).
#include "free_run.hpp"
#include "replay.hpp"

#include <algorithm>
#include <array>
#include <optional>

namespace test_free_running {  // this file's names (unity batches: tests/CMakeLists.txt)

using namespace emakit_conformance;
using emakit_free_run::FreeNet;

namespace {

constexpr const auto& kArithmetics = emakit::all_arithmetics;

// A scenario's recorded data (_free_run.py): the recorded steps, the peer's stacked averages.
struct Recorded {
  Dict trajectory, meta;
  std::vector<std::int64_t> steps;
  std::int64_t total = 0;
  std::vector<std::string> names;  // the tensors the peer holds (peer.<name>)
};

Recorded load_recorded(const fs::path& dir) {
  Recorded r;
  r.trajectory = load_dict(dir / "trajectory.pt");
  r.meta = load_dict(dir / "meta.pt");
  r.total = r.meta.at("total").item<std::int64_t>();
  const at::Tensor steps = r.trajectory.at("steps");
  REQUIRE(steps.dim() == 1);
  for (std::int64_t i = 0; i < steps.size(0); ++i) r.steps.push_back(steps[i].item<std::int64_t>());
  REQUIRE(!r.steps.empty());
  REQUIRE(r.steps.back() == r.total);
  REQUIRE(std::is_sorted(r.steps.begin(), r.steps.end()));
  REQUIRE(std::adjacent_find(r.steps.begin(), r.steps.end()) == r.steps.end());
  REQUIRE(r.steps.front() >= 1);
  for (const auto& [key, value] : r.trajectory) {
    if (key.rfind("peer.", 0) != 0) continue;
    r.names.push_back(key.substr(5));
    REQUIRE(value.size(0) == static_cast<std::int64_t>(r.steps.size()));
  }
  REQUIRE(!r.names.empty());
  return r;
}

// The scenario's option `name` as the generator recorded it (meta.pt opt.<name>) must be `value`:
// the test runs emakit with the options the peer ran with.
void require_option(const Recorded& r, const std::string& name, double value) {
  INFO("option " << name);
  REQUIRE(r.meta.count("opt." + name) == 1);
  REQUIRE(r.meta.at("opt." + name).item<double>() == value);
}

enum class Step { implicit, passed };  // passed: update({.step = k}), timm's update(model, step=k)

// What a scenario expects of emakit.
struct Expect {
  emakit::Arithmetic arithmetic;  // the peer's, which the preset (or the EMA built by hand) computes
  Step step = Step::implicit;
};

// The arithmetic that rounds as `a` does while W = 1 - d < 0.5: a lerp's first form a + W(x - a)
// is a subtraction's a - W(a - x) bit for bit (fl(x - a) = -fl(a - x), and rounding to nearest is
// symmetric; the fused pair has the same exact product and one rounding). They can part only where
// the lerp takes its second form, x + (W - 1)(x - a), for 0.5 <= W < 1 (at W = 1 both give x where
// x - a is exact), and need not there: x - a is exact while a and x are close (Sterbenz), and the
// fused pair then rounds one exact value.
std::optional<emakit::Arithmetic> twin(emakit::Arithmetic a) {
  using emakit::Arithmetic;
  switch (a) {
    case Arithmetic::lerp: return Arithmetic::subtract;
    case Arithmetic::subtract: return Arithmetic::lerp;
    case Arithmetic::fused_lerp: return Arithmetic::fused_subtract;
    case Arithmetic::fused_subtract: return Arithmetic::fused_lerp;
    default: return std::nullopt;
  }
}

// Whether an averaging update with decay d has the lerps take their second form (W rounded to
// float, the opmath type of FreeNet's float32 tensors, as detail/simd.hpp's op_weights does).
bool second_form(double d) {
  const float w = static_cast<float>(1.0 - d);
  return w >= 0.5f && w < 1.0f;
}

struct Control {
  emakit::Arithmetic arithmetic;
  std::int64_t first_step = 0;  // the first recorded step at which a tensor differs from the peer's (0: none)
  int differing = 0;            // tensors not bitwise equal to the peer's at the end
  double max_rel = 0;           // max over tensors of max |ours - peer| / max |peer| at the end
};

struct Result {
  std::int64_t steps = 0, averaged = 0, copied = 0;  // emakit's updates, by action
  int recorded = 0;                                  // recorded steps compared
  int compared = 0, equal = 0;                       // tensor comparisons, of which bitwise equal
  int held = 0, untouched = 0;                       // against emakit's average / the step-0 model
  int counters = 0;                                  // counter comparisons (check_counters)
  int decays = 0, decays_equal = 0;                  // the peer's decay against emakit's, at averaging steps
  int second_form_steps = 0;                         // averaging updates with 0.5 <= W < 1 (twin())
  std::string first_difference, first_decay_difference;
  std::vector<Control> controls;
};

double relative_difference(const at::Tensor& ours, const at::Tensor& peer) {
  const double scale = peer.to(at::kDouble).abs().max().item<double>();
  const double diff = (ours.to(at::kDouble) - peer.to(at::kDouble)).abs().max().item<double>();
  return scale > 0 ? diff / scale : diff;
}

// Runs the scenario in `dir` through `ema` (made from `net` at step 0, which `net` still holds):
// k = 1 .. total, step k's values written into `net`, then update(); at each recorded step every
// peer.<name> against emakit's average of that name (bitwise), or, for a tensor emakit does not
// hold, against the model's step-0 tensor (the peer must have left it alone); the peer's counters
// (check_counters(ema, trajectory, row) returns how many it compared); and, where the peer
// recorded it (counter.decay) and emakit's update averaged, the decay, bitwise. Beside it, one
// control per other arithmetic: the same policies and options, the same trajectory.
template <class E, class Counters>
Result free_run(const fs::path& dir, FreeNet& net, E& ema, const Expect& expect, Counters check_counters) {
  // The preset (or the EMA built by hand) computes its peer's arithmetic.
  REQUIRE(std::string(emakit::arithmetic_name(ema.options().arithmetic())) ==
          emakit::arithmetic_name(expect.arithmetic));
  const Recorded rec = load_recorded(dir);
  Result r;

  using Twin = emakit::Ema<typename E::decay_type, typename E::schedule_type>;
  std::vector<Twin> twins;
  twins.reserve(std::size(kArithmetics));
  for (const auto a : kArithmetics) {
    if (a == expect.arithmetic) continue;
    auto options = ema.options();
    options.arithmetic(a);
    twins.emplace_back(*net, ema.decay_policy(), ema.schedule(), options);
    r.controls.push_back(Control{a});
  }
  std::map<std::string, at::Tensor> initial;
  for (const auto& e : emakit_free_run::state_dict_entries(*net)) initial.emplace(e.name, e.tensor.clone());
  for (const auto& name : rec.names) REQUIRE(initial.count(name) == 1);  // the peer holds FreeNet's names
  for (const auto& item : ema.averages()) {
    INFO("emakit holds " << item.key());
    CHECK(std::find(rec.names.begin(), rec.names.end(), item.key()) != rec.names.end());
  }
  const auto decay = rec.trajectory.find("counter.decay");
  int averaged_rows = 0;

  std::size_t row = 0;
  for (std::int64_t k = 1; k <= rec.total; ++k) {
    emakit_free_run::write_step(*net, k);
    emakit::StepInfo info;
    if (expect.step == Step::passed) info.step = k;
    const auto result = ema.update(info);
    const auto action = result.action;
    for (auto& twin : twins) twin.update(info);
    ++r.steps;
    r.averaged += action == emakit::Action::averaged;
    r.copied += action == emakit::Action::copied;
    r.second_form_steps += action == emakit::Action::averaged && second_form(result.decay) ? 1 : 0;
    if (row >= rec.steps.size() || rec.steps[row] != k) continue;
    const auto index = static_cast<std::int64_t>(row);
    ++r.recorded;
    const emakit::StateDict held = ema.averages();
    for (const auto& name : rec.names) {
      const at::Tensor peer = rec.trajectory.at("peer." + name)[index];
      const at::Tensor* ours = held.find(name);
      const at::Tensor& expected_value = ours != nullptr ? *ours : initial.at(name);
      ++r.compared;
      (ours != nullptr ? r.held : r.untouched) += 1;
      REQUIRE(expected_value.scalar_type() == peer.scalar_type());
      REQUIRE(expected_value.sizes() == peer.sizes());
      if (torch::equal(expected_value, peer)) {
        ++r.equal;
      } else if (r.first_difference.empty()) {
        r.first_difference = fmt::format(
            "{} at step {} ({})", name, k,
            ours != nullptr ? fmt::format("max relative difference {:.3g}", relative_difference(*ours, peer))
                            : std::string("the peer changed a tensor emakit leaves alone"));
      }
    }
    r.counters += check_counters(ema, rec.trajectory, index);
    if (decay != rec.trajectory.end() && action == emakit::Action::averaged) {
      ++averaged_rows;
      ++r.decays;
      const double peer_decay = decay->second[index].item<double>();
      if (ema.decay() == peer_decay) {
        ++r.decays_equal;
      } else if (r.first_decay_difference.empty()) {
        r.first_decay_difference =
            fmt::format("at step {}: emakit {:.17g}, the peer {:.17g}", k, ema.decay(), peer_decay);
      }
    }
    for (std::size_t i = 0; i < twins.size(); ++i) {
      if (r.controls[i].first_step != 0) continue;
      const emakit::StateDict twin_held = twins[i].averages();
      for (const auto& name : rec.names) {
        const at::Tensor* ours = twin_held.find(name);
        if (ours != nullptr && !torch::equal(*ours, rec.trajectory.at("peer." + name)[index])) {
          r.controls[i].first_step = k;
          break;
        }
      }
    }
    ++row;
  }
  REQUIRE(row == rec.steps.size());

  // The controls against the peer's last average (the tensors each holds; the others were
  // compared above and do not depend on the arithmetic).
  const auto last = static_cast<std::int64_t>(rec.steps.size()) - 1;
  for (std::size_t i = 0; i < twins.size(); ++i) {
    Control& c = r.controls[i];
    const emakit::StateDict held = twins[i].averages();
    for (const auto& name : rec.names) {
      const at::Tensor* ours = held.find(name);
      if (ours == nullptr || !ours->is_floating_point()) continue;
      const at::Tensor peer = rec.trajectory.at("peer." + name)[last];
      if (!torch::equal(*ours, peer)) ++c.differing;
      c.max_rel = std::max(c.max_rel, relative_difference(*ours, peer));
    }
  }

  std::string controls_text;
  for (const auto& c : r.controls)
    controls_text += fmt::format("{}{}: {} tensors differ at the end, max rel {:.3g}, first differs at step {}",
                                 controls_text.empty() ? "" : "; ", emakit::arithmetic_name(c.arithmetic), c.differing,
                                 c.max_rel, c.first_step);
  std::cout << dir.filename().string() << " (" << emakit::arithmetic_name(expect.arithmetic) << "): " << r.steps
            << " steps (" << r.averaged << " averaging, " << r.copied << " copies), " << r.compared
            << " tensor comparisons at " << r.recorded << " recorded steps (" << r.held << " averages, " << r.untouched
            << " left alone), " << r.equal << " bitwise equal"
            << (r.first_difference.empty() ? "" : " (first difference: " + r.first_difference + ")") << "; "
            << r.counters << " counters"
            << (decay == rec.trajectory.end() ? std::string()
                                              : fmt::format("; {} of {} decays bitwise", r.decays_equal, r.decays))
            << (r.first_decay_difference.empty() ? "" : " (first difference " + r.first_decay_difference + ")") << "; "
            << r.second_form_steps << " updates with 0.5 <= W < 1"
            << "; controls (emakit's default lerp first): " << controls_text << "\n";

  // The counts the recorded data implies.
  REQUIRE(r.steps == rec.total);
  REQUIRE(r.recorded == static_cast<int>(rec.steps.size()));
  REQUIRE(r.compared == r.recorded * static_cast<int>(rec.names.size()));
  int counter_keys = 0;  // every counter the peer recorded (but the decay) at every recorded step
  for (const auto& [key, _] : rec.trajectory) counter_keys += key.rfind("counter.", 0) == 0 && key != "counter.decay";
  REQUIRE(r.counters == r.recorded * counter_keys);
  REQUIRE(r.decays == averaged_rows);
  REQUIRE(r.averaged >= 1000);
  {
    INFO("first difference: " << r.first_decay_difference);
    CHECK(r.decays_equal == r.decays);  // the decay the peer used, bitwise, at every recorded average
  }
  INFO("first difference: " << r.first_difference);
  REQUIRE(r.equal == r.compared);  // bitwise, every tensor at every recorded step
  // Every control differs from the peer at some recorded step and at the end, but the peer's twin:
  // equal throughout where the run never took the lerps' second form; where it
  // did, it may differ, and may end equal (a long run forgets its first steps: the diffusers cases
  // require that it differed).
  for (const auto& c : r.controls) {
    INFO("control " << emakit::arithmetic_name(c.arithmetic));
    if (twin(expect.arithmetic) == c.arithmetic) {
      INFO(r.second_form_steps << " updates with 0.5 <= W < 1");
      if (r.second_form_steps == 0) CHECK(c.first_step == 0);
    } else {
      REQUIRE(c.differing > 0);  // another arithmetic: not the peer
      REQUIRE(c.first_step > 0);
    }
  }
  return r;
}

// The control of arithmetic `a` in a run's result.
const Control& control_of(const Result& r, emakit::Arithmetic a) {
  const auto c =
      std::find_if(r.controls.begin(), r.controls.end(), [a](const Control& x) { return x.arithmetic == a; });
  REQUIRE(c != r.controls.end());
  return *c;
}

std::int64_t at_row(const Dict& trajectory, const std::string& counter, std::int64_t row) {
  return trajectory.at("counter." + counter)[row].item<std::int64_t>();
}

// Counter checks: each returns how many counters it compared.
auto no_peer_counters = [](const auto&, const Dict&, std::int64_t) { return 0; };
// n_averaged (AveragedModel, Lightning) and the like: the number of updates, copies included.
auto updates_counter(std::string name) {
  return [name](const auto& ema, const Dict& t, std::int64_t row) {
    CHECK(ema.num_updates() == at_row(t, name, row));
    return 1;
  };
}
// The peer's step counter (ema-pytorch's step, diffusers' optimization_step, Lightning's global_step).
auto step_counter(std::string name) {
  return [name](const auto& ema, const Dict& t, std::int64_t row) {
    CHECK(ema.step() == at_row(t, name, row));
    return 1;
  };
}
// ema-pytorch's step (calls) and initted.
auto ema_pytorch_step_initted = [](const auto& ema, const Dict& t, std::int64_t row) {
  CHECK(ema.step() == at_row(t, "step", row));
  CHECK((ema.num_updates() > 0) == (at_row(t, "initted", row) != 0));
  return 2;
};
template <class A, class B>
auto both(A a, B b) {
  return [a, b](const auto& ema, const Dict& t, std::int64_t row) { return a(ema, t, row) + b(ema, t, row); };
}

// The model at step 0, for a peer made from it.
FreeNet step0() {
  FreeNet net;
  emakit_free_run::write_step(*net, 0);
  return net;
}

// Python's synthetic model (sources.pt of `peer`) against free_run.hpp's, bitwise; returns the
// number of tensors compared.
int check_python_sources(const std::string& peer) {
  const auto file = peer_file(peer, "sources.pt");
  if (!file) return -1;
  const Dict sources = load_dict(*file);
  FreeNet net;
  const auto entries = emakit_free_run::state_dict_entries(*net);
  int compared = 0;
  for (const auto& e : entries) {
    INFO(e.name);
    REQUIRE(sources.count("order." + e.name) == 1);
    CHECK(sources.at("order." + e.name).item<std::int64_t>() == e.t);  // Python's state_dict() order
  }
  for (const std::int64_t k : {std::int64_t{0}, std::int64_t{1}, emakit_free_run::kTotal}) {
    emakit_free_run::write_step(*net, k);
    for (const auto& e : entries) {
      INFO(e.name << " at step " << k);
      const auto key = fmt::format("source_{}.{}", k, e.name);
      REQUIRE(sources.count(key) == 1);
      const at::Tensor& python = sources.at(key);
      REQUIRE(python.scalar_type() == e.tensor.scalar_type());
      CHECK(torch::equal(python, e.tensor));  // integer ones: the model's own (0), not written
      ++compared;
    }
  }
  int recorded = 0;
  for (const auto& [key, _] : sources) recorded += key.rfind("source_", 0) == 0;
  REQUIRE(compared == recorded);
  std::cout << peer << "/sources.pt: " << compared << " tensors (steps 0, 1, " << emakit_free_run::kTotal
            << ") bitwise equal to free_run.hpp's\n";
  return compared;
}

}  // namespace

// ---- the trajectory itself -------------------------------------------------------------------------

TEST_CASE("free run: Python's synthetic trajectory is free_run.hpp's, bitwise (first venv)", "[conformance][free]") {
  const int n = check_python_sources("free_run_peer");
  if (n < 0) return;
  REQUIRE(n == 3 * 7);  // steps 0, 1, 1011; FreeNet's 7 state_dict entries
}

TEST_CASE("free run: Python's synthetic trajectory is free_run.hpp's, bitwise (seed venv)", "[conformance][free]") {
  const int n = check_python_sources("free_run_seed_peer");
  if (n < 0) return;
  REQUIRE(n == 3 * 7);
}

TEST_CASE("free run: the trajectory moves every floating tensor at every step, integers untouched",
          "[conformance][free]") {
  FreeNet net = step0();
  const auto entries = emakit_free_run::state_dict_entries(*net);
  REQUIRE(entries.size() == 7);
  std::map<std::string, at::Tensor> previous;
  for (const auto& e : entries) previous.emplace(e.name, e.tensor.clone());
  int moved = 0;
  for (std::int64_t k = 1; k <= 20; ++k) {
    emakit_free_run::write_step(*net, k);
    for (const auto& e : entries) {
      INFO(e.name << " at step " << k);
      if (e.tensor.is_floating_point()) {
        CHECK((e.tensor != previous.at(e.name)).all().item<bool>());
        CHECK(e.tensor.abs().max().item<double>() < 0.3125);
        ++moved;
      } else {
        CHECK(torch::equal(e.tensor, previous.at(e.name)));
      }
      previous[e.name] = e.tensor.clone();
    }
  }
  REQUIRE(moved == 20 * 6);
}

// ---- ema-pytorch ------------------------------------------------------------------------------------

TEST_CASE("free run: ema-pytorch EMA, beta 0.9999 (its default), copies until update_after_step 10",
          "[conformance][free][ema_pytorch]") {
  const auto dir = scenario_dir("free_run_peer", "ema_pytorch_default");
  if (!dir) return;
  require_option(load_recorded(*dir), "update_after_step", 10);
  FreeNet net = step0();
  auto ema = emakit::ema_pytorch(*net, {.update_after_step = 10, .update_every = 1});
  const auto r = free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::implicit}, ema_pytorch_step_initted);
  CHECK(r.copied == 11);             // the first update and steps 2 .. 11
  CHECK(r.untouched == r.recorded);  // num_batches_tracked: ema-pytorch never writes integers
}

TEST_CASE("free run: ema-pytorch EMA, beta 0.999 reached (inv_gamma 0.01), foreach",
          "[conformance][free][ema_pytorch]") {
  const auto dir = scenario_dir("free_run_peer", "ema_pytorch_0999");
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  require_option(rec, "beta", 0.999);
  require_option(rec, "inv_gamma", 0.01);
  FreeNet net = step0();
  auto ema = emakit::ema_pytorch(*net, {.beta = 0.999, .update_after_step = 0, .update_every = 1, .inv_gamma = 0.01});
  free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::implicit}, ema_pytorch_step_initted);
  CHECK(ema.decay() == Approx(0.999));  // the warmup reached beta
}

// ---- timm ModelEmaV3 --------------------------------------------------------------------------------

TEST_CASE("free run: timm ModelEmaV3, warmup by step, decay 0.9999", "[conformance][free][timm]") {
  const auto dir = scenario_dir("free_run_peer", "timm_warmup");
  if (!dir) return;
  require_option(load_recorded(*dir), "use_warmup", 1);
  FreeNet net = step0();
  auto ema = emakit::timm_model_ema_v3(*net, {.use_warmup = true});
  free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::passed}, no_peer_counters);
}

TEST_CASE("free run: timm ModelEmaV3 without warmup, update(model, step), decay 0.9999", "[conformance][free][timm]") {
  const auto dir = scenario_dir("free_run_peer", "timm_step");
  if (!dir) return;
  FreeNet net = step0();
  auto ema = emakit::timm_model_ema_v3(*net);
  free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::passed}, no_peer_counters);
  CHECK(ema.decay() == 0.9999);
}

TEST_CASE("free run: timm ModelEmaV3, decay 0.999, exclude_buffers", "[conformance][free][timm]") {
  const auto dir = scenario_dir("free_run_peer", "timm_0999_exclude_buffers");
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  require_option(rec, "decay", 0.999);
  require_option(rec, "exclude_buffers", 1);
  FreeNet net = step0();
  auto ema = emakit::timm_model_ema_v3(*net, {.decay = 0.999, .exclude_buffers = true});
  free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::passed}, no_peer_counters);
}

TEST_CASE("free run: timm ModelEmaV3.update(model) without a step: FixedEma(0.9999), fused_lerp",
          "[conformance][free][timm]") {
  const auto dir = scenario_dir("free_run_peer", "timm_no_step");
  if (!dir) return;
  require_option(load_recorded(*dir), "pass_step", 0);
  FreeNet net = step0();
  emakit::FixedEma ema(*net, emakit::Fixed(0.9999), {},
                       emakit::EmaOptions().keep_model_dtype(true).arithmetic(emakit::Arithmetic::fused_lerp));
  const auto r = free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::implicit}, no_peer_counters);
  CHECK(r.copied == 0);  // timm averages at 0.9999 from its first update
}

// ---- torch AveragedModel ----------------------------------------------------------------------------

TEST_CASE("free run: AveragedModel(multi_avg_fn=get_ema_multi_avg_fn()), decay 0.999, buffers copied",
          "[conformance][free][averaged_model]") {
  const auto dir = scenario_dir("free_run_peer", "averaged_model_ema");
  if (!dir) return;
  require_option(load_recorded(*dir), "decay", 0.999);
  FreeNet net = step0();
  auto ema = emakit::averaged_model_ema(*net);
  const auto r =
      free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::implicit}, updates_counter("n_averaged"));
  CHECK(r.averaged == emakit_free_run::kTotal - 1);
}

TEST_CASE("free run: AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(0.9999), use_buffers=True)",
          "[conformance][free][averaged_model]") {
  const auto dir = scenario_dir("free_run_peer", "averaged_model_ema_9999_buffers");
  if (!dir) return;
  require_option(load_recorded(*dir), "decay", 0.9999);
  FreeNet net = step0();
  auto ema = emakit::averaged_model_ema(*net, {.decay = 0.9999, .use_buffers = true});
  free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::implicit}, updates_counter("n_averaged"));
}

// AveragedModel(model), SWA: the one peer whose CPU arithmetic no preset computes. torch's CPU path
// divides, a + (x - a) / (n + 1) (get_swa_avg_fn); its CUDA path lerps with 1 / (n + 1), which the
// preset computes (fused_lerp, w = 1/n exactly): so on CPU a bound, derived here, not bitwise.
// In ulps of float32 at M, the largest magnitude of the run (the model's values and both averages;
// |x - a| <= 2M): each side's update n is the exact a + (x - a)/n within 1/2 (the result's rounding)
// + 1/2 (x - a) + 1/2 (the quotient, or the weight 1/n) + 1/2 (the product) of 2M/n, so the two
// results of update n from the same a differ by at most 1 + 4/n; an earlier difference e is carried
// as (1 - 1/n) e. After N updates: |e_N| <= sum_{k=2..N} (1 + 4/k) k/N = ((N + 1) / 2 - 1/N) +
// 4 (N - 1) / N <= (N + 9) / 2 ulps. The first update copies (bitwise).
TEST_CASE("free run: AveragedModel(model) (SWA) on CPU, within the derived (N + 9) / 2 ulps",
          "[conformance][free][averaged_model]") {
  const auto dir = scenario_dir("free_run_peer", "averaged_model_swa");
  if (!dir) return;
  const Recorded rec = load_recorded(*dir);
  FreeNet net = step0();
  auto swa = emakit::averaged_model_swa(*net);
  REQUIRE(swa.options().arithmetic() == emakit::Arithmetic::fused_lerp);
  std::size_t row = 0;
  int compared = 0, bitwise = 0;
  double worst = 0, worst_bound_share = 0;
  double magnitude = 0;
  for (std::int64_t k = 1; k <= rec.total; ++k) {
    emakit_free_run::write_step(*net, k);
    for (const auto& e : emakit_free_run::state_dict_entries(*net))
      if (e.tensor.is_floating_point()) magnitude = std::max(magnitude, e.tensor.abs().max().item<double>());
    swa.update();
    if (row >= rec.steps.size() || rec.steps[row] != k) continue;
    const auto index = static_cast<std::int64_t>(row++);
    CHECK(swa.num_updates() == at_row(rec.trajectory, "n_averaged", index));
    const emakit::StateDict held = swa.averages();
    for (const auto& name : rec.names) {
      INFO(name << " at step " << k);
      const at::Tensor peer = rec.trajectory.at("peer." + name)[index];
      const at::Tensor* ours = held.find(name);
      ++compared;
      if (ours == nullptr || !peer.is_floating_point() || k == 1) {  // left alone, integers, the copy
        const at::Tensor& expected = ours != nullptr ? *ours : peer;
        CHECK(torch::equal(expected, peer));
        bitwise += 1;
        continue;
      }
      magnitude = std::max({magnitude, peer.abs().max().item<double>(), ours->abs().max().item<double>()});
      const double n = static_cast<double>(swa.num_updates());
      const double bound = (n + 9) / 2;
      const double ulps =
          emakit_test::max_ulps_at(*ours, peer, at::full_like(peer, magnitude, at::kDouble), at::kFloat);
      CHECK(ulps <= bound);
      worst = std::max(worst, ulps);
      worst_bound_share = std::max(worst_bound_share, ulps / bound);
      bitwise += torch::equal(*ours, peer) ? 1 : 0;
    }
  }
  REQUIRE(row == rec.steps.size());
  REQUIRE(compared == static_cast<int>(rec.steps.size() * rec.names.size()));
  REQUIRE(swa.num_updates() == rec.total);
  std::cout << "averaged_model_swa (fused_lerp against the CPU's division): " << compared << " tensor comparisons at "
            << rec.steps.size() << " recorded steps, " << bitwise << " bitwise; max " << worst
            << " ulps at the run's magnitude, " << worst_bound_share << " of the bound (N + 9) / 2\n";
}

// AveragedModel(avg_fn=get_ema_avg_fn(d)): averaged_model_ema's policies and options (its preset is
// the multi_avg_fn one), with the arithmetic set by hand.
emakit::Ema<emakit::Fixed> averaged_model_avg_fn(FreeNet& net, double decay, bool use_buffers) {
  return emakit::Ema<emakit::Fixed>(
      *net, emakit::Fixed(decay), emakit::averaged_model_schedule(),
      emakit::averaged_model_options(use_buffers).arithmetic(emakit::Arithmetic::weighted_sum));
}

TEST_CASE("free run: AveragedModel(avg_fn=get_ema_avg_fn()), decay 0.999, buffers copied: weighted_sum",
          "[conformance][free][averaged_model]") {
  const auto dir = scenario_dir("free_run_peer", "averaged_model_avg_fn");
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  require_option(rec, "decay", 0.999);
  require_option(rec, "multi", 0);
  FreeNet net = step0();
  auto ema = averaged_model_avg_fn(net, 0.999, false);
  free_run(*dir, net, ema, {emakit::Arithmetic::weighted_sum, Step::implicit}, updates_counter("n_averaged"));
}

TEST_CASE("free run: AveragedModel(avg_fn=get_ema_avg_fn(0.9999), use_buffers=True): weighted_sum",
          "[conformance][free][averaged_model]") {
  const auto dir = scenario_dir("free_run_peer", "averaged_model_avg_fn_9999_buffers");
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  require_option(rec, "decay", 0.9999);
  require_option(rec, "use_buffers", 1);
  FreeNet net = step0();
  auto ema = averaged_model_avg_fn(net, 0.9999, true);
  free_run(*dir, net, ema, {emakit::Arithmetic::weighted_sum, Step::implicit}, updates_counter("n_averaged"));
}

// ---- diffusers EMAModel -----------------------------------------------------------------------------

// emakit's lerp, a + W(x - a) rounded twice, is diffusers' a - W(a - x) bit for bit while W < 0.5
// (twin()): the two differ only in the ramp's and the warmup's first steps (d <= 0.5), which a long
// run forgets, so the lerp control may end equal; with min_decay = decay, W is 1 at the first step
// and 1e-4 after: equal throughout. foreach=True's fused subtraction is fused_lerp's twin alike.
const Expect kDiffusers{.arithmetic = emakit::Arithmetic::subtract};

TEST_CASE("free run: diffusers EMAModel, the TF ramp (its defaults): subtract", "[conformance][free][diffusers]") {
  const auto dir = scenario_dir("free_run_peer", "diffusers_ramp");
  if (!dir) return;
  FreeNet net = step0();
  auto ema = emakit::diffusers_ema_model(*net);
  const auto r = free_run(*dir, net, ema, kDiffusers, step_counter("optimization_step"));
  CHECK(r.untouched == 0);                                        // parameters only, on both sides
  CHECK(control_of(r, emakit::Arithmetic::lerp).first_step > 0);  // the ramp's first steps
}

TEST_CASE("free run: diffusers EMAModel, use_ema_warmup: subtract", "[conformance][free][diffusers]") {
  const auto dir = scenario_dir("free_run_peer", "diffusers_warmup");
  if (!dir) return;
  require_option(load_recorded(*dir), "use_ema_warmup", 1);
  FreeNet net = step0();
  auto ema = emakit::diffusers_ema_model_warmup(*net, {.use_ema_warmup = true});
  const auto r = free_run(*dir, net, ema, kDiffusers, step_counter("optimization_step"));
  CHECK(control_of(r, emakit::Arithmetic::lerp).first_step > 0);  // the warmup's first steps
}

TEST_CASE("free run: diffusers EMAModel, min_decay = decay = 0.9999: subtract", "[conformance][free][diffusers]") {
  const auto dir = scenario_dir("free_run_peer", "diffusers_fixed_9999");
  if (!dir) return;
  require_option(load_recorded(*dir), "min_decay", 0.9999);
  FreeNet net = step0();
  auto ema = emakit::diffusers_ema_model(*net, {.min_decay = 0.9999});
  const auto r = free_run(*dir, net, ema, kDiffusers, step_counter("optimization_step"));
  CHECK(r.second_form_steps == 0);
  CHECK(ema.decay() == 0.9999);
}

// EMAModel(foreach=True): _foreach_sub_(s, s - p, alpha = 1 - d), fma(-W, fl(s - p), s), which is
// fused_lerp's fma(W, fl(p - s), s) bit for bit while W < 0.5 (twin()): the fused_lerp control
// may end equal, but must differ in the ramp's first steps.
TEST_CASE("free run: diffusers EMAModel(foreach=True), the TF ramp: fused_subtract", "[conformance][free][diffusers]") {
  const auto dir = scenario_dir("free_run_peer", "diffusers_foreach");
  if (!dir) return;
  require_option(load_recorded(*dir), "foreach", 1);
  FreeNet net = step0();
  auto ema = emakit::diffusers_ema_model(*net, {.foreach = true});
  const auto r =
      free_run(*dir, net, ema, {.arithmetic = emakit::Arithmetic::fused_subtract}, step_counter("optimization_step"));
  CHECK(r.untouched == 0);
  CHECK(control_of(r, emakit::Arithmetic::fused_lerp).first_step > 0);  // the ramp's first steps
}

// ---- DINO's teacher ---------------------------------------------------------------------------------

// DINO's teacher update, mul_(m).add_((1 - m) * x) over the parameters, with its cosine_scheduler
// (K' = K): cosine_momentum_teacher with CosineEnd::after_last_step and Arithmetic::weighted_sum.
void dino_case(const std::string& scenario, double start) {
  const auto dir = scenario_dir("free_run_peer", scenario);
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  require_option(rec, "start", start);
  require_option(rec, "total_steps", 1000);
  REQUIRE(rec.total == 1000);  // DINO's schedule has one value per iteration
  FreeNet net = step0();
  auto ema = emakit::cosine_momentum_teacher(*net, {.start = start,
                                                    .end = 1.0,
                                                    .total_steps = 1000,
                                                    .endpoint = emakit::CosineEnd::after_last_step,
                                                    .arithmetic = emakit::Arithmetic::weighted_sum});
  const auto r = free_run(*dir, net, ema, {emakit::Arithmetic::weighted_sum, Step::implicit}, no_peer_counters);
  CHECK(r.untouched == 3 * r.recorded);  // the teacher's buffers: running stats and num_batches_tracked
  CHECK(r.averaged == 1000);
}

TEST_CASE("free run: DINO teacher, cosine momentum 0.996 -> 1: weighted_sum", "[conformance][free][dino]") {
  dino_case("dino_cosine_0996", 0.996);
}

TEST_CASE("free run: DINO teacher, cosine momentum 0.99 -> 1: weighted_sum", "[conformance][free][dino]") {
  dino_case("dino_cosine_099", 0.99);
}

// ---- Lightning EMAWeightAveraging (seed venv or fixture) ---------------------------------------------

void lightning_case(const std::string& scenario, double decay) {
  const auto dir = scenario_dir("free_run_seed_peer", scenario);
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  if (decay != 0.999) require_option(rec, "decay", decay);
  REQUIRE(rec.meta.at("every").item<std::int64_t>() == 10);
  FreeNet net = step0();
  auto ema = emakit::lightning_ema_weight_averaging(*net, {.decay = decay});
  const auto r = free_run(*dir, net, ema, {emakit::Arithmetic::weighted_sum, Step::implicit},
                          both(updates_counter("n_averaged"), step_counter("global_step")));
  CHECK(r.recorded == 102);  // steps 10, 20, .., 1010 and 1011
  CHECK(r.averaged == emakit_free_run::kTotal - 1);
}

TEST_CASE("free run: Lightning EMAWeightAveraging in a real fit, decay 0.999 (default): weighted_sum",
          "[conformance][free][lightning]") {
  lightning_case("lightning_default", 0.999);
}

TEST_CASE("free run: Lightning EMAWeightAveraging in a real fit, decay 0.9999: weighted_sum",
          "[conformance][free][lightning]") {
  lightning_case("lightning_9999", 0.9999);
}

// ---- lightly (seed venv or fixture) -----------------------------------------------------------------

void lightly_case(const std::string& scenario, double start) {
  const auto dir = scenario_dir("free_run_seed_peer", scenario);
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  require_option(rec, "start", start);
  require_option(rec, "total_steps", 1000);
  FreeNet net = step0();
  auto ema = emakit::cosine_momentum_teacher(*net, {.start = start, .end = 1.0, .total_steps = 1000});
  const auto r = free_run(*dir, net, ema, {emakit::Arithmetic::scaled_fused_add, Step::implicit}, no_peer_counters);
  CHECK(r.untouched == 3 * r.recorded);  // update_momentum takes parameters only
}

TEST_CASE("free run: lightly cosine_schedule 0.996 -> 1 over 1000 steps, update_momentum: scaled_fused_add",
          "[conformance][free][lightly]") {
  lightly_case("lightly_cosine_0996", 0.996);
}

TEST_CASE("free run: lightly cosine_schedule 0.99 -> 1 over 1000 steps, update_momentum: scaled_fused_add",
          "[conformance][free][lightly]") {
  lightly_case("lightly_cosine_099", 0.99);
}

// ---- luxonis-train ModelEma (seed venv or fixture) --------------------------------------------------

void luxonis_case(const std::string& scenario, const emakit::LuxonisModelEmaOptions& o) {
  const auto dir = scenario_dir("free_run_seed_peer", scenario);
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  if (rec.meta.count("opt.decay") != 0) {
    require_option(rec, "decay", o.decay);
    require_option(rec, "decay_tau", o.decay_tau);
  }
  FreeNet net = step0();
  auto ema = emakit::luxonis_model_ema(*net, o);
  const auto r = free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::implicit}, updates_counter("updates"));
  CHECK(r.copied == 0);  // ModelEma averages from its first update (d = decay (1 - e^(-1/tau)))
}

TEST_CASE("free run: luxonis-train ModelEma, its defaults (0.9999, tau 2000): fused_lerp",
          "[conformance][free][luxonis]") {
  luxonis_case("luxonis_default", {});
}

TEST_CASE("free run: luxonis-train ModelEma, decay 0.999, tau 100: fused_lerp", "[conformance][free][luxonis]") {
  luxonis_case("luxonis_0999_tau100", {.decay = 0.999, .decay_tau = 100.0});
}

// ---- nvalchemi EMAHook (seed venv or fixture) -------------------------------------------------------

void nvalchemi_case(const std::string& scenario, double decay) {
  const auto dir = scenario_dir("free_run_seed_peer", scenario);
  if (!dir) return;
  const auto rec = load_recorded(*dir);
  if (decay != 0.999) require_option(rec, "decay", decay);
  FreeNet net = step0();
  auto ema = emakit::nvalchemi_ema(*net, {.decay = decay});
  const auto r = free_run(*dir, net, ema, {emakit::Arithmetic::fused_lerp, Step::implicit},
                          both(updates_counter("num_updates"), updates_counter("n_averaged")));
  CHECK(r.averaged == emakit_free_run::kTotal - 1);
}

TEST_CASE("free run: nvalchemi EMAHook, decay 0.999 (default), use_buffers: fused_lerp",
          "[conformance][free][nvalchemi]") {
  nvalchemi_case("nvalchemi_default", 0.999);
}

TEST_CASE("free run: nvalchemi EMAHook, decay 0.9999: fused_lerp", "[conformance][free][nvalchemi]") {
  nvalchemi_case("nvalchemi_9999", 0.9999);
}

}  // namespace test_free_running
