"""The c2f2d part's tables and targets (bench_c2f2d): C2FAttention2D over grids and blocks against
the in-run copy bandwidth and GEMM rooflines and full MHA, and the coarse-to-fine attention article's claim
for a 1024 × 1024 image."""

from .common import entries, fmt_bytes, ms, slope, table, targets_table


class Run:
    """bench_c2f2d's JSON with what its tables derive from it: the entries, the repetitions' spread, the
    rooflines and full MHA's time (measured to 128², extrapolated beyond)."""

    def __init__(self, result):
        self.e = entries(result)
        self.ctx = result["context"]
        self.cv = {}  # run name -> coefficient of variation of the repetitions' times (Google Benchmark's "cv")
        for b in result["benchmarks"]:
            if b.get("aggregate_name") == "cv":
                self.cv[b["run_name"]] = b["real_time"]
        self.copy = next(b for k, b in self.e.items() if k[0] == "copy")
        self.gemm = next(b for k, b in self.e.items() if k[0] == "gemm")
        self.bw, self.peak_flops = self.copy["GB/s"] * 1e9, self.gemm["GFLOPS"] * 1e9
        self.mha = sorted((k[1] * k[1], ms(b)) for k, b in self.e.items() if k[0] == "mha")
        fit = self.mha[-2:] if len(self.mha) >= 2 else []
        self.mha_slope = slope(*zip(*fit)) if fit else None

    def spread(self, b):
        return (f"{100 * self.cv[b['run_name']]:.0f} % ({b.get('repetitions', 1)} runs)" if b["run_name"] in self.cv
                else "1 run")

    def mha_time(self, L):
        """(full MHA's ms at L tokens, extrapolated?); (None, False) below the longest measured MHA."""
        for tokens, t in self.mha:
            if tokens == L:
                return t, False
        if self.mha_slope is None or L < self.mha[-1][0]:
            return None, False
        return self.mha[-1][1] * (L / self.mha[-1][0]) ** self.mha_slope, True

    def roofline(self, b):
        """(binding roofline, roofline time / measured time) of an entry."""
        t_mem, t_flop = b["bytes"] / self.bw, b["FLOP"] / self.peak_flops
        bound, t = ("memory", t_mem) if t_mem >= t_flop else ("compute", t_flop)
        return bound, t * 1e3 / ms(b)


def c2f2d_section(result):
    """The C2FAttention2D table: C2FAttention2D over grids and blocks next to the in-run copy bandwidth and GEMM
    rooflines, full MHA where it runs (to 128²) and its fitted slope beyond; and the targets."""
    run = Run(result)
    out = ["### C2FAttention2D: 2-D blocks, relative position bias, against the rooflines (same run)", ""]
    out.append(setup_line(run))
    out.append("")
    out += grid_table(run)
    checks = []
    target = run.e.get(("c2f2d", 1024, 64))
    if target:
        lines, checks = article_claim(run, target)
        out += lines
    out.append("")
    out.append("### Targets (C2FAttention2D)")
    out.append("")
    out.append(targets_table(checks))
    return "\n".join(out)


def setup_line(run):
    ctx, copy, gemm, mha_slope = run.ctx, run.copy, run.gemm, run.mha_slope
    return (f"{ctx.get('num_cpus')} CPUs, {ctx.get('c2f_threads')} threads, Eigen SIMD: {ctx.get('c2f_isa')}, "
            f"sweep `{ctx.get('c2f2d_sweep')}`, {ctx.get('date')}; d = 512, 8 heads, batch 1, float, table = the "
            f"block grid. Medians of repetitions (repetitions and their spread in bench_c2f2d.json). Rooflines "
            f"of this run: STREAM copy {copy['GB/s']:.1f} GB/s (2 × 256 MiB), GEMM {gemm['GFLOPS']:.1f} GFLOPS "
            f"([4096, 512] × [512, 512]). A forward moves 3·L·d·4 bytes (x read twice, y written once) and does "
            f"the analytic FLOP; roofline = the larger of bytes / copy bandwidth and FLOP / GEMM rate; "
            f"fraction = roofline time / measured time." +
            (f" MHA beyond 128² tokens: its time at 128² × (L / 128²)^{mha_slope:.2f} (log-log slope of 64² → "
             f"128²), *extrapolated*." if mha_slope else ""))


def grid_table(run):
    """The noise line and one row per c2f2d / c2f2d_into entry."""
    e, ctx = run.e, run.ctx
    rows = []
    for k in sorted(k for k in e if k[0] in ("c2f2d", "c2f2d_into")):
        b = e[k]
        side, block = k[1], k[2]
        L = side * side
        bound, frac = run.roofline(b)
        mem = "—"
        if "input_bytes" in b:
            io = b["input_bytes"] + 4.0 * L * 512  # input + output
            mem = f"{fmt_bytes(b['peak_bytes'])}, ×{(b['input_bytes'] + b['peak_bytes']) / io:.3f}"
        t_mha, extrapolated = run.mha_time(L)
        mha_col = "—" if t_mha is None else (f"{t_mha / 1e3:.3g} s" + (" *(extrapolated)*" if extrapolated else ""))
        speedup = "—" if t_mha is None else f"{t_mha / ms(b):,.0f}×" + (" *(extr.)*" if extrapolated else "")
        name = "forward" if k[0] == "c2f2d" else "forward_into"
        rows.append([f"{side}²", f"{L:,}", f"{block}²", int(b["blocks"]), name, f"{ms(b):.2f}", run.spread(b),
                     f"{b['FLOP'] / 1e9:.3g}", f"{b['GFLOPS']:.1f}", f"{b['GB/s']:.1f}", mem,
                     f"{bound}, {100 * frac:.0f} %", mha_col, speedup])
    load = ", ".join(f"{v:.2f}" for v in ctx.get("load_avg", []))
    return [f"Noise: load average {load or '?'} when the binary started (other processes share the cores); "
            f"spread of the roofline entries: copy {run.spread(run.copy)}, GEMM {run.spread(run.gemm)}.", "",
            table(["grid", "tokens", "block", "blocks", "call", "ms (median)", "spread (cv)", "GFLOP", "GFLOPS",
                   "GB/s", "peak memory, (input + peak) / (input + output)", "roofline binding, fraction",
                   "full MHA", "speedup"], rows)]


def article_claim(run, target):
    """The article's claim for a 1024² image in 64² blocks against `target` (entry c2f2d/1024/64), the
    memory and roofline targets, and what a fresh output costs. Returns (lines, checks)."""
    e, copy = run.e, run.copy
    L = 1024 * 1024
    full_t, _ = run.mha_time(L)
    out = ["", "### The coarse-to-fine attention article's claim for a 1024 × 1024 image in 64 × 64 blocks, "
               "measured", ""]
    h, d, m = 8, 512, 256
    claim = [["the article's claim", "O(10¹²)", "O(10⁸)"],
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
    checks = [("1024² tokens, 64² blocks in one forward within input + output + 10 % of memory",
               f"×{ratio:.3f}", ratio <= 1.10)]
    for name in ("c2f2d", "c2f2d_into"):
        b = e.get((name, 1024, 64))
        if b:
            bound, frac = run.roofline(b)
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
    return out, checks
