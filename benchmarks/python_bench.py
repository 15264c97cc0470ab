#!/usr/bin/python3
"""c2f from Python against PyTorch, and what the binding costs: one run, same weights, same threads.

    /usr/bin/python3 benchmarks/python_bench.py --build build/release-native [--out results/latest]
                                                [--quick | --headline]

1. Speed-ups from Python: torch.nn.MultiheadAttention(512, 8, batch_first=True) against c2f.MultiHeadAttention
   (L = 1024 … 8192), and the coarse-to-fine article's C2FAttention (tests/reference/c2f_reference.py) against
   c2f.C2FAttention, chunk 32 (L = 4096 … 16384); batch 1, float32, the same weights and input (outputs
   checked: |c2f − torch| ≤ 1e-5 + 1e-5·|torch|). PyTorch runs under torch.inference_mode() with
   need_weights=False; c2f is called on the torch tensor (read in place) and its output wrapped with
   torch.from_numpy (no copy), as c2f.torch does. Each time is the median of --reps wall-clock runs after a
   warm-up. The C++ speed-up divides the same PyTorch time by bench_attention's time for the same entry
   (mha_streaming/L, c2f/L/32; the median of 5 repetitions), run by this script from the same build just
   before the Python runs of that L; the target is the Python speed-up within 10 % of the C++ one.
2. The binding's overhead per call: one decode step of one token (MultiHeadAttention(512, 8), causal,
   batch 1, a context of 1024 tokens: bench_decode's entry mha/1/1024) called from Python, against the same
   step repeated in C++ inside the same process (layer._decode_loop: no Python between steps), on states
   prefilled alike, alternating; the Python step takes a numpy array, and a torch tensor; and bench_decode's
   own time for that entry (when bench_decode is built). The same for a tiny layer (embed_dim 8, context
   16), where the step itself costs almost nothing. Target: ≤ 15 µs per call.

--quick: MHA at L = 1024 and 2048, C2F at 4096. --headline (scripts/run.sh's default): MHA at L = 2048 only.

Threads: C2F_BENCH_THREADS (default 2) for c2f, torch.set_num_threads and OpenBLAS alike (torch_peer.py's
setup). PyTorch's side runs in its own process, in the peers' environment (report/blas.py's peer_env():
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset, jemalloc preloaded), on the modules' weights and the input this
process writes; it sends back its output (checked here) and its time, and reports its OpenBLAS kernel and
allocator. c2f's side (the module and bench_attention) runs in this process's environment as it is: never with
the peers' allocator. The module comes from <build>/python (C2F_PYTHON, built by the
same preset). Writes python_bench.json
and python_bench.md to --out and prints the tables. Exit code 1 when an output differs from torch's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests" / "reference"))

EMBED, HEADS, CHUNK = 512, 8, 32
MHA_LENGTHS = [1024, 2048, 4096, 8192]
C2F_LENGTHS = [4096, 8192, 16384]
DECODE_CONTEXT, DECODE_STEPS = 1024, 200  # bench_decode's mha/1/1024 entry times 200 steps a repetition
ATOL = RTOL = 1e-5


def median_time(fn, reps):
    fn()  # warm-up: scratch memory, pages, thread pools
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def google_benchmark(binary, pattern, extra=()):
    """{entry name and arguments: median real time in ms} of the entries of `binary` matching `pattern`."""
    cmd = [str(binary), f"--benchmark_filter={pattern}", "--benchmark_format=json", "--benchmark_repetitions=5",
           "--benchmark_report_aggregates_only=true", *extra]
    print("== " + " ".join(cmd), flush=True)
    from report import blas
    doc = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=blas.c2f_env()).stdout)
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
    def entry(run_name):  # "mha_streaming/1024/process_time/real_time" -> "mha_streaming/1024"
        name, *args = run_name.split("/")
        return "/".join([name] + [a for a in args if a.isdigit()])
    return {entry(b["run_name"]): b["real_time"] * scale[b["time_unit"]]
            for b in doc["benchmarks"] if b.get("aggregate_name") == "median"}


def check(name, L, ours, theirs):
    diff = (ours - theirs).abs()
    worst = float((diff / (ATOL + RTOL * theirs.abs())).max())
    print(f"check {name}, L = {L}: max |c2f - torch| = {float(diff.max()):.3g} ({100 * worst:.0f} % of the "
          f"tolerance)", flush=True)
    if worst > 1:
        sys.exit(f"python_bench: c2f's {name} differs from PyTorch's at L = {L}")


def torch_module(torch, key):
    """The PyTorch module of `key` ("mha" or "c2f") and the call this script times."""
    import torch.nn as nn
    from c2f_reference import C2FAttention
    if key == "mha":
        mha = nn.MultiheadAttention(EMBED, HEADS, batch_first=True).eval()
        return mha, lambda x: mha(x, x, x, need_weights=False)[0]
    article = C2FAttention(EMBED, HEADS, CHUNK).eval()
    return article, article


def torch_side(spec_file):
    """--torch-side FILE: PyTorch's side of one (layer, L), in the process the peers' environment started
    (jemalloc preloaded, OpenBLAS unforced): loads the layer's weights and x from FILE (torch.save), checks
    nothing itself, and writes its output, its median time and its setup to FILE + ".out"."""
    from torch_peer import bench_threads, setup_torch
    torch, setup = setup_torch(bench_threads())
    spec = torch.load(spec_file)
    module, call = torch_module(torch, spec["layer"])
    module.load_state_dict(spec["state"])
    x = spec["x"]
    with torch.inference_mode():
        y = call(x)
        seconds = median_time(lambda: call(x), spec["reps"])
    torch.save({"y": y, "seconds": seconds, "setup": setup}, spec_file + ".out")
    return 0


def run_torch_side(torch, key, module, x, reps):
    """PyTorch's output and median time for (module, x), run by `--torch-side` in the peers' environment
    (report/blas.py); returns (output, seconds, that process's setup)."""
    from report import blas
    with tempfile.TemporaryDirectory(prefix="c2f-python-bench-") as tmp:
        spec = os.path.join(tmp, "spec.pt")
        torch.save({"layer": key, "state": module.state_dict(), "x": x, "reps": reps}, spec)
        subprocess.run(["/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable,
                        str(Path(__file__).resolve()), "--torch-side", spec], check=True, env=blas.peer_env())
        out = torch.load(spec + ".out")
    return out["y"], out["seconds"], out["setup"]


def speedups(torch, c2f, threads, build, reps, quick, headline=False):
    torch.manual_seed(0)
    mha_lengths = [2048] if headline else MHA_LENGTHS[:2] if quick else MHA_LENGTHS
    c2f_lengths = [] if headline else C2F_LENGTHS[:1] if quick else C2F_LENGTHS
    mha, _ = torch_module(torch, "mha")
    article, _ = torch_module(torch, "c2f")
    layers = {
        "mha": (mha, c2f.MultiHeadAttention(EMBED, HEADS, num_threads=threads), mha_lengths, "mha_streaming/{L}"),
        "c2f": (article, c2f.C2FAttention(EMBED, HEADS, CHUNK, num_threads=threads), c2f_lengths,
                "c2f/{L}/" + str(CHUNK)),
    }
    rows, torch_setup = [], None
    for key, (module, layer, lengths, entry) in layers.items():
        layer.load_state_dict(module.state_dict())
        for L in lengths:
            # The C++ entry right before the Python runs of the same L: a load that comes and goes on the
            # machine then blurs both alike.
            name = entry.format(L=L)
            cpp_s = google_benchmark(build / "benchmarks" / "bench_attention", f"^{name}/")[name] / 1e3
            x = torch.randn(1, L, EMBED, generator=torch.Generator().manual_seed(L))
            # PyTorch's side in its own process (the peers' environment), then c2f's in this one.
            theirs, torch_s, torch_setup = run_torch_side(torch, key, module, x, reps)
            with torch.inference_mode():
                ours = torch.from_numpy(layer(x))
                check(key, L, ours, theirs)
                python_s = median_time(lambda: torch.from_numpy(layer(x)), reps)
            rows.append(dict(layer=key, L=L, torch_ms=1e3 * torch_s, c2f_python_ms=1e3 * python_s,
                             c2f_cpp_ms=1e3 * cpp_s, speedup_python=torch_s / python_s, speedup_cpp=torch_s / cpp_s))
            r = rows[-1]
            print(f"  {key} L = {L}: torch {r['torch_ms']:.2f} ms ({torch_setup['blas_kernel']}), c2f from Python "
                  f"{r['c2f_python_ms']:.2f} ms, c2f in C++ {r['c2f_cpp_ms']:.2f} ms", flush=True)
    return rows, torch_setup


def overhead(torch, c2f, threads, build, reps):
    """Per-step times (µs) of a decode step from Python and repeated in C++, for bench_decode's entry and a
    tiny layer, on states prefilled alike (alternating, median of `reps` pairs)."""
    import numpy as np
    results = {}
    for name, embed, heads, context in (("mha 512x8, context 1024", EMBED, HEADS, DECODE_CONTEXT),
                                        ("tiny: mha 8x2, context 16", 8, 2, 16)):
        layer = c2f.MultiHeadAttention(embed, heads, causal=True, num_threads=threads)
        rng = np.random.default_rng(7)
        prompt = rng.standard_normal((1, context, embed)).astype(np.float32)
        token = rng.standard_normal((1, 1, embed)).astype(np.float32)

        def fresh_state():
            state = layer.new_decode_state(1, reserve=context + DECODE_STEPS + 1)
            layer.prefill(prompt, state)
            return state

        def python_loop(x):
            state = fresh_state()
            t0 = time.perf_counter()
            for _ in range(DECODE_STEPS):
                layer.decode(x, state)
            return 1e6 * (time.perf_counter() - t0) / DECODE_STEPS

        python_us, torch_us, cpp_us = [], [], []
        for _ in range(reps):
            python_us.append(python_loop(token))
            torch_us.append(python_loop(torch.from_numpy(token)))  # a torch tensor in (c2f.torch's case)
            cpp_us.append(1e6 * layer._decode_loop(token, fresh_state(), DECODE_STEPS) / DECODE_STEPS)
        results[name] = dict(python_us=statistics.median(python_us), torch_in_us=statistics.median(torch_us),
                             cpp_us=statistics.median(cpp_us),
                             overhead_us=statistics.median(p - c for p, c in zip(python_us, cpp_us)),
                             overhead_torch_in_us=statistics.median(p - c for p, c in zip(torch_us, cpp_us)),
                             python_runs_us=python_us, torch_in_runs_us=torch_us, cpp_runs_us=cpp_us)
    decode_bin = build / "benchmarks" / "bench_decode"
    if decode_bin.exists():
        bench = google_benchmark(decode_bin, f"^mha/1/{DECODE_CONTEXT}/", ["--decode_sweep=quick"])
        results["bench_decode"] = {k: 1e3 * v for k, v in bench.items()}  # µs
    else:
        print(f"python_bench: {decode_bin} is not built: no bench_decode figure", flush=True)
        results["bench_decode"] = {}
    return results


def c2f_allocator_text(setup):
    """The allocator of the process that ran c2f's side."""
    from report import blas
    return blas.allocator_text(setup.get("c2f_process", {}).get("allocator") or blas.allocator_here())


def markdown(setup, rows, over):
    lines = ["### c2f from Python against PyTorch (benchmarks/python_bench.py)", "",
             f"Batch 1, d = {EMBED}, {HEADS} heads, float32, {setup['c2f_threads']} threads for c2f and torch "
             f"({setup['torch_version']}, its sgemm from {setup['blas_library']}: {setup['blas_kernel']}; in its own "
             "process, the peers' environment); c2f in this script's process (allocator "
             f"{c2f_allocator_text(setup)}); median wall-clock times. "
             "Speed-up = torch time / c2f time; \"Python / C++\" = the Python speed-up over the C++ one "
             "(target ≥ 0.90). Load average (1 min) before and after the run: "
             f"{setup['load_average_before_after'][0]:.2f}, {setup['load_average_before_after'][1]:.2f}.", "",
             "| layer | L | torch (ms) | c2f from Python (ms) | c2f in C++ (ms) | speed-up from Python | "
             "speed-up in C++ | Python / C++ |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = "MHA" if r["layer"] == "mha" else f"C2F, chunk {CHUNK}"
        ratio = r["speedup_python"] / r["speedup_cpp"]
        lines.append(f"| {label} | {r['L']} | {r['torch_ms']:.2f} | {r['c2f_python_ms']:.2f} | {r['c2f_cpp_ms']:.2f} | "
                     f"{r['speedup_python']:.2f}× | {r['speedup_cpp']:.2f}× | {ratio:.2f}"
                     f"{'' if ratio >= 0.9 else ' (below 0.90)'} |")
    lines += ["", "The binding's overhead per call: one decode step of one token, from Python against the same "
              f"step repeated in C++ in the same process ({DECODE_STEPS} steps a run, median of the runs; target "
              "≤ 15 µs). The input is a numpy array, or a torch tensor (read through numpy.asarray, as c2f.torch does):",
              "", "| step | in C++ (µs) | from Python, numpy in (µs) | overhead (µs) | from Python, torch in (µs) | "
              "overhead (µs) |", "|---|---:|---:|---:|---:|---:|"]
    for name, o in over.items():
        if name != "bench_decode":
            lines.append(f"| {name} | {o['cpp_us']:.1f} | {o['python_us']:.1f} | {o['overhead_us']:.1f} | "
                         f"{o['torch_in_us']:.1f} | {o['overhead_torch_in_us']:.1f} |")
    for name, us in over["bench_decode"].items():
        lines.append(f"\nbench_decode's {name} (C++, its own process): {us:.1f} µs per step.")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=str(REPO / "build" / "release-native"), help="build folder (benchmarks/, python/)")
    p.add_argument("--out", default=str(REPO / "results" / "latest"), help="output folder")
    p.add_argument("--reps", type=int, default=7, help="timed runs per entry (median)")
    p.add_argument("--quick", action="store_true", help="two MHA lengths and one C2F length")
    p.add_argument("--headline", action="store_true", help="MHA at L = 2048 only (scripts/run.sh's default)")
    p.add_argument("--long", action="store_true", help="accepted for scripts/run.sh; changes nothing")
    p.add_argument("--torch-side", metavar="FILE", help=argparse.SUPPRESS)  # PyTorch's side (run_torch_side)
    args = p.parse_args(argv)
    if args.torch_side:
        return torch_side(args.torch_side)
    build = Path(args.build).resolve()
    sys.path.insert(0, str(build / "python"))
    from torch_peer import bench_threads, blas, setup_torch
    threads = bench_threads()
    torch, setup = setup_torch(threads)  # this process's torch: the weights and inputs, not timed
    import c2f
    if not Path(c2f.__file__).is_relative_to(build):
        sys.exit(f"python_bench: imported c2f from {c2f.__file__}, not from {build}/python (build it with C2F_PYTHON)")
    print(f"python_bench: c2f {c2f.__file__} (allocator {blas.allocator_text(blas.allocator_here())}), torch "
          f"{torch.__version__}, {threads} threads; PyTorch's side runs in the peers' environment", flush=True)
    load_before = os.getloadavg()
    rows, torch_setup = speedups(torch, c2f, threads, build, args.reps, args.quick, args.headline)
    if torch_setup is not None:  # the setup PyTorch's side was timed with (its kernel and allocator)
        setup = dict(torch_setup, c2f_process={"allocator": blas.allocator_here()})
    for note in (blas.forced_note(setup["openblas_env"]), blas.allocator_note(setup.get("allocator"))):
        if note:
            print(f"python_bench: PyTorch's side: {note}", flush=True)
    over = overhead(torch, c2f, threads, build, args.reps)
    # Other processes on the cores blur every comparison: the load average before and after says if they did.
    setup["load_average_before_after"] = [load_before[0], os.getloadavg()[0]]
    text = markdown(setup, rows, over)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "python_bench.json").write_text(json.dumps(dict(setup=setup, speedups=rows, overhead=over), indent=1))
    (out / "python_bench.md").write_text(text + "\n")
    print()
    print(text)
    print(f"\nwrote {out}/python_bench.json, python_bench.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
