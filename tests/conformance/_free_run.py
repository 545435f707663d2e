"""Shared by the free-running conformance generators (free_run_peer.py, free_run_seed_peer.py):
the synthetic source trajectory, the model, and the file format. C++: free_run.hpp.

Free-running: each peer runs a whole trajectory on its own, from the same start, and emakit runs
the same trajectory on its own through its preset; the averages are compared bitwise after each
recorded step (tests/conformance/test_free_running.cpp). Nothing is restarted from the peer's
state, so a difference of one rounding anywhere in the run shows at the end.

The model's tensors at step k are a function of (tensor number t, element i, k), computed with
integer arithmetic only, so that Python and C++ write the same bits without recording them:

  splitmix64(z): z = z + 0x9e3779b97f4a7c15; z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
                 z = (z ^ (z >> 27)) * 0x94d049bb133111eb; return z ^ (z >> 31)   (all mod 2^64)
  base  = (splitmix64((t << 20) | i) >> 41) - 2^22                (signed, 23 bits)
  noise = (splitmix64(((k + 1) << 32) | (t << 20) | i) >> 43) - 2^20   (signed, 21 bits)
  value = float32((base + noise) * 2^-24)    (|base + noise| < 2^23: exact in float32)

t numbers the model's state_dict() entries in their order (integer ones included: they keep their
number but are never written; they keep the value the model has), i the element in the flat
(row-major) tensor, k the step: k = 0 is the model the peer is made from, k >= 1 the model after
optimizer step k, when the peer's update is called. Every value lies in [-0.3125, 0.3125): its
element's fixed base plus a fresh offset in [-2^-4, 2^-4) at each step.

The model (FreeNet, the same in C++): a Linear(9, 4) (a weight of 36 elements: ATen's vectorized
loops run 32 of them as two AVX-512 or four AVX2 vectors and leave 4 to their scalar loop, so both
kinds of code are compared; the other tensors, of 4, are scalar loops only) and a BatchNorm1d(4)
(weight, bias, running_mean, running_var, and the integer num_batches_tracked, which no step
writes: it stays 0). No forward pass runs through it. Small, so that a recorded fixture of the seed
packages (every 10th step of 1011, eight runs) stays near 100 KB.

A scenario S writes OUT/S/trajectory.pt, a plain dict:
  steps            long [R]: the steps k recorded (ascending, the last one the run's last step)
  peer.<name>      the peer's average after its update at each recorded step, stacked: [R, *shape]
                   (every tensor the peer holds; the peer's dtype, integers included)
  counter.<c>      long or double [R]: the peer's counters at each recorded step (names per peer)
and OUT/S/meta.pt: total (the run's last step), every (the recording interval), and per peer the
options it ran with (opt.<name>, double). OUT/sources.pt holds the synthetic model at steps 0, 1
and TOTAL (source_<k>.<name>, and order.<name> = t), which C++ checks against its own function.

Every run is TOTAL = 1011 steps (DINO's 1000, its schedule's length): at least 1000 averaging
updates for every peer (a first update that copies, ema-pytorch's copies until update_after_step
= 10 has passed).

The seed fixture's staleness check (cmake/emakit_run_conformance_script.cmake) hashes the
generator and _common.py, not this file: a change here that moves the trajectory shows as
sources.pt differing from free_run.hpp in test_free_running.cpp, in both modes (regenerate the
fixture with ./scripts/seed_fixtures.sh free_run_seed_peer).
"""
import os

import torch
from torch import nn

MASK = (1 << 64) - 1
TOTAL = 1011


def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def synthetic_values(t, numel, k):
    """The numel values of tensor number t at step k, as a flat float32 tensor (exact)."""
    values = []
    for i in range(numel):
        base = (splitmix64((t << 20) | i) >> 41) - (1 << 22)
        noise = (splitmix64(((k + 1) << 32) | (t << 20) | i) >> 43) - (1 << 20)
        values.append((base + noise) * 2.0 ** -24)  # exact in double, and in float32
    return torch.tensor(values, dtype=torch.float64).to(torch.float32)


class FreeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(9, 4)
        self.bn = nn.BatchNorm1d(4)


class Trajectory:
    """The synthetic values of a module's floating state_dict() entries, step by step (cached: every
    scenario of a generator runs the same trajectory)."""

    def __init__(self, module):
        self.entries = [(t, name, tuple(v.shape)) for t, (name, v) in enumerate(module.state_dict().items())
                        if v.is_floating_point()]
        self.cache = {}

    def values(self, k):
        if k not in self.cache:
            self.cache[k] = {name: synthetic_values(t, int(torch.Size(shape).numel()), k).reshape(shape)
                             for t, name, shape in self.entries}
        return self.cache[k]

    @torch.no_grad()
    def write(self, module, k):
        """Writes step k's values into the module's floating state_dict() entries (in place)."""
        state = module.state_dict()
        for name, value in self.values(k).items():
            state[name].copy_(value)


def write_sources(out, module_class=FreeNet, steps=(0, 1, TOTAL)):
    """OUT/sources.pt: the synthetic model at some steps, and each entry's number t."""
    os.makedirs(out, exist_ok=True)
    module = module_class()
    trajectory = Trajectory(module)
    record = {"order." + name: torch.tensor(t) for t, name in enumerate(module.state_dict())}
    for k in steps:
        trajectory.write(module, k)
        record.update({f"source_{k}.{name}": v.detach().clone() for name, v in module.state_dict().items()})
    torch.save(record, os.path.join(out, "sources.pt"))


class Recording:
    """The recorded steps of one scenario, written as trajectory.pt and meta.pt (see the top)."""

    def __init__(self, out, scenario, total=TOTAL, every=1, options=None):
        self.folder = os.path.join(out, scenario)
        self.total, self.every, self.options = total, every, options or {}
        self.steps, self.stacks, self.counters = [], {}, {}

    def wants(self, k):
        return k % self.every == 0 or k == self.total

    def add(self, k, average, counters):
        assert self.wants(k) and (not self.steps or k > self.steps[-1])
        self.steps.append(k)
        for name, value in average.items():
            self.stacks.setdefault(name, []).append(value.detach().clone())
        for name, value in counters.items():
            self.counters.setdefault(name, []).append(value)

    def save(self):
        assert self.steps and self.steps[-1] == self.total, "the run's last step must be recorded"
        os.makedirs(self.folder, exist_ok=True)
        record = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        record.update({"peer." + name: torch.stack(values) for name, values in self.stacks.items()})
        for name, values in self.counters.items():
            dtype = torch.float64 if any(isinstance(v, float) for v in values) else torch.int64
            record["counter." + name] = torch.tensor(values, dtype=dtype)
        torch.save(record, os.path.join(self.folder, "trajectory.pt"))
        meta = {"total": torch.tensor(self.total), "every": torch.tensor(self.every)}
        meta.update({"opt." + name: torch.tensor(float(v), dtype=torch.float64) for name, v in self.options.items()})
        torch.save(meta, os.path.join(self.folder, "meta.pt"))
        print("wrote", self.folder, self.total, "steps,", len(self.steps), "recorded")


def run(out, scenario, make, update, average, counters=lambda peer: {}, total=TOTAL, every=1, options=None,
        module_class=FreeNet):
    """Drives one peer through the trajectory and writes its files.

    make(model) -> peer, made from the model at step 0; update(peer, model, k) the peer's update
    after step k's values were written; average(peer) -> dict name -> tensor, the peer's average;
    counters(peer) -> dict name -> int or float; options: what the scenario ran with (meta.pt's
    opt.<name>). Records the steps k with k % every == 0, and the last one."""
    recording = Recording(out, scenario, total, every, options)
    model = module_class()
    trajectory = Trajectory(model)
    trajectory.write(model, 0)
    peer = make(model)
    for k in range(1, total + 1):
        trajectory.write(model, k)
        update(peer, model, k)
        if recording.wants(k):
            recording.add(k, average(peer), counters(peer))
    recording.save()
