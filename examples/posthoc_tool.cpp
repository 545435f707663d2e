// Post-hoc EMA from the command line: list a snapshot folder, synthesize the EMA for any
// sigma_rel (or gamma), or any EMA (a fixed decay, a warmup, a preset's), at any snapshot time into
// a checkpoint file.
//
//   emakit_example_posthoc_tool list runs/a/phema
//   emakit_example_posthoc_tool synthesize runs/a/phema --sigma-rel 0.07 -o ema-0.07.pt
//   emakit_example_posthoc_tool synthesize runs/a/phema --gamma 5 --step 20000 --format emkit -o ema.emkit
//   emakit_example_posthoc_tool synthesize runs/a/phema --fixed 0.999 -o ema-fixed.pt
//   emakit_example_posthoc_tool synthesize runs/a/phema --warmup 0.9999 --power 0.75 --ema-start-step 1000
//   emakit_example_posthoc_tool synthesize runs/a/phema --preset timm_model_ema_v3
//
// The .pt output is a dict name -> tensor: torch.load("ema-0.07.pt") in Python,
// torch::pickle_load in C++, model.load_state_dict(...) with the model's names. It is written
// atomically: on any error there is no output file.
//
// Exit status: 0 written (or listed); 1 an error (a folder of two runs, a corrupt file, ...);
// 2 bad arguments; 3 a synthesis refused because its result would not be the EMA asked for (a
// snapshot set with gaps, a target far outside the tracked profiles, weights past the bound, an
// ill-conditioned system, an EMA the snapshots cannot represent): the message names the flag that
// accepts it (--allow-partial, --max-extrapolation, --max-weight, --max-condition, --max-fit-error).
#include <emakit/posthoc.hpp>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/ranges.h>  // fmt::join

#include <cstdint>
#include <exception>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

double megabytes(std::uint64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

int list(const std::string& folder) {
  const auto snapshots = emakit::list_snapshots(folder);
  std::set<std::int64_t> times;
  std::map<std::uint32_t, double> profiles;
  std::uint64_t total = 0;
  fmt::print("{:>12}  {:>12}  {:>7}  {:>9}  {:>11}  {:>5}  {:>7}  {:>9}  {:>8}  {}\n", "t", "step", "profile",
             "sigma_rel", "gamma", "dt", "tensors", "MiB", "run", "file");
  for (const auto& s : snapshots) {
    std::set<std::string> dtypes;
    for (const auto& t : s.tensors)
      if (t.averaged) dtypes.insert(c10::toString(t.stored_dtype));
    fmt::print("{:>12}  {:>12}  {:>7}  {:>9.5f}  {:>11.6f}  {:>5}  {:>7}  {:>9.2f}  {:>8}  {} ({})\n", s.t, s.step,
               s.profile, s.sigma_rel, s.gamma, s.update_every, s.tensors.size(), megabytes(s.file_size),
               s.run.short_hex(), s.path.filename().string(), fmt::join(dtypes, ", "));
    times.insert(s.t);
    profiles[s.profile] = s.sigma_rel;
    total += s.file_size;
  }
  if (snapshots.empty()) {
    fmt::print("{}: no snapshot files (phema-*.emkit)\n", folder);
  } else {
    fmt::print("\n{} snapshots, {} profiles (sigma_rel", snapshots.size(), profiles.size());
    for (const auto& [index, sigma_rel] : profiles) fmt::print(" {}:{:.4f}", index, sigma_rel);
    fmt::print("), {} times from t = {} to {}, {:.1f} MiB\n", times.size(), *times.begin(), *times.rbegin(),
               megabytes(total));
    const auto runs = emakit::snapshot_runs(snapshots);
    for (const auto& r : runs) fmt::print("{}\n", r.describe());
    if (runs.size() > 1)
      fmt::print("warning: {} training runs share this folder; a synthesis refuses it until one is left\n",
                 runs.size());
  }
  if (const auto stale = emakit::interrupted_writes(folder); !stale.empty())
    fmt::print("{} temporary files of interrupted writes (not snapshots; safe to delete when nothing writes here)\n",
               stale.size());
  return 0;
}

struct SynthesizeArgs {
  std::string folder;
  std::optional<double> sigma_rel;
  std::optional<double> gamma;
  std::optional<double> fixed;   // an EMA target: Fixed(decay)
  std::optional<double> warmup;  // or InversePowerWarmup(beta).power(power).inv_gamma(inv_gamma)
  double power = 2.0 / 3.0;
  double inv_gamma = 1.0;
  std::string preset;  // or a preset's, with its peer's defaults
  std::int64_t ema_start_step = 0;
  std::int64_t ema_update_every = 1;
  std::optional<std::int64_t> step;
  std::string output;
  std::string format = "pt";
  std::string dtype;
  double max_condition = emakit::default_max_condition;
  double max_extrapolation = emakit::SynthesisOptions::default_max_extrapolation;
  double max_weight = emakit::SynthesisOptions::default_max_weight;
  double max_fit_error = emakit::SynthesisOptions::default_max_fit_error;
  bool allow_partial = false;
  bool dry_run = false;
};

std::optional<emakit::EmaTarget> ema_target(const SynthesizeArgs& a) {
  const auto schedule = emakit::StepSchedule().start_step(a.ema_start_step).update_every(a.ema_update_every);
  if (a.fixed) return emakit::EmaTarget(emakit::Fixed(*a.fixed), schedule);
  if (a.warmup)
    return emakit::EmaTarget(emakit::InversePowerWarmup(*a.warmup).power(a.power).inv_gamma(a.inv_gamma), schedule);
  if (!a.preset.empty()) return emakit::preset_target(a.preset);
  return std::nullopt;
}

int synthesize(const SynthesizeArgs& args) {
  const auto target = ema_target(args);
  auto options = target       ? emakit::SynthesisOptions(*target)
                 : args.gamma ? emakit::SynthesisOptions(*args.gamma)
                              : emakit::SynthesisOptions::from_sigma_rel(*args.sigma_rel);
  if (args.step) options.step(*args.step);
  options.max_condition(args.max_condition).max_extrapolation(args.max_extrapolation).max_weight(args.max_weight);
  options.max_fit_error(args.max_fit_error);
  options.allow_partial(args.allow_partial);
  static const std::map<std::string, c10::ScalarType> dtypes = {{"float32", c10::ScalarType::Float},
                                                                {"float64", c10::ScalarType::Double},
                                                                {"float16", c10::ScalarType::Half},
                                                                {"bfloat16", c10::ScalarType::BFloat16}};
  if (!args.dtype.empty()) options.dtype(dtypes.at(args.dtype));

  const auto plan = emakit::plan_synthesis(args.folder, options);
  if (target)
    fmt::print("target: {} at t = {}\n", options.describe_target(), static_cast<std::int64_t>(plan.target.t));
  else
    fmt::print("target: sigma_rel {:.5f} (gamma {:.6f}) at t = {}\n", options.sigma_rel(), options.gamma(),
               static_cast<std::int64_t>(plan.target.t));
  fmt::print("run {}, {} snapshots, tracked sigma_rel {:.4f} to {:.4f}\n", plan.run.short_hex(), plan.snapshots.size(),
             plan.tracked_min_sigma_rel, plan.tracked_max_sigma_rel);
  fmt::print("condition number {:.3g}, weights before normalisation sum to {:.9f}\n", plan.solution.condition,
             plan.solution.raw_sum);
  fmt::print("largest |weight| {:.4g}, sum of |weight| {:.4g}, profile error {:.3g} (relative L2 distance to the "
             "target profile)\n",
             plan.solution.max_abs_weight, plan.solution.abs_sum, plan.solution.profile_error);
  fmt::print("fit error {:.3g} (relative L2 distance of the weights on the past, over {} intervals), weight on the "
             "model before the first update {:.3g}\n",
             plan.solution.fit_error, plan.solution.intervals, plan.solution.initial_weight);
  for (const auto& m : plan.missing)
    fmt::print("missing (accepted with --allow-partial): profile {} at step {} ({})\n", m.profile, m.step, m.file_name);
  fmt::print("{:>12}  {:>9}  {:>16}  {}\n", "t", "sigma_rel", "weight", "file");
  for (std::size_t i = 0; i < plan.snapshots.size(); ++i)
    fmt::print("{:>12}  {:>9.5f}  {:>16.9e}  {}\n", plan.snapshots[i].t, plan.snapshots[i].sigma_rel,
               plan.solution.weights[i], plan.snapshots[i].path.filename().string());
  if (args.dry_run) return 0;
  const auto format = args.format == "emkit" ? emakit::OutputFormat::snapshot : emakit::OutputFormat::torch_pickle;
  emakit::synthesize_to_file(plan, args.output, format);
  fmt::print("wrote {}\n", args.output);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Post-hoc EMA: list a snapshot folder, synthesize an EMA for any sigma_rel, or any EMA"};
  app.require_subcommand(1);

  std::string list_folder;
  auto* list_cmd = app.add_subcommand("list", "list the snapshots of a folder");
  list_cmd->add_option("folder", list_folder, "the snapshot folder")->required()->check(CLI::ExistingDirectory);

  SynthesizeArgs args;
  auto* synth = app.add_subcommand("synthesize", "synthesize the EMA of a profile into a checkpoint file");
  synth->add_option("folder", args.folder, "the snapshot folder")->required()->check(CLI::ExistingDirectory);
  auto* sigma = synth->add_option("--sigma-rel,-s", args.sigma_rel, "the EMA length, in (0, 0.2887)");
  auto* gamma = synth->add_option("--gamma,-g", args.gamma, "or the power-function exponent, > 0");
  auto* fixed = synth->add_option("--fixed", args.fixed, "or an EMA of this fixed decay, in [0, 1]");
  auto* warmup =
      synth->add_option("--warmup", args.warmup, "or an inverse-power warmup EMA of this beta (--power, --inv-gamma)");
  std::vector<std::string> presets;
  for (const auto name : emakit::preset_target_names()) presets.emplace_back(name);
  auto* preset = synth->add_option("--preset", args.preset, "or a preset's EMA with its peer's defaults")
                     ->check(CLI::IsMember(presets));
  const std::vector<CLI::Option*> targets{sigma, gamma, fixed, warmup, preset};
  for (auto* a : targets)
    for (auto* b : targets)
      if (a != b) a->excludes(b);
  synth->add_option("--power", args.power, "--warmup's power (default 2/3)");
  synth->add_option("--inv-gamma", args.inv_gamma, "--warmup's inv_gamma (default 1)");
  synth->add_option("--ema-start-step", args.ema_start_step, "--fixed/--warmup: the first step that averages")
      ->check(CLI::NonNegativeNumber);
  synth->add_option("--ema-update-every", args.ema_update_every, "--fixed/--warmup: update every this many steps")
      ->check(CLI::PositiveNumber);
  synth->add_option("--step,-t", args.step, "the target time: a snapshot's t (default: the latest)");
  synth->add_option("--output,-o", args.output, "the output file (default: ema-<sigma_rel>-<t>.pt)");
  synth->add_option("--format,-f", args.format, "pt: a dict name -> tensor for torch.load; emkit: a snapshot file")
      ->check(CLI::IsMember({"pt", "emkit"}));
  synth->add_option("--dtype", args.dtype, "the result's dtype (default: the averages' dtype)")
      ->check(CLI::IsMember({"float32", "float64", "float16", "bfloat16"}));
  synth->add_option("--max-condition", args.max_condition, "refuse systems with a larger condition number");
  synth
      ->add_option("--max-extrapolation", args.max_extrapolation,
                   "refuse a sigma_rel outside the tracked range by more than this factor (default 2.5; inf: no limit)")
      ->check(CLI::Range(1.0, std::numeric_limits<double>::infinity()));
  synth->add_option("--max-weight", args.max_weight, "refuse weights larger than this in magnitude (default 10)")
      ->check(CLI::PositiveNumber);
  synth
      ->add_option("--max-fit-error", args.max_fit_error,
                   "refuse an EMA whose fitted weighting of the past is farther than this (relative L2; default 0.5)")
      ->check(CLI::PositiveNumber);
  synth->add_flag("--allow-partial", args.allow_partial,
                  "synthesize even when snapshots of the run are missing (they are listed)");
  synth->add_flag("--dry-run,-n", args.dry_run, "print the weights, write nothing");

  CLI11_PARSE(app, argc, argv);
  try {
    if (list_cmd->parsed()) return list(list_folder);
    if (!args.sigma_rel && !args.gamma && !args.fixed && !args.warmup && args.preset.empty()) {
      fmt::print(stderr, "error: give --sigma-rel, --gamma, --fixed, --warmup or --preset\n");
      return 2;
    }
    if (args.output.empty()) {
      const std::string what =
          args.fixed    ? fmt::format("fixed-{}", *args.fixed)
          : args.warmup ? fmt::format("warmup-{}", *args.warmup)
          : !args.preset.empty()
              ? args.preset
              : fmt::format("{:.4f}", args.sigma_rel ? *args.sigma_rel : emakit::gamma_to_sigma_rel(*args.gamma));
      args.output =
          fmt::format("ema-{}{}.{}", what, args.step ? fmt::format("-{}", *args.step) : std::string(), args.format);
    }
    return synthesize(args);
  } catch (const emakit::SynthesisRefused& e) {
    fmt::print(stderr, "refused: {}\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
