"""The runtime part's tables and targets (bench_runtime*): OpenMP builds against the plain one, latency of
small calls, concurrent callers, the cost of one parallel loop, SIMD flags."""

from .common import entries, table, targets_table, us

RUNTIME_VARIANTS = [  # (binary, column title); benchmarks/bench_runtime.cpp explains the four builds
    ("bench_runtime", "plain"),
    ("bench_runtime_omp", "-fopenmp (c2f pool)"),
    ("bench_runtime_omploops", "-fopenmp (OpenMP loops)"),
    ("bench_runtime_portable", "portable (no -march)"),
]


def runtime_section(results):
    """The runtime part of summary.md: runtime_summary()'s tables and its targets table."""
    runtime_text, checks = runtime_summary(results)
    return ("## Threads: runtime sweeps\n\n" + runtime_text + "\n### Runtime targets\n\n" +
            targets_table(checks))


def runtime_summary(results):
    """Tables of the runtime sweeps (bench_runtime*): OpenMP vs plain, latency, concurrency, loop cost,
    SIMD flags. `results` maps a binary name to its Google Benchmark JSON (bench_runtime's is required).
    Returns (markdown, checks)."""
    e = {name: entries(r) for name, r in results.items()}
    plain = e.get("bench_runtime", {})
    ctx = results["bench_runtime"]["context"]
    repetitions = max(1, results["bench_runtime"]["benchmarks"][0].get("repetitions", 1))
    out = [f"Runtime sweeps: {ctx.get('num_cpus')} CPUs, c2f threads {ctx.get('c2f_threads')}, "
           f"small-work threshold {float(ctx.get('c2f_min_parallel_work', 0)):.3g} FLOP, "
           f"Eigen SIMD {ctx.get('c2f_isa')}; medians of {repetitions} "
           f"repetitions. d = 512, 8 heads, float, batch 1 unless stated.", ""]
    checks = []
    for lines, more in (openmp_table(e, plain), latency_tables(e), concurrency_table(e)):
        out += lines
        checks += more
    out += loop_table(plain)
    out += simd_table(e, plain, results)
    return "\n".join(out), checks


def openmp_table(e, plain):
    """(a) OpenMP vs plain. Returns (lines, checks)."""
    rows, checks = [], []
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
    if not rows:
        return [], checks
    return ["### (a) -fopenmp against the plain build (ms per forward, all threads; ratio to plain)", "",
            table(["", "plain", "-fopenmp, c2f pool (default)", "-fopenmp, C2F_PARALLEL_OPENMP"], rows), ""], checks


def latency_tables(e):
    """(b) latency of small calls, one table per build that has the entries. Returns (lines, checks)."""
    out, checks = [], []
    for variant, title in RUNTIME_VARIANTS[:3]:
        v = e.get(variant, {})
        if not any(k[0] == "lat_mha" for k in v):
            continue
        rows, worst, more = latency_rows(v, variant)
        checks += more
        out.append(f"### (b) Latency of small calls, {title} build (µs per forward)")
        out.append("")
        out.append(table(["layer", "B", "L", "1 thread", "2 threads", "2 / 1", "2 threads, no threshold (/ 1)",
                          "1-thread overhead over its GEMMs"], rows))
        out.append("")
        for model, r in worst.items():
            checks.append((f"{title}: {model.upper()} latency, 2 threads never > 5 % slower than 1", f"worst {r:.2f}×",
                           r <= 1.05))
    return out, checks


def latency_rows(v, variant):
    """The rows of one build's latency table (entries `v`), the worst 2-thread / 1-thread ratio per layer and
    the L = 1 overhead checks (plain build only). Returns (rows, {layer: worst}, checks)."""
    rows, worst, checks = [], {}, []
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
                        checks.append((f"L = 1 single-thread overhead over the GEMM work < 20 %: "
                                       f"{model.upper()} B = {B}",
                                       f"{100 * (us(one) / us(gemm) - 1):.0f} %", us(one) / us(gemm) < 1.20))
                rows.append([model.upper(), B, L, f"{us(one):.0f}", f"{us(two):.0f}", f"{r:.2f}",
                             f"{us(free):.0f} ({us(free) / us(one):.2f})" if free else "—", over])
    return rows, worst, checks


def concurrency_table(e):
    """(c) concurrent callers on one shared MHA: forwards/s per build. Returns (lines, checks)."""
    rows, through, checks = [], {}, []
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
    if not through:
        return [], checks
    out = ["### (c) Concurrent callers on one shared MultiHeadAttention, L = 1024 (total forwards/s)", "",
           table(["callers", "threads per call"] + [t for _, t in RUNTIME_VARIANTS[:3]], rows), ""]
    for variant, title in RUNTIME_VARIANTS[:3]:
        t = {k[1:]: f for k, f in through.items() if k[0] == variant}
        if len(t) < 6:
            continue
        r1 = t[(2, 1)] / t[(1, 2)]
        r2 = t[(4, 2)] / max(t.values())
        checks.append((f"{title}: 2 callers × 1 thread ≥ 0.9 × 1 caller × 2 threads", f"{r1:.2f}", r1 >= 0.9))
        checks.append((f"{title}: 4 callers × 2 threads ≥ 0.8 × the best", f"{r2:.2f}", r2 >= 0.8))
    return out, checks


def loop_table(plain):
    """The cost of one loop, which sets the small-work threshold (plain build)."""
    loops = sorted({k[1] for k in plain if k[0] == "loop"})
    if not loops:
        return []
    rows = []
    for r in loops:
        w = 65536 * r
        cells = [f"{w / 1e6:.3g} M"]
        for cold in (0, 1):
            one, two = plain.get(("loop", r, 1, cold)), plain.get(("loop", r, 2, cold))
            cells += [f"{us(one):.1f}", f"{us(two):.1f}", f"{us(two) / us(one):.2f}"]
        rows.append(cells)
    return ["### One parallel loop of 8 tasks (µs), threshold off: where a second thread starts to pay", "",
            table(["work (FLOP)", "1 thread", "2 threads", "2 / 1", "1 thread, pool idle",
                   "2 threads, pool idle", "2 / 1"], rows), ""]


def simd_table(e, plain, results):
    """SIMD flags: the portable build against this one."""
    port = e.get("bench_runtime_portable", {})
    rows = []
    for key, label in [(("rt_gemm", 2048), "GEMM [2048, 512] × [512, 512]"), (("rt_mha", 256), "MHA L = 256"),
                       (("rt_mha", 2048), "MHA L = 2048"), (("rt_c2f", 16384, 32), "C2F (chunk 32) L = 16384")]:
        a, b = port.get(key), plain.get(key)
        if a and b:
            rows.append([label, f"{us(a) / 1e3:.2f}", f"{us(b) / 1e3:.2f}", f"{us(a) / us(b):.2f}×"])
    if not rows:
        return []
    ctx = results["bench_runtime"]["context"]
    return [f"### SIMD flags: portable ({results['bench_runtime_portable']['context'].get('c2f_isa')}) against "
            f"this build ({ctx.get('c2f_isa')}), ms, all threads", "",
            table(["", "portable", "this build", "speedup"], rows), ""]
