"""Conformance data from timm's ModelEmaV3 (see _common.py for the format)."""
import sys

import _common

from timm.utils.model_ema import ModelEmaV3

out = sys.argv[1]


def state(ema):
    return dict(ema.module.state_dict())


def no_counters(ema):
    return {"none": 0}


def with_step(ema, model, step):
    ema.update(model, step=step)


_common.run(out, "warmup_with_step",
            make=lambda m: ModelEmaV3(m, decay=0.99, min_decay=0.1, update_after_step=2, use_warmup=True,
                                      warmup_power=3 / 4),
            update=with_step, peer_state=state, counters=no_counters, steps=40,
            saved_state=lambda e: dict(e.state_dict()), saved_state_step=25)
_common.run(out, "no_warmup_exclude_buffers",
            make=lambda m: ModelEmaV3(m, decay=0.95, update_after_step=3, exclude_buffers=True),
            update=with_step, peer_state=state, counters=no_counters, steps=30)
_common.run(out, "no_step",
            make=lambda m: ModelEmaV3(m, decay=0.9),
            update=lambda ema, model, step: ema.update(model), peer_state=state, counters=no_counters, steps=30)
# A tied weight (head.weight IS emb.weight). apply_update_ walks state_dict().values(), where the
# tied tensor is listed under both names: it is lerped twice per update (the second lerp starts
# from the first one's result, so decay d moves it like d**2). With exclude_buffers, the walk is
# parameters(), which lists it once.
_common.run(out, "tied",
            make=lambda m: ModelEmaV3(m, decay=0.9, update_after_step=2),
            update=with_step, peer_state=state, counters=no_counters, steps=20, model=_common.TiedNet)
_common.run(out, "tied_exclude_buffers",
            make=lambda m: ModelEmaV3(m, decay=0.9, update_after_step=2, exclude_buffers=True),
            update=with_step, peer_state=state, counters=no_counters, steps=20, model=_common.TiedNet)
