"""Conformance data from ema-pytorch's EMA (see _common.py for the format)."""
import sys

import _common

import ema_pytorch
from ema_pytorch import EMA

out = sys.argv[1]


def ema_state(ema):
    return dict(ema.ema_model.state_dict())


def counters(ema):
    return {"step": int(ema.step.item()), "initted": int(ema.initted.item())}


def update(ema, model, step):
    ema.update()


common = dict(peer_state=ema_state, counters=counters, update=update)

# Warmup copies, update_every, the three name sets, inverse-power decay with min_value.
_common.run(out, "names_and_warmup",
            make=lambda m: EMA(m, beta=0.99, update_after_step=5, update_every=3, power=3 / 4, min_value=0.2,
                               param_or_buffer_names_no_ema={"mask"}, ignore_names={"emb.weight"},
                               ignore_startswith_names={"conv."}, include_online_model=False),
            steps=40, **common)
# Defaults (update_after_step 100, update_every 10), with steps the trainer skipped.
_common.run(out, "defaults_with_skips",
            make=lambda m: EMA(m, include_online_model=False),
            steps=160, skip_steps={7, 8, 55, 101}, saved_state=lambda e: dict(e.state_dict()), saved_state_step=120,
            **common)
# Switch EMA: the model is pulled to the EMA every 4 steps (beta 0.5), and copied (beta 0).
_common.run(out, "switch_lerp",
            make=lambda m: EMA(m, beta=0.9, update_after_step=2, update_every=1, include_online_model=False,
                               update_model_with_ema_every=4, update_model_with_ema_beta=0.5),
            steps=25, writes_model=True, **common)
_common.run(out, "switch_copy",
            make=lambda m: EMA(m, beta=0.9, update_after_step=2, update_every=2, include_online_model=False,
                               update_model_with_ema_every=3, update_model_with_ema_beta=0.0),
            steps=25, writes_model=True, **common)
# A tied weight (head.weight IS emb.weight): the EMA walks named_parameters(), which lists the
# tied Parameter once (as emb.weight), so it averages it once per update.
_common.run(out, "tied",
            make=lambda m: EMA(m, beta=0.9, update_after_step=2, update_every=1, power=3 / 4,
                               include_online_model=False),
            steps=20, model=_common.TiedNet, **common)
print("ema-pytorch", getattr(ema_pytorch, "__version__", "?"))
