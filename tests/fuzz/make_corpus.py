#!/usr/bin/env python3
"""Writes the committed seed corpus of the safetensors fuzz targets (tests/fuzz/corpus/).

corpus/parse/: whole safetensors files. ok_* must parse, bad_* must be rejected with a
SafetensorsError (tests/test_safetensors.cpp checks both).
corpus/roundtrip/: inputs of fuzz_safetensors_roundtrip, encoded for its FuzzedDataProvider so each
builds the StateDict its name describes (C2F_FUZZ_VERBOSE=1 ./fuzz_safetensors_roundtrip FILE prints it).

Run from anywhere: python3 tests/fuzz/make_corpus.py (rewrites the files; the output is deterministic).
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# ------------------------------------------------------------------------------------------------
# corpus/parse


def st_file(header, buffer=b"", pad_to=8, n_override=None):
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode("utf-8")
    if pad_to:
        raw += b" " * ((-len(raw)) % pad_to)
    n = len(raw) if n_override is None else n_override
    return struct.pack("<Q", n) + raw + buffer


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def several_dtypes():
    header, buf = {}, b""
    for name, dtype, fmt, values in [
        ("a.f16", "F16", "<2H", (0x3C00, 0xC000)),
        ("b.bf16", "BF16", "<2H", (0x3F80, 0x7F80)),
        ("c.i64", "I64", "<q", (-1,)),
        ("d.mask", "BOOL", "<3B", (1, 0, 1)),
        ("e.f8", "F8_E4M3", "<B", (0x38,)),
        ("f.f64", "F64", "<d", (0.1,)),
        ("g.u16", "U16", "<H", (65535,)),
    ]:
        data = struct.pack(fmt, *values)
        count = len(values)
        header[name] = entry(dtype, [count] if count > 1 else [], len(buf), len(buf) + len(data))
        buf += data
    return st_file(header, buf)


PARSE = {
    "ok_empty": st_file("{}"),
    "ok_one_f32": st_file({"w": entry("F32", [2], 0, 8)}, struct.pack("<2f", 1.0, 2.0)),
    "ok_several_dtypes": several_dtypes(),
    "ok_metadata": st_file({"__metadata__": {"format": "pt", "note": "caf\u00e9"},
                            "w": entry("U8", [1], 0, 1)}, b"\x07"),
    "ok_padded_header": st_file(json.dumps({"w": entry("I32", [1], 0, 4)}) + "   ",
                                struct.pack("<i", -5), pad_to=None),
    "ok_zero_size": st_file({"z": entry("F32", [2, 0], 0, 0)}),
    "ok_scalar": st_file({"s": entry("F64", [], 0, 8)}, struct.pack("<d", -3.75)),
    "ok_offsets_not_in_name_order": st_file(
        {"a": entry("F32", [1], 4, 8), "b\u20ac": entry("F32", [1], 0, 4), "c": entry("U8", [0], 8, 8)},
        struct.pack("<2f", 10.0, 20.0)),
    "bad_shape_wraps_to_zero": st_file({"w": entry("U8", [4294967296, 4294967296], 0, 0)}),
    # Shapes near 2^63 that hold no element parse, as in the reference reader; what uses them checks
    # its own products (a mask made from [2, 2^62, 0, 1] is refused: tests/test_bad_input.cpp).
    "ok_empty_shape_past_2_63": st_file({"w": entry("BOOL", [2, 4611686018427387904, 0, 1], 0, 0)}),
    "ok_empty_shape_dim_2_63_minus_1_twice": st_file(
        {"w": entry("F32", [9223372036854775807, 0, 9223372036854775807], 0, 0)}),
    "ok_empty_shape_dim_2_63_minus_1": st_file({"w": entry("F32", [9223372036854775807, 0], 0, 0)}),
    "bad_overlap": st_file({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, bytes(8)),
    "bad_trailing_bytes": st_file({"w": entry("U8", [1], 0, 1)}, b"\x01\x02"),
    "bad_metadata_not_string_map": st_file({"__metadata__": {"n": 1}}),
}

# ------------------------------------------------------------------------------------------------
# corpus/roundtrip: FuzzedDataProvider reads integers from the end of the input (one byte per 8 bits
# of the range, most significant first) and bytes/strings from the front.


class Tape:
    def __init__(self):
        self.front = bytearray()
        self.back = bytearray()  # in consumption order; reversed onto the end of the input

    def integral(self, lo, hi, value):
        assert lo <= value <= hi
        rng, off, raw = hi - lo, 0, []
        v = value - lo
        nbytes = 0
        while off < 64 and (rng >> off) > 0:
            nbytes += 1
            off += 8
        for i in reversed(range(nbytes)):
            raw.append((v >> (8 * i)) & 0xFF)
        self.back += bytes(raw)

    def random_length_string(self, s):  # ConsumeRandomLengthString: '\\' + other char ends it
        self.front += s.replace(b"\\", b"\\\\") + b"\\x"

    def data(self):
        return bytes(self.front) + bytes(reversed(self.back))


PICKS = ["", "__metadata__", "weight", "a.b.c", '"', "\\", "\0", "\u20ac", "\U0001F600", b"\xed\xa0\x80",
         b"\xc0\x80", b"\xff"]


def put_string(t, s):
    """A string: raw bytes (bytes objects) or well-formed code points (str)."""
    if isinstance(s, bytes):
        t.integral(0, 3, 0)
        t.random_length_string(s)
        return
    t.integral(0, 3, 2)
    t.integral(0, 12, len(s))
    for ch in s:
        cp = ord(ch)
        if cp < 0x20:
            t.integral(0, 4, 0); t.integral(0, 0x1F, cp)
        elif cp < 0x80:
            t.integral(0, 4, 1); t.integral(0x20, 0x7F, cp)
        elif cp < 0x800:
            t.integral(0, 4, 2); t.integral(0x80, 0x7FF, cp)
        elif cp < 0x10000:
            assert not 0xD800 <= cp <= 0xDFFF
            t.integral(0, 4, 3); t.integral(0x800, 0xF7FF, cp - 0x800 if cp >= 0xE000 else cp)
        else:
            t.integral(0, 4, 4); t.integral(0x10000, 0x10FFFF, cp)


DTYPES = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64",
          "U64", "F64"]
SIZES = dict(BOOL=1, U8=1, I8=1, F8_E5M2=1, F8_E4M3=1, I16=2, U16=2, F16=2, BF16=2, I32=4, U32=4, F32=4,
             I64=8, U64=8, F64=8)


def roundtrip(tensors, metadata=()):
    """tensors: (name, dtype, shape, huge) with huge=True for [0, big...] shapes."""
    t = Tape()
    t.integral(0, 8, len(tensors))
    for name, dtype, shape, huge in tensors:
        put_string(t, name)
        t.integral(0, len(DTYPES) - 1, DTYPES.index(dtype))
        t.integral(0, 4, len(shape))
        if shape:
            t.integral(0, 15, 0 if huge else 7)
        for d in shape if not huge else shape[1:]:
            if huge:
                t.integral(0, 2**63 - 1, d)
            else:
                t.integral(0, 6, d)
        n = SIZES[dtype]
        for d in shape:
            n *= d
        t.front += bytes((i * 37 + 11) & 0xFF for i in range(n))
    t.integral(0, 4, len(metadata))
    for key, value in metadata:
        put_string(t, key)
        put_string(t, value)
    return t.data()


ROUNDTRIP = {
    "empty": b"",
    "one_f32": roundtrip([("w", "F32", [2], False)]),
    "all_dtypes": roundtrip([(f"t{i}", d, [2], False) for i, d in enumerate(DTYPES[:8])]),
    "more_dtypes": roundtrip([(f"u{i}", d, [1, 2], False) for i, d in enumerate(DTYPES[8:])]),
    "scalar_and_zero_size": roundtrip([("s", "F64", [], False), ("z", "F32", [2, 0], False),
                                       ("h", "U8", [0, 2**62, 2**62], True)]),
    "metadata": roundtrip([("w", "BF16", [3], False)], [("format", "pt"), ("note", "caf\u00e9 \"q\"\n")]),
    "unicode_names": roundtrip([("\u20ac\U0001F600", "I16", [2, 1], False), ("\0\\\"", "U8", [1], False)]),
    "name_not_utf8": roundtrip([(b"w\xff", "U8", [1], False)]),
    "name_reserved": roundtrip([("__metadata__", "U8", [1], False)]),
    "metadata_not_utf8": roundtrip([], [("k", b"\xc0\x80")]),
}


def main():
    for sub, files in (("parse", PARSE), ("roundtrip", ROUNDTRIP)):
        d = os.path.join(HERE, "corpus", sub)
        os.makedirs(d, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(d, name + (".safetensors" if sub == "parse" else ".bin")), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
