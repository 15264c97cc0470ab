#!/usr/bin/env bash
# The main job: install what is missing, build Release, run the examples, then the benchmark sweep
# (table on stdout; Google Benchmark JSON, summary.md and PNG plots in the output folder).
#
#   scripts/run.sh [--long] [--native] [--out DIR]
#     --long    the long sweep (L = 256 … 16384 in powers of two, HMHA to 32768; about 3 minutes)
#     --native  build with -march=native (binaries then only run on this CPU family)
#     --out     output folder (default results/latest)
set -euo pipefail
cd "$(dirname "$0")/.."

preset=release
sweep_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --long) sweep_args+=(--long) ;;
    --native) preset=release-native ;;
    --out) sweep_args+=(--out "$2"); shift ;;
    *) echo "usage: scripts/run.sh [--long] [--native] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done

scripts/install-deps.sh
cmake --workflow --preset "$preset"
for example in mha_from_pytorch c2f_from_pytorch seed000_multihead vit_pyramid; do
  echo "== example: $example"
  "build/$preset/examples/$example"
done
echo "== benchmark sweep"
/usr/bin/python3 benchmarks/sweep.py --build "build/$preset" "${sweep_args[@]}"
