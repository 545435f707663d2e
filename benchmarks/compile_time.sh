#!/usr/bin/env bash
# How much compile time EMAs add to a trainer TU, in each of emakit's three modes, in one run:
# builds benchmarks/compile_time/ (a standalone project that takes emakit in by add_subdirectory),
# runs each binary once, then times the exact compile command of each trainer TU (from
# compile_commands.json), interleaved round by round, and prints a Markdown table of the times,
# their ratios to the TU without emakit and the object size of each TU (bytes of the .o, and the
# text column of `size`):
#   base     trainer.cpp with LibTorch only (the reference): a Cloneable module with BatchNorm,
#            AdamW, four steps, torch::save/load
#   ema      + one WarmupEma (a shipped alias) through <emakit/emakit.hpp>; each mode: default
#            (emakit::emakit), compiled (emakit::compiled), header-only (emakit::header_only)
#   narrow   the same through aliases/checkpoint/format.hpp only; each mode
#   own x1   + one of the user's own aliases, Ema<LinearRamp, StepSchedule, ModuleStorage<NetImpl>>
#            (LinearRamp: a decay policy written in the TU), same work as the WarmupEma; each mode
#   own x2   + a second own alias (decay HalfLife), same work again; each mode
#   own x3   + a third (decay CosineRamp); each mode. x2 - x1 and x3 - x2: the cost of each extra alias
# A TU's time is what an edit of the trainer costs to rebuild (the implementation file of the
# default mode is not compiled again). A second table, in the same rounds: the clean build of a
# one-TU trainer, `cmake --build --target T -j2` after deleting T's objects, wall and CPU seconds,
# without emakit and in the default mode (where the trainer and emakit's implementation file
# compile in parallel). The emakit::compiled library's own build (a one-off cost) is timed once,
# before the rounds.
#
#   ./benchmarks/compile_time.sh                       Debian LibTorch 1.13, 3 rounds
#   ./benchmarks/compile_time.sh --runs 5 --out build/compile_time.md
#   ./benchmarks/compile_time.sh --torch wheel         the LibTorch in the PyPI wheel ($EMAKIT_VENV)
#   ./benchmarks/compile_time.sh --no-narrow --no-own  base and the WarmupEma TUs only
#   ./benchmarks/compile_time.sh --no-narrow --own1    base, the WarmupEma and the first own alias
#   ./benchmarks/compile_time.sh --by-header           also where the WarmupEma TU's extra goes: the
#                                                      compiler's memory by phase and by umbrella
#                                                      header (-ftime-report; repeats exactly; ~4 min)
#
# Knobs (the options win): EMAKIT_CT_RUNS (3), EMAKIT_CT_TORCH (debian|wheel), EMAKIT_CT_OUT (a
# file for the table), EMAKIT_CT_BUILD (build dir; default build/compile_time-<torch>),
# EMAKIT_CT_NARROW (1; 0 = --no-narrow), EMAKIT_CT_OWN (1; 0 = --no-own), EMAKIT_BUILD_TYPE
# (Release), EMAKIT_JOBS (for the untimed build). Compiles are timed one at a time (wall seconds),
# without ccache; a round runs every TU once, so a burst of load from elsewhere hits them alike.
# Quiet machines only (`uptime`).
# Time on 2 quiet cores (g++ 12, LibTorch 1.13, before issue 26's core): the untimed build ~4 min
# (the library ~35 s, then the 11 trainers at -j$EMAKIT_JOBS), then ~4 min per round of the 11
# TUs (~1.5 min with --no-own): --runs 1 ~9 min, the default 3 rounds ~17 min. With two other
# builds on the machine (load average 5), --runs 1 took 20 min.
#
# Exit status: non-zero when a configure, build, binary or timed compile fails.
set -euo pipefail
# The environment knobs that change the result, as given (before lib.sh fills in its defaults),
# belong in the recorded command.
knobs=""
for knob in EMAKIT_CT_RUNS EMAKIT_CT_TORCH EMAKIT_CT_NARROW EMAKIT_CT_OWN EMAKIT_BUILD_TYPE EMAKIT_VENV; do
  if [[ -n "${!knob:-}" ]]; then knobs+="$knob=$(printf '%q' "${!knob}") "; fi
done
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/lib.sh"
cd "$EMAKIT_ROOT"

invocation="$knobs$(printf '%q ' "./benchmarks/compile_time.sh" "$@")"
runs="${EMAKIT_CT_RUNS:-3}"
torch="${EMAKIT_CT_TORCH:-debian}"
out_file="${EMAKIT_CT_OUT:-}"
build="${EMAKIT_CT_BUILD:-}"
narrow="${EMAKIT_CT_NARROW:-1}"
own="${EMAKIT_CT_OWN:-1}"
own1_only=0
by_header=0
while (($# > 0)); do
  case "$1" in
    --runs) (($# >= 2)) || emakit_die "--runs needs a number"; runs="$2"; shift 2 ;;
    --torch) (($# >= 2)) || emakit_die "--torch needs debian or wheel"; torch="$2"; shift 2 ;;
    --wheel) torch=wheel; shift ;;
    --out) (($# >= 2)) || emakit_die "--out needs a file"; out_file="$2"; shift 2 ;;
    --build-dir) (($# >= 2)) || emakit_die "--build-dir needs a directory"; build="$2"; shift 2 ;;
    --no-narrow) narrow=0; shift ;;
    --no-own) own=0; shift ;;
    --own1) own1_only=1; shift ;;
    --by-header) by_header=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) emakit_die "unknown argument '$1' (known: --runs N, --torch debian|wheel, --wheel, --out FILE, --build-dir DIR, --no-narrow, --no-own, --own1, --by-header)" ;;
  esac
done
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || emakit_die "the number of runs must be a positive integer, not '$runs'"
build="${build:-build/compile_time-$torch}"
invocation="${invocation% }"

# ccache out of the way: the project configures emakit without its launcher (EMAKIT_USE_CCACHE=OFF),
# and this keeps a compiler symlinked to ccache (/usr/lib/ccache) from caching anyway.
export CCACHE_DISABLE=1

emakit_apt_ensure g++ binutils make cmake libtorch-dev libfmt-dev jq
case "$torch" in
  debian) mapfile -t torch_args < <(emakit_debian_torch_args) ;;
  wheel)
    wheel_args="$(emakit_wheel_torch_args)" || {
      emakit_wheel_torch_args >/dev/null || true  # it ran in a subshell: ask again for the reason
      emakit_die "the torch wheel in $EMAKIT_VENV cannot be used: ${EMAKIT_WHEEL_STATUS:-unknown reason} (./scripts/test.sh installs the venv)"
    }
    mapfile -t torch_args <<<"$wheel_args" ;;
  *) emakit_die "unknown --torch '$torch' (known: debian wheel)" ;;
esac

started=$SECONDS
mkdir -p "$build"
log_dir="$build/logs"
mkdir -p "$log_dir"
emakit_say "configure $build ($torch LibTorch, $EMAKIT_BUILD_TYPE)"
cmake -S benchmarks/compile_time -B "$build" -DCMAKE_BUILD_TYPE="$EMAKIT_BUILD_TYPE" \
  -DCMAKE_CXX_COMPILER_LAUNCHER= "${torch_args[@]}" >"$log_dir/configure.log" 2>&1 \
  || emakit_die "configure failed (see $log_dir/configure.log)"
torch_version="$(sed -n 's/^-- emakit: LibTorch \([^ ]*\) at \(.*\)$/\1 (\2)/p' "$log_dir/configure.log" | tail -n1)"
fmt_line="$(sed -n 's/^-- emakit: fmt //p' "$log_dir/configure.log" | tail -n1)"

# The library first and alone, from clean, one compile at a time: its build is the one-off cost
# of the compiled mode, comparable with the per-TU times below.
cmake --build "$build" --target clean >/dev/null
emakit_say "build emakit::compiled (-j1, timed)"
t0=$EPOCHREALTIME
cmake --build "$build" --target emakit_compiled -j 1 >"$log_dir/build-library.log" 2>&1 \
  || emakit_die "building emakit::compiled failed (see $log_dir/build-library.log)"
library_s="$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')"
library_file="$(find "$build" -name 'libemakit.a' -print -quit)"
emakit_say "emakit::compiled took $library_s s ($(du -h "$library_file" | cut -f1) $library_file)"

# name | TU | mode | target
tus=("base|trainer without emakit|-|trainer_base")
# add_modes NAME "TU label": the TU in each mode
add_modes() {
  tus+=("$1-d|$2|default|trainer_${1%%-*}_default" "$1-c|$2|compiled|trainer_${1%%-*}_compiled"
        "$1-h|$2|header-only|trainer_${1%%-*}_header_only")
}
add_modes ema "trainer + a shipped alias (\`WarmupEma\`), \`<emakit/emakit.hpp>\`"
if [[ "$narrow" == 1 ]]; then add_modes narrow "trainer + a shipped alias, three headers"; fi
if [[ "$own" == 1 ]]; then
  add_modes own1 "trainer + the own alias \`Ema<LinearRamp, StepSchedule, ModuleStorage<NetImpl>>\`"
  if [[ "$own1_only" == 0 ]]; then
    add_modes own2 "trainer + own alias x2 (+ \`HalfLife\`)"
    add_modes own3 "trainer + own alias x3 (+ \`CosineRamp\`)"
  fi
fi
# The clean builds: name | label | target
clean=("base|trainer without emakit|trainer_base"
       "ema-d|+ a shipped alias (\`WarmupEma\`), default mode|trainer_ema_default")
if [[ "$own" == 1 ]]; then clean+=("own1-d|+ the own alias, default mode|trainer_own1_default"); fi
targets=()
for entry in "${tus[@]}"; do targets+=("$(cut -d'|' -f4 <<<"$entry")"); done

emakit_say "build the ${#targets[@]} trainers (-j$EMAKIT_JOBS, untimed; also warms the page cache)"
cmake --build "$build" -j "$EMAKIT_JOBS" --target "${targets[@]}" >"$log_dir/build.log" 2>&1 \
  || emakit_die "build failed (see $log_dir/build.log)"

# Each binary once, in a scratch directory (they write model.pt and ema.pt where they run).
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
declare -A dir=() cmd=() obj=() label=() times=()
names=()
for entry in "${tus[@]}"; do
  IFS='|' read -r name tu mode target <<<"$entry"
  names+=("$name")
  label[$name]="$tu | $mode"
  binary="$build/$target"
  [[ -x "$binary" ]] || emakit_die "no binary $binary after the build"
  mkdir -p "$scratch/$name"
  (cd "$scratch/$name" && "$EMAKIT_ROOT/$binary") >"$log_dir/run-$name.log" 2>&1 \
    || emakit_die "$target failed when run (see $log_dir/run-$name.log)"
  emakit_say "ran $target: $(grep -m1 -E '^Ema\(' "$log_dir/run-$name.log" || echo 'ok')"

  # Its compile command, as the build ran it: the entry whose -o names this target's object.
  object="CMakeFiles/$target.dir/trainer.cpp.o"
  mapfile -t found < <(jq -r --arg o "$object" \
    '.[] | select(.command | contains(" -o " + $o + " ")) | .directory, .command' "$build/compile_commands.json")
  ((${#found[@]} == 2)) || emakit_die "no single compile command for $object in $build/compile_commands.json"
  dir[$name]="${found[0]}"
  cmd[$name]="${found[1]}"
  obj[$name]="${found[0]}/$object"
  [[ "${cmd[$name]}" != *ccache* ]] || emakit_die "the compile command of $target goes through ccache: ${cmd[$name]}"
done
compiler_path="$(read -r -a words <<<"${cmd[base]}"; printf '%s' "${words[0]}")"
compiler="$("$compiler_path" --version | head -n1) ($compiler_path)"
opt_level="$(grep -oE '(^| )-O[0-9sgz]?( |$)' <<<"${cmd[base]}" | tr -d ' ' | paste -sd' ' - || true)"

load_before="$(uptime | sed 's/.*load average: //')"
emakit_say "load average before the rounds: $load_before"
declare -A clean_wall=() clean_cpu=()
for ((round = 1; round <= runs; ++round)); do
  line=""
  for name in "${names[@]}"; do
    t0=$EPOCHREALTIME
    (cd "${dir[$name]}" && eval "${cmd[$name]}") >"$log_dir/compile-$name.log" 2>&1 \
      || emakit_die "compiling ${label[$name]} failed (see $log_dir/compile-$name.log)"
    s="$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')"
    times[$name]+="$s "
    line+=" $name $s s,"
  done
  for entry in "${clean[@]}"; do
    IFS='|' read -r name _ target <<<"$entry"
    find "$build/CMakeFiles/$target.dir" -name '*.o' -delete
    rm -f "$build/$target"
    TIMEFORMAT='%R %U %S'
    { time cmake --build "$build" --target "$target" -j 2 >"$log_dir/clean-$name.log" 2>&1; } 2>"$log_dir/clean-$name.time" \
      || emakit_die "the clean build of $target failed (see $log_dir/clean-$name.log)"
    read -r wall user sys <"$log_dir/clean-$name.time"
    clean_wall[$name]+="$wall "
    clean_cpu[$name]+="$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.2f", u + s }') "
    line+=" clean $name ${wall} s,"
  done
  emakit_say "round $round of $runs:${line%,}"
done
load_after="$(uptime | sed 's/.*load average: //')"
emakit_say "load average after the rounds: $load_after"

# --by-header: where the default-mode TU's extra goes, in the compiler's own memory accounting
# (GGC megabytes of -ftime-report: the same for the same compiler, flags and headers on every run,
# where the seconds above move by a tenth). First by phase, the base TU against the WarmupEma TU
# (their exact commands); then by header: <torch/torch.h> and the umbrella's headers added one at
# a time in its order, each step -fsyntax-only (parsing and the templates the headers themselves
# instantiate; code generation is the phase table's).
by_header_table=""
if [[ "$by_header" == 1 ]]; then
  # ggc COMMAND... -> "parsing deferred generate total" in MB, from -ftime-report's memory column
  ggc() {
    "$@" -ftime-report 2>&1 >/dev/null | awk '
      function mb(s) { v = s + 0; if (s ~ /k$/) v /= 1024; if (s ~ /G$/) v *= 1024; return v }
      /phase parsing/ { p = mb($(NF - 2)) } /phase lang. deferred/ { d = mb($(NF - 2)) }
      /phase opt and generate/ { g = mb($(NF - 2)) } /^ TOTAL/ { t = mb($NF) }
      END { if (t == 0) exit 1; printf "%.0f %.0f %.0f %.0f", p, d, g, t }'
  }
  emakit_say "by phase and by header (compiler memory, -ftime-report)"
  read -r -a base_words <<<"${cmd[base]}"
  read -r -a ema_words <<<"${cmd[ema-d]}"
  base_phases="$(cd "${dir[base]}" && ggc "${base_words[@]}")" || emakit_die "-ftime-report gave no figures for the base TU"
  ema_phases="$(cd "${dir[ema-d]}" && ggc "${ema_words[@]}")" || emakit_die "-ftime-report gave no figures for the WarmupEma TU"
  # The WarmupEma TU's flags without its output and input: -fsyntax-only of a file of includes.
  flags=()
  skip=0
  for w in "${ema_words[@]:1}"; do
    if ((skip)); then skip=0; continue; fi
    case "$w" in -o | -c) skip=1 ;; *) flags+=("$w") ;; esac
  done
  probe="$scratch/by_header.cpp"
  # The umbrella's headers, not the implementation it includes for EMAKIT_IMPLEMENTATION.
  mapfile -t umbrella < <(sed -n 's/^#include <\(emakit\/[^>]*\)>$/\1/p' include/emakit/emakit.hpp | grep -v '^emakit/implementation')
  rows=""
  includes="#include <torch/torch.h>"
  previous=""
  for header in "" "${umbrella[@]}"; do
    [[ -z "$header" ]] || includes+=$'\n'"#include <$header>"
    printf '%s\nint main() {}\n' "$includes" >"$probe"
    read -r p d _ t <<<"$(ggc "$compiler_path" "${flags[@]}" -fsyntax-only "$probe")" \
      || emakit_die "-fsyntax-only of <torch/torch.h> and the umbrella's headers up to ${header:-none} failed"
    if [[ -z "$header" ]]; then
      rows+="| \`<torch/torch.h>\` alone | $t | | $p | $d |"$'\n'
    else
      rows+="| + \`<$header>\` | $t | +$((t - previous)) | $p | $d |"$'\n'
    fi
    previous=$t
  done
  by_header_table="$(
    read -r bp bd bg bt <<<"$base_phases"
    read -r ep ed eg et <<<"$ema_phases"
    printf '| compiler memory, MB (GGC, -ftime-report) | parsing | deferred (templates instantiated at the end of the TU) | optimisation and code generation | total |\n'
    printf '|---|---:|---:|---:|---:|\n'
    printf '| trainer without emakit | %s | %s | %s | %s |\n' "$bp" "$bd" "$bg" "$bt"
    printf '| + a shipped alias (`WarmupEma`), default mode | %s | %s | %s | %s |\n' "$ep" "$ed" "$eg" "$et"
    printf '| difference | %+d | %+d | %+d | %+d (%s) |\n' $((ep - bp)) $((ed - bd)) $((eg - bg)) $((et - bt)) \
      "$(awk -v a="$et" -v b="$bt" 'BEGIN { printf "%.3fx", a / b }')"
    printf '\n| `-fsyntax-only`, headers added in the umbrella'"'"'s order | total MB | added MB | parsing MB | deferred MB |\n'
    printf '|---|---:|---:|---:|---:|\n'
    printf '%s' "$rows"
  )"
fi

# Each TU's object as the last round left it (the same command each round): its bytes, and the
# text column of `size` (the machine code, without symbols, debug info or relocations).
declare -A obj_bytes=() text_bytes=()
for name in "${names[@]}"; do
  obj_bytes[$name]="$(stat -c %s "${obj[$name]}")"
  text_bytes[$name]="$(size "${obj[$name]}" | awk 'NR == 2 { print $1 }')"
  [[ "${text_bytes[$name]}" =~ ^[0-9]+$ ]] || emakit_die "size gave no text column for ${obj[$name]}"
done

# stats "T1 T2 ..." -> "min median"
stats() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END {
  m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.2f %.2f", v[1], m }'; }
read -r base_min base_med <<<"$(stats "${times[base]}")"

table="$(
  printf '## Compile time of a trainer TU with and without emakit\n\n'
  printf '| TU | mode | min s | median s | ratio to base (median) | ratio to base (min) | object bytes | text bytes |\n'
  printf '|---|---|---:|---:|---:|---:|---:|---:|\n'
  for name in "${names[@]}"; do
    read -r mn md <<<"$(stats "${times[$name]}")"
    printf '| %s | %.2f | %.2f | %s | %s | %s | %s |\n' "${label[$name]}" "$mn" "$md" \
      "$(awk -v a="$md" -v b="$base_med" 'BEGIN { printf "%.2fx", a / b }')" \
      "$(awk -v a="$mn" -v b="$base_min" 'BEGIN { printf "%.2fx", a / b }')" \
      "${obj_bytes[$name]}" "${text_bytes[$name]}"
  done
  printf '\n'
  # shellcheck disable=SC2016  # the backquotes are Markdown
  printf '| clean build of a one-TU trainer, `cmake --build -j2` | wall s (median) | ratio to base (wall) | CPU s (median) | ratio to base (CPU) |\n'
  printf '|---|---:|---:|---:|---:|\n'
  read -r _ clean_base_wall <<<"$(stats "${clean_wall[base]}")"
  read -r _ clean_base_cpu <<<"$(stats "${clean_cpu[base]}")"
  for entry in "${clean[@]}"; do
    IFS='|' read -r name what _ <<<"$entry"
    read -r _ w <<<"$(stats "${clean_wall[$name]}")"
    read -r _ c <<<"$(stats "${clean_cpu[$name]}")"
    printf '| %s | %.2f | %s | %.2f | %s |\n' "$what" "$w" \
      "$(awk -v a="$w" -v b="$clean_base_wall" 'BEGIN { printf "%.2fx", a / b }')" "$c" \
      "$(awk -v a="$c" -v b="$clean_base_cpu" 'BEGIN { printf "%.2fx", a / b }')"
  done
  printf '\n'
  if [[ "$own" == 1 && "$own1_only" == 0 ]]; then
    for mode in d c h; do
      r1="$(read -r _ md <<<"$(stats "${times[own1-$mode]}")"; echo "$md")"
      r2="$(read -r _ md <<<"$(stats "${times[own2-$mode]}")"; echo "$md")"
      r3="$(read -r _ md <<<"$(stats "${times[own3-$mode]}")"; echo "$md")"
      printf -- '- each extra own alias, %s (median ratios): x2 - x1 = %s, x3 - x2 = %s; objects +%s and +%s bytes\n' \
        "$(case $mode in d) echo default ;; c) echo compiled ;; *) echo header-only ;; esac)" \
        "$(awk -v a="$r2" -v b="$r1" -v r="$base_med" 'BEGIN { printf "%+.2fx", (a - b) / r }')" \
        "$(awk -v a="$r3" -v b="$r2" -v r="$base_med" 'BEGIN { printf "%+.2fx", (a - b) / r }')" \
        "$((obj_bytes[own2-$mode] - obj_bytes[own1-$mode]))" "$((obj_bytes[own3-$mode] - obj_bytes[own2-$mode]))"
    done
  fi
  if [[ -n "$by_header_table" ]]; then printf '%s\n\n' "$by_header_table"; fi
  printf -- '- emakit::compiled library, built once (a one-off cost, -j1): %s s, %s\n' "$library_s" \
    "$(stat -c %s "$library_file" | awk '{ printf "%.0f KiB", $1 / 1024 }')"
  printf -- '- %s timed compiles per TU, interleaved by round, wall seconds, one at a time, no ccache\n' "$runs"
  printf -- '- LibTorch %s; fmt %s\n' "$torch_version" "$fmt_line"
  printf -- '- compiler: %s; %s (CMAKE_BUILD_TYPE=%s)\n' "$compiler" "${opt_level:-no -O flag}" "$EMAKIT_BUILD_TYPE"
  printf -- '- machine: %s, %s CPUs, load average %s before the rounds, %s after; emakit %s\n' \
    "$(lscpu | sed -n 's/^Model name:[[:space:]]*//p' | head -n1)" "$(nproc)" "$load_before" "$load_after" \
    "$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- include src CMakeLists.txt 2>/dev/null || echo ' + local changes')"
  printf -- '- date: %s\n' "$(date -u '+%Y-%m-%d %H:%M UTC')"
  # shellcheck disable=SC2016  # the backquotes are Markdown
  printf -- '- made by: `%s`\n' "$invocation"
)"
printf '\n%s\n\n' "$table"
if [[ -n "$out_file" ]]; then
  mkdir -p "$(dirname "$out_file")"
  printf '%s\n' "$table" >"$out_file"
  emakit_say "wrote $out_file"
fi
emakit_say "took $((SECONDS - started)) s in all"
