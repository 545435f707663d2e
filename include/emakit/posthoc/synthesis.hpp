// Post-hoc EMA synthesis: choose the snapshots for a target profile, weigh them, and combine their
// tensors.
//
// plan_synthesis() takes the snapshots at or before the target time and solves for their weights
// (profile_math.hpp); synthesize(), synthesize_into() and synthesize_to_file() combine the
// snapshots' averaged tensors with them. Tensors are combined one at a time in float64, so peak
// memory is the result plus one tensor and its float64 sum, never all snapshots.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/snapshot_file.hpp>
#include <emakit/detail/serial/torch_pickle.hpp>
#include <emakit/ema.hpp>
#include <emakit/posthoc/options.hpp>
#include <emakit/posthoc/profile_math.hpp>
#include <emakit/posthoc/snapshot_folder.hpp>

#include <ATen/core/Dict.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit {

// Which snapshots a synthesis combines and with which weights.
struct SynthesisPlan {
  Profile target;
  std::vector<SnapshotInfo> snapshots;  // those with t <= target, sorted by (t, gamma)
  PosthocWeights solution;              // solution.weights[i] is the weight of snapshots[i]
  SynthesisOptions options;
};

namespace detail {

EMAKIT_FUNC void check_same_model(const SnapshotInfo& reference, const SnapshotInfo& other);

// Calls sink(entry, tensor) for each tensor of the plan, in the snapshots' order: averaged
// tensors as the weighted sum (float64 or complex128, on the CPU), copied ones from the latest
// snapshot. One tensor of one snapshot is read at a time.

EMAKIT_FUNC c10::ScalarType result_dtype(const SnapshotTensor& entry, const SynthesisOptions& options);

}  // namespace detail

// Chooses the snapshots and solves for their weights. Throws when no snapshot is at or before the
// target, the target is not a snapshot time, two snapshots have the same profile, the snapshots
// are of different models, or the system is ill-conditioned.
EMAKIT_FUNC SynthesisPlan plan_synthesis(std::vector<SnapshotInfo> snapshots, const SynthesisOptions& options);

EMAKIT_FUNC SynthesisPlan plan_synthesis(const std::filesystem::path& folder, const SynthesisOptions& options);

// The synthesized EMA: the model's state-dict names -> tensors (on options.device()).
EMAKIT_FUNC StateDict synthesize(const SynthesisPlan& plan);

// Writes the synthesized EMA into `module` (matched by name). Every tensor of the snapshots must be
// there with the same shape; nothing is written unless the whole synthesis succeeded.
EMAKIT_FUNC void synthesize_into(const SynthesisPlan& plan, torch::nn::Module& module);

enum class OutputFormat : std::uint8_t {
  torch_pickle,  // a dict name -> tensor: torch.load(path) in Python (weights_only), torch::pickle_load in C++
  snapshot,      // an emakit snapshot file of the target profile: load_snapshot(path)
};

// Writes the synthesized EMA to `path` atomically: on any error no file is left there (an
// existing file is left as it was). torch_pickle holds the result in memory (not its bytes);
// snapshot streams one tensor at a time.
EMAKIT_FUNC void synthesize_to_file(const SynthesisPlan& plan, const std::filesystem::path& path,
                                    OutputFormat format = OutputFormat::torch_pickle);

}  // namespace emakit

#if EMAKIT_DEFINITIONS

namespace emakit::detail {

EMAKIT_FUNC void check_same_model(const SnapshotInfo& reference, const SnapshotInfo& other) {
  const auto where = [&] { return fmt::format("snapshot '{}' is of another model than '{}'", other.path.string(), reference.path.string()); };
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
                   b[i].averaged ? "averaged" : "copied", c10::toString(b[i].dtype), a[i].averaged ? "averaged" : "copied",
                   c10::toString(a[i].dtype));
  }
}

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

}  // namespace emakit::detail

namespace emakit {

EMAKIT_FUNC SynthesisPlan plan_synthesis(std::vector<SnapshotInfo> snapshots, const SynthesisOptions& options) {
  if (snapshots.empty()) detail::fail_runtime("no snapshots to synthesize from");
  std::sort(snapshots.begin(), snapshots.end(), [](const SnapshotInfo& a, const SnapshotInfo& b) {
    return std::tie(a.t, a.gamma, a.profile, a.path) < std::tie(b.t, b.gamma, b.profile, b.path);
  });
  const std::int64_t latest = snapshots.back().t;
  const std::int64_t target = options.step().value_or(latest);
  if (snapshots.front().t > target)
    detail::fail("no snapshot at or before step {}: the earliest is at step {} ('{}')", target, snapshots.front().t,
                 snapshots.front().path.string());
  const bool at_snapshot = std::any_of(snapshots.begin(), snapshots.end(), [&](const SnapshotInfo& s) { return s.t == target; });
  if (!at_snapshot) {
    std::int64_t before = 0, after = 0;
    for (const auto& s : snapshots) {
      if (s.t < target) before = s.t;
      if (s.t > target && after == 0) after = s.t;
    }
    detail::fail("step {} is not a snapshot time; the nearest snapshots are at step {}{}", target, before,
                 after > 0 ? fmt::format(" and step {}", after) : std::string());
  }
  std::erase_if(snapshots, [&](const SnapshotInfo& s) { return s.t > target; });
  for (std::size_t i = 1; i < snapshots.size(); ++i) {
    if (snapshots[i].t == snapshots[i - 1].t && snapshots[i].gamma == snapshots[i - 1].gamma)
      detail::fail_runtime("snapshots '{}' and '{}' have the same profile (t = {}, gamma = {}); a folder must hold one "
                           "training run",
                           snapshots[i - 1].path.string(), snapshots[i].path.string(), snapshots[i].t, snapshots[i].gamma);
    detail::check_same_model(snapshots.front(), snapshots[i]);
  }
  std::vector<Profile> profiles;
  for (const auto& s : snapshots) profiles.push_back({static_cast<double>(s.t), s.gamma});
  const Profile goal{static_cast<double>(target), options.gamma()};
  auto solution = solve_posthoc_weights(profiles, goal, options.max_condition());
  return SynthesisPlan{goal, std::move(snapshots), std::move(solution), options};
}

EMAKIT_FUNC SynthesisPlan plan_synthesis(const std::filesystem::path& folder, const SynthesisOptions& options) {
  auto snapshots = list_snapshots(folder);
  if (snapshots.empty()) detail::fail_runtime("the folder '{}' holds no snapshot files (phema-*.emkit)", folder.string());
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
                   detail::shape_string(it->second.sizes()), detail::shape_string(entry.sizes), reference.path.string());
  }
  const StateDict result = synthesize(plan);
  c10::NoGradGuard no_grad;
  for (const auto& item : result) theirs.at(item.key()).copy_(item.value());
}

EMAKIT_FUNC void synthesize_to_file(const SynthesisPlan& plan, const std::filesystem::path& path,
                                    OutputFormat format) {
  if (format == OutputFormat::snapshot) {
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

}  // namespace emakit

#endif  // EMAKIT_DEFINITIONS
