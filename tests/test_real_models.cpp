// Models as users write them, and misuse as users make it (issue 14): tied weights, modules
// built around another module's tensor, sparse tensors, steps out of range, swap guards ended out
// of order or over another EMA, threads, and a model changed after binding. Each case averages
// correctly, or is refused with an error that names the tensor, before anything changes.
#include <emakit/emakit.hpp>
#include <emakit/posthoc.hpp>

#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace test_real_models {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::Action;
using emakit_test::bitwise_equal;
using emakit_test::TinyNet;

namespace {

// One tensor under two names, as a language model ties its embedding to its output head.
struct TiedImpl : torch::nn::Cloneable<TiedImpl> {
  TiedImpl() { reset(); }
  void reset() override {
    embed = register_parameter("embed", torch::randn({5, 3}));
    head = register_parameter("head", embed);
    bias = register_parameter("bias", torch::randn({5}));
  }
  torch::Tensor embed, head, bias;
};
TORCH_MODULE(Tied);

// The same, without the tie: a factory may build the EMA module of a tied model this way.
struct UntiedImpl : torch::nn::Module {
  UntiedImpl() {
    embed = register_parameter("embed", torch::randn({5, 3}));
    head = register_parameter("head", torch::randn({5, 3}));
    bias = register_parameter("bias", torch::randn({5}));
  }
  torch::Tensor embed, head, bias;
};

// A sub-module registered under two names (a shared block).
struct SharedBlockImpl : torch::nn::Cloneable<SharedBlockImpl> {
  SharedBlockImpl() { reset(); }
  void reset() override {
    a = register_module("a", torch::nn::Linear(2, 2));
    b = register_module("b", a);
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

// A head built around a tensor it is given, whose reset() registers that tensor again: LibTorch's
// clone() of the model then returns a module whose head.weight is the model's embedding weight.
struct HeadImpl : torch::nn::Cloneable<HeadImpl> {
  explicit HeadImpl(torch::Tensor w) : given(std::move(w)) { reset(); }
  void reset() override { weight = register_parameter("weight", given); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(x, weight.t()); }
  torch::Tensor given, weight;
};
TORCH_MODULE(Head);

struct LmImpl : torch::nn::Cloneable<LmImpl> {
  LmImpl() { reset(); }
  void reset() override {
    embedding = register_module("embedding", torch::nn::Embedding(5, 3));
    head = register_module("head", Head(embedding->weight));
  }
  torch::Tensor forward(const torch::Tensor& ids) { return head->forward(embedding->forward(ids)); }
  torch::nn::Embedding embedding{nullptr};
  Head head{nullptr};
};
TORCH_MODULE(Lm);

void shift(const torch::Tensor& t, double by) {
  torch::NoGradGuard no_grad;
  t.add_(by);
}

// An average that started at `start` and took one update towards x = fl(start + s) with w s = 1
// (w = 1/2 or 1/4, exact) against fl(start + 1), in fp32 ulps at max(|start|, |x|): the update is
// 2 ulps from the exact lerp (helpers.hpp; w exact), which is w times the rounding of start + s
// (1/4 ulp at most) from start + 1, itself rounded once (1/2): 2.75. Twice would be off by 1/2.
double once_ulps(const torch::Tensor& got, const torch::Tensor& start, const torch::Tensor& x) {
  return emakit_test::max_ulps_at(got, start + 1.0, emakit_test::operand_magnitude(start, x), torch::kFloat);
}

// The state of `ema` loads into a fresh Ema of the same model and gives the same averages.
template <class E, class... Args>
void check_round_trip(const E& ema, Args&&... make_args) {
  E fresh(std::forward<Args>(make_args)...);
  fresh.load_state_dict(ema.state_dict());
  CHECK(fresh.step() == ema.step());
  CHECK(fresh.calls() == ema.calls());
  CHECK(fresh.num_updates() == ema.num_updates());
  CHECK(emakit_test::same_averages(fresh.averages(), emakit_test::snapshot(ema.averages())));
}

}  // namespace

TEST_CASE("A tied weight is one average, updated once, under both names, with every storage", "[real-models]") {
  torch::manual_seed(1);
  Tied model;
  REQUIRE(model->embed.is_same(model->head));

  auto check = [&](auto& ema, const std::string& what) {
    INFO(what);
    const torch::Tensor start = model->embed.detach().clone();  // each EMA starts here
    shift(model->embed, 2.0);
    const auto r = ema.update();
    CHECK(r.action == Action::averaged);
    CHECK(r.decay == 0.5);
    // Once: 0.5 * start + 0.5 * (start + 2) = start + 1 (twice would give start + 1.5).
    CHECK(once_ulps(ema.average("embed"), start, model->embed) <= 2.75);
    CHECK(ema.average("head").is_same(ema.average("embed")));
    const auto names = ema.names(emakit::Role::average);
    CHECK(names == std::vector<std::string>{"embed", "head", "bias"});
    const auto state = ema.state_dict();
    REQUIRE(state.contains("average.embed"));
    REQUIRE(state.contains("average.head"));
    shift(model->embed, -2.0);
  };
  {
    emakit::FixedEma ema(*model, emakit::Fixed(0.5));
    check(ema, "FlatStorage");
    check_round_trip(ema, *model, emakit::Fixed(0.5));
  }
  {
    emakit::ModuleEma<TiedImpl> ema(*model, emakit::Fixed(0.5));
    check(ema, "ModuleStorage, clone");
    CHECK(ema.module()->embed.is_same(ema.module()->head));
    CHECK(ema.module()->embed.is_same(ema.average("embed")));
    check_round_trip(ema, *model, emakit::Fixed(0.5));
  }
  {
    // A factory whose module does not tie: the storage ties its two tensors, so that the EMA
    // module computes with the one average under both names.
    using E = emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<UntiedImpl>>;
    E ema(*model, emakit::Fixed(0.5), {}, {},
          emakit::ModuleStorage<UntiedImpl>([] { return std::make_shared<UntiedImpl>(); }));
    check(ema, "ModuleStorage, factory");
    CHECK(ema.module()->head.data_ptr() == ema.module()->embed.data_ptr());
    CHECK(torch::equal(ema.module()->head, ema.average("embed")));
  }
}

TEST_CASE("A factory module that ties what the model keeps apart is refused", "[real-models]") {
  UntiedImpl model;
  using E = emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<TiedImpl>>;
  REQUIRE_THROWS_WITH(E(model, emakit::Fixed(0.5), {}, {},
                        emakit::ModuleStorage<TiedImpl>([] { return std::make_shared<TiedImpl>(); })),
                      Contains("one tensor for 'embed' and 'head'") && Contains("tie"));
}

TEST_CASE("A sub-module registered twice is averaged once, under both names", "[real-models]") {
  torch::manual_seed(2);
  auto model = std::make_shared<SharedBlockImpl>();
  REQUIRE(model->named_parameters().contains("b.weight"));
  const torch::Tensor start = model->a->weight.detach().clone();
  emakit::ModuleEma<SharedBlockImpl> ema(*model, emakit::Fixed(0.75));
  shift(model->a->weight, 4.0);
  ema.update();
  CHECK(once_ulps(ema.average("a.weight"), start, model->a->weight) <= 2.75);  // 0.25 * 4 once
  CHECK(ema.average("b.weight").is_same(ema.average("a.weight")));
  CHECK(ema.averages().size() == 4);
}

TEST_CASE("A tied tensor whose two names differ in a state is refused, and one name alone loads it", "[real-models]") {
  torch::manual_seed(3);
  Tied model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  ema.update();
  const auto before = emakit_test::snapshot(ema.averages());

  emakit::StateDict spoiled;
  for (const auto& item : ema.state_dict())
    spoiled.insert(item.key(), item.key() == "average.head" ? item.value() + 1.0 : item.value().clone());
  REQUIRE_THROWS_WITH(ema.load_state_dict(spoiled),
                      Contains("average.head") && Contains("differs from 'average.embed'") && Contains("tied"));
  CHECK(emakit_test::same_averages(ema.averages(), before));

  // One name alone (a deduplicating writer, a sharded checkpoint) loads the tensor, also strictly;
  // a tensor is missing only when none of its names is there.
  emakit::StateDict one_name;
  for (const auto& item : ema.state_dict())
    if (item.key() != "average.head") one_name.insert(item.key(), item.value().clone());
  one_name["average.embed"].add_(3.0);
  const auto report = ema.load_state_dict(one_name);
  CHECK(report.clean());
  CHECK(torch::equal(ema.average("head"), before.at("embed") + 3.0));
  one_name.erase("average.embed");
  const auto none = ema.load_state_dict(one_name, emakit::LoadMode::lenient);
  CHECK(none.missing == std::vector<std::string>{"average.embed", "average.head"});
}

TEST_CASE("Names of one tied tensor must agree on its role, and ignoring one name keeps the other", "[real-models]") {
  Tied model;
  REQUIRE_THROWS_WITH(emakit::FixedEma(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().copy_only({"head"})),
                      Contains("'embed' and 'head' are one tensor") && Contains("same role"));
  emakit::FixedEma ema(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().ignore({"head"}));
  CHECK(ema.averages().size() == 2);
  CHECK(!ema.averages().contains("head"));
}

TEST_CASE("Overlapping views of one tensor cannot be averaged apart: refused, naming both", "[real-models]") {
  torch::manual_seed(5);
  torch::Tensor whole = torch::randn({4, 4});
  std::vector<emakit::SourceTensor> parts{{"top", whole.narrow(0, 0, 3)}, {"bottom", whole.narrow(0, 2, 2)}};
  REQUIRE_THROWS_WITH(emakit::FixedEma(parts, emakit::Fixed(0.5)),
                      Contains("'top' and 'bottom'") && Contains("overlapping memory"));
  // Disjoint views of one storage (a fused weight split into parts) are independent tensors.
  std::vector<emakit::SourceTensor> split{{"q", whole.narrow(0, 0, 2)}, {"k", whole.narrow(0, 2, 2)}};
  emakit::FixedEma ema(split, emakit::Fixed(0.5));
  {
    torch::NoGradGuard no_grad;
    whole.add_(2.0);
  }
  const torch::Tensor before = ema.average("q").clone();
  ema.update();
  CHECK(once_ulps(ema.average("q"), before, whole.narrow(0, 0, 2)) <= 2.75);
}

TEST_CASE("A module whose clone hands back the model's tensor is refused, and the model is untouched",
          "[real-models]") {
  torch::manual_seed(4);
  Lm model;
  REQUIRE(model->head->weight.is_same(model->embedding->weight));
  const void* data = model->embedding->weight.data_ptr();
  const torch::Tensor values = model->embedding->weight.detach().clone();

  REQUIRE_THROWS_WITH(emakit::ModuleEma<LmImpl>(*model, emakit::Fixed(0.5)),
                      Contains("'head.weight'") && Contains("model's own tensor 'embedding.weight'") &&
                          Contains("Nothing was changed"));
  CHECK(model->embedding->weight.requires_grad());
  CHECK(model->embedding->weight.data_ptr() == data);
  CHECK(model->head->weight.is_same(model->embedding->weight));
  CHECK(torch::equal(model->embedding->weight, values));
  // The model still trains.
  model->forward(torch::tensor({1, 2}, torch::kLong)).sum().backward();
  CHECK(model->embedding->weight.grad().defined());

  // A factory builds a fresh model with its own tie: one average, and the model keeps its tensor.
  using E = emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<LmImpl>>;
  E ema(*model, emakit::Fixed(0.5), {}, {}, emakit::ModuleStorage<LmImpl>([] { return std::make_shared<LmImpl>(); }));
  CHECK(model->embedding->weight.requires_grad());
  CHECK(!ema.average("head.weight").is_alias_of(model->embedding->weight));
  CHECK(ema.module()->head->weight.is_same(ema.module()->embedding->weight));
  shift(model->embedding->weight, 2.0);
  ema.update();
  CHECK(once_ulps(ema.average("head.weight"), values, model->embedding->weight) <= 2.75);
  // FlatStorage of the same model: the tie is one average too.
  emakit::FixedEma flat(*model, emakit::Fixed(0.5));
  CHECK(flat.average("head.weight").is_same(flat.average("embedding.weight")));
}

TEST_CASE("A storage that returns the model's memory is refused", "[real-models]") {
  struct Sharing {
    std::vector<at::Tensor> create(const torch::nn::Module*, std::span<const emakit::TensorSpec> specs) {
      std::vector<at::Tensor> out;
      for (const auto& s : specs) out.push_back(s.source.detach());  // the model's memory
      return out;
    }
  };
  TinyNet model;
  using E = emakit::Ema<emakit::Fixed, emakit::StepSchedule, Sharing>;
  REQUIRE_THROWS_WITH(E(*model, emakit::Fixed(0.5)), Contains("shares memory with the model's 'fc.weight'"));
}

TEST_CASE("A sparse tensor in the model is refused by name, not an abort, and ignored it is left alone",
          "[real-models]") {
  struct SparseImpl : torch::nn::Module {
    SparseImpl() {
      w = register_parameter("w", torch::randn({3, 3}));
      table = register_buffer("table", torch::eye(3).to_sparse());
    }
    torch::Tensor w, table;
  };
  SparseImpl model;
  REQUIRE_THROWS_WITH(emakit::FixedEma(model, emakit::Fixed(0.5)),
                      Contains("'table'") && Contains("sparse") && Contains("ignore"));
  emakit::FixedEma ema(model, emakit::Fixed(0.5), {}, emakit::EmaOptions().ignore({"table"}));
  CHECK(ema.averages().size() == 1);
  // A sparse parameter, bound as a tensor list, and a big one (past the huge-page threshold).
  std::vector<emakit::SourceTensor> tensors{{"sp", torch::eye(1024).to_sparse()}};
  REQUIRE_THROWS_WITH(emakit::FixedEma(tensors, emakit::Fixed(0.5)), Contains("'sp'") && Contains("sparse"));
}

TEST_CASE("Steps out of range are refused before anything changes, so every reached state saves and loads",
          "[real-models]") {
  constexpr auto max = std::numeric_limits<std::int64_t>::max();
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  REQUIRE_THROWS_WITH(ema.update({.step = -1}), Contains("update({.step = -1})") && Contains(">= 0"));
  CHECK(ema.calls() == 0);

  ema.update({.step = max - 1});
  ema.update();
  CHECK(ema.step() == max);
  REQUIRE_THROWS_WITH(ema.update(), Contains("step counter is at its maximum"));
  CHECK(ema.calls() == 2);
  emakit_test::TempDir dir;
  emakit::save(ema, dir.path / "max.pt");
  emakit::FixedEma back(*model, emakit::Fixed(0.5));
  emakit::load(back, dir.path / "max.pt");
  CHECK(back.step() == max);

  emakit::FixedEma advanced(*model, emakit::Fixed(0.5));
  advanced.advance(max, max);
  REQUIRE_THROWS_WITH(advanced.update(), Contains("call counter is at its maximum"));
  check_round_trip(advanced, *model, emakit::Fixed(0.5));

  emakit::PowerEma power(*model, emakit::PowerFunction::from_sigma_rel(0.1));
  power.update({.step = 10});
  REQUIRE_THROWS_WITH(power.update({.step = 5}),
                      Contains("update({.step = 5})") && Contains("went backwards") && Contains("last step was 10"));

  emakit::FixedEma fixed(*model, emakit::Fixed(0.5));
  fixed.update({.step = 5});
  REQUIRE_THROWS_WITH(fixed.update({.step = 5}), Contains("step 5 was already applied"));
  REQUIRE_THROWS_WITH(fixed.update({.step = 3}), Contains("went backwards"));
  CHECK(fixed.update({.step = 5, .vetoed = true}).action == Action::skipped);  // a vetoed step repeats nothing
  CHECK(fixed.update({.step = 6}).action == Action::averaged);
  CHECK(fixed.num_updates() == 2);
}

// Random sequences of update() calls, given steps among them (many invalid): each call either
// succeeds or throws and changes nothing, and every state reached saves and loads.
TEST_CASE("Any sequence of updates leaves a state that loads, or throws and changes nothing", "[real-models]") {
  constexpr auto max = std::numeric_limits<std::int64_t>::max();
  for (int seed = 0; seed < 40; ++seed) {
    INFO("seed " << seed);
    torch::manual_seed(seed);
    TinyNet model;
    const auto schedule = emakit::StepSchedule()
                              .update_every(1 + seed % 3)
                              .accumulate(1 + (seed / 3) % 2)
                              .start_step(seed % 4)
                              .warmup(static_cast<emakit::Warmup>(seed % 3));
    emakit::Ema<emakit::PowerFunction> ema(*model, emakit::PowerFunction(5.0), schedule);
    std::mt19937_64 rng(static_cast<std::uint64_t>(seed));
    for (int call = 0; call < 30; ++call) {
      emakit::StepInfo info;
      switch (rng() % 6) {
        case 0: info.step = ema.step() > max - 3 ? max : ema.step() + static_cast<std::int64_t>(rng() % 3); break;
        case 1: info.step = ema.step() - 1 - static_cast<std::int64_t>(rng() % 3); break;
        case 2: info.step = max - static_cast<std::int64_t>(rng() % 3); break;
        case 3: info.vetoed = true; break;
        default: break;
      }
      emakit_test::perturb(*model);
      const auto before = emakit_test::snapshot(ema.averages());
      const auto calls = ema.calls(), step = ema.step(), updates = ema.num_updates();
      try {
        ema.update(info);
      } catch (const std::invalid_argument&) {
        CHECK(ema.calls() == calls);
        CHECK(ema.step() == step);
        CHECK(ema.num_updates() == updates);
        CHECK(emakit_test::same_averages(ema.averages(), before));
      }
      check_round_trip(ema, *model, emakit::PowerFunction(5.0), schedule);
    }
  }
}

TEST_CASE("Swap guards ended in any order give the model its own weights back", "[real-models]") {
  torch::manual_seed(5);
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  emakit_test::perturb(*model, 1.0);
  ema.update();
  emakit_test::perturb(*model, 1.0);
  // Every parameter and buffer of the model, by name (the EMA holds them all).
  auto model_now = [&] { return emakit_test::model_snapshot(*model); };
  const auto own = model_now();
  {
    auto g1 = ema.swap_into();
    auto g2 = ema.swap_into();
    CHECK(emakit_test::same_averages(ema.averages(), model_now()));
    g1.restore();  // the outer guard first: the model keeps the EMA weights while g2 is open
    CHECK(emakit_test::same_averages(ema.averages(), model_now()));
    REQUIRE_THROWS_WITH(ema.update(), Contains("SwapGuard"));
  }
  for (const auto& [name, t] : model_now()) CHECK(bitwise_equal(t, own.at(name)));
  {
    auto g1 = ema.swap_into();
    { auto g2 = ema.swap_into(); }
    CHECK(emakit_test::same_averages(ema.averages(), model_now()));
  }
  for (const auto& [name, t] : model_now()) CHECK(bitwise_equal(t, own.at(name)));
  CHECK(ema.update().action == Action::averaged);
}

TEST_CASE("Two EMAs of one model: one refuses to update or swap while the other's guard is open", "[real-models]") {
  torch::manual_seed(6);
  TinyNet model;
  emakit::FixedEma e1(*model, emakit::Fixed(0.5));
  emakit::FixedEma e2(*model, emakit::Fixed(0.9));
  emakit_test::perturb(*model, 1.0);
  e2.update();
  const auto before = emakit_test::snapshot(e1.averages());
  {
    auto g = e2.swap_into();
    REQUIRE_THROWS_WITH(e1.update(), Contains("another Ema's weights"));
    REQUIRE_THROWS_WITH(e1.swap_into(), Contains("another Ema's weights"));
    REQUIRE_THROWS_WITH(e1.switch_model(0.0), Contains("another Ema's weights"));
  }
  CHECK(emakit_test::same_averages(e1.averages(), before));
  CHECK(e1.calls() == 0);
  CHECK(e1.update().action == Action::averaged);
}

namespace {
// A decay that, on request, waits inside update() until another thread has tried its own update.
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool armed = false, inside = false, released = false;
};
struct GatedDecay {
  std::shared_ptr<Gate> gate = std::make_shared<Gate>();
  double decay(const emakit::DecayInput&) const {
    std::unique_lock lock(gate->m);
    if (gate->armed) {
      gate->inside = true;
      gate->cv.notify_all();
      gate->cv.wait(lock, [&] { return gate->released; });
    }
    return 0.5;
  }
};
}  // namespace

TEST_CASE("Two threads calling update() on one Ema at once: the second is refused, counters stay exact",
          "[real-models]") {
  TinyNet model;
  GatedDecay decay;
  emakit::Ema<GatedDecay> ema(*model, decay);
  decay.gate->armed = true;
  std::thread first([&] { ema.update(); });
  {
    std::unique_lock lock(decay.gate->m);
    decay.gate->cv.wait(lock, [&] { return decay.gate->inside; });
  }
  CHECK_THROWS_WITH(ema.update(), Contains("another update() of this Ema is running") && Contains("not thread-safe"));
  {
    std::lock_guard lock(decay.gate->m);
    decay.gate->released = true;
    decay.gate->armed = false;
  }
  decay.gate->cv.notify_all();
  first.join();
  CHECK(ema.calls() == 1);
  CHECK(ema.num_updates() == 1);
  CHECK(ema.update().action == Action::averaged);
}

TEST_CASE("A model changed after binding: swap_into() names the replaced or reshaped tensor", "[real-models]") {
  TinyNet model;
  emakit::FixedEma ema(*model, emakit::Fixed(0.5));
  model->replace_module("fc", torch::nn::Linear(3, 4));
  REQUIRE_THROWS_WITH(ema.swap_into(),
                      Contains("'fc.weight' is not the one the EMA was bound to") && Contains("replace_module"));

  TinyNet other;
  emakit::FixedEma reshaped(*other, emakit::Fixed(0.5));
  {
    torch::NoGradGuard no_grad;
    other->fc->weight.set_data(torch::randn({2, 2}));
  }
  REQUIRE_THROWS_WITH(reshaped.swap_into(), Contains("'fc.weight' changed shape from [4, 3] to [2, 2]"));
}

TEST_CASE("Options that cannot hold: CUDA without CUDA, a name both ignored and copied, nothing left",
          "[real-models]") {
  TinyNet model;
  if (!at::globalContext().hasCUDA()) {
    REQUIRE_THROWS_WITH(emakit::FixedEma(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().device(torch::kCUDA)),
                        Contains("EmaOptions::device is cuda") && Contains("no CUDA"));
  } else {  // with a GPU the same line must work
    emakit::FixedEma on_gpu(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().device(torch::kCUDA));
    CHECK(on_gpu.average("fc.weight").is_cuda());
  }
  REQUIRE_THROWS_WITH(
      emakit::FixedEma(*model, emakit::Fixed(0.5), {}, emakit::EmaOptions().ignore({"fc.bias"}).copy_only({"fc.bias"})),
      Contains("'fc.bias' is in both ignore and copy_only"));
  REQUIRE_THROWS_WITH(emakit::FixedEma(*model, emakit::Fixed(0.5), {},
                                       emakit::EmaOptions().ignore_prefixes({"fc."}).copy_only({"fc.bias"})),
                      Contains("ignore_prefixes has 'fc.'"));
  REQUIRE_THROWS_WITH(
      emakit::FixedEma(*model, emakit::Fixed(0.5), {},
                       emakit::EmaOptions().ignore_prefixes({"fc.", "bn."}).buffers(emakit::TensorMode::ignore)),
      Contains("every tensor of the model is ignored"));
}

namespace {
struct HalfLife {  // two custom decay policies without a name
  double decay(const emakit::DecayInput&) const { return 0.5; }
};
struct Quarter {
  double decay(const emakit::DecayInput&) const { return 0.25; }
};
}  // namespace

TEST_CASE("Two custom decay policies without a name do not load each other's states", "[real-models]") {
  TinyNet model;
  emakit::Ema<HalfLife> a(*model);
  emakit::Ema<Quarter> b(*model);
  a.update();
  REQUIRE_THROWS_WITH(b.load_state_dict(a.state_dict()),
                      Contains("decay policy is custom:") && Contains("HalfLife") && Contains("Quarter"));
  emakit::Ema<HalfLife> a2(*model);
  a2.load_state_dict(a.state_dict());
  CHECK(a2.num_updates() == 1);
}

TEST_CASE("A tied model through the hook's checkpoint and post-hoc synthesis: the tie holds, one average",
          "[real-models]") {
  torch::manual_seed(7);
  emakit_test::TempDir dir;
  Tied model;
  emakit::EmaHook hook;
  hook.add(*model, emakit::Recipe(emakit::Fixed(0.5)));
  hook.setup();
  emakit::PostHocEma posthoc(*model, emakit::PostHocOptions(dir.path / "phema").snapshot_every(2));
  emakit::FixedEma plain(*model, emakit::Fixed(0.5));
  for (int step = 1; step <= 4; ++step) {
    emakit_test::perturb(*model);
    hook.after_optimizer_step();
    posthoc.update();
    plain.update();
  }
  auto& ema = hook.ema<emakit::FixedEma>("model");
  CHECK(emakit_test::same_averages(ema.averages(), emakit_test::snapshot(plain.averages())));
  hook.save_checkpoint(dir.path / "last.pt");

  Tied resumed_model;
  emakit::EmaHook resumed;
  resumed.add(*resumed_model, emakit::Recipe(emakit::Fixed(0.5)));
  resumed.setup();
  resumed.load_checkpoint(dir.path / "last.pt");
  CHECK(resumed_model->embed.is_same(resumed_model->head));  // loading keeps the model's tie
  CHECK(torch::equal(resumed_model->embed, model->embed));
  auto& back = resumed.ema<emakit::FixedEma>("model");
  CHECK(emakit_test::same_averages(back.averages(), emakit_test::snapshot(ema.averages())));
  CHECK(back.average("head").is_same(back.average("embed")));

  Tied deployed;
  emakit::load_weights(*deployed, dir.path / "last.pt");  // the EMA weights, tie kept
  CHECK(deployed->embed.is_same(deployed->head));
  CHECK(torch::equal(deployed->embed, ema.average("embed")));

  Tied synthesized;
  emakit::synthesize_into(emakit::plan_synthesis(dir.path / "phema", emakit::SynthesisOptions::from_sigma_rel(0.07)),
                          *synthesized);
  CHECK(synthesized->embed.is_same(synthesized->head));
  CHECK(torch::isfinite(synthesized->embed).all().item<bool>());
}

}  // namespace test_real_models
