"""Checks _peer_roundtrip.py without any C++ (run it after changing that script or its generators).

  <python> _peer_roundtrip_check.py [--seed-python PY] [--first-python PY] [--peers P,P,...] [ROOT]

  --seed-python PY   the Python that runs _peer_roundtrip.py for the seed peers (luxonis_callback,
                     lightning, nvalchemi_hook): the seed venv's. Default: the Python running this.
  --first-python PY  the Python that runs _peer_roundtrip.py for the first venv's peers
                     (ema_pytorch, timm_v3, averaged_model) and, without ROOT, their generators:
                     the first venv's. Default: the Python running this.
  --peers P,P,...    only these peers (default: all six).
  ROOT               holds the generators' output folders (luxonis_peer/, nvalchemi_peer/,
                     lightning_peer/, ema_pytorch_peer/, averaged_model_peer/, timm_peer/, as
                     `python <stem>.py ROOT/<stem>` writes them). Without ROOT the seed peers use
                     the committed fixtures (fixtures/<stem>.tar.xz, unpacked into a temporary
                     folder) and the first venv's generators are run with --first-python into it.

This script itself needs only torch (any of the two venvs): it imports no peer package. A seed
run and a first-venv run together, e.g. from the repository root:

  ~/.cache/emakit/seed-venv/bin/python tests/conformance/_peer_roundtrip_check.py \
      --first-python ~/.cache/emakit/venv/bin/python

For each peer it makes stand-in exports, in the formats _peer_roundtrip.py documents, from the
generator's own record of the peer's state after step F (the peer's saved state file at N, or
peer.* and counter.* of step_F.pt), runs _peer_roundtrip.py on them and requires
  - exit 0, loaded_from_export 1, and OUT's peer.* and counter.* equal to step L's, bit for bit
    (the same arithmetic on the same values as the generator's run): the largest difference is
    printed;
  - a stand-in whose one tensor is moved by 1e-3: exit 0, and OUT's peer.* differ from step L's
    (the exported values, not a fresh average, are what the peer continues);
  - corrupted exports (a missing key or counter, a tensor of another shape or dtype, a counter of
    another type or value, a config the peer refuses, a step without a checkpoint, not a dict, an
    unknown scenario, a step past the end): a non-zero exit whose message names the fault.
Exit 0 when every case held, 1 naming the cases that did not."""
import argparse
import copy
import os
import subprocess
import sys
import tarfile
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_peer_roundtrip.py")
sys.path.insert(0, HERE)
import _peer_roundtrip  # noqa: E402 (raw, prefixed: the same helpers)

SEED_STEMS = {"luxonis_callback": ("luxonis_peer", "callback_state"), "nvalchemi_hook": ("nvalchemi_peer", "resume"),
              "lightning": ("lightning_peer", "roundtrip")}
FIRST_STEMS = {"ema_pytorch": ("ema_pytorch_peer", "defaults_with_skips"),
               "averaged_model": ("averaged_model_peer", "ema_no_buffers"),
               "timm_v3": ("timm_peer", "warmup_with_step")}
PYTHON = {}  # peer -> the Python that runs _peer_roundtrip.py for it (main sets it)
failures = []


def record(folder, step):
    return torch.load(os.path.join(folder, "step_%04d.pt" % step), weights_only=True)


def run(peer, folder, export, from_step, work, name):
    path, out = os.path.join(work, name + ".export.pt"), os.path.join(work, name + ".out.pt")
    torch.save(export, path)
    proc = subprocess.run([PYTHON[peer], SCRIPT, peer, folder, path, str(from_step), out],
                          capture_output=True, text=True)
    return proc, out


def max_difference(a, b):
    if a.dtype.is_floating_point:
        return (a.double() - b.double()).abs().max().item()
    return (a.long() - b.long()).abs().max().item()


def expect_equal(peer, folder, last, export, from_step, work, name):
    proc, out = run(peer, folder, export, from_step, work, name)
    if proc.returncode != 0:
        failures.append(f"{name}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        return
    got, want = torch.load(out, weights_only=True), record(folder, last)
    want = {k: v for k, v in want.items() if k.startswith(("peer.", "counter."))}
    keys = set(got) - {"loaded_from_export"}
    if keys != set(want):
        failures.append(f"{name}: OUT's keys {sorted(keys ^ set(want))} differ from step {last}'s")
        return
    if int(got["loaded_from_export"]) != 1:
        failures.append(f"{name}: loaded_from_export is {int(got['loaded_from_export'])}")
    worst = max(max_difference(got[k], want[k]) for k in want)
    unequal = sorted(k for k in want if not _peer_roundtrip.same_bits(got[k], want[k]))
    if unequal:
        failures.append(f"{name}: {unequal} differ from step {last}'s (max |difference| {worst:.3g})")
    print(f"ok   {name}: F = {from_step}, L = {last}: OUT equals step {last}'s {len(want)} entries bitwise "
          f"(max |difference| {worst:.3g})")


def expect_moved(peer, folder, last, export, from_step, work, name):
    proc, out = run(peer, folder, export, from_step, work, name)
    if proc.returncode != 0:
        failures.append(f"{name}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
        return
    got, want = torch.load(out, weights_only=True), record(folder, last)
    peers = [k for k in want if k.startswith("peer.")]
    worst = max(max_difference(got[k], want[k]) for k in peers)
    if worst == 0:
        failures.append(f"{name}: a moved export gave step {last}'s average exactly: the export was not used")
    else:
        print(f"ok   {name}: a tensor moved by 1e-3 at F = {from_step} leaves a difference {worst:.3g} at L")


def expect_failure(peer, folder, export, from_step, work, name, fragment):
    proc, _ = run(peer, folder, export, from_step, work, name)
    message = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    if proc.returncode == 0:
        failures.append(f"{name}: exit 0 for a corrupted export")
    elif fragment not in message:
        failures.append(f"{name}: exit {proc.returncode}, but the message does not name {fragment!r}: {message}")
    else:
        print(f"ok   {name}: exit {proc.returncode}: {message}")


def moved(tensors, name):
    out = dict(tensors)
    out[name] = tensors[name] + 1e-3
    return out


def luxonis_cases(folder, last, work):
    peer = "luxonis_callback"
    saved = torch.load(os.path.join(folder, "state_0015.pt"), weights_only=True)
    expect_equal(peer, folder, last, saved, 15, work, "luxonis_from_state_0015")
    at22 = record(folder, 22)
    export = {"ema_state_dict": _peer_roundtrip.prefixed(at22, "peer."), "updates": int(at22["counter.updates"])}
    expect_equal(peer, folder, last, export, 22, work, "luxonis_from_step_0022")
    expect_moved(peer, folder, last, export | {"ema_state_dict": moved(export["ema_state_dict"], "lin.weight")}, 22,
                 work, "luxonis_moved")
    expect_failure(peer, folder, {"ema_state_dict": export["ema_state_dict"]}, 22, work, "luxonis_missing_updates",
                   "missing keys ['updates']")
    expect_failure(peer, folder, export | {"updates": float(export["updates"])}, 22, work, "luxonis_float_updates",
                   "updates is a float")
    bad = dict(export["ema_state_dict"])
    bad["lin.weight"] = bad["lin.weight"].t().contiguous()
    expect_failure(peer, folder, export | {"ema_state_dict": bad}, 22, work, "luxonis_wrong_shape", "lin.weight")
    bad = dict(export["ema_state_dict"])
    del bad["bn.running_var"]
    expect_failure(peer, folder, export | {"ema_state_dict": bad}, 22, work, "luxonis_missing_tensor",
                   "missing keys ['bn.running_var']")
    bad = dict(export["ema_state_dict"])
    bad["emb.weight"] = bad["emb.weight"].double()
    expect_failure(peer, folder, export | {"ema_state_dict": bad}, 22, work, "luxonis_wrong_dtype", "torch.float64")
    expect_failure(peer, folder, [export], 22, work, "luxonis_not_a_dict", "the export is a list")


def nvalchemi_cases(folder, last, work):
    peer = "nvalchemi_hook"
    saved = torch.load(os.path.join(folder, "state_0008.pt"), weights_only=True)  # the user's file
    saved = {k: v for k, v in saved.items() if k != "model_key"}
    saved["averaged_model_state"] = dict(saved["averaged_model_state"])
    expect_equal(peer, folder, last, saved, 8, work, "nvalchemi_from_state_0008")
    at14 = record(folder, 14)
    # The hook's config as its own saved state holds it (nvalchemi_peer.RESUME_CONFIG: that module
    # imports nvalchemi, which only the seed venv has; this script runs in either venv).
    config = {k: saved[k] for k in ("decay", "update_every", "start_step", "use_buffers")}
    export = dict(config, num_updates=int(at14["counter.num_updates"]))
    export["averaged_model_state"] = {"module." + k: v for k, v in _peer_roundtrip.prefixed(at14, "peer.").items()}
    export["averaged_model_state"]["n_averaged"] = at14["counter.n_averaged"].long()
    expect_equal(peer, folder, last, export, 14, work, "nvalchemi_from_step_0014")
    expect_moved(peer, folder, last, export | {"averaged_model_state": moved(export["averaged_model_state"],
                                                                               "module.conv.weight")},
                 14, work, "nvalchemi_moved")
    expect_failure(peer, folder, {k: v for k, v in export.items() if k != "num_updates"}, 14, work,
                   "nvalchemi_missing_num_updates", "missing keys ['num_updates']")
    bad = dict(export["averaged_model_state"])
    del bad["n_averaged"]
    expect_failure(peer, folder, export | {"averaged_model_state": bad}, 14, work, "nvalchemi_missing_n_averaged",
                   "missing keys ['n_averaged']")
    bad = dict(export["averaged_model_state"])
    bad["module.lin.bias"] = bad["module.lin.bias"][:3].clone()
    expect_failure(peer, folder, export | {"averaged_model_state": bad}, 14, work, "nvalchemi_wrong_shape",
                   "module.lin.bias")
    expect_failure(peer, folder, export | {"decay": 0.9}, 14, work, "nvalchemi_other_decay",
                   "EMAHook.load_state_dict refused")
    expect_failure(peer, folder, export | {"use_buffers": 0}, 14, work, "nvalchemi_int_use_buffers",
                   "use_buffers is an int")
    expect_failure(peer, folder, export | {"model_key": "main"}, 14, work, "nvalchemi_extra_key",
                   "extra keys ['model_key']")


def lightning_cases(folder, last, work):
    peer = "lightning"

    def standin(step):
        at = record(folder, step)
        return {"state_dict": _peer_roundtrip.prefixed(at, "peer."),
                "averaging_state": {"n_averaged": at["counter.n_averaged"].clone()},
                "callbacks": {"EMAWeightAveraging": {"latest_update_step": int(at["counter.latest_update_step"])}},
                "global_step": int(at["counter.global_step"])}

    export = standin(14)
    expect_equal(peer, folder, last, export, 14, work, "lightning_from_step_0014")
    expect_equal(peer, folder, last, standin(7), 7, work, "lightning_from_step_0007")
    expect_moved(peer, folder, last, export | {"state_dict": moved(export["state_dict"], "emb.weight")}, 14, work,
                 "lightning_moved")
    expect_failure(peer, folder, {k: v for k, v in export.items() if k != "averaging_state"}, 14, work,
                   "lightning_missing_averaging_state", "missing keys ['averaging_state']")
    bad = dict(export["state_dict"])
    bad["conv.weight"] = bad["conv.weight"].reshape(3, 2, 9).clone()
    expect_failure(peer, folder, export | {"state_dict": bad}, 14, work, "lightning_wrong_shape", "conv.weight")
    expect_failure(peer, folder, export | {"averaging_state": {"n_averaged": torch.tensor(5.0)}}, 14, work,
                   "lightning_float_n_averaged", "n_averaged")
    expect_failure(peer, folder, export | {"global_step": 13}, 14, work, "lightning_other_global_step",
                   "global_step is 13")
    bad = copy.deepcopy(export)
    bad["callbacks"] = {"EMAWeightAveraging": {"latest_update_step": torch.tensor(13)}}
    expect_failure(peer, folder, bad, 14, work, "lightning_tensor_latest_update_step", "latest_update_step is a Tensor")
    expect_failure(peer, folder, standin(10), 10, work, "lightning_no_checkpoint_at_10", "at global_step 10")


def without(d, key):
    return {k: v for k, v in d.items() if k != key}


def replaced(d, key, value):
    return d | {key: value}


def ema_pytorch_cases(folder, last, work):
    peer = "ema_pytorch"

    def standin(step):
        at = record(folder, step)
        tensors = {"ema_model." + k: v for k, v in _peer_roundtrip.prefixed(at, "peer.").items()
                   if v.is_floating_point()}  # emakit leaves out the integer buffers
        return tensors | {"step": at["counter.step"].long(), "initted": at["counter.initted"].bool()}

    saved = torch.load(os.path.join(folder, "state_0120.pt"), weights_only=True)  # the user's file
    expect_failure(peer, folder, saved, 120, work, "ema_pytorch_saved_with_integer_buffer",
                   "extra keys ['ema_model.bn.num_batches_tracked']")
    saved = {k: v for k, v in saved.items() if not (k.startswith("ema_model.") and not v.is_floating_point())}
    expect_equal(peer, folder, last, saved, 120, work, "ema_pytorch_from_state_0120")
    expect_equal(peer, folder, last, standin(55), 55, work, "ema_pytorch_from_step_0055")  # skipped, copy phase
    export = standin(140)
    expect_equal(peer, folder, last, export, 140, work, "ema_pytorch_from_step_0140")
    expect_moved(peer, folder, last, moved(export, "ema_model.lin.weight"), 140, work, "ema_pytorch_moved")
    expect_failure(peer, folder, without(export, "ema_model.bn.running_var"), 140, work, "ema_pytorch_missing_tensor",
                   "missing keys ['ema_model.bn.running_var']")
    expect_failure(peer, folder, without(export, "step"), 140, work, "ema_pytorch_missing_step",
                   "missing keys ['step']")
    expect_failure(peer, folder, without(export, "initted"), 140, work, "ema_pytorch_missing_initted",
                   "missing keys ['initted']")
    expect_failure(peer, folder, replaced(export, "ema_model.lin.weight", export["ema_model.lin.weight"].t().clone()),
                   140, work, "ema_pytorch_wrong_shape", "ema_model.lin.weight")
    expect_failure(peer, folder, replaced(export, "ema_model.emb.weight", export["ema_model.emb.weight"].double()),
                   140, work, "ema_pytorch_wrong_dtype", "torch.float64")
    expect_failure(peer, folder, replaced(export, "step", export["step"].int()), 140, work, "ema_pytorch_int32_step",
                   "the export['step'] is torch.int32")
    expect_failure(peer, folder, replaced(export, "initted", export["initted"].long()), 140, work,
                   "ema_pytorch_long_initted", "the export['initted'] is torch.int64")
    expect_failure(peer, folder, replaced(export, "step", int(export["step"])), 140, work,
                   "ema_pytorch_python_int_step", "the export['step'] is an int, not a tensor")
    expect_failure(peer, folder, replaced(export, "step", export["step"] + 1), 140, work, "ema_pytorch_other_step",
                   f"the export's step is {int(export['step']) + 1}")
    expect_failure(peer, folder, export, last + 1, work, "ema_pytorch_step_past_the_end",
                   f"outside the scenario's steps 1 .. {last}")
    other = os.path.join(os.path.dirname(folder), "names_and_warmup")
    if os.path.isdir(other):
        expect_failure(peer, other, export, 30, work, "ema_pytorch_unknown_scenario",
                       "unknown scenario 'names_and_warmup'")


def averaged_model_cases(folder, last, work):
    peer = "averaged_model"

    def standin(step):
        at = record(folder, step)
        tensors = {"module." + k: v for k, v in _peer_roundtrip.prefixed(at, "peer.").items()}
        return tensors | {"n_averaged": at["counter.n_averaged"].long()}

    saved = torch.load(os.path.join(folder, "state_0012.pt"), weights_only=True)  # the user's file
    expect_equal(peer, folder, last, saved, 12, work, "averaged_model_from_state_0012")
    expect_equal(peer, folder, last, standin(4), 4, work, "averaged_model_from_step_0004")  # a skipped step
    export = standin(20)
    expect_equal(peer, folder, last, export, 20, work, "averaged_model_from_step_0020")
    expect_moved(peer, folder, last, moved(export, "module.conv.weight"), 20, work, "averaged_model_moved")
    expect_failure(peer, folder, without(export, "module.bn.num_batches_tracked"), 20, work,
                   "averaged_model_missing_tensor", "missing keys ['module.bn.num_batches_tracked']")
    expect_failure(peer, folder, without(export, "n_averaged"), 20, work, "averaged_model_missing_n_averaged",
                   "missing keys ['n_averaged']")
    expect_failure(peer, folder, replaced(export, "module.lin.bias", export["module.lin.bias"][:3].clone()), 20, work,
                   "averaged_model_wrong_shape", "module.lin.bias")
    expect_failure(peer, folder, replaced(export, "module.mask", export["module.mask"].half()), 20, work,
                   "averaged_model_wrong_dtype", "torch.float16")
    expect_failure(peer, folder, replaced(export, "n_averaged", export["n_averaged"].float()), 20, work,
                   "averaged_model_float_n_averaged", "the export['n_averaged'] is torch.float32")
    expect_failure(peer, folder, replaced(export, "n_averaged", export["n_averaged"] - 1), 20, work,
                   "averaged_model_other_n_averaged", f"the export's n_averaged is {int(export['n_averaged']) - 1}")
    expect_failure(peer, folder, export | {"module.extra": torch.zeros(2)}, 20, work, "averaged_model_extra_key",
                   "extra keys ['module.extra']")


def timm_v3_cases(folder, last, work):
    peer = "timm_v3"

    def standin(step):
        return {"module." + k: v for k, v in _peer_roundtrip.prefixed(record(folder, step), "peer.").items()}

    saved = torch.load(os.path.join(folder, "state_0025.pt"), weights_only=True)  # the user's file
    expect_equal(peer, folder, last, saved, 25, work, "timm_v3_from_state_0025")
    expect_equal(peer, folder, last, standin(2), 2, work, "timm_v3_from_step_0002")  # before update_after_step
    export = standin(32)
    expect_equal(peer, folder, last, export, 32, work, "timm_v3_from_step_0032")
    expect_moved(peer, folder, last, moved(export, "module.emb.weight"), 32, work, "timm_v3_moved")
    expect_failure(peer, folder, without(export, "module.conv.bias"), 32, work, "timm_v3_missing_tensor",
                   "missing keys ['module.conv.bias']")
    expect_failure(peer, folder, replaced(export, "module.conv.weight", export["module.conv.weight"].reshape(3, 2, 9)),
                   32, work, "timm_v3_wrong_shape", "module.conv.weight")
    expect_failure(peer, folder, replaced(export, "module.bn.num_batches_tracked",
                                          export["module.bn.num_batches_tracked"].int()), 32, work,
                   "timm_v3_wrong_dtype", "torch.int32")
    # ModelEmaV3 holds no counter (its caller passes the step): one in the export is an error.
    expect_failure(peer, folder, export | {"step": torch.tensor(32)}, 32, work, "timm_v3_extra_counter",
                   "extra keys ['step']")
    expect_failure(peer, folder, [export], 32, work, "timm_v3_not_a_dict", "the export is a list")


def generate(python, stem, out):
    """Runs the first venv's generator `stem` into out/<stem> with `python`."""
    proc = subprocess.run([python, os.path.join(HERE, stem + ".py"), os.path.join(out, stem)], cwd=HERE,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"_peer_roundtrip_check.py: {python} {stem}.py failed (exit {proc.returncode}):\n{proc.stderr}")


def main():
    parser = argparse.ArgumentParser(description="Checks _peer_roundtrip.py on stand-in exports (no C++).")
    parser.add_argument("--seed-python", default=sys.executable, help="runs the seed peers (default: this Python)")
    parser.add_argument("--first-python", default=sys.executable,
                        help="runs the first venv's peers and their generators (default: this Python)")
    parser.add_argument("--peers", default=",".join(list(SEED_STEMS) + list(FIRST_STEMS)),
                        help="comma-separated peers (default: all)")
    parser.add_argument("root", nargs="?", help="the generators' output folders (default: fixtures and fresh runs)")
    args = parser.parse_args()
    peers = args.peers.split(",")
    unknown = sorted(set(peers) - set(SEED_STEMS) - set(FIRST_STEMS))
    if unknown or not peers:
        sys.exit(f"_peer_roundtrip_check.py: unknown peers {unknown} (known: {list(SEED_STEMS) + list(FIRST_STEMS)})")
    for python in (args.seed_python, args.first_python):
        if not (os.path.isfile(python) and os.access(python, os.X_OK)):
            sys.exit(f"_peer_roundtrip_check.py: {python} is not an executable file")
    PYTHON.update({peer: args.seed_python for peer in SEED_STEMS} | {peer: args.first_python for peer in FIRST_STEMS})
    stems = SEED_STEMS | FIRST_STEMS
    cases = {"luxonis_callback": luxonis_cases, "nvalchemi_hook": nvalchemi_cases, "lightning": lightning_cases,
             "ema_pytorch": ema_pytorch_cases, "averaged_model": averaged_model_cases, "timm_v3": timm_v3_cases}
    with tempfile.TemporaryDirectory() as work:
        if args.root is not None:
            root = args.root
        else:
            root = os.path.join(work, "data")
            for peer in peers:
                stem = stems[peer][0]
                if peer in SEED_STEMS:
                    with tarfile.open(os.path.join(HERE, "fixtures", stem + ".tar.xz")) as tar:
                        tar.extractall(root, filter="data")
                else:
                    generate(args.first_python, stem, root)
        for peer in peers:
            stem, scenario = stems[peer]
            folder = os.path.join(root, stem, scenario)
            last = int(torch.load(os.path.join(folder, "meta.pt"), weights_only=True)["steps"])
            print(f"---- {peer} ({PYTHON[peer]}, {folder})")
            cases[peer](folder, last, work)
        if "luxonis_callback" in peers:
            expect_failure("luxonis_callback", os.path.join(root, "luxonis_peer", "callback_state"), {}, 31, work,
                           "step_past_the_end", "outside the scenario's steps 1 .. 30")
    if failures:
        sys.exit("_peer_roundtrip_check.py: FAILED:\n  " + "\n  ".join(failures))
    print("_peer_roundtrip_check.py: every case held")


if __name__ == "__main__":
    main()
