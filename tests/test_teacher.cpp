// emakit::TeacherStudent: teacher sub-module outputs routed into the student, each mapping format,
// no grad and eval for the teacher, multi-view input, cleanup on exceptions, and bad input.
#include <emakit/emakit.hpp>
#include <emakit/teacher.hpp>

#include "helpers.hpp"

#include <c10/core/GradMode.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>

#include <catch2/catch.hpp>

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace test_teacher {  // this file's names (unity batches: tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using emakit::TeacherRoute;
using emakit::TeacherRoutes;
using emakit::TeacherStudent;
using emakit_test::bitwise_equal;

namespace {

// A sub-module that records its output (as a teacher) and asks for teacher inputs by name (as a
// student), keeping what it got and how it ran.
struct ProbeImpl : torch::nn::Cloneable<ProbeImpl> {
  ProbeImpl(std::int64_t in, std::int64_t out) : in_(in), out_(out) { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(in_, out_)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc->forward(x);
    ran_training = is_training();
    ran_with_grad = c10::GradMode::is_enabled();
    if (records) emakit::record_teacher_output(*this, y);
    for (const auto& name : asks) {
      std::optional<torch::Tensor> t =
          like_own_output ? emakit::teacher_input(*this, name, y) : emakit::teacher_input(*this, name);
      if (t) {
        received[name] = *t;
        if (add_input) y = y + *t;
      }
    }
    if (throw_now) throw std::runtime_error("student failed");
    return y;
  }
  std::int64_t in_, out_;
  torch::nn::Linear fc{nullptr};
  bool records = true, add_input = false, like_own_output = false, throw_now = false;
  bool ran_training = false, ran_with_grad = false;
  std::vector<std::string> asks{"ema_output"};
  std::map<std::string, torch::Tensor> received;
};
TORCH_MODULE(Probe);

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    a = register_module("a", Probe(4, 6));
    b = register_module("b", Probe(6, 6));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b->forward(a->forward(x)); }
  Probe a{nullptr}, b{nullptr};
};
TORCH_MODULE(Net);

using NetEma = emakit::ModuleEma<NetImpl>;

// The teacher's sub-module outputs for input x, computed by hand.
std::pair<torch::Tensor, torch::Tensor> teacher_outputs(NetImpl& teacher, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  auto a = teacher.a->fc->forward(x);
  auto b = teacher.b->fc->forward(a);
  return {a, b};
}

// A model and an EMA that differs from it (so teacher and student outputs differ).
struct Setup {
  Net model;
  NetEma ema;
  Setup() : model(), ema(*model, emakit::Fixed(0.5)) { emakit_test::perturb(*model, 0.5); }
};

}  // namespace

TEST_CASE("Teacher: a list of paths routes each teacher sub-module to the same path, exactly", "[teacher]") {
  torch::manual_seed(1);
  Setup s;
  TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::paths({"a", "b"}));
  const auto x = torch::randn({5, 4});
  const auto out = wrapper.forward(x);
  const auto [ta, tb] = teacher_outputs(*s.ema.module(), x);
  CHECK(bitwise_equal(s.model->a->received.at("ema_output"), ta));
  CHECK(bitwise_equal(s.model->b->received.at("ema_output"), tb));
  CHECK_FALSE(bitwise_equal(ta, s.model->a->fc->forward(x).detach()));  // the teacher is not the student
  CHECK(bitwise_equal(out.detach(), s.model->forward(x).detach()));     // the student's own output
  CHECK(out.requires_grad());
  CHECK_FALSE(s.model->a->received.at("ema_output").requires_grad());
  // The EMA module's own probes ran as the teacher and kept nothing they were not given.
  CHECK(s.ema.module()->a->received.empty());
}

TEST_CASE("Teacher: map() takes a module path as the teacher path and anything else as the name", "[teacher]") {
  torch::manual_seed(2);
  const auto x = torch::randn({3, 4});
  {
    Setup s;
    TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::map({{"b", "a"}}));  // receiver b <- teacher a
    REQUIRE(wrapper.routes().size() == 1);
    CHECK(wrapper.routes()[0].teacher == "a");
    CHECK(wrapper.routes()[0].name == "ema_output");
    s.model->a->asks.clear();
    wrapper.forward(x);
    CHECK(bitwise_equal(s.model->b->received.at("ema_output"), teacher_outputs(*s.ema.module(), x).first));
  }
  {
    Setup s;
    s.model->b->asks = {"features"};
    s.model->a->asks.clear();
    TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::map({{"b", "features"}}));  // name, teacher b
    CHECK(wrapper.routes()[0].teacher == "b");
    CHECK(wrapper.routes()[0].name == "features");
    wrapper.forward(x);
    CHECK(bitwise_equal(s.model->b->received.at("features"), teacher_outputs(*s.ema.module(), x).second));
  }
}

TEST_CASE("Teacher: the full form routes through a transform", "[teacher]") {
  torch::manual_seed(3);
  Setup s;
  s.model->a->asks.clear();
  s.model->b->asks = {"target"};
  TeacherStudent wrapper(*s.model, s.ema,
                         TeacherRoutes().add({.receiver = "b",
                                              .teacher = "a",
                                              .name = "target",
                                              .transform = [](const at::Tensor& t) { return t * 2.0; },
                                              .transform_name = "twice"}));
  const auto x = torch::randn({3, 4});
  wrapper.forward(x);
  CHECK(bitwise_equal(s.model->b->received.at("target"), teacher_outputs(*s.ema.module(), x).first * 2.0));
}

TEST_CASE("Teacher: the teacher runs without grad in eval mode, its mode is restored, no gradient reaches it",
          "[teacher]") {
  torch::manual_seed(4);
  Setup s;
  s.model->b->add_input = true;  // the student's output depends on the injected teacher output
  s.model->train();
  auto& teacher = *s.ema.module();
  teacher.train();  // a user may have switched it; the wrapper restores whatever it was
  TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::paths({"b"}));
  const auto out = wrapper.forward(torch::randn({3, 4}));
  CHECK_FALSE(teacher.b->ran_training);
  CHECK_FALSE(teacher.b->ran_with_grad);
  CHECK(teacher.is_training());
  CHECK(s.model->b->ran_training);
  CHECK(s.model->b->ran_with_grad);
  out.sum().backward();
  CHECK(s.model->b->fc->weight.grad().defined());
  for (const auto& p : teacher.parameters()) CHECK_FALSE(p.grad().defined());
  teacher.eval();
  wrapper.forward(torch::randn({3, 4}));
  CHECK_FALSE(teacher.is_training());
}

TEST_CASE("Teacher: multi-view, the teacher sees one view and the student another", "[teacher]") {
  torch::manual_seed(5);
  Setup s;
  TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::paths({"b"}));
  s.model->a->asks.clear();
  const auto view_t = torch::randn({2, 4});
  const auto view_s = torch::randn({2, 4});
  const auto out = wrapper.forward_views(std::make_tuple(view_t), std::make_tuple(view_s));
  CHECK(bitwise_equal(s.model->b->received.at("ema_output"), teacher_outputs(*s.ema.module(), view_t).second));
  CHECK(bitwise_equal(out.detach(), s.model->forward(view_s).detach()));
}

TEST_CASE("Teacher: an exception in the student pass clears the recorded state", "[teacher]") {
  torch::manual_seed(6);
  Setup s;
  TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::paths({"b"}));
  s.model->a->asks.clear();
  s.model->b->throw_now = true;
  REQUIRE_THROWS_WITH(wrapper.forward(torch::randn({2, 4})), Contains("student failed"));
  s.model->b->throw_now = false;
  s.model->b->received.clear();
  s.model->forward(torch::randn({2, 4}));  // a plain call: no wrapper is running any more
  CHECK(s.model->b->received.empty());
  wrapper.forward(torch::randn({2, 4}));  // and the wrapper works again
  CHECK(s.model->b->received.count("ema_output") == 1);
}

TEST_CASE("Teacher: the wrapper can own its EMA and update it", "[teacher]") {
  torch::manual_seed(7);
  Net model;
  TeacherStudent wrapper(*model, NetEma(*model, emakit::Fixed(0.5)), TeacherRoutes::paths({"b"}));
  model->a->asks.clear();
  emakit_test::perturb(*model);
  CHECK(wrapper.update().action == emakit::Action::averaged);
  CHECK(wrapper.ema().num_updates() == 1);
  const auto x = torch::randn({2, 4});
  wrapper.forward(x);
  CHECK(bitwise_equal(model->b->received.at("ema_output"), teacher_outputs(wrapper.teacher(), x).second));
}

TEST_CASE("Teacher: bad routes and misbehaving modules give errors that name them", "[teacher]") {
  torch::manual_seed(8);
  Setup s;
  REQUIRE_THROWS_WITH(TeacherStudent(*s.model, s.ema, TeacherRoutes::paths({"bb"})),
                      Contains("no sub-module 'bb'") && Contains("nearest valid paths: 'b'"));
  REQUIRE_THROWS_WITH(TeacherStudent(*s.model, s.ema, TeacherRoutes().add({.receiver = "b", .teacher = "a.fcc"})),
                      Contains("EMA (teacher) model has no sub-module 'a.fcc'") && Contains("'a.fc'"));
  REQUIRE_THROWS_WITH(TeacherStudent(*s.model, s.ema, TeacherRoutes()), Contains("no routes"));

  // A teacher sub-module that never records: an error after the teacher pass naming it.
  {
    TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes().add({.receiver = "b", .teacher = "a.fc"}));
    REQUIRE_THROWS_WITH(wrapper.forward(torch::randn({2, 4})),
                        Contains("'a.fc' did not record its output") && Contains("record_teacher_output"));
  }
  // A receiver that never asks: warned once, naming it.
  {
    s.model->a->asks.clear();
    TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::paths({"a", "b"}));
    emakit_test::WarningCapture warnings;
    wrapper.forward(torch::randn({2, 4}));
    wrapper.forward(torch::randn({2, 4}));
    REQUIRE(warnings.messages.size() == 1);
    CHECK_THAT(warnings.messages[0], Contains("'a' never asked for its teacher input 'ema_output'"));
    s.model->a->asks = {"ema_output"};
  }
  // A shape that does not fit after the transform: the transform's name and both shapes.
  {
    s.model->a->asks.clear();
    s.model->b->like_own_output = true;
    TeacherStudent wrapper(*s.model, s.ema,
                           TeacherRoutes().add({.receiver = "b",
                                                .teacher = "b",
                                                .transform = [](const at::Tensor& t) { return t.sum(1); },
                                                .transform_name = "sum_features"}));
    REQUIRE_THROWS_WITH(wrapper.forward(torch::randn({2, 4})),
                        Contains("sum_features") && Contains("shape [2]") && Contains("expected [2, 6]"));
  }
}

TEST_CASE("Every read of the EMA, the teacher's included, settles the last update first", "[teacher][sync]") {
  // On a GPU with a side stream (or a CPU average of a CUDA model), an update may still run when
  // update() returns; each accessor must pass through the kernel's wait_for_update() before it hands out
  // the averages. Counted here on the CPU; tests/cuda/test_cuda_races.cpp provokes the races.
  torch::manual_seed(5);
  Setup s;
  TeacherStudent wrapper(*s.model, s.ema, TeacherRoutes::paths({"a", "b"}));
  auto& counts = emakit::detail::testing::sync_counts();
  auto settles = [&](const char* what, auto&& read) {
    s.ema.update();
    const auto before = counts.settles;
    read();
    INFO(what);
    CHECK(counts.settles > before);
  };
  settles("module()", [&] { (void)s.ema.module(); });
  settles("storage()", [&] { (void)s.ema.storage(); });
  settles("averages()", [&] { (void)s.ema.averages(); });
  settles("average(name)", [&] { (void)s.ema.average("a.fc.weight"); });
  settles("state_dict()", [&] { (void)s.ema.state_dict(); });
  settles("names()", [&] { (void)s.ema.names(emakit::Role::average); });
  settles("copy_to()", [&] {
    Net other;
    s.ema.copy_to(*other);
  });
  settles("swap_into()", [&] { auto guard = s.ema.swap_into(); });
  settles("TeacherStudent::teacher()", [&] { (void)wrapper.teacher(); });
  settles("TeacherStudent::forward()", [&] { (void)wrapper.forward(torch::randn({2, 4})); });
  settles("wait_for_update()", [&] { s.ema.wait_for_update(); });
  // wait_for_model_reads() is the trainer's point before the optimizer step: it orders the model's writers only.
  s.ema.update();
  const auto waits = counts.waits;
  const auto settled = counts.settles;
  s.ema.wait_for_model_reads();
  CHECK(counts.waits == waits + 1);
  CHECK(counts.settles == settled);
}

}  // namespace test_teacher
