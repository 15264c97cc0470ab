// c2f layers — MultiHeadAttention, numerically torch.nn.MultiheadAttention(batch_first=True) in eval mode.
#pragma once

#include "c2f/detail/mask_plan.hpp"
#include "c2f/detail/module.hpp"
#include "c2f/detail/random.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/layers/linear.hpp"
#include "c2f/mask.hpp"

#include <string>
#include <string_view>

namespace c2f {

/// Masks for one attention call (both optional); see c2f/mask.hpp for the conventions.
template <class Scalar>
struct AttentionMasks {
  AttnMask<Scalar> attn_mask;
  KeyPaddingMask<Scalar> key_padding_mask;
};

/// Which attention weights forward_with_weights() returns (PyTorch's `average_attn_weights`).
enum class AttnWeights {
  Averaged,  ///< mean over heads: weights [batch, 1, queries, keys]
  PerHead,   ///< weights [batch, heads, queries, keys]
};

/// Which kernel computes softmax(q kᵀ) v when no weights are asked for.
enum class AttentionKernel {
  Streaming,  ///< blocked online softmax, no [queries, keys] buffer (default)
  Naive,      ///< materialises the scores of one (batch, head) at a time; the reference
};

template <class Scalar>
struct AttentionOutput {
  Tensor3<Scalar> output;   ///< [batch, queries, embed_dim]
  Tensor4<Scalar> weights;  ///< [batch, 1 or heads, queries, keys]
};

/// Multi-head attention with PyTorch's parameters, state-dict names and eval-mode semantics:
///   q = query W_qᵀ + b_q, k = key W_kᵀ + b_k, v = value W_vᵀ + b_v, split into `num_heads` heads of
///   width head_dim = embed_dim / num_heads; per head softmax(q kᵀ / sqrt(head_dim) + mask) v;
///   heads concatenated; out_proj. Dropout is not applied (eval mode).
/// State dict: `in_proj_weight` [3E, E] (rows W_q; W_k; W_v) and `in_proj_bias` [3E] when
/// kdim = vdim = E, else `q_proj_weight` [E, E], `k_proj_weight` [E, kdim], `v_proj_weight` [E, vdim]
/// (and `in_proj_bias` [3E]); `out_proj.weight` [E, E], `out_proj.bias` [E]. With bias = false no bias
/// tensor exists. Seed 000's C2FMultiHeadAttention names (`qkv_proj.weight`, `qkv_proj.bias`) load too.
/// forward() is const: one module may serve several threads at once.
template <class Scalar>
class MultiHeadAttention : public detail::Module<MultiHeadAttention<Scalar>> {
 public:
  struct Options {
    bool bias = true;
    Index kdim = 0;  ///< key features; 0 = embed_dim
    Index vdim = 0;  ///< value features; 0 = embed_dim
    int num_threads = 0;  ///< 0 = c2f::get_num_threads(); results are bitwise the same for any count
    AttentionKernel kernel = AttentionKernel::Streaming;
    Index query_block = 64;  ///< streaming kernel: query rows per task
    Index key_block = 256;   ///< streaming kernel: keys per online-softmax step
    std::uint64_t seed = 0;  ///< initialisation seed (PyTorch's init distributions)
  };

  MultiHeadAttention(Index embed_dim, Index num_heads) : MultiHeadAttention(embed_dim, num_heads, Options{}) {}

  MultiHeadAttention(Index embed_dim, Index num_heads, Options options)
      : embed_dim_(embed_dim),
        num_heads_(num_heads),
        kdim_(options.kdim > 0 ? options.kdim : embed_dim),
        vdim_(options.vdim > 0 ? options.vdim : embed_dim),
        options_(options),
        out_proj_(std::max<Index>(embed_dim, 1), std::max<Index>(embed_dim, 1), options.bias, options.seed + 1) {
    detail::check_scalar<Scalar>();
    if (embed_dim <= 0 || num_heads <= 0) {
      detail::fail("MultiHeadAttention needs embed_dim > 0 and num_heads > 0, got embed_dim=", embed_dim,
                   ", num_heads=", num_heads);
    }
    if (embed_dim % num_heads != 0) {
      detail::fail("MultiHeadAttention: embed_dim (", embed_dim, ") must be divisible by num_heads (", num_heads, ")");
    }
    if (options.kdim < 0 || options.vdim < 0) {
      detail::fail("MultiHeadAttention: kdim and vdim must be >= 0 (0 = embed_dim), got kdim=", options.kdim,
                   ", vdim=", options.vdim);
    }
    reset_parameters(options.seed);
  }

  Index embed_dim() const { return embed_dim_; }
  Index num_heads() const { return num_heads_; }
  Index head_dim() const { return embed_dim_ / num_heads_; }
  Index kdim() const { return kdim_; }
  Index vdim() const { return vdim_; }
  bool has_bias() const { return options_.bias; }
  /// True when the q, k and v weights are stored as PyTorch's one `in_proj_weight`.
  bool packed_in_proj() const { return kdim_ == embed_dim_ && vdim_ == embed_dim_; }
  const Options& options() const { return options_; }
  void set_num_threads(int n) { options_.num_threads = n; }
  void set_kernel(AttentionKernel kernel) { options_.kernel = kernel; }

  const RowMatrix<Scalar>& q_weight() const { return w_[0]; }
  const RowMatrix<Scalar>& k_weight() const { return w_[1]; }
  const RowMatrix<Scalar>& v_weight() const { return w_[2]; }
  const Linear<Scalar>& out_proj() const { return out_proj_; }

  /// PyTorch's initialisation distributions (Xavier-uniform in-projection, zero biases, Linear's
  /// default for out_proj.weight), drawn deterministically from `seed`.
  void reset_parameters(std::uint64_t seed) {
    detail::Rng rng(seed);
    const Index in_dims[3] = {embed_dim_, kdim_, vdim_};
    if (packed_in_proj()) {
      RowMatrix<Scalar> packed(3 * embed_dim_, embed_dim_);
      detail::xavier_uniform(packed, rng);
      for (int i = 0; i < 3; ++i) w_[i] = packed.middleRows(i * embed_dim_, embed_dim_);
    } else {
      for (int i = 0; i < 3; ++i) {
        w_[i].resize(embed_dim_, in_dims[i]);
        detail::xavier_uniform(w_[i], rng);
      }
    }
    b_ = Vector<Scalar>::Zero(options_.bias ? 3 * embed_dim_ : 0);
    detail::linear_default_uniform(out_proj_.weight(), rng);
    if (options_.bias) out_proj_.bias().setZero();
  }

  /// Reads this module's tensors under `name` (a prefix ending in '.' or empty) from a loader shared
  /// with an enclosing module.
  void load(detail::StrictLoader& loader, const std::string& name) {
    const Index e = embed_dim_;
    if (packed_in_proj()) {
      // PyTorch's name, or seed 000's `qkv_proj` Linear (same [3E, E] layout).
      const bool seed_names = !loader.has(name + "in_proj_weight") && loader.has(name + "qkv_proj.weight");
      const std::string w_key = name + (seed_names ? "qkv_proj.weight" : "in_proj_weight");
      const std::string b_key = name + (seed_names ? "qkv_proj.bias" : "in_proj_bias");
      RowMatrix<Scalar> packed;
      loader.read(w_key, {3 * e, e}, packed);
      for (int i = 0; i < 3; ++i) w_[i] = packed.middleRows(i * e, e);
      if (options_.bias) loader.read(b_key, {3 * e}, b_);
    } else {
      const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
      const Index in_dims[3] = {embed_dim_, kdim_, vdim_};
      for (int i = 0; i < 3; ++i) loader.read(name + names[i], {e, in_dims[i]}, w_[i]);
      if (options_.bias) loader.read(name + "in_proj_bias", {3 * e}, b_);
    }
    out_proj_.load(loader, name + "out_proj.");
  }

  /// Writes this module's tensors under `name`; `qkv_proj_names` writes the packed projection as seed
  /// 000/004's `qkv_proj.weight` / `qkv_proj.bias` instead of `in_proj_weight` / `in_proj_bias`.
  void save(StateDict& sd, const std::string& name, bool qkv_proj_names = false) const {
    const Index e = embed_dim_;
    if (packed_in_proj()) {
      RowMatrix<Scalar> packed(3 * e, e);
      for (int i = 0; i < 3; ++i) packed.middleRows(i * e, e) = w_[i];
      detail::store(sd, name + (qkv_proj_names ? "qkv_proj.weight" : "in_proj_weight"), packed, {3 * e, e});
      if (options_.bias) detail::store(sd, name + (qkv_proj_names ? "qkv_proj.bias" : "in_proj_bias"), b_, {3 * e});
    } else {
      detail::store(sd, name + "q_proj_weight", w_[0], {e, embed_dim_});
      detail::store(sd, name + "k_proj_weight", w_[1], {e, kdim_});
      detail::store(sd, name + "v_proj_weight", w_[2], {e, vdim_});
      if (options_.bias) detail::store(sd, name + "in_proj_bias", b_, {3 * e});
    }
    out_proj_.save(sd, name + "out_proj.");
  }

  /// Self-attention: forward(x, x, x, masks).
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x, const AttentionMasks<Scalar>& masks = {}) const {
    return run(x, x, x, masks, nullptr).output;
  }

  /// query [B, Lq, E], key [B, Lk, kdim], value [B, Lk, vdim] → [B, Lq, E].
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> query, ConstTensor3Ref<Scalar> key, ConstTensor3Ref<Scalar> value,
                          const AttentionMasks<Scalar>& masks = {}) const {
    return run(query, key, value, masks, nullptr).output;
  }

  /// Like forward(), and also returns the attention weights (PyTorch's need_weights=True). This
  /// materialises [B, H, Lq, Lk] and uses the naive kernel.
  AttentionOutput<Scalar> forward_with_weights(ConstTensor3Ref<Scalar> query, ConstTensor3Ref<Scalar> key,
                                               ConstTensor3Ref<Scalar> value, const AttentionMasks<Scalar>& masks = {},
                                               AttnWeights mode = AttnWeights::Averaged) const {
    return run(query, key, value, masks, &mode);
  }

  /// The in-projection alone: qp [B·Lq, E] = query W_qᵀ + b_q, kp [B·Lk, E], vp [B·Lk, E] (head h is
  /// columns [h·head_dim, (h+1)·head_dim)). For layers that run other attention on these weights.
  void project(const ConstTensor3Ref<Scalar>& query, const ConstTensor3Ref<Scalar>& key,
               const ConstTensor3Ref<Scalar>& value, RowMatrix<Scalar>& qp, RowMatrix<Scalar>& kp,
               RowMatrix<Scalar>& vp) const {
    check_inputs(query, key, value);
    const Index e = embed_dim_;
    const int threads = options_.num_threads;
    qp.resize(query.batch() * query.seq(), e);
    kp.resize(key.batch() * key.seq(), e);
    vp.resize(value.batch() * value.seq(), e);
    const Scalar* bias = options_.bias ? b_.data() : nullptr;
    kernels::linear<Scalar>(query.rows(), w_[0], bias, qp, threads);
    kernels::linear<Scalar>(key.rows(), w_[1], bias ? bias + e : nullptr, kp, threads);
    kernels::linear<Scalar>(value.rows(), w_[2], bias ? bias + 2 * e : nullptr, vp, threads);
  }

  /// Bytes of temporary memory one forward() without weights holds at its peak, besides the returned
  /// [batch, lq, embed_dim] output: the projected q, k, v, the heads' output and every worker's kernel
  /// scratch — linear in the sequence lengths.
  std::size_t workspace_bytes(Index batch, Index lq, Index lk) const {
    const std::size_t proj = sizeof(Scalar) * static_cast<std::size_t>(embed_dim_ * batch * (2 * lq + 2 * lk));
    if (options_.kernel == AttentionKernel::Naive) {
      return proj + sizeof(Scalar) * static_cast<std::size_t>(lq * lk) * static_cast<std::size_t>(threads_for(batch));
    }
    return proj + kernels::sdpa_streaming_workspace_bytes<Scalar>(sdpa_options(), head_dim(), head_dim()) *
                      static_cast<std::size_t>(threads_for(batch * num_heads_ * lq));
  }

 private:
  kernels::SdpaOptions sdpa_options() const {
    kernels::SdpaOptions o;
    o.query_block = options_.query_block;
    o.key_block = options_.key_block;
    o.num_threads = options_.num_threads;
    return o;
  }
  int threads_for(Index tasks) const { return detail::resolve_threads(options_.num_threads, tasks); }

  void check_inputs(const ConstTensor3Ref<Scalar>& q, const ConstTensor3Ref<Scalar>& k,
                    const ConstTensor3Ref<Scalar>& v) const {
    using detail::shape_string;
    detail::check_features(q, embed_dim_, "MultiHeadAttention", "query", "embed_dim");
    if (k.features() != kdim_ || v.features() != vdim_) {
      detail::fail("MultiHeadAttention: key must be [batch, seq, kdim=", kdim_, "] and value [batch, seq, vdim=", vdim_,
                   "], got key ", shape_string({k.batch(), k.seq(), k.features()}), " and value ",
                   shape_string({v.batch(), v.seq(), v.features()}));
    }
    if (k.batch() != q.batch() || v.batch() != q.batch() || k.seq() != v.seq()) {
      detail::fail("MultiHeadAttention: query ", shape_string({q.batch(), q.seq(), q.features()}), ", key ",
                   shape_string({k.batch(), k.seq(), k.features()}), " and value ",
                   shape_string({v.batch(), v.seq(), v.features()}),
                   " must share the batch size, and key and value the sequence length");
    }
  }

  AttentionOutput<Scalar> run(const ConstTensor3Ref<Scalar>& query, const ConstTensor3Ref<Scalar>& key,
                              const ConstTensor3Ref<Scalar>& value, const AttentionMasks<Scalar>& masks,
                              const AttnWeights* weights_mode) const {
    RowMatrix<Scalar> qp, kp, vp;
    project(query, key, value, qp, kp, vp);  // validates the shapes
    const Index batch = query.batch(), lq = query.seq(), lk = key.seq(), e = embed_dim_, h = num_heads_;
    const detail::MaskPlan<Scalar> plan(masks.attn_mask, masks.key_padding_mask, batch, h, lq, lk);
    const int threads = options_.num_threads;

    RowMatrix<Scalar> attn(batch * lq, e);
    const Index dh = head_dim();
    const kernels::HeadsView<const Scalar> qv = kernels::heads_view<const Scalar>(qp.data(), batch, lq, e, 0, h, dh);
    const kernels::HeadsView<const Scalar> kv = kernels::heads_view<const Scalar>(kp.data(), batch, lk, e, 0, h, dh);
    const kernels::HeadsView<const Scalar> vv = kernels::heads_view<const Scalar>(vp.data(), batch, lk, e, 0, h, dh);
    const kernels::HeadsView<Scalar> ov = kernels::heads_view<Scalar>(attn.data(), batch, lq, e, 0, h, dh);

    AttentionOutput<Scalar> result;
    result.output = Tensor3<Scalar>(batch, lq, e);
    if (weights_mode != nullptr) {
      Tensor4<Scalar> per_head(batch, h, lq, lk);
      kernels::sdpa_naive<Scalar>(qv, kv, vv, ov, plan, sdpa_options(), per_head.data());
      if (*weights_mode == AttnWeights::PerHead) {
        result.weights = std::move(per_head);
      } else {
        const Eigen::array<Index, 4> dims{batch, 1, lq, lk};
        result.weights = per_head.mean(Eigen::array<Index, 1>{1}).reshape(dims);
      }
    } else if (options_.kernel == AttentionKernel::Naive) {
      kernels::sdpa_naive<Scalar>(qv, kv, vv, ov, plan, sdpa_options());
    } else {
      kernels::sdpa_streaming<Scalar>(qv, kv, vv, ov, plan, sdpa_options());
    }

    Eigen::Map<RowMatrix<Scalar>> out(result.output.data(), batch * lq, e);
    out_proj_.forward_rows(attn, out, threads);
    return result;
  }

  Index embed_dim_;
  Index num_heads_;
  Index kdim_;
  Index vdim_;
  Options options_;
  RowMatrix<Scalar> w_[3];  ///< W_q [E, E], W_k [E, kdim], W_v [E, vdim]
  Vector<Scalar> b_;        ///< [b_q; b_k; b_v], empty without bias
  Linear<Scalar> out_proj_;
};

}  // namespace c2f
