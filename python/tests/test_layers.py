"""Every layer of c2f, from Python, against its PyTorch reference module built here (torch.nn modules and
tests/reference/*.py, random weights loaded into c2f through load_state_dict): fp32 atol = rtol = 1e-5,
fp64 1e-10, several shapes (L = 1, partial chunks and windows) and masks."""

import copy

import numpy as np
import pytest

from helpers import DTYPES, assert_close, bool_mask, c2f_layer, randomized, tokens, torch

import c2f
import torch.nn as nn
import torch.nn.functional as F
from c2f2d_reference import C2FAttention2D as Ref2D
from c2f_reference import C2FAttention as RefC2F
from c2f_reference import CoarseAttention as RefCoarse
from c2f_reference import FineAttention as RefFine
from hmha_reference import HMHA as RefHMHA
from hmha_reference import C3K2Projection as RefC3K2
import sparse_reference

E, H = 16, 4


# ---------------------------------------------------------------------------------------------------------
# MultiHeadAttention: torch.nn.MultiheadAttention(batch_first=True)

def mha_pair(dtype, seed=0, **kwargs):
    ref = randomized(nn.MultiheadAttention(E, H, batch_first=True, **kwargs), dtype, seed)
    options = {k: v for k, v in kwargs.items() if k in ("kdim", "vdim", "bias")}
    return ref, c2f_layer("MultiHeadAttention", ref, dtype, E, H, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 7, 37, 130])
def test_mha_self_attention(dtype, length):
    ref, layer = mha_pair(dtype)
    x = tokens(2, length, E, dtype=dtype)
    want = ref(x, x, x, need_weights=False)[0]
    assert_close(layer(x), want, dtype)
    assert_close(layer.forward(x.numpy()), want, dtype)  # numpy in, the same
    assert_close(layer(x, x, x), want, dtype)  # query, key, value given


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_mha_cross_attention(dtype, bias):
    ref, layer = mha_pair(dtype, kdim=6, vdim=10, bias=bias)
    q, k, v = tokens(2, 5, E, dtype=dtype), tokens(2, 9, 6, dtype=dtype, seed=3), tokens(2, 9, 10, dtype=dtype, seed=4)
    assert_close(layer(q, k, v), ref(q, k, v, need_weights=False)[0], dtype)


def mha_masks(B, L):
    """(name, c2f keywords, torch keywords) for every mask kind nn.MultiheadAttention takes."""
    ignore = bool_mask(L, L)
    additive = torch.randn(L, L, generator=torch.Generator().manual_seed(5)).double()
    additive[ignore] = float("-inf")
    per_head = bool_mask(B * H, L, L, seed=6)
    padding = torch.zeros(B, L, dtype=torch.bool)
    padding[0, L - 3:] = True
    padding_float = torch.zeros(B, L, dtype=torch.float64)
    padding_float[1, :2] = float("-inf")
    padding_float[0, 4] = -1.5
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    return [
        ("bool 2-D", dict(attn_mask=ignore), dict(attn_mask=ignore)),
        ("float 2-D", dict(attn_mask=additive), dict(attn_mask=additive)),
        ("bool 3-D per head", dict(attn_mask=per_head), dict(attn_mask=per_head)),
        ("bool key padding", dict(key_padding_mask=padding), dict(key_padding_mask=padding)),
        ("float key padding", dict(key_padding_mask=padding_float), dict(key_padding_mask=padding_float)),
        ("causal", dict(causal=True), dict(attn_mask=causal)),
        ("keep", dict(attn_mask=c2f.keep(~ignore)), dict(attn_mask=ignore)),
        ("both", dict(attn_mask=ignore, key_padding_mask=padding), dict(attn_mask=ignore, key_padding_mask=padding)),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(8))
def test_mha_masks(dtype, case):
    B, L = 2, 11
    name, ours, theirs = mha_masks(B, L)[case]
    to = lambda d: {k: (v.to(torch.float64 if dtype == "float64" else torch.float32)  # noqa: E731
                        if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ref, layer = mha_pair(dtype)
    x = tokens(B, L, E, dtype=dtype)
    assert_close(layer(x, **ours), ref(x, x, x, need_weights=False, **to(theirs))[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("average", [True, False])
def test_mha_attention_weights(dtype, average):
    ref, layer = mha_pair(dtype)
    x = tokens(2, 9, E, dtype=dtype)
    mask = bool_mask(9, 9)
    y, w = layer.forward_with_weights(x, attn_mask=mask, average_attn_weights=average)
    want_y, want_w = ref(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=average)
    assert_close(y, want_y, dtype)
    assert_close(w, want_w, dtype)


@pytest.mark.parametrize("kernel", ["streaming", "naive"])
def test_mha_kernels_and_threads_agree(kernel):
    ref, _ = mha_pair("float32")
    x = tokens(2, 70, E)
    outs = []
    for threads in (1, 2):
        layer = c2f_layer("MultiHeadAttention", ref, "float32", E, H, kernel=kernel, num_threads=threads,
                          query_block=16, key_block=32)
        outs.append(layer(x))
    assert_close(outs[0], ref(x, x, x, need_weights=False)[0], "float32")
    np.testing.assert_array_equal(outs[0], outs[1])  # the same bits for any thread count


def test_mha_bfloat16_compute():
    """compute="bfloat16" (docs/bf16.md): within 2e-2 · max|y| of torch under torch.autocast("cpu",
    bfloat16) and of fp32, not equal to fp32 (it rounds), the same bits for any thread count; a double
    layer and an unknown name are refused."""
    ref, _ = mha_pair("float32")
    x = tokens(2, 70, E)
    outs = [c2f_layer("MultiHeadAttention", ref, "float32", E, H, compute="bfloat16", num_threads=t)(x)
            for t in (1, 2)]
    np.testing.assert_array_equal(outs[0], outs[1])
    want = ref(x, x.clone(), x.clone(), need_weights=False)[0].detach().numpy()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = ref(x, x.clone(), x.clone(), need_weights=False)[0].float().detach().numpy()
    scale = np.abs(want).max()
    assert np.abs(outs[0] - want).max() <= 2e-2 * scale
    assert np.abs(outs[0] - autocast).max() <= 2e-2 * scale
    assert np.abs(outs[0] - want).max() > 1e-6 * scale
    with pytest.raises(ValueError, match="compute BFloat16 needs float, got double"):
        c2f.MultiHeadAttention(E, H, dtype="float64", compute="bfloat16")
    with pytest.raises((ValueError, TypeError), match="compute"):
        c2f.MultiHeadAttention(E, H, compute="fp8")


def test_bf16_engines():
    """set_bf16_engine (docs/bf16.md#engines): each engine this CPU has gives outputs within 1e-3 · max|y| of
    the fallback's; "auto" runs the rule's pick; a name that is none is a ValueError naming the choices, and
    an engine the CPU lacks one naming what is missing."""
    ref, _ = mha_pair("float32")
    x = tokens(2, 70, E)
    layer = c2f_layer("MultiHeadAttention", ref, "float32", E, H, compute="bfloat16")
    assert c2f.get_bf16_engine() == "auto"
    auto = c2f.bf16_engine()
    assert auto in ("fallback", "dot", "tiles")
    outs = {}
    try:
        for name in ("fallback", "dot", "tiles"):
            try:
                c2f.set_bf16_engine(name)
            except ValueError as e:
                assert name != "fallback" and "lacks" in str(e)
                continue
            assert c2f.bf16_engine() == name and c2f.get_bf16_engine() == name
            outs[name] = layer(x)
        with pytest.raises(ValueError, match="auto, fallback, dot, tiles"):
            c2f.set_bf16_engine("amx")
    finally:
        c2f.set_bf16_engine("auto")
    assert c2f.bf16_engine() == auto and auto in outs
    scale = np.abs(outs["fallback"]).max()
    for name, y in outs.items():
        assert np.abs(y - outs["fallback"]).max() <= 1e-3 * scale, name


@pytest.mark.parametrize("name, args, call", [
    ("Conv1d", (E, 6, 3), ()), ("C3K2Projection", (E, H), ()), ("HMHA", (E, H, 8), ()),
    ("SparseC2FAttention", (E, H, 8, 2), ()), ("C2FAttention2D", (E, H, 2, 3), (5, 14))])
def test_every_layer_takes_bfloat16_compute(name, args, call):
    """compute="bfloat16" on the layers beyond MultiHeadAttention (docs/bf16.md): the same weights as the fp32
    layer (seed), within 2e-2 · max|y| of it but not equal (it rounds), the same bits for any thread count;
    float64 refused."""
    x = tokens(2, 70, E)
    fp32 = getattr(c2f, name)(*args, seed=5)(x, *call)
    outs = [getattr(c2f, name)(*args, seed=5, compute="bfloat16", num_threads=t)(x, *call) for t in (1, 2)]
    np.testing.assert_array_equal(outs[0], outs[1])
    scale = np.abs(fp32).max()
    assert np.abs(outs[0] - fp32).max() <= 2e-2 * scale
    assert np.abs(outs[0] - fp32).max() > 1e-6 * scale
    with pytest.raises(ValueError, match="compute BFloat16 needs float, got double"):
        getattr(c2f, name)(*args, dtype="float64", compute="bfloat16")


# ---------------------------------------------------------------------------------------------------------
# The coarse-to-fine article's modules (tests/reference/c2f_reference.py); masks 1 = keep.

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunks", [1, 6])
@pytest.mark.parametrize("masked", [False, True])
def test_coarse_attention(dtype, chunks, masked):
    ref = randomized(RefCoarse(E, H), dtype)
    layer = c2f_layer("CoarseAttention", ref, dtype, E, H)
    x = tokens(2, chunks, E, dtype=dtype)
    keep = ~bool_mask(2, chunks, chunks) if masked else None
    want = ref(x, mask=keep)
    assert_close(layer(x, attn_mask=None if keep is None else c2f.keep(keep)), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True])
def test_fine_attention(dtype, masked):
    B, m, k = 2, 3, 5
    ref = randomized(RefFine(E, H), dtype)
    layer = c2f_layer("FineAttention", ref, dtype, E, H)
    x, context = tokens(B, m, k, E, dtype=dtype), tokens(B, m, E, dtype=dtype, seed=7)
    keep = ~bool_mask(B, m, k, k) if masked else None
    want = ref(x, context, mask=keep)
    assert_close(layer(x, context, attn_mask=None if keep is None else c2f.keep(keep)), want, dtype)
    # The same on the flat tokens in chunks of k.
    flat = layer.forward_chunked(x.reshape(B, m * k, E), k, context,
                                 attn_mask=None if keep is None else c2f.keep(keep))
    assert_close(flat, want.reshape(B, m * k, E), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 5, 16, 61])
@pytest.mark.parametrize("fine_path", ["auto", "general"])
def test_c2f_attention(dtype, length, fine_path):
    chunk = 8
    ref = randomized(RefC2F(E, H, chunk), dtype)
    layer = c2f_layer("C2FAttention", ref, dtype, E, H, chunk, fine_path=fine_path)
    x = tokens(2, length, E, dtype=dtype)
    assert_close(layer(x), ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["coarse", "fine", "both"])
def test_c2f_attention_masks(dtype, which):
    B, L, chunk = 2, 61, 8
    m = (L + chunk - 1) // chunk
    ref = randomized(RefC2F(E, H, chunk), dtype)
    layer = c2f_layer("C2FAttention", ref, dtype, E, H, chunk)
    x = tokens(B, L, E, dtype=dtype)
    coarse = ~bool_mask(B, m, m, seed=8) if which != "fine" else None
    fine = ~bool_mask(B, m, chunk, chunk, seed=9) if which != "coarse" else None  # rows differ: the general path
    got = layer(x, attn_mask=None if coarse is None else c2f.keep(coarse),
                fine_attn_mask=None if fine is None else c2f.keep(fine))
    assert_close(got, ref(x, coarse_mask=coarse, fine_mask=fine), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grid", [(1, 1, 2, 2), (1, 37, 1, 8), (7, 5, 2, 3), (9, 13, 4, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_c2f_attention_2d(dtype, grid, bias):
    height, width, bh, bw = grid
    ref = randomized(Ref2D(E, H, bh, bw, 8, 8, relative_position_bias=bias), dtype)
    layer = c2f_layer("C2FAttention2D", ref, dtype, E, H, bh, bw, max_blocks_h=8, max_blocks_w=8,
                      relative_position_bias=bias)
    x = tokens(2, height * width, E, dtype=dtype)
    assert_close(layer(x, height, width), ref(x, height, width), dtype)


# ---------------------------------------------------------------------------------------------------------
# Conv1d (torch.nn.Conv1d on [batch, channels, length]), C3K2Projection and HMHA (hmha_reference.py).

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 0, 1), (3, 1, 1), (3, 1, 2), (5, 2, 1), (5, 0, 2), (3, 0, 1)])
@pytest.mark.parametrize("length", [1, 7])
@pytest.mark.parametrize("bias", [True, False])
def test_conv1d(dtype, shape, length, bias):
    kernel, padding, groups = shape
    ref = randomized(nn.Conv1d(8, 6, kernel, padding=padding, groups=groups, bias=bias), dtype)
    layer = c2f_layer("Conv1d", ref, dtype, 8, 6, kernel, padding=padding, groups=groups, bias=bias)
    x = tokens(2, length, 8, dtype=dtype)
    if length + 2 * padding < kernel:  # torch.nn.Conv1d refuses an input shorter than its kernel; c2f: no rows
        assert layer(x).shape == (2, 0, 6)
        return
    assert_close(layer(x), ref(x.transpose(1, 2)).transpose(1, 2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d(dtype):
    ref = randomized(nn.Conv1d(8, 6, 3), dtype)
    layer = c2f_layer("Conv1d", ref, dtype, 8, 6, 3, causal=True)
    x = tokens(2, 9, 8, dtype=dtype)
    assert_close(layer(x), ref(F.pad(x.transpose(1, 2), (2, 0))).transpose(1, 2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length", [1, 9])
def test_c3k2_projection(dtype, causal, length):
    ref = randomized(RefC3K2(E, H, causal), dtype)
    layer = c2f_layer("C3K2Projection", ref, dtype, E, H, causal=causal)
    x = tokens(2, length, E, dtype=dtype)
    assert_close(layer(x), ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length,window", [(1, 4), (5, 4), (37, 4), (64, 16), (150, 16)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("levels", [(1, 2, 3), (1,), (2,), (3,)])
def test_hmha(dtype, length, window, causal, levels):
    ref = randomized(RefHMHA(E, 2, window, levels, causal), dtype)
    layer = c2f_layer("HMHA", ref, dtype, E, 2, window, causal=causal, levels=levels)
    x = tokens(2, length, E, dtype=dtype)
    assert_close(layer(x), ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(dtype):
    ref = randomized(nn.Linear(8, 5), dtype)
    layer = c2f_layer("Linear", ref, dtype, 8, 5)
    x = tokens(3, 4, 8, dtype=dtype)
    assert_close(layer(x), ref(x), dtype)


# ---------------------------------------------------------------------------------------------------------
# SparseC2FAttention: sparse_reference.py's dense statement on an nn.MultiheadAttention's weights.

def sparse_case(dtype, gating, causal, padded):
    """(mha, x, key padding, float64 selection) for the first seed whose selection has a safe margin in
    float64 and float32 alike (as tests/reference/generate.py picks the fixtures' seeds)."""
    B, L, chunk, top_k = 2, 37, 8, 2
    kpm = None
    if padded:
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, L - 6:] = True
    for seed in range(40):
        mha64 = randomized(nn.MultiheadAttention(E, H, batch_first=True), "float64", seed, scale=0.5)
        x64 = tokens(B, L, E, dtype="float64", seed=100 + seed)
        rounded = copy.deepcopy(mha64).float().double(), x64.float().double()  # float32 values, float64 arithmetic
        sel = [sparse_reference.selection(m, xx, chunk, top_k, gating, causal, kpm)
               for m, xx in ((mha64, x64), rounded)]
        if torch.equal(sel[0][1], sel[1][1]) and min(float(s[2].min()) for s in sel) >= sparse_reference.MARGIN_REL:
            mha = mha64 if dtype == "float64" else mha64.float()
            return mha, x64.to(mha.in_proj_weight.dtype), kpm, sel[0]
    raise AssertionError("no seed with a safe selection margin")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gating,causal", [("chunk", False), ("token", False), ("token", True)])
@pytest.mark.parametrize("padded", [False, True])
def test_sparse_c2f_attention(dtype, gating, causal, padded):
    chunk, top_k = 8, 2
    mha, x, kpm, (keep, selected, _) = sparse_case(dtype, gating, causal, padded)
    layer = c2f_layer("SparseC2FAttention", mha, dtype, E, H, chunk, top_k, causal=causal,
                      gating="per_chunk" if gating == "chunk" else "per_token")
    y, got_sel = layer.forward_with_selection(x, key_padding_mask=kpm)
    want, _ = sparse_reference.sparse_c2f_attention(mha, x, chunk, top_k, gating, causal, kpm, keep=keep)
    assert_close(y, want, dtype)
    assert_close(layer(x, key_padding_mask=kpm), want, dtype)
    widened = np.full(selected.shape, -1)
    widened[..., :got_sel.shape[-1]] = got_sel
    np.testing.assert_array_equal(widened, selected.numpy())


@pytest.mark.parametrize("causal", [False, True])
def test_sparse_top_k_covering_every_chunk_is_mha(causal):
    mha = randomized(nn.MultiheadAttention(E, H, batch_first=True), "float64")
    layer = c2f_layer("SparseC2FAttention", mha, "float64", E, H, 4, 100, causal=causal)
    x = tokens(2, 23, E, dtype="float64")
    mask = torch.ones(23, 23, dtype=torch.bool).triu(1) if causal else None
    assert_close(layer(x), mha(x, x, x, attn_mask=mask, need_weights=False)[0], "float64")
