"""State dicts and safetensors files: torch → c2f → torch round trips (same keys, same bits, same outputs),
torch parameters and torch tensors loaded directly, prefixes, and files written by another writer
(tests/reference/safetensors_io.py) and read back."""

import numpy as np
import pytest

from helpers import randomized, tokens, torch

import c2f
import safetensors_io
import torch.nn as nn
from c2f2d_reference import C2FAttention2D as Ref2D
from c2f_reference import C2FAttention as RefC2F
from hmha_reference import HMHA as RefHMHA

# (c2f layer, its sizes and options, the torch module with the same parameters and names, how to call it)
MODULES = [
    ("MultiHeadAttention", (16, 4), {}, lambda: nn.MultiheadAttention(16, 4, batch_first=True),
     lambda m, x: m(x, x, x, need_weights=False)[0]),
    ("MultiHeadAttention", (16, 4), dict(kdim=16, vdim=16, bias=False),
     lambda: nn.MultiheadAttention(16, 4, batch_first=True, bias=False), lambda m, x: m(x, x, x, need_weights=False)[0]),
    ("C2FAttention", (16, 4, 4), {}, lambda: RefC2F(16, 4, 4), lambda m, x: m(x)),
    ("C2FAttention2D", (16, 4, 2, 2), dict(max_blocks_h=4, max_blocks_w=4), lambda: Ref2D(16, 4, 2, 2, 4, 4),
     lambda m, x: m(x, 3, 4)),
    ("HMHA", (16, 2, 4), {}, lambda: RefHMHA(16, 2, 4), lambda m, x: m(x)),
    ("Conv1d", (16, 6, 3), dict(padding=1), lambda: nn.Conv1d(16, 6, 3, padding=1),
     lambda m, x: m(x.transpose(1, 2)).transpose(1, 2)),
    ("Linear", (16, 5), {}, lambda: nn.Linear(16, 5), lambda m, x: m(x)),
]
IDS = [f"{m[0]}{'-nobias' if m[2].get('bias') is False else ''}" for m in MODULES]


def c2f_call(layer, x):
    return layer(x, 3, 4) if layer.__class__.__name__.startswith("C2FAttention2D") else layer(x)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", MODULES, ids=IDS)
def test_round_trip_torch_c2f_torch(dtype, case):
    name, sizes, options, build, call = case
    src = randomized(build(), dtype, seed=11)
    layer = getattr(c2f, name)(*sizes, dtype=dtype, **options)
    layer.load_state_dict(src.state_dict())
    sd = layer.state_dict()
    want = src.state_dict()
    assert set(sd) == set(want)
    for k, v in sd.items():
        assert v.dtype == np.dtype(dtype) and v.shape == tuple(want[k].shape), k
        np.testing.assert_array_equal(v, want[k].numpy(), err_msg=k)
    dst = randomized(build(), dtype, seed=12)
    dst.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)
    x = tokens(2, 12, 16, dtype=dtype)
    # (with grad on: torch 1.13's no-grad fast path of a bias-free nn.MultiheadAttention fails)
    assert torch.equal(call(dst, x), call(src, x))
    np.testing.assert_allclose(c2f_call(layer, x), call(src, x).detach().numpy(),
                               **(dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=1e-10, rtol=1e-10)))


def test_parameters_that_require_grad_load_directly():
    mha = randomized(nn.MultiheadAttention(16, 4, batch_first=True), "float32")
    layer = c2f.MultiHeadAttention(16, 4)
    params = dict(mha.named_parameters())
    assert params["in_proj_weight"].requires_grad
    layer.load_state_dict(params)
    np.testing.assert_array_equal(layer.state_dict()["in_proj_weight"], params["in_proj_weight"].detach().numpy())


def test_float64_weights_load_into_float32_and_round():
    mha = randomized(nn.MultiheadAttention(16, 4, batch_first=True), "float64")
    layer = c2f.MultiHeadAttention(16, 4)
    layer.load_state_dict(mha.state_dict())
    np.testing.assert_array_equal(layer.state_dict()["out_proj.weight"],
                                  mha.out_proj.weight.detach().numpy().astype(np.float32))


def test_prefix():
    layer = c2f.C2FAttention(16, 4, 4, seed=5)
    sd = layer.state_dict(prefix="block.attn")
    assert all(k.startswith("block.attn.") for k in sd)
    other = c2f.C2FAttention(16, 4, 4, seed=6)
    other.load_state_dict(dict(sd, **{"head.weight": np.zeros((2, 2), np.float32)}), prefix="block.attn.")
    x = np.random.default_rng(0).standard_normal((1, 9, 16)).astype(np.float32)
    np.testing.assert_array_equal(other(x), layer(x))


def test_safetensors_round_trip(tmp_path):
    layer = c2f.SparseC2FAttention(16, 4, 4, 2, dtype="float64", seed=3)
    path = str(tmp_path / "w.safetensors")
    c2f.save_safetensors(path, layer.state_dict(), metadata={"layer": "sparse", "top_k": "2"})
    loaded = c2f.load_safetensors(path)
    assert c2f.load_safetensors_metadata(path) == {"layer": "sparse", "top_k": "2"}
    for k, v in layer.state_dict().items():
        assert loaded[k].dtype == np.float64
        np.testing.assert_array_equal(loaded[k], v)
    again = c2f.SparseC2FAttention(16, 4, 4, 2, dtype="float64", seed=4)
    again.load_state_dict(loaded)
    x = np.random.default_rng(1).standard_normal((2, 10, 16))
    np.testing.assert_array_equal(again(x), layer(x))


def test_safetensors_from_another_writer_and_every_dtype(tmp_path):
    arrays = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "f16": np.array([0.5, -2.0], np.float16),
              "i64": np.array([1, -2], np.int64), "u8": np.array([7], np.uint8), "b": np.array([True, False]),
              "empty": np.zeros((2, 0), np.float64)}
    path = str(tmp_path / "py.safetensors")
    safetensors_io.save_file(path, {k: safetensors_io.from_numpy(v) for k, v in arrays.items()}, {"by": "python"})
    loaded = c2f.load_safetensors(path)
    assert set(loaded) == set(arrays)
    for k, v in arrays.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        np.testing.assert_array_equal(loaded[k], v)
    # ... and c2f's file reads back with the other reader.
    ours = str(tmp_path / "c2f.safetensors")
    c2f.save_safetensors(ours, dict(arrays, scalar=np.array(3.5)))
    theirs = safetensors_io.load_file(ours)[0]
    assert theirs["scalar"].shape == () and c2f.load_safetensors(ours)["scalar"].shape == ()
    for k, v in arrays.items():
        np.testing.assert_array_equal(safetensors_io.to_numpy(theirs[k]), v)


def test_bfloat16_tensors_are_stored_as_bf16_and_read_as_float32(tmp_path):
    t = torch.tensor([1.5, -3.25, 1e-3], dtype=torch.bfloat16)
    path = str(tmp_path / "bf16.safetensors")
    c2f.save_safetensors(path, {"w": t})
    assert safetensors_io.load_file(path)[0]["w"].dtype == "BF16"
    loaded = c2f.load_safetensors(path)["w"]
    assert loaded.dtype == np.float32
    np.testing.assert_array_equal(loaded, t.float().numpy())


def test_torch_state_dict_saved_by_c2f_loads_into_a_layer(tmp_path):
    src = randomized(RefC2F(16, 4, 4), "float32", seed=2)
    path = str(tmp_path / "c2f.safetensors")
    c2f.save_safetensors(path, src.state_dict())
    layer = c2f.C2FAttention(16, 4, 4)
    layer.load_state_dict(c2f.load_safetensors(path))
    x = tokens(1, 13, 16)
    np.testing.assert_allclose(layer(x), src(x).detach().numpy(), atol=1e-5, rtol=1e-5)


def test_layers_copy_deeply():
    import copy
    layer = c2f.HMHA(16, 2, 4, causal=True, seed=1)
    twin = copy.deepcopy(layer)
    x = np.random.default_rng(2).standard_normal((1, 9, 16)).astype(np.float32)
    np.testing.assert_array_equal(twin(x), layer(x))
    twin.load_state_dict(c2f.HMHA(16, 2, 4, causal=True, seed=2).state_dict())
    assert not np.array_equal(twin(x), layer(x))  # a copy, not a view of the same layer
    assert copy.copy(layer).options == layer.options
