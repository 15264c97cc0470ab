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
// A query row with no visible key outputs zeros (and zero weights).
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/softmax.hpp"
#include "c2f/mask_view.hpp"
#include "c2f/options.hpp"

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

  HeadsView() = default;
  /// A view of mutable data is also a read-only view.
  template <class U, class = std::enable_if_t<std::is_same<const U, T>::value && !std::is_const<U>::value>>
  HeadsView(const HeadsView<U>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data), batch(o.batch), seq(o.seq), heads(o.heads), dim(o.dim), row_stride(o.row_stride),
        batch_stride(o.batch_stride) {}

  /// Rows [i0, i0 + n) of head h of batch b, as an n × dim matrix.
  Block block(Index b, Index h, Index i0, Index n) const {
    return Block(data + b * batch_stride + i0 * row_stride + h * dim, n, dim, Eigen::OuterStride<>(row_stride));
  }
};

/// Views the [batch·seq, cols] row-major matrix at `data` as heads of width `dim` starting at column
/// `col0` (so the q, k and v of a packed [.., 3·E] projection are three views of one matrix).
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

/// The [batch·seq, heads·dim] matrix `m` as `heads` heads (seq = rows / batch, dim = cols / heads).
template <class Scalar>
HeadsView<const Scalar> heads_view(const RowMatrix<Scalar>& m, Index batch, Index heads) {
  const Index seq = batch > 0 ? m.rows() / batch : 0;
  return heads_view<const Scalar>(m.data(), batch, seq, m.cols(), 0, heads, heads > 0 ? m.cols() / heads : 0);
}
template <class Scalar>
HeadsView<Scalar> heads_view(RowMatrix<Scalar>& m, Index batch, Index heads) {
  const Index seq = batch > 0 ? m.rows() / batch : 0;
  return heads_view<Scalar>(m.data(), batch, seq, m.cols(), 0, heads, heads > 0 ? m.cols() / heads : 0);
}

/// The usual softmax scale 1 / sqrt(head_dim).
template <class Scalar>
Scalar default_scale(Index head_dim) {
  return static_cast<Scalar>(1.0 / std::sqrt(static_cast<double>(std::max<Index>(head_dim, 1))));
}

/// Blocking and threads of the sdpa kernels.
class SdpaOptions {
  /// Query rows per task (streaming kernel).
  C2F_ARG(Index, query_block) = 64;
  /// Keys per online-softmax step (streaming kernel).
  C2F_ARG(Index, key_block) = 256;
  /// Worker threads; 0 = c2f::get_num_threads(), else a cap on it.
  C2F_ARG(int, num_threads) = 0;
};

/// Reference kernel: out = softmax(q kᵀ · scale + mask) v (overwritten). `weights`, when not null,
/// receives the softmax weights as a row-major [batch, heads, q.seq, k.seq] array. Tasks are
/// (batch, head) pairs.
template <class Scalar>
void sdpa_naive(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                const HeadsView<Scalar>& out, const MaskView<Scalar>& mask, Scalar scale, const SdpaOptions& options,
                Scalar* weights = nullptr) {
  c2f::detail::check_sdpa("sdpa_naive", q, k, v, out, mask, scale);
  const Index lq = q.seq, lk = k.seq;
  const double work = c2f::detail::attention_work(q.batch * q.heads, lq, lk, q.dim, v.dim);
  c2f::detail::parallel_for(q.batch * q.heads, options.num_threads(), work, [&](Index task, int) {
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
  const Index bq = std::max<Index>(1, options.query_block()), bk = std::max<Index>(1, options.key_block());
  return sizeof(Scalar) * static_cast<std::size_t>(bq * qk_dim + bq * bk + bq * v_dim + 3 * bq);
}

/// Streaming kernel: out = softmax(q kᵀ · scale + mask) v (overwritten). Tasks are (batch, head, query
/// block); each walks the key blocks with an online softmax. Blocks the mask fully hides (causal, key
/// lengths) are skipped without computing scores. Keys and values may be stored in another type `KV`
/// (Eigen::half, Eigen::bfloat16: a KVCache's): each key block is then converted to Scalar first.
template <class Scalar, class KV = Scalar>
void sdpa_streaming(const HeadsView<const Scalar>& q, const c2f::detail::NoDeduce<HeadsView<const KV>>& k,
                    const c2f::detail::NoDeduce<HeadsView<const KV>>& v,
                    const HeadsView<Scalar>& out, const MaskView<Scalar>& mask, Scalar scale,
                    const SdpaOptions& options) {
  c2f::detail::check_sdpa("sdpa_streaming", q, k, v, out, mask, scale);
  const Index bq = std::max<Index>(1, options.query_block()), bk = std::max<Index>(1, options.key_block());
  const Index lq = q.seq, lk = k.seq, dk = q.dim, dv = v.dim;
  const Index query_blocks = (lq + bq - 1) / bq;
  const Index tasks = q.batch * q.heads * query_blocks;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();

  struct Workspace {
    RowMatrix<Scalar> q, s, acc, kv;  // kv: a converted key or value block (KV ≠ Scalar)
    Vector<Scalar> m, l, alpha;
  };
  // Work: the key blocks a causal or length mask skips are not counted (an upper bound).
  const double work = c2f::detail::attention_work(q.batch * q.heads, lq, lk, dk, dv);
  c2f::detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
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
      c2f::detail::as_scalar(k.block(b, h, j0, nj), ws.kv, [&](const auto& kb) { s.noalias() = qs * kb.transpose(); });
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
      c2f::detail::as_scalar(v.block(b, h, j0, nj), ws.kv, [&](const auto& vb) { acc.noalias() += s * vb; });
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
