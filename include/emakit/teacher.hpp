// Teacher outputs for self-supervised learning (BYOL, DINO, data2vec, I-JEPA, mean teacher): the
// outputs of named sub-modules of the EMA model (the teacher) reach named sub-modules of the
// online model (the student) as an extra input. What ema-pytorch's EMAModuleWrapper does with
// forward hooks, which LibTorch's C++ modules do not have; here a sub-module that takes part says
// so in its own forward, and everything else stays ordinary LibTorch code:
//
//   struct EncoderImpl : torch::nn::Cloneable<EncoderImpl> {
//     torch::Tensor forward(torch::Tensor x) {
//       auto y = body->forward(x);
//       emakit::record_teacher_output(*this, y);      // kept when this module runs as the teacher
//       return y;
//     }
//   };
//   struct HeadImpl : torch::nn::Cloneable<HeadImpl> {
//     torch::Tensor forward(torch::Tensor x) {
//       if (auto t = emakit::teacher_input(*this))    // the teacher's output, when run as the student
//         loss_target = *t;
//       return fc->forward(x);
//     }
//   };
//
//   emakit::TeacherStudent wrapper(*model, std::move(ema), emakit::TeacherRoutes::paths({"head"}));
//   auto out = wrapper.forward(x);                    // teacher pass (no grad, eval), then student
//   auto out = wrapper.forward_views(std::forward_as_tuple(view_a), std::forward_as_tuple(view_b));
//
// Modules that do not take part cost nothing; the two calls above cost one thread-local read
// when no wrapper is running. One wrapper per thread may run at a time on each thread.
//
// The model (the student) is borrowed: when a shared_ptr owns it (a ModuleHolder's), a model
// destroyed while the wrapper lives makes forward(), forward_views() and run() refuse, naming the
// wrapper, before anything runs; a model no shared_ptr owns must outlive the wrapper (docs/ema.md,
// "The bound model's lifetime").
#pragma once

#include <emakit/detail/config.hpp>
#include <fmt/core.h>
#include <emakit/detail/check.hpp>
#include <emakit/ema.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

inline constexpr std::string_view default_teacher_input = "ema_output";

// One route: the output of `teacher` (a path in the EMA model) reaches `receiver` (a path in the
// online model) under `name`, through `transform` if given. "" is the model itself.
struct TeacherRoute {
  std::string receiver;
  std::string teacher;
  std::string name = std::string(default_teacher_input);
  std::function<at::Tensor(const at::Tensor&)> transform = {};
  std::string transform_name = {};  // for error messages, e.g. "l2_normalize"
};

// The mapping formats of ema-pytorch's EMAModuleWrapper.
class TeacherRoutes {
 public:
  TeacherRoutes() = default;

  // ["encoder", "head"]: the same path on both sides, name "ema_output".
  static TeacherRoutes paths(const std::vector<std::string>& paths);
  // {receiver: value}: a value that is a module path of the model is the teacher path (name
  // "ema_output"); any other value is the name, with the receiver's own path as the teacher's.
  // The same rule as the reference; use add() to say it explicitly.
  static TeacherRoutes map(const std::vector<std::pair<std::string, std::string>>& pairs);
  // receiver -> (teacher path, name, transform): the full form.
  TeacherRoutes& add(TeacherRoute route) {
    routes_.push_back(std::move(route));
    return *this;
  }

  // The routes with every map() entry decided against the model's module paths.
  std::vector<TeacherRoute> resolve(const std::vector<std::string>& model_paths) const;
  bool empty() const noexcept { return routes_.empty() && pending_.empty(); }

 private:
  std::vector<TeacherRoute> routes_;
  std::vector<std::pair<std::string, std::string>> pending_;
};

namespace detail {

// The pass a TeacherStudent is running on this thread.
struct TeacherPass {
  enum class Mode : std::uint8_t { teacher, student };
  Mode mode = Mode::teacher;
  const std::vector<TeacherRoute>* routes = nullptr;
  std::unordered_map<const torch::nn::Module*, std::string> teacher_paths;           // recording modules
  std::unordered_map<const torch::nn::Module*, std::vector<std::size_t>> receivers;  // route indices
  std::unordered_map<std::string, at::Tensor> recorded;                              // by teacher path
  std::vector<char> asked;                                                           // per route
};

EMAKIT_FUNC TeacherPass*& active_teacher_pass() noexcept;

// The error of a TeacherStudent call that would run its model (the student) after that model was
// destroyed.
[[noreturn]] EMAKIT_FUNC void fail_student_destroyed(const char* what);

EMAKIT_FUNC std::size_t edit_distance(std::string_view a, std::string_view b);

// "", then every sub-module path of `model`, with the module each names.
EMAKIT_FUNC std::vector<std::pair<std::string, const torch::nn::Module*>> module_paths(const torch::nn::Module& model);

EMAKIT_FUNC const torch::nn::Module* find_path(
    const std::vector<std::pair<std::string, const torch::nn::Module*>>& paths, const std::string& path,
    const char* side);

}  // namespace detail

// In a sub-module's forward: keeps `output` when this module runs as a routed teacher
// sub-module. Does nothing otherwise.
EMAKIT_FUNC void record_teacher_output(const torch::nn::Module& self, const at::Tensor& output);

// In a sub-module's forward: the teacher's output routed to this module under `name` (after the
// route's transform) when it runs as the student; nullopt otherwise (no wrapper running, the
// teacher pass, a module without such a route). With `like`, the value must have like's shape.
EMAKIT_FUNC std::optional<at::Tensor> teacher_input(const torch::nn::Module& self,
                                                    std::string_view name = default_teacher_input,
                                                    const at::Tensor* like = nullptr);
EMAKIT_FUNC std::optional<at::Tensor> teacher_input(const torch::nn::Module& self, std::string_view name,
                                                    const at::Tensor& like);

// A model, its EMA (module storage: the EMA is a module of the model's type) and the routes
// between them. forward() runs the EMA model without grad in eval mode (its mode restored
// after), records the routed outputs, runs the online model whose receivers get them, and
// clears what it recorded, also on an exception.
template <class EmaT>
class TeacherStudent {
 public:
  using module_type = typename std::remove_cvref_t<decltype(*std::declval<const EmaT&>().module())>;

  // Borrows `ema` (it must outlive the wrapper). Borrows `model` too: see the top of this file.
  TeacherStudent(module_type& model, EmaT& ema, TeacherRoutes routes) : model_(&model), ema_(&ema) {
    init(std::move(routes));
  }
  // Owns `ema`.
  TeacherStudent(module_type& model, EmaT&& ema, TeacherRoutes routes)
      : model_(&model), owned_(std::make_unique<EmaT>(std::move(ema))), ema_(owned_.get()) {
    init(std::move(routes));
  }

  // The wrapper refers to its own routes while it runs: it stays where it was made.
  TeacherStudent(const TeacherStudent&) = delete;
  TeacherStudent& operator=(const TeacherStudent&) = delete;
  TeacherStudent(TeacherStudent&&) = delete;
  TeacherStudent& operator=(TeacherStudent&&) = delete;

  EmaT& ema() noexcept { return *ema_; }
  module_type& teacher() const { return *ema_->module(); }
  const std::vector<TeacherRoute>& routes() const noexcept { return routes_; }

  // The EMA's update, after the optimizer step.
  UpdateResult update(StepInfo info = {}) { return ema_->update(info); }

  // One input for both passes.
  template <class... Args>
  decltype(auto) forward(Args&&... args) {
    return run_as(
        "forward", [&](module_type& t) { t.forward(args...); },
        [&](module_type& s) -> decltype(auto) { return s.forward(std::forward<Args>(args)...); });
  }
  // Multi-view: the teacher sees one view, the student another (tuples of forward arguments).
  template <class... T, class... S>
  decltype(auto) forward_views(std::tuple<T...> teacher_args, std::tuple<S...> student_args) {
    return run_as(
        "forward_views", [&](module_type& t) { std::apply([&](auto&&... a) { t.forward(a...); }, teacher_args); },
        [&](module_type& s) -> decltype(auto) {
          return std::apply([&](auto&&... a) -> decltype(auto) { return s.forward(a...); }, student_args);
        });
  }
  // The general form: `teacher_pass(teacher module)` then `student_pass(model)`, whose result is
  // returned.
  template <class TeacherPass, class StudentPass>
  decltype(auto) run(TeacherPass&& teacher_pass, StudentPass&& student_pass) {
    return run_as("run", std::forward<TeacherPass>(teacher_pass), std::forward<StudentPass>(student_pass));
  }

 private:
  // run(), named `what` in its errors.
  template <class TeacherPass, class StudentPass>
  decltype(auto) run_as(const char* what, TeacherPass&& teacher_pass, StudentPass&& student_pass) {
    // model_ is a raw pointer: a model destroyed while the wrapper lives is refused here, before
    // anything runs (one atomic load), when a shared_ptr owns it (watch_ was set).
    if (watch_.destroyed()) detail::fail_student_destroyed(what);
    detail::TeacherPass*& slot = detail::active_teacher_pass();
    if (slot != nullptr) detail::fail("TeacherStudent: a wrapper is already running on this thread (nested forward)");
    pass_.recorded.clear();
    std::fill(pass_.asked.begin(), pass_.asked.end(), 0);
    struct Clear {  // ends the pass and drops what it recorded, also on an exception
      detail::TeacherPass*& slot;
      detail::TeacherPass& pass;
      ~Clear() {
        slot = nullptr;
        pass.recorded.clear();
      }
    } clear{slot, pass_};
    slot = &pass_;

    {
      pass_.mode = detail::TeacherPass::Mode::teacher;
      module_type& t = teacher();
      struct Mode {  // the teacher's mode as it was, also on an exception
        module_type& m;
        bool training;
        ~Mode() { m.train(training); }
      } mode{t, t.is_training()};
      c10::NoGradGuard no_grad;
      t.eval();
      teacher_pass(t);
    }
    for (const auto& route : routes_)
      if (!pass_.recorded.count(route.teacher))
        detail::fail("TeacherStudent: teacher sub-module '{}' did not record its output during the teacher pass; call "
                     "emakit::record_teacher_output(*this, output) in its forward",
                     route.teacher);

    pass_.mode = detail::TeacherPass::Mode::student;
    auto finish = [&] {
      for (std::size_t i = 0; i < routes_.size(); ++i)
        if (!pass_.asked[i] && !warned_[i]) {
          warned_[i] = 1;
          TORCH_WARN("emakit: TeacherStudent: '", routes_[i].receiver, "' never asked for its teacher input '",
                     routes_[i].name, "' (emakit::teacher_input(*this, \"", routes_[i].name,
                     "\") in its forward); warned once");
        }
    };
    if constexpr (std::is_void_v<decltype(student_pass(*model_))>) {
      student_pass(*model_);
      finish();
    } else {
      decltype(auto) out = student_pass(*model_);
      finish();
      return out;
    }
  }

  void init(TeacherRoutes routes) {
    if (!ema_->module()) detail::fail("TeacherStudent: the EMA has no module; use an Ema with ModuleStorage");
    if (routes.empty()) detail::fail("TeacherStudent: no routes; give at least one teacher path");
    const auto student_paths = detail::module_paths(*model_);
    const auto teacher_paths = detail::module_paths(teacher());
    std::vector<std::string> names;
    for (const auto& [p, m] : student_paths) names.push_back(p);
    routes_ = routes.resolve(names);
    for (std::size_t i = 0; i < routes_.size(); ++i) {
      const auto& r = routes_[i];
      const torch::nn::Module* receiver = detail::find_path(student_paths, r.receiver, "model");
      const torch::nn::Module* source = detail::find_path(teacher_paths, r.teacher, "EMA (teacher) model");
      for (std::size_t j = 0; j < i; ++j)
        if (routes_[j].receiver == r.receiver && routes_[j].name == r.name)
          detail::fail("teacher route: '{}' receives '{}' twice (from '{}' and '{}')", r.receiver, r.name,
                       routes_[j].teacher, r.teacher);
      pass_.teacher_paths.emplace(source, r.teacher);
      pass_.receivers[receiver].push_back(i);
    }
    pass_.routes = &routes_;
    pass_.asked.assign(routes_.size(), 0);
    warned_.assign(routes_.size(), 0);
    watch_ = detail::ModelWatch(*model_);
  }

  module_type* model_;        // the student; checked through watch_ before each run
  detail::ModelWatch watch_;  // the model (watched when a shared_ptr owns it)
  std::unique_ptr<EmaT> owned_;
  EmaT* ema_;
  std::vector<TeacherRoute> routes_;
  detail::TeacherPass pass_;
  std::vector<char> warned_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/teacher-inl.hpp>
#endif
