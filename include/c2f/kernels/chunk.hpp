// c2f kernels — fixed-size chunks of a sequence: mean pooling, broadcasting chunk rows back to tokens,
// and the folded fine-attention step of coarse-to-fine attention.
//
// A sequence of length L is cut into m = ceil(L / chunk) chunks; chunk i of batch b holds the tokens
// [i·chunk, min((i+1)·chunk, L)) — the last one may be partial. Chunk rows are indexed c = b·m + i.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/softmax.hpp"

namespace c2f {
namespace kernels {

/// Chunks of a [batch, length] sequence.
struct ChunkGrid {
  Index batch = 0, length = 0, chunk = 1;

  Index chunks_per_batch() const { return length == 0 ? 0 : (length + chunk - 1) / chunk; }
  Index chunks() const { return batch * chunks_per_batch(); }
  /// First token (within its batch) and number of real tokens of chunk c = b·m + i.
  Index first(Index c) const { return (c % chunks_per_batch()) * chunk; }
  Index count(Index c) const { return std::min(chunk, length - first(c)); }
  /// Row of token 0 of chunk c in the [batch·length, features] token matrix.
  Index row(Index c) const { return (c / chunks_per_batch()) * length + first(c); }
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

/// out[c] = mean of the real tokens of chunk c (overwritten). x [batch·length, d], out [chunks, d].
template <class Scalar>
void chunk_mean(const Eigen::Ref<const RowMatrix<Scalar>>& x, const ChunkGrid& grid, Eigen::Ref<RowMatrix<Scalar>> out,
                int num_threads) {
  detail::check_grid("chunk_mean", grid);
  detail::check_shape("chunk_mean", "x", x, grid.batch * grid.length, x.cols());
  detail::check_shape("chunk_mean", "out", out, grid.chunks(), x.cols());
  const double work = detail::kElementWork * static_cast<double>(grid.batch * grid.length * x.cols());
  detail::parallel_for(grid.chunks(), num_threads, work, [&](Index c, int) {
    out.row(c) = x.middleRows(grid.row(c), grid.count(c)).colwise().sum() / static_cast<Scalar>(grid.count(c));
  });
}

/// y[token] = chunk_rows[chunk of token] for every real token: overwrites y, or adds to it with
/// `accumulate`. chunk_rows [chunks, d], y [batch·length, d].
template <class Scalar>
void broadcast_chunks(const Eigen::Ref<const RowMatrix<Scalar>>& chunk_rows, const ChunkGrid& grid,
                      Eigen::Ref<RowMatrix<Scalar>> y, int num_threads, bool accumulate = false) {
  detail::check_grid("broadcast_chunks", grid);
  detail::check_shape("broadcast_chunks", "chunk_rows", chunk_rows, grid.chunks(), y.cols());
  detail::check_shape("broadcast_chunks", "y", y, grid.batch * grid.length, chunk_rows.cols());
  const double work = detail::kElementWork * static_cast<double>(grid.batch * grid.length * y.cols());
  detail::parallel_for(grid.chunks(), num_threads, work, [&](Index c, int) {
    if (accumulate) {
      y.middleRows(grid.row(c), grid.count(c)).rowwise() += chunk_rows.row(c);
    } else {
      y.middleRows(grid.row(c), grid.count(c)).rowwise() = chunk_rows.row(c);
    }
  });
}

/// The folded fine-attention step. For every chunk c and head h, with one query per chunk:
///   p_c,h = softmax_j( qk[c, h] · x_j + bias(c, h, j) )  over the real tokens j of chunk c,
///   pooled[c, h] = Σ_j p_c,h[j] x_j   and   mass[c, h] = Σ_j p_c,h[j]  (1, or 0 if all keys are masked).
/// x [batch·length, d]; qk [chunks, heads·d] holds, per head, the query already multiplied into the key
/// projection and by the softmax scale (q_h W_k,h / sqrt(d_k)), so no scale is applied here; pooled
/// [chunks, heads·d] and mass [chunks, heads] are overwritten.
/// `bias(c, h, j)` returns 0, an additive value or -inf (masked). Masked keys get exactly 0 weight.
template <class Scalar, class Bias>
void fine_attention_folded(const Eigen::Ref<const RowMatrix<Scalar>>& x, const ChunkGrid& grid,
                           const Eigen::Ref<const RowMatrix<Scalar>>& qk, Index heads, Bias&& bias,
                           Eigen::Ref<RowMatrix<Scalar>> pooled, Eigen::Ref<RowMatrix<Scalar>> mass, int num_threads) {
  const Index d = x.cols();
  detail::check_grid("fine_attention_folded", grid);
  detail::check_heads("fine_attention_folded", heads * d, heads);
  detail::check_shape("fine_attention_folded", "x", x, grid.batch * grid.length, d);
  detail::check_shape("fine_attention_folded", "qk", qk, grid.chunks(), heads * d);
  detail::check_shape("fine_attention_folded", "pooled", pooled, grid.chunks(), heads * d);
  detail::check_shape("fine_attention_folded", "mass", mass, grid.chunks(), heads);
  const double work =
      static_cast<double>(grid.batch * grid.length * heads) * (4.0 * static_cast<double>(d) + detail::kElementWork);
  detail::parallel_for(grid.chunks(), num_threads, work, [&](Index c, int) {
    const Index n = grid.count(c);
    const typename Eigen::Ref<const RowMatrix<Scalar>>::ConstRowsBlockXpr xc = x.middleRows(grid.row(c), n);
    const Eigen::Map<const RowMatrix<Scalar>> q(qk.row(c).data(), heads, d);
    RowMatrix<Scalar> p(heads, n);
    p.noalias() = q * xc.transpose();
    for (Index h = 0; h < heads; ++h) {
      for (Index j = 0; j < n; ++j) p(h, j) += bias(c, h, j);
      mass(c, h) = detail::softmax_row(p.row(h)) ? Scalar(1) : Scalar(0);
    }
    Eigen::Map<RowMatrix<Scalar>>(pooled.row(c).data(), heads, d).noalias() = p * xc;
  });
}

}  // namespace kernels
}  // namespace c2f
