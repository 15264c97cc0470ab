#!/usr/bin/env bash
# Installs c2f's dependencies from Debian packages — the one list used by the README commands
# (scripts/test.sh, scripts/run.sh) and by CI (.ci/run).
# Packages already installed are not touched; `apt-get update` runs once, only when something is missing.
# Then, when npm is there, the ONNX Runtime peer's one npm package (benchmarks/ort/package-lock.json).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

PACKAGES=(
  # build
  g++ cmake make ninja-build libeigen3-dev nlohmann-json3-dev
  # tests: GoogleTest, and PyTorch + numpy to regenerate and check the reference fixtures
  libgtest-dev python3 python3-numpy python3-torch
  # benchmarks: Google Benchmark, matplotlib for the plots, libtorch for the libtorch peer, and OpenBLAS
  # (pthread build): Debian makes it the libblas.so.3 alternative, so libtorch and python3-torch — the
  # peers — run their GEMMs on an optimised BLAS instead of the reference one (libblas3)
  libbenchmark-dev python3-matplotlib libtorch-dev libopenblas0-pthread
  # jemalloc, preloaded into the PyTorch and libtorch peers' commands only (benchmarks/report/blas.py): with
  # glibc's malloc, PyTorch maps its large per-call buffers (nn.MultiheadAttention's scores: 128 MiB at
  # L = 2048) afresh and page-faults them in on every call — most of its time on a small VM; PyTorch's and
  # Intel's CPU tuning guides run it with jemalloc or tcmalloc. Without it the peers fall back to glibc's
  # malloc, with a note
  libjemalloc2
  # comparing two benchmark runs: Google Benchmark's compare.py (/usr/share/benchmark/), which needs scipy
  libbenchmark-tools python3-scipy
  # the ONNX Runtime peer (benchmarks/ort_peer.py): python3-onnx writes its graphs; the runtime itself is
  # the npm package onnxruntime-node (install_ort below), skipped when npm is missing
  python3-onnx
  # the machine's rooflines (bench_machine): oneDNN's matmul as a GEMM reference point (it runs on OpenMP)
  libdnnl-dev
  # hardening: clang with libFuzzer (the sanitizer runtimes of g++ come with it); clang-format 14 for the
  # format check (docs.format: scripts/check_format.py)
  clang libclang-rt-14-dev clang-format-14
  # c2f::dist (sequence-parallel layers) and its tests under mpirun: Open MPI
  libopenmpi-dev openmpi-bin
  # the Python module `c2f` (python/, CMake option C2F_PYTHON): Python's headers, pybind11, and pytest for
  # its tests
  python3-dev pybind11-dev python3-pytest
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# The BLAS behind libblas.so.3 (what libtorch and python3-torch load): Debian's alternatives system picks
# OpenBLAS (priority 100) over the reference BLAS (10) unless an administrator chose another one by hand.
report_blas() {
  local link blas
  # awk reads to the end (an early exit would end ldconfig with SIGPIPE, which pipefail turns into a failure)
  link=$( (/sbin/ldconfig -p 2>/dev/null || true) | awk '/libblas\.so\.3 / && !found {print $NF; found = 1}')
  blas=$(readlink -f "$link" 2>/dev/null || true)
  case "$blas" in
    *openblas*) echo "install-deps: libblas.so.3 is OpenBLAS ($blas)" ;;
    "") echo "install-deps: note: the dynamic linker knows no libblas.so.3" ;;
    *) echo "install-deps: note: libblas.so.3 is $blas, not OpenBLAS: the PyTorch peers run on it;" \
            "'update-alternatives --config libblas.so.3-<triplet>' selects OpenBLAS" ;;
  esac
}

# The ONNX Runtime peer's runtime: onnxruntime-node's prebuilt CPU library, from the npm registry, pinned by
# benchmarks/ort/package-lock.json. --ignore-scripts: its install script would download a GPU add-on (not
# needed, and not reachable offline). Without npm the peer is skipped, which is not an error.
install_ort() {
  local dir="$REPO/benchmarks/ort" want have
  want=$(sed -n 's/.*"onnxruntime-node": *"\([^"]*\)".*/\1/p' "$dir/package.json")
  have=$(sed -n 's/^  "version": *"\([^"]*\)".*/\1/p' "$dir/node_modules/onnxruntime-node/package.json" \
         2>/dev/null || true)
  if [ -n "$have" ] && [ "$have" = "$want" ]; then
    echo "install-deps: onnxruntime-node $have present ($dir/node_modules)"
  elif ! command -v npm >/dev/null 2>&1; then
    echo "install-deps: note: npm is not installed: the ONNX Runtime peer (benchmarks/ort_peer.py) will be" \
         "skipped; 'apt-get install nodejs npm', then run this script again, installs it"
  else
    echo "install-deps: installing onnxruntime-node $want into $dir/node_modules (npm ci --ignore-scripts)"
    if ! (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund); then
      echo "install-deps: warning: npm ci failed in $dir: the ONNX Runtime peer will be skipped" >&2
    fi
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  report_blas
  install_ort
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
report_blas
install_ort
