// An Ema whose bound model was destroyed (issue 25, finding 6): update(), switch_model() and
// swap_into() refuse with an error that says what happened and what to do; the EMA's own state
// (averages(), state_dict(), save()) still reads, bitwise as before, and copy_to() puts it into a
// new model. An Ema that cannot see the model's end (a module not owned by a shared_ptr, a list of
// tensors) keeps its own references and goes on (docs/ema.md, "Identity and ownership").
#include <emakit/emakit.hpp>

#include "helpers.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

using Catch::Matchers::Contains;
using emakit::Action;
using emakit_test::PlainNetImpl;
using emakit_test::TinyNet;
using emakit_test::TinyNetImpl;

namespace {

// How the bound model is held, and how it comes to be destroyed while its Ema lives.
enum class Holder : std::uint8_t {
  holder_reassigned,    // TinyNet model; Ema(*model); model = TinyNet() (a rebuilt model)
  holder_out_of_scope,  // the ModuleHolder's scope ends
  make_shared_custom,   // std::make_shared<PlainNetImpl>() (a custom Module), the shared_ptr reset
  child_replaced,       // Ema(*parent->fc); the live parent's fc replaced (replace_module) and dropped
};

const char* holder_name(Holder h) {
  switch (h) {
    case Holder::holder_reassigned: return "a ModuleHolder reassigned (a rebuilt model)";
    case Holder::holder_out_of_scope: return "a ModuleHolder out of scope";
    case Holder::make_shared_custom: return "make_shared of a custom Module";
    case Holder::child_replaced: return "a sub-module of a live parent, replaced";
  }
  return "?";
}

const std::string destroyed = "the model this Ema was bound to has been destroyed (a rebuilt model?)";
const std::string what_to_do = "make a new Ema for the new model, or load this EMA's state into it";

// Every tensor of `averages` is in `model` under its name, bitwise equal; returns how many it compared.
std::size_t require_model_holds(const torch::nn::Module& model,
                                const torch::OrderedDict<std::string, torch::Tensor>& averages) {
  const auto theirs = emakit_test::model_snapshot(model);
  std::size_t compared = 0;
  for (const auto& item : averages) {
    INFO("tensor " << item.key());
    REQUIRE(theirs.count(item.key()) == 1);
    CHECK(emakit_test::bitwise_equal(theirs.at(item.key()), item.value()));
    ++compared;
  }
  return compared;
}

}  // namespace

TEST_CASE("An Ema whose model was destroyed refuses update and swap_into, its own state still reads",
          "[ema][orphan][errors]") {
  const Holder kind = GENERATE(Holder::holder_reassigned, Holder::holder_out_of_scope, Holder::make_shared_custom,
                               Holder::child_replaced);
  INFO("model held by " << holder_name(kind));
  torch::manual_seed(25);
  std::optional<TinyNet> tiny;           // the model, or the parent of the bound sub-module
  std::shared_ptr<PlainNetImpl> plain;   // the custom Module
  torch::nn::Module* bound = nullptr;
  if (kind == Holder::make_shared_custom) {
    plain = std::make_shared<PlainNetImpl>();
    bound = plain.get();
  } else {
    tiny.emplace();
    bound = kind == Holder::child_replaced ? static_cast<torch::nn::Module*>((*tiny)->fc.get()) : tiny->get();
  }
  const std::weak_ptr<const torch::nn::Module> watch = bound->weak_from_this();
  REQUIRE_FALSE(watch.expired());  // a shared_ptr owns it: the case this checks

  emakit::FixedEma ema(*bound, emakit::Fixed(0.9));
  for (int i = 0; i < 3; ++i) {
    emakit_test::perturb(*bound);
    REQUIRE(ema.update().action != Action::skipped);
  }
  const auto averages_before = emakit_test::snapshot(ema.averages());
  const auto state_before = emakit_test::snapshot(ema.state_dict());
  REQUIRE(averages_before.size() == (kind == Holder::child_replaced ? 2u : 8u));  // fc.{weight,bias} (+ bn, scale)
  const auto calls = ema.calls();
  const auto updates = ema.num_updates();

  switch (kind) {
    case Holder::holder_reassigned: *tiny = TinyNet(); break;
    case Holder::holder_out_of_scope: tiny.reset(); break;
    case Holder::make_shared_custom: plain.reset(); break;
    case Holder::child_replaced: {
      torch::nn::Linear fresh(3, 4);
      (*tiny)->replace_module("fc", fresh);
      (*tiny)->fc = fresh;  // the parent lives on; nothing holds the old fc
      break;
    }
  }
  bound = nullptr;
  REQUIRE(watch.expired());

  // What would use the bound model's tensors is refused, naming the call, and changes nothing.
  CHECK_THROWS_WITH(ema.update(), Contains("update(): " + destroyed) && Contains(what_to_do));
  CHECK_THROWS_WITH(ema.update({.step = 100}), Contains("update(): " + destroyed));
  CHECK_THROWS_WITH((void)ema.swap_into(), Contains("swap_into(): " + destroyed) && Contains(what_to_do));
  CHECK_THROWS_WITH(ema.switch_model(0.5), Contains("switch_model(): " + destroyed));
  CHECK(ema.calls() == calls);
  CHECK(ema.num_updates() == updates);

  // The EMA's own state is the user's data: it reads, bitwise what it was before the model went.
  CHECK(emakit_test::same_averages(ema.averages(), averages_before));
  CHECK(emakit_test::same_averages(ema.state_dict(), state_before));
  CHECK(ema.state_dict().size() == state_before.size());

  // ... and reaches a new model: saved and loaded into a new Ema, or copied into it.
  emakit_test::TempDir dir;
  const auto file = (dir.path / "orphan.pt").string();
  emakit::save(ema, file);
  torch::nn::Module* fresh_model = nullptr;
  TinyNet rebuilt;
  if (kind == Holder::child_replaced)
    fresh_model = (*tiny)->fc.get();
  else
    fresh_model = rebuilt.get();
  emakit::FixedEma moved_on(*fresh_model, emakit::Fixed(0.9));
  emakit::load(moved_on, file);
  CHECK(emakit_test::same_averages(moved_on.averages(), averages_before));
  CHECK(moved_on.calls() == calls);
  CHECK(moved_on.num_updates() == updates);
  CHECK(moved_on.update().action == Action::averaged);  // the new Ema works on its live model
  emakit::FixedEma handed_over(*fresh_model, emakit::Fixed(0.9));
  handed_over.load_state_dict(ema.state_dict());
  CHECK(emakit_test::same_averages(handed_over.averages(), averages_before));
  CHECK(handed_over.calls() == calls);

  ema.copy_to(*fresh_model);
  CHECK(require_model_holds(*fresh_model, ema.averages()) == averages_before.size());
}

TEST_CASE("An Ema bound to a module no shared_ptr owns, or to tensors, keeps its own references",
          "[ema][orphan]") {
  // Neither can see the model's end (docs/ema.md): the Ema holds the tensors themselves, so it
  // goes on averaging them, correctly and safely, but nothing trains them any more. This pins the
  // documented behaviour: the check must not refuse where it cannot know.
  SECTION("a Module not owned by a shared_ptr") {
    std::optional<TinyNetImpl> model(std::in_place);
    REQUIRE(model->weak_from_this().expired());  // no shared_ptr: nothing to watch
    emakit_test::fill_floats(*model, 1.0);
    emakit::FixedEma ema(*model, emakit::Fixed(0.5));
    emakit_test::fill_floats(*model, 3.0);
    model.reset();
    CHECK(ema.update().action == Action::averaged);
    CHECK(torch::equal(ema.average("fc.weight"), torch::full({4, 3}, 2.0)));
    CHECK_NOTHROW(ema.swap_into());
  }
  SECTION("a list of a ModuleHolder's tensors") {
    std::optional<TinyNet> model(std::in_place);
    emakit_test::fill_floats(**model, 1.0);
    std::vector<emakit::SourceTensor> tensors;
    for (const auto& p : (*model)->named_parameters()) tensors.push_back({p.key(), p.value(), false});
    emakit::FixedEma ema(std::move(tensors), emakit::Fixed(0.5));
    emakit_test::fill_floats(**model, 3.0);
    model.reset();
    CHECK(ema.update().action == Action::averaged);
    CHECK(torch::equal(ema.average("fc.weight"), torch::full({4, 3}, 2.0)));
    CHECK_NOTHROW(ema.swap_into());
  }
}

TEST_CASE("A parent-bound Ema whose sub-module was replaced is not orphaned: swap_into names the tensor",
          "[ema][orphan][errors]") {
  // The two checks do not meet: the parent is alive (update() goes on; check_model_alive passes),
  // and swap_into() reports the replaced tensor (check_model_unchanged), not a destroyed model.
  TinyNet parent;
  emakit::FixedEma ema(*parent, emakit::Fixed(0.5));
  const std::weak_ptr<const torch::nn::Module> old_fc = parent->fc.ptr();
  torch::nn::Linear fresh(3, 4);
  parent->replace_module("fc", fresh);
  parent->fc = fresh;
  REQUIRE(old_fc.expired());
  CHECK(ema.update().action == Action::averaged);
  CHECK_THROWS_WITH((void)ema.swap_into(), Contains("'fc.weight' is not the one the EMA was bound to") &&
                                               Contains("replace_module") && !Contains("destroyed"));
}
