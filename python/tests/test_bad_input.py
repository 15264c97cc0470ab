"""Bad input from Python is a ValueError (what c2f's C++ refuses, with its message) or a TypeError (a wrong
dtype, dimension count or type, naming the expected and the given) — never a crash. The last test throws a
few thousand random wrong inputs at every layer in a child interpreter, which must end normally."""

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import c2f

def dims(x):
    """x's shape padded to [B, L, ...] (a bad x still gets a context / grid of some shape)."""
    shape = tuple(getattr(x, "shape", ())) + (1, 1)
    return shape[0], shape[1]


def context(x):
    """FineAttention's coarse context for x in chunks of 4."""
    b, length = dims(x)
    return np.zeros((b, math.ceil(length / 4), 8), getattr(x, "dtype", np.float32))


# Every layer, small: (sizes, options, how to call it on x [B, L, 8]).
LAYERS = {
    "Linear": ((8, 5), {}, lambda l, x, **m: l(x, **m)),
    "Conv1d": ((8, 6, 3), dict(padding=1), lambda l, x, **m: l(x, **m)),
    "C3K2Projection": ((8, 2), {}, lambda l, x, **m: l(x, **m)),
    "MultiHeadAttention": ((8, 2), {}, lambda l, x, **m: l(x, **m)),
    "CoarseAttention": ((8, 2), {}, lambda l, x, **m: l(x, **m)),
    "FineAttention": ((8, 2), {}, lambda l, x, **m: l.forward_chunked(x, 4, context(x), **m)),
    "C2FAttention": ((8, 2, 4), {}, lambda l, x, **m: l(x, **m)),
    "C2FAttention2D": ((8, 2, 2, 2), {}, lambda l, x, **m: l(x, 1, dims(x)[1], **m)),
    "HMHA": ((8, 2, 4), {}, lambda l, x, **m: l(x, **m)),
    "SparseC2FAttention": ((8, 2, 4, 2), {}, lambda l, x, **m: l(x, **m)),
}
CASES = [(name, dtype) for name in LAYERS for dtype in ("float32", "float64")]


def make(name, dtype):
    sizes, options, call = LAYERS[name]
    return getattr(c2f, name)(*sizes, dtype=dtype, **options), call


def x_of(shape, dtype):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def test_every_layer_is_listed():
    assert set(LAYERS) == set(c2f.LAYERS)


@pytest.mark.parametrize("name,dtype", CASES)
def test_wrong_dtype_is_a_type_error_naming_both(name, dtype):
    layer, call = make(name, dtype)
    other = "float64" if dtype == "float32" else "float32"
    for wrong in (other, "int32", "float16", "bool"):
        with pytest.raises(TypeError) as e:
            call(layer, x_of((2, 5, 8), wrong))
        assert dtype in str(e.value) and str(np.dtype(wrong)) in str(e.value)


@pytest.mark.parametrize("name,dtype", CASES)
def test_wrong_ndim_is_a_type_error(name, dtype):
    layer, call = make(name, dtype)
    for shape in ((5, 8), (1, 2, 5, 8), ()):
        with pytest.raises(TypeError, match="3-D") as e:
            call(layer, x_of(shape, dtype))
        assert f"{len(shape)}-D" in str(e.value)


@pytest.mark.parametrize("name,dtype", CASES)
def test_wrong_feature_size_is_a_value_error_naming_the_shapes(name, dtype):
    layer, call = make(name, dtype)
    with pytest.raises(ValueError, match=r"\[2, 5, 7\]") as e:
        call(layer, x_of((2, 5, 7), dtype))
    assert "8" in str(e.value)


@pytest.mark.parametrize("name,dtype", CASES)
def test_not_an_array_is_a_type_error(name, dtype):
    layer, call = make(name, dtype)
    for obj in (None, "abc", 3, [[["a"]]], object()):
        with pytest.raises(TypeError):
            call(layer, obj)


@pytest.mark.parametrize("name,dtype", CASES)
def test_non_contiguous_input_gives_the_contiguous_result(name, dtype):
    layer, call = make(name, dtype)
    x = x_of((2, 12, 8), dtype)
    np.testing.assert_array_equal(call(layer, np.asfortranarray(x)), call(layer, x))
    np.testing.assert_array_equal(call(layer, x_of((2, 24, 8), dtype)[:, ::2]), call(layer, x_of((2, 24, 8), dtype)[:, ::2].copy()))


@pytest.mark.parametrize("name,dtype", CASES)
def test_zero_size_inputs(name, dtype):
    layer, call = make(name, dtype)
    assert call(layer, x_of((0, 5, 8), dtype)).shape[:2] == (0, 5)
    y = call(layer, x_of((2, 0, 8), dtype))
    assert y.shape[:2] == (2, 0) and y.size == 0


@pytest.mark.parametrize("name,dtype", CASES)
def test_nan_input_reaches_the_output(name, dtype):
    layer, call = make(name, dtype)
    x = x_of((2, 8, 8), dtype)
    x[1, 2, 3] = np.nan
    y = call(layer, x)
    assert np.isnan(y[1]).any() and np.isfinite(y[0]).all()


def test_torch_tensors_that_numpy_cannot_read_are_type_errors():
    torch = pytest.importorskip("torch")
    layer = c2f.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match="requires grad"):
        layer(torch.zeros(1, 3, 8, requires_grad=True))
    with pytest.raises(TypeError, match="float32"):
        layer(torch.zeros(1, 3, 8, dtype=torch.float64))
    with pytest.raises(TypeError):
        layer(torch.zeros(1, 3, 8, dtype=torch.bfloat16))


def test_huge_broadcast_input_is_refused_before_a_copy():
    layer = c2f.MultiHeadAttention(8, 2)
    huge = np.broadcast_to(np.zeros(1, np.float32), (1 << 20, 1 << 20, 8))
    with pytest.raises(ValueError, match="1 TiB"):
        layer(huge)


# ---------------------------------------------------------------------------------------------------------
# Constructors and options

def test_constructor_errors():
    with pytest.raises(ValueError, match="divisible"):
        c2f.MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        c2f.C2FAttention(8, 2, 0)
    with pytest.raises(ValueError, match="1 TiB"):
        c2f.MultiHeadAttention(1 << 19, 1)
    with pytest.raises(ValueError):
        c2f.Conv1d(8, 6, 3, groups=5)
    with pytest.raises(TypeError, match="missing required argument 'chunk_size'"):
        c2f.C2FAttention(8, 2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk'"):
        c2f.C2FAttention(8, 2, chunk=4)
    with pytest.raises(TypeError, match="multiple values for argument 'num_heads'"):
        c2f.MultiHeadAttention(8, 2, num_heads=2)
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        c2f.MultiHeadAttention(8, 2, 3)
    with pytest.raises(TypeError, match="embed_dim must be an int, got str"):
        c2f.MultiHeadAttention("8", 2)
    with pytest.raises(TypeError, match="must be an int, got float"):
        c2f.MultiHeadAttention(8.0, 2)
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        c2f.MultiHeadAttention(8, 2, causal=1)
    with pytest.raises(TypeError, match="must be an int, got bool"):
        c2f.MultiHeadAttention(8, 2, num_threads=True)
    with pytest.raises(ValueError, match="kernel must be one of 'streaming', 'naive', got 'flash'"):
        c2f.MultiHeadAttention(8, 2, kernel="flash")
    with pytest.raises(ValueError, match="out of range"):
        c2f.MultiHeadAttention(8, 2, num_threads=1 << 40)
    with pytest.raises(ValueError, match="out of range"):
        c2f.MultiHeadAttention(8, 2, seed=-1)
    with pytest.raises(ValueError, match=r"levels from \(1, 2, 3\)"):
        c2f.HMHA(8, 2, 4, levels=(1, 4))
    with pytest.raises(ValueError, match="per-chunk gating"):
        c2f.SparseC2FAttention(8, 2, 4, 2, causal=True, gating="per_chunk")
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        c2f.MultiHeadAttention(8, 2, dtype="int32")
    with pytest.raises(TypeError, match="num_threads must be an int"):
        c2f.MultiHeadAttention(8, 2).num_threads = "2"


def test_options_are_kept():
    layer = c2f.SparseC2FAttention(8, 2, 4, 2, causal=True, kernel="naive", query_block=5, seed=7)
    assert layer.options["causal"] is True and layer.options["kernel"] == "naive"
    assert layer.options["gating"] == "auto" and layer.options["query_block"] == 5 and layer.options["seed"] == 7
    assert (layer.embed_dim, layer.num_heads, layer.chunk_size, layer.top_k) == (8, 2, 4, 2)
    assert c2f.HMHA(8, 2, 4, levels=[3, 1]).options["levels"] == (1, 3)
    assert isinstance(layer, c2f.SparseC2FAttention) and not isinstance(layer, c2f.HMHA)
    assert c2f.MultiHeadAttention(8, 2, dtype="float64").dtype == np.float64
    assert "SparseC2FAttention(embed_dim=8" in repr(layer)


# ---------------------------------------------------------------------------------------------------------
# Masks

def test_mask_errors():
    mha = c2f.MultiHeadAttention(8, 2)
    x = x_of((2, 5, 8), "float32")
    with pytest.raises(ValueError, match="MultiHeadAttention"):
        mha(x, attn_mask=np.zeros((4, 5), bool))  # wrong shape
    with pytest.raises(ValueError):
        mha(x, key_padding_mask=np.zeros((3, 5), bool))
    with pytest.raises(TypeError, match="bool or float"):
        mha(x, attn_mask=np.zeros((5, 5), np.int32))
    with pytest.raises(TypeError, match="2-D"):
        mha(x, key_padding_mask=np.zeros((2, 5, 1), bool))
    with pytest.raises(TypeError, match="bool or float"):
        mha(x, attn_mask=np.zeros(5, bool))
    with pytest.raises(TypeError, match="c2f.keep"):
        mha(x, attn_mask=c2f.keep(np.zeros((5, 5), np.float32)))
    with pytest.raises(ValueError, match="not both"):
        mha(x, attn_mask=np.zeros((5, 5), bool), causal=True)
    with pytest.raises(ValueError, match="finite or -inf"):
        mha(x, attn_mask=np.full((5, 5), np.nan, np.float32))
    with pytest.raises(ValueError, match="C2FAttention takes no key_padding_mask"):
        c2f.C2FAttention(8, 2, 4)(x, key_padding_mask=np.zeros((2, 5), bool))
    with pytest.raises(ValueError, match="HMHA takes no attn_mask"):
        c2f.HMHA(8, 2, 4)(x, causal=True)
    with pytest.raises(ValueError, match="1 TiB"):
        mha(x, attn_mask=np.broadcast_to(False, (1 << 30, 1 << 10, 1 << 10)))
    # A fully masked row: zeros, never NaN.
    y = mha(x, attn_mask=np.ones((5, 5), bool))
    np.testing.assert_array_equal(y, mha(np.zeros_like(x), attn_mask=np.ones((5, 5), bool)))


# ---------------------------------------------------------------------------------------------------------
# State dicts, decoding, files

def test_state_dict_errors():
    layer = c2f.MultiHeadAttention(8, 2)
    sd = layer.state_dict()
    before = layer(x_of((1, 3, 8), "float32"))
    with pytest.raises(ValueError, match="in_proj_weight"):
        layer.load_state_dict({k: v for k, v in sd.items() if k != "in_proj_weight"})
    with pytest.raises(ValueError, match="unexpected.*extra"):
        layer.load_state_dict(dict(sd, extra=np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="out_proj.weight"):
        layer.load_state_dict(dict(sd, **{"out_proj.weight": np.zeros((8, 7), np.float32)}))
    with pytest.raises(ValueError, match="out_proj.bias"):
        layer.load_state_dict(dict(sd, **{"out_proj.bias": np.zeros(8, np.int64)}))
    with pytest.raises(TypeError, match="keys must be str"):
        layer.load_state_dict({1: np.zeros(3)})
    with pytest.raises(TypeError, match="dict of arrays"):
        layer.load_state_dict([("a", np.zeros(3))])
    with pytest.raises(TypeError, match="object"):
        layer.load_state_dict(dict(sd, **{"out_proj.bias": np.array([None] * 8)}))
    np.testing.assert_array_equal(layer(x_of((1, 3, 8), "float32")), before)  # failed loads changed nothing


def test_decode_errors():
    causal = c2f.MultiHeadAttention(8, 2, causal=True)
    state = causal.new_decode_state(2)
    with pytest.raises(ValueError, match="causal"):
        c2f.MultiHeadAttention(8, 2).decode(x_of((2, 1, 8), "float32"), state)
    with pytest.raises(ValueError, match="made by"):
        c2f.MultiHeadAttention(16, 2, causal=True).decode(x_of((2, 1, 16), "float32"), state)
    with pytest.raises(ValueError):
        causal.decode(x_of((3, 1, 8), "float32"), state)  # another batch size
    with pytest.raises(TypeError):
        causal.decode(x_of((2, 1, 8), "float32"), c2f.HMHA(8, 2, 4, causal=True).new_decode_state(2))
    with pytest.raises(ValueError, match=">= 0"):
        causal.new_decode_state(-1)
    assert state.length == 0  # nothing was appended by the failed calls


def test_file_errors(tmp_path):
    with pytest.raises(OSError, match="cannot open"):
        c2f.load_safetensors(str(tmp_path / "missing.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError):
        c2f.load_safetensors(str(bad))
    with pytest.raises(OSError):
        c2f.save_safetensors(str(tmp_path / "no" / "dir.safetensors"), {"a": np.zeros(2, np.float32)})


# ---------------------------------------------------------------------------------------------------------
# Random wrong input, in a child interpreter: each call succeeds or raises ValueError / TypeError.

FUZZ = textwrap.dedent("""
    import math, random, sys
    import numpy as np
    import c2f
    sys.path.insert(0, sys.argv[1])
    from test_bad_input import LAYERS
    rng, r = np.random.default_rng(int(sys.argv[2])), random.Random(int(sys.argv[2]))
    dtypes = ["float32", "float64", "float16", "int64", "bool", "complex64", "object"]
    outcomes = {}
    def array(dtype, rank=None):
        # mostly near-valid: the layer's dtype, [B, L, 8], sizes 0, 1 and odd; else anything
        rank = rank if rank is not None else r.choice([0, 1, 2, 3, 3, 3, 3, 3, 4])
        shape = [r.choice([0, 1, 2, 3, 5, 8, 9, 17]) for _ in range(rank)]
        if rank == 3 and r.random() < 0.7:
            shape[2] = 8
        a = rng.standard_normal(shape).astype(dtype if r.random() < 0.7 else r.choice(dtypes))
        if a.ndim and r.random() < 0.3:
            a = np.asfortranarray(a)
        if a.ndim and a.shape[0] > 1 and r.random() < 0.2:
            a = a[::2]
        if a.dtype.kind == "f" and a.size and r.random() < 0.3:
            a.flat[r.randrange(a.size)] = r.choice([np.nan, np.inf, -np.inf])
        return a
    for name, (sizes, options, call) in LAYERS.items():
        for dtype in ("float32", "float64"):
            layer = getattr(c2f, name)(*sizes, dtype=dtype, **options)
            for i in range(150):
                kwargs = {}
                if r.random() < 0.4:
                    field = r.choice(["attn_mask", "key_padding_mask", "fine_attn_mask"])
                    kwargs[field] = array(r.choice(["bool", dtype]), r.choice([1, 2, 2, 3, 4]))
                if r.random() < 0.1:
                    kwargs["causal"] = True
                try:
                    call(layer, array(dtype), **kwargs)
                    outcome = "ok"
                except (ValueError, TypeError) as e:
                    outcome = type(e).__name__
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(outcomes)
""")


@pytest.mark.parametrize("seed", [1, 2])
def test_random_wrong_input_never_crashes(seed):
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", FUZZ, here, str(seed)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"the child interpreter ended with {r.returncode}: {r.stderr[-3000:]}"
    outcomes = eval(r.stdout.strip().splitlines()[-1])
    assert set(outcomes) <= {"ok", "ValueError", "TypeError"} and len(outcomes) == 3, outcomes
