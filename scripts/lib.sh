# shellcheck shell=bash disable=SC2034  # variables used by the sourcing scripts
# Helpers shared by the scripts in scripts/ (test.sh, sanitize.sh, fuzz.sh, bench.sh, demo.sh,
# seed_fixtures.sh, format.sh; mutate.sh stands alone) and benchmarks/compile_time.sh. Source it;
# do not run it. What to build lives in CMakePresets.json (one configure, build and test preset
# per build/<name>): the scripts call `cmake --preset NAME` and add only what is known at run
# time (the wheel's location, a knob that was set).
#
# Environment knobs (all optional):
#   EMAKIT_VENV        Python venv for the PyPI torch wheel and the reference packages
#                      (default: $HOME/.cache/emakit/venv)
#   EMAKIT_JOBS        parallel build/test jobs (default: 2)
#   EMAKIT_BUILD_TYPE  CMake build type of scripts/test.sh's torch variants and scripts/demo.sh
#                      (default: Release; the other scripts set their own)
#   EMAKIT_NO_INSTALL  set to 1 to never call apt-get or pip (use what is there)

EMAKIT_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EMAKIT_VENV="${EMAKIT_VENV:-$HOME/.cache/emakit/venv}"
EMAKIT_JOBS="${EMAKIT_JOBS:-2}"
EMAKIT_BUILD_TYPE="${EMAKIT_BUILD_TYPE:-Release}"
EMAKIT_REQUIREMENTS="$EMAKIT_ROOT/scripts/requirements.txt"
# The seed packages (luxonis-train, nvalchemi-toolkit, lightning, lightly) pin a torch that
# cannot share the first venv: a second venv, made only when asked (EMAKIT_SEED_PACKAGES=1
# ./scripts/test.sh, ./scripts/seed_fixtures.sh). Cold: about 3 minutes and 6.9 GB (a CUDA torch
# wheel and ~240 packages); the default run replays the fixtures they recorded instead.
EMAKIT_SEED_VENV="${EMAKIT_SEED_VENV:-$HOME/.cache/emakit/seed-venv}"
EMAKIT_SEED_REQUIREMENTS="$EMAKIT_ROOT/scripts/requirements-seed.txt"

# Debian packages the tests' build needs: compiler, CMake, ccache, LibTorch 1.13, fmt, Catch2 v2,
# the Gloo headers (the distributed tests). scripts/sanitize.sh needs no more;
# `./scripts/test.sh --quick` adds CLI11 (the examples).
EMAKIT_BUILD_DEB_PACKAGES=(g++ make cmake ccache libtorch-dev libfmt-dev catch2 libgloo-dev)
# Everything the full run needs: the above, CLI11 for the examples, Google Benchmark, python3-venv
# for the reference packages, the Fashion-MNIST demo's data and plotting (dataset-fashion-mnist,
# gnuplot-nox), clang with its libFuzzer and sanitizer runtimes for scripts/fuzz.sh,
# clang-format 14 for scripts/format.sh, and valgrind for the cost label (benchmarks/cost: its
# callgrind.h when building, callgrind when counting).
EMAKIT_DEB_PACKAGES=("${EMAKIT_BUILD_DEB_PACKAGES[@]}" libcli11-dev libbenchmark-dev python3-venv
                     dataset-fashion-mnist gnuplot-nox clang libclang-rt-dev clang-format-14 valgrind)

# Where dataset-fashion-mnist installs its gzip'd IDX files, and where the demo (and its ctest,
# examples/CMakeLists.txt) reads them uncompressed.
EMAKIT_FASHION_MNIST_SOURCE=/usr/share/datasets/fashion-mnist
EMAKIT_FASHION_MNIST_DIR="$EMAKIT_ROOT/build/data/fashion-mnist"
EMAKIT_FASHION_MNIST_FILES=(train-images-idx3-ubyte train-labels-idx1-ubyte
                            t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)

emakit_say() { printf '==> %s\n' "$*"; }
emakit_warn() { printf '==> WARNING: %s\n' "$*" >&2; }
emakit_die() { printf '==> ERROR: %s\n' "$*" >&2; exit 1; }

# emakit_apt_ensure PKG...: install the packages dpkg does not report as installed; runs
# `apt-get update` only when something is missing.
emakit_apt_ensure() {
  local missing=() pkg
  for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$pkg")
    fi
  done
  ((${#missing[@]} == 0)) && return 0
  if [[ "${EMAKIT_NO_INSTALL:-0}" == 1 ]]; then
    emakit_die "missing Debian packages: ${missing[*]} (EMAKIT_NO_INSTALL=1)"
  fi
  command -v apt-get >/dev/null || emakit_die "missing packages ${missing[*]} and no apt-get"
  local sudo=()
  if ((EUID != 0)); then
    command -v sudo >/dev/null || emakit_die "missing packages ${missing[*]}; run as root or install sudo"
    sudo=(sudo)
  fi
  emakit_say "installing Debian packages: ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
}

# emakit_fashion_mnist_ensure: install dataset-fashion-mnist if missing and decompress its four
# files into $EMAKIT_FASHION_MNIST_DIR, each only when absent or older than its .gz (written to
# a temporary name first, so an interrupted run leaves no truncated file).
emakit_fashion_mnist_ensure() {
  local name src dst
  emakit_apt_ensure dataset-fashion-mnist
  mkdir -p "$EMAKIT_FASHION_MNIST_DIR"
  for name in "${EMAKIT_FASHION_MNIST_FILES[@]}"; do
    src="$EMAKIT_FASHION_MNIST_SOURCE/$name.gz"
    dst="$EMAKIT_FASHION_MNIST_DIR/$name"
    [[ -f "$src" ]] || emakit_die "$src is missing although dataset-fashion-mnist is installed"
    [[ -f "$dst" && ! "$dst" -ot "$src" ]] && continue
    emakit_say "decompressing $src -> $dst"
    if ! { gzip -dc "$src" >"$dst.tmp.$$" && mv -f "$dst.tmp.$$" "$dst"; }; then
      rm -f "$dst.tmp.$$"
      emakit_die "cannot decompress $src into $dst"
    fi
  done
}

# emakit_venv_ensure: create $EMAKIT_VENV and install scripts/requirements.txt into it, unless
# the stamp file already records this requirements file (and this python). Returns
#   0 ready, 2 PyPI unreachable (network), 1 any other failure.
# Sets EMAKIT_PYTHON_STATUS to a one-line reason when it does not return 0.
emakit_venv_ensure() { emakit_venv_ensure_at "$EMAKIT_VENV" "$EMAKIT_REQUIREMENTS"; }

# emakit_seed_venv_ensure: the same for $EMAKIT_SEED_VENV and scripts/requirements-seed.txt.
emakit_seed_venv_ensure() { emakit_venv_ensure_at "$EMAKIT_SEED_VENV" "$EMAKIT_SEED_REQUIREMENTS"; }

# emakit_venv_ensure_at VENV REQUIREMENTS: emakit_venv_ensure for any venv and requirements file.
emakit_venv_ensure_at() {
  local venv="$1" requirements="$2"
  local python="$venv/bin/python" stamp="$venv/.emakit-requirements.sha256"
  local want rel="${2#"$EMAKIT_ROOT"/}"
  want="$(cat "$requirements" <(python3 -c 'import sys; print(sys.version)' 2>/dev/null) \
          | sha256sum | cut -d' ' -f1)"
  if [[ -x "$python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    return 0
  fi
  if [[ "${EMAKIT_NO_INSTALL:-0}" == 1 ]]; then
    if [[ -x "$python" ]] && "$python" -c 'import torch' 2>/dev/null; then return 0; fi
    EMAKIT_PYTHON_STATUS="no usable venv at $venv (EMAKIT_NO_INSTALL=1)"
    return 1
  fi
  if [[ ! -x "$python" ]]; then
    emakit_say "creating the Python venv $venv"
    python3 -m venv "$venv" || { EMAKIT_PYTHON_STATUS="python3 -m venv failed"; return 1; }
  fi
  local log="$venv/.emakit-pip.log"
  emakit_say "installing $rel into $venv (log: $log)"
  if "$python" -m pip install --disable-pip-version-check --retries 2 --timeout 30 \
       -r "$requirements" >"$log" 2>&1; then
    printf '%s\n' "$want" >"$stamp"
    return 0
  fi
  # Only a failure to reach the index is "the network". pip's "(from versions: none)" alone is
  # not: it is also what a pin that PyPI does not have prints, and that is a bug to fail on.
  if grep -qiE 'NewConnectionError|Max retries exceeded|Temporary failure in name resolution|Name or service not known|Network is unreachable|ConnectTimeout|ReadTimeout|Connection (refused|reset)|ProxyError|SSLError' "$log"; then
    EMAKIT_PYTHON_STATUS="PyPI cannot be reached (pip install failed on the network; see $log)"
    return 2
  fi
  EMAKIT_PYTHON_STATUS="pip install -r $rel failed (see $log)"
  return 1
}

# emakit_debian_torch_args: CMake arguments selecting Debian's LibTorch 1.13, for a project that
# is not configured through the root's presets (benchmarks/compile_time.sh; the presets name the
# same folder in CMakePresets.json, the hidden preset debian-libtorch).
emakit_debian_torch_args() {
  local multiarch dir
  multiarch="$(gcc -print-multiarch 2>/dev/null || true)"
  dir="/usr/lib/${multiarch:-x86_64-linux-gnu}/cmake/Torch"
  if [[ -f "$dir/TorchConfig.cmake" ]]; then
    printf '%s\n' "-DTorch_DIR=$dir" "-DCMAKE_PREFIX_PATH="
  fi
}

# emakit_wheel_torch_args: CMake arguments selecting the LibTorch inside the venv's torch
# wheel, given on top of the presets that build against it (torch2, bench-torch2; Debian's
# LibTorch 1.13 is named in CMakePresets.json itself). Prints nothing and sets
# EMAKIT_WHEEL_STATUS when it cannot be used.
#  - CMAKE_PREFIX_PATH is the torch package root, not torch.utils.cmake_prefix_path
#    (share/cmake): TorchConfig's find_library would otherwise find Debian's libtorch first.
#  - A CUDA wheel's Caffe2 config needs a CUDA toolkit (nvcc) to configure; CUDA::cudart is
#    pointed at the wheel's own runtime so that the link does not resolve libtorch_cuda's
#    NCCL/cuBLAS in the toolkit's lib dir.
emakit_wheel_torch_args() {
  local python="$EMAKIT_VENV/bin/python" info root cuda cudart
  local args=()
  info="$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__)); print(torch.version.cuda or "")' 2>/dev/null)" \
    || { EMAKIT_WHEEL_STATUS="the venv's python cannot import torch"; return 1; }
  root="$(sed -n 1p <<<"$info")"
  cuda="$(sed -n 2p <<<"$info")"
  args=("-DCMAKE_PREFIX_PATH=$root" "-DTorch_DIR=$root/share/cmake/Torch")
  if [[ -n "$cuda" ]]; then
    if ! command -v nvcc >/dev/null && [[ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]]; then
      EMAKIT_WHEEL_STATUS="the torch wheel is built for CUDA $cuda and its CMake config needs a CUDA toolkit (nvcc); none found"
      return 1
    fi
    cudart="$(compgen -G "$root/../nvidia/cu*/lib/libcudart.so.*" | head -n1 || true)"
    [[ -n "$cudart" ]] || cudart="$(compgen -G "$root/../nvidia/cuda_runtime/lib/libcudart.so.*" | head -n1 || true)"
    [[ -n "$cudart" ]] && args+=("-DCUDA_cudart_LIBRARY=$(realpath "$cudart")")
  fi
  printf '%s\n' "${args[@]}"
}

# emakit_expected_skips: the ctest test names (globs, one a line) that may be skipped on this
# machine: $EMAKIT_EXPECTED_SKIPS (space-separated) when it is set (.ci/run states CI's), else
#  - cuda.all when no CUDA device is visible (tests/cuda exits 77), unless EMAKIT_EXPECT_CUDA=1;
#  - conformance.* when there is no Python for the conformance tests (EMAKIT_PYTHON unset) and the
#    user accepted that with EMAKIT_ALLOW_SKIP=torch2 (PyPI unreachable); a venv that failed to
#    install without it leaves those skips unexpected, so the run fails whichever variants ran.
# Any other skip fails the run: a test that cannot run is either explained here or a failure.
emakit_expected_skips() {
  if [[ -n "${EMAKIT_EXPECTED_SKIPS+set}" ]]; then
    tr ' ' '\n' <<<"$EMAKIT_EXPECTED_SKIPS" | sed '/^$/d'
    return 0
  fi
  if [[ "${EMAKIT_EXPECT_CUDA:-0}" != 1 ]] && ! nvidia-smi -L >/dev/null 2>&1; then
    printf '%s\n' 'cuda.all'
  fi
  if [[ -z "${EMAKIT_PYTHON:-}" && " ${EMAKIT_ALLOW_SKIP:-} " == *" torch2 "* ]]; then
    printf '%s\n' 'conformance.*'
  fi
}

# emakit_ctest_summary LOG RC WHAT: one line from a ctest log ("PASSED: 100% tests passed, ...
# [unit 59, ...] (WHAT)" or "FAILED: ..."), naming the skipped tests (ctest counts them among the
# passed) and the sanitizer reports, if any. A skipped test that emakit_expected_skips does not
# list fails the run, and so does a log without ctest's summary. Returns 0 for PASSED.
emakit_ctest_summary() {
  local log="$1" rc="$2" what="$3" totals labels name pattern ok reports
  local skipped=() expected=() unexpected=()
  totals="$(grep -E '^[0-9]+% tests passed' "$log" | tail -n1 || true)"
  # "unit = 48.65 sec*proc (59 tests)" -> "unit 59"
  labels="$(awk '/^Label Time Summary:/{on=1; next} on && NF==0 {on=0}
                 on && /\(([0-9]+) tests?\)/ {n=$0; sub(/.*\(/, "", n); sub(/ tests?\).*/, "", n);
                                              printf "%s%s %s", sep, $1, n; sep=", "}' "$log")"
  [[ -n "$totals" ]] || totals="no test summary (see $log)"
  mapfile -t skipped < <(grep -E '^[[:space:]]+[0-9]+ - .* \(Skipped\)$' "$log" \
                           | sed -E 's/^[[:space:]]+[0-9]+ - //; s/ \(Skipped\)$//' || true)
  mapfile -t expected < <(emakit_expected_skips)
  for name in "${skipped[@]}"; do
    ok=0
    for pattern in "${expected[@]}"; do
      # shellcheck disable=SC2053  # the pattern is a glob on purpose
      [[ "$name" == $pattern ]] && ok=1 && break
    done
    ((ok == 1)) || unexpected+=("$name")
  done
  if ((${#skipped[@]} > 0)); then
    totals="$totals; skipped, not run: $(IFS=,; printf '%s' "${skipped[*]}")"
  fi
  if ((${#unexpected[@]} > 0)); then
    totals="$totals; NOT EXPECTED on this machine (EMAKIT_EXPECTED_SKIPS: ${expected[*]:-none}): $(IFS=,; printf '%s' "${unexpected[*]}")"
  fi
  reports="$(grep -cE '^(==[0-9]+==ERROR: |SUMMARY: (Address|Leak|UndefinedBehavior)Sanitizer)|runtime error: ' "$log" || true)"
  ((reports == 0)) || totals="$totals; $reports sanitizer report line(s) in $log"
  if ((rc == 0)) && [[ "$totals" == 100%* ]] && ((${#unexpected[@]} == 0 && reports == 0)); then
    printf 'PASSED: %s%s (%s)\n' "$totals" "${labels:+ [$labels]}" "$what"
  else
    printf 'FAILED: %s%s (%s)\n' "$totals" "${labels:+ [$labels]}" "$what"
    return 1
  fi
}
