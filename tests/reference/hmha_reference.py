"""PyTorch reference modules for the C3K2/HMHA article's C3K2 projection and HMHA attention (fixture families
"conv1d" and "hmha").

The article's code does not run (its reshapes are wrong, stages 2 and 3 are missing). The modules below
implement the DEFINITION the C++ side follows, by a deliberately different formulation from a windowed
kernel: every attention level is computed DENSELY, with explicit boolean masks over all L x L (or m x m)
score pairs, dense window-averaging / membership matrices, ``masked_fill(~mask, -inf)`` + softmax, and
fully masked rows (NaN after the softmax) replaced by zero. There is no loop over windows, positions or
offsets in the attention math.

Definitions (x is [B, L, dim], batch first, as in c2f):

* ``C3K2Projection(dim, heads, causal=False)``: ``conv3 = nn.Conv1d(dim, dim // 2, 3, padding=1)``,
  ``conv2 = nn.Conv1d(dim, dim - dim // 2, 1)``; output ``cat([conv3(x), conv2(x)], channels)`` ->
  [B, L, dim] (the convolutions run on ``x.transpose(1, 2)``; torch's Conv1d is a cross-correlation
  with zero padding). ``heads`` is only recorded (the article's signature); the output is not split.
  Causal: conv3 has padding 0 and runs on ``F.pad(x, (2, 0))`` (two zeros on the left only), so output i
  reads x[i-2], x[i-1], x[i]; same parameters.
* ``HMHA(dim, heads, window, levels, causal)``: q, k, v = ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``
  (three C3K2Projections), head h = channels [h*dh, (h+1)*dh), dh = dim / heads, scale 1/sqrt(dh).
  Windows: m = ceil(L / W), window j = positions [jW, min((j+1)W, L)) (the last one may be partial).

  - level 1 (local): softmax over the keys t of i's window (causal: t <= i) of q_i.k_t * scale.
  - level 2 (cross-window): qbar_j, kbar_j, vbar_j = means of the PROJECTED q, k, v over the real tokens
    of window j; c_j = softmax over all windows j' of qbar_j.kbar_j' * scale, applied to vbar_j';
    o2_i = c_(window of i).
    Causal (NSA's compressed branch): token i attends with its OWN query q_i to (kbar_j, vbar_j) of the
    windows j < window(i) (all complete), one softmax, scale 1/sqrt(dh); tokens of window 0 get 0.
  - level 3 (global sparse): S(i) = {i} U {i - 2^p, i + 2^p : p >= 0} inside [0, L) (causal: only
    {i} U {i - 2^p}); softmax over t in S(i) of q_i.k_t * scale.
  - y = out_proj(concat_heads(o1 + o2 + o3)); a level that is switched off contributes 0 (out_proj's
    bias is always added).
"""

import math
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F


def conv1d_blc(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """Applies a Conv1d to x [B, L, C] in c2f's layout: [B, L, C] -> [B, L_out, C_out]."""
    return conv(x.transpose(1, 2)).transpose(1, 2)


class C3K2Projection(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.conv3 = nn.Conv1d(dim, dim // 2, 3, padding=0 if causal else 1)
        self.conv2 = nn.Conv1d(dim, dim - dim // 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, dim] -> [B, L, dim] = [conv3 channels | conv2 channels]."""
        xc = x.transpose(1, 2)  # [B, dim, L]
        x3 = F.pad(xc, (2, 0)) if self.causal else xc
        return torch.cat([self.conv3(x3), self.conv2(xc)], dim=1).transpose(1, 2)


def num_windows(seq_len: int, window: int) -> int:
    return (seq_len + window - 1) // window


def level_masks(seq_len: int, window: int, causal: bool, device=None):
    """Dense masks (True = attend) and window matrices, all built with tensor ops:
    M1 [L, L] same window (and t <= i if causal), M2 [m, m] all windows (non-causal) or [L, m] windows
    before the token's own (causal), M3 [L, L] t in S(i), E [L, m] window membership (0/1, float64),
    A [m, L] window averaging (float64)."""
    L, m = seq_len, num_windows(seq_len, window)
    i = torch.arange(L, device=device).view(L, 1)
    t = torch.arange(L, device=device).view(1, L)
    win_i, win_t = i // window, t // window
    below = t <= i  # lower triangle including the diagonal
    M1 = win_i == win_t
    if causal:
        M1 = M1 & below
    j = torch.arange(m, device=device)
    M2 = win_i > j.view(1, m) if causal else torch.ones(m, m, dtype=torch.bool, device=device)
    d = (i - t).abs()  # |i - t|; i - t is a power of two <=> d > 0 and d & (d - 1) == 0
    M3 = (d == 0) | ((d > 0) & ((d & (d - 1)) == 0))
    if causal:
        M3 = M3 & below
    E = (torch.arange(L, device=device).view(L, 1) // window == j.view(1, m)).to(torch.float64)
    A = E.t() / E.sum(dim=0, keepdim=True).t()  # row j: 1/|window j| on its real tokens
    return M1, M2, M3, E, A


def masked_attention(q, k, v, keep, scale):
    """q [..., Lq, dh], k/v [..., Lk, dh], keep [Lq, Lk] bool: softmax(masked q.k^T * scale) v.
    Rows without any kept key give NaN in the softmax and are replaced by 0."""
    s = (q @ k.transpose(-2, -1)) * scale
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)
    return p @ v


class HMHA(nn.Module):
    LEVELS = (1, 2, 3)

    def __init__(self, dim: int, heads: int, window: int = 64, levels: Iterable[int] = LEVELS,
                 causal: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} not divisible by heads {heads}")
        if window < 1:
            raise ValueError("window must be >= 1")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.window, self.causal = window, causal
        self.levels = tuple(sorted(set(levels)))
        if not set(self.levels) <= set(self.LEVELS):
            raise ValueError(f"levels must be a subset of {self.LEVELS}, got {self.levels}")
        self.q_proj = C3K2Projection(dim, heads, causal)
        self.k_proj = C3K2Projection(dim, heads, causal)
        self.v_proj = C3K2Projection(dim, heads, causal)
        self.out_proj = nn.Linear(dim, dim)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.heads, self.head_dim).transpose(1, 2)  # [B, H, L, dh]

    def project(self, x: torch.Tensor):
        """The three C3K2 projections, [B, L, dim] each."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, return_qkv: bool = False):
        B, L, _ = x.shape
        q_, k_, v_ = self.project(x)
        q, k, v = self.split_heads(q_), self.split_heads(k_), self.split_heads(v_)
        scale = 1.0 / math.sqrt(self.head_dim)
        M1, M2, M3, E, A = level_masks(L, self.window, self.causal, device=x.device)
        E, A = E.to(x.dtype), A.to(x.dtype)
        o = torch.zeros_like(q)
        if 1 in self.levels:
            o = o + masked_attention(q, k, v, M1, scale)
        if 2 in self.levels:
            qb, kb, vb = A @ q, A @ k, A @ v  # [B, H, m, dh]: window means over real tokens
            if self.causal:
                o = o + masked_attention(q, kb, vb, M2, scale)  # own query over earlier summaries
            else:
                c = masked_attention(qb, kb, vb, M2, scale)  # [B, H, m, dh]
                o = o + E @ c  # broadcast each window's context to its tokens
        if 3 in self.levels:
            o = o + masked_attention(q, k, v, M3, scale)
        y = self.out_proj(o.transpose(1, 2).reshape(B, L, self.dim))
        return (y, (q_, k_, v_)) if return_qkv else y
