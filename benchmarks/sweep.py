#!/usr/bin/python3
"""Runs c2f's benchmark sweep and turns it into a table, Google Benchmark JSON and PNG plots.

    /usr/bin/python3 benchmarks/sweep.py [--long | --headline] [--build build/release] [--out results/latest]
                                         [--only machine|attention|runtime|c2f2d|decode ...]

Parts (all by default; `--only` picks some), each streaming its progress:
    machine     bench_machine: the rooflines — fp32 FMA and bf16 dot peaks (register-only loops, 1 and n
                threads), STREAM copy, and Eigen's, c2f's and (when built with it) oneDNN's GEMM
    attention   bench_attention: the layers against the GEMM and copy-bandwidth rooflines (and a second,
                one-thread run of GEMM and MHA); the peers on OpenBLAS, same threads: bench_libtorch (when
                built) and benchmarks/torch_peer.py (PyTorch modules on c2f's weights and inputs); then
                benchmarks/ort_peer.py (ONNX Runtime's CPU runtime on the same weights and inputs, when
                python3-onnx and onnxruntime-node are installed)
    runtime     bench_runtime* (threads, OpenMP builds, latency, concurrent callers, SIMD flags)
    c2f2d       bench_c2f2d: two-dimensional C2F against the copy-bandwidth and GEMM rooflines
    decode      bench_decode: per-token decode latency from 1k to 128k context (MHA, SparseC2F, HMHA)
The output folder receives each binary's Google Benchmark JSON (bench_attention_1thread.json for the
one-thread run), torch_peer.json and torch_peer.md (the PyTorch peer), ort_peer.json and ort_peer.md (the
ONNX Runtime peer), summary.md (the tables printed at the end, and the target checks) and the plots
(time_vs_length.png, speedup_vs_chunk.png, memory_vs_length.png, sparse_error_vs_speedup.png,
decode_latency.png). Every ratio is taken between entries of the same run.

--headline (scripts/run.sh's default) runs the machine and attention parts short: bench_machine's peaks and
copy bandwidth, and the peer table at a few lengths (HEADLINE_LENGTHS) — bench_attention's copy, GEMM,
MHA and C2F (chunk 32) entries there, bench_libtorch's MHA, torch_peer.py's MHA and article C2F (chunk 32),
ort_peer.py's two MHA graphs and the exported C2F module at HEADLINE_C2F_LENGTH; no one-thread run.

The PyTorch, libtorch and ONNX Runtime peers run with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset in
their own command (report/blas.py: a machine that sets them pins OpenBLAS to an older kernel family), and
each reports the OpenBLAS kernel it ran. The PyTorch and libtorch peers also run with jemalloc preloaded
(report/blas.py's PEER_ALLOCATOR; glibc's malloc, with a note, when libjemalloc2 is missing): with glibc's
malloc their large per-call buffers are mapped and page-faulted in again on every call. Each reports the
allocator it ran with. c2f's binaries never get it: bench_libtorch runs twice, its libtorch entries in the
peer's environment and its c2f entries in this script's own (merged into bench_libtorch.json).

This script runs the binaries and writes the files; the tables, targets and plots are built by the
package benchmarks/report/ (one module per part: attention, runtime, c2f2d, decode; plots; common).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from report import attention, blas, c2f2d, decode, machine, plots, runtime
from report.common import entries, ms, table  # torch_peer.py imports these from sweep (see __all__)
from report.runtime import RUNTIME_VARIANTS

__all__ = ["main", "run_benchmark", "run_runtime", "entries", "ms", "table"]

REPO = Path(__file__).resolve().parent.parent
PARTS = ["machine", "attention", "runtime", "c2f2d", "decode"]  # the main job's parts, in the order they run
# --headline: the lengths of the peer table, and the one length of the exported C2F module in ONNX Runtime.
HEADLINE_LENGTHS = (1024, 2048, 4096)
HEADLINE_C2F_LENGTH = 4096
_LS = "|".join(map(str, HEADLINE_LENGTHS))
HEADLINE_FILTERS = {
    # the FMA and bf16 peaks (1 and n threads) and STREAM copy; the GEMM reference points at L = 2048
    "bench_machine": r"^(peak_[a-z0-9_]+/[0-9]+|copy/[0-9]+|gemm_(eigen|c2f_layer|onednn_packed)/2048/[0-9]+)/",
    "bench_attention": rf"^(copy|triad)/|^(gemm|mha_streaming)/({_LS})/|^c2f/({_LS})/32/",
    "bench_libtorch": rf"_mha/({_LS})/",  # after ^libtorch or ^c2f: the two runs of bench_libtorch
}


def run_benchmark(binary, out_json, extra_args, env=None):
    """Runs one Google Benchmark binary (in `env`, default this process's), printing each finished entry with
    a progress counter."""
    listed = [line for line in subprocess.run([str(binary), "--benchmark_list_tests"] + extra_args, check=True,
                                              capture_output=True, text=True, env=env).stdout.splitlines()
              if line and " " not in line]
    total = len(listed)
    print(f"== {binary.name}: {total} entries", flush=True)
    cmd = [str(binary), f"--benchmark_out={out_json}", "--benchmark_out_format=json",
           "--benchmark_counters_tabular=false"] + extra_args
    start = time.time()
    done = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                          env=env) as proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            name = line.split(" ")[0] if line else ""
            # Entries with repetitions report aggregates only (name_mean, _median, ...): count the median.
            aggregate = name.endswith(("_mean", "_median", "_stddev", "_cv"))
            if aggregate and not name.endswith("_median"):
                continue
            name = name.rsplit("_", 1)[0] if aggregate else name
            if name in listed or name.rsplit("/real_time", 1)[0] in listed:
                done += 1
                print(f"[{done:3d}/{total} {time.time() - start:6.1f}s] {line}", flush=True)
            elif line.startswith(("check", "Run on", "Load Average", "peer:")):
                print(line, flush=True)
    if proc.returncode != 0:
        sys.exit(f"{binary.name} failed with exit code {proc.returncode}")
    with open(out_json) as f:
        return json.load(f)


def run_attention(build, out_dir, extra, fma_peak=None, headline=False):
    """The attention part: bench_attention (all threads, then one thread), bench_libtorch when built,
    torch_peer.py and ort_peer.py; with `headline`, bench_attention's headline entries only, no one-thread run,
    and the peers at HEADLINE_LENGTHS. Returns (summary section, JSON files written, plot files)."""
    attn_bin = build / "benchmarks" / "bench_attention"
    attn = run_benchmark(attn_bin, out_dir / "bench_attention.json",
                         extra + ([f"--benchmark_filter={HEADLINE_FILTERS['bench_attention']}"] if headline else []))
    written = ["bench_attention.json"]
    if headline:
        attn["context"]["c2f_sweep"] = "headline (" + HEADLINE_FILTERS["bench_attention"] + ")"
    one_thread = None
    if not headline:
        # The MHA target against ONE-thread GEMM: a second, short run on one thread.
        saved_threads = os.environ.get("C2F_BENCH_THREADS")
        os.environ["C2F_BENCH_THREADS"] = "1"
        try:
            one_thread = run_benchmark(attn_bin, out_dir / "bench_attention_1thread.json",
                                       [a for a in extra if not a.startswith("--c2f_sweep")] +
                                       ["--benchmark_filter=^(gemm|mha_streaming)/(1024|2048|4096|8192)/"])
        finally:
            if saved_threads is None:
                del os.environ["C2F_BENCH_THREADS"]
            else:
                os.environ["C2F_BENCH_THREADS"] = saved_threads
        written.append("bench_attention_1thread.json")
    torch_bin = build / "benchmarks" / "bench_libtorch"
    torch_result = None
    if torch_bin.exists():
        # The lengths of the peer table (1024 … 8192), whatever the sweep. libtorch's entries run in the peer's
        # environment: the variables that force OpenBLAS's kernel family unset, like the PyTorch peer, and the
        # peers' allocator preloaded; c2f's entries of the same binary run in a second process, in this
        # script's environment (c2f never runs with the peers' allocator).
        env = blas.peer_env()
        args = [a for a in extra if not a.startswith("--c2f_sweep")] + ["--c2f_sweep=peers"]
        lengths = HEADLINE_FILTERS["bench_libtorch"] if headline else "_mha/"
        allocator = blas.probe_allocator(env)
        print(f"== bench_libtorch: libtorch's entries with {', '.join(blas.FORCING)} unset and allocator "
              f"{blas.allocator_text(allocator)}; c2f's entries in a second run, in this script's environment",
              flush=True)
        torch_result = run_benchmark(torch_bin, out_dir / "bench_libtorch.json",
                                     args + [f"--benchmark_filter=^libtorch{lengths}"], env=env)
        c2f_part = run_benchmark(torch_bin, out_dir / "bench_libtorch_c2f.json",
                                 args + [f"--benchmark_filter=^c2f{lengths}"], env=blas.c2f_env(env))
        torch_result["benchmarks"] += c2f_part["benchmarks"]
        torch_result["openblas_env"] = blas.env_state(env)  # read by the peer table (torch_peer.py)
        torch_result["allocator"] = allocator  # libtorch's entries; c2f's: c2f_mha_context
        torch_result["c2f_mha_context"] = {"file": "bench_libtorch_c2f.json", "allocator": blas.probe_allocator(
            blas.c2f_env(env)), "load_avg": c2f_part["context"].get("load_avg")}
        (out_dir / "bench_libtorch.json").write_text(json.dumps(torch_result, indent=2) + "\n")
        written += ["bench_libtorch.json", "bench_libtorch_c2f.json"]
    else:
        print("bench_libtorch was not built (libtorch-dev not installed): skipping the libtorch peer")
    lengths = ",".join(map(str, HEADLINE_LENGTHS))
    peers = run_torch_peer(build, out_dir, ["--lengths", lengths, "--layers", "mha,c2f32"] if headline else [])
    if peers is not None:
        written += ["torch_peer.json", "torch_peer.md"]
    ort = run_ort_peer(build, out_dir, ["--lengths", lengths, "--c2f-lengths", str(HEADLINE_C2F_LENGTH),
                                        "--hmha-lengths", "", "--sparse-lengths", ""] if headline else [])
    if ort is not None:
        written += ["ort_peer.json", "ort_peer.md"]
    text, e, lengths = attention.summarize(attn, torch_result, one_thread, peers, ort, fma_peak)
    return text, written, plots.attention_plots(e, lengths, out_dir)


def run_torch_peer(build, out_dir, more=()):
    """Runs benchmarks/torch_peer.py (with the arguments `more`), OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset
    and the peers' allocator preloaded in its command (report/blas.py); returns its JSON, or None when that
    Python has no torch."""
    # The PyTorch peer runs under Debian's python3 (python3-torch), whichever Python runs this script.
    torch_python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    print(f"== torch_peer.py ({torch_python}; {', '.join(blas.FORCING)} unset; allocator "
          f"{blas.allocator_text(blas.probe_allocator(blas.peer_env()))})", flush=True)
    r = subprocess.run([torch_python, str(REPO / "benchmarks" / "torch_peer.py"), "--build", str(build),
                        "--out", str(out_dir), *more], env=blas.peer_env())
    if r.returncode == 77:
        print(f"{torch_python} has no torch (Debian: python3-torch): skipping the PyTorch peer")
        return None
    if r.returncode != 0:
        sys.exit(f"torch_peer.py failed with exit code {r.returncode}")
    return json.loads((out_dir / "torch_peer.json").read_text())


def run_ort_peer(build, out_dir, more=()):
    """Runs benchmarks/ort_peer.py (ONNX Runtime through onnxruntime-node; with the arguments `more`); returns
    its JSON, or None when it is skipped (exit code 77: python3-onnx, torch, node or onnxruntime-node
    missing; it says which)."""
    # The graphs are written with Debian's python3-onnx and python3-torch, like the PyTorch peer's modules;
    # ORT's kernels are its own, the variables that pin OpenBLAS's kernels are unset as for the other peers.
    # No preloaded allocator: ORT's CPU arena (on by default) keeps its buffers, and that script times c2f's
    # forwards (bench_attention --c2f_peer_time) in its rounds.
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    print(f"== ort_peer.py ({python})", flush=True)
    r = subprocess.run([python, str(REPO / "benchmarks" / "ort_peer.py"), "--build", str(build),
                        "--out", str(out_dir), *more], env=blas.peer_env(allocator=False))
    if r.returncode == 77:
        print("skipping the ONNX Runtime peer (scripts/install-deps.sh installs python3-onnx, and onnxruntime-node "
              "into benchmarks/ort/ when npm is there)")
        return None
    if r.returncode != 0:
        sys.exit(f"ort_peer.py failed with exit code {r.returncode}")
    return json.loads((out_dir / "ort_peer.json").read_text())


def run_runtime(build, out_dir, repetitions, set_name):
    """Runs every bench_runtime build present; returns {binary: JSON}."""
    results = {}
    for binary, _ in RUNTIME_VARIANTS:
        path = build / "benchmarks" / binary
        if not path.exists():
            print(f"{binary} was not built: skipping it")
            continue
        which = set_name
        if binary == "bench_runtime_portable":
            which = "simd"
        args = [f"--c2f_set={which}", f"--benchmark_repetitions={repetitions}",
                "--benchmark_enable_random_interleaving=true"]
        results[binary] = run_benchmark(path, out_dir / f"{binary}.json", args)
    return results


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    how = p.add_mutually_exclusive_group()
    how.add_argument("--long", action="store_true", help="the long sweep (more lengths, HMHA to 32768)")
    how.add_argument("--headline", action="store_true",
                     help="the short run of scripts/run.sh's default: machine and attention parts (unless --only), "
                          "peaks, copy bandwidth and the peer table at L = "
                          + ", ".join(map(str, HEADLINE_LENGTHS)))
    p.add_argument("--build", default=str(REPO / "build" / "release"), help="build folder with benchmarks/")
    p.add_argument("--out", default=str(REPO / "results" / "latest"), help="output folder")
    p.add_argument("--repetitions", type=int, default=1, help="Google Benchmark repetitions (median reported)")
    p.add_argument("--only", choices=PARTS, action="append",
                   help="run only these parts (repeatable; default: all): machine = bench_machine (rooflines), attention = bench_attention, "
                        "bench_libtorch and the PyTorch and ONNX Runtime peers, runtime = bench_runtime* (threads, OpenMP), c2f2d = bench_c2f2d, "
                        "decode = bench_decode")
    p.add_argument("--runtime-repetitions", type=int, default=3,
                   help="repetitions of the runtime sweeps (bench_runtime*; median reported)")
    p.add_argument("--c2f2d-sweep", choices=["full", "quick"], default="full",
                   help="bench_c2f2d's grids: full (32² … 1024² × blocks 8² … 64², about 4 minutes) or quick "
                        "(to 256², plus 1024² in 64² blocks)")
    p.add_argument("--decode-sweep", choices=["full", "quick"], default="full",
                   help="bench_decode's contexts: full (1k … 128k, about 5 minutes) or quick (to 16k)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    build, out_dir = Path(args.build), Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = args.only or (["machine", "attention"] if args.headline else PARTS)
    extra = ["--c2f_sweep=long"] if args.long else []
    if args.repetitions > 1:
        extra += [f"--benchmark_repetitions={args.repetitions}"]
    sections, written, files = [], [], []
    fma_peak = None
    if "machine" in parts:
        result = run_benchmark(build / "benchmarks" / "bench_machine", out_dir / "bench_machine.json",
                               [f"--benchmark_filter={HEADLINE_FILTERS['bench_machine']}"] if args.headline else [])
        written.append("bench_machine.json")
        sections.append(machine.machine_section(result))
        p = machine.peaks(result)
        fma_peak = p["fp32"].get(int(os.environ.get("C2F_BENCH_THREADS", "2")))
    if "attention" in parts:
        text, more, files = run_attention(build, out_dir, extra, fma_peak, args.headline)
        written += more
        sections.append(text)
    if "runtime" in parts:
        results = run_runtime(build, out_dir, args.runtime_repetitions, "all")
        written += [f"{b}.json" for b in results]
        if "bench_runtime" in results:
            sections.append(runtime.runtime_section(results))
    if "c2f2d" in parts:
        # Its entries set their own repetitions (cheap ones 5, minute-long ones 1); see bench_c2f2d.cpp.
        result = run_benchmark(build / "benchmarks" / "bench_c2f2d", out_dir / "bench_c2f2d.json",
                               [f"--c2f2d_sweep={args.c2f2d_sweep}"])
        written.append("bench_c2f2d.json")
        sections.append(c2f2d.c2f2d_section(result))
    if "decode" in parts:
        # Its entries set their own iterations and repetitions; see bench_decode.cpp.
        result = run_benchmark(build / "benchmarks" / "bench_decode", out_dir / "bench_decode.json",
                               [f"--decode_sweep={args.decode_sweep}"])
        written.append("bench_decode.json")
        sections.append(decode.decode_section(result))
        files = list(files) + plots.decode_plots(result, out_dir)
    text = "\n\n".join(sections)
    (out_dir / "summary.md").write_text(text + "\n")
    print()
    print(text)
    print()
    print(f"wrote {out_dir}/: " + ", ".join(written + ["summary.md"] + [f.name for f in files]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
