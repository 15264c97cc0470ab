"""The sweep's PNG plots (matplotlib, Agg backend; none when matplotlib is not installed): time, C2F speedup,
memory and SparseC2F error of the attention part; decode latency of the decode part."""

from .attention import CHUNKS
from .common import entries, ms
from .decode import DECODE_LAYERS, contexts_and_batches, per_token


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def finish(plt, fig, ax, path, legend_size):
    """Grid, legend, layout; saves `fig` as a small PNG at `path` and returns the path."""
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def attention_plots(e, lengths, out_dir):
    """time_vs_length.png, speedup_vs_chunk.png, memory_vs_length.png and (with sparse entries)
    sparse_error_vs_speedup.png from bench_attention's entries `e`. Returns the paths written."""
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed (Debian: python3-matplotlib): no plots")
        return []
    files = [time_plot(plt, e, lengths, out_dir), speedup_plot(plt, e, lengths, out_dir),
             memory_plot(plt, e, lengths, out_dir)]
    if any(k[0] == "sparse" for k in e):
        files.append(sparse_plot(plt, e, out_dir))
    return files


def time_plot(plt, e, lengths, out_dir):
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
    return finish(plt, fig, ax, out_dir / "time_vs_length.png", legend_size=7)


def speedup_plot(plt, e, lengths, out_dir):
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, L in enumerate(lengths):
        cs = [c for c in CHUNKS if ("c2f", L, c) in e]
        ax.plot(cs, [ms(e[("mha_streaming", L)]) / ms(e[("c2f", L, c)]) for c in cs], "-o",
                color=plt.get_cmap("plasma")(i / max(1, len(lengths))), label=f"L = {L}")
    ax.set(xscale="log", yscale="log", xlabel="chunk size", ylabel="speedup over MultiHeadAttention",
           title="C2FAttention speedup vs chunk size (same run)")
    ax.set_xticks(CHUNKS)
    ax.set_xticklabels([str(c) for c in CHUNKS])
    return finish(plt, fig, ax, out_dir / "speedup_vs_chunk.png", legend_size=8)


def memory_plot(plt, e, lengths, out_dir):
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(lengths, [e[("mha_streaming", L)]["peak_bytes"] / 2**20 for L in lengths], "k-o", lw=4, ms=9,
            alpha=0.35, label="MultiHeadAttention (streaming)")
    naive = [L for L in lengths if ("mha_naive", L) in e]
    if naive:
        ax.plot(naive, [e[("mha_naive", L)]["peak_bytes"] / 2**20 for L in naive], "k:", marker="x",
                label="MHA, naive kernel")
    hm = sorted(k[1] for k in e if k[0] == "hmha")
    ax.plot(hm, [e[("hmha", L, 64)]["peak_bytes"] / 2**20 for L in hm], "m--s", label="HMHA (W = 64)")
    ls = [L for L in lengths if ("c2f", L, 32) in e]
    ax.plot(ls, [e[("c2f", L, 32)]["peak_bytes"] / 2**20 for L in ls], "g-^", label="C2F chunk 32")
    ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="peak working memory (MiB, measured)",
           title="Memory vs length (heap held during one forward)")
    return finish(plt, fig, ax, out_dir / "memory_vs_length.png", legend_size=8)


def sparse_plot(plt, e, out_dir):
    sparse = sorted(k for k in e if k[0] == "sparse")
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
    return finish(plt, fig, ax, out_dir / "sparse_error_vs_speedup.png", legend_size=8)


def decode_plots(result, out_dir):
    """decode_latency.png from bench_decode's JSON: ms per step against the context, per layer and batch.
    Returns the paths written (none, silently, without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    e = entries(result)
    contexts, batches = contexts_and_batches(e)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors = {"mha": "k", "mha_bf16": "0.5", "mha_bf16_compute": "tab:orange", "sparse": "tab:green", "hmha": "tab:purple"}
    for name, label in DECODE_LAYERS:
        for B, style in zip(batches, ("-o", "--s")):
            cs = [c for c in contexts if (name, B, c) in e]
            if cs:
                ax.plot(cs, [per_token(e[(name, B, c)]) for c in cs], style, color=colors[name],
                        label=f"{label}, B = {B}")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per decode step",
           title="Decode latency vs context (d = 512, 8 heads)")
    ax.set_xscale("log", base=2)
    return [finish(plt, fig, ax, out_dir / "decode_latency.png", legend_size=7)]
