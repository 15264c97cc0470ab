// c2f layers — SparseC2FAttention: a trained torch.nn.MultiheadAttention run with coarse-guided
// top-k chunk selection (the real coarse → fine of seed 000's description; NSA / MoBA-style).
//
// Parameters and state-dict names are exactly MultiHeadAttention's (`in_proj_weight`, `in_proj_bias`,
// `out_proj.*`), so any trained nn.MultiheadAttention loads. Self-attention, x [B, L, E]. Per batch
// and head, after the in-projection (head width dh = E / H), chunks of `chunk_size` positions (the last
// may be partial) are both query and key chunks, and k̄_j is the mean of the projected keys of chunk j.
// Gating chooses the key chunks:
//   - per chunk (the non-causal default): q̄_i = mean of the projected queries of chunk i; query chunk i
//     selects itself and the (top_k − 1) chunks j ≠ i with the highest q̄_i·k̄_j; every query of chunk i
//     attends to every key of its selected chunks;
//   - per token (MoBA's gating; always with `causal`): token t of chunk c scores the eligible chunks
//     j ≠ c by q_t·k̄_j and selects c and the (top_k − 1) highest; eligible = every chunk, or with
//     `causal` the chunks j < c (complete, before t); with `causal` the keys of its own chunk are
//     those ≤ t;
//   ties go to the lower index; with fewer eligible chunks than top_k − 1, all of them;
//   - fine stage: one softmax (scale 1/sqrt(dh)) over the keys of the selected chunks; the library's
//     masks (AttentionMasks) combine with the selection (they do not change which chunks are selected);
//   - heads concatenated, out_proj.
// With top_k ≥ the number of chunks the output equals MultiHeadAttention's (with a causal mask when
// `causal`). Cost per head O(L·top_k·chunk·dh + (L/chunk)²·dh) (per token: + O(L·(L/chunk)·dh) for the
// scores of the chunk summaries); no L × L buffer.
#pragma once

#include "c2f/detail/module.hpp"
#include "c2f/kernels/chunk_sparse.hpp"
#include "c2f/layers/multihead_attention.hpp"

#include <string>

namespace c2f {

/// How SparseC2FAttention chooses the key chunks of a query.
enum class Gating {
  Auto,      ///< PerToken when causal, PerChunk otherwise
  PerChunk,  ///< one choice per query chunk, from the mean of its queries (reads the whole chunk: not causal)
  PerToken,  ///< one choice per query token, from its own query (MoBA's gating)
};

template <class Scalar>
struct SparseAttentionOutput {
  Tensor3<Scalar> output;  ///< [B, L, E]
  /// Selected key chunks per (batch, head, query chunk), or per (batch, head, token) with per-token gating.
  kernels::ChunkSelection selection;
};

template <class Scalar>
class SparseC2FAttention : public detail::Module<SparseC2FAttention<Scalar>> {
 public:
  struct Options {
    bool bias = true;
    int num_threads = 0;     ///< 0 = all hardware threads; results are bitwise the same for any count
    std::uint64_t seed = 0;  ///< PyTorch's MultiheadAttention init
    Gating gating = Gating::Auto;  ///< PerChunk cannot be causal
  };

  SparseC2FAttention(Index embed_dim, Index num_heads, Index chunk_size, Index top_k, bool causal = false)
      : SparseC2FAttention(embed_dim, num_heads, chunk_size, top_k, causal, Options{}) {}
  SparseC2FAttention(Index embed_dim, Index num_heads, Index chunk_size, Index top_k, bool causal, Options options)
      : chunk_(chunk_size),
        top_k_(top_k),
        causal_(causal),
        gating_(options.gating == Gating::Auto ? (causal ? Gating::PerToken : Gating::PerChunk) : options.gating),
        mha_(embed_dim, num_heads, mha_options(options)) {
    if (chunk_size < 1 || top_k < 1) {
      detail::fail("SparseC2FAttention needs chunk_size >= 1 and top_k >= 1, got chunk_size=", chunk_size,
                   ", top_k=", top_k);
    }
    if (causal && gating_ == Gating::PerChunk) {
      detail::fail("SparseC2FAttention: per-chunk gating reads every query of a chunk, so it cannot be causal; "
                   "use Gating::PerToken (or Auto) with causal = true");
    }
  }

  Index embed_dim() const { return mha_.embed_dim(); }
  Index num_heads() const { return mha_.num_heads(); }
  Index chunk_size() const { return chunk_; }
  Index top_k() const { return top_k_; }
  bool causal() const { return causal_; }
  /// PerChunk or PerToken (Auto resolved at construction).
  Gating gating() const { return gating_; }
  void set_top_k(Index top_k) {
    if (top_k < 1) detail::fail("SparseC2FAttention: top_k must be >= 1, got ", top_k);
    top_k_ = top_k;
  }
  void set_num_threads(int n) { mha_.set_num_threads(n); }
  /// The same weights as a full MultiHeadAttention.
  const MultiHeadAttention<Scalar>& dense() const { return mha_; }

  void load(detail::StrictLoader& loader, const std::string& name) { mha_.load(loader, name); }
  void save(StateDict& sd, const std::string& name) const { mha_.save(sd, name); }

  /// x [B, L, E] → [B, L, E].
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x, const AttentionMasks<Scalar>& masks = {}) const {
    return forward_with_selection(x, masks).output;
  }

  /// Also returns the selected key chunks of every (batch, head, query chunk) — of every (batch, head,
  /// token) with per-token gating.
  SparseAttentionOutput<Scalar> forward_with_selection(ConstTensor3Ref<Scalar> x,
                                                       const AttentionMasks<Scalar>& masks = {}) const {
    RowMatrix<Scalar> q, k, v;
    mha_.project(x, x, x, q, k, v);  // validates x
    const Index batch = x.batch(), length = x.seq(), e = embed_dim(), heads = num_heads();
    const int threads = mha_.options().num_threads;
    const detail::MaskPlan<Scalar> plan(masks.attn_mask, masks.key_padding_mask, batch, heads, length, length);
    const kernels::ChunkGrid grid{batch, length, chunk_};
    SparseAttentionOutput<Scalar> result;
    RowMatrix<Scalar> attn(batch * length, e);
    if (gating_ == Gating::PerToken) {
      result.selection = kernels::select_chunks_per_token<Scalar>(q, k, grid, heads, top_k_, causal_, threads);
      kernels::token_sparse_attention<Scalar>(q, k, v, grid, heads, result.selection, causal_, plan, attn, threads);
    } else {
      result.selection = kernels::select_chunks<Scalar>(q, k, grid, heads, top_k_, threads);
      kernels::chunk_sparse_attention<Scalar>(q, k, v, grid, heads, result.selection, plan, attn, threads);
    }
    result.output = Tensor3<Scalar>(batch, length, e);
    Eigen::Map<RowMatrix<Scalar>> out(result.output.data(), batch * length, e);
    mha_.out_proj().forward_rows(attn, out, threads);
    return result;
  }

 private:
  static typename MultiHeadAttention<Scalar>::Options mha_options(const Options& o) {
    typename MultiHeadAttention<Scalar>::Options m;
    m.bias = o.bias;
    m.num_threads = o.num_threads;
    m.seed = o.seed;
    return m;
  }

  Index chunk_;
  Index top_k_;
  bool causal_;
  Gating gating_;
  MultiHeadAttention<Scalar> mha_;
};

}  // namespace c2f
