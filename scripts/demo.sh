#!/usr/bin/env bash
# The README's first command: what an EMA of the weights buys, on real data.
#
# Installs what is missing (the Debian packages of scripts/lib.sh, among them
# dataset-fashion-mnist and gnuplot-nox), decompresses Fashion-MNIST into
# build/data/fashion-mnist (once), builds examples/fashion_mnist.cpp against Debian's LibTorch
# 1.13 in build/demo (the preset demo of CMakePresets.json) and runs it: a small MLP trained on
# the CPU with noisy SGD, then the test accuracy and loss of the online weights, a fixed EMA, a
# warmup EMA and post-hoc EMAs for a sweep of sigma_rel (and the fixed and warmup EMAs themselves,
# synthesized from the same snapshots), as a table and as
# build/demo-out/{results.csv,curve.csv,results.png}.
# The run takes about 1.5 minutes on 2 cores (87 s measured on 2026-12-02, 387 steps/s; the first
# build adds about a minute).
#
#   ./scripts/demo.sh                        the default run (6 epochs, seed 0)
#   ./scripts/demo.sh --epochs 2 --seed 1    arguments go to the program (--help lists them)
#   ./scripts/demo.sh ssl [args]             instead: self-supervised learning with an EMA teacher
#                                            (examples/ssl_byol.cpp, emakit::TeacherStudent)
#   EMAKIT_DEMO_BUILD_DIR=build/other ./scripts/demo.sh
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$EMAKIT_ROOT"

emakit_apt_ensure "${EMAKIT_DEB_PACKAGES[@]}"
emakit_fashion_mnist_ensure

example=fashion_mnist
defaults=(--data "$EMAKIT_FASHION_MNIST_DIR" --out build/demo-out)
if [[ "${1:-}" == ssl ]]; then
  shift
  example=ssl_byol
  defaults=(--data "$EMAKIT_FASHION_MNIST_DIR")
fi

dir="${EMAKIT_DEMO_BUILD_DIR:-build/demo}"
emakit_say "configure $dir (Debian LibTorch 1.13, $EMAKIT_BUILD_TYPE)"
cmake --preset demo -B "$dir" -DCMAKE_BUILD_TYPE="$EMAKIT_BUILD_TYPE" >/dev/null
emakit_say "build emakit_example_$example (-j$EMAKIT_JOBS)"
cmake --build "$dir" -j "$EMAKIT_JOBS" --target "emakit_example_$example"
program="$dir/examples/emakit_example_$example"
args=("${defaults[@]}" "$@")
emakit_say "run $program ${args[*]}"
exec "$program" "${args[@]}"
