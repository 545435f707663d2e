#!/usr/bin/env bash
# The CUDA checks of emakit, for a machine with a GPU: builds against the PyTorch found there,
# runs the CUDA tests and the CUDA benchmarks (emakit against a device-to-device copy of the same
# bytes, the Python peers on the same GPU, a training step with and without the side stream) and
# writes every result into one folder. Sized to finish within 5 minutes on one GPU.
#
#   benchmarks/gpu_check.sh [OUT]          OUT: default $OUT (the device tool's folder), else build/gpu-check
#   benchmarks/gpu_check.sh --stage        on a machine without a GPU: copy the build's small
#                                          dependencies (Catch2, fmt, Google Benchmark headers,
#                                          CMake configs and libraries, ema-pytorch) into
#                                          build/gpu-deps, to carry to a GPU machine that lacks them
#
# EMAKIT_GPU_CHECK_DRY=1 runs the build steps on a machine without a GPU (a check of this script).
# Needs there: a python with torch built for CUDA ($EMAKIT_PYTHON, else ~/.cache/emakit/venv, else
# python3), cmake, a C++20 compiler, and a CUDA toolkit (nvcc) for the wheel's CMake config.
# Catch2 v2, fmt and Google Benchmark come from the system or from build/gpu-deps.
# OUT receives: env.txt (GPU, driver, torch), configure.log, build.log, cuda_tests.txt (every CUDA
# test but the races), cuda_race_tests.txt (the provoked races, tests tagged [race]),
# cuda_tests.xml (JUnit, all of them, when time is left at the end), cuda_bench.json,
# cuda_peers.json, cuda_results.md, summary.txt. summary.txt has one line per test run (PASSED,
# FAILED with the failed test cases, SKIPPED) and the tests' `BYTES_PER_PARAM <label> <value>`
# lines (GPU bytes an EMA holds per parameter) as they are, and the race tests' `PROVOKED
# <held>/<rounds> rounds: <read>` lines (rounds that provoked each race). On a machine with a GPU
# the tests run with EMAKIT_EXPECT_CUDA=1: a CUDA check that cannot run there fails.
# Every stage after the build gets a timeout cut from one deadline, EMAKIT_GPU_CHECK_BUDGET_S
# (default 300 s) after the start, so that the whole run stays within it.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
deps="$root/build/gpu-deps"

if [[ "${1:-}" == "--stage" ]]; then
  set -e
  rm -rf "$deps"
  arch="$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
  mkdir -p "$deps/usr/include" "$deps/usr/lib/cmake" "$deps/usr/lib/$arch/cmake" "$deps/python"
  cp -a /usr/include/catch2 /usr/include/fmt /usr/include/benchmark "$deps/usr/include/"
  cp -a /usr/lib/cmake/Catch2 "$deps/usr/lib/cmake/"
  cp -a "/usr/lib/$arch/cmake/fmt" "/usr/lib/$arch/cmake/benchmark" "$deps/usr/lib/$arch/cmake/"
  cp -a /usr/lib/libCatch2WithMain.a "$deps/usr/lib/" 2>/dev/null || true
  cp -a /usr/lib/"$arch"/libfmt.so* /usr/lib/"$arch"/libbenchmark.so* /usr/lib/"$arch"/libbenchmark_main.a "$deps/usr/lib/$arch/"
  py="${EMAKIT_PYTHON:-$HOME/.cache/emakit/venv/bin/python}"
  site="$("$py" -c 'import ema_pytorch, os; print(os.path.dirname(os.path.dirname(ema_pytorch.__file__)))')"
  cp -a "$site/ema_pytorch" "$deps/python/"
  du -sh "$deps"
  echo "staged into $deps: carry build/gpu-deps with the working tree"
  exit 0
fi

out="${1:-${OUT:-$root/build/gpu-check}}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
say() { printf '==> %s\n' "$*" | tee -a "$summary"; }
started=$SECONDS
deadline=$((started + ${EMAKIT_GPU_CHECK_BUDGET_S:-300}))
# limit WANT RESERVE [FLOOR]: a stage timeout of WANT seconds, cut so that RESERVE seconds of the
# budget remain for the stages after it, but at least FLOOR seconds (default 10), so that a late
# stage still gets a try. The tests come first: a slow build squeezes the benchmarks, not them.
limit() {
  local left=$((deadline - SECONDS - $2))
  ((left < ${3:-10})) && left=${3:-10}
  ((left < $1)) && echo "$left" || echo "$1"
}

# ---- the environment ------------------------------------------------------------------------
python=""
for candidate in "${EMAKIT_PYTHON:-}" "$HOME/.cache/emakit/venv/bin/python" python3 python; do
  [[ -n "$candidate" ]] || continue
  if "$candidate" -c 'import torch' 2>/dev/null; then python="$candidate"; break; fi
done
[[ -n "$python" ]] || { say "FAILED: no python with torch found"; exit 1; }
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$deps/python"
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv 2>&1 || echo "nvidia-smi: unavailable"
  "$python" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.1f} GiB")
for mod in ("ema_pytorch", "timm"):
    try:
        __import__(mod); print(mod, "importable")
    except Exception as e:
        print(mod, "unavailable:", type(e).__name__, e)
EOF
  echo "cmake: $(cmake --version 2>/dev/null | head -n1)"
  echo "c++: $(c++ --version 2>/dev/null | head -n1)"
  echo "nvcc: $( (command -v nvcc || ls "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc") 2>/dev/null)"
  echo "cpus: $(nproc)"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
if ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  # EMAKIT_GPU_CHECK_DRY=1: go on without a GPU, to check the build steps of this script.
  [[ "${EMAKIT_GPU_CHECK_DRY:-0}" == 1 ]] || { say "FAILED: torch sees no CUDA device"; exit 1; }
  say "no CUDA device: dry run (EMAKIT_GPU_CHECK_DRY=1), the tests and benchmarks will report skipped"
else
  # A GPU is here: the CUDA tests must run all of it. With EMAKIT_EXPECT_CUDA=1 a test binary that
  # sees no device, and a check that cannot run (no allocator statistics ...), fail instead of
  # skipping (tests/cuda/main.cpp, tests/cuda/expect.hpp).
  export EMAKIT_EXPECT_CUDA=1
fi

info="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__)); print(torch.version.cuda or "")')"
torch_root="$(sed -n 1p <<<"$info")"
args=("-DCMAKE_PREFIX_PATH=$torch_root;$deps/usr" "-DTorch_DIR=$torch_root/share/cmake/Torch")
cudart="$(compgen -G "$torch_root/../nvidia/cu*/lib/libcudart.so.*" | head -n1 || true)"
[[ -n "$cudart" ]] || cudart="$(compgen -G "$torch_root/../nvidia/cuda_runtime/lib/libcudart.so.*" | head -n1 || true)"
[[ -n "$cudart" ]] && args+=("-DCUDA_cudart_LIBRARY=$(realpath "$cudart")")
if ! command -v nvcc >/dev/null && [[ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
  export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
fi

# ---- build ------------------------------------------------------------------------------------
build="$root/build/gpu"
jobs="$(nproc)"
say "configure $build against $torch_root"
if ! cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DEMAKIT_BUILD_TESTS=ON -DEMAKIT_BUILD_BENCHMARKS=ON \
     -DEMAKIT_PACKAGE_TESTS=OFF -DEMAKIT_INSTALL=OFF -DEMAKIT_USE_CCACHE=OFF "${args[@]}" >"$out/configure.log" 2>&1; then
  say "FAILED: configure (see configure.log; without Catch2/fmt/benchmark run '$0 --stage' where they are installed and carry build/gpu-deps)"
  tail -n 30 "$out/configure.log"
  exit 1
fi
say "build emakit_cuda_tests and emakit_bench_ema_update (-j$jobs)"
if ! cmake --build "$build" --target emakit_cuda_tests emakit_bench_ema_update -j "$jobs" >"$out/build.log" 2>&1; then
  say "FAILED: build (see build.log)"
  grep -E 'error' "$out/build.log" | head -n 20
  exit 1
fi
say "built in $((SECONDS - started)) s"

# ---- tests ------------------------------------------------------------------------------------
status=0
tests="$build/tests/emakit_cuda_tests"
# failed_cases FILE: the test cases with a failure in a Catch2 console log, comma-separated (the
# name is the first line of the header block that precedes each failure).
failed_cases() {
  awk '/^-+$/ && length($0) >= 70 { header = !header; if (header) first = 1; next }
       header && first { name = $0; first = 0; next }
       /: FAILED:$/ && name != "" && !(name in seen) { seen[name] = 1; printf "%s%s", sep, name; sep = ", " }' "$1"
}
# run_tests WHAT FILE SECONDS SPEC...: one console run of the CUDA tests SPEC into OUT/FILE and one
# summary line; returns non-zero unless they passed.
run_tests() {
  local what="$1" file="$2" seconds="$3" rc
  shift 3
  timeout "$seconds" "$tests" "$@" -r console -d yes >"$out/$file" 2>&1
  rc=$?
  case $rc in
    0) say "$what: PASSED ($(grep -E '^(All tests passed|test cases)' "$out/$file" | tail -n1))" ;;
    77) say "$what: SKIPPED (no device seen by LibTorch, or checks that could not run here: see $file)"; return 1 ;;
    124) say "$what: FAILED (timed out after $seconds s; see $file)"; tail -n 20 "$out/$file"; return 1 ;;
    *) say "$what: FAILED (rc $rc; $(grep -E '^test cases' "$out/$file" | tail -n1); failed: $(failed_cases "$out/$file"); see $file)"
       tail -n 40 "$out/$file"; return 1 ;;
  esac
}
run_tests "CUDA tests (all but [race])" cuda_tests.txt "$(limit 120 60 45)" "~[race]" || status=1
run_tests "CUDA race tests ([race])" cuda_race_tests.txt "$(limit 90 30 45)" "[race]" || status=1
if grep -qh '^BYTES_PER_PARAM ' "$out/cuda_tests.txt" "$out/cuda_race_tests.txt" 2>/dev/null; then
  grep -h '^BYTES_PER_PARAM ' "$out/cuda_tests.txt" "$out/cuda_race_tests.txt" 2>/dev/null | tee -a "$summary"
else
  say "no BYTES_PER_PARAM lines: the GPU memory test ([memory]) did not run"
fi
# How many rounds of each race test provoked its race (a race no round provoked fails its test).
grep -h '^PROVOKED ' "$out/cuda_race_tests.txt" 2>/dev/null | tee -a "$summary"

# ---- benchmarks -------------------------------------------------------------------------------
bench="$build/benchmarks/emakit_bench_ema_update"
layouts="${EMAKIT_GPU_LAYOUTS:-many_small,resnet50,vit_b16,llm1b}"
"$bench" --emakit_dump_layouts="$out/layouts.json"
say "CUDA benchmarks ($layouts)"
timeout "$(limit 150 30)" "$bench" --emakit_device=cuda --emakit_layouts="$layouts" --benchmark_repetitions=3 \
  --benchmark_min_time=0.1 --benchmark_report_aggregates_only=true \
  --benchmark_out="$out/cuda_bench.json" --benchmark_out_format=json >"$out/cuda_bench.txt" 2>&1 \
  || { say "FAILED: CUDA benchmarks (rc $?; see cuda_bench.txt)"; status=1; }
say "Python peers on the GPU"
timeout "$(limit 100 5)" "$python" benchmarks/peers.py --device cuda --layouts "$out/layouts.json" --names "$layouts" \
  --out "$out/cuda_peers.json" --min-time 0.1 --repetitions 3 >"$out/cuda_peers.txt" 2>&1 \
  || { say "FAILED: peers (rc $?; see cuda_peers.txt)"; status=1; }
if [[ -s "$out/cuda_bench.json" && -s "$out/cuda_peers.json" ]]; then
  png=()
  "$python" -c 'import matplotlib' 2>/dev/null && png=(--out-png "$out/cuda_results.png")
  gpu="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
  "$python" benchmarks/report.py --cpp "$out/cuda_bench.json" --peers "$out/cuda_peers.json" \
    --out-md "$out/cuda_results.md" "${png[@]}" --machine "${gpu:-a CUDA GPU}" >/dev/null 2>"$out/report.log" \
    || say "report.py failed (see report.log)"
  [[ -s "$out/cuda_results.md" ]] && grep -E '^- ' "$out/cuda_results.md" | tee -a "$summary"
fi
# JUnit of every CUDA test (a second run of them), only with the time that is left.
if ((deadline - SECONDS >= 30)); then
  timeout "$((deadline - SECONDS - 5))" "$tests" -r junit -o "$out/cuda_tests.xml" >/dev/null 2>&1 || true
else
  say "no time left for the JUnit run (cuda_tests.xml)"
fi
say "done in $((SECONDS - started)) s; results in $out"
exit "$status"
