// c2f layers — HMHA, the hierarchical multi-head attention of the C3K2/HMHA article, with a precise
// definition (the article's code does not run).
//
// q, k, v = three C3K2Projections (q_proj, k_proj, v_proj) of x [B, L, E], split into H heads of
// width dh = E / H (E = embed_dim, H = num_heads). Windows: m = ceil(L / W); window j holds positions [jW, min((j+1)W,
// L)). Per head, with scores q·k / sqrt(dh):
//   level 1, local:   o1_i = softmax_t(q_i·k_t) v_t over t in the window of i;
//   level 2, cross:   q̄_j, k̄_j, v̄_j = means over the real tokens of window j;
//                     c_j = Σ_j' softmax_j'(q̄_j·k̄_j') v̄_j' over all m windows; o2_i = c_(window of i);
//   level 3, global:  S(i) = {i} ∪ {i − 2^p, i + 2^p : p = 0, 1, 2, … inside [0, L)};
//                     o3_i = softmax_t(q_i·k_t) v_t over t ∈ S(i);
//   y = out_proj(concat_heads(o1 + o2 + o3)), out_proj = Linear(E, E).
// Options: each level can be switched off (it then contributes 0). `causal` (a construction option)
// makes every output depend only on x[0 … i]:
//   projections: each C3K2 conv3 pads 2 on the left and 0 on the right (reads x[i−2], x[i−1], x[i]);
//   level 1: keys t ≤ i of i's window;
//   level 2: token i attends with its own q_i to the summaries (k̄_j, v̄_j) of the complete windows
//            j < window(i), one softmax (NSA's compressed branch); window 0 gets 0;
//   level 3: S(i) = {i} ∪ {i − 2^p}.
// Cost O(L·W·E + (L/W)²·E + L·log L·E) (causal level 2: O(L·(L/W)·E)); no L × L buffer anywhere.
// Training (forward_train, backward: docs/training.md): the levels' backward kernels recompute their
// probabilities from the saved q and k; memory stays O(L·E).
// State dict: q_proj.conv3.*, q_proj.conv2.*, k_proj.*, v_proj.*, out_proj.weight, out_proj.bias.
#pragma once

#include "c2f/detail/scratch.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/hierarchical.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/kernels/sdpa_backward.hpp"
#include "c2f/layers/conv1d.hpp"
#include "c2f/layers/linear.hpp"
#include "c2f/layers/support/decoding.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/mask_view.hpp"
#include "c2f/options.hpp"

#include <algorithm>
#include <array>
#include <string>

namespace c2f {

/// Which HMHA levels are on (all by default).
struct HMHALevels {
  bool local = true;   ///< level 1: attention inside each window
  bool cross = true;   ///< level 2: attention between window means
  bool global = true;  ///< level 3: log-spaced sparse attention
};

template <class Scalar>
class HMHA : public detail::DecodingLayerBase<HMHA<Scalar>, Scalar> {
 public:
  /// seed: PyTorch's Conv1d / Linear default init.
  /// causal: every output depends only on x[0 … i] (see the file comment).
  class Options : public RuntimeOptions<Options>, public CausalOption<Options>, public ComputeOption<Options> {
    C2F_ARG(HMHALevels, levels) = HMHALevels{};
  };

  C2F_LAYER_TRAITS("HMHA", MaskFields::None);  // takes no masks

  HMHA(Index embed_dim, Index num_heads, Index window, Options options = Options())
      : shape_(detail::checked_heads<Scalar>("HMHA", embed_dim, num_heads, /*min_embed=*/2, 7)),
        window_(detail::checked_positive("HMHA", "window", window)),
        options_((detail::check_compute_option<Scalar>("HMHA", options.compute()), options)),
        q_proj_(embed_dim, num_heads, projection_options(options, 0)),
        k_proj_(embed_dim, num_heads, projection_options(options, 2)),
        v_proj_(embed_dim, num_heads, projection_options(options, 4)),
        out_proj_(embed_dim, embed_dim, detail::inner_options<typename Linear<Scalar>::Options>(options, 6)) {
    detail::check_scalar<Scalar>();
  }

  Index embed_dim() const { return shape_.embed_dim; }
  Index num_heads() const { return shape_.num_heads; }
  Index head_dim() const { return shape_.embed_dim / shape_.num_heads; }
  Index window() const { return window_; }
  const Options& options() const { return options_; }
  bool causal() const { return options_.causal(); }
  void set_levels(HMHALevels levels) { options_.levels(levels); }
  void set_num_threads(int n) { this->set_num_threads_of(options_, n); }
  const C3K2Projection<Scalar>& q_proj() const { return q_proj_; }
  const C3K2Projection<Scalar>& k_proj() const { return k_proj_; }
  const C3K2Projection<Scalar>& v_proj() const { return v_proj_; }
  const Linear<Scalar>& out_proj() const { return out_proj_; }

  template <class Self, class Fn>
  static void children(Self& self, Fn&& fn) {
    fn("q_proj.", self.q_proj_);
    fn("k_proj.", self.k_proj_);
    fn("v_proj.", self.v_proj_);
    fn("out_proj.", self.out_proj_);
  }

  /// Incremental decoding state of a causal HMHA: the last two inputs (for the causal C3K2 convolution),
  /// the keys and values of every token (stored as `Cache`: Scalar, Eigen::half or Eigen::bfloat16) —
  /// level 1 reads the current window's, level 3 the log-spaced ones, and a position stays reachable at
  /// every later power-of-two distance — and the key and value means of every complete window (level 2).
  template <class Cache = Scalar>
  class DecodeStateOf : public detail::DecodeStateBase<Cache> {
   public:
    std::size_t memory_bytes() const {
      return this->cache_.memory_bytes() + windows_.memory_bytes() +
             sizeof(Scalar) * static_cast<std::size_t>(tail_.size());
    }

   private:
    friend class HMHA;
    DecodeStateOf(Index batch, Index embed_dim, Index window, std::string made_by)
        : detail::DecodeStateBase<Cache>(batch, embed_dim, std::move(made_by)),
          windows_(batch, embed_dim, window, /*values=*/true),
          tail_(RowMatrix<Scalar>::Zero(2 * batch, embed_dim)) {}
    detail::ChunkSummaries<Scalar> windows_;
    RowMatrix<Scalar> tail_;  ///< inputs T − 2, T − 1 of batch item b at rows 2b, 2b + 1 (zeros before the start)
  };
  using DecodeState = DecodeStateOf<Scalar>;

  /// forward(x, masks), forward_into(x, out, masks) (detail::LayerBase): x [B, L, E] → [B, L, E].

  /// Bytes of temporary memory one forward_into() holds at its peak: q, k, v and the summed levels
  /// ([B·L, E] each) and the largest level's scratch — level 1 a [window, window] score block per
  /// worker; level 2 the window means (k̄, v̄, and q̄ and the coarse output when not causal) and its
  /// attention's scratch; level 3 a [rows, heads · offsets] score block and a [rows, E] product per
  /// worker (rows = min(64, L)) and the offsets.
  std::size_t workspace_bytes(Index batch, Index seq) const {
    const kernels::ChunkGrid windows{batch, seq, window_};
    const std::size_t s = sizeof(Scalar), e = static_cast<std::size_t>(shape_.embed_dim);
    const std::size_t h = static_cast<std::size_t>(shape_.num_heads), dh = e / h;
    const std::size_t tokens = static_cast<std::size_t>(batch * seq),
                      chunks = static_cast<std::size_t>(windows.chunks());
    const Index m = windows.chunks_per_batch();
    const std::size_t w = static_cast<std::size_t>(std::min(window_, std::max<Index>(seq, 1)));
    const std::size_t workers = static_cast<std::size_t>(detail::resolve_threads(options_.num_threads(), batch * seq));
    const HMHALevels& on = options_.levels();
    const kernels::KernelOptions ko = detail::kernel_options(options_);
    // Compute::BFloat16 (per worker): level 1 the scaled queries, a window's values rounded and the
    // engine's operands of its two products; level 2 (causal) the scaled queries and the operands of its
    // products with the means; level 3 the scaled queries and a key or value block of a row block.
    const bool bf16 = options_.compute() == Compute::BFloat16;
    const Bf16Engine engine = bf16_engine();
    const std::size_t ms = static_cast<std::size_t>(m);
    const Index wi = static_cast<Index>(w), di = static_cast<Index>(dh);
    std::size_t level = 0;
    if (on.local) {
      level = std::max(level, workers * (s * (w * w + (bf16 ? 2 * w * dh : 0)) +
                                         (bf16 ? cpu::bf16_operands_bytes(wi, di, wi, wi, wi, di, engine) : 0)));
    }
    if (on.cross && options_.causal()) {
      level = std::max(
          level, s * 2 * chunks * e + workers * (s * (w * ms + (bf16 ? w * dh : 0)) +
                                                 (bf16 ? cpu::bf16_operands_bytes(wi, di, m, wi, m, di, engine) : 0)));
    } else if (on.cross) {
      level = std::max(
          level, s * 4 * chunks * e + workers * kernels::sdpa_streaming_workspace_bytes<Scalar>(ko, dh, dh, m, m) +
                     kernels::sdpa_streaming_shared_bytes<Scalar>(ko, batch * shape_.num_heads, dh, dh, m, m));
    }
    if (on.global) {
      const std::size_t offsets = kernels::sparse_offsets(seq, options_.causal()).size();
      const std::size_t rows = static_cast<std::size_t>(std::min(kernels::kSparseRowBlock, std::max<Index>(seq, 1)));
      level = std::max(level, s * workers * rows * (h * offsets + e + (bf16 ? 2 * e : 0)) + sizeof(Index) * offsets);
    }
    // + the projections' packed weights (micro-kernel builds), which the scratch cache may keep during the
    // levels: one C3K2Projection's (q, k and v reuse the same blocks) and out_proj's.
    const std::size_t packed = q_proj_.workspace_bytes(batch, seq) + out_proj_.workspace_bytes(batch, seq);
    return s * 4 * tokens * e + level + packed;
  }

  /// The attention part alone on given projections q, k, v [B·L, E]: o += o1 + o2 + o3.
  void attend(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
              const ConstRowMatrixRef<Scalar>& v, Index batch, Index length, RowMatrixRef<Scalar> o) const {
    const kernels::ChunkGrid windows{batch, length, window_};
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    const bool causal = options_.causal();
    const HMHALevels& levels = options_.levels();
    const Scalar scale = kernels::default_scale<Scalar>(head_dim());
    if (levels.local)
      kernels::window_attention_add<Scalar>(q, k, v, windows, shape_.num_heads, o, causal, scale, threads);
    if (levels.cross && windows.chunks() > 0) {
      const Index chunks = windows.chunks();
      RowMatrix<Scalar> km(chunks, shape_.embed_dim), vm(chunks, shape_.embed_dim);
      kernels::chunk_mean<Scalar>(k, windows, km, threads);
      kernels::chunk_mean<Scalar>(v, windows, vm, threads);
      if (causal) {
        kernels::window_summary_attention_add<Scalar>(q, km, vm, windows, shape_.num_heads, o, scale, threads);
      } else {
        RowMatrix<Scalar> qm(chunks, shape_.embed_dim), c(chunks, shape_.embed_dim);
        kernels::chunk_mean<Scalar>(q, windows, qm, threads);
        const Index m = windows.chunks_per_batch(), h = shape_.num_heads;
        kernels::sdpa_streaming<Scalar>(kernels::heads_view(qm, batch, m, h), kernels::heads_view(km, batch, m, h),
                                        kernels::heads_view(vm, batch, m, h), kernels::heads_view(c, batch, m, h),
                                        MaskView<Scalar>(), scale, threads);
        kernels::broadcast_chunks_add<Scalar>(c, windows, o, threads);
      }
    }
    if (levels.global) {
      kernels::sparse_global_attention_add<Scalar>(q, k, v, batch, length, shape_.num_heads, o, causal, scale, threads);
    }
  }

  /// Training. What forward_train() keeps for backward(): the input x, its projections q, k, v and the
  /// summed levels o ([B·L, E] each: 5·E values per token), and the levels that were on. backward()
  /// recomputes each level's probabilities from q and k: no [L, L] or [L, L/W] state.
  struct Saved : detail::SavedBase {
    detail::ScratchRowMatrix<Scalar> x, q, k, v, o;
    Index batch = 0, seq = 0;
    HMHALevels levels;
  };

  /// The backward of attend() for dout = dL/d(o1 + o2 + o3) [B·L, E]: adds the gradients of the `levels`
  /// that are on to dq, dk, dv [B·L, E] — level 1, then 2, then 3 (kernels::window_attention_backward_add;
  /// level 2 through the window means: causal window_summary_attention_backward_add, else sdpa_backward on
  /// the means with chunk_sum of dout; sparse_global_attention_backward_add).
  void attend_backward(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                       const ConstRowMatrixRef<Scalar>& v, const ConstRowMatrixRef<Scalar>& dout, Index batch,
                       Index length, RowMatrixRef<Scalar> dq, RowMatrixRef<Scalar> dk, RowMatrixRef<Scalar> dv,
                       const HMHALevels& levels) const {
    const kernels::ChunkGrid windows{batch, length, window_};
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    const bool causal = options_.causal();
    const Index h = shape_.num_heads, e = shape_.embed_dim;
    const Scalar scale = kernels::default_scale<Scalar>(head_dim());
    if (levels.local)
      kernels::window_attention_backward_add<Scalar>(q, k, v, dout, windows, h, dq, dk, dv, causal, scale, threads);
    if (levels.cross && windows.chunks() > 0) {
      const Index chunks = windows.chunks(), m = windows.chunks_per_batch();
      RowMatrix<Scalar> km(chunks, e), vm(chunks, e), dkm(chunks, e), dvm(chunks, e);
      kernels::chunk_mean<Scalar>(k, windows, km, threads);
      kernels::chunk_mean<Scalar>(v, windows, vm, threads);
      if (causal) {
        dkm.setZero();
        dvm.setZero();
        kernels::window_summary_attention_backward_add<Scalar>(q, km, vm, dout, windows, h, dq, dkm, dvm, scale,
                                                               threads);
      } else {
        // c = attention of the window means (the forward's), its gradient the window sums of dout.
        RowMatrix<Scalar> qm(chunks, e), c(chunks, e), lse(batch * h, m), dc(chunks, e), dqm(chunks, e);
        kernels::chunk_mean<Scalar>(q, windows, qm, threads);
        const kernels::HeadsView<const Scalar> qv = kernels::heads_view(std::as_const(qm), batch, m, h),
                                               kv = kernels::heads_view(std::as_const(km), batch, m, h),
                                               vv = kernels::heads_view(std::as_const(vm), batch, m, h);
        kernels::sdpa_streaming_lse<Scalar>(qv, kv, vv, kernels::heads_view(c, batch, m, h), lse, MaskView<Scalar>(),
                                            scale, threads);
        kernels::chunk_sum<Scalar>(dout, windows, dc, threads);
        kernels::sdpa_backward<Scalar>(qv, kv, vv, kernels::heads_view(std::as_const(c), batch, m, h), lse,
                                       kernels::heads_view(std::as_const(dc), batch, m, h),
                                       kernels::heads_view(dqm, batch, m, h), kernels::heads_view(dkm, batch, m, h),
                                       kernels::heads_view(dvm, batch, m, h), MaskView<Scalar>(),
                                       kernels::AttnDropout(), scale, threads);
        kernels::chunk_mean_backward_add<Scalar>(dqm, windows, dq, threads);
      }
      kernels::chunk_mean_backward_add<Scalar>(dkm, windows, dk, threads);
      kernels::chunk_mean_backward_add<Scalar>(dvm, windows, dv, threads);
    }
    if (levels.global) {
      kernels::sparse_global_attention_backward_add<Scalar>(q, k, v, dout, batch, length, h, dq, dk, dv, causal, scale,
                                                            threads);
    }
  }

 private:
  friend class detail::LayerBase<HMHA, Scalar>;
  void compute(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>&) const {
    const Index rows = x.batch() * x.seq(), e = shape_.embed_dim;
    // The projections live in reused scratch memory (detail/scratch.hpp): no fresh pages per call.
    detail::ScratchRowMatrix<Scalar> q(rows, e), k(rows, e), v(rows, e), o(rows, e);
    run(x, q, k, v, o, out);
  }
  /// The forward into q, k, v, o [B·L, E] (the projections and the summed levels) and out.
  void run(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> q, RowMatrixRef<Scalar> k, RowMatrixRef<Scalar> v,
           RowMatrixRef<Scalar> o, RowMatrixRef<Scalar> out) const {
    const Index batch = x.batch(), length = x.seq();
    q_proj_.forward_rows(x.rows(), batch, length, q);
    k_proj_.forward_rows(x.rows(), batch, length, k);
    v_proj_.forward_rows(x.rows(), batch, length, v);
    o.setZero();
    attend(q, k, v, batch, length, o);
    out_proj_.forward_rows(o, out);
  }

  friend struct detail::TrainAccess;
  /// The forward (run()) into the saved state's buffers.
  void compute_train(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>&, std::uint64_t,
                     Saved& saved) const {
    const Index rows = x.batch() * x.seq(), e = shape_.embed_dim;
    saved.batch = x.batch();
    saved.seq = x.seq();
    saved.levels = options_.levels();
    saved.x = x.rows();
    for (detail::ScratchRowMatrix<Scalar>* m : {&saved.q, &saved.k, &saved.v, &saved.o}) m->resize(rows, e);
    run(x, saved.q, saved.k, saved.v, saved.o, out);
  }
  /// out_proj's backward (kernels::linear_backward), the levels' (attend_backward), then the three
  /// projections' (C3K2Projection::backward_rows), summed into the input gradient.
  void compute_backward(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g, HMHA& grad) const {
    const Index batch = saved.batch, length = saved.seq, rows = batch * length, e = shape_.embed_dim;
    // The temporaries in reused scratch memory (detail/scratch.hpp), as the forward's; each block goes
    // back to the cache once it is read.
    using Rows = detail::ScratchRowMatrix<Scalar>;
    Rows dout(rows, e);
    kernels::linear_backward<Scalar>(saved.o, out_proj_.weight(), dy, dout, grad.out_proj_.weight(),
                                     grad.out_proj_.bias().data(), detail::kernel_options(options_));
    Rows dq(rows, e), dk(rows, e), dv(rows, e);
    for (Rows* m : {&dq, &dk, &dv}) m->setZero();
    attend_backward(saved.q, saved.k, saved.v, dout, batch, length, dq, dk, dv, saved.levels);
    dout = Rows();
    g.input = Tensor3<Scalar>(batch, length, e);
    Eigen::Map<RowMatrix<Scalar>> dx(g.input.data(), rows, e);
    q_proj_.backward_rows(saved.x, batch, length, dq, dx, grad.q_proj_, /*add_dx=*/false);
    dq = Rows();
    k_proj_.backward_rows(saved.x, batch, length, dk, dx, grad.k_proj_, /*add_dx=*/true);
    dk = Rows();
    v_proj_.backward_rows(saved.x, batch, length, dv, dx, grad.v_proj_, /*add_dx=*/true);
  }

  friend class detail::Decoder<HMHA, Scalar>;
  template <class Cache>
  DecodeStateOf<Cache> make_decode_state(Index batch) const {
    return DecodeStateOf<Cache>(batch, shape_.embed_dim, window_, decode_config());
  }
  /// What shapes a decoding state: a state made by another configuration is refused.
  std::string decode_config() const {
    return "HMHA(embed_dim=" + std::to_string(shape_.embed_dim) + ", num_heads=" + std::to_string(shape_.num_heads) +
           ", window=" + std::to_string(window_) + ")";
  }

  template <class Cache>
  Output<Scalar> run_decode(const ConstTensor3Ref<Scalar>& x, DecodeStateOf<Cache>& state, Index outputs) const {
    detail::check_decode("HMHA", options_.causal(), x, state.batch(), shape_.embed_dim);
    const Index batch = x.batch(), n = x.seq(), e = shape_.embed_dim, span = n + 2;
    // Each sequence's new inputs behind its last two: the causal convolutions read x[t − 2 … t].
    RowMatrix<Scalar> in(batch * span, e), in_q(batch * (outputs + 2), e);
    for (Index b = 0; b < batch; ++b) {
      in.middleRows(b * span, 2) = state.tail_.middleRows(2 * b, 2);
      in.middleRows(b * span + 2, n) = x.rows().middleRows(b * n, n);
      in_q.middleRows(b * (outputs + 2), outputs + 2) = in.middleRows(b * span + n - outputs, outputs + 2);
      state.tail_.middleRows(2 * b, 2) = in.middleRows(b * span + n, 2);
    }
    RowMatrix<Scalar> kp(batch * span, e), vp(batch * span, e), qp(batch * (outputs + 2), e);
    k_proj_.forward_rows(in, batch, span, kp);
    v_proj_.forward_rows(in, batch, span, vp);
    q_proj_.forward_rows(in_q, batch, outputs + 2, qp);
    RowMatrix<Scalar> k(batch * n, e), v(batch * n, e), q(batch * outputs, e);
    for (Index b = 0; b < batch; ++b) {  // drop the two context rows
      k.middleRows(b * n, n) = kp.middleRows(b * span + 2, n);
      v.middleRows(b * n, n) = vp.middleRows(b * span + 2, n);
      q.middleRows(b * outputs, outputs) = qp.middleRows(b * (outputs + 2) + 2, outputs);
    }
    state.cache_.append(ConstRowMatrixRef<Scalar>(k), ConstRowMatrixRef<Scalar>(v), n);
    state.windows_.update(state.cache_);
    const Index total = state.length();
    const kernels::ChunkGrid grid{1, total, window_};
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    const HMHALevels& levels = options_.levels();
    const Scalar scale = kernels::default_scale<Scalar>(head_dim());
    RowMatrix<Scalar> o = RowMatrix<Scalar>::Zero(batch * outputs, e);
    for (Index b = 0; b < batch; ++b) {
      const ConstRowMatrixRef<Scalar> qb = q.middleRows(b * outputs, outputs);
      const ConstRowMatrixRef<Cache> kb = state.cache_.keys(b, 0, total), vb = state.cache_.values(b, 0, total);
      RowMatrixRef<Scalar> ob = o.middleRows(b * outputs, outputs);
      if (levels.local)
        kernels::window_attention_add<Scalar, Cache>(qb, kb, vb, grid, shape_.num_heads, ob, true, scale, threads);
      if (levels.cross) {
        kernels::window_summary_attention_add<Scalar>(qb, state.windows_.keys(b), state.windows_.values(b), grid,
                                                      shape_.num_heads, ob, scale, threads);
      }
      if (levels.global) {
        kernels::sparse_global_attention_add<Scalar, Cache>(qb, kb, vb, 1, total, shape_.num_heads, ob, true, scale,
                                                            threads);
      }
    }
    return detail::fresh_output<Scalar>(type_name, {batch, outputs, e}, options_.num_threads(),
                                        [&](RowMatrixRef<Scalar> out) { out_proj_.forward_rows(o, out); });
  }

  static typename C3K2Projection<Scalar>::Options projection_options(const Options& o, std::uint64_t seed_offset) {
    return detail::inner_options<typename C3K2Projection<Scalar>::Options>(o, seed_offset).causal(o.causal());
  }

  detail::HeadShape shape_;  // first: checked before the projections are built
  Index window_;
  Options options_;
  C3K2Projection<Scalar> q_proj_;
  C3K2Projection<Scalar> k_proj_;
  C3K2Projection<Scalar> v_proj_;
  Linear<Scalar> out_proj_;
};

}  // namespace c2f
