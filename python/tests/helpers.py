"""What the Python tests share: tolerances, seeded PyTorch modules with random weights, and inputs."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="python3-torch is needed for the reference comparisons")

import c2f  # noqa: E402

DTYPES = ["float32", "float64"]
# The project's tolerances (CONTRIBUTING.md): fp32 atol = rtol = 1e-5, fp64 1e-10.
TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "float64": dict(atol=1e-10, rtol=1e-10)}
TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64}


def numpy_of(t):
    return t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def assert_close(got, want, dtype):
    """c2f's output against torch's, at the dtype's tolerance."""
    got, want = numpy_of(got), numpy_of(want)
    assert got.shape == want.shape, f"shape {got.shape} != torch's {want.shape}"
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got, want, **TOL[dtype])


def randomized(module, dtype, seed=0, scale=0.3):
    """`module` in eval mode and `dtype`, every parameter (biases too) drawn from U(-scale, scale)."""
    torch.manual_seed(seed)
    module = module.to(TORCH_DTYPE[dtype]).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-scale, scale)
    return module


def tokens(*shape, dtype="float32", seed=1):
    """A torch tensor of standard normal values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=TORCH_DTYPE[dtype])


def bool_mask(*shape, seed=2, p=0.3, keep_diagonal=True):
    """A random bool mask, True with probability p; with keep_diagonal the last two dimensions' diagonal
    (and so every row) has at least one False entry."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(*shape, generator=g) < p
    if keep_diagonal:
        n = min(shape[-2], shape[-1])
        idx = torch.arange(n)
        m[..., idx, idx] = False
    return m


def c2f_layer(name, module, dtype, *args, **kwargs):
    """c2f.<name>(*args, dtype=dtype, **kwargs) holding `module`'s weights."""
    layer = getattr(c2f, name)(*args, dtype=dtype, **kwargs)
    layer.load_state_dict(module.state_dict())
    return layer
