#!/usr/bin/env bash
# The main job: install what is missing, build Release for this machine (only the targets the chosen parts
# need), run the benchmarks, and end with the headline of every part (headline.md in the output folder).
#
# By default it runs the short form of every part, about 15 minutes on 2 cores with the build:
#   machine    the machine's rooflines (bench_machine): fp32 FMA and bf16 dot peaks on 1 and 2 threads,
#              STREAM copy bandwidth, three GEMM reference points at L = 2048
#   attention  the peer table: c2f against PyTorch, libtorch and ONNX Runtime — MultiHeadAttention at
#              L = 1024, 2048, 4096 and C2FAttention chunk 32 (the article's module; ORT at 4096)
#              (benchmarks/sweep.py --headline)
#   loop       forward() in a user's loop against forward_into() into a reused buffer, every layer at its
#              largest benchmark size (bench_forward_loop; the target is 1.15x at most)
#   train      one training step, MultiHeadAttention at L = 2048: bench_train against torch.autograd
#              (benchmarks/torch_train_peer.py, gradients checked first)
#   python     the Python module against torch, MultiHeadAttention at L = 2048, and the binding's cost per
#              call (benchmarks/python_bench.py --headline)
#   dist       bench_dist under mpirun: C2FAttention (chunk 32) at 262 144 tokens on 2 ranks × 1 thread,
#              1 rank × 2 threads and one process
#
#   scripts/run.sh [--full] [--only PART]... [--portable] [--out DIR]
#     --full      every part at full size — hours on 2 cores: the examples; the whole benchmark sweep
#                 (machine, attention with the one-thread run and every peer, runtime, c2f2d, decode) with
#                 the long lengths (L = 256 … 16384 in powers of two, HMHA to 32768, the naive kernel to
#                 4096); training at every length, bench_train with glibc's default malloc and with large
#                 blocks kept (train_default/, train_kept/; torch.autograd on jemalloc in both), and
#                 examples/train_c2f against its PyTorch twin; the
#                 Python example and benchmark at every length; bench_dist at 1 and 2 ranks and
#                 examples/dist_c2f
#     --only PART run only this part (repeatable), short unless --full. Parts: examples, machine,
#                 attention (or peers), runtime, c2f2d, decode, sweep (= machine attention runtime c2f2d
#                 decode), loop, train, python, dist. Short forms of runtime, c2f2d and decode: one repetition
#                 of the runtime sweeps, the quick c2f2d and decode sweeps; examples has one form
#     --portable  build without -march=native (preset `release`: SSE2 on x86-64). The default is
#                 -march=native (preset `release-native`): the benchmarks measure the machine they run on.
#     --out DIR   output folder, under results/ (default results/latest; git-ignored); never docs/
#     --long      the same as --full (older command lines)
#
# The PyTorch, libtorch and numpy peers run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset in their own
# command (a machine may set them to pin OpenBLAS to an older kernel family; then the peer is not PyTorch at
# its best), and with jemalloc preloaded (LD_PRELOAD, MALLOC_CONF keeping freed memory; Debian's
# libjemalloc2): with glibc's malloc, PyTorch's large per-call buffers are mapped and page-faulted in again
# on every call. Without libjemalloc2 they run on glibc's malloc, with a note. Each reports the OpenBLAS
# kernel and the allocator it ran with (benchmarks/report/blas.py). The rest of the job — every c2f binary,
# the c2f Python module — and the tests keep the environment as it is.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: scripts/run.sh [--full] [--only PART]... [--portable] [--out DIR]
  parts: examples machine attention (peers) runtime c2f2d decode sweep loop train python dist"
preset=release-native
out=results/latest
full=0
only=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full | --long) full=1 ;;
    --only)
      [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
      case "$2" in
        examples | machine | attention | runtime | c2f2d | decode | loop | train | python | dist) only+=("$2") ;;
        peers) only+=(attention) ;;
        sweep) only+=(machine attention runtime c2f2d decode) ;;
        *) echo "run: unknown part '$2'" >&2; echo "$usage" >&2; exit 2 ;;
      esac
      shift ;;
    --portable) preset=release ;;
    --native) preset=release-native ;;  # the default; kept for old command lines
    --out)
      [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
      out="$2"; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done

# Snapshots go under results/ (git-ignored) or outside the repository, never into docs/.
case "$(realpath -m "$out")/" in
  "$(realpath -m docs)/"*) echo "run: --out $out is inside docs/: the main job writes its results under results/" >&2
                           exit 2 ;;
esac

if [ ${#only[@]} -eq 0 ]; then
  if [ "$full" = 1 ]; then
    parts=(examples machine attention runtime c2f2d decode loop train python dist)
  else
    parts=(machine attention loop train python dist)
  fi
else
  parts=("${only[@]}")
fi
has() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # mpirun as root (containers, CI)

mkdir -p "$out"
times="$out/run_times.md"
echo "| step | seconds | load average (1, 5, 15 min) at its end |" > "$times"
echo "|---|---:|---|" >> "$times"
job_start=$SECONDS
step_start=$SECONDS
step() {  # step NAME: record the time since the last step and the load average now
  local load
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "| $1 | $((SECONDS - step_start)) | $load |" >> "$times"
  echo "run: $1 took $((SECONDS - step_start)) s (load average $load)"
  step_start=$SECONDS
}

scripts/install-deps.sh
step "install-deps (not counted)"

# The command prefix of every PyTorch / libtorch peer: the variables that pin OpenBLAS's kernel family unset
# and jemalloc preloaded, for that command alone (benchmarks/report/blas.py --env-args, one argument of `env`
# a line; it prints a note when libjemalloc2 is missing; sweep.py starts its peers the same way). The peer
# scripts give the c2f binaries they start the environment as it was (blas.c2f_env()).
peer_args=$(/usr/bin/python3 benchmarks/report/blas.py --env-args)
mapfile -t peer_args <<< "$peer_args"
[ -n "${peer_args[0]}" ] || peer_args=()
peer=(env "${peer_args[@]}")
# A command that runs c2f and PyTorch in one process (examples/python/accelerate.py): OpenBLAS unforced only.
peer_blas=(env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE)
build="build/$preset"

# ---- build: the targets of the chosen parts (the full job with every part builds everything)
targets=()
has examples && targets+=(mha_from_pytorch c2f_from_pytorch c2f_multihead_article vit_pyramid decode_stream)
has machine && targets+=(bench_machine)
has attention && targets+=(bench_attention bench_libtorch)
has runtime && targets+=(bench_runtime bench_runtime_portable bench_runtime_omp bench_runtime_omploops)
has c2f2d && targets+=(bench_c2f2d)
has decode && targets+=(bench_decode)
has loop && targets+=(bench_forward_loop)
has train && targets+=(bench_train)
has train && [ "$full" = 1 ] && targets+=(train_c2f)
has python && targets+=(c2f_python bench_attention)
has python && [ "$full" = 1 ] && targets+=(bench_decode)
has dist && targets+=(bench_dist)
has dist && [ "$full" = 1 ] && targets+=(dist_c2f)
echo "== build ($preset): ${parts[*]}"
cmake --preset "$preset" > "$out/cmake-configure.log"
grep -E '^-- c2f:' "$out/cmake-configure.log" || true
if [ "$full" = 1 ] && [ ${#only[@]} -eq 0 ]; then
  cmake --build --preset "$preset"
  built="every target"
else
  # Only the targets this configuration defines (bench_libtorch needs libtorch-dev, bench_dist MPI, …).
  known=$(cmake --build "$build" --target help | sed -n 's/^\([A-Za-z0-9_]*\): .*/\1/p; s/^\.\.\. \([A-Za-z0-9_]*\).*/\1/p')
  wanted=()
  for t in $(printf '%s\n' "${targets[@]}" | awk '!seen[$0]++'); do
    if grep -qx "$t" <<< "$known"; then wanted+=("$t"); else echo "run: target $t is not defined here: skipped"; fi
  done
  [ ${#wanted[@]} -eq 0 ] || cmake --build --preset "$preset" --target "${wanted[@]}"
  built="${wanted[*]}"
fi
step "build: $built"

# ---- the parts
if has examples; then
  for example in mha_from_pytorch c2f_from_pytorch c2f_multihead_article vit_pyramid decode_stream; do
    echo "== example: $example"
    "$build/examples/$example"
  done
  step "examples"
fi

sweep_parts=()
sweep_names=""
for p in machine attention runtime c2f2d decode; do
  if has "$p"; then sweep_parts+=(--only "$p"); sweep_names+=" $p"; fi
done
if [ ${#sweep_parts[@]} -gt 0 ]; then
  echo "== benchmark sweep (benchmarks/sweep.py):$sweep_names"
  if [ "$full" = 1 ]; then
    /usr/bin/python3 benchmarks/sweep.py --build "$build" --out "$out" --long "${sweep_parts[@]}"
  else
    /usr/bin/python3 benchmarks/sweep.py --build "$build" --out "$out" --headline "${sweep_parts[@]}" \
      --runtime-repetitions 1 --c2f2d-sweep quick --decode-sweep quick
  fi
  step "sweep:$sweep_names"
fi

if has loop; then
  echo "== forward() in a loop against forward_into(): bench_forward_loop (every layer at its largest benchmark size)"
  "$build/benchmarks/bench_forward_loop" | tee "$out/forward_loop.md"
  step "loop"
fi

if has train; then
  if [ "$full" = 1 ]; then
    echo "== training: bench_train and torch.autograd (torch_train_peer.py) at every length, bench_train with glibc's"
    echo "   default malloc and with large blocks kept between steps (GLIBC_TUNABLES; torch runs on its preloaded"
    echo "   allocator in both, on glibc's only when libjemalloc2 is missing); then examples/train_c2f"
    modes=(default kept)
  else
    echo "== training: MultiHeadAttention at L = 2048, bench_train against torch.autograd (torch_train_peer.py)"
    modes=(default)
  fi
  for mode in "${modes[@]}"; do
    tunables=""
    [ "$mode" = kept ] && tunables="glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"
    mkdir -p "$out/train_$mode"
    filter=()
    peer_args=()
    [ "$full" = 1 ] || { filter=(--benchmark_filter='^train_mha/2048/'); peer_args=(--only mha --lengths 2048); }
    GLIBC_TUNABLES="$tunables" "$build/benchmarks/bench_train" --benchmark_out="$out/train_$mode/bench_train.json" \
      --benchmark_out_format=json "${filter[@]}"
    GLIBC_TUNABLES="$tunables" "${peer[@]}" /usr/bin/python3 benchmarks/torch_train_peer.py --build "$build" \
      --out "$out/train_$mode" "${peer_args[@]}"
  done
  if [ "$full" = 1 ]; then
    /usr/bin/python3 examples/train_c2f.py --out "$out/train_c2f" --cpp "$build/examples/train_c2f" \
      --plot "$out/train_c2f_loss.png"
  fi
  step "train"
fi

if has python; then
  if [ "$full" = 1 ]; then
    echo "== Python: examples/python/accelerate.py, then benchmarks/python_bench.py"
    echo "   (accelerate.py runs PyTorch and c2f in one process: glibc's malloc for both, so its 'before' is not"
    echo "   PyTorch at its best; python_bench.py times PyTorch in its own process with the peers' allocator)"
    PYTHONPATH="$build/python" "${peer_blas[@]}" /usr/bin/python3 examples/python/accelerate.py
    /usr/bin/python3 benchmarks/python_bench.py --build "$build" --out "$out"
  else
    echo "== Python: benchmarks/python_bench.py --headline (MultiHeadAttention at L = 2048, the cost of a call)"
    # It starts its PyTorch side itself in the peers' environment (report/blas.py); c2f's side runs here.
    /usr/bin/python3 benchmarks/python_bench.py --build "$build" --out "$out" --headline
  fi
  step "python"
fi

if has dist; then
  if [ -x "$build/benchmarks/bench_dist" ] && command -v mpirun >/dev/null 2>&1; then
    if [ "$full" = 1 ]; then
      echo "== sequence-parallel layers (c2f::dist): benchmarks/run_dist.sh, then examples/dist_c2f on 2 ranks"
      benchmarks/run_dist.sh "$build" | tee "$out/bench_dist.txt"
      mpirun -np 2 --oversubscribe --bind-to none "$build/examples/dist_c2f"
    else
      echo "== sequence-parallel layers (c2f::dist): bench_dist, C2FAttention at 262 144 tokens on 1 and 2 ranks"
      {
        echo "== mpirun -np 1"
        mpirun -np 1 --oversubscribe --bind-to none "$build/benchmarks/bench_dist" \
          --benchmark_counters_tabular=true --benchmark_color=false --benchmark_filter='^(c2f|c2f_local)/262144/'
        echo "== mpirun -np 2"
        mpirun -np 2 --oversubscribe --bind-to none "$build/benchmarks/bench_dist" \
          --benchmark_counters_tabular=true --benchmark_color=false --benchmark_filter='^c2f/262144/'
      } | tee "$out/bench_dist.txt"
    fi
  else
    echo "run: bench_dist skipped: c2f::dist is not built (MPI or mpirun missing; Debian: libopenmpi-dev" \
         "openmpi-bin, which scripts/install-deps.sh installs)"
  fi
  step "dist"
fi

# ---- the headline of every part that ran, and how to get the rest
echo
/usr/bin/python3 benchmarks/headline.py "$out"
total=$((SECONDS - job_start))
echo "| total (install-deps included) | $total | $(cut -d' ' -f1-3 /proc/loadavg) |" >> "$times"
echo
cat "$times"
echo
if [ "$full" = 0 ]; then
  echo "This was the short run of each part (${parts[*]}). The rest:"
  echo "  scripts/run.sh --full                  every part at full size (hours on 2 cores)"
  echo "  scripts/run.sh [--full] --only PART    one part (repeatable); parts: examples machine attention runtime"
  echo "                                         c2f2d decode sweep loop train python dist"
  echo "  benchmarks/README.md                   each binary and script alone"
fi
echo "run: results in $out/ (headline.md, run_times.md, and each part's tables and JSON)"
