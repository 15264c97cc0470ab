#!/usr/bin/python3
"""Deterministic PyTorch reference fixtures for c2f's C++ tests.

Usage (needs Debian's python3 with torch, i.e. /usr/bin/python3, not the pyenv one):

    /usr/bin/python3 tests/reference/generate.py                 # writes tests/data/<family>/...
    /usr/bin/python3 tests/reference/generate.py --out /tmp/x    # somewhere else
    /usr/bin/python3 tests/reference/generate.py --family mha    # only some families
    /usr/bin/python3 tests/reference/generate.py --list          # list families and cases

Every case is written once per dtype as ``<out>/<family>/<case>_f32.safetensors`` and
``<case>_f64.safetensors``, and each family gets ``<out>/<family>/manifest.json``.

Determinism contract: every input and every parameter is drawn from ``numpy.random.RandomState``
(whose streams are stable across platforms and numpy versions) and then handed to the real torch
module; torch's own RNG is never used for data. Running the generator twice gives byte-identical files
on the same machine; across machines only the computed tensors (``output``, ``weights``) may differ in
the last bits (see check_fixtures.py for the tolerance policy).

Adding a module: write a function ``gen_<family>(family_dir) -> list of manifest entries`` that uses the
shared helpers (``stream``, ``glorot_uniform``, ``write_case``), and register it with
``@register_family("<family>", computed=(...names of torch-computed tensors...))``. Its fixtures land in
``tests/data/<family>/``.
"""

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "data"
GENERATOR = "tests/reference/generate.py"

sys.dont_write_bytecode = True  # keep __pycache__ out of the source tree
sys.path.insert(0, str(HERE))
import safetensors_io as st  # noqa: E402

# dtype tag -> (numpy dtype, torch dtype); every case is produced in both.
DTYPES = {"f32": (np.float32, torch.float32), "f64": (np.float64, torch.float64)}


# =====================================================================================================
# Registry of case families
# =====================================================================================================

@dataclass(frozen=True)
class Family:
    name: str
    generate: Callable[[Path], List[dict]]  # writes the files into the family dir, returns manifest entries
    computed: Tuple[str, ...]  # tensor names computed by torch (compared with a tolerance)
    description: str


FAMILIES: Dict[str, Family] = {}


def register_family(name, computed, description):
    def deco(fn):
        if name in FAMILIES:
            raise ValueError(f"family '{name}' registered twice")
        FAMILIES[name] = Family(name, fn, tuple(computed), description)
        return fn
    return deco


# =====================================================================================================
# Shared helpers
# =====================================================================================================

# Independent RandomState streams per purpose, so that e.g. adding a mask to a case never changes its
# weights or inputs. The numbers are part of the fixture contract: never renumber.
STREAMS = {"weights": 1, "inputs": 2, "attn_mask": 3, "key_padding_mask": 4}


def stream(seed: int, purpose: str) -> np.random.RandomState:
    """RandomState seeded with the array [seed, STREAMS[purpose]] (Mersenne Twister init_by_array)."""
    return np.random.RandomState([seed, STREAMS[purpose]])


def glorot_uniform(rs: np.random.RandomState, fan_out: int, fan_in: int) -> np.ndarray:
    """[fan_out, fan_in] float64 ~ U(-a, a), a = sqrt(6 / (fan_in + fan_out))."""
    a = math.sqrt(6.0 / (fan_in + fan_out))
    return rs.uniform(-a, a, size=(fan_out, fan_in))


def bias_uniform(rs: np.random.RandomState, n: int) -> np.ndarray:
    """Biases ~ U(-0.1, 0.1): clearly non-zero so that a missing or misplaced bias shows."""
    return rs.uniform(-0.1, 0.1, size=(n,))


def torch_version() -> str:
    return str(torch.__version__)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().numpy())


def write_case(family_dir: Path, case: str, dtype_tag: str, tensors: Dict[str, np.ndarray],
               metadata: Dict[str, str]) -> str:
    """Writes ``<family_dir>/<case>_<dtype_tag>.safetensors``; returns its path relative to the data dir."""
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise TypeError(f"{case}: metadata {k!r} must be a string, got {v!r}")
    fname = f"{case}_{dtype_tag}.safetensors"
    st.save_file(family_dir / fname, {k: st.from_numpy(v) for k, v in tensors.items()}, metadata)
    return f"{family_dir.name}/{fname}"


def write_manifest(family_dir: Path, entries: List[dict]) -> None:
    manifest = {"generator": GENERATOR, "torch_version": torch_version(), "cases": entries}
    text = json.dumps(manifest, indent=2, ensure_ascii=True) + "\n"
    (family_dir / "manifest.json").write_text(text, encoding="ascii")


def prepare_family_dir(out: Path, family: str) -> Path:
    """Creates ``out/family`` and removes the fixtures of a previous run (stale cases must not linger)."""
    d = out / family
    d.mkdir(parents=True, exist_ok=True)
    for p in list(d.glob("*.safetensors")) + [d / "manifest.json"]:
        if p.exists():
            p.unlink()
    return d


def b(x: bool) -> str:
    return "true" if x else "false"


@contextlib.contextmanager
def record_native_mha_calls():
    """Counts calls of torch._native_multi_head_attention, i.e. whether nn.MultiheadAttention took its
    fused "fast path" (torch >= 1.12) or the Python F.multi_head_attention_forward "slow path"."""
    calls = []
    orig = getattr(torch, "_native_multi_head_attention", None)
    if orig is None:
        yield calls
        return

    def wrapper(*args, **kwargs):
        calls.append(1)
        return orig(*args, **kwargs)

    torch._native_multi_head_attention = wrapper
    try:
        yield calls
    finally:
        torch._native_multi_head_attention = orig


# =====================================================================================================
# Family "mha": torch.nn.MultiheadAttention(batch_first=True)
# =====================================================================================================

@dataclass(frozen=True)
class MhaCase:
    name: str
    seed: int
    description: str
    embed_dim: int = 16
    num_heads: int = 4
    batch: int = 2
    lq: int = 7
    lk: Optional[int] = None  # None: self-attention (key = value = query, lk = lq)
    kdim: Optional[int] = None  # None: embed_dim
    vdim: Optional[int] = None  # None: embed_dim
    bias: bool = True
    attn_mask: Optional[str] = None  # a key of ATTN_MASK_BUILDERS
    key_padding_mask: Optional[str] = None  # "bool" | "float"
    lengths: Tuple[int, ...] = ()  # valid key lengths per batch item, for key_padding_mask
    need_weights: str = "none"  # "none" | "average" | "per_head"
    # Self-attention is called as mha(x, x, x) (same tensor object: torch may take its fast path). A
    # non-empty reason calls mha(x, x.clone(), x.clone()) instead, which forces the slow path.
    avoid_fast_path: str = ""

    @property
    def self_attention(self) -> bool:
        return self.lk is None

    @property
    def Lk(self) -> int:
        return self.lq if self.lk is None else self.lk

    @property
    def Kdim(self) -> int:
        return self.embed_dim if self.kdim is None else self.kdim

    @property
    def Vdim(self) -> int:
        return self.embed_dim if self.vdim is None else self.vdim

    @property
    def packed(self) -> bool:
        return self.Kdim == self.embed_dim and self.Vdim == self.embed_dim


def _ensure_row_has_allowed(rs, masked: np.ndarray) -> np.ndarray:
    """For every row (last axis) that is entirely masked, unmask one random position."""
    masked = masked.copy()
    flat = masked.reshape(-1, masked.shape[-1])
    for r in range(flat.shape[0]):
        if flat[r].all():
            flat[r, rs.randint(flat.shape[1])] = False
    return flat.reshape(masked.shape)


def _mask_bool_random_2d(rs, c: MhaCase) -> np.ndarray:
    m = rs.uniform(size=(c.lq, c.Lk)) < 0.3
    return _ensure_row_has_allowed(rs, m)


def _mask_bool_random_3d(rs, c: MhaCase) -> np.ndarray:
    m = rs.uniform(size=(c.batch * c.num_heads, c.lq, c.Lk)) < 0.4
    return _ensure_row_has_allowed(rs, m)


def _mask_float_random_2d(rs, c: MhaCase) -> np.ndarray:
    vals = rs.standard_normal(size=(c.lq, c.Lk))
    ninf = _ensure_row_has_allowed(rs, rs.uniform(size=(c.lq, c.Lk)) < 0.2)
    return np.where(ninf, -np.inf, vals)


def _mask_causal(rs, c: MhaCase) -> np.ndarray:
    # torch convention (bool): True = not allowed; mask[i][j] = j > i, as torch.triu(ones, diagonal=1).
    return np.triu(np.ones((c.lq, c.Lk), dtype=bool), k=1)


FULLY_MASKED_ROWS = (1, 4)


def _mask_bool_fully_masked_rows(rs, c: MhaCase) -> np.ndarray:
    m = _mask_bool_random_2d(rs, c)
    m[list(FULLY_MASKED_ROWS), :] = True
    return m


ATTN_MASK_BUILDERS = {
    "bool_random_2d": _mask_bool_random_2d,
    "bool_random_3d": _mask_bool_random_3d,
    "float_random_2d": _mask_float_random_2d,
    "causal": _mask_causal,
    "bool_fully_masked_rows": _mask_bool_fully_masked_rows,
}


def _key_padding_mask(rs, c: MhaCase) -> np.ndarray:
    assert len(c.lengths) == c.batch, c.name
    pad = np.arange(c.Lk)[None, :] >= np.asarray(c.lengths)[:, None]  # True = ignore that key
    if c.key_padding_mask == "bool":
        return pad
    if c.key_padding_mask == "float":
        # Additive: finite random values on the kept keys, -inf on the padded ones.
        return np.where(pad, -np.inf, 0.5 * rs.standard_normal(size=(c.batch, c.Lk)))
    raise ValueError(f"{c.name}: unknown key_padding_mask kind {c.key_padding_mask!r}")


MHA_CASES: List[MhaCase] = [
    # --- plain self-attention ------------------------------------------------------------------------
    MhaCase("self_l1", 101, "self-attention, single position", lq=1),
    MhaCase("self_l7", 102, "self-attention", lq=7),
    MhaCase("self_l37_avg_weights", 103, "self-attention, averaged attention weights returned",
            lq=37, need_weights="average"),
    MhaCase("self_l128", 104, "self-attention, longer sequence", lq=128),
    # --- cross-attention -----------------------------------------------------------------------------
    MhaCase("cross_kdim12_vdim20", 201,
            "cross-attention Lq=7 Lk=37 with kdim=12, vdim=20: separate q/k/v projection weights",
            num_heads=2, lq=7, lk=37, kdim=12, vdim=20),
    MhaCase("cross_lq37_lk7", 202,
            "cross-attention Lq=37 Lk=7, kdim=vdim=embed_dim (packed in_proj), key != value",
            lq=37, lk=7),
    # --- no bias -------------------------------------------------------------------------------------
    MhaCase("nobias_l37", 301, "self-attention without any bias (bias=False)", lq=37, bias=False,
            avoid_fast_path="torch 1.13's fast path crashes with bias=False (in_proj_bias None)"),
    # --- attention masks -----------------------------------------------------------------------------
    MhaCase("attn_mask_bool_2d_l37", 401,
            "self-attention, random bool attn_mask [L, L] (True = not allowed), no fully masked row",
            lq=37, attn_mask="bool_random_2d"),
    MhaCase("attn_mask_bool_3d_cross", 402,
            "cross-attention Lq=7 Lk=37 (packed), random bool attn_mask [B*H, Lq, Lk], no fully masked row",
            lq=7, lk=37, attn_mask="bool_random_3d"),
    MhaCase("attn_mask_float_2d_l37", 403,
            "self-attention, additive float attn_mask [L, L]: N(0,1) values and ~20% -inf, no fully masked row",
            lq=37, attn_mask="float_random_2d"),
    # --- key padding masks ---------------------------------------------------------------------------
    MhaCase("kpm_bool_l37", 501, "self-attention, bool key_padding_mask (True = ignore), lengths 37 and 20",
            lq=37, key_padding_mask="bool", lengths=(37, 20)),
    MhaCase("kpm_float_l37", 502,
            "self-attention, additive float key_padding_mask: 0.5*N(0,1) on kept keys, -inf on padded "
            "(lengths 37 and 25)",
            lq=37, key_padding_mask="float", lengths=(37, 25),
            avoid_fast_path="torch 1.13's fast path converts a float key_padding_mask to bool "
                            "(non-zero = masked) instead of adding it"),
    # --- causal --------------------------------------------------------------------------------------
    MhaCase("causal_l7", 601, "self-attention, causal bool attn_mask (torch.triu(ones, diagonal=1))",
            lq=7, attn_mask="causal"),
    MhaCase("causal_l128", 602, "self-attention, causal bool attn_mask (torch.triu(ones, diagonal=1))",
            lq=128, attn_mask="causal"),
    MhaCase("causal_kpm_l37", 603, "self-attention, causal bool attn_mask + bool key_padding_mask (lengths 37, 20)",
            lq=37, attn_mask="causal", key_padding_mask="bool", lengths=(37, 20)),
    # --- returned attention weights ------------------------------------------------------------------
    MhaCase("per_head_weights_bool_mask_l37", 701,
            "self-attention, random bool attn_mask [L, L], per-head weights (average_attn_weights=False)",
            lq=37, attn_mask="bool_random_2d", need_weights="per_head"),
    MhaCase("avg_weights_kpm_l37", 702,
            "self-attention, bool key_padding_mask (lengths 37, 20), averaged weights",
            lq=37, key_padding_mask="bool", lengths=(37, 20), need_weights="average"),
    MhaCase("fully_masked_rows_l7", 703,
            f"self-attention, bool attn_mask [L, L] with query rows {list(FULLY_MASKED_ROWS)} entirely "
            "masked, averaged weights: torch yields NaN in those rows of output and weights",
            lq=7, attn_mask="bool_fully_masked_rows", need_weights="average"),
    # --- shapes --------------------------------------------------------------------------------------
    MhaCase("single_head_b1_l7", 801, "self-attention, batch 1, one head, embed_dim 8",
            embed_dim=8, num_heads=1, batch=1, lq=7),
    MhaCase("head_dim3_l37", 802, "self-attention, embed_dim 24 with 8 heads (head_dim 3)",
            embed_dim=24, num_heads=8, lq=37),
]


def _mha_parameters(c: MhaCase) -> Dict[str, np.ndarray]:
    """float64 values for every entry of the module's state_dict, drawn in a fixed order."""
    rs = stream(c.seed, "weights")
    E = c.embed_dim
    p = {}
    if c.packed:
        # Three [E, E] blocks (q, k, v), each Glorot-uniform for its own fan-in/fan-out.
        p["in_proj_weight"] = np.concatenate([glorot_uniform(rs, E, E) for _ in range(3)], axis=0)
    else:
        p["q_proj_weight"] = glorot_uniform(rs, E, E)
        p["k_proj_weight"] = glorot_uniform(rs, E, c.Kdim)
        p["v_proj_weight"] = glorot_uniform(rs, E, c.Vdim)
    if c.bias:
        p["in_proj_bias"] = bias_uniform(rs, 3 * E)
    p["out_proj.weight"] = glorot_uniform(rs, E, E)
    if c.bias:
        p["out_proj.bias"] = bias_uniform(rs, E)
    return p


def _mha_inputs(c: MhaCase) -> Dict[str, np.ndarray]:
    rs = stream(c.seed, "inputs")
    x = {"query": rs.standard_normal(size=(c.batch, c.lq, c.embed_dim))}
    if c.self_attention:
        x["key"] = x["query"]
        x["value"] = x["query"]
    else:
        x["key"] = rs.standard_normal(size=(c.batch, c.Lk, c.Kdim))
        x["value"] = rs.standard_normal(size=(c.batch, c.Lk, c.Vdim))
    return x


def _blocked(c: MhaCase, attn_mask, kpm) -> np.ndarray:
    """[B, H, Lq, Lk] bool: True where a score is masked out (bool True or additive -inf)."""
    blk = np.zeros((c.batch, c.num_heads, c.lq, c.Lk), dtype=bool)
    if attn_mask is not None:
        m = attn_mask if attn_mask.dtype == bool else np.isneginf(attn_mask)
        blk |= m.reshape(c.batch, c.num_heads, c.lq, c.Lk) if m.ndim == 3 else m[None, None]
    if kpm is not None:
        m = kpm if kpm.dtype == bool else np.isneginf(kpm)
        blk |= m[:, None, None, :]
    return blk


def _run_mha(c: MhaCase, dtype_tag: str, params, inputs, attn_mask, kpm):
    np_dt, t_dt = DTYPES[dtype_tag]
    mha = torch.nn.MultiheadAttention(c.embed_dim, c.num_heads, bias=c.bias, kdim=c.kdim, vdim=c.vdim,
                                      batch_first=True)
    if t_dt == torch.float64:
        mha = mha.double()
    sd_names = set(mha.state_dict().keys())
    if sd_names != set(params):
        raise RuntimeError(f"{c.name}: state_dict keys {sorted(sd_names)} != generated {sorted(params)}")
    mha.load_state_dict({k: torch.from_numpy(v.astype(np_dt)) for k, v in params.items()}, strict=True)
    mha.eval()

    q = torch.from_numpy(inputs["query"].astype(np_dt))
    if c.self_attention:
        k = v = q
        if c.avoid_fast_path:
            k, v = q.clone(), q.clone()
    else:
        k = torch.from_numpy(inputs["key"].astype(np_dt))
        v = torch.from_numpy(inputs["value"].astype(np_dt))

    def as_torch(m):
        if m is None:
            return None
        return torch.from_numpy(m if m.dtype == bool else m.astype(np_dt))

    with torch.no_grad(), record_native_mha_calls() as calls:
        out, w = mha(q, k, v, key_padding_mask=as_torch(kpm), need_weights=c.need_weights != "none",
                     attn_mask=as_torch(attn_mask), average_attn_weights=c.need_weights != "per_head")
    path = "fast" if calls else "slow"
    if c.avoid_fast_path and path == "fast":
        raise RuntimeError(f"{c.name}: expected the slow path ({c.avoid_fast_path})")

    sd = {k: to_numpy(t) for k, t in mha.state_dict().items()}
    return sd, to_numpy(out), (None if w is None else to_numpy(w)), path


def _mha_case_files(family_dir: Path, c: MhaCase) -> dict:
    params = _mha_parameters(c)
    inputs = _mha_inputs(c)
    attn_mask = None
    if c.attn_mask is not None:
        attn_mask = ATTN_MASK_BUILDERS[c.attn_mask](stream(c.seed, "attn_mask"), c)
    kpm = _key_padding_mask(stream(c.seed, "key_padding_mask"), c) if c.key_padding_mask else None

    blocked = _blocked(c, attn_mask, kpm)
    fully_masked = bool(blocked.all(axis=-1).any())
    causal = (attn_mask is not None and attn_mask.dtype == bool and attn_mask.ndim == 2
              and attn_mask.shape[0] == attn_mask.shape[1]
              and np.array_equal(attn_mask, np.triu(np.ones(attn_mask.shape, dtype=bool), k=1)))
    if c.attn_mask == "causal" and not causal:
        raise RuntimeError(f"{c.name}: causal mask is not triu(diagonal=1)")

    base_meta = {
        "embed_dim": str(c.embed_dim), "num_heads": str(c.num_heads), "batch": str(c.batch),
        "lq": str(c.lq), "lk": str(c.Lk), "kdim": str(c.Kdim), "vdim": str(c.Vdim), "bias": b(c.bias),
        "attn_mask": "none" if attn_mask is None else ("bool" if attn_mask.dtype == bool else "float"),
        "attn_mask_shape": "none" if attn_mask is None else f"{attn_mask.ndim}d",
        "causal": b(causal),
        "key_padding_mask": "none" if kpm is None else ("bool" if kpm.dtype == bool else "float"),
        "need_weights": c.need_weights,
        "fully_masked_rows": b(fully_masked),
        "seed": str(c.seed),
        "torch_version": torch_version(),
        "description": c.description + (f" [called with key/value copies: {c.avoid_fast_path}]"
                                         if c.avoid_fast_path else ""),
    }

    files, entry_meta = {}, None
    for tag, (np_dt, _) in DTYPES.items():
        sd, out, w, path = _run_mha(c, tag, params, inputs, attn_mask, kpm)
        exp_w = {"none": None, "average": (c.batch, c.lq, c.Lk),
                 "per_head": (c.batch, c.num_heads, c.lq, c.Lk)}[c.need_weights]
        if out.shape != (c.batch, c.lq, c.embed_dim) or (None if w is None else w.shape) != exp_w:
            raise RuntimeError(f"{c.name}/{tag}: unexpected shapes output {out.shape}, "
                               f"weights {None if w is None else w.shape}")
        # torch gives NaN exactly in fully masked query rows (0/0 in the softmax).
        nan_rows = np.isnan(out).any(axis=-1)  # [B, Lq]
        if not np.array_equal(nan_rows, blocked.all(axis=-1).any(axis=1)):
            raise RuntimeError(f"{c.name}/{tag}: NaN rows of output do not match the fully masked rows")

        tensors = {f"mha.{k}": v for k, v in sd.items()}
        for k, v in params.items():  # the module must hold exactly the numpy values
            if not np.array_equal(tensors[f"mha.{k}"], v.astype(np_dt)):
                raise RuntimeError(f"{c.name}/{tag}: parameter {k} was not loaded exactly")
        tensors.update({k: v.astype(np_dt) for k, v in inputs.items()})
        if attn_mask is not None:
            tensors["attn_mask"] = attn_mask if attn_mask.dtype == bool else attn_mask.astype(np_dt)
        if kpm is not None:
            tensors["key_padding_mask"] = kpm if kpm.dtype == bool else kpm.astype(np_dt)
        tensors["output"] = out
        if w is not None:
            tensors["weights"] = w
        for k, v in tensors.items():
            if v.dtype != bool and v.dtype != np_dt:
                raise RuntimeError(f"{c.name}/{tag}: tensor {k} has dtype {v.dtype}")

        meta = dict(base_meta, torch_path=path)
        if entry_meta is not None and meta != entry_meta:
            raise RuntimeError(f"{c.name}: f32 and f64 metadata differ: {entry_meta} vs {meta}")
        entry_meta = meta
        files[tag] = write_case(family_dir, c.name, tag, tensors, meta)

    return {"name": c.name, "files": files, **{k: entry_meta[k] for k in sorted(entry_meta)}}


@register_family(
    "mha", computed=("output", "weights"),
    description="torch.nn.MultiheadAttention(batch_first=True): self/cross attention, masks, weights")
def gen_mha(family_dir: Path) -> List[dict]:
    names = [c.name for c in MHA_CASES]
    if len(set(names)) != len(names) or len({c.seed for c in MHA_CASES}) != len(MHA_CASES):
        raise RuntimeError("MHA case names and seeds must be unique")
    return [_mha_case_files(family_dir, c) for c in MHA_CASES]


# =====================================================================================================
# Driver
# =====================================================================================================

def generate(out: Path, families: Optional[List[str]] = None, verbose: bool = False) -> Dict[str, List[dict]]:
    """Writes the fixtures of ``families`` (all by default) under ``out``; returns manifest entries."""
    torch.set_num_threads(1)  # reductions in a fixed order: reproducible bits on a given machine
    out = Path(out)
    result = {}
    for name in families or sorted(FAMILIES):
        if name not in FAMILIES:
            raise SystemExit(f"unknown family '{name}' (known: {', '.join(sorted(FAMILIES))})")
        fam = FAMILIES[name]
        d = prepare_family_dir(out, name)
        entries = fam.generate(d)
        write_manifest(d, entries)
        result[name] = entries
        if verbose:
            for e in entries:
                sizes = ", ".join(f"{t} {(out / p).stat().st_size} B" for t, p in e["files"].items())
                print(f"{name}/{e['name']}: {sizes}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"data directory; each family goes to OUT/<family>/ (default: {DEFAULT_OUT})")
    ap.add_argument("--family", action="append", help="generate only this family (repeatable)")
    ap.add_argument("--list", action="store_true", help="list families and MHA cases, write nothing")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for f in FAMILIES.values():
            print(f"{f.name}: {f.description}")
        for c in MHA_CASES:
            print(f"  mha/{c.name}: {c.description}")
        return 0
    generate(args.out, args.family, verbose=not args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
