#!/usr/bin/env bash
# The mutation run: shows that the unit tests catch bugs. Applies each mutant of
# scripts/mutants.txt (a small, realistic bug in include/emakit/) to a copy of the source tree,
# one at a time, builds the unit tests against it and runs them: a mutant must make a test fail.
#
#   ./scripts/mutate.sh                 # every mutant (docs/tests.md, "Mutation run": the last result)
#   ./scripts/mutate.sh --list          # the mutants: id, header, what
#   ./scripts/mutate.sh --only ID[,ID]  # some of them (the baseline run is still made first)
#   ./scripts/mutate.sh --no-baseline   # skip the unmutated run (only when it just passed)
#
# A mutant with "tests: cost" is a cost the unit tests cannot see (a redundant pass that leaves the
# averages as they were): it is built as the torch1.13 preset builds the cost model (Release,
# emakit::compiled; build/mutate/cost-build) and killed when benchmarks/cost/cost.py --check fails
# (a figure off its budget); the unmutated tree must pass that check first.
#
# Per mutant: the text is replaced in the copy (it must occur exactly once: a mutant that no
# longer applies fails the run, it is never counted as killed); emakit_tests is built with the
# test files the mutant names (EMAKIT_UNIT_TEST_SOURCES, tests/CMakeLists.txt) and run directly
# (`--abort --order decl`: the first failure ends it). A failure, crash or timeout kills the
# mutant. If it survives its files, emakit_tests is built with every test file and run whole;
# only then is it "survived". A mutant that does not compile is "stillborn" (a broken mutant,
# not a kill). The copy is restored after each mutant and checked byte for byte.
#
# The tree, the build and the logs live in build/mutate (EMAKIT_MUTATE_DIR): tree/ is a fresh copy
# of the working tree (tracked files and untracked ones git does not ignore) made at the start,
# so the real sources are never touched. The build is header-only, -O1 (EMAKIT_MUTATE_FLAGS), with
# ccache: a mutant recompiles only the test files it is built with.
#
# Exit status: 0 when every mutant was killed; 1 when one survived or was stillborn, or the
# unmutated tests fail; 2 on a usage error or a mutant that does not apply.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MUTANTS="$ROOT/scripts/mutants.txt"
WORK="${EMAKIT_MUTATE_DIR:-$ROOT/build/mutate}"
FLAGS="${EMAKIT_MUTATE_FLAGS:--O1 -DNDEBUG}"
JOBS="${EMAKIT_JOBS:-2}"
RUN_TIMEOUT="${EMAKIT_MUTATE_TIMEOUT:-900}"  # seconds one run of emakit_tests may take
# The Catch2 test spec of every run (baseline included); empty (the default): every test case.
TEST_SPEC="${EMAKIT_MUTATE_TESTS-}"
TORCH_DIR="${Torch_DIR:-/usr/lib/x86_64-linux-gnu/cmake/Torch}"
PYTHON_PEERS="${EMAKIT_PYTHON:-$HOME/.cache/emakit/venv/bin/python}"
# Fixed, so that every set of test files shares one precompiled header (the narrow set that
# tests/CMakeLists.txt picks when no test includes <torch/torch.h>).
PCH_HEADERS="<ATen/ATen.h>;<ATen/Parallel.h>;<torch/nn/module.h>;<torch/nn/cloneable.h>;<torch/nn/modules/linear.h>;<torch/nn/modules/batchnorm.h>;<torch/serialize.h>;<fmt/format.h>;<catch2/catch.hpp>"

TREE="$WORK/tree"
BUILD="$WORK/build"
LOGS="$WORK/logs"
RUNDIR="$WORK/run"

say() { printf '==> %s\n' "$*"; }
die() { printf '==> ERROR: %s\n' "$1" >&2; exit "${2:-1}"; }

# The mutant list's parser and the apply/restore step (python3: exact text, counted).
mutants_py() {
  python3 - "$MUTANTS" "$@" <<'PY'
import hashlib, pathlib, sys

def parse(path):
    mutants, cur = [], None
    for no, raw in enumerate(pathlib.Path(path).read_text().split("\n"), 1):
        line = raw.rstrip("\r")
        if cur is None:
            if not line.strip() or line.startswith("#"):
                continue
            if not line.startswith("[") or "]" not in line:
                sys.exit(f"{path}:{no}: expected '[ID] description', got {line!r}")
            mid, what = line[1:].split("]", 1)
            cur = {"id": mid.strip(), "what": what.strip(), "file": None, "tests": [], "old": [], "new": [], "line": no}
            continue
        if not line.strip():
            mutants.append(cur); cur = None; continue
        if line.startswith("file:"):
            cur["file"] = line[5:].strip()
        elif line.startswith("tests:"):
            cur["tests"] = line[6:].split()
        elif line.startswith("-"):
            cur["old"].append(line[2:] if len(line) > 1 else "")
        elif line.startswith("+"):
            cur["new"].append(line[2:] if len(line) > 1 else "")
        else:
            sys.exit(f"{path}:{no}: unexpected line in mutant {cur['id']}: {line!r}")
    if cur is not None:
        mutants.append(cur)
    seen = set()
    for m in mutants:
        where = f"{path}:{m['line']}: mutant {m['id']}"
        if not m["id"] or any(c.isspace() or c == "," for c in m["id"]): sys.exit(f"{where}: a bad id")
        if m["id"] in seen: sys.exit(f"{where}: the id appears twice")
        seen.add(m["id"])
        if not m["file"] or not m["old"] or not m["tests"]: sys.exit(f"{where}: needs file:, tests: and '- ' lines")
        if m["old"] == m["new"]: sys.exit(f"{where}: the replacement is the original")
    return mutants

def find(mutants, mid):
    for m in mutants:
        if m["id"] == mid: return m
    sys.exit(f"no mutant '{mid}' in {sys.argv[1]} (--list shows them)")

def text(lines): return "\n".join(lines)

mutants = parse(sys.argv[1])
cmd = sys.argv[2]
if cmd == "ids":
    print("\n".join(m["id"] for m in mutants))
elif cmd == "list":
    for m in mutants: print(f"{m['id']:34} {m['file'].removeprefix('include/emakit/'):34} {m['what']}")
elif cmd == "field":  # field ID file|tests|what
    m = find(mutants, sys.argv[3]); v = m[sys.argv[4]]
    print(" ".join(v) if isinstance(v, list) else v)
elif cmd == "check":  # check TREE [ID...]: every (given) mutant applies exactly once
    root = pathlib.Path(sys.argv[3]); bad = []
    for m in (mutants if len(sys.argv) == 4 else [find(mutants, i) for i in sys.argv[4:]]):
        p = root / m["file"]
        n = p.read_bytes().decode().count(text(m["old"])) if p.is_file() else -1
        for t in m["tests"]:
            if t == "cost": continue  # the cost label (benchmarks/cost), not a test file
            if not (root / "tests" / t).is_file(): bad.append(f"{m['id']}: tests/{t} does not exist")
        if n != 1: bad.append(f"{m['id']}: its original text occurs {n} times in {m['file']} (must be exactly once)"
                              if n >= 0 else f"{m['id']}: {m['file']} does not exist")
    if bad: sys.exit("mutants that do not apply:\n  " + "\n  ".join(bad))
elif cmd == "apply":  # apply TREE ID: prints the sha256 of the original file
    m = find(mutants, sys.argv[4]); p = pathlib.Path(sys.argv[3]) / m["file"]
    data = p.read_bytes().decode(); old = text(m["old"])
    if data.count(old) != 1: sys.exit(f"{m['id']}: its original text occurs {data.count(old)} times in {p}")
    p.write_bytes(data.replace(old, text(m["new"]), 1).encode())
    print(hashlib.sha256(data.encode()).hexdigest())
elif cmd == "sha256":  # sha256 FILE
    print(hashlib.sha256(pathlib.Path(sys.argv[3]).read_bytes()).hexdigest())
else:
    sys.exit(f"unknown command {cmd}")
PY
}

LIST=0 ONLY="" BASELINE=1
while (($#)); do
  case "$1" in
    --list) LIST=1 ;;
    --only) shift; ONLY="${1:?--only needs an id}" ;;
    --only=*) ONLY="${1#--only=}" ;;
    --no-baseline) BASELINE=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (--list, --only ID[,ID], --no-baseline)" 2 ;;
  esac
  shift
done

command -v python3 >/dev/null || die "python3 is needed to read scripts/mutants.txt" 2
if ((LIST)); then mutants_py list; exit 0; fi

mapfile -t IDS < <(mutants_py ids) || die "scripts/mutants.txt does not parse" 2
if [[ -n "$ONLY" ]]; then IFS=, read -r -a IDS <<<"$ONLY"; fi
# Every mutant must apply to the sources as they are, before anything is built.
mutants_py check "$ROOT" "${IDS[@]}" || die "fix scripts/mutants.txt: a mutant that does not apply is an error" 2

START=$SECONDS
rm -rf "$LOGS"  # this run's logs only
mkdir -p "$WORK" "$LOGS" "$RUNDIR"
rm -rf "$TREE"
mkdir -p "$TREE"
# The working tree as it is (uncommitted edits and new files included), without ignored files.
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard |
   while IFS= read -r -d '' f; do if [[ -e "$f" || -L "$f" ]]; then printf '%s\0' "$f"; fi; done |
   tar --null --no-recursion -T - -cf -) | tar -xmf - -C "$TREE"  # -m: new mtimes, so nothing built from an older copy looks up to date
say "copied the working tree to $TREE"

GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
if [[ -f "$BUILD/CMakeCache.txt" ]] && ! grep -q "^CMAKE_HOME_DIRECTORY:INTERNAL=$TREE\$" "$BUILD/CMakeCache.txt"; then
  rm -rf "$BUILD"
fi
CURRENT_SOURCES="unset"
# configure "a.cpp;b.cpp" (or "" for every test file): reconfigures only when the set changes.
configure() {
  [[ "$1" == "$CURRENT_SOURCES" ]] && return 0
  cmake -S "$TREE" -B "$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="$FLAGS" \
    -DTorch_DIR="$TORCH_DIR" -DCMAKE_PREFIX_PATH= -DEMAKIT_BUILD_TESTS=ON -DEMAKIT_PACKAGE_TESTS=OFF \
    -DEMAKIT_BUILD_COMPILED=OFF -DEMAKIT_INSTALL=OFF -DEMAKIT_PYTHON="$PYTHON_PEERS" \
    -DEMAKIT_TESTS_PCH_HEADERS="$PCH_HEADERS" -DEMAKIT_UNIT_TEST_SOURCES="$1" >"$LOGS/configure.log" 2>&1 ||
    { cat "$LOGS/configure.log" >&2; die "configuring $BUILD failed"; }
  CURRENT_SOURCES="$1"
}
build() { cmake --build "$BUILD" --target emakit_tests -j "$JOBS" >"$1" 2>&1; }
# run LOG: emakit_tests as ctest runs each test (same environment), to the first failure.
run_tests() {
  (cd "$RUNDIR" && EMAKIT_PYTHON="$PYTHON_PEERS" timeout --kill-after=30 "$RUN_TIMEOUT" \
     "$BUILD/tests/emakit_tests" --abort --order decl ${TEST_SPEC:+"$TEST_SPEC"}) >"$1" 2>&1
}
# The test that failed, from Catch2's console report: "test_x.cpp: test case name".
failed_test() {
  awk '
    /^------------------------------------------------------------+$/ {
      if (header) { header = 0; next }  # a test case name (wrapped at 80 columns), then its sections
      header = 1; name = ""; sections = 0
      while ((getline line) > 0 && line !~ /^------------------------------------------------------------+$/) {
        if (line ~ /^  [^ ]/ || sections) { sections = 1; continue }  # sections: two spaces
        sub(/^ +/, "", line)  # a wrapped name goes on without indent, or indented past a ':'
        name = name (name == "" ? "" : " ") line
      }
      header = 0; next
    }
    match($0, /[A-Za-z0-9_]+\.cpp:[0-9]+: FAILED/) && !found {
      file = substr($0, RSTART, RLENGTH); sub(/:[0-9]+: FAILED/, "", file); failed = name; found = 1
    }
    END { if (found) printf "%s: %s", file, failed }' "$1"
}

if ((BASELINE)); then
  say "baseline: every test file, unmutated${TEST_SPEC:+ (test cases: $TEST_SPEC)}"
  t0=$SECONDS
  configure ""
  build "$LOGS/baseline.build.log" || { tail -30 "$LOGS/baseline.build.log" >&2; die "the unmutated tests do not build"; }
  run_tests "$LOGS/baseline.run.log" ||
    { tail -40 "$LOGS/baseline.run.log" >&2; die "the unmutated tests fail ($LOGS/baseline.run.log): a mutation run needs a passing suite"; }
  say "baseline passed: $(grep -E '^(All tests passed|test cases:)' "$LOGS/baseline.run.log" | tail -1) ($((SECONDS - t0)) s)"
fi

# The cost model's build of the copy, as the torch1.13 preset makes it (the budgets' build).
COST_BUILD="$WORK/cost-build"
COST_READY=0
# cost_check LOG: builds emakit_cost_model from the copy (exit 100 when that fails) and runs the
# budget check: cost.py's own exit status (0 passed, 1 a figure or limit failed, else it could not count).
cost_check() {
  if ((COST_READY == 0)); then
    cmake -S "$TREE" -B "$COST_BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release -DTorch_DIR="$TORCH_DIR" \
      -DCMAKE_PREFIX_PATH= -DEMAKIT_BUILD_TESTS=ON -DEMAKIT_PACKAGE_TESTS=OFF -DEMAKIT_USER_BUILD_TESTS=OFF \
      -DEMAKIT_INSTALL=OFF -DEMAKIT_PYTHON= >"$LOGS/cost-configure.log" 2>&1 ||
      { cat "$LOGS/cost-configure.log" >&2; die "configuring $COST_BUILD failed"; }
    COST_READY=1
  fi
  cmake --build "$COST_BUILD" --target emakit_cost_model -j "$JOBS" >"$1.build.log" 2>&1 || return 100
  python3 "$TREE/benchmarks/cost/cost.py" --binary "$COST_BUILD/benchmarks/cost/emakit_cost_model" \
    --out "$COST_BUILD/cost" --check >"$1.run.log" 2>&1
}
# cost_mutant ID FILE LOG: a mutant of the cost label (applied to the copy): sets result and by. The
# first one checks the unmutated copy first (FILE restored for it, then the mutant applied again).
COST_BASELINE=0
cost_mutant() {
  local id="$1" file="$2" log="$3" rc=0
  if ((COST_BASELINE == 0)); then
    cp "$WORK/original.bak" "$TREE/$file"
    cost_check "$LOGS/cost-baseline" ||
      { tail -20 "$LOGS/cost-baseline.run.log" >&2; die "the unmutated cost check fails ($LOGS/cost-baseline.run.log)"; }
    COST_BASELINE=1
    mutants_py apply "$TREE" "$id" >/dev/null
  fi
  cost_check "$log" || rc=$?
  case "$rc" in
    0) result=survived by="cost.py --check passes ($log.run.log)" ;;
    1) result=killed by="cost: $(grep -m1 -E 'budget FAIL|limit FAIL' "$log.run.log" | sed -E 's/^ +//' | cut -c1-120)" ;;
    100) result=stillborn by="does not compile: $log.build.log" ;;
    *) tail -20 "$log.run.log" >&2; die "cost.py could not count the mutant $id (exit $rc, $log.run.log)" ;;
  esac
}

declare -A RESULT BY TIME
killed=0 survived=0 stillborn=0
printf '%-34s %-9s %6s  %s\n' "mutant" "result" "secs" "killed by"
for id in "${IDS[@]}"; do
  t0=$SECONDS
  file="$(mutants_py field "$id" file)"
  hint="$(mutants_py field "$id" tests)"
  log="$LOGS/$id"
  cp -p "$TREE/$file" "$WORK/original.bak"
  original_sha="$(mutants_py apply "$TREE" "$id")" || die "mutant $id does not apply to $TREE" 2
  result="" by=""
  if [[ "$hint" == cost ]]; then
    cost_mutant "$id" "$file" "$log"
  else
    configure "${hint// /;}"
    if ! build "$log.build.log"; then
      result=stillborn by="does not compile: $log.build.log"
    elif ! run_tests "$log.run.log"; then
      result=killed by="$(failed_test "$log.run.log")"
      [[ -n "$by" ]] || by="crash or timeout (rc != 0): $log.run.log"
    else
      # Survived its own test files: every test file.
      configure ""
      if ! build "$log.all.build.log"; then
        result=stillborn by="does not compile with every test file: $log.all.build.log"
      elif ! run_tests "$log.all.run.log"; then
        result=killed by="$(failed_test "$log.all.run.log") (not by its listed files: $hint)"
        [[ -n "$by" ]] || by="crash or timeout: $log.all.run.log"
      else
        result=survived by="no test fails ($log.all.run.log)"
      fi
    fi
  fi
  # Restore the copy and check it byte for byte.
  cp "$WORK/original.bak" "$TREE/$file"
  if [[ "$(mutants_py sha256 "$TREE/$file")" != "$original_sha" ]]; then
    die "restoring $file after $id: the copy differs from the original"
  fi
  case "$result" in killed) killed=$((killed + 1)) ;; survived) survived=$((survived + 1)) ;; *) stillborn=$((stillborn + 1)) ;; esac
  RESULT[$id]=$result BY[$id]=$by TIME[$id]=$((SECONDS - t0))
  printf '%-34s %-9s %6d  %s\n' "$id" "$result" "${TIME[$id]}" "$by"
done

total=$((SECONDS - START))
say "mutants: ${#IDS[@]}, killed $killed, survived $survived, stillborn $stillborn; total $((total / 60)) min $((total % 60)) s (logs: $LOGS)"
((survived == 0 && stillborn == 0))
