"""Conformance data from ema-pytorch's EMAModuleWrapper (ema_pytorch/ema_module_kwargs.py): the
teacher's (EMA model's) sub-module outputs injected into the student's sub-modules.

The model (the C++ twin is in test_teacher_conformance.cpp): encoder (Linear 6->5, BatchNorm1d)
-> projector (Linear 5->4) -> predictor (Linear 4->4, takes `ema_output`) -> head (Linear 4->3,
takes `target`). Routes, in the reference's mapping formats (one wrapper per scenario: two wrappers on one model
would see each other's captured outputs):
  map_routes:   {"predictor": "projector",   a module path: predictor <- teacher projector
                 "head": "target"}           not a path: the name; head <- teacher head
  list_routes:  ["projector"]                projector <- teacher projector, as ema_output
Each receiver adds 0.5 * the injected tensor to its output (so the student's output depends on the
teacher's).

Scenarios (OUT/<scenario>/step_KKKK.pt, K = 1..steps; meta.pt):
  source.<name>  the model's state after the noisy optimizer step, before the forward
  input          the forward's input
  out            the wrapper's output in train mode (teacher pass, then the student)
  after.<name>   the model's state after that forward (BatchNorm's running stats move)
  peer.<name>    the EMA model's state after wrapper.update()
  eval_out       (every 4th step) after model.eval() and wrapper.eval(): the wrapper's output,
                 which is the EMA model's; ema_eval_direct: ema_model(input) the same
  counter.step   ema.step
and the scenario "not_online_in_train" (forward_online_during_train=False): out is the EMA model's
output in train mode (its BatchNorm moves: after_ema.<name> is the EMA model's state after it).
"""
import os
import sys

import torch
from torch import nn

from ema_pytorch import EMAModuleWrapper

out_dir = sys.argv[1]


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.bn = nn.BatchNorm1d(5)

    def forward(self, x):
        return torch.tanh(self.bn(self.fc(x)))


class Receiver(nn.Module):
    def __init__(self, n_in, n_out, kwarg):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.kwarg = kwarg

    def forward(self, x, **kwargs):
        y = self.fc(x)
        injected = kwargs.get(self.kwarg)
        if injected is not None:
            y = y + 0.5 * injected
        return y


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.projector = Receiver(5, 4, "ema_output")
        self.predictor = Receiver(4, 4, "ema_output")
        self.head = Receiver(4, 3, "target")

    def forward(self, x):
        return self.head(self.predictor(self.projector(self.encoder(x))))


def noisy_step(model, g):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def scenario(name, routes, steps, online_in_train=True, seed=0):
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model = Model()
    wrapper = EMAModuleWrapper(model, ema_module_kwargs=routes, forward_online_during_train=online_in_train,
                               beta=0.9, update_after_step=2, update_every=1)
    first = {"source." + k: v for k, v in snapshot(model).items()}
    torch.save(first, os.path.join(folder, "step_0000.pt"))
    buffers = {n for n, _ in model.named_buffers()}
    for step in range(1, steps + 1):
        noisy_step(model, g)
        rec = {"source." + k: v for k, v in snapshot(model).items()}
        x = torch.randn(7, 6, generator=g)
        rec["input"] = x
        model.train()
        rec["out"] = wrapper(x).detach().clone()
        rec.update({"after." + k: v for k, v in snapshot(model).items()})
        if not online_in_train:
            rec.update({"after_ema." + k: v for k, v in snapshot(wrapper.ema_model).items()})
        wrapper.update()
        rec.update({"peer." + k: v for k, v in snapshot(wrapper.ema_model).items()})
        rec["counter.step"] = torch.tensor(int(wrapper.ema.step.item()))
        if step % 4 == 0:
            model.eval()
            wrapper.eval()
            rec["eval_out"] = wrapper(x).detach().clone()
            rec["ema_eval_direct"] = wrapper.ema_model(x).detach().clone()
            model.train()
            wrapper.ema_model.train()
        torch.save(rec, os.path.join(folder, "step_%04d.pt" % step))
    meta = {"steps": torch.tensor(steps), "seed": torch.tensor(seed)}
    meta.update({"buffer." + n: torch.tensor(1) for n in buffers})
    torch.save(meta, os.path.join(folder, "meta.pt"))
    print("wrote", folder, steps, "steps")


scenario("map_routes", {"predictor": "projector", "head": "target"}, steps=12)
scenario("list_routes", ["projector"], steps=8)
scenario("not_online_in_train", {"predictor": "projector", "head": "target"}, steps=6, online_in_train=False)
