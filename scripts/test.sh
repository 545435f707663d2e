#!/usr/bin/env bash
# Check the C++ formatting, build emakit's tests and run them with ctest against both supported
# LibTorch versions, then the tests under the sanitizers and the checkpoint loader's fuzz target.
# Each build/<name> is the CMake preset <name> (CMakePresets.json: `cmake --preset NAME`,
# `cmake --build --preset NAME`, `ctest --preset NAME`):
#   format           clang-format 14 over the C++ files (scripts/format.sh --check), a few seconds
#   build/torch1.13  Debian's libtorch-dev (LibTorch 1.13), every label; the tests all-inline
#                    (emakit::header_only), the examples and docs samples against emakit::compiled
#   build/torch2     the LibTorch inside the PyPI torch wheel in the Python venv, with everything
#                    linked against the compiled mode (emakit::compiled); the docs samples, package
#                    and compile-fail tests run in torch1.13 only (EMAKIT_USER_BUILD_TESTS)
#   build/asan       the unit, conformance and distributed tests with ASan + UBSan, Debian's
#                    LibTorch, compiled mode (scripts/sanitize.sh)
#   build/fuzz       libFuzzer on the checkpoint loader, 60 s (scripts/fuzz.sh)
# Not run by default: build/torch1.13-compiled, the compiled mode on LibTorch 1.13 with every
# test (EMAKIT_VARIANTS=torch1.13-compiled).
# Installs what is missing first (Debian packages, the venv with scripts/requirements.txt).
#
# A green run proves what it says. A variant that was asked for and did not run fails the run:
# if the venv cannot be installed (PyPI unreachable, a bad pin) or the wheel cannot be built
# against, torch2 is FAILED, unless the user accepts it with EMAKIT_ALLOW_SKIP=torch2 (no
# network): then torch2 and the Python conformance tests are SKIPPED and the summary says so.
# Inside a variant, a test that cannot run here exits 77 (tests/skip.hpp) and ctest reports it
# skipped; the summary names every skipped test and fails on any that this machine does not
# explain (scripts/lib.sh, emakit_expected_skips; EMAKIT_EXPECTED_SKIPS overrides it, and .ci/run
# states CI's). Every test has a timeout (ctest TIMEOUT properties; EMAKIT_CTEST_TIMEOUT, default
# 900 s, for any test without one), so a hang fails its test instead of holding the run.
#
#   ./scripts/test.sh                       every variant, then the fuzz run (what CI runs)
#   ./scripts/test.sh --quick               a developer's edit loop: LibTorch 1.13, unit tests only,
#                                           no format check, no sanitizers, no fuzzing, no venv
#                                           install, no demo data; checks only the Debian
#                                           packages its build needs (scripts/lib.sh,
#                                           EMAKIT_BUILD_DEB_PACKAGES, and libcli11-dev)
#   EMAKIT_VARIANTS=torch1.13 ./scripts/test.sh
#       (known: format torch1.13 torch1.13-compiled torch2 asan; default: format torch1.13 torch2 asan)
#   EMAKIT_CTEST_ARGS="-L unit" ./scripts/test.sh
#   EMAKIT_FUZZ_SECONDS=0 ./scripts/test.sh   without the fuzz run (scripts/fuzz.sh)
#   EMAKIT_ALLOW_SKIP=torch2 ./scripts/test.sh   accept a run without PyPI (LibTorch 1.13 only)
#   EMAKIT_SEED_PACKAGES=1 ./scripts/test.sh  also installs the seed venv (luxonis-train,
#       nvalchemi-toolkit; scripts/requirements-seed.txt, ~3 min and 6.9 GB cold) and runs their
#       conformance generators for real; without it their recorded fixtures are replayed
#
# Each stage prints how long it took, and the summary says it again per run.
#
# Exit status: 0 when every variant asked for ran (or was allowed to be skipped), built and passed
# all its tests, and every skipped test was expected on this machine.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

quick=0
case "${1:-}" in
  "") ;;
  --quick)
    quick=1
    : "${EMAKIT_VARIANTS:=torch1.13}" "${EMAKIT_CTEST_ARGS:=-L unit}" "${EMAKIT_FUZZ_SECONDS:=0}"
    ;;
  *) emakit_die "unknown argument '$1' (known: --quick)" ;;
esac
started=$SECONDS

read -r -a variants <<<"${EMAKIT_VARIANTS:-format torch1.13 torch2 asan}"
read -r -a ctest_extra <<<"${EMAKIT_CTEST_ARGS:-}"
ctest_timeout="${EMAKIT_CTEST_TIMEOUT:-900}"
allow_skip=" ${EMAKIT_ALLOW_SKIP:-} "
for skip in ${EMAKIT_ALLOW_SKIP:-}; do
  [[ "$skip" == torch2 ]] || emakit_die "EMAKIT_ALLOW_SKIP: unknown variant '$skip' (known: torch2)"
done

if ((quick == 1)); then
  emakit_apt_ensure "${EMAKIT_BUILD_DEB_PACKAGES[@]}" libcli11-dev
else
  emakit_apt_ensure "${EMAKIT_DEB_PACKAGES[@]}"
  # The data of the demo tests (demo.*, built with the examples; --quick runs no demo test).
  emakit_fashion_mnist_ensure
fi

# The venv serves both runs: the conformance tests compare against the Python packages
# (EMAKIT_PYTHON), and the torch2 run links the wheel's LibTorch.
venv_rc=0
if ((quick == 1)); then
  EMAKIT_NO_INSTALL=1 emakit_venv_ensure || venv_rc=$?  # the venv if it is there; never installed
else
  emakit_venv_ensure || venv_rc=$?
fi
if ((venv_rc == 0)); then
  export EMAKIT_PYTHON="$EMAKIT_VENV/bin/python"
else
  unset EMAKIT_PYTHON
  if ((quick == 0)) && [[ "$allow_skip" == *" torch2 "* ]]; then
    emakit_warn "Python venv unavailable: $EMAKIT_PYTHON_STATUS; EMAKIT_ALLOW_SKIP=torch2: the LibTorch 2.x run and the Python conformance tests are skipped"
  elif ((quick == 0)); then
    emakit_warn "Python venv unavailable: $EMAKIT_PYTHON_STATUS; the torch2 variant and the conformance tests FAIL (EMAKIT_ALLOW_SKIP=torch2 accepts a run without PyPI)"
  fi
fi

# The seed packages' venv, only when asked: otherwise their conformance tests replay the
# fixtures recorded in tests/conformance/fixtures (./scripts/seed_fixtures.sh regenerates them).
unset EMAKIT_SEED_PYTHON
if [[ "${EMAKIT_SEED_PACKAGES:-0}" == 1 ]]; then
  seed_rc=0
  emakit_seed_venv_ensure || seed_rc=$?
  if ((seed_rc == 0)); then
    export EMAKIT_SEED_PYTHON="$EMAKIT_SEED_VENV/bin/python"
  else
    emakit_die "EMAKIT_SEED_PACKAGES=1 but the seed venv is unavailable: $EMAKIT_PYTHON_STATUS"
  fi
fi

emakit_say "set-up (Debian packages$( ((quick == 1)) || echo ', data'), venvs) took $((SECONDS - started)) s"
declare -A result=() took=()

# run_variant NAME DESCRIPTION CMAKE_ARGS...: configure, build and ctest the preset NAME
# (build/NAME; its cache reads EMAKIT_PYTHON and EMAKIT_SEED_PYTHON from the environment), with
# CMAKE_ARGS on top; records one summary line in result[NAME]; returns non-zero on failure.
run_variant() {
  local name="$1" what="$2"; shift 2
  local dir="build/$name" log t0=$SECONDS t1 t2
  emakit_say "[$name] configure ($what)"
  if ! cmake --preset "$name" -DCMAKE_BUILD_TYPE="$EMAKIT_BUILD_TYPE" "$@"; then
    result[$name]="FAILED: configure ($what)"
    return 1
  fi
  emakit_say "[$name] build (-j$EMAKIT_JOBS)"
  t1=$SECONDS
  if ! cmake --build --preset "$name" -j "$EMAKIT_JOBS"; then
    result[$name]="FAILED: build ($what)"
    return 1
  fi
  emakit_say "[$name] ctest (configure $((t1 - t0)) s, build $((SECONDS - t1)) s)"
  t2=$SECONDS
  log="$dir/ctest.log"
  local ctest_rc=0
  ctest --preset "$name" -j "$EMAKIT_JOBS" --timeout "$ctest_timeout" "${ctest_extra[@]}" 2>&1 \
    | tee "$log" || ctest_rc=$?
  took[$name]="configure $((t1 - t0)) s, build $((t2 - t1)) s, ctest $((SECONDS - t2)) s"
  result[$name]="$(emakit_ctest_summary "$log" "$ctest_rc" "$what")" || return 1
}

# run_script NAME SCRIPT [ARGS...]: runs scripts/SCRIPT ARGS, which ends with "==> [NAME] PASSED:
# ..." or "==> [NAME] FAILED: ..."; records that line in result[NAME]; returns non-zero on failure.
run_script() {
  local name="$1" script="$2" log="build/$1.summary.log" line
  shift 2
  mkdir -p build
  local rc=0 t0=$SECONDS
  "$EMAKIT_ROOT/scripts/$script" "$@" 2>&1 | tee "$log" || rc=$?
  took[$name]="$((SECONDS - t0)) s"
  line="$(grep -E "^==> \[$name\] (PASSED|FAILED)" "$log" | tail -n1 | sed -E "s/^==> \[$name\] //" || true)"
  if ((rc == 0)) && [[ "$line" == PASSED* ]]; then
    result[$name]="$line"
  else
    result[$name]="${line:-FAILED: scripts/$script exited $rc (see $log)}"
    [[ "${result[$name]}" == FAILED* ]] || result[$name]="FAILED: ${result[$name]}"
    return 1
  fi
}

status=0
ran=()
for variant in "${variants[@]}"; do
  case "$variant" in
    format)
      # The C++ files as .clang-format says (scripts/format.sh --check; ./scripts/format.sh fixes).
      ran+=("$variant")
      run_script format format.sh --check || status=1
      ;;
    torch1.13)
      ran+=("$variant")
      run_variant torch1.13 "Debian LibTorch 1.13" || status=1
      ;;
    torch1.13-compiled)
      ran+=("$variant")
      run_variant torch1.13-compiled "Debian LibTorch 1.13, compiled mode" || status=1
      ;;
    torch2)
      # Asked for and not run: SKIPPED only when the user allowed it, otherwise FAILED.
      not_run=""
      EMAKIT_WHEEL_STATUS=""
      if ((venv_rc != 0)); then
        not_run="${EMAKIT_PYTHON_STATUS:-no venv}"
      elif ! wheel_args="$(emakit_wheel_torch_args)"; then
        # emakit_wheel_torch_args ran in a subshell: ask again for the reason.
        emakit_wheel_torch_args >/dev/null || true
        not_run="${EMAKIT_WHEEL_STATUS:-torch wheel unusable}"
      fi
      if [[ -n "$not_run" ]]; then
        ran+=("$variant")
        if [[ "$allow_skip" == *" torch2 "* ]]; then
          result[torch2]="SKIPPED (EMAKIT_ALLOW_SKIP=torch2): $not_run"
        else
          result[torch2]="FAILED: not run: $not_run (EMAKIT_ALLOW_SKIP=torch2 accepts this)"
          status=1
        fi
        printf '==> [%s] %s\n' "$variant" "${result[$variant]}"
        continue
      fi
      mapfile -t args <<<"$wheel_args"
      torch_version="$("$EMAKIT_VENV/bin/python" -c 'import torch; print(torch.__version__)')"
      ran+=("$variant")
      # This variant builds everything against the compiled mode (emakit::compiled; the preset
      # says so); torch1.13 keeps the all-inline tests, so both pass the unit,
      # conformance, distributed and example tests. The preset leaves the docs samples, package
      # and compile-fail tests to torch1.13 (EMAKIT_USER_BUILD_TESTS=OFF).
      run_variant torch2 "PyPI torch $torch_version, compiled mode; docs, package, compile_fail: in torch1.13" \
        "${args[@]}" || status=1
      ;;
    asan)
      # The unit, conformance and distributed tests under AddressSanitizer +
      # UndefinedBehaviorSanitizer, compiled mode (scripts/sanitize.sh).
      ran+=("$variant")
      run_script asan sanitize.sh || status=1
      ;;
    *) emakit_die "unknown variant '$variant' (known: format torch1.13 torch1.13-compiled torch2 asan)" ;;
  esac
  printf '==> [%s] %s\n' "$variant" "${result[$variant]}"
done

# The checkpoint loader's fuzz target (libFuzzer, clang, ASan + UBSan), EMAKIT_FUZZ_SECONDS long
# (default 60); EMAKIT_FUZZ_SECONDS=0 leaves it out.
if [[ "${EMAKIT_FUZZ_SECONDS:-60}" != 0 ]]; then
  ran+=(fuzz)
  run_script fuzz fuzz.sh || status=1
fi

printf '\n==> emakit test summary (%d s in all)\n' "$((SECONDS - started))"
for variant in "${ran[@]}"; do
  printf '==>   %-10s %s\n' "$variant" "${result[$variant]}"
  [[ -n "${took[$variant]:-}" ]] && printf '==>   %-10s   took %s\n' "" "${took[$variant]}"
done
mapfile -t expected_skips < <(emakit_expected_skips)
printf '==>   skips expected on this machine: %s%s\n' "${expected_skips[*]:-none}" \
  "$([[ -n "${EMAKIT_EXPECTED_SKIPS+set}" ]] && echo ' (EMAKIT_EXPECTED_SKIPS)' || echo ' (scripts/lib.sh, emakit_expected_skips)')"
((quick == 0)) || printf '==> quick mode: LibTorch 1.13 unit tests only; the full run is ./scripts/test.sh\n'

if ((status == 0)); then
  printf '==> OVERALL: PASSED\n'
else
  printf '==> OVERALL: FAILED\n'
fi
exit "$status"
