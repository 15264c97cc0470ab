#!/usr/bin/env bash
# Installs c2f's dependencies from Debian packages — the one list used by the README commands
# (scripts/test.sh, scripts/run.sh) and by CI (.ci/run).
# Packages already installed are not touched; `apt-get update` runs once, only when something is missing.
set -euo pipefail

PACKAGES=(
  # build
  g++ cmake make libeigen3-dev nlohmann-json3-dev
  # tests: GoogleTest, and PyTorch + numpy to regenerate and check the reference fixtures
  libgtest-dev python3 python3-numpy python3-torch
  # benchmarks: Google Benchmark, matplotlib for the plots, libtorch for the libtorch peer
  libbenchmark-dev python3-matplotlib libtorch-dev
  # hardening: clang with libFuzzer (the sanitizer runtimes of g++ come with it)
  clang libclang-rt-14-dev
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install-deps: missing ${missing[*]}; run as root or install sudo" >&2
    exit 1
  fi
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends "${missing[@]}"
