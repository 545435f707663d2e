"""Checks _peer_roundtrip.py without any C++ (run it after changing that script or its generators).

  <seed python> _peer_roundtrip_check.py [ROOT]

ROOT holds the generators' output folders luxonis_peer/, nvalchemi_peer/ and lightning_peer/ (as
`python <stem>.py ROOT/<stem>` writes them); without ROOT the committed fixtures
(fixtures/<stem>.tar.xz) are unpacked into a temporary folder and used.

For each peer it makes stand-in exports, in the formats _peer_roundtrip.py documents, from the
generator's own record of the peer's state after step F (the peer's saved state file at N, or
peer.* and counter.* of step_F.pt), runs _peer_roundtrip.py on them and requires
  - exit 0, loaded_from_export 1, and OUT's peer.* and counter.* equal to step L's, bit for bit
    (the same arithmetic on the same values as the generator's run): the largest difference is
    printed;
  - a stand-in whose one tensor is moved by 1e-3: exit 0, and OUT's peer.* differ from step L's
    (the exported values, not a fresh average, are what the peer continues);
  - corrupted exports (a missing key, a tensor of another shape or dtype, a counter of another
    type, a config the peer refuses, a step without a checkpoint, not a dict): a non-zero exit
    whose message names the fault.
Exit 0 when every case held, 1 naming the cases that did not."""
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

STEMS = {"luxonis_callback": ("luxonis_peer", "callback_state"), "nvalchemi_hook": ("nvalchemi_peer", "resume"),
         "lightning": ("lightning_peer", "roundtrip")}
failures = []


def record(folder, step):
    return torch.load(os.path.join(folder, "step_%04d.pt" % step), weights_only=True)


def run(peer, folder, export, from_step, work, name):
    path, out = os.path.join(work, name + ".export.pt"), os.path.join(work, name + ".out.pt")
    torch.save(export, path)
    proc = subprocess.run([sys.executable, SCRIPT, peer, folder, path, str(from_step), out],
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
    import nvalchemi_peer

    peer = "nvalchemi_hook"
    saved = torch.load(os.path.join(folder, "state_0008.pt"), weights_only=True)  # the user's file
    saved = {k: v for k, v in saved.items() if k != "model_key"}
    saved["averaged_model_state"] = dict(saved["averaged_model_state"])
    expect_equal(peer, folder, last, saved, 8, work, "nvalchemi_from_state_0008")
    at14 = record(folder, 14)
    export = dict(nvalchemi_peer.RESUME_CONFIG, num_updates=int(at14["counter.num_updates"]))
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


def main():
    with tempfile.TemporaryDirectory() as work:
        if len(sys.argv) > 2:
            sys.exit(f"usage: {sys.argv[0]} [ROOT]")
        if len(sys.argv) == 2:
            root = sys.argv[1]
        else:
            root = os.path.join(work, "fixtures")
            for stem, _ in STEMS.values():
                with tarfile.open(os.path.join(HERE, "fixtures", stem + ".tar.xz")) as tar:
                    tar.extractall(root, filter="data")
        cases = {"luxonis_callback": luxonis_cases, "nvalchemi_hook": nvalchemi_cases, "lightning": lightning_cases}
        for peer, (stem, scenario) in STEMS.items():
            folder = os.path.join(root, stem, scenario)
            last = int(torch.load(os.path.join(folder, "meta.pt"), weights_only=True)["steps"])
            cases[peer](folder, last, work)
        expect_failure("luxonis_callback", os.path.join(root, "luxonis_peer", "callback_state"), {}, 31, work,
                       "step_past_the_end", "outside the scenario's steps 1 .. 30")
    if failures:
        sys.exit("_peer_roundtrip_check.py: FAILED:\n  " + "\n  ".join(failures))
    print("_peer_roundtrip_check.py: every case held")


if __name__ == "__main__":
    main()
