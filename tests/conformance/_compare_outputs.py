"""Diffs a seed generator's live output with its committed fixture: drift is a failure.

Run as `python _compare_outputs.py LIVE FIXTURE` (cmake/emakit_run_conformance_script.cmake, with
the seed venv's Python, after the generator wrote LIVE and the fixture was unpacked to FIXTURE).
Both trees must hold the same files; each .pt file the same keys, and each tensor the same dtype,
shape and bits (compared as raw bytes, so NaN payloads and the sign of zero count too); any other
file the same bytes. Bitwise, not within ulps: the live run uses the pinned torch on the CPU with
the generator's seeds, as the recording did, so the same arithmetic in the same order gives the
same bits. A machine whose ATen picks another CPU kernel (its CPU capability, printed here and
recorded in the fixture's .txt) may legitimately round differently: the failure then names the
largest difference in ulps, and the fixture is regenerated with ./scripts/seed_fixtures.sh.
Exit status 0 when equal, 1 with every difference listed otherwise.
"""
import os
import sys

import torch


def files(root):
    out = set()
    for folder, _, names in os.walk(root):
        for name in names:
            out.add(os.path.relpath(os.path.join(folder, name), root))
    return out


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def ulps(a, b):
    """Largest |a - b| in ulps of the dtype at max(|a|, |b|) (floating tensors of one dtype)."""
    info = torch.finfo(a.dtype)
    a64, b64 = a.double(), b.double()
    m = torch.maximum(a64.abs(), b64.abs()).clamp_min(info.tiny)
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(m)))
    return ((a64 - b64).abs() / ulp).max().item()


def compare_nested(where, x, y, problems):
    """Compares two torch.load values (dicts, lists, tensors, plain values); returns the tensors compared."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        if x.dtype != y.dtype or x.shape != y.shape:
            problems.append(f"{where}: live {x.dtype} {tuple(x.shape)}, fixture {y.dtype} {tuple(y.shape)}")
        elif not torch.equal(raw(x), raw(y)):
            extra = f", up to {ulps(x, y):.3g} ulps" if x.is_floating_point() else ""
            problems.append(f"{where}: the bits differ{extra}")
        return 1
    if isinstance(x, dict) and isinstance(y, dict):
        if set(x) != set(y):
            problems.append(f"{where}: keys differ (live only {sorted(set(x) - set(y), key=str)}, "
                            f"fixture only {sorted(set(y) - set(x), key=str)})")
        return sum(compare_nested(f"{where} {k}", x[k], y[k], problems) for k in x if k in y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and type(x) is type(y):
        if len(x) != len(y):
            problems.append(f"{where}: {len(x)} items live, {len(y)} in the fixture")
        return sum(compare_nested(f"{where}[{i}]", a, b, problems) for i, (a, b) in enumerate(zip(x, y)))
    if type(x) is not type(y) or x != y:
        problems.append(f"{where}: live {x!r}, fixture {y!r}")
    return 0


def main(live, fixture):
    problems = []
    live_files, fixture_files = files(live), files(fixture)
    for name in sorted(live_files - fixture_files):
        problems.append(f"{name}: written by the live run, not in the fixture")
    for name in sorted(fixture_files - live_files):
        problems.append(f"{name}: in the fixture, not written by the live run")
    tensors = 0
    for name in sorted(live_files & fixture_files):
        a_path, b_path = os.path.join(live, name), os.path.join(fixture, name)
        if not name.endswith((".pt", ".ckpt")):
            if open(a_path, "rb").read() != open(b_path, "rb").read():
                problems.append(f"{name}: the bytes differ")
            continue
        # A record (a dict of tensors), a peer's state as a user saves it (state_KKKK.pt: nested
        # dicts, Python ints and floats) or a real Lightning checkpoint (.ckpt: nested dicts and
        # lists): compared by content, tensors bitwise, other values equal.
        a, b = torch.load(a_path, weights_only=True), torch.load(b_path, weights_only=True)
        tensors += compare_nested(name, a, b, problems)
    capability = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    print(f"compared {len(live_files & fixture_files)} files, {tensors} tensors of the live run with the fixture "
          f"(torch {torch.__version__}, ATen CPU capability {capability})")
    if tensors == 0:
        problems.append("no tensor was compared")
    for p in problems:
        print("DRIFT:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
