"""Conformance data from torch.optim.swa_utils.AveragedModel (see _common.py for the format)."""
import sys

import _common

from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

out = sys.argv[1]


def state(avg):
    return dict(avg.module.state_dict())


def counters(avg):
    return {"n_averaged": int(avg.n_averaged.item())}


def update(avg, model, step):
    avg.update_parameters(model)


common = dict(update=update, peer_state=state, counters=counters)
_common.run(out, "ema_buffers",
            make=lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True),
            steps=30, **common)
_common.run(out, "ema_no_buffers",
            make=lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=False),
            steps=30, skip_steps={4, 5}, saved_state=lambda a: dict(a.state_dict()), saved_state_step=12, **common)
_common.run(out, "swa_no_buffers", make=lambda m: AveragedModel(m, use_buffers=False), steps=30, **common)
# A tied weight (head.weight IS emb.weight): update_parameters walks parameters() (and buffers()),
# which list the tied Parameter once: averaged once per update.
_common.run(out, "tied_ema",
            make=lambda m: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True),
            steps=20, model=_common.TiedNet, **common)
