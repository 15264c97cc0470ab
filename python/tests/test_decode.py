"""Decoding from Python: decode() in pieces and prefill() give the rows of the causal forward (and so of the
PyTorch reference: nn.MultiheadAttention with a causal mask), states fork with copy(), and a state serves
one call at a time."""

import threading

import numpy as np
import pytest

from helpers import DTYPES, TOL, randomized, tokens, torch

import c2f
import torch.nn as nn

DECODERS = [("MultiHeadAttention", (16, 4)), ("HMHA", (16, 2, 4)), ("SparseC2FAttention", (16, 4, 4, 2))]


def causal_layer(name, sizes, dtype):
    return getattr(c2f, name)(*sizes, causal=True, dtype=dtype, seed=9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,sizes", DECODERS)
@pytest.mark.parametrize("pieces", [(1, 5, 13), (19,), (1,) * 19])
def test_decode_in_pieces_equals_the_causal_forward(dtype, name, sizes, pieces):
    layer = causal_layer(name, sizes, dtype)
    x = tokens(2, sum(pieces), 16, dtype=dtype).numpy()
    want = layer(x)
    state = layer.new_decode_state(2)
    got, start = [], 0
    for n in pieces:
        got.append(layer.decode(x[:, start:start + n], state))
        start += n
    assert state.length == sum(pieces) and state.batch == 2 and state.memory_bytes > 0
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_decode_equals_torch_with_a_causal_mask(dtype):
    mha = randomized(nn.MultiheadAttention(16, 4, batch_first=True), dtype)
    layer = c2f.MultiHeadAttention(16, 4, causal=True, dtype=dtype)
    layer.load_state_dict(mha.state_dict())
    x = tokens(2, 11, 16, dtype=dtype)
    mask = torch.ones(11, 11, dtype=torch.bool).triu(1)
    want = mha(x, x, x, attn_mask=mask, need_weights=False)[0].detach().numpy()
    state = layer.new_decode_state(2, reserve=32)
    got = np.concatenate([layer.decode(x[:, t:t + 1], state) for t in range(11)], axis=1)
    np.testing.assert_allclose(got, want, **TOL[dtype])


@pytest.mark.parametrize("name,sizes", DECODERS)
def test_prefill_returns_the_last_row_and_copies_fork(name, sizes):
    layer = causal_layer(name, sizes, "float64")
    x = tokens(1, 12, 16, dtype="float64").numpy()
    want = layer(x)
    state = layer.new_decode_state(1)
    np.testing.assert_allclose(layer.prefill(x[:, :10], state), want[:, 9:10], **TOL["float64"])
    fork = state.copy()
    a = layer.decode(x[:, 10:12], state)
    b = layer.decode(x[:, 10:12], fork)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, want[:, 10:12], **TOL["float64"])
    assert fork.made_by == state.made_by and name in state.made_by


def test_a_state_serves_one_call_at_a_time():
    layer = c2f.MultiHeadAttention(64, 2, causal=True, num_threads=1)
    state = layer.new_decode_state(1)
    long_x = np.random.default_rng(0).standard_normal((1, 6000, 64)).astype(np.float32)
    one = long_x[:, :1].copy()
    errors = []

    def long_call():
        try:
            layer.prefill(long_x, state)
        except RuntimeError as e:
            errors.append(str(e))
    worker = threading.Thread(target=long_call)
    worker.start()
    while worker.is_alive() and not errors:
        try:
            layer.decode(one, state)  # the GIL is free during the other call: this runs while it does
        except RuntimeError as e:
            errors.append(str(e))
    worker.join()
    assert errors and "in use by another call" in errors[0]
