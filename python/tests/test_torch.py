"""c2f.torch.accelerate: a PyTorch model with its nn.MultiheadAttention and coarse-to-fine modules replaced
by c2f gives the untouched model's outputs (fp32 ≤ 1e-5, fp64 ≤ 1e-10), keeps its state dict, follows
changes of its weights, and refuses what it cannot run as PyTorch would."""

import copy

import numpy as np
import pytest

from helpers import TOL, bool_mask, randomized, tokens, torch

import c2f
import c2f.torch as ct
import torch.nn as nn
from c2f2d_reference import C2FAttention2D as Ref2D
from c2f_reference import C2FAttention as RefC2F

D, HEADS = 32, 4


class Model(nn.Module):
    """A small model with every kind accelerate replaces: a TransformerEncoderLayer (its self_attn), a
    bare nn.MultiheadAttention and the article's C2FAttention, between ordinary PyTorch layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.encoder = nn.TransformerEncoderLayer(D, HEADS, 64, dropout=0.1, batch_first=True)
        self.mha = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.c2f = RefC2F(D, HEADS, chunk_size=8)
        self.head = nn.Linear(D, 3)

    def forward(self, x, padding=None):
        h = self.encoder(self.embed(x), src_key_padding_mask=padding)
        h = h + self.mha(h, h, h, key_padding_mask=padding, need_weights=False)[0]
        return self.head(h + self.c2f(h))


def pair(dtype, seed=0):
    ref = randomized(Model(), dtype, seed)
    return ref, ct.accelerate(copy.deepcopy(ref))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("length", [1, 13, 40])
def test_accelerated_model_gives_the_same_outputs(dtype, length):
    ref, fast = pair(dtype)
    assert ct.accelerated(fast) == ["encoder.self_attn", "mha", "c2f"]
    x = tokens(2, length, 8, dtype=dtype)
    with torch.no_grad():
        want, got = ref(x), fast(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), **TOL[dtype])


def test_key_padding_through_the_model():
    ref, fast = pair("float32")
    x, padding = tokens(2, 20, 8), torch.zeros(2, 20, dtype=torch.bool)
    padding[1, 15:] = True
    with torch.inference_mode():
        want, got = ref(x, padding), fast(x, padding)
    np.testing.assert_allclose(got.numpy(), want.numpy(), **TOL["float32"])


@pytest.mark.parametrize("masks", ["none", "src_mask", "padding"])
def test_transformer_encoder_layer_with_its_self_attn_replaced(masks):
    layer = randomized(nn.TransformerEncoderLayer(D, HEADS, 64, batch_first=True), "float32", 3)
    fast = ct.accelerate(copy.deepcopy(layer))
    assert isinstance(fast.self_attn, ct.MultiheadAttention)
    x = tokens(3, 17, D)
    kw = {}
    if masks == "src_mask":
        kw["src_mask"] = bool_mask(17, 17)
    elif masks == "padding":
        kw["src_key_padding_mask"] = torch.zeros(3, 17, dtype=torch.bool)
        kw["src_key_padding_mask"][0, 12:] = True
    with torch.no_grad():
        np.testing.assert_allclose(fast(x, **kw).numpy(), layer(x, **kw).numpy(), **TOL["float32"])


def test_transformer_decoder_layer_self_and_cross_attention():
    layer = randomized(nn.TransformerDecoderLayer(D, HEADS, 64, batch_first=True), "float64", 4)
    fast = ct.accelerate(copy.deepcopy(layer))
    assert ct.accelerated(fast) == ["self_attn", "multihead_attn"]
    tgt, memory = tokens(2, 9, D, dtype="float64"), tokens(2, 14, D, dtype="float64", seed=5)
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)
    with torch.no_grad():
        np.testing.assert_allclose(fast(tgt, memory, tgt_mask=causal).numpy(),
                                   layer(tgt, memory, tgt_mask=causal).numpy(), **TOL["float64"])


def test_the_replacement_is_called():
    layer = randomized(nn.TransformerEncoderLayer(D, HEADS, 64, batch_first=True), "float32")
    fast = ct.accelerate(copy.deepcopy(layer))
    calls = []
    fast.self_attn.register_forward_hook(lambda *args: calls.append(1))
    with torch.no_grad():
        fast(tokens(1, 5, D))
    assert calls == [1]  # torch's fast path (which bypasses self_attn) is not taken


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_mha_options(dtype):
    for kwargs in (dict(batch_first=False), dict(batch_first=True, kdim=6, vdim=10), dict(batch_first=True, bias=False)):
        mha = randomized(nn.MultiheadAttention(D, HEADS, **kwargs), dtype)
        fast = ct.accelerate(copy.deepcopy(mha))
        assert isinstance(fast, ct.MultiheadAttention)
        q = tokens(2, 7, D, dtype=dtype)
        k, v = tokens(2, 9, mha.kdim, dtype=dtype, seed=2), tokens(2, 9, mha.vdim, dtype=dtype, seed=3)
        if not mha.batch_first:
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        # (grad on: torch 1.13's no-grad fast path of a bias-free nn.MultiheadAttention fails)
        want, want_w = mha(q, k, v)
        got, got_w = fast(q, k, v)
        np.testing.assert_allclose(got.numpy(), want.detach().numpy(), **TOL[dtype])
        np.testing.assert_allclose(got_w.numpy(), want_w.detach().numpy(), **TOL[dtype])


def test_mha_unbatched_and_per_head_weights():
    mha = randomized(nn.MultiheadAttention(D, HEADS, batch_first=True), "float64")
    fast = ct.accelerate(copy.deepcopy(mha))
    x = tokens(6, D, dtype="float64")
    with torch.no_grad():
        for average in (True, False):
            want = mha(x, x, x, average_attn_weights=average)
            got = fast(x, x, x, average_attn_weights=average)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g.numpy(), w.numpy(), **TOL["float64"])


def test_c2f_module_with_masks_and_2d():
    ref = randomized(RefC2F(D, HEADS, 8), "float32")
    fast = ct.accelerate(copy.deepcopy(ref))
    assert isinstance(fast, ct.C2FAttention)
    x = tokens(2, 29, D)
    coarse, fine = ~bool_mask(2, 4, 4), (~bool_mask(2, 4, 8, 8, seed=4)).float()  # 1 = keep, bool or float
    with torch.no_grad():
        np.testing.assert_allclose(fast(x, coarse, fine).numpy(), ref(x, coarse, fine).numpy(), **TOL["float32"])
    ref2 = randomized(Ref2D(D, HEADS, 2, 3, 4, 4), "float32")
    fast2 = ct.accelerate(copy.deepcopy(ref2))
    assert isinstance(fast2, ct.C2FAttention2D)
    x = tokens(2, 35, D)
    with torch.no_grad():
        np.testing.assert_allclose(fast2(x, 7, 5).numpy(), ref2(x, 7, 5).numpy(), **TOL["float32"])


def test_state_dict_is_kept_and_weight_changes_are_followed():
    ref, fast = pair("float32")
    assert list(fast.state_dict()) == list(ref.state_dict())
    other = randomized(Model(), "float32", seed=7)
    fast.load_state_dict(other.state_dict())  # into the accelerated model: c2f reloads before the next call
    x = tokens(2, 16, 8)
    with torch.no_grad():
        np.testing.assert_allclose(fast(x).numpy(), other(x).numpy(), **TOL["float32"])
        fast.mha.out_proj.weight.mul_(0.5)  # an in-place edit
        other.mha.out_proj.weight.mul_(0.5)
        np.testing.assert_allclose(fast(x).numpy(), other(x).numpy(), **TOL["float32"])
    fast.double()  # a dtype change rebuilds the layers in float64
    other.double()
    with torch.no_grad():
        np.testing.assert_allclose(fast(x.double()).numpy(), other(x.double()).numpy(), **TOL["float64"])


def test_refusals():
    model = randomized(Model(), "float32")
    with pytest.raises(ct.Unsupported, match="training mode"):
        ct.accelerate(model.train())
    fast = ct.accelerate(model.eval())
    x = tokens(1, 9, 8)
    with pytest.raises(ct.Unsupported, match="requires grad"):
        fast(x)  # the encoder's output requires grad: c2f computes no gradients
    with pytest.raises(ct.Unsupported, match="requires grad"):
        fast.mha(x.new_ones(1, 3, D).requires_grad_(), x.new_ones(1, 3, D), x.new_ones(1, 3, D))
    fast.train()
    with pytest.raises(ct.Unsupported, match="training mode"), torch.no_grad():
        fast(x)
    with pytest.raises(ct.Unsupported, match="add_bias_kv"):
        ct.accelerate(nn.MultiheadAttention(D, HEADS, add_bias_kv=True).eval())
    with pytest.raises(ct.Unsupported, match="float32 or float64"):
        ct.accelerate(nn.MultiheadAttention(D, HEADS).half().eval())
    assert issubclass(ct.Unsupported, ValueError)


def test_module_with_the_structure_but_other_parameters_is_refused():
    module = RefC2F(D, HEADS, 8).eval()
    module.fine_attn.extra = nn.Linear(2, 2)
    with pytest.raises(ct.Unsupported, match="extra"):
        ct.accelerate(module)


def test_import_c2f_does_not_import_torch():
    import subprocess
    import sys
    code = "import sys, c2f; assert 'torch' not in sys.modules; import c2f.torch; assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    assert c2f.torch is ct
