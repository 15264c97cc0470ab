"""Arrays in are read in place, arrays out are numpy arrays over c2f's own result (no copy either way).

The binding records the data address of the input a layer read (c2f._c2f._debug.last_input_address());
c2f._c2f._debug.set_force_copy(True) makes it copy every input, and the last test shows the zero-copy
checks then fail."""

import gc

import numpy as np
import pytest

import c2f

debug = c2f._c2f._debug


@pytest.fixture(autouse=True)
def no_forced_copy():
    debug.set_force_copy(False)
    yield
    debug.set_force_copy(False)


def layer():
    return c2f.C2FAttention(16, 4, chunk_size=4, seed=3)


def x_numpy(seed=0):
    return np.random.default_rng(seed).standard_normal((2, 10, 16)).astype(np.float32)


def read_in_place(x):
    """Whether the layer read x's own memory."""
    layer()(x)
    return debug.last_input_address() == x.__array_interface__["data"][0]


def test_c_contiguous_numpy_is_read_in_place():
    assert read_in_place(x_numpy())


def test_a_view_with_c_layout_is_read_in_place():
    big = x_numpy()
    assert read_in_place(big[1:])  # a slice along the batch stays C-contiguous


def test_other_layouts_are_copied_once_and_give_the_same_result():
    x = x_numpy()
    strided = np.asfortranarray(x)
    assert not strided.flags["C_CONTIGUOUS"]
    assert not read_in_place(strided)
    np.testing.assert_array_equal(layer()(strided), layer()(x))
    transposed = np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    np.testing.assert_array_equal(layer()(transposed), layer()(x))


def test_a_change_between_two_calls_is_seen():
    x, attn = x_numpy(), layer()
    y1 = attn(x)
    x[0, 3, :] += 1.0  # in place: the next call reads the new values
    y2 = attn(x)
    assert not np.array_equal(y1, y2)
    np.testing.assert_array_equal(y2, attn(x.copy()))


def test_torch_cpu_tensor_is_read_in_place():
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x_numpy())
    attn = layer()
    y = attn(t)
    assert debug.last_input_address() == t.data_ptr()
    np.testing.assert_array_equal(y, attn(t.numpy().copy()))
    view = t[:, 2:5]  # not contiguous: copied
    attn(view)
    assert debug.last_input_address() != view.data_ptr()


def test_output_is_numpy_over_the_result_and_torch_wraps_it_without_copy():
    torch = pytest.importorskip("torch")
    y = layer()(x_numpy())
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.flags["C_CONTIGUOUS"] and y.flags["WRITEABLE"]
    assert type(y.base).__name__ == "PyCapsule"  # c2f's buffer, owned by the array
    t = torch.from_numpy(y)
    assert t.data_ptr() == y.__array_interface__["data"][0]


def test_output_outlives_the_layer_and_input():
    attn, x = layer(), x_numpy()
    y = attn(x)
    want = y.copy()
    del attn, x
    gc.collect()
    np.testing.assert_array_equal(y, want)


def test_the_checks_fail_when_inputs_are_copied():
    debug.set_force_copy(True)
    assert not read_in_place(x_numpy())
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x_numpy())
    layer()(t)
    assert debug.last_input_address() != t.data_ptr()
