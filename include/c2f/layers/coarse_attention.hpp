// c2f layers — CoarseAttention, the coarse stage of the coarse-to-fine attention article's module:
// attention between chunk summaries.
//
// Semantics (eval mode; dropout is the identity), for d = embed_dim, H = num_heads, d_k = d / H: x [B, m,
// d] chunk summaries → [B, m, d]. q, k, v = chunks of qkv_proj(x) (Linear d → 3d, in that order),
// softmax(q kᵀ / sqrt(d_k) + mask) v per head, heads concatenated, out_proj. Optional mask [m, m] or [B,
// m, m] (broadcast over heads). This is MultiHeadAttention with the module's parameter names
// (`qkv_proj`). The article's masks did not broadcast over heads (a bug, fixed here), and it fills masked
// scores with -1e9 where c2f masks with -inf: the same result except for a row with no visible key, where
// c2f outputs zero attention (the article's code would average every value uniformly).
#pragma once

#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/options.hpp"

#include <string>

namespace c2f {

/// The coarse-to-fine module's CoarseAttention: attention between chunk summaries, parameters
/// `qkv_proj`, `out_proj`. Masks: attn_mask [m, m] or [n, m, m] (n = 1, B or B·H), key_padding_mask [B, m].
template <class Scalar>
class CoarseAttention : public detail::LayerBase<CoarseAttention<Scalar>, Scalar> {
 public:
  /// seed: Xavier-uniform qkv_proj.weight, nn.Linear's default out_proj.weight, zero biases.
  class Options : public RuntimeOptions<Options>,
                  public AttnKernelOptions<Options>,
                  public DropoutOption<Options>,
                  public ComputeOption<Options> {};

  /// attn_mask [m, m] or [n, m, m] (n = 1, B or B·H), key_padding_mask [B, m].
  C2F_LAYER_TRAITS("CoarseAttention", MaskFields::AttnMask | MaskFields::KeyPaddingMask);
  /// Training (forward_train, backward: detail::LayerBase): MultiHeadAttention's, under this layer's names.
  using Saved = typename MultiHeadAttention<Scalar>::Saved;

  CoarseAttention(Index embed_dim, Index num_heads, Options options = Options())
      : shape_((kernels::impl::check_dropout("CoarseAttention", options.dropout()),
                detail::check_compute_option<Scalar>("CoarseAttention", options.compute()),
                detail::checked_heads<Scalar>("CoarseAttention", embed_dim, num_heads, 1, 4))),
        options_(options),
        mha_(embed_dim, num_heads,
             detail::inner_options<typename MultiHeadAttention<Scalar>::Options>(options).rows_independent(true)) {}

  Index embed_dim() const { return mha_.embed_dim(); }
  Index num_heads() const { return mha_.num_heads(); }
  Index head_dim() const { return mha_.head_dim(); }
  const Options& options() const { return options_; }
  void set_num_threads(int n) {
    options_.num_threads(n);
    mha_.set_num_threads(n);
  }
  /// The same module as a MultiHeadAttention (PyTorch names `in_proj_*` in its state_dict()).
  const MultiHeadAttention<Scalar>& as_multihead_attention() const { return mha_; }

  /// The module's init: nn.init.xavier_uniform_(qkv_proj.weight); out_proj.weight nn.Linear's default;
  /// zero biases.
  void reset_parameters(std::uint64_t seed) { mha_.reset_parameters(seed); }

  /// `qkv_proj.weight` [3d, d], `qkv_proj.bias` [3d], `out_proj.weight` [d, d], `out_proj.bias` [d].
  void load(detail::StrictLoader& loader, const std::string& name) {
    if (!loader.has(name + "qkv_proj.weight")) {
      detail::fail("missing key '", loader.prefix(), name, "qkv_proj.weight' (CoarseAttention)");
    }
    mha_.load(loader, name);
  }
  void save(StateDict& sd, const std::string& name) const { mha_.save(sd, name, /*qkv_proj_names=*/true); }

  /// forward(x, masks), forward_into(x, out, masks): x [B, m, d] → [B, m, d] (detail::LayerBase).
  std::size_t workspace_bytes(Index batch, Index seq) const { return mha_.workspace_bytes(batch, seq); }

 private:
  friend class detail::LayerBase<CoarseAttention, Scalar>;
  void compute(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks) const {
    mha_.forward_into(x, out, masks);
  }
  friend struct detail::TrainAccess;
  void compute_train(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                     std::uint64_t step, Saved& saved) const {
    detail::TrainAccess::train(mha_, x, out, masks, step, saved);
  }
  void compute_backward(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
                        CoarseAttention& grad) const {
    detail::TrainAccess::backward(mha_, saved, dy, g, grad.mha_);
  }

  detail::HeadShape shape_;  // first: checked before the wrapped layer is built
  Options options_;
  MultiHeadAttention<Scalar> mha_;
};

}  // namespace c2f
