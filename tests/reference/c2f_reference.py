"""PyTorch reference modules for c2f's coarse-to-fine attention (fixture family "c2f").

A faithful copy of the three modules of the coarse-to-fine attention article (``CoarseAttention``, ``FineAttention``,
``C2FAttention``): same parameter names, same math (q·kᵀ / sqrt(d_k), ``masked_fill(mask == 0, -1e9)``,
softmax, dropout, out_proj). Mask convention, as in the article: 1 / True = keep, 0 / False = masked.
Run the modules in eval mode, where dropout is the identity.

Only these changes were made to the article's code; each is marked "FIX n" below:

1. ``FineAttention.forward`` unpacked ``batch_size, m, k, _ = x.shape`` and then overwrote ``k`` with the
   key tensor (``k, v = kv.chunk(2, -1)``) before ``q.view(batch_size, m, k, ...)``. The chunk length is
   now called ``chunk_len``.
2. The masks [B, m, m] (coarse) and [B, m, k, k] (fine) did not broadcast against the scores
   [B, H, m, m] / [B, H, m, k, k]. They are now ``mask.unsqueeze(1)``: one mask shared by all heads.
3. ``C2FAttention`` asserted ``seq_len % chunk_size == 0``. It now zero-pads x to m = ceil(L / chunk)
   chunks: the coarse input of a chunk is the mean over its REAL tokens only (the last chunk divides by
   its number of real tokens), the fine stage masks the padded KEYS (a fine-mask entry is kept only if
   the user's fine mask keeps it AND the key is a real token), and the padded query rows are dropped
   from the output ([B, L, d]). L < chunk_size is one partial chunk. When L is divisible and there is
   no user fine mask, the fine stage gets ``mask=None``, exactly as in the article.
4. ``C2FAttention.forward(x, coarse_mask=None, fine_mask=None)``: the article passed ``mask=None`` to the
   coarse stage (comment "可添加块间 mask": a block mask can be added); the coarse mask [B, m, m] is now
   passed there, and the fine mask [B, m, k, k] (over the padded chunk grid) to the fine stage.

Note on the article's semantics, kept as is: the fine stage's query is ``q_proj(coarse_context)``,
broadcast to every token of the chunk. Without a fine mask whose rows differ, all the token rows of a
chunk therefore get the same output. And a row whose keys are ALL masked gets a uniform average from
the -1e9 fill (not NaN and not zero); the fixtures avoid such rows.
"""

import math

import torch
import torch.nn as nn


class CoarseAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.d_k = d_model // n_heads
        self.n_heads = n_heads
        self.dropout = nn.Dropout(dropout)
        # 共享投影矩阵 (shared projection matrix)
        self.qkv_proj = nn.Linear(d_model, d_model * 3)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        """
        Args:
            x: [batch, m, d_model] 粗粒度块嵌入 (coarse chunk embeddings)
            mask: [batch, m, m] 块间掩码 (inter-chunk mask, 1 = keep, 0 = masked)
        Returns:
            [batch, m, d_model]
        """
        batch_size, m, _ = x.shape
        # 投影 QKV [batch, m, d_model] -> [batch, m, 3*d_model]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.chunk(3, dim=-1)  # 各[batch, m, d_model]
        # 分头处理 [batch, m, d_model] -> [batch, heads, m, d_k]
        q = q.view(batch_size, m, self.n_heads, self.d_k).transpose(1, 2)
        k = k.view(batch_size, m, self.n_heads, self.d_k).transpose(1, 2)
        v = v.view(batch_size, m, self.n_heads, self.d_k).transpose(1, 2)
        # 计算注意力得分 [batch, heads, m, m]
        attn_scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            # FIX 2: [batch, m, m] -> [batch, 1, m, m], shared by all heads.
            attn_scores = attn_scores.masked_fill(mask.unsqueeze(1) == 0, -1e9)
        attn_probs = self.dropout(torch.softmax(attn_scores, dim=-1))
        # 加权求和 [batch, heads, m, d_k]
        output = attn_probs @ v
        output = output.transpose(1, 2).contiguous().view(batch_size, m, -1)
        return self.out_proj(output)


class FineAttention(nn.Module):
    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.d_k = d_model // n_heads
        self.n_heads = n_heads
        self.dropout = nn.Dropout(dropout)
        # 细粒度阶段使用独立投影矩阵 (the fine stage has its own projections)
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, d_model * 2)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, coarse_context, mask=None):
        """
        Args:
            x: [batch, m, k, d_model] 细粒度 token 嵌入 (token embeddings, chunked)
            coarse_context: [batch, m, d_model] 粗粒度上下文 (coarse context)
            mask: [batch, m, k, k] 块内掩码 (intra-chunk mask, 1 = keep, 0 = masked)
        """
        # FIX 1: the article named the chunk length `k` and then overwrote it with the key tensor.
        batch_size, m, chunk_len, _ = x.shape
        # 使用粗粒度信息初始化 query [batch, m, d_model] -> [batch, m, k, d_model]
        q = self.q_proj(coarse_context).unsqueeze(2).expand(-1, -1, chunk_len, -1)
        kv = self.kv_proj(x)  # [batch, m, k, 2*d_model]
        k, v = kv.chunk(2, dim=-1)
        # 分头处理 [batch, m, k, d_model] -> [batch, heads, m, k, d_k]
        q = q.view(batch_size, m, chunk_len, self.n_heads, self.d_k).permute(0, 3, 1, 2, 4)
        k = k.view(batch_size, m, chunk_len, self.n_heads, self.d_k).permute(0, 3, 1, 2, 4)
        v = v.view(batch_size, m, chunk_len, self.n_heads, self.d_k).permute(0, 3, 1, 2, 4)
        # 计算块内注意力 [batch, heads, m, k, k]
        attn_scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            # FIX 2: [batch, m, k, k] -> [batch, 1, m, k, k], shared by all heads.
            attn_scores = attn_scores.masked_fill(mask.unsqueeze(1) == 0, -1e9)
        attn_probs = self.dropout(torch.softmax(attn_scores, dim=-1))
        output = attn_probs @ v  # [batch, heads, m, k, d_k]
        output = output.permute(0, 2, 3, 1, 4).contiguous().view(batch_size, m, chunk_len, -1)
        return self.out_proj(output)


class C2FAttention(nn.Module):
    def __init__(self, d_model, n_heads, chunk_size=32, dropout=0.1):
        super().__init__()
        self.chunk_size = chunk_size
        self.coarse_attn = CoarseAttention(d_model, n_heads, dropout)
        self.fine_attn = FineAttention(d_model, n_heads, dropout)

    @staticmethod
    def num_chunks(seq_len, chunk_size):
        return (seq_len + chunk_size - 1) // chunk_size  # m = ceil(L / chunk)

    def forward(self, x, coarse_mask=None, fine_mask=None):
        """
        Args:
            x: [batch, seq_len, d_model], any seq_len >= 1 (FIX 3: zero-padded to m * chunk_size)
            coarse_mask: [batch, m, m] 块间掩码 (FIX 4), 1 = keep
            fine_mask: [batch, m, chunk_size, chunk_size] over the padded chunk grid (FIX 4), 1 = keep
        Returns:
            [batch, seq_len, d_model]
        """
        batch_size, seq_len, d = x.shape
        c = self.chunk_size
        m = self.num_chunks(seq_len, c)
        padded_len = m * c
        pad = padded_len - seq_len
        # FIX 3: zero-pad to a whole number of chunks (no-op when divisible, as in the article).
        x_p = x if pad == 0 else torch.cat([x, x.new_zeros(batch_size, pad, d)], dim=1)

        # 重组为粗粒度块 [batch, seq_len, d] -> [batch, m, k, d]
        x_blocks = x_p.view(batch_size, m, c, -1)
        # 粗粒度阶段：平均池化块内 token [batch, m, k, d] -> [batch, m, d]
        if pad == 0:
            coarse_input = x_blocks.mean(dim=2)
        else:
            # FIX 3: the last chunk is averaged over its real tokens only.
            last = x[:, (m - 1) * c:, :].mean(dim=1, keepdim=True)
            coarse_input = torch.cat([x_blocks[:, :m - 1].mean(dim=2), last], dim=1)
        coarse_output = self.coarse_attn(coarse_input, mask=coarse_mask)  # FIX 4: 块间 mask

        # 细粒度阶段 [batch, m, k, d]
        mask = fine_mask
        if pad != 0:
            # FIX 3: padded keys are never attended to; combined with the user's fine mask.
            key_real = (torch.arange(padded_len, device=x.device) < seq_len).view(1, m, 1, c)
            mask = key_real.expand(batch_size, m, c, c)
            if fine_mask is not None:
                mask = mask & (fine_mask != 0)
        fine_output = self.fine_attn(x_blocks, coarse_output, mask=mask)
        # FIX 3: drop the padded query rows.
        return fine_output.view(batch_size, padded_len, -1)[:, :seq_len]
