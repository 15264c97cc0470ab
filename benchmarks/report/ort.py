"""The ONNX Runtime peer's tables (ort_peer.py's JSON): its own table (ort_peer.md) and the ORT columns of
the peer table, whose best peer then includes ORT's graphs. c2f's times come from bench_attention.json of
the same sweep. No torch, onnx or node needed."""

import re

from .common import entries, ms, table

SHORT = {"mha_op": "ORT MHA op", "mha_plain": "ORT plain graph", "c2f32": "ORT exported module",
         "hmha": "ORT exported module", "sparse": "ORT exported module"}


def timed(ort):
    """{(layer, L): {graph: row}} of the rows ORT timed."""
    out = {}
    for r in ort["results"]:
        if r.get("ort_ms") is not None:
            out.setdefault((r["layer"], r["L"]), {})[r["graph"]] = r
    return out


def best_mha(by_layer, L):
    """(ms, label) of ORT's fastest MHA graph at L, or None."""
    rows = by_layer.get(("mha", L), {})
    return min(((r["ort_ms"], SHORT.get(g, g)) for g, r in rows.items()), default=None)


def paired_text(row):
    """"**1.3×** (1.2, 1.3, 1.4)": the paired ratio and each round's, or "—" when not paired."""
    if row.get("paired_speedup") is None:
        return "—"
    return f"**{row['paired_speedup']:.2f}×** ({', '.join(f'{x:.2f}' for x in row['paired_speedups'])})"


def paired_mha(ort):
    """{L: (paired ratio, graph label)} against ORT's MHA graph that c2f leads least at L (the best ORT graph
    of the same rounds)."""
    out = {}
    for (layer, L), rows in timed(ort).items():
        if layer == "mha":
            cand = [(r["paired_speedup"], SHORT.get(g, g)) for g, r in rows.items() if r.get("paired_speedup")]
            if cand:
                out[L] = min(cand)
    return out


def kernel_text(row):
    """What ran in the profiled check run: "MatMul ×4 (48 %), com.microsoft.MultiHeadAttention ×1 (51 %), …",
    with the ORT fusions that made a node (from its name: "FusedMatMul ×1 [MatMulScaleFusion]")."""
    ks = row.get("kernels") or []
    total = sum(k["us"] for k in ks) or 1
    providers = sorted({k["provider"] for k in ks})
    parts = []
    for k in ks:
        op = k["op"] if k["domain"] in ("ai.onnx", "?") else f"{k['domain']}.{k['op']}"
        share = 100 * k["us"] / total
        fusions = sorted({f for name in k["names"] for f in re.findall(r"[A-Za-z]+Fusion", name)})
        parts.append(f"{op} ×{k['nodes']}" + (f" ({share:.0f} %)" if share >= 10 else "") +
                     (f" [{', '.join(fusions)}]" if fusions else ""))
    return ", ".join(parts) + (f"; {', '.join(providers)}" if providers else "")


def setup_line(ort):
    s = ort["setup"]
    return (f"ONNX Runtime {s['onnxruntime_node']} (npm onnxruntime-node, its prebuilt CPU runtime; Node "
            f"{s['node_version']}): {s['execution_provider']}, intraOpNumThreads {s['intra_op_threads']}, "
            f"interOpNumThreads {s['inter_op_threads']}, graphOptimizationLevel '{s['graph_optimization_level']}', "
            f"executionMode '{s['execution_mode']}'; graphs written by onnx {s['onnx_version']} (opset "
            f"{s['opset']}), the other layers' PyTorch modules exported by torch {s['torch_version']}'s torch.onnx.export; median of "
            f"{ort['reps']} runs (3 when a call takes ≥ 1 s) after the check run, which is the warm-up; "
            f"{s['timing'].split(';')[0]}.")


def ort_table(ort, attn=None):
    """ort_peer.md: every ORT graph and L against c2f (bench_attention.json of the same sweep, if given), and
    the kernels each graph ran."""
    e = entries(attn) if attn else {}
    tol = ort["tolerance"]
    lines = ["### c2f against ONNX Runtime (same weights and inputs as the PyTorch peer, outputs checked first)", ""]
    lines.append("- " + setup_line(ort))
    if attn:
        lines.append(f"- c2f: bench_attention, {attn['context'].get('c2f_threads')} threads, Eigen SIMD "
                     f"{attn['context'].get('c2f_isa')}.")
    load = [", ".join(f"{v:.2f}" for v in ort.get(k, [])) or "?" for k in ("load_avg_start", "load_avg_end")]
    lines.append("- Paired: ORT's runs and c2f's forwards (bench_attention's peer mode, the same layer as its entry) "
                 "alternate in rounds, in the same minute; the paired ratio is the median over the rounds of ORT's "
                 "median over c2f's (each round's ratio in brackets). \"c2f ms (bench_attention)\" ran minutes "
                 "earlier, in the sweep's bench_attention run.")
    lines.append(f"- Agreement before timing: |ORT − c2f| ≤ {tol['atol']:g} + {tol['rtol']:g}·|c2f| element-wise; "
                 f"the column gives max |diff|. Load average {load[0]} when the ORT peer started, {load[1]} when it "
                 f"ended; \"cores\" = CPU seconds of the process per wall-clock second while timed.")
    lines.append("")
    rows = []
    for r in ort["results"]:
        b = e.get(tuple(r["entry"]))
        c2f_ms = ms(b) if b else None
        own = r.get("ort_ms")
        rows.append([r["label"], r["L"],
                     f"{own:.1f}" if own is not None else
                     ("skipped (" + ("memory" if "memory" in r.get("skipped", "") else "time") + ")"),
                     f"{c2f_ms:.2f}" if c2f_ms is not None else ("— (no entry)" if attn else "—"),
                     f"**{own / c2f_ms:.1f}×**" if own and c2f_ms else "—",
                     f"{r['c2f_paired_ms']:.2f}" if r.get("c2f_paired_ms") is not None else "—",
                     paired_text(r),
                     f"{r['max_abs_diff']:.1g}" if "max_abs_diff" in r else "—",
                     f"{r['session_ms']:.0f} / {r['first_call_ms']:.0f}" if "session_ms" in r else "—",
                     (("?" if "/process_time" not in b["name"] else f"{b['cpu_time'] / b['real_time']:.1f}")
                      if b else "—") + " / " +
                     (f"{r['cpu_per_wall']:.1f}" if r.get("cpu_per_wall") is not None else "—")])
    lines.append(table(["graph", "L", "ORT ms", "c2f ms (bench_attention)", "c2f vs ORT", "c2f ms, same rounds",
                        "c2f vs ORT, paired (rounds)", "max \\|diff\\|",
                        "ORT InferenceSession creation / check run ms", "cores c2f / ORT"], rows))
    lines += ["", "Kernels that ran (ORT's profiler on the check run; per operator: nodes, and the share of the "
                  "run's kernel time when ≥ 10 %):", ""]
    for graph, label in ort["graphs"].items():
        seen = {}
        for r in ort["results"]:
            if r["graph"] == graph and r.get("kernels"):
                seen.setdefault(kernel_text(r), []).append(r["L"])
        for text, ls in seen.items():
            lines.append(f"- {label} (L = {', '.join(map(str, ls))}): {text}")
    skipped = [f"{r['label']} at L = {r['L']} ({r['skipped']})" for r in ort["results"] if "skipped" in r]
    if skipped:
        lines += ["", "Not run in ORT: " + "; ".join(skipped) + "."]
    return "\n".join(lines)


def peer_table(peers, attn, libtorch, ort):
    """torch_peer.py's peer table with ORT's columns: "ORT ms" (this layer's graphs: the MHA operator and the
    plain graph for MHA, the exported module for the others) and "ORT MHA ms" (ORT's fastest MHA graph at the same L,
    for the other layers, as "PyTorch nn.MHA ms"); best peer and c2f vs best peer include them. Returns
    (markdown, {(layer, L): row}) as torch_peer.peer_table does, rows with ort_ms added."""
    from torch_peer import peer_table as torch_peer_table
    text, by_key = torch_peer_table(peers, attn, libtorch)
    if ort is None:
        return text, by_key
    e = entries(attn)
    lt = entries(libtorch) if libtorch else {}
    by_layer = timed(ort)
    head = text.split("\n|", 1)[0].rstrip("\n").split("\n")
    head = [line.replace("best peer = the fastest PyTorch/libtorch module of the row",
                         "best peer = the fastest PyTorch/libtorch module or ORT graph of the row") for line in head]
    head.append("- " + setup_line(ort) + f" ORT's outputs agreed with c2f's within {ort['tolerance']['atol']:g} + "
                f"{ort['tolerance']['rtol']:g}·|c2f| (the column gives max |diff| PyTorch / ORT).")
    rows = []
    for r in peers["results"]:
        key, L = r["layer"], r["L"]
        row = by_key[(key, L)]
        mine = by_layer.get((key, L), {})
        cand = [row["best"]] if row.get("best") else []
        cand += [(o["ort_ms"], SHORT.get(g, g)) for g, o in mine.items()]
        ort_mha = best_mha(by_layer, L) if key != "mha" else None
        if ort_mha:
            cand.append(ort_mha)
        best = min(cand) if cand else None
        c2f_ms = row.get("c2f_ms")
        speedup = best[0] / c2f_ms if best and c2f_ms else None
        row.update(ort_ms=min((o["ort_ms"] for o in mine.values()), default=None),
                   ort_mha_ms=ort_mha[0] if ort_mha else None, best=best, speedup=speedup)
        b = e.get(tuple(r["entry"]))
        own, lt_ms = r.get("torch_ms"), row.get("libtorch_ms")
        nn_mha = by_key.get(("mha", L), {}).get("torch_ms") if key != "mha" else None
        lb = lt.get(("libtorch_mha", L)) if key == "mha" else None
        ort_cores = [f"{o['cpu_per_wall']:.1f}" for o in mine.values() if o.get("cpu_per_wall") is not None]
        cores = [f"{b['cpu_time'] / b['real_time']:.1f}" if b and "/process_time" in b["name"] else "?",
                 f"{r['cpu_per_wall']:.1f}" if "cpu_per_wall" in r else "—",
                 ("?" if "/process_time" not in lb["name"] else f"{lb['cpu_time'] / lb['real_time']:.1f}")
                 if lb else "—",
                 ", ".join(ort_cores) or "—"]
        diffs = [f"{r['max_abs_diff']:.1g}" if "max_abs_diff" in r else "—",
                 ", ".join(f"{o['max_abs_diff']:.1g}" for o in mine.values()) or "—"]
        rows.append([r["label"], L,
                     f"{own:.1f}" if own is not None else
                     ("skipped (" + ("memory" if "memory" in r.get("skipped", "") else "time") + ")"),
                     f"{nn_mha:.1f}" if nn_mha is not None else "—",
                     f"{lt_ms:.1f}" if lt_ms is not None else "—",
                     "; ".join(f"{o['ort_ms']:.1f} ({SHORT.get(g, g).replace('ORT ', '')})" for g, o in mine.items())
                     or "—",
                     f"{ort_mha[0]:.1f}" if ort_mha else "—",
                     f"{c2f_ms:.2f}" if c2f_ms is not None else "— (no entry)",
                     f"{best[1]}, {best[0]:.1f}" if best else "—",
                     f"**{speedup:.1f}×**" if speedup else "—",
                     " / ".join(diffs), " / ".join(cores)])
    lines = head + ["", table(["layer (PyTorch module)", "L", "PyTorch ms", "PyTorch nn.MHA ms", "libtorch ms",
                               "ORT ms", "ORT MHA ms", "c2f ms", "best peer, ms", "c2f vs best peer",
                               "max \\|diff\\| PyTorch / ORT", "cores c2f / PyTorch / libtorch / ORT"], rows)]
    return "\n".join(lines), by_key
