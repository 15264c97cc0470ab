"""The attention part's tables and targets: bench_attention against the GEMM and copy-bandwidth rooflines,
C2F and SparseC2F against MHA, the coarse-to-fine attention article's table, the libtorch peer, the
one-thread run, the PyTorch peer (torch_peer.py) and the ONNX Runtime peer (ort_peer.py, report/ort.py).
Every ratio is between entries of the same sweep."""

import platform

from . import blas
from .common import entries, fmt_bytes, ms, slope, table, targets_table
from .ort import ort_table, paired_mha
from .ort import peer_table as ort_peer_table

CHUNKS = [8, 16, 32, 64, 128, 256]
SPARSE_MODES = {"sparse": 0, "sparse_token": 1, "sparse_token_causal": 2}  # bench_attention's 4th argument
ROOFLINE_ORDER = {"gemm": 0, "mha_streaming": 1, "mha_naive": 2, "c2f": 3, "c2f_into": 4, "hmha": 5, "sparse": 6,
                  "sparse_token": 7, "sparse_token_causal": 8}  # the rows of the roofline table, in this order


def summarize(attn, torch_result, one_thread=None, peers=None, ort=None, fma_peak=None):
    """The attention part's tables and targets. attn: bench_attention's JSON; torch_result:
    bench_libtorch's (or None); one_thread: bench_attention's gemm and mha_streaming entries run with
    C2F_BENCH_THREADS=1 (or None); peers: torch_peer.py's JSON (or None); ort: ort_peer.py's JSON (or
    None); fma_peak: the fp32 FMA peak (GFLOPS) at c2f's thread count from bench_machine of this sweep (or
    None: the fastest GEMM entry is the compute roofline). Every ratio is between entries of this sweep. Returns (markdown, bench_attention's entries, the
    MHA lengths)."""
    e = entries(attn)
    lengths = sorted({k[1] for k in e if k[0] == "mha_streaming"})
    ctx = attn["context"]
    out = [machine_line(ctx), ""]
    out += full_attention_table(e, lengths)
    out += c2f_table(e, lengths)
    out += sparse_table(e)
    if ("c2f", 1024, 32) in e and ("mha_naive", 1024) in e:
        out += ["", article_table(e)]
    checks = length_checks(e, lengths)
    if torch_result is not None:
        out += libtorch_table(torch_result)
    lines, more = roofline_section(e, lengths, ctx, fma_peak)
    out, checks = out + lines, checks + more
    if one_thread is not None:
        lines, more = one_thread_table(one_thread)
        out, checks = out + lines, checks + more
    if peers is not None:
        lines, more = peers_section(peers, attn, torch_result, ort)
        out, checks = out + lines, checks + more
    elif ort is not None:
        out += ["", ort_table(ort, attn)]
    out += ["", "### Targets", "", targets_table(checks)]
    return "\n".join(out), e, lengths


def machine_line(ctx):
    cpu = platform.processor() or platform.machine()
    return (f"Machine: {ctx.get('num_cpus')} CPUs at {ctx.get('mhz_per_cpu')} MHz ({cpu}), "
            f"{ctx.get('c2f_threads')} threads, Eigen SIMD: {ctx.get('c2f_isa')}, sweep `{ctx.get('c2f_sweep')}`, "
            f"{ctx.get('date')}; "
            f"d = 512, 8 heads, batch 1, float.")


def full_attention_table(e, lengths):
    """MHA (streaming and naive kernels) and HMHA against the GEMM of the same length; HMHA's longer
    lengths on a line below."""
    rows = []
    for L in lengths:
        g, s = e[("gemm", L)], e[("mha_streaming", L)]
        n = e.get(("mha_naive", L))
        h = e.get(("hmha", L, 64))
        rows.append([L, f"{g['GFLOPS']:.1f}", f"{ms(s):.1f}", f"{s['GFLOPS']:.1f}",
                     f"{100 * s['GFLOPS'] / g['GFLOPS']:.0f} %", fmt_bytes(s["peak_bytes"]),
                     f"{ms(n):.1f}" if n else "—", fmt_bytes(n["peak_bytes"]) if n else "—",
                     f"{ms(h):.1f}" if h else "—", fmt_bytes(h["peak_bytes"]) if h else "—"])
    out = ["### Full attention against the GEMM roofline (same run)", ""]
    out.append(table(["L", "GEMM GFLOPS", "MHA ms", "MHA GFLOPS", "MHA / GEMM", "MHA memory",
                      "naive ms", "naive memory", "HMHA ms", "HMHA memory"], rows))
    extra_hmha = sorted(k[1] for k in e if k[0] == "hmha" and k[1] not in lengths)
    if extra_hmha:
        out.append("")
        out.append("HMHA beyond the MHA lengths: " + ", ".join(
            f"L = {L}: {ms(e[('hmha', L, 64)]):.1f} ms" for L in extra_hmha))
    return out


def c2f_table(e, lengths):
    rows = []
    for L in lengths:
        mha = ms(e[("mha_streaming", L)])
        row = [L]
        for c in CHUNKS:
            b = e.get(("c2f", L, c))
            row.append(f"{ms(b):.2f} ms, {mha / ms(b):.0f}×, {fmt_bytes(b['peak_bytes'])}" if b else "—")
        rows.append(row)
    return ["", "### C2FAttention: time, speedup over MultiHeadAttention (same run), peak memory", "",
            table(["L"] + [f"chunk {c}" for c in CHUNKS], rows)]


def sparse_table(e):
    """SparseC2F's three gatings against MHA (no lines without sparse entries)."""
    sparse = sorted(k for k in e if k[0] == "sparse")
    if not sparse:
        return []
    out = ["", "### SparseC2FAttention (chunk 64) against MultiHeadAttention, same weights, random-walk input", ""]
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
    return out


def article_table(e):
    """The coarse-to-fine attention article's table (n = 1024, k = 32, h = 8, d = 512), answered with this
    run's measurements."""
    n, k, h = 1024, 32, 8
    m = n // k
    mha, naive, c2f = e[("mha_streaming", n)], e[("mha_naive", n)], e[("c2f", n, k)]
    rows = [
        ["the article's \"computational complexity\"", "O(n²) = 1M", "O(m² + m·k²) = 38k (m² + m·k² is 33,792)"],
        ["attention scores per forward (all heads)", f"h·n² = {h * n * n:,}",
         f"coarse h·m² = {h * m * m:,} + fine h·m·k = {h * m * k:,} (the article's formula computes h·m·k² = "
         f"{h * m * k * k:,}; the fine query is the same for a whole chunk, so one row per chunk suffices)"],
        ["FLOP per forward (analytic, whole layer)", f"{mha['FLOP'] / 1e9:.2f} G", f"{c2f['FLOP'] / 1e9:.3f} G"],
        ["the article's \"actual memory (h=8, d=512)\"", "4.2 GB", "1.1 GB"],
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
    return ("### The coarse-to-fine attention article's table, measured (n = 1024, k = 32, h = 8, d = 512, "
            "batch 1)\n\n" + table(["", "MultiHeadAttention", "C2FAttention (chunk 32)"], rows))


def length_checks(e, lengths):
    """The targets on MHA against GEMM, C2F and SparseC2F speed, and how MHA's memory and HMHA's time grow."""
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
    return checks


def libtorch_table(torch_result):
    """c2f's MHA against libtorch's in bench_libtorch (same weights and input, same binary)."""
    t = entries(torch_result)
    c = torch_result["context"]
    rows = []
    for L in sorted({k[1] for k in t if k[0] == "libtorch_mha"}):
        lt, cm = ms(t[("libtorch_mha", L)]), ms(t[("c2f_mha", L)])
        rows.append([L, f"{lt:.1f}", f"{cm:.1f}", f"{lt / cm:.1f}×", f"{t[('c2f_mha', L)]['max_abs_diff']:.2g}"])
    out = ["", f"### c2f MultiHeadAttention vs libtorch {c.get('torch_version', '')} "
               "torch::nn::MultiheadAttention (same weights and input, same binary)", ""]
    kernel = blas.kernel_text(c.get("openblas_config"), c.get("openblas_threads"), env=torch_result.get("openblas_env"),
                              allocator=torch_result.get("allocator"))
    out.append(f"libtorch's BLAS (sgemm_ from): `{c.get('blas_library', '? (not reported)')}`: {kernel}; "
               f"torch threads {c.get('torch_threads', '?')}, c2f threads {c.get('c2f_threads', '?')}.")
    c2f_ctx = torch_result.get("c2f_mha_context")
    if c2f_ctx:  # sweep.py runs c2f's entries in a second process, without the peer's allocator
        out.append(f"c2f's entries ran in a second run of the binary ({c2f_ctx.get('file')}), allocator "
                   f"{blas.allocator_text(c2f_ctx.get('allocator') or {})}.")
    out.append("")
    out.append(table(["L", "libtorch ms", "c2f ms", "c2f speedup", "max |diff|"], rows))
    return out


def roofline_section(e, lengths, ctx, fma_peak=None):
    """Rooflines: every entry against the compute roofline — the machine's fp32 FMA peak when bench_machine
    measured it (`fma_peak`), else the fastest GEMM of this run — and the STREAM copy bandwidth. Returns
    (lines, checks); nothing without the copy entry or the GEMMs' byte counts."""
    copy, triad = next((b for k, b in e.items() if k[0] == "copy"), None), next(
        (b for k, b in e.items() if k[0] == "triad"), None)
    gemms = [(b["GFLOPS"], k[1]) for k, b in e.items() if k[0] == "gemm"]
    if not (copy is not None and gemms and all("bytes" in e[("gemm", L)] for _, L in gemms)):
        return [], []
    bw = copy["GB/s"]
    gemm_peak, peak_L = max(gemms)
    peak = fma_peak if fma_peak else gemm_peak
    name = "FMA peak" if fma_peak else "GEMM"
    balance = peak / bw
    llc = max((c["size"] for c in ctx.get("caches", []) if c.get("type") in ("Unified", "Data")), default=0)
    out = ["", "### Rooflines (same run)", ""]
    threads = ctx.get("c2f_threads")
    compute_text = (f"the fp32 FMA peak of a register-only loop on {threads} threads (bench_machine, same sweep), "
                    f"{peak:.1f} GFLOPS; c2f's GEMM of the projection shape reaches {gemm_peak:.1f} "
                    f"({100 * gemm_peak / peak:.0f} % of it, [{peak_L}, 512] × [512, 512])" if fma_peak else
                    f"the fastest GEMM entry of the run, {peak:.1f} GFLOPS ([{peak_L}, 512] × [512, 512], "
                    f"{threads} threads; bench_machine was not run, so the FMA peak is unknown)")
    out.append(
        f"Memory roofline: STREAM copy {bw:.1f} GB/s" + (f" (triad {triad['GB/s']:.1f} GB/s)" if triad else "") +
        f", {threads} threads, 256 MiB arrays, STREAM's byte counts. Compute roofline: {compute_text}. Machine "
        f"balance = {peak:.1f} / {bw:.1f} = {balance:.1f} "
        f"FLOP/byte. Bytes = what a forward must move: read x and the weights, write y. An entry whose intensity "
        f"(FLOP / bytes) is above the balance is bound by the compute roofline (fraction = its GFLOPS ÷ "
        f"{peak:.1f}), below it by memory (fraction = its GB/s ÷ {bw:.1f}). Entries marked \"in cache\" move "
        f"less than the {fmt_bytes(llc)} last-level cache: their data stays there between calls, so they can "
        f"pass the copy roofline. Cores = the process's CPU time ÷ wall time during the entry: {threads} on a "
        f"quiet machine, less when other processes held the cores (then every rate of that entry is low).")
    paired = any("pct_paired_peak" in b for b in e.values())
    if paired:
        out[-1] += (" Paired peak: before each timed call the fp32 FMA peaks were read on the same threads, "
                    "each for half as long as the call (at most 10 ms, untimed; entries whose calls take 5 ms or "
                    "more): the register-only loop and c2f's "
                    "micro-kernel on L1-resident operands (\"tile\"); \"% of paired peak\" is the median over "
                    "the calls of the call's GFLOPS ÷ the reading just before it, then the readings' mean "
                    "(GFLOP/s) and the same fraction of the tile reading — the fraction of the machine the entry "
                    "used in the moments it ran, which a VM's phases move far less than a ratio of two readings "
                    "taken minutes apart (docs/benchmarks.md, \"Paired peaks, and where MHA's time goes\").")
    out.append("")
    rows = []
    for k in sorted((k for k, b in e.items() if k[0] in ROOFLINE_ORDER and "bytes" in b),
                    key=lambda k: (ROOFLINE_ORDER[k[0]], k[1:])):
        b = e[k]
        compute = b["intensity"] >= balance
        frac = b["GFLOPS"] / peak if compute else b["GB/s"] / bw
        rows.append(["/".join(map(str, k)), f"{ms(b):.2f}", f"{b['GFLOPS']:.1f}",
                     f"{100 * b['GFLOPS'] / peak:.0f} %"] +
                    ([f"{b['pct_paired_peak']:.0f} % of {b['paired_peak']:.0f} (tile {b['pct_paired_tile_peak']:.0f} % "
                      f"of {b['paired_tile_peak']:.0f})" if "pct_paired_peak" in b else "—"]
                     if paired else []) + [
                     fmt_bytes(b["bytes"]) + (" (in cache)" if b["bytes"] < llc else ""), f"{b['GB/s']:.2f}",
                     f"{100 * b['GB/s'] / bw:.1f} %", f"{b['intensity']:.0f}",
                     f"{name if compute else 'memory'}, {100 * frac:.0f} %",
                     f"{b['cpu_time'] / b['real_time']:.2f}" if "/process_time" in b["name"] else "?"])
    out.append(table(["entry", "ms", "GFLOPS", f"% of {name}"] + (["% of paired peak"] if paired else []) +
                     ["bytes", "GB/s", "% of copy BW", "FLOP/byte", "binding roofline, fraction", "cores"], rows))
    checks = roofline_checks(e, lengths, ctx, gemm_peak)
    bf16 = [(ms(e[("mha_streaming", L)]) / ms(e[("mha_bf16", L)]), L) for L in lengths if 1024 <= L <= 8192
            and ("mha_bf16", L) in e and ("mha_streaming", L) in e]
    if bf16:
        checks.append(("MHA with Compute::BFloat16, L = 1024 … 8192, ≥ 1.7× the fp32 layer (the bf16 target)",
                       ", ".join(f"{L}: {r:.2f}×" for r, L in bf16), min(bf16)[0] >= 1.7))
    c2f_bf16 = [(ms(e[("c2f", L, 32)]) / ms(e[("c2f_bf16", L, 32)]), L) for L in lengths if 4096 <= L <= 16384
                and ("c2f_bf16", L, 32) in e and ("c2f", L, 32) in e]
    if c2f_bf16:
        checks.append(("C2FAttention chunk 32 with Compute::BFloat16, L = 4096 … 16384, ≥ 1.7× the fp32 layer (the bf16 target)",
                       ", ".join(f"{L}: {r:.2f}×" for r, L in c2f_bf16), min(c2f_bf16)[0] >= 1.7))
    c2f_bf16_into = [(ms(e[("c2f_into", L, 32)]) / ms(e[("c2f_bf16_into", L, 32)]), L) for L in lengths
                     if ("c2f_bf16_into", L, 32) in e and ("c2f_into", L, 32) in e]
    if c2f_bf16_into:
        checks.append(("… the same with forward_into (a reused output buffer, both precisions)",
                       ", ".join(f"{L}: {r:.2f}×" for r, L in c2f_bf16_into), min(c2f_bf16_into)[0] >= 1.7))
    if fma_peak:
        mha = [(e[("mha_streaming", L)]["GFLOPS"] / peak, L) for L in lengths if 1024 <= L <= 8192
               and ("mha_streaming", L) in e]
        if mha:
            checks.append((f"MHA fp32, L = 1024 … 8192, ≥ 80 % of the {threads}-thread FMA peak ({peak:.1f})",
                           ", ".join(f"{L}: {100 * f:.0f} %" for f, L in mha), min(mha)[0] >= 0.80))
        for name, label in (("c2f", "C2F chunk 32, L = 16384, ≥ 60 % of its binding roofline"),
                            ("c2f_into", "… the same with forward_into (a reused output buffer)")):
            if (name, 16384, 32) in e:
                b = e[(name, 16384, 32)]
                frac = b["GFLOPS"] / peak if b["intensity"] >= balance else b["GB/s"] / bw
                checks.append((label, f"{100 * frac:.0f} %", frac >= 0.60))
    # The same bars read against the peak paired with each call (compute-bound entries only).
    mha_paired = [(e[("mha_streaming", L)]["pct_paired_peak"] / 100, L) for L in lengths if 1024 <= L <= 8192
                  and "pct_paired_peak" in e.get(("mha_streaming", L), {})]
    if mha_paired:
        checks.append(("MHA fp32, L = 1024 … 8192, ≥ 80 % of the paired FMA peak",
                       ", ".join(f"{L}: {100 * f:.0f} %" for f, L in mha_paired), min(mha_paired)[0] >= 0.80))
    for name, label in (("c2f", "C2F chunk 32, L = 16384, ≥ 60 % of the paired FMA peak"),
                        ("c2f_into", "… the same with forward_into")):
        b = e.get((name, 16384, 32), {})
        if "pct_paired_peak" in b and b["intensity"] >= balance:
            checks.append((label, f"{b['pct_paired_peak']:.0f} %", b["pct_paired_peak"] >= 60))
    return out, checks


def roofline_checks(e, lengths, ctx, peak):
    """C2F, C2F forward_into, HMHA and SparseC2F against the run's fastest GEMM (`peak` GFLOPS)."""
    checks = []
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
    return checks


def one_thread_table(one_thread):
    """MHA against GEMM in the one-thread run (C2F_BENCH_THREADS=1). Returns (lines, checks)."""
    o = entries(one_thread)
    rows, fracs, checks = [], [], []
    for L in sorted(k[1] for k in o if k[0] == "mha_streaming"):
        g, m = o.get(("gemm", L)), o[("mha_streaming", L)]
        if g is None:
            continue
        frac = m["GFLOPS"] / g["GFLOPS"]
        fracs.append((frac, L))
        rows.append([L, f"{g['GFLOPS']:.1f}", f"{ms(m):.1f}", f"{m['GFLOPS']:.1f}", f"{100 * frac:.0f} %",
                     "yes" if frac >= 0.8 else "**no**"])
    out = ["", f"### MHA vs one-thread GEMM (a second, short run of bench_attention with C2F_BENCH_THREADS="
               f"{one_thread['context'].get('c2f_threads')})", ""]
    out.append(table(["L", "GEMM GFLOPS (1 thread)", "MHA ms (1 thread)", "MHA GFLOPS (1 thread)",
                      "MHA / GEMM", "≥ 80 %"], rows))
    want = [L for L in (1024, 2048, 4096, 8192) if any(L == f[1] for f in fracs)]
    if want:
        worst = min(f for f in fracs if f[1] in want)
        checks.append(("MHA ≥ 80 % of the single-thread GEMM GFLOPS at L ∈ {" + ", ".join(map(str, want)) + "}",
                       f"lowest {100 * worst[0]:.0f} % (L = {worst[1]})", worst[0] >= 0.8))
    return out, checks


def peers_section(peers, attn, torch_result, ort=None):
    """The peer table (torch_peer.py's peer_table(), with ORT's columns when ort_peer.py ran: report/ort.py),
    what the peers skipped, ORT's own table (its kernels), and the targets against the peers. Returns
    (lines, checks)."""
    peer_text, by_key = ort_peer_table(peers, attn, torch_result, ort)
    out, checks = ["", peer_text], []
    skipped = [f"{r['label']} at L = {r['L']} ({r['skipped']})" for r in peers["results"] if "skipped" in r]
    if skipped:
        out.append("")
        out.append("Not run in PyTorch: " + "; ".join(skipped) + ".")
    if ort is not None:
        out += ["", ort_table(ort, attn)]
    row = by_key.get(("mha", 2048))
    if row and row.get("torch_ms") and row.get("c2f_ms"):
        r = row["torch_ms"] / row["c2f_ms"]
        checks.append(("MHA ≥ 3× PyTorch's nn.MultiheadAttention at L = 2048 (2 threads each)", f"{r:.1f}×",
                       r >= 3))
    if row and row.get("best") and row.get("c2f_ms"):
        names = "PyTorch nn.MultiheadAttention, libtorch" + (", ONNX Runtime" if ort is not None else "")
        checks.append((f"MHA ≥ 3× the best MHA peer ({names}) at L = 2048",
                       f"{row['speedup']:.1f}× ({row['best'][1]})", row["speedup"] >= 3))
    pm = paired_mha(ort) if ort is not None else {}
    if pm:
        checks.append(("MHA ≥ 1.1× ORT's best MHA graph at every L, paired rounds (the MHA target against ONNX Runtime)",
                       ", ".join(f"{L}: {x:.2f}× ({g.replace('ORT ', '')})" for L, (x, g) in sorted(pm.items())),
                       min(x for x, _ in pm.values()) >= 1.1))
    row = by_key.get(("c2f32", 16384))
    if row and row.get("torch_ms") and row.get("c2f_ms"):
        r = row["torch_ms"] / row["c2f_ms"]
        checks.append(("C2F (chunk 32) at L = 16384 ≥ 15× PyTorch's article module", f"{r:.1f}×", r >= 15))
    for key, what in (("mha_bf16", "MHA"), ("c2f32_bf16", "C2FAttention chunk 32")):
        rows = sorted((L, r["torch_ms"] / r["c2f_ms"]) for (k, L), r in by_key.items()
                      if k == key and r.get("torch_ms") and r.get("c2f_ms"))
        if rows:
            checks.append((f"{what} with Compute::BFloat16 faster than PyTorch's autocast bf16 (the bf16 target)",
                           ", ".join(f"{L}: {x:.1f}×" for L, x in rows), min(x for _, x in rows) > 1))
    ranked = sorted((v["speedup"], k) for k, v in by_key.items() if v.get("speedup"))
    if ranked:
        checks.append(("c2f against the best peer, every layer and L compared (lowest … highest)",
                       f"{ranked[0][0]:.1f}× ({ranked[0][1][0]}, L = {ranked[0][1][1]}) … "
                       f"{ranked[-1][0]:.1f}× ({ranked[-1][1][0]}, L = {ranked[-1][1][1]})", None))
    return out, checks
