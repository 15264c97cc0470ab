// c2f kernels — fixed-size chunks of a sequence: mean pooling, broadcasting chunk rows back to tokens,
// and the folded fine-attention step of coarse-to-fine attention.
//
// A sequence of length L is cut into m = ceil(L / chunk) chunks; chunk i of batch b holds the tokens
// [i·chunk, min((i+1)·chunk, L)) — the last one may be partial. Chunk rows are indexed c = b·m + i.
//
// The kernels take any *block grid*, of which ChunkGrid is the one-dimensional case: blocks() blocks,
// block c holding count(c) real tokens that lie in segments(c) runs of consecutive rows of the token
// matrix — run s starts at row segment_row(c, s) and holds segment_length(c, s) rows. Tokens are
// numbered inside a block run after run (j = 0 … count(c) − 1). A chunk is one run; a 2-D image block
// (kernels::BlockGrid2D in c2f/kernels/block2d.hpp) is one run per image row it covers.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/masked_values.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/small_gemm.hpp"
#include "c2f/detail/softmax.hpp"
#include "c2f/kernels/kernel_options.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace c2f {
namespace kernels {

/// Chunks of a [batch, length] sequence.
struct ChunkGrid {
  Index batch = 0, length = 0, chunk = 1;

  Index chunks_per_batch() const { return detail::ceil_div(length, chunk); }
  Index chunks() const { return batch * chunks_per_batch(); }
  /// First token (within its batch) and number of real tokens of chunk c = b·m + i.
  Index first(Index c) const { return (c % chunks_per_batch()) * chunk; }
  Index count(Index c) const { return std::min(chunk, length - first(c)); }
  /// Row of token 0 of chunk c in the [batch·length, features] token matrix.
  Index row(Index c) const { return (c / chunks_per_batch()) * length + first(c); }

  // The block-grid interface of the kernels below: a chunk is one run of rows.
  Index blocks() const { return chunks(); }
  /// Rows of the token matrix.
  Index tokens() const { return batch * length; }
  /// Throws unless batch >= 0, length >= 0 and chunk >= 1.
  void check(const char* kernel) const { detail::check_grid(kernel, *this); }
  Index segments(Index) const { return 1; }
  Index segment_row(Index c, Index) const { return row(c); }
  Index segment_length(Index c, Index) const { return count(c); }
};

/// The chunks of `grid` that hold the last n positions (the queries of a kernel whose queries are the
/// last n of the grid's T positions): [first, first + count) in every batch item, and the first query
/// position T − n.
struct QueryChunks {
  Index first = 0, count = 0, first_position = 0;
  QueryChunks(const ChunkGrid& grid, Index n) : first_position(grid.length - n) {
    if (n > 0) {
      first = first_position / grid.chunk;
      count = (grid.length - 1) / grid.chunk - first + 1;
    }
  }
};

}  // namespace kernels
namespace detail {
/// chunk_mean and chunk_mean_where: the mean of the tokens `keep(c, j)` accepts, NaN where none.
template <class Scalar, class Grid, class Keep>
void chunk_mean_of(const char* kernel, const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid, const Keep& keep,
                   Eigen::Ref<RowMatrix<Scalar>> out, const kernels::KernelOptions& options) {
  grid.check(kernel);
  check_shape(kernel, "x", x, grid.tokens(), x.cols());
  check_shape(kernel, "out", out, grid.blocks(), x.cols());
  const double work = kElementWork * static_cast<double>(grid.tokens() * x.cols());
  parallel_for(grid.blocks(), options.num_threads(), work, [&](Index c, int) {
    typename Eigen::Ref<RowMatrix<Scalar>>::RowXpr o = out.row(c);
    o.setZero();
    Index kept = 0;
    for (Index s = 0, j = 0; s < grid.segments(c); ++s) {
      const Index r0 = grid.segment_row(c, s), n = grid.segment_length(c, s);
      for (Index r = r0; r < r0 + n; ++r, ++j) {
        if (!keep(c, j)) continue;
        o += x.row(r);
        ++kept;
      }
    }
    if (kept == 0) {
      o.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
    } else {
      o /= static_cast<Scalar>(kept);
    }
  });
}
}  // namespace detail
namespace kernels {

/// out[c] = mean of the real tokens of block c. x [rows, d], out [blocks, d]; `grid` is a ChunkGrid or
/// another block grid (see the file comment). Rows are added one after the other in token order,
/// streaming through memory (2.4× the bandwidth of Eigen's column-by-column colwise().sum() on a
/// 64-row run at d = 512).
/// Overwrites out.
template <class Scalar, class Grid>
void chunk_mean(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid, Eigen::Ref<RowMatrix<Scalar>> out,
                const KernelOptions& options) {
  detail::chunk_mean_of("chunk_mean", x, grid, [](Index, Index) { return true; }, out, options);
}

/// chunk_mean over the tokens `keep(c, j)` accepts (token j of block c, in the block's order): the mean of
/// those, or NaN in every feature when a block keeps none (a summary that ranks below every other in a
/// selection). With keep always true, the bits of chunk_mean.
template <class Scalar, class Grid, class Keep>
void chunk_mean_where(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid, Keep&& keep,
                      Eigen::Ref<RowMatrix<Scalar>> out, const KernelOptions& options) {
  detail::chunk_mean_of("chunk_mean_where", x, grid, keep, out, options);
}

}  // namespace kernels
namespace detail {

/// broadcast_chunks and broadcast_chunks_add.
template <bool Add, class Scalar, class Grid>
void broadcast_rows(const char* kernel, const Eigen::Ref<const RowMatrix<Scalar>>& chunk_rows, const Grid& grid,
                    Eigen::Ref<RowMatrix<Scalar>> y, const kernels::KernelOptions& options) {
  grid.check(kernel);
  check_shape(kernel, "chunk_rows", chunk_rows, grid.blocks(), y.cols());
  check_shape(kernel, "y", y, grid.tokens(), chunk_rows.cols());
  const double work = kElementWork * static_cast<double>(grid.tokens() * y.cols());
  parallel_for(grid.blocks(), options.num_threads(), work, [&](Index c, int) {
    for (Index s = 0; s < grid.segments(c); ++s) {
      typename Eigen::Ref<RowMatrix<Scalar>>::RowsBlockXpr rows = y.middleRows(grid.segment_row(c, s), grid.segment_length(c, s));
      if constexpr (Add) {
        rows.rowwise() += chunk_rows.row(c);
      } else {
        rows.rowwise() = chunk_rows.row(c);
      }
    }
  });
}
}  // namespace detail
namespace kernels {

/// y[token] = chunk_rows[block of token] for every real token (overwritten; rows of y that belong to
/// no block are left as they are). chunk_rows [blocks, d], y [rows, d]; `grid` is a ChunkGrid or
/// another block grid.
template <class Scalar, class Grid>
void broadcast_chunks(const Eigen::Ref<const RowMatrix<Scalar>>& chunk_rows, const Grid& grid,
                      Eigen::Ref<RowMatrix<Scalar>> y, const KernelOptions& options) {
  detail::broadcast_rows<false, Scalar>("broadcast_chunks", chunk_rows, grid, y, options);
}

/// broadcast_chunks, adding: y[token] += chunk_rows[block of token].
template <class Scalar, class Grid>
void broadcast_chunks_add(const Eigen::Ref<const RowMatrix<Scalar>>& chunk_rows, const Grid& grid,
                          Eigen::Ref<RowMatrix<Scalar>> y, const KernelOptions& options) {
  detail::broadcast_rows<true, Scalar>("broadcast_chunks_add", chunk_rows, grid, y, options);
}

/// The folded fine-attention step. For every block c and head h, with one query per block:
///   p_c,h = softmax_j( qk[c, h] · x_j + bias(c, h, j) )  over the real tokens j of block c,
///   pooled[c, h] = Σ_j p_c,h[j] x_j   and   mass[c, h] = Σ_j p_c,h[j]  (1, or 0 if all keys are masked).
/// x [rows, d]; qk [blocks, heads·d] holds, per head, the query already multiplied into the key
/// projection and by the softmax scale (q_h W_k,h / sqrt(d_k)), so no scale is applied here; pooled
/// [blocks, heads·d] and mass [blocks, heads] are overwritten.
/// `bias(c, h, j)` returns 0, an additive value or -inf (masked). Masked keys get exactly 0 weight.
///
/// Blocks of several runs (2-D blocks) are read run by run, each once from memory: a run's softmax and
/// pooled sum are merged into the block's with the running-max rule (flash decoding's split-K merge, in
/// run order, so the bits do not depend on the thread count). A block of one run (a chunk) is exactly
/// softmax then Σ p x. Working memory: heads × (longest run + d) values per worker. The two products
/// per run read the run in place (detail/small_gemm.hpp): no packed copy of x.
template <class Scalar, class Grid, class Bias>
void fine_attention_folded(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid,
                           const Eigen::Ref<const RowMatrix<Scalar>>& qk, Index heads,
                           Eigen::Ref<RowMatrix<Scalar>> pooled, Eigen::Ref<RowMatrix<Scalar>> mass, Bias&& bias,
                           const KernelOptions& options) {
  const Index d = x.cols();
  grid.check("fine_attention_folded");
  detail::check_heads("fine_attention_folded", heads * d, heads);
  detail::check_shape("fine_attention_folded", "x", x, grid.tokens(), d);
  detail::check_shape("fine_attention_folded", "qk", qk, grid.blocks(), heads * d);
  detail::check_shape("fine_attention_folded", "pooled", pooled, grid.blocks(), heads * d);
  detail::check_shape("fine_attention_folded", "mass", mass, grid.blocks(), heads);
  struct Workspace {
    RowMatrix<Scalar> p, o;            // one run: scores [heads, run length] and pooled rows [heads, d]
    Vector<Scalar> max, sum;           // per head: the block's running max and softmax sum
    Vector<Scalar> run_max, run_sum;   // per head: the run's
  };
  const double work = static_cast<double>(grid.tokens() * heads) * (4.0 * static_cast<double>(d) + detail::kElementWork);
  detail::parallel_for_each_worker<Workspace>(grid.blocks(), options.num_threads(), work, [&](Index c, Workspace& ws) {
    if (ws.max.size() != heads) {
      ws.max.resize(heads);
      ws.sum.resize(heads);
      ws.run_max.resize(heads);
      ws.run_sum.resize(heads);
    }
    const Eigen::Map<const RowMatrix<Scalar>> q(qk.row(c).data(), heads, d);
    Eigen::Map<RowMatrix<Scalar>> acc(pooled.row(c).data(), heads, d);
    for (Index s = 0, j0 = 0; s < grid.segments(c); ++s) {
      const Index n = grid.segment_length(c, s);
      const typename Eigen::Ref<const RowMatrix<Scalar>>::ConstRowsBlockXpr xs = x.middleRows(grid.segment_row(c, s), n);
      if (ws.p.rows() != heads || ws.p.cols() != n) ws.p.resize(heads, n);
      const bool more = s + 1 < grid.segments(c);  // the next run, read ahead while this one is scored
      detail::dot_rows(q.data(), heads, d, xs.data(), x.outerStride(), n, ws.p.data(), n,
                       more ? x.data() + grid.segment_row(c, s + 1) * x.outerStride() : nullptr,
                       more ? grid.segment_length(c, s + 1) : 0);  // p = q xsᵀ
      for (Index h = 0; h < heads; ++h) {
        for (Index j = 0; j < n; ++j) ws.p(h, j) = detail::add_bias(ws.p(h, j), bias(c, h, j0 + j));
        const bool visible = detail::softmax_row(ws.p.row(h), &ws.run_max[h], &ws.run_sum[h]);
        if (s == 0) mass(c, h) = visible ? Scalar(1) : Scalar(0);
      }
      j0 += n;
      if (s == 0) {
        detail::weighted_rows(ws.p.data(), n, heads, n, xs.data(), x.outerStride(), d, acc.data(), d);  // p xs
        ws.max = ws.run_max;
        ws.sum = ws.run_sum;
        continue;
      }
      // Merge the run into the block: o_block = (L·e^(M−M')·o_block + l·e^(m−M')·o_run) / (L·e^(M−M') + l·e^(m−M')).
      if (ws.o.rows() != heads || ws.o.cols() != d) ws.o.resize(heads, d);
      detail::weighted_rows(ws.p.data(), n, heads, n, xs.data(), x.outerStride(), d, ws.o.data(), d);
      for (Index h = 0; h < heads; ++h) {
        const Scalar l = ws.run_sum[h], m = ws.run_max[h];
        if (l == Scalar(0)) continue;  // every key of this run is masked for head h
        if (ws.sum[h] == Scalar(0)) {  // the block's first run with a visible key
          acc.row(h) = ws.o.row(h);
          ws.max[h] = m;
          ws.sum[h] = l;
          mass(c, h) = Scalar(1);
          continue;
        }
        const Scalar m_new = std::max(ws.max[h], m);
        const Scalar a = ws.sum[h] * std::exp(ws.max[h] - m_new), b = l * std::exp(m - m_new);
        ws.sum[h] = a + b;
        ws.max[h] = m_new;
        acc.row(h) = acc.row(h) * (a / ws.sum[h]) + ws.o.row(h) * (b / ws.sum[h]);
      }
    }
  });
}

}  // namespace kernels
}  // namespace c2f
