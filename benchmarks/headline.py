#!/usr/bin/python3
"""The headline of every part of the main job, on one page, from the files of its output folder.

    /usr/bin/python3 benchmarks/headline.py results/latest

scripts/run.sh runs it last; it reads what the parts wrote and prints (and writes as headline.md) one short
table per part that ran — a part whose files are missing is named as not run:
    machine    bench_machine.json: the fp32 FMA and bf16 dot peaks (1 and n threads), STREAM copy
    attention  bench_attention.json, torch_peer.json, bench_libtorch.json, ort_peer.json: c2f against
               PyTorch, libtorch and ONNX Runtime (MultiHeadAttention at every length run, C2FAttention
               chunk 32 at 4096 and 16384), and the OpenBLAS kernel each torch peer ran
    loop       forward_loop.md: forward() in a loop against forward_into(), every layer (bench_forward_loop)
    train      train_default/torch_train_peer.json: a training step, c2f against torch.autograd
    python     python_bench.json: c2f from Python against torch, and the binding's cost per call
    dist       bench_dist.txt: bench_dist's C2FAttention on 1 and 2 MPI ranks
Needs no torch. Every figure is the one the part's own report gives (summary.md, torch_train_peer.md,
python_bench.md, bench_dist.txt): this page only gathers them.
"""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.dont_write_bytecode = True

from report import blas, machine  # noqa: E402
from report.common import entries, ms, table  # noqa: E402


def load(path):
    return json.loads(path.read_text()) if path.exists() else None


def machine_part(out):
    result = load(out / "bench_machine.json")
    if result is None:
        return None
    p = machine.peaks(result)
    rows = [["fp32 FMA peak (register-only loop)", f"{g:.0f} GFLOP/s", t] for t, g in sorted(p["fp32"].items())]
    rows += [["bf16 dot peak (vdpbf16ps)", f"{g:.0f} GFLOP/s", t] for t, g in sorted(p["bf16"].items())]
    rows += [["bf16 tile peak (AMX)", f"{g:.0f} GFLOP/s", t] for t, g in sorted(p["amx_bf16"].items())]
    if p["copy"]:
        rows.append(["STREAM copy (2 × 256 MiB)", f"{p['copy']:.1f} GB/s", p["threads"]])
    attn = load(out / "bench_attention.json")
    peak = p["fp32"].get(p["threads"])
    if attn and peak:
        e = entries(attn)
        for L in sorted(k[1] for k in e if k[0] == "mha_streaming"):
            if L == 2048:
                rows.append([f"MultiHeadAttention, L = {L}, share of the FMA peak",
                             f"{100 * e[('mha_streaming', L)]['GFLOPS'] / peak:.0f} % "
                             f"({e[('mha_streaming', L)]['GFLOPS']:.0f} GFLOP/s)", p["threads"]])
    return ["## Machine (bench_machine)", "", table(["roofline", "measured", "threads"], rows),
            "", f"ISA: {p['isa']}; the fastest timed call of each loop."]


def attention_part(out):
    peers, attn = load(out / "torch_peer.json"), load(out / "bench_attention.json")
    if peers is None or attn is None:
        return None
    from report.ort import paired_mha
    from report.ort import peer_table
    libtorch, ort = load(out / "bench_libtorch.json"), load(out / "ort_peer.json")
    _, by_key = peer_table(peers, attn, libtorch, ort)
    paired = paired_mha(ort) if ort else {}
    rows = []
    for (key, L), r in sorted(by_key.items(), key=lambda kv: (kv[0][0] != "mha", kv[0][1])):
        if not (key == "mha" or (key == "c2f32" and L in (4096, 16384))) or not r.get("c2f_ms"):
            continue
        own = r.get("torch_ms")
        ort_ms = r.get("ort_ms")
        rows.append(["MultiHeadAttention" if key == "mha" else "C2FAttention, chunk 32 (article module)", L,
                     f"{own:.1f}" if own else "—", f"{r['libtorch_ms']:.1f}" if r.get("libtorch_ms") else "—",
                     f"{ort_ms:.1f}" if ort_ms else "—", f"{r['c2f_ms']:.2f}",
                     f"**{own / r['c2f_ms']:.1f}×**" if own else "—",
                     f"**{r['speedup']:.2f}×** ({r['best'][1]})" if r.get("speedup") else "—",
                     f"{paired[L][0]:.2f}×" if key == "mha" and L in paired else "—"])
    s = peers["setup"]
    lines = ["## c2f against its peers (benchmarks/sweep.py: summary.md, torch_peer.md, ort_peer.md)", "",
             table(["layer", "L", "PyTorch ms", "libtorch ms", "ORT ms", "c2f ms", "c2f vs PyTorch",
                    "c2f vs best peer", "c2f vs ORT, paired rounds"], rows), "",
             f"- PyTorch {s['torch_version']}: {s.get('blas_kernel') or s.get('openblas_config')}."]
    if libtorch:
        c = libtorch["context"]
        lines.append(f"- libtorch {c.get('torch_version', '?')}: "
                     f"{blas.kernel_text(c.get('openblas_config'), c.get('openblas_threads'), env=libtorch.get('openblas_env'), allocator=libtorch.get('allocator'))}.")
    if ort:
        lines.append(f"- ONNX Runtime {ort['setup']['onnxruntime_node']} (its own kernels, "
                     f"{ort['setup']['intra_op_threads']} threads).")
    for note in {blas.forced_note(s.get("openblas_env")), blas.forced_note((libtorch or {}).get("openblas_env")),
                 blas.allocator_note(s.get("allocator")), blas.allocator_note((libtorch or {}).get("allocator"))}:
        if note:
            lines.append(f"- **{note}**")
    ctx = attn["context"]
    lines.append(f"- c2f: {ctx.get('c2f_threads')} threads; load average {', '.join(f'{v:.2f}' for v in ctx.get('load_avg', []))} "
                 f"when bench_attention started (2 cores: above about 2, other processes shared them).")
    return lines


def train_part(out):
    doc = load(out / "train_default" / "torch_train_peer.json")
    if doc is None:
        return None
    rows = []
    for r in doc["results"]:
        c = r.get("c2f")
        if c is None:
            bench = load(out / "train_default" / "bench_train.json") or {"benchmarks": []}
            c = next((b for b in bench["benchmarks"] if b["name"].startswith(f"train_{r['layer']}/{r['L']}/")), None)
        if c is None:
            continue
        rows.append([r["layer"], r["L"], f"{c['forward_ms']:.1f}", f"{c['step_ms']:.1f}",
                     f"{c['bwd_over_fwd']:.2f}", f"{r['torch_step_ms']:.1f}",
                     f"**{r['torch_step_ms'] / c['step_ms']:.2f}×**"])
    s = doc["setup"]
    return ["## Training step: c2f against torch.autograd (train_default/torch_train_peer.md)", "",
            table(["layer", "L", "c2f forward ms", "c2f step ms (forward_train + backward)", "backward / forward",
                   "torch step ms", "speed-up"], rows), "",
            f"Gradients checked equal first. PyTorch {s['torch_version']}: {s.get('blas_kernel', '?')}; c2f on "
            f"glibc's default malloc; c2f's figures are the mean of its runs right before and after torch's steps."]


def python_part(out):
    doc = load(out / "python_bench.json")
    if doc is None:
        return None
    rows = [["MultiHeadAttention" if r["layer"] == "mha" else "C2FAttention, chunk 32", r["L"], f"{r['torch_ms']:.1f}",
             f"{r['c2f_python_ms']:.2f}", f"{r['c2f_cpp_ms']:.2f}", f"**{r['speedup_python']:.2f}×**",
             f"{r['speedup_python'] / r['speedup_cpp']:.2f}"] for r in doc["speedups"]]
    lines = ["## c2f from Python against torch (python_bench.md)", "",
             table(["layer", "L", "torch ms", "c2f from Python ms", "c2f in C++ ms", "speed-up from Python",
                    "Python / C++ speed-up"], rows), ""]
    over = [f"{name}: {o['overhead_us']:.1f} µs (numpy in), {o['overhead_torch_in_us']:.1f} µs (torch in)"
            for name, o in doc["overhead"].items() if name != "bench_decode"]
    lines.append("The binding's cost per decode call, over the same step in C++: " + "; ".join(over) + ".")
    lines.append(f"PyTorch {doc['setup']['torch_version']}: {doc['setup'].get('blas_kernel', '?')}.")
    return lines


def loop_part(out):
    path = out / "forward_loop.md"
    if not path.exists():
        return None
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and re.match(r"^[0-9.]+$", cells[5]):
            rows.append([cells[0], cells[4], cells[3], cells[2], cells[5], cells[6]])
    if not rows:
        return None
    worst = max(max(float(r[4]), float(r[5])) for r in rows)
    return ["## forward() in a loop against forward_into() (forward_loop.md)", "",
            table(["layer", "forward_into ms", "forward into a kept Output ms", "forward, new Output each call ms",
                   "new ÷ into", "kept ÷ into"], rows), "",
            f"The largest ratio: **{worst:.2f}×** (the target is 1.15× at most)."]


def dist_part(out):
    path = out / "bench_dist.txt"
    if not path.exists():
        return None
    ranks, header, rows = None, [], []
    for line in path.read_text().splitlines():
        line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # colour codes, if the console had them
        m = re.match(r"== mpirun -np (\d+)", line)
        if m:
            ranks = int(m.group(1))
            continue
        words = line.split()
        if words[:2] == ["Benchmark", "Time"]:
            header = words[4:]  # the counters (--benchmark_counters_tabular=true)
            continue
        m = re.match(r"^(c2f|c2f_local|ring|ring_causal|mha_local|c2f2d|c2f2d_local|hmha|hmha_local)/(\d+)/", line)
        if not (m and ranks and len(words) >= 6 and words[2] == "ms"):
            continue
        counters = dict(zip(header, words[6:]))
        name, L = m.group(1), int(m.group(2))
        threads = counters.get("threads", "?")
        how = (f"one process (the single-process layer), {threads} threads" if name.endswith("_local") else
               f"{ranks} rank{'s' if ranks > 1 else ''} × {threads} thread{'' if threads == '1' else 's'}")
        rows.append([name.replace("_local", ""), L, how, f"{float(words[1]):.0f}", counters.get("recv_bytes", "—")])
    headline = [r for r in rows if r[0] == "c2f" and r[1] == 262144] or rows
    return ["## Sequence-parallel layers under MPI (bench_dist.txt)", "",
            table(["layer", "L", "ranks × threads", "ms per call (slowest rank)", "bytes received per rank"],
                  headline), "",
            "The same cores in every row: the rows differ by the cost of splitting the layer over ranks "
            "(C2FAttention, chunk 32, d = 512, 8 heads)."]


PARTS = [("machine", machine_part), ("attention", attention_part), ("loop", loop_part), ("train", train_part),
         ("python", python_part), ("dist", dist_part)]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "results/latest")
    lines, missing = [f"# The main job's headline ({out})", ""], []
    for name, part in PARTS:
        text = part(out)
        if text is None:
            missing.append(name)
        else:
            lines += text + [""]
    if missing:
        lines.append("Not run (no files in this folder): " + ", ".join(missing) + ".")
    text = "\n".join(lines).rstrip() + "\n"
    (out / "headline.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
