#!/usr/bin/python3
"""Saves a torch.nn.MultiheadAttention, an input and PyTorch's output as one safetensors file that
examples/mha_from_pytorch reads:

    /usr/bin/python3 examples/export_mha.py out.safetensors
    build/release/examples/mha_from_pytorch out.safetensors

With the `safetensors` package, `safetensors.torch.save_file(tensors, path, metadata)` does the same;
this script uses the small writer of tests/reference so that it runs with Debian's python3-torch alone.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "reference"))
from safetensors_io import from_numpy, save_file  # noqa: E402


def main(path):
    torch.manual_seed(0)
    embed_dim, num_heads = 32, 4
    mha = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True).eval()
    x = torch.randn(2, 10, embed_dim)
    with torch.no_grad():
        y, _ = mha(x, x, x, need_weights=False)
    tensors = {f"mha.{k}": v.contiguous() for k, v in mha.state_dict().items()}
    tensors["query"] = x
    tensors["output"] = y
    save_file(path, {k: from_numpy(v.numpy()) for k, v in tensors.items()},
              metadata={"embed_dim": str(embed_dim), "num_heads": str(num_heads)})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mha.safetensors")
