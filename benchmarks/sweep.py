#!/usr/bin/python3
"""Runs c2f's benchmark sweep and turns it into a table, Google Benchmark JSON and PNG plots.

    /usr/bin/python3 benchmarks/sweep.py [--long] [--build build/release] [--out results/latest]
                                         [--only attention|runtime|c2f2d|decode ...]

Parts (all by default; `--only` picks some), each streaming its progress:
    attention   bench_attention: the layers against the GEMM and copy-bandwidth rooflines (and a second,
                one-thread run of GEMM and MHA); the peers on OpenBLAS, same threads: bench_libtorch (when
                built) and benchmarks/torch_peer.py (PyTorch modules on c2f's weights and inputs)
    runtime     bench_runtime* (threads, OpenMP builds, latency, concurrent callers, SIMD flags)
    c2f2d       bench_c2f2d: two-dimensional C2F against the copy-bandwidth and GEMM rooflines
    decode      bench_decode: per-token decode latency from 1k to 128k context (MHA, SparseC2F, HMHA)
The output folder receives each binary's Google Benchmark JSON (bench_attention_1thread.json for the
one-thread run), torch_peer.json and torch_peer.md (the PyTorch peer), summary.md (the tables printed at
the end, and the target checks) and the plots (time_vs_length.png, speedup_vs_chunk.png,
memory_vs_length.png, sparse_error_vs_speedup.png, decode_latency.png). Every ratio is taken between
entries of the same run.
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHUNKS = [8, 16, 32, 64, 128, 256]
PARTS = ["attention", "runtime", "c2f2d", "decode"]  # the main job's parts, in the order they run
SPARSE_MODES = {"sparse": 0, "sparse_token": 1, "sparse_token_causal": 2}  # bench_attention's 4th argument


def run_benchmark(binary, out_json, extra_args):
    """Runs one Google Benchmark binary, printing each finished entry with a progress counter."""
    listed = [line for line in subprocess.run([str(binary), "--benchmark_list_tests"] + extra_args, check=True,
                                              capture_output=True, text=True).stdout.splitlines()
              if line and " " not in line]
    total = len(listed)
    print(f"== {binary.name}: {total} entries", flush=True)
    cmd = [str(binary), f"--benchmark_out={out_json}", "--benchmark_out_format=json",
           "--benchmark_counters_tabular=false"] + extra_args
    start = time.time()
    done = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
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
            elif line.startswith(("check", "Run on", "Load Average")):
                print(line, flush=True)
    if proc.returncode != 0:
        sys.exit(f"{binary.name} failed with exit code {proc.returncode}")
    with open(out_json) as f:
        return json.load(f)


def entries(result):
    """{(name, L, extra): entry} of a Google Benchmark JSON result: the median of repeated runs, or the
    single run."""
    out = {}
    for b in result["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if b.get("run_type") != "aggregate" and b.get("repetitions", 1) > 1:
            continue
        parts = b["run_name"].split("/")
        args = tuple(int(p) for p in parts[1:] if p.isdigit())
        out[(parts[0],) + args] = b
    return out


def ms(b):
    assert b["time_unit"] == "ms"
    return b["real_time"]


def fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


def slope(xs, ys):
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summarize(attn, torch_result, one_thread=None, peers=None):
    """The attention part's tables and targets. attn: bench_attention's JSON; torch_result:
    bench_libtorch's (or None); one_thread: bench_attention's gemm and mha_streaming entries run with
    C2F_BENCH_THREADS=1 (or None); peers: torch_peer.py's JSON (or None). Every ratio is between entries
    of this sweep."""
    e = entries(attn)
    lengths = sorted({k[1] for k in e if k[0] == "mha_streaming"})
    out = []
    ctx = attn["context"]
    out.append(f"Machine: {ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz ({platform.processor() or platform.machine()}), "
               f"{ctx.get('c2f_threads')} threads, Eigen SIMD: {ctx.get('c2f_isa')}, sweep `{ctx.get('c2f_sweep')}`, "
               f"{ctx.get('date')}; "
               f"d = 512, 8 heads, batch 1, float.")
    out.append("")
    rows = []
    for L in lengths:
        g, s = e[("gemm", L)], e[("mha_streaming", L)]
        n = e.get(("mha_naive", L))
        h = e.get(("hmha", L, 64))
        rows.append([L, f"{g['GFLOPS']:.1f}", f"{ms(s):.1f}", f"{s['GFLOPS']:.1f}",
                     f"{100 * s['GFLOPS'] / g['GFLOPS']:.0f} %", fmt_bytes(s["peak_bytes"]),
                     f"{ms(n):.1f}" if n else "—", fmt_bytes(n["peak_bytes"]) if n else "—",
                     f"{ms(h):.1f}" if h else "—", fmt_bytes(h["peak_bytes"]) if h else "—"])
    out.append("### Full attention against the GEMM roofline (same run)")
    out.append("")
    out.append(table(["L", "GEMM GFLOPS", "MHA ms", "MHA GFLOPS", "MHA / GEMM", "MHA memory",
                      "naive ms", "naive memory", "HMHA ms", "HMHA memory"], rows))
    extra_hmha = sorted(k[1] for k in e if k[0] == "hmha" and k[1] not in lengths)
    if extra_hmha:
        out.append("")
        out.append("HMHA beyond the MHA lengths: " + ", ".join(
            f"L = {L}: {ms(e[('hmha', L, 64)]):.1f} ms" for L in extra_hmha))
    out.append("")
    out.append("### C2FAttention: time, speedup over MultiHeadAttention (same run), peak memory")
    out.append("")
    rows = []
    for L in lengths:
        mha = ms(e[("mha_streaming", L)])
        row = [L]
        for c in CHUNKS:
            b = e.get(("c2f", L, c))
            row.append(f"{ms(b):.2f} ms, {mha / ms(b):.0f}×, {fmt_bytes(b['peak_bytes'])}" if b else "—")
        rows.append(row)
    out.append(table(["L"] + [f"chunk {c}" for c in CHUNKS], rows))

    sparse = sorted(k for k in e if k[0] == "sparse")
    if sparse:
        out.append("")
        out.append("### SparseC2FAttention (chunk 64) against MultiHeadAttention, same weights, random-walk input")
        out.append("")
        out.append("Per-chunk gating (mean query of a chunk), per-token gating (MoBA: each token's own query) "
                   "and per-token causal; relative error against full MHA (causal MHA for the causal column).")
        out.append("")
        rows = []
        for key in sparse:
            _, L, chunk, top_k, _mode = key
            b = e[key]
            mha = ms(e[("mha_streaming", L)])
            row = [L, top_k, f"{ms(b):.1f} ms, {mha / ms(b):.1f}×, {b['rel_error']:.3f}", fmt_bytes(b["peak_bytes"])]
            for name in ("sparse_token", "sparse_token_causal"):
                t = e.get((name, L, chunk, top_k, SPARSE_MODES[name]))
                row.append(f"{ms(t):.1f} ms, {ms(t) / ms(b):.2f}× per-chunk time, {t['rel_error']:.3f}" if t else "—")
            rows.append(row)
        out.append(table(["L", "top_k", "per chunk: time, speedup vs MHA, error", "memory",
                          "per token: time, vs per chunk, error", "per token causal: time, vs per chunk, error"],
                         rows))

    if ("c2f", 1024, 32) in e and ("mha_naive", 1024) in e:
        out.append("")
        out.append(seed004_table(e))

    checks = []
    window = [L for L in lengths if 1024 <= L <= 8192]
    if window:
        worst = min(e[("mha_streaming", L)]["GFLOPS"] / e[("gemm", L)]["GFLOPS"] for L in window)
        checks.append(("streaming MHA ≥ 60 % of the GEMM GFLOPS for L in " + ", ".join(map(str, window)),
                       f"lowest {100 * worst:.0f} %", worst >= 0.60))
    if ("c2f", 16384, 32) in e:
        r = ms(e[("mha_streaming", 16384)]) / ms(e[("c2f", 16384, 32)])
        checks.append(("C2F (chunk 32) ≥ 50× faster than MHA at L = 16384", f"{r:.0f}×", r >= 50))
    chunk_g, token_g = e.get(("sparse", 16384, 64, 8, 0)), e.get(("sparse_token", 16384, 64, 8, 1))
    if chunk_g and token_g:
        r = ms(token_g) / ms(chunk_g)
        checks.append(("SparseC2F per-token gating within 1.5× of per-chunk gating (L = 16384, chunk 64, top_k 8)",
                       f"{r:.2f}×", r <= 1.5))
    mem = [(L, e[("mha_streaming", L)]["peak_bytes"]) for L in lengths if L >= 1024]
    if len(mem) >= 2:
        s = slope([m[0] for m in mem], [m[1] for m in mem])
        checks.append(("streaming MHA memory grows linearly in L (log-log slope ≈ 1, L ≥ 1024)", f"slope {s:.2f}",
                       s < 1.2))
    hm = sorted((k[1], ms(b)) for k, b in e.items() if k[0] == "hmha" and k[1] >= 1024)
    if len(hm) >= 2:
        checks.append(("HMHA time vs L (log-log slope, L ≥ 1024)", f"slope {slope(*zip(*hm)):.2f}", None))
    if torch_result is not None:
        t = entries(torch_result)
        c = torch_result["context"]
        rows = []
        for L in sorted({k[1] for k in t if k[0] == "libtorch_mha"}):
            lt, cm = ms(t[("libtorch_mha", L)]), ms(t[("c2f_mha", L)])
            rows.append([L, f"{lt:.1f}", f"{cm:.1f}", f"{lt / cm:.1f}×", f"{t[('c2f_mha', L)]['max_abs_diff']:.2g}"])
        out.append("")
        out.append(f"### c2f MultiHeadAttention vs libtorch {c.get('torch_version', '')} "
                   "torch::nn::MultiheadAttention (same weights and input, same binary)")
        out.append("")
        out.append(f"libtorch's BLAS (sgemm_ from): `{c.get('blas_library', '? (not reported)')}`; "
                   f"OpenBLAS threads {c.get('openblas_threads', '?')}, torch threads {c.get('torch_threads', '?')}, "
                   f"c2f threads {c.get('c2f_threads', '?')}.")
        out.append("")
        out.append(table(["L", "libtorch ms", "c2f ms", "c2f speedup", "max |diff|"], rows))

    # Rooflines: every entry against the fastest GEMM and the STREAM copy bandwidth of this run.
    copy, triad = next((b for k, b in e.items() if k[0] == "copy"), None), next(
        (b for k, b in e.items() if k[0] == "triad"), None)
    gemms = [(b["GFLOPS"], k[1]) for k, b in e.items() if k[0] == "gemm"]
    if copy is not None and gemms and all("bytes" in e[("gemm", L)] for _, L in gemms):
        bw = copy["GB/s"]
        peak, peak_L = max(gemms)
        balance = peak / bw
        llc = max((c["size"] for c in ctx.get("caches", []) if c.get("type") in ("Unified", "Data")), default=0)
        out.append("")
        out.append("### Rooflines (same run)")
        out.append("")
        threads = ctx.get("c2f_threads")
        out.append(
            f"Memory roofline: STREAM copy {bw:.1f} GB/s" + (f" (triad {triad['GB/s']:.1f} GB/s)" if triad else "") +
            f", {threads} threads, 256 MiB arrays, STREAM's byte counts. Compute roofline: the fastest GEMM entry "
            f"of the run, {peak:.1f} GFLOPS ([{peak_L}, 512] × [512, 512], {threads} threads; the GEMM entries "
            f"ranged {min(gemms)[0]:.1f} … {peak:.1f}). Machine balance = {peak:.1f} / {bw:.1f} = {balance:.1f} "
            f"FLOP/byte. Bytes = what a forward must move: read x and the weights, write y. An entry whose intensity "
            f"(FLOP / bytes) is above the balance is bound by the GEMM roofline (fraction = its GFLOPS ÷ "
            f"{peak:.1f}), below it by memory (fraction = its GB/s ÷ {bw:.1f}). Entries marked \"in cache\" move "
            f"less than the {fmt_bytes(llc)} last-level cache: their data stays there between calls, so they can "
            f"pass the copy roofline. Cores = the process's CPU time ÷ wall time during the entry: {threads} on a "
            f"quiet machine, less when other processes held the cores (then every rate of that entry is low).")
        out.append("")
        order = {"gemm": 0, "mha_streaming": 1, "mha_naive": 2, "c2f": 3, "c2f_into": 4, "hmha": 5, "sparse": 6,
                 "sparse_token": 7, "sparse_token_causal": 8}
        rows = []
        for k in sorted((k for k, b in e.items() if k[0] in order and "bytes" in b),
                        key=lambda k: (order[k[0]], k[1:])):
            b = e[k]
            compute = b["intensity"] >= balance
            frac = b["GFLOPS"] / peak if compute else b["GB/s"] / bw
            rows.append(["/".join(map(str, k)), f"{ms(b):.2f}", f"{b['GFLOPS']:.1f}",
                         f"{100 * b['GFLOPS'] / peak:.0f} %",
                         fmt_bytes(b["bytes"]) + (" (in cache)" if b["bytes"] < llc else ""), f"{b['GB/s']:.2f}",
                         f"{100 * b['GB/s'] / bw:.1f} %", f"{b['intensity']:.0f}",
                         f"{'GEMM' if compute else 'memory'}, {100 * frac:.0f} %",
                         f"{b['cpu_time'] / b['real_time']:.2f}" if "/process_time" in b["name"] else "?"])
        out.append(table(["entry", "ms", "GFLOPS", "% of GEMM", "bytes", "GB/s", "% of copy BW", "FLOP/byte",
                          "binding roofline, fraction", "cores"], rows))
        c2f_big = [(e[("c2f", L, c)]["GFLOPS"] / peak, L, c) for L in lengths if L >= 4096
                   for c in CHUNKS if c >= 32 and ("c2f", L, c) in e]
        if c2f_big:
            worst = min(c2f_big)
            checks.append((f"C2F (chunk ≥ 32, L ≥ 4096) ≥ 75 % of the {ctx.get('c2f_threads')}-thread GEMM GFLOPS "
                           f"(the run's fastest GEMM, {peak:.1f})",
                           f"lowest {100 * worst[0]:.0f} % (L = {worst[1]}, chunk {worst[2]}); highest "
                           f"{100 * max(c2f_big)[0]:.0f} % (L = {max(c2f_big)[1]}, chunk {max(c2f_big)[2]})",
                           worst[0] >= 0.75))
        into = [(b["GFLOPS"] / peak, k[1]) for k, b in sorted(e.items()) if k[0] == "c2f_into"]
        if into:
            checks.append(("C2F (chunk 32) with forward_into (a reused output buffer) ≥ 75 % of the GEMM GFLOPS",
                           ", ".join(f"L = {L}: {100 * f:.0f} %" for f, L in into), min(into)[0] >= 0.75))
        for name, label in (("hmha", "HMHA (W = 64)"), ("sparse", "SparseC2F (chunk 64, per-chunk gating)")):
            fr = sorted(b["GFLOPS"] / peak for k, b in e.items() if k[0] == name)
            if fr:
                checks.append((f"{label}: fraction of the GEMM GFLOPS reached (all its entries; no target)",
                               f"{100 * fr[0]:.0f} … {100 * fr[-1]:.0f} %", None))

    if one_thread is not None:
        o = entries(one_thread)
        rows, fracs = [], []
        for L in sorted(k[1] for k in o if k[0] == "mha_streaming"):
            g, m = o.get(("gemm", L)), o[("mha_streaming", L)]
            if g is None:
                continue
            frac = m["GFLOPS"] / g["GFLOPS"]
            fracs.append((frac, L))
            rows.append([L, f"{g['GFLOPS']:.1f}", f"{ms(m):.1f}", f"{m['GFLOPS']:.1f}", f"{100 * frac:.0f} %",
                         "yes" if frac >= 0.8 else "**no**"])
        out.append("")
        out.append(f"### MHA vs one-thread GEMM (a second, short run of bench_attention with C2F_BENCH_THREADS="
                   f"{one_thread['context'].get('c2f_threads')})")
        out.append("")
        out.append(table(["L", "GEMM GFLOPS (1 thread)", "MHA ms (1 thread)", "MHA GFLOPS (1 thread)",
                          "MHA / GEMM", "≥ 80 %"], rows))
        want = [L for L in (1024, 2048, 4096, 8192) if any(L == f[1] for f in fracs)]
        if want:
            worst = min(f for f in fracs if f[1] in want)
            checks.append(("MHA ≥ 80 % of the single-thread GEMM GFLOPS at L ∈ {" + ", ".join(map(str, want)) + "}",
                           f"lowest {100 * worst[0]:.0f} % (L = {worst[1]})", worst[0] >= 0.8))

    if peers is not None:
        from torch_peer import peer_table
        peer_text, by_key = peer_table(peers, attn, torch_result)
        out.append("")
        out.append(peer_text)
        skipped = [f"{r['label']} at L = {r['L']} ({r['skipped']})" for r in peers["results"] if "skipped" in r]
        if skipped:
            out.append("")
            out.append("Not run in PyTorch: " + "; ".join(skipped) + ".")
        row = by_key.get(("mha", 2048))
        if row and row.get("torch_ms") and row.get("c2f_ms"):
            r = row["torch_ms"] / row["c2f_ms"]
            checks.append(("MHA ≥ 3× PyTorch's nn.MultiheadAttention at L = 2048 (2 threads each)", f"{r:.1f}×", r >= 3))
        if row and row.get("best") and row.get("c2f_ms"):
            checks.append(("MHA ≥ 3× the best MHA peer (PyTorch nn.MultiheadAttention, libtorch) at L = 2048",
                           f"{row['speedup']:.1f}× ({row['best'][1]})", row["speedup"] >= 3))
        row = by_key.get(("c2f32", 16384))
        if row and row.get("torch_ms") and row.get("c2f_ms"):
            r = row["torch_ms"] / row["c2f_ms"]
            checks.append(("C2F (chunk 32) at L = 16384 ≥ 15× PyTorch's seed 004 module", f"{r:.1f}×", r >= 15))
        ranked = sorted((v["speedup"], k) for k, v in by_key.items() if v.get("speedup"))
        if ranked:
            checks.append(("c2f against the best peer, every layer and L compared (lowest … highest)",
                           f"{ranked[0][0]:.1f}× ({ranked[0][1][0]}, L = {ranked[0][1][1]}) … "
                           f"{ranked[-1][0]:.1f}× ({ranked[-1][1][0]}, L = {ranked[-1][1][1]})", None))
    out.append("")
    out.append("### Targets")
    out.append("")
    out.append(table(["target", "measured", "met"],
                     [[c, m, "—" if ok is None else ("yes" if ok else "**no**")] for c, m, ok in checks]))
    return "\n".join(out), e, lengths


def seed004_table(e):
    """Seed 004's table (n = 1024, k = 32, h = 8, d = 512), answered with this run's measurements."""
    n, k, h, d = 1024, 32, 8, 512
    m = n // k
    mha, naive, c2f = e[("mha_streaming", n)], e[("mha_naive", n)], e[("c2f", n, k)]
    rows = [
        ["seed's \"computational complexity\"", "O(n²) = 1M", "O(m² + m·k²) = 38k (m² + m·k² is 33,792)"],
        ["attention scores per forward (all heads)", f"h·n² = {h * n * n:,}",
         f"coarse h·m² = {h * m * m:,} + fine h·m·k = {h * m * k:,} (the seed's formula computes h·m·k² = "
         f"{h * m * k * k:,}; the fine query is the same for a whole chunk, so one row per chunk suffices)"],
        ["FLOP per forward (analytic, whole layer)", f"{mha['FLOP'] / 1e9:.2f} G", f"{c2f['FLOP'] / 1e9:.3f} G"],
        ["seed's \"actual memory (h=8, d=512)\"", "4.2 GB", "1.1 GB"],
        ["largest score buffer", f"naive kernel: one head's n² floats = {fmt_bytes(4 * n * n)}; streaming: "
         f"64 × 256 floats = {fmt_bytes(4 * 64 * 256)} per thread",
         f"coarse: m × m = {m} × {m} per head (inside the same 64 × 256 streaming block); fine: h × k = "
         f"{h} × {k} per chunk"],
        ["peak working memory (measured, incl. output)",
         f"streaming {fmt_bytes(mha['peak_bytes'])}; naive {fmt_bytes(naive['peak_bytes'])}",
         fmt_bytes(c2f["peak_bytes"])],
        ["time per forward (measured)", f"{ms(mha):.1f} ms (naive {ms(naive):.1f} ms)",
         f"{ms(c2f):.2f} ms ({ms(mha) / ms(c2f):.1f}× faster)"],
    ]
    return ("### Seed 004's table, measured (n = 1024, k = 32, h = 8, d = 512, batch 1)\n\n" +
            table(["", "MultiHeadAttention", "C2FAttention (chunk 32)"], rows))


RUNTIME_VARIANTS = [  # (binary, column title); benchmarks/bench_runtime.cpp explains the four builds
    ("bench_runtime", "plain"),
    ("bench_runtime_omp", "-fopenmp (c2f pool)"),
    ("bench_runtime_omploops", "-fopenmp (OpenMP loops)"),
    ("bench_runtime_portable", "portable (no -march)"),
]


def us(b):
    """Real time of an entry in microseconds."""
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b["time_unit"]]
    return b["real_time"] * scale


def ratio_cell(value, base, fmt="{:.2f}"):
    return fmt.format(value / base) if value and base else "—"


def runtime_summary(results):
    """Tables of the runtime sweeps (bench_runtime*): OpenMP vs plain, latency, concurrency, loop cost,
    SIMD flags. `results` maps a binary name to its Google Benchmark JSON. Returns (markdown, checks)."""
    e = {name: entries(r) for name, r in results.items()}
    plain = e.get("bench_runtime", {})
    out, checks = [], []
    ctx = results["bench_runtime"]["context"]
    out.append(f"Runtime sweeps: {ctx.get('num_cpus')} CPUs, c2f threads {ctx.get('c2f_threads')}, "
               f"small-work threshold {float(ctx.get('c2f_min_parallel_work', 0)):.3g} FLOP, "
               f"Eigen SIMD {ctx.get('c2f_isa')}; medians of {max(1, results['bench_runtime']['benchmarks'][0].get('repetitions', 1))} "
               f"repetitions. d = 512, 8 heads, float, batch 1 unless stated.")
    out.append("")

    # (a) OpenMP vs plain.
    rows = []
    for key, label in [(("rt_mha", 256), "MHA L = 256"), (("rt_mha", 2048), "MHA L = 2048"),
                       (("rt_c2f", 16384, 32), "C2F (chunk 32) L = 16384")]:
        base = plain.get(key)
        if base is None:
            continue
        row = [label, f"{us(base) / 1e3:.2f}"]
        for variant in ("bench_runtime_omp", "bench_runtime_omploops"):
            b = e.get(variant, {}).get(key)
            row.append(f"{us(b) / 1e3:.2f} ({us(b) / us(base):.2f}×)" if b else "—")
            if b and variant == "bench_runtime_omp":
                checks.append((f"-fopenmp build within 10 % of the plain build: {label}", f"{us(b) / us(base):.2f}×",
                               us(b) / us(base) <= 1.10))
        rows.append(row)
    if rows:
        out.append("### (a) -fopenmp against the plain build (ms per forward, all threads; ratio to plain)")
        out.append("")
        out.append(table(["", "plain", "-fopenmp, c2f pool (default)", "-fopenmp, C2F_PARALLEL_OPENMP"], rows))
        out.append("")

    # (b) latency, per build.
    for variant, title in RUNTIME_VARIANTS[:3]:
        v = e.get(variant, {})
        if not any(k[0] == "lat_mha" for k in v):
            continue
        rows = []
        worst = {}
        for model in ("mha", "c2f"):
            for B in (1, 8):
                for L in (1, 8, 64, 256):
                    one, two, free = (v.get((f"lat_{model}", B, L, 1, 1)), v.get((f"lat_{model}", B, L, 2, 1)),
                                      v.get((f"lat_{model}", B, L, 2, 0)))
                    if not (one and two):
                        continue
                    r = us(two) / us(one)
                    worst[model] = max(worst.get(model, 0), r)
                    over = "—"
                    gemm = v.get((f"lat_gemm_{model}", B))
                    if L == 1 and gemm:
                        over = f"{100 * (us(one) / us(gemm) - 1):.0f} % (GEMMs {us(gemm):.0f} µs)"
                        if variant == "bench_runtime":
                            checks.append((f"L = 1 single-thread overhead over the GEMM work < 20 %: {model.upper()} B = {B}",
                                           f"{100 * (us(one) / us(gemm) - 1):.0f} %", us(one) / us(gemm) < 1.20))
                    rows.append([model.upper(), B, L, f"{us(one):.0f}", f"{us(two):.0f}", f"{r:.2f}",
                                 f"{us(free):.0f} ({us(free) / us(one):.2f})" if free else "—", over])
        out.append(f"### (b) Latency of small calls, {title} build (µs per forward)")
        out.append("")
        out.append(table(["layer", "B", "L", "1 thread", "2 threads", "2 / 1", "2 threads, no threshold (/ 1)",
                          "1-thread overhead over its GEMMs"], rows))
        out.append("")
        for model, r in worst.items():
            checks.append((f"{title}: {model.upper()} latency, 2 threads never > 5 % slower than 1", f"worst {r:.2f}×",
                           r <= 1.05))

    # (c) concurrency.
    rows, through = [], {}
    for callers in (1, 2, 4):
        for threads in (1, 2):
            row = [callers, threads]
            for variant, _ in RUNTIME_VARIANTS[:3]:
                b = e.get(variant, {}).get(("conc_mha", callers, threads))
                if b:
                    fps = callers / (us(b) * 1e-6)
                    through[(variant, callers, threads)] = fps
                    row.append(f"{fps:.1f}")
                else:
                    row.append("—")
            rows.append(row)
    if through:
        out.append("### (c) Concurrent callers on one shared MultiHeadAttention, L = 1024 (total forwards/s)")
        out.append("")
        out.append(table(["callers", "threads per call"] + [t for _, t in RUNTIME_VARIANTS[:3]], rows))
        out.append("")
        for variant, title in RUNTIME_VARIANTS[:3]:
            t = {k[1:]: f for k, f in through.items() if k[0] == variant}
            if len(t) < 6:
                continue
            r1 = t[(2, 1)] / t[(1, 2)]
            r2 = t[(4, 2)] / max(t.values())
            checks.append((f"{title}: 2 callers × 1 thread ≥ 0.9 × 1 caller × 2 threads", f"{r1:.2f}", r1 >= 0.9))
            checks.append((f"{title}: 4 callers × 2 threads ≥ 0.8 × the best", f"{r2:.2f}", r2 >= 0.8))

    # The cost of one loop, which sets the small-work threshold.
    loops = sorted({k[1] for k in plain if k[0] == "loop"})
    if loops:
        rows = []
        for r in loops:
            w = 65536 * r
            cells = [f"{w / 1e6:.3g} M"]
            for cold in (0, 1):
                one, two = plain.get(("loop", r, 1, cold)), plain.get(("loop", r, 2, cold))
                cells += [f"{us(one):.1f}", f"{us(two):.1f}", f"{us(two) / us(one):.2f}"]
            rows.append(cells)
        out.append("### One parallel loop of 8 tasks (µs), threshold off: where a second thread starts to pay")
        out.append("")
        out.append(table(["work (FLOP)", "1 thread", "2 threads", "2 / 1", "1 thread, pool idle",
                          "2 threads, pool idle", "2 / 1"], rows))
        out.append("")

    # SIMD flags.
    port = e.get("bench_runtime_portable", {})
    rows = []
    for key, label in [(("rt_gemm", 2048), "GEMM [2048, 512] × [512, 512]"), (("rt_mha", 256), "MHA L = 256"),
                       (("rt_mha", 2048), "MHA L = 2048"), (("rt_c2f", 16384, 32), "C2F (chunk 32) L = 16384")]:
        a, b = port.get(key), plain.get(key)
        if a and b:
            rows.append([label, f"{us(a) / 1e3:.2f}", f"{us(b) / 1e3:.2f}", f"{us(a) / us(b):.2f}×"])
    if rows:
        out.append(f"### SIMD flags: portable ({results['bench_runtime_portable']['context'].get('c2f_isa')}) against "
                   f"this build ({ctx.get('c2f_isa')}), ms, all threads")
        out.append("")
        out.append(table(["", "portable", "this build", "speedup"], rows))
        out.append("")
    return "\n".join(out), checks


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
        args = [f"--c2f_set={which}", f"--benchmark_repetitions={repetitions}", "--benchmark_enable_random_interleaving=true"]
        results[binary] = run_benchmark(path, out_dir / f"{binary}.json", args)
    return results


def c2f2d_section(result):
    """Issue 14's table: C2FAttention2D over grids and blocks next to the in-run copy bandwidth and GEMM
    rooflines, full MHA where it runs (to 128²) and its fitted slope beyond; and the targets."""
    e = entries(result)
    ctx = result["context"]
    cv = {}  # run name -> coefficient of variation of the repetitions' times (Google Benchmark's "cv")
    for b in result["benchmarks"]:
        if b.get("aggregate_name") == "cv":
            cv[b["run_name"]] = b["real_time"]

    def spread(b):
        return f"{100 * cv[b['run_name']]:.0f} % ({b.get('repetitions', 1)} runs)" if b["run_name"] in cv else "1 run"

    copy = next(b for k, b in e.items() if k[0] == "copy")
    gemm = next(b for k, b in e.items() if k[0] == "gemm")
    bw, peak_flops = copy["GB/s"] * 1e9, gemm["GFLOPS"] * 1e9
    mha = sorted((k[1] * k[1], ms(b)) for k, b in e.items() if k[0] == "mha")
    fit = mha[-2:] if len(mha) >= 2 else []
    mha_slope = slope(*zip(*fit)) if fit else None

    def mha_time(L):
        for tokens, t in mha:
            if tokens == L:
                return t, False
        if mha_slope is None or L < mha[-1][0]:
            return None, False
        return mha[-1][1] * (L / mha[-1][0]) ** mha_slope, True

    def roofline(b):
        t_mem, t_flop = b["bytes"] / bw, b["FLOP"] / peak_flops
        bound, t = ("memory", t_mem) if t_mem >= t_flop else ("compute", t_flop)
        return bound, t * 1e3 / ms(b)

    out = ["### C2FAttention2D (issue 14): 2-D blocks, relative position bias, against the rooflines (same run)", ""]
    out.append(f"{ctx.get('num_cpus')} CPUs, {ctx.get('c2f_threads')} threads, Eigen SIMD: {ctx.get('c2f_isa')}, "
               f"sweep `{ctx.get('c2f2d_sweep')}`, {ctx.get('date')}; d = 512, 8 heads, batch 1, float, table = the "
               f"block grid. Medians of repetitions (repetitions and their spread in bench_c2f2d.json). Rooflines "
               f"of this run: STREAM copy {copy['GB/s']:.1f} GB/s (2 × 256 MiB), GEMM {gemm['GFLOPS']:.1f} GFLOPS "
               f"([4096, 512] × [512, 512]). A forward moves 3·L·d·4 bytes (x read twice, y written once) and does "
               f"the analytic FLOP; roofline = the larger of bytes / copy bandwidth and FLOP / GEMM rate; "
               f"fraction = roofline time / measured time." +
               (f" MHA beyond 128² tokens: its time at 128² × (L / 128²)^{mha_slope:.2f} (log-log slope of 64² → "
                f"128²), *extrapolated*." if mha_slope else ""))
    out.append("")
    rows = []
    for k in sorted(k for k in e if k[0] in ("c2f2d", "c2f2d_into")):
        b = e[k]
        side, block = k[1], k[2]
        L = side * side
        bound, frac = roofline(b)
        mem = "—"
        if "input_bytes" in b:
            io = b["input_bytes"] + 4.0 * L * 512  # input + output
            mem = f"{fmt_bytes(b['peak_bytes'])}, ×{(b['input_bytes'] + b['peak_bytes']) / io:.3f}"
        t_mha, extrapolated = mha_time(L)
        mha_col = "—" if t_mha is None else (f"{t_mha / 1e3:.3g} s" + (" *(extrapolated)*" if extrapolated else ""))
        speedup = "—" if t_mha is None else f"{t_mha / ms(b):,.0f}×" + (" *(extr.)*" if extrapolated else "")
        name = "forward" if k[0] == "c2f2d" else "forward_into"
        rows.append([f"{side}²", f"{L:,}", f"{block}²", int(b["blocks"]), name, f"{ms(b):.2f}", spread(b),
                     f"{b['FLOP'] / 1e9:.3g}", f"{b['GFLOPS']:.1f}", f"{b['GB/s']:.1f}", mem,
                     f"{bound}, {100 * frac:.0f} %", mha_col, speedup])
    load = ", ".join(f"{v:.2f}" for v in ctx.get("load_avg", []))
    out.append(f"Noise: load average {load or '?'} when the binary started (other processes share the cores); "
               f"spread of the roofline entries: copy {spread(copy)}, GEMM {spread(gemm)}.")
    out.append("")
    out.append(table(["grid", "tokens", "block", "blocks", "call", "ms (median)", "spread (cv)", "GFLOP", "GFLOPS",
                      "GB/s", "peak memory, (input + peak) / (input + output)", "roofline binding, fraction",
                      "full MHA", "speedup"], rows))

    checks = []
    target = e.get(("c2f2d", 1024, 64))
    if target:
        L = 1024 * 1024
        full_t, _ = mha_time(L)
        out.append("")
        out.append("### Seed 004's claim for a 1024 × 1024 image in 64 × 64 blocks, measured")
        out.append("")
        h, d, m = 8, 512, 256
        claim = [["seed's claim", "O(10¹²)", "O(10⁸)"],
                 ["attention scores (all heads)", f"h·n² = {h * L * L:.3g}",
                  f"coarse h·m² + fine h·n = {h * m * m + h * L:.3g} (one query per block)"],
                 ["analytic FLOP per forward", f"{8.0 * L * d * d + 4.0 * L * L * d:.3g} (8·n·d² + 4·n²·d)",
                  f"{target['FLOP']:.3g}"],
                 ["time per forward", "—" if full_t is None else f"{full_t / 1e3:,.0f} s *(extrapolated)*",
                  f"{ms(target) / 1e3:.3f} s (measured)"],
                 ["peak working memory (incl. output)", f"≥ the output, {fmt_bytes(4.0 * L * d)}",
                  f"{fmt_bytes(target['peak_bytes'])} (measured)"]]
        out.append(table(["", "full self-attention (MHA)", "C2FAttention2D"], claim))
        io = target["input_bytes"] + 4.0 * L * d
        ratio = (target["input_bytes"] + target["peak_bytes"]) / io
        checks.append(("1024² tokens, 64² blocks in one forward within input + output + 10 % of memory",
                       f"×{ratio:.3f}", ratio <= 1.10))
        for name in ("c2f2d", "c2f2d_into"):
            b = e.get((name, 1024, 64))
            if b:
                bound, frac = roofline(b)
                checks.append((f"1024², 64² blocks ({'forward' if name == 'c2f2d' else 'forward_into'}) ≥ 50 % of "
                               f"the binding roofline", f"{bound}, {100 * frac:.0f} %", frac >= 0.5))
        into, fresh = e.get(("c2f2d_into", 1024, 64)), e.get(("new_output", 1024))
        if into and fresh:
            out.append("")
            out.append(f"forward() returns a new 2 GiB tensor: it takes {ms(target) - ms(into):.0f} ms longer than "
                       f"forward_into() a reused buffer; allocating and writing a fresh [1024², 512] float tensor "
                       f"alone (entry `new_output`, no attention) takes {ms(fresh):.0f} ms "
                       f"({fresh['GB/s']:.1f} GB/s, against {copy['GB/s']:.1f} GB/s for STREAM copy between "
                       f"touched buffers): the operating system mapping and zeroing new pages.")
    out.append("")
    out.append("### Targets (issue 14)")
    out.append("")
    out.append(table(["target", "measured", "met"], [[c, m_, "yes" if ok else "**no**"] for c, m_, ok in checks]))
    return "\n".join(out)


DECODE_LAYERS = [("mha", "MHA"), ("mha_bf16", "MHA, bf16 cache"), ("sparse", "SparseC2F"), ("hmha", "HMHA")]


def decode_section(result, out_dir):
    """Issue 15's tables: per-token decode latency (n = 1) against the context for each layer and batch,
    the states' memory, MHA's achieved key/value bandwidth against the in-run copy bandwidth; the targets;
    and a plot of latency vs context. Returns (markdown, [plot files])."""
    e = entries(result)
    ctx = result["context"]
    copy = next(b for k, b in e.items() if k[0] == "copy")
    read = next((b for k, b in e.items() if k[0] == "read"), None)
    bw = copy["GB/s"]
    contexts = sorted({k[2] for k in e if k[0] == "mha"})
    batches = sorted({k[1] for k in e if k[0] == "mha"})

    def per_token(b):  # ms per decode step of the whole batch
        return ms(b)

    out = ["### Decoding (issue 15): one token per step against the context, same run", ""]
    out.append(f"{ctx.get('num_cpus')} CPUs, {ctx.get('c2f_threads')} threads, Eigen SIMD: {ctx.get('c2f_isa')}, "
               f"sweep `{ctx.get('decode_sweep')}`, {ctx.get('date')}; d = 512, 8 heads, float weights, causal "
               f"layers; SparseC2F chunk 64, top_k 8 (per-token gating); HMHA window 64. A step = decode() of one "
               f"new token for each of the B sequences (median of 3 repetitions). Rooflines of this run: STREAM "
               f"copy {bw:.1f} GB/s" + (f", read-only scan {read['GB/s']:.1f} GB/s" if read else "") +
               ". MHA GB/s = the key and value bytes a step reads (B · context · 2 · d · 4) per second.")
    rows_by_batch = {}
    for B in batches:
        out.append("")
        out.append(f"Batch {B}: ms per step (all {B} sequences), and the decoding state's memory")
        out.append("")
        rows = []
        for c in contexts:
            m = e.get(("mha", B, c))
            if not m:
                continue
            row = [f"{c // 1024}k", f"{per_token(m):.3f}", f"{m['GB/s']:.1f} ({100 * m['GB/s'] / bw:.0f} %)"]
            bf = e.get(("mha_bf16", B, c))
            row.append(f"{per_token(bf):.3f}" if bf else "—")
            for name in ("sparse", "hmha"):
                b = e.get((name, B, c))
                row.append(f"{per_token(b):.3f} ({per_token(m) / per_token(b):.1f}×)" if b else "—")
            mem = [e.get((name, B, c)) for name in ("mha", "mha_bf16", "sparse", "hmha")]
            row.append(" / ".join(fmt_bytes(b["state_bytes"]) if b else "—" for b in mem))
            rows.append(row)
        rows_by_batch[B] = rows
        out.append(table(["context", "MHA ms", "MHA GB/s (of copy)", "MHA bf16-cache ms", "SparseC2F ms (vs MHA)",
                          "HMHA ms (vs MHA)", "state: MHA / MHA bf16 / SparseC2F / HMHA"], rows))

    checks = []
    long_ctx = [c for c in contexts if c >= 32768]
    if long_ctx:
        worst = min((e[("mha", B, c)]["GB/s"] / bw, B, c) for B in batches for c in long_ctx if ("mha", B, c) in e)
        checks.append((f"MHA decode ≥ 50 % of the copy bandwidth from 32k context on (B = "
                       f"{', '.join(map(str, batches))})",
                       f"lowest {100 * worst[0]:.0f} % (B = {worst[1]}, {worst[2] // 1024}k)", worst[0] >= 0.5))
    top = contexts[-1] if contexts else None
    if top == 131072:
        for B in batches:
            m, sp = e.get(("mha", B, top)), e.get(("sparse", B, top))
            if m and sp:
                r = per_token(m) / per_token(sp)
                checks.append((f"SparseC2F decode ≥ 10× faster than MHA per token at 128k (B = {B})", f"{r:.1f}×",
                               r >= 10))
    new_threads = max(b.get("new_threads", 0) for k, b in e.items() if k[0] in dict(DECODE_LAYERS))
    checks.append(("no thread created during the timed steps (every entry)", f"max {new_threads:.0f} new threads",
                   new_threads == 0))
    out.append("")
    out.append("### Targets (issue 15)")
    out.append("")
    out.append(table(["target", "measured", "met"], [[c, m_, "yes" if ok else "**no**"] for c, m_, ok in checks]))

    files = []
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "\n".join(out), files
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = {"mha": "k", "mha_bf16": "0.5", "sparse": "tab:green", "hmha": "tab:purple"}
    for name, label in DECODE_LAYERS:
        for B, style in zip(batches, ("-o", "--s")):
            cs = [c for c in contexts if (name, B, c) in e]
            if cs:
                ax.plot(cs, [per_token(e[(name, B, c)]) for c in cs], style, color=colors[name], label=f"{label}, B = {B}")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per decode step",
           title="Decode latency vs context (d = 512, 8 heads)")
    ax.set_xscale("log", base=2)
    files.append(finish(plt, fig, ax, out_dir / "decode_latency.png", legend_size=7))
    return "\n".join(out), files


def finish(plt, fig, ax, path, legend_size):
    """Grid, legend, layout; saves `fig` as a small PNG at `path` and returns the path."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot(e, lengths, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (Debian: python3-matplotlib): no plots")
        return []
    files = []
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(lengths, [ms(e[("mha_streaming", L)]) for L in lengths], "k-o", label="MultiHeadAttention")
    naive = [L for L in lengths if ("mha_naive", L) in e]
    if naive:
        ax.plot(naive, [ms(e[("mha_naive", L)]) for L in naive], "k:", marker="x", label="MHA, naive kernel")
    hm = sorted(k[1] for k in e if k[0] == "hmha")
    ax.plot(hm, [ms(e[("hmha", L, 64)]) for L in hm], "m-s", label="HMHA (W = 64)")
    cmap = plt.get_cmap("viridis")
    for i, c in enumerate(CHUNKS):
        ls = [L for L in lengths if ("c2f", L, c) in e]
        ax.plot(ls, [ms(e[("c2f", L, c)]) for L in ls], "-^", color=cmap(i / len(CHUNKS)), label=f"C2F chunk {c}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="time per forward (ms)",
           title="Time vs length (d = 512, 8 heads, batch 1)")
    files.append(finish(plt, fig, ax, out_dir / "time_vs_length.png", legend_size=7))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, L in enumerate(lengths):
        cs = [c for c in CHUNKS if ("c2f", L, c) in e]
        ax.plot(cs, [ms(e[("mha_streaming", L)]) / ms(e[("c2f", L, c)]) for c in cs], "-o",
                color=plt.get_cmap("plasma")(i / max(1, len(lengths))), label=f"L = {L}")
    ax.set(xscale="log", yscale="log", xlabel="chunk size", ylabel="speedup over MultiHeadAttention",
           title="C2FAttention speedup vs chunk size (same run)")
    ax.set_xticks(CHUNKS)
    ax.set_xticklabels([str(c) for c in CHUNKS])
    files.append(finish(plt, fig, ax, out_dir / "speedup_vs_chunk.png", legend_size=8))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(lengths, [e[("mha_streaming", L)]["peak_bytes"] / 2**20 for L in lengths], "k-o", lw=4, ms=9,
            alpha=0.35, label="MultiHeadAttention (streaming)")
    if naive:
        ax.plot(naive, [e[("mha_naive", L)]["peak_bytes"] / 2**20 for L in naive], "k:", marker="x",
                label="MHA, naive kernel")
    ax.plot(hm, [e[("hmha", L, 64)]["peak_bytes"] / 2**20 for L in hm], "m--s", label="HMHA (W = 64)")
    ls = [L for L in lengths if ("c2f", L, 32) in e]
    ax.plot(ls, [e[("c2f", L, 32)]["peak_bytes"] / 2**20 for L in ls], "g-^", label="C2F chunk 32")
    ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="peak working memory (MiB, measured)",
           title="Memory vs length (heap held during one forward)")
    files.append(finish(plt, fig, ax, out_dir / "memory_vs_length.png", legend_size=8))
    sparse = sorted(k for k in e if k[0] == "sparse")
    if sparse:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for i, L in enumerate(sorted({k[1] for k in sparse})):
            for name, style, label in (("sparse", "-o", "per chunk"), ("sparse_token", "--s", "per token")):
                ks = [k for k in e if k[0] == name and k[1] == L]
                ks.sort()
                xs = [ms(e[("mha_streaming", L)]) / ms(e[k]) for k in ks]
                ys = [e[k]["rel_error"] for k in ks]
                ax.plot(xs, ys, style, color=plt.get_cmap("tab10")(i), label=f"L = {L}, {label}")
                for x, y, k in zip(xs, ys, ks):
                    ax.annotate(f"k={k[3]}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set(xscale="log", yscale="log", xlabel="speedup over MultiHeadAttention (same run)",
               ylabel="relative output error ‖y − y_MHA‖ / ‖y_MHA‖",
               title="SparseC2FAttention (chunk 64): error vs speedup, top_k = k")
        files.append(finish(plt, fig, ax, out_dir / "sparse_error_vs_speedup.png", legend_size=8))
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", action="store_true", help="the long sweep (more lengths, HMHA to 32768)")
    p.add_argument("--build", default=str(REPO / "build" / "release"), help="build folder with benchmarks/")
    p.add_argument("--out", default=str(REPO / "results" / "latest"), help="output folder")
    p.add_argument("--repetitions", type=int, default=1, help="Google Benchmark repetitions (median reported)")
    p.add_argument("--only", choices=PARTS, action="append",
                   help="run only these parts (repeatable; default: all): attention = bench_attention and "
                        "bench_libtorch, runtime = bench_runtime* (threads, OpenMP), c2f2d = bench_c2f2d, "
                        "decode = bench_decode")
    p.add_argument("--runtime-repetitions", type=int, default=3,
                   help="repetitions of the runtime sweeps (bench_runtime*; median reported)")
    p.add_argument("--c2f2d-sweep", choices=["full", "quick"], default="full",
                   help="bench_c2f2d's grids: full (32² … 1024² × blocks 8² … 64², about 4 minutes) or quick "
                        "(to 256², plus 1024² in 64² blocks)")
    p.add_argument("--decode-sweep", choices=["full", "quick"], default="full",
                   help="bench_decode's contexts: full (1k … 128k, about 5 minutes) or quick (to 16k)")
    args = p.parse_args(argv)
    build, out_dir = Path(args.build), Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = args.only or PARTS
    extra = ["--c2f_sweep=long"] if args.long else []
    if args.repetitions > 1:
        extra += [f"--benchmark_repetitions={args.repetitions}"]
    sections, written, files = [], [], []
    if "attention" in parts:
        attn_bin = build / "benchmarks" / "bench_attention"
        attn = run_benchmark(attn_bin, out_dir / "bench_attention.json", extra)
        written.append("bench_attention.json")
        # Issue 13's MHA target is against ONE-thread GEMM: a second, short run on one thread.
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
            # The lengths of the peer table (1024 … 8192), whatever the sweep.
            torch_result = run_benchmark(torch_bin, out_dir / "bench_libtorch.json",
                                         [a for a in extra if not a.startswith("--c2f_sweep")] + ["--c2f_sweep=peers"])
            written.append("bench_libtorch.json")
        else:
            print("bench_libtorch was not built (libtorch-dev not installed): skipping the libtorch peer")
        # The PyTorch peer runs under Debian's python3 (python3-torch), whichever Python runs this script.
        peers = None
        torch_python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
        print(f"== torch_peer.py ({torch_python})", flush=True)
        r = subprocess.run([torch_python, str(REPO / "benchmarks" / "torch_peer.py"), "--build", str(build),
                            "--out", str(out_dir)])
        if r.returncode == 77:
            print(f"{torch_python} has no torch (Debian: python3-torch): skipping the PyTorch peer")
        elif r.returncode != 0:
            sys.exit(f"torch_peer.py failed with exit code {r.returncode}")
        else:
            peers = json.loads((out_dir / "torch_peer.json").read_text())
            written += ["torch_peer.json", "torch_peer.md"]
        text, e, lengths = summarize(attn, torch_result, one_thread, peers)
        sections.append(text)
        files = plot(e, lengths, out_dir)
    if "runtime" in parts:
        results = run_runtime(build, out_dir, args.runtime_repetitions, "all")
        written += [f"{b}.json" for b in results]
        if "bench_runtime" in results:
            runtime_text, checks = runtime_summary(results)
            sections.append("## Threads: runtime sweeps\n\n" + runtime_text + "\n### Runtime targets\n\n" +
                            table(["target", "measured", "met"],
                                  [[c, m, "yes" if ok else "**no**"] for c, m, ok in checks]))
    if "c2f2d" in parts:
        # Its entries set their own repetitions (cheap ones 5, minute-long ones 1); see bench_c2f2d.cpp.
        c2f2d = run_benchmark(build / "benchmarks" / "bench_c2f2d", out_dir / "bench_c2f2d.json",
                              [f"--c2f2d_sweep={args.c2f2d_sweep}"])
        written.append("bench_c2f2d.json")
        sections.append(c2f2d_section(c2f2d))
    if "decode" in parts:
        # Its entries set their own iterations and repetitions; see bench_decode.cpp.
        decode = run_benchmark(build / "benchmarks" / "bench_decode", out_dir / "bench_decode.json",
                               [f"--decode_sweep={args.decode_sweep}"])
        written.append("bench_decode.json")
        text, decode_files = decode_section(decode, out_dir)
        sections.append(text)
        files = list(files) + decode_files
    text = "\n\n".join(sections)
    (out_dir / "summary.md").write_text(text + "\n")
    print()
    print(text)
    print()
    print(f"wrote {out_dir}/: " + ", ".join(written + ["summary.md"] + [f.name for f in files]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
