// c2f kernels — the attention levels of HMHA (hierarchical multi-head attention): local windows, the
// causal window-summary level, and the log-spaced sparse level.
//
// q, k, v, out are [batch·length, heads·head_dim] row-major matrices (head h = columns
// [h·head_dim, (h+1)·head_dim)); every kernel ACCUMULATES its result into `out` (out += …). Scores are
// q·k · scale. Arguments are checked at entry (std::invalid_argument, every build type).
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/softmax.hpp"
#include "c2f/kernels/chunk.hpp"

#include <cmath>
#include <limits>
#include <vector>

namespace c2f {
namespace kernels {

/// Level 1: token i of window c attends to the tokens of window c (with `causal`, to those ≤ i):
/// out[i] += softmax_t(q_i·k_t · scale) v_t per head. Windows are the chunks of `grid`.
/// Tasks are windows; scratch is one window × window score block per worker.
template <class Scalar>
void window_attention(const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
                      const Eigen::Ref<const RowMatrix<Scalar>>& v, const ChunkGrid& grid, Index heads, bool causal,
                      Scalar scale, Eigen::Ref<RowMatrix<Scalar>> out, int num_threads) {
  detail::check_grid("window_attention", grid);
  detail::check_qkv_out("window_attention", q, k, v, out, grid.batch * grid.length, heads, scale);
  const Index dh = q.cols() / heads;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  std::vector<RowMatrix<Scalar>> scratch(
      static_cast<std::size_t>(detail::resolve_threads(num_threads, grid.chunks())));
  detail::parallel_for(grid.chunks(), num_threads, [&](Index c, int worker) {
    const Index r = grid.row(c), n = grid.count(c);
    RowMatrix<Scalar>& buffer = scratch[static_cast<std::size_t>(worker)];
    if (buffer.rows() < n) buffer.resize(grid.chunk, grid.chunk);
    Eigen::Block<RowMatrix<Scalar>> s = buffer.topLeftCorner(n, n);
    for (Index h = 0; h < heads; ++h) {
      s.noalias() = (q.block(r, h * dh, n, dh) * scale) * k.block(r, h * dh, n, dh).transpose();
      for (Index i = 0; i < n; ++i) {
        if (causal) s.row(i).tail(n - i - 1).setConstant(kNegInf);
        detail::softmax_row(s.row(i));
      }
      out.block(r, h * dh, n, dh).noalias() += s * v.block(r, h * dh, n, dh);
    }
  });
}

/// Causal level 2 (NSA's compressed branch): token i of window c attends, with its own query and one
/// softmax, to the summaries of the complete windows before its own:
///   out[i] += softmax_j(q_i·k̄_j · scale) v̄_j per head, j = 0 … c − 1 (window 0 gets nothing).
/// k̄, v̄ [chunks, heads·dh] hold the window means (chunk_mean over `grid`). Tasks are windows; each is
/// one [count, c] score block per head, so a token's result never depends on a later token.
template <class Scalar>
void window_summary_attention(const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k_mean,
                              const Eigen::Ref<const RowMatrix<Scalar>>& v_mean, const ChunkGrid& grid, Index heads,
                              Scalar scale, Eigen::Ref<RowMatrix<Scalar>> out, int num_threads) {
  const char* kernel = "window_summary_attention";
  detail::check_grid(kernel, grid);
  detail::check_heads(kernel, q.cols(), heads);
  detail::check_shape(kernel, "q", q, grid.batch * grid.length, q.cols());
  detail::check_shape(kernel, "out", out, grid.batch * grid.length, q.cols());
  detail::check_shape(kernel, "k_mean", k_mean, grid.chunks(), q.cols());
  detail::check_shape(kernel, "v_mean", v_mean, grid.chunks(), q.cols());
  detail::check_scale(kernel, scale);
  const Index dh = q.cols() / heads, m = grid.chunks_per_batch();
  std::vector<RowMatrix<Scalar>> scratch(
      static_cast<std::size_t>(detail::resolve_threads(num_threads, grid.chunks())));
  detail::parallel_for(grid.chunks(), num_threads, [&](Index c, int worker) {
    const Index before = c % m;  // complete windows before this one, in the same batch item
    if (before == 0) return;
    const Index r = grid.row(c), n = grid.count(c), first = c - before;
    RowMatrix<Scalar>& s = scratch[static_cast<std::size_t>(worker)];
    s.resize(n, before);
    for (Index h = 0; h < heads; ++h) {
      s.noalias() = (q.block(r, h * dh, n, dh) * scale) * k_mean.block(first, h * dh, before, dh).transpose();
      for (Index i = 0; i < n; ++i) detail::softmax_row(s.row(i));
      out.block(r, h * dh, n, dh).noalias() += s * v_mean.block(first, h * dh, before, dh);
    }
  });
}

/// Offsets of the log-spaced key set of level 3, in the order the kernels visit them:
/// 0, −1, +1, −2, +2, −4, +4, … (|offset| < length); with `causal` only 0 and the negative ones.
inline std::vector<Index> sparse_offsets(Index length, bool causal) {
  std::vector<Index> offsets = {0};
  for (Index step = 1; step < length; step *= 2) {
    offsets.push_back(-step);
    if (!causal) offsets.push_back(step);
  }
  return offsets;
}

/// Rows per task of sparse_global_attention(); fixed, so the bits do not depend on the thread count.
constexpr Index kSparseRowBlock = 64;

/// Level 3: token i attends to S(i) = {i} ∪ {i − 2^p, i + 2^p : p ≥ 0} ∩ [0, length) (with `causal`,
/// {i} ∪ {i − 2^p}): out[i] += softmax_t(q_i·k_t · scale) v_t per head. v and out must be contiguous.
///
/// The keys at one offset δ of a block of consecutive queries are a shifted block of consecutive key
/// rows, so the kernel works offset by offset on contiguous rows (no gather): scores for all rows and
/// heads at once, one softmax across offsets, then the weighted value rows.
template <class Scalar>
void sparse_global_attention(const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
                             const Eigen::Ref<const RowMatrix<Scalar>>& v, Index batch, Index length, Index heads,
                             bool causal, Scalar scale, Eigen::Ref<RowMatrix<Scalar>> out, int num_threads) {
  if (batch < 0 || length < 0) detail::fail("sparse_global_attention: batch and length must be >= 0");
  detail::check_qkv_out("sparse_global_attention", q, k, v, out, batch * length, heads, scale);
  const Index dim = q.cols(), dh = dim / heads;
  if (v.outerStride() != dim || out.outerStride() != dim) {
    detail::fail("sparse_global_attention: v and out must be contiguous [batch·length, ", dim, "] matrices");
  }
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const std::vector<Index> offsets = sparse_offsets(length, causal);
  const Index noff = static_cast<Index>(offsets.size());
  const Index blocks_per_batch = (length + kSparseRowBlock - 1) / kSparseRowBlock;
  detail::parallel_for(batch * blocks_per_batch, num_threads, [&](Index task, int) {
    const Index b = task / blocks_per_batch;
    const Index a = (task % blocks_per_batch) * kSparseRowBlock, n = std::min(kSparseRowBlock, length - a);
    const Index base = b * length;
    // scores(r·heads + h, o): query a + r, head h, key a + r + offsets[o].
    RowMatrix<Scalar> scores = RowMatrix<Scalar>::Constant(n * heads, noff, kNegInf);
    RowMatrix<Scalar> prod(n, dim);
    for (Index o = 0; o < noff; ++o) {
      const Index delta = offsets[static_cast<std::size_t>(o)];
      const Index i0 = std::max<Index>(0, -delta - a), i1 = std::min(n, length - delta - a);  // rows with a key
      if (i1 <= i0) continue;
      const Index rows = i1 - i0;
      prod.topRows(rows) = q.middleRows(base + a + i0, rows).cwiseProduct(k.middleRows(base + a + i0 + delta, rows));
      scores.col(o).segment(i0 * heads, rows * heads) =
          Eigen::Map<const RowMatrix<Scalar>>(prod.data(), rows * heads, dh).rowwise().sum() * scale;
    }
    for (Index r = 0; r < n * heads; ++r) detail::softmax_row(scores.row(r));
    for (Index o = 0; o < noff; ++o) {
      const Index delta = offsets[static_cast<std::size_t>(o)];
      const Index i0 = std::max<Index>(0, -delta - a), i1 = std::min(n, length - delta - a);
      if (i1 <= i0) continue;
      const Index rows = i1 - i0;
      // out rows as [rows·heads, dh]: each (query, head) row gains weight · its value row.
      Eigen::Map<RowMatrix<Scalar>> dst(out.row(base + a + i0).data(), rows * heads, dh);
      const Eigen::Map<const RowMatrix<Scalar>> src(v.row(base + a + i0 + delta).data(), rows * heads, dh);
      dst.noalias() += scores.col(o).segment(i0 * heads, rows * heads).asDiagonal() * src;
    }
  });
}

}  // namespace kernels
}  // namespace c2f
