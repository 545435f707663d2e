// The non-template definitions of teacher.hpp: included at the end of teacher.hpp in the all-inline
// mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/teacher-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/teacher.hpp> instead"
#endif

#include <emakit/teacher.hpp>

#include <fmt/format.h>  // fmt::join
#include <fmt/ranges.h>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC TeacherPass*& active_teacher_pass() noexcept {
  thread_local TeacherPass* pass = nullptr;
  return pass;
}

[[noreturn]] EMAKIT_FUNC void fail_student_destroyed(const char* what) {
  fail("TeacherStudent::{}(): the model (the student) this wrapper was made with has been destroyed (a rebuilt "
       "model?), so the student pass would run a module that no longer exists; nothing was run. Make a new "
       "TeacherStudent for the new model, with an EMA of it (load this EMA's state into that one: "
       "new_ema.load_state_dict(wrapper.ema().state_dict())). This wrapper's EMA (the teacher) still reads: ema(), "
       "teacher()",
       what);
}

EMAKIT_FUNC std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

EMAKIT_FUNC std::vector<std::pair<std::string, const torch::nn::Module*>> module_paths(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, const torch::nn::Module*>> out{{"", &model}};
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    out.emplace_back(item.key(), item.value().get());
  return out;
}

EMAKIT_FUNC const torch::nn::Module* find_path(
    const std::vector<std::pair<std::string, const torch::nn::Module*>>& paths, const std::string& path,
    const char* side) {
  for (const auto& [p, m] : paths)
    if (p == path) return m;
  std::vector<std::pair<std::size_t, std::string>> near;
  for (const auto& [p, m] : paths)
    near.emplace_back(edit_distance(path, p), p.empty() ? "\"\" (the model)" : "'" + p + "'");
  std::sort(near.begin(), near.end());
  std::vector<std::string> best;
  for (std::size_t i = 0; i < near.size() && i < 3; ++i) best.push_back(near[i].second);
  fail("teacher route: the {} has no sub-module '{}'; nearest valid paths: {}", side, path, fmt::join(best, ", "));
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC void record_teacher_output(const torch::nn::Module& self, const at::Tensor& output) {
  detail::TeacherPass* pass = detail::active_teacher_pass();
  if (pass == nullptr || pass->mode != detail::TeacherPass::Mode::teacher) return;
  auto it = pass->teacher_paths.find(&self);
  if (it != pass->teacher_paths.end()) pass->recorded[it->second] = output.detach();
}

EMAKIT_FUNC std::optional<at::Tensor> teacher_input(const torch::nn::Module& self, std::string_view name,
                                                    const at::Tensor* like) {
  detail::TeacherPass* pass = detail::active_teacher_pass();
  if (pass == nullptr || pass->mode != detail::TeacherPass::Mode::student) return std::nullopt;
  auto it = pass->receivers.find(&self);
  if (it == pass->receivers.end()) return std::nullopt;
  for (std::size_t i : it->second) {
    const TeacherRoute& route = (*pass->routes)[i];
    if (route.name != name) continue;
    pass->asked[i] = 1;
    at::Tensor value = pass->recorded.at(route.teacher);
    if (route.transform) value = route.transform(value);
    if (like != nullptr && !value.sizes().equals(like->sizes()))
      detail::fail("teacher input '{}' of '{}' from '{}' has shape {} after transform {}, expected {}", name,
                   route.receiver, route.teacher, detail::shape_string(value.sizes()),
                   route.transform ? (route.transform_name.empty() ? std::string("(unnamed)") : route.transform_name)
                                   : std::string("(none)"),
                   detail::shape_string(like->sizes()));
    return value;
  }
  return std::nullopt;
}

EMAKIT_FUNC std::optional<at::Tensor> teacher_input(const torch::nn::Module& self, std::string_view name,
                                                    const at::Tensor& like) {
  return teacher_input(self, name, &like);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

EMAKIT_FUNC TeacherRoutes TeacherRoutes::paths(const std::vector<std::string>& paths) {
  TeacherRoutes r;
  for (const auto& p : paths) r.add({p, p});
  return r;
}

EMAKIT_FUNC TeacherRoutes TeacherRoutes::map(const std::vector<std::pair<std::string, std::string>>& pairs) {
  TeacherRoutes r;
  for (const auto& [receiver, value] : pairs) r.pending_.push_back({receiver, value});
  return r;
}

EMAKIT_FUNC std::vector<TeacherRoute> TeacherRoutes::resolve(const std::vector<std::string>& model_paths) const {
  std::vector<TeacherRoute> out = routes_;
  for (const auto& [receiver, value] : pending_) {
    const bool is_path = std::find(model_paths.begin(), model_paths.end(), value) != model_paths.end();
    out.push_back(is_path ? TeacherRoute{receiver, value} : TeacherRoute{receiver, receiver, value});
  }
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
