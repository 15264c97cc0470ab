// c2f layers — MultiHeadAttention, numerically torch.nn.MultiheadAttention(batch_first=True) in eval mode.
#pragma once

#include "c2f/detail/huge_pages.hpp"
#include "c2f/detail/random.hpp"
#include "c2f/detail/scratch.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/kernels/sdpa_backward.hpp"
#include "c2f/layers/linear.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/mask_view.hpp"
#include "c2f/options.hpp"

#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <utility>

namespace c2f {

template <class Scalar>
class SparseC2FAttention;

/// Which attention weights forward_with_weights() returns (PyTorch's `average_attn_weights`).
enum class AttnWeights {
  Averaged,  ///< mean over heads: weights [batch, 1, queries, keys]
  PerHead,   ///< weights [batch, heads, queries, keys]
};

template <class Scalar>
struct AttnOutput {
  Output<Scalar> output;    ///< [batch, queries, embed_dim]
  Tensor4<Scalar> weights;  ///< [batch, 1 or heads, queries, keys]
};

/// Multi-head attention with PyTorch's parameters, state-dict names and eval-mode semantics:
///   q = query W_qᵀ + b_q, k = key W_kᵀ + b_k, v = value W_vᵀ + b_v, split into `num_heads` heads of
///   width head_dim = embed_dim / num_heads; per head softmax(q kᵀ / sqrt(head_dim) + mask) v;
///   heads concatenated; out_proj. Dropout is not applied (eval mode).
/// State dict: `in_proj_weight` [3E, E] (rows W_q; W_k; W_v) and `in_proj_bias` [3E] when
/// kdim = vdim = E, else `q_proj_weight` [E, E], `k_proj_weight` [E, kdim], `v_proj_weight` [E, vdim]
/// (and `in_proj_bias` [3E]); `out_proj.weight` [E, E], `out_proj.bias` [E]. With bias = false no bias
/// tensor exists. The c2f multi-head article's C2FMultiHeadAttention names (`qkv_proj.weight`,
/// `qkv_proj.bias`) load too.
/// Options::causal: query i attends only to keys j <= i (top-left aligned, as AttnMask::causal()),
/// combined with any masks given to forward().
/// Training: forward_train(x, masks, step) or forward_train(query, key, value, masks, step), then
/// backward(saved, dy); Options::dropout drops attention probabilities in forward_train (docs/training.md).
/// forward() is const: one module may serve several threads at once.
template <class Scalar>
class MultiHeadAttention : public detail::DecodingLayerBase<MultiHeadAttention<Scalar>, Scalar> {
 public:
  /// causal: query i attends only to keys j <= i.
  class Options : public RuntimeOptions<Options>,
                  public AttnKernelOptions<Options>,
                  public BiasOption<Options>,
                  public CausalOption<Options>,
                  public DropoutOption<Options>,
                  public ComputeOption<Options> {
    /// Key features; 0 = embed_dim.
    C2F_ARG(Index, kdim) = 0;
    /// Value features; 0 = embed_dim.
    C2F_ARG(Index, vdim) = 0;
    /// Every output row's bits independent of the other rows of the call (KernelOptions::rows_independent:
    /// the packed micro-kernel for every product and every row count; holds with the Streaming kernel and a
    /// key_block that is a multiple of 32). CoarseAttention sets it, so that c2f::dist can shard the coarse
    /// stage's queries; it costs the packing of the weights on calls of few rows.
    C2F_ARG(bool, rows_independent) = false;
  };

  /// attn_mask [Lq, Lk] or [n, Lq, Lk] (n = 1, B or B·H), key_padding_mask [B, Lk].
  C2F_LAYER_TRAITS("MultiHeadAttention", MaskFields::AttnMask | MaskFields::KeyPaddingMask);

  MultiHeadAttention(Index embed_dim, Index num_heads, Options options = Options())
      : shape_(detail::checked_heads<Scalar>("MultiHeadAttention", embed_dim, num_heads, 1, 4)),
        kdim_(input_dim("kdim", options.kdim(), embed_dim)),
        vdim_(input_dim("vdim", options.vdim(), embed_dim)),
        options_(options),
        out_proj_(embed_dim, embed_dim, out_proj_options(options), detail::NoInit{}) {
    detail::check_scalar<Scalar>();
    kernels::impl::check_dropout("MultiHeadAttention", options.dropout());
    reset_parameters(options.seed());
  }

  Index embed_dim() const { return shape_.embed_dim; }
  Index num_heads() const { return shape_.num_heads; }
  Index head_dim() const { return shape_.head_dim(); }
  Index kdim() const { return kdim_; }
  Index vdim() const { return vdim_; }
  bool causal() const { return options_.causal(); }
  /// True when the q, k and v weights are stored as PyTorch's one `in_proj_weight`.
  bool packed_in_proj() const { return kdim_ == embed_dim() && vdim_ == embed_dim(); }
  const Options& options() const { return options_; }
  void set_num_threads(int n) {
    options_.num_threads(n);
    out_proj_.set_num_threads(n);
  }
  void set_kernel(AttnKernel kernel) { options_.kernel(kernel); }

  const RowMatrix<Scalar>& q_weight() const { return w_[0]; }
  const RowMatrix<Scalar>& k_weight() const { return w_[1]; }
  const RowMatrix<Scalar>& v_weight() const { return w_[2]; }
  const Linear<Scalar>& out_proj() const { return out_proj_; }

  /// PyTorch's initialisation distributions (Xavier-uniform in-projection, zero biases, Linear's
  /// default for out_proj.weight), drawn deterministically from `seed`.
  void reset_parameters(std::uint64_t seed) {
    detail::Rng rng(seed);
    w_stamp_ = detail::fresh_parameters_id();
    const Index in_dims[3] = {embed_dim(), kdim_, vdim_};
    if (packed_in_proj()) {
      RowMatrix<Scalar> packed(3 * embed_dim(), embed_dim());
      detail::xavier_uniform(packed, rng);
      for (int i = 0; i < 3; ++i) w_[i] = packed.middleRows(i * embed_dim(), embed_dim());
    } else {
      for (int i = 0; i < 3; ++i) {
        w_[i].resize(embed_dim(), in_dims[i]);
        detail::xavier_uniform(w_[i], rng);
      }
    }
    b_ = Vector<Scalar>::Zero(options_.bias() ? 3 * embed_dim() : 0);
    detail::linear_default_uniform(out_proj_.weight(), rng);
    out_proj_.bias().setZero();
  }

  /// Reads this module's tensors under `name` (a prefix ending in '.' or empty) from a loader shared
  /// with an enclosing module.
  void load(detail::StrictLoader& loader, const std::string& name) {
    const Index e = embed_dim();
    w_stamp_ = detail::fresh_parameters_id();
    if (packed_in_proj()) {
      // PyTorch's name, or the C2FMultiHeadAttention module's `qkv_proj` Linear (same [3E, E] layout).
      const bool seed_names = !loader.has(name + "in_proj_weight") && loader.has(name + "qkv_proj.weight");
      const std::string w_key = name + (seed_names ? "qkv_proj.weight" : "in_proj_weight");
      const std::string b_key = name + (seed_names ? "qkv_proj.bias" : "in_proj_bias");
      RowMatrix<Scalar> packed;
      loader.read(w_key, {3 * e, e}, packed);
      for (int i = 0; i < 3; ++i) w_[i] = packed.middleRows(i * e, e);
      if (options_.bias()) loader.read(b_key, {3 * e}, b_);
    } else {
      const char* names[3] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
      const Index in_dims[3] = {embed_dim(), kdim_, vdim_};
      for (int i = 0; i < 3; ++i) loader.read(name + names[i], {e, in_dims[i]}, w_[i]);
      if (options_.bias()) loader.read(name + "in_proj_bias", {3 * e}, b_);
    }
    out_proj_.load(loader, name + "out_proj.");
  }

  /// Writes this module's tensors under `name`; `qkv_proj_names` writes the packed projection as
  /// `qkv_proj.weight` / `qkv_proj.bias` (the coarse-to-fine modules' names) instead of
  /// `in_proj_weight` / `in_proj_bias`.
  void save(StateDict& sd, const std::string& name, bool qkv_proj_names = false) const {
    const Index e = embed_dim();
    if (packed_in_proj()) {
      RowMatrix<Scalar> packed(3 * e, e);
      for (int i = 0; i < 3; ++i) packed.middleRows(i * e, e) = w_[i];
      detail::store(sd, name + (qkv_proj_names ? "qkv_proj.weight" : "in_proj_weight"), packed, {3 * e, e});
      if (options_.bias()) detail::store(sd, name + (qkv_proj_names ? "qkv_proj.bias" : "in_proj_bias"), b_, {3 * e});
    } else {
      detail::store(sd, name + "q_proj_weight", w_[0], {e, embed_dim()});
      detail::store(sd, name + "k_proj_weight", w_[1], {e, kdim_});
      detail::store(sd, name + "v_proj_weight", w_[2], {e, vdim_});
      if (options_.bias()) detail::store(sd, name + "in_proj_bias", b_, {3 * e});
    }
    out_proj_.save(sd, name + "out_proj.");
  }

  /// Self-attention, forward(x, masks) and forward_into(x, out, masks) (detail::LayerBase): forward(x, x, x,
  /// masks), x [B, L, E] → [B, L, E].
  using detail::LayerBase<MultiHeadAttention, Scalar>::forward;
  using detail::LayerBase<MultiHeadAttention, Scalar>::forward_into;
  std::array<Index, 3> output_shape(const ConstTensor3Ref<Scalar>& x) const {
    check_inputs(x, x, x);
    return {x.batch(), x.seq(), embed_dim()};
  }

  /// query [B, Lq, E], key [B, Lk, kdim], value [B, Lk, vdim] → [B, Lq, E]. Masks: attn_mask
  /// [Lq, Lk] or [n, Lq, Lk] (n = 1, B or B·H), key_padding_mask [B, Lk].
  Output<Scalar> forward(ConstTensor3Ref<Scalar> query, ConstTensor3Ref<Scalar> key, ConstTensor3Ref<Scalar> value,
                         const Masks<Scalar>& masks = {}) const {
    return detail::with_layer_name(type_name, [&] {
      check_inputs(query, key, value);
      return detail::fresh_output<Scalar>(
          type_name, {query.batch(), query.seq(), embed_dim()}, options_.num_threads(),
          [&](RowMatrixRef<Scalar> out) { run(query, key, value, masks, out, nullptr); });
    });
  }
  /// forward(query, key, value, masks) into caller memory: out [B·Lq, E] (overwritten).
  void forward_into(ConstTensor3Ref<Scalar> query, ConstTensor3Ref<Scalar> key, ConstTensor3Ref<Scalar> value,
                    RowMatrixRef<Scalar> out, const Masks<Scalar>& masks = {}) const {
    detail::with_layer_name(type_name, [&] { run(query, key, value, masks, out, nullptr); });
  }

  /// Training. What forward_train() keeps for backward(): the inputs, their projections, the heads' output
  /// and each attention row's log-sum-exp, the masks and the dropout's key — O((Lq + Lk)·E) values, no
  /// [Lq, Lk] term.
  struct Saved : detail::SavedBase {
    detail::ScratchRowMatrix<Scalar> query, key, value;  ///< the inputs' rows; self-attention: query only
    detail::ScratchRowMatrix<Scalar> q, k, v, attn;      ///< projections [B·L, E] and the heads' output [B·Lq, E]
    detail::ScratchRowMatrix<Scalar> lse;                ///< [B·H, Lq]
    Masks<Scalar> masks;
    kernels::AttnDropout dropout;
    Index batch = 0, lq = 0, lk = 0;
    bool self_attention = true;
  };
  /// Self-attention: forward_train(x, masks, step) and backward(saved, dy) (detail::LayerBase).
  using detail::LayerBase<MultiHeadAttention, Scalar>::forward_train;
  using detail::LayerBase<MultiHeadAttention, Scalar>::backward;
  /// Cross-attention in train mode: forward(query, key, value, masks) and what backward() needs; its
  /// Grads hold dL/dquery in `input` and dL/dkey, dL/dvalue in `key`, `value`.
  TrainOutput<Scalar, Saved> forward_train(ConstTensor3Ref<Scalar> query, ConstTensor3Ref<Scalar> key,
                                           ConstTensor3Ref<Scalar> value, const Masks<Scalar>& masks = {},
                                           std::uint64_t step = 0) const {
    return detail::with_layer_name(type_name, [&] {
      check_inputs(query, key, value);
      return detail::train_output<Scalar, Saved>(
          *this, {query.batch(), query.seq(), embed_dim()},
          [&](RowMatrixRef<Scalar> out, Saved& saved) { compute_train(query, key, value, out, masks, step, saved); });
    });
  }

  /// Like forward(), and also returns the attention weights (PyTorch's need_weights=True). This
  /// materialises [B, H, Lq, Lk] and uses the naive kernel.
  AttnOutput<Scalar> forward_with_weights(ConstTensor3Ref<Scalar> query, ConstTensor3Ref<Scalar> key,
                                          ConstTensor3Ref<Scalar> value, const Masks<Scalar>& masks = {},
                                          AttnWeights mode = AttnWeights::Averaged) const {
    return detail::with_layer_name(type_name, [&] {
      check_inputs(query, key, value);
      detail::check_buffer_of<Scalar>("MultiHeadAttention: the attention weights",
                                      {query.batch(), num_heads(), query.seq(), key.seq()});
      AttnOutput<Scalar> result;
      WeightsRequest request{mode, &result.weights};
      result.output =
          detail::fresh_output<Scalar>(type_name, {query.batch(), query.seq(), embed_dim()}, options_.num_threads(),
                                       [&](RowMatrixRef<Scalar> out) { run(query, key, value, masks, out, &request); });
      return result;
    });
  }

  /// The in-projection alone: qp [B·Lq, E] = query W_qᵀ + b_q, kp [B·Lk, E], vp [B·Lk, E] (head h is
  /// columns [h·head_dim, (h+1)·head_dim)). For layers that run other attention on these weights.
  void project(const ConstTensor3Ref<Scalar>& query, const ConstTensor3Ref<Scalar>& key,
               const ConstTensor3Ref<Scalar>& value, RowMatrix<Scalar>& qp, RowMatrix<Scalar>& kp,
               RowMatrix<Scalar>& vp) const {
    check_inputs(query, key, value);
    qp.resize(query.batch() * query.seq(), embed_dim());
    kp.resize(key.batch() * key.seq(), embed_dim());
    vp.resize(value.batch() * value.seq(), embed_dim());
    detail::prefer_huge_pages(qp);
    detail::prefer_huge_pages(kp);
    detail::prefer_huge_pages(vp);
    project_into(query, key, value, qp, kp, vp);
  }

  /// project() into the caller's qp [B·Lq, E], kp and vp [B·Lk, E] (e.g. scratch memory; a wrong shape is
  /// refused).
  void project_into(const ConstTensor3Ref<Scalar>& query, const ConstTensor3Ref<Scalar>& key,
                    const ConstTensor3Ref<Scalar>& value, RowMatrixRef<Scalar> qp, RowMatrixRef<Scalar> kp,
                    RowMatrixRef<Scalar> vp) const {
    check_inputs(query, key, value);
    const Index e = embed_dim();
    const kernels::KernelOptions threads = kernel_options();
    const Scalar* bias = options_.bias() ? b_.data() : nullptr;
    kernels::linear_cached<Scalar>(query.rows(), w_[0], bias, qp, threads, packed_, 0, w_stamp_);
    kernels::linear_cached<Scalar>(key.rows(), w_[1], bias ? bias + e : nullptr, kp, threads, packed_, 1, w_stamp_);
    kernels::linear_cached<Scalar>(value.rows(), w_[2], bias ? bias + 2 * e : nullptr, vp, threads, packed_, 2,
                                   w_stamp_);
  }

  /// Incremental decoding state of a causal layer (new_decode_state(), decode(), prefill(): see
  /// detail::Decoder): the projected keys and values of every token so far.
  template <class Cache = Scalar>
  class DecodeStateOf : public detail::DecodeStateBase<Cache> {
   public:
    /// Bytes the state holds.
    std::size_t memory_bytes() const { return this->cache_.memory_bytes(); }

   private:
    friend class MultiHeadAttention;
    using detail::DecodeStateBase<Cache>::DecodeStateBase;
  };
  using DecodeState = DecodeStateOf<Scalar>;

  /// The self-attention in-projection for decoding: kp, vp [B·n, E] of every token of x [B, n, E], and
  /// qp [B·outputs, E] of the last `outputs` tokens of each sequence.
  void project_last(const ConstTensor3Ref<Scalar>& x, Index outputs, RowMatrix<Scalar>& qp, RowMatrix<Scalar>& kp,
                    RowMatrix<Scalar>& vp) const {
    check_inputs(x, x, x);
    const Index batch = x.batch(), n = x.seq(), e = embed_dim();
    if (outputs < 0 || outputs > n) detail::fail("MultiHeadAttention: outputs must lie in [0, ", n, "], got ", outputs);
    const Scalar* bias = options_.bias() ? b_.data() : nullptr;
    qp.resize(batch * outputs, e);
    kp.resize(batch * n, e);
    vp.resize(batch * n, e);
    const kernels::KernelOptions threads = kernel_options();
    kernels::linear_cached<Scalar>(x.rows(), w_[1], bias ? bias + e : nullptr, kp, threads, packed_, 1, w_stamp_);
    kernels::linear_cached<Scalar>(x.rows(), w_[2], bias ? bias + 2 * e : nullptr, vp, threads, packed_, 2, w_stamp_);
    for (Index b = 0; b < batch; ++b) {
      kernels::linear_cached<Scalar>(x.rows().middleRows(b * n + n - outputs, outputs), w_[0], bias,
                                     qp.middleRows(b * outputs, outputs), threads, packed_, 0, w_stamp_);
    }
  }

  /// Bytes of temporary memory one forward_into() (or forward() without weights) holds at its peak,
  /// besides the output and Eigen's GEMM blocking buffers (portable builds; on the heap above 128 KiB, E ≥
  /// 256): the projected q, k, v and the heads' output, and the largest of what each step adds — a packed
  /// projection weight (Eigen's product keeps none; the micro-kernel and bfloat16 paths keep theirs between
  /// calls, not counted here), the attention kernel's shared and per-worker scratch —
  /// linear in the sequence lengths.
  std::size_t workspace_bytes(Index batch, Index lq, Index lk) const {
    const Index e = embed_dim();
    const std::size_t proj = sizeof(Scalar) * static_cast<std::size_t>(e * batch * (2 * lq + 2 * lk));
    const bool ri = options_.rows_independent();
    const Compute c = options_.compute();
    const int t = options_.num_threads();
    const std::size_t packed_weights =
        std::max({kernels::matmul_rows_workspace_bytes<Scalar>(batch * lq, e, e, ri, c, t, true),
                  kernels::matmul_rows_workspace_bytes<Scalar>(batch * lk, kdim_, e, ri, c, t, true),
                  kernels::matmul_rows_workspace_bytes<Scalar>(batch * lk, vdim_, e, ri, c, t, true),
                  out_proj_.rows_workspace_bytes(batch * lq, ri)});
    std::size_t attention;
    if (options_.kernel() == AttnKernel::Naive) {
      attention = sizeof(Scalar) * static_cast<std::size_t>(lq * lk) * static_cast<std::size_t>(threads_for(batch));
    } else {
      attention = kernels::sdpa_streaming_workspace_bytes<Scalar>(kernel_options(), head_dim(), head_dim(), lq, lk) *
                      static_cast<std::size_t>(threads_for(batch * num_heads() * lq)) +
                  kernels::sdpa_streaming_shared_bytes<Scalar>(kernel_options(), batch * num_heads(), head_dim(),
                                                               head_dim(), lq, lk);
    }
    // A packed weight the scratch cache keeps after the in-projection stays allocated during the attention.
    return proj + std::max(packed_weights, attention + detail::scratch_kept_bytes(packed_weights));
  }
  /// Self-attention: workspace_bytes(batch, seq, seq).
  std::size_t workspace_bytes(Index batch, Index seq) const { return workspace_bytes(batch, seq, seq); }

 private:
  struct WeightsRequest {
    AttnWeights mode;
    Tensor4<Scalar>* weights;
  };

  static Index input_dim(const char* what, Index given, Index embed_dim) {
    if (given < 0) detail::fail("MultiHeadAttention: ", what, " must be >= 0 (0 = embed_dim), got ", given);
    if (given > 0) detail::check_buffer_of<Scalar>("MultiHeadAttention: a key or value projection", {embed_dim, given});
    return given > 0 ? given : embed_dim;
  }
  static typename Linear<Scalar>::Options out_proj_options(const Options& o) {
    detail::check_compute_option<Scalar>("MultiHeadAttention", o.compute());  // before out_proj_ refuses it as "Linear"
    return typename Linear<Scalar>::Options().bias(o.bias()).num_threads(o.num_threads()).compute(o.compute());
  }
  kernels::KernelOptions kernel_options() const {
    return detail::kernel_options(options_).rows_independent(options_.rows_independent());
  }
  int threads_for(Index tasks) const { return detail::resolve_threads(options_.num_threads(), tasks); }

  friend class detail::LayerBase<MultiHeadAttention, Scalar>;
  void compute(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks) const {
    run(x, x, x, masks, out, nullptr);
  }

  friend struct detail::TrainAccess;
  /// SparseC2FAttention runs other attention on these weights: its backward writes their gradients.
  friend class SparseC2FAttention<Scalar>;
  void compute_train(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                     std::uint64_t step, Saved& saved) const {
    train(x, x, x, out, masks, step, saved, true);
  }
  void compute_train(const ConstTensor3Ref<Scalar>& query, const ConstTensor3Ref<Scalar>& key,
                     const ConstTensor3Ref<Scalar>& value, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                     std::uint64_t step, Saved& saved) const {
    train(query, key, value, out, masks, step, saved, false);
  }
  /// run() in train mode: the same arithmetic (sdpa_train is sdpa_streaming with the log-sum-exp, and
  /// dropout when it is on), into heap buffers the saved state keeps. Self-attention keeps its input once.
  void train(const ConstTensor3Ref<Scalar>& query, const ConstTensor3Ref<Scalar>& key,
             const ConstTensor3Ref<Scalar>& value, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
             std::uint64_t step, Saved& saved, bool self_attention) const {
    check_inputs(query, key, value);
    const Index batch = query.batch(), lq = query.seq(), lk = key.seq(), e = embed_dim(), h = num_heads();
    detail::check_call(type_name, masks, mask_fields, {batch, lq, e}, out);
    detail::check_train_compute(type_name, options_.compute());
    saved.self_attention = self_attention;
    saved.batch = batch;
    saved.lq = lq;
    saved.lk = lk;
    saved.masks = masks;
    saved.dropout = kernels::AttnDropout{options_.dropout(), options_.seed(), step};
    saved.query = query.rows();
    if (!self_attention) {
      saved.key = key.rows();
      saved.value = value.rows();
    }
    const MaskView<Scalar> mask(saved.masks, batch, h, lq, lk, options_.causal());
    saved.q.resize(batch * lq, e);
    saved.k.resize(batch * lk, e);
    saved.v.resize(batch * lk, e);
    saved.attn.resize(batch * lq, e);
    saved.lse.resize(batch * h, lq);
    project_into(query, key, value, saved.q, saved.k, saved.v);
    const Scalar scale = kernels::default_scale<Scalar>(head_dim());
    const kernels::HeadsView<const Scalar> qv = kernels::heads_view(std::as_const(saved.q), batch, lq, h),
                                           kv = kernels::heads_view(std::as_const(saved.k), batch, lk, h),
                                           vv = kernels::heads_view(std::as_const(saved.v), batch, lk, h);
    const kernels::HeadsView<Scalar> ov = kernels::heads_view(saved.attn, batch, lq, h);
    if (options_.kernel() == AttnKernel::Naive) {
      kernels::sdpa_naive_train<Scalar>(qv, kv, vv, ov, saved.lse, mask, saved.dropout, scale, kernel_options());
    } else {
      kernels::sdpa_train<Scalar>(qv, kv, vv, ov, saved.lse, mask, saved.dropout, scale, kernel_options());
    }
    out_projection(saved.attn, out);
  }
  /// The backward pass: out_proj, the attention (sdpa_backward, or its naive twin with the Naive kernel),
  /// the in-projection; parameter gradients into `grad`'s parameters.
  void compute_backward(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
                        MultiHeadAttention& grad) const {
    const Index batch = saved.batch, lq = saved.lq, lk = saved.lk, e = embed_dim(), h = num_heads();
    const kernels::KernelOptions opts = kernel_options();
    const bool bias = options_.bias();
    // The temporaries in reused scratch memory (detail/scratch.hpp), as the forward's.
    detail::ScratchRowMatrix<Scalar> dattn(batch * lq, e);
    kernels::linear_backward<Scalar>(saved.attn, out_proj_.weight(), dy, dattn, grad.out_proj_.weight(),
                                     bias ? grad.out_proj_.bias().data() : nullptr, opts);
    detail::ScratchRowMatrix<Scalar> dq(batch * lq, e), dk(batch * lk, e), dv(batch * lk, e);
    {
      const MaskView<Scalar> mask(saved.masks, batch, h, lq, lk, options_.causal());
      const Scalar scale = kernels::default_scale<Scalar>(head_dim());
      const kernels::HeadsView<const Scalar> qv = kernels::heads_view(saved.q, batch, lq, h),
                                             kv = kernels::heads_view(saved.k, batch, lk, h),
                                             vv = kernels::heads_view(saved.v, batch, lk, h),
                                             gv = kernels::heads_view(std::as_const(dattn), batch, lq, h);
      const kernels::HeadsView<Scalar> dqv = kernels::heads_view(dq, batch, lq, h),
                                       dkv = kernels::heads_view(dk, batch, lk, h),
                                       dvv = kernels::heads_view(dv, batch, lk, h);
      if (options_.kernel() == AttnKernel::Naive) {
        kernels::sdpa_backward_naive<Scalar>(qv, kv, vv, gv, dqv, dkv, dvv, mask, saved.dropout, scale, opts);
      } else {
        kernels::sdpa_backward<Scalar>(qv, kv, vv, kernels::heads_view(saved.attn, batch, lq, h), saved.lse, gv, dqv,
                                       dkv, dvv, mask, saved.dropout, scale, opts);
      }
    }
    dattn = detail::ScratchRowMatrix<Scalar>();  // its block back to the cache
    // The in-projection: input gradient i of query, key, value (self-attention: their sum).
    Scalar* db = bias ? grad.b_.data() : nullptr;
    using Rows = detail::ScratchRowMatrix<Scalar>;
    const Rows* inputs[3] = {&saved.query, saved.self_attention ? &saved.query : &saved.key,
                             saved.self_attention ? &saved.query : &saved.value};
    const Rows* dproj[3] = {&dq, &dk, &dv};
    const Index lengths[3] = {lq, lk, lk};
    Tensor3<Scalar>* targets[3] = {&g.input, &g.key, &g.value};
    Rows part;
    for (int i = 0; i < 3; ++i) {
      const Index rows = batch * lengths[i], cols = inputs[i]->cols();
      Scalar* bias_grad = db != nullptr ? db + i * e : nullptr;
      if (saved.self_attention && i > 0) {
        part.resize(rows, cols);
        kernels::linear_backward<Scalar>(*inputs[i], w_[i], *dproj[i], part, grad.w_[i], bias_grad, opts);
        Eigen::Map<RowMatrix<Scalar>>(g.input.data(), rows, cols) += part;
        continue;
      }
      *targets[i] = Tensor3<Scalar>(batch, lengths[i], cols);
      kernels::linear_backward<Scalar>(*inputs[i], w_[i], *dproj[i],
                                       Eigen::Map<RowMatrix<Scalar>>(targets[i]->data(), rows, cols), grad.w_[i],
                                       bias_grad, opts);
    }
  }
  /// out = attn W_oᵀ + b_o, row-independent when the options ask (CoarseAttention's).
  void out_projection(const ConstRowMatrixRef<Scalar>& attn, RowMatrixRef<Scalar> out) const {
    if (options_.rows_independent()) {
      out_proj_.forward_rows_independent(attn, out);
    } else {
      out_proj_.forward_rows(attn, out);
    }
  }

  friend class detail::Decoder<MultiHeadAttention, Scalar>;
  template <class Cache>
  DecodeStateOf<Cache> make_decode_state(Index batch) const {
    return DecodeStateOf<Cache>(batch, embed_dim(), decode_config());
  }
  /// What shapes a decoding state: a state made by another configuration is refused.
  std::string decode_config() const {
    return "MultiHeadAttention(embed_dim=" + std::to_string(embed_dim()) +
           ", num_heads=" + std::to_string(num_heads()) + ")";
  }

  /// decode() steps of at most this many new tokens (and every prefill()) attend with sdpa_split_keys.
  static constexpr Index kSplitKeysMaxQueries = 16;

  /// decode()/prefill(): appends the n tokens of x to the state and returns the outputs of the last
  /// `outputs` of them.
  template <class Cache>
  Output<Scalar> run_decode(const ConstTensor3Ref<Scalar>& x, DecodeStateOf<Cache>& state, Index outputs) const {
    detail::check_decode("MultiHeadAttention", options_.causal(), x, state.batch(), embed_dim());
    if (kdim_ != embed_dim() || vdim_ != embed_dim()) {
      detail::fail("MultiHeadAttention::decode is self-attention: kdim and vdim must equal embed_dim");
    }
    const Index batch = x.batch(), n = x.seq(), e = embed_dim(), h = num_heads();
    RowMatrix<Scalar> q, k, v;
    project_last(x, outputs, q, k, v);
    state.cache_.append(ConstRowMatrixRef<Scalar>(k), ConstRowMatrixRef<Scalar>(v), n);
    const Index total = state.length();
    // Query i sits at position total − outputs + i and sees keys j ≤ that position.
    const AttnMask<Scalar> causal = AttnMask<Scalar>::causal(total - outputs);
    const MaskView<Scalar> mask(causal, KeyPaddingMask<Scalar>(), batch, h, outputs, total);
    RowMatrix<Scalar> attn(batch * outputs, e);
    // A few new queries over a long cache: split the keys (one pass over the cache for all heads);
    // many: the query-blocked streaming kernel.
    const auto attend = outputs <= kSplitKeysMaxQueries ? &kernels::sdpa_split_keys<Scalar, Cache>
                                                        : &kernels::sdpa_streaming<Scalar, Cache>;
    attend(kernels::heads_view(std::as_const(q), batch, outputs, h), state.cache_.key_heads(h),
           state.cache_.value_heads(h), kernels::heads_view(attn, batch, outputs, h), mask,
           kernels::default_scale<Scalar>(head_dim()), kernel_options());
    return detail::fresh_output<Scalar>(type_name, {batch, outputs, e}, options_.num_threads(),
                                        [&](RowMatrixRef<Scalar> out) { out_proj_.forward_rows(attn, out); });
  }

  void check_inputs(const ConstTensor3Ref<Scalar>& q, const ConstTensor3Ref<Scalar>& k,
                    const ConstTensor3Ref<Scalar>& v) const {
    using detail::shape_string;
    detail::check_features(q, embed_dim(), "MultiHeadAttention", "query", "embed_dim");
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

  /// The forward pass into `out` [B·Lq, E]; with a weights request, on the naive kernel, also the
  /// attention weights.
  void run(const ConstTensor3Ref<Scalar>& query, const ConstTensor3Ref<Scalar>& key,
           const ConstTensor3Ref<Scalar>& value, const Masks<Scalar>& masks, RowMatrixRef<Scalar> out,
           const WeightsRequest* request) const {
    check_inputs(query, key, value);
    const Index batch = query.batch(), lq = query.seq(), lk = key.seq(), e = embed_dim(), h = num_heads();
    detail::check_call(type_name, masks, mask_fields, {batch, lq, e}, out);
    const MaskView<Scalar> mask(masks, batch, h, lq, lk, options_.causal());
    // The temporaries live in reused scratch memory (detail/scratch.hpp): no fresh pages per call.
    detail::ScratchRowMatrix<Scalar> qp(batch * lq, e), kp(batch * lk, e), vp(batch * lk, e), attn(batch * lq, e);
    project_into(query, key, value, qp, kp, vp);
    const Scalar scale = kernels::default_scale<Scalar>(head_dim());

    const kernels::HeadsView<const Scalar> qv = kernels::heads_view(qp, batch, lq, h),
                                           kv = kernels::heads_view(kp, batch, lk, h),
                                           vv = kernels::heads_view(vp, batch, lk, h);
    const kernels::HeadsView<Scalar> ov = kernels::heads_view(attn, batch, lq, h);
    if (request != nullptr) {
      Tensor4<Scalar> per_head(batch, h, lq, lk);
      kernels::sdpa_naive<Scalar>(qv, kv, vv, ov, mask, scale, kernel_options(), per_head.data());
      if (request->mode == AttnWeights::PerHead) {
        *request->weights = std::move(per_head);
      } else {
        const Eigen::array<Index, 4> dims{batch, 1, lq, lk};
        *request->weights = per_head.mean(Eigen::array<Index, 1>{1}).reshape(dims);
      }
    } else if (options_.kernel() == AttnKernel::Naive) {
      kernels::sdpa_naive<Scalar>(qv, kv, vv, ov, mask, scale, kernel_options());
    } else {
      kernels::sdpa_streaming<Scalar>(qv, kv, vv, ov, mask, scale, kernel_options());
    }
    out_projection(attn, out);
  }

  detail::HeadShape shape_;  // first: checked before out_proj_ is built
  Index kdim_;
  Index vdim_;
  Options options_;
  RowMatrix<Scalar> w_[3];  ///< W_q [E, E], W_k [E, kdim], W_v [E, vdim]
  Vector<Scalar> b_;        ///< [b_q; b_k; b_v], empty without bias
  Linear<Scalar> out_proj_;
  std::uint64_t w_stamp_ = detail::fresh_parameters_id();  ///< new whenever w_ may change (reset_parameters, load)
  kernels::WeightCache<Scalar> packed_;                    ///< W_q, W_k, W_v transposed, packed
};

}  // namespace c2f
