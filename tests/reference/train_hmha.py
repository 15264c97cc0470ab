"""Fixture family "train_hmha": the gradients (torch.autograd) of Conv1d, the C3K2/HMHA article's
C3K2Projection and HMHA (all three levels).

generate.py registers this family with one line (``register(generate module)``); it uses the generator's
streams and parameter draws (``conv_uniform``, ``_c3k2_parameters``, ``_hmha_parameters``), so that a case
here draws its weights as the forward families do. Each case builds the PyTorch module in float64 and float32,
runs ``y = module(x)`` and ``y.backward(dy)`` with a random dy, and stores x, the parameters, dy, the output
and every input's and parameter's ``.grad``:

* ``conv1d``: ``torch.nn.Conv1d`` in c2f's [B, L, C] layout (``hmha_reference.conv1d_blc``); causal:
  ``conv(F.pad(x, (k - 1, 0)))`` with padding 0. Tensors ``conv.*``, ``output``, ``grad.input``,
  ``grad.conv.*``.
* ``c3k2``: ``hmha_reference.C3K2Projection`` (causal too). ``c3k2.*``, ``output``, ``grad.input``,
  ``grad.c3k2.*``.
* ``hmha``: ``hmha_reference.HMHA``, the dense formulation (every level through explicit [L, L] or [L, m]
  masks; a row that sees nothing — causal level 2's first window — gives 0, and so does its gradient), once
  per level configuration ``<cfg>`` in LEVEL_CONFIGS: ``output.<cfg>``, ``grad.<cfg>.input``,
  ``grad.<cfg>.hmha.*``; ``hmha.*`` the parameters. In float64 the small cases are also checked with
  ``torch.autograd.gradcheck`` (x), so that the dense reference's own gradients are known right.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import hmha_reference as hmha_ref

G = None  # the generate module: its streams and helpers (set by register())

FAMILY = "train_hmha"

# Level configuration -> the levels switched on (the hmha family's outputs).
LEVEL_CONFIGS = {"l1": (1,), "l2": (2,), "l3": (3,), "all": (1, 2, 3)}


def register(generate_module) -> None:
    """Registers the family with generate.py's registry; `generate_module` is generate.py itself."""
    global G
    G = generate_module
    G.register_family(FAMILY, computed=("output", "output.*", "grad.*"),
                      description="gradients of Conv1d, C3K2Projection and HMHA (y.backward(dy)), HMHA per level "
                                  "configuration (hmha_reference.py)")(gen_train_hmha)


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    description: str
    module: str  # "conv1d" | "c3k2" | "hmha"
    seq_len: int
    batch: int = 2
    causal: bool = False
    # conv1d: (in, out, kernel_size, padding, groups); c3k2 and hmha: dim, heads (and window)
    conv: Tuple[int, int, int, int, int] = (8, 6, 3, 1, 1)
    bias: bool = True
    dim: int = 16
    heads: int = 4
    window: int = 8  # hmha


def _cases() -> List[Case]:
    conv = [
        Case("conv_k3_p1_b3_l13", 25001, "Conv1d(8, 6, 3, padding 1), B = 3, L = 13", "conv1d", 13, batch=3),
        Case("conv_k5_p0_g2_l13", 25002, "Conv1d(8, 6, 5, groups 2), no padding: L_out = L - 4", "conv1d", 13,
             conv=(8, 6, 5, 0, 2)),
        Case("conv_k3_p2_l1", 25003, "Conv1d(8, 6, 3, padding 2), L = 1: L_out = 3, each output one real tap",
             "conv1d", 1, conv=(8, 6, 3, 2, 1)),
        Case("conv_causal_k3_l9", 25004, "causal Conv1d(8, 6, 3): conv(F.pad(x, (2, 0)))", "conv1d", 9, causal=True,
             conv=(8, 6, 3, 0, 1)),
        Case("conv_causal_k5_g2_nobias_l4", 25005, "causal Conv1d(8, 6, 5, groups 2, bias=False), L = 4 < k",
             "conv1d", 4, causal=True, conv=(8, 6, 5, 0, 2), bias=False),
        Case("conv_depthwise_k3_p1", 25006, "Conv1d(4, 8, 3, padding 1, groups 4) (depthwise)", "conv1d", 11,
             conv=(4, 8, 3, 1, 4)),
        Case("conv_k3_p1_l130", 25007, "Conv1d(16, 8, 3, padding 1), L = 130 (two row chunks of 128)", "conv1d", 130,
             conv=(16, 8, 3, 1, 1)),
    ]
    c3k2 = [
        Case("c3k2_d16_l1_b3", 25101, "C3K2Projection dim 16, L = 1, B = 3", "c3k2", 1, batch=3),
        Case("c3k2_d16_l13", 25102, "C3K2Projection dim 16, L = 13", "c3k2", 13),
        Case("c3k2_d15_l7", 25103, "C3K2Projection odd dim 15 (heads 3): conv3 -> 7 | conv2 -> 8", "c3k2", 7, dim=15,
             heads=3),
        Case("c3k2_causal_d16_l1", 25104, "causal C3K2Projection dim 16, L = 1", "c3k2", 1, causal=True),
        Case("c3k2_causal_d16_l13_b3", 25105, "causal C3K2Projection dim 16, L = 13, B = 3", "c3k2", 13, batch=3,
             causal=True),
        Case("c3k2_causal_d15_l2", 25106, "causal C3K2Projection odd dim 15, L = 2", "c3k2", 2, dim=15, heads=3,
             causal=True),
    ]
    hmha = []
    for L, W, batch, dim, heads, seed, what in (
            (1, 4, 3, 8, 2, 25201, "L = 1, B = 3"),
            (7, 8, 2, 8, 2, 25203, "L = W - 1: one partial window"),
            (8, 8, 2, 8, 2, 25205, "L = W: one full window"),
            (9, 8, 2, 8, 2, 25207, "L = W + 1: a last window of one token"),
            (37, 8, 3, 8, 2, 25209, "L = 37: 5 windows, the last of 5 tokens, B = 3"),
            (70, 4, 1, 8, 2, 25211, "L = 70, W = 4: 18 windows (two summary blocks of 16), two blocks of 64 rows"),
            (13, 4, 2, 12, 4, 25213, "head dim 3, L = 13: 4 windows, the last of 1 token")):
        for causal in (False, True):
            name = f"hmha{'_dh3' if dim == 12 else ''}_l{L}_w{W}{'_b3' if batch == 3 else ''}{'_causal' if causal else ''}"
            hmha.append(Case(name, seed + causal, f"HMHA dim {dim}, {heads} heads, window {W}, {what}"
                             f"{', causal' if causal else ''}", "hmha", L, batch=batch, causal=causal, dim=dim,
                             heads=heads, window=W))
    return conv + c3k2 + hmha


def _backward(fn, x: torch.Tensor, module: torch.nn.Module, prefix: str, dy: np.ndarray, np_dt):
    """y = fn(); y.backward(dy): (output, {grad.input, grad.<prefix><parameter>})."""
    out, grads = G._backward(fn, {"input": x}, module, dy, np_dt)
    return out, {(k if k == "grad.input" else f"grad.{prefix}{k[5:]}"): v for k, v in grads.items()}


def _conv_case(c: Case, tag: str):
    np_dt, t_dt = G.DTYPES[tag]
    cin, cout, k, p, g = c.conv
    rs = G.stream(c.seed, "weights")
    params = {"weight": G.conv_uniform(rs, (cout, cin // g, k), cin // g * k)}
    if c.bias:
        params["bias"] = G.bias_uniform(rs, cout)
    mod = torch.nn.Conv1d(cin, cout, k, padding=p, groups=g, bias=c.bias).to(t_dt)
    G._load_exactly(mod, params, np_dt, c.name)
    x_np = G.stream(c.seed, "inputs").standard_normal(size=(c.batch, c.seq_len, cin))
    x = torch.from_numpy(x_np.astype(np_dt))
    if c.causal:  # kernel_size - 1 zeros on the left only
        fn = lambda: mod(F.pad(x.transpose(1, 2), (k - 1, 0))).transpose(1, 2)  # noqa: E731
    else:
        fn = lambda: hmha_ref.conv1d_blc(mod, x)  # noqa: E731
    out_len = c.seq_len if c.causal else c.seq_len + 2 * p - k + 1
    dy = G.stream(c.seed, "grad_output").standard_normal(size=(c.batch, out_len, cout))
    out, grads = _backward(fn, x, mod, "conv.", dy, np_dt)
    tensors = {f"conv.{n}": v.astype(np_dt) for n, v in params.items()}
    tensors.update(x=x_np.astype(np_dt), grad_output=dy.astype(np_dt), output=out, **grads)
    meta = {"in_channels": str(cin), "out_channels": str(cout), "kernel_size": str(k), "padding": str(p),
            "groups": str(g), "bias": G.b(c.bias), "out_len": str(out_len)}
    return tensors, meta


def _c3k2_case(c: Case, tag: str):
    np_dt, t_dt = G.DTYPES[tag]
    params = G._c3k2_parameters(G.stream(c.seed, "weights"), c.dim)
    mod = hmha_ref.C3K2Projection(c.dim, c.heads, c.causal).to(t_dt)
    G._load_exactly(mod, params, np_dt, c.name)
    x_np = G.stream(c.seed, "inputs").standard_normal(size=(c.batch, c.seq_len, c.dim))
    x = torch.from_numpy(x_np.astype(np_dt))
    dy = G.stream(c.seed, "grad_output").standard_normal(size=(c.batch, c.seq_len, c.dim))
    out, grads = _backward(lambda: mod(x), x, mod, "c3k2.", dy, np_dt)
    tensors = {f"c3k2.{n}": v.astype(np_dt) for n, v in params.items()}
    tensors.update(x=x_np.astype(np_dt), grad_output=dy.astype(np_dt), output=out, **grads)
    return tensors, {"dim": str(c.dim), "heads": str(c.heads)}


def _hmha_case(c: Case, tag: str):
    np_dt, t_dt = G.DTYPES[tag]
    params = G._hmha_parameters(G.HmhaCase(c.name, c.seed, c.description, c.seq_len, c.window, c.causal, c.dim, c.heads,
                                           c.batch))
    x_np = G.stream(c.seed, "inputs").standard_normal(size=(c.batch, c.seq_len, c.dim))
    dy = G.stream(c.seed, "grad_output").standard_normal(size=(c.batch, c.seq_len, c.dim))
    tensors = {f"hmha.{n}": v.astype(np_dt) for n, v in params.items()}
    tensors.update(x=x_np.astype(np_dt), grad_output=dy.astype(np_dt))
    for config, levels in LEVEL_CONFIGS.items():
        mod = hmha_ref.HMHA(c.dim, c.heads, window=c.window, levels=levels, causal=c.causal).to(t_dt)
        G._load_exactly(mod, params, np_dt, c.name)
        x = torch.from_numpy(x_np.astype(np_dt))
        out, grads = _backward(lambda: mod(x), x, mod, "hmha.", dy, np_dt)
        tensors[f"output.{config}"] = out
        tensors.update({f"grad.{config}.{k[5:]}": v for k, v in grads.items()})
        if tag == "f64" and c.batch * c.seq_len <= 27:
            xg = torch.from_numpy(x_np).requires_grad_(True)
            if not torch.autograd.gradcheck(lambda t: mod(t), (xg,), eps=1e-6, atol=1e-5, rtol=1e-3):
                raise RuntimeError(f"{c.name}: gradcheck failed for levels {levels}")
    meta = {"dim": str(c.dim), "heads": str(c.heads), "window": str(c.window),
            "num_windows": str(hmha_ref.num_windows(c.seq_len, c.window)), "level_configs": ",".join(LEVEL_CONFIGS)}
    return tensors, meta


BUILDERS = {"conv1d": _conv_case, "c3k2": _c3k2_case, "hmha": _hmha_case}


def _case_files(family_dir: Path, c: Case) -> dict:
    files, entry_meta = {}, None
    for tag, (np_dt, _) in G.DTYPES.items():
        tensors, meta = BUILDERS[c.module](c, tag)
        if not all(np.isfinite(v).all() for v in tensors.values()):
            raise RuntimeError(f"{c.name}/{tag}: an output or gradient is not finite")
        G._check_dtypes(c.name, tensors, np_dt)
        meta = dict(meta, module=c.module, causal=G.b(c.causal), batch=str(c.batch), seq_len=str(c.seq_len),
                    seed=str(c.seed), torch_version=G.torch_version(), description=c.description)
        if entry_meta is not None and meta != entry_meta:
            raise RuntimeError(f"{c.name}: f32 and f64 metadata differ")
        entry_meta = meta
        files[tag] = G.write_case(family_dir, c.name, tag, tensors, meta)
    return {"name": c.name, "files": files, **{k: entry_meta[k] for k in sorted(entry_meta)}}


def gen_train_hmha(family_dir: Path) -> List[dict]:
    cases = _cases()
    names = [c.name for c in cases]
    if len(set(names)) != len(names) or len({c.seed for c in cases}) != len(cases):
        raise RuntimeError("train_hmha case names and seeds must be unique")
    return [_case_files(family_dir, c) for c in cases]
