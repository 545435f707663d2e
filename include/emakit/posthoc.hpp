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
//   // any EMA, e.g. a fixed 0.999, with the fit's error (plan.solution.fit_error) stated:
//   auto fixed = emakit::plan_synthesis("runs/a/phema",
//   emakit::SynthesisOptions(emakit::EmaTarget(emakit::Fixed(0.999))));
//
// The parts, each its own header under <emakit/posthoc/> (this header includes them all):
//   profile_math.hpp     profiles, their inner product, the solve for the snapshots' weights
//   options.hpp          PostHocOptions (what is tracked) and SynthesisOptions (what is made)
//   snapshot_folder.hpp  snapshot file names, write_snapshot, load_snapshot, list_snapshots
//   synthesis.hpp        plan_synthesis, synthesize, synthesize_into, synthesize_to_file
//   target.hpp           EmaTarget, preset_target: any EMA as a synthesis target
//   tracker.hpp          PostHocEma: the tracked profiles, their snapshots and state
//
// Compared with ema-pytorch's PostHocEMA: its KarrasEMA uses beta = (1 - 1/(k+1))^(gamma+1) at its
// k-th update (the EMA of the trajectory with the first state counted twice, one step off the
// power function) and ignores update_every in beta; its synthesis uses every snapshot, also those
// after the target, and does not normalise the weights. emakit follows the EDM2 math.
#pragma once

#include <emakit/posthoc/options.hpp>
#include <emakit/posthoc/profile_math.hpp>
#include <emakit/posthoc/snapshot_folder.hpp>
#include <emakit/posthoc/synthesis.hpp>
#include <emakit/posthoc/target.hpp>
#include <emakit/posthoc/tracker.hpp>
