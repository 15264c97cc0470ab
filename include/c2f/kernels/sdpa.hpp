// c2f kernels — scaled dot-product attention, softmax(q kᵀ · scale + mask) v, per batch and head.
//
// Two forms with the same contract:
//   sdpa_naive      materialises the [queries, keys] scores of one (batch, head) and can return the
//                   attention weights — the reference, and the path used when weights are wanted;
//   sdpa_streaming  blocked over queries and keys with an online (running-max) softmax, Eigen GEMMs on
//                   the blocks, and O(query_block · key_block) working memory per worker — never a
//                   [queries, keys] buffer.
// Both run (batch, head[, query block]) tasks on a caller-chosen number of threads; every task's
// arithmetic depends only on its index, so the output bits do not depend on the thread count.
// A query row with no visible key outputs zeros (and zero weights).
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/mask_plan.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/softmax.hpp"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace c2f {
namespace kernels {

/// A [batch, seq, heads, dim] view: head h of token i of batch b starts at
/// data + b·batch_stride + i·row_stride + h·dim, and its `dim` values are contiguous. This is how the
/// projected q, k and v of every head sit inside one [batch·seq, heads·dim] (or packed [.., 3·E]) matrix.
template <class T>
struct HeadsView {
  using Scalar = std::remove_const_t<T>;
  using Block = Eigen::Map<std::conditional_t<std::is_const<T>::value, const RowMatrix<Scalar>, RowMatrix<Scalar>>,
                           0, Eigen::OuterStride<>>;

  T* data = nullptr;
  Index batch = 0, seq = 0, heads = 0, dim = 0;
  Index row_stride = 0, batch_stride = 0;

  /// Rows [i0, i0 + n) of head h of batch b, as an n × dim matrix.
  Block block(Index b, Index h, Index i0, Index n) const {
    return Block(data + b * batch_stride + i0 * row_stride + h * dim, n, dim, Eigen::OuterStride<>(row_stride));
  }
};

/// Views the [batch·seq, cols] row-major matrix `m` as heads of width `dim` starting at column `col0`.
template <class T>
HeadsView<T> heads_view(T* data, Index batch, Index seq, Index cols, Index col0, Index heads, Index dim) {
  HeadsView<T> v;
  v.data = data + col0;
  v.batch = batch;
  v.seq = seq;
  v.heads = heads;
  v.dim = dim;
  v.row_stride = cols;
  v.batch_stride = seq * cols;
  return v;
}

struct SdpaOptions {
  /// Multiplies q kᵀ; 0 means 1 / sqrt(head dim).
  double scale = 0.0;
  /// Query rows per task (streaming kernel).
  Index query_block = 64;
  /// Keys per online-softmax step (streaming kernel).
  Index key_block = 256;
  /// Worker threads; 0 = c2f::get_num_threads(), else a cap on it.
  int num_threads = 0;
};

}  // namespace kernels

namespace detail {

template <class Scalar>
void check_sdpa_views(const kernels::HeadsView<const Scalar>& q, const kernels::HeadsView<const Scalar>& k,
                      const kernels::HeadsView<const Scalar>& v, const kernels::HeadsView<Scalar>& out) {
  if (k.batch != q.batch || v.batch != q.batch || out.batch != q.batch || k.heads != q.heads ||
      v.heads != q.heads || out.heads != q.heads || k.dim != q.dim || v.seq != k.seq || out.seq != q.seq ||
      out.dim != v.dim) {
    fail("sdpa: q ", shape_string({q.batch, q.seq, q.heads, q.dim}), ", k ",
         shape_string({k.batch, k.seq, k.heads, k.dim}), ", v ", shape_string({v.batch, v.seq, v.heads, v.dim}),
         " and out ", shape_string({out.batch, out.seq, out.heads, out.dim}),
         " ([batch, seq, heads, dim]) do not fit");
  }
}

/// Work (FLOP) of attention over `pairs` (batch, head) pairs: q kᵀ and p v, plus the softmax's exp,
/// counted as kElementWork per score.
inline double attention_work(Index pairs, Index lq, Index lk, Index dk, Index dv) {
  return static_cast<double>(pairs) * static_cast<double>(lq) * static_cast<double>(lk) *
         (2.0 * static_cast<double>(dk + dv) + kElementWork);
}

template <class Scalar>
Scalar resolve_scale(double scale, Index dim) {
  return static_cast<Scalar>(scale != 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(std::max<Index>(dim, 1))));
}

}  // namespace detail

namespace kernels {

/// Reference kernel. `weights`, when not null, receives the softmax weights as a row-major
/// [batch, heads, q.seq, k.seq] array. Tasks are (batch, head) pairs.
template <class Scalar>
void sdpa_naive(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                const HeadsView<Scalar>& out, const c2f::detail::MaskPlan<Scalar>& mask, const SdpaOptions& options,
                Scalar* weights = nullptr) {
  detail::check_sdpa_views(q, k, v, out);
  const Scalar scale = detail::resolve_scale<Scalar>(options.scale, q.dim);
  const Index lq = q.seq, lk = k.seq;
  const double work = detail::attention_work(q.batch * q.heads, lq, lk, q.dim, v.dim);
  c2f::detail::parallel_for(q.batch * q.heads, options.num_threads, work, [&](Index task, int) {
    const Index b = task / q.heads, h = task % q.heads;
    RowMatrix<Scalar> s(lq, lk);
    s.noalias() = (q.block(b, h, 0, lq) * scale) * k.block(b, h, 0, lk).transpose();
    for (Index i = 0; i < lq; ++i) {
      for (Index j = 0; j < lk; ++j) s(i, j) += mask.bias(b, h, i, j);
      c2f::detail::softmax_row(s.row(i));
    }
    out.block(b, h, 0, lq).noalias() = s * v.block(b, h, 0, lk);
    if (weights != nullptr) {
      Eigen::Map<RowMatrix<Scalar>>(weights + task * lq * lk, lq, lk) = s;
    }
  });
}

/// Bytes of scratch memory one worker of sdpa_streaming uses (independent of the sequence lengths).
template <class Scalar>
std::size_t sdpa_streaming_workspace_bytes(const SdpaOptions& options, Index qk_dim, Index v_dim) {
  const Index bq = std::max<Index>(1, options.query_block), bk = std::max<Index>(1, options.key_block);
  return sizeof(Scalar) * static_cast<std::size_t>(bq * qk_dim + bq * bk + bq * v_dim + 3 * bq);
}

/// Streaming kernel: tasks are (batch, head, query block); each walks the key blocks with an online
/// softmax. Blocks the mask fully hides (causal, key lengths) are skipped without computing scores.
template <class Scalar>
void sdpa_streaming(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const c2f::detail::MaskPlan<Scalar>& mask, const SdpaOptions& options) {
  detail::check_sdpa_views(q, k, v, out);
  using c2f::detail::BlockMask;
  const Scalar scale = detail::resolve_scale<Scalar>(options.scale, q.dim);
  const Index bq = std::max<Index>(1, options.query_block), bk = std::max<Index>(1, options.key_block);
  const Index lq = q.seq, lk = k.seq, dk = q.dim, dv = v.dim;
  const Index query_blocks = (lq + bq - 1) / bq;
  const Index tasks = q.batch * q.heads * query_blocks;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();

  struct Workspace {
    RowMatrix<Scalar> q, s, acc;
    Vector<Scalar> m, l, alpha;
  };
  std::vector<Workspace> work(static_cast<std::size_t>(c2f::detail::resolve_threads(options.num_threads, tasks)));

  // The scratch count is passed as the cap, so workers stay below it even if c2f::set_num_threads
  // changes the thread count meanwhile.
  c2f::detail::parallel_for(tasks, static_cast<int>(work.size()),
                            detail::attention_work(q.batch * q.heads, lq, lk, dk, dv), [&](Index task, int worker) {
    Workspace& ws = work[static_cast<std::size_t>(worker)];
    if (ws.q.size() == 0) {
      ws.q.resize(bq, dk);
      ws.s.resize(bq, bk);
      ws.acc.resize(bq, dv);
      ws.m.resize(bq);
      ws.l.resize(bq);
      ws.alpha.resize(bq);
    }
    const Index qb = task % query_blocks, bh = task / query_blocks;
    const Index b = bh / q.heads, h = bh % q.heads;
    const Index i0 = qb * bq, ni = std::min(bq, lq - i0);

    typename RowMatrix<Scalar>::RowsBlockXpr qs = ws.q.topRows(ni);
    qs = q.block(b, h, i0, ni) * scale;
    typename RowMatrix<Scalar>::RowsBlockXpr acc = ws.acc.topRows(ni);
    acc.setZero();
    Eigen::VectorBlock<Vector<Scalar>> m = ws.m.head(ni), l = ws.l.head(ni), alpha = ws.alpha.head(ni);
    m.setConstant(kNegInf);
    l.setZero();

    for (Index j0 = 0; j0 < lk; j0 += bk) {
      const Index nj = std::min(bk, lk - j0);
      const BlockMask status = mask.classify(b, i0, ni, j0, nj);
      if (status == BlockMask::Skip) continue;
      Eigen::Block<RowMatrix<Scalar>> s = ws.s.topLeftCorner(ni, nj);
      s.noalias() = qs * k.block(b, h, j0, nj).transpose();
      if (status == BlockMask::Partial) mask.apply(b, h, i0, j0, s);
      bool rescale = false;
      for (Index r = 0; r < ni; ++r) {
        const Scalar block_max = s.row(r).maxCoeff();
        const Scalar m_new = std::max(m[r], block_max);
        // All keys so far hidden: shift by 0, not by -inf (which would give exp(-inf + inf) = NaN).
        const Scalar shift = m_new == kNegInf ? Scalar(0) : m_new;
        alpha[r] = std::exp(m[r] - shift);
        rescale = rescale || alpha[r] != Scalar(1);
        m[r] = m_new;
        c2f::detail::exp_shifted(s.row(r), shift);
        l[r] = alpha[r] * l[r] + s.row(r).sum();
      }
      if (rescale) acc = alpha.asDiagonal() * acc;
      acc.noalias() += s * v.block(b, h, j0, nj);
    }
    typename HeadsView<Scalar>::Block dst = out.block(b, h, i0, ni);
    for (Index r = 0; r < ni; ++r) {
      // l is 0 only when every key was masked (a visible key contributes exp(0) = 1 at the max).
      if (l[r] == Scalar(0)) {
        dst.row(r).setZero();
      } else {
        dst.row(r) = acc.row(r) / l[r];
      }
    }
  });
}

}  // namespace kernels
}  // namespace c2f
