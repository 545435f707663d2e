#!/usr/bin/env bash
# Regenerates the recorded fixtures of the seed packages' conformance generators
# (tests/conformance/fixtures/<stem>.tar.xz and <stem>.txt) with the real packages: makes the seed
# venv (scripts/requirements-seed.txt, cached like the first venv; ~3 min and 6.9 GB cold), runs
# each generator into a fresh folder and packs its output. <stem>.txt records the package
# versions (the same lines as the archive's versions.txt, each a pin of requirements-seed.txt),
# the sha256 of the archive (checked before ctest unpacks it), of the generator and of _common.py
# (a fixture whose generator changed is reported stale by ctest), the Python and ATen's CPU
# capability it ran with, and this command. Commit both files. A seed-packages run
# (EMAKIT_SEED_PACKAGES=1 ./scripts/test.sh) diffs its live output with the committed fixture
# and fails on drift (cmake/emakit_run_conformance_script.cmake).
#
#   ./scripts/seed_fixtures.sh                 every seed generator (luxonis_peer, nvalchemi_peer,
#                                              lightning_peer, lightly_peer, free_run_seed_peer)
#   ./scripts/seed_fixtures.sh luxonis_peer    one
#   ./scripts/seed_fixtures.sh roundtrip       the seed peers' interop round trips
#                                              (tests/conformance/fixtures/roundtrip/), after the
#                                              generators' fixtures they start from
#
# roundtrip: test_interop.cpp's "... round trip" tests import a seed peer's recorded file, go on
# in emakit and export; the real peer (tests/conformance/_peer_roundtrip.py, the seed venv) loads
# that export and goes on. Recording runs those tests with the seed venv in a configured build
# ($EMAKIT_BUILD, default build/torch2), which keeps the export and the peer's continuation as
# fixtures/roundtrip/<peer>.export.pt and <peer>.continued.pt; without the seed venv ctest checks
# that emakit's export is still that file and replays the continuation.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

stems=("$@")
((${#stems[@]} > 0)) || stems=(luxonis_peer nvalchemi_peer lightning_peer lightly_peer free_run_seed_peer)
emakit_seed_venv_ensure || emakit_die "the seed venv is unavailable: $EMAKIT_PYTHON_STATUS"
python="$EMAKIT_SEED_VENV/bin/python"
fixtures=tests/conformance/fixtures
mkdir -p "$fixtures"

if [[ "${stems[*]}" == roundtrip ]]; then
  build="${EMAKIT_BUILD:-build/torch2}"
  [[ -f "$build/CMakeCache.txt" ]] || emakit_die "no configured build at $build (set EMAKIT_BUILD)"
  cmake --build "$build" --target emakit_conformance_tests -j"$(nproc)"
  record="$EMAKIT_ROOT/$fixtures/roundtrip"
  rm -rf "$record"
  mkdir -p "$record"
  # The generators' data (their fixtures, unpacked), then the round trips with the real packages.
  ctest --test-dir "$build" -R '^conformance\.generate\.' --output-on-failure
  EMAKIT_SEED_PYTHON="$python" EMAKIT_RECORD_ROUNDTRIP="$record" \
    ctest --test-dir "$build" -R '^conformance\.test_interop$' --output-on-failure
  {
    printf '# Recorded seed round trips (test_interop.cpp), replayed by ctest without the seed venv.\n'
    printf '# Regenerate: ./scripts/seed_fixtures.sh roundtrip (python %s)\n' \
      "$("$python" -c 'import platform; print(platform.python_version())')"
    "$python" - <<'PY'
from importlib.metadata import version
for name in ("torch", "luxonis-train", "lightning", "nvalchemi-toolkit"):
    print(f"{name}=={version(name).split('+')[0]}")
PY
  } >"$record/versions.txt"
  for peer in luxonis_callback lightning nvalchemi_hook; do
    [[ -f "$record/$peer.export.pt" && -f "$record/$peer.continued.pt" ]] \
      || emakit_die "the $peer round trip recorded nothing (is its test named '... round trip ...'?)"
  done
  emakit_say "wrote $(ls "$record" | wc -l) files to $record"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for stem in "${stems[@]}"; do
  script="tests/conformance/$stem.py"
  [[ -f "$script" ]] || emakit_die "no generator $script"
  emakit_say "running $script with $python"
  (cd tests/conformance && "$python" "$stem.py" "$work/$stem") >"$work/$stem.log" 2>&1 \
    || { cat "$work/$stem.log"; emakit_die "$script failed"; }
  # Reproducible archives: sorted names, fixed owner and times.
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2000-01-01 00:00Z' \
      -C "$work" -cf - "$stem" | xz -9e >"$fixtures/$stem.tar.xz"
  {
    printf '# Recorded output of tests/conformance/%s.py with the real packages, replayed by ctest\n' "$stem"
    printf '# when the seed venv is not used. Regenerate: ./scripts/seed_fixtures.sh %s\n' "$stem"
    printf '# (python %s, ATen CPU capability %s)\n' \
      "$("$python" -c 'import platform; print(platform.python_version())')" \
      "$("$python" -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')"
    cat "$work/$stem/versions.txt"
    printf 'sha256 %s.tar.xz %s\n' "$stem" "$(sha256sum "$fixtures/$stem.tar.xz" | cut -d' ' -f1)"
    printf 'sha256 %s.py %s\n' "$stem" "$(sha256sum "$script" | cut -d' ' -f1)"
    printf 'sha256 _common.py %s\n' "$(sha256sum tests/conformance/_common.py | cut -d' ' -f1)"
  } >"$fixtures/$stem.txt"
  emakit_say "wrote $fixtures/$stem.tar.xz ($(stat -c %s "$fixtures/$stem.tar.xz") bytes) and $fixtures/$stem.txt"
done
