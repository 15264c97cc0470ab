#!/usr/bin/env bash
# bench_dist at P = 1 (the machine's cores as threads of one process) and P = 2 (one thread per rank when
# the machine has 2 cores): the same total work, one table each (docs/distributed.md, "Measured").
#
#   benchmarks/run_dist.sh [BUILD_DIR] [Google Benchmark flags...]     (default build/release-native)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release-native}
shift || true
bench="$build/benchmarks/bench_dist"
if [ ! -x "$bench" ]; then
  echo "run_dist: $bench not found (a Release build with MPI: cmake --workflow --preset release-native)" >&2
  exit 1
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for np in 1 2; do
  echo "== mpirun -np $np"
  mpirun -np "$np" --oversubscribe --bind-to none "$bench" --benchmark_counters_tabular=true --benchmark_color=false "$@"
done
