"""Runs a Python interop recipe of the docs exactly as the page shows it, with the real packages.

  python _doc_recipes.py PAGE RECIPE FOLDER

PAGE is a Markdown file (docs/coming-from-python.md); RECIPE names the ```python block that
follows the line `<!-- recipe: RECIPE -->` on that page. The block runs as it is written, in
FOLDER (its working folder, where "ema.pt" is), with `model` defined (_common.Net(), the
architecture of the C++ side's model: the page says "model: the same architecture").

  <peer>_load   the block loads the file emakit::export_state wrote (FOLDER/ema.pt) into the peer.
                Checked here: the peer then holds, bitwise, every tensor of the file under the
                peer's key, and the file's counters; a block that raises fails.
  <peer>_save   the block saves the peer's state (FOLDER/ema.pt), as a user would. The peer it
                saves is made here, under the name the page uses, and updated a few times; its
                averages and counters go to FOLDER/reference.pt (a plain dict: peer.<name>,
                counter.<name>) for the C++ test, which imports ema.pt and compares.

Exit 0 when the block ran and every check passed. Used by tests/conformance/test_interop.cpp.
"""
import os
import re
import sys

import torch

import _common

PEERS = {
    # peer: (variable the page uses, prefix of the file's keys, counters in the file)
    "ema_pytorch": ("ema", "ema_model.", ("step",)),
    "timm_v3": ("ema", "module.", ()),
    "averaged_model": ("averaged", "module.", ("n_averaged",)),
}
UPDATES = 15  # the saved peer's updates


def recipe(page, name):
    """The code of the ```python block after `<!-- recipe: name -->`, and its first line."""
    lines = open(page, encoding="utf-8").read().splitlines()
    marker = re.compile(r"^<!--\s*recipe:\s*(\S+)\s*-->\s*$")
    for i, line in enumerate(lines):
        m = marker.match(line)
        if not m or m.group(1) != name:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
            sys.exit(f"{page}:{i + 1}: the recipe '{name}' is not followed by a ```python block")
        end = i + 2
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            sys.exit(f"{page}:{i + 2}: the ```python block of '{name}' is never closed")
        return "\n".join(lines[i + 2:end]) + "\n", i + 3
    sys.exit(f"{page}: no recipe '{name}' (a line <!-- recipe: {name} --> before a ```python block)")


def inner(peer, obj):
    """The peer's averaged module."""
    return obj.ema_model if peer == "ema_pytorch" else obj.module


def counters(peer, obj):
    if peer == "ema_pytorch":
        return {"step": int(obj.step.item()), "initted": int(bool(obj.initted.item()))}
    if peer == "averaged_model":
        return {"n_averaged": int(obj.n_averaged.item())}
    return {}


def make_and_update(peer, model):
    """The peer as the C++ test's EMA is made (same options), updated UPDATES times."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if peer == "ema_pytorch":
        from ema_pytorch import EMA
        obj = EMA(model)
        update = lambda step: obj.update()
    elif peer == "timm_v3":
        from timm.utils.model_ema import ModelEmaV3
        obj = ModelEmaV3(model)
        update = lambda step: obj.update(model, step=step)
    else:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
        obj = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.95))
        update = lambda step: obj.update_parameters(model)
    for step in range(1, UPDATES + 1):
        _common.optimizer_step(model, generator)
        update(step)
    return obj


def main():
    page, name, folder = sys.argv[1:4]
    page = os.path.abspath(page)
    peer, direction = name.rsplit("_", 1)
    variable, prefix, counter_names = PEERS[peer]
    code, first_line = recipe(page, name)
    os.chdir(folder)
    model = _common.Net()
    namespace = {"__name__": "__recipe__", "model": model}
    if direction == "save":
        namespace[variable] = make_and_update(peer, model)
    # Line numbers of a traceback point at the page.
    exec(compile("\n" * (first_line - 1) + code, page, "exec"), namespace)

    if direction == "save":
        obj = namespace[variable]
        reference = {"peer." + k: v.detach().clone() for k, v in inner(peer, obj).state_dict().items()}
        reference.update({"counter." + k: torch.tensor(v) for k, v in counters(peer, obj).items()})
        torch.save(reference, "reference.pt")
        assert os.path.isfile("ema.pt"), f"the recipe '{name}' wrote no ema.pt"
        print(f"ok: {name} saved ema.pt; reference.pt holds {len(reference)} entries")
        return

    if variable not in namespace:
        sys.exit(f"the recipe '{name}' made no '{variable}'")
    obj = namespace[variable]
    data = torch.load("ema.pt", weights_only=True)
    held = inner(peer, obj).state_dict()
    compared = 0
    for key, value in data.items():
        if key.startswith(prefix):
            name_in_module = key[len(prefix):]
            assert name_in_module in held, f"{key}: the peer has no {name_in_module}"
            assert torch.equal(held[name_in_module], value), f"{key}: the peer does not hold the file's value"
            compared += 1
    assert compared > 0, "no tensor under " + prefix
    now = counters(peer, obj)
    for c in counter_names:
        assert now[c] == int(data[c].item()), f"{c}: the peer has {now[c]}, the file {int(data[c].item())}"
    print(f"ok: {name} loaded ema.pt: {compared} tensors bitwise, counters {sorted(counter_names)}")


if __name__ == "__main__":
    main()
