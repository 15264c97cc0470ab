#!/usr/bin/env bash
# The main job: install what is missing, build Release for this machine, run the examples, then the
# benchmark sweep (tables on stdout; Google Benchmark JSON, summary.md and PNG plots in the output
# folder), including the runtime sweeps (OpenMP, latency, concurrency, SIMD flags), and last the Python
# module's example and benchmark (python_bench.md in the output folder), the training step against torch
# autograd (train_default/ and train_kept/: bench_train.json, torch_train_peer.md) and examples/train_c2f
# against its PyTorch twin, and, with MPI, the sequence-parallel
# layers under mpirun (bench_dist at 1 and 2 ranks, bench_dist.txt in the output folder; examples/dist_c2f).
#
#   scripts/run.sh [--long] [--portable] [--out DIR]
#     --long      the long sweep (L = 256 … 16384 in powers of two, HMHA to 32768)
#     --portable  build without -march=native (preset `release`: SSE2 on x86-64). The default is
#                 -march=native (preset `release-native`): the sweep measures the machine it runs on.
#     --out       output folder (default results/latest)
set -euo pipefail
cd "$(dirname "$0")/.."

preset=release-native
out=results/latest
sweep_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --long) sweep_args+=(--long) ;;
    --portable) preset=release ;;
    --native) preset=release-native ;;  # the default; kept for old command lines
    --out) sweep_args+=(--out "$2"); out="$2"; shift ;;
    *) echo "usage: scripts/run.sh [--long] [--portable] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done

scripts/install-deps.sh
cmake --workflow --preset "$preset"
for example in mha_from_pytorch c2f_from_pytorch c2f_multihead_article vit_pyramid decode_stream; do
  echo "== example: $example"
  "build/$preset/examples/$example"
done
echo "== benchmark sweep"
/usr/bin/python3 benchmarks/sweep.py --build "build/$preset" "${sweep_args[@]}"
echo "== training (issue 25): bench_train and its PyTorch peer (torch_train_peer.py), with glibc's default malloc"
echo "   and with large blocks kept between steps (GLIBC_TUNABLES, docs/benchmarks.md#training); examples/train_c2f"
for mode in default kept; do
  tunables=""
  [ "$mode" = kept ] && tunables="glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
  mkdir -p "$out/train_$mode"
  GLIBC_TUNABLES="$tunables" "build/$preset/benchmarks/bench_train" --benchmark_out="$out/train_$mode/bench_train.json" \
    --benchmark_out_format=json
  GLIBC_TUNABLES="$tunables" /usr/bin/python3 benchmarks/torch_train_peer.py --build "build/$preset" --out "$out/train_$mode"
done
/usr/bin/python3 examples/train_c2f.py --out "$out/train_c2f" --cpp "build/$preset/examples/train_c2f" \
  --plot "$out/train_c2f_loss.png"
echo "== Python (issue 24): examples/python/accelerate.py, then benchmarks/python_bench.py"
PYTHONPATH="build/$preset/python" /usr/bin/python3 examples/python/accelerate.py
/usr/bin/python3 benchmarks/python_bench.py --build "build/$preset" "${sweep_args[@]}"
echo "== sequence-parallel layers (c2f::dist): benchmarks/run_dist.sh, then examples/dist_c2f on 2 ranks"
if [ -x "build/$preset/benchmarks/bench_dist" ] && command -v mpirun >/dev/null 2>&1; then
  mkdir -p "$out"
  benchmarks/run_dist.sh "build/$preset" | tee "$out/bench_dist.txt"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    mpirun -np 2 --oversubscribe --bind-to none "build/$preset/examples/dist_c2f"
else
  echo "run: bench_dist skipped: c2f::dist is not built (MPI or mpirun missing; Debian: libopenmpi-dev" \
       "openmpi-bin, which scripts/install-deps.sh installs)"
fi
