"""PyTorch reference for c2f's ``SparseC2FAttention`` (fixture family "sparse"): coarse-guided top-k
chunk-sparse self-attention (NSA / MoBA-style block selection) that runs the weights of a trained
``torch.nn.MultiheadAttention(E, H, batch_first=True)``.

The functions below take a real ``nn.MultiheadAttention`` module and use its parameters
(``in_proj_weight``, ``in_proj_bias``, ``out_proj.weight``, ``out_proj.bias``): the sparse layer has
exactly those parameters and state-dict names. The semantics are stated with DENSE tensors, as a
formulation deliberately different from a chunked kernel: a chunk-averaging matrix, an m x m score
matrix, a pairwise rank tensor for the top-k selection, and a boolean [B, H, L, L] "allowed" mask for a
single masked softmax. There is no loop over batch items, heads, chunks or positions.

Definition (x is [B, L, E], self-attention only; dh = E / H, head h = columns [h*dh, (h+1)*dh)):

* q, k, v = x W_q^T + b_q, x W_k^T + b_k, x W_v^T + b_v (the three blocks of in_proj), split in heads.
* Chunks: m = ceil(L / c); chunk j = positions [j*c, min((j+1)*c, L)) (the last one may be partial).
  qbar_i, kbar_j = means of the PROJECTED queries / keys of head h over the positions of the chunk that
  are real tokens: a key padding mask (True = padding) leaves its positions out of the means. A chunk
  without a real token has no mean: its score is -inf for every query row, and the row of such a query
  chunk (gating "chunk") scores -inf everywhere (it then keeps the lowest candidates, by the tie rule).
* Gating "chunk" (never causal): a selection row per query chunk i; scores s_ij = qbar_i . kbar_j (no
  scaling: it would not change the order); candidates = all chunks j != i; S_i = {i} U the (top_k - 1)
  candidates with the highest s_ij, ties to the lower index; when top_k - 1 >= the number of candidates,
  all of them. Every query position of chunk i uses S_i.
* Gating "token" (MoBA's): a selection row per query position t of chunk c; scores s_tj = q_t . kbar_j;
  candidates = all chunks j != c, or with causal the chunks j < c; S_t = {c} U the (top_k - 1) best
  candidates, same rules. top_k >= 1.
* Fine stage: query position t attends, with ONE softmax (scale 1/sqrt(dh)), to every key position u of
  the chunks in its selection, with causal additionally u <= t, and with a key padding mask (bool
  [B, L], True = ignore, torch's convention) only to keys that are not padded. A row without any allowed
  key gives zero attention (not NaN).
* y = out_proj(concat_heads(attention)).

With top_k >= m the layer is nn.MultiheadAttention itself (causal: with attn_mask = triu(ones, 1)).
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

# A selection is accepted for a fixture only if, for every (batch, head, query chunk) where a choice is
# made, the gap between the last selected and the first rejected candidate score is at least
# MARGIN_REL * (1 + max |score| of the two): float32 rounding elsewhere cannot flip it then.
MARGIN_REL = 1e-3


def num_chunks(seq_len: int, chunk_size: int) -> int:
    return (seq_len + chunk_size - 1) // chunk_size


def chunk_membership(seq_len: int, chunk_size: int) -> torch.Tensor:
    """[L, m] bool: position t belongs to chunk j."""
    m = num_chunks(seq_len, chunk_size)
    return torch.arange(seq_len).view(-1, 1) // chunk_size == torch.arange(m).view(1, -1)


def chunk_averaging(seq_len: int, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[m, L]: row j holds 1/|chunk j| on the positions of chunk j (a partial last chunk divides by its
    own size), 0 elsewhere."""
    member = chunk_membership(seq_len, chunk_size).t().to(dtype)
    return member / member.sum(dim=1, keepdim=True)


def project_heads(mha: nn.MultiheadAttention, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """q, k, v [B, H, L, dh] from mha's packed in-projection (torch's head layout)."""
    B, L, E = x.shape
    H = mha.num_heads
    if not mha._qkv_same_embed_dim or mha.in_proj_bias is None or not mha.batch_first:
        raise ValueError("SparseC2FAttention needs nn.MultiheadAttention(E, H, batch_first=True) with bias")
    q, k, v = F.linear(x, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
    return tuple(t.reshape(B, L, H, E // H).transpose(1, 2) for t in (q, k, v))


def chunk_means(x: torch.Tensor, chunk_size: int, real: Optional[torch.Tensor] = None):
    """The chunk means of x [B, H, L, dh] over its real positions (real [B, L] bool; None: every
    position): ([B, H, m, dh] means, [B, 1, m] bool "the chunk has a real position"). A chunk without
    one gets a zero mean (its scores are replaced by -inf)."""
    B, L = x.shape[0], x.shape[-2]
    member = chunk_membership(L, chunk_size).t().to(x.dtype)  # [m, L]
    weight = member.expand(B, 1, *member.shape)
    if real is not None:
        weight = weight * real.to(x.dtype).view(B, 1, 1, L)
    count = weight.sum(dim=-1, keepdim=True)
    return (weight / count.clamp(min=1)) @ x, count[..., 0] > 0


def gating_scores(q: torch.Tensor, k: torch.Tensor, chunk_size: int, gating: str,
                  key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Chunk scores: [B, H, m, m] = qbar kbar^T (gating "chunk") or [B, H, L, m] = q kbar^T ("token");
    -inf for a key chunk without a real position (and for the rows of such a query chunk)."""
    real = None if key_padding_mask is None else ~key_padding_mask
    kbar, k_real = chunk_means(k, chunk_size, real)
    if gating == "chunk":
        qbar, q_real = chunk_means(q, chunk_size, real)
        scores = qbar @ kbar.transpose(-2, -1)
        scores = scores.masked_fill(~q_real.unsqueeze(-1), float("-inf"))
    else:
        scores = q @ kbar.transpose(-2, -1)
    return scores.masked_fill(~k_real.unsqueeze(-2), float("-inf"))


def own_and_candidates(seq_len: int, chunk_size: int, gating: str, causal: bool):
    """[R, m] bool each: the query row's own chunk, and its candidate chunks (R = m rows for gating
    "chunk", L rows for "token")."""
    m = num_chunks(seq_len, chunk_size)
    if gating == "chunk":
        if causal:
            raise ValueError("per-chunk gating reads every query of a chunk: it cannot be causal")
        own_idx = torch.arange(m)
    else:
        own_idx = torch.arange(seq_len) // chunk_size
    j = torch.arange(m).view(1, -1)
    own = own_idx.view(-1, 1) == j
    cand = (j < own_idx.view(-1, 1)) if causal else ~own
    return own, cand


def select_chunks(scores: torch.Tensor, top_k: int, own: torch.Tensor, cand: torch.Tensor):
    """Top-k chunk selection from chunk scores [B, H, R, m] (R query rows: chunks or tokens).

    Returns ``keep`` [B, H, R, m] bool (key chunk j selected for row r), ``selected`` [B, H, R, top_k]
    int64 (the indices ascending, padded with -1), and ``margin`` [B, H, R] float64: the gap between the
    last chosen and the first rejected candidate divided by 1 + max(|their scores|), +inf where nothing is
    chosen or rejected (top_k = 1, or every candidate fits).

    The rank of a candidate is the number of candidates that beat it: a higher score, or an equal score
    and a lower index. The top_k - 1 candidates of rank < top_k - 1 are chosen.
    """
    if top_k < 1:
        raise ValueError("top_k must be >= 1")
    m = scores.shape[-1]
    s_j = scores.unsqueeze(-1)  # [B, H, R, m(j), 1]
    s_o = scores.unsqueeze(-2)  # [B, H, R, 1, m(j')]
    idx = torch.arange(m)
    lower = (idx.view(1, -1) < idx.view(-1, 1))  # [m(j), m(j')]: j' < j
    beats = (s_o > s_j) | ((s_o == s_j) & lower)  # j' beats j
    beats = beats & cand.unsqueeze(-2)  # only candidates j' count (cand[r, j'])
    rank = beats.sum(dim=-1)  # [B, H, R, m]
    n_pick = top_k - 1
    chosen = cand & (rank < n_pick)
    keep = own | chosen

    # selected indices: ascending, -1 padding to top_k columns
    key = torch.where(keep, idx.expand_as(keep), idx.expand_as(keep) + m)
    srt = torch.sort(key, dim=-1).values[..., :min(top_k, m)]
    srt = torch.where(srt < m, srt, torch.full_like(srt, -1))
    if top_k > m:
        srt = torch.cat([srt, torch.full(srt.shape[:-1] + (top_k - m,), -1, dtype=srt.dtype)], dim=-1)

    # selection margin
    s64 = scores.to(torch.float64)
    zero = torch.zeros_like(s64)
    last_in = cand & (rank == n_pick - 1)
    first_out = cand & (rank == n_pick)
    has = last_in.any(dim=-1) & first_out.any(dim=-1)
    a = torch.where(last_in, s64, zero).sum(dim=-1)
    b = torch.where(first_out, s64, zero).sum(dim=-1)
    rel = (a - b) / (1.0 + torch.maximum(a.abs(), b.abs()))
    # A -inf score (a chunk without a real token) cannot move by rounding: no margin to keep there.
    rel = torch.where(torch.isinf(a) | torch.isinf(b), torch.full_like(rel, math.inf), rel)
    margin = torch.where(has, rel, torch.full_like(rel, math.inf))
    return keep, srt.to(torch.int64), margin


def allowed_mask(keep: torch.Tensor, seq_len: int, chunk_size: int, gating: str, causal: bool,
                 key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, H, L, L] bool: query t may attend key u (u's chunk is selected for t's row, u <= t when
    causal, u not padded)."""
    member = chunk_membership(seq_len, chunk_size).to(torch.float64)  # [L, m]
    rows = member @ keep.to(torch.float64) if gating == "chunk" else keep.to(torch.float64)  # [B, H, L, m]
    allowed = (rows @ member.t()) > 0.5  # keep[row(t), chunk(u)]
    if causal:
        allowed = allowed & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask.view(key_padding_mask.shape[0], 1, 1, seq_len)
    return allowed


def selection(mha: nn.MultiheadAttention, x: torch.Tensor, chunk_size: int, top_k: int, gating: str,
              causal: bool, key_padding_mask: Optional[torch.Tensor] = None):
    """select_chunks on the gating scores of mha's own projections of x, in x's dtype (call it with a
    float64 module and x for the fixtures' selection); the padded positions (key_padding_mask True) are
    left out of the chunk means."""
    with torch.no_grad():
        q, k, _ = project_heads(mha, x)
        own, cand = own_and_candidates(x.shape[1], chunk_size, gating, causal)
        return select_chunks(gating_scores(q, k, chunk_size, gating, key_padding_mask), top_k, own, cand)


def sparse_c2f_attention(mha: nn.MultiheadAttention, x: torch.Tensor, chunk_size: int, top_k: int,
                         gating: str, causal: bool, key_padding_mask: Optional[torch.Tensor] = None,
                         keep: Optional[torch.Tensor] = None):
    """SparseC2FAttention forward with mha's weights: returns (output [B, L, E], keep [B, H, R, m]).

    ``keep`` overrides the selection (the generator passes the one computed in float64); by default it
    is computed from x in x's dtype."""
    B, L, E = x.shape
    H = mha.num_heads
    dh = E // H
    with torch.no_grad():
        if keep is None:
            keep, _, _ = selection(mha, x, chunk_size, top_k, gating, causal, key_padding_mask)
        q, k, v = project_heads(mha, x)
        allowed = allowed_mask(keep, L, chunk_size, gating, causal, key_padding_mask)
        s = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        p = torch.where(torch.isnan(p), torch.zeros_like(p), p)  # a row without allowed key -> 0
        o = (p @ v).transpose(1, 2).reshape(B, L, E)
        return F.linear(o, mha.out_proj.weight, mha.out_proj.bias), keep
