// c2f kernels — the backward pass of scaled dot-product attention: dq, dk, dv of out = softmax(q kᵀ ·
// scale + mask) v, with the forward's dropout, flash style and naive.
//
//   sdpa_backward        PyTorch's CPU flash-attention backward / FlashAttention-2: from the forward's out
//                        and per-row log-sum-exp (sdpa_train), D = rowsum(dout ∘ out), and per (query block,
//                        key block) P = exp(scale · q kᵀ + mask − lse) recomputed, dv += Pᵀ dout,
//                        dS = P ∘ (dout vᵀ − D), dq += scale · dS k, dk += scale · dSᵀ q. Working memory
//                        O(query_block · key_block) per worker — never a [queries, keys] buffer. Where
//                        the build has the packed micro-kernel (cpu/packed_gemm.hpp) and there is no
//                        dropout, the five products run on it: each task packs its head's kᵀ, vᵀ and k
//                        once, each query block its dout and scale · q (the forward's packed path);
//                        otherwise on Eigen's product;
//   sdpa_backward_naive  the twin: one (batch, head)'s probabilities P materialised from q and k, and the
//                        textbook formulas (D = rowsum(P ∘ dP)).
// Both OVERWRITE dq, dk, dv and check their arguments at entry. A row with no visible key (lse = −inf)
// gets zero gradients and gives none; a masked key receives none, NaN or Inf in its key or value
// included. docs/training.md.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/masked_values.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/mask_view.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace c2f {
namespace kernels {
namespace impl {

/// sdpa_backward splits each (batch, head)'s query blocks into this many parts or fewer when there are
/// fewer than kBackwardMinTasks (batch, head) pairs, so that a few heads still keep several threads busy.
/// Each part's dk, dv is a partial sum (part 0 in the outputs, the others in buffers of the keys' size),
/// added in part order at the end. The split depends on the shape only, never on the thread count.
constexpr Index kBackwardMinTasks = 8;

/// The query parts per (batch, head) of sdpa_backward: ceil(kBackwardMinTasks / pairs), at most one per
/// query block.
inline Index backward_query_parts(Index pairs, Index query_blocks) {
  if (pairs <= 0 || query_blocks <= 1) return 1;
  return std::max<Index>(1, std::min(detail::ceil_div(kBackwardMinTasks, pairs), query_blocks));
}

}  // namespace impl

/// Flash-style attention backward (FlashAttention-2, PyTorch's CPU flash attention): given the forward's
/// q, k, v, output `out` and log-sum-exp `lse` [batch·heads, queries] (sdpa_train, with the same mask,
/// dropout and scale) and the output's gradient dout, writes dq, dk, dv (overwritten). Tasks are (batch,
/// head, query part) (impl::backward_query_parts); each walks its query blocks and, per key block the
/// mask does not skip, recomputes the probabilities from lse. The bits depend on the shapes and blocks
/// only, not on the thread count.
template <class Scalar>
void sdpa_backward(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                   const HeadsView<const Scalar>& out, const ConstRowMatrixRef<Scalar>& lse,
                   const HeadsView<const Scalar>& dout, const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk,
                   const HeadsView<Scalar>& dv, const MaskView<Scalar>& mask, const AttnDropout& dropout, Scalar scale,
                   const KernelOptions& options) {
  detail::check_sdpa_backward("sdpa_backward", q, k, v, out, dout, dq, dk, dv, mask, scale);
  impl::check_lse("sdpa_backward", q, lse, &dropout);
  const Index lq = q.seq, lk = k.seq, dqk = q.dim, ddv = v.dim, pairs = q.batch * q.heads;
  const std::pair<Index, Index> blocks = impl::streaming_blocks(options, lq, lk);
  const Index bq = blocks.first, bk = blocks.second;
  const Index query_blocks = detail::ceil_div(lq, bq);
  const Index parts = impl::backward_query_parts(pairs, query_blocks);
  const bool drop = dropout.active();
  const Scalar kept_scale = drop ? impl::dropout_scale<Scalar>(dropout) : Scalar(1);
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  using Target = typename HeadsView<Scalar>::Block;  // a head's dk or dv rows

  // Parts after the first accumulate dk | dv into their own [lk, dqk + ddv] buffer.
  std::vector<RowMatrix<Scalar>> partial(static_cast<std::size_t>(pairs * (parts - 1)));
  // The packed path (see the file comment): the micro-kernel's products need key blocks that start on
  // its panels (as sdpa_streaming's packed path).
  const bool packed = cpu::kPackedGemm && !drop && lq >= impl::kPackedAttentionMinQueries &&
                      (bk % cpu::GemmBlocking<Scalar>::kNR == 0 || bk >= lk);
  struct Workspace {
    RowMatrix<Scalar> qs, s, t, dq;
    Vector<Scalar> rowdot;
    std::vector<std::uint8_t> keep;
    cpu::MaskedValues<Scalar> hidden_k, hidden_v;
    cpu::PackedB<Scalar> kt, vt, kp, gp, qp;  // kᵀ, vᵀ, k of the head; dout, scale · q of the query block
  };
  const double work = 2.5 * detail::attention_work(pairs, lq, lk, dqk, ddv);
  detail::parallel_for_each_worker<Workspace>(
      pairs * parts, options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index bh = task / parts, part = task % parts, b = bh / q.heads, h = bh % q.heads;
        if (ws.qs.size() == 0) {
          ws.qs.resize(bq, dqk);
          ws.s.resize(bq, bk);
          ws.t.resize(bq, bk);
          ws.dq.resize(bq, dqk);
          ws.rowdot.resize(bq);
          ws.keep.resize(static_cast<std::size_t>(bq * bk));
        }
        if (packed) {
          ws.kt.pack(k.block(b, h, 0, lk).transpose());
          ws.vt.pack(v.block(b, h, 0, lk).transpose());
          ws.kp.pack(k.block(b, h, 0, lk));
        }
        RowMatrix<Scalar>* buffer =
            part > 0 ? &partial[static_cast<std::size_t>(bh * (parts - 1) + part - 1)] : nullptr;
        if (buffer != nullptr) buffer->setZero(lk, dqk + ddv);
        Target dk_sum = buffer != nullptr ? Target(buffer->data(), lk, dqk, Eigen::OuterStride<>(dqk + ddv))
                                          : dk.block(b, h, 0, lk);
        Target dv_sum = buffer != nullptr ? Target(buffer->data() + dqk, lk, ddv, Eigen::OuterStride<>(dqk + ddv))
                                          : dv.block(b, h, 0, lk);
        if (buffer == nullptr) {
          dk_sum.setZero();
          dv_sum.setZero();
        }
        const Index first = part * query_blocks / parts, last = (part + 1) * query_blocks / parts;
        for (Index qb = first; qb < last; ++qb) {
          const Index i0 = qb * bq, ni = std::min(bq, lq - i0);
          typename RowMatrix<Scalar>::RowsBlockXpr qs = ws.qs.topRows(ni), dq_acc = ws.dq.topRows(ni);
          qs = q.block(b, h, i0, ni) * scale;
          dq_acc.setZero();
          const typename HeadsView<const Scalar>::Block g = dout.block(b, h, i0, ni);
          Eigen::VectorBlock<Vector<Scalar>> rowdot = ws.rowdot.head(ni);  // D = rowsum(dout ∘ out)
          rowdot = g.cwiseProduct(out.block(b, h, i0, ni)).rowwise().sum();
          if (packed) {
            ws.gp.pack(g);
            ws.qp.pack(qs);
          }
          for (Index j0 = 0; j0 < lk; j0 += bk) {
            const Index nj = std::min(bk, lk - j0);
            const BlockMask status = mask.classify(b, i0, ni, j0, nj);
            if (status == BlockMask::Skip) continue;
            const typename HeadsView<const Scalar>::Block kb = k.block(b, h, j0, nj), vb = v.block(b, h, j0, nj);
            Eigen::Block<RowMatrix<Scalar>> s = ws.s.topLeftCorner(ni, nj), t = ws.t.topLeftCorner(ni, nj);
            if (packed) {
              cpu::packed_gemm_range<Scalar>(qs.data(), qs.outerStride(), ni, ws.kt, 0, dqk, j0, nj, nullptr, false,
                                             s.data(), s.outerStride());
            } else {
              s.noalias() = qs * kb.transpose();
            }
            bool guard_k = false, guard_v = false;  // non-finite keys or values a mask hides (masked_values.hpp)
            if (status == BlockMask::Partial) {
              mask.apply(b, h, i0, j0, s);
              guard_k = ws.hidden_k.find(kb);
              if (guard_k) ws.hidden_k.remember_hidden(s);
              guard_v = ws.hidden_v.find(vb);
              if (guard_v) ws.hidden_v.remember_hidden(s);
            }
            // P = exp(s − lse); a row with no visible key has lse = −inf and P = 0.
            for (Index r = 0; r < ni; ++r) {
              const Scalar shift = lse(bh, i0 + r);
              if (shift == kNegInf) {
                s.row(r).setZero();
              } else {
                cpu::exp_shifted(s.row(r), shift);
              }
            }
            if (drop) {
              t = s;
              impl::apply_dropout(dropout, bh, i0, j0, t, kept_scale, ws.keep.data());
              dv_sum.middleRows(j0, nj).noalias() += t.transpose() * g;
            } else if (packed) {  // dv += Pᵀ dout (Pᵀ read in place from P)
              cpu::packed_gemm_range<Scalar, true>(s.data(), s.outerStride(), nj, ws.gp, 0, ni, 0, ddv, nullptr, true,
                                                   &dv_sum.coeffRef(j0, 0), dv_sum.outerStride());
            } else {
              dv_sum.middleRows(j0, nj).noalias() += s.transpose() * g;
            }
            if (packed) {  // dP = dout vᵀ
              cpu::packed_gemm_range<Scalar>(g.data(), g.outerStride(), ni, ws.vt, 0, ddv, j0, nj, nullptr, false,
                                             t.data(), t.outerStride());
            } else {
              t.noalias() = g * vb.transpose();  // dP (of the dropped probabilities)
            }
            if (drop) {
              for (Index r = 0; r < ni; ++r) {
                for (Index c = 0; c < nj; ++c)
                  t(r, c) = ws.keep[static_cast<std::size_t>(r * nj + c)] ? t(r, c) * kept_scale : 0;
              }
            }
            t = s.cwiseProduct((t.colwise() - rowdot));  // dS = P ∘ (dP − D)
            if (guard_v) ws.hidden_v.zero_hidden(t);
            if (guard_k && packed) {  // the packed product's bits for the rows that hide the non-finite keys
              ws.hidden_k.product_packed_add(dq_acc, t, kb, j0);
            } else if (guard_k) {
              ws.hidden_k.template product<true>(dq_acc, t, kb);
            } else if (packed) {
              cpu::packed_gemm_range<Scalar>(t.data(), t.outerStride(), ni, ws.kp, j0, j0 + nj, 0, dqk, nullptr, true,
                                             dq_acc.data(), dq_acc.outerStride());
            } else {
              dq_acc.noalias() += t * kb;
            }
            if (packed) {  // dk += dSᵀ (scale · q) (dSᵀ read in place from dS)
              cpu::packed_gemm_range<Scalar, true>(t.data(), t.outerStride(), nj, ws.qp, 0, ni, 0, dqk, nullptr, true,
                                                   &dk_sum.coeffRef(j0, 0), dk_sum.outerStride());
            } else {
              dk_sum.middleRows(j0, nj).noalias() += t.transpose() * qs;  // qs = scale · q
            }
          }
          dq.block(b, h, i0, ni) = dq_acc * scale;
        }
      });
  if (parts > 1) {
    detail::parallel_for(pairs, options.num_threads(),
                         detail::kElementWork * double(pairs * (parts - 1) * lk * (dqk + ddv)), [&](Index bh, int) {
                           const Index b = bh / q.heads, h = bh % q.heads;
                           for (Index p = 1; p < parts; ++p) {
                             const RowMatrix<Scalar>& buffer =
                                 partial[static_cast<std::size_t>(bh * (parts - 1) + p - 1)];
                             dk.block(b, h, 0, lk) += buffer.leftCols(dqk);
                             dv.block(b, h, 0, lk) += buffer.rightCols(ddv);
                           }
                         });
  }
}

/// Twin of sdpa_backward, obviously correct and slow: per (batch, head) the probabilities P [queries, keys]
/// from q, k and the mask (softmax_row: a row with no visible key is 0), the dropped P' = P ∘ keep /
/// (1 − p), then dv = P'ᵀ dout, dP = (dout vᵀ) ∘ keep / (1 − p), dS = P ∘ (dP − rowsum(P ∘ dP)),
/// dq = scale · dS k, dk = scale · dSᵀ q. Needs no forward output or lse.
template <class Scalar>
void sdpa_backward_naive(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                         const HeadsView<const Scalar>& v, const HeadsView<const Scalar>& dout,
                         const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk, const HeadsView<Scalar>& dv,
                         const MaskView<Scalar>& mask, const AttnDropout& dropout, Scalar scale,
                         const KernelOptions& options) {
  detail::check_sdpa_backward("sdpa_backward_naive", q, k, v, dout, dout, dq, dk, dv, mask, scale);
  impl::check_dropout("sdpa_backward_naive", dropout.p);
  const Index lq = q.seq, lk = k.seq;
  const double work = 3.0 * detail::attention_work(q.batch * q.heads, lq, lk, q.dim, v.dim);
  detail::parallel_for(q.batch * q.heads, options.num_threads(), work, [&](Index task, int) {
    const Index b = task / q.heads, h = task % q.heads;
    RowMatrix<Scalar> p(lq, lk), dp(lq, lk), keep = RowMatrix<Scalar>::Ones(lq, lk);
    p.noalias() = (q.block(b, h, 0, lq) * scale) * k.block(b, h, 0, lk).transpose();
    for (Index i = 0; i < lq; ++i) {
      for (Index j = 0; j < lk; ++j) p(i, j) = cpu::add_bias(p(i, j), mask.bias(b, h, i, j));
      cpu::softmax_row(p.row(i));
    }
    if (dropout.active()) impl::apply_dropout(dropout, task, 0, 0, keep, impl::dropout_scale<Scalar>(dropout));
    const typename HeadsView<const Scalar>::Block g = dout.block(b, h, 0, lq);
    dv.block(b, h, 0, lk).noalias() = p.cwiseProduct(keep).transpose() * g;
    dp.noalias() = g * v.block(b, h, 0, lk).transpose();
    dp = dp.cwiseProduct(keep);
    const Vector<Scalar> rowdot = p.cwiseProduct(dp).rowwise().sum();
    const RowMatrix<Scalar> ds = p.cwiseProduct(dp.colwise() - rowdot);
    dq.block(b, h, 0, lq).noalias() = scale * (ds * k.block(b, h, 0, lk));
    dk.block(b, h, 0, lk).noalias() = scale * (ds.transpose() * q.block(b, h, 0, lq));
  });
}

}  // namespace kernels
}  // namespace c2f
