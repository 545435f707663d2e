// An Ema whose bound model was destroyed (issue 25, finding 6): update(), switch_model() and
// swap_into() refuse with an error that says what happened and what to do; the EMA's own state
// (averages(), state_dict(), save()) still reads, bitwise as before, and copy_to() puts it into a
// new model. An Ema that cannot see the model's end (a module not owned by a shared_ptr, a list of
// tensors) keeps its own references and goes on (docs/ema.md, "The bound model's lifetime").
// The same for the two that borrow a model by raw pointer, where the old code read freed memory:
// an EmaHook refuses every call that would use a destroyed model, naming its key, before any
// model changes; a TeacherStudent refuses to run a destroyed student. The "nothing to watch"
// cases pin the other side: a model no shared_ptr owns is never refused (they fail if the check
// forgets whether a shared_ptr owned the model).
#include <emakit/emakit.hpp>
#include <emakit/teacher.hpp>

#include "helpers.hpp"

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace test_orphan {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::Action;
using emakit::Creation;
using emakit::EmaHook;
using emakit::Recipe;
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
  std::optional<TinyNet> tiny;          // the model, or the parent of the bound sub-module
  std::shared_ptr<PlainNetImpl> plain;  // the custom Module
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

TEST_CASE("An Ema bound to a module no shared_ptr owns, or to tensors, keeps its own references", "[ema][orphan]") {
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

// ---- EmaHook and TeacherStudent: a model borrowed by raw pointer ------------------------------

namespace {

const std::string hook_what_to_do = "Make a new EmaHook for the new model";

// "<call>(): model '<key>' of this EmaHook has been destroyed".
std::string hook_destroyed(const std::string& call, const std::string& key) {
  return call + "(): model '" + key + "' of this EmaHook has been destroyed (a rebuilt model?)";
}

}  // namespace

TEST_CASE("An EmaHook whose model was destroyed before its EMA was made refuses the step", "[hooks][orphan][errors]") {
  // start_step 0: the first step would make the EMA from the destroyed model (the old code read
  // freed memory there); 3: a step the schedule skips, refused all the same (nothing trains it).
  const std::int64_t start_step = GENERATE(0, 3);
  INFO("start_step " << start_step);
  std::optional<TinyNet> model(std::in_place);
  EmaHook hook;
  hook.add("net", **model, emakit::nvalchemi_ema_recipe({.decay = 0.9, .start_step = start_step}),
           {.creation = Creation::at_first_eligible_step});
  hook.setup();
  REQUIRE_FALSE(hook.created("net"));
  model.reset();

  CHECK_THROWS_WITH(hook.after_optimizer_step(), Contains(hook_destroyed("after_optimizer_step", "net")) &&
                                                     Contains("before its EMA was made") &&
                                                     Contains("nothing was changed") && Contains(hook_what_to_do));
  CHECK_FALSE(hook.created("net"));
  CHECK_THROWS_WITH((void)hook.validation(), Contains(hook_destroyed("validation_start", "net")));
  CHECK_THROWS_WITH(hook.after_optimizer_step({.step = 10}), Contains(hook_destroyed("after_optimizer_step", "net")));
  CHECK_FALSE(hook.created("net"));
}

TEST_CASE("An EmaHook refuses every call that would use a destroyed model, naming its key, before any model changes",
          "[hooks][orphan][errors]") {
  // Two models: "live" (added first, so the old code stepped, swapped or wrote it before it met
  // the destroyed one) and "dead", rebuilt after its EMA was made.
  torch::manual_seed(2525);
  TinyNet live;
  std::optional<TinyNet> dead(std::in_place);
  EmaHook hook;
  hook.add("live", *live, Recipe(emakit::Fixed(0.9)));
  hook.add("dead", **dead, Recipe(emakit::Fixed(0.8)));
  hook.setup();
  for (int i = 0; i < 3; ++i) {
    emakit_test::perturb(*live);
    emakit_test::perturb(**dead);
    REQUIRE(hook.after_optimizer_step().size() == 2);
  }
  emakit_test::TempDir dir;
  const auto earlier = dir.path / "earlier.pt";
  hook.save_checkpoint(earlier);  // a checkpoint from before the model went, to load later
  emakit_test::perturb(*live);
  emakit_test::perturb(**dead);
  REQUIRE(hook.after_optimizer_step().size() == 2);  // the hook now differs from the checkpoint

  auto& live_ema = hook.ema<emakit::FixedEma>("live");
  auto& dead_ema = hook.ema<emakit::FixedEma>("dead");
  const auto live_averages = emakit_test::snapshot(live_ema.averages());
  const auto dead_averages = emakit_test::snapshot(dead_ema.averages());
  const auto live_weights = emakit_test::model_snapshot(*live);
  REQUIRE(live_averages.size() == 8);  // fc.{weight,bias}, bn.{weight,bias,running_*,num_batches_tracked}, scale
  REQUIRE(dead_averages.size() == 8);
  REQUIRE(live_weights.size() == 8);
  REQUIRE_FALSE(emakit_test::same_averages(live_ema.averages(), emakit_test::model_snapshot(*live)));
  const auto live_calls = live_ema.calls();
  const auto dead_calls = dead_ema.calls();

  const std::weak_ptr<const torch::nn::Module> watch = dead->ptr();
  *dead = TinyNet();  // a rebuilt model
  REQUIRE(watch.expired());

  // Nothing changed: neither EMA, nor the live model's weights.
  const auto unchanged = [&] {
    CHECK(live_ema.calls() == live_calls);
    CHECK(dead_ema.calls() == dead_calls);
    CHECK(emakit_test::same_averages(live_ema.averages(), live_averages));
    CHECK(emakit_test::same_averages(dead_ema.averages(), dead_averages));
    CHECK(emakit_test::same_snapshot(emakit_test::model_snapshot(*live), live_weights));
  };

  SECTION("every model with the default options") {
    CHECK_THROWS_WITH(hook.after_optimizer_step(), Contains(hook_destroyed("after_optimizer_step", "dead")) &&
                                                       Contains("nothing was changed") && Contains(hook_what_to_do) &&
                                                       Contains("hook.ema<E>(\"dead\").averages()"));
    unchanged();
    CHECK_THROWS_WITH((void)hook.validation(), Contains(hook_destroyed("validation_start", "dead")));
    CHECK_THROWS_WITH((void)hook.test(), Contains(hook_destroyed("test_start", "dead")));
    unchanged();  // the live model got its own weights back
    const auto file = dir.path / "now.pt";
    CHECK_THROWS_WITH(hook.save_checkpoint(file), Contains(hook_destroyed("save_checkpoint", "dead")));
    CHECK_FALSE(std::filesystem::exists(file));
    torch::serialize::OutputArchive archive;
    CHECK_THROWS_WITH(hook.save_checkpoint(archive), Contains(hook_destroyed("save_checkpoint", "dead")));
    archive.save_to((dir.path / "archive.pt").string());
    torch::serialize::InputArchive written;
    written.load_from((dir.path / "archive.pt").string());
    CHECK(written.keys().empty());  // nothing written into the caller's archive either
    CHECK_THROWS_WITH(hook.load_checkpoint(earlier), Contains(hook_destroyed("load_checkpoint", "dead")));
    unchanged();
    CHECK_THROWS_WITH(hook.train_end(), Contains(hook_destroyed("train_end", "dead")));
    unchanged();
    CHECK_NOTHROW(hook.setup());  // both EMAs are made: setup() has nothing to do with either model
    unchanged();
  }

  SECTION("a destroyed model that validation, test and train_end leave alone") {
    // The same hook, but "dead" takes no part in validation, test or train_end: those go on for "live".
    EmaHook quiet;
    std::optional<TinyNet> gone(std::in_place);
    quiet.add("live", *live, Recipe(emakit::Fixed(0.9)));
    quiet.add("gone", **gone, Recipe(emakit::Fixed(0.8)),
              {.validate_with_ema = false, .test_with_ema = false, .keep_ema_at_train_end = false});
    quiet.setup();
    emakit_test::perturb(*live);
    REQUIRE(quiet.after_optimizer_step().size() == 2);
    auto& quiet_live = quiet.ema<emakit::FixedEma>("live");
    const auto quiet_calls = quiet_live.calls();
    const auto before = emakit_test::model_snapshot(*live);
    gone.reset();

    CHECK_THROWS_WITH(quiet.after_optimizer_step(), Contains(hook_destroyed("after_optimizer_step", "gone")));
    CHECK(quiet_live.calls() == quiet_calls);
    {
      auto scope = quiet.validation();
      CHECK(require_model_holds(*live, quiet_live.averages()) == 8);
    }
    CHECK(emakit_test::same_snapshot(emakit_test::model_snapshot(*live), before));
    quiet.train_end();
    CHECK(require_model_holds(*live, quiet_live.averages()) == 8);
  }

  // The EMA of the destroyed model is the user's data: it reads, saves, and carries over into a
  // new hook for the new model, as the error says.
  CHECK(emakit_test::same_averages(dead_ema.averages(), dead_averages));
  const auto saved = dir.path / "dead_ema.pt";
  emakit::save(dead_ema, saved);
  EmaHook next;
  next.add("dead", **dead, Recipe(emakit::Fixed(0.8)));
  next.setup();
  next.ema<emakit::FixedEma>("dead").load_state_dict(dead_ema.state_dict());
  CHECK(emakit_test::same_averages(next.ema<emakit::FixedEma>("dead").averages(), dead_averages));
  CHECK(next.ema<emakit::FixedEma>("dead").calls() == dead_calls);
  CHECK(next.after_optimizer_step().at(0).action == Action::averaged);
  emakit::FixedEma from_file(**dead, emakit::Fixed(0.8));
  emakit::load(from_file, saved);
  CHECK(emakit_test::same_averages(from_file.averages(), dead_averages));
  // ... or the checkpoint saved before the model went, loaded into the new hook.
  EmaHook resumed;
  resumed.add("live", *live, Recipe(emakit::Fixed(0.9)));
  resumed.add("dead", **dead, Recipe(emakit::Fixed(0.8)));
  resumed.setup();
  CHECK_NOTHROW(resumed.load_checkpoint(earlier));
  CHECK(resumed.ema<emakit::FixedEma>("dead").calls() == dead_calls - 1);
}

TEST_CASE("An EmaHook takes a new model made where a destroyed one was: not the same module", "[hooks][orphan]") {
  // The hook compares models by address; a destroyed model's address may be reused by the next.
  // Placement new into one buffer makes that certain.
  alignas(TinyNetImpl) std::byte buffer[sizeof(TinyNetImpl)];
  const auto in_buffer = [&] {
    return std::shared_ptr<TinyNetImpl>(new (buffer) TinyNetImpl(), [](TinyNetImpl* p) { p->~TinyNetImpl(); });
  };
  auto first = in_buffer();
  EmaHook hook;
  hook.add("first", *first, Recipe(emakit::Fixed(0.5)));
  first.reset();
  auto second = in_buffer();
  REQUIRE(static_cast<void*>(second.get()) == static_cast<void*>(buffer));
  CHECK_NOTHROW(hook.add("second", *second, Recipe(emakit::Fixed(0.5))));
  CHECK_THROWS_WITH(hook.setup(), Contains(hook_destroyed("setup", "first")));
  CHECK_FALSE(hook.created("second"));  // refused before any EMA was made
  second.reset();
}

TEST_CASE("An EmaHook or a TeacherStudent with a model no shared_ptr owns goes on: nothing to watch",
          "[hooks][teacher][orphan]") {
  // The check must not refuse where it cannot know (such a model must outlive them, docs/hooks.md).
  TinyNetImpl model;
  REQUIRE(model.weak_from_this().expired());
  EmaHook hook;
  hook.add(model, Recipe(emakit::Fixed(0.5)));
  hook.setup();
  CHECK(hook.after_optimizer_step().at(0).action == Action::averaged);
  { auto scope = hook.validation(); }
  emakit_test::TempDir dir;
  CHECK_NOTHROW(hook.save_checkpoint(dir.path / "c.pt"));
  CHECK_NOTHROW(hook.load_checkpoint(dir.path / "c.pt"));
  CHECK_NOTHROW(hook.train_end());
}

namespace {

// Records its output as the teacher and keeps the teacher's as the student (the route "": the model itself).
struct SelfTaughtImpl : torch::nn::Cloneable<SelfTaughtImpl> {
  SelfTaughtImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(3, 4)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc->forward(x);
    emakit::record_teacher_output(*this, y);
    if (auto t = emakit::teacher_input(*this, emakit::default_teacher_input, y)) received = *t;
    return y;
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor received;
};
TORCH_MODULE(SelfTaught);

using SelfTaughtEma = emakit::ModuleEma<SelfTaughtImpl>;

const std::string student_destroyed =
    "the model (the student) this wrapper was made with has been destroyed (a rebuilt model?)";

}  // namespace

TEST_CASE("A TeacherStudent whose model was destroyed refuses to run, naming the wrapper, and its teacher still reads",
          "[teacher][orphan][errors]") {
  const bool reassigned = GENERATE(false, true);
  INFO((reassigned ? "model = SelfTaught() (a rebuilt model)" : "the ModuleHolder's scope ends"));
  torch::manual_seed(25);
  std::optional<SelfTaught> model(std::in_place);
  SelfTaughtEma ema(**model, emakit::Fixed(0.5));
  emakit_test::perturb(**model);  // the student differs from the teacher
  emakit::TeacherStudent wrapper(**model, std::move(ema), emakit::TeacherRoutes::paths({""}));
  const auto x = torch::randn({2, 3});
  const auto out = wrapper.forward(x);
  const auto teacher_out = [&] {
    torch::NoGradGuard no_grad;
    return wrapper.teacher().fc->forward(x);
  }();
  REQUIRE(emakit_test::bitwise_equal((*model)->received, teacher_out));
  REQUIRE_FALSE(emakit_test::bitwise_equal(out.detach(), teacher_out));
  const auto averages = emakit_test::snapshot(wrapper.ema().averages());
  REQUIRE(averages.size() == 2);

  if (reassigned)
    *model = SelfTaught();
  else
    model.reset();

  CHECK_THROWS_WITH(wrapper.forward(x), Contains("TeacherStudent::forward(): " + student_destroyed) &&
                                            Contains("nothing was run") &&
                                            Contains("Make a new TeacherStudent for the new model"));
  CHECK_THROWS_WITH(wrapper.forward_views(std::forward_as_tuple(x), std::forward_as_tuple(x)),
                    Contains("TeacherStudent::forward_views(): " + student_destroyed));
  CHECK_THROWS_WITH(wrapper.run([](SelfTaughtImpl&) {}, [](SelfTaughtImpl&) {}),
                    Contains("TeacherStudent::run(): " + student_destroyed));

  // The teacher is the EMA's own module: it still reads and runs, bitwise what it was.
  CHECK(emakit_test::same_averages(wrapper.ema().averages(), averages));
  {
    torch::NoGradGuard no_grad;
    CHECK(emakit_test::bitwise_equal(wrapper.teacher().fc->forward(x), teacher_out));
  }
  // No pass was left running on this thread: a wrapper of a live model runs, with this EMA's state
  // loaded into its own, as the error says.
  SelfTaught rebuilt;
  SelfTaughtEma next(*rebuilt, emakit::Fixed(0.5));
  next.load_state_dict(wrapper.ema().state_dict());
  CHECK(emakit_test::same_averages(next.averages(), averages));
  emakit::TeacherStudent again(*rebuilt, next, emakit::TeacherRoutes::paths({""}));
  CHECK_NOTHROW(again.forward(x));
  CHECK(emakit_test::bitwise_equal(rebuilt->received, teacher_out));
}

TEST_CASE("A TeacherStudent of a model no shared_ptr owns goes on: nothing to watch", "[teacher][orphan]") {
  SelfTaughtImpl model;
  REQUIRE(model.weak_from_this().expired());
  emakit::TeacherStudent wrapper(model, SelfTaughtEma(model, emakit::Fixed(0.5)), emakit::TeacherRoutes::paths({""}));
  const auto x = torch::randn({2, 3});
  CHECK_NOTHROW(wrapper.forward(x));
  CHECK(model.received.defined());
}

}  // namespace test_orphan
