#!/usr/bin/env bash
# Build the examples against Debian's LibTorch 1.13 and run the example trainer.
# Installs the Debian packages it needs first. Arguments go to the trainer:
#   ./scripts/demo.sh [steps] [seed]
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

emakit_apt_ensure "${EMAKIT_DEB_PACKAGES[@]}"

mapfile -t torch_args < <(emakit_debian_torch_args)
dir=build/demo
emakit_say "configure $dir (Debian LibTorch 1.13, $EMAKIT_BUILD_TYPE)"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE="$EMAKIT_BUILD_TYPE" \
  -DEMAKIT_BUILD_TESTS=OFF -DEMAKIT_BUILD_EXAMPLES=ON "${torch_args[@]}" >/dev/null
emakit_say "build emakit_example_trainer (-j$EMAKIT_JOBS)"
cmake --build "$dir" -j "$EMAKIT_JOBS" --target emakit_example_trainer
emakit_say "run $dir/examples/emakit_example_trainer $*"
exec "$dir/examples/emakit_example_trainer" "$@"
