#!/usr/bin/env bash
# Build emakit's unit, conformance and distributed tests with AddressSanitizer +
# UndefinedBehaviorSanitizer (g++, Debian's LibTorch 1.13) in build/asan and run them:
# the preset asan of CMakePresets.json (cmake --preset asan; cmake --build --preset asan;
# ctest --preset asan, which runs -L 'unit|conformance|distributed'). They link the compiled mode
# (emakit::compiled, built in the same tree with the same flags, so emakit's code in libemakit.a
# is instrumented too): the same code as header-only, and each test TU compiles in about half the
# time (the header-only mode is tested by the LibTorch 1.13 variant of scripts/test.sh). The
# conformance tests need EMAKIT_PYTHON (the venv of scripts/test.sh, which exports it; the preset
# reads it from the environment); without it they are skipped, which the summary only accepts
# when emakit_expected_skips allows it (EMAKIT_ALLOW_SKIP=torch2 in scripts/test.sh).
#
#   ./scripts/sanitize.sh
#   EMAKIT_CTEST_ARGS="-R Soak" ./scripts/sanitize.sh      # extra ctest arguments
#
# Environment knobs (besides those of scripts/lib.sh: EMAKIT_JOBS, EMAKIT_NO_INSTALL); the
# defaults are the preset's:
#   EMAKIT_SANITIZE_BUILD_TYPE  CMake build type of build/asan (default: RelWithDebInfo)
#   EMAKIT_SANITIZE_OPT         its optimization/debug flags (default: "-O1 -g1": line tables for
#                               the sanitizers' stacks, -O1 to keep the instrumented run fast)
#   EMAKIT_CTEST_ARGS           extra ctest arguments (after -L ...)
#   EMAKIT_SANITIZE_LABELS      a ctest label regex that narrows the preset's filter
#                               (unit|conformance|distributed: what build/asan builds); e.g. unit
#   EMAKIT_SANITIZE_TIMEOUT     per-test ctest timeout in seconds (default: 900)
#
# Only emakit (include/emakit and libemakit.a), the LibTorch header code it inlines, and the
# tests are instrumented; LibTorch's libraries are Debian's uninstrumented build. The sanitizer runtimes
# still see LibTorch's allocations (ASan/LSan intercept malloc and operator new process-wide).
# No suppression is needed: with LibTorch 1.13 and g++ 12 no unit test raises a report, LibTorch's
# registries are still reachable at exit (so LeakSanitizer does not count them), and a block
# leaked on purpose (a preloaded library) was reported, so leak checking does run. If a LibTorch
# upgrade needs one, add a suppressions= file here naming LibTorch's function and why.
#
# Exit status: 0 when the build succeeded and every test it ran passed under the sanitizers (and
# every skipped one was expected: emakit_ctest_summary).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

build_type="${EMAKIT_SANITIZE_BUILD_TYPE:-RelWithDebInfo}"
opt_flags="${EMAKIT_SANITIZE_OPT:--O1 -g1}"
timeout="${EMAKIT_SANITIZE_TIMEOUT:-900}"
labels="${EMAKIT_SANITIZE_LABELS:-unit|conformance|distributed}"
read -r -a ctest_extra <<<"${EMAKIT_CTEST_ARGS:-}"
dir="build/asan"
name="asan"
what="ASan+UBSan, g++, Debian LibTorch 1.13, compiled mode"

# g++ brings libasan/libubsan/liblsan (libgcc-12-dev depends on them).
emakit_apt_ensure "${EMAKIT_BUILD_DEB_PACKAGES[@]}"

# The preset holds the sanitizer flags (-fsanitize=address,undefined -fno-sanitize-recover=undefined
# -fno-omit-frame-pointer, compile and link) and the runtime options, which its build and test
# presets inherit.
#  - halt_on_error / -fno-sanitize-recover: the first report fails the test.
#  - detect_leaks: LeakSanitizer at exit.
#  - check_initialization_order/strict_init_order: static-initialization-order bugs.
#  - detect_stack_use_after_return stays off (its fake stacks slow LibTorch-heavy tests a lot).
# On top of it, only the knobs that were set.
overrides=()
if [[ -n "${EMAKIT_SANITIZE_BUILD_TYPE:-}${EMAKIT_SANITIZE_OPT:-}" ]]; then
  overrides+=("-DCMAKE_BUILD_TYPE=$build_type" "-DCMAKE_CXX_FLAGS_${build_type^^}=$opt_flags")
fi
# EMAKIT_TEST_TIMEOUT (preset: 900): the instrumented tests run several times slower.
[[ -z "${EMAKIT_SANITIZE_TIMEOUT:-}" ]] || overrides+=("-DEMAKIT_TEST_TIMEOUT=$timeout")
# ctest applies a -L given on top of the test preset's label filter as well: it narrows it.
ctest_labels=()
[[ -z "${EMAKIT_SANITIZE_LABELS:-}" ]] || ctest_labels=(-L "$labels")

summary() { printf '==> [%s] %s\n' "$name" "$1"; }

emakit_say "[$name] configure ($what, $build_type: $opt_flags)"
if ! cmake --preset asan "${overrides[@]}"; then
  summary "FAILED: configure ($what)"
  exit 1
fi

emakit_say "[$name] build emakit_tests, emakit_conformance_tests, emakit_distributed_tests (-j$EMAKIT_JOBS)"
build_start=$SECONDS
if ! cmake --build --preset asan -j "$EMAKIT_JOBS"; then
  summary "FAILED: build ($what)"
  exit 1
fi
emakit_say "[$name] built in $((SECONDS - build_start)) s"

emakit_say "[$name] ctest -L '$labels'"
log="$dir/ctest.log"
test_start=$SECONDS
ctest_rc=0
ctest --preset asan "${ctest_labels[@]}" -j "$EMAKIT_JOBS" --timeout "$timeout" "${ctest_extra[@]}" 2>&1 \
  | tee "$log" || ctest_rc=$?
emakit_say "[$name] tests ran in $((SECONDS - test_start)) s"

line="$(emakit_ctest_summary "$log" "$ctest_rc" "$what")" && rc=0 || rc=$?
summary "$line"
exit "$rc"
