#!/usr/bin/env python3
"""Tables and a plot from one benchmark run: emakit_bench_ema_update's Google Benchmark JSON (any
number of files per LibTorch build, e.g. one per round and layout; files are grouped by the
LibTorch version they name) and benchmarks/peers.py's JSON (likewise).

  python benchmarks/report.py --cpp build/bench/torch1.13-*.json build/bench/torch2-*.json \
      --peers build/bench/peers-*.json --out-md results.md --out-png results.png [--machine TEXT]

Every time is the median over all repetitions of all rounds. Ratios compare results of this one run:
"of roofline" is emakit's throughput over the plain fused loop's on the same buffers in the same
process; "a peer / emakit" is the peer's time per update over emakit's (above 1: emakit is faster).
"""
import argparse
import json
import re
import sys

PEERS = [("ema_pytorch", "ema-pytorch"), ("ema_pytorch_foreach", "ema-pytorch foreach"),
         ("timm_v3", "timm ModelEmaV3"), ("averaged_model", "AveragedModel")]
# The Python peers keeping K EMAs of one model (peers.py --groups).
GROUP_PEERS = [("posthoc_ema", "PostHocEMA"), ("timm_v3", "K × timm ModelEmaV3")]
LARGE = ("large_16m", "resnet50", "large_64m", "vit_b16", "large_256m", "llm1b")
SMALL = ("many_small",)


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])


def load_cpp(paths):
    """{(op, layout, precision, impl, threads): record} over one LibTorch build's rounds (every
    repetition of every file; the time is their median), its version and context."""
    samples, meta, memory, ctx = {}, {}, {}, {}
    for path in paths:
        data = json.load(open(path))
        ctx = data.get("context", ctx)
        for b in data["benchmarks"]:
            if b.get("error_occurred") or b.get("run_type") == "aggregate":
                continue
            name = re.sub(r"/(real_time|manual_time|iterations:\d+|repeats:\d+)", "", b.get("run_name", b["name"]))
            parts = name.split("/")
            scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
            if parts[0] == "memory":
                key = (parts[1], parts[3])
                memory[key] = max(memory.get(key, 0.0), b.get("extra_rss_fraction", 0.0))
                continue
            key = ("step", parts[1], parts[2], parts[3], 0) if parts[0] == "step" else \
                (parts[0], parts[1], parts[2], parts[3], int(parts[4].split(":")[1]))
            samples.setdefault(key, []).append(b["real_time"] * scale)
            meta[key] = {"bytes": b.get("bytes"), "params": b.get("params"), "tensors": b.get("tensors")}
            if "drift_off_seconds" in b:  # emakit_drift: the same EMA's updates that did not measure it
                off_key = key[:3] + ("emakit_drift_off",) + key[4:]
                samples.setdefault(off_key, []).append(b["drift_off_seconds"])
                meta[off_key] = meta[key]
    runs = {}
    for key, times in samples.items():
        rec = {"time_s": median(times), "samples": len(times)}
        if key[0] != "step":
            rec.update(meta[key])
        runs[key] = rec
    add_rooflines(runs)
    return ctx.get("libtorch", "?"), ctx, runs, memory


def add_rooflines(runs):
    """The CPU roofline of a row is the fastest way anything moves its bytes on the same buffers:
    the plain loop of each instruction set (roofline_<isa>) and ATen's own ops (aten_lerp,
    aten_foreach, aten_copy; group rows: the plain loops only). Stored as the row's "roofline"
    with "set_by" naming the winner, so that no competitor can beat the limit. CUDA rows keep
    their measured "roofline" (a device-to-device copy)."""
    best = {}
    for (op, layout, precision, impl, threads), rec in runs.items():
        if op == "step" or not (impl.startswith("roofline_") or (impl.startswith("aten_") and impl != "aten_mul_add")):
            continue
        key = (op, layout, precision, "roofline", threads)
        if key not in best or rec["time_s"] < best[key]["time_s"]:
            best[key] = dict(rec, set_by=impl.removeprefix("roofline_").replace("aten_", "ATen "))
    for key, rec in best.items():
        runs.setdefault(key, rec)


def of_roofline(e, r):
    """emakit's share of the roofline, naming what set it: "97% (avx512)"."""
    if not (e and r):
        return "n/a"
    return f"{r['time_s'] / e['time_s']:.0%}" + (f" ({r['set_by']})" if "set_by" in r else "")


def load_peers(paths):
    samples, meta, memory, unsupported, ctx = {}, {}, {}, [], {}
    for path in paths:
        data = json.load(open(path))
        ctx = data["context"]
        for r in data["results"]:
            op, layout, precision, impl, threads = r["name"].split("/")
            key = (op, layout, precision, impl, int(threads.split(":")[1]))
            samples.setdefault(key, []).extend(r["times_s"])
            meta[key] = r
        for m in data.get("memory", []):
            _, layout, _, peer = m["name"].split("/")
            memory[(layout, peer)] = max(memory.get((layout, peer), 0.0), m["extra_rss_fraction"])
        unsupported += data.get("unsupported", [])
    runs = {k: dict(meta[k], time_s=median(v), samples=len(v)) for k, v in samples.items()}
    return ctx, runs, memory, unsupported


def fmt_time(s):
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def fmt_ratio(x):
    return "n/a" if x is None else f"{x:.2f}×"


def gbps(rec):
    return rec["bytes"] / rec["time_s"] / 1e9


def layouts_in(runs):
    order = ["many_small", "large_16m", "resnet50", "large_64m", "vit_b16", "large_256m", "llm1b"]
    present = {k[1] for k in runs if k[0] in ("average", "copy")}
    return [l for l in order if l in present]


def table(version, runs, peer_runs, op, threads_list):
    peer_cols = [label for _, label in PEERS]
    base_cols = ["lerp_", "mul_+add_"] if op == "average" else ["copy_"]
    base_impl = {"lerp_": "aten_lerp", "mul_+add_": "aten_mul_add", "copy_": "aten_copy"}
    head = ["layout", "params, tensors", "model → EMA", "threads", "emakit time", "GB/s", "of roofline"]
    head += [f"{c} / emakit" for c in peer_cols] + [f"C++ {c} / emakit" for c in base_cols]
    lines = [f"**{op}, LibTorch {version}**", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * 4 + ["---:"] * (len(head) - 4)) + "|"]
    for layout in layouts_in(runs):
        for precision in ("fp32", "bf16"):
            for t in threads_list:
                e = runs.get((op, layout, precision, "emakit", t))
                r = runs.get((op, layout, precision, "roofline", t))
                if not e:
                    continue
                row = [layout, f"{e['params'] / 1e6:.3g}M, {int(e['tensors'])}",
                       "fp32 → fp32" if precision == "fp32" else "bf16 → fp32", str(t), fmt_time(e["time_s"]),
                       f"{gbps(e):.1f}", of_roofline(e, r)]
                for peer, _ in PEERS:
                    p = peer_runs.get((op, layout, precision, peer, t))
                    row.append(fmt_ratio(p["time_s"] / e["time_s"]) if p else "n/a")
                for c in base_cols:
                    b = runs.get((op, layout, precision, base_impl[c], t))
                    row.append(fmt_ratio(b["time_s"] / e["time_s"]) if b else "n/a")
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(versions, peer_runs, threads_list):
    """One row per layout, precision and thread count; a column pair per LibTorch build."""
    names = " / ".join(v for v, _ in versions)
    head = ["layout", "model → EMA", "threads", f"emakit time ({names})", f"of roofline ({names})",
            f"fastest peer / emakit ({names})", f"C++ lerp_ / emakit ({names})"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    layouts = []
    for _, runs in versions:
        layouts += [l for l in layouts_in(runs) if l not in layouts]
    for layout in layouts:
        for precision in ("fp32", "bf16"):
            for t in threads_list:
                cells = {"time": [], "roof": [], "peer": [], "lerp": []}
                for _, runs in versions:
                    e = runs.get(("average", layout, precision, "emakit", t))
                    r = runs.get(("average", layout, precision, "roofline", t))
                    b = runs.get(("average", layout, precision, "aten_lerp", t))
                    peers = [peer_runs[k] for k in (("average", layout, precision, p, t) for p, _ in PEERS) if k in peer_runs]
                    cells["time"].append(fmt_time(e["time_s"]) if e else "n/a")
                    cells["roof"].append(of_roofline(e, r))
                    cells["peer"].append(f"{min(p['time_s'] for p in peers) / e['time_s']:.2f}×" if e and peers else "n/a")
                    cells["lerp"].append(f"{b['time_s'] / e['time_s']:.2f}×" if e and b else "n/a")
                if all(c == "n/a" for c in cells["time"]):
                    continue
                pr = "fp32 → fp32" if precision == "fp32" else "bf16 → fp32"
                lines.append("| " + " | ".join([layout, pr, str(t)] + [" / ".join(cells[k]) for k in ("time", "roof", "peer", "lerp")]) + " |")
    return "\n".join(lines)


def targets(version, runs, peer_runs, memory, threads_list):
    """The issue's CPU targets, checked on this run: list of (text, met)."""
    out = []
    worst_roof, worst_peer, worst_same = None, None, None
    for layout in layouts_in(runs):
        if layout not in LARGE:
            continue
        for precision in ("fp32", "bf16"):
            for t in threads_list:
                e = runs.get(("average", layout, precision, "emakit", t))
                r = runs.get(("average", layout, precision, "roofline", t))
                if not e or not r:
                    continue
                frac = r["time_s"] / e["time_s"]
                if worst_roof is None or frac < worst_roof[0]:
                    worst_roof = (frac, f"{layout} {precision} {t} thr, set by {r.get('set_by', 'the loop')}")
                peers = [peer_runs[k] for k in ((("average", layout, precision, p, t)) for p, _ in PEERS) if k in peer_runs]
                if peers:
                    best = min(p["time_s"] for p in peers)
                    ratio = best / e["time_s"]
                    if worst_peer is None or ratio < worst_peer[0]:
                        worst_peer = (ratio, f"{layout} {precision} {t} thr")
                # ATen's lerp kernels on emakit's own buffers: the Python peers' work without their
                # buffers (a buffer's placement moves a streaming pass by up to 25% on some machines).
                kernels = [runs[k] for k in (("average", layout, precision, i, t) for i in ("aten_lerp", "aten_foreach"))
                           if k in runs]
                if kernels:
                    ratio = min(k["time_s"] for k in kernels) / e["time_s"]
                    if worst_same is None or ratio < worst_same[0]:
                        worst_same = (ratio, f"{layout} {precision} {t} thr")
    if worst_roof:
        out.append((f"large layouts ≥ 90% of the roofline: lowest {worst_roof[0]:.0%} ({worst_roof[1]})",
                    worst_roof[0] >= 0.90))
    if worst_peer:
        out.append((f"large layouts never slower than the fastest peer: lowest fastest-peer/emakit "
                    f"{worst_peer[0]:.2f}× ({worst_peer[1]}; each on its own buffers)", worst_peer[0] >= 1.0))
    if worst_same:
        out.append((f"large fp32 layouts faster than this LibTorch's lerp_ and _foreach_lerp_ (1.13: mul_ + add_) "
                    f"on the same buffers: lowest {worst_same[0]:.2f}× ({worst_same[1]})", worst_same[0] >= 1.0))
    worst_small = None
    for precision in ("fp32", "bf16"):
        for t in threads_list:
            e = runs.get(("average", "many_small", precision, "emakit", t))
            peers = [peer_runs[k] for k in (("average", "many_small", precision, p, t) for p, _ in PEERS) if k in peer_runs]
            if e and peers:
                ratio = min(p["time_s"] for p in peers) / e["time_s"]
                if worst_small is None or ratio < worst_small[0]:
                    worst_small = (ratio, f"{precision} {t} thr")
    if worst_small:
        out.append((f"many small tensors ≤ 1/3 of the fastest peer's time: lowest fastest-peer/emakit "
                    f"{worst_small[0]:.1f}× ({worst_small[1]})", worst_small[0] >= 3.0))
    # K EMAs of one model, large fp32 layouts: the model read once for all of them.
    for k, goal in ((2, 1.15), (4, 1.25)):
        worst_gain, worst_group = None, None
        for (op, layout, precision, impl, t), together in runs.items():
            if op != f"group{k}" or impl != "emakit_together" or layout not in LARGE or precision != "fp32":
                continue
            apart, roof = runs.get((op, layout, precision, "emakit_apart", t)), runs.get((op, layout, precision, "roofline", t))
            where = f"{layout} {t} thr"
            if apart and (worst_gain is None or apart["time_s"] / together["time_s"] < worst_gain[0]):
                worst_gain = (apart["time_s"] / together["time_s"], where)
            if roof and (worst_group is None or roof["time_s"] / together["time_s"] < worst_group[0]):
                worst_group = (roof["time_s"] / together["time_s"], f"{where}, set by {roof.get('set_by', 'the loop')}")
        if worst_gain:
            # What the memory allows: the plain loops' own ratio, K one-EMA rooflines against the
            # group's (reads and writes do not cost the same, so it is not the byte ratio).
            plain = [plain_group_ratio(runs, k, layout, precision, t)
                     for (op, layout, precision, impl, t) in runs
                     if op == f"group{k}" and impl == "emakit_together" and layout in LARGE and precision == "fp32"]
            plain = [r for r in plain if r is not None]
            machine = f"; the plain loops' own ratio {min(plain):.2f}-{max(plain):.2f}×" if plain else ""
            out.append((f"K = {k} EMAs together ≥ {goal:.2f}× apart (large fp32): lowest {worst_gain[0]:.2f}× "
                        f"({worst_gain[1]}{machine})", worst_gain[0] >= goal))
        worst_peer_k = None
        for (op, layout, precision, impl, t), together in runs.items():
            if op != f"group{k}" or impl != "emakit_together":
                continue
            peers = [peer_runs[key] for key in ((op, layout, precision, p, t) for p, _ in GROUP_PEERS) if key in peer_runs]
            if peers and (worst_peer_k is None or min(p["time_s"] for p in peers) / together["time_s"] < worst_peer_k[0]):
                worst_peer_k = (min(p["time_s"] for p in peers) / together["time_s"], f"{layout} {precision} {t} thr")
        if worst_peer_k:
            out.append((f"K = {k} EMAs never slower than the fastest Python peer keeping {k}: lowest {worst_peer_k[0]:.2f}× "
                        f"({worst_peer_k[1]})", worst_peer_k[0] >= 1.0))
        if worst_group:
            out.append((f"K = {k} together ≥ 90% of the group roofline (large fp32): lowest {worst_group[0]:.0%} "
                        f"({worst_group[1]})", worst_group[0] >= 0.90))
    worst_drift = None
    for layout in layouts_in(runs):
        for precision in ("fp32", "bf16"):
            for t in threads_list:
                on, off = drift_pair(runs, layout, precision, t)
                if layout in LARGE and on and off and (worst_drift is None or on["time_s"] / off["time_s"] > worst_drift[0]):
                    worst_drift = (on["time_s"] / off["time_s"], f"{layout} {precision} {t} thr")
    if worst_drift:
        out.append((f"an update measuring the drift at most 5% slower than one that does not (large layouts): "
                    f"highest on/off {worst_drift[0]:.3f}× ({worst_drift[1]})", worst_drift[0] <= 1.05))
    if memory:
        worst = max(memory.items(), key=lambda kv: kv[1])
        out.append((f"bf16 model, fp32 EMA: one update adds < 1% resident memory: at most "
                    f"{worst[1]:.3%} of model + EMA ({worst[0][0]})", worst[1] < 0.01))
    return out


def cuda_targets(runs, peer_runs):
    """The issue's CUDA targets, checked on this run: list of (text, met)."""
    out = []
    t = max((k[4] for k in runs if k[0] == "average"), default=0)
    e = runs.get(("average", "llm1b", "fp32", "emakit", t))
    r = runs.get(("average", "llm1b", "fp32", "roofline", t))
    if e and r:
        frac = r["time_s"] / e["time_s"]
        out.append((f"1B-parameter fp32 layout ≥ 80% of the device-to-device copy bandwidth: {frac:.0%} "
                    f"({gbps(e):.0f} of {gbps(r):.0f} GB/s)", frac >= 0.8))
    worst = None
    for (op, layout, precision, impl, th), e in runs.items():
        if op != "average" or impl != "emakit":
            continue
        for peer, label in PEERS:
            p = peer_runs.get((op, layout, precision, peer, th))
            if p and (worst is None or p["time_s"] / e["time_s"] < worst[0]):
                worst = (p["time_s"] / e["time_s"], f"{label}, {layout} {precision}")
    if worst:
        out.append((f"faster than each Python peer on the same GPU: lowest peer/emakit {worst[0]:.2f}× ({worst[1]})",
                    worst[0] > 1.0))
    steps = {k[1]: r["time_s"] for k, r in runs.items() if k[0] == "step"}
    if "ema_inline" in steps and "ema_side_stream" in steps:
        saving = steps["ema_inline"] - steps["ema_side_stream"]
        out.append((f"the side stream saves step time: {saving * 1e3:.3f} ms of {steps['ema_inline'] * 1e3:.3f} ms "
                    f"({saving / steps['ema_inline']:.1%})", saving > 0))
    return out


def memory_table(cpp_memory, peer_memory):
    layouts = sorted({l for (l, _) in cpp_memory} | {l for (l, _) in peer_memory},
                     key=lambda l: ["many_small", "large_16m", "resnet50", "large_64m", "vit_b16", "large_256m"].index(l)
                     if l in ["many_small", "large_16m", "resnet50", "large_64m", "vit_b16", "large_256m"] else 99)
    cols = [("emakit", "emakit")] + PEERS
    lines = ["**Resident memory one update adds (bf16 model, fp32 EMA), as a fraction of model + EMA**", "",
             "| layout | " + " | ".join(label for _, label in cols) + " |", "|---|" + "---:|" * len(cols)]
    for l in layouts:
        row = [l]
        for key, _ in cols:
            v = cpp_memory.get((l, key)) if key == "emakit" else peer_memory.get((l, key))
            row.append("n/a" if v is None else f"{v:.2%}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def drift_pair(runs, layout, precision, threads):
    """(on, off) records of one row: the updates of the emakit_drift case that measured the drift and
    those of the same EMA that did not (emakit_drift_off); files without the latter compare with
    the emakit case, another EMA's buffers."""
    on = runs.get(("average", layout, precision, "emakit_drift", threads))
    off = runs.get(("average", layout, precision, "emakit_drift_off", threads)) or \
        runs.get(("average", layout, precision, "emakit", threads))
    return on, off


def drift_table(version, runs, threads_list):
    """An update that measures the drift (EmaOptions::drift_every) against one that does not, per
    layout and thread count."""
    rows = []
    for layout in layouts_in(runs):
        for precision in ("fp32", "bf16"):
            cells = []
            for t in threads_list:
                on, off = drift_pair(runs, layout, precision, t)
                cells.append(f"{fmt_time(off['time_s'])} → {fmt_time(on['time_s'])} ({on['time_s'] / off['time_s']:.3f}×)"
                             if on and off else "n/a")
            if any(c != "n/a" for c in cells):
                rows.append(f"| {layout} | {precision} → fp32 | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    head = [f"**Drift, LibTorch {version}** (an update measuring the drift against one that does not, the same "
            "EMA's alternate updates, EmaOptions::drift_every(2); time off → on, and on / off)", "",
            "| layout | model → EMA | " + " | ".join(f"{t} thread{'s' * (t > 1)}" for t in threads_list) + " |",
            "|---|---|" + "---:|" * len(threads_list)]
    return "\n".join(head + rows)


def plain_group_ratio(runs, k, layout, precision, threads):
    """K one-EMA rooflines against the K-EMA group roofline of one row: the gain from reading the
    model once that plain loops reach on this machine, or None."""
    one = runs.get(("average", layout, precision, "roofline", threads))
    group = runs.get((f"group{k}", layout, precision, "roofline", threads))
    return k * one["time_s"] / group["time_s"] if one and group else None


def group_table(version, runs, peer_runs):
    """K EMAs of one model (group<K> cases): update_together against each EMA's update() one after
    another, against the group's roofline (one plain pass reading the model once), and against the
    Python peers keeping K EMAs (benchmarks/peers.py --groups)."""
    keys = sorted({(k[1], k[2], k[4], int(k[0][5:])) for k in runs if k[0].startswith("group")},
                  key=lambda t: (t[1], t[0], t[2], t[3]))
    if not keys:
        return ""
    rows = [f"**Several EMAs of one model, LibTorch {version}** (bytes per element of one pass: 4 + 8K from fp32, "
            "2 + 8K from bf16; apart: K times 12, or 10)", "",
            "| layout | model → EMA | threads | K | together | apart | apart / together | plain loops: K × one / group | "
            "together, of group roofline | " + " | ".join(f"{label} / together" for _, label in GROUP_PEERS) + " |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(GROUP_PEERS)]
    for layout, precision, threads, k in keys:
        get = lambda impl: runs.get((f"group{k}", layout, precision, impl, threads))
        together, apart, roof = get("emakit_together"), get("emakit_apart"), get("roofline")
        if not (together and apart and roof):
            continue
        peers = [peer_runs.get((f"group{k}", layout, precision, p, threads)) for p, _ in GROUP_PEERS]
        rows.append(f"| {layout} | {precision} → fp32 | {threads} | {k} | {fmt_time(together['time_s'])} | "
                    f"{fmt_time(apart['time_s'])} | {apart['time_s'] / together['time_s']:.2f}× | "
                    f"{fmt_ratio(plain_group_ratio(runs, k, layout, precision, threads))} | "
                    f"{of_roofline(together, roof)} | "
                    + " | ".join(fmt_ratio(p["time_s"] / together["time_s"]) if p else "n/a" for p in peers) + " |")
    return "\n".join(rows)


def plot(path, versions, peer_runs, threads_list, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(threads_list), figsize=(6 * len(threads_list), 8.5), squeeze=False, sharex=True)
    for row, precision in enumerate(("fp32", "bf16")):
        for col, t in enumerate(threads_list):
            ax = axes[row][col]
            series = []
            for k, (version, runs) in enumerate(versions):
                series.append((f"emakit (LibTorch {version})", runs, "emakit", dict(marker="o", lw=2.2)))
                if k == 0:
                    series.append(("fused-loop roofline", runs, "roofline", dict(ls="--", color="black", lw=1.2)))
            for peer, label in PEERS:
                series.append((label, peer_runs, peer, dict(marker="s", lw=1, alpha=0.85)))
            for label, runs, impl, style in series:
                pts = sorted((r["params"], gbps(r)) for (op, l, p, i, th), r in runs.items()
                             if op == "average" and p == precision and i == impl and th == t and "bytes" in r)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], label=label, **style)
            ax.set_xscale("log")
            ax.set_title(f"{'fp32' if precision == 'fp32' else 'bf16'} model → fp32 EMA, {t} thread{'s' * (t > 1)}")
            ax.set_ylabel("GB/s (bytes moved per update / time)")
            ax.grid(True, which="both", alpha=0.3)
            if row == 1:
                ax.set_xlabel("model size (parameters)")
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpp", nargs="+", required=True)
    ap.add_argument("--peers", nargs="+", required=True)
    ap.add_argument("--out-md", required=True)
    ap.add_argument("--out-png")
    ap.add_argument("--machine", default="")
    args = ap.parse_args()

    peer_ctx, peer_runs, peer_memory, unsupported = load_peers(args.peers)
    versions, md = [], []
    cpp_memory = {}
    threads_list = None
    devices = []
    # One group of files per LibTorch build (each file is one round of the run).
    groups = {}
    for path in args.cpp:
        version = json.load(open(path)).get("context", {}).get("libtorch", "?")
        groups.setdefault(version, []).append(path)
    for paths in groups.values():
        version, ctx, runs, memory = load_cpp(paths)
        versions.append((version, runs))
        devices.append(ctx.get("emakit_device", "cpu"))
        cpp_memory.update(memory)
        if threads_list is None:
            threads_list = sorted({k[4] for k in runs if k[0] in ("average", "copy")})
    v = peer_ctx["versions"]
    counts = sorted({rec["samples"] for _, runs in versions for k, rec in runs.items() if k[3] == "emakit"}
                    | {rec["samples"] for rec in peer_runs.values()})
    counts_text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    md.append(f"Machine: {args.machine or 'not named'}. Python peers: torch {v.get('torch')}, ema-pytorch "
              f"{v.get('ema_pytorch')}, timm {v.get('timm')}. Each time is the median of its {counts_text} "
              "measurement(s) (rounds × repetitions; scripts/bench.sh runs each round layout by layout, the peers "
              "and every LibTorch build one after the other, so that they measure a layout minutes apart at most); "
              "every ratio compares results of this one run.")
    md.append("")
    md.append("**Summary: averaging** (fastest peer: the fastest of the four Python peers for that row)")
    md.append("")
    md.append(summary(versions, peer_runs, threads_list))
    md.append("")
    for version, runs in versions:
        md.append(table(version, runs, peer_runs, "average", threads_list))
        md.append("")
    for version, runs in versions:
        md.append(table(version, runs, peer_runs, "copy", threads_list))
        md.append("")
    for version, runs in versions:
        text = drift_table(version, runs, threads_list)
        if text:
            md.append(text)
            md.append("")
    for version, runs in versions:
        text = group_table(version, runs, peer_runs)
        if text:
            md.append(text)
            md.append("")
    if cpp_memory or peer_memory:
        md.append(memory_table(cpp_memory, peer_memory))
        md.append("")
    if unsupported:
        combos = sorted({(u["peer"], u["precision"]) for u in unsupported})
        md.append("Not supported by a peer (no result): " + ", ".join(f"{p} with a {pr} model" for p, pr in combos) + ".")
        md.append("")
    md.append("**Targets**")
    md.append("")
    for (version, runs), device in zip(versions, devices):
        checks = cuda_targets(runs, peer_runs) if device == "cuda" else targets(version, runs, peer_runs, cpp_memory, threads_list)
        for text, met in checks:
            md.append(f"- LibTorch {version} ({device}): {text}: **{'met' if met else 'not met'}**")
    md.append("")
    steps = {}
    for version, runs in versions:
        for k, r in runs.items():
            if k[0] == "step":
                steps[(version, k[1])] = r["time_s"]
    if steps:
        md.append("**Synthetic training step (CUDA, 8 × Linear(4096, 4096), batch 1024, SGD)**")
        md.append("")
        md.append("| LibTorch | no EMA | EMA inline | EMA on a side stream | saving of the side stream |")
        md.append("|---|---:|---:|---:|---:|")
        for version, _ in versions:
            a, b, c = (steps.get((version, m)) for m in ("no_ema", "ema_inline", "ema_side_stream"))
            if a and b and c:
                md.append(f"| {version} | {fmt_time(a)} | {fmt_time(b)} | {fmt_time(c)} | {(b - c) / b:.1%} of the step |")
        md.append("")
    open(args.out_md, "w").write("\n".join(md))
    if args.out_png:
        plot(args.out_png, versions, peer_runs, threads_list,
             "EMA update throughput vs model size" + (f" — {args.machine}" if args.machine else ""))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
