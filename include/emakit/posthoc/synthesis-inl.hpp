// The non-template definitions of synthesis.hpp: included at the end of synthesis.hpp in the
// all-inline mode (EMAKIT_HEADER_ONLY), else compiled once per program by implementation.hpp
// (detail/config.hpp).
#pragma once

#if defined(EMAKIT_COMPILED) && !defined(EMAKIT_BUILDING_LIBRARY)
#error \
    "emakit/posthoc/synthesis-inl.hpp holds definitions that emakit compiles once per program, in the file that defines EMAKIT_IMPLEMENTATION (emakit/implementation.hpp): include <emakit/posthoc/synthesis.hpp> instead"
#endif

#include <emakit/posthoc/synthesis.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

EMAKIT_FUNC void check_same_model(const SnapshotInfo& reference, const SnapshotInfo& other) {
  const auto where = [&] {
    return fmt::format("snapshot '{}' is of another model than '{}'", other.path.string(), reference.path.string());
  };
  const auto& a = reference.tensors;
  const auto& b = other.tensors;
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= b.size()) fail_runtime("{}: it has no tensor '{}'", where(), a[i].name);
    if (i >= a.size()) fail_runtime("{}: it has the tensor '{}' that the other lacks", where(), b[i].name);
    if (a[i].name != b[i].name)
      fail_runtime("{}: tensor {} is '{}' there and '{}' here", where(), i, b[i].name, a[i].name);
    if (a[i].sizes != b[i].sizes)
      fail_runtime("{}: tensor '{}' has shape {} there and {} here", where(), a[i].name, shape_string(b[i].sizes),
                   shape_string(a[i].sizes));
    if (a[i].averaged != b[i].averaged || a[i].dtype != b[i].dtype)
      fail_runtime("{}: tensor '{}' is {} {} there and {} {} here", where(), a[i].name,
                   b[i].averaged ? "averaged" : "copied", c10::toString(b[i].dtype),
                   a[i].averaged ? "averaged" : "copied", c10::toString(a[i].dtype));
  }
}

// Calls sink(entry, tensor) for each tensor of the plan, in the snapshots' order: averaged
// tensors as the weighted sum (float64 or complex128, on the CPU), copied ones from the latest
// snapshot. One tensor of one snapshot is read at a time.
template <class Sink>
void combine_snapshots(const SynthesisPlan& plan, Sink&& sink) {
  const std::size_t n = plan.snapshots.size();
  const bool keep_open = n <= 64;  // beyond that, reopen per read rather than hold many descriptors
  std::vector<SnapshotReader> readers;
  readers.reserve(n);
  for (const auto& s : plan.snapshots) {
    readers.emplace_back(s.path, keep_open);
    const auto& now = readers.back().info();
    bool same = now.file_size == s.file_size && now.tensors.size() == s.tensors.size();
    for (std::size_t k = 0; same && k < s.tensors.size(); ++k) same = now.tensors[k].crc32 == s.tensors[k].crc32;
    if (!same) fail_runtime("snapshot '{}' changed since the synthesis was planned; plan again", s.path.string());
  }
  const auto& table = plan.snapshots.front().tensors;
  c10::NoGradGuard no_grad;
  for (std::size_t k = 0; k < table.size(); ++k) {
    const auto& entry = table[k];
    if (!entry.averaged) {
      sink(entry, readers.back().read(k));
      continue;
    }
    const auto sum_type = c10::isComplexType(entry.dtype) ? c10::ScalarType::ComplexDouble : c10::ScalarType::Double;
    at::Tensor sum = at::zeros(entry.sizes, at::TensorOptions().dtype(sum_type));
    for (std::size_t i = 0; i < n; ++i) sum.add_(readers[i].read(k).to(sum_type), plan.solution.weights[i]);
    sink(entry, sum);
  }
}

EMAKIT_FUNC c10::ScalarType result_dtype(const SnapshotTensor& entry, const SynthesisOptions& options) {
  if (entry.averaged && options.dtype() && c10::isFloatingType(entry.dtype)) return *options.dtype();
  return entry.dtype;
}

EMAKIT_FUNC void check_one_run(const std::vector<SnapshotInfo>& snapshots) {
  const auto runs = snapshot_runs(snapshots);
  if (runs.size() <= 1) return;
  std::string which;
  for (const auto& r : runs) which += fmt::format("{}  - {}", which.empty() ? "" : "\n", r.describe());
  fail_runtime("the snapshots are of {} training runs, and a synthesis combines the snapshots of one:\n{}\nMove "
               "every run but one out of the folder (a PostHocEma does it when it starts with "
               "PostHocOptions::existing_snapshots(ExistingSnapshots::move_aside))",
               runs.size(), which);
}

EMAKIT_FUNC std::vector<MissingSnapshot> missing_snapshots(const std::vector<SnapshotInfo>& snapshots) {
  std::map<double, std::uint32_t> profile_of;  // gamma -> index
  std::set<std::int64_t> steps;
  std::set<std::pair<std::int64_t, double>> present;
  std::uint32_t recorded_profiles = 0;
  for (const auto& s : snapshots) {
    profile_of.emplace(s.gamma, s.profile);
    steps.insert(s.step);
    present.emplace(s.step, s.gamma);
    recorded_profiles = std::max(recorded_profiles, s.profiles);
  }
  for (const auto& s : snapshots)
    if (s.previous_step > 0) steps.insert(s.previous_step);
  std::set<std::uint32_t> indices;
  for (const auto& [gamma, index] : profile_of) indices.insert(index);
  std::vector<MissingSnapshot> out;
  for (const std::int64_t step : steps) {
    for (const auto& [gamma, index] : profile_of)
      if (present.count({step, gamma}) == 0)
        out.push_back({step, index, gamma_to_sigma_rel(gamma), snapshot_file_name(step, index)});
    for (std::uint32_t index = 0; index < recorded_profiles; ++index)
      if (indices.count(index) == 0) out.push_back({step, index, 0.0, snapshot_file_name(step, index)});
  }
  return out;
}

// The snapshots' weights for the plan's target: EDM2's solve for a power function (its fit over the
// updates measured beside it), fit_target_weights for an EMA target.
EMAKIT_FUNC PosthocWeights solve_plan(const std::vector<SnapshotInfo>& snapshots, Profile target,
                                      const SynthesisOptions& options) {
  std::vector<Profile> profiles;
  for (const auto& s : snapshots) profiles.push_back({static_cast<double>(s.t), s.gamma});
  const std::int64_t dt = snapshots.front().update_every;
  for (const auto& s : snapshots)
    if (s.update_every != dt)
      fail_runtime("snapshots '{}' and '{}' were tracked with update_every {} and {}; a synthesis combines the "
                   "snapshots of one PostHocEma",
                   snapshots.front().path.string(), s.path.string(), dt, s.update_every);
  const auto t = static_cast<std::int64_t>(target.t);
  if (const auto& ema = options.ema_target())
    return fit_target_weights(profiles, dt, ema->weights(t), options.max_condition(), options.keep_weights());
  PosthocWeights out = solve_posthoc_weights(profiles, target, options.max_condition());
  // Measured where the snapshots are on their updates' grid (every snapshot PostHocEma writes is):
  // else fit_error stays 0 with intervals 0, and profile_error says how good the weights are.
  const bool on_grid =
      std::all_of(snapshots.begin(), snapshots.end(), [&](const SnapshotInfo& s) { return s.t > 0 && s.t % dt == 0; });
  if (on_grid) measure_fit(profiles, dt, power_function_weights(t, target.gamma, dt), out, options.keep_weights());
  return out;
}

inline std::string describe_missing(const std::vector<MissingSnapshot>& missing) {
  std::string out;
  const std::size_t shown = std::min<std::size_t>(missing.size(), 8);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto& m = missing[i];
    out += fmt::format(
        "{}profile {} ({}) at step {} ('{}')", i == 0 ? "" : ", ", m.profile,
        m.sigma_rel > 0 ? fmt::format("sigma_rel {:.4f}", m.sigma_rel) : std::string("no file of it is left"), m.step,
        m.file_name);
  }
  if (missing.size() > shown) out += fmt::format(" and {} more", missing.size() - shown);
  return out;
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

namespace detail {

// The snapshots a synthesis at `target` combines: those at or before it, sorted by time and
// profile, one run and one model, `target` itself a snapshot time.
EMAKIT_FUNC std::vector<SnapshotInfo> snapshots_until(std::vector<SnapshotInfo> snapshots, std::int64_t target) {
  std::sort(snapshots.begin(), snapshots.end(), [](const SnapshotInfo& a, const SnapshotInfo& b) {
    return std::tie(a.t, a.gamma, a.profile, a.path) < std::tie(b.t, b.gamma, b.profile, b.path);
  });
  check_one_run(snapshots);
  if (snapshots.front().t > target)
    fail("no snapshot at or before step {}: the earliest is at step {} ('{}')", target, snapshots.front().t,
         snapshots.front().path.string());
  const bool at_snapshot =
      std::any_of(snapshots.begin(), snapshots.end(), [&](const SnapshotInfo& s) { return s.t == target; });
  if (!at_snapshot) {
    std::int64_t before = 0, after = 0;
    for (const auto& s : snapshots) {
      if (s.t < target) before = s.t;
      if (s.t > target && after == 0) after = s.t;
    }
    fail("step {} is not a snapshot time; the nearest snapshots are at step {}{}", target, before,
         after > 0 ? fmt::format(" and step {}", after) : std::string());
  }
  std::erase_if(snapshots, [&](const SnapshotInfo& s) { return s.t > target; });
  for (std::size_t i = 1; i < snapshots.size(); ++i) {
    if (snapshots[i].t == snapshots[i - 1].t && snapshots[i].gamma == snapshots[i - 1].gamma)
      fail_runtime("snapshots '{}' and '{}' have the same profile (t = {}, gamma = {}); a folder must hold one "
                   "training run",
                   snapshots[i - 1].path.string(), snapshots[i].path.string(), snapshots[i].t, snapshots[i].gamma);
    check_same_model(snapshots.front(), snapshots[i]);
  }
  return snapshots;
}

// Refuses a plan whose snapshot set has gaps (unless allow_partial) or whose sigma_rel lies
// farther outside the tracked profiles than max_extrapolation: before anything is solved.
EMAKIT_FUNC void check_coverage(const SynthesisPlan& plan, const std::string& folder) {
  const SynthesisOptions& options = plan.options;
  const auto target = static_cast<std::int64_t>(plan.target.t);
  if (!plan.missing.empty() && !options.allow_partial())
    refuse_synthesis("the snapshot set in '{}' has gaps up to t = {}: {} snapshot{} of the run {} missing: {}. "
                     "Without {} the result is another (worse) approximation of the EMA asked for. Restore "
                     "{}, choose an earlier target time, or accept the partial set "
                     "(SynthesisOptions::allow_partial, posthoc_tool --allow-partial)",
                     folder, target, plan.missing.size(), plan.missing.size() == 1 ? "" : "s",
                     plan.missing.size() == 1 ? "is" : "are", describe_missing(plan.missing),
                     plan.missing.size() == 1 ? "it" : "them", plan.missing.size() == 1 ? "it" : "them");
  if (options.ema_target()) return;
  const double wanted = options.sigma_rel();
  const double outside = std::max({1.0, plan.tracked_min_sigma_rel / wanted, wanted / plan.tracked_max_sigma_rel});
  if (outside > options.max_extrapolation() * (1.0 + 1e-9))  // 1e-9: sigma_rel -> gamma -> sigma_rel rounding
    refuse_synthesis("sigma_rel {:.4g} lies {:.3g}x outside the tracked profiles' range {:.4g} to {:.4g} "
                     "(in '{}'); past {:.3g}x (max_extrapolation) the combination cannot reproduce it. "
                     "Track a profile closer to it, or accept it (SynthesisOptions::max_extrapolation, "
                     "posthoc_tool --max-extrapolation)",
                     wanted, outside, plan.tracked_min_sigma_rel, plan.tracked_max_sigma_rel, folder,
                     options.max_extrapolation());
}

// Refuses a solution whose weights amplify the snapshots' rounding past max_weight, or whose
// combination lies farther from the target than max_fit_error.
EMAKIT_FUNC void check_solution(const SynthesisPlan& plan, const std::vector<SnapshotInfo>& snapshots,
                                const std::string& folder) {
  const SynthesisOptions& options = plan.options;
  const auto target = static_cast<std::int64_t>(plan.target.t);
  const std::string what = options.describe_target();
  if (plan.solution.max_abs_weight > options.max_weight()) {
    const auto& w = plan.solution.weights;
    const auto i = static_cast<std::size_t>(
        std::max_element(w.begin(), w.end(), [](double a, double b) { return std::abs(a) < std::abs(b); }) - w.begin());
    refuse_synthesis(
        "the weights for {} at t = {} reach {:.4g} (snapshot '{}'), above max_weight {:.4g}; weights of both signs "
        "that large amplify the snapshots' rounding {:.3g}-fold (the sum of |weight|). Choose a target closer to "
        "the tracked profiles (sigma_rel {:.4g} to {:.4g}), or accept it (SynthesisOptions::max_weight, "
        "posthoc_tool --max-weight)",
        what, target, w[i], snapshots[i].path.string(), options.max_weight(), plan.solution.abs_sum,
        plan.tracked_min_sigma_rel, plan.tracked_max_sigma_rel);
  }
  if (plan.solution.fit_error > options.max_fit_error())
    refuse_synthesis(
        "the snapshots in '{}' cannot represent {} at t = {}: the best combination of the {} snapshots weighs the "
        "past {:.3g} (relative L2) away from it, above max_fit_error {:.3g}{}. Snapshot more often, track profiles "
        "closer to it, choose a later target time, or accept it (SynthesisOptions::max_fit_error, posthoc_tool "
        "--max-fit-error)",
        folder, what, target, snapshots.size(), plan.solution.fit_error, options.max_fit_error(),
        plan.solution.initial_weight > 0.01
            ? fmt::format("; {:.3g} of its weight is on the model before the first update, which no snapshot holds",
                          plan.solution.initial_weight)
            : std::string());
}

}  // namespace detail

EMAKIT_FUNC SynthesisPlan plan_synthesis(std::vector<SnapshotInfo> snapshots, const SynthesisOptions& options) {
  if (snapshots.empty()) detail::fail_runtime("no snapshots to synthesize from");
  const std::int64_t latest =
      std::max_element(snapshots.begin(), snapshots.end(), [](const auto& a, const auto& b) { return a.t < b.t; })->t;
  const std::int64_t target = options.step().value_or(latest);
  snapshots = detail::snapshots_until(std::move(snapshots), target);
  const auto [longest, shortest] =
      std::minmax_element(snapshots.begin(), snapshots.end(),
                          [](const SnapshotInfo& a, const SnapshotInfo& b) { return a.gamma < b.gamma; });
  SynthesisPlan plan{.target = {static_cast<double>(target), options.gamma()},
                     .snapshots = {},
                     .solution = {},
                     .options = options,
                     .run = snapshots.front().run,
                     .missing = detail::missing_snapshots(snapshots),
                     .tracked_min_sigma_rel = gamma_to_sigma_rel(shortest->gamma),  // sigma_rel falls as gamma grows
                     .tracked_max_sigma_rel = gamma_to_sigma_rel(longest->gamma)};
  const std::string folder = snapshots.front().path.parent_path().string();
  detail::check_coverage(plan, folder);
  plan.solution = detail::solve_plan(snapshots, plan.target, options);
  detail::check_solution(plan, snapshots, folder);
  plan.snapshots = std::move(snapshots);
  return plan;
}

EMAKIT_FUNC SynthesisPlan plan_synthesis(const std::filesystem::path& folder, const SynthesisOptions& options) {
  auto snapshots = list_snapshots(folder);
  if (snapshots.empty())
    detail::fail_runtime("the folder '{}' holds no snapshot files (phema-*.emkit)", folder.string());
  return plan_synthesis(std::move(snapshots), options);
}

EMAKIT_FUNC StateDict synthesize(const SynthesisPlan& plan) {
  StateDict out;
  detail::combine_snapshots(plan, [&](const SnapshotTensor& entry, const at::Tensor& t) {
    out.insert(entry.name, t.to(plan.options.device(), detail::result_dtype(entry, plan.options)));
  });
  return out;
}

EMAKIT_FUNC void synthesize_into(const SynthesisPlan& plan, torch::nn::Module& module) {
  auto theirs = detail::tensors_by_name(module);
  const auto& reference = plan.snapshots.front();
  for (const auto& entry : reference.tensors) {
    auto it = theirs.find(entry.name);
    if (it == theirs.end())
      detail::fail("the module has no tensor '{}' that snapshot '{}' holds; it is not the snapshots' model", entry.name,
                   reference.path.string());
    if (!it->second.sizes().equals(entry.sizes))
      detail::fail("tensor '{}' has shape {} in the module but {} in snapshot '{}'", entry.name,
                   detail::shape_string(it->second.sizes()), detail::shape_string(entry.sizes),
                   reference.path.string());
  }
  const StateDict result = synthesize(plan);
  c10::NoGradGuard no_grad;
  for (const auto& item : result) theirs.at(item.key()).copy_(item.value());
}

EMAKIT_FUNC void synthesize_to_file(const SynthesisPlan& plan, const std::filesystem::path& path, OutputFormat format) {
  if (format == OutputFormat::snapshot) {
    if (plan.options.ema_target())
      detail::fail("synthesize_to_file: an emakit snapshot file records a power-function profile, and this synthesis "
                   "is of {}; write OutputFormat::torch_pickle (posthoc_tool --format pt)",
                   plan.options.describe_target());
    SnapshotInfo header;
    header.step = header.t = static_cast<std::int64_t>(plan.target.t);
    header.gamma = plan.target.gamma;
    header.sigma_rel = gamma_to_sigma_rel(plan.target.gamma);
    header.update_every = plan.snapshots.front().update_every;
    header.profile = 0xFFFFFFFFU;  // synthesized, not tracked
    for (auto entry : plan.snapshots.front().tensors) {
      entry.dtype = entry.stored_dtype = detail::result_dtype(entry, plan.options);
      header.tensors.push_back(std::move(entry));
    }
    detail::SnapshotWriter writer(path, std::move(header));
    std::size_t k = 0;
    detail::combine_snapshots(plan, [&](const SnapshotTensor&, const at::Tensor& t) { writer.write(k++, t); });
    writer.commit();
    return;
  }
  detail::check_writable_folder(path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path(), path);
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  detail::combine_snapshots(plan, [&](const SnapshotTensor& entry, const at::Tensor& t) {
    dict.insert(entry.name, t.to(c10::kCPU, detail::result_dtype(entry, plan.options)));
  });
  detail::write_tensor_dict(path, dict);
}

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
