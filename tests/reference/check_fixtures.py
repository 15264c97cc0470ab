#!/usr/bin/python3
"""Checks the committed fixtures in tests/data/ against a fresh run of generate.py.

    /usr/bin/python3 tests/reference/check_fixtures.py [--data DIR] [--family mha] [--determinism]

Exit status: 0 all fixtures match, 1 mismatch (a report is printed), 77 skipped (torch or numpy cannot
be imported, e.g. when run with a Python that lacks them; CTest understands 77 via SKIP_RETURN_CODE).

Policy:
* Every file, tensor name, dtype, shape and metadata entry must match. The metadata entries
  ``torch_version`` and ``torch_path`` only produce notes, since they describe the torch that ran.
* Tensors that are generator inputs (parameters ``mha.*``, ``query``/``key``/``value``, masks) come from
  numpy's RandomState and must be bit-identical.
* Tensors computed by torch (each family declares them; for mha: ``output``, ``weights``; for c2f:
  ``output``, ``coarse_input``, ``coarse_output``; for conv1d: ``output``; for hmha: ``output_l1``,
  ``output_l2``, ``output_l3``, ``output_all``, ``q``, ``k``, ``v``; for sparse: ``output``,
  ``mha_output``; for c2f2d: ``output``, ``coarse_input``, ``coarse_output``; for train: ``output``,
  ``total_norm`` and every tensor under ``grad.``, ``expected.``, ``clipped.``) may differ in the last
  bits across CPUs/BLAS builds, and must satisfy
  |new - committed| <= atol + rtol * |committed| with atol = rtol = 1e-6 for F32 and 1e-12 for F64;
  NaN and +-inf positions must be identical. F32 gradients (``grad.*``, and ``expected.*``,
  ``clipped.*``, ``total_norm``, which are computed from them) also get 1e-6 * max|committed tensor|: a
  gradient element is a sum over tokens and batch whose terms are of the tensor's scale and may cancel
  to near zero, so the rounding of a different summation order (another CPU's BLAS and ATen kernels)
  follows the tensor's scale, not the element's. Measured: regenerated on an Intel Xeon with AVX-512 and
  AMX, the fixtures committed from an AMD EPYC with AVX2 differ by up to 2.5e-7 * max|tensor| beyond
  atol + rtol * |committed| (train/, train_c2f/, train_hmha/; forward outputs stay within 1e-6).
* The bf16 family's ``output_autocast`` is torch's output under torch.autocast("cpu", bfloat16): each
  product's operands and result are rounded to bfloat16 (8 significant bits), and where a sum lands
  next to a rounding boundary another CPU's bf16 kernels (AMX, AVX512_BF16 or fp32 emulation, each
  summing in its own order) may round it to the neighbouring value, 2^-8 of it, and the next products
  carry that on. Its bound is atol + rtol * |committed| + 1e-2 * max|committed tensor|; the fp32
  ``output`` of the same file keeps the F32 bound.
* Independently of torch, every mha fixture is also checked against a small float64 numpy
  implementation of multi-head attention (loose tolerance: 1e-4 for f32 files, 1e-10 for f64), so a
  fixture that encodes a torch quirk rather than the documented semantics is caught. Likewise every c2f
  fixture (``output``, ``coarse_input``, ``coarse_output``) against a float64 numpy implementation of
  the coarse-to-fine attention article's modules with padding, plus its contract (shapes, mask metadata, no query
  row without a kept real key).
* Every conv1d and hmha fixture is cross-checked (same tolerances) against float64 numpy code that is a
  second formulation next to the dense torch one (hmha_reference.py): convolutions as explicit loops
  over output positions, groups and taps; HMHA with every window, window mean and sparse set S(i)
  enumerated per batch item, head and position. Tensor names and shapes are checked against the metadata.
* Every sparse fixture (SparseC2FAttention) is cross-checked against float64 numpy loops over batch
  items, heads, query chunks and positions, selecting per chunk or per position as the fixture's
  ``gating`` says (a second formulation next to the dense masks of
  sparse_reference.py): ``selected`` must match exactly, ``output`` (and ``mha_output`` when top_k >= m,
  also against the mha family's numpy attention) within the same tolerances; the selection margin
  recomputed from the stored values must be >= 1e-3 (relative), and the metadata must agree with the
  tensors (names, dtypes, shapes, ``num_chunks``, ``covers_all``, ``key_padding_mask``, ``empty_rows``).
* Every c2f2d fixture (C2FAttention2D and its ViT pyramid) is cross-checked (same tolerances) against
  float64 numpy loops: block token lists enumerated from the grid coordinates, the relative position bias
  looked up from the block coordinates, one softmax per list, the pyramid's 2 x 2 merging per window;
  shapes, block counts and the bias table's presence and shape are checked against the metadata.
* ``--determinism`` additionally generates twice and requires byte-identical files.
"""

import argparse
import filecmp
import json
import sys
import tempfile
from pathlib import Path

SKIP = 77
HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent / "data"

TOLERANCE = {"F32": (1e-6, 1e-6), "F64": (1e-12, 1e-12)}  # dtype -> (atol, rtol) for computed tensors
GRADIENT_SCALE_TOLERANCE = {"F32": 1e-6}  # dtype -> c in "+ c * max|tensor|" for gradient tensors (see above)
GRADIENT_TENSORS = ("grad.", "expected.", "clipped.", "total_norm")  # name prefixes
BF16_TENSORS = ("output_autocast",)  # computed in bfloat16 (see the policy above)
BF16_SCALE_TOLERANCE = 1e-2  # c in "+ c * max|tensor|" for BF16_TENSORS
CROSSCHECK_TOLERANCE = {"F32": 1e-4, "F64": 1e-10}  # atol = rtol, numpy reference vs. fixture
VOLATILE_METADATA = {"torch_version", "torch_path"}
MAX_LINES_PER_TENSOR = 3


class Report:
    def __init__(self):
        self.errors, self.notes, self.checked = [], [], 0
        self.max_diff = {}  # dtype -> (diff, where)

    def error(self, msg):
        self.errors.append(msg)

    def note(self, msg):
        self.notes.append(msg)

    def diff(self, dtype, value, where):
        if value > self.max_diff.get(dtype, (-1.0, ""))[0]:
            self.max_diff[dtype] = (value, where)


def _strip_volatile(obj):
    if isinstance(obj, dict):
        return {k: _strip_volatile(v) for k, v in obj.items() if k not in VOLATILE_METADATA}
    if isinstance(obj, list):
        return [_strip_volatile(v) for v in obj]
    return obj


def _compare_metadata(old, new, report, where):
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        msg = f"{where}: metadata '{k}': committed {a!r}, regenerated {b!r}"
        (report.note if k in VOLATILE_METADATA else report.error)(msg)


def compare_values(np, old, new, dtype, atol, rtol, where, report, stat_key=None, scale_tol=0.0):
    """Tolerance comparison of two float arrays, |new - old| <= atol + rtol * |old| + scale_tol * max|old|
    (over the finite elements); NaN/inf positions must match. Returns True if ok."""
    a, b = old.astype(np.float64), new.astype(np.float64)
    ok = True
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        idx = np.argwhere(nan_a != nan_b)[:MAX_LINES_PER_TENSOR]
        report.error(f"{where}: NaN positions differ ({int((nan_a != nan_b).sum())} elements), "
                     f"e.g. at {[tuple(int(i) for i in ix) for ix in idx]}")
        ok = False
    inf_a, inf_b = np.isinf(a), np.isinf(b)
    if not np.array_equal(inf_a, inf_b) or not np.array_equal(a[inf_a], b[inf_a]):
        report.error(f"{where}: +-inf positions or signs differ")
        ok = False
    fin = np.isfinite(a) & np.isfinite(b)
    err = np.where(fin, np.abs(a - b), 0.0)
    bound = atol + rtol * np.abs(np.where(fin, a, 0.0))
    if scale_tol and fin.any():
        bound = bound + scale_tol * float(np.abs(a[fin]).max())
    if err.size:
        report.diff(stat_key or dtype, float(err.max()), where)
    bad = err > bound
    if bad.any():
        order = np.argsort(-(err - bound), axis=None)[:MAX_LINES_PER_TENSOR]
        lines = []
        for flat in order:
            ix = np.unravel_index(int(flat), a.shape)
            if not bad[ix]:
                break
            lines.append(f"at {tuple(int(i) for i in ix)}: committed {a[ix]!r} regenerated {b[ix]!r} "
                         f"|diff| {err[ix]:.3g} > {bound[ix]:.3g}")
        scale = f" + {scale_tol:g} * max|tensor|" if scale_tol else ""
        report.error(f"{where}: {int(bad.sum())} of {a.size} elements outside atol {atol:g} + rtol {rtol:g}{scale} "
                     f"({dtype}):\n      " + "\n      ".join(lines))
        ok = False
    return ok


def is_computed(name, computed):
    """Whether tensor `name` is computed by torch: listed in `computed`, or under a listed prefix "p.*"."""
    return name in computed or any(c.endswith(".*") and name.startswith(c[:-1]) for c in computed)


def compare_file(np, st, old_path, new_path, computed, report, rel):
    try:
        old_t, old_m = st.load_file(old_path)
    except st.SafetensorsError as e:
        report.error(f"{rel}: committed file is not a valid canonical safetensors file: {e}")
        return
    new_t, new_m = st.load_file(new_path)
    _compare_metadata(old_m, new_m, report, rel)
    for name in sorted(set(old_t) - set(new_t)):
        report.error(f"{rel}: tensor '{name}' is committed but no longer generated")
    for name in sorted(set(new_t) - set(old_t)):
        report.error(f"{rel}: tensor '{name}' is generated but missing from the committed file")
    for name in sorted(set(old_t) & set(new_t)):
        a, b = old_t[name], new_t[name]
        where = f"{rel}:{name}"
        report.checked += 1
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            report.error(f"{where}: committed {a.dtype}{list(a.shape)}, regenerated {b.dtype}{list(b.shape)}")
            continue
        if is_computed(name, computed) and a.dtype in TOLERANCE:
            atol, rtol = TOLERANCE[a.dtype]
            scale_tol = GRADIENT_SCALE_TOLERANCE.get(a.dtype, 0.0) if name.startswith(GRADIENT_TENSORS) else 0.0
            if name in BF16_TENSORS:
                scale_tol = BF16_SCALE_TOLERANCE
            compare_values(np, st.to_numpy(a), st.to_numpy(b), a.dtype, atol, rtol, where, report,
                           scale_tol=scale_tol)
        elif a.data != b.data:
            nbad = "?"
            if a.dtype in ("F32", "F64", "BOOL", "I64"):
                x, y = st.to_numpy(a), st.to_numpy(b)
                nbad = int((x.view(x.dtype) != y).sum()) if a.dtype == "BOOL" else int(
                    (x.view(f"u{x.itemsize}") != y.view(f"u{y.itemsize}")).sum())
            report.error(f"{where}: input tensor is not bit-identical ({nbad} elements differ); the "
                         "generator's random streams or case definitions changed — regenerate and review")


def compare_family(np, st, family, committed_dir, fresh_dir, report):
    def listing(d):
        if not d.is_dir():
            return set()
        return {p.name for p in d.iterdir() if p.suffix == ".safetensors" or p.name == "manifest.json"}

    old, new = listing(committed_dir), listing(fresh_dir)
    if not old:
        report.error(f"{committed_dir}: no committed fixtures (run generate.py and commit tests/data/{family.name})")
        return
    for n in sorted(old - new):
        report.error(f"{family.name}/{n}: committed but not generated any more (stale file)")
    for n in sorted(new - old):
        report.error(f"{family.name}/{n}: generated but not committed")
    for n in sorted(old & new):
        rel = f"{family.name}/{n}"
        if n == "manifest.json":
            a = json.loads((committed_dir / n).read_text())
            b = json.loads((fresh_dir / n).read_text())
            if a.get("torch_version") != b.get("torch_version"):
                report.note(f"{rel}: torch_version committed {a.get('torch_version')!r}, "
                            f"here {b.get('torch_version')!r}")
            if _strip_volatile(a) != _strip_volatile(b):
                report.error(f"{rel}: manifest differs from the regenerated one (beyond torch_version/torch_path)")
            continue
        compare_file(np, st, committed_dir / n, fresh_dir / n, family.computed, report, rel)


# --- independent numpy reference for the mha family ------------------------------------------------

def mha_reference(np, t, md):
    """float64 multi-head attention from a fixture's tensors, following torch's documented semantics."""
    f = lambda name: t[name].astype(np.float64)  # noqa: E731
    E, H = int(md["embed_dim"]), int(md["num_heads"])
    B, Lq, Lk = int(md["batch"]), int(md["lq"]), int(md["lk"])
    d = E // H
    if "mha.in_proj_weight" in t:
        Wq, Wk, Wv = np.split(f("mha.in_proj_weight"), 3, axis=0)
    else:
        Wq, Wk, Wv = f("mha.q_proj_weight"), f("mha.k_proj_weight"), f("mha.v_proj_weight")
    bq = bk = bv = bo = 0.0
    if "mha.in_proj_bias" in t:
        bq, bk, bv = np.split(f("mha.in_proj_bias"), 3)
    if "mha.out_proj.bias" in t:
        bo = f("mha.out_proj.bias")
    heads = lambda x, L: x.reshape(B, L, H, d).transpose(0, 2, 1, 3)  # noqa: E731
    q = heads(f("query") @ Wq.T + bq, Lq)
    k = heads(f("key") @ Wk.T + bk, Lk)
    v = heads(f("value") @ Wv.T + bv, Lk)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)  # [B, H, Lq, Lk]
    if "attn_mask" in t:
        m = t["attn_mask"]
        add = np.where(m, -np.inf, 0.0) if m.dtype == bool else m.astype(np.float64)
        s = s + (add.reshape(B, H, Lq, Lk) if add.ndim == 3 else add)
    if "key_padding_mask" in t:
        m = t["key_padding_mask"]
        add = np.where(m, -np.inf, 0.0) if m.dtype == bool else m.astype(np.float64)
        s = s + add[:, None, None, :]
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))  # a fully masked row gives NaN, as in torch
        p = e / e.sum(axis=-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(B, Lq, E) @ f("mha.out_proj.weight").T + bo
    w = {"none": None, "average": p.mean(axis=1), "per_head": p}[md["need_weights"]]
    return o, w


def family_files(st, committed_dir, family):
    """(relative name, raw tensors, metadata) of every committed file of a family that loads (files that
    do not load were already reported by the comparison)."""
    for path in sorted(committed_dir.glob("*.safetensors")):
        try:
            raw, md = st.load_file(path)
        except st.SafetensorsError:
            continue
        yield f"{family}/{path.name}", raw, md


def crosscheck_mha(np, st, committed_dir, report):
    for rel, raw, md in family_files(st, committed_dir, "mha"):
        t = {k: st.to_numpy(v) for k, v in raw.items()}
        dtype = raw["output"].dtype
        tol = CROSSCHECK_TOLERANCE[dtype]
        o, w = mha_reference(np, t, md)
        compare_values(np, o, t["output"], dtype, tol, tol, f"{rel}:output vs numpy reference", report,
                       stat_key=f"numpy-reference {dtype}")
        if (w is None) != ("weights" not in t):
            report.error(f"{rel}: need_weights={md['need_weights']} but 'weights' "
                         f"{'present' if 'weights' in t else 'absent'}")
        elif w is not None:
            compare_values(np, w, t["weights"], dtype, tol, tol, f"{rel}:weights vs numpy reference", report,
                           stat_key=f"numpy-reference {dtype}")
        if (md["fully_masked_rows"] == "true") != bool(np.isnan(t["output"]).any()):
            report.error(f"{rel}: fully_masked_rows={md['fully_masked_rows']} disagrees with NaNs in output")


# --- independent numpy reference for the c2f family ------------------------------------------------

def _attend(np, q, k, v, keep):
    """One head: q [Lq, dh], k/v [Lk, dh], keep [Lq, Lk] bool (True = attend). A row without any kept key
    gives NaN here (the fixtures must not have one: c2f's C++ layer and the article's -1e9 fill disagree)."""
    s = (q @ k.T) / np.sqrt(q.shape[-1])
    s = np.where(keep, s, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)) @ v


def c2f_reference(np, t, md):
    """float64 CoarseAttention / FineAttention / C2FAttention (the coarse-to-fine attention article's, with
    its fixes) from a fixture's tensors; written per batch item, chunk and head, without torch's reshapes.
    Returns name -> array."""
    module = md["module"]
    d, H, B = int(md["d_model"]), int(md["n_heads"]), int(md["batch"])
    dh = d // H
    f = lambda name: t[name].astype(np.float64)  # noqa: E731

    def lin(x, p):
        return x @ f(p + ".weight").T + f(p + ".bias")

    def coarse(x, keep, p):  # x [B, m, d], keep [B, m, m] or None
        m = x.shape[1]
        qkv = lin(x, p + "qkv_proj")
        q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
        o = np.zeros((B, m, d))
        for bi in range(B):
            kp = np.ones((m, m), dtype=bool) if keep is None else keep[bi]
            for h in range(H):
                s = slice(h * dh, (h + 1) * dh)
                o[bi, :, s] = _attend(np, q[bi, :, s], k[bi, :, s], v[bi, :, s], kp)
        return lin(o, p + "out_proj")

    def fine(xg, ctx, keep, p):  # xg [B, m, k, d], ctx [B, m, d], keep [B, m, k, k]
        _, m, k, _ = xg.shape
        q = lin(ctx, p + "q_proj")  # one query per chunk, shared by its k tokens
        kv = lin(xg, p + "kv_proj")
        kk, vv = kv[..., :d], kv[..., d:]
        o = np.zeros((B, m, k, d))
        for bi in range(B):
            for j in range(m):
                for h in range(H):
                    s = slice(h * dh, (h + 1) * dh)
                    qq = np.repeat(q[bi, j, s][None, :], k, axis=0)
                    o[bi, j, :, s] = _attend(np, qq, kk[bi, j, :, s], vv[bi, j, :, s], keep[bi, j])
        return lin(o, p + "out_proj")

    if module == "coarse":
        return {"output": coarse(f("x"), t.get("mask"), "coarse.")}
    if module == "fine":
        x = f("x")
        _, m, k, _ = x.shape
        keep = t["mask"] if "mask" in t else np.ones((B, m, k, k), dtype=bool)
        return {"output": fine(x, f("coarse_context"), keep, "fine.")}
    if module != "c2f":
        raise ValueError(f"unknown module {module!r}")
    x = f("x")
    L, c = int(md["seq_len"]), int(md["chunk_size"])
    m = -(-L // c)
    chunks = [x[:, j * c:min((j + 1) * c, L)] for j in range(m)]  # the last one may be partial
    coarse_in = np.stack([ch.mean(axis=1) for ch in chunks], axis=1)  # mean over the real tokens
    ctx = coarse(coarse_in, t.get("coarse_mask"), "c2f.coarse_attn.")
    xg = np.zeros((B, m * c, d))
    xg[:, :L] = x
    real = (np.arange(m * c) < L).reshape(m, c)  # padded keys are never attended to
    keep = np.broadcast_to(real[None, :, None, :], (B, m, c, c))
    if "fine_mask" in t:
        keep = keep & t["fine_mask"]
    out = fine(xg.reshape(B, m, c, d), ctx, keep, "c2f.fine_attn.").reshape(B, m * c, d)[:, :L]
    return {"output": out, "coarse_input": coarse_in, "coarse_output": ctx}


def _c2f_check_contract(np, t, md, rel, report):
    """Shapes/metadata agree with the tensors; no query row of a mask keeps nothing (real keys only)."""
    module, B, d = md["module"], int(md["batch"]), int(md["d_model"])
    m = int(md["num_chunks"])
    if module == "c2f":
        L, c = int(md["seq_len"]), int(md["chunk_size"])
        k = c
        if m != -(-L // c):
            report.error(f"{rel}: num_chunks {m} != ceil({L} / {c})")
        shapes = {"x": (B, L, d), "output": (B, L, d), "coarse_input": (B, m, d), "coarse_output": (B, m, d),
                  "coarse_mask": (B, m, m), "fine_mask": (B, m, c, c)}
        cmask, fmask = t.get("coarse_mask"), t.get("fine_mask")
        real = (np.arange(m * c) < L).reshape(m, c)
        mask_md = {"coarse_mask": cmask, "fine_mask": fmask}
    elif module == "coarse":
        shapes = {"x": (B, m, d), "output": (B, m, d), "mask": (B, m, m)}
        cmask, fmask, real, k = t.get("mask"), None, None, None
        mask_md = {"mask": cmask}
    else:
        k = int(md["chunk_len"])
        shapes = {"x": (B, m, k, d), "coarse_context": (B, m, d), "output": (B, m, k, d), "mask": (B, m, k, k)}
        cmask, fmask, real = None, t.get("mask"), np.ones((m, k), dtype=bool)
        mask_md = {"mask": fmask}
    for name, shape in shapes.items():
        if name in t and t[name].shape != shape:
            report.error(f"{rel}: {name} has shape {list(t[name].shape)}, expected {list(shape)}")
    for name, v in mask_md.items():
        if md.get(name) != ("none" if v is None else "bool") or (v is not None and v.dtype != bool):
            report.error(f"{rel}: metadata {name}={md.get(name)!r} disagrees with the stored tensor")
    if cmask is not None and cmask.shape == (B, m, m) and not cmask.any(axis=-1).all():
        report.error(f"{rel}: a coarse mask row keeps no chunk")
    if module != "coarse":
        keep = np.broadcast_to(real[None, :, None, :], (B, m, k, k))
        if fmask is not None and fmask.shape == (B, m, k, k):
            keep = keep & fmask
        if not keep.any(axis=-1).all():
            report.error(f"{rel}: a fine query row keeps no real key")
        rows_equal = fmask is None or bool((fmask == fmask[:, :, :1, :]).all())
        if md.get("fine_mask_rows_equal") != ("true" if rows_equal else "false"):
            report.error(f"{rel}: fine_mask_rows_equal={md.get('fine_mask_rows_equal')!r}, rows equal: {rows_equal}")


def crosscheck_c2f(np, st, committed_dir, report):
    for rel, raw, md in family_files(st, committed_dir, "c2f"):
        t = {k: st.to_numpy(v) for k, v in raw.items()}
        dtype = raw["output"].dtype
        tol = CROSSCHECK_TOLERANCE[dtype]
        _c2f_check_contract(np, t, md, rel, report)
        for name, ref in c2f_reference(np, t, md).items():
            if name not in t:
                report.error(f"{rel}: '{name}' missing")
            elif t[name].shape != ref.shape:
                report.error(f"{rel}: '{name}' has shape {list(t[name].shape)}, numpy reference {list(ref.shape)}")
            else:
                compare_values(np, ref, t[name], dtype, tol, tol, f"{rel}:{name} vs numpy reference", report,
                               stat_key=f"numpy-reference {dtype}")


# --- independent numpy reference for the conv1d and hmha families -----------------------------------

def conv1d_loops(np, x, w, bias, padding, groups, right_padding=None):
    """float64 torch.nn.Conv1d semantics in [B, L, C] layout, by explicit loops over output positions,
    groups and kernel taps: out[b, l, o] = bias[o] + sum_{c, j} w[o, c, j] * x[b, l + j - padding, g*cin + c]
    (taps outside [0, L) read zero). ``padding`` zeros go on the left, ``right_padding`` (default: the
    same) on the right; causal = (k - 1, 0)."""
    B, L, _ = x.shape
    c_out, cin_g, k = w.shape
    cout_g = c_out // groups
    L_out = L + padding + (padding if right_padding is None else right_padding) - k + 1
    out = np.zeros((B, L_out, c_out))
    for l in range(L_out):
        for g in range(groups):
            o_sl = slice(g * cout_g, (g + 1) * cout_g)
            for j in range(k):
                src = l + j - padding
                if 0 <= src < L:
                    out[:, l, o_sl] += x[:, src, g * cin_g:(g + 1) * cin_g] @ w[o_sl, :, j].T
    if bias is not None:
        out += bias
    return out


def c3k2_loops(np, x, f, prefix, causal=False):
    """C3K2Projection: [conv3 (k=3, padding 1; causal: 2 zeros on the left, none on the right) |
    conv2 (k=1)] along channels."""
    pads = (2, 0) if causal else (1, 1)
    y3 = conv1d_loops(np, x, f(prefix + "conv3.weight"), f(prefix + "conv3.bias"), pads[0], 1, pads[1])
    y2 = conv1d_loops(np, x, f(prefix + "conv2.weight"), f(prefix + "conv2.bias"), 0, 1)
    return np.concatenate([y3, y2], axis=-1)


def _softmax_rows(np, q, keys, vals, dh):
    """q [dh], keys/vals [n, dh]; n = 0 gives a zero vector."""
    if len(keys) == 0:
        return np.zeros(dh)
    s = keys @ q / np.sqrt(dh)
    e = np.exp(s - s.max())
    return (e / e.sum()) @ vals


def sparse_set(i, L, causal):
    """S(i) = {i} U {i - 2^p} (U {i + 2^p} unless causal), p = 0, 1, ... inside [0, L); sorted."""
    s, step = {i}, 1
    while step < L:
        if i - step >= 0:
            s.add(i - step)
        if not causal and i + step < L:
            s.add(i + step)
        step *= 2
    return sorted(s)


def hmha_levels_loops(np, q, k, v, H, W, causal):
    """Per-level head outputs [B, L, dim] of HMHA from the projections, windows and S(i) enumerated."""
    B, L, d = q.shape
    dh = d // H
    m = -(-L // W)
    windows = [list(range(j * W, min((j + 1) * W, L))) for j in range(m)]
    o = {lvl: np.zeros((B, L, d)) for lvl in (1, 2, 3)}
    for bi in range(B):
        for h in range(H):
            cs = slice(h * dh, (h + 1) * dh)
            qh, kh, vh = q[bi, :, cs], k[bi, :, cs], v[bi, :, cs]
            # level 2: window means, then attention among windows
            qb = np.array([qh[win].mean(axis=0) for win in windows])
            kb = np.array([kh[win].mean(axis=0) for win in windows])
            vb = np.array([vh[win].mean(axis=0) for win in windows])
            ctx = [_softmax_rows(np, qb[j], kb, vb, dh) for j in range(m)]
            for j, win in enumerate(windows):
                for i in win:
                    keys = [t for t in win if not causal or t <= i]
                    o[1][bi, i, cs] = _softmax_rows(np, qh[i], kh[keys], vh[keys], dh)
                    # causal: token i's own query over the summaries of the windows before its own
                    o[2][bi, i, cs] = _softmax_rows(np, qh[i], kb[:j], vb[:j], dh) if causal else ctx[j]
                    sset = sparse_set(i, L, causal)
                    o[3][bi, i, cs] = _softmax_rows(np, qh[i], kh[sset], vh[sset], dh)
    return o


HMHA_OUTPUT_LEVELS = {"output_l1": (1,), "output_l2": (2,), "output_l3": (3,), "output_all": (1, 2, 3)}


def conv1d_family_reference(np, t, md):
    f = lambda name: t[name].astype(np.float64)  # noqa: E731
    if md["module"] == "conv1d":
        bias = f("conv.bias") if md["bias"] == "true" else None
        return {"output": conv1d_loops(np, f("x"), f("conv.weight"), bias, int(md["padding"]),
                                       int(md["groups"]))}
    if md["module"] == "c3k2":
        return {"output": c3k2_loops(np, f("x"), f, "c3k2.", md["causal"] == "true")}
    raise ValueError(f"unknown module {md['module']!r}")


def hmha_reference(np, t, md):
    f = lambda name: t[name].astype(np.float64)  # noqa: E731
    x = f("x")
    causal = md["causal"] == "true"
    q, k, v = (c3k2_loops(np, x, f, f"hmha.{p}_proj.", causal) for p in "qkv")
    o = hmha_levels_loops(np, q, k, v, int(md["heads"]), int(md["window"]), causal)
    res = {"q": q, "k": k, "v": v}
    for name, levels in HMHA_OUTPUT_LEVELS.items():
        res[name] = sum(o[lvl] for lvl in levels) @ f("hmha.out_proj.weight").T + f("hmha.out_proj.bias")
    return res


def _conv_family_contract(np, t, md, rel, report):
    """Tensor names and shapes agree with the metadata."""
    B, L = int(md["batch"]), int(md["seq_len"])
    module = md["module"]
    if module == "conv1d":
        ci, co, kk = int(md["in_channels"]), int(md["out_channels"]), int(md["kernel_size"])
        p, g = int(md["padding"]), int(md["groups"])
        lo = L + 2 * p - kk + 1
        shapes = {"conv.weight": (co, ci // g, kk), "x": (B, L, ci), "output": (B, lo, co)}
        if md["bias"] == "true":
            shapes["conv.bias"] = (co,)
        if md.get("out_len") != str(lo):
            report.error(f"{rel}: out_len {md.get('out_len')!r}, expected {lo}")
    elif module == "c3k2":
        d = int(md["dim"])
        shapes = {"c3k2.conv3.weight": (d // 2, d, 3), "c3k2.conv3.bias": (d // 2,),
                  "c3k2.conv2.weight": (d - d // 2, d, 1), "c3k2.conv2.bias": (d - d // 2,),
                  "x": (B, L, d), "output": (B, L, d)}
    elif module == "hmha":
        d, H, W = int(md["dim"]), int(md["heads"]), int(md["window"])
        if md.get("num_windows") != str(-(-L // W)):
            report.error(f"{rel}: num_windows {md.get('num_windows')!r} != ceil({L} / {W})")
        if d % H:
            report.error(f"{rel}: dim {d} not divisible by heads {H}")
        shapes = {"x": (B, L, d), "hmha.out_proj.weight": (d, d), "hmha.out_proj.bias": (d,)}
        for p in "qkv":
            shapes.update({f"hmha.{p}_proj.conv3.weight": (d // 2, d, 3),
                           f"hmha.{p}_proj.conv3.bias": (d // 2,),
                           f"hmha.{p}_proj.conv2.weight": (d - d // 2, d, 1),
                           f"hmha.{p}_proj.conv2.bias": (d - d // 2,),
                           p: (B, L, d)})
        shapes.update({name: (B, L, d) for name in HMHA_OUTPUT_LEVELS})
    else:
        report.error(f"{rel}: unknown module {module!r}")
        return False
    ok = True
    for name in sorted(set(shapes) | set(t)):
        if name not in shapes:
            report.error(f"{rel}: unexpected tensor '{name}'")
            ok = False
        elif name not in t:
            report.error(f"{rel}: tensor '{name}' missing")
            ok = False
        elif t[name].shape != shapes[name]:
            report.error(f"{rel}: {name} has shape {list(t[name].shape)}, expected {list(shapes[name])}")
            ok = False
    return ok


def _crosscheck_with(reference, family):
    def crosscheck(np, st, committed_dir, report):
        for rel, raw, md in family_files(st, committed_dir, family):
            t = {k: st.to_numpy(v) for k, v in raw.items()}
            dtype = raw["x"].dtype
            tol = CROSSCHECK_TOLERANCE[dtype]
            if not _conv_family_contract(np, t, md, rel, report):
                continue
            for name, ref in reference(np, t, md).items():
                compare_values(np, ref, t[name], dtype, tol, tol, f"{rel}:{name} vs numpy reference", report,
                               stat_key=f"numpy-reference {dtype}")
    return crosscheck


crosscheck_conv1d = _crosscheck_with(conv1d_family_reference, "conv1d")
crosscheck_hmha = _crosscheck_with(hmha_reference, "hmha")


# --- independent numpy reference for the sparse family ---------------------------------------------

SPARSE_MARGIN_REL = 1e-3  # the fixtures' selection margin rule (restated here, not imported)


def sparse_loops(np, t, md):
    """float64 SparseC2FAttention from a fixture's tensors, by explicit loops over batch items, heads, query
    chunks and positions (no masks, no rank tensor): per query chunk (gating "chunk") or per query position
    (gating "token") the candidates are sorted by (-score, index), the key list of every query position is
    enumerated chunk by chunk, and each list gets its own softmax. The chunk means are over the unpadded
    positions; a chunk without one scores -inf (and so does every candidate of its own query row). Returns selected [B, H, R, top_k] (R = m
    or L), output [B, L, E], the smallest relative selection margin with its location, and whether some
    query row had no allowed key."""
    f = lambda name: t[name].astype(np.float64)  # noqa: E731
    E, H, B, L = int(md["embed_dim"]), int(md["num_heads"]), int(md["batch"]), int(md["seq_len"])
    c, K, causal = int(md["chunk_size"]), int(md["top_k"]), md["causal"] == "true"
    per_token = md["gating"] == "token"
    dh = E // H
    W, bias, x = f("mha.in_proj_weight"), f("mha.in_proj_bias"), f("x")
    q, k, v = (x @ W[n * E:(n + 1) * E].T + bias[n * E:(n + 1) * E] for n in range(3))
    pad = t.get("key_padding_mask")
    m = -(-L // c)
    chunks = [list(range(j * c, min((j + 1) * c, L))) for j in range(m)]
    selected = np.full((B, H, L if per_token else m, K), -1, dtype=np.int64)
    o = np.zeros((B, L, E))
    margin, where, empty = np.inf, None, False
    for bi in range(B):
        for h in range(H):
            cs = slice(h * dh, (h + 1) * dh)
            qbar, kbar = [], []  # None: the chunk has no unpadded position
            for ch in chunks:
                real = [p for p in ch if pad is None or not pad[bi, p]]
                sq, sk = np.zeros(dh), np.zeros(dh)
                for p in real:
                    sq += q[bi, p, cs]
                    sk += k[bi, p, cs]
                qbar.append(sq / len(real) if real else None)
                kbar.append(sk / len(real) if real else None)

            def choose(row, query, own):
                """own + the K - 1 best candidates for one selection row; records the margin."""
                nonlocal margin, where
                score = {j: (-np.inf if query is None or kbar[j] is None else float(query @ kbar[j]))
                         for j in range(m) if j != own and (not causal or j < own)}
                ranked = sorted(score, key=lambda j: (-score[j], j))
                n_pick = K - 1
                if 0 < n_pick < len(ranked):
                    a, b = score[ranked[n_pick - 1]], score[ranked[n_pick]]
                    rel = np.inf if np.isinf(a) or np.isinf(b) else (a - b) / (1.0 + max(abs(a), abs(b)))
                    if rel < margin:
                        margin, where = rel, (bi, h, row)
                S = sorted([own] + ranked[:n_pick])
                selected[bi, h, row, :len(S)] = S
                return S

            for i, ch in enumerate(chunks):
                S_chunk = None if per_token else choose(i, qbar[i], i)
                for tq in ch:
                    S = choose(tq, q[bi, tq, cs], i) if per_token else S_chunk
                    keys = [u for j in S for u in chunks[j]
                            if (not causal or u <= tq) and (pad is None or not pad[bi, u])]
                    if not keys:
                        empty = True  # zero attention for this head
                        continue
                    s = np.array([q[bi, tq, cs] @ k[bi, u, cs] for u in keys]) / np.sqrt(dh)
                    e = np.exp(s - s.max())
                    o[bi, tq, cs] = (e / e.sum()) @ v[bi, keys, cs]
    out = o @ f("mha.out_proj.weight").T + f("mha.out_proj.bias")
    return selected, out, margin, where, empty


def _sparse_contract(np, raw, md, rel, report):
    """Tensor names, dtypes and shapes agree with the metadata; metadata is self-consistent."""
    E, H, B, L = int(md["embed_dim"]), int(md["num_heads"]), int(md["batch"]), int(md["seq_len"])
    c, K = int(md["chunk_size"]), int(md["top_k"])
    m = -(-L // c)
    fdt = raw["x"].dtype
    ok = True
    if md.get("module") != "sparse" or E % H or K < 1:
        report.error(f"{rel}: module {md.get('module')!r}, embed_dim {E}, num_heads {H}, top_k {K}")
        ok = False
    if md.get("num_chunks") != str(m):
        report.error(f"{rel}: num_chunks {md.get('num_chunks')!r} != ceil({L} / {c})")
    if md.get("covers_all") != ("true" if K >= m else "false"):
        report.error(f"{rel}: covers_all {md.get('covers_all')!r} but top_k {K}, m {m}")
    if md.get("gating") not in ("chunk", "token") or (md.get("gating") == "chunk" and md.get("causal") != "false"):
        report.error(f"{rel}: gating {md.get('gating')!r} with causal {md.get('causal')!r}")
        ok = False
    rows = L if md.get("gating") == "token" else m
    spec = {"mha.in_proj_weight": (fdt, (3 * E, E)), "mha.in_proj_bias": (fdt, (3 * E,)),
            "mha.out_proj.weight": (fdt, (E, E)), "mha.out_proj.bias": (fdt, (E,)),
            "x": (fdt, (B, L, E)), "output": (fdt, (B, L, E)), "selected": ("I64", (B, H, rows, K))}
    if md.get("key_padding_mask") == "bool":
        spec["key_padding_mask"] = ("BOOL", (B, L))
    elif md.get("key_padding_mask") != "none":
        report.error(f"{rel}: key_padding_mask metadata {md.get('key_padding_mask')!r}")
    if md.get("covers_all") == "true":
        spec["mha_output"] = (fdt, (B, L, E))
    for name in sorted(set(spec) | set(raw)):
        if name not in spec:
            report.error(f"{rel}: unexpected tensor '{name}'")
            ok = False
        elif name not in raw:
            report.error(f"{rel}: tensor '{name}' missing")
            ok = False
        elif (raw[name].dtype, tuple(raw[name].shape)) != spec[name]:
            report.error(f"{rel}: {name} is {raw[name].dtype}{list(raw[name].shape)}, expected "
                         f"{spec[name][0]}{list(spec[name][1])}")
            ok = False
    if fdt not in CROSSCHECK_TOLERANCE:
        report.error(f"{rel}: x has dtype {fdt}")
        ok = False
    return ok


def crosscheck_sparse(np, st, committed_dir, report):
    smallest = (np.inf, "")
    for rel, raw, md in family_files(st, committed_dir, "sparse"):
        try:
            if not _sparse_contract(np, raw, md, rel, report):
                continue
        except (KeyError, ValueError) as e:
            report.error(f"{rel}: bad metadata ({e!r})")
            continue
        t = {k: st.to_numpy(v) for k, v in raw.items()}
        dtype = raw["output"].dtype
        tol = CROSSCHECK_TOLERANCE[dtype]
        selected, out, margin, where, empty = sparse_loops(np, t, md)
        if not np.array_equal(selected, t["selected"]):
            bad = np.argwhere((selected != t["selected"]).any(axis=-1))[:MAX_LINES_PER_TENSOR]
            report.error(f"{rel}: 'selected' differs from the numpy selection at (b, h, row) "
                         f"{[tuple(int(i) for i in ix) for ix in bad]}")
        if margin < SPARSE_MARGIN_REL:
            report.error(f"{rel}: selection margin {margin:.3g} at (b, h, row) {where} is below "
                         f"{SPARSE_MARGIN_REL:g}: float rounding could flip the selection")
        if margin < smallest[0]:
            smallest = (margin, f"{rel} at (b, h, row) {where}")
        if md.get("empty_rows") != ("true" if empty else "false"):
            report.error(f"{rel}: empty_rows={md.get('empty_rows')!r}, numpy reference: {empty}")
        compare_values(np, out, t["output"], dtype, tol, tol, f"{rel}:output vs numpy reference", report,
                       stat_key=f"numpy-reference {dtype}")
        if "mha_output" in t:
            # top_k >= m: the loops above are plain attention; also the mha family's dense reference.
            compare_values(np, out, t["mha_output"], dtype, tol, tol, f"{rel}:mha_output vs numpy reference",
                           report, stat_key=f"numpy-reference {dtype}")
            L = int(md["seq_len"])
            mt = {"mha.in_proj_weight": t["mha.in_proj_weight"], "mha.in_proj_bias": t["mha.in_proj_bias"],
                  "mha.out_proj.weight": t["mha.out_proj.weight"], "mha.out_proj.bias": t["mha.out_proj.bias"],
                  "query": t["x"], "key": t["x"], "value": t["x"]}
            if md["causal"] == "true":
                mt["attn_mask"] = np.triu(np.ones((L, L), dtype=bool), k=1)
            mmd = {"embed_dim": md["embed_dim"], "num_heads": md["num_heads"], "batch": md["batch"],
                   "lq": str(L), "lk": str(L), "need_weights": "none"}
            dense, _ = mha_reference(np, mt, mmd)
            compare_values(np, dense, t["mha_output"], dtype, tol, tol,
                           f"{rel}:mha_output vs numpy multi-head attention", report,
                           stat_key=f"numpy-reference {dtype}")
    if smallest[1]:
        report.note(f"sparse: smallest relative selection margin {smallest[0]:.3g} ({smallest[1]}); "
                    f"required >= {SPARSE_MARGIN_REL:g}")


# --- independent numpy reference for the c2f2d family ----------------------------------------------

def _ceil_div(n, k):
    return -(-n // k)


def c2f2d_layer_loops(np, f, x, H, W, bh, bw, gh, gw, heads, pre, bias):
    """float64 C2FAttention2D by explicit loops: each block's token list is enumerated from the grid
    coordinates; the coarse bias is looked up from the block coordinates; every softmax is taken over a
    list. x [B, H*W, d]. Returns (output, coarse_input, coarse_output)."""
    B, _, d = x.shape
    dh = d // heads
    Mh, Mw = _ceil_div(H, bh), _ceil_div(W, bw)
    coords = [(r, c) for r in range(Mh) for c in range(Mw)]  # block n = r*Mw + c
    members = [[y * W + xx for y in range(r * bh, min((r + 1) * bh, H)) for xx in range(c * bw, min((c + 1) * bw, W))]
               for r, c in coords]

    def lin(v, p):
        return v @ f(pre + p + ".weight").T + f(pre + p + ".bias")

    def softmax(s):
        e = np.exp(s - s.max())
        return e / e.sum()

    cin = np.zeros((B, len(coords), d))
    for bi in range(B):
        for n, toks in enumerate(members):
            for t in toks:
                cin[bi, n] += x[bi, t]
            cin[bi, n] /= len(toks)
    qkv = lin(cin, "coarse_attn.qkv_proj")
    o = np.zeros((B, len(coords), d))
    table = f(pre + "coarse_attn.relative_position_bias_table") if bias else None
    for bi in range(B):
        for h in range(heads):
            s_ = slice(h * dh, (h + 1) * dh)
            for n, (r, c) in enumerate(coords):
                scores = np.zeros(len(coords))
                for n2, (r2, c2) in enumerate(coords):
                    scores[n2] = qkv[bi, n, s_] @ qkv[bi, n2, d:2 * d][s_] / np.sqrt(dh)
                    if bias:
                        scores[n2] += table[(r - r2 + gh - 1) * (2 * gw - 1) + (c - c2 + gw - 1), h]
                p = softmax(scores)
                for n2 in range(len(coords)):
                    o[bi, n, s_] += p[n2] * qkv[bi, n2, 2 * d:][s_]
    ctx = lin(o, "coarse_attn.out_proj")
    q = lin(ctx, "fine_attn.q_proj")
    out = np.zeros_like(x)
    for bi in range(B):
        for n, toks in enumerate(members):
            kv = lin(np.stack([x[bi, t] for t in toks]), "fine_attn.kv_proj")
            oh = np.zeros(d)
            for h in range(heads):
                s_ = slice(h * dh, (h + 1) * dh)
                p = softmax(np.array([q[bi, n, s_] @ kv[j, :d][s_] / np.sqrt(dh) for j in range(len(toks))]))
                for j in range(len(toks)):
                    oh[s_] += p[j] * kv[j, d:][s_]
            row = lin(oh, "fine_attn.out_proj")
            for t in toks:
                out[bi, t] = row
    return out, cin, ctx


def c2f2d_loops(np, t, md):
    """name -> float64 array for a c2f2d fixture: C2FAttention2D, or the pyramid stage by stage with the
    2 x 2 patch merging written as a loop over the windows."""
    f = lambda name: t[name].astype(np.float64)  # noqa: E731
    heads, bias = int(md["num_heads"]), md["relative_position_bias"] == "true"
    H, W = int(md["height"]), int(md["width"])
    x = f("x")
    if md["module"] == "c2f2d":
        out, cin, ctx = c2f2d_layer_loops(np, f, x, H, W, int(md["block_h"]), int(md["block_w"]),
                                          int(md["max_blocks_h"]), int(md["max_blocks_w"]), heads, "c2f2d.", bias)
        return {"output": out, "coarse_input": cin, "coarse_output": ctx}
    B, _, d = x.shape
    for i, stage in enumerate(md["stages"].split(",")):
        grid, block, gmax = stage.split(":")
        if i > 0:
            H2, W2 = _ceil_div(H, 2), _ceil_div(W, 2)
            merged = np.zeros((B, H2 * W2, d))
            for y2 in range(H2):
                for x2 in range(W2):
                    win = [y * W + xx for y in range(2 * y2, min(2 * y2 + 2, H)) for xx in range(2 * x2, min(2 * x2 + 2, W))]
                    merged[:, y2 * W2 + x2] = sum(x[:, k] for k in win) / len(win)
            x, H, W = merged, H2, W2
        if grid != f"{H}x{W}":
            raise ValueError(f"stage {i} metadata says grid {grid}, the loops reach {H}x{W}")
        (bh, bw), (gh, gw) = (int(v) for v in block.split("x")), (int(v) for v in gmax.split("x"))
        y, _, _ = c2f2d_layer_loops(np, f, x, H, W, bh, bw, gh, gw, heads, f"pyramid.stages.{i}.", bias)
        x = x + y
    return {"output": x}


def _c2f2d_contract(np, t, md, rel, report):
    """Tensor shapes and the table's presence against the metadata; the block grid fits the table."""
    B, d, heads = int(md["batch"]), int(md["embed_dim"]), int(md["num_heads"])
    H, W, bias = int(md["height"]), int(md["width"]), md["relative_position_bias"] == "true"
    shapes = {"x": (B, H * W, d)}
    if md["module"] == "c2f2d":
        layers = [("c2f2d.", int(md["max_blocks_h"]), int(md["max_blocks_w"]))]
        bh, bw = int(md["block_h"]), int(md["block_w"])
        mh, mw = _ceil_div(H, bh), _ceil_div(W, bw)
        if (str(mh), str(mw)) != (md["blocks_h"], md["blocks_w"]) or mh > layers[0][1] or mw > layers[0][2]:
            report.error(f"{rel}: blocks {md['blocks_h']} x {md['blocks_w']} (computed {mh} x {mw}) vs max "
                         f"{layers[0][1]} x {layers[0][2]}")
        shapes.update(output=(B, H * W, d), coarse_input=(B, mh * mw, d), coarse_output=(B, mh * mw, d))
    else:
        stages = md["stages"].split(",")
        layers = [(f"pyramid.stages.{i}.", *(int(v) for v in s.split(":")[2].split("x"))) for i, s in enumerate(stages)]
        shapes["output"] = (B, int(md["out_height"]) * int(md["out_width"]), d)
    for pre, gh, gw in layers:
        key = pre + "coarse_attn.relative_position_bias_table"
        if bias != (key in t):
            report.error(f"{rel}: relative_position_bias={md['relative_position_bias']} but '{key}' "
                         f"{'present' if key in t else 'absent'}")
        elif bias:
            shapes[key] = ((2 * gh - 1) * (2 * gw - 1), heads)
    for name, shape in shapes.items():
        if name not in t:
            report.error(f"{rel}: tensor '{name}' missing")
        elif t[name].shape != shape:
            report.error(f"{rel}: {name} has shape {list(t[name].shape)}, expected {list(shape)}")
            return False
    return True


def crosscheck_c2f2d(np, st, committed_dir, report):
    for rel, raw, md in family_files(st, committed_dir, "c2f2d"):
        t = {k: st.to_numpy(v) for k, v in raw.items()}
        dtype = raw["x"].dtype
        tol = CROSSCHECK_TOLERANCE[dtype]
        if not _c2f2d_contract(np, t, md, rel, report):
            continue
        for name, ref in c2f2d_loops(np, t, md).items():
            compare_values(np, ref, t[name], dtype, tol, tol, f"{rel}:{name} vs numpy reference", report,
                           stat_key=f"numpy-reference {dtype}")


CROSSCHECKS = {"mha": crosscheck_mha, "c2f": crosscheck_c2f, "conv1d": crosscheck_conv1d,
               "hmha": crosscheck_hmha, "sparse": crosscheck_sparse, "c2f2d": crosscheck_c2f2d}


def main(argv=None):
    ap = argparse.ArgumentParser(description="Compare committed fixtures with a fresh generate.py run.")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"committed data dir (default {DEFAULT_DATA})")
    ap.add_argument("--family", action="append", help="check only this family (repeatable)")
    ap.add_argument("--determinism", action="store_true", help="also generate twice and require identical bytes")
    args = ap.parse_args(argv)

    try:
        import numpy as np
        import torch  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        print(f"SKIPPED: cannot import numpy/torch with {sys.executable} ({e}); "
              "use Debian's /usr/bin/python3 (python3-torch, python3-numpy)")
        return SKIP

    sys.dont_write_bytecode = True  # keep __pycache__ out of the source tree
    sys.path.insert(0, str(HERE))
    import generate
    import safetensors_io as st

    families = args.family or sorted(generate.FAMILIES)
    for name in families:
        if name not in generate.FAMILIES:
            print(f"unknown family '{name}' (known: {', '.join(sorted(generate.FAMILIES))})")
            return 1

    report = Report()
    with tempfile.TemporaryDirectory(prefix="c2f-fixtures-") as tmp:
        fresh = Path(tmp) / "a"
        generate.generate(fresh, families)
        if args.determinism:
            again = Path(tmp) / "b"
            generate.generate(again, families)
            for name in families:
                cmp = filecmp.dircmp(fresh / name, again / name)
                _, mismatch, errors = filecmp.cmpfiles(fresh / name, again / name, cmp.common_files, shallow=False)
                for n in mismatch + errors + cmp.left_only + cmp.right_only:
                    report.error(f"{name}/{n}: two generator runs did not produce identical bytes")
        for name in families:
            compare_family(np, st, generate.FAMILIES[name], args.data / name, fresh / name, report)
    for name in families:
        if name in CROSSCHECKS and (args.data / name).is_dir():
            CROSSCHECKS[name](np, st, args.data / name, report)

    for n in report.notes:
        print(f"note: {n}")
    for key in sorted(report.max_diff):
        val, where = report.max_diff[key]
        print(f"max |diff| {key}: {val:.3g} ({where})")
    if report.errors:
        print(f"FAILED: {len(report.errors)} problem(s) in {args.data} (torch {torch.__version__}):")
        for e in report.errors:
            print(f"  - {e}")
        print("If the change is intended, regenerate with: /usr/bin/python3 tests/reference/generate.py")
        return 1
    print(f"OK: {report.checked} tensors in {', '.join(families)} match a fresh run "
          f"(torch {torch.__version__}){' and generation is deterministic' if args.determinism else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
