"""Conformance data from nvalchemi-toolkit's EMAHook (see _common.py for the format), where the
package installs. It pins an older torch than the venv's and pulls in many packages, so the test
command does not install it: without it this reports itself skipped."""
import sys
import types

import _common

out = sys.argv[1]
try:
    from nvalchemi.training._stages import TrainingStage
    from nvalchemi.training.hooks.ema import EMAHook
except Exception as e:
    _common.skipped(out, f"nvalchemi-toolkit is not installed here ({type(e).__name__}: {e}); "
                         "it pins an older torch than the venv's, so the test command does not install it")

skips = {6, 7}


def make(model):
    hook = EMAHook(decay=0.9, update_every=2, start_step=3, use_buffers=False)
    hook.ctx = types.SimpleNamespace(models={"main": model}, step_count=0, workflow=None)
    return hook


def update(hook, model, step):
    hook.ctx.step_count = step - 1
    hook(hook.ctx, TrainingStage.AFTER_OPTIMIZER_STEP, will_skip=step in skips)


def state(hook):
    try:
        return dict(hook.get_averaged_model().module.state_dict())
    except RuntimeError:  # not initialised before the first eligible step
        return {}


_common.run(out, "vetoed_start_every", make=make, update=update, peer_state=state,
            counters=lambda h: {"num_updates": h.num_updates}, steps=20, vetoed_steps=skips)
