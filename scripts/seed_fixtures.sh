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
#                                              lightning_peer, lightly_peer)
#   ./scripts/seed_fixtures.sh luxonis_peer    one
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

stems=("$@")
((${#stems[@]} > 0)) || stems=(luxonis_peer nvalchemi_peer lightning_peer lightly_peer)
emakit_seed_venv_ensure || emakit_die "the seed venv is unavailable: $EMAKIT_PYTHON_STATUS"
python="$EMAKIT_SEED_VENV/bin/python"
fixtures=tests/conformance/fixtures
mkdir -p "$fixtures"
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
