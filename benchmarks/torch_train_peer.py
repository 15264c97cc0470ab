#!/usr/bin/python3
"""The PyTorch peer of c2f's training benchmark (bench_train): the same layers under torch.autograd, on the
same weights, x and dy, gradients checked against c2f's before timing.

    /usr/bin/python3 benchmarks/torch_train_peer.py --build build/release-native --out results/latest

Setup: torch_peer.py's (Debian's python3-torch, float32, batch 1, d = 512, 8 heads, torch and OpenBLAS on
n threads, n = C2F_BENCH_THREADS, default 2; the OpenBLAS kernel and the allocator that ran are reported —
scripts/run.sh starts this script with OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset and jemalloc preloaded,
report/blas.py; bench_train, c2f's binary, is started with the environment as it was before, blas.c2f_env()),
in training mode with autograd:
    mha    torch.nn.MultiheadAttention(512, 8, batch_first=True), (x, x, x, need_weights=False),
           L = 1024 … 8192 — against bench_train's train_mha/L
    c2f    the article's C2FAttention (tests/reference/c2f_reference.py), chunk 32, dropout 0 (c2f's default;
           the article's 0.1 would make the two differ), L = 4096 … 16384 —
           against train_c2f/L/32
    hmha   tests/reference/hmha_reference.py's HMHA (dense), window 64, L = 4096 — against train_hmha/L/64
One training step = y = module(x); y.backward(dy) with x.requires_grad (the input gradient too), the
parameters' .grad set to None before each step. Timed: the median of --reps steps after the check.
Interleaved: bench_train's entry for the same (layer, L) runs right before and right after torch's timed
steps (`--benchmark_filter`), and the table's c2f figures are the mean of those two runs — on a VM whose
speed drifts by tens of percent over minutes, the ratio compares c2f and torch measured within seconds of
each other (--no-interleave: bench_train.json's figures instead).

The check, per (layer, L): the module's parameters (PyTorch's default initialisation, seeded), x and dy
(torch.randn, seeded) are written as safetensors; `bench_train --c2f_train_check=DIR` writes c2f's output,
input gradient and parameter gradients; each tensor must satisfy max |c2f − torch| ≤ TOL · max |torch|
+ ATOL (the two sides sum in different orders over up to 16384 rows; a weight gradient is a sum over every
row; ATOL = 1e-5 for the gradients that are zero up to rounding).
A mismatch stops the script with exit code 1.

Output in --out: torch_train_peer.json, and torch_train_peer.md (the table against bench_train.json of the
same run, when it is there) with train_memory_per_token.png (bench_train's heap peak per token against L). Exit codes: 0 done, 1 a mismatch or an error, 77 torch is not importable.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "reference"))
sys.dont_write_bytecode = True
import torch_peer  # noqa: E402  (setup_torch, save_tensors, bench_threads)

EMBED, HEADS, CHUNK, WINDOW = 512, 8, 32, 64
# The check: max |c2f - torch| <= TOL * max |torch| + ATOL per tensor. ATOL is the project's fp32 atol, for
# the gradients that are zero in exact arithmetic up to edge terms (HMHA's key biases: a constant added to
# every key shifts a softmax row by a constant), where both sides hold only rounding noise (~1e-6).
TOL, ATOL = 1e-4, 1e-5
SKIP = 77
CASES = [("mha", L) for L in (1024, 2048, 4096, 8192)] + [("c2f", L) for L in (4096, 8192, 16384)] + [("hmha", 4096)]
TARGETS = {"mha": 2.0, "c2f": 8.0}  # the training targets: speed-up of the step time, torch / c2f


def build(torch, layer):
    import torch.nn as nn
    from c2f_reference import C2FAttention
    from hmha_reference import HMHA
    if layer == "mha":
        m = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
        return m, (lambda x: m(x, x, x, need_weights=False)[0]), {}
    if layer == "c2f":
        m = C2FAttention(EMBED, HEADS, CHUNK, dropout=0.0)  # c2f's layer has no dropout by default
        return m, m, {"chunk_size": str(CHUNK)}
    m = HMHA(EMBED, HEADS, WINDOW)
    return m, m, {"window": str(WINDOW)}


def entry_name(layer, L):
    return {"mha": f"train_mha/{L}", "c2f": f"train_c2f/{L}/{CHUNK}", "hmha": f"train_hmha/{L}/{WINDOW}"}[layer]


def c2f_entry(binary, layer, L):
    """bench_train's entry for (layer, L), run now: its counters (one Google Benchmark record)."""
    with tempfile.TemporaryDirectory(prefix="c2f-train-entry-") as tmp:
        out = Path(tmp) / "entry.json"
        r = subprocess.run([str(binary), f"--benchmark_filter=^{entry_name(layer, L)}/", f"--benchmark_out={out}",
                            "--benchmark_out_format=json"], capture_output=True, text=True,
                           env=torch_peer.blas.c2f_env())  # c2f's environment: no peer allocator (report/blas.py)
        runs = json.loads(out.read_text()).get("benchmarks", []) if r.returncode == 0 and out.exists() else []
    if len(runs) != 1:
        raise RuntimeError(f"bench_train --benchmark_filter=^{entry_name(layer, L)}/ gave {len(runs)} entries: "
                           f"{r.stderr.strip()}")
    return runs[0]


def mean_entry(a, b):
    """The two runs' numeric counters averaged (bwd_over_fwd recomputed from the means)."""
    m = dict(a)
    for key, value in a.items():
        if isinstance(value, (int, float)) and isinstance(b.get(key), (int, float)):
            m[key] = 0.5 * (value + b[key])
    m["bwd_over_fwd"] = m["backward_ms"] / m["forward_ms"]
    return m


def table(rows, bench):
    by_name = {}
    for b in bench.get("benchmarks", []):
        by_name[re.split(r"/(?:min_time|manual_time)", b["name"])[0]] = b
    for r in rows:  # the interleaved runs' timings, where there are some; the heap peak stays bench_train's
        name = entry_name(r["layer"], r["L"])
        if "c2f" in r:
            interleaved = dict(r["c2f"])
            if name in by_name:
                interleaved["bytes_per_token"] = by_name[name]["bytes_per_token"]
            by_name[name] = interleaved
    out = ["| layer | L | c2f forward ms | c2f step ms (fwd_train + bwd) | backward / forward | c2f peak bytes/token "
           "| torch step ms | speed-up | target |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        b = by_name.get(entry_name(r["layer"], r["L"]))
        if b is None:
            continue
        speed = r["torch_step_ms"] / b["step_ms"]
        target = TARGETS.get(r["layer"])
        bwd_ok = b["bwd_over_fwd"] <= 3.0
        verdict = []
        if target:
            verdict.append(f"≥ {target:g}×: {'met' if speed >= target else 'NOT met'}")
        verdict.append(f"bwd ≤ 3× fwd: {'met' if bwd_ok else 'NOT met'}")
        out.append(f"| {r['layer']} | {r['L']} | {b['forward_ms']:.1f} | {b['step_ms']:.1f} | {b['bwd_over_fwd']:.2f} "
                   f"| {b['bytes_per_token']:.0f} | {r['torch_step_ms']:.1f} | {speed:.2f}× | {'; '.join(verdict)} |")
    return "\n".join(out) + "\n"


def memory_plot(bench, png):
    """bench_train's heap peak per token against L, one line per layer (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = {}
    for b in bench.get("benchmarks", []):
        layer = b["name"].split("/")[0].replace("train_", "")
        lines.setdefault(layer, []).append((b["L"], b["bytes_per_token"] / 1024))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for layer, points in sorted(lines.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=layer)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("L (tokens)")
    ax.set_ylabel("heap peak per token, KiB")
    ax.set_title("forward_train + backward, E = 512, 8 heads, float")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default="build/release-native", help="the build holding benchmarks/bench_train")
    p.add_argument("--out", default="results/latest", help="output folder")
    p.add_argument("--reps", type=int, default=3, help="timed steps per (layer, L) after the check")
    p.add_argument("--only", action="append", choices=["mha", "c2f", "hmha"], help="run only these layers")
    p.add_argument("--max-length", type=int, default=0, help="skip the lengths above this (0: none)")
    p.add_argument("--lengths", default="", help="comma-separated lengths to run (default: every case's)")
    p.add_argument("--no-interleave", action="store_true",
                   help="do not rerun bench_train's entry around torch's steps (use bench_train.json's figures)")
    args = p.parse_args(argv)
    threads = torch_peer.bench_threads()
    try:
        torch, setup = torch_peer.setup_torch(threads)
    except ImportError as e:
        print(f"torch_train_peer: {sys.executable} cannot import torch ({e}); Debian: python3-torch. Skipping.")
        return SKIP
    binary = Path(args.build) / "benchmarks" / "bench_train"
    if not binary.exists():
        sys.exit(f"torch_train_peer: {binary} does not exist (build the bench_train target)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"train peer: PyTorch {setup['torch_version']}, BLAS {setup['blas_library']} ({setup['blas_kernel']}), "
          f"torch threads {setup['torch_threads']}, OpenBLAS threads {setup['openblas_threads']}, c2f threads {threads}",
          flush=True)
    for note in (torch_peer.blas.forced_note(setup["openblas_env"]), torch_peer.blas.allocator_note(setup["allocator"])):
        if note:
            print(f"train peer: {note}", flush=True)
    rows = []
    for index, (layer, L) in enumerate(CASES):
        if (args.only and layer not in args.only) or (args.max_length and L > args.max_length):
            continue
        if args.lengths and L not in [int(v) for v in args.lengths.split(",") if v]:
            continue
        torch.manual_seed(2000 + index)
        module, call, meta = build(torch, layer)
        module.train()
        g = torch.Generator().manual_seed(L)
        x = torch.randn(1, L, EMBED, generator=g)
        dy = torch.randn(1, L, EMBED, generator=g)
        with tempfile.TemporaryDirectory(prefix="c2f-train-peer-") as tmp:
            torch_peer.save_tensors(Path(tmp) / "weights.safetensors", dict(module.state_dict()),
                                    dict(meta, layer=layer, embed_dim=str(EMBED), num_heads=str(HEADS)))
            torch_peer.save_tensors(Path(tmp) / "input.safetensors", {"x": x, "dy": dy}, {})
            r = subprocess.run([str(binary), f"--c2f_train_check={tmp}"], capture_output=True, text=True,
                               env=torch_peer.blas.c2f_env())
            if r.returncode != 0:
                print(f"torch_train_peer: bench_train's check mode failed: {r.stderr.strip()}", file=sys.stderr)
                return 1
            ours = torch_peer.load_tensors(torch, Path(tmp) / "c2f.safetensors")

        def step():
            for prm in module.parameters():
                prm.grad = None
            xi = x.clone().requires_grad_(True)
            y = call(xi)
            y.backward(dy)
            return y, xi.grad

        t0 = time.perf_counter()
        y, dx = step()
        first = time.perf_counter() - t0
        ref = {"y": y.detach(), "grad.input": dx}
        ref.update({f"grad.{n}": prm.grad for n, prm in module.named_parameters()})
        if set(ref) != set(ours):
            print(f"torch_train_peer: {layer} L = {L}: c2f gives {sorted(ours)}, torch {sorted(ref)}", file=sys.stderr)
            return 1
        worst_name, worst, worst_diff = "", 0.0, 0.0
        for name, t in ref.items():
            diff = float((ours[name].double() - t.double()).abs().max())
            ratio = diff / (TOL * float(t.abs().max()) + ATOL)
            if not ratio <= worst:
                worst_name, worst, worst_diff = name, ratio, diff
        if not worst <= 1.0:
            print(f"torch_train_peer: {layer} L = {L}: {worst_name} differs by {worst_diff:.2e}, {worst:.2f} of the "
                  f"bound {TOL:g} * max |torch| + {ATOL:g}", file=sys.stderr)
            return 1
        before = None if args.no_interleave else c2f_entry(binary, layer, L)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        row = {"layer": layer, "L": L, "torch_step_ms": 1e3 * statistics.median(times), "first_step_s": first,
               "worst_fraction_of_bound": worst, "worst_abs_diff": worst_diff, "worst_tensor": worst_name,
               "reps": args.reps}
        if before is not None:
            after = c2f_entry(binary, layer, L)
            row["c2f"] = mean_entry(before, after)
            row["c2f_step_ms_before_after"] = [before["step_ms"], after["step_ms"]]
        rows.append(row)
        c2f_note = (f"; c2f step {row['c2f']['step_ms']:.1f} ms (before {before['step_ms']:.1f}, after "
                    f"{row['c2f_step_ms_before_after'][1]:.1f})" if before is not None else "")
        print(f"  {layer} L = {L}: gradients equal (worst {worst:.2f} of the bound, |diff| {worst_diff:.1e} in "
              f"{worst_name}); torch step "
              f"{row['torch_step_ms']:.1f} ms{c2f_note}", flush=True)
        del module, y, dx, ref, ours
    doc = {"setup": setup, "tolerance": f"max |c2f - torch| <= {TOL:g} * max |torch| + {ATOL:g} per tensor", "results": rows,
           "load_average": os.getloadavg()}
    (out_dir / "torch_train_peer.json").write_text(json.dumps(doc, indent=1))
    bench_file = out_dir / "bench_train.json"
    if bench_file.exists():
        md = (f"torch.autograd: PyTorch {setup['torch_version']}, {setup['blas_kernel']}; c2f: bench_train, "
              f"{threads} threads; load average {', '.join(f'{v:.2f}' for v in doc['load_average'])} at the end.\n\n"
              + table(rows, json.loads(bench_file.read_text())))
        (out_dir / "torch_train_peer.md").write_text(md)
        print(md)
        memory_plot(json.loads(bench_file.read_text()), out_dir / "train_memory_per_token.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
