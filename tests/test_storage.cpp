// Storage policies: flat state dict and module-backed (Cloneable module or factory).
#include <emakit/aliases.hpp>
#include <emakit/storage.hpp>

#include "helpers.hpp"

#include <catch2/catch.hpp>

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

TEST_CASE("ModuleStorage without a factory for a non-Cloneable module is an error that says what to do",
          "[storage][errors]") {
  PlainNet model;
  using PlainEma = emakit::Ema<emakit::Fixed, emakit::StepSchedule, emakit::ModuleStorage<PlainNetImpl>>;
  CHECK_THROWS_WITH(PlainEma(*model), Contains("not Cloneable") && Contains("factory"));
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

}  // namespace test_storage
