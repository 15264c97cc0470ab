#!/usr/bin/python3
"""The ONNX Runtime peer of c2f's benchmark: ONNX graphs of the same layers, on the same weights and inputs
as torch_peer.py's, run on ONNX Runtime's CPU execution provider set up for speed, outputs checked against
c2f's before timing.

    /usr/bin/python3 benchmarks/ort_peer.py --build build/release-native --out results/latest
    /usr/bin/python3 benchmarks/ort_peer.py --build build/release-native --check-only

Needs Debian's python3-torch and python3-onnx (the graphs are written in Python, under /usr/bin/python3),
Node and the npm package onnxruntime-node (benchmarks/ort/package-lock.json; `npm ci --ignore-scripts` in
benchmarks/ort, which scripts/install-deps.sh runs): its prebuilt CPU runtime runs the graphs, driven by
benchmarks/ort/run.mjs. When one of them is missing the script says which and exits with 77 (skipped).

Setup (printed, and stored in the JSON): onnxruntime-node's InferenceSession, execution provider CPU,
intraOpNumThreads = n (c2f's thread count, C2F_BENCH_THREADS, default 2), interOpNumThreads = 1,
graphOptimizationLevel 'all', executionMode 'sequential'; float32, batch 1, d = 512, 8 heads.

Graphs (weights and inputs: torch_peer.py's, built by its own layers() with its seeds):
    mha_op     torch_peer.py's nn.MultiheadAttention as ORT's fused attention operator: three MatMuls (the
               in-projection, without bias), com.microsoft MultiHeadAttention (num_heads = 8; query, key,
               value [1, L, 512], the in-projection bias through its `bias` input), the out-projection
               MatMul + Add. One graph for every L (L is a symbolic dimension).
    mha_plain  the same attention in standard ONNX operators (opset 17): MatMul + Add for q, k, v,
               Reshape / Transpose to heads, MatMul, Mul by 1/sqrt(64), Softmax, MatMul, Transpose / Reshape,
               out-projection MatMul + Add; ORT's optimiser fuses what it can (the profile shows what ran).
    c2f32      torch_peer.py's article C2FAttention, chunk 32 (tests/reference/c2f_reference.py), exported
               with torch.onnx.export (opset 17) at each L (the module's shapes are fixed by L).
    hmha       torch_peer.py's HMHA reference, window 64 (tests/reference/hmha_reference.py: dense, every
               level over an [L, L] mask), exported the same way. Its masks depend on L only and use a
               bitwise AND on integers, which opset 17 does not have (BitwiseAnd is opset 18): the export
               computes them once and the trace takes them as constants, as constant folding would.
    sparse     torch_peer.py's SparseC2F reference, chunk 64, top_k 8, per-chunk gating
               (tests/reference/sparse_reference.py: dense, the top-k chunks chosen by a pairwise rank
               tensor), run on its nn.MultiheadAttention, exported the same way.
Both MHA graphs are compared with c2f's MultiHeadAttention (bench_attention entry mha_streaming), each
exported module with its c2f layer (the entry torch_peer.py gives it: c2f/L/32, hmha/L/64,
sparse/L/64/8/0).

Per (graph, L): bench_attention's peer mode (--c2f_peer_*) computes c2f's output (once per layer and L);
run.mjs creates the InferenceSession with ORT's profiler on, runs the graph once (the check and the warm-up) and
writes its output; this script compares it with c2f's — |ORT − c2f| ≤ ATOL + RTOL·|c2f| element-wise,
else it stops with exit code 1 — and only then times, in ROUNDS alternating rounds (default 3): run.mjs
runs the graph ceil(REPS / ROUNDS) times, each the wall clock measured inside Node (process.hrtime)
around `await session.run(feeds)` (no file or Python in the timed region), then bench_attention's peer
mode times C2F_ROUND_RUNS forwards of c2f's layer (--c2f_peer_time, after its own warm-up call). ORT's
time is the median of all its runs; c2f's time in the same rounds the median of its; the paired ratio
is the median over the rounds of ORT's median over c2f's. On a shared VM whose speed changes from
minute to minute (docs/benchmarks.md, "Paired peaks, and where MHA's time goes") this ratio compares
the two in the same minute, where bench_attention's own entries ran minutes earlier. The profile of the
check run (profiler ended before the timed runs) names the kernels that ran: operator, domain and
execution provider of every node of the optimised graph.

Lengths: MHA at L ∈ {1024, 2048, 4096, 8192}, the exported C2F and SparseC2F at L ∈ {4096, 16384}, the
exported HMHA at L ∈ {1024, 4096} (an empty list, e.g. `--hmha-lengths ''`, leaves a graph out); a (graph, L) is
skipped when its predicted time (the last measured L scaled by (L / L_prev)^p, p from the last two
lengths clamped to [1, 2], 2 after the first) exceeds --budget seconds for the check plus the runs, or its
predicted memory exceeds --max-gib (or 60 % of the memory available when the script starts).

Output in --out: ort_peer.json and ort_peer.md (the table; c2f's times come from bench_attention.json of
the same sweep when it is there: c2f is not timed here). Exit codes: 0 done, 1 a mismatch or error,
77 torch, onnx, node or onnxruntime-node is missing (the peer is skipped).
"""

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch_peer  # the PyTorch peer: its modules, seeds, safetensors writer and c2f's peer mode
from report import blas
from torch_peer import EMBED, HEADS, SKIP, available_bytes, c2f_output, run_c2f_peer, save_tensors

REPO = Path(__file__).resolve().parent.parent
ORT_DIR = REPO / "benchmarks" / "ort"
RUNNER = ORT_DIR / "run.mjs"

MHA_LENGTHS = [1024, 2048, 4096, 8192]
C2F_LENGTHS = [4096, 16384]
HMHA_LENGTHS = [1024, 4096]
CHECK_LENGTHS = torch_peer.CHECK_LENGTHS  # --check-only: 1, a prime, chunk 256 + 1, 1000 (padded chunks)
C2F_CHUNK = 32
OPSET = 17
# fp32 agreement between ORT and c2f: both sum in float32 in different orders (MLAS's blocked GEMMs and its
# own exp in Softmax against Eigen's GEMMs and c2f's streaming softmax). Measured max |diff| is 3e-8 … 7e-7
# for every graph and L (stored in the JSON, printed as a fraction of the bound: at most 1 %); a weight
# matrix off by 1e-3 per element (--perturb) exceeds the bound 20-fold already at L = 1.
ATOL, RTOL = 1e-4, 1e-4
# c2f's timed forwards per round (bench_attention --c2f_peer_time), after its warm-up call.
C2F_ROUND_RUNS = 3


# ---------------------------------------------------------------------------------------------------------
# What is installed.

def probe(threads):
    """(setup dict, None), or (None, reason) when a part of the ORT peer is missing."""
    try:
        import onnx
    except ImportError as e:
        return None, f"{sys.executable} cannot import onnx ({e}); Debian: python3-onnx"
    try:
        import torch
    except ImportError as e:
        return None, f"{sys.executable} cannot import torch ({e}); Debian: python3-torch"
    node = shutil.which("node")
    if node is None:
        return None, "node is not installed (Debian: nodejs, npm)"
    r = subprocess.run([node, str(RUNNER), "--probe", "1"], capture_output=True, text=True)
    if r.returncode == 2:
        return None, (f"onnxruntime-node is not installed in {ORT_DIR} (scripts/install-deps.sh, or "
                      f"'npm ci --ignore-scripts' there)")
    if r.returncode != 0:
        return None, f"{RUNNER} --probe failed ({r.returncode}): {r.stderr.strip()}"
    versions = json.loads(r.stdout)
    torch.set_num_threads(threads)  # for the exports and the c2f reference tensors only: PyTorch is not timed
    return {
        "onnxruntime_node": versions["ort_version"], "node": node, "node_version": versions["node_version"],
        "runner": str(RUNNER.relative_to(REPO)), "onnx_version": onnx.__version__, "opset": OPSET,
        "ir_version": onnx.IR_VERSION, "torch_version": torch.__version__, "python": sys.executable,
        "execution_provider": "CPUExecutionProvider", "intra_op_threads": threads, "inter_op_threads": 1,
        "graph_optimization_level": "all", "execution_mode": "sequential", "c2f_threads": threads,
        "timing": "wall clock inside Node (process.hrtime) around await session.run(feeds); median; rounds "
                  "alternating with c2f's forwards (bench_attention --c2f_peer_time)",
        "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
        # ORT runs its own kernels (MLAS), not OpenBLAS; torch (the exports, not timed) loads OpenBLAS, and
        # sweep.py starts this script with the variables that force its kernel family unset, as the others.
        "openblas_env": blas.env_state(),
    }, None


# ---------------------------------------------------------------------------------------------------------
# torch_peer.py's modules and inputs.

def peer_module(torch, key):
    """torch_peer.py's module `key` with its weights: built as its run() builds it, seeded 1000 + the
    module's index in torch_peer.layers(). Returns (torch_peer.Layer, module in eval mode)."""
    listed = torch_peer.layers(torch, lambda layer: [])
    index = next(i for i, layer in enumerate(listed) if layer.key == key)
    torch.manual_seed(1000 + index)
    return listed[index], listed[index].build().eval()


def peer_input(torch, L):
    """torch_peer.py's input at length L (its run(): a generator seeded with L)."""
    return torch.randn(1, L, EMBED, generator=torch.Generator().manual_seed(L))


# ---------------------------------------------------------------------------------------------------------
# The graphs.

def mha_graphs(state, directory):
    """Writes the two MHA graphs of nn.MultiheadAttention's state dict `state` (numpy arrays); returns
    {graph key: path}."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    E, d = EMBED, EMBED // HEADS
    w_in, b_in = state["in_proj_weight"], state["in_proj_bias"]
    w_out, b_out = state["out_proj.weight"], state["out_proj.bias"]

    def const(name, a):
        return numpy_helper.from_array(np.ascontiguousarray(a), name)

    def model(name, nodes, inits, opsets):
        graph = helper.make_graph(
            nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "L", E])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "L", E])], inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid(dom, v) for dom, v in opsets],
                              producer_name="c2f benchmarks/ort_peer.py")
        onnx.checker.check_model(m)
        return m

    # y = x Wᵀ + b in nn.Linear's layout: MatMul with Wᵀ [in, out].
    proj = [const(f"w_{n}", w_in[i * E:(i + 1) * E].T) for i, n in enumerate("qkv")]
    out = [const("w_out", w_out.T), const("b_out", b_out)]
    out_nodes = [helper.make_node("MatMul", ["attn", "w_out"], ["y0"], name="out_proj_matmul"),
                 helper.make_node("Add", ["y0", "b_out"], ["y"], name="out_proj_bias")]

    op_nodes = [helper.make_node("MatMul", ["x", f"w_{n}"], [n], name=f"in_proj_{n}") for n in "qkv"]
    op_nodes.append(helper.make_node("MultiHeadAttention", ["q", "k", "v", "b_in"], ["attn"], name="attention",
                                     domain="com.microsoft", num_heads=HEADS))
    op = model("mha_op", op_nodes + out_nodes, proj + [const("b_in", b_in)] + out,
               [("", OPSET), ("com.microsoft", 1)])

    plain_nodes, plain_inits = [], proj + out + [
        const("heads_shape", np.array([0, -1, HEADS, d], np.int64)),
        const("merged_shape", np.array([0, -1, E], np.int64)),
        const("scale", np.array(1.0 / math.sqrt(d), np.float32))]
    for i, n in enumerate("qkv"):
        plain_inits.append(const(f"b_{n}", b_in[i * E:(i + 1) * E]))
        # q and v to [1, H, L, d]; k straight to [1, H, d, L]
        perm = [0, 2, 3, 1] if n == "k" else [0, 2, 1, 3]
        plain_nodes += [helper.make_node("MatMul", ["x", f"w_{n}"], [f"{n}0"], name=f"in_proj_{n}"),
                        helper.make_node("Add", [f"{n}0", f"b_{n}"], [f"{n}1"], name=f"in_proj_{n}_bias"),
                        helper.make_node("Reshape", [f"{n}1", "heads_shape"], [f"{n}2"], name=f"{n}_heads"),
                        helper.make_node("Transpose", [f"{n}2"], [f"{n}h"], name=f"{n}_transpose", perm=perm)]
    plain_nodes += [helper.make_node("MatMul", ["qh", "kh"], ["s0"], name="scores"),
                    helper.make_node("Mul", ["s0", "scale"], ["s"], name="scores_scale"),
                    helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
                    helper.make_node("MatMul", ["p", "vh"], ["o"], name="context"),
                    helper.make_node("Transpose", ["o"], ["o1"], name="context_transpose", perm=[0, 2, 1, 3]),
                    helper.make_node("Reshape", ["o1", "merged_shape"], ["attn"], name="context_merge")]
    plain = model("mha_plain", plain_nodes + out_nodes, plain_inits, [("", OPSET)])
    paths = {}
    for key, m in (("mha_op", op), ("mha_plain", plain)):
        paths[key] = directory / f"{key}.onnx"
        onnx.save(m, str(paths[key]))
    return paths


def export_module(torch, layer, module, L, path):
    """torch.onnx.export (opset 17) of torch_peer.py's `layer` at length L, called as torch_peer.py calls it
    (layer.call: the sparse reference is a function of its nn.MultiheadAttention); returns the seconds taken."""
    import warnings
    import hmha_reference

    class Call(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x):
            return layer.call(self.inner, x)

    level_masks = hmha_reference.level_masks
    if layer.key == "hmha":  # its masks as constants of the trace (the module docstring says why)
        fixed = level_masks(L, module.window, module.causal)
        hmha_reference.level_masks = lambda seq_len, window, causal, device=None: (
            fixed if (seq_len, window, causal) == (L, module.window, module.causal)
            else level_masks(seq_len, window, causal, device))
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            x = torch.zeros(1, L, EMBED)  # the trace depends on the shape only
            warnings.simplefilter("ignore")  # the tracer's notes on Python ints and branches taken at this L
            torch.onnx.export(Call(), (x,), str(path), opset_version=OPSET, input_names=["x"], output_names=["y"],
                              do_constant_folding=True)
    finally:
        hmha_reference.level_masks = level_masks
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------
# Running a graph (benchmarks/ort/run.mjs) and reading its profile.

class Runner:
    """One run.mjs process for one (graph, L): the InferenceSession, the check run, then (on `time`) the runs."""

    def __init__(self, model, x_bin, L, threads, y_bin, profile_prefix, optimized, then_time):
        cmd = [shutil.which("node"), str(RUNNER), "--model", str(model), "--input", str(x_bin),
               "--dims", f"1,{L},{EMBED}", "--threads", str(threads), "--output", str(y_bin),
               "--profile", str(profile_prefix), "--optimized", str(optimized), "--then-time", str(int(then_time))]
        self.waits = then_time  # run.mjs waits for a word after the check run
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def _line(self, what):
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"run.mjs ended ({code}) before reporting {what} (its error is above)")
        return json.loads(line)

    def check(self):
        return self._line("the check run")

    def time(self, reps):
        """One round of timed runs: {runs_ms, cpu_per_wall}. The InferenceSession stays for the next round."""
        self.proc.stdin.write(f"time {reps}\n")
        self.proc.stdin.flush()
        return self._line("the timed runs")

    def close(self):
        if self.waits:  # "stop": no (more) timed runs
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.waits = False
        self.proc.stdin.close()
        if self.proc.wait() != 0:
            raise RuntimeError(f"run.mjs failed with exit code {self.proc.returncode}")


def kernels(profile_file, optimized_file):
    """The nodes that ran in the profiled run, per (operator, execution provider) in the order they first
    ran: [{op, domain, provider, nodes, us, names}]; domain from ORT's optimised graph."""
    import onnx
    domains = {}
    for n in onnx.load(str(optimized_file)).graph.node:
        domains.setdefault(n.op_type, n.domain or "ai.onnx")
    out = {}
    for event in json.loads(Path(profile_file).read_text()):
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        a = event.get("args", {})
        key = (a.get("op_name", "?"), a.get("provider", "?"))
        k = out.setdefault(key, {"op": key[0], "domain": domains.get(key[0], "?"), "provider": key[1], "nodes": 0,
                                 "us": 0, "names": []})
        k["nodes"] += 1
        k["us"] += int(event.get("dur", 0))
        name = event["name"][:-len("_kernel_time")]
        if name not in k["names"]:
            k["names"].append(name)
    return list(out.values())


def paired(played):
    """The row's timing from alternating rounds [(ORT's {runs_ms, cpu_per_wall}, c2f's runs_ms)]: ORT's
    median over all its runs (ort_ms) and its cores, c2f's median over its runs in the same rounds
    (c2f_paired_ms), and paired_speedup, the median over the rounds of ORT's median over c2f's median."""
    ort_runs = [t for o, _ in played for t in o["runs_ms"]]
    c2f_runs = [t for _, c in played for t in c]
    wall = sum(ort_runs)
    ratios = [statistics.median(o["runs_ms"]) / statistics.median(c) for o, c in played]
    return dict(ort_ms=statistics.median(ort_runs), runs_ms=ort_runs,
                cpu_per_wall=sum(o["cpu_per_wall"] * sum(o["runs_ms"]) for o, _ in played) / wall,
                c2f_paired_ms=statistics.median(c2f_runs), c2f_runs_ms=[c for _, c in played],
                ort_rounds_ms=[o["runs_ms"] for o, _ in played], paired_speedup=statistics.median(ratios),
                paired_speedups=ratios)


def agreement(ort_y, c2f_y):
    """(max |ORT − c2f|, max |ORT − c2f| / (ATOL + RTOL·|c2f|), ok), in float64; a non-finite value fails."""
    import numpy as np
    if ort_y.shape != c2f_y.shape:
        return math.inf, math.inf, False
    a, b = ort_y.astype(np.float64), c2f_y.astype(np.float64)
    diff = np.abs(a - b)
    if diff.size == 0:
        return 0.0, 0.0, True
    worst = float((diff / (ATOL + RTOL * np.abs(b))).max())
    finite = bool(np.isfinite(a).all() and np.isfinite(b).all())
    return float(diff.max()), worst, finite and worst <= 1.0


# ---------------------------------------------------------------------------------------------------------

class Graph:
    def __init__(self, key, layer, label, entry, lengths, memory):
        self.key, self.layer, self.label, self.entry = key, layer, label, entry
        self.lengths, self.memory = lengths, memory
        self.timed = []  # (L, median seconds per call)

    def predicted(self, L):
        """Seconds a call at L, from the timed lengths (None before the first)."""
        if not self.timed:
            return None
        p = 2.0
        if len(self.timed) >= 2:
            (l0, t0), (l1, t1) = self.timed[-2], self.timed[-1]
            p = min(2.0, max(1.0, math.log(t1 / t0) / math.log(l1 / l0)))
        return self.timed[-1][1] * (L / self.timed[-1][0]) ** p


def run(args):
    import numpy as np
    threads = torch_peer.bench_threads()
    setup, missing = probe(threads)
    if setup is None:
        print(f"ort_peer: {missing}. Skipping the ONNX Runtime peer.")
        return SKIP
    import torch
    binary = Path(args.c2f_binary) if args.c2f_binary else Path(args.build) / "benchmarks" / "bench_attention"
    if not binary.exists():
        sys.exit(f"ort_peer: {binary} does not exist (build the bench_attention target)")
    print(f"peer: ONNX Runtime {setup['onnxruntime_node']} (onnxruntime-node, Node {setup['node_version']}), "
          f"CPUExecutionProvider, intraOpNumThreads {threads}, interOpNumThreads 1, graphOptimizationLevel 'all', "
          f"executionMode 'sequential'; graphs by onnx {setup['onnx_version']} (opset {OPSET}) and torch "
          f"{setup['torch_version']}; c2f threads {threads}", flush=True)

    mha_lengths = CHECK_LENGTHS if args.check_only else [int(v) for v in args.lengths.split(",") if v]
    module_lengths = {key: CHECK_LENGTHS if args.check_only else [int(v) for v in text.split(",") if v]
                      for key, text in ((f"c2f{C2F_CHUNK}", args.c2f_lengths), ("hmha", args.hmha_lengths),
                                        ("sparse", args.sparse_lengths))}
    dense = lambda L: 3 * HEADS * L * L * 4.0  # [8, L, L] float tensors alive at once (scores, softmax, …)
    graphs = [
        Graph("mha_op", "mha", "ORT com.microsoft MultiHeadAttention", lambda L: ("mha_streaming", L),
              mha_lengths, dense),
        Graph("mha_plain", "mha", "ORT plain ONNX attention (MatMul, Softmax)", lambda L: ("mha_streaming", L),
              mha_lengths, dense),
    ]
    # The exported modules: torch_peer.py's layers, with their bench_attention entries and memory estimates.
    for layer in torch_peer.layers(torch, lambda layer: []):
        if layer.key in module_lengths:
            graphs.append(Graph(layer.key, layer.key, f"ORT exported {layer.label}", layer.entry,
                                module_lengths[layer.key], layer.memory))
    budget, cap = args.budget, args.max_gib * 2**30
    avail = available_bytes()
    if avail:
        cap = min(cap, 0.6 * avail)
    reps = 0 if args.check_only else args.reps
    rounds = args.rounds
    if rounds < 1:
        sys.exit(f"ort_peer: --rounds must be at least 1, got {rounds}")
    results = []
    start = time.time()
    load_start = os.getloadavg()
    # No torch.inference_mode() here: torch.onnx.export traces the module, whose parameters must be normal
    # tensors (the values are the same: torch_peer.py builds its modules inside inference_mode).
    with tempfile.TemporaryDirectory(prefix="c2f-ort-peer-") as tmp, torch.no_grad():
        tmp = Path(tmp)
        for layer_key in ("mha",) + tuple(module_lengths):
            layer, module = peer_module(torch, layer_key)
            state = {name: t.detach().clone() for name, t in module.state_dict().items()}
            weights = tmp / f"{layer_key}.safetensors"
            save_tensors(weights, state, dict(layer.metadata, embed_dim=str(EMBED), num_heads=str(HEADS)))
            if args.perturb:  # the check's own test: ORT's first weight matrix is off by 1e-3 per element
                state[sorted(n for n in state if n.endswith("weight"))[0]] += 1e-3
                module.load_state_dict(state)
            mine = [g for g in graphs if g.layer == layer_key]
            files = {}
            if layer_key == "mha":
                files = mha_graphs({k: v.numpy() for k, v in state.items()}, tmp)
            for L in sorted({L for g in mine for L in g.lengths}):
                todo = []
                for g in (g for g in mine if L in g.lengths):
                    row = {"graph": g.key, "layer": g.layer, "label": g.label, "L": L, "entry": list(g.entry(L))}
                    results.append(row)
                    need = g.memory(L)
                    per_call = g.predicted(L)
                    n = reps if per_call is None or per_call < 1.0 else min(reps, 3)
                    runs = rounds * math.ceil(n / rounds) if n else 0  # ORT's runs over all rounds
                    if need > cap:
                        row["skipped"] = f"predicted memory {need / 2**30:.1f} GiB > cap {cap / 2**30:.1f} GiB"
                    elif per_call is not None and (1 + runs) * per_call > budget:
                        row["skipped"] = (f"predicted {per_call:.1f} s a call, {(1 + runs) * per_call:.0f} s for "
                                          f"the check and {runs} runs > budget {budget:.0f} s")
                    if "skipped" in row:
                        print(f"  {g.label}, L = {L}: skipped, {row['skipped']}", flush=True)
                    else:
                        todo.append((g, row, n))
                if not todo:
                    continue
                x = peer_input(torch, L)
                x_file, x_bin = tmp / f"x_{L}.safetensors", tmp / f"x_{L}.bin"
                save_tensors(x_file, {"x": x}, {})
                x.numpy().astype("<f4").tofile(x_bin)
                try:
                    ours = c2f_output(torch, binary, weights, x_file, tmp / "y.safetensors").numpy()
                except (RuntimeError, OSError, ValueError) as e:
                    print(f"ort_peer: no c2f output for {layer.label}, L = {L}: {e}", file=sys.stderr)
                    return 1
                for g, row, n in todo:
                    model = files.get(g.key)
                    if model is None:  # an exported module: one graph per L
                        model = tmp / f"{g.key}_{L}.onnx"
                        row["export_s"] = export_module(torch, layer, module, L, model)
                    y_bin, prefix, optimized = tmp / "y.bin", tmp / f"profile_{g.key}_{L}", tmp / "optimized.onnx"
                    try:
                        runner = Runner(model, x_bin, L, threads, y_bin, prefix, optimized, n > 0)
                        first = runner.check()
                        y = np.fromfile(y_bin, dtype="<f4").reshape(first["output_dims"])
                        max_diff, worst, ok = agreement(y, ours)
                        row.update(max_abs_diff=max_diff, worst_fraction_of_tolerance=worst,
                                   session_ms=first["session_ms"], first_call_ms=first["first_run_ms"],
                                   kernels=kernels(first["profile_file"], optimized))
                        print(f"check {g.label}, L = {L}: max |c2f - ORT| = {max_diff:.3g} "
                              f"({100 * worst:.0f} % of the tolerance) {'OK' if ok else 'MISMATCH'}", flush=True)
                        if not ok:
                            runner.close()
                            print(f"ort_peer: ORT's {g.key} differs from c2f's {layer_key} at L = {L}: max |diff| "
                                  f"{max_diff:.3g}, tolerance |diff| <= {ATOL:g} + {RTOL:g}·|c2f| exceeded "
                                  f"{worst:.3g}×", file=sys.stderr)
                            return 1
                        if n == 0:
                            runner.close()
                            continue
                        if first["first_run_ms"] >= 1e3:
                            n = min(n, 3)
                        per_round = math.ceil(n / rounds)
                        played = []
                        for _ in range(rounds):
                            ort_round = runner.time(per_round)
                            c2f_round = run_c2f_peer(binary, weights, x_file, tmp / "y_timed.safetensors",
                                                     C2F_ROUND_RUNS)
                            played.append((ort_round, c2f_round))
                        runner.close()
                    except (RuntimeError, OSError, ValueError) as e:
                        print(f"ort_peer: {g.label}, L = {L}: {e}", file=sys.stderr)
                        return 1
                    row.update(paired(played))
                    g.timed.append((L, row["ort_ms"] / 1e3))
                    print(f"  {g.label}, L = {L}: {row['ort_ms']:.2f} ms (median of {len(row['runs_ms'])}); c2f "
                          f"{row['c2f_paired_ms']:.2f} ms in the same rounds; paired c2f vs ORT "
                          f"{row['paired_speedup']:.2f}× ({time.time() - start:.0f} s so far)", flush=True)
    doc = torch_peer.peer_document(setup, (ATOL, RTOL), args, budget, results, start, load_start, perturb=args.perturb,
                                   graphs={g.key: g.label for g in graphs})
    if args.check_only:
        print(f"ort_peer: all {sum('max_abs_diff' in r for r in results)} checks OK ({doc['seconds']:.0f} s)")
        return 0
    from report.ort import ort_table
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ort_peer.json").write_text(json.dumps(doc, indent=1) + "\n")
    attn_file = out / "bench_attention.json"
    text = ort_table(doc, json.loads(attn_file.read_text()) if attn_file.exists() else None)
    (out / "ort_peer.md").write_text(text + "\n")
    print()
    print(text)
    print(f"ort_peer: wrote {out / 'ort_peer.json'}, {out / 'ort_peer.md'} ({doc['seconds']:.0f} s)")
    return 0


def main(argv=None):
    p = torch_peer.peer_arguments(__doc__, MHA_LENGTHS, "graph", "ORT against c2f")
    p.add_argument("--c2f-lengths", default=",".join(map(str, C2F_LENGTHS)),
                   help="comma-separated sequence lengths of the exported C2F module")
    p.add_argument("--hmha-lengths", default=",".join(map(str, HMHA_LENGTHS)),
                   help="comma-separated sequence lengths of the exported HMHA module")
    p.add_argument("--sparse-lengths", default=",".join(map(str, torch_peer.SPARSE_LENGTHS)),
                   help="comma-separated sequence lengths of the exported SparseC2F module")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating rounds per (graph, L): ORT's runs split over them, each followed by "
                        f"{C2F_ROUND_RUNS} c2f forwards (default 3)")
    return torch_peer.peer_main(p, argv, run)


if __name__ == "__main__":
    sys.exit(main())
