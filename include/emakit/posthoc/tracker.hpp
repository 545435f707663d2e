// Post-hoc EMA tracking: PostHocEma keeps several power-function EMAs of one model and writes their
// snapshots.
//
// Tracking. Each profile is a core emakit::Ema<PowerFunction, StepSchedule, FlatStorage> that
// updates at steps dt, 2dt, ... (StepSchedule::update_every(dt), Warmup::skip_before_start): the
// first update, at t = dt, copies the model, and the update at step t uses
// d = (1 - dt_t / t)^(gamma + 1) with dt_t the steps since the previous update. The weight of the
// model of step s in the EMA at step T is then exactly (s^(gamma+1) - (s - dt_s)^(gamma+1)) /
// T^(gamma+1): the mass that the power-function profile (gamma+1) tau^gamma / T^(gamma+1) puts on
// (s - dt_s, s], so the profile the synthesis assumes is the one tracked (steps the EMA never
// saw, e.g. with caller-supplied steps, widen the next interval, and that stays exact).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/posthoc/part.hpp>
#include <emakit/checkpoint.hpp>
#include <emakit/concepts.hpp>
#include <emakit/decay.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/serial/ema_state.hpp>
#include <emakit/detail/serial/formats.hpp>
#include <emakit/detail/serial/state_reader.hpp>
#include <emakit/ema.hpp>
#include <emakit/options.hpp>
#include <emakit/posthoc/options.hpp>
#include <emakit/posthoc/snapshot_folder.hpp>
#include <emakit/together.hpp>
#include <emakit/posthoc/synthesis.hpp>
#include <emakit/schedule.hpp>
#include <emakit/storage.hpp>

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <fmt/core.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

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

  // Call after each optimizer step: updates every profile (in one pass over the model,
  // update_together) and writes snapshots at multiples of snapshot_every. A failed snapshot write
  // throws (naming the file) after the update was applied. The first call (and the first after
  // load_state_dict) checks the folder first: another run's snapshots there are refused, before
  // anything changes, or moved aside (PostHocOptions::existing_snapshots); this run's snapshots
  // from after the step it goes on from (a run resumed from an older checkpoint than its last
  // snapshot: the crashed branch's) are always moved into "<folder>/abandoned-<id>-after-<step>",
  // with a warning.
  PostHocUpdate update(StepInfo info = {});

  // Writes a snapshot of every profile now; returns the files. Needs at least one applied update.
  std::vector<std::filesystem::path> snapshot();

  // This training run's identity, written into every snapshot: random when the PostHocEma is
  // made, the saved run's after load_state_dict (a state of format 1 has none: its run goes on
  // without an id, as its snapshots).
  const RunId& run() const noexcept { return run_; }
  std::int64_t run_started() const noexcept { return run_started_; }

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
  // "posthoc.previous_snapshot_step", "posthoc.run_id" (16 uint8), "posthoc.run_started", then
  // each profile's Ema::state_dict() under "profile.<i>.".
  StateDict state_dict() const;

  // Loads a state_dict() of a PostHocEma with the same profiles and model (format 2, or format 1
  // from before run ids), and takes on its run: the snapshots this PostHocEma writes next belong
  // to that run. Everything is checked first: a failed load changes nothing. The first update
  // after it sets aside the snapshots of this run from after the loaded step (see update()).
  void load_state_dict(const StateDict& state);

 private:
  StepSchedule schedule() const {
    return StepSchedule().update_every(options_.update_every()).warmup(Warmup::skip_before_start);
  }

  void prepare();

  // Once per run start: refuses, or moves aside, another run's snapshots in the folder.
  void check_folder();

  // Throws unless emas_[i].load_state_dict(part) would load every key: Ema::check_state_dict
  // (strict), its message prefixed with the profile.
  void check_loadable(std::size_t i, const StateDict& part) const;

  PostHocOptions options_;
  std::vector<Tracked> emas_;
  std::optional<EmaGroup> group_;  // the profiles, updated in one pass (made at the first update)
  std::int64_t last_snapshot_step_ = -1;
  std::int64_t previous_snapshot_step_ = -1;  // the step before last_snapshot_step_ in the chain (-1: unknown)
  RunId run_ = RunId::random();
  std::int64_t run_started_ = 0;
  bool folder_checked_ = false;
};

// A PostHocEma in a file of its own (its state_dict(): every profile and the run), as
// emakit::save and emakit::load keep an Ema (checkpoint.hpp): written atomically, a crash
// mid-write leaves the previous file readable; read only after the file is checked (nothing but
// tensors and plain values, each tensor's CRC-32), then load_state_dict()'s checks (the profiles,
// the model, each profile's config). A failed load leaves the PostHocEma as it was.
EMAKIT_FUNC void save(const PostHocEma& posthoc, const std::filesystem::path& path);
EMAKIT_FUNC void load(PostHocEma& posthoc, const std::filesystem::path& path);

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE

#if !defined(EMAKIT_COMPILED)
#include <emakit/posthoc/tracker-inl.hpp>
#endif
