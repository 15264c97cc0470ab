#!/usr/bin/python3
"""Saves the coarse-to-fine attention article's C2FAttention (PyTorch, bugs fixed, see
tests/reference/c2f_reference.py), an input and PyTorch's output as one safetensors file that
examples/c2f_from_pytorch reads:

    /usr/bin/python3 examples/export_c2f.py c2f.safetensors
    build/release/examples/c2f_from_pytorch c2f.safetensors
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "reference"))
from c2f_reference import C2FAttention  # noqa: E402
from safetensors_io import from_numpy, save_file  # noqa: E402


def main(path):
    torch.manual_seed(0)
    d_model, n_heads, chunk_size, length = 64, 8, 16, 100  # 100 is not a multiple of 16: a partial chunk
    module = C2FAttention(d_model, n_heads, chunk_size).eval()
    x = torch.randn(2, length, d_model)
    with torch.no_grad():
        y = module(x)
    tensors = {f"c2f.{k}": from_numpy(v.contiguous().numpy()) for k, v in module.state_dict().items()}
    tensors["x"] = from_numpy(x.numpy())
    tensors["output"] = from_numpy(y.numpy())
    meta = {"module": "c2f", "d_model": str(d_model), "n_heads": str(n_heads), "chunk_size": str(chunk_size)}
    save_file(path, tensors, metadata=meta)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "c2f.safetensors")
