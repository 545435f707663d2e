#!/usr/bin/env bash
# Run emakit's update benchmarks against their roofline and the Python peers, in one run, and
# write a Markdown table and a plot:
#   build/bench-torch1.13, build/bench-torch2   emakit_bench_ema_update against each LibTorch
#                                               (the presets bench-torch1.13, bench-torch2)
#   $EMAKIT_BENCH_OUT (default build/bench)     <variant>-<round>-<layout>.json (Google Benchmark),
#                                               peers-<round>-<layout>.json, layouts.json,
#                                               results.md, results.png
# Installs what is missing first (Debian packages, the venv with scripts/requirements.txt).
#
#   ./scripts/bench.sh
#   EMAKIT_BENCH_LAYOUTS=many_small,resnet50 EMAKIT_BENCH_ROUNDS=1 ./scripts/bench.sh
#
# Knobs: EMAKIT_BENCH_OUT, EMAKIT_BENCH_VARIANTS ("torch1.13 torch2"), EMAKIT_BENCH_LAYOUTS
# (many_small,large_16m,resnet50,large_64m,vit_b16,large_256m), EMAKIT_BENCH_THREADS (1,all),
# EMAKIT_BENCH_ROUNDS (3), EMAKIT_BENCH_REPETITIONS (per round, 1), EMAKIT_BENCH_MIN_TIME (seconds
# per repetition, 0.2), EMAKIT_BENCH_GROUPS (none; e.g. 1,2,4: K EMAs of one model updated
# together and apart, and the Python peers keeping K, peers.py --groups),
# EMAKIT_BENCH_MACHINE (the machine's description in the report; default from lscpu),
# EMAKIT_BENCH_PUBLISH=1 (copy the table and plot to benchmarks/results/cpu.{md,png}; with
# EMAKIT_BENCH_PUBLISH_NAME=cpu-avx2, to benchmarks/results/cpu-avx2.{md,png}).
# The numbers are only as quiet as the machine: run it when nothing else does (see `uptime`).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

out="${EMAKIT_BENCH_OUT:-build/bench}"
read -r -a variants <<<"${EMAKIT_BENCH_VARIANTS:-torch1.13 torch2}"
layouts="${EMAKIT_BENCH_LAYOUTS:-many_small,large_16m,resnet50,large_64m,vit_b16,large_256m}"
threads="${EMAKIT_BENCH_THREADS:-1,all}"
rounds="${EMAKIT_BENCH_ROUNDS:-3}"
repetitions="${EMAKIT_BENCH_REPETITIONS:-1}"
min_time="${EMAKIT_BENCH_MIN_TIME:-0.2}"
groups="${EMAKIT_BENCH_GROUPS:-}"
publish_name="${EMAKIT_BENCH_PUBLISH_NAME:-cpu}"
[[ "$publish_name" =~ ^[A-Za-z0-9._-]+$ ]] \
  || emakit_die "EMAKIT_BENCH_PUBLISH_NAME='$publish_name': expected a file name of letters, digits, '.', '_' or '-'"

emakit_apt_ensure "${EMAKIT_DEB_PACKAGES[@]}"
venv_rc=0
emakit_venv_ensure || venv_rc=$?
((venv_rc == 0)) || emakit_die "the Python peers need the venv: $EMAKIT_PYTHON_STATUS"
python="$EMAKIT_VENV/bin/python"
mkdir -p "$out"

machine="${EMAKIT_BENCH_MACHINE:-}"
if [[ -z "$machine" ]]; then
  model="$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n1)"
  machine="$model, $(nproc) CPUs, $(free -g | awk '/^Mem:/ {print $2}') GiB RAM"
fi

# build VARIANT -> prints the benchmark binary's path
build() {
  local name="$1" dir="build/bench-$1" args=()
  case "$name" in
    torch1.13) ;;
    torch2)
      local wheel_args
      wheel_args="$(emakit_wheel_torch_args)" || emakit_die "the torch wheel cannot be used: run ./scripts/test.sh for the reason"
      mapfile -t args <<<"$wheel_args" ;;
    *) emakit_die "unknown variant '$name' (known: torch1.13 torch2)" ;;
  esac
  emakit_say "[$name] configure and build $dir" >&2
  cmake --preset "bench-$name" "${args[@]}" >"$out/configure-$name.log" 2>&1 \
    || emakit_die "configure failed (see $out/configure-$name.log)"
  cmake --build --preset "bench-$name" -j "$EMAKIT_JOBS" >"$out/build-$name.log" 2>&1 \
    || emakit_die "build failed (see $out/build-$name.log)"
  [[ -x "$dir/benchmarks/emakit_bench_ema_update" ]] \
    || emakit_die "no benchmark binary in $dir: is Google Benchmark (libbenchmark-dev) installed?"
  printf '%s\n' "$dir/benchmarks/emakit_bench_ema_update"
}

declare -A binary=()
for v in "${variants[@]}"; do binary[$v]="$(build "$v")"; done

emakit_say "load before the run: $(uptime | sed 's/.*load average/load average/')"
"${binary[${variants[0]}]}" --emakit_dump_layouts="$out/layouts.json"

# Rounds: each runs, layout by layout, the peers and every LibTorch build one after the other (in
# the reverse order in every other round), so that a peer and emakit measure one layout a minute
# or two apart, not the length of a whole pass over the layouts: a 2-vCPU guest's memory bandwidth
# drifted by up to 30% over minutes (the same case took 5.10 ms in one round and 6.57 in the next
# when a round ran each build over every layout in turn, 2026-12-03). Where each process's buffers
# lie is the other difference between a peer and emakit, which no order removes: report.py also
# compares emakit with ATen's lerp kernels on emakit's own buffers. It takes the medians of every
# round.
peers_json=()
cpp_json=()
IFS=, read -r -a layout_list <<<"$layouts"
# run_one ROUND LAYOUT WHO: runs the peers (WHO = peers) or a LibTorch build on one layout and adds
# its JSON to the lists.
run_one() {
  local round="$1" layout="$2" who="$3"
  if [[ "$who" == peers ]]; then
    "$python" benchmarks/peers.py --layouts "$out/layouts.json" --out "$out/peers-$round-$layout.json" \
      --names "$layout" --threads "$threads" --min-time "$min_time" --repetitions "$repetitions" --groups "$groups"
    peers_json+=("$out/peers-$round-$layout.json")
  else
    "${binary[$who]}" --emakit_layouts="$layout" --emakit_threads="$threads" \
      --emakit_groups="$groups" --benchmark_repetitions="$repetitions" --benchmark_min_time="$min_time" \
      --benchmark_out="$out/$who-$round-$layout.json" --benchmark_out_format=json
    cpp_json+=("$out/$who-$round-$layout.json")
  fi
}
rm -f "$out"/peers-*.json "$out"/torch*-*.json  # a file of an earlier run must not join this one's medians
for ((round = 1; round <= rounds; ++round)); do
  order=(peers "${variants[@]}")
  if ((round % 2 == 0)); then
    reversed=()
    for ((i = ${#order[@]} - 1; i >= 0; --i)); do reversed+=("${order[i]}"); done
    order=("${reversed[@]}")
  fi
  for layout in "${layout_list[@]}"; do
    for who in "${order[@]}"; do
      emakit_say "round $round of $rounds, $layout: $who"
      run_one "$round" "$layout" "$who"
    done
  done
done
emakit_say "load after the run: $(uptime | sed 's/.*load average/load average/')"

"$python" benchmarks/report.py --cpp "${cpp_json[@]}" --peers "${peers_json[@]}" \
  --out-md "$out/results.md" --out-png "$out/results.png" --machine "$machine"
emakit_say "wrote $out/results.md and $out/results.png"
# EMAKIT_BENCH_PUBLISH=1: also copy them to benchmarks/results/ (what the README shows).
if [[ "${EMAKIT_BENCH_PUBLISH:-0}" == 1 ]]; then
  mkdir -p benchmarks/results
  cp "$out/results.md" "benchmarks/results/$publish_name.md"
  cp "$out/results.png" "benchmarks/results/$publish_name.png"
  emakit_say "published to benchmarks/results/$publish_name.md and $publish_name.png"
fi
