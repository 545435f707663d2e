// ShardedStorage: an EMA split across the ranks of a c10d process group (Gloo on CPU, NCCL on GPU).
// The public include of the sharded EMA; it pulls in the headers below, one job each.
//
// Data-parallel training keeps the whole model on every rank, and a plain EMA keeps a whole copy
// on every rank too, computed identically N times. With ShardedStorage each rank keeps and
// updates only its share of the average (about 1/N of the bytes), with no communication per
// update; the whole average is gathered on demand, to every rank or to one.
//
//   #include <emakit/sharded.hpp>          // not in emakit.hpp: see "Why a header of its own"
//   #include <emakit/gloo.hpp>             // make_gloo_group, if the trainer has no group yet
//
//   auto group = emakit::make_gloo_group(store, rank, world, std::chrono::seconds(30));
//   emakit::ShardedWarmupEma ema(*model, {}, {}, {}, emakit::ShardedStorage(group, std::chrono::seconds(30)));
//   for (...) { ...; optimizer.step(); ema.update(); }              // local: no communication
//   emakit::StateDict full = emakit::gather_averages(ema);          // collective: every rank gets it all
//   emakit::StateDict on0 = emakit::gather_averages(ema, 0);        // only rank 0 gets it (others: empty)
//   { auto swapped = emakit::swap_gathered_into(ema, *model); evaluate(*model); }   // collective
//   emakit::save_sharded(ema, "ckpt/ema");     // collective: rank-<r>-of-<N>.<id>.pt per rank + index.pt
//   emakit::load_sharded(ema, "ckpt/ema");     // collective; any world size (resharding)
//
//   sharded/storage.hpp      ShardedStorage, LocalShard: which rank holds which tensor or slice
//   sharded/gather.hpp       gather_averages, gather_state_dict, swap_gathered_into
//   sharded/checkpoint.hpp   save_sharded, load_sharded (emakit::save / emakit::load call them)
//   detail/collectives.hpp   the collectives, each with a timeout
//
// Every decay and schedule policy works unchanged: the Ema runs the same update on the tensors
// this rank holds, and the storage only decides which those are.
//
// Collectives. gather_averages, gather_state_dict, swap_gathered_into, save_sharded and
//   load_sharded must be called by every rank of the group, in the same order. Each first
//   exchanges the update counters (calls, step, num_updates, last_update_step) and a fingerprint
//   of the layout: ranks that disagree (a rank that updated once more, another model) make every
//   rank throw an error naming the ranks and their values. Each collective waits at most the
//   storage's timeout: a rank that died or stalled gives the others std::runtime_error, not a
//   hang. After such an error the process group is unusable (as in PyTorch); make the group with
//   the same timeout (make_gloo_group's argument), so that Gloo's own worker gives up too.
//
// On a sharded EMA, the Ema's own members see this rank's share only: averages(), state_dict(),
// copy_to(), swap_into(), torch::save(ema). Use the functions here for the whole average; a
// swap_gathered_into() guard is the Ema's own SwapGuard, so update() is refused while it is open.
//
// Why a header of its own: the c10d headers are only in LibTorch builds with USE_DISTRIBUTED,
// and they add to every translation unit's compile time; a trainer without processes should not
// pay for them. It needs nothing to link beyond LibTorch (c10d lives in libtorch_cpu).
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/decay.hpp>
#include <emakit/ema.hpp>
#include <emakit/schedule.hpp>
#include <emakit/sharded/checkpoint.hpp>
#include <emakit/sharded/gather.hpp>
#include <emakit/sharded/storage.hpp>

namespace emakit::inline EMAKIT_ABI_NAMESPACE {

// Ready-made sharded EMAs.
using ShardedEma = Ema<Fixed, StepSchedule, ShardedStorage>;
using ShardedWarmupEma = Ema<InversePowerWarmup, StepSchedule, ShardedStorage>;

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE
