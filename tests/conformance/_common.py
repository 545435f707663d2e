"""Shared by the conformance generators: the model, the seeded trajectory, the file format.

Each generator drives the real Python package through scenarios. For scenario S it writes
OUT/S/step_KKKK.pt (K = 0 .. steps), each a plain dict of tensors (LibTorch 1.13's unpickler
reads plain dicts, not OrderedDicts):

  source.<name>   the model's state after optimizer step K, before the EMA update (K = 0: at
                  the EMA's construction)
  peer.<name>     the peer's averaged state after its update at step K (K >= 1)
  after.<name>    the model's state after the update (only for scenarios that write the model)
  called          1 when the trainer called the peer's update at step K, 0 for a skipped step
  vetoed          1 when the trainer called the peer but told it the step was skipped
  counter.<c>     the peer's counters after step K (names per peer)

and, for scenarios that test moving a run to C++, OUT/S/state_KKKK.pt: the peer's own
state_dict() after step K, saved as a user would (a plain dict).

and OUT/S/meta.pt with steps, buffer.<name> = 1 for buffers and tied.<name> = 1 for each name of a
tied tensor (a scenario run on TiedNet: head.weight IS emb.weight).

A generator imports its package at the top, unguarded: a package that cannot be imported ends
the run with the ImportError and exit status 1, and ctest reports the generator (and the replays
that need its data) as failed. A peer that does not import is never a skip; the only skip is
a build without any Python (cmake/emakit_run_conformance_script.cmake).
"""
import os

import torch
from torch import nn


class Net(nn.Module):
    """Linear, Conv2d, BatchNorm (running stats and num_batches_tracked), Embedding, and a
    float buffer `mask` that must be copied, not averaged."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.conv = nn.Conv2d(2, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.emb = nn.Embedding(10, 4)
        self.register_buffer("mask", torch.ones(6))


class TiedNet(Net):
    """Net with a tied weight: head.weight IS emb.weight (one Parameter, one storage, under two
    names, as a language model ties its output projection to its input embedding). parameters()
    and named_parameters() list it once (as emb.weight); state_dict() lists it under both names,
    as two views of one storage. A peer that walks state_dict() averages it twice per update."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def optimizer_step(model, generator):
    """A noisy 'optimizer step': parameters move, BatchNorm updates its buffers, mask flips."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
        model.bn.train()
        model.bn(torch.randn(4, 3, 5, 5, generator=generator))
        model.mask.copy_((torch.rand(6, generator=generator) > 0.5).float())


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(out, scenario, make, update, peer_state, counters, steps, skip_steps=(), writes_model=False, seed=0,
        saved_state=None, saved_state_step=None, vetoed_steps=(), model=Net):
    """Drives one scenario and writes its files.

    make(model) -> ema; update(ema, model, step) calls the peer; peer_state(ema) -> dict name ->
    tensor; counters(ema) -> dict name -> int or float. saved_state(ema) -> the dict a user
    would torch.save to move the run to C++, written as state_KKKK.pt after step
    saved_state_step. model: the module class (Net, or TiedNet for a tied weight); the meta records
    tied.<name> = 1 for each name of a tensor that is also the model's tensor under another name."""
    folder = os.path.join(out, scenario)
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    model = model()
    tied = tied_names(model)
    buffers = {name for name, _ in model.named_buffers()}
    ema = make(model)
    first = {"source." + k: v for k, v in state(model).items()}
    first["called"] = torch.tensor(0)
    torch.save(first, os.path.join(folder, "step_0000.pt"))
    for step in range(1, steps + 1):
        optimizer_step(model, generator)
        record = {"source." + k: v for k, v in state(model).items()}
        called = step not in skip_steps
        if called:
            update(ema, model, step)
        record["called"] = torch.tensor(1 if called else 0)
        record["vetoed"] = torch.tensor(1 if step in vetoed_steps else 0)
        record.update({"peer." + k: v.detach().clone() for k, v in peer_state(ema).items()})
        record.update({"counter." + k: torch.tensor(v) for k, v in counters(ema).items()})
        if writes_model:
            record.update({"after." + k: v for k, v in state(model).items()})
        torch.save(record, os.path.join(folder, "step_%04d.pt" % step))
        if saved_state is not None and step == saved_state_step:
            torch.save(saved_state(ema), os.path.join(folder, "state_%04d.pt" % step))
    meta = {"steps": torch.tensor(steps), "seed": torch.tensor(seed)}
    meta.update({"buffer." + name: torch.tensor(1) for name in buffers})
    meta.update({"tied." + name: torch.tensor(1) for name in tied})
    torch.save(meta, os.path.join(folder, "meta.pt"))
    print("wrote", folder, steps, "steps")


def tied_names(model):
    """The names of state_dict() entries that share their storage with another entry."""
    by_storage = {}
    for name, t in model.state_dict().items():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    return sorted(n for names in by_storage.values() if len(names) > 1 for n in names)


def write_versions(out, packages):
    """OUT/versions.txt: 'name==version' of each package the generator drove, one a line, so that
    a recorded fixture can be checked against scripts/requirements-seed.txt (stale fixtures)."""
    from importlib.metadata import version
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "versions.txt"), "w") as f:
        for name in packages:
            f.write(f"{name}=={version(name).split('+')[0]}\n")
