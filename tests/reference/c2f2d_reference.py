"""PyTorch reference for c2f's two-dimensional coarse-to-fine attention (fixture family "c2f2d").

The coarse-to-fine attention article ends with how to carry coarse-to-fine attention to vision
Transformers: 2-D coarse blocks, a 2-D relative position bias in the coarse stage (as Swin does) and
larger blocks in deeper layers (a feature pyramid). The article gives no code for it; this module
builds it from the article's own ``CoarseAttention`` and ``FineAttention`` (c2f_reference.py, with its
two bug fixes) and Swin's ``relative_position_bias_table``:

* x [B, H*W, d] holds the tokens of an H x W grid flattened row-major (token y*W + x), as ViT patch
  embeddings are.
* Blocks: Mh = ceil(H / block_h) x Mw = ceil(W / block_w); block (r, c) holds rows
  [r*block_h, min((r+1)*block_h, H)) x columns [c*block_w, min((c+1)*block_w, W)); blocks are numbered
  row-major n = r*Mw + c, tokens row-major inside a block. Edge blocks may be partial: the grid is
  zero-padded to Mh*block_h x Mw*block_w, like c2f_reference.C2FAttention pads the sequence.
* Coarse stage: the mean of each block's REAL tokens -> [B, Mh*Mw, d] -> the article's CoarseAttention
  (``coarse_attn.qkv_proj``, ``coarse_attn.out_proj``), with, when enabled, Swin's bias added to the
  scores of head h between blocks n = (r, c) and n' = (r', c'):
  ``table[(r - r' + Gh - 1) * (2*Gw - 1) + (c - c' + Gw - 1), h]``, Gh = max_blocks_h, Gw = max_blocks_w,
  ``coarse_attn.relative_position_bias_table`` [(2*Gh - 1) * (2*Gw - 1), n_heads], initialised like Swin
  (trunc_normal_, std 0.02). The index is computed as Swin's ``relative_position_index`` but on the fly
  (the block grid changes with the image), so it is not a buffer and not in the state dict. A grid with
  Mh > Gh or Mw > Gw raises ValueError.
* Fine stage: the article's FineAttention on the blocks [B, Mh*Mw, block_h*block_w, d] (``fine_attn.q_proj``,
  ``fine_attn.kv_proj``, ``fine_attn.out_proj``): the query of every token of block n is
  q_proj(coarse output of n); keys and values are the block's real tokens (padded keys are masked, the
  article's convention: keep-mask, -1e9 fill); padded query rows are dropped from the output.

``ViTPyramid`` stacks such layers as a feature pyramid: stage s runs x = x + attention_s(x, H, W) on the
current grid; between stages a 2 x 2 mean-pool patch merging halves the grid (ceil(H/2) x ceil(W/2)),
each new token being the mean of the real tokens of its 2 x 2 window. Deeper stages use larger blocks.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from c2f_reference import CoarseAttention, FineAttention


def num_blocks(n, block):
    return (n + block - 1) // block  # ceil(n / block)


class CoarseAttention2D(CoarseAttention):
    """The coarse-to-fine attention article's CoarseAttention with Swin's relative position bias added to the scores."""

    def __init__(self, d_model, n_heads, max_blocks_h, max_blocks_w, relative_position_bias=True, dropout=0.1):
        super().__init__(d_model, n_heads, dropout)
        self.max_blocks_h, self.max_blocks_w = max_blocks_h, max_blocks_w
        if relative_position_bias:
            entries = (2 * max_blocks_h - 1) * (2 * max_blocks_w - 1)
            self.relative_position_bias_table = nn.Parameter(torch.zeros(entries, n_heads))
            nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)
        else:
            self.relative_position_bias_table = None

    def relative_position_index(self, blocks_h, blocks_w):
        """Swin's relative_position_index for a blocks_h x blocks_w grid: [M, M] entries of the table."""
        coords = torch.stack(torch.meshgrid(torch.arange(blocks_h), torch.arange(blocks_w), indexing="ij"))
        coords = torch.flatten(coords, 1)  # [2, M]
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()  # [M, M, 2]
        relative[:, :, 0] += self.max_blocks_h - 1
        relative[:, :, 1] += self.max_blocks_w - 1
        relative[:, :, 0] *= 2 * self.max_blocks_w - 1
        return relative.sum(-1)

    def forward(self, x, blocks_h, blocks_w):
        """x [batch, Mh*Mw, d_model] block summaries of a blocks_h x blocks_w grid -> [batch, Mh*Mw, d_model].
        The article's CoarseAttention.forward with the bias added before the softmax."""
        batch_size, m, _ = x.shape
        qkv = self.qkv_proj(x)
        q, k, v = qkv.chunk(3, dim=-1)
        q = q.view(batch_size, m, self.n_heads, self.d_k).transpose(1, 2)
        k = k.view(batch_size, m, self.n_heads, self.d_k).transpose(1, 2)
        v = v.view(batch_size, m, self.n_heads, self.d_k).transpose(1, 2)
        attn_scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_k)  # [batch, heads, m, m]
        if self.relative_position_bias_table is not None:
            index = self.relative_position_index(blocks_h, blocks_w)
            bias = self.relative_position_bias_table[index.view(-1)].view(m, m, -1).permute(2, 0, 1)
            attn_scores = attn_scores + bias.unsqueeze(0)
        attn_probs = self.dropout(torch.softmax(attn_scores, dim=-1))
        output = attn_probs @ v
        output = output.transpose(1, 2).contiguous().view(batch_size, m, -1)
        return self.out_proj(output)


def block_layout(B, H, W, d, block_h, block_w):
    """Sizes of the padded block grid and the [Mh*Mw, block_h*block_w] mask of real tokens."""
    Mh, Mw = num_blocks(H, block_h), num_blocks(W, block_w)
    real = torch.zeros(Mh * block_h, Mw * block_w, dtype=torch.bool)
    real[:H, :W] = True
    real_blocks = real.view(Mh, block_h, Mw, block_w).permute(0, 2, 1, 3).reshape(Mh * Mw, block_h * block_w)
    return Mh, Mw, real_blocks


def to_blocks(x, H, W, block_h, block_w):
    """x [B, H*W, d] -> zero-padded blocks [B, Mh*Mw, block_h*block_w, d] (blocks and tokens row-major)."""
    B, _, d = x.shape
    Mh, Mw = num_blocks(H, block_h), num_blocks(W, block_w)
    grid = F.pad(x.view(B, H, W, d), (0, 0, 0, Mw * block_w - W, 0, Mh * block_h - H))
    return grid.view(B, Mh, block_h, Mw, block_w, d).permute(0, 1, 3, 2, 4, 5).reshape(
        B, Mh * Mw, block_h * block_w, d)


def from_blocks(blocks, H, W, block_h, block_w):
    """Inverse of to_blocks: [B, Mh*Mw, block_h*block_w, d] -> [B, H*W, d] (padded tokens dropped)."""
    B, _, _, d = blocks.shape
    Mh, Mw = num_blocks(H, block_h), num_blocks(W, block_w)
    grid = blocks.view(B, Mh, Mw, block_h, block_w, d).permute(0, 1, 3, 2, 4, 5).reshape(
        B, Mh * block_h, Mw * block_w, d)
    return grid[:, :H, :W].reshape(B, H * W, d)


def block_means(x, H, W, block_h, block_w):
    """The mean of the real tokens of each block: [B, Mh*Mw, d]."""
    B, _, d = x.shape
    _, _, real = block_layout(B, H, W, d, block_h, block_w)
    counts = real.sum(-1).to(x.dtype)  # [M]
    return to_blocks(x, H, W, block_h, block_w).sum(dim=2) / counts[None, :, None]


class C2FAttention2D(nn.Module):
    def __init__(self, d_model, n_heads, block_h, block_w, max_blocks_h=16, max_blocks_w=16,
                 relative_position_bias=True, dropout=0.1):
        super().__init__()
        self.block_h, self.block_w = block_h, block_w
        self.coarse_attn = CoarseAttention2D(d_model, n_heads, max_blocks_h, max_blocks_w, relative_position_bias,
                                             dropout)
        self.fine_attn = FineAttention(d_model, n_heads, dropout)

    def forward(self, x, H, W):
        """x [batch, H*W, d_model] -> [batch, H*W, d_model]; self.coarse_input / self.coarse_output keep the
        coarse stage's input and output of the last call."""
        B, L, d = x.shape
        if L != H * W:
            raise ValueError(f"x has {L} tokens, not H*W = {H}*{W}")
        bh, bw = self.block_h, self.block_w
        Mh, Mw, real = block_layout(B, H, W, d, bh, bw)
        ca = self.coarse_attn
        if ca.relative_position_bias_table is not None and (Mh > ca.max_blocks_h or Mw > ca.max_blocks_w):
            raise ValueError(f"a grid of {Mh} x {Mw} blocks exceeds max_blocks {ca.max_blocks_h} x {ca.max_blocks_w}")
        blocks = to_blocks(x, H, W, bh, bw)  # [B, M, k, d]
        self.coarse_input = block_means(x, H, W, bh, bw)
        self.coarse_output = self.coarse_attn(self.coarse_input, Mh, Mw)
        k = bh * bw
        mask = None  # as in the article when nothing is padded
        if not bool(real.all()):
            mask = real[None, :, None, :].expand(B, Mh * Mw, k, k)  # padded keys are never attended to
        fine = self.fine_attn(blocks, self.coarse_output, mask=mask)
        return from_blocks(fine, H, W, bh, bw)


def patch_merge_2x2(x, H, W):
    """2 x 2 mean-pool patch merging: [B, H*W, d] -> [B, ceil(H/2)*ceil(W/2), d] (means of real tokens)."""
    return block_means(x, H, W, 2, 2), num_blocks(H, 2), num_blocks(W, 2)


class ViTPyramid(nn.Module):
    """Stages of C2FAttention2D on a shrinking grid: x = x + stage(x, H, W), then 2 x 2 patch merging
    between stages. ``stages``: one (block_h, block_w, max_blocks_h, max_blocks_w) per stage."""

    def __init__(self, d_model, n_heads, stages, relative_position_bias=True, dropout=0.1):
        super().__init__()
        self.stages = nn.ModuleList(
            C2FAttention2D(d_model, n_heads, bh, bw, gh, gw, relative_position_bias, dropout)
            for bh, bw, gh, gw in stages)

    def forward(self, x, H, W):
        """-> (output [B, H'*W', d], H', W') on the last stage's grid."""
        for i, stage in enumerate(self.stages):
            if i > 0:
                x, H, W = patch_merge_2x2(x, H, W)
            x = x + stage(x, H, W)
        return x, H, W


def pyramid_metadata(H, W, stages):
    """The pyramid's stage grids as the fixtures and examples/export_vit_pyramid.py record them:
    ("HxW:bhxbw:GhxGw,..." per stage, final height, final width). Raises ValueError when a stage's block
    grid exceeds its max_blocks."""
    parts, h, w = [], H, W
    for i, (bh, bw, gh, gw) in enumerate(stages):
        if i > 0:
            h, w = num_blocks(h, 2), num_blocks(w, 2)
        if num_blocks(h, bh) > gh or num_blocks(w, bw) > gw:
            raise ValueError(f"stage {i}: {num_blocks(h, bh)} x {num_blocks(w, bw)} blocks exceed max_blocks {gh} x {gw}")
        parts.append(f"{h}x{w}:{bh}x{bw}:{gh}x{gw}")
    return ",".join(parts), h, w
