"""c2f from Python: the C++ attention layers of c2f (MultiHeadAttention, the coarse-to-fine layers, HMHA,
SparseC2FAttention, ...) on numpy arrays and torch CPU tensors.

    import c2f
    attn = c2f.C2FAttention(512, 8, chunk_size=32, num_threads=2)      # float32; dtype="float64" for double
    attn.load_state_dict(torch_module.state_dict())                     # PyTorch's names
    y = attn(x)                                                          # x [batch, seq, 512] -> numpy array

Inputs of the layer's dtype that are C-contiguous are read in place (a torch tensor through its numpy view);
outputs are numpy arrays over c2f's result (``torch.from_numpy(y)`` wraps them without a copy). Every
forward and decode call releases the GIL. ``c2f.torch.accelerate(model)`` swaps c2f into a PyTorch model.
The API: docs/python.md; what each layer computes: docs/layers.md.
"""

from . import _c2f
from ._c2f import (KeepMask, bf16_engine, get_bf16_engine, get_num_threads, keep, load_safetensors,
                   load_safetensors_metadata, save_safetensors, set_bf16_engine, set_num_threads)

__version__ = getattr(_c2f, "__version__", "unknown")

DTYPES = ("float32", "float64")


def _dtype_name(dtype):
    """'float32' or 'float64' from a numpy dtype, a dtype name, a Python type or a torch dtype."""
    import numpy
    text = str(dtype)
    try:
        name = numpy.dtype(text[len("torch."):] if text.startswith("torch.") else dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise TypeError(f"dtype must be float32 or float64 (numpy or torch), got {dtype!r}")
    return name


class Layer:
    """c2f.<Name>: builds the float32 or float64 class of a layer (``Name.float32``, ``Name.float64``) from
    ``dtype=`` (default float32); ``isinstance(obj, c2f.Name)`` holds for both."""

    def __init__(self, name):
        self.__name__ = self.__qualname__ = name
        self.float32 = getattr(_c2f, f"{name}_float32")
        self.float64 = getattr(_c2f, f"{name}_float64")
        self.__doc__ = self.float32.__doc__.replace(" in float32", "") + " dtype: 'float32' (default) or 'float64'."

    def __call__(self, *args, dtype="float32", **kwargs):
        return getattr(self, _dtype_name(dtype))(*args, **kwargs)

    def __instancecheck__(self, obj):
        return isinstance(obj, (self.float32, self.float64))

    def __repr__(self):
        return f"<c2f layer {self.__name__}>"


LAYERS = tuple(sorted(n[: -len("_float32")] for n in dir(_c2f) if n.endswith("_float32")))
globals().update({name: Layer(name) for name in LAYERS})

__all__ = list(LAYERS) + ["KeepMask", "keep", "load_safetensors", "load_safetensors_metadata", "save_safetensors",
                          "get_num_threads", "set_num_threads", "bf16_engine", "get_bf16_engine", "set_bf16_engine",
                          "LAYERS", "DTYPES"]
