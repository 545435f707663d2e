"""The Python side of test_interop.cpp's diffusers round trip (not a generator: the test runs it).

  python _diffusers_roundtrip.py save SCENARIO FOLDER
  python _diffusers_roundtrip.py load SCENARIO FOLDER

save: a diffusers EMAModel follows _common.Net through N noisy optimizer steps and is saved as a
user saves it, torch.save(ema.state_dict(), FOLDER/state.pt). FOLDER/trajectory.pt holds the model
(every tensor, parameters and buffers) after each later optimizer step k = N+1 .. N+M+P as
s<k>.<name>, the model at step N as s<N>.<name>, and order.<name> = the position of each parameter
in model.parameters() (what diffusers' shadow_params list follows). The same EMAModel then goes on
in Python alone for M + P steps: FOLDER/reference.pt holds its shadow params by name
(peer.<name>) and its optimization_step: the run that never left Python.

load: FOLDER/export.pt (emakit's export after it imported state.pt and went on M steps) is read
with torch.load(weights_only=True), checked to be the dict EMAModel.state_dict() returns (its keys,
each value's Python type), loaded with the real EMAModel.load_state_dict into a fresh EMAModel of
the same config, which goes on for P steps on the same trajectory: FOLDER/continued.pt, as
reference.pt. Exit 0 when every check passes."""
import os
import sys

import torch
from diffusers.training_utils import EMAModel

import _common

N, M, P = 10, 8, 7
SCENARIOS = {
    # The TF ramp (use_ema_warmup=False), with a floor and a delay; one frozen parameter, which
    # EMAModel copies instead of averaging.
    "ramp": dict(decay=0.99, min_decay=0.05, update_after_step=3, use_ema_warmup=False, frozen="emb.weight"),
    # The inverse-power warmup.
    "warmup": dict(decay=0.995, min_decay=0.0, update_after_step=2, use_ema_warmup=True, inv_gamma=1.5, power=0.75,
                   frozen=None),
    # _common.TiedNet: head.weight IS emb.weight, which model.parameters() (and so shadow_params)
    # lists once.
    "tied": dict(decay=0.99, min_decay=0.05, update_after_step=3, use_ema_warmup=False, frozen=None, tied=True),
}

mode, scenario, folder = sys.argv[1:4]
config = dict(SCENARIOS[scenario])
frozen = config.pop("frozen")
tied = config.pop("tied", False)


def make_model():
    torch.manual_seed(0)
    model = _common.TiedNet() if tied else _common.Net()
    if frozen is not None:
        model.get_parameter(frozen).requires_grad_(False)
    return model


def shadow_by_name(model, ema):
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(ema.shadow_params)
    return {"peer." + name: t.detach().clone() for name, t in zip(names, ema.shadow_params)}


def set_model(model, trajectory, step):
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(trajectory["s%d.%s" % (step, name)])


if mode == "save":
    model = make_model()
    generator = torch.Generator().manual_seed(1)
    ema = EMAModel(model.parameters(), **config)
    for _ in range(N):
        _common.optimizer_step(model, generator)
        ema.step(model.parameters())
    torch.save(ema.state_dict(), os.path.join(folder, "state.pt"))
    trajectory = {"order." + name: torch.tensor(i) for i, (name, _) in enumerate(model.named_parameters())}
    trajectory.update({"s%d.%s" % (N, k): v for k, v in _common.state(model).items()})
    for step in range(N + 1, N + M + P + 1):
        _common.optimizer_step(model, generator)
        trajectory.update({"s%d.%s" % (step, k): v for k, v in _common.state(model).items()})
        ema.step(model.parameters())
    torch.save(trajectory, os.path.join(folder, "trajectory.pt"))
    reference = shadow_by_name(model, ema)
    reference["optimization_step"] = torch.tensor(ema.optimization_step)
    torch.save(reference, os.path.join(folder, "reference.pt"))
    print("saved", scenario, "after", N, "steps; reference after", N + M + P)
elif mode == "load":
    data = torch.load(os.path.join(folder, "export.pt"), weights_only=True)
    assert type(data) is dict, f"expected a plain dict, got {type(data)}"
    types = {"decay": float, "min_decay": float, "optimization_step": int, "update_after_step": int,
             "use_ema_warmup": bool, "inv_gamma": float, "power": float, "shadow_params": list}
    assert set(data) == set(types), f"the export holds {sorted(data)}, EMAModel.state_dict() {sorted(types)}"
    for key, kind in types.items():
        assert type(data[key]) is kind, f"{key}: {type(data[key])}, EMAModel.state_dict() holds a {kind}"
    for key in ("decay", "min_decay", "update_after_step", "use_ema_warmup"):
        assert data[key] == config[key], f"{key}: {data[key]} in the export, {config[key]} in the run"
    if config["use_ema_warmup"]:
        assert data["inv_gamma"] == config["inv_gamma"] and data["power"] == config["power"]
    assert data["optimization_step"] == N + M, data["optimization_step"]
    trajectory = torch.load(os.path.join(folder, "trajectory.pt"), weights_only=True)
    model = make_model()
    set_model(model, trajectory, N + M)
    ema = EMAModel(model.parameters(), **config)
    ema.load_state_dict(data)
    assert ema.optimization_step == N + M
    for s, p in zip(ema.shadow_params, model.parameters()):
        assert s.dtype == p.dtype and s.shape == p.shape
    for step in range(N + M + 1, N + M + P + 1):
        set_model(model, trajectory, step)
        ema.step(model.parameters())
    continued = shadow_by_name(model, ema)
    continued["optimization_step"] = torch.tensor(ema.optimization_step)
    torch.save(continued, os.path.join(folder, "continued.pt"))
    print("loaded emakit's export at step", N + M, "and went on to", ema.optimization_step)
else:
    sys.exit(f"unknown mode {mode}")
