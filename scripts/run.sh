#!/usr/bin/env bash
# The main job: install what is missing, build Release for this machine, run the examples, then the
# benchmark sweep (tables on stdout; Google Benchmark JSON, summary.md and PNG plots in the output
# folder), including the runtime sweeps (OpenMP, latency, concurrency, SIMD flags), and last the Python
# module's example and benchmark (python_bench.md in the output folder).
#
#   scripts/run.sh [--long] [--portable] [--out DIR]
#     --long      the long sweep (L = 256 … 16384 in powers of two, HMHA to 32768)
#     --portable  build without -march=native (preset `release`: SSE2 on x86-64). The default is
#                 -march=native (preset `release-native`): the sweep measures the machine it runs on.
#     --out       output folder (default results/latest)
set -euo pipefail
cd "$(dirname "$0")/.."

preset=release-native
sweep_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --long) sweep_args+=(--long) ;;
    --portable) preset=release ;;
    --native) preset=release-native ;;  # the default; kept for old command lines
    --out) sweep_args+=(--out "$2"); shift ;;
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
echo "== Python (issue 24): examples/python/accelerate.py, then benchmarks/python_bench.py"
PYTHONPATH="build/$preset/python" /usr/bin/python3 examples/python/accelerate.py
/usr/bin/python3 benchmarks/python_bench.py --build "build/$preset" "${sweep_args[@]}"
