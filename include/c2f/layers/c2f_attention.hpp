// c2f layers — C2FAttention, the coarse-to-fine attention article's module: mean-pooled chunks →
// CoarseAttention → FineAttention.
//
// Semantics (eval mode), for d = embed_dim: x [B, L, d] → chunks of chunk_size → mean over each chunk →
// CoarseAttention → FineAttention(x chunks, coarse output) → [B, L, d]. Lengths not divisible by
// chunk_size: m = ceil(L / chunk_size) chunks, the last one partial. Its coarse mean averages only its real
// tokens; in the fine stage its padded keys are masked and its padded query rows do not exist in the
// output. L < chunk_size is one partial chunk. The fine mask is given over the padded grid [B·m, k, k];
// its entries at padded positions are ignored. The two stages: c2f/layers/coarse_attention.hpp and
// c2f/layers/fine_attention.hpp.
#pragma once

#include "c2f/kernels/chunk.hpp"
#include "c2f/layers/coarse_attention.hpp"
#include "c2f/layers/fine_attention.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/options.hpp"

#include <algorithm>

namespace c2f {

/// The coarse-to-fine module's C2FAttention: mean-pooled chunks → CoarseAttention → FineAttention.
/// State dict: `coarse_attn.qkv_proj.*`, `coarse_attn.out_proj.*`, `fine_attn.q_proj.*`,
/// `fine_attn.kv_proj.*`, `fine_attn.out_proj.*` — exactly the PyTorch module's names.
/// Masks: attn_mask is the coarse stage's, over chunks ([m, m] or [n, m, m], n = 1, B or B·H);
/// fine_attn_mask the fine stage's, inside chunks over the padded grid ([k, k] or [n, k, k], n = 1, B·m
/// or B·m·H).
template <class Scalar>
class C2FAttention : public detail::LayerBase<C2FAttention<Scalar>, Scalar> {
 public:
  /// FineAttention's options: num_threads, seed (init as the article advises, see reset_parameters),
  /// kernel, query_block and key_block (the coarse stage and the fine stage's general path), fine_path.
  using Options = typename FineAttention<Scalar>::Options;

  /// attn_mask: the coarse stage's ([m, m] or [n, m, m], n = 1, B or B·H); fine_attn_mask: the fine
  /// stage's ([k, k] or [n, k, k], n = 1, B·m or B·m·H, over the padded grid).
  C2F_LAYER_TRAITS("C2FAttention", MaskFields::AttnMask | MaskFields::FineAttnMask);

  C2FAttention(Index embed_dim, Index num_heads, Index chunk_size, Options options = Options())
      : shape_(detail::checked_heads<Scalar>("C2FAttention", embed_dim, num_heads, 1, 8)),
        chunk_(detail::checked_positive("C2FAttention", "chunk_size", chunk_size)),
        options_(options),
        coarse_(embed_dim, num_heads, detail::inner_options<typename CoarseAttention<Scalar>::Options>(options)),
        fine_(embed_dim, num_heads, Options(options).seed(options.seed() + 1)) {}

  Index embed_dim() const { return fine_.embed_dim(); }
  Index num_heads() const { return fine_.num_heads(); }
  Index head_dim() const { return fine_.head_dim(); }
  Index chunk_size() const { return chunk_; }
  const Options& options() const { return options_; }
  const CoarseAttention<Scalar>& coarse_attn() const { return coarse_; }
  const FineAttention<Scalar>& fine_attn() const { return fine_; }
  void set_num_threads(int n) { this->set_num_threads_of(options_, n); }
  void set_fine_path(FinePath path) {
    options_.fine_path(path);
    fine_.set_fine_path(path);
  }

  /// reset_parameters(seed) (from detail::Module) follows the article's advice: Xavier-uniform coarse
  /// qkv_proj.weight (seed), Kaiming-normal (fan_out) fine q_proj.weight (seed + 1), nn.Linear's default
  /// for the other weights, zero biases.
  template <class Self, class Fn>
  static void children(Self& self, Fn&& fn) {
    fn("coarse_attn.", self.coarse_);
    fn("fine_attn.", self.fine_);
  }

  /// forward(x, masks), forward_into(x, out, masks) (detail::LayerBase): x [B, L, d] → [B, L, d]; any
  /// L ≥ 0 (see the file comment for partial chunks). forward_into into a buffer reused across calls
  /// saves the first-touch cost of a fresh output (the operating system maps and zeroes every page of it).

  /// The coarse stage's input: the mean of the real tokens of every chunk, [B, ceil(L / chunk), d].
  Tensor3<Scalar> coarse_input(ConstTensor3Ref<Scalar> x) const {
    const kernels::ChunkGrid grid{x.batch(), x.seq(), chunk_};
    Tensor3<Scalar> summaries(x.batch(), grid.chunks_per_batch(), embed_dim());
    Eigen::Map<RowMatrix<Scalar>> rows(summaries.data(), grid.chunks(), embed_dim());
    kernels::chunk_mean<Scalar>(x.rows(), grid, rows, detail::kernel_options(options_));
    return summaries;
  }

  /// Training. What forward_train() keeps for backward(): the coarse stage's state (over the chunk means:
  /// O((L / chunk)·d)) and the fine stage's (which keeps x) — O(L·d) values, no [L, L] term.
  struct Saved : detail::SavedBase {
    typename CoarseAttention<Scalar>::Saved coarse;
    typename FineAttention<Scalar>::Saved fine;
  };
  /// forward_train(x, masks, step) and backward(saved, dy) (detail::LayerBase): the output has forward()'s
  /// bits (C2FAttention has no dropout); g.input = dL/dx, to which the mean pooling gives dL/dmean_c / n_c
  /// on each of chunk c's n_c real tokens (a partial last chunk: its own count).

  /// Bytes of temporary memory one forward_into() holds at its peak: the chunk means and the coarse
  /// output ([B·m, d] each), and the larger of the coarse stage's and the fine stage's working memory.
  std::size_t workspace_bytes(Index batch, Index seq) const {
    const kernels::ChunkGrid grid{batch, seq, chunk_};
    const std::size_t means = 2 * sizeof(Scalar) * static_cast<std::size_t>(grid.chunks() * embed_dim());
    return means +
           std::max(coarse_.workspace_bytes(batch, grid.chunks_per_batch()), fine_.workspace_bytes(batch, seq, chunk_));
  }

 private:
  friend class detail::LayerBase<C2FAttention, Scalar>;
  void compute(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks) const {
    const Tensor3<Scalar> summaries = coarse_input(x);
    const Tensor3<Scalar> context = coarse_.forward(summaries, Masks<Scalar>().attn_mask(masks.attn_mask()));
    fine_.forward_chunked_into(x, chunk_, context, out, Masks<Scalar>().attn_mask(masks.fine_attn_mask()));
  }

  friend struct detail::TrainAccess;
  /// compute() in train mode: the same stages, each keeping its state.
  void compute_train(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                     std::uint64_t step, Saved& saved) const {
    const Tensor3<Scalar> summaries = coarse_input(x);
    Tensor3<Scalar> context(summaries.dimension(0), summaries.dimension(1), embed_dim());
    detail::TrainAccess::train(
        coarse_, ConstTensor3Ref<Scalar>(summaries),
        Eigen::Map<RowMatrix<Scalar>>(context.data(), summaries.dimension(0) * summaries.dimension(1), embed_dim()),
        Masks<Scalar>().attn_mask(masks.attn_mask()), step, saved.coarse);
    detail::TrainAccess::train(fine_, x, chunk_, ConstTensor3Ref<Scalar>(context), out,
                               Masks<Scalar>().attn_mask(masks.fine_attn_mask()), step, saved.fine);
  }
  /// The fine stage's backward (dL/dx through its keys and values, dL/dcontext), the coarse stage's on
  /// dL/dcontext (dL/dmeans), and the mean pooling's: dL/dx += dL/dmean_c / n_c on chunk c's real tokens.
  void compute_backward(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
                        C2FAttention& grad) const {
    Grads<Scalar> fine_g, coarse_g;
    detail::TrainAccess::backward(fine_, saved.fine, dy, fine_g, grad.fine_);
    const kernels::ChunkGrid grid{saved.fine.grid.batch, saved.fine.grid.length, chunk_};
    detail::TrainAccess::backward(
        coarse_, saved.coarse, Eigen::Map<const RowMatrix<Scalar>>(fine_g.context.data(), grid.chunks(), embed_dim()),
        coarse_g, grad.coarse_);
    g.input = std::move(fine_g.input);
    kernels::chunk_mean_backward_add<Scalar>(
        Eigen::Map<const RowMatrix<Scalar>>(coarse_g.input.data(), grid.chunks(), embed_dim()), grid,
        Eigen::Map<RowMatrix<Scalar>>(g.input.data(), grid.tokens(), embed_dim()), detail::kernel_options(options_));
  }

  detail::HeadShape shape_;  // first: checked before the stages are built
  Index chunk_;
  Options options_;
  CoarseAttention<Scalar> coarse_;
  FineAttention<Scalar> fine_;
};

}  // namespace c2f
