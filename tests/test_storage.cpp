// Storage policies: flat state dict and module-backed (Cloneable module or factory).
#include <emakit/aliases.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/hooks.hpp>
#include <emakit/posthoc.hpp>
#include <emakit/storage.hpp>
#include <emakit/teacher.hpp>

#include "helpers.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <catch2/catch.hpp>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace test_storage {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit_test::PlainNet;
using emakit_test::PlainNetImpl;
using emakit_test::TinyNet;
using emakit_test::TinyNetImpl;

static_assert(emakit::StoragePolicy<emakit::FlatStorage>);
static_assert(emakit::StoragePolicy<emakit::ModuleStorage<TinyNetImpl>>);
static_assert(emakit::CloneableModule<TinyNetImpl>);
static_assert(!emakit::CloneableModule<PlainNetImpl>);

TEST_CASE("FlatStorage holds a copy of every tensor, sharing no memory with the model", "[storage]") {
  TinyNet model;
  emakit::FixedEma ema(*model);
  const auto averages = ema.averages();
  CHECK(averages.size() == 8);  // 4 parameters, 3 BatchNorm buffers, scale
  for (const auto& item : model->named_parameters()) {
    const auto& mine = averages[item.key()];
    CHECK(torch::equal(mine, item.value()));
    CHECK(mine.data_ptr() != item.value().data_ptr());
    CHECK_FALSE(mine.requires_grad());
  }
}

TEST_CASE("ModuleStorage clones a Cloneable model and runs forward on the average", "[storage]") {
  torch::manual_seed(0);
  TinyNet model;
  emakit::ModuleEma<TinyNetImpl> ema(*model);
  const auto& ema_module = ema.module();
  REQUIRE(ema_module);
  CHECK_FALSE(ema_module->is_training());
  for (const auto& p : ema_module->parameters()) CHECK_FALSE(p.requires_grad());

  const auto x = torch::randn({5, 3});
  model->eval();
  // The module's tensors are copies of the model's (the first average is a copy), and the same
  // operations run on the same bits: bitwise.
  CHECK(torch::equal(ema_module->forward(x), model->forward(x)));

  // The module's own tensors are the average: an update shows in its forward.
  emakit_test::fill_floats(*model, 0.5);
  emakit::ModuleEma<TinyNetImpl> fast(*model, emakit::Fixed(0.0));
  emakit_test::fill_floats(*model, 2.0);
  fast.update();
  CHECK(torch::equal(fast.module()->fc->weight, torch::full({4, 3}, 2.0)));
  CHECK(fast.module()->fc->weight.data_ptr() == fast.average("fc.weight").data_ptr());
}

TEST_CASE("ModuleStorage builds a non-Cloneable module with a factory and copies weights by name", "[storage]") {
  torch::manual_seed(1);
  PlainNet model;
  int made = 0;
  emakit::ModuleStorage<PlainNetImpl> storage([&] {
    ++made;
    return std::make_shared<PlainNetImpl>();
  });
  emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<PlainNetImpl>> ema(
      *model, emakit::Fixed(), emakit::StepSchedule(), emakit::EmaOptions(), std::move(storage));
  CHECK(made == 1);
  CHECK(torch::equal(ema.module()->fc->weight, model->fc->weight));
  CHECK(ema.module()->fc->weight.data_ptr() != model->fc->weight.data_ptr());
}

// Without a factory, a module that is not Cloneable fails to compile, naming the fix:
// tests/compile_fail/module_storage_without_factory.cpp.
TEST_CASE("module_ema makes a module EMA from a factory, with Ema's policies, options and defaults", "[storage]") {
  torch::manual_seed(1);
  PlainNet model;
  int made = 0;
  auto ema = emakit::module_ema(*model, [&] {
    ++made;
    return std::make_shared<PlainNetImpl>();
  });
  static_assert(std::is_same_v<decltype(ema), emakit::ModuleEma<PlainNetImpl>>);
  CHECK(made == 1);
  CHECK(ema.decay_policy() == emakit::Fixed());
  CHECK(torch::equal(ema.module()->fc->weight, model->fc->weight));
  CHECK(ema.module()->fc->weight.data_ptr() != model->fc->weight.data_ptr());

  auto slow = emakit::module_ema(
      *model, [] { return std::make_shared<PlainNetImpl>(); }, emakit::InversePowerWarmup(0.999),
      emakit::StepSchedule().update_every(2), emakit::EmaOptions().dtype(torch::kFloat64));
  static_assert(std::is_same_v<decltype(slow), emakit::ModuleWarmupEma<PlainNetImpl>>);
  CHECK(slow.decay_policy() == emakit::InversePowerWarmup(0.999));
  CHECK(slow.schedule().update_every() == 2);
  CHECK(slow.module()->fc->weight.scalar_type() == torch::kFloat64);
}

namespace {
struct OtherNetImpl : torch::nn::Module {
  OtherNetImpl() { fc = register_module("fc", torch::nn::Linear(3, 5)); }
  torch::nn::Linear fc{nullptr};
};
}  // namespace

TEST_CASE("A factory that builds another architecture is an error naming the tensor", "[storage][errors]") {
  PlainNet model;
  using OtherEma = emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<OtherNetImpl>>;
  auto factory = [] { return std::make_shared<OtherNetImpl>(); };
  CHECK_THROWS_WITH(OtherEma(*model, {}, {}, {}, emakit::ModuleStorage<OtherNetImpl>(factory)),
                    Contains("fc.weight") && Contains("[5, 3]") && Contains("[4, 3]"));
  CHECK_THROWS_WITH(emakit::ModuleStorage<OtherNetImpl>(nullptr), Contains("factory is empty"));
}

TEST_CASE("ModuleStorage keeps the average in the EMA's dtype while non-float buffers keep theirs", "[storage]") {
  TinyNet model;
  emakit_test::cast_floats(*model, torch::kBFloat16);
  emakit::ModuleEma<TinyNetImpl> ema(*model);
  CHECK(ema.module()->fc->weight.scalar_type() == torch::kFloat);
  CHECK(ema.module()->bn->num_batches_tracked.scalar_type() == torch::kLong);
}

// A storage that holds every other tensor (what ShardedStorage does for another rank's tensors:
// an undefined tensor from create() means "held elsewhere").
struct EveryOtherStorage {
  std::vector<at::Tensor> create(const torch::nn::Module*, std::span<const emakit::TensorSpec> specs) {
    std::vector<at::Tensor> out;
    for (std::size_t i = 0; i < specs.size(); ++i)
      out.push_back(i % 2 == 0 ? specs[i].source.detach().to(specs[i].dtype).clone() : at::Tensor());
    return out;
  }
};
static_assert(emakit::StoragePolicy<EveryOtherStorage>);

TEST_CASE("A storage may hold only some tensors: the Ema updates, saves and loads just those", "[storage]") {
  torch::manual_seed(0);
  TinyNet model;
  emakit::Ema<emakit::Fixed, emakit::StepSchedule, EveryOtherStorage> part(*model, emakit::Fixed(0.5));
  emakit::FixedEma whole(*model, emakit::Fixed(0.5));
  const auto names = part.averages().keys();
  CHECK(names.size() == 4);  // of 8
  emakit_test::perturb(*model);
  part.update();
  whole.update();
  for (const auto& name : names) CHECK(emakit_test::bitwise_equal(part.average(name), whole.average(name)));
  CHECK_THROWS_WITH(part.average("fc.bias"), Contains("no tensor 'fc.bias'"));
  // Its state holds its own tensors; the whole EMA's state has more, which strict loading names.
  emakit::Ema<emakit::Fixed, emakit::StepSchedule, EveryOtherStorage> again(*model, emakit::Fixed(0.5));
  again.load_state_dict(part.state_dict());
  for (const auto& name : names) CHECK(emakit_test::bitwise_equal(again.average(name), part.average(name)));
  CHECK_THROWS_WITH(again.load_state_dict(whole.state_dict()), Contains("unexpected key 'average.fc.bias'"));
}

// ---- a seeded run is the same run with an EMA (issue 49) ------------------------------------

// A generated model: its architecture comes from `seed` through its own std::mt19937_64 (never
// from torch's generator), its weights from torch's generator like any module's: Linear layers of
// random widths, BatchNorm1d, Dropout (which draws at every training forward) and Tanh, 1 to 5 of
// them, then a Linear head. Cloneable, so ModuleStorage can clone it; a factory makes one from
// the seed alone.
struct GenNetImpl : torch::nn::Cloneable<GenNetImpl> {
  explicit GenNetImpl(std::uint64_t seed_) : seed(seed_) { reset(); }
  void reset() override {
    std::mt19937_64 pick(seed);
    width_in = 2 + static_cast<std::int64_t>(pick() % 6);
    layers = register_module("layers", torch::nn::Sequential());
    std::int64_t width = width_in;
    const int depth = 1 + static_cast<int>(pick() % 5);
    for (int d = 0; d < depth; ++d) {
      switch (pick() % 4) {
        case 0: {
          const std::int64_t out = 2 + static_cast<std::int64_t>(pick() % 7);
          layers->push_back(torch::nn::Linear(width, out));
          width = out;
          break;
        }
        case 1: layers->push_back(torch::nn::BatchNorm1d(width)); break;
        case 2: layers->push_back(torch::nn::Dropout(0.25)); break;
        default: layers->push_back(torch::nn::Tanh()); break;
      }
    }
    head = register_module("head", torch::nn::Linear(width, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(layers->forward(x)); }

  std::uint64_t seed;
  std::int64_t width_in = 0;
  torch::nn::Sequential layers{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GenNet);

// What a run leaves: the trained model's tensors and the default generator's next draws.
struct RunResult {
  std::map<std::string, torch::Tensor> model;
  torch::Tensor next_draws;
};
// Attaches an EMA of some kind to the freshly made model; returns what the loop calls after each
// optimizer step (it owns the EMA), and `last` after the last step.
struct Attached {
  std::function<void()> after_step;
  std::function<void()> last;
};
using Attach = std::function<Attached(GenNet&, const std::filesystem::path&)>;

// The seeded loop a user writes: seed, model, [EMA], SGD over random batches through dropout.
RunResult seeded_run(std::uint64_t seed, const Attach& attach) {
  emakit_test::TempDir folder;
  torch::manual_seed(seed);
  GenNet model(seed);
  Attached ema;
  if (attach) ema = attach(model, folder.path);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 4; ++step) {
    const auto x = torch::randn({8, model->width_in});
    const auto loss = model->forward(x).pow(2).mean();
    optimizer.zero_grad();
    loss.backward();
    optimizer.step();
    if (ema.after_step) ema.after_step();
  }
  if (ema.last) ema.last();
  return {emakit_test::model_snapshot(*model), torch::randn({16})};
}

using GenEma = emakit::ModuleEma<GenNetImpl>;
using FactoryEma = emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<GenNetImpl>>;

// Every kind of EMA a trainer makes right after its model, updated after each step, saved and
// loaded at the end.
std::vector<std::pair<std::string, Attach>> ema_kinds() {
  std::vector<std::pair<std::string, Attach>> kinds;
  kinds.emplace_back("FixedEma (FlatStorage)", [](GenNet& model, const std::filesystem::path& dir) {
    auto ema = std::make_shared<emakit::FixedEma>(*model, emakit::Fixed(0.9));
    return Attached{[ema] { ema->update(); },
                    [ema, file = dir / "flat.ema"] {
                      emakit::save(*ema, file);
                      emakit::load(*ema, file);
                    }};
  });
  kinds.emplace_back("ModuleEma (a Cloneable model's clone)", [](GenNet& model, const std::filesystem::path& dir) {
    auto ema = std::make_shared<GenEma>(*model, emakit::Fixed(0.9));
    return Attached{[ema] { ema->update(); },
                    [ema, &model, file = dir / "module.ema"] {
                      emakit::save(*ema, file);
                      GenEma again(*model, emakit::Fixed(0.9));  // a second EMA made mid-run, then loaded
                      emakit::load(again, file);
                    }};
  });
  kinds.emplace_back("ModuleStorage with a factory", [](GenNet& model, const std::filesystem::path&) {
    const std::uint64_t seed = model->seed;
    auto ema = std::make_shared<FactoryEma>(
        *model, emakit::Fixed(0.9), emakit::StepSchedule(), emakit::EmaOptions(),
        emakit::ModuleStorage<GenNetImpl>([seed] { return std::make_shared<GenNetImpl>(seed); }));
    return Attached{[ema] { ema->update(); }, {}};
  });
  kinds.emplace_back("EmaHook of a ModuleStorage recipe", [](GenNet& model, const std::filesystem::path& dir) {
    auto hook = std::make_shared<emakit::EmaHook>();
    hook->add(*model, emakit::Recipe(emakit::Fixed(0.9), emakit::StepSchedule(), emakit::EmaOptions(),
                                     emakit::ModuleStorage<GenNetImpl>()));
    hook->setup();
    return Attached{[hook] { hook->after_optimizer_step(); },
                    [hook, file = dir / "hook.ckpt"] {
                      hook->save_checkpoint(file);
                      hook->load_checkpoint(file);
                    }};
  });
  kinds.emplace_back("TeacherStudent owning a ModuleEma", [](GenNet& model, const std::filesystem::path&) {
    // Routes the teacher's head into the student's head, which changes the student's outputs: the
    // loop uses the wrapper for its EMA only (made, updated), as a trainer does between epochs.
    auto wrapper = std::make_shared<emakit::TeacherStudent<GenEma>>(*model, GenEma(*model, emakit::Fixed(0.9)),
                                                                    emakit::TeacherRoutes::paths({"head"}));
    return Attached{[wrapper] { wrapper->update(); }, {}};
  });
  kinds.emplace_back("PostHocEma with snapshots, synthesized", [](GenNet& model, const std::filesystem::path& dir) {
    auto posthoc =
        std::make_shared<emakit::PostHocEma>(*model, emakit::PostHocOptions(dir / "snapshots").snapshot_every(2));
    return Attached{[posthoc] { posthoc->update(); },
                    [posthoc, &model] {
                      // into a second model of the architecture, made without a trace in the
                      // default generator (its draws are the test's, not emakit's)
                      auto generator = at::detail::getDefaultCPUGenerator();  // a handle
                      const auto state = generator.get_state();
                      GenNet target(model->seed);
                      generator.set_state(state);
                      emakit::synthesize_into(posthoc->plan(emakit::SynthesisOptions::from_sigma_rel(0.07)), *target);
                    }};
  });
  return kinds;
}

bool same_run(const RunResult& a, const RunResult& b) {
  return emakit_test::same_snapshot(a.model, b.model) && emakit_test::bitwise_equal(a.next_draws, b.next_draws);
}

TEST_CASE("A seeded training run is bitwise the same run with an EMA of any kind: making, updating, saving and "
          "loading it draws nothing from the default generator",
          "[storage][generators]") {
  constexpr std::uint64_t kModels = 24;
  const auto kinds = ema_kinds();
  std::size_t runs = 0, tensors = 0;
  for (std::uint64_t seed = 0; seed < kModels; ++seed) {
    const RunResult plain = seeded_run(seed, {});
    REQUIRE(plain.model.size() >= 2);  // at least the head's weight and bias
    // The check can fail: one extra draw after the model changes the run.
    const RunResult disturbed = seeded_run(seed, [](GenNet&, const std::filesystem::path&) {
      (void)torch::rand({1});
      return Attached{};
    });
    REQUIRE_FALSE(same_run(plain, disturbed));
    for (const auto& [kind, attach] : kinds) {
      INFO("model seed " << seed << ", " << kind);
      const RunResult with_ema = seeded_run(seed, attach);
      CHECK(same_run(plain, with_ema));
      ++runs;
      tensors += with_ema.model.size();
    }
  }
  CHECK(runs == kModels * kinds.size());
  CHECK(kinds.size() == 6);  // FlatStorage, a clone, a factory, a hook, a teacher, post-hoc
  CHECK(tensors >= runs * 2);
}

TEST_CASE("A storage that throws while it draws leaves the default generator as it was", "[storage][generators]") {
  torch::manual_seed(7);
  GenNet model(3);
  const auto state = at::detail::getDefaultCPUGenerator().get_state();  // not a draw
  CHECK_THROWS_WITH(FactoryEma(*model, emakit::Fixed(0.9), emakit::StepSchedule(), emakit::EmaOptions(),
                               emakit::ModuleStorage<GenNetImpl>([]() -> std::shared_ptr<GenNetImpl> {
                                 (void)torch::randn({100});
                                 throw std::runtime_error("the factory's own error");
                               })),
                    Contains("the factory's own error"));
  CHECK(emakit_test::bitwise_equal(at::detail::getDefaultCPUGenerator().get_state(), state));
}

}  // namespace test_storage
