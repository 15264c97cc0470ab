"""A tiny, strict safetensors writer and reader (standard library only: struct + json).

File layout (https://github.com/huggingface/safetensors):

    u64 little-endian N | N bytes of UTF-8 JSON header | tensor data

The writer always produces the canonical form that c2f's C++ reader validates strictly:

* the header is a JSON object; ``__metadata__`` (written first, omitted when empty) is a string -> string
  map; every other key is a tensor ``{"dtype", "shape", "data_offsets": [begin, end]}``;
* the header is padded with spaces so that ``8 + N`` is a multiple of 8;
* tensors are stored sorted by name, with data_offsets contiguous from 0 and no trailing bytes;
* data is little-endian, row-major (C order), BOOL is one byte 0/1.

The core API works on :class:`Tensor` (dtype name, shape, raw bytes) and needs nothing outside the
standard library. :func:`from_numpy` / :func:`to_numpy` convert to and from numpy arrays when numpy is
available (it is imported lazily).
"""

import json
import struct
from collections import namedtuple

__all__ = [
    "DTYPE_SIZES", "Tensor", "SafetensorsError", "serialize", "deserialize", "save_file", "load_file",
    "from_numpy", "to_numpy",
]

# Element sizes in bytes of the safetensors dtypes.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

# safetensors dtype -> numpy dtype string (little-endian); BF16 and F8 have no numpy equivalent.
_NUMPY_DTYPES = {
    "BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2", "F16": "<f2",
    "I32": "<i4", "U32": "<u4", "F32": "<f4", "I64": "<i8", "U64": "<u8", "F64": "<f8",
}

METADATA_KEY = "__metadata__"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # same limit as the reference implementation

Tensor = namedtuple("Tensor", ["dtype", "shape", "data"])
Tensor.__doc__ = "A tensor as stored: dtype name (e.g. 'F32'), shape (tuple of ints), raw little-endian bytes."


class SafetensorsError(ValueError):
    pass


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _check_tensor(name, t):
    if not isinstance(name, str) or not name:
        raise SafetensorsError(f"tensor name must be a non-empty string, got {name!r}")
    if name == METADATA_KEY:
        raise SafetensorsError(f"'{METADATA_KEY}' is reserved and cannot name a tensor")
    if t.dtype not in DTYPE_SIZES:
        raise SafetensorsError(f"tensor '{name}': unknown dtype {t.dtype!r}")
    for d in t.shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise SafetensorsError(f"tensor '{name}': bad shape {t.shape!r}")
    expected = _numel(t.shape) * DTYPE_SIZES[t.dtype]
    if len(t.data) != expected:
        raise SafetensorsError(
            f"tensor '{name}': dtype {t.dtype} shape {list(t.shape)} needs {expected} bytes, got {len(t.data)}")
    if t.dtype == "BOOL" and any(b not in (0, 1) for b in bytes(t.data)):
        raise SafetensorsError(f"tensor '{name}': BOOL bytes must be 0 or 1")


def serialize(tensors, metadata=None):
    """Returns the bytes of a safetensors file holding ``tensors`` (name -> Tensor) and ``metadata``."""
    metadata = dict(metadata or {})
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise SafetensorsError(f"__metadata__ must map strings to strings, got {k!r}: {v!r}")
    # Same canonical form as c2f::serialize_safetensors: "__metadata__" first and only when non-empty.
    header = {METADATA_KEY: {k: metadata[k] for k in sorted(metadata)}} if metadata else {}
    chunks = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        t = Tensor(t.dtype, tuple(int(d) for d in t.shape), bytes(t.data))
        _check_tensor(name, t)
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        chunks.append(t.data)
        offset += len(t.data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def save_file(path, tensors, metadata=None):
    data = serialize(tensors, metadata)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise SafetensorsError(f"duplicate key {k!r} in header")
        out[k] = v
    return out


def deserialize(buf, strict=True):
    """Parses safetensors bytes; returns (tensors: name -> Tensor, metadata: dict).

    Always checks what any valid file must satisfy (header bounds, JSON object, known dtypes, offsets
    matching shapes, offsets within the buffer, no overlaps or holes, no trailing bytes). With
    ``strict`` it also requires the canonical form this module writes: padding to a multiple of 8 and
    data laid out in name order.
    """
    buf = bytes(buf)
    if len(buf) < 8:
        raise SafetensorsError(f"file too short ({len(buf)} bytes) for the 8-byte header length")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > _MAX_HEADER_BYTES or 8 + n > len(buf):
        raise SafetensorsError(f"header length {n} exceeds the file size {len(buf)}")
    raw = buf[8:8 + n]
    if strict and (8 + n) % 8 != 0:
        raise SafetensorsError(f"header length {n}: 8 + N is not a multiple of 8")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"header is not UTF-8: {e}") from None
    if not text.startswith("{"):
        raise SafetensorsError("header does not start with '{'")
    try:
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    if strict and text.rstrip(" ") != text.rstrip():
        raise SafetensorsError("header padding must be spaces")

    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in metadata.items()):
        raise SafetensorsError("__metadata__ must be a string -> string map")

    data = buf[8 + n:]
    spans = []
    tensors = {}
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SafetensorsError(f"tensor '{name}': entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"tensor '{name}': unknown dtype {dtype!r}")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise SafetensorsError(f"tensor '{name}': bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise SafetensorsError(f"tensor '{name}': bad data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= len(data):
            raise SafetensorsError(f"tensor '{name}': data_offsets {offsets} outside the data ({len(data)} bytes)")
        if end - begin != _numel(shape) * DTYPE_SIZES[dtype]:
            raise SafetensorsError(f"tensor '{name}': data_offsets {offsets} do not match dtype {dtype} shape {shape}")
        t = Tensor(dtype, tuple(shape), data[begin:end])
        _check_tensor(name, t)
        tensors[name] = t
        spans.append((begin, end, name))

    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise SafetensorsError(f"tensor '{name}': data starts at {begin}, expected {pos} (hole or overlap)")
        pos = end
    if pos != len(data):
        raise SafetensorsError(f"{len(data) - pos} trailing bytes after the last tensor")
    if strict and [s[2] for s in spans] != sorted(tensors):
        raise SafetensorsError("tensor data is not laid out in name order")
    return tensors, metadata


def load_file(path, strict=True):
    with open(path, "rb") as f:
        return deserialize(f.read(), strict=strict)


# --- numpy conveniences ----------------------------------------------------------------------------

def from_numpy(array):
    """Tensor from a numpy array (bool, ints, float16/32/64), stored little-endian row-major."""
    import numpy as np
    a = np.asarray(array)
    for name, npdt in _NUMPY_DTYPES.items():
        if np.dtype(npdt) == a.dtype.newbyteorder("<") or np.dtype(npdt) == a.dtype:
            a = np.ascontiguousarray(a, dtype=np.dtype(npdt))
            return Tensor(name, tuple(int(d) for d in a.shape), a.tobytes(order="C"))
    raise SafetensorsError(f"no safetensors dtype for numpy dtype {a.dtype}")


def to_numpy(tensor):
    """numpy array (a copy, native byte order) of a Tensor; BF16/F8 raise SafetensorsError."""
    import numpy as np
    if tensor.dtype not in _NUMPY_DTYPES:
        raise SafetensorsError(f"dtype {tensor.dtype} has no numpy equivalent")
    a = np.frombuffer(tensor.data, dtype=np.dtype(_NUMPY_DTYPES[tensor.dtype])).reshape(tensor.shape)
    return a.astype(a.dtype.newbyteorder("="), copy=True)
