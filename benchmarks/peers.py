#!/usr/bin/env python3
"""The Python peers of emakit_bench_ema_update, on the same layouts, precisions and threads.

  python benchmarks/peers.py --layouts layouts.json --out peers.json [--device cpu|cuda]

Peers (decay 0.999, every call averages; the first call, made before timing, may copy):
  ema_pytorch          ema-pytorch EMA.update() (default: a lerp_ per tensor); copy:
                       copy_params_from_model_to_ema()
  ema_pytorch_foreach  the same with use_foreach=True (torch._foreach_lerp_)
  timm_v3              timm ModelEmaV3(foreach=True).update(model); copy: set(model)
  averaged_model       torch.optim.swa_utils.AveragedModel(multi_avg_fn=get_ema_multi_avg_fn)
                       .update_parameters(model); copy: the same call with n_averaged = 0
bf16 model, fp32 EMA: ema-pytorch with an fp32 ema_model and coerce_dtype=True, timm with
dtype=torch.float32; AveragedModel groups its tensors by dtype and cannot pair an fp32 average
with a bf16 model (recorded as unsupported).

group<K>/<layout>/<precision>/<peer>/threads:<n> (--groups 2,4): K EMAs of one model, as the
Python users who keep several run them:
  posthoc_ema          ema-pytorch PostHocEMA with K sigma_rels (update_every=1, no checkpoints):
                       its update() updates each KarrasEMA in turn (fp32 only: its ema_model holds
                       the model's dtype, and lerp_ cannot read bf16 into fp32)
  timm_v3              K timm ModelEmaV3(foreach=True), updated one after another

Each case is timed like Google Benchmark's real time: calls are repeated until --min-time seconds
have passed, --repetitions times; the JSON holds every repetition's time per call (seconds).
On CUDA every call is followed by torch.cuda.synchronize(), as in the C++ benchmark.
memory/<layout>/bf16/<peer>: the resident memory one update adds (VmHWM after it minus VmRSS
before, with /proc/self/clear_refs resetting the peak), as a fraction of model + EMA.
"""
import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

DECAY = 0.999
PEERS = ("ema_pytorch", "ema_pytorch_foreach", "timm_v3", "averaged_model")


def build_model(shapes, dtype, device):
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(s, device=device).to(dtype)) for s in shapes)
    return model


def make_peer(peer, model, precision):
    """Returns (average(), copy()) callables, or raises NotImplementedError."""
    fp32_ema = precision == "bf16"
    if peer.startswith("ema_pytorch"):
        from ema_pytorch import EMA
        kwargs = dict(beta=DECAY, update_after_step=0, update_every=1, include_online_model=False,
                      use_foreach=peer.endswith("foreach"))
        if fp32_ema:
            kwargs.update(ema_model=copy.deepcopy(model).float(), coerce_dtype=True)
        ema = EMA(model, **kwargs)
        ema.update()  # the first update copies
        return ema.update, ema.copy_params_from_model_to_ema
    if peer == "timm_v3":
        from timm.utils.model_ema import ModelEmaV3
        ema = ModelEmaV3(model, decay=DECAY, foreach=True, dtype=torch.float32 if fp32_ema else None)
        return (lambda: ema.update(model)), (lambda: ema.set(model))
    if peer == "averaged_model":
        avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
        if fp32_ema:
            avg.module.float()
        avg.update_parameters(model)  # the first update copies
        avg.update_parameters(model)  # and the second averages: raises here if it cannot

        def copy_():
            avg.n_averaged.zero_()
            avg.update_parameters(model)

        return (lambda: avg.update_parameters(model)), copy_
    raise ValueError(peer)


# ema-pytorch's default pair, and four profiles spread over the same range.
SIGMA_RELS = {2: (0.05, 0.28), 4: (0.05, 0.1, 0.2, 0.28)}
GROUP_PEERS = ("posthoc_ema", "timm_v3")


def make_group_peer(peer, model, precision, k, folder):
    """Returns update() of K EMAs of model, or raises NotImplementedError."""
    if peer == "posthoc_ema":
        if precision != "fp32":
            raise NotImplementedError("PostHocEMA keeps the model's dtype: no fp32 EMA of a bf16 model")
        if k not in SIGMA_RELS:
            raise NotImplementedError(f"PostHocEMA keeps 2 or more EMAs, not {k}")
        from ema_pytorch import PostHocEMA
        ema = PostHocEMA(model, sigma_rels=SIGMA_RELS[k], update_every=1, checkpoint_every_num_steps="manual",
                         checkpoint_folder=folder)
        ema.update()  # the first update copies
        return ema.update
    if peer == "timm_v3":
        from timm.utils.model_ema import ModelEmaV3
        emas = [ModelEmaV3(model, decay=(0.999, 0.9999, 0.99, 0.9)[i % 4], foreach=True,  # as the C++ group's
                           dtype=torch.float32 if precision == "bf16" else None) for i in range(k)]

        def update():
            for ema in emas:
                ema.update(model)

        return update
    raise ValueError(peer)


def measure(fn, sync, min_time, repetitions):
    def once():
        fn()
        sync()

    once()
    once()
    n, elapsed = 1, 0.0
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            once()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time or n >= 1 << 16:
            break
        n = max(n * 2, int(n * min_time / max(elapsed, 1e-9) * 1.1))
    times = []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        for _ in range(n):
            once()
        times.append((time.perf_counter() - t0) / n)
    return times, n


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def extra_rss(fn):
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = status_kib("VmRSS:")
    fn()
    return (status_kib("VmHWM:") - before) * 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", required=True, help="JSON from emakit_bench_ema_update --emakit_dump_layouts")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--names", default="many_small,large_16m,resnet50,large_64m,vit_b16,large_256m",
                    help="layouts to run, comma-separated")
    ap.add_argument("--threads", default="1,all")
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--groups", default="", help="K values of the group<K> cases, comma-separated (CPU)")
    ap.add_argument("--min-time", type=float, default=0.5)
    ap.add_argument("--repetitions", type=int, default=3)
    args = ap.parse_args()

    warnings.filterwarnings("ignore")
    layouts = json.load(open(args.layouts))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    all_threads = len(os.sched_getaffinity(0))
    threads = []
    for t in args.threads.split(","):
        n = all_threads if t == "all" else int(t)
        if n not in threads:
            threads.append(n)
    if cuda:
        threads = [all_threads]  # as the C++ benchmark: the thread count does not matter on the GPU
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("ema_pytorch", "timm"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - report whatever is missing
            versions[mod] = f"unavailable: {e}"
    if "unavailable" in str(versions.get("ema_pytorch")):
        try:
            from importlib.metadata import version
            versions["ema_pytorch"] = version("ema-pytorch")
        except Exception:  # noqa: BLE001
            pass
    out = {"context": {"device": args.device, "threads_all": all_threads, "versions": versions,
                       "min_time": args.min_time, "repetitions": args.repetitions},
           "results": [], "unsupported": [], "memory": []}
    torch.set_grad_enabled(False)
    for name in args.names.split(","):
        layout = layouts[name]
        shapes, params = layout["shapes"], layout["params"]
        for precision in ("fp32", "bf16"):
            torch.manual_seed(0)
            model = build_model(shapes, torch.float32 if precision == "fp32" else torch.bfloat16, device)
            src_bytes = 4 if precision == "fp32" else 2
            for peer in args.peers.split(","):
                try:
                    average, copy_ = make_peer(peer, model, precision)
                except Exception as e:  # noqa: BLE001 - an unsupported combination is a result
                    out["unsupported"].append({"peer": peer, "layout": name, "precision": precision,
                                               "error": f"{type(e).__name__}: {e}"[:300]})
                    print(f"  {peer} {name} {precision}: unsupported ({type(e).__name__})", flush=True)
                    continue
                if precision == "bf16" and not cuda:
                    extra = extra_rss(average)
                    if extra is not None:
                        out["memory"].append({"name": f"memory/{name}/bf16/{peer}", "extra_rss_bytes": extra,
                                              "model_plus_ema_bytes": params * (4 + src_bytes),
                                              "extra_rss_fraction": extra / (params * (4 + src_bytes))})
                for t in threads:
                    torch.set_num_threads(t)
                    for op, fn, per_elem in (("average", average, 8 + src_bytes), ("copy", copy_, 4 + src_bytes)):
                        times, n = measure(fn, sync, args.min_time, args.repetitions)
                        rec = {"name": f"{op}/{name}/{precision}/{peer}/threads:{t}", "time_s": statistics.median(times),
                               "times_s": times, "iterations": n, "bytes": params * per_elem, "params": params,
                               "tensors": len(shapes)}
                        out["results"].append(rec)
                        print(f"  {rec['name']}: {rec['time_s'] * 1e3:.3f} ms, "
                              f"{rec['bytes'] / rec['time_s'] / 1e9:.1f} GB/s", flush=True)
                del average, copy_
            for k in (int(g) for g in args.groups.split(",") if g and not cuda):
                for peer in GROUP_PEERS:
                    try:
                        update = make_group_peer(peer, model, precision, k,
                                                 os.path.join(os.path.dirname(os.path.abspath(args.out)), "posthoc-ckpt"))
                    except NotImplementedError as e:
                        out["unsupported"].append({"peer": f"{peer} x{k}", "layout": name, "precision": precision,
                                                   "error": str(e)})
                        continue
                    for t in threads:
                        torch.set_num_threads(t)
                        times, n = measure(update, sync, args.min_time, args.repetitions)
                        rec = {"name": f"group{k}/{name}/{precision}/{peer}/threads:{t}",
                               "time_s": statistics.median(times), "times_s": times, "iterations": n,
                               "bytes": params * (src_bytes + 8 * k), "params": params, "tensors": len(shapes)}
                        out["results"].append(rec)
                        print(f"  {rec['name']}: {rec['time_s'] * 1e3:.3f} ms", flush=True)
                    del update
            del model
            if cuda:
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
