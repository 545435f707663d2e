#!/usr/bin/env bash
# Fuzzes emakit's readers of untrusted files (tests/fuzz/fuzz_checkpoint.cpp: the checkpoint
# loader, the torch.save pickle rewrite and the snapshot reader) with libFuzzer: builds the target
# against Debian's LibTorch 1.13 (the archive check and the rewrite with clang, libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer; the loading after them with g++), writes the
# seed corpus (valid, truncated and bit-flipped checkpoints, torch.save pickles, snapshots), and
# runs for EMAKIT_FUZZ_SECONDS (default 60). Any crash, sanitizer report, leak or timeout fails
# the run; the input that caused it is left in build/fuzz/findings.
#
#   ./scripts/fuzz.sh
#   EMAKIT_FUZZ_SECONDS=1800 ./scripts/fuzz.sh
#   EMAKIT_FUZZ_BUILD=build/my-fuzz ./scripts/fuzz.sh     another build folder (and <it>-glue)
#
# The corpus grows in build/fuzz/corpus (kept between runs: later runs start from what earlier
# ones found). scripts/test.sh runs this after the test variants. The two builds are the presets
# fuzz-glue (build/fuzz-glue) and fuzz (build/fuzz) of CMakePresets.json.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

seconds="${EMAKIT_FUZZ_SECONDS:-60}"
dir="$(realpath -m "${EMAKIT_FUZZ_BUILD:-build/fuzz}")"

emakit_apt_ensure "${EMAKIT_BUILD_DEB_PACKAGES[@]}" clang libclang-rt-dev
# Two parts, two compilers (tests/fuzz/fuzz_checkpoint.cpp says why); the fuzz preset links
# build/fuzz-glue's library.
emakit_say "[fuzz] configure and build the loading part (g++, Debian LibTorch 1.13)"
cmake --preset fuzz-glue -B "$dir-glue" >/dev/null
cmake --build "$dir-glue" --target emakit_fuzz_glue -j "$EMAKIT_JOBS"
emakit_say "[fuzz] configure and build the fuzzer (clang, libFuzzer, ASan + UBSan)"
cmake --preset fuzz -B "$dir" -DEMAKIT_FUZZ_GLUE="$dir-glue/tests/fuzz/libemakit_fuzz_glue.a" >/dev/null
cmake --build "$dir" --target emakit_fuzz_checkpoint -j "$EMAKIT_JOBS"

fuzzer="$dir/tests/fuzz/emakit_fuzz_checkpoint"
mkdir -p "$dir/corpus" "$dir/findings"
EMAKIT_FUZZ_MAKE_CORPUS="$dir/seeds" "$fuzzer"
# A leak inside LibTorch itself is suppressed by name (tests/fuzz/lsan.supp says which and why).
# LibTorch is built without frame pointers: only the slow unwinder sees its functions' names.
export LSAN_OPTIONS="suppressions=$EMAKIT_ROOT/tests/fuzz/lsan.supp:print_suppressions=0"
export ASAN_OPTIONS="fast_unwind_on_malloc=0:detect_odr_violation=0:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
emakit_say "[fuzz] run ${seconds} s"
log="$dir/fuzz.log"
rc=0
"$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 \
  -artifact_prefix="$dir/findings/" "$dir/corpus" "$dir/seeds" >"$log" 2>&1 || rc=$?
stats="$(grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb):' "$log" |
         sed -E 's/^stat::([a-z_]+): +/\1=/' | paste -sd' ' - || true)"
cov="$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -n1 || true)"
if ((rc == 0)); then
  printf '==> [fuzz] PASSED: %s s, no crash (%s; %s; corpus %s files)\n' "$seconds" "$stats" "$cov" \
    "$(find "$dir/corpus" -type f | wc -l)"
else
  tail -n 60 "$log"
  printf '==> [fuzz] FAILED (exit %s): see %s and the input in %s\n' "$rc" "$log" "$dir/findings"
  exit 1
fi
