"""Fixture family "train_c2f": the gradients (torch.autograd) of the coarse-to-fine layers.

generate.py registers this family with one line (``register(generate module)``); it uses the generator's
streams, parameter draws and case vocabulary (C2fCase, C2f2dCase, SparseCase), so that a case here draws
exactly as the forward families do. Each case builds the real PyTorch module in float64 and float32, runs
``y = module(inputs)`` and ``y.backward(dy)`` with a random dy, and stores the inputs, the parameters, dy,
the output and every input's and parameter's ``.grad`` (``grad.<input>``, ``grad.<module>.<parameter>``).

* ``fine``: the article's FineAttention (c2f_reference.py), x [B, m, k, d] and coarse_context [B, m, d]
  both requiring grad, an optional keep mask [B, m, k, k].
* ``c2f``: the article's C2FAttention with FIX 3's padding (partial last chunks: the mean divides by the
  chunk's real tokens), an optional coarse keep mask [B, m, m] and fine keep mask [B, m, k, k].
* ``c2f2d``: C2FAttention2D (c2f2d_reference.py), the relative position bias table a parameter whose
  gradient is stored (``grad.c2f2d.coarse_attn.relative_position_bias_table``).
* ``sparse``: SparseC2FAttention with nn.MultiheadAttention's weights (``sparse_forward``: the sparse
  family's dense reference with autograd), the selection a constant found as the sparse family finds its
  own (a margin that float32 rounding cannot flip), stored as ``selected``.
* Rows whose keys are all masked: the article fills masked scores with -1e9, which averages every value
  uniformly there; c2f gives zero attention (and zero gradient). Such cases use a written-out twin of the
  module with c2f's semantics (``fine_forward``, ``c2f_forward``: -inf masking, zero rows), which the generator checks
  equals the module, output and gradients, on every case without such rows (float64, 1e-12).
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

import c2f2d_reference as c2f2d_ref
import c2f_reference as c2f_ref
import sparse_reference as sparse_ref

G = None  # the generate module: its streams, helpers and case types (set by register())

FAMILY = "train_c2f"


def register(generate_module) -> None:
    """Registers the family with generate.py's registry; `generate_module` is generate.py itself."""
    global G
    G = generate_module
    G.register_family(FAMILY, computed=("output", "grad.*"),
                      description="gradients of the coarse-to-fine layers (y.backward(dy)): the article's "
                                  "FineAttention and C2FAttention, C2FAttention2D, SparseC2FAttention")(gen_train_c2f)


# =====================================================================================================
# c2f's semantics for rows without a visible key, written out (differentiable)
# =====================================================================================================

def softmax_zero_rows(s: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension of s where keep (bool, broadcast) is True; a row that keeps nothing
    is zeros (not the -1e9 fill's uniform average, not NaN), and so is its gradient."""
    keep = keep.expand_as(s)
    seen = keep.any(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~keep, -math.inf).masked_fill(~seen, 0.0), dim=-1)
    return torch.where(seen, p, torch.zeros_like(p))


def coarse_forward(mod: c2f_ref.CoarseAttention, x: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The article's CoarseAttention.forward with c2f's semantics: keep [B, m, m] (True = keep)."""
    B, m, _ = x.shape
    H, dk = mod.n_heads, mod.d_k

    def heads(t):
        return t.reshape(B, m, H, dk).transpose(1, 2)

    q, k, v = mod.qkv_proj(x).chunk(3, dim=-1)
    s = (heads(q) @ heads(k).transpose(-2, -1)) / math.sqrt(dk)
    p = torch.softmax(s, dim=-1) if keep is None else softmax_zero_rows(s, keep.unsqueeze(1))
    return mod.out_proj((p @ heads(v)).transpose(1, 2).reshape(B, m, -1))


def c2f_forward(mod: c2f_ref.C2FAttention, x: torch.Tensor, coarse_keep: Optional[torch.Tensor],
                fine_keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The article's C2FAttention.forward (with FIX 3's padding) with c2f's semantics in both stages."""
    B, L, d = x.shape
    c = mod.chunk_size
    m = mod.num_chunks(L, c)
    x_p = torch.cat([x, x.new_zeros(B, m * c - L, d)], dim=1)
    blocks = x_p.view(B, m, c, d)
    real = torch.arange(m * c) < L
    counts = real.view(m, c).sum(dim=1).to(x.dtype)
    context = coarse_forward(mod.coarse_attn, blocks.sum(dim=2) / counts.view(1, m, 1), coarse_keep)
    keep = real.view(1, m, 1, c).expand(B, m, c, c)
    if fine_keep is not None:
        keep = keep & fine_keep
    fine = fine_forward(mod.fine_attn, blocks, context, keep)
    return fine.reshape(B, m * c, d)[:, :L]


def sparse_forward(mha: torch.nn.MultiheadAttention, x: torch.Tensor, keep: torch.Tensor, chunk: int, gating: str,
                   causal: bool, key_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """sparse_reference.sparse_c2f_attention with autograd: the selection `keep` [B, H, R, m] is a constant
    (as MoBA and NSA train), so the gradients flow through the selected chunks' keys only; a row without an
    allowed key gives zero attention and zero gradient."""
    B, L, E = x.shape
    q, k, v = sparse_ref.project_heads(mha, x)
    allowed = sparse_ref.allowed_mask(keep, L, chunk, gating, causal, key_padding_mask)
    p = softmax_zero_rows((q @ k.transpose(-2, -1)) / math.sqrt(E // mha.num_heads), allowed)
    o = (p @ v).transpose(1, 2).reshape(B, L, E)
    return torch.nn.functional.linear(o, mha.out_proj.weight, mha.out_proj.bias)


def fine_forward(mod: c2f_ref.FineAttention, x: torch.Tensor, context: torch.Tensor,
                 keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The article's FineAttention.forward with c2f's semantics: keep [B, m, k, k] (True = keep)."""
    B, m, k, d = x.shape
    H, dk = mod.n_heads, mod.d_k

    def heads(t):
        return t.reshape(B, m, k, H, dk).permute(0, 3, 1, 2, 4)

    q = mod.q_proj(context).unsqueeze(2).expand(-1, -1, k, -1)
    kk, v = mod.kv_proj(x).chunk(2, dim=-1)
    s = (heads(q) @ heads(kk).transpose(-2, -1)) / math.sqrt(dk)
    p = torch.softmax(s, dim=-1) if keep is None else softmax_zero_rows(s, keep.unsqueeze(1))
    return mod.out_proj((p @ heads(v)).permute(0, 2, 3, 1, 4).reshape(B, m, k, d))


# =====================================================================================================
# Cases
# =====================================================================================================

@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    description: str
    module: str  # "fine" | "c2f" | "c2f2d" | "sparse"
    sizes: tuple = ()  # fine: (m, k); c2f: (L, chunk); c2f2d: (H, W, block_h, block_w, Gh, Gw) (Gh = 0: Mh);
    #                    sparse: (L, chunk, top_k)
    batch: int = 2
    d_model: int = 16
    n_heads: int = 4
    mask: Optional[str] = None  # fine: "per_token" | "per_chunk_key" | "fully_masked"; c2f: the fine mask's
    coarse_mask: bool = False  # c2f: a random coarse keep mask [B, m, m]
    bias: bool = True  # c2f2d: the relative position bias table
    gating: str = "chunk"  # sparse: "chunk" | "token"
    causal: bool = False  # sparse (per-token gating)
    lengths: tuple = ()  # sparse: a bool key_padding_mask with these valid lengths
    require_empty_rows: bool = False  # sparse: re-seed until some (b, h, query) has no allowed key


def _cases() -> List[Case]:
    return [
        Case("fine_m3_k4", 17001, "FineAttention, 3 chunks of 4 tokens, no mask", "fine", (3, 4)),
        Case("fine_m3_k4_keys", 17002, "FineAttention, 3 chunks of 4, a per-chunk key mask (rows equal: the folded "
             "path with a mask)", "fine", (3, 4), mask="per_chunk_key"),
        Case("fine_m3_k4_tokens", 17003, "FineAttention, 3 chunks of 4, a random per-token mask (the general path)",
             "fine", (3, 4), mask="per_token"),
        Case("fine_m5_k1_b3", 17004, "FineAttention, 5 chunks of 1 token, B = 3", "fine", (5, 1), batch=3),
        Case("fine_m1_k1_b3", 17005, "FineAttention, one chunk of one token (L = 1), B = 3", "fine", (1, 1), batch=3),
        Case("fine_m4_k5_fully_masked", 17006, "FineAttention, 4 chunks of 5, a mask with whole query rows masked and "
             "one chunk of batch 1 masked for every row: zero attention there (c2f's semantics, fine_forward)",
             "fine", (4, 5), mask="fully_masked"),
        Case("fine_m3_k7_h8", 17007, "FineAttention, d_model 24 with 8 heads (head dim 3), 3 chunks of 7", "fine", (3, 7),
             d_model=24, n_heads=8),
        Case("c2f_l64_c8", 17101, "C2FAttention, L = 64 in chunks of 8 (divisible), no masks", "c2f", (64, 8)),
        Case("c2f_l61_c8", 17102, "C2FAttention, L = 61 in chunks of 8: the last chunk holds 5 tokens (its mean divides "
             "by 5)", "c2f", (61, 8)),
        Case("c2f_l1_c8_b3", 17103, "C2FAttention, L = 1 (one partial chunk of one token), B = 3", "c2f", (1, 8),
             batch=3),
        Case("c2f_l7_c8", 17104, "C2FAttention, L = chunk - 1 = 7: one partial chunk", "c2f", (7, 8)),
        Case("c2f_l9_c8", 17105, "C2FAttention, L = chunk + 1 = 9: the last chunk holds one token", "c2f", (9, 8)),
        Case("c2f_l13_c1", 17106, "C2FAttention, chunk_size 1: every token its own chunk", "c2f", (13, 1)),
        Case("c2f_coarse_mask_l61_c8", 17107, "C2FAttention, L = 61, a random coarse keep mask [B, m, m]", "c2f",
             (61, 8), coarse_mask=True),
        Case("c2f_fine_tokens_l61_c8", 17108, "C2FAttention, L = 61, a random per-token fine keep mask [B, m, k, k] "
             "(the general path)", "c2f", (61, 8), mask="per_token"),
        Case("c2f_fine_keys_l61_c8", 17109, "C2FAttention, L = 61, a per-chunk key fine mask (rows equal: the folded "
             "path with a mask)", "c2f", (61, 8), mask="per_chunk_key"),
        Case("c2f_both_masks_l37_c8_b3", 17110, "C2FAttention, L = 37, B = 3, a coarse and a per-token fine mask",
             "c2f", (37, 8), batch=3, coarse_mask=True, mask="per_token"),
        Case("c2f_fully_masked_l29_c8", 17111, "C2FAttention, L = 29: a coarse mask row that keeps no chunk, fine "
             "query rows that keep no key (one in the partial last chunk): zero attention there (c2f's semantics, "
             "c2f_forward)", "c2f", (29, 8), coarse_mask=True, mask="fully_masked"),
        Case("c2f_head_dim3_l37_c8", 17112, "C2FAttention, d_model 24 with 8 heads (head dim 3), L = 37", "c2f",
             (37, 8), d_model=24, n_heads=8),
        Case("c2f2d_7x5_b2x3", 17201, "C2FAttention2D, a 7 x 5 grid in blocks of 2 x 3 (partial on both edges), "
             "bias table 4 x 3 > the 4 x 2 blocks", "c2f2d", (7, 5, 2, 3, 4, 3)),
        Case("c2f2d_7x5_b2x3_nobias", 17202, "C2FAttention2D, a 7 x 5 grid in blocks of 2 x 3, no bias", "c2f2d",
             (7, 5, 2, 3, 0, 0), bias=False),
        Case("c2f2d_9x13_b4x4", 17203, "C2FAttention2D, a 9 x 13 grid in blocks of 4 x 4 (3 x 4 blocks), table 5 x 6",
             "c2f2d", (9, 13, 4, 4, 5, 6)),
        Case("c2f2d_8x8_b4x4_b3", 17204, "C2FAttention2D, an 8 x 8 grid in full blocks of 4 x 4, B = 3", "c2f2d",
             (8, 8, 4, 4, 0, 0), batch=3),
        Case("c2f2d_1x1_b2x2_b3", 17205, "C2FAttention2D, a 1 x 1 grid (L = 1, one partial block), B = 3", "c2f2d",
             (1, 1, 2, 2, 0, 0), batch=3),
        Case("c2f2d_1x9_b1x8", 17206, "C2FAttention2D, a 1 x 9 grid in blocks of 1 x 8 (chunk + 1: a last block of one "
             "token)", "c2f2d", (1, 9, 1, 8, 0, 0)),
        Case("c2f2d_5x6_b2x2_h8", 17207, "C2FAttention2D, d_model 24 with 8 heads (head dim 3), a 5 x 6 grid in blocks "
             "of 2 x 2", "c2f2d", (5, 6, 2, 2, 0, 0), d_model=24, n_heads=8),
        Case("sparse_l37_c8_k2", 17300, "SparseC2FAttention, L = 37 in chunks of 8, top_k 2, per-chunk gating",
             "sparse", (37, 8, 2)),
        Case("sparse_tok_l37_c8_k2_causal", 17400, "SparseC2FAttention, L = 37, chunk 8, top_k 2, per-token gating, causal",
             "sparse", (37, 8, 2), gating="token", causal=True),
        Case("sparse_tok_l37_c8_k3", 17500, "SparseC2FAttention, L = 37, chunk 8, top_k 3, per-token gating, not causal",
             "sparse", (37, 8, 3), gating="token"),
        Case("sparse_kpm_l37_c8_k2", 17600, "SparseC2FAttention, L = 37, chunk 8, top_k 2, per-chunk gating, key padding "
             "(lengths 37, 29: chunk 4 of batch 1 entirely padded)", "sparse", (37, 8, 2), lengths=(37, 29)),
        Case("sparse_tok_kpm_l37_c8_k1_causal", 17700, "SparseC2FAttention, L = 37, chunk 8, top_k 1, per-token causal, "
             "key padding (lengths 37, 20): padded tokens of batch 1 that see no allowed key (zero attention, zero "
             "gradient)", "sparse", (37, 8, 1), gating="token", causal=True, lengths=(37, 20), require_empty_rows=True),
        Case("sparse_l1_c8_k2_b3", 17800, "SparseC2FAttention, L = 1 (one chunk of one token), top_k 2, B = 3", "sparse",
             (1, 8, 2), batch=3),
        Case("sparse_l17_c8_k2_b3", 17900, "SparseC2FAttention, L = 17 (chunk + 1: 3 chunks, the last of one token), "
             "top_k 2, per-chunk gating, B = 3", "sparse", (17, 8, 2), batch=3),
        Case("sparse_all_l37_c8_k5", 18000, "SparseC2FAttention, L = 37, chunk 8, top_k 5 >= the 5 chunks: every chunk "
             "selected (nn.MultiheadAttention's gradients)", "sparse", (37, 8, 5)),
    ]


def _fully_masked_fine(rs, B: int, m: int, k: int) -> np.ndarray:
    """[B, m, k, k] keep mask: random (60 % kept), query rows 0 and k - 1 of chunk 0 entirely masked, and
    chunk m - 1 of batch item 1 masked for every row."""
    keep = rs.uniform(size=(B, m, k, k)) < G.C2F_MASK_KEEP_PROBABILITY
    keep[:, 0, 0, :] = False
    keep[:, 0, k - 1, :] = False
    keep[1, m - 1] = False
    return keep


def _fully_masked_c2f(rs_coarse, rs_fine, B: int, m: int, k: int, L: int):
    """Coarse [B, m, m] and fine [B, m, k, k] keep masks: random (60 % kept), every row keeping a chunk and a
    real key except: coarse row 1 of batch item 0, fine row 2 of chunk 0 (every batch item), and fine row 0 of
    the last chunk of batch item 1 (a real token of the partial last chunk), which keep nothing."""
    coarse = rs_coarse.uniform(size=(B, m, m)) < G.C2F_MASK_KEEP_PROBABILITY
    fine = rs_fine.uniform(size=(B, m, k, k)) < G.C2F_MASK_KEEP_PROBABILITY
    real = (np.arange(m * k) < L).reshape(m, k)
    for bi in range(B):
        for i in range(m):
            G._keep_one_real(rs_coarse, coarse[bi, i], np.ones(m, dtype=bool))
            for r in range(k):
                G._keep_one_real(rs_fine, fine[bi, i, r], real[i])
    coarse[0, 1, :] = False
    fine[:, 0, 2, :] = False
    fine[1, m - 1, 0, :] = False
    return coarse, fine


def _backward(fn, inputs: Dict[str, torch.Tensor], module: torch.nn.Module, prefix: str, dy: np.ndarray, np_dt):
    """y = fn(); y.backward(dy): (output, {grad.<input>, grad.<prefix><parameter>})."""
    out, grads = G._backward(fn, inputs, module, dy, np_dt)
    names = {k for k, _ in module.named_parameters()}
    return out, {(f"grad.{prefix}{k[5:]}" if k[5:] in names else k): v for k, v in grads.items()}


def _fine_case(c: Case, tag: str, check_twin: bool):
    np_dt, t_dt = G.DTYPES[tag]
    m, k = c.sizes
    vocabulary = G.C2fCase(c.name, c.seed, c.description, "fine", m, k, d_model=c.d_model, n_heads=c.n_heads,
                           batch=c.batch, fine_mask=c.mask if c.mask in ("per_token", "per_chunk_key") else None)
    params = G._c2f_parameters(vocabulary)
    inputs = G._c2f_inputs(vocabulary)
    mask = None
    if c.mask == "fully_masked":
        mask = _fully_masked_fine(G.stream(c.seed, "fine_mask"), c.batch, m, k)
    elif c.mask is not None:
        mask = G._c2f_fine_mask(G.stream(c.seed, "fine_mask"), vocabulary)
    fully_masked = mask is not None and not bool(mask.any(axis=-1).all())
    if fully_masked != (c.mask == "fully_masked"):
        raise RuntimeError(f"{c.name}: fully masked rows {fully_masked}, the case says {c.mask}")
    dy = G.stream(c.seed, "grad_output").standard_normal(size=(c.batch, m, k, c.d_model))

    def run(use_twin: bool):
        mod = c2f_ref.FineAttention(c.d_model, c.n_heads).to(t_dt)
        G._load_exactly(mod, params, np_dt, c.name)
        x = {n: torch.from_numpy(v.astype(np_dt)) for n, v in inputs.items()}
        mt = None if mask is None else torch.from_numpy(mask)
        if use_twin:
            fn = lambda: fine_forward(mod, x["x"], x["coarse_context"], mt)  # noqa: E731
        else:
            fn = lambda: mod(x["x"], x["coarse_context"], mask=mt)  # noqa: E731
        return _backward(fn, x, mod, "fine.", dy, np_dt)

    out, grads = run(use_twin=fully_masked)
    if check_twin and not fully_masked:
        _check_twin(c.name, (out, grads), run(use_twin=True))
    tensors = {f"fine.{n}": v.astype(np_dt) for n, v in params.items()}
    tensors.update({n: v.astype(np_dt) for n, v in inputs.items()})
    if mask is not None:
        tensors["mask"] = mask
    rows_equal = mask is None or bool((mask == mask[:, :, :1, :]).all())
    meta = {"d_model": str(c.d_model), "n_heads": str(c.n_heads), "batch": str(c.batch), "num_chunks": str(m),
            "chunk_len": str(k), "mask": "none" if mask is None else "bool", "mask_rows_equal": G.b(rows_equal),
            "fully_masked_rows": G.b(fully_masked),
            "reference": "fine_forward" if fully_masked else "c2f_reference.FineAttention"}
    return tensors, dy, out, grads, meta


def _check_twin(name: str, module_result, twin_result) -> None:
    """The written-out twin equals the module (float64): output and every gradient within 1e-12."""
    (out, grads), (out2, grads2) = module_result, twin_result
    if not np.allclose(out2, out, rtol=0, atol=1e-12) or grads.keys() != grads2.keys() or any(
            not np.allclose(grads2[n], g, rtol=0, atol=1e-12) for n, g in grads.items()):
        raise RuntimeError(f"{name}: the zero-rows twin disagrees with the module")


def _c2f_case(c: Case, tag: str, check_twin: bool):
    np_dt, t_dt = G.DTYPES[tag]
    L, chunk = c.sizes
    vocabulary = G.C2fCase(c.name, c.seed, c.description, "c2f", L, chunk, d_model=c.d_model, n_heads=c.n_heads,
                           batch=c.batch, coarse_mask="random" if c.coarse_mask else None,
                           fine_mask=c.mask if c.mask in ("per_token", "per_chunk_key") else None)
    m = vocabulary.num_chunks
    params = G._c2f_parameters(vocabulary)
    x_np = G._c2f_inputs(vocabulary)["x"]
    if c.mask == "fully_masked":
        coarse, fine = _fully_masked_c2f(G.stream(c.seed, "coarse_mask"), G.stream(c.seed, "fine_mask"), c.batch, m,
                                         chunk, L)
    else:
        coarse = G._c2f_coarse_mask(G.stream(c.seed, "coarse_mask"), vocabulary) if c.coarse_mask else None
        fine = G._c2f_fine_mask(G.stream(c.seed, "fine_mask"), vocabulary) if c.mask else None
    real = vocabulary.real_keys()
    fine_keep = np.broadcast_to(real[None, :, None, :], (c.batch, m, chunk, chunk)) & (True if fine is None else fine)
    fully_masked = (coarse is not None and not bool(coarse.any(axis=-1).all())) or not bool(
        fine_keep.reshape(c.batch, m * chunk, chunk)[:, :L].any(axis=-1).all())  # the real query rows
    if fully_masked != (c.mask == "fully_masked"):
        raise RuntimeError(f"{c.name}: fully masked rows {fully_masked}, the case says {c.mask}")
    dy = G.stream(c.seed, "grad_output").standard_normal(size=(c.batch, L, c.d_model))

    def run(use_twin: bool):
        mod = c2f_ref.C2FAttention(c.d_model, c.n_heads, chunk_size=chunk).to(t_dt)
        G._load_exactly(mod, params, np_dt, c.name)
        x = {"input": torch.from_numpy(x_np.astype(np_dt))}
        cm = None if coarse is None else torch.from_numpy(coarse)
        fm = None if fine is None else torch.from_numpy(fine)
        if use_twin:
            fn = lambda: c2f_forward(mod, x["input"], cm, fm)  # noqa: E731
        else:
            fn = lambda: mod(x["input"], coarse_mask=cm, fine_mask=fm)  # noqa: E731
        return _backward(fn, x, mod, "c2f.", dy, np_dt)

    out, grads = run(use_twin=fully_masked)
    if check_twin and not fully_masked:
        _check_twin(c.name, (out, grads), run(use_twin=True))
    tensors = {f"c2f.{n}": v.astype(np_dt) for n, v in params.items()}
    tensors["x"] = x_np.astype(np_dt)
    if coarse is not None:
        tensors["coarse_mask"] = coarse
    if fine is not None:
        tensors["fine_mask"] = fine
    rows_equal = fine is None or bool((fine == fine[:, :, :1, :]).all())
    meta = {"d_model": str(c.d_model), "n_heads": str(c.n_heads), "batch": str(c.batch), "seq_len": str(L),
            "chunk_size": str(chunk), "num_chunks": str(m), "coarse_mask": "none" if coarse is None else "bool",
            "fine_mask": "none" if fine is None else "bool", "fine_mask_rows_equal": G.b(rows_equal),
            "fully_masked_rows": G.b(fully_masked),
            "reference": "c2f_forward" if fully_masked else "c2f_reference.C2FAttention"}
    return tensors, dy, out, grads, meta


def _c2f2d_case(c: Case, tag: str, check_twin: bool):
    np_dt, t_dt = G.DTYPES[tag]
    H, W, bh, bw, gh, gw = c.sizes
    vocabulary = G.C2f2dCase(c.name, c.seed, c.description, H, W, bh, bw, (gh, gw), bias=c.bias, d_model=c.d_model,
                             n_heads=c.n_heads, batch=c.batch)
    (mh, mw), (gh, gw) = vocabulary.blocks, vocabulary.gmax
    params = G._c2f2d_parameters(vocabulary)
    x_np = G.stream(c.seed, "inputs").standard_normal(size=(c.batch, H * W, c.d_model))
    dy = G.stream(c.seed, "grad_output").standard_normal(size=(c.batch, H * W, c.d_model))
    mod = G._c2f2d_module(vocabulary).to(t_dt)
    G._load_exactly(mod, params, np_dt, c.name)
    x = {"input": torch.from_numpy(x_np.astype(np_dt))}
    out, grads = _backward(lambda: mod(x["input"], H, W), x, mod, "c2f2d.", dy, np_dt)
    tensors = {f"c2f2d.{n}": v.astype(np_dt) for n, v in params.items()}
    tensors["x"] = x_np.astype(np_dt)
    meta = {"d_model": str(c.d_model), "n_heads": str(c.n_heads), "batch": str(c.batch), "height": str(H),
            "width": str(W), "block_h": str(bh), "block_w": str(bw), "blocks_h": str(mh), "blocks_w": str(mw),
            "max_blocks_h": str(gh), "max_blocks_w": str(gw), "relative_position_bias": G.b(c.bias),
            "fully_masked_rows": "false", "reference": "c2f2d_reference.C2FAttention2D"}
    return tensors, dy, out, grads, meta


def _sparse_selection(c: Case):
    """The sparse family's search: the first seed from c.seed whose selection is the same in float64 and
    float32 with a margin (generate._sparse_try_seed), so that c2f selects exactly the stored chunks."""
    L, chunk, top_k = c.sizes
    vocabulary = G.SparseCase(c.name, c.seed, c.description, L, chunk, top_k, c.causal, batch=c.batch,
                              embed_dim=c.d_model, num_heads=c.n_heads, lengths=c.lengths,
                              require_empty_rows=c.require_empty_rows, gating=c.gating)
    kpm = None if not c.lengths else np.arange(L)[None, :] >= np.asarray(c.lengths)[:, None]  # True = padding
    for attempt in range(G.SPARSE_MAX_ATTEMPTS):
        sel, _ = G._sparse_try_seed(vocabulary, c.seed + attempt, kpm)
        if sel is not None:
            return c.seed + attempt, sel, kpm
    raise RuntimeError(f"{c.name}: no acceptable seed in {G.SPARSE_MAX_ATTEMPTS} attempts")


def _sparse_case(c: Case, tag: str, check_twin: bool):
    np_dt, t_dt = G.DTYPES[tag]
    L, chunk, top_k = c.sizes
    seed, sel, kpm = _sparse_selection(c)
    kpm_t = None if kpm is None else torch.from_numpy(kpm)
    dy = G.stream(c.seed, "grad_output").standard_normal(size=(c.batch, L, c.d_model))
    mha = torch.nn.MultiheadAttention(c.d_model, c.n_heads, batch_first=True).to(t_dt)
    G._load_exactly(mha, sel["params"], np_dt, c.name)
    x = {"input": torch.from_numpy(sel["x"].astype(np_dt))}
    fn = lambda: sparse_forward(mha, x["input"], sel["keep"], chunk, c.gating, c.causal, kpm_t)  # noqa: E731
    out, grads = _backward(fn, x, mha, "mha.", dy, np_dt)
    if check_twin:  # the forward is the sparse family's reference
        with torch.no_grad():
            want, _ = sparse_ref.sparse_c2f_attention(mha, x["input"], chunk, top_k, c.gating, c.causal, kpm_t,
                                                      keep=sel["keep"])
        if not np.allclose(out, G.to_numpy(want), rtol=0, atol=1e-12):
            raise RuntimeError(f"{c.name}: sparse_forward disagrees with sparse_reference.sparse_c2f_attention")
    tensors = {f"mha.{n}": v.astype(np_dt) for n, v in sel["params"].items()}
    tensors["x"] = sel["x"].astype(np_dt)
    if kpm is not None:
        tensors["key_padding_mask"] = kpm
    tensors["selected"] = sel["selected"]
    meta = {"embed_dim": str(c.d_model), "num_heads": str(c.n_heads), "batch": str(c.batch), "seq_len": str(L),
            "chunk_size": str(chunk), "top_k": str(top_k), "gating": c.gating, "causal": G.b(c.causal),
            "key_padding_mask": "none" if kpm is None else "bool", "fully_masked_rows": G.b(sel["empty"]),
            "selection_seed": str(seed), "reference": "sparse_forward (sparse_reference.py, selection constant)"}
    return tensors, dy, out, grads, meta


BUILDERS = {"fine": _fine_case, "c2f": _c2f_case, "c2f2d": _c2f2d_case, "sparse": _sparse_case}


def _case_files(family_dir: Path, c: Case) -> dict:
    files, entry_meta = {}, None
    for tag, (np_dt, _) in G.DTYPES.items():
        tensors, dy, out, grads, meta = BUILDERS[c.module](c, tag, check_twin=tag == "f64")
        if not (np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads.values())):
            raise RuntimeError(f"{c.name}/{tag}: output or gradients not finite")
        tensors.update(grad_output=dy.astype(np_dt), output=out, **grads)
        G._check_dtypes(c.name, {n: v for n, v in tensors.items() if v.dtype not in (bool, np.int64)}, np_dt)
        meta = dict(meta, module=c.module, seed=str(c.seed), torch_version=G.torch_version(), description=c.description)
        if entry_meta is not None and meta != entry_meta:
            raise RuntimeError(f"{c.name}: f32 and f64 metadata differ")
        entry_meta = meta
        files[tag] = G.write_case(family_dir, c.name, tag, tensors, meta)
    return {"name": c.name, "files": files, **{k: entry_meta[k] for k in sorted(entry_meta)}}


def gen_train_c2f(family_dir: Path) -> List[dict]:
    cases = _cases()
    names = [c.name for c in cases]
    if len(set(names)) != len(names) or len({c.seed for c in cases}) != len(cases):
        raise RuntimeError("train_c2f case names and seeds must be unique")
    return [_case_files(family_dir, c) for c in cases]
