// c2f kernels — scaled dot-product attention, softmax(q kᵀ · scale + mask) v, per batch and head.
//
// Two forms with the same contract:
//   sdpa_naive      materialises the [queries, keys] scores of one (batch, head) and can return the
//                   attention weights — the reference, and the path used when weights are wanted;
//   sdpa_streaming  blocked over queries and keys with an online (running-max) softmax, Eigen GEMMs on
//                   the blocks, and O(query_block · key_block) working memory per worker — never a
//                   [queries, keys] buffer.
// Both OVERWRITE `out`, run (batch, head[, query block]) tasks on a caller-chosen number of threads, and
// check their arguments at entry (std::invalid_argument, in every build type). Every task's arithmetic
// depends only on its index, so the output bits do not depend on the thread count.
// A query row with no visible key outputs zeros (and zero weights). A masked key never reaches an
// output, NaN or Inf in its key or value included (c2f/cpu/masked_values.hpp).
//
// For training (docs/training.md): sdpa_train (streaming) and sdpa_naive_train (its twin) also write each
// row's log-sum-exp, which the backward pass (c2f/kernels/sdpa_backward.hpp) needs, and apply dropout to
// the probabilities (AttnDropout); with dropout off their outputs have sdpa_streaming's and sdpa_naive's
// bits.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/cpu/masked_values.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/cpu/score_tile.hpp"
#include "c2f/cpu/small_gemm.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/random.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/mask_view.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace c2f {
namespace kernels {

/// Dropout on the attention probabilities, as training applies it (torch.nn.MultiheadAttention's
/// `dropout` in train mode): probability (b, h, i, j) is kept with probability 1 − p and scaled by
/// 1 / (1 − p), else zeroed. Whether it is kept is a counter-based draw keyed by (seed, step, b·heads + h,
/// i) at counter j (detail::CounterRng): the same bits for any thread count and block size, and the
/// backward pass regenerates the mask instead of storing it. p = 0 (the default) is no dropout.
struct AttnDropout {
  double p = 0;
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  bool active() const { return p > 0; }
};

namespace impl {

/// "<what>: dropout must lie in [0, 1), got p" unless it does.
inline void check_dropout(const char* what, double p) {
  if (!(p >= 0.0 && p < 1.0)) detail::fail(what, ": dropout must lie in [0, 1), got ", p);
}

/// The dropout decisions of one row (b·heads + h, i) of a problem: keep(j) for its keys j.
class DropoutRow {
 public:
  DropoutRow(const kernels::AttnDropout& d, Index bh, Index i)
      : key_(detail::CounterRng::key(d.seed, d.step, static_cast<std::uint64_t>(bh), static_cast<std::uint64_t>(i))),
        threshold_(static_cast<std::uint64_t>(std::ldexp(d.p, 53))) {}
  /// Kept with probability 1 − p: the top 53 bits of draw j against p · 2^53.
  bool keep(Index j) const { return (detail::CounterRng::at(key_, static_cast<std::uint64_t>(j)) >> 11) >= threshold_; }

 private:
  std::uint64_t key_, threshold_;
};

/// Applies dropout to the probabilities p [rows, cols] of rows [i0, i0 + rows) × keys [j0, j0 + cols) of
/// (batch·head) bh: a dropped one becomes 0; the kept ones are scaled by `kept_scale` (1 / (1 − p), or 1
/// when the caller scales later). `keep`, when not null, receives the decisions row-major (1 = kept).
template <class P>
void apply_dropout(const kernels::AttnDropout& d, Index bh, Index i0, Index j0, P&& p,
                   typename std::decay_t<P>::Scalar kept_scale, std::uint8_t* keep = nullptr) {
  for (Index r = 0; r < p.rows(); ++r) {
    const DropoutRow row(d, bh, i0 + r);
    for (Index c = 0; c < p.cols(); ++c) {
      const bool kept = row.keep(j0 + c);
      p(r, c) = kept ? p(r, c) * kept_scale : 0;
      if (keep != nullptr) keep[r * p.cols() + c] = kept ? 1 : 0;
    }
  }
}

/// 1 / (1 − p) in Scalar.
template <class Scalar>
Scalar dropout_scale(const kernels::AttnDropout& d) {
  return static_cast<Scalar>(1.0 / (1.0 - d.p));
}

/// The body of sdpa_naive and sdpa_naive_train: weights, lse ([batch·heads, queries]) and dropout each
/// optional (nullptr).
template <class Scalar>
void sdpa_naive_impl(const char* kernel, const kernels::HeadsView<const Scalar>& q,
                     const kernels::HeadsView<const Scalar>& k, const kernels::HeadsView<const Scalar>& v,
                     const kernels::HeadsView<Scalar>& out, const MaskView<Scalar>& mask, Scalar scale,
                     const kernels::KernelOptions& options, Scalar* weights, RowMatrixRef<Scalar>* lse,
                     const kernels::AttnDropout* dropout) {
  using kernels::HeadsView;
  detail::check_sdpa(kernel, q, k, v, out, mask, scale);
  const Index lq = q.seq, lk = k.seq;
  const bool drop = dropout != nullptr && dropout->active();
  const bool bf16 = cpu::check_compute<Scalar>(kernel, options.compute());
  const double work = detail::attention_work(q.batch * q.heads, lq, lk, q.dim, v.dim);
  detail::parallel_for(q.batch * q.heads, options.num_threads(), work, [&](Index task, int) {
    const Index b = task / q.heads, h = task % q.heads;
    RowMatrix<Scalar> s(lq, lk);
    const typename HeadsView<const Scalar>::Block vb = v.block(b, h, 0, lk);
    RowMatrix<Scalar> vr;  // Compute::BFloat16: the rounded values
    if (bf16) {
      s.noalias() = (q.block(b, h, 0, lq) * scale).unaryExpr(cpu::RoundBf16<Scalar>()) *
                    k.block(b, h, 0, lk).unaryExpr(cpu::RoundBf16<Scalar>()).transpose();
      vr = vb.unaryExpr(cpu::RoundBf16<Scalar>());
    } else {
      s.noalias() = (q.block(b, h, 0, lq) * scale) * k.block(b, h, 0, lk).transpose();
    }
    for (Index i = 0; i < lq; ++i) {
      for (Index j = 0; j < lk; ++j) s(i, j) = cpu::add_bias(s(i, j), mask.bias(b, h, i, j));
    }
    cpu::MaskedValues<Scalar> masked;
    const bool guard = bf16 ? masked.find(vr) : masked.find(vb);
    if (guard) masked.remember_hidden(s);
    RowMatrix<Scalar>
        e;  // Compute::BFloat16: the scores, then exp(score − row max) rounded, as sdpa_streaming rounds them
    if (bf16) e = s;
    for (Index i = 0; i < lq; ++i) {
      Scalar max = 0, sum = 0;
      cpu::softmax_row(s.row(i), &max, &sum);
      if (lse != nullptr) (*lse)(task, i) = sum == Scalar(0) ? max : max + std::log(sum);
    }
    if (drop) apply_dropout(*dropout, task, 0, 0, s, dropout_scale<Scalar>(*dropout));
    if (weights != nullptr) {
      Eigen::Map<RowMatrix<Scalar>>(weights + task * lq * lk, lq, lk) = s;
    }
    if (bf16) {
      // softmax(s) v = (exp(s − max) v) / Σ exp(s − max), with the unnormalised exp rounded for the product.
      Vector<Scalar> sums(lq);
      for (Index i = 0; i < lq; ++i) {
        const Scalar max = e.row(i).maxCoeff();
        Scalar sum = 0;
        for (Index j = 0; j < lk; ++j) {
          const Scalar p = e(i, j) == -std::numeric_limits<Scalar>::infinity() ? Scalar(0) : std::exp(e(i, j) - max);
          sum += p;
          e(i, j) = p;
        }
        sums[i] = sum;
      }
      if (drop) apply_dropout(*dropout, task, 0, 0, e, dropout_scale<Scalar>(*dropout));
      e = e.unaryExpr(cpu::RoundBf16<Scalar>());
      typename HeadsView<Scalar>::Block dst = out.block(b, h, 0, lq);
      if (guard) {
        masked.template product<false>(dst, e, vr);
      } else {
        dst.noalias() = e * vr;
      }
      for (Index i = 0; i < lq; ++i) {
        if (sums[i] == Scalar(0)) {
          dst.row(i).setZero();
        } else {
          dst.row(i) /= sums[i];
        }
      }
    } else if (guard) {
      masked.template product<false>(out.block(b, h, 0, lq), s, vb);
    } else {
      out.block(b, h, 0, lq).noalias() = s * vb;
    }
  });
}

/// "<kernel>: lse must be [batch·heads, queries] = [..], got [..]" unless it is; with `dropout`, its p too.
template <class View, class Lse>
void check_lse(const char* kernel, const View& q, const Lse& lse, const kernels::AttnDropout* dropout = nullptr) {
  if (lse.rows() != q.batch * q.heads || lse.cols() != q.seq) {
    detail::fail(kernel, ": lse must be [batch·heads, queries] = ", detail::shape_string({q.batch * q.heads, q.seq}),
                 ", got ", detail::shape_string({lse.rows(), lse.cols()}));
  }
  if (dropout != nullptr) check_dropout(kernel, dropout->p);
}

/// The blocks sdpa_streaming works in: the options' query and key blocks, capped by the problem's lengths
/// (a block longer than the sequence is the sequence: the same arithmetic, less scratch).
inline std::pair<Index, Index> streaming_blocks(const kernels::KernelOptions& options, Index lq, Index lk) {
  return {std::max<Index>(1, std::min(options.query_block(), lq)),
          std::max<Index>(1, std::min(options.key_block(), lk))};
}

/// sdpa_split_keys computes row by row of the cache (every head on a row at once) up to this many
/// queries; with more, head by head on Eigen's products, whose register tiles then pay
/// (docs/benchmarks.md#decoding-reads-the-whole-cache; the A/B: "The row-by-row decode kernel" in git show
/// 9944106:docs/benchmarks.md).
constexpr Index kSplitKeysByRowMaxQueries = 4;

/// From this many queries on, sdpa_streaming packs each head's keys and values once (where the build has
/// cpu::packed_gemm): below, packing would cost more than the products it speeds up.
constexpr Index kPackedAttentionMinQueries = 32;

/// Whether sdpa_streaming takes its packed path: the build has packed_gemm (or the options ask for
/// rows_independent, whatever the build), keys and values are Scalar, enough queries (any number with
/// rows_independent: every row's products are then the same whatever query block holds it), and key
/// blocks that start on the packed keys' panels (QKᵀ's columns; PV reads any range of the packed values'
/// rows).
template <class Scalar, class KV = Scalar>
bool streaming_packed(const kernels::KernelOptions& options, Index lq, Index lk) {
  const Index bk = streaming_blocks(options, lq, lk).second;
  const bool ri = cpu::honoured_rows_independent(options.rows_independent());
  return (cpu::kPackedGemm || ri) && std::is_same<KV, Scalar>::value && (lq >= kPackedAttentionMinQueries || ri) &&
         (bk % cpu::GemmBlocking<Scalar>::kNR == 0 || bk >= lk);
}
/// The engine of sdpa_streaming's bfloat16 products for key blocks of bk over lk keys: bf16_engine() where
/// every key block starts on a 32-row k-step of the blocked engines, else the fallback.
inline Bf16Engine streaming_bf16_engine(Index bk, Index lk) {
  const Bf16Engine engine = bf16_engine();
  return cpu::bf16_blocked(engine) && !(bk % cpu::kTileK == 0 || bk >= lk) ? Bf16Engine::Fallback : engine;
}
/// From this many bytes of one head's keys and values on, a task of sdpa_streaming's packed path takes
/// two query blocks (streaming_query_group).
constexpr std::size_t kStreamingGroupBytes = std::size_t(1) << 20;
/// Query blocks per task of sdpa_streaming: 2 on the fp32 packed path when a head's keys and values take
/// kStreamingGroupBytes or more — the task then walks the keys once for both blocks, reading the panels
/// from beyond L2 half as often (the A/B: "Two query blocks per task over long keys" in
/// git show 9944106:docs/benchmarks.md) — else
/// 1. A row's arithmetic is the same either way.
template <class Scalar, class KV = Scalar>
Index streaming_query_group(const kernels::KernelOptions& options, Index lq, Index lk, Index dk, Index dv) {
  const bool long_keys = sizeof(Scalar) * static_cast<std::size_t>(lk * (dk + dv)) >= kStreamingGroupBytes;
  return long_keys && options.compute() != Compute::BFloat16 && streaming_packed<Scalar, KV>(options, lq, lk) ? 2 : 1;
}
/// Whether sdpa_streaming may take the fused online-softmax step (cpu/score_tile.hpp): on the fp32
/// packed path of builds that have it (kFusedScores), for head widths up to one k-block of packed_gemm,
/// without rows_independent — the step is taken on the key blocks a mask leaves whole, which depend on
/// the query block, so a row's bits would depend on the query block that holds it — and (checked by the
/// kernel) without dropout.
template <class Scalar, class KV = Scalar>
bool streaming_fused(const kernels::KernelOptions& options, Index lq, Index lk, Index dk) {
  return cpu::kFusedScores && std::is_same<Scalar, float>::value && options.compute() != Compute::BFloat16 &&
         !cpu::honoured_rows_independent(options.rows_independent()) && dk <= cpu::GemmBlocking<Scalar>::kKC &&
         streaming_packed<Scalar, KV>(options, lq, lk);
}
/// The body of sdpa_streaming, sdpa_streaming_lse and sdpa_train (lse: nullptr, or [batch·heads, queries];
/// dropout: nullptr or the probabilities' dropout).
template <class Scalar, class KV>
void sdpa_streaming_impl(const char* kernel, const HeadsView<const Scalar>& q, const HeadsView<const KV>& k,
                         const HeadsView<const KV>& v, const HeadsView<Scalar>& out, RowMatrixRef<Scalar>* lse,
                         const MaskView<Scalar>& mask, Scalar scale, const KernelOptions& options,
                         const AttnDropout* dropout = nullptr) {
  detail::check_sdpa(kernel, q, k, v, out, mask, scale);
  const Index lq = q.seq, lk = k.seq, dk = q.dim, dv = v.dim;
  const std::pair<Index, Index> blocks = impl::streaming_blocks(options, lq, lk);
  const Index bq = blocks.first, bk = blocks.second;  // named: a lambda cannot capture a structured binding in C++17
  const Index query_blocks = (lq + bq - 1) / bq;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const bool drop = dropout != nullptr && dropout->active();
  const Scalar kept_scale = drop ? impl::dropout_scale<Scalar>(*dropout) : Scalar(1);
  const bool bf16 = c2f::cpu::check_compute<Scalar, KV>(kernel, options.compute(), true);

  struct Workspace {
    RowMatrix<Scalar> q, s, acc, kv;    // kv: a converted key or value block (KV ≠ Scalar)
    Vector<Scalar> m, l, alpha, lanes;  // lanes: the fused step's sums and maxes
    c2f::cpu::Bf16A q16, p16;           // Compute::BFloat16: the query block and the probabilities, rounded
    c2f::cpu::MaskedValues<Scalar> masked;
  };
  // Work: the key blocks a causal or length mask skips are not counted (an upper bound).
  const double work = detail::attention_work(q.batch * q.heads, lq, lk, dk, dv);
  // The packed path (cpu::packed_gemm, where the build has it): each head's keys and values packed
  // once into the micro-kernel's panels, shared by all of its query blocks; the products of a block are
  // then QKᵀ and PV on those panels.
  const bool packed = !bf16 && impl::streaming_packed<Scalar, KV>(options, lq, lk);
  // The key blocks the mask leaves whole take the fused step.
  const bool fused = !drop && impl::streaming_fused<Scalar, KV>(options, lq, lk, dk);
  const Index pairs = q.batch * q.heads;
  std::vector<c2f::cpu::PackedB<Scalar>> packed_k, packed_v;
  // Compute::BFloat16: each head's keys and values packed once for bf16_gemm_range, on the tile engine
  // where key blocks start on its 32-row steps.
  std::vector<c2f::cpu::Bf16PackedB> packed_k16, packed_v16;
  const bool blocked = bf16 && cpu::bf16_blocked(impl::streaming_bf16_engine(bk, lk));
  if (packed) {
    packed_k.resize(static_cast<std::size_t>(pairs));
    packed_v.resize(packed_k.size());
  } else if (bf16) {
    packed_k16.resize(static_cast<std::size_t>(pairs));
    packed_v16.resize(packed_k16.size());
  }
  // Each pair is packed by the first task that reaches it, inside the attention's loop (detail::GroupBlockTasks):
  // the packing runs on every worker, and its panels are still in that worker's cache for its first block.
  // Each task takes `group` consecutive query blocks of one pair and walks the keys once for all of them.
  const Index group = impl::streaming_query_group<Scalar, KV>(options, lq, lk, dk, dv);  // 1 off the packed path
  const Index groups = (query_blocks + group - 1) / group;
  const detail::GroupBlockTasks order(pairs, groups, packed || bf16);
  const auto pack_pair = [&](Index bh) {
    const Index b = bh / q.heads, h = bh % q.heads;
    if constexpr (std::is_same<Scalar, float>::value && !std::is_same<KV, double>::value) {
      if (bf16) {
        packed_k16[static_cast<std::size_t>(bh)].pack(k.block(b, h, 0, lk).template cast<float>().transpose(), 1,
                                                      blocked);
        packed_v16[static_cast<std::size_t>(bh)].pack(v.block(b, h, 0, lk).template cast<float>(), 1, blocked);
      }
    }
    if constexpr (std::is_same<KV, Scalar>::value) {
      if (packed) {
        packed_k[static_cast<std::size_t>(bh)].pack(k.block(b, h, 0, lk).transpose());
        packed_v[static_cast<std::size_t>(bh)].pack(v.block(b, h, 0, lk));
      }
    }
  };
  detail::parallel_for_each_worker<Workspace>(
      pairs * groups, options.num_threads(), work, [&](Index task, Workspace& ws) {
        if (ws.q.size() == 0) {
          ws.q.resize(group * bq, dk);
          ws.s.resize(bq, c2f::cpu::score_stride<Scalar>(bk));
          ws.acc.resize(group * bq, dv);
          ws.m.resize(group * bq);
          ws.l.resize(group * bq);
          ws.alpha.resize(group * bq);
          if (fused) ws.lanes.resize(32 * bq);
        }
        const std::pair<Index, Index> at = order.task(task);
        const Index bh = at.first, first_block = at.second * group;
        const Index task_blocks = std::min(group, query_blocks - first_block);
        order.prepare(bh, pack_pair);
        const Index b = bh / q.heads, h = bh % q.heads;
        const c2f::cpu::Bf16Tiles tile_registers(bf16 ? packed_k16[static_cast<std::size_t>(bh)].engine()
                                                      : Bf16Engine::Fallback);
        // Query block g of the task: its first query, its rows, and its rows of the workspace from g·bq on.
        const auto first_query = [&](Index g) { return (first_block + g) * bq; };
        const auto rows_of = [&](Index g) { return std::min(bq, lq - first_query(g)); };
        for (Index g = 0; g < task_blocks; ++g) {
          const Index ni = rows_of(g);
          ws.q.middleRows(g * bq, ni) = q.block(b, h, first_query(g), ni) * scale;
          ws.acc.middleRows(g * bq, ni).setZero();
          ws.m.segment(g * bq, ni).setConstant(kNegInf);
          ws.l.segment(g * bq, ni).setZero();
        }
        if constexpr (std::is_same<Scalar, float>::value) {  // bf16: one block per task
          if (bf16)
            ws.q16.prepare(ws.q.data(), ws.q.outerStride(), rows_of(0), dk,
                           packed_k16[static_cast<std::size_t>(bh)].engine());
        }

        for (Index j0 = 0; j0 < lk; j0 += bk) {
          const Index nj = std::min(bk, lk - j0);
          for (Index g = 0; g < task_blocks; ++g) {
            const Index i0 = first_query(g), ni = rows_of(g);
            typename RowMatrix<Scalar>::RowsBlockXpr qs = ws.q.middleRows(g * bq, ni),
                                                     acc = ws.acc.middleRows(g * bq, ni);
            Eigen::VectorBlock<Vector<Scalar>> m = ws.m.segment(g * bq, ni), l = ws.l.segment(g * bq, ni),
                                               alpha = ws.alpha.segment(g * bq, ni);
            const BlockMask status = mask.classify(b, i0, ni, j0, nj);
            if (status == BlockMask::Skip) continue;
            Eigen::Block<RowMatrix<Scalar>> s = ws.s.topLeftCorner(ni, nj);
            if constexpr (std::is_same<Scalar, float>::value && !std::is_same<KV, double>::value) {
              if (bf16) {
                c2f::cpu::bf16_gemm(ws.q16, packed_k16[static_cast<std::size_t>(bh)], 0, dk, j0, nj, nullptr, false,
                                    s.data(), s.outerStride());
                if (status == BlockMask::Partial) mask.apply(b, h, i0, j0, s);
                // The rounded values: a finite value beyond bfloat16's range is infinite there.
                const Eigen::CwiseUnaryOp<c2f::cpu::RoundBf16<Scalar>, const typename HeadsView<const KV>::Block> vr =
                    v.block(b, h, j0, nj).unaryExpr(c2f::cpu::RoundBf16<Scalar>());
                const bool guard = status == BlockMask::Partial && ws.masked.find(vr);
                if (guard) ws.masked.remember_hidden(s);
                const c2f::cpu::Bf16PackedB& pv = packed_v16[static_cast<std::size_t>(bh)];
                if (!guard && !drop && c2f::cpu::bf16_blocked(pv.engine())) {
                  // The exponentials rounded straight into the PV product's operand (one pass).
                  if (c2f::cpu::online_softmax_step_bf16(s, m, l, alpha, ws.p16, pv.engine()))
                    acc = alpha.asDiagonal() * acc;
                  c2f::cpu::bf16_gemm(ws.p16, pv, j0, j0 + nj, 0, dv, nullptr, true, acc.data(), acc.outerStride());
                  continue;
                }
                if (c2f::cpu::online_softmax_step(s, m, l, alpha)) acc = alpha.asDiagonal() * acc;
                if (drop) impl::apply_dropout(*dropout, bh, i0, j0, s, Scalar(1));
                if (guard) {
                  c2f::cpu::round_bf16_rows(s.data(), ni, nj, s.outerStride());
                  ws.masked.template product<true>(acc, s, vr);
                } else {
                  ws.p16.prepare(s.data(), s.outerStride(), ni, nj, pv.engine());
                  c2f::cpu::bf16_gemm(ws.p16, pv, j0, j0 + nj, 0, dv, nullptr, true, acc.data(), acc.outerStride());
                }
                continue;
              }
            }
            // QKᵀ and the softmax step: fused on a block the mask leaves whole.
            bool stepped = false, rescale = false;
#if C2F_EXP_SIMD == 16
            if constexpr (std::is_same<Scalar, float>::value && std::is_same<KV, float>::value) {
              if (fused && status == BlockMask::Clear) {
                rescale = c2f::cpu::fused_online_softmax_step(qs.data(), qs.outerStride(), ni,
                                                              packed_k[static_cast<std::size_t>(bh)], dk, j0, nj,
                                                              s.data(), s.outerStride(), m, l, alpha, ws.lanes.data());
                stepped = true;
              }
            }
#endif
            if (!stepped && packed) {
              c2f::cpu::packed_gemm_range<Scalar>(qs.data(), qs.outerStride(), ni,
                                                  packed_k[static_cast<std::size_t>(bh)], 0, dk, j0, nj, nullptr, false,
                                                  s.data(), s.outerStride());
            } else if (!stepped) {
              detail::as_scalar(k.block(b, h, j0, nj), ws.kv,
                                [&](const auto& kb) { s.noalias() = qs * kb.transpose(); });
            }
            if (status == BlockMask::Partial) mask.apply(b, h, i0, j0, s);
            detail::as_scalar(v.block(b, h, j0, nj), ws.kv, [&](const auto& vb) {
              // A block the mask cuts through may hide non-finite values: leave them out (masked_values.hpp).
              const bool guard = status == BlockMask::Partial && ws.masked.find(vb);
              if (guard) ws.masked.remember_hidden(s);
              if (!stepped) rescale = c2f::cpu::online_softmax_step(s, m, l, alpha);
              if (rescale) acc = alpha.asDiagonal() * acc;
              // Dropout zeroes probabilities after the running sum took them (scaled by 1 / (1 − p) at the end).
              if (drop) impl::apply_dropout(*dropout, bh, i0, j0, s, Scalar(1));
              if (guard && packed) {
                ws.masked.product_packed_add(acc, s, vb, j0);
              } else if (guard) {
                ws.masked.template product<true>(acc, s, vb);
              } else if (packed) {
                c2f::cpu::packed_gemm_range<Scalar>(s.data(), s.outerStride(), ni,
                                                    packed_v[static_cast<std::size_t>(bh)], j0, j0 + nj, 0, dv, nullptr,
                                                    true, acc.data(), acc.outerStride());
              } else {
                acc.noalias() += s * vb;
              }
            });
          }
        }
        for (Index g = 0; g < task_blocks; ++g) {
          const Index i0 = first_query(g), ni = rows_of(g);
          const typename RowMatrix<Scalar>::RowsBlockXpr acc = ws.acc.middleRows(g * bq, ni);
          const Eigen::VectorBlock<Vector<Scalar>> m = ws.m.segment(g * bq, ni), l = ws.l.segment(g * bq, ni);
          typename HeadsView<Scalar>::Block dst = out.block(b, h, i0, ni);
          for (Index r = 0; r < ni; ++r) {
            // l is 0 only when every key was masked (a visible key contributes exp(0) = 1 at the max).
            if (l[r] == Scalar(0)) {
              dst.row(r).setZero();
            } else if (drop) {
              dst.row(r) = acc.row(r) / l[r] * kept_scale;
            } else {
              dst.row(r) = acc.row(r) / l[r];
            }
            if (lse != nullptr) (*lse)(bh, i0 + r) = l[r] == Scalar(0) ? kNegInf : m[r] + std::log(l[r]);
          }
        }
      });
}

}  // namespace impl

/// Reference kernel: out = softmax(q kᵀ · scale + mask) v (overwritten). `weights`, when not null,
/// receives the softmax weights as a row-major [batch, heads, q.seq, k.seq] array. Tasks are
/// (batch, head) pairs.
template <class Scalar>
void sdpa_naive(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                const HeadsView<Scalar>& out, const MaskView<Scalar>& mask, Scalar scale, const KernelOptions& options,
                Scalar* weights = nullptr) {
  impl::sdpa_naive_impl<Scalar>("sdpa_naive", q, k, v, out, mask, scale, options, weights, nullptr, nullptr);
}

/// sdpa_naive() in train mode, the twin of sdpa_train(): also writes each row's log-sum-exp lse
/// [batch·heads, queries] (−inf for a row with no visible key), and applies `dropout` to the
/// probabilities. Without dropout the output has sdpa_naive()'s bits.
template <class Scalar>
void sdpa_naive_train(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                      const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out, RowMatrixRef<Scalar> lse,
                      const MaskView<Scalar>& mask, const AttnDropout& dropout, Scalar scale,
                      const KernelOptions& options) {
  impl::check_lse("sdpa_naive_train", q, lse, &dropout);
  impl::sdpa_naive_impl<Scalar>("sdpa_naive_train", q, k, v, out, mask, scale, options, nullptr, &lse, &dropout);
}

/// Bytes of scratch memory one worker of sdpa_streaming uses for lq queries over lk keys: at most
/// query_block × key_block scores, whatever the lengths.
/// Compute::BFloat16 adds the query block and a block of probabilities rounded (bf16 in whole 32-row,
/// 32-column steps on the Dot and Tiles engines, floats on the fallback).
template <class Scalar>
std::size_t sdpa_streaming_workspace_bytes(const KernelOptions& options, Index qk_dim, Index v_dim, Index lq,
                                           Index lk) {
  const auto [bq, bk] = impl::streaming_blocks(options, lq, lk);
  std::size_t rounded = 0;
  if (options.compute() == Compute::BFloat16) {
    using c2f::cpu::kTileK;
    using detail::ceil_div;
    rounded =
        cpu::bf16_blocked(impl::streaming_bf16_engine(bk, lk))
            ? 2 * static_cast<std::size_t>(ceil_div(bq, cpu::kTileK) * cpu::kTileK *
                                           (ceil_div(qk_dim, cpu::kTileK) + ceil_div(bk, cpu::kTileK)) * cpu::kTileK)
            : 4 * static_cast<std::size_t>(bq * (qk_dim + bk));
  }
  // A task's query blocks (streaming_query_group) each keep their queries, accumulator and row state.
  const Index rows = impl::streaming_query_group<Scalar>(options, lq, lk, qk_dim, v_dim) * bq;
  // The fused step's sum and max lanes: 16 + 16 per query of a block.
  const Index lanes = impl::streaming_fused<Scalar>(options, lq, lk, qk_dim) ? 32 * bq : 0;
  return rounded + sizeof(Scalar) * static_cast<std::size_t>(rows * qk_dim + bq * c2f::cpu::score_stride<Scalar>(bk) +
                                                             rows * v_dim + 3 * rows + lanes);
}

/// Bytes sdpa_streaming holds once per call, shared by its workers, for `pairs` (batch, head) pairs: on
/// the packed path every head's keys and values in the micro-kernel's panels (linear in lk); else 0.
template <class Scalar>
std::size_t sdpa_streaming_shared_bytes(const KernelOptions& options, Index pairs, Index qk_dim, Index v_dim, Index lq,
                                        Index lk) {
  if (options.compute() == Compute::BFloat16) {  // every head's keys and values packed for bf16_gemm
    const Bf16Engine engine = impl::streaming_bf16_engine(impl::streaming_blocks(options, lq, lk).second, lk);
    return static_cast<std::size_t>(pairs) *
           (c2f::cpu::Bf16PackedB::bytes(qk_dim, lk, engine) + c2f::cpu::Bf16PackedB::bytes(lk, v_dim, engine));
  }
  if (!impl::streaming_packed<Scalar>(options, lq, lk)) return 0;
  return static_cast<std::size_t>(pairs) *
         (c2f::cpu::PackedB<Scalar>::bytes(qk_dim, lk) + c2f::cpu::PackedB<Scalar>::bytes(lk, v_dim));
}

/// Streaming kernel: out = softmax(q kᵀ · scale + mask) v (overwritten). Tasks are (batch, head, query
/// block — two blocks over long keys, impl::streaming_query_group); each walks the key blocks with an
/// online softmax. Blocks the mask fully hides (causal, key
/// lengths) are skipped without computing scores. Keys and values may be stored in another type `KV`
/// (Eigen::half, Eigen::bfloat16: a KVCache's): each key block is then converted to Scalar first.
template <class Scalar, class KV = Scalar>
void sdpa_streaming(const HeadsView<const Scalar>& q, const detail::NoDeduce<HeadsView<const KV>>& k,
                    const detail::NoDeduce<HeadsView<const KV>>& v, const HeadsView<Scalar>& out,
                    const MaskView<Scalar>& mask, Scalar scale, const KernelOptions& options) {
  impl::sdpa_streaming_impl<Scalar, KV>("sdpa_streaming", q, k, v, out, nullptr, mask, scale, options);
}

/// sdpa_streaming() that also writes each row's log-sum-exp, lse [batch·heads, queries] (row b·heads + h):
/// log Σ_j exp(scale · q_i·k_j + mask_ij), −inf for a row whose keys are all masked (its output is 0).
/// Two outputs over disjoint key sets merge into the output over their union by the log-sum-exp rule
/// (c2f/dist's ring attention): with M = max(lse_a, lse_b), w = exp(lse − M),
/// out = (w_a·out_a + w_b·out_b) / (w_a + w_b) and lse = M + log(w_a + w_b).
template <class Scalar>
void sdpa_streaming_lse(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                        const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out, RowMatrixRef<Scalar> lse,
                        const MaskView<Scalar>& mask, Scalar scale, const KernelOptions& options) {
  impl::check_lse("sdpa_streaming_lse", q, lse);
  impl::sdpa_streaming_impl<Scalar, Scalar>("sdpa_streaming_lse", q, k, v, out, &lse, mask, scale, options);
}

/// sdpa_streaming_lse() in train mode: `dropout` applied to the probabilities after the softmax (the
/// log-sum-exp is of the scores before it, as the backward pass needs). Without dropout it is
/// sdpa_streaming_lse(), bit for bit. Twin: sdpa_naive_train().
template <class Scalar>
void sdpa_train(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                const HeadsView<Scalar>& out, RowMatrixRef<Scalar> lse, const MaskView<Scalar>& mask,
                const AttnDropout& dropout, Scalar scale, const KernelOptions& options) {
  impl::check_lse("sdpa_train", q, lse, &dropout);
  impl::sdpa_streaming_impl<Scalar, Scalar>("sdpa_train", q, k, v, out, &lse, mask, scale, options, &dropout);
}

/// Split-key kernel (flash decoding) with sdpa_streaming's contract, for few queries over many keys — a
/// decode step. Tasks are (batch, part of options.key_part() keys); a task walks its part's key blocks
/// (options.key_block() keys) and, while a block is in cache, attends every head's queries to it, so the
/// keys and values are read from memory once and in order whatever the head count. Each (head, query)
/// keeps a running max, sum and accumulator per part; the parts are merged by the log-sum-exp rule in
/// part order. Scratch: batch · parts · heads · queries · (dv + 2) values.
/// With at most impl::kSplitKeysByRowMaxQueries queries (a decode step), a block's scores and weighted
/// values are computed row by row of the cache, every head on a row at once (cpu::head_scores_by_row):
/// the keys and values are then read front to back, not in one strided pass per head.
template <class Scalar, class KV = Scalar>
void sdpa_split_keys(const HeadsView<const Scalar>& q, const detail::NoDeduce<HeadsView<const KV>>& k,
                     const detail::NoDeduce<HeadsView<const KV>>& v, const HeadsView<Scalar>& out,
                     const MaskView<Scalar>& mask, Scalar scale, const KernelOptions& options) {
  detail::check_sdpa("sdpa_split_keys", q, k, v, out, mask, scale);
  // Compute::BFloat16: the queries, the key and value blocks (copied, as a narrow cache's are) and the
  // probabilities rounded to bfloat16, the same products in fp32.
  const bool bf16 = c2f::cpu::check_compute<Scalar, KV>("sdpa_split_keys", options.compute(), true);
  const Index bk = std::max<Index>(1, options.key_block()), part_keys = std::max<Index>(1, options.key_part());
  const Index n = q.seq, lk = k.seq, dk = q.dim, dv = v.dim, heads = q.heads;
  const Index parts = std::max<Index>(1, detail::ceil_div(lk, part_keys));
  const Index rows = heads * n;  // (head, query) rows of one task
  const bool by_row = n <= impl::kSplitKeysByRowMaxQueries;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  // Per task: the accumulators [rows, dv] and each row's running max and sum.
  std::vector<Scalar> acc_all(static_cast<std::size_t>(q.batch * parts * rows * dv));
  std::vector<Scalar> max_all(static_cast<std::size_t>(q.batch * parts * rows)), sum_all(max_all.size());

  struct Workspace {
    RowMatrix<Scalar> q, s, kb, vb;  // kb, vb: converted key and value blocks of every head (KV ≠ Scalar)
    Vector<Scalar> alpha;
    c2f::cpu::MaskedValues<Scalar> masked;
    std::vector<unsigned char> guarded;  // by_row: the heads of a block whose values hold hidden non-finite rows
  };
  // Work: the products and exps, and every cached key and value element read once from memory.
  const double work = detail::attention_work(q.batch * heads, n, lk, dk, dv) +
                      detail::kElementWork * double(q.batch * heads * lk * (dk + dv));
  detail::parallel_for_each_worker<Workspace>(
      q.batch * parts, options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index b = task / parts, part = task % parts;
        const Index first = part * part_keys, last = std::min(lk, first + part_keys);
        ws.q.resize(rows, dk);
        for (Index h = 0; h < heads; ++h) ws.q.middleRows(h * n, n) = q.block(b, h, 0, n) * scale;
        if (bf16) ws.q = ws.q.unaryExpr(c2f::cpu::RoundBf16<Scalar>());
        ws.s.resize(by_row ? rows : n, std::min(bk, last - first));
        ws.alpha.resize(n);
        if (by_row) ws.guarded.assign(static_cast<std::size_t>(heads), 0);
        Eigen::Map<RowMatrix<Scalar>> acc(acc_all.data() + task * rows * dv, rows, dv);
        Eigen::Map<Vector<Scalar>> m(max_all.data() + task * rows, rows), l(sum_all.data() + task * rows, rows);
        acc.setZero();
        m.setConstant(kNegInf);
        l.setZero();
        for (Index j0 = first; j0 < last; j0 += bk) {
          const Index nj = std::min(bk, last - j0);
          const BlockMask status = mask.classify(b, 0, n, j0, nj);
          if (status == BlockMask::Skip) continue;
          // A bfloat16 cache is read in place by the row-by-row kernels (widened in registers: exact, the bits
          // of the converted block) where the mask does not cut through the block; elsewhere a narrow cache
          // converts the block of every head at once (one sequential read), into kb / vb.
          constexpr bool kWidenInPlace = std::is_same<Scalar, float>::value && std::is_same<KV, Eigen::bfloat16>::value;
          const bool in_place = kWidenInPlace && by_row && status == BlockMask::Clear;
          const bool copies = !in_place && (bf16 || !std::is_same<KV, Scalar>::value);
          if (copies) {
            detail::convert_block<Scalar>(k.rows(b, j0, nj), ws.kb);
            detail::convert_block<Scalar>(v.rows(b, j0, nj), ws.vb);
            if (bf16 && !std::is_same<KV, Eigen::bfloat16>::value) {  // a half value is not a bfloat16 one
              ws.kb = ws.kb.unaryExpr(c2f::cpu::RoundBf16<Scalar>());
              ws.vb = ws.vb.unaryExpr(c2f::cpu::RoundBf16<Scalar>());
            }
          }
          // The block's key and value rows, every head side by side: the cache's, or the converted copies.
          const Scalar *key_rows = nullptr, *value_rows = nullptr;
          Index key_stride = 0, value_stride = 0;
          if constexpr (std::is_same<KV, Scalar>::value) {
            if (!copies) {
              key_rows = k.rows(b, j0, nj).data(), key_stride = k.row_stride;
              value_rows = v.rows(b, j0, nj).data(), value_stride = v.row_stride;
            }
          }
          if (copies) {
            key_rows = ws.kb.data(), key_stride = ws.kb.outerStride();
            value_rows = ws.vb.data(), value_stride = ws.vb.outerStride();
          }
          if (by_row && in_place) {
            if constexpr (kWidenInPlace) {
              c2f::cpu::head_scores_by_row<Scalar, KV>(ws.q.data(), heads, n, dk, k.rows(b, j0, nj).data(),
                                                       k.row_stride, nj, ws.s.data(), ws.s.outerStride());
            }
          } else if (by_row) {
            c2f::cpu::head_scores_by_row(ws.q.data(), heads, n, dk, key_rows, key_stride, nj, ws.s.data(),
                                         ws.s.outerStride());
          }
          for (Index h = 0; h < heads; ++h) {
            Eigen::Block<RowMatrix<Scalar>> s = ws.s.block(by_row ? h * n : 0, 0, n, nj);
            if (!by_row) {
              const Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> kb(key_rows + h * dk, nj, dk,
                                                                                    Eigen::OuterStride<>(key_stride));
              s.noalias() = ws.q.middleRows(h * n, n) * kb.transpose();
            }
            if (status == BlockMask::Partial) mask.apply(b, h, 0, j0, s);
            Eigen::VectorBlock<Eigen::Map<Vector<Scalar>>> mh = m.segment(h * n, n), lh = l.segment(h * n, n);
            typename Eigen::Map<RowMatrix<Scalar>>::RowsBlockXpr ah = acc.middleRows(h * n, n);
            // Null when a bfloat16 cache's values are read in place (below, after the heads): then unused.
            const Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> vblock(
                detail::offset_or_null(value_rows, h * dv), nj, dv, Eigen::OuterStride<>(value_stride));
            const bool guard = status == BlockMask::Partial && ws.masked.find(vblock);  // masked_values.hpp
            if (guard) ws.masked.remember_hidden(s);
            if (c2f::cpu::online_softmax_step(s, mh, lh, ws.alpha)) ah = ws.alpha.asDiagonal() * ah;
            if (bf16) c2f::cpu::round_bf16_rows(s.data(), n, nj, s.outerStride());
            if (by_row) ws.guarded[static_cast<std::size_t>(h)] = guard;
            if (guard && by_row) {  // this head's row pass, on the block with the hidden non-finite rows zeroed
              ws.masked.product_add_with(ah, s, vblock, [&](const RowMatrix<Scalar>& clean) {
                c2f::cpu::head_values_by_row(s.data(), s.outerStride(), 1, n, clean.data(), clean.outerStride(), nj, dv,
                                             ah.data());
              });
            } else if (guard) {
              ws.masked.template product<true>(ah, s, vblock);
            } else if (!by_row) {
              ah.noalias() += s * vblock;
            }
          }
          if (by_row && in_place) {  // (no head is guarded: the block is not cut by the mask)
            if constexpr (kWidenInPlace) {
              c2f::cpu::head_values_by_row<Scalar, KV>(ws.s.data(), ws.s.outerStride(), heads, n,
                                                       v.rows(b, j0, nj).data(), v.row_stride, nj, dv, acc.data());
            }
          } else if (by_row) {  // every other head's weighted values, one pass over the value rows
            c2f::cpu::head_values_by_row(ws.s.data(), ws.s.outerStride(), heads, n, value_rows, value_stride, nj, dv,
                                         acc.data(), ws.guarded.data());
          }
        }
      });
  // Merge the parts of every (batch, head, query) row: out = Σ e^(m_p − M) acc_p / Σ e^(m_p − M) l_p.
  detail::parallel_for(
      q.batch * heads, options.num_threads(), double(q.batch * heads * n * parts * (dv + 2)), [&](Index bh, int) {
        const Index b = bh / heads, h = bh % heads;
        typename HeadsView<Scalar>::Block dst = out.block(b, h, 0, n);
        for (Index i = 0; i < n; ++i) {
          const Index row = h * n + i;
          Scalar top = kNegInf;
          bool nan = false;  // a NaN score leaves the running max alone but makes the sum NaN: propagate it
          for (Index p = 0; p < parts; ++p) {
            const std::size_t at = static_cast<std::size_t>((b * parts + p) * rows + row);
            top = std::max(top, max_all[at]);
            nan = nan || std::isnan(sum_all[at]);
          }
          if (nan) {
            dst.row(i).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
            continue;
          }
          dst.row(i).setZero();
          if (top == kNegInf) continue;  // no visible key: zeros
          Scalar total = 0;
          for (Index p = 0; p < parts; ++p) {
            const Index t = b * parts + p;
            const Scalar mp = max_all[static_cast<std::size_t>(t * rows + row)];
            if (mp == kNegInf) continue;
            const Scalar w = std::exp(mp - top);
            total += w * sum_all[static_cast<std::size_t>(t * rows + row)];
            dst.row(i) += w * Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(
                                  acc_all.data() + (t * rows + row) * dv, dv);
          }
          dst.row(i) /= total;
        }
      });
}

}  // namespace kernels
}  // namespace c2f
