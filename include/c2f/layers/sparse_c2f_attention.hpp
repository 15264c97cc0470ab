// c2f layers — SparseC2FAttention: a trained torch.nn.MultiheadAttention run with coarse-guided
// top-k chunk selection (the coarse → fine refinement the c2f multi-head article describes; NSA /
// MoBA-style).
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
//     masks (attn_mask, key_padding_mask) combine with the selection (they do not change which chunks
//     are selected);
//   - heads concatenated, out_proj.
// With top_k ≥ the number of chunks the output equals MultiHeadAttention's (with a causal mask when
// `causal`). Cost per head O(L·top_k·chunk·dh + (L/chunk)²·dh) (per token: + O(L·(L/chunk)·dh) for the
// scores of the chunk summaries); no L × L buffer.
//
// Training (docs/training.md): forward_train(x, masks, step) and backward(saved, dy) with the selection
// treated as a constant, as MoBA and NSA train: the gradients flow through the selected chunks' keys and
// values (kernels::sparse_attention_backward), and none through the gating's chunk means and scores.
#pragma once

#include "c2f/detail/scratch.hpp"
#include "c2f/kernels/chunk_sparse.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/support/decoding.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/options.hpp"

#include <algorithm>
#include <array>
#include <string>

namespace c2f {

/// How SparseC2FAttention chooses the key chunks of a query.
enum class Gating {
  Auto,      ///< PerToken when causal, PerChunk otherwise
  PerChunk,  ///< one choice per query chunk, from the mean of its queries (reads the whole chunk: not causal)
  PerToken,  ///< one choice per query token, from its own query (MoBA's gating)
};

template <class Scalar>
struct SparseAttnOutput {
  Output<Scalar> output;  ///< [B, L, E]
  /// Selected key chunks per (batch, head, query chunk), or per (batch, head, token) with per-token gating.
  kernels::ChunkSelection selection;
};

template <class Scalar>
class SparseC2FAttention : public detail::DecodingLayerBase<SparseC2FAttention<Scalar>, Scalar> {
 public:
  /// seed: PyTorch's MultiheadAttention init. The kernel options serve as_multihead_attention(). causal:
  /// token t attends only to keys <= t, chosen from the chunks before its own (per-token gating).
  class Options : public RuntimeOptions<Options>,
                  public AttnKernelOptions<Options>,
                  public BiasOption<Options>,
                  public CausalOption<Options>,
                  public ComputeOption<Options> {
    /// PerChunk cannot be causal.
    C2F_ARG(Gating, gating) = Gating::Auto;
  };

  /// attn_mask [L, L] or [n, L, L] (n = 1, B or B·H), key_padding_mask [B, L].
  C2F_LAYER_TRAITS("SparseC2FAttention", MaskFields::AttnMask | MaskFields::KeyPaddingMask);

  SparseC2FAttention(Index embed_dim, Index num_heads, Index chunk_size, Index top_k, Options options = Options())
      : shape_(detail::checked_heads<Scalar>("SparseC2FAttention", embed_dim, num_heads, 1, 4)),
        chunk_(detail::checked_positive("SparseC2FAttention", "chunk_size", chunk_size)),
        top_k_(detail::checked_positive("SparseC2FAttention", "top_k", top_k)),
        options_(options),
        gating_(options.gating() == Gating::Auto ? (options.causal() ? Gating::PerToken : Gating::PerChunk)
                                                 : options.gating()),
        mha_(embed_dim, num_heads,
             detail::inner_options<typename MultiHeadAttention<Scalar>::Options>(
                 (detail::check_compute_option<Scalar>("SparseC2FAttention", options.compute()), options))
                 .bias(options.bias())) {
    if (options.causal() && gating_ == Gating::PerChunk) {
      detail::fail(
          "SparseC2FAttention: per-chunk gating reads every query of a chunk, so it cannot be causal; "
          "use Gating::PerToken (or Auto) with causal = true");
    }
  }

  Index embed_dim() const { return mha_.embed_dim(); }
  Index num_heads() const { return mha_.num_heads(); }
  /// The positional `causal`: the same as Options().causal(causal).
  [[deprecated("use Options().causal(causal)")]] SparseC2FAttention(Index embed_dim, Index num_heads, Index chunk_size,
                                                                    Index top_k, bool causal,
                                                                    Options options = Options())
      : SparseC2FAttention(embed_dim, num_heads, chunk_size, top_k, options.causal(causal)) {}

  Index head_dim() const { return mha_.head_dim(); }
  Index chunk_size() const { return chunk_; }
  Index top_k() const { return top_k_; }
  const Options& options() const { return options_; }
  bool causal() const { return options_.causal(); }
  /// PerChunk or PerToken (Auto resolved at construction).
  Gating gating() const { return gating_; }
  void set_top_k(Index top_k) { top_k_ = detail::checked_positive("SparseC2FAttention", "top_k", top_k); }
  void set_num_threads(int n) { this->set_num_threads_of(options_, n); }
  /// The same weights as a full MultiHeadAttention (not causal: give it a causal mask to compare with
  /// a causal layer).
  const MultiHeadAttention<Scalar>& as_multihead_attention() const { return mha_; }

  /// The state dict is the MultiHeadAttention's, under the same names.
  template <class Self, class Fn>
  static void children(Self& self, Fn&& fn) {
    fn("", self.mha_);
  }

  /// Incremental decoding state of a causal layer: the keys and values of every token so far (stored
  /// as `Cache`: Scalar, Eigen::half or Eigen::bfloat16) and the mean key of every complete chunk, so a
  /// step scores the complete chunks without re-reading their keys.
  template <class Cache = Scalar>
  class DecodeStateOf : public detail::DecodeStateBase<Cache> {
   public:
    std::size_t memory_bytes() const { return this->cache_.memory_bytes() + means_.memory_bytes(); }

   private:
    friend class SparseC2FAttention;
    DecodeStateOf(Index batch, Index embed_dim, Index chunk, std::string made_by)
        : detail::DecodeStateBase<Cache>(batch, embed_dim, std::move(made_by)),
          means_(batch, embed_dim, chunk, /*values=*/false) {}
    detail::ChunkSummaries<Scalar> means_;
  };
  using DecodeState = DecodeStateOf<Scalar>;

  /// forward(x, masks), forward_into(x, out, masks) (detail::LayerBase): x [B, L, E] → [B, L, E].

  /// Training: forward_train(x, masks, step) and backward(saved, dy) (detail::LayerBase). What
  /// forward_train() keeps: x, the projections q, k, v, the heads' output, the selection and the masks —
  /// O(L·E + L·H·top_k) values (per-chunk gating: (L / chunk)·H·top_k), no [L, L] term. The output has
  /// forward()'s bits (no dropout).
  struct Saved : detail::SavedBase {
    detail::ScratchRowMatrix<Scalar> x, q, k, v, attn;  ///< [B·L, E] each
    kernels::ChunkSelection selection;
    Masks<Scalar> masks;
    Index batch = 0, length = 0;
  };

  /// forward(), and also the selected key chunks of every (batch, head, query chunk) — of every (batch,
  /// head, token) with per-token gating.
  SparseAttnOutput<Scalar> forward_with_selection(ConstTensor3Ref<Scalar> x, const Masks<Scalar>& masks = {}) const {
    return detail::with_layer_name(type_name, [&] {
      const std::array<Index, 3> dims = this->output_shape(x);
      detail::check_mask_fields(masks, type_name, mask_fields);
      SparseAttnOutput<Scalar> result;
      result.output =
          detail::fresh_output<Scalar>(type_name, dims, options_.num_threads(),
                                       [&](RowMatrixRef<Scalar> out) { result.selection = run(x, out, masks); });
      return result;
    });
  }

  /// Bytes of temporary memory one forward_into() holds at its peak: the projected q, k, v and the
  /// heads' output ([B·L, E] each), the selection (Index per (batch, head, query row) × top_k), and the
  /// scratch of the gating (chunk means, score blocks) and of the fine stage (per chunk: the keys and
  /// values in panels, or gathered per task — kernels::impl::chunk_sparse_workspace_bytes; per token: the
  /// accumulators and a key chunk — kernels::impl::token_sparse_workspace_bytes) — every worker's.
  std::size_t workspace_bytes(Index batch, Index seq) const {
    const kernels::ChunkGrid grid{batch, seq, chunk_};
    const std::size_t s = sizeof(Scalar), ix = sizeof(Index), e = static_cast<std::size_t>(embed_dim());
    const std::size_t h = static_cast<std::size_t>(num_heads()), k = static_cast<std::size_t>(chunk_);
    const std::size_t tokens = static_cast<std::size_t>(batch * seq), chunks = static_cast<std::size_t>(grid.chunks());
    const std::size_t m = static_cast<std::size_t>(grid.chunks_per_batch());
    const std::size_t top_k = static_cast<std::size_t>(top_k_), picks = std::min(top_k, std::max<std::size_t>(m, 1));
    const std::size_t workers = static_cast<std::size_t>(detail::resolve_threads(options_.num_threads(), batch * seq));
    const std::size_t top_picks = workers * picks * (s + ix);
    std::size_t selection, gating, fine;
    if (gating_ == Gating::PerToken) {
      selection = ix * tokens * h * top_k;
      gating = s * (chunks * e + workers * k * m) + top_picks;
      fine = kernels::impl::token_sparse_workspace_bytes<Scalar>(grid, num_heads(), head_dim(), top_k_,
                                                                 detail::kernel_options(options_));
    } else {
      selection = ix * chunks * h * top_k;
      gating = s * (2 * chunks * e + workers * m * m) + top_picks;
      fine = kernels::impl::chunk_sparse_workspace_bytes<Scalar>(grid, num_heads(), head_dim(), top_k_,
                                                                 detail::kernel_options(options_));
    }
    // + a packed [E, E] projection weight (micro-kernel builds; the in- and out-projections').
    const std::size_t packed = kernels::matmul_rows_workspace_bytes<Scalar>(
        batch * seq, embed_dim(), embed_dim(), false, options_.compute(), options_.num_threads());
    return s * 4 * tokens * e + selection + gating + fine + packed;
  }

 private:
  friend class detail::LayerBase<SparseC2FAttention, Scalar>;
  void compute(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks) const {
    run(x, out, masks);
  }

  friend struct detail::TrainAccess;
  void compute_train(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                     std::uint64_t, Saved& saved) const {
    saved.x = x.rows();
    saved.masks = masks;
    saved.batch = x.batch();
    saved.length = x.seq();
    saved.selection = run(x, out, masks, &saved);
  }
  /// out_proj's backward, the fine stage's (the selection constant) and the in-projection's (x feeds the
  /// query, key and value paths: dL/dx is their sum).
  void compute_backward(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
                        SparseC2FAttention& grad) const {
    const Index batch = saved.batch, length = saved.length, e = embed_dim(), heads = num_heads(), rows = batch * length;
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    const bool bias = options_.bias();
    MultiHeadAttention<Scalar>& gm = grad.mha_;
    g.input = Tensor3<Scalar>(batch, length, e);
    Eigen::Map<RowMatrix<Scalar>> dx(g.input.data(), rows, e);
    RowMatrix<Scalar> dattn(rows, e);
    kernels::linear_backward<Scalar>(saved.attn, mha_.out_proj_.weight(), dy, dattn, gm.out_proj_.weight(),
                                     bias ? gm.out_proj_.bias().data() : nullptr, threads);
    RowMatrix<Scalar> dq(rows, e), dk(rows, e), dv(rows, e);
    {
      const MaskView<Scalar> mask(saved.masks, batch, heads, length, length);
      kernels::sparse_attention_backward<Scalar>(saved.q, saved.k, saved.v, kernels::ChunkGrid{batch, length, chunk_},
                                                 heads, saved.selection, dattn, dq, dk, dv, options_.causal(), mask,
                                                 kernels::default_scale<Scalar>(head_dim()), threads);
    }
    dattn.resize(0, 0);
    const RowMatrix<Scalar>* dproj[3] = {&dq, &dk, &dv};
    RowMatrix<Scalar> part(rows, e);
    for (int i = 0; i < 3; ++i) {
      Scalar* db = bias ? gm.b_.data() + i * e : nullptr;
      if (i == 0) {
        kernels::linear_backward<Scalar>(saved.x, mha_.w_[i], *dproj[i], dx, gm.w_[i], db, threads);
      } else {
        kernels::linear_backward<Scalar>(saved.x, mha_.w_[i], *dproj[i], part, gm.w_[i], db, threads);
        dx += part;
      }
    }
  }

  /// The forward pass into out, after the checks; returns the selection. `saved`: nullptr, or training's
  /// state, which then holds q, k, v and the heads' output (moved there at the end: the same arithmetic).
  kernels::ChunkSelection run(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                              Saved* saved = nullptr) const {
    const Index batch = x.batch(), length = x.seq(), e = embed_dim(), heads = num_heads();
    // The large temporaries live in reused scratch memory (detail/scratch.hpp): no fresh pages per call.
    detail::ScratchRowMatrix<Scalar> q(batch * length, e), k(batch * length, e), v(batch * length, e),
        attn(batch * length, e);
    mha_.project_into(x, x, x, q, k, v);
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    const bool causal = options_.causal();
    const MaskView<Scalar> mask(masks, batch, heads, length, length);
    const Scalar scale = kernels::default_scale<Scalar>(head_dim());
    const kernels::ChunkGrid grid{batch, length, chunk_};
    kernels::ChunkSelection selection;
    // The chunk summaries leave out the tokens key padding hides: a padded token is no token, so its
    // values cannot change which chunks a real token selects (a chunk with none ranks last).
    const KeyPaddingMask<Scalar>& padding = masks.key_padding_mask();
    const auto means = [&](const ConstRowMatrixRef<Scalar>& rows, RowMatrix<Scalar>& out_means) {
      out_means.resize(grid.chunks(), e);
      if (padding.is_none()) {
        kernels::chunk_mean<Scalar>(rows, grid, out_means, threads);
      } else {
        const Index m = grid.chunks_per_batch();
        kernels::chunk_mean_where<Scalar>(
            rows, grid, [&](Index c, Index j) { return !padding.hides(c / m, grid.first(c) + j); }, out_means, threads);
      }
    };
    RowMatrix<Scalar> k_means, q_means;
    means(k, k_means);
    if (gating_ == Gating::PerToken) {
      selection = kernels::select_chunks_per_token<Scalar>(q, k_means, grid, heads, top_k_, causal, threads);
      kernels::token_sparse_attention<Scalar>(q, k, v, grid, heads, selection, attn, causal, mask, scale, threads);
    } else {
      means(q, q_means);
      selection = kernels::select_chunks_from_means<Scalar>(q_means, k_means, grid, heads, top_k_, threads);
      kernels::chunk_sparse_attention<Scalar>(q, k, v, grid, heads, selection, attn, mask, scale, threads);
    }
    mha_.out_proj().forward_rows(attn, out);
    if (saved != nullptr) {
      saved->q = std::move(q);
      saved->k = std::move(k);
      saved->v = std::move(v);
      saved->attn = std::move(attn);
    }
    return selection;
  }

  friend class detail::Decoder<SparseC2FAttention, Scalar>;
  template <class Cache>
  DecodeStateOf<Cache> make_decode_state(Index batch) const {
    return DecodeStateOf<Cache>(batch, embed_dim(), chunk_, decode_config());
  }
  /// What shapes a decoding state: a state made by another configuration is refused.
  std::string decode_config() const {
    return "SparseC2FAttention(embed_dim=" + std::to_string(embed_dim()) +
           ", num_heads=" + std::to_string(num_heads()) + ", chunk_size=" + std::to_string(chunk_) + ")";
  }

  template <class Cache>
  Output<Scalar> run_decode(const ConstTensor3Ref<Scalar>& x, DecodeStateOf<Cache>& state, Index outputs) const {
    detail::check_decode("SparseC2FAttention", options_.causal(), x, state.batch(), embed_dim());
    const Index batch = x.batch(), n = x.seq(), e = embed_dim(), heads = num_heads();
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    RowMatrix<Scalar> q, k, v;
    mha_.project_last(x, outputs, q, k, v);
    state.cache_.append(ConstRowMatrixRef<Scalar>(k), ConstRowMatrixRef<Scalar>(v), n);
    state.means_.update(state.cache_);
    const Index total = state.length();
    const kernels::ChunkGrid grid{1, total, chunk_};
    const Scalar scale = kernels::default_scale<Scalar>(head_dim());
    RowMatrix<Scalar> attn(batch * outputs, e);
    for (Index b = 0; b < batch; ++b) {
      const ConstRowMatrixRef<Scalar> qb = q.middleRows(b * outputs, outputs);
      const kernels::ChunkSelection selection = kernels::select_chunks_per_token<Scalar>(
          qb, state.means_.keys(b), grid, heads, top_k_, /*causal=*/true, threads);
      kernels::token_sparse_attention<Scalar, Cache>(qb, state.cache_.keys(b, 0, total),
                                                     state.cache_.values(b, 0, total), grid, heads, selection,
                                                     attn.middleRows(b * outputs, outputs),
                                                     /*causal=*/true, MaskView<Scalar>(), scale, threads);
    }
    return detail::fresh_output<Scalar>(type_name, {batch, outputs, e}, options_.num_threads(),
                                        [&](RowMatrixRef<Scalar> out) { mha_.out_proj().forward_rows(attn, out); });
  }

  detail::HeadShape shape_;  // first: checked before the wrapped layer is built
  Index chunk_;
  Index top_k_;
  Options options_;
  Gating gating_;
  MultiHeadAttention<Scalar> mha_;
};

}  // namespace c2f
