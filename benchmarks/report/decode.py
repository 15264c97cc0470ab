"""The decode part's tables and targets (bench_decode): per-token decode latency against the
context for each layer and batch, the decoding states' memory, MHA's key/value bandwidth against the in-run
copy bandwidth. The latency plot is plots.decode_plots()."""

from .common import entries, fmt_bytes, ms, table, targets_table

DECODE_LAYERS = [("mha", "MHA"), ("mha_bf16", "MHA, bf16 cache"), ("mha_bf16_compute", "MHA, bf16 cache and compute"),
                 ("sparse", "SparseC2F"), ("hmha", "HMHA")]


def per_token(b):
    """ms per decode step of the whole batch."""
    return ms(b)


def contexts_and_batches(e):
    """The sorted contexts and batch sizes of bench_decode's MHA entries."""
    return sorted({k[2] for k in e if k[0] == "mha"}), sorted({k[1] for k in e if k[0] == "mha"})


def decode_section(result):
    """The decode tables: per-token decode latency (n = 1) against the context for each layer and batch,
    the states' memory, MHA's achieved key/value bandwidth against the in-run copy bandwidth; the targets."""
    e = entries(result)
    ctx = result["context"]
    copy = next(b for k, b in e.items() if k[0] == "copy")
    read = next((b for k, b in e.items() if k[0] == "read"), None)
    bw = copy["GB/s"]
    contexts, batches = contexts_and_batches(e)
    out = ["### Decoding: one token per step against the context, same run", ""]
    out.append(f"{ctx.get('num_cpus')} CPUs, {ctx.get('c2f_threads')} threads, Eigen SIMD: {ctx.get('c2f_isa')}, "
               f"sweep `{ctx.get('decode_sweep')}`, {ctx.get('date')}; d = 512, 8 heads, float weights, causal "
               f"layers; SparseC2F chunk 64, top_k 8 (per-token gating); HMHA window 64. A step = decode() of one "
               f"new token for each of the B sequences (median of 3 repetitions). Rooflines of this run: STREAM "
               f"copy {bw:.1f} GB/s" + (f", read-only scan {read['GB/s']:.1f} GB/s" if read else "") +
               ". MHA GB/s = the key and value bytes a step reads (B · context · 2 · d · 4) per second.")
    for B in batches:
        out += batch_table(e, B, contexts, bw)
    out.append("")
    out.append("### Targets (decoding)")
    out.append("")
    out.append(targets_table(decode_checks(e, batches, contexts, bw)))
    return "\n".join(out)


def batch_table(e, B, contexts, bw):
    """Batch B: ms per step of each layer against the context, and the decoding states' memory."""
    out = ["", f"Batch {B}: ms per step (all {B} sequences), and the decoding state's memory", ""]
    rows = []
    for c in contexts:
        m = e.get(("mha", B, c))
        if not m:
            continue
        row = [f"{c // 1024}k", f"{per_token(m):.3f}", f"{m['GB/s']:.1f} ({100 * m['GB/s'] / bw:.0f} %)"]
        for name in ("mha_bf16", "mha_bf16_compute"):
            bf = e.get((name, B, c))
            row.append(f"{per_token(bf):.3f} ({per_token(bf) / per_token(m):.2f}×)" if bf else "—")
        for name in ("sparse", "hmha"):
            b = e.get((name, B, c))
            row.append(f"{per_token(b):.3f} ({per_token(m) / per_token(b):.1f}×)" if b else "—")
        mem = [e.get((name, B, c)) for name in ("mha", "mha_bf16", "sparse", "hmha")]
        row.append(" / ".join(fmt_bytes(b["state_bytes"]) if b else "—" for b in mem))
        rows.append(row)
    out.append(table(["context", "MHA ms", "MHA GB/s (of copy)", "MHA bf16-cache ms (of MHA)",
                      "MHA bf16 cache + compute ms (of MHA)", "SparseC2F ms (vs MHA)",
                      "HMHA ms (vs MHA)", "state: MHA / MHA bf16 / SparseC2F / HMHA"], rows))
    return out


def decode_checks(e, batches, contexts, bw):
    """MHA's bandwidth from 32k context on, SparseC2F's speedup at 128k, no thread created while timed."""
    checks = []
    long_ctx = [c for c in contexts if c >= 32768]
    if long_ctx:
        worst = min((e[("mha", B, c)]["GB/s"] / bw, B, c) for B in batches for c in long_ctx if ("mha", B, c) in e)
        checks.append((f"MHA decode ≥ 50 % of the copy bandwidth from 32k context on (B = "
                       f"{', '.join(map(str, batches))})",
                       f"lowest {100 * worst[0]:.0f} % (B = {worst[1]}, {worst[2] // 1024}k)", worst[0] >= 0.5))
    if ("mha", 1, 32768) in e and ("mha_bf16_compute", 1, 32768) in e:
        r = per_token(e[("mha_bf16_compute", 1, 32768)]) / per_token(e[("mha", 1, 32768)])
        checks.append(("MHA decode with bf16 compute and cache ≤ 0.6× the fp32 step at 32k (B = 1; the bf16 target)",
                       f"{r:.2f}×", r <= 0.6))
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
    return checks
