#!/usr/bin/python3
"""Saves a ViT feature pyramid of two-dimensional coarse-to-fine attention (PyTorch module ViTPyramid of
tests/reference/c2f2d_reference.py: the coarse-to-fine attention article's CoarseAttention /
FineAttention on 2-D blocks, Swin's relative position bias, 2 x 2 mean-pool patch merging between
stages), an input and PyTorch's output as one safetensors file that examples/vit_pyramid reads:

    /usr/bin/python3 examples/export_vit_pyramid.py pyramid.safetensors
    build/release/examples/vit_pyramid pyramid.safetensors

The default pyramid: a 32 x 32 grid of 64-dimensional patch tokens, 8 heads; stage 1 in blocks of 2 x 2
(16 x 16 blocks), stage 2 on 16 x 16 tokens in blocks of 4 x 4, stage 3 on 8 x 8 tokens in one 8 x 8 block.
PyTorch's own initialisation (Swin's trunc_normal_(std=.02) for the bias tables), eval mode.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "reference"))
from c2f2d_reference import ViTPyramid, pyramid_metadata  # noqa: E402
from safetensors_io import from_numpy, save_file  # noqa: E402


def main(path):
    torch.manual_seed(0)
    d_model, n_heads, height, width = 64, 8, 32, 32
    stages = ((2, 2, 16, 16), (4, 4, 4, 4), (8, 8, 1, 1))  # (block_h, block_w, max_blocks_h, max_blocks_w)
    grids, out_h, out_w = pyramid_metadata(height, width, stages)
    module = ViTPyramid(d_model, n_heads, stages).eval()
    x = torch.randn(2, height * width, d_model)
    with torch.no_grad():
        y, h, w = module(x, height, width)
    assert (h, w) == (out_h, out_w)
    tensors = {f"pyramid.{k}": from_numpy(v.contiguous().numpy()) for k, v in module.state_dict().items()}
    tensors["x"] = from_numpy(x.numpy())
    tensors["output"] = from_numpy(y.contiguous().numpy())
    meta = {"module": "pyramid", "embed_dim": str(d_model), "num_heads": str(n_heads), "height": str(height),
            "width": str(width), "relative_position_bias": "true", "num_stages": str(len(stages)), "stages": grids,
            "out_height": str(out_h), "out_width": str(out_w)}
    save_file(path, tensors, metadata=meta)
    print(f"wrote {path}: {grids} -> output [2, {out_h * out_w}, {d_model}]")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "pyramid.safetensors")
