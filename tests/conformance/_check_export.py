"""Checks a file emakit exported for Python: torch.load(path, weights_only=True) reads it as a
plain dict, its tensors are bitwise the averages emakit held (an export is a copy), and the peer
itself loads it.

  python _check_export.py EXPORT REFERENCE PEER     (PEER: ema_pytorch | timm_v3 | averaged_model)

REFERENCE is a plain dict of peer.<name> entries: the averages emakit held when it exported
(written by test_interop.cpp; how close those are to the peer's own numbers is the replay's
check). The export must hold exactly those names. Exit 0 when every check passes."""
import sys

import torch

import _common

export, reference, peer = sys.argv[1:4]
data = torch.load(export, weights_only=True)
assert type(data) is dict, f"expected a plain dict, got {type(data)}"
# The reference is the test's own file (LibTorch's pickle_save tags the dict's types, which
# weights_only refuses); the export above is read with weights_only, as a user would.
ref = {k[5:]: v for k, v in torch.load(reference, weights_only=False).items() if k.startswith("peer.")}
prefix = {"ema_pytorch": "ema_model.", "timm_v3": "module.", "averaged_model": "module."}[peer]
held = {k[len(prefix):]: v for k, v in data.items() if k.startswith(prefix)}
assert held, "no tensors under " + prefix
assert set(held) == set(ref), f"the export holds {sorted(held)}, emakit held {sorted(ref)}"
for name, value in held.items():
    expected = ref[name]
    assert value.dtype == expected.dtype and value.shape == expected.shape, name
    assert torch.equal(value, expected), f"{name}: the export is not bitwise the average emakit held"

model = _common.Net()
if peer == "ema_pytorch":
    from ema_pytorch import EMA
    ema = EMA(model, include_online_model=False)
    missing, unexpected = ema.load_state_dict(data, strict=False)
    assert not unexpected, unexpected
    assert all("num_batches_tracked" in k for k in missing), missing  # integers: emakit holds none
    assert int(ema.step.item()) == int(data["step"].item()) and bool(ema.initted.item())
elif peer == "averaged_model":
    from torch.optim.swa_utils import AveragedModel
    avg = AveragedModel(model)
    avg.load_state_dict(data, strict=True)
    assert int(avg.n_averaged.item()) == int(data["n_averaged"].item())
else:
    from timm.utils.model_ema import ModelEmaV3
    ModelEmaV3(model).load_state_dict(data, strict=True)
print("ok:", export, "loads in Python as", peer, "with", len(held), "tensors")
