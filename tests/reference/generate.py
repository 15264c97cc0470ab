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
import c2f_reference as c2f_ref  # noqa: E402
import c2f2d_reference as c2f2d_ref  # noqa: E402
import hmha_reference as hmha_ref  # noqa: E402
import sparse_reference as sparse_ref  # noqa: E402

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
STREAMS = {"weights": 1, "inputs": 2, "attn_mask": 3, "key_padding_mask": 4, "coarse_mask": 5,
           "fine_mask": 6, "grad_output": 7, "grads": 8}


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
# Family "bf16": torch.nn.MultiheadAttention under torch.autocast("cpu", dtype=torch.bfloat16), the peer of
# c2f's Compute::BFloat16 (docs/bf16.md). Outputs in fp32 and under autocast (bf16, stored as f32).
# =====================================================================================================

BF16_CASES: List[MhaCase] = [
    MhaCase("mha_self_l128", 1101, "self-attention, embed_dim 64, 4 heads, L = 128, batch 2",
            embed_dim=64, num_heads=4, lq=128),
    MhaCase("mha_causal_l128", 1102, "self-attention with a causal bool attn_mask, embed_dim 64, 4 heads, L = 128",
            embed_dim=64, num_heads=4, lq=128, attn_mask="causal"),
]


def _fp32_and_autocast(name: str, run: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """run() without gradients in fp32 and under torch.autocast("cpu", bfloat16), whose output must be bfloat16."""
    with torch.no_grad():
        out = run()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_bf16 = run()
    if out_bf16.dtype != torch.bfloat16:
        raise RuntimeError(f"{name}: autocast gave {out_bf16.dtype}, not bfloat16")
    return out, out_bf16


@register_family(
    "bf16", computed=("output", "output_autocast"),
    description="torch.nn.MultiheadAttention in fp32 and under torch.autocast('cpu', dtype=torch.bfloat16)")
def gen_bf16(family_dir: Path) -> List[dict]:
    entries = []
    for c in BF16_CASES:
        params, inputs = _mha_parameters(c), _mha_inputs(c)
        attn_mask = ATTN_MASK_BUILDERS[c.attn_mask](stream(c.seed, "attn_mask"), c) if c.attn_mask else None
        mha = torch.nn.MultiheadAttention(c.embed_dim, c.num_heads, bias=c.bias, batch_first=True)
        mha.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in params.items()}, strict=True)
        mha.eval()
        q = torch.from_numpy(inputs["query"].astype(np.float32))
        mask = None if attn_mask is None else torch.from_numpy(attn_mask)
        # Key and value copies: torch 1.13's fast path (same tensor thrice, eval) fails under autocast
        # ("expected scalar type BFloat16 but found Float"); the general path autocasts each product.
        k, v = q.clone(), q.clone()
        out, out_bf16 = _fp32_and_autocast(c.name, lambda: mha(q, k, v, need_weights=False, attn_mask=mask)[0])
        tensors = {f"mha.{k}": to_numpy(t) for k, t in mha.state_dict().items()}
        tensors["query"] = inputs["query"].astype(np.float32)
        if attn_mask is not None:
            tensors["attn_mask"] = attn_mask
        tensors["output"] = to_numpy(out)
        tensors["output_autocast"] = to_numpy(out_bf16.float())
        meta = {"embed_dim": str(c.embed_dim), "num_heads": str(c.num_heads), "batch": str(c.batch),
                "lq": str(c.lq), "causal": b(attn_mask is not None), "seed": str(c.seed),
                "torch_version": torch_version(), "description": c.description}
        entries.append({"name": c.name, "files": {"f32": write_case(family_dir, c.name, "f32", tensors, meta)},
                        **{k: meta[k] for k in sorted(meta)}})
    # The coarse-to-fine article's C2FAttention (c2f_reference.py), the same two ways.
    c = C2fCase("c2f_chunk8_l64", 1103, "the article's C2FAttention, d_model 64, 4 heads, chunk 8, L = 64, batch 2",
                module="c2f", seq_len=64, chunk=8, d_model=64, n_heads=4)
    params, inputs = _c2f_parameters(c), _c2f_inputs(c)
    mod = c2f_ref.C2FAttention(c.d_model, c.n_heads, chunk_size=c.chunk)
    mod.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in params.items()}, strict=True)
    mod.eval()
    x = torch.from_numpy(inputs["x"].astype(np.float32))
    out, out_bf16 = _fp32_and_autocast(c.name, lambda: mod(x))
    tensors = {f"c2f.{k}": to_numpy(t) for k, t in mod.state_dict().items()}
    tensors["x"] = inputs["x"].astype(np.float32)
    tensors["output"] = to_numpy(out)
    tensors["output_autocast"] = to_numpy(out_bf16.float())
    meta = {"d_model": str(c.d_model), "num_heads": str(c.n_heads), "chunk_size": str(c.chunk), "batch": str(c.batch),
            "seq_len": str(c.seq_len), "seed": str(c.seed), "autocast_dtype": str(out_bf16.dtype),
            "torch_version": torch_version(), "description": c.description}
    entries.append({"name": c.name, "files": {"f32": write_case(family_dir, c.name, "f32", tensors, meta)},
                    **{k: meta[k] for k in sorted(meta)}})
    # C2FAttention2D (c2f2d_reference.py) with the relative position bias, partial blocks on both edges.
    g = C2f2dCase("c2f2d_9x13_b4x4_bf16", 1104, "C2FAttention2D, d_model 32, 4 heads, a 9 x 13 grid in blocks of 4 x 4, "
                  "relative position bias, batch 2", 9, 13, 4, 4, (5, 6), d_model=32)
    params = _c2f2d_parameters(g)
    x = stream(g.seed, "inputs").standard_normal(size=(g.batch, g.height * g.width, g.d_model)).astype(np.float32)
    mod = _c2f2d_module(g)
    _load_exactly(mod, params, np.float32, g.name)
    mod.eval()
    out, out_bf16 = _fp32_and_autocast(g.name, lambda: mod(torch.from_numpy(x), g.height, g.width))
    tensors = {f"c2f2d.{k}": v.astype(np.float32) for k, v in params.items()}
    tensors.update(x=x, output=to_numpy(out), output_autocast=to_numpy(out_bf16.float()))
    (mh, mw), (gh, gw) = g.blocks, g.gmax
    meta = {"embed_dim": str(g.d_model), "num_heads": str(g.n_heads), "batch": str(g.batch), "height": str(g.height),
            "width": str(g.width), "block_h": str(g.block_h), "block_w": str(g.block_w), "max_blocks_h": str(gh),
            "max_blocks_w": str(gw), "seed": str(g.seed), "autocast_dtype": str(out_bf16.dtype),
            "torch_version": torch_version(), "description": g.description}
    entries.append({"name": g.name, "files": {"f32": write_case(family_dir, g.name, "f32", tensors, meta)},
                    **{k: meta[k] for k in sorted(meta)}})
    # The C3K2/HMHA article's HMHA (hmha_reference.py), every level on, not causal and causal.
    for causal in (False, True):
        h = HmhaCase(f"hmha_l100_w16{'_causal' if causal else ''}_bf16", 1105,
                     f"HMHA, dim 64, 4 heads, L = 100, window 16 (the last window 4 tokens), batch 2"
                     f"{', causal' if causal else ''}", 100, 16, causal, dim=64, heads=4, batch=2)
        params = _hmha_parameters(h)
        x = stream(h.seed, "inputs").standard_normal(size=(h.batch, h.seq_len, h.dim)).astype(np.float32)
        mod = hmha_ref.HMHA(h.dim, h.heads, window=h.window, levels=(1, 2, 3), causal=h.causal)
        _load_exactly(mod, params, np.float32, h.name)
        mod.eval()
        out, out_bf16 = _fp32_and_autocast(h.name, lambda: mod(torch.from_numpy(x)))
        tensors = {f"hmha.{k}": v.astype(np.float32) for k, v in params.items()}
        tensors.update(x=x, output=to_numpy(out), output_autocast=to_numpy(out_bf16.float()))
        meta = {"dim": str(h.dim), "heads": str(h.heads), "window": str(h.window), "causal": b(h.causal),
                "batch": str(h.batch), "seq_len": str(h.seq_len), "seed": str(h.seed),
                "autocast_dtype": str(out_bf16.dtype), "torch_version": torch_version(), "description": h.description}
        entries.append({"name": h.name, "files": {"f32": write_case(family_dir, h.name, "f32", tensors, meta)},
                        **{k: meta[k] for k in sorted(meta)}})
    # The convolutions alone: a grouped torch.nn.Conv1d and the C3K2/HMHA article's C3K2Projection.
    for conv in (ConvCase("conv1d_k3_p1_g2_l50_bf16", 1106, "Conv1d in 16, out 12, k = 3, padding 1, groups 2, "
                          "L = 50, batch 2", "conv1d", 50, in_channels=16, out_channels=12, padding=1, groups=2),
                 ConvCase("c3k2_d64_l50_bf16", 1107, "C3K2Projection dim 64, heads 4, L = 50, batch 2", "c3k2", 50,
                          dim=64, heads=4)):
        rs = stream(conv.seed, "weights")
        if conv.module == "conv1d":
            cin_g = conv.in_channels // conv.groups
            params = {"weight": conv_uniform(rs, (conv.out_channels, cin_g, 3), cin_g * 3),
                      "bias": bias_uniform(rs, conv.out_channels)}
            mod = torch.nn.Conv1d(conv.in_channels, conv.out_channels, 3, padding=1, groups=conv.groups)
            c_in, prefix = conv.in_channels, "conv."
            meta = {"module": "conv1d", "in_channels": str(conv.in_channels), "out_channels": str(conv.out_channels),
                    "kernel_size": "3", "padding": "1", "groups": str(conv.groups)}
        else:
            params = _c3k2_parameters(rs, conv.dim)
            mod = hmha_ref.C3K2Projection(conv.dim, conv.heads, conv.causal)
            c_in, prefix = conv.dim, "c3k2."
            meta = {"module": "c3k2", "dim": str(conv.dim), "heads": str(conv.heads)}
        _load_exactly(mod, params, np.float32, conv.name)
        x = stream(conv.seed, "inputs").standard_normal(size=(conv.batch, conv.seq_len, c_in)).astype(np.float32)
        run = (lambda t: hmha_ref.conv1d_blc(mod, t)) if conv.module == "conv1d" else mod
        out, out_bf16 = _fp32_and_autocast(conv.name, lambda: run(torch.from_numpy(x)))
        tensors = {prefix + k: v.astype(np.float32) for k, v in params.items()}
        tensors.update(x=x, output=to_numpy(out), output_autocast=to_numpy(out_bf16.float()))
        meta.update(batch=str(conv.batch), seq_len=str(conv.seq_len), seed=str(conv.seed),
                    autocast_dtype=str(out_bf16.dtype), torch_version=torch_version(), description=conv.description)
        entries.append({"name": conv.name, "files": {"f32": write_case(family_dir, conv.name, "f32", tensors, meta)},
                        **{k: meta[k] for k in sorted(meta)}})
    return entries


# =====================================================================================================
# Family "c2f": the coarse-to-fine attention article's CoarseAttention / FineAttention / C2FAttention (c2f_reference.py)
# =====================================================================================================

C2F_MODULES = ("c2f", "coarse", "fine")
C2F_MASK_KEEP_PROBABILITY = 0.6  # random keep masks: each entry kept (True) with this probability


@dataclass(frozen=True)
class C2fCase:
    name: str
    seed: int
    description: str
    module: str  # "c2f" (C2FAttention) | "coarse" (CoarseAttention) | "fine" (FineAttention)
    seq_len: int  # c2f: L (tokens); coarse and fine: m (chunks)
    chunk: int = 0  # c2f: chunk_size; fine: chunk length k; coarse: unused
    d_model: int = 16
    n_heads: int = 4
    batch: int = 2
    coarse_mask: Optional[str] = None  # "random" (c2f: coarse_mask [B, m, m]; coarse: mask)
    fine_mask: Optional[str] = None  # "per_token" | "per_chunk_key" (c2f: fine_mask [B, m, k, k]; fine: mask)

    @property
    def num_chunks(self) -> int:
        if self.module == "c2f":
            return c2f_ref.C2FAttention.num_chunks(self.seq_len, self.chunk)
        return self.seq_len

    @property
    def chunk_len(self) -> int:
        return self.chunk  # k of the (padded) chunk grid

    def real_keys(self) -> np.ndarray:
        """[m, k] bool: True where the position of the chunk grid holds a real (not padded) token."""
        m, k = self.num_chunks, self.chunk_len
        if self.module != "c2f":
            return np.ones((m, k), dtype=bool)
        return (np.arange(m * k) < self.seq_len).reshape(m, k)


C2F_CASES: List[C2fCase] = [
    # --- C2FAttention, no masks ----------------------------------------------------------------------
    C2fCase("c2f_l64_c8", 4101, "C2FAttention, L divisible by chunk_size (no padding), no masks",
            "c2f", 64, 8),
    C2fCase("c2f_l61_c8", 4102, "C2FAttention, L = 61 not divisible by 8: last chunk has 5 real tokens",
            "c2f", 61, 8),
    C2fCase("c2f_l5_c8", 4103, "C2FAttention, L = 5 < chunk_size 8: one partial chunk", "c2f", 5, 8),
    C2fCase("c2f_l13_c1", 4104, "C2FAttention, chunk_size 1: every token is its own chunk", "c2f", 13, 1),
    C2fCase("c2f_l24_c24", 4105, "C2FAttention, chunk_size = L: a single full chunk", "c2f", 24, 24),
    C2fCase("c2f_l100_c32", 4106, "C2FAttention, L = 100, chunk 32: last chunk has 4 real tokens",
            "c2f", 100, 32),
    C2fCase("c2f_l37_c16", 4107, "C2FAttention, L = 37, chunk 16: last chunk has 5 real tokens",
            "c2f", 37, 16),
    # --- C2FAttention with masks ---------------------------------------------------------------------
    C2fCase("c2f_coarse_mask_l64_c8", 4201, "C2FAttention, random BOOL coarse_mask [B, m, m] (True = keep)",
            "c2f", 64, 8, coarse_mask="random"),
    C2fCase("c2f_coarse_mask_l61_c8", 4202,
            "C2FAttention with padding, random BOOL coarse_mask [B, m, m] (True = keep)",
            "c2f", 61, 8, coarse_mask="random"),
    C2fCase("c2f_fine_mask_tokens_l64_c8", 4301,
            "C2FAttention, random per-token BOOL fine_mask [B, m, k, k] (query rows differ)",
            "c2f", 64, 8, fine_mask="per_token"),
    C2fCase("c2f_fine_mask_tokens_l61_c8", 4302,
            "C2FAttention with padding, random per-token BOOL fine_mask [B, m, k, k] over the padded grid "
            "(query rows differ; padded keys are masked whatever the mask says)",
            "c2f", 61, 8, fine_mask="per_token"),
    C2fCase("c2f_fine_mask_keys_l61_c8", 4303,
            "C2FAttention with padding, per-chunk key BOOL fine_mask [B, m, k, k]: all query rows of a "
            "chunk equal",
            "c2f", 61, 8, fine_mask="per_chunk_key"),
    C2fCase("c2f_both_masks_l61_c8", 4401,
            "C2FAttention with padding, random BOOL coarse_mask and per-token BOOL fine_mask",
            "c2f", 61, 8, coarse_mask="random", fine_mask="per_token"),
    # --- C2FAttention shapes -------------------------------------------------------------------------
    C2fCase("c2f_head_dim3_l37_c8", 4501, "C2FAttention, d_model 24 with 8 heads (head dim 3), L = 37",
            "c2f", 37, 8, d_model=24, n_heads=8),
    C2fCase("c2f_single_head_b1_l20_c4", 4502, "C2FAttention, batch 1, one head, d_model 8, L = 20, chunk 4",
            "c2f", 20, 4, d_model=8, n_heads=1, batch=1),
    # --- CoarseAttention alone -----------------------------------------------------------------------
    C2fCase("coarse_m1", 4601, "CoarseAttention, a single chunk", "coarse", 1),
    C2fCase("coarse_m1_mask", 4602, "CoarseAttention, a single chunk, BOOL mask [B, 1, 1] (all True)",
            "coarse", 1, coarse_mask="random"),
    C2fCase("coarse_m7", 4603, "CoarseAttention, 7 chunks", "coarse", 7),
    C2fCase("coarse_m7_mask", 4604, "CoarseAttention, 7 chunks, random BOOL mask [B, m, m] (True = keep)",
            "coarse", 7, coarse_mask="random"),
    # --- FineAttention alone -------------------------------------------------------------------------
    C2fCase("fine_m3_k4", 4701, "FineAttention, 3 chunks of 4 tokens", "fine", 3, 4),
    C2fCase("fine_m3_k4_mask", 4702,
            "FineAttention, 3 chunks of 4 tokens, random per-token BOOL mask [B, m, k, k] (True = keep)",
            "fine", 3, 4, fine_mask="per_token"),
    C2fCase("fine_m5_k1", 4703, "FineAttention, 5 chunks of 1 token", "fine", 5, 1),
    C2fCase("fine_m5_k1_mask", 4704, "FineAttention, 5 chunks of 1 token, BOOL mask [B, m, 1, 1] (all True)",
            "fine", 5, 1, fine_mask="per_token"),
]


def _keep_one_real(rs, keep: np.ndarray, real: np.ndarray) -> None:
    """keep [n], real [n] bool: if no real position is kept, keep one random real position (in place)."""
    if not (keep & real).any():
        idx = np.flatnonzero(real)
        keep[idx[rs.randint(len(idx))]] = True


def _c2f_coarse_mask(rs, c: C2fCase) -> np.ndarray:
    """[B, m, m] bool, True = keep; every query row keeps at least one chunk."""
    m = c.num_chunks
    keep = rs.uniform(size=(c.batch, m, m)) < C2F_MASK_KEEP_PROBABILITY
    all_real = np.ones(m, dtype=bool)  # every chunk holds at least one real token
    for bi in range(c.batch):
        for i in range(m):
            _keep_one_real(rs, keep[bi, i], all_real)
    return keep


def _c2f_fine_mask(rs, c: C2fCase) -> np.ndarray:
    """[B, m, k, k] bool over the padded chunk grid, True = keep. Every query row (padded ones included)
    keeps at least one REAL key, so no row is fully masked once the padded keys are masked too."""
    B, m, k = c.batch, c.num_chunks, c.chunk_len
    real = c.real_keys()
    if c.fine_mask == "per_chunk_key":
        key_keep = rs.uniform(size=(B, m, k)) < C2F_MASK_KEEP_PROBABILITY
        for bi in range(B):
            for j in range(m):
                _keep_one_real(rs, key_keep[bi, j], real[j])
        return np.ascontiguousarray(np.repeat(key_keep[:, :, None, :], k, axis=2))
    if c.fine_mask == "per_token":
        keep = rs.uniform(size=(B, m, k, k)) < C2F_MASK_KEEP_PROBABILITY
        for bi in range(B):
            for j in range(m):
                for r in range(k):
                    _keep_one_real(rs, keep[bi, j, r], real[j])
        return keep
    raise ValueError(f"{c.name}: unknown fine_mask kind {c.fine_mask!r}")


def _c2f_parameters(c: C2fCase) -> Dict[str, np.ndarray]:
    """float64 values for every entry of the module's state_dict (names relative to the module)."""
    rs = stream(c.seed, "weights")
    d = c.d_model
    p = {}
    if c.module in ("c2f", "coarse"):
        pre = "coarse_attn." if c.module == "c2f" else ""
        # Three [d, d] blocks (q, k, v), each Glorot-uniform for its own fan-in/fan-out.
        p[pre + "qkv_proj.weight"] = np.concatenate([glorot_uniform(rs, d, d) for _ in range(3)], axis=0)
        p[pre + "qkv_proj.bias"] = bias_uniform(rs, 3 * d)
        p[pre + "out_proj.weight"] = glorot_uniform(rs, d, d)
        p[pre + "out_proj.bias"] = bias_uniform(rs, d)
    if c.module in ("c2f", "fine"):
        pre = "fine_attn." if c.module == "c2f" else ""
        p[pre + "q_proj.weight"] = glorot_uniform(rs, d, d)
        p[pre + "q_proj.bias"] = bias_uniform(rs, d)
        p[pre + "kv_proj.weight"] = np.concatenate([glorot_uniform(rs, d, d) for _ in range(2)], axis=0)
        p[pre + "kv_proj.bias"] = bias_uniform(rs, 2 * d)
        p[pre + "out_proj.weight"] = glorot_uniform(rs, d, d)
        p[pre + "out_proj.bias"] = bias_uniform(rs, d)
    return p


def _c2f_inputs(c: C2fCase) -> Dict[str, np.ndarray]:
    rs = stream(c.seed, "inputs")
    B, d = c.batch, c.d_model
    if c.module == "c2f":
        return {"x": rs.standard_normal(size=(B, c.seq_len, d))}
    if c.module == "coarse":
        return {"x": rs.standard_normal(size=(B, c.num_chunks, d))}
    return {"x": rs.standard_normal(size=(B, c.num_chunks, c.chunk_len, d)),
            "coarse_context": rs.standard_normal(size=(B, c.num_chunks, d))}


def _run_c2f(c: C2fCase, dtype_tag: str, params, inputs, coarse_mask, fine_mask):
    np_dt, t_dt = DTYPES[dtype_tag]
    if c.module == "c2f":
        mod = c2f_ref.C2FAttention(c.d_model, c.n_heads, chunk_size=c.chunk)
    elif c.module == "coarse":
        mod = c2f_ref.CoarseAttention(c.d_model, c.n_heads)
    else:
        mod = c2f_ref.FineAttention(c.d_model, c.n_heads)
    if t_dt == torch.float64:
        mod = mod.double()
    sd_names = set(mod.state_dict().keys())
    if sd_names != set(params):
        raise RuntimeError(f"{c.name}: state_dict keys {sorted(sd_names)} != generated {sorted(params)}")
    mod.load_state_dict({k: torch.from_numpy(v.astype(np_dt)) for k, v in params.items()}, strict=True)
    mod.eval()  # dropout is the identity

    t = {k: torch.from_numpy(v.astype(np_dt)) for k, v in inputs.items()}
    cm = None if coarse_mask is None else torch.from_numpy(coarse_mask)
    fm = None if fine_mask is None else torch.from_numpy(fine_mask)
    extra = {}
    with torch.no_grad():
        if c.module == "c2f":
            def hook(_module, args, result):
                extra["coarse_input"] = to_numpy(args[0])
                extra["coarse_output"] = to_numpy(result)
            handle = mod.coarse_attn.register_forward_hook(hook)
            try:
                out = mod(t["x"], coarse_mask=cm, fine_mask=fm)
            finally:
                handle.remove()
        elif c.module == "coarse":
            out = mod(t["x"], mask=cm)
        else:
            out = mod(t["x"], t["coarse_context"], mask=fm)
    sd = {k: to_numpy(v) for k, v in mod.state_dict().items()}
    return sd, to_numpy(out), extra


def _c2f_case_files(family_dir: Path, c: C2fCase) -> dict:
    if c.module not in C2F_MODULES:
        raise ValueError(f"{c.name}: unknown module {c.module!r}")
    if c.d_model % c.n_heads:
        raise ValueError(f"{c.name}: d_model {c.d_model} not divisible by n_heads {c.n_heads}")
    if (c.module == "coarse") != (c.chunk == 0):
        raise ValueError(f"{c.name}: chunk must be set for c2f/fine cases and only for them")
    if (c.coarse_mask and c.module == "fine") or (c.fine_mask and c.module == "coarse"):
        raise ValueError(f"{c.name}: mask kind does not fit module {c.module}")
    B, m, k, d = c.batch, c.num_chunks, c.chunk_len, c.d_model

    params = _c2f_parameters(c)
    inputs = _c2f_inputs(c)
    coarse_mask = _c2f_coarse_mask(stream(c.seed, "coarse_mask"), c) if c.coarse_mask else None
    fine_mask = _c2f_fine_mask(stream(c.seed, "fine_mask"), c) if c.fine_mask else None

    # Fixture contract (c2f's C++ layer gives zero for a row with every key masked, the -1e9 fill a uniform
    # average): every query row keeps at least one chunk, every fine query row at least one real key.
    if coarse_mask is not None and not coarse_mask.any(axis=-1).all():
        raise RuntimeError(f"{c.name}: a coarse mask row masks every chunk")
    if c.module != "coarse":
        fine_keep = np.broadcast_to(c.real_keys()[None, :, None, :], (B, m, k, k))
        if fine_mask is not None:
            fine_keep = fine_keep & fine_mask
        if not fine_keep.any(axis=-1).all():
            raise RuntimeError(f"{c.name}: a fine query row has no kept real key")
    rows_equal = fine_mask is None or bool((fine_mask == fine_mask[:, :, :1, :]).all())
    if c.fine_mask == "per_chunk_key" and not rows_equal:
        raise RuntimeError(f"{c.name}: per-chunk key mask has differing rows")
    if c.fine_mask == "per_token" and k > 1 and rows_equal:
        raise RuntimeError(f"{c.name}: per-token mask happens to have equal rows; pick another seed")

    mask_kind = lambda mk: "none" if mk is None else "bool"  # noqa: E731
    base_meta = {"module": c.module, "d_model": str(d), "n_heads": str(c.n_heads), "batch": str(B),
                 "seq_len": str(c.seq_len), "num_chunks": str(m)}
    if c.module == "c2f":
        base_meta.update(chunk_size=str(c.chunk), coarse_mask=mask_kind(coarse_mask),
                         fine_mask=mask_kind(fine_mask), fine_mask_rows_equal=b(rows_equal))
    elif c.module == "coarse":
        base_meta.update(mask=mask_kind(coarse_mask))
    else:
        base_meta.update(chunk_len=str(k), mask=mask_kind(fine_mask), fine_mask_rows_equal=b(rows_equal))
    base_meta.update(seed=str(c.seed), torch_version=torch_version(), description=c.description)

    out_shape = {"c2f": (B, c.seq_len, d), "coarse": (B, m, d), "fine": (B, m, k, d)}[c.module]
    files = {}
    for tag, (np_dt, _) in DTYPES.items():
        sd, out, extra = _run_c2f(c, tag, params, inputs, coarse_mask, fine_mask)
        if out.shape != out_shape or not np.isfinite(out).all():
            raise RuntimeError(f"{c.name}/{tag}: output shape {out.shape} (expected {out_shape}) or not finite")
        for name, v in extra.items():
            if v.shape != (B, m, d):
                raise RuntimeError(f"{c.name}/{tag}: {name} has shape {v.shape}")

        prefix = f"{c.module}."
        tensors = {prefix + k_: v for k_, v in sd.items()}
        for k_, v in params.items():  # the module must hold exactly the numpy values
            if not np.array_equal(tensors[prefix + k_], v.astype(np_dt)):
                raise RuntimeError(f"{c.name}/{tag}: parameter {k_} was not loaded exactly")
        tensors.update({k_: v.astype(np_dt) for k_, v in inputs.items()})
        if c.module == "c2f":
            if coarse_mask is not None:
                tensors["coarse_mask"] = coarse_mask
            if fine_mask is not None:
                tensors["fine_mask"] = fine_mask
        elif c.module == "coarse" and coarse_mask is not None:
            tensors["mask"] = coarse_mask
        elif c.module == "fine" and fine_mask is not None:
            tensors["mask"] = fine_mask
        tensors["output"] = out
        tensors.update(extra)
        for k_, v in tensors.items():
            if v.dtype != bool and v.dtype != np_dt:
                raise RuntimeError(f"{c.name}/{tag}: tensor {k_} has dtype {v.dtype}")
        files[tag] = write_case(family_dir, c.name, tag, tensors, base_meta)

    return {"name": c.name, "files": files, **{k_: base_meta[k_] for k_ in sorted(base_meta)}}


@register_family(
    "c2f", computed=("output", "coarse_input", "coarse_output"),
    description="the coarse-to-fine attention article's C2FAttention / CoarseAttention / FineAttention "
                "(c2f_reference.py): padding, coarse and fine keep-masks")
def gen_c2f(family_dir: Path) -> List[dict]:
    names = [c.name for c in C2F_CASES]
    if len(set(names)) != len(names) or len({c.seed for c in C2F_CASES}) != len(C2F_CASES):
        raise RuntimeError("C2F case names and seeds must be unique")
    return [_c2f_case_files(family_dir, c) for c in C2F_CASES]


# =====================================================================================================
# Family "conv1d": torch.nn.Conv1d in c2f's [B, L, C] layout, and the C3K2/HMHA article's C3K2Projection
# =====================================================================================================

def conv_uniform(rs: np.random.RandomState, shape: Tuple[int, ...], fan_in: int) -> np.ndarray:
    """Convolution weights ~ U(-a, a), a = 1 / sqrt(fan_in) (fan_in = in_channels / groups * kernel_size,
    the bound of torch's default Conv1d init)."""
    a = 1.0 / math.sqrt(fan_in)
    return rs.uniform(-a, a, size=shape)


def _load_exactly(mod: torch.nn.Module, params: Dict[str, np.ndarray], np_dt, case: str) -> None:
    """load_state_dict(strict=True) from float64 numpy values cast to np_dt, then verify the values."""
    sd_names = set(mod.state_dict().keys())
    if sd_names != set(params):
        raise RuntimeError(f"{case}: state_dict keys {sorted(sd_names)} != generated {sorted(params)}")
    mod.load_state_dict({k: torch.from_numpy(v.astype(np_dt)) for k, v in params.items()}, strict=True)
    mod.eval()
    for k, v in mod.state_dict().items():
        if not np.array_equal(to_numpy(v), params[k].astype(np_dt)):
            raise RuntimeError(f"{case}: parameter {k} was not loaded exactly")


def _check_dtypes(case: str, tensors: Dict[str, np.ndarray], np_dt) -> None:
    for k, v in tensors.items():
        if v.dtype != np_dt:
            raise RuntimeError(f"{case}: tensor {k} has dtype {v.dtype}")


CONV1D_MODULES = ("conv1d", "c3k2")


@dataclass(frozen=True)
class ConvCase:
    name: str
    seed: int
    description: str
    module: str  # "conv1d" (torch.nn.Conv1d) | "c3k2" (hmha_reference.C3K2Projection)
    seq_len: int
    batch: int = 2
    # conv1d
    in_channels: int = 8
    out_channels: int = 6
    kernel_size: int = 3
    padding: int = 0
    groups: int = 1
    bias: bool = True
    # c3k2
    dim: int = 16
    heads: int = 4
    causal: bool = False

    @property
    def out_len(self) -> int:
        if self.module == "c3k2":
            return self.seq_len
        return self.seq_len + 2 * self.padding - self.kernel_size + 1


def _conv(name, seed, description, k, p, g, L=13, **kw) -> ConvCase:
    return ConvCase(name, seed, description, "conv1d", L, kernel_size=k, padding=p, groups=g, **kw)


CONV1D_CASES: List[ConvCase] = [
    # --- kernel size x groups x padding 0 / k // 2 (L = 13, in 8, out 6) ------------------------------
    _conv("conv_k1_p0_g1", 5101, "Conv1d k=1 (pointwise), no padding", 1, 0, 1),
    _conv("conv_k1_p0_g2", 5102, "Conv1d k=1, groups 2 (4 in / 3 out channels per group)", 1, 0, 2),
    _conv("conv_k3_p0_g1", 5103, "Conv1d k=3, padding 0: L_out = L - 2", 3, 0, 1),
    _conv("conv_k3_p1_g1", 5104, "Conv1d k=3, padding 1 (same length)", 3, 1, 1),
    _conv("conv_k3_p0_g2", 5105, "Conv1d k=3, padding 0, groups 2", 3, 0, 2),
    _conv("conv_k3_p1_g2", 5106, "Conv1d k=3, padding 1, groups 2", 3, 1, 2),
    _conv("conv_k5_p0_g1", 5107, "Conv1d k=5, padding 0: L_out = L - 4", 5, 0, 1),
    _conv("conv_k5_p2_g1", 5108, "Conv1d k=5, padding 2 (same length)", 5, 2, 1),
    _conv("conv_k5_p0_g2", 5109, "Conv1d k=5, padding 0, groups 2", 5, 0, 2),
    _conv("conv_k5_p2_g2", 5110, "Conv1d k=5, padding 2, groups 2", 5, 2, 2),
    # --- edges ---------------------------------------------------------------------------------------
    _conv("conv_k3_p1_l1", 5201, "Conv1d k=3, padding 1, L = 1: only the centre tap sees data", 3, 1, 1, L=1),
    _conv("conv_k3_p2_g1", 5202, "Conv1d k=3, padding 2 > k // 2: L_out = L + 2, border outputs "
          "see a single real tap", 3, 2, 1),
    _conv("conv_k1_p1_g1", 5203, "Conv1d k=1, padding 1: the first and last outputs are the bias alone",
          1, 1, 1),
    _conv("conv_k5_p2_l3", 5204, "Conv1d k=5, padding 2, L = 3 < k: every output window reaches into "
          "the padding", 5, 2, 1, L=3),
    _conv("conv_k5_p0_l5", 5205, "Conv1d k=5, padding 0, L = k: a single output position", 5, 0, 1, L=5),
    _conv("conv_k3_p1_nobias", 5206, "Conv1d k=3, padding 1, bias=False (no conv.bias tensor)", 3, 1, 1,
          bias=False),
    _conv("conv_depthwise_k3_p1", 5207, "Conv1d in 4, out 8, groups 4 (depthwise, 2 outputs per input "
          "channel), k=3, padding 1", 3, 1, 4, in_channels=4, out_channels=8),
    _conv("conv_k3_p1_b1_l64", 5208, "Conv1d k=3, padding 1, batch 1, L = 64, in 16, out 8 (C3K2's conv3 "
          "shape)", 3, 1, 1, L=64, batch=1, in_channels=16, out_channels=8),
    # --- C3K2Projection ------------------------------------------------------------------------------
    ConvCase("c3k2_d16_l1", 5301, "C3K2Projection dim 16: conv3 (k=3, padding 1) -> 8 | conv2 (k=1) -> 8, "
             "L = 1", "c3k2", 1),
    ConvCase("c3k2_d16_l7", 5302, "C3K2Projection dim 16, L = 7", "c3k2", 7),
    ConvCase("c3k2_d16_l64", 5303, "C3K2Projection dim 16, L = 64", "c3k2", 64),
    ConvCase("c3k2_d15_l13", 5304, "C3K2Projection odd dim 15 (heads 3): conv3 -> 7 channels | conv2 -> 8",
             "c3k2", 13, dim=15, heads=3),
    ConvCase("c3k2_d15_l2", 5305, "C3K2Projection odd dim 15 (heads 3), L = 2", "c3k2", 2, dim=15, heads=3),
    ConvCase("c3k2_causal_d16_l1", 5401, "causal C3K2Projection dim 16, L = 1: conv3 = Conv1d(k=3, padding 0) "
             "on F.pad(x, (2, 0)), only the last tap sees data", "c3k2", 1, causal=True),
    ConvCase("c3k2_causal_d16_l7", 5402, "causal C3K2Projection dim 16, L = 7: output i reads x[i-2 .. i]",
             "c3k2", 7, causal=True),
    ConvCase("c3k2_causal_d15_l13", 5403, "causal C3K2Projection odd dim 15 (heads 3), L = 13", "c3k2", 13,
             dim=15, heads=3, causal=True),
]


def _c3k2_parameters(rs: np.random.RandomState, dim: int, prefix: str = "") -> Dict[str, np.ndarray]:
    """conv3 [dim // 2, dim, 3] and conv2 [dim - dim // 2, dim, 1], weights U(+-1/sqrt(fan_in))."""
    d3, d2 = dim // 2, dim - dim // 2
    p = {}
    p[prefix + "conv3.weight"] = conv_uniform(rs, (d3, dim, 3), 3 * dim)
    p[prefix + "conv3.bias"] = bias_uniform(rs, d3)
    p[prefix + "conv2.weight"] = conv_uniform(rs, (d2, dim, 1), dim)
    p[prefix + "conv2.bias"] = bias_uniform(rs, d2)
    return p


def _conv_case_files(family_dir: Path, c: ConvCase) -> dict:
    if c.module not in CONV1D_MODULES:
        raise ValueError(f"{c.name}: unknown module {c.module!r}")
    rs = stream(c.seed, "weights")
    if c.module == "conv1d":
        if c.in_channels % c.groups or c.out_channels % c.groups:
            raise ValueError(f"{c.name}: channels not divisible by groups")
        if c.out_len < 1:
            raise ValueError(f"{c.name}: empty output")
        cin_g = c.in_channels // c.groups
        params = {"weight": conv_uniform(rs, (c.out_channels, cin_g, c.kernel_size), cin_g * c.kernel_size)}
        if c.bias:
            params["bias"] = bias_uniform(rs, c.out_channels)
        c_in, c_out, prefix = c.in_channels, c.out_channels, "conv."
        meta = {"module": "conv1d", "in_channels": str(c.in_channels), "out_channels": str(c.out_channels),
                "kernel_size": str(c.kernel_size), "padding": str(c.padding), "groups": str(c.groups),
                "bias": b(c.bias), "batch": str(c.batch), "seq_len": str(c.seq_len),
                "out_len": str(c.out_len)}
    else:
        if c.dim % c.heads:
            raise ValueError(f"{c.name}: dim not divisible by heads")
        params = _c3k2_parameters(rs, c.dim)
        c_in = c_out = c.dim
        prefix = "c3k2."
        meta = {"module": "c3k2", "dim": str(c.dim), "heads": str(c.heads), "batch": str(c.batch),
                "seq_len": str(c.seq_len), "causal": b(c.causal)}
    meta.update(seed=str(c.seed), torch_version=torch_version(), description=c.description)
    x = stream(c.seed, "inputs").standard_normal(size=(c.batch, c.seq_len, c_in))

    files = {}
    for tag, (np_dt, t_dt) in DTYPES.items():
        if c.module == "conv1d":
            mod = torch.nn.Conv1d(c.in_channels, c.out_channels, c.kernel_size, padding=c.padding,
                                  groups=c.groups, bias=c.bias)
        else:
            mod = hmha_ref.C3K2Projection(c.dim, c.heads, c.causal)
        if t_dt == torch.float64:
            mod = mod.double()
        _load_exactly(mod, params, np_dt, c.name)
        with torch.no_grad():
            xt = torch.from_numpy(x.astype(np_dt))
            out = to_numpy(hmha_ref.conv1d_blc(mod, xt) if c.module == "conv1d" else mod(xt))
        if out.shape != (c.batch, c.out_len, c_out) or not np.isfinite(out).all():
            raise RuntimeError(f"{c.name}/{tag}: output shape {out.shape} or not finite")
        tensors = {prefix + k: v.astype(np_dt) for k, v in params.items()}
        tensors["x"] = x.astype(np_dt)
        tensors["output"] = out
        _check_dtypes(c.name, tensors, np_dt)
        files[tag] = write_case(family_dir, c.name, tag, tensors, meta)
    return {"name": c.name, "files": files, **{k: meta[k] for k in sorted(meta)}}


@register_family(
    "conv1d", computed=("output",),
    description="torch.nn.Conv1d in [B, L, C] layout (kernel, padding, groups, bias) and the C3K2/HMHA article's "
                "C3K2Projection (hmha_reference.py)")
def gen_conv1d(family_dir: Path) -> List[dict]:
    names = [c.name for c in CONV1D_CASES]
    if len(set(names)) != len(names) or len({c.seed for c in CONV1D_CASES}) != len(CONV1D_CASES):
        raise RuntimeError("conv1d case names and seeds must be unique")
    return [_conv_case_files(family_dir, c) for c in CONV1D_CASES]


# =====================================================================================================
# Family "hmha": the C3K2/HMHA article's hierarchical multi-head attention, dense formulation (hmha_reference.py)
# =====================================================================================================

# Output tensor -> the attention levels switched on.
HMHA_OUTPUTS = {"output_l1": (1,), "output_l2": (2,), "output_l3": (3,), "output_all": (1, 2, 3)}
HMHA_GRID_L = (1, 5, 64, 150, 257)
HMHA_GRID_W = (4, 16, 64)


@dataclass(frozen=True)
class HmhaCase:
    name: str
    seed: int  # shared by all cases of one problem (L, dim, heads, batch): same weights and x
    description: str
    seq_len: int
    window: int
    causal: bool
    dim: int = 16
    heads: int = 4
    batch: int = 2

    @property
    def num_windows(self) -> int:
        return hmha_ref.num_windows(self.seq_len, self.window)


def _hmha_cases() -> List[HmhaCase]:
    cases = []

    def add(L, W, dim, heads, batch, seed, what):
        for causal in (False, True):
            m = hmha_ref.num_windows(L, W)
            last = L - (m - 1) * W
            desc = (f"HMHA {what}, L = {L}, window {W}: {m} window(s), the last with {last} token(s)"
                    f"{', causal' if causal else ''}; weights and x shared by every hmha case of seed {seed}")
            name = f"hmha{'_dh3' if dim == 24 else ''}_l{L}_w{W}{'_causal' if causal else ''}"
            cases.append(HmhaCase(name, seed, desc, L, W, causal, dim, heads, batch))

    for L in HMHA_GRID_L:
        batch = 2 if L <= 64 else 1  # keeps the family under ~6 MB
        for W in HMHA_GRID_W:
            add(L, W, 16, 4, batch, 6000 + L, f"dim 16, 4 heads (dh 4), batch {batch}")
    add(37, 8, 24, 8, 2, 6800 + 37, "dim 24, 8 heads (dh 3), batch 2")
    return cases


HMHA_CASES: List[HmhaCase] = _hmha_cases()


def _hmha_parameters(c: HmhaCase) -> Dict[str, np.ndarray]:
    rs = stream(c.seed, "weights")
    p = {}
    for proj in ("q_proj", "k_proj", "v_proj"):
        p.update(_c3k2_parameters(rs, c.dim, prefix=proj + "."))
    p["out_proj.weight"] = glorot_uniform(rs, c.dim, c.dim)
    p["out_proj.bias"] = bias_uniform(rs, c.dim)
    return p


def _plain_attention(mod: "hmha_ref.HMHA", x: torch.Tensor, causal: bool) -> torch.Tensor:
    """out_proj(softmax(q k^T / sqrt(dh)) v) over ALL tokens (causal: t <= i), same projections."""
    q, k, v = (mod.split_heads(t) for t in mod.project(x))
    s = (q @ k.transpose(-2, -1)) / math.sqrt(mod.head_dim)
    if causal:
        L = x.shape[1]
        s = s.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v
    return mod.out_proj(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], mod.dim))


def _hmha_metamorphic_check(c: HmhaCase, params, x: np.ndarray) -> None:
    """Assert: with W >= L and only level 1 on, HMHA is plain softmax attention over all tokens."""
    xt = torch.from_numpy(x)
    for W in (c.seq_len, c.seq_len + 3):
        mod = hmha_ref.HMHA(c.dim, c.heads, window=W, levels=(1,), causal=c.causal).double()
        _load_exactly(mod, params, np.float64, c.name)
        with torch.no_grad():
            diff = float((mod(xt) - _plain_attention(mod, xt, c.causal)).abs().max())
        if not diff <= 1e-12:
            raise AssertionError(f"{c.name}: level 1 with window {W} >= L differs from plain attention "
                                 f"by {diff:g}")


def _hmha_case_files(family_dir: Path, c: HmhaCase) -> dict:
    if c.dim % c.heads:
        raise ValueError(f"{c.name}: dim not divisible by heads")
    B, L, d = c.batch, c.seq_len, c.dim
    params = _hmha_parameters(c)
    x = stream(c.seed, "inputs").standard_normal(size=(B, L, d))
    _hmha_metamorphic_check(c, params, x)

    meta = {"module": "hmha", "dim": str(d), "heads": str(c.heads), "window": str(c.window),
            "causal": b(c.causal), "batch": str(B), "seq_len": str(L), "num_windows": str(c.num_windows),
            "seed": str(c.seed), "torch_version": torch_version(), "description": c.description}
    files = {}
    for tag, (np_dt, t_dt) in DTYPES.items():
        tensors = {"hmha." + k: v.astype(np_dt) for k, v in params.items()}
        tensors["x"] = x.astype(np_dt)
        xt = torch.from_numpy(tensors["x"])
        qkv = None
        for out_name, levels in HMHA_OUTPUTS.items():
            mod = hmha_ref.HMHA(d, c.heads, window=c.window, levels=levels, causal=c.causal)
            if t_dt == torch.float64:
                mod = mod.double()
            _load_exactly(mod, params, np_dt, c.name)
            with torch.no_grad():
                out, proj = mod(xt, return_qkv=True)
            out, proj = to_numpy(out), tuple(to_numpy(t) for t in proj)
            if out.shape != (B, L, d) or not np.isfinite(out).all():
                raise RuntimeError(f"{c.name}/{tag}: {out_name} shape {out.shape} or not finite")
            if qkv is not None and not all(np.array_equal(a, b_) for a, b_ in zip(qkv, proj)):
                raise RuntimeError(f"{c.name}/{tag}: q/k/v differ between level configurations")
            qkv = proj
            tensors[out_name] = out
        tensors.update(q=qkv[0], k=qkv[1], v=qkv[2])
        _check_dtypes(c.name, tensors, np_dt)
        files[tag] = write_case(family_dir, c.name, tag, tensors, meta)
    return {"name": c.name, "files": files, **{k: meta[k] for k in sorted(meta)}}


@register_family(
    "hmha", computed=tuple(HMHA_OUTPUTS) + ("q", "k", "v"),
    description="the C3K2/HMHA article's HMHA (C3K2 q/k/v projections; local window, cross-window and power-of-two "
                "sparse levels), dense reference (hmha_reference.py)")
def gen_hmha(family_dir: Path) -> List[dict]:
    names = [c.name for c in HMHA_CASES]
    if len(set(names)) != len(names):
        raise RuntimeError("HMHA case names must be unique")
    problems = {}
    for c in HMHA_CASES:  # one seed per problem (L, dim, heads, batch); cases differ by window / causal
        if problems.setdefault(c.seed, (c.seq_len, c.dim, c.heads, c.batch)) != (c.seq_len, c.dim, c.heads,
                                                                                  c.batch):
            raise RuntimeError(f"{c.name}: seed {c.seed} reused for a different problem")
    return [_hmha_case_files(family_dir, c) for c in HMHA_CASES]


# =====================================================================================================
# Family "sparse": SparseC2FAttention, coarse-guided top-k chunk-sparse attention with the weights of a
# torch.nn.MultiheadAttention (sparse_reference.py)
# =====================================================================================================

SPARSE_AR_RHO = 0.9  # x = AR(1) walk per feature (a leaky cumulative sum of Gaussian steps) + noise
SPARSE_NOISE = 0.3
SPARSE_MAX_ATTEMPTS = 100  # re-seeds per case (seed, seed + 1, ...); case seeds are 100 apart
SPARSE_COVER_TOL = {"f32": 1e-5, "f64": 1e-12}  # |output - mha_output| when top_k >= m


@dataclass(frozen=True)
class SparseCase:
    name: str
    seed: int  # first seed tried; the one used (seed + attempt) goes into the metadata
    description: str
    seq_len: int
    chunk: int
    top_k: int
    causal: bool
    batch: int = 2
    embed_dim: int = 16
    num_heads: int = 4
    lengths: Tuple[int, ...] = ()  # non-empty: bool key_padding_mask with these valid lengths
    require_empty_rows: bool = False  # re-seed until some (b, h, query) has no allowed key
    gating: str = "chunk"  # "chunk" (one selection per query chunk) or "token" (per query position)

    @property
    def num_chunks(self) -> int:
        return sparse_ref.num_chunks(self.seq_len, self.chunk)

    @property
    def selection_rows(self) -> int:
        return self.num_chunks if self.gating == "chunk" else self.seq_len

    @property
    def covers_all(self) -> bool:
        return self.top_k >= self.num_chunks


def _sparse_cases() -> List[SparseCase]:
    cases = []
    seed = 7000
    for L in (37, 128):
        batch = 2 if L <= 64 else 1  # keeps the family small
        for chunk in (8, 16):
            for top_k in (1, 2, 4):
                # per-chunk gating (seeds 7100, 7300, ...), per-token gating causal (7200, 7400, ...) and
                # non-causal (the causal case's seed + 13000)
                for gating, causal, seed_base in (("chunk", False, 0), ("token", True, 0),
                                                  ("token", False, 13000)):
                    if seed_base == 0:
                        seed += 100
                    m = sparse_ref.num_chunks(L, chunk)
                    last = L - (m - 1) * chunk
                    desc = (f"SparseC2FAttention batch {batch}, L = {L}, chunk {chunk} ({m} chunks, the last "
                            f"with {last} position(s)), top_k {top_k}, {gating} gating"
                            f"{', causal' if causal else ''}")
                    if top_k >= m:
                        desc += " (top_k >= m: output equals nn.MultiheadAttention, mha_output)"
                    tag = "tok_" if gating == "token" else ""
                    cases.append(SparseCase(f"sparse_{tag}l{L}_c{chunk}_k{top_k}{'_causal' if causal else ''}",
                                            seed + seed_base, desc, L, chunk, top_k, causal, batch=batch,
                                            gating=gating))
    cases += [
        SparseCase("sparse_kpm_l37_c8_k2", 10100,
                   "SparseC2FAttention L = 37, chunk 8, top_k 2, per-chunk gating, bool key_padding_mask "
                   "(lengths 37, 29): chunk 4 of batch 1 is entirely padded: the chunk means leave the padded "
                   "tokens out, no chunk selects chunk 4, and chunk 4's own row scores -inf everywhere",
                   37, 8, 2, False, lengths=(37, 29)),
        SparseCase("sparse_tok_kpm_l37_c8_k2_causal", 10200,
                   "SparseC2FAttention L = 37, chunk 8, top_k 2, per-token gating, causal, bool "
                   "key_padding_mask (lengths 37, 20): chunk 2 of batch 1 is partly padded (its mean is over "
                   "positions 16-19), chunk 3 entirely, so no token selects chunk 3",
                   37, 8, 2, True, lengths=(37, 20), gating="token"),
        SparseCase("sparse_tok_kpm_l37_c8_k1_causal", 10900,
                   "SparseC2FAttention L = 37, chunk 8, top_k 1 (own chunk only), per-token gating, causal, "
                   "bool key_padding_mask (lengths 37, 20): the padded tokens of chunks 3 and 4 of batch 1 "
                   "see no allowed key (zero attention, not NaN)",
                   37, 8, 1, True, lengths=(37, 20), require_empty_rows=True, gating="token"),
    ]
    for k_all, seeds in ((5, (10300, 10400, 10700)), (100, (10500, 10600, 10800))):
        for (gating, causal), seed in zip((("chunk", False), ("token", True), ("token", False)), seeds):
            tag = "tok_" if gating == "token" else ""
            top_k = k_all if gating == "chunk" else min(k_all, 9)  # per token: [B, H, L, top_k] stays small
            cases.append(SparseCase(
                f"sparse_{tag}all_l37_c8_k{top_k}{'_causal' if causal else ''}", seed,
                f"SparseC2FAttention L = 37, chunk 8 (5 chunks), top_k {top_k} >= m, {gating} gating"
                f"{', causal' if causal else ''}: every eligible chunk is selected, output equals "
                f"nn.MultiheadAttention (mha_output)", 37, 8, top_k, causal, gating=gating))
    return cases


SPARSE_CASES: List[SparseCase] = _sparse_cases()


def _sparse_parameters(seed: int, E: int) -> Dict[str, np.ndarray]:
    """nn.MultiheadAttention(E, H, batch_first=True) state_dict values, drawn as in family mha."""
    rs = stream(seed, "weights")
    return {"in_proj_weight": np.concatenate([glorot_uniform(rs, E, E) for _ in range(3)], axis=0),
            "in_proj_bias": bias_uniform(rs, 3 * E),
            "out_proj.weight": glorot_uniform(rs, E, E),
            "out_proj.bias": bias_uniform(rs, E)}


def _sparse_inputs(seed: int, B: int, L: int, E: int) -> np.ndarray:
    """x [B, L, E] with local structure: per (b, feature), w_0 = e_0, w_t = rho w_(t-1) + sqrt(1 - rho^2) e_t
    (unit variance, correlation length ~ 1 / (1 - rho) = 10 positions), x = w + 0.3 N(0, 1). Elementwise
    float64 operations only, so the values are the same on every platform."""
    rs = stream(seed, "inputs")
    steps = rs.standard_normal(size=(B, L, E))
    noise = rs.standard_normal(size=(B, L, E))
    w = np.empty((B, L, E))
    w[:, 0] = steps[:, 0]
    s = math.sqrt(1.0 - SPARSE_AR_RHO * SPARSE_AR_RHO)
    for t in range(1, L):
        w[:, t] = SPARSE_AR_RHO * w[:, t - 1] + s * steps[:, t]
    return w + SPARSE_NOISE * noise


def _sparse_mha(c: SparseCase, params: Dict[str, np.ndarray], np_dt) -> torch.nn.MultiheadAttention:
    """A real nn.MultiheadAttention(E, H, batch_first=True) holding exactly ``params`` cast to np_dt."""
    mha = torch.nn.MultiheadAttention(c.embed_dim, c.num_heads, batch_first=True)
    if np_dt == np.float64:
        mha = mha.double()
    _load_exactly(mha, params, np_dt, c.name)
    return mha


def _sparse_try_seed(c: SparseCase, seed: int, kpm: Optional[np.ndarray]):
    """Selection of one candidate seed, or the reason it is rejected."""
    B, L, E = c.batch, c.seq_len, c.embed_dim
    params = _sparse_parameters(seed, E)
    x = _sparse_inputs(seed, B, L, E)
    results = {}
    # float64 arithmetic on the float64 values (the reference), float64 arithmetic on the float32-rounded
    # values (what the f32 file holds), and float32 arithmetic (roughly what an f32 implementation does).
    for label, vals_dt, arith_dt in (("f64", np.float64, np.float64), ("f32-values", np.float32, np.float64),
                                     ("f32", np.float32, np.float32)):
        p = {k: v.astype(vals_dt).astype(arith_dt) for k, v in params.items()}
        mha = _sparse_mha(c, p, arith_dt)
        results[label] = sparse_ref.selection(mha, torch.from_numpy(x.astype(vals_dt).astype(arith_dt)),
                                              c.chunk, c.top_k, c.gating, c.causal,
                                              None if kpm is None else torch.from_numpy(kpm))
    keep, selected, margin = results["f64"]
    for label, (k2, s2, m2) in results.items():
        if not torch.equal(keep, k2) or not torch.equal(selected, s2):
            return None, f"selection in {label} differs from float64"
        if label != "f32" and float(m2.min()) < sparse_ref.MARGIN_REL:
            return None, f"margin {float(m2.min()):.3g} < {sparse_ref.MARGIN_REL:g} ({label})"
    allowed = sparse_ref.allowed_mask(keep, L, c.chunk, c.gating, c.causal,
                                      None if kpm is None else torch.from_numpy(kpm))
    empty = bool((~allowed.any(dim=-1)).any())
    if c.require_empty_rows and not empty:
        return None, "no query row without allowed key"
    min_margin = min(float(results[k][2].min()) for k in ("f64", "f32-values"))
    return dict(params=params, x=x, keep=keep, selected=selected.numpy(), empty=empty,
                margin=min_margin), ""


SPARSE_MARGINS: Dict[str, float] = {}  # case -> smallest relative selection margin (inf: no choice made)


def _sparse_case_files(family_dir: Path, c: SparseCase) -> dict:
    B, L, E, H, m = c.batch, c.seq_len, c.embed_dim, c.num_heads, c.num_chunks
    if E % H or c.top_k < 1 or c.chunk < 1:
        raise ValueError(f"{c.name}: bad shape parameters")
    kpm = None
    if c.lengths:
        if len(c.lengths) != B:
            raise ValueError(f"{c.name}: one length per batch item")
        kpm = np.arange(L)[None, :] >= np.asarray(c.lengths)[:, None]  # True = ignore that key
    reasons = []
    for attempt in range(SPARSE_MAX_ATTEMPTS):
        seed = c.seed + attempt
        sel, why = _sparse_try_seed(c, seed, kpm)
        if sel is not None:
            break
        reasons.append(f"seed {seed}: {why}")
    else:
        raise RuntimeError(f"{c.name}: no acceptable seed in {SPARSE_MAX_ATTEMPTS} attempts: {reasons[-3:]}")
    SPARSE_MARGINS[c.name] = sel["margin"]
    params, x, keep = sel["params"], sel["x"], sel["keep"]
    kpm_t = None if kpm is None else torch.from_numpy(kpm)
    own, cand = sparse_ref.own_and_candidates(L, c.chunk, c.gating, c.causal)
    eligible = (own | cand).expand(B, H, c.selection_rows, m)
    if c.covers_all and not torch.equal(keep, eligible):
        raise RuntimeError(f"{c.name}: top_k >= m but not every eligible chunk is selected")
    causal_mask = torch.ones(L, L, dtype=torch.bool).triu(diagonal=1) if c.causal else None

    # Metamorphic check (float64, every case): with every eligible chunk selected the dense sparse
    # reference is nn.MultiheadAttention on the same weights and x (causal mask, key padding mask).
    mha64 = _sparse_mha(c, params, np.float64)
    x64 = torch.from_numpy(x)
    with torch.no_grad():
        full, _ = sparse_ref.sparse_c2f_attention(mha64, x64, c.chunk, c.top_k, c.gating, c.causal, kpm_t,
                                                  keep=eligible)
        ref, _ = mha64(x64, x64, x64, key_padding_mask=kpm_t, attn_mask=causal_mask, need_weights=False)
    diff = float((full - ref).abs().max())
    if not diff <= 1e-12:
        raise AssertionError(f"{c.name}: all-chunks sparse reference differs from nn.MultiheadAttention "
                             f"by {diff:g}")

    meta = {"module": "sparse", "embed_dim": str(E), "num_heads": str(H), "chunk_size": str(c.chunk),
            "top_k": str(c.top_k), "gating": c.gating, "causal": b(c.causal), "batch": str(B), "seq_len": str(L),
            "num_chunks": str(m), "key_padding_mask": "none" if kpm is None else "bool",
            "covers_all": b(c.covers_all), "empty_rows": b(sel["empty"]), "seed": str(seed),
            "torch_version": torch_version(), "description": c.description}
    files = {}
    for tag, (np_dt, t_dt) in DTYPES.items():
        mha = _sparse_mha(c, params, np_dt)
        xt = torch.from_numpy(x.astype(np_dt))
        out, _ = sparse_ref.sparse_c2f_attention(mha, xt, c.chunk, c.top_k, c.gating, c.causal, kpm_t, keep=keep)
        out = to_numpy(out)
        if out.shape != (B, L, E) or not np.isfinite(out).all():
            raise RuntimeError(f"{c.name}/{tag}: output shape {out.shape} or not finite")
        tensors = {f"mha.{k}": to_numpy(v) for k, v in mha.state_dict().items()}
        tensors["x"] = x.astype(np_dt)
        if kpm is not None:
            tensors["key_padding_mask"] = kpm
        tensors["output"] = out
        tensors["selected"] = sel["selected"]
        if c.covers_all:
            with torch.no_grad():
                mo, _ = mha(xt, xt, xt, attn_mask=causal_mask, need_weights=False)
            mo = to_numpy(mo)
            diff = float(np.abs(mo - out).max())
            if not diff <= SPARSE_COVER_TOL[tag]:
                raise AssertionError(f"{c.name}/{tag}: output differs from nn.MultiheadAttention by {diff:g}")
            tensors["mha_output"] = mo
        for k, v in tensors.items():
            want = {"key_padding_mask": np.dtype(bool), "selected": np.dtype(np.int64)}.get(k, np.dtype(np_dt))
            if v.dtype != want:
                raise RuntimeError(f"{c.name}/{tag}: tensor {k} has dtype {v.dtype}")
        files[tag] = write_case(family_dir, c.name, tag, tensors, meta)
    return {"name": c.name, "files": files, **{k: meta[k] for k in sorted(meta)}}


@register_family(
    "sparse", computed=("output", "mha_output"),
    description="SparseC2FAttention: coarse-guided top-k chunk-sparse attention with the weights of "
                "torch.nn.MultiheadAttention, dense reference (sparse_reference.py)")
def gen_sparse(family_dir: Path) -> List[dict]:
    names = [c.name for c in SPARSE_CASES]
    seeds = [c.seed for c in SPARSE_CASES]
    if len(set(names)) != len(names) or len(set(s // 100 for s in seeds)) != len(seeds) or any(
            s % 100 for s in seeds):
        raise RuntimeError("sparse case names must be unique and seeds distinct multiples of 100")
    return [_sparse_case_files(family_dir, c) for c in SPARSE_CASES]


# =====================================================================================================
# Family "c2f2d": two-dimensional coarse-to-fine attention (the coarse-to-fine attention article's ViT
# extension) and a pyramid
# =====================================================================================================

C2F2D_TABLE_STD = 0.5  # fixture bias tables ~ N(0, 0.5^2): large enough that a wrong table entry shows


@dataclass(frozen=True)
class C2f2dCase:
    name: str
    seed: int
    description: str
    height: int
    width: int
    block_h: int = 0  # c2f2d; the pyramid's blocks are in `stages`
    block_w: int = 0
    max_blocks: Tuple[int, int] = (0, 0)  # (Gh, Gw); (0, 0) = the block grid's own (Mh, Mw)
    bias: bool = True
    module: str = "c2f2d"  # "c2f2d" (C2FAttention2D) | "pyramid" (ViTPyramid)
    stages: Tuple[Tuple[int, int, int, int], ...] = ()  # pyramid: (block_h, block_w, Gh, Gw) per stage
    d_model: int = 16
    n_heads: int = 4
    batch: int = 2

    @property
    def blocks(self) -> Tuple[int, int]:
        return c2f2d_ref.num_blocks(self.height, self.block_h), c2f2d_ref.num_blocks(self.width, self.block_w)

    @property
    def gmax(self) -> Tuple[int, int]:
        return self.max_blocks if self.max_blocks != (0, 0) else self.blocks


def _c2f2d(name, seed, what, H, W, bh, bw, max_blocks=(0, 0)):
    """The case with the bias and its twin without (seed + 1)."""
    return [C2f2dCase(name, seed, f"C2FAttention2D, {what}, relative position bias", H, W, bh, bw, max_blocks),
            C2f2dCase(name + "_nobias", seed + 1, f"C2FAttention2D, {what}, no bias", H, W, bh, bw, max_blocks,
                      bias=False)]


C2F2D_CASES: List[C2f2dCase] = [
    *_c2f2d("c2f2d_1x1_b2x2", 14001, "a 1 x 1 grid in blocks of 2 x 2: one partial block", 1, 1, 2, 2),
    *_c2f2d("c2f2d_1x37_b1x8", 14011, "a 1 x 37 grid in blocks of 1 x 8 (one row: the 1-D layer, last block 5)",
            1, 37, 1, 8),
    *_c2f2d("c2f2d_7x5_b2x3", 14021, "a 7 x 5 grid in blocks of 2 x 3: partial on both edges, table 4 x 3 > grid 4 x 2",
            7, 5, 2, 3, (4, 3)),
    *_c2f2d("c2f2d_16x16_b4x4", 14031, "a 16 x 16 grid in blocks of 4 x 4: 4 x 4 full blocks", 16, 16, 4, 4),
    *_c2f2d("c2f2d_9x13_b4x4", 14041, "a 9 x 13 grid in blocks of 4 x 4: 3 x 4 blocks, table 5 x 6",
            9, 13, 4, 4, (5, 6)),
    C2f2dCase("pyramid_14x18", 14101,
              "ViTPyramid: 14 x 18 grid, stages with blocks 2 x 2, 3 x 3, 4 x 4 and 2 x 2 patch merging "
              "(14 x 18 -> 7 x 9 -> 4 x 5, partial merge windows)",
              14, 18, module="pyramid", stages=((2, 2, 7, 9), (3, 3, 3, 3), (4, 4, 1, 2))),
]


def _c2f2d_layer_parameters(rs, d: int, heads: int, gmax: Tuple[int, int], bias: bool, pre: str) -> Dict[str, np.ndarray]:
    """float64 values for one C2FAttention2D state_dict (keys under `pre`)."""
    p = {pre + "coarse_attn.qkv_proj.weight": np.concatenate([glorot_uniform(rs, d, d) for _ in range(3)], axis=0),
         pre + "coarse_attn.qkv_proj.bias": bias_uniform(rs, 3 * d),
         pre + "coarse_attn.out_proj.weight": glorot_uniform(rs, d, d),
         pre + "coarse_attn.out_proj.bias": bias_uniform(rs, d)}
    if bias:
        entries = (2 * gmax[0] - 1) * (2 * gmax[1] - 1)
        p[pre + "coarse_attn.relative_position_bias_table"] = C2F2D_TABLE_STD * rs.standard_normal(size=(entries, heads))
    p.update({pre + "fine_attn.q_proj.weight": glorot_uniform(rs, d, d),
              pre + "fine_attn.q_proj.bias": bias_uniform(rs, d),
              pre + "fine_attn.kv_proj.weight": np.concatenate([glorot_uniform(rs, d, d) for _ in range(2)], axis=0),
              pre + "fine_attn.kv_proj.bias": bias_uniform(rs, 2 * d),
              pre + "fine_attn.out_proj.weight": glorot_uniform(rs, d, d),
              pre + "fine_attn.out_proj.bias": bias_uniform(rs, d)})
    return p


def _c2f2d_parameters(c: C2f2dCase) -> Dict[str, np.ndarray]:
    rs = stream(c.seed, "weights")
    if c.module == "c2f2d":
        return _c2f2d_layer_parameters(rs, c.d_model, c.n_heads, c.gmax, c.bias, "")
    p = {}
    for i, (_, _, gh, gw) in enumerate(c.stages):
        p.update(_c2f2d_layer_parameters(rs, c.d_model, c.n_heads, (gh, gw), c.bias, f"stages.{i}."))
    return p


def _c2f2d_module(c: C2f2dCase):
    if c.module == "c2f2d":
        return c2f2d_ref.C2FAttention2D(c.d_model, c.n_heads, c.block_h, c.block_w, *c.gmax, relative_position_bias=c.bias)
    return c2f2d_ref.ViTPyramid(c.d_model, c.n_heads, c.stages, relative_position_bias=c.bias)


def _c2f2d_h1_equivalence(c: C2f2dCase, params, x: np.ndarray) -> None:
    """One grid row without the bias is the article's 1-D C2FAttention with chunk_size = block_w (float64)."""
    one_d = c2f_ref.C2FAttention(c.d_model, c.n_heads, chunk_size=c.block_w).double()
    _load_exactly(one_d, params, np.float64, c.name)
    two_d = _c2f2d_module(c).double()
    _load_exactly(two_d, params, np.float64, c.name)
    with torch.no_grad():
        t = torch.from_numpy(x)
        diff = (one_d(t) - two_d(t, c.height, c.width)).abs().max().item()
    if diff > 1e-12:
        raise RuntimeError(f"{c.name}: H = 1 without bias differs from C2FAttention by {diff}")


def _c2f2d_case_files(family_dir: Path, c: C2f2dCase) -> dict:
    if c.module not in ("c2f2d", "pyramid") or (c.module == "pyramid") != bool(c.stages):
        raise ValueError(f"{c.name}: module {c.module!r} and stages {c.stages} do not fit")
    B, H, W, d = c.batch, c.height, c.width, c.d_model
    params = _c2f2d_parameters(c)
    x = stream(c.seed, "inputs").standard_normal(size=(B, H * W, d))
    if c.module == "c2f2d" and H == 1 and not c.bias:
        _c2f2d_h1_equivalence(c, params, x)

    meta = {"module": c.module, "embed_dim": str(d), "num_heads": str(c.n_heads), "batch": str(B),
            "height": str(H), "width": str(W), "relative_position_bias": b(c.bias)}
    if c.module == "c2f2d":
        (mh, mw), (gh, gw) = c.blocks, c.gmax
        if mh > gh or mw > gw:
            raise ValueError(f"{c.name}: {mh} x {mw} blocks exceed max_blocks {gh} x {gw}")
        meta.update(block_h=str(c.block_h), block_w=str(c.block_w), blocks_h=str(mh), blocks_w=str(mw),
                    max_blocks_h=str(gh), max_blocks_w=str(gw))
    else:
        grids, h, w = c2f2d_ref.pyramid_metadata(H, W, c.stages)
        meta.update(num_stages=str(len(c.stages)), stages=grids, out_height=str(h), out_width=str(w))
    meta.update(seed=str(c.seed), torch_version=torch_version(), description=c.description)

    files = {}
    for tag, (np_dt, t_dt) in DTYPES.items():
        mod = _c2f2d_module(c)
        if t_dt == torch.float64:
            mod = mod.double()
        _load_exactly(mod, params, np_dt, c.name)
        with torch.no_grad():
            t = torch.from_numpy(x.astype(np_dt))
            if c.module == "c2f2d":
                out = to_numpy(mod(t, H, W))
                extra = {"coarse_input": to_numpy(mod.coarse_input), "coarse_output": to_numpy(mod.coarse_output)}
            else:
                y, h, w = mod(t, H, W)
                out, extra = to_numpy(y), {}
                if (str(h), str(w)) != (meta["out_height"], meta["out_width"]):
                    raise RuntimeError(f"{c.name}: pyramid ends on {h} x {w}")
        if not np.isfinite(out).all():
            raise RuntimeError(f"{c.name}/{tag}: output not finite")
        prefix = f"{c.module}."
        tensors = {prefix + k: v.astype(np_dt) for k, v in params.items()}
        tensors.update(x=x.astype(np_dt), output=out, **extra)
        _check_dtypes(c.name, tensors, np_dt)
        files[tag] = write_case(family_dir, c.name, tag, tensors, meta)
    return {"name": c.name, "files": files, **{k: meta[k] for k in sorted(meta)}}


@register_family(
    "c2f2d", computed=("output", "coarse_input", "coarse_output"),
    description="two-dimensional coarse-to-fine attention (the coarse-to-fine attention article's ViT extension) "
                "with Swin's relative position bias, and a ViT feature pyramid of it (c2f2d_reference.py)")
def gen_c2f2d(family_dir: Path) -> List[dict]:
    names = [c.name for c in C2F2D_CASES]
    if len(set(names)) != len(names) or len({c.seed for c in C2F2D_CASES}) != len(C2F2D_CASES):
        raise RuntimeError("c2f2d case names and seeds must be unique")
    return [_c2f2d_case_files(family_dir, c) for c in C2F2D_CASES]


# =====================================================================================================
# Family "train": gradients (torch.autograd) of Linear, MultiheadAttention and the article's
# CoarseAttention, and torch.optim / clip_grad_norm_ step by step
# =====================================================================================================

@dataclass(frozen=True)
class TrainCase:
    name: str
    seed: int
    description: str
    module: str  # "linear" | "mha" | "coarse" | "adamw" | "sgd" | "clip"
    mha: Optional[MhaCase] = None  # module "mha": the problem, in the mha family's vocabulary
    sizes: Tuple[int, ...] = ()  # linear: (in, out, B, L); coarse: (d, H, B, m); optimizers: (in, out)
    bias: bool = True
    coarse_mask: bool = False  # coarse: a random keep mask [B, m, m]
    hyper: Tuple[Tuple[str, float], ...] = ()  # optimizer / clipping hyperparameters
    steps: int = 0  # optimizers: steps taken


def _mha_train(name, seed, what, **kw) -> TrainCase:
    return TrainCase(name, seed, what, "mha", mha=MhaCase(name, seed, what, **kw))


TRAIN_CASES: List[TrainCase] = [
    TrainCase("linear_b3_l7", 15001, "nn.Linear(12, 5), x [3, 7, 12]", "linear", sizes=(12, 5, 3, 7)),
    TrainCase("linear_nobias_l1", 15002, "nn.Linear(6, 9, bias=False), x [2, 1, 6]", "linear", sizes=(6, 9, 2, 1),
              bias=False),
    _mha_train("mha_self_l1_b3", 15101, "self-attention, L = 1, B = 3", batch=3, lq=1),
    _mha_train("mha_self_l37_b3", 15102, "self-attention, L = 37, B = 3", batch=3, lq=37),
    _mha_train("mha_cross_kdim12_vdim20", 15103, "cross-attention Lq = 7, Lk = 37, kdim 12, vdim 20",
               num_heads=2, lq=7, lk=37, kdim=12, vdim=20),
    _mha_train("mha_cross_lq37_lk7", 15104, "cross-attention Lq = 37, Lk = 7 (packed in_proj), key != value",
               lq=37, lk=7),
    _mha_train("mha_nobias_l13", 15105, "self-attention without bias, L = 13", lq=13, bias=False),
    _mha_train("mha_attn_bool_2d_l37", 15106, "random bool attn_mask [L, L] (True = not allowed)", lq=37,
               attn_mask="bool_random_2d"),
    _mha_train("mha_attn_bool_3d_cross", 15107, "cross-attention Lq = 7, Lk = 37, random bool attn_mask [B*H, Lq, Lk]",
               lq=7, lk=37, attn_mask="bool_random_3d"),
    _mha_train("mha_attn_float_2d_l37", 15108, "additive float attn_mask [L, L]: N(0,1) and ~20% -inf", lq=37,
               attn_mask="float_random_2d"),
    _mha_train("mha_kpm_bool_l37", 15109, "bool key_padding_mask, lengths 37 and 20", lq=37,
               key_padding_mask="bool", lengths=(37, 20)),
    _mha_train("mha_kpm_float_l37", 15110, "additive float key_padding_mask, -inf on padding (lengths 37, 25)",
               lq=37, key_padding_mask="float", lengths=(37, 25)),
    _mha_train("mha_causal_l37", 15111, "causal bool attn_mask (torch.triu(ones, diagonal=1)), L = 37", lq=37,
               attn_mask="causal"),
    _mha_train("mha_causal_kpm_l37_b3", 15112, "causal bool attn_mask + bool key_padding_mask (37, 20, 1), B = 3",
               batch=3, lq=37, attn_mask="causal", key_padding_mask="bool", lengths=(37, 20, 1)),
    _mha_train("mha_causal_l128", 15113, "causal bool attn_mask, L = 128 (several key blocks)", lq=128,
               attn_mask="causal"),
    _mha_train("mha_fully_masked_rows_l7", 15114,
               f"bool attn_mask with query rows {list(FULLY_MASKED_ROWS)} entirely masked, and batch item 1 with "
               "every key padded (length 0): zero attention there (c2f's semantics; torch's MHA gives NaN)",
               lq=7, attn_mask="bool_fully_masked_rows", key_padding_mask="bool", lengths=(7, 0)),
    _mha_train("mha_head_dim3_l37", 15115, "embed_dim 24 with 8 heads (head_dim 3)", embed_dim=24, num_heads=8, lq=37),
    TrainCase("coarse_m1_b3", 15201, "the article's CoarseAttention(16, 4), a single chunk, B = 3", "coarse",
              sizes=(16, 4, 3, 1)),
    TrainCase("coarse_m9", 15202, "the article's CoarseAttention(16, 4), 9 chunks", "coarse", sizes=(16, 4, 2, 9)),
    TrainCase("coarse_m9_mask", 15203, "the article's CoarseAttention(16, 4), 9 chunks, random keep mask [B, m, m]",
              "coarse", sizes=(16, 4, 2, 9), coarse_mask=True),
    TrainCase("adamw_default", 15301, "torch.optim.AdamW(lr=1e-2), 5 steps on nn.Linear(4, 3)'s parameters", "adamw",
              sizes=(4, 3), hyper=(("lr", 1e-2), ("beta1", 0.9), ("beta2", 0.999), ("eps", 1e-8),
                                   ("weight_decay", 1e-2)), steps=5),
    TrainCase("adamw_betas", 15302, "torch.optim.AdamW(lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), "
              "5 steps", "adamw", sizes=(4, 3), hyper=(("lr", 0.05), ("beta1", 0.8), ("beta2", 0.99), ("eps", 1e-6),
                                                       ("weight_decay", 0.1)), steps=5),
    TrainCase("sgd_plain", 15401, "torch.optim.SGD(lr=0.1), 4 steps", "sgd", sizes=(4, 3),
              hyper=(("lr", 0.1), ("momentum", 0.0), ("dampening", 0.0), ("weight_decay", 0.0), ("nesterov", 0.0)),
              steps=4),
    TrainCase("sgd_momentum", 15402, "torch.optim.SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), 4 steps",
              "sgd", sizes=(4, 3), hyper=(("lr", 0.1), ("momentum", 0.9), ("dampening", 0.1), ("weight_decay", 0.01),
                                          ("nesterov", 0.0)), steps=4),
    TrainCase("sgd_nesterov", 15403, "torch.optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), 4 steps",
              "sgd", sizes=(4, 3), hyper=(("lr", 0.05), ("momentum", 0.9), ("dampening", 0.0), ("weight_decay", 1e-3),
                                          ("nesterov", 1.0)), steps=4),
    TrainCase("clip_large", 15501, "clip_grad_norm_(max_norm=1.0) of gradients whose total norm is about 4", "clip",
              sizes=(4, 3), hyper=(("max_norm", 1.0),)),
    TrainCase("clip_small", 15502, "clip_grad_norm_(max_norm=100.0): the total norm is below, nothing changes", "clip",
              sizes=(4, 3), hyper=(("max_norm", 100.0),)),
]


def mha_zero_rows(mod: torch.nn.MultiheadAttention, q, k, v, attn_mask, kpm):
    """nn.MultiheadAttention's computation (F.multi_head_attention_forward, slow path) written out, with c2f's
    semantics where a query row sees no key: zero attention (torch's softmax gives NaN there). Where every row
    sees a key, the generator checks it equals nn.MultiheadAttention, output and gradients (float64, 1e-12)."""
    E, H = mod.embed_dim, mod.num_heads
    d = E // H
    if mod._qkv_same_embed_dim:
        wq, wk, wv = mod.in_proj_weight.chunk(3)
    else:
        wq, wk, wv = mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight
    bq = bk = bv = None
    if mod.in_proj_bias is not None:
        bq, bk, bv = mod.in_proj_bias.chunk(3)
    B, Lq, Lk = q.shape[0], q.shape[1], k.shape[1]

    def heads(t, L):
        return t.reshape(B, L, H, d).transpose(1, 2)

    qh = heads(torch.nn.functional.linear(q, wq, bq), Lq)
    kh = heads(torch.nn.functional.linear(k, wk, bk), Lk)
    vh = heads(torch.nn.functional.linear(v, wv, bv), Lk)
    s = (qh / math.sqrt(d)) @ kh.transpose(-2, -1)
    hidden = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    for m, shape in ((attn_mask, None), (kpm, (B, 1, 1, Lk))):
        if m is None:
            continue
        if m.dim() == 3:
            m = m.reshape(B, H, Lq, Lk)
        elif shape is not None:
            m = m.reshape(shape)
        if m.dtype == torch.bool:
            hidden = hidden | m
        else:
            hidden = hidden | torch.isneginf(m)
            s = s + torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    seen = (~hidden).any(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(hidden, -math.inf).masked_fill(~seen, 0.0), dim=-1)
    p = torch.where(seen, p, torch.zeros_like(p))
    o = (p @ vh).transpose(1, 2).reshape(B, Lq, E)
    return torch.nn.functional.linear(o, mod.out_proj.weight, mod.out_proj.bias)


def _backward(fn, inputs: Dict[str, torch.Tensor], module: torch.nn.Module, dy: np.ndarray, np_dt):
    """y = fn(); y.backward(dy); returns (output, {grad.<input>: ..., grad.<prefix><param>: ...})."""
    for t in inputs.values():
        t.requires_grad_(True)
    y = fn()
    y.backward(torch.from_numpy(dy.astype(np_dt)))
    grads = {f"grad.{k}": to_numpy(t.grad) for k, t in inputs.items()}
    for k, prm in module.named_parameters():
        grads[f"grad.{k}"] = to_numpy(prm.grad)
    return to_numpy(y), grads


def _train_mha(c: TrainCase, tag: str):
    mc = c.mha
    np_dt, t_dt = DTYPES[tag]
    params = _mha_parameters(mc)
    inputs = _mha_inputs(mc)
    attn_mask = ATTN_MASK_BUILDERS[mc.attn_mask](stream(c.seed, "attn_mask"), mc) if mc.attn_mask else None
    kpm = _key_padding_mask(stream(c.seed, "key_padding_mask"), mc) if mc.key_padding_mask else None
    dy = stream(c.seed, "grad_output").standard_normal(size=(mc.batch, mc.lq, mc.embed_dim))
    fully_masked = bool(_blocked(mc, attn_mask, kpm).all(axis=-1).any())

    def run(use_twin: bool):
        mod = torch.nn.MultiheadAttention(mc.embed_dim, mc.num_heads, bias=mc.bias, kdim=mc.kdim, vdim=mc.vdim,
                                          batch_first=True).to(t_dt)
        _load_exactly(mod, params, np_dt, c.name)
        mod.eval()
        names = ["query"] if mc.self_attention else ["query", "key", "value"]
        x = {n: torch.from_numpy(inputs[n].astype(np_dt)) for n in names}
        am = None if attn_mask is None else torch.from_numpy(attn_mask if attn_mask.dtype == bool else attn_mask.astype(np_dt))
        pm = None if kpm is None else torch.from_numpy(kpm if kpm.dtype == bool else kpm.astype(np_dt))

        def fn():
            q = x["query"]
            k, v = (q, q) if mc.self_attention else (x["key"], x["value"])
            if use_twin:
                return mha_zero_rows(mod, q, k, v, am, pm)
            return mod(q, k, v, key_padding_mask=pm, attn_mask=am, need_weights=False)[0]

        out, grads = _backward(fn, x, mod, dy, np_dt)
        if mc.self_attention:
            grads["grad.input"] = grads.pop("grad.query")
        return out, {(k.replace("grad.", "grad.mha.", 1) if k[5:] in params else k): v for k, v in grads.items()}

    out, grads = run(use_twin=fully_masked)
    if tag == "f64" and not fully_masked:  # the twin is nn.MultiheadAttention where every row sees a key
        out2, grads2 = run(use_twin=True)
        if not np.allclose(out2, out, rtol=0, atol=1e-12) or any(
                not np.allclose(grads2[k], g, rtol=0, atol=1e-11) for k, g in grads.items()):
            raise RuntimeError(f"{c.name}: mha_zero_rows disagrees with nn.MultiheadAttention")
    if not (np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads.values())):
        raise RuntimeError(f"{c.name}/{tag}: output or gradients not finite")
    tensors = {f"mha.{k}": v.astype(np_dt) for k, v in params.items()}
    # Self-attention stores its input once, as `query`.
    tensors.update({k: v.astype(np_dt) for k, v in inputs.items() if k == "query" or not mc.self_attention})
    if attn_mask is not None:
        tensors["attn_mask"] = attn_mask if attn_mask.dtype == bool else attn_mask.astype(np_dt)
    if kpm is not None:
        tensors["key_padding_mask"] = kpm if kpm.dtype == bool else kpm.astype(np_dt)
    causal = mc.attn_mask == "causal"
    meta = {"embed_dim": str(mc.embed_dim), "num_heads": str(mc.num_heads), "batch": str(mc.batch),
            "lq": str(mc.lq), "lk": str(mc.Lk), "kdim": str(mc.Kdim), "vdim": str(mc.Vdim), "bias": b(mc.bias),
            "self_attention": b(mc.self_attention),
            "attn_mask": "none" if attn_mask is None else ("bool" if attn_mask.dtype == bool else "float"),
            "causal": b(causal),
            "key_padding_mask": "none" if kpm is None else ("bool" if kpm.dtype == bool else "float"),
            "fully_masked_rows": b(fully_masked),
            "reference": "mha_zero_rows" if fully_masked else "nn.MultiheadAttention"}
    return tensors, dy, out, grads, meta


def _train_linear_or_coarse(c: TrainCase, tag: str):
    np_dt, t_dt = DTYPES[tag]
    rs = stream(c.seed, "weights")
    if c.module == "linear":
        fin, fout, B, L = c.sizes
        params = {"weight": glorot_uniform(rs, fout, fin)}
        if c.bias:
            params["bias"] = bias_uniform(rs, fout)
        mod = torch.nn.Linear(fin, fout, bias=c.bias).to(t_dt)
        width, out_width, prefix = fin, fout, "linear."
        meta = {"in_features": str(fin), "out_features": str(fout), "bias": b(c.bias)}
    else:
        d, H, B, L = c.sizes
        params = {"qkv_proj.weight": np.concatenate([glorot_uniform(rs, d, d) for _ in range(3)], axis=0),
                  "qkv_proj.bias": bias_uniform(rs, 3 * d), "out_proj.weight": glorot_uniform(rs, d, d),
                  "out_proj.bias": bias_uniform(rs, d)}
        mod = c2f_ref.CoarseAttention(d, H).to(t_dt)
        width, out_width, prefix = d, d, "coarse."
        meta = {"d_model": str(d), "n_heads": str(H), "mask": b(c.coarse_mask)}
    _load_exactly(mod, params, np_dt, c.name)
    mod.eval()  # the article's dropout is the identity
    x_np = stream(c.seed, "inputs").standard_normal(size=(B, L, width))
    mask = None
    if c.coarse_mask:  # True = keep (the article's convention); every row keeps a chunk
        rs_mask = stream(c.seed, "coarse_mask")
        mask = rs_mask.uniform(size=(B, L, L)) < C2F_MASK_KEEP_PROBABILITY
        for bi in range(B):
            for i in range(L):
                _keep_one_real(rs_mask, mask[bi, i], np.ones(L, dtype=bool))
    dy = stream(c.seed, "grad_output").standard_normal(size=(B, L, out_width))
    x = {"input": torch.from_numpy(x_np.astype(np_dt))}
    m = None if mask is None else torch.from_numpy(mask)
    out, grads = _backward(lambda: mod(x["input"]) if c.module == "linear" else mod(x["input"], mask=m), x, mod, dy, np_dt)
    grads = {(f"grad.{prefix}{k[5:]}" if k[5:] in params else k): v for k, v in grads.items()}
    tensors = {prefix + k: v.astype(np_dt) for k, v in params.items()}
    tensors["x"] = x_np.astype(np_dt)
    if mask is not None:
        tensors["mask"] = mask
    meta.update(batch=str(B), seq_len=str(L))
    return tensors, dy, out, grads, meta


def _train_optimizer(c: TrainCase, tag: str):
    np_dt, t_dt = DTYPES[tag]
    fin, fout = c.sizes
    rs = stream(c.seed, "weights")
    params = {"weight": glorot_uniform(rs, fout, fin), "bias": bias_uniform(rs, fout)}
    mod = torch.nn.Linear(fin, fout).to(t_dt)
    _load_exactly(mod, params, np_dt, c.name)
    hp = dict(c.hyper)
    tensors = {f"linear.{k}": v.astype(np_dt) for k, v in params.items()}
    grs = stream(c.seed, "grads")
    if c.module == "clip":
        for k, prm in mod.named_parameters():
            g = 2.0 * grs.standard_normal(size=tuple(prm.shape))
            prm.grad = torch.from_numpy(g.astype(np_dt))
            tensors[f"grads.{k}"] = g.astype(np_dt)
        norm = torch.nn.utils.clip_grad_norm_(mod.parameters(), max_norm=hp["max_norm"])
        tensors["total_norm"] = np.array([float(norm)], dtype=np_dt)
        for k, prm in mod.named_parameters():
            tensors[f"clipped.{k}"] = to_numpy(prm.grad)
    else:
        if c.module == "adamw":
            opt = torch.optim.AdamW(mod.parameters(), lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                    weight_decay=hp["weight_decay"])
        else:
            opt = torch.optim.SGD(mod.parameters(), lr=hp["lr"], momentum=hp["momentum"], dampening=hp["dampening"],
                                  weight_decay=hp["weight_decay"], nesterov=bool(hp["nesterov"]))
        for t in range(1, c.steps + 1):
            for k, prm in mod.named_parameters():
                g = grs.standard_normal(size=tuple(prm.shape))
                prm.grad = torch.from_numpy(g.astype(np_dt))
                tensors[f"grads.{t}.{k}"] = g.astype(np_dt)
            opt.step()
            for k, prm in mod.named_parameters():  # a copy: the next step updates the parameter in place
                tensors[f"expected.{t}.{k}"] = to_numpy(prm.detach()).copy()
    meta = {"in_features": str(fin), "out_features": str(fout), "steps": str(c.steps)}
    meta.update({k: repr(v) for k, v in c.hyper})
    return tensors, meta


def _train_case_files(family_dir: Path, c: TrainCase) -> dict:
    files, entry_meta = {}, None
    for tag, (np_dt, _) in DTYPES.items():
        if c.module in ("adamw", "sgd", "clip"):
            tensors, meta = _train_optimizer(c, tag)
        else:
            tensors, dy, out, grads, meta = (_train_mha if c.module == "mha" else _train_linear_or_coarse)(c, tag)
            tensors.update(grad_output=dy.astype(np_dt), output=out, **grads)
        _check_dtypes(c.name, {k: v for k, v in tensors.items() if v.dtype != bool}, np_dt)  # masks are BOOL
        meta = dict(meta, module=c.module, seed=str(c.seed), torch_version=torch_version(), description=c.description)
        if entry_meta is not None and meta != entry_meta:
            raise RuntimeError(f"{c.name}: f32 and f64 metadata differ")
        entry_meta = meta
        files[tag] = write_case(family_dir, c.name, tag, tensors, meta)
    return {"name": c.name, "files": files, **{k: entry_meta[k] for k in sorted(entry_meta)}}


@register_family(
    "train", computed=("output", "grad.*", "expected.*", "clipped.*", "total_norm"),
    description="gradients of nn.Linear, nn.MultiheadAttention and the article's CoarseAttention (y.backward(dy)), "
                "torch.optim.AdamW / SGD step by step, clip_grad_norm_")
def gen_train(family_dir: Path) -> List[dict]:
    names = [c.name for c in TRAIN_CASES]
    if len(set(names)) != len(names) or len({c.seed for c in TRAIN_CASES}) != len(TRAIN_CASES):
        raise RuntimeError("train case names and seeds must be unique")
    return [_train_case_files(family_dir, c) for c in TRAIN_CASES]


__import__("train_c2f").register(sys.modules[__name__])  # family "train_c2f": tests/reference/train_c2f.py
__import__("train_hmha").register(sys.modules[__name__])  # family "train_hmha": tests/reference/train_hmha.py


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
    ap.add_argument("--list", action="store_true", help="list families and cases, write nothing")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.list:
        for f in FAMILIES.values():
            print(f"{f.name}: {f.description}")
        for c in MHA_CASES:
            print(f"  mha/{c.name}: {c.description}")
        for c in C2F_CASES:
            print(f"  c2f/{c.name}: {c.description}")
        for c in CONV1D_CASES:
            print(f"  conv1d/{c.name}: {c.description}")
        for c in HMHA_CASES:
            print(f"  hmha/{c.name}: {c.description}")
        for c in SPARSE_CASES:
            print(f"  sparse/{c.name}: {c.description}")
        for c in C2F2D_CASES:
            print(f"  c2f2d/{c.name}: {c.description}")
        for c in TRAIN_CASES:
            print(f"  train/{c.name}: {c.description}")
        return 0
    generate(args.out, args.family, verbose=not args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
