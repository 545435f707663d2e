"""Conformance data from diffusers' EMAModel (see _common.py for the format).

EMAModel holds the model's parameters only (no buffers), as a positional list (shadow_params)
cloned at construction; peer.<name> below names each shadow by model.named_parameters(), which
walks the parameters in the order parameters() gives them to EMAModel. Counters after step K:

  optimization_step  EMAModel's own count of step() calls
  decay_bits         the float64 bits of cur_decay_value (get_decay(optimization_step)) as an
                     int64, so that the C++ side can compare the decay bitwise; -1 before the
                     first step() call

A trainer step that skips the EMA (diffusers has no veto) is simply no step() call (skip_steps).
"""
import struct
import sys

from torch import nn

import _common

import diffusers
from diffusers.training_utils import EMAModel

out = sys.argv[1]


def shadows(ema_and_model):
    ema, model = ema_and_model
    names = [name for name, _ in model.named_parameters()]  # parameters() order, ties once
    assert len(names) == len(ema.shadow_params), (names, len(ema.shadow_params))
    out = dict(zip(names, ema.shadow_params))
    # A tied weight: diffusers keeps one shadow for it (parameters() dedupes); record it under
    # every name the model's state_dict() has, so that the replay finds it under each.
    if hasattr(model, "head"):
        assert model.head.weight is model.emb.weight
        out["head.weight"] = out["emb.weight"]
    return out


def counters(ema_and_model):
    ema, _ = ema_and_model
    d = ema.cur_decay_value
    bits = -1 if d is None else struct.unpack("<q", struct.pack("<d", float(d)))[0]
    return {"optimization_step": ema.optimization_step, "decay_bits": bits}


def update(ema_and_model, model, step):
    ema, _ = ema_and_model
    ema.step(model.parameters())


def maker(freeze=(), tie=False, **options):
    """make(model) for _common.run: freezes the named parameters (requires_grad False) and ties a
    head to the embedding before EMAModel sees the parameters."""

    def make(model):
        for name in freeze:
            model.get_parameter(name).requires_grad_(False)
        if tie:
            model.head = nn.Linear(4, 10, bias=False)  # Embedding(10, 4).weight is [10, 4]
            model.head.weight = model.emb.weight
            assert len(list(model.parameters())) == 7 and len(model.state_dict()) == 12
        ema = EMAModel(model.parameters(), **options)
        assert len(ema.shadow_params) == 7  # Net's parameters; a tie counts once
        return ema, model

    return make


common = dict(peer_state=shadows, counters=counters, update=update)

# The TF ramp (1+t)/(10+t) with every default (decay 0.9999, min_decay 0, update_after_step 0,
# foreach False): step 1 has d = 0.
_common.run(out, "ramp_defaults", make=maker(), steps=60, **common)
# foreach=True, decay 0.9 reached by the ramp at t = 81 (step 82), trainer steps without step().
_common.run(out, "ramp_foreach_with_skips", make=maker(decay=0.9, foreach=True), steps=100,
            skip_steps={3, 4, 40, 90}, **common)
# min_decay > 0 with update_after_step > 0: d = 0 for steps 1..6 (get_decay returns before the
# clamp), then max(0.5, min(0.95, ramp)).
_common.run(out, "min_decay_after_step", make=maker(decay=0.95, min_decay=0.5, update_after_step=5), steps=40,
            **common)
# use_ema_warmup with inv_gamma and power not the defaults, foreach True and False.
for foreach in (False, True):
    _common.run(out, "warmup_foreach" if foreach else "warmup",
                make=maker(decay=0.99, use_ema_warmup=True, inv_gamma=2.0, power=0.75, update_after_step=2,
                           foreach=foreach),
                steps=50, **common)
# A frozen parameter (requires_grad False at construction and at every step): copied, not
# averaged; the trajectory still moves it. Both code paths of step().
for foreach in (False, True):
    _common.run(out, "frozen_foreach" if foreach else "frozen",
                make=maker(freeze=("lin.bias",), decay=0.9, foreach=foreach), steps=30, **common)
# A head tied to the embedding: one shadow, averaged once per step.
_common.run(out, "tied", make=maker(tie=True, decay=0.9), steps=30, **common)

print("diffusers", diffusers.__version__)
