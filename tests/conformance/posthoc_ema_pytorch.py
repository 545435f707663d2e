"""Conformance data from ema-pytorch's PostHocEMA: tracking, snapshots, solve and synthesis.

Run as `python posthoc_ema_pytorch.py OUT`. Drives _common.Net through a seeded trajectory
with PostHocEMA(sigma_rels=(0.05, 0.10), update_every=1, checkpoint_every_num_steps=10,
checkpoint_dtype=float32) and writes OUT/posthoc.pt, a plain dict:

  steps                      int64, the number of update() calls (T)
  gammas                     float64 [2], the tracked gammas (ema-pytorch's own sigma_rel_to_gamma)
  target_sigma_rel, target_gamma, mid_step   the synthesis target, and the earlier target time
  traj.<name>                the model's state at each call, stacked: [T, ...]
  buffer.<name>              1 for buffers
  ckpt_steps                 int64, the checkpoint steps
  ckpt.<ind>.<step>.<name>   each checkpoint's averaged tensors (ema_model.* of its state dict)
  order_ind, order_step      the checkpoints in the order PostHocEMA's synthesis used them
  weights, weights_mid       its solve_weights() for the target at T and at mid_step, in that order
  synth.<name>, synth_mid.<name>   synthesize_ema_model(sigma_rel=target) at T and at mid_step

A package that cannot be imported ends it with the ImportError (exit status 1), which fails its
ctest test: a peer that does not import is a failure, never a skip.
"""
import os
import pathlib
import sys
import tempfile

import torch

import _common

import ema_pytorch
from ema_pytorch import PostHocEMA
from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma, solve_weights

out = sys.argv[1]

STEPS, EVERY, MID = 40, 10, 20
SIGMA_RELS, TARGET = (0.05, 0.10), 0.07

os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
model = _common.Net()
record = {}
with tempfile.TemporaryDirectory() as folder:
    posthoc = PostHocEMA(model, sigma_rels=SIGMA_RELS, update_every=1, checkpoint_every_num_steps=EVERY,
                         checkpoint_folder=folder, checkpoint_dtype=torch.float32)
    trajectory = []
    for step in range(1, STEPS + 1):
        _common.optimizer_step(model, generator)
        trajectory.append(_common.state(model))
        posthoc.update()
    for name in trajectory[0]:
        record["traj." + name] = torch.stack([s[name] for s in trajectory])
    for name, _ in model.named_buffers():
        record["buffer." + name] = torch.tensor(1)

    # The checkpoints, and the order the synthesis globs them in (it pairs weights with files).
    files = [*pathlib.Path(folder).glob("*.pt")]
    inds, steps = [], []
    for f in files:
        ind, step = map(int, f.stem.split("."))
        inds.append(ind)
        steps.append(step)
        for key, value in torch.load(str(f), weights_only=True).items():
            if key.startswith("ema_model."):
                record[f"ckpt.{ind}.{step}.{key[len('ema_model.'):]}"] = value
    record["ckpt_steps"] = torch.tensor(sorted(set(steps)))
    record["order_ind"] = torch.tensor(inds)
    record["order_step"] = torch.tensor(steps)
    gammas = [sigma_rel_to_gamma(s) for s in SIGMA_RELS]
    record["gammas"] = torch.tensor(gammas, dtype=torch.float64)
    target_gamma = sigma_rel_to_gamma(TARGET)
    for suffix, t in (("", STEPS), ("_mid", MID)):
        w = solve_weights(torch.tensor(steps), torch.tensor([gammas[i] for i in inds], dtype=torch.float64),
                          torch.tensor([t]), torch.tensor([target_gamma], dtype=torch.float64))
        record["weights" + suffix] = w.squeeze(-1).double()
        synthesized = posthoc.synthesize_ema_model(sigma_rel=TARGET, step=t if suffix else None)
        for key, value in synthesized.ema_model.state_dict().items():
            record[f"synth{suffix}.{key}"] = value.detach().clone()

record["steps"] = torch.tensor(STEPS)
record["mid_step"] = torch.tensor(MID)
record["target_sigma_rel"] = torch.tensor(TARGET, dtype=torch.float64)
record["target_gamma"] = torch.tensor(target_gamma, dtype=torch.float64)
torch.save(record, os.path.join(out, "posthoc.pt"))
print("wrote", os.path.join(out, "posthoc.pt"), "ema-pytorch", getattr(ema_pytorch, "__version__", "?"),
      "weights sum", float(record["weights"].sum()))
