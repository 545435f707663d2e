// Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion
// Models", Algorithm 3; EDM2's phema.py): train once with a few power-function EMAs, save their
// snapshots, and choose the EMA length afterwards.
//
//   emakit::PostHocEma posthoc(*model, emakit::PostHocOptions("runs/a/phema")
//                                          .sigma_rels({0.05, 0.10})   // the tracked profiles
//                                          .update_every(10)           // dt between updates
//                                          .snapshot_every(1000));     // a snapshot every 1000 steps
//   for (...) { ...; optimizer.step(); posthoc.update(); }
//
//   // later, from the folder alone (or: emakit_example_posthoc_tool synthesize runs/a/phema -s 0.07):
//   auto plan = emakit::plan_synthesis("runs/a/phema", emakit::SynthesisOptions::from_sigma_rel(0.07));
//   emakit::synthesize_into(plan, *model);         // or synthesize(plan) -> name -> tensor
//
// Tracking. Each profile is a core emakit::Ema<PowerFunction, StepSchedule, FlatStorage> that
// updates at steps dt, 2dt, ... (StepSchedule::update_every(dt), Warmup::skip_before_start): the
// first update, at t = dt, copies the model, and the update at step t uses
// d = (1 - dt_t / t)^(gamma + 1) with dt_t the steps since the previous update. The weight of the
// model of step s in the EMA at step T is then exactly (s^(gamma+1) - (s - dt_s)^(gamma+1)) /
// T^(gamma+1): the mass that the power-function profile (gamma+1) tau^gamma / T^(gamma+1) puts on
// (s - dt_s, s], so the profile the synthesis assumes is the one tracked (steps the EMA never
// saw, e.g. with caller-supplied steps, widen the next interval, and that stays exact).
//
// Synthesis. For snapshot profiles p_i = (t_i, gamma_i), all with t_i <= the target time, and a
// target profile q, solve A x = b with A_ij = <p_i, p_j>, b_i = <p_i, q>, where
//   <(t_a, g_a), (t_b, g_b)> = (g_a+1)(g_b+1) (t_a/t_b)^e / ((g_a+g_b+1) max(t_a, t_b)),
//   e = g_b if t_a < t_b else -g_a
// (the L2 inner product of the two profiles), exactly (LU with partial pivoting, float64), check
// the 1-norm condition number, normalise x to sum 1 (as EDM2), and combine the snapshots'
// averaged tensors with x. Tensors are combined one at a time in float64, so peak memory is the
// result plus one tensor and its float64 sum, never all snapshots.
//
// Snapshot files. One file per profile and snapshot, "<folder>/phema-<step, 10 digits>-<profile>.emkit",
// written atomically (temporary file, fsync, rename, fsync of the folder): a crash leaves every
// earlier snapshot readable. The format (detail::formats::snapshot; detail/serial/snapshot_file.hpp has
// the byte layout): magic "EMAKITPH", u32 version, the header (step and t as int64, gamma,
// sigma_rel, update_every, profile index, file size, and per tensor its name, stored and original
// dtype, role, shape, offset, size and CRC-32), the header's CRC-32, then the raw tensor data.
// Reading checks the magic, version, header CRC, file size and each tensor's CRC, and names the
// file in every error.
//
// Compared with ema-pytorch's PostHocEMA: its KarrasEMA uses beta = (1 - 1/(k+1))^(gamma+1) at its
// k-th update (the EMA of the trajectory with the first state counted twice, one step off the
// power function) and ignores update_every in beta; its synthesis uses every snapshot, also those
// after the target, and does not normalise the weights. emakit follows the EDM2 math.
#pragma once

#include <emakit/concepts.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/atomic_file.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/dense_solve.hpp>
#include <emakit/detail/snapshot_file.hpp>
#include <emakit/detail/torch_pickle.hpp>
#include <emakit/ema.hpp>
#include <emakit/options.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>

#include <ATen/core/Dict.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit {

// ---- the math -------------------------------------------------------------------------------

// A power-function EMA profile: the EMA at time t (> 0) with exponent gamma (> 0).
struct Profile {
  double t = 0;
  double gamma = 0;
};

// The L2 inner product of two profiles (gamma+1) tau^gamma / t^(gamma+1) on [0, t].
inline double profile_inner_product(Profile a, Profile b) {
  const double e = a.t < b.t ? b.gamma : -a.gamma;
  return (a.gamma + 1.0) * (b.gamma + 1.0) * std::pow(a.t / b.t, e) / ((a.gamma + b.gamma + 1.0) * std::max(a.t, b.t));
}

// The combination weights of the snapshots for a target profile.
struct PosthocWeights {
  std::vector<double> weights;  // normalised to sum 1, one per snapshot, in the snapshots' order
  double raw_sum = 0;           // the sum of the exact solution before normalisation (1 in exact arithmetic
                                // only when the target lies in the snapshots' span)
  double condition = 0;         // the 1-norm condition number of A
};

// The limit on the condition number above which a solve is refused: past it, float64 leaves
// fewer than ~4 correct digits in the weights.
inline constexpr double default_max_condition = 1e12;

// Solves the EDM2 system for `snapshots` and `target` (see the top of this file).
inline PosthocWeights solve_posthoc_weights(std::span<const Profile> snapshots, Profile target,
                                            double max_condition = default_max_condition) {
  const std::size_t n = snapshots.size();
  if (n == 0) detail::fail("solve_posthoc_weights: no snapshot profiles");
  if (!(target.t > 0 && target.gamma > 0))
    detail::fail("the target profile needs t > 0 and gamma > 0, got t = {}, gamma = {}", target.t, target.gamma);
  for (std::size_t i = 0; i < n; ++i)
    if (!(snapshots[i].t > 0 && snapshots[i].gamma > 0))
      detail::fail("snapshot profile {} needs t > 0 and gamma > 0, got t = {}, gamma = {}", i, snapshots[i].t,
                   snapshots[i].gamma);
  std::vector<double> a(n * n), b(n);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) a[i * n + j] = profile_inner_product(snapshots[i], snapshots[j]);
    b[i] = profile_inner_product(snapshots[i], target);
  }
  const detail::LuFactors lu(a, n);
  PosthocWeights out;
  out.condition = detail::condition_number_1(a, lu);
  if (!(out.condition <= max_condition))
    detail::fail_runtime("the post-hoc EMA system of {} snapshots is ill-conditioned: condition number {:.3g} > {:.3g} "
                         "(max_condition); snapshots with (nearly) the same t and gamma make the weights meaningless: "
                         "use fewer, farther apart snapshots, profiles with more different sigma_rel, or raise "
                         "max_condition",
                         n, out.condition, max_condition);
  out.weights = lu.solve(b);
  for (double w : out.weights) out.raw_sum += w;
  if (!(std::abs(out.raw_sum) > 1e-12))
    detail::fail_runtime("the post-hoc EMA weights sum to {:.3g}; they cannot be normalised", out.raw_sum);
  for (double& w : out.weights) w /= out.raw_sum;
  return out;
}

// ---- options --------------------------------------------------------------------------------

// What a PostHocEma tracks and where it writes its snapshots.
class PostHocOptions {
 public:
  // `folder` is created if missing; it must be writable.
  explicit PostHocOptions(std::filesystem::path folder) : folder_(std::move(folder)) {
    if (folder_.empty()) detail::fail("PostHocOptions: the snapshot folder is empty; give a path");
    sigma_rels({0.05, 0.10});
  }

  const std::filesystem::path& folder() const noexcept { return folder_; }

  // The tracked profiles by sigma_rel, each in (0, 0.2887), at least two, all different.
  PostHocOptions& sigma_rels(const std::vector<double>& values) {
    for (double s : values)
      if (!(s > 0.0 && s < max_sigma_rel))
        detail::fail("PostHocOptions::sigma_rels: each sigma_rel must be in (0, {:.4f}), got {}", max_sigma_rel, s);
    std::vector<double> g;
    for (double s : values) g.push_back(sigma_rel_to_gamma(s));
    return set_gammas(std::move(g), "sigma_rels", values);
  }
  // The tracked profiles by gamma, each > 0, at least two, all different.
  PostHocOptions& gammas(const std::vector<double>& values) {
    for (double g : values)
      if (!(g > 0.0 && std::isfinite(g))) detail::fail("PostHocOptions::gammas: each gamma must be > 0, got {}", g);
    return set_gammas(values, "gammas", values);
  }
  const std::vector<double>& gammas() const noexcept { return gammas_; }
  std::vector<double> sigma_rels() const {
    std::vector<double> out;
    for (double g : gammas_) out.push_back(gamma_to_sigma_rel(g));
    return out;
  }

  // Steps between EMA updates (dt): updates at steps dt, 2dt, ... Default 1 (every step, as EDM2).
  std::int64_t update_every() const noexcept { return update_every_; }
  PostHocOptions& update_every(std::int64_t value) {
    detail::check_positive_int(value, "PostHocOptions::update_every");
    update_every_ = value;
    return *this;
  }
  // A snapshot at every step that is a multiple of this (a multiple of update_every); 0: only on
  // demand (PostHocEma::snapshot()). Default 1000.
  std::int64_t snapshot_every() const noexcept { return snapshot_every_; }
  PostHocOptions& snapshot_every(std::int64_t value) {
    detail::check_non_negative_int(value, "PostHocOptions::snapshot_every");
    snapshot_every_ = value;
    return *this;
  }
  // The dtype averaged tensors are stored in (e.g. torch::kBFloat16 to halve the files); default:
  // the averages' own dtype. Copied tensors (integer buffers) keep theirs.
  std::optional<c10::ScalarType> snapshot_dtype() const noexcept { return snapshot_dtype_; }
  PostHocOptions& snapshot_dtype(c10::ScalarType value) {
    if (!c10::isFloatingType(value))
      detail::fail("PostHocOptions::snapshot_dtype must be a floating dtype, got {}", c10::toString(value));
    snapshot_dtype_ = value;
    return *this;
  }

 private:
  PostHocOptions& set_gammas(std::vector<double> g, const char* option, const std::vector<double>& given) {
    if (g.size() < 2)
      detail::fail("PostHocOptions::{} needs at least two profiles to synthesize from, got {} ([{}])", option,
                   given.size(), fmt::join(given, ", "));
    for (std::size_t i = 0; i < g.size(); ++i)
      for (std::size_t j = i + 1; j < g.size(); ++j)
        if (g[i] == g[j]) detail::fail("PostHocOptions::{}: the value {} appears twice; profiles must differ", option, given[i]);
    gammas_ = std::move(g);
    return *this;
  }

  std::filesystem::path folder_;
  std::vector<double> gammas_;
  std::int64_t update_every_ = 1;
  std::int64_t snapshot_every_ = 1000;
  std::optional<c10::ScalarType> snapshot_dtype_;
};

// The EMA to synthesize: its profile (by gamma, or by sigma_rel), the time (a snapshot time;
// default the latest), and the result's dtype and device.
class SynthesisOptions {
 public:
  explicit SynthesisOptions(double gamma) {
    if (!(gamma > 0.0 && std::isfinite(gamma))) detail::fail("SynthesisOptions: gamma must be > 0, got {}", gamma);
    gamma_ = gamma;
  }
  static SynthesisOptions from_sigma_rel(double sigma_rel) {
    if (!(sigma_rel > 0.0 && sigma_rel < max_sigma_rel))
      detail::fail("SynthesisOptions: sigma_rel must be in (0, {:.4f}), got {}", max_sigma_rel, sigma_rel);
    return SynthesisOptions(sigma_rel_to_gamma(sigma_rel));
  }

  double gamma() const noexcept { return gamma_; }
  double sigma_rel() const { return gamma_to_sigma_rel(gamma_); }

  // The target time: the t of some snapshot. Default: the latest.
  std::optional<std::int64_t> step() const noexcept { return step_; }
  SynthesisOptions& step(std::int64_t value) {
    detail::check_positive_int(value, "SynthesisOptions::step");
    step_ = value;
    return *this;
  }
  double max_condition() const noexcept { return max_condition_; }
  SynthesisOptions& max_condition(double value) {
    if (!(value >= 1.0)) detail::fail("SynthesisOptions::max_condition must be >= 1, got {}", value);
    max_condition_ = value;
    return *this;
  }
  // The dtype of the synthesized (real floating) tensors; default: the dtype the EMA averaged in.
  std::optional<c10::ScalarType> dtype() const noexcept { return dtype_; }
  SynthesisOptions& dtype(c10::ScalarType value) {
    if (!c10::isFloatingType(value))
      detail::fail("SynthesisOptions::dtype must be a floating dtype, got {}", c10::toString(value));
    dtype_ = value;
    return *this;
  }
  c10::Device device() const noexcept { return device_; }
  SynthesisOptions& device(c10::Device value) {
    device_ = value;
    return *this;
  }

 private:
  double gamma_ = 0;
  std::optional<std::int64_t> step_;
  double max_condition_ = default_max_condition;
  std::optional<c10::ScalarType> dtype_;
  c10::Device device_{c10::kCPU};
};

// ---- snapshot files -------------------------------------------------------------------------

// "phema-<step, 10 digits>-<profile>.emkit"
inline std::string snapshot_file_name(std::int64_t step, std::uint32_t profile) {
  return fmt::format("phema-{:010}-{}.emkit", step, profile);
}

inline bool is_snapshot_file_name(const std::string& name) {
  constexpr std::string_view prefix = "phema-", suffix = ".emkit";
  return name.size() > prefix.size() + suffix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The header of one snapshot file (checked; the tensors' data is not read).
inline SnapshotInfo read_snapshot_info(const std::filesystem::path& path) { return detail::SnapshotReader(path).info(); }

// Every tensor of a snapshot file, on the CPU in its stored dtype, each checked against its CRC.
inline StateDict load_snapshot(const std::filesystem::path& path) {
  const detail::SnapshotReader reader(path);
  StateDict out;
  for (std::size_t i = 0; i < reader.info().tensors.size(); ++i) out.insert(reader.info().tensors[i].name, reader.read(i));
  return out;
}

namespace detail {
// The table entry of one tensor; with `dtype`, an averaged real floating tensor is stored in it.
inline SnapshotTensor snapshot_entry(const std::string& name, const at::Tensor& tensor, bool averaged,
                                     std::optional<c10::ScalarType> dtype) {
  SnapshotTensor t;
  t.name = name;
  t.dtype = tensor.scalar_type();
  t.stored_dtype = (averaged && dtype && c10::isFloatingType(t.dtype)) ? *dtype : t.dtype;
  t.averaged = averaged;
  t.sizes.assign(tensor.sizes().begin(), tensor.sizes().end());
  return t;
}
}  // namespace detail

// Writes `tensors` as a snapshot of profile (t, gamma) atomically. Without a tensor table in the
// header, floating and complex tensors are marked averaged and the others copied; with `dtype`,
// averaged real floating tensors are stored in that dtype. For importing snapshots made elsewhere
// (ema-pytorch, EDM2) into a folder that plan_synthesis() reads; PostHocEma writes its own.
inline void write_snapshot(const std::filesystem::path& path, SnapshotInfo header, const StateDict& tensors,
                           std::optional<c10::ScalarType> dtype = std::nullopt) {
  if (!(header.gamma > 0) || header.t <= 0 || header.update_every <= 0)
    detail::fail("write_snapshot '{}': needs t > 0, gamma > 0 and update_every > 0, got t = {}, gamma = {}, "
                 "update_every = {}",
                 path.string(), header.t, header.gamma, header.update_every);
  header.sigma_rel = gamma_to_sigma_rel(header.gamma);
  if (header.tensors.empty()) {  // floating and complex tensors are averaged, others copied
    for (const auto& item : tensors) {
      const auto type = item.value().scalar_type();
      header.tensors.push_back(detail::snapshot_entry(item.key(), item.value(),
                                                      c10::isFloatingType(type) || c10::isComplexType(type), dtype));
    }
  }
  if (header.tensors.size() != tensors.size())
    detail::fail("write_snapshot '{}': the header lists {} tensors, {} given", path.string(), header.tensors.size(),
                 tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i)
    if (header.tensors[i].name != tensors[i].key())
      detail::fail("write_snapshot '{}': tensor {} is '{}' in the header but '{}' in the tensors", path.string(), i,
                   header.tensors[i].name, tensors[i].key());
  detail::SnapshotWriter writer(path, std::move(header));
  for (std::size_t i = 0; i < tensors.size(); ++i) writer.write(i, tensors[i].value());
  writer.commit();
}

// The snapshot files of a folder (names "phema-*.emkit"), headers checked, sorted by (t, gamma).
// Temporary files of interrupted writes are never listed (see interrupted_writes()).
inline std::vector<SnapshotInfo> list_snapshots(const std::filesystem::path& folder) {
  std::error_code ec;
  if (!std::filesystem::is_directory(folder, ec))
    detail::fail_runtime("the snapshot folder '{}' does not exist or is not a folder", folder.string());
  std::vector<SnapshotInfo> out;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (!is_snapshot_file_name(name) || !entry.is_regular_file()) continue;
    out.push_back(read_snapshot_info(entry.path()));
  }
  std::sort(out.begin(), out.end(), [](const SnapshotInfo& a, const SnapshotInfo& b) {
    return std::tie(a.t, a.gamma, a.profile, a.path) < std::tie(b.t, b.gamma, b.profile, b.path);
  });
  return out;
}

// Temporary files that writes interrupted by a crash left in `folder` (safe to delete when no
// process is writing there).
inline std::vector<std::filesystem::path> interrupted_writes(const std::filesystem::path& folder) {
  std::vector<std::filesystem::path> out;
  for (const auto& entry : std::filesystem::directory_iterator(folder))
    if (detail::is_temporary_name(entry.path().filename().string())) out.push_back(entry.path());
  std::sort(out.begin(), out.end());
  return out;
}

// ---- synthesis ------------------------------------------------------------------------------

// Which snapshots a synthesis combines and with which weights.
struct SynthesisPlan {
  Profile target;
  std::vector<SnapshotInfo> snapshots;  // those with t <= target, sorted by (t, gamma)
  PosthocWeights solution;              // solution.weights[i] is the weight of snapshots[i]
  SynthesisOptions options;
};

namespace detail {

inline void check_same_model(const SnapshotInfo& reference, const SnapshotInfo& other) {
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

inline c10::ScalarType result_dtype(const SnapshotTensor& entry, const SynthesisOptions& options) {
  if (entry.averaged && options.dtype() && c10::isFloatingType(entry.dtype)) return *options.dtype();
  return entry.dtype;
}

}  // namespace detail

// Chooses the snapshots and solves for their weights. Throws when no snapshot is at or before the
// target, the target is not a snapshot time, two snapshots have the same profile, the snapshots
// are of different models, or the system is ill-conditioned.
inline SynthesisPlan plan_synthesis(std::vector<SnapshotInfo> snapshots, const SynthesisOptions& options) {
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

inline SynthesisPlan plan_synthesis(const std::filesystem::path& folder, const SynthesisOptions& options) {
  auto snapshots = list_snapshots(folder);
  if (snapshots.empty()) detail::fail_runtime("the folder '{}' holds no snapshot files (phema-*.emkit)", folder.string());
  return plan_synthesis(std::move(snapshots), options);
}

// The synthesized EMA: the model's state-dict names -> tensors (on options.device()).
inline StateDict synthesize(const SynthesisPlan& plan) {
  StateDict out;
  detail::combine_snapshots(plan, [&](const SnapshotTensor& entry, const at::Tensor& t) {
    out.insert(entry.name, t.to(plan.options.device(), detail::result_dtype(entry, plan.options)));
  });
  return out;
}

// Writes the synthesized EMA into `module` (matched by name). Every tensor of the snapshots must be
// there with the same shape; nothing is written unless the whole synthesis succeeded.
inline void synthesize_into(const SynthesisPlan& plan, torch::nn::Module& module) {
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

enum class OutputFormat : std::uint8_t {
  torch_pickle,  // a dict name -> tensor: torch.load(path) in Python (weights_only), torch::pickle_load in C++
  snapshot,      // an emakit snapshot file of the target profile: load_snapshot(path)
};

// Writes the synthesized EMA to `path` atomically: on any error no file is left there (an
// existing file is left as it was). torch_pickle holds the result in memory (not its bytes);
// snapshot streams one tensor at a time.
inline void synthesize_to_file(const SynthesisPlan& plan, const std::filesystem::path& path,
                               OutputFormat format = OutputFormat::torch_pickle) {
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

// ---- tracking -------------------------------------------------------------------------------

// What PostHocEma::update() did.
struct PostHocUpdate {
  Action action = Action::skipped;  // the same for every profile
  std::int64_t step = 0;
  bool snapshot = false;  // snapshots were written at this step
};

// Several power-function EMAs of one model, with snapshots in a folder (see the top of this file).
class PostHocEma {
 public:
  // Each profile is one of these: the core Ema with the power-function decay.
  using Tracked = Ema<PowerFunction, StepSchedule, FlatStorage>;

  PostHocEma(const torch::nn::Module& model, PostHocOptions options, EmaOptions ema_options = EmaOptions())
      : options_(std::move(options)) {
    prepare();
    for (double g : options_.gammas()) emas_.emplace_back(model, PowerFunction(g), schedule(), ema_options);
  }
  // Binds to a list of named tensors (a TorchScript module, a hand-made list).
  PostHocEma(const std::vector<SourceTensor>& tensors, PostHocOptions options, EmaOptions ema_options = EmaOptions())
      : options_(std::move(options)) {
    prepare();
    for (double g : options_.gammas()) emas_.emplace_back(tensors, PowerFunction(g), schedule(), ema_options);
  }

  // Call after each optimizer step: updates every profile and writes snapshots at multiples of
  // snapshot_every. A failed snapshot write throws (naming the file) after the update was applied.
  PostHocUpdate update(StepInfo info = {}) {
    UpdateResult first;
    for (std::size_t i = 0; i < emas_.size(); ++i) {
      const auto r = emas_[i].update(info);
      if (i == 0) first = r;
    }
    PostHocUpdate out{first.action, first.step, false};
    const auto every = options_.snapshot_every();
    if (every > 0 && first.step > 0 && first.step % every == 0 && emas_.front().num_updates() > 0 &&
        first.step != last_snapshot_step_) {
      snapshot();
      out.snapshot = true;
    }
    return out;
  }

  // Writes a snapshot of every profile now; returns the files. Needs at least one applied update.
  std::vector<std::filesystem::path> snapshot() {
    const Tracked& lead = emas_.front();
    if (lead.num_updates() == 0)
      detail::fail("PostHocEma::snapshot() before the first update: no EMA has been updated yet (updates happen at "
                   "steps that are multiples of update_every = {})",
                   options_.update_every());
    std::vector<std::filesystem::path> files;
    for (std::size_t i = 0; i < emas_.size(); ++i) {
      const Tracked& ema = emas_[i];
      SnapshotInfo header;
      header.step = ema.step();
      header.t = ema.last_update_step();
      header.gamma = ema.decay_policy().gamma();
      header.sigma_rel = ema.decay_policy().sigma_rel();
      header.update_every = options_.update_every();
      header.profile = static_cast<std::uint32_t>(i);
      const StateDict tensors = ema.averages();
      const auto averaged = ema.names(Role::average);  // copy_only names and integer buffers are copied
      for (const auto& item : tensors) {
        const bool is_averaged = std::find(averaged.begin(), averaged.end(), item.key()) != averaged.end();
        header.tensors.push_back(detail::snapshot_entry(item.key(), item.value(), is_averaged, options_.snapshot_dtype()));
      }
      const auto path = options_.folder() / snapshot_file_name(header.step, header.profile);
      write_snapshot(path, std::move(header), tensors);
      files.push_back(path);
    }
    last_snapshot_step_ = lead.step();
    return files;
  }

  std::size_t size() const noexcept { return emas_.size(); }
  const Tracked& ema(std::size_t i) const { return emas_.at(i); }
  const PostHocOptions& options() const noexcept { return options_; }
  const std::filesystem::path& folder() const noexcept { return options_.folder(); }
  std::int64_t step() const noexcept { return emas_.front().step(); }

  // Synthesis from this EMA's folder (plan_synthesis and synthesize for the folder).
  SynthesisPlan plan(const SynthesisOptions& options) const { return plan_synthesis(folder(), options); }
  StateDict synthesize(const SynthesisOptions& options) const { return emakit::synthesize(plan(options)); }

  // ---- state (to resume training) -----------------------------------------------------------

  // "posthoc.format", "posthoc.profiles", "posthoc.snapshot_every", "posthoc.last_snapshot_step",
  // then each profile's Ema::state_dict() under "profile.<i>.".
  StateDict state_dict() const {
    StateDict out;
    out.insert("posthoc.format", at::scalar_tensor(detail::formats::posthoc_state.version, at::kLong));
    out.insert("posthoc.profiles", at::scalar_tensor(static_cast<std::int64_t>(emas_.size()), at::kLong));
    out.insert("posthoc.snapshot_every", at::scalar_tensor(options_.snapshot_every(), at::kLong));
    out.insert("posthoc.last_snapshot_step", at::scalar_tensor(last_snapshot_step_, at::kLong));
    for (std::size_t i = 0; i < emas_.size(); ++i)
      for (const auto& item : emas_[i].state_dict()) out.insert(fmt::format("profile.{}.{}", i, item.key()), item.value());
    return out;
  }

  // Loads a state_dict() of a PostHocEma with the same profiles and model. Everything is checked
  // first: a failed load changes nothing.
  void load_state_dict(const StateDict& state) {
    auto integer = [&](const char* key) {
      const at::Tensor* t = state.find(key);
      if (t == nullptr || t->numel() != 1) detail::fail("PostHocEma::load_state_dict: the state has no '{}'", key);
      return t->item<std::int64_t>();
    };
    if (integer("posthoc.format") != 1)
      detail::fail("PostHocEma::load_state_dict: posthoc.format is {}, this emakit reads 1", integer("posthoc.format"));
    if (integer("posthoc.profiles") != static_cast<std::int64_t>(emas_.size()))
      detail::fail("PostHocEma::load_state_dict: the state has {} profiles, this PostHocEma {}",
                   integer("posthoc.profiles"), emas_.size());
    if (integer("posthoc.snapshot_every") != options_.snapshot_every())
      detail::fail("PostHocEma::load_state_dict: snapshot_every is {} in the state, {} here",
                   integer("posthoc.snapshot_every"), options_.snapshot_every());
    std::vector<StateDict> parts(emas_.size());
    for (const auto& item : state) {
      const auto& key = item.key();
      if (key.rfind("posthoc.", 0) == 0) continue;
      std::size_t i = 0, used = 0;
      if (key.rfind("profile.", 0) == 0) i = std::stoul(key.substr(8), &used);
      if (used == 0 || i >= emas_.size() || key.size() <= 8 + used || key[8 + used] != '.')
        detail::fail("PostHocEma::load_state_dict: unexpected key '{}'", key);
      parts[i].insert(key.substr(9 + used), item.value());
    }
    for (std::size_t i = 0; i < emas_.size(); ++i) check_loadable(i, parts[i]);
    for (std::size_t i = 0; i < emas_.size(); ++i) emas_[i].load_state_dict(parts[i]);
    last_snapshot_step_ = integer("posthoc.last_snapshot_step");
  }

 private:
  StepSchedule schedule() const {
    return StepSchedule().update_every(options_.update_every()).warmup(Warmup::skip_before_start);
  }

  void prepare() {
    const auto every = options_.snapshot_every(), dt = options_.update_every();
    if (every > 0 && every % dt != 0)
      detail::fail("PostHocOptions: snapshot_every ({}) must be a multiple of update_every ({}), so that each "
                   "snapshot is taken right after an update",
                   every, dt);
    std::error_code ec;
    std::filesystem::create_directories(options_.folder(), ec);
    if (ec) detail::fail_runtime("cannot create the snapshot folder '{}': {}", options_.folder().string(), ec.message());
    detail::check_writable_folder(options_.folder());
  }

  // Throws unless emas_[i].load_state_dict(part) would load every key (config equal, same
  // tensors with the same shapes and dtypes, no extra keys).
  void check_loadable(std::size_t i, const StateDict& part) const {
    const StateDict ours = emas_[i].state_dict();
    for (const auto& item : ours) {
      const auto& key = item.key();
      const at::Tensor* theirs = part.find(key);
      if (theirs == nullptr) detail::fail("PostHocEma::load_state_dict: profile {}: the state has no '{}'", i, key);
      const at::Tensor& mine = item.value();
      const bool same_kind = theirs->sizes().equals(mine.sizes()) && theirs->scalar_type() == mine.scalar_type();
      const bool is_config = key.rfind("config.", 0) == 0 || key == "emakit.format";
      if (!same_kind || (is_config && !at::equal(*theirs, mine)))
        detail::fail("PostHocEma::load_state_dict: profile {}: '{}' differs (the profiles or the model changed)", i, key);
    }
    for (const auto& item : part)
      if (ours.find(item.key()) == nullptr)
        detail::fail("PostHocEma::load_state_dict: profile {}: unexpected key '{}'", i, item.key());
  }

  PostHocOptions options_;
  std::vector<Tracked> emas_;
  std::int64_t last_snapshot_step_ = -1;
};

}  // namespace emakit
