"""Conformance data from nvalchemi-toolkit's EMAHook (see _common.py for the format).

Runs in the seed venv (scripts/requirements-seed.txt; nvalchemi pins a torch that cannot share
the first venv). Without it, ctest replays the recorded fixture (tests/conformance/fixtures/).

The hook is driven the way nvalchemi's TrainingStrategy drives it (training/strategy.py,
_train_batch_with_optimizers): hook(ctx, AFTER_OPTIMIZER_STEP, will_skip=...) after each batch,
with ctx.step_count the optimizer steps completed before this batch; the strategy advances
step_count only when the optimizer step ran, so a vetoed batch (will_skip) completes no step.
Each step record also holds
  counter.num_updates    the hook's num_updates
  counter.step_count     ctx.step_count after the batch (completed optimizer steps)
  counter.created        1 once the hook has built its AveragedModel (lazy creation)
  counter.n_averaged     the AveragedModel's n_averaged (0 before creation)

The scenarios run under `python nvalchemi_peer.py OUT` (main); importing the module runs none, so
that _peer_roundtrip.py drives a hook with the same Driver, averaged, counters and RESUME_*.
"""
import os
import sys
import types

import _common
import torch

# Not importable outside the seed venv (nvalchemi pins its own torch): the ImportError ends the
# run with exit status 1, a failure. ctest runs this only with EMAKIT_SEED_PYTHON.
from nvalchemi.training._stages import TrainingStage
from nvalchemi.training.hooks.ema import EMAHook

class Driver:
    """The hook and a TrainContext-like namespace, advanced as TrainingStrategy does."""

    def __init__(self, model, hook, setup=False):
        self.hook = hook
        self.ctx = types.SimpleNamespace(models={"main": model}, step_count=0, workflow=None, loss=None)
        if setup:
            hook(self.ctx, TrainingStage.SETUP)

    def batch(self, vetoed):
        self.hook(self.ctx, TrainingStage.AFTER_OPTIMIZER_STEP, will_skip=vetoed)
        if not vetoed:
            self.ctx.step_count += 1


def averaged(d):
    try:
        return dict(d.hook.get_averaged_model().module.state_dict())
    except RuntimeError:  # not built before the first eligible step
        return {}


def counters(d):
    created = d.hook._averaged_model is not None
    return {"num_updates": d.hook.num_updates, "step_count": d.ctx.step_count, "created": int(created),
            "n_averaged": int(d.hook.get_averaged_model().n_averaged.item()) if created else 0}


# Resume: the run saves hook.state_dict() after batch 8; a fresh hook with the same config loads
# it before its averaged model exists (pending state) and drives batches 9..20, with
# ctx.step_count restored as the strategy's checkpoint does. It builds its averaged model at its
# first eligible step, applies the pending state there and averages on (n_averaged and
# num_updates restored). hook_state_0008.pt holds the saved state (averaged_model_state.*,
# num_updates, step_count) as a plain dict, state_0008.pt the same state as a user saves it:
# torch.save(hook.state_dict()). _peer_roundtrip.py drives the same scenario from an export.
RESUME_CONFIG = dict(decay=0.85, update_every=3, start_step=4, use_buffers=False)
RESUME_VETOES = {2, 10}


def main(out):
    _common.write_versions(out, ["nvalchemi-toolkit", "torch"])

    def scenario(name, make_hook, vetoes, steps=20, setup=False, **kw):
        _common.run(out, name, make=lambda m: Driver(m, make_hook(), setup=setup),
                    update=lambda d, m, step: d.batch(step in vetoes), peer_state=averaged, counters=counters,
                    steps=steps, vetoed_steps=vetoes, **kw)

    # Lazy creation at the first eligible step, start_step, update_every, vetoed batches, buffers
    # copied (use_buffers=False keeps them in sync with the model).
    scenario("vetoed_start_every",
             lambda: EMAHook(decay=0.9, update_every=2, start_step=3, use_buffers=False), vetoes={6, 7, 12})
    # The defaults' use_buffers=True (AveragedModel averages every buffer, integers in integer
    # arithmetic), the averaged model built at SETUP.
    scenario("buffers_at_setup", lambda: EMAHook(decay=0.8, start_step=2), vetoes={5}, setup=True)
    # A tied weight (head.weight IS emb.weight): the hook's AveragedModel walks parameters() (and
    # buffers()), which list the tied Parameter once: averaged once per update.
    scenario("tied", lambda: EMAHook(decay=0.9, start_step=2, use_buffers=False), vetoes=set(), model=_common.TiedNet)

    # Resume (RESUME_CONFIG, RESUME_VETOES above).
    config = RESUME_CONFIG
    resume_vetoes = RESUME_VETOES
    saved = {}

    class Resume:
        def __init__(self, model):
            self.d = Driver(model, EMAHook(**config))
            self.hook, self.ctx = self.d.hook, self.d.ctx

        def update(self, model, step):
            self.d.batch(step in resume_vetoes)
            if step == 8:
                state = self.d.hook.state_dict()
                saved["state"] = state
                saved["step_count"] = self.d.ctx.step_count
                saved["model"] = {k: v.clone() for k, v in model.state_dict().items()}
                hook = EMAHook(**config)
                hook.load_state_dict(state)
                saved["pending"] = hook._pending_averaged_state is not None and hook._averaged_model is None
                self.d = Driver(model, hook)
                self.d.ctx.step_count = saved["step_count"]
                self.hook, self.ctx = self.d.hook, self.d.ctx

    _common.run(out, "resume", make=Resume, update=lambda r, m, step: r.update(m, step), peer_state=averaged,
                counters=counters, steps=20, vetoed_steps=resume_vetoes)
    state = saved["state"]
    torch.save({"averaged_model_state." + k: v for k, v in state["averaged_model_state"].items()}
               | {"num_updates": torch.tensor(state["num_updates"]), "step_count": torch.tensor(saved["step_count"])},
               os.path.join(out, "resume", "hook_state_0008.pt"))
    # The same state as a user saves it: torch.save(hook.state_dict()), the nested OrderedDict
    # (model_key and the config included).
    torch.save(state, os.path.join(out, "resume", "state_0008.pt"))

    # A state saved with another config: load_state_dict raises naming the field, and loads nothing.
    errors = {}
    for field, value in (("decay", 0.9), ("update_every", 2), ("start_step", 0), ("use_buffers", True)):
        other = dict(config)
        other[field] = value
        hook = EMAHook(**other)
        try:
            hook.load_state_dict(saved["state"])
            errors[field] = ""
        except ValueError as e:
            errors[field] = str(e)
        assert hook.num_updates == 0 and hook._pending_averaged_state is None, "a failed load changed the hook"
    os.makedirs(os.path.join(out, "config_conflict"), exist_ok=True)
    torch.save({"message." + k: torch.tensor(list(v.encode()), dtype=torch.uint8) for k, v in errors.items()}
               | {"pending_before_creation": torch.tensor(int(saved["pending"]))},
               os.path.join(out, "config_conflict", "errors.pt"))
    torch.save({"steps": torch.tensor(0)}, os.path.join(out, "config_conflict", "meta.pt"))
    print("wrote", os.path.join(out, "config_conflict"))

    # Device/dtype alignment: the state saved by the float32 run, loaded into a fresh hook whose
    # model is float64. The pending state is applied at creation and aligned to the source's dtype.
    model64 = _common.Net()
    model64.load_state_dict(saved["model"])
    model64.double()
    hook = EMAHook(**config)
    hook.load_state_dict(saved["state"])
    d = Driver(model64, hook)
    d.ctx.step_count = saved["step_count"]
    hook(d.ctx, TrainingStage.SETUP)  # builds it now: applies the pending state, aligned
    avg = hook.get_averaged_model()
    os.makedirs(os.path.join(out, "dtype_alignment"), exist_ok=True)
    torch.save({"peer." + k: v.detach().clone() for k, v in avg.module.state_dict().items()}
               | {"n_averaged": avg.n_averaged.detach().clone(), "num_updates": torch.tensor(hook.num_updates)},
               os.path.join(out, "dtype_alignment", "aligned.pt"))
    torch.save({"steps": torch.tensor(0)}, os.path.join(out, "dtype_alignment", "meta.pt"))
    print("wrote", os.path.join(out, "dtype_alignment"))


if __name__ == "__main__":
    main(sys.argv[1])
