#!/usr/bin/python3
"""The PyTorch peer of c2f's benchmark: the modules a PyTorch user would run instead, timed the way a user
who cares about speed would run them, on the same weights and inputs as c2f (outputs checked equal first).

    /usr/bin/python3 benchmarks/torch_peer.py --build build/release-native --out results/latest
    /usr/bin/python3 benchmarks/torch_peer.py --build build/release-native --check-only

Setup (printed, and stored in the JSON): Debian's python3-torch, float32, batch 1, d = 512, 8 heads,
torch.inference_mode(), torch.set_num_threads(n) and OpenBLAS's own threads = n, where n is c2f's thread
count (C2F_BENCH_THREADS, default 2). The BLAS reported is the library whose sgemm_ libtorch calls, found
after a first matmul (the BLAS-like libraries mapped into the process are listed too), and the kernel it
runs: OpenBLAS's version and the kernel family it chose for this CPU (openblas_get_config,
openblas_get_corename), e.g. "OpenBLAS 0.3.21 Cooperlake kernels, 2 threads". OPENBLAS_CORETYPE in the
environment forces an older family: sweep.py and scripts/run.sh start this script with OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE unset (`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 ...` by hand); the
script prints a note, and the table says so, when they are set (report/blas.py). The same commands preload
jemalloc (report/blas.py's PEER_ALLOCATOR, with MALLOC_CONF keeping freed memory): with glibc's malloc the
[8, L, L] scores of every call are mapped and page-faulted in again. The allocator the peer ran with is
reported next to the kernel, e.g. "...; allocator jemalloc 5.3.0 (MALLOC_CONF=...)"; a note when it is not
jemalloc. bench_attention (c2f), which this script runs for the check, gets the environment as it was before
(blas.c2f_env()).

Modules (PyTorch's default initialisation, seeded; the same tensors are loaded into c2f):
    mha      torch.nn.MultiheadAttention(512, 8, batch_first=True), called (x, x, x, need_weights=False)
             (PyTorch's inference fast path) — against c2f's MultiHeadAttention (entry mha_streaming)
    c2f      the coarse-to-fine attention article's C2FAttention with its bugs fixed
             (tests/reference/c2f_reference.py), chunk 8 … 256 — against c2f's C2FAttention (entry c2f)
    hmha     tests/reference/hmha_reference.py's HMHA, window 64 — against c2f's HMHA (entry hmha). That
             module states HMHA densely (L × L masks): a correctness reference, not a fast implementation
    sparse   tests/reference/sparse_reference.py's sparse_c2f_attention on an nn.MultiheadAttention's
             weights, chunk 64, top_k 8, per-chunk gating — against c2f's SparseC2FAttention (entry
             sparse). Also dense (L × L masks)
    mha_bf16 the mha module under torch.autocast("cpu", dtype=torch.bfloat16), called (x, x', x'') with
             copies of x (1.13's fast path fails under autocast) — against c2f's MultiHeadAttention with
             Compute::BFloat16 (entry mha_bf16); checked with max |c2f − torch| ≤ BF16_BOUND · max |torch|
Every module is also compared, in the table, with nn.MultiheadAttention at the same L: the full attention
it replaces. "Best peer" = the fastest PyTorch or libtorch module for that layer and L.

Per (module, L): the script writes the weights (with the layer in __metadata__) and x as safetensors, has
bench_attention's peer mode (--c2f_peer_*) compute c2f's output, runs the PyTorch module once (the
check, which is also the warm-up), compares — |c2f − torch| ≤ ATOL + RTOL·|torch| element-wise, else it
stops with exit code 1 — and then times the PyTorch module: the median of REPS wall-clock runs. c2f's
times are not measured here: the peer table takes them from bench_attention.json of the same sweep.

Lengths: L ∈ {1024, 2048, 4096, 8192, 16384}, skipping an (module, L) when its predicted time (the last
measured L scaled by (L / L_prev)², conservative) exceeds --budget seconds for the check plus the runs, or
its predicted memory (the dense modules hold several [8, L, L] float tensors) exceeds --max-gib (or 60 %
of the memory available when the script starts); each skip is reported with its reason. --lengths and
--layers (module keys: mha, c2f8 … c2f256, hmha, sparse, mha_bf16, c2f32_bf16) pick fewer.

Output in --out: torch_peer.json, and torch_peer.md (the peer table) when bench_attention.json (and
bench_libtorch.json) of the same sweep are there. Exit codes: 0 done, 1 a mismatch or error, 77 torch is
not importable (the check is skipped).
"""

import argparse
import ctypes
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "reference"))
sys.path.insert(0, str(REPO / "benchmarks"))
from report import blas  # noqa: E402  (the BLAS kernel the peer runs on, and the variables that force one)

EMBED, HEADS = 512, 8
LENGTHS = [1024, 2048, 4096, 8192, 16384]
CHECK_LENGTHS = [1, 37, 257, 1000]  # --check-only: 1, a prime, chunk 256 + 1, and 1000 (sparse selects)
CHUNKS = [8, 16, 32, 64, 128, 256]  # bench_attention's C2F chunks
WINDOW = 64  # bench_attention's HMHA window
SPARSE_CHUNK, SPARSE_TOP_K = 64, 8  # bench_attention's entry sparse/L/64/8/0 (per-chunk gating)
SPARSE_LENGTHS = (4096, 16384)  # the lengths of bench_attention's sparse entries
# fp32 agreement, the project's fp32 tolerance: the two sides sum in different orders (blocked GEMMs, a
# streaming softmax against a full one) over up to 16384 keys. Measured max |diff| is 1e-7 … 8e-7 for
# every module and L here (stored in the JSON), under 10 % of the bound; a weight matrix off by 1e-4 per
# element (--perturb) already exceeds it.
ATOL, RTOL = 1e-5, 1e-5
BF16_BOUND = 2e-2  # c2f's Compute::BFloat16 against torch.autocast("cpu", bfloat16): max|diff| ≤ it · max|torch|
SKIP = 77


def bench_threads():
    raw = os.environ.get("C2F_BENCH_THREADS", "2")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        sys.exit(f"torch_peer: C2F_BENCH_THREADS must be an integer >= 1, got {raw!r}")
    return n


# ---------------------------------------------------------------------------------------------------------
# The peer's setup: threads and the BLAS it really runs on.

def mapped_files():
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6
                       and line.split(None, 5)[5].startswith("/")})


BLAS_PREFIXES = ("libblas", "libopenblas", "libmkl", "libblis", "libcblas")


class DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def setup_torch(threads):
    """Imports torch with `threads` threads (torch and OpenBLAS) and returns (torch, setup dict)."""
    os.environ["OPENBLAS_NUM_THREADS"] = str(threads)  # read by OpenBLAS when it loads, with torch
    import torch
    torch.set_num_threads(threads)
    a = torch.ones(256, 256)
    float((a @ a).sum())  # the first matmul: every BLAS torch uses is loaded now
    files = mapped_files()
    mapped = sorted({os.path.realpath(p) for p in files if os.path.basename(p).startswith(BLAS_PREFIXES)})
    # The sgemm_ libtorch calls: looked up from libtorch_cpu's own handle (its dependency scope), then
    # mapped back to a file with dladdr.
    sgemm_from = "unknown"
    torch_cpu = next((p for p in files if os.path.basename(p).startswith("libtorch_cpu")), None)
    if torch_cpu:
        try:
            addr = ctypes.cast(ctypes.CDLL(torch_cpu).sgemm_, ctypes.c_void_p).value
            info = DlInfo()
            if ctypes.CDLL(None).dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) and info.dli_fname:
                sgemm_from = os.path.realpath(info.dli_fname.decode())
        except (AttributeError, OSError) as e:
            sgemm_from = f"unknown ({e})"
    openblas_threads, openblas_config = "n/a (no OpenBLAS mapped)", "n/a (no OpenBLAS mapped)"
    openblas_corename = None
    engine = next((p for p in mapped if os.path.basename(p).startswith("libopenblas")), None)
    if engine:
        lib = ctypes.CDLL(engine)
        lib.openblas_set_num_threads(threads)
        openblas_threads = str(lib.openblas_get_num_threads())
        lib.openblas_get_config.restype = ctypes.c_char_p
        openblas_config = lib.openblas_get_config().decode()
        lib.openblas_get_corename.restype = ctypes.c_char_p  # the kernel family OpenBLAS runs on this CPU
        openblas_corename = lib.openblas_get_corename().decode()
    allocator = blas.allocator_here()  # jemalloc when the peer's command preloads it (report/blas.py)
    found = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    blas_info = f"built with BLAS_INFO={found.group(1) if found else '?'}"
    setup = {
        "python": sys.executable, "torch_version": torch.__version__, "torch_path": os.path.dirname(torch.__file__),
        "torch_build_blas": blas_info, "blas_library": sgemm_from, "mapped_blas": mapped,
        "openblas_threads": openblas_threads, "openblas_config": openblas_config,
        "openblas_corename": openblas_corename, "openblas_env": blas.env_state(), "allocator": allocator,
        "blas_kernel": (blas.kernel_text(openblas_config, openblas_threads, openblas_corename, blas.env_state(),
                                         allocator)
                        if engine else f"not OpenBLAS: sgemm_ from {sgemm_from}; allocator "
                                       f"{blas.allocator_text(allocator)}"),
        "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
        "c2f_threads": threads, "cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count(),
    }
    return torch, setup


# ---------------------------------------------------------------------------------------------------------
# The modules.

class Layer:
    """One PyTorch module next to one c2f layer (a bench_attention entry)."""

    def __init__(self, key, label, entry, metadata, build, call, memory, check_call=None, relative_bound=None):
        self.key, self.label, self.entry, self.metadata = key, label, entry, metadata
        self.relative_bound = relative_bound  # None: ATOL + RTOL·|torch| per element; else max|diff| ≤ it · max|torch|
        self.build, self.call, self.memory = build, call, memory
        self.check_call = check_call or call


def layers(torch, lengths_of):
    import torch.nn as nn
    from c2f_reference import C2FAttention
    from hmha_reference import HMHA
    from sparse_reference import selection, sparse_c2f_attention

    def mha_build():
        return nn.MultiheadAttention(EMBED, HEADS, batch_first=True)

    def dense(tensors):  # bytes of `tensors` [8, L, L] float tensors alive at once
        return lambda L: tensors * HEADS * L * L * 4.0

    out = [Layer("mha", "nn.MultiheadAttention", lambda L: ("mha_streaming", L), {"layer": "mha"}, mha_build,
                 lambda m, x: m(x, x, x, need_weights=False)[0], dense(3))]
    for c in CHUNKS:
        out.append(Layer(f"c2f{c}", f"article C2FAttention, chunk {c}", lambda L, c=c: ("c2f", L, c),
                         {"layer": "c2f", "chunk_size": str(c)}, lambda c=c: C2FAttention(EMBED, HEADS, c),
                         lambda m, x: m(x), lambda L, c=c: 8.0 * L * EMBED * 4 * 6 + HEADS * (L / c) ** 2 * 4 * 3))
    out.append(Layer("hmha", f"HMHA reference (dense), W = {WINDOW}", lambda L: ("hmha", L, WINDOW),
                     {"layer": "hmha", "window": str(WINDOW)}, lambda: HMHA(EMBED, HEADS, WINDOW),
                     lambda m, x: m(x), dense(6)))

    def sparse_check(m, x):
        # The check takes the selection computed in float64 (as the fixtures do): c2f selects in float32,
        # and a near-tie must not count as a mismatch of the attention itself.
        m64 = nn.MultiheadAttention(EMBED, HEADS, batch_first=True).double()
        m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
        keep, _, margin = selection(m64, x.double(), SPARSE_CHUNK, SPARSE_TOP_K, "chunk", False)
        sparse_check.min_margin = float(margin.min())
        return sparse_c2f_attention(m, x, SPARSE_CHUNK, SPARSE_TOP_K, "chunk", False, keep=keep)[0]

    out.append(Layer("sparse", f"SparseC2F reference (dense), chunk {SPARSE_CHUNK}, top_k {SPARSE_TOP_K}",
                     lambda L: ("sparse", L, SPARSE_CHUNK, SPARSE_TOP_K, 0),
                     {"layer": "sparse", "chunk_size": str(SPARSE_CHUNK), "top_k": str(SPARSE_TOP_K),
                      "gating": "chunk"}, mha_build,
                     lambda m, x: sparse_c2f_attention(m, x, SPARSE_CHUNK, SPARSE_TOP_K, "chunk", False)[0],
                     dense(8), check_call=sparse_check))
    def autocast_call(m, x):  # key and value copies: torch 1.13's fast path fails under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, x.clone(), x.clone(), need_weights=False)[0].float()

    out.append(Layer("mha_bf16", "nn.MultiheadAttention, autocast bf16", lambda L: ("mha_bf16", L),
                     {"layer": "mha", "compute": "bfloat16"}, mha_build, autocast_call, dense(3),
                     relative_bound=BF16_BOUND))

    def c2f_autocast_call(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x).float()

    out.append(Layer("c2f32_bf16", "article C2FAttention, chunk 32, autocast bf16", lambda L: ("c2f_bf16", L, 32),
                     {"layer": "c2f", "chunk_size": "32", "compute": "bfloat16"}, lambda: C2FAttention(EMBED, HEADS, 32),
                     c2f_autocast_call, lambda L: 8.0 * L * EMBED * 4 * 6 + HEADS * (L / 32) ** 2 * 4 * 3,
                     relative_bound=BF16_BOUND))
    for layer in out:
        layer.lengths = lengths_of(layer)
    return out


# ---------------------------------------------------------------------------------------------------------
# safetensors in and out (tests/reference/safetensors_io.py).

def save_tensors(path, tensors, metadata):
    import safetensors_io as st
    st.save_file(path, {name: st.Tensor("F32", tuple(t.shape), t.detach().contiguous().float().numpy().tobytes())
                        for name, t in tensors.items()}, metadata)


def load_tensors(torch, path):
    """Every tensor of a safetensors file, as float32 torch tensors (another dtype is an error)."""
    import safetensors_io as st
    tensors, _ = st.load_file(path)
    out = {}
    for name, t in tensors.items():
        if t.dtype != "F32":
            raise ValueError(f"{path}: {name} is {t.dtype}, expected F32")
        out[name] = torch.frombuffer(bytearray(t.data), dtype=torch.float32).reshape(t.shape)
    return out


def load_tensor(torch, path, name):
    return load_tensors(torch, path)[name]


def run_c2f_peer(binary, weights, x_file, out_file, timed=0):
    """bench_attention's peer mode: c2f's output on the weights and x written to out_file, then (timed > 0)
    the wall-clock ms of `timed` more forwards, returned as a list (else [])."""
    cmd = [str(binary), f"--c2f_peer_weights={weights}", f"--c2f_peer_input={x_file}", f"--c2f_peer_output={out_file}"]
    if timed > 0:
        cmd.append(f"--c2f_peer_time={timed}")
    # c2f's binary runs in the environment as it was before the peer's command changed it (no preloaded
    # allocator: bench_attention interposes malloc itself, tools/malloc_counter.hpp; report/blas.py).
    r = subprocess.run(cmd, capture_output=True, text=True, env=blas.c2f_env())
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return json.loads(r.stdout.strip().splitlines()[-1])["runs_ms"] if timed > 0 else []


def c2f_output(torch, binary, weights, x_file, out_file):
    run_c2f_peer(binary, weights, x_file, out_file)
    y = load_tensor(torch, out_file, "y")
    os.remove(out_file)
    return y


def compare(ours, ref, relative_bound=None):
    """(max |diff|, max |diff| / (ATOL + RTOL·|ref|) — or, with relative_bound, / (relative_bound · max|ref|)
    —, ok)."""
    if ours.shape != ref.shape:
        return math.inf, math.inf, False
    diff = (ours.double() - ref.double()).abs()
    if relative_bound is not None:
        ratio = diff / (relative_bound * float(ref.double().abs().max()))
    else:
        ratio = diff / (ATOL + RTOL * ref.double().abs())
    finite = bool(ours.isfinite().all()) and bool(ref.isfinite().all())
    worst = float(ratio.max()) if ratio.numel() else 0.0
    return float(diff.max()) if diff.numel() else 0.0, worst, finite and worst <= 1.0


# ---------------------------------------------------------------------------------------------------------

def available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def run(args):
    threads = bench_threads()
    try:
        torch, setup = setup_torch(threads)
    except ImportError as e:
        print(f"torch_peer: {sys.executable} cannot import torch ({e}); Debian: python3-torch, run with "
              f"/usr/bin/python3. Skipping the PyTorch peer.")
        return SKIP
    binary = Path(args.c2f_binary) if args.c2f_binary else Path(args.build) / "benchmarks" / "bench_attention"
    if not binary.exists():
        sys.exit(f"torch_peer: {binary} does not exist (build the bench_attention target)")
    print(f"peer: PyTorch {setup['torch_version']} ({setup['python']}, {setup['torch_build_blas']}), BLAS (sgemm_ "
          f"from) {setup['blas_library']}, torch threads {setup['torch_threads']}, OpenBLAS threads "
          f"{setup['openblas_threads']}, c2f threads {threads}", flush=True)
    print(f"peer: mapped BLAS libraries: {', '.join(setup['mapped_blas']) or 'none'}; OpenBLAS config: "
          f"{setup['openblas_config']}", flush=True)
    print(f"peer: BLAS kernel: {setup['blas_kernel']}", flush=True)
    for note in (blas.forced_note(setup["openblas_env"]), blas.allocator_note(setup["allocator"])):
        if note:
            print(f"peer: {note}", flush=True)

    lengths = CHECK_LENGTHS if args.check_only else [int(v) for v in args.lengths.split(",")]
    budget, cap = args.budget, args.max_gib * 2**30
    avail = available_bytes()
    if avail:
        cap = min(cap, 0.6 * avail)
    results = []
    start = time.time()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="c2f-torch-peer-") as tmp, torch.inference_mode():
        tmp = Path(tmp)
        x_files = {}
        for L in lengths:
            g = torch.Generator().manual_seed(L)
            x = torch.randn(1, L, EMBED, generator=g)
            x_files[L] = (tmp / f"x_{L}.safetensors", x)
            save_tensors(x_files[L][0], {"x": x}, {})
        # bench_attention times the sparse layer at L = 4096 and 16384 only; the checks run everywhere.
        def lengths_of(layer):
            if layer.key == "sparse" and not args.check_only:
                return [L for L in lengths if L in SPARSE_LENGTHS]
            if layer.key == "c2f32_bf16" and not args.check_only:  # bench_attention's c2f_bf16: L >= 4096
                return [L for L in lengths if L >= 4096]
            return lengths

        for index, layer in enumerate(layers(torch, lengths_of)):
            if args.layers and layer.key not in args.layers.split(","):
                continue
            torch.manual_seed(1000 + index)  # the index in the whole list: ort_peer.py builds the same weights
            module = layer.build().eval()
            weights = tmp / f"{layer.key}.safetensors"
            state = {name: t.detach().clone() for name, t in module.state_dict().items()}
            if args.perturb:  # the check's own test: c2f's first weight matrix is off by 1e-4 per element
                state[sorted(n for n in state if n.endswith("weight"))[0]] += 1e-4
            save_tensors(weights, state, dict(layer.metadata, embed_dim=str(EMBED), num_heads=str(HEADS)))
            timed = []  # (L, median seconds per call) of the timed lengths
            for L in layer.lengths:
                x_file, x = x_files[L]
                row = {"layer": layer.key, "label": layer.label, "L": L, "entry": list(layer.entry(L))}
                results.append(row)
                need = layer.memory(L)
                if need > cap:
                    row["skipped"] = f"predicted memory {need / 2**30:.1f} GiB > cap {cap / 2**30:.1f} GiB"
                    print(f"  {layer.label}, L = {L}: skipped, {row['skipped']}", flush=True)
                    continue
                reps = args.reps
                if timed and not args.check_only:
                    # Time per call from the last timed L: the growth exponent of the last two timed lengths
                    # (clamped to [1, 2]), or 2 after the first one.
                    p = 2.0
                    if len(timed) >= 2:
                        (l0, t0_), (l1, t1_) = timed[-2], timed[-1]
                        p = min(2.0, max(1.0, math.log(t1_ / t0_) / math.log(l1 / l0)))
                    per_call = timed[-1][1] * (L / timed[-1][0]) ** p
                    reps = args.reps if per_call < 1.0 else min(args.reps, 3)
                    if (1 + reps) * per_call > budget:
                        row["skipped"] = (f"predicted {per_call:.1f} s a call, {(1 + reps) * per_call:.0f} s for the "
                                          f"check and {reps} runs > budget {budget:.0f} s")
                        print(f"  {layer.label}, L = {L}: skipped, {row['skipped']}", flush=True)
                        continue
                try:
                    ours = c2f_output(torch, binary, weights, x_file, tmp / "y.safetensors")
                except (RuntimeError, OSError, ValueError) as e:
                    print(f"torch_peer: no c2f output for {layer.label}, L = {L}: {e}", file=sys.stderr)
                    return 1
                t0 = time.perf_counter()
                ref = layer.call(module, x)
                first = time.perf_counter() - t0
                if layer.check_call is not layer.call:
                    ref = layer.check_call(module, x)
                    row["min_selection_margin"] = layer.check_call.min_margin
                max_diff, worst, ok = compare(ours, ref, layer.relative_bound)
                row.update(max_abs_diff=max_diff, worst_fraction_of_tolerance=worst, first_call_s=first)
                print(f"check {layer.label}, L = {L}: max |c2f - torch| = {max_diff:.3g} "
                      f"({100 * worst:.0f} % of the tolerance) {'OK' if ok else 'MISMATCH'}", flush=True)
                if not ok:
                    print(f"torch_peer: c2f's {layer.key} differs from PyTorch's at L = {L}: "
                          f"max |diff| {max_diff:.3g}, "
                          f"tolerance |diff| <= {ATOL:g} + {RTOL:g}·|torch| exceeded {worst:.3g}×", file=sys.stderr)
                    return 1
                if args.check_only:
                    continue
                if first >= 1.0:
                    reps = min(reps, 3)
                times, cpu = [], 0.0
                for _ in range(reps):
                    c0, t0 = time.process_time(), time.perf_counter()
                    y = layer.call(module, x)
                    times.append(time.perf_counter() - t0)
                    cpu += time.process_time() - c0
                    del y
                # cpu_per_wall: CPU seconds of this process per wall-clock second while timed (at most the
                # thread count; well below it when other processes hold the cores or threads wait)
                row.update(torch_ms=1e3 * statistics.median(times), runs_ms=[1e3 * t for t in times],
                           cpu_per_wall=cpu / sum(times))
                timed.append((L, statistics.median(times)))
                print(f"  {layer.label}, L = {L}: {row['torch_ms']:.2f} ms (median of {reps}; "
                      f"{time.time() - start:.0f} s so far)", flush=True)
    doc = peer_document(setup, (ATOL, RTOL), args, budget, results, start, load_start)
    if args.check_only:
        print(f"torch_peer: all {len(results)} checks OK ({doc['seconds']:.0f} s)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "torch_peer.json").write_text(json.dumps(doc, indent=1) + "\n")
    written = ["torch_peer.json"]
    if (out / "bench_attention.json").exists():
        attn = json.loads((out / "bench_attention.json").read_text())
        lt_file = out / "bench_libtorch.json"
        libtorch = json.loads(lt_file.read_text()) if lt_file.exists() else None
        text, _ = peer_table(doc, attn, libtorch)
        (out / "torch_peer.md").write_text(text + "\n")
        written.append("torch_peer.md")
        print()
        print(text)
    print(f"torch_peer: wrote {', '.join(str(out / w) for w in written)} ({doc['seconds']:.0f} s)")
    return 0


# ---------------------------------------------------------------------------------------------------------
# The peer table (also used by sweep.py's summary): no torch needed.

def peer_table(peers, attn, libtorch=None):
    """Markdown of c2f against its peers per layer and L, from this script's JSON (`peers`) and the same
    sweep's bench_attention / bench_libtorch Google Benchmark JSON. Returns (markdown, {(layer, L): row})."""
    from sweep import entries, ms, table
    e = entries(attn)
    lt = entries(libtorch) if libtorch else {}
    s = peers["setup"]
    torch_mha = {r["L"]: r for r in peers["results"] if r["layer"] == "mha"}
    lines = ["### c2f against its peers (same weights and inputs, outputs checked equal; same sweep)", ""]
    kernel = s.get("blas_kernel") or blas.kernel_text(s.get("openblas_config"), s.get("openblas_threads"))
    lines.append(f"- PyTorch {s['torch_version']} (Debian python3-torch, {s['python']}; {s['torch_build_blas']}): "
                 f"**{kernel}**; BLAS (sgemm_ from) `{s['blas_library']}`, torch threads {s['torch_threads']}, "
                 f"OpenBLAS threads {s['openblas_threads']} (`{s['openblas_config']}`); torch.inference_mode(), "
                 f"float32, median of {peers['reps']} wall-clock runs after a warm-up.")
    for note in (blas.forced_note(s.get("openblas_env")), blas.allocator_note(s.get("allocator"))):
        if note:
            lines.append(f"- **{note}**: not PyTorch at its best.")
    if libtorch:
        c = libtorch["context"]
        env = libtorch.get("openblas_env")  # set by sweep.py, which starts bench_libtorch
        alloc = libtorch.get("allocator")
        lines.append(f"- libtorch {c.get('torch_version', '?')} (bench_libtorch, torch::nn::MultiheadAttention): "
                     f"**{blas.kernel_text(c.get('openblas_config'), c.get('openblas_threads'), env=env, allocator=alloc)}**; "
                     f"BLAS (sgemm_ from) `{c.get('blas_library', '?')}`, torch threads {c.get('torch_threads', '?')}, "
                     f"OpenBLAS threads {c.get('openblas_threads', '?')}.")
        for note in (blas.forced_note(env), blas.allocator_note(alloc)):
            if note:
                lines.append(f"- **libtorch: {note}**: not libtorch at its best.")
    lines.append(f"- c2f: bench_attention, {attn['context'].get('c2f_threads')} threads, Eigen SIMD "
                 f"{attn['context'].get('c2f_isa')}, in the job's own environment (its malloc is glibc's; never the "
                 f"peers' preloaded allocator).")
    loads = (attn["context"].get("load_avg", []), peers.get("load_avg_start", []), peers.get("load_avg_end", []))
    load = [", ".join(f"{v:.2f}" for v in x) for x in loads]
    lines.append(f"- Noise: load average {load[0] or '?'} when bench_attention started, {load[1] or '?'} when the "
                 f"PyTorch peer started and {load[2] or '?'} when it ended (2 cores: above about 2, other processes "
                 f"shared them). \"Cores\" = CPU seconds of the process per wall-clock second while timed: "
                 f"{attn['context'].get('c2f_threads')} if the threads ran in parallel undisturbed; near 1 when "
                 f"another process held a core or the module ran serially. The JSON keeps every run.")
    lines.append(f"- Agreement before timing: |c2f − torch| ≤ {peers['tolerance']['atol']:g} + "
                 f"{peers['tolerance']['rtol']:g}·|torch| element-wise; the column gives max |diff|. "
                 f"\"nn.MHA\" = PyTorch's nn.MultiheadAttention at the same L (the full attention each layer "
                 f"replaces); best peer = the fastest PyTorch/libtorch module of the row.")
    lines.append("")
    rows, by_key = [], {}
    for r in peers["results"]:
        L = r["L"]
        b = e.get(tuple(r["entry"]))
        c2f_ms = ms(b) if b else None
        cand = []
        own = r.get("torch_ms")
        if own is not None:
            cand.append((own, "PyTorch " + ("nn.MHA" if r["layer"] == "mha" else "module")))
        if r["layer"] != "mha" and L in torch_mha and torch_mha[L].get("torch_ms") is not None:
            cand.append((torch_mha[L]["torch_ms"], "PyTorch nn.MHA"))
        lt_ms, lt_cores = None, "—"
        if r["layer"] == "mha" and ("libtorch_mha", L) in lt:
            lb = lt[("libtorch_mha", L)]
            lt_ms = ms(lb)
            lt_cores = f"{lb['cpu_time'] / lb['real_time']:.1f}" if "/process_time" in lb["name"] else "?"
            cand.append((lt_ms, "libtorch MHA"))
        best = min(cand) if cand else None
        speedup = best[0] / c2f_ms if best and c2f_ms else None
        by_key[(r["layer"], L)] = dict(r, c2f_ms=c2f_ms, libtorch_ms=lt_ms, best=best, speedup=speedup)
        nn_mha = torch_mha.get(L, {}).get("torch_ms") if r["layer"] != "mha" else None
        cores = [f"{b['cpu_time'] / b['real_time']:.1f}" if b and "/process_time" in b["name"] else "?",
                 f"{r['cpu_per_wall']:.1f}" if "cpu_per_wall" in r else "—", lt_cores]
        rows.append([r["label"], L,
                     f"{own:.1f}" if own is not None else
                     ("skipped (" + ("memory" if "memory" in r.get("skipped", "") else "time") + ")"),
                     f"{nn_mha:.1f}" if nn_mha is not None else "—",
                     f"{lt_ms:.1f}" if lt_ms is not None else "—",
                     f"{c2f_ms:.2f}" if c2f_ms is not None else "— (no entry)",
                     f"{best[1]}, {best[0]:.1f}" if best else "—",
                     f"**{speedup:.1f}×**" if speedup else "—",
                     f"{r['max_abs_diff']:.1g}" if "max_abs_diff" in r else "—", " / ".join(cores)])
    lines.append(table(["layer (PyTorch module)", "L", "PyTorch ms", "PyTorch nn.MHA ms", "libtorch ms", "c2f ms",
                        "best peer, ms", "c2f vs best peer", "max |diff|", "cores c2f / PyTorch / libtorch"], rows))
    return "\n".join(lines), by_key


def peer_document(setup, tolerance, args, budget, results, start, load_start, **more):
    """The JSON document a peer writes (torch_peer.json, ort_peer.json): setup, tolerance (atol, rtol),
    the run's settings, its results, its duration and the load average before and after; `more` adds
    fields."""
    return {"setup": setup, "tolerance": {"atol": tolerance[0], "rtol": tolerance[1]}, "embed_dim": EMBED, "num_heads": HEADS,
            "reps": args.reps, "budget_s": budget, "check_only": args.check_only, **more, "results": results,
            "seconds": time.time() - start, "load_avg_start": load_start, "load_avg_end": os.getloadavg()}


def peer_arguments(doc, lengths, what, check_what):
    """The command line both peers take (torch_peer.py, ort_peer.py): `what` names the timed thing
    ("module", "graph"), `check_what` what --check-only and --perturb compare. Returns the parser."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=str(REPO / "build" / "release-native"), help="build folder with benchmarks/")
    p.add_argument("--c2f-binary", help="bench_attention to run (default: BUILD/benchmarks/bench_attention)")
    p.add_argument("--out", default=str(REPO / "results" / "latest"), help="output folder (the sweep's)")
    p.add_argument("--lengths", default=",".join(map(str, lengths)), help="comma-separated sequence lengths")
    p.add_argument("--reps", type=int, default=5, help=f"timed runs per ({what}, L) after the warm-up (median)")
    p.add_argument("--budget", type=float, default=20.0,
                   help=f"seconds allowed for one ({what}, L): the check and the runs (predicted from the last L)")
    p.add_argument("--max-gib", type=float, default=8.0, help=f"predicted memory allowed for one {what} call")
    p.add_argument("--check-only", action="store_true",
                   help=f"only check {check_what} at L in {CHECK_LENGTHS}, every {what}, no timing")
    p.add_argument("--perturb", action="store_true",
                   help="test of the check itself: one weight off by 1e-3 (the check must fail, exit 1)")
    return p


def peer_main(parser, argv, run_peer):
    """Parses a peer's command line (peer_arguments' parser), checks it and runs the peer."""
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    return run_peer(args)


def main(argv=None):
    p = peer_arguments(__doc__, LENGTHS, "module", "c2f against PyTorch")
    p.add_argument("--layers", default="",
                   help="comma-separated modules to run (default: all): mha, c2f8 … c2f256, hmha, sparse, mha_bf16, "
                        "c2f32_bf16")
    return peer_main(p, argv, run)


if __name__ == "__main__":
    sys.exit(main())
