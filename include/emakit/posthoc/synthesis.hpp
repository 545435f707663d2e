// Post-hoc EMA synthesis: choose the snapshots for a target profile, weigh them, and combine their
// tensors.
//
// plan_synthesis() takes the snapshots at or before the target time and solves for their weights
// (profile_math.hpp); synthesize(), synthesize_into() and synthesize_to_file() combine the
// snapshots' averaged tensors with them. Tensors are combined one at a time in float64, so peak
// memory is the result plus one tensor and its float64 sum, never all snapshots.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/posthoc/part.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/serial/atomic_file.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/snapshot_file.hpp>
#include <emakit/detail/serial/torch_pickle.hpp>
#include <emakit/detail/module_tensors.hpp>
#include <emakit/state.hpp>
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
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// A snapshot the run wrote (or should have) that is not in the folder.
struct MissingSnapshot {
  std::int64_t step = 0;
  std::uint32_t profile = 0;  // the profile's index in the PostHocEma
  double sigma_rel = 0;       // 0 when no file of that profile is left to say
  std::string file_name;      // the name it would have: snapshot_file_name(step, profile)
};

// Which snapshots a synthesis combines and with which weights, and what that is worth.
struct SynthesisPlan {
  Profile target;                       // t: the target time; gamma: the power function's (0 for an EMA target)
  std::vector<SnapshotInfo> snapshots;  // those with t <= target, sorted by (t, gamma)
  PosthocWeights solution;              // solution.weights[i] is the weight of snapshots[i]; its condition,
                                        // max_abs_weight, abs_sum, fit_error (and profile_error for
                                        // a power function) say how good they are
  SynthesisOptions options;
  RunId run;                             // the run that wrote the snapshots (not recorded: all zero)
  std::vector<MissingSnapshot> missing;  // the gaps in the snapshot set, accepted with allow_partial (else empty)
  double tracked_min_sigma_rel = 0;      // the tracked profiles' range
  double tracked_max_sigma_rel = 0;
};

namespace detail {

EMAKIT_FUNC void check_same_model(const SnapshotInfo& reference, const SnapshotInfo& other);

// The dtype of a synthesized tensor (combine_snapshots in synthesis-inl.hpp sums in float64 or
// complex128 on the CPU; this is what the result is converted to).
EMAKIT_FUNC c10::ScalarType result_dtype(const SnapshotTensor& entry, const SynthesisOptions& options);

// The snapshots' weights for the plan's target (synthesis-inl.hpp).
EMAKIT_FUNC PosthocWeights solve_plan(const std::vector<SnapshotInfo>& snapshots, Profile target,
                                      const SynthesisOptions& options);

// Throws unless every snapshot is of one run, naming each run.
EMAKIT_FUNC void check_one_run(const std::vector<SnapshotInfo>& snapshots);

// The gaps in a run's snapshot set: every profile (by its gamma; and by index up to the recorded
// number of profiles) at every snapshot step (those present and those their files name as the
// step before).
EMAKIT_FUNC std::vector<MissingSnapshot> missing_snapshots(const std::vector<SnapshotInfo>& snapshots);

}  // namespace detail

// Chooses the snapshots and solves for their weights. Throws when the snapshots are of two runs,
// no snapshot is at or before the target, the target is not a snapshot time, two snapshots have
// the same profile, or the snapshots are of different models. Refuses (SynthesisRefused, which
// names the option that accepts it) a snapshot set with gaps, a target sigma_rel outside the
// tracked range by more than max_extrapolation, a system above max_condition, weights above
// max_weight, and a fit error above max_fit_error.
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

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/posthoc/synthesis-inl.hpp>
#endif
