"""Conformance data from torch.optim.swa_utils.update_bn: BatchNorm running statistics recomputed by
one pass over data, alone and at the end of an SWA run (AveragedModel, then update_bn).

The model (its C++ twin is in test_update_bn.cpp): conv (Conv2d 2->3, 3x3) -> bn2 (BatchNorm2d 3,
momentum 0.3) -> relu -> flatten -> fc (Linear 48->5) -> bn1 (BatchNorm1d 5). Input [N, 2, 6, 6].

Scenarios (OUT/<scenario>/):
  eval_loader   the model in eval mode, stale running statistics (a few train-mode forwards), bn1's
                momentum None; update_bn over a DataLoader of (input, target) pairs, batch size 6
                over 15 samples (batches of 6, 6 and 3): update_bn takes input[0].
  swa           AveragedModel(model) (SWA, use_buffers=False) over 8 noisy steps of a model in train
                mode (each step moves the parameters and runs a train-mode forward, which moves the
                model's running statistics), then update_bn(batches, swa_model) over a list of
                tensors (batches of 5, 5, 5 and 4). The averaging steps are written in _common.py's
                format (step_KKKK.pt: source.*, peer.*, called, counter.n_averaged), replayed by the
                C++ test through averaged_model_swa.

Each scenario's update_bn.pt (a plain dict of tensors), of the module update_bn ran on:
  before.<name>           its state_dict() before update_bn
  after.<name>            and after
  batch.<KK>              the model's input of batch KK (K = 0 .. batches - 1), in order
  momentum_before.<bn>    each BatchNorm's momentum before (float64; absent: None) ...
  momentum_after.<bn>     ... and after
  training_before.<mod>   each module's training flag before (1/0; <mod> "root" for the model) ...
  training_after.<mod>    ... and after
  calls                   how many times the model ran (a forward pre-hook counted)
and meta.pt: steps (the averaging steps, 0 without), buffer.<name> = 1 for buffers, torch_version
[major, minor] of the torch that wrote the data: a C++ build on the same torch must reproduce the
statistics bit for bit (the same kernels), another within a bound (test_update_bn.cpp).
"""
import os
import sys

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn


out = sys.argv[1]


class BnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn2 = nn.BatchNorm2d(3, momentum=0.3)
        self.fc = nn.Linear(48, 5)
        self.bn1 = nn.BatchNorm1d(5)

    def forward(self, x):
        return self.bn1(self.fc(torch.flatten(torch.relu(self.bn2(self.conv(x))), 1)))


def module_names(model):
    return [(name if name else "root", m) for name, m in model.named_modules()]


def batch_norms(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def record_module(record, prefix, model):
    for name, m in batch_norms(model):
        if m.momentum is not None:
            record[f"momentum_{prefix}.{name}"] = torch.tensor(float(m.momentum), dtype=torch.float64)
    for name, m in module_names(model):
        record[f"training_{prefix}.{name}"] = torch.tensor(1 if m.training else 0)


def run_update_bn(folder, loader, swa_model, model):
    """update_bn(loader, swa_model); `model` is the module whose state is recorded (swa_model's)."""
    record = {"before." + k: v.detach().clone() for k, v in model.state_dict().items()}
    record_module(record, "before", model)
    inputs = []
    calls = [0]

    def count(module, args):
        calls[0] += 1
        inputs.append(args[0].detach().clone())

    hook = model.register_forward_pre_hook(count)
    update_bn(loader, swa_model)
    hook.remove()
    record.update({"after." + k: v.detach().clone() for k, v in model.state_dict().items()})
    record_module(record, "after", model)
    record["calls"] = torch.tensor(calls[0])
    for k, x in enumerate(inputs):
        record["batch.%02d" % k] = x
    torch.save(record, os.path.join(folder, "update_bn.pt"))


def write_meta(folder, model, steps):
    version = [int(v) for v in torch.__version__.split("+")[0].split(".")[:2]]
    meta = {"steps": torch.tensor(steps), "torch_version": torch.tensor(version)}
    meta.update({"buffer." + name: torch.tensor(1) for name, _ in model.named_buffers()})
    torch.save(meta, os.path.join(folder, "meta.pt"))


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def scenario_eval_loader():
    folder = os.path.join(out, "eval_loader")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(4)
    model = BnNet()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
        model.train()
        for _ in range(5):  # stale statistics, and num_batches_tracked 5
            model(torch.randn(4, 2, 6, 6, generator=g))
    model.bn1.momentum = None
    model.eval()
    x = torch.cat([2 * torch.randn(6, 2, 6, 6, generator=g) + 1, torch.randn(9, 2, 6, 6, generator=g) - 0.5])
    y = torch.randint(0, 10, (15,), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6, shuffle=False)
    run_update_bn(folder, loader, model, model)
    write_meta(folder, model, 0)
    print("wrote", folder)


def scenario_swa(steps=8):
    folder = os.path.join(out, "swa")
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    model = BnNet()
    model.train()
    swa_model = AveragedModel(model)  # SWA: the equal-weight mean, use_buffers=False
    first = {"source." + k: v for k, v in state(model).items()}
    first["called"] = torch.tensor(0)
    torch.save(first, os.path.join(folder, "step_0000.pt"))
    for step in range(1, steps + 1):
        with torch.no_grad():  # a noisy "optimizer step" and a training forward
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
            model(torch.randn(5, 2, 6, 6, generator=g) * 1.5)
        record = {"source." + k: v for k, v in state(model).items()}
        swa_model.update_parameters(model)
        record["called"] = torch.tensor(1)
        record["vetoed"] = torch.tensor(0)
        record.update({"peer." + k: v for k, v in state(swa_model.module).items()})
        record["counter.n_averaged"] = torch.tensor(int(swa_model.n_averaged.item()))
        torch.save(record, os.path.join(folder, "step_%04d.pt" % step))
    batches = [torch.randn(n, 2, 6, 6, generator=g) * s for n, s in ((5, 1.0), (5, 2.0), (5, 0.5), (4, 1.0))]
    run_update_bn(folder, batches, swa_model, swa_model.module)
    write_meta(folder, model, steps)
    print("wrote", folder, steps, "steps")


scenario_eval_loader()
scenario_swa()
