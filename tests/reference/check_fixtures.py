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
  ``output``, ``coarse_input``, ``coarse_output``) may differ in the last bits across CPUs/BLAS builds,
  and must satisfy |new - committed| <= atol + rtol * |committed| with atol = rtol = 1e-6 for F32 and
  1e-12 for F64; NaN and +-inf positions must be identical.
* Independently of torch, every mha fixture is also checked against a small float64 numpy
  implementation of multi-head attention (loose tolerance: 1e-4 for f32 files, 1e-10 for f64), so a
  fixture that encodes a torch quirk rather than the documented semantics is caught. Likewise every c2f
  fixture (``output``, ``coarse_input``, ``coarse_output``) against a float64 numpy implementation of
  seed 004's coarse-to-fine attention with padding, plus its contract (shapes, mask metadata, no query
  row without a kept real key).
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


def compare_values(np, old, new, dtype, atol, rtol, where, report, stat_key=None):
    """Tolerance comparison of two float arrays; NaN/inf positions must match. Returns True if ok."""
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
        report.error(f"{where}: {int(bad.sum())} of {a.size} elements outside atol {atol:g} + rtol {rtol:g} "
                     f"({dtype}):\n      " + "\n      ".join(lines))
        ok = False
    return ok


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
        if name in computed and a.dtype in TOLERANCE:
            atol, rtol = TOLERANCE[a.dtype]
            compare_values(np, st.to_numpy(a), st.to_numpy(b), a.dtype, atol, rtol, where, report)
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


def crosscheck_mha(np, st, committed_dir, report):
    for path in sorted(committed_dir.glob("*.safetensors")):
        rel = f"mha/{path.name}"
        try:
            raw, md = st.load_file(path)
        except st.SafetensorsError:
            continue  # already reported
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
    gives NaN here (the fixtures must not have one: c2f's C++ layer and the seed's -1e9 fill disagree)."""
    s = (q @ k.T) / np.sqrt(q.shape[-1])
    s = np.where(keep, s, -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)) @ v


def c2f_reference(np, t, md):
    """float64 CoarseAttention / FineAttention / C2FAttention (seed 004 with its fixes) from a fixture's
    tensors; written per batch item, chunk and head, without torch's reshapes. Returns name -> array."""
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
    for path in sorted(committed_dir.glob("*.safetensors")):
        rel = f"c2f/{path.name}"
        try:
            raw, md = st.load_file(path)
        except st.SafetensorsError:
            continue  # already reported
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


CROSSCHECKS = {"mha": crosscheck_mha, "c2f": crosscheck_c2f}


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
