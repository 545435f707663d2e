#!/usr/bin/env python3
"""The cost model: every CPU update path counted under valgrind's cache simulation, in numbers that
repeat exactly, checked against the budgets in budgets.json and against the design's own limits.

  python3 benchmarks/cost/cost.py --binary build/torch1.13/benchmarks/cost/emakit_cost_model \\
      --out build/torch1.13/benchmarks/cost [--check] [--record] [--cases REGEX]
  python3 benchmarks/cost/cost.py --binary ... --out ... --calibrate   # + native timings

It runs emakit_cost_model under callgrind with a fixed cache (I1 and D1 32 KiB 8-way, LL 1 MiB
16-way, 64-byte lines, write-back simulated), one thread, on the AVX2 copies of the loops (valgrind
reports no AVX-512), and writes cost.md and cost.json into --out. Callgrind, not cachegrind: the
same cache simulator, plus the write-backs of dirty lines (--simulate-wb, which memory traffic
needs: cachegrind counts no writes to memory) and client requests that count one case at a time
(cachegrind has them only from valgrind 3.22 on; Debian 12 has 3.19).

Figures, per element of the model (per update): instructions (Ir), D1 read and write misses, LL
read and write misses, LL write-backs, and traffic = 64 bytes x (LL misses + write-backs), the
bytes that move between the caches and memory. For many_small also instructions per tensor.

--check fails (exit 1) when
  - a figure of one of emakit's cases is off its budget (budgets.json, the entry of this build:
    LibTorch, compiler, ISA, build type, emakit mode) by more than TOLERANCE of it plus ABSOLUTE
    per element, up or down (a change that makes an update cheaper records the new figure, so that
    the budget stays tight), or the build has no entry (--record writes it); the references (plain
    loops, ATen) are counted for the limits but have no budget;
  - a limit of the design does not hold (limits() below: together and EmaGroup against apart,
    drift on against off, one EMA against the plain loop).
A limit that a build does not meet yet is in its entry's "open_limits" (the reason in budgets.json's
"reasons"); --check reports it and fails when a listed limit holds (take it off the list).
--record writes this build's figures, and the limits it does not meet as its open ones, into
budgets.json (commit it with the reason).
Exit 77 (skipped) when valgrind is not installed.
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
BUDGETS = HERE / "budgets.json"
LINE = 64
CACHE = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64"]
# The budgeted figures, per element and update: name -> (label, events summed).
FIGURES = {
    "instructions": ("instructions", ["Ir"]),
    "d1_read_misses": ("D1 read misses", ["D1mr"]),
    "d1_write_misses": ("D1 write misses", ["D1mw"]),
    "ll_read_misses": ("LL read misses", ["ILmr", "DLmr"]),
    "ll_write_misses": ("LL write misses", ["DLmw"]),
    "ll_write_backs": ("LL write-backs", ["ILdmr", "DLdmr", "DLdmw"]),
}
# What a budget holds per case: each figure, and the traffic they add up to (bytes per element).
BUDGETED = list(FIGURES) + ["traffic_bytes"]
# A figure may move by TOLERANCE of its budget plus ABSOLUTE per element (so that a figure near 0,
# a few write misses in a million elements, does not fail on one line).
TOLERANCE = 0.015
ABSOLUTE = 1e-3
# The references (the plain loops, ATen's ops) are measured for the limits, not budgeted: they are
# not emakit's code, and ATen's allocate per call, so their D1 misses move with the heap's layout
# (a copy of the tree at another path: 6% of aten_foreach's D1 write misses on many_small).


def budgeted(name):
    return not name.startswith(("plain", "aten_"))


def fail(message):
    print(f"cost.py: {message}", file=sys.stderr)
    sys.exit(2)


def run_valgrind(binary, out, pattern, updates):
    valgrind = shutil.which("valgrind")
    if not valgrind:
        print("cost.py: SKIPPED: valgrind is not installed (apt-get install valgrind); nothing was counted")
        sys.exit(77)
    dumps = out / "callgrind"
    shutil.rmtree(dumps, ignore_errors=True)
    dumps.mkdir(parents=True)
    cmd = [valgrind, "--tool=callgrind", "--cache-sim=yes", "--simulate-wb=yes", "--instr-atstart=no",
           "--collect-atstart=no", *CACHE, f"--callgrind-out-file={dumps}/case", "--dump-line=no",
           "--compress-strings=no", "--compress-pos=no", "-q", str(binary), f"--updates={updates}"]
    if pattern:
        cmd.append(f"--cases={pattern}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        fail(f"emakit_cost_model under valgrind exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    header, cases = parse_stdout(proc.stdout)
    if header.get("counted") != "1":
        fail(f"{binary} was built without <valgrind/callgrind.h>: it cannot be counted (install valgrind, rebuild)")
    counts = {}
    for f in sorted(dumps.glob("case.*")):  # "case" alone is the dump at exit, of nothing
        name, events = parse_dump(f)
        counts[name] = events
    missing = [c for c in cases if c not in counts]
    if missing:
        fail(f"no callgrind dump for the cases {missing} (dumps in {dumps})")
    return header, cases, counts, time.monotonic() - t0


def parse_stdout(text):
    header, cases = {}, {}
    for line in text.splitlines():
        if line.startswith("# emakit_cost_model "):
            for m in re.finditer(r"(\w+)=(.*?)(?= \w+=|$)", line[len("# emakit_cost_model "):]):
                header[m.group(1)] = m.group(2)
        elif line.startswith("case ") or line.startswith("time "):
            parts = line.split()
            entry = {"elements": int(parts[2]), "tensors": int(parts[3])}
            if parts[0] == "case":
                entry["updates"] = int(parts[4])
            else:
                entry["seconds"] = float(parts[4])
            cases[parts[1]] = entry
    if not header:
        fail("emakit_cost_model printed no '# emakit_cost_model' line")
    return header, cases


TRIGGER = "desc: Trigger: Client Request: "


def parse_dump(path):
    name, events, summary = None, None, None
    with open(path) as fh:
        for line in fh:
            if line.startswith(TRIGGER):
                name = line[len(TRIGGER):].strip()
            elif line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("totals:"):  # the sum over the dump's functions; its "summary:" line
                summary = [int(v) for v in line.split()[1:]]  # is wrong after START_INSTRUMENTATION
    if name is None or events is None or summary is None:
        fail(f"{path}: not a callgrind dump of a case (no trigger, events or totals line)")
    if len(summary) < len(events):
        summary += [0] * (len(events) - len(summary))
    return name, dict(zip(events, summary))


def key_of(header):
    return (f"libtorch {header.get('libtorch')} | {header.get('compiler')} | {header.get('isa')} | "
            f"{header.get('build')}")


def figures(cases, counts):
    out = {}
    for name, c in cases.items():
        ev = counts[name]
        per = c["elements"] * c["updates"]
        f = {k: sum(ev.get(e, 0) for e in events) / per for k, (_, events) in FIGURES.items()}
        f["traffic_bytes"] = LINE * (f["ll_read_misses"] + f["ll_write_misses"] + f["ll_write_backs"])
        f["instructions_per_tensor"] = ev.get("Ir", 0) / (c["tensors"] * c["updates"])
        f["elements"] = c["elements"]
        f["tensors"] = c["tensors"]
        out[name] = f
    return out


def parse_name(name):
    path, layout, precision = name.split("/")
    return path, layout, precision


# The design's limits: (description, function of the figures -> list of (what, value, bound, ok)).
def limits(fig):
    rows = []

    def have(*names):
        return all(n in fig for n in names)

    for layout in ("large", "many_small"):
        for k in (1, 2, 4, 8):
            apart = f"apart{k}/{layout}/fp32"
            expected = (4 + 8 * k) / (12 * k)
            for path in ("together", "group"):
                name = f"{path}{k}/{layout}/fp32"
                if have(name, apart):
                    r = fig[name]["traffic_bytes"] / fig[apart]["traffic_bytes"]
                    rows.append((f"{path}{k} / apart{k} traffic, {layout}", r,
                                 f"(4 + 8K) / 12K = {expected:.4f} within 5%", abs(r / expected - 1) <= 0.05))
        for precision in ("fp32", "bf16"):
            ema, drift, plain = (f"{p}/{layout}/{precision}" for p in ("ema", "drift", "plain"))
            if have(ema, drift):
                r = fig[drift]["instructions"] / fig[ema]["instructions"]
                rows.append((f"drift / ema instructions, {layout} {precision}", r, "<= 1.05", r <= 1.05))
                r = fig[drift]["traffic_bytes"] / fig[ema]["traffic_bytes"]
                rows.append((f"drift / ema traffic, {layout} {precision}", r, "<= 1.005 (no traffic)", r <= 1.005))
            if have(ema, plain):
                r = fig[ema]["instructions"] / fig[plain]["instructions"]
                bound = 1.10 if layout == "large" else 1.15
                rows.append((f"ema / plain loop instructions, {layout} {precision}", r, f"<= {bound:.2f}",
                             r <= bound))
    return rows


def budget_rows(fig, entry):
    rows = []
    budget_cases = entry.get("cases", {})
    for name in sorted(n for n in fig if budgeted(n)):
        if name not in budget_cases:
            rows.append((name, "(all)", None, None, False, "no budget for this case: --record adds it"))
            continue
        for k in BUDGETED:
            got, want = fig[name][k], budget_cases[name][k]
            allowed = TOLERANCE * want + ABSOLUTE
            ok = abs(got - want) <= allowed
            rows.append((name, k, got, want, ok, "" if ok else
                         ("above its budget: a change added work; raise the budget with --record in the same "
                          "commit, with the reason" if got > want else
                          "below its budget: record the improvement with --record")))
    for name in sorted(set(budget_cases) - set(fig)):
        rows.append((name, "(all)", None, None, False, "budgeted but not measured (a case was removed or renamed)"))
    return rows


def fmt(v, digits=4):
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def write_tables(out, header, fig, lim, seconds=None, open_limits=()):
    lines = [f"# emakit cost model", "",
             f"Build: `{key_of(header)}`; callgrind {' '.join(CACHE)}, write-backs simulated, one thread; "
             "counts per element of the model and update (many_small also per tensor). Traffic: 64 bytes x "
             "(LL misses + LL write-backs).", "",
             "| case | instructions | D1 read misses | D1 write misses | LL read misses | LL write misses | "
             "LL write-backs | traffic (bytes) | instructions per tensor |" + (" ns per element |" if seconds else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if seconds else "")]
    for name, f in fig.items():
        row = [f"`{name}`", fmt(f["instructions"]), fmt(f["d1_read_misses"]), fmt(f["d1_write_misses"]),
               fmt(f["ll_read_misses"]), fmt(f["ll_write_misses"]), fmt(f["ll_write_backs"]),
               fmt(f["traffic_bytes"]), fmt(f["instructions_per_tensor"]) if f["tensors"] > 1 else "-"]
        if seconds:
            s = seconds.get(name)
            row.append(fmt(s["seconds"] / s["elements"] * 1e9) if s else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| limit | measured | bound | holds |", "|---|---:|---|---|"]
    for what, value, bound, ok in lim:
        verdict = "yes" if ok else ("**no** (open)" if what in open_limits else "**no**")
        lines.append(f"| {what} | {value:.4f} | {bound} | {verdict} |")
    (out / "cost.md").write_text("\n".join(lines) + "\n")
    (out / "cost.json").write_text(json.dumps({"build": key_of(header), "cache": CACHE, "figures": fig,
                                               "limits": [{"what": w, "value": v, "bound": b, "holds": ok}
                                                          for w, v, b, ok in lim]}, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True, type=pathlib.Path)
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--cases", default="", help="a regular expression: only the matching cases")
    ap.add_argument("--updates", type=int, default=2, help="updates counted per case (default 2)")
    ap.add_argument("--check", action="store_true", help="fail on a figure off its budget or a limit broken")
    ap.add_argument("--record", action="store_true", help="write this build's figures into budgets.json")
    ap.add_argument("--calibrate", action="store_true",
                    help="also time every case natively (large scaled 16x) and add ns per element to cost.md")
    args = ap.parse_args()
    if not args.binary.is_file():
        fail(f"--binary {args.binary}: no such file (build the target emakit_cost_model)")
    if args.record and args.cases:
        fail("--record with --cases would leave out the other cases' budgets: record every case")
    args.out.mkdir(parents=True, exist_ok=True)
    header, cases, counts, took = run_valgrind(args.binary, args.out, args.cases, args.updates)
    fig = figures(cases, counts)
    lim = limits(fig)
    seconds = None
    if args.calibrate:
        proc = subprocess.run([str(args.binary), "--time"] + ([f"--cases={args.cases}"] if args.cases else []),
                              capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            fail(f"emakit_cost_model --time exited {proc.returncode}:\n{proc.stderr}")
        seconds = parse_stdout(proc.stdout)[1]
    budgets = json.loads(BUDGETS.read_text()) if BUDGETS.is_file() else {"configurations": {}}
    key = key_of(header)
    entry = budgets.get("configurations", {}).get(key)
    # A limit this build does not meet yet is listed in its entry's "open_limits" (why: budgets.json's
    # "reasons"): reported, not failed. One that holds while listed fails (take it off: it is met).
    reasons = budgets.get("reasons", {})
    open_limits = set(entry.get("open_limits", [])) if entry else set()
    write_tables(args.out, header, fig, lim, seconds, open_limits)
    print(f"cost.py: {len(fig)} cases counted in {took:.0f} s under valgrind; build: {key}")
    print(f"cost.py: tables in {args.out / 'cost.md'} and {args.out / 'cost.json'}")
    status = 0
    for what, value, bound, ok in lim:
        if what in open_limits:
            verdict = "FAIL (listed in open_limits but holds: remove it)" if ok else "open"
            print(f"  limit {verdict} {what}: {value:.4f} ({bound}); {reasons.get(what, 'no reason given')}")
            if ok and args.check and not args.record:
                status = 1
            continue
        print(f"  limit {'ok  ' if ok else 'FAIL'} {what}: {value:.4f} ({bound})")
        if not ok and args.check and not args.record:
            status = 1
    if not args.cases:
        for what in sorted(open_limits - {r[0] for r in lim}):
            print(f"  limit FAIL {what}: listed in open_limits, but no such limit")
            if args.check:
                status = 1
    if args.record:
        # The limits not met now are this build's open ones: each needs a reason in "reasons".
        broken = sorted(r[0] for r in lim if not r[3])
        budgets.setdefault("configurations", {})[key] = {
            "cases": {n: {k: round(f[k], 6) for k in BUDGETED} for n, f in sorted(fig.items()) if budgeted(n)},
            "open_limits": broken}
        for what in broken:
            if what not in reasons:
                print(f"cost.py: open limit '{what}' has no reason in budgets.json's \"reasons\": add one")
        BUDGETS.write_text(json.dumps(budgets, indent=1, sort_keys=True) + "\n")
        print(f"cost.py: recorded {sum(1 for n in fig if budgeted(n))} cases' budgets for '{key}' in {BUDGETS}")
    if args.check:
        if entry is None:
            recorded = "\n  ".join(budgets.get("configurations", {})) or "(none)"
            print(f"cost.py: FAIL: budgets.json has no entry for this build '{key}'; recorded builds:\n  {recorded}\n"
                  "  (a new LibTorch, compiler or build type: record its budgets with --record and commit them)")
            return 1
        # A run of some cases (--cases) is not told about the budgeted cases it left out.
        rows = [r for r in budget_rows(fig, entry) if not args.cases or r[0] in fig]
        checked = sum(1 for r in rows if r[2] is not None)
        bad = [r for r in rows if not r[4]]
        for name, k, got, want, ok, why in bad:
            print(f"  budget FAIL {name} {k}: {fmt(got, 6)} against {fmt(want, 6)} per element "
                  f"(tolerance {TOLERANCE:.1%} + {ABSOLUTE:g}): {why}")
        broken = [r for r in lim if not r[3]]
        print(f"cost.py: {checked} figures of {len(fig)} cases against their budgets, {len(bad)} off; "
              f"{len(lim)} limits, {len(broken)} not met ({sum(1 for r in broken if r[0] in open_limits)} of them "
              "open in budgets.json)")
        if bad:
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
