// c2f kernels — fixed-size chunks of a sequence: mean pooling and broadcasting chunk rows back to tokens;
// and, for training, their backward passes (chunk_sum, chunk_mean_backward_add). The folded fine
// attention on these grids: c2f/kernels/fine_folded.hpp.
//
// A sequence of length L is cut into m = ceil(L / chunk) chunks; chunk i of batch b holds the tokens
// [i·chunk, min((i+1)·chunk, L)) — the last one may be partial. Chunk rows are indexed c = b·m + i.
//
// The kernels take any *block grid*, of which ChunkGrid is the one-dimensional case: blocks() blocks,
// block c holding count(c) real tokens that lie in segments(c) runs of consecutive rows of the token
// matrix — run s starts at row segment_row(c, s) and holds segment_length(c, s) rows. Tokens are
// numbered inside a block run after run (j = 0 … count(c) − 1). A chunk is one run; a 2-D image block
// (kernels::BlockGrid2D in c2f/kernels/block2d.hpp) is one run per image row it covers. Blocks whose runs
// interleave in memory form a band, [c, band_end(c)): a block row of 2-D blocks; a chunk is its own band.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/cpu/stream_store.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/kernel_options.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
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
  Index band_end(Index c) const { return c + 1; }
};

/// Blocks [first, first + count) of a block grid, numbered from 0: the kernels below run on a range of
/// blocks through it (token rows keep their places in the whole token matrix: tokens() is the grid's).
template <class Grid>
struct BlockRange {
  const Grid& grid;
  Index first = 0, n = 0;

  Index blocks() const { return n; }
  Index tokens() const { return grid.tokens(); }
  void check(const char* kernel) const { grid.check(kernel); }
  Index count(Index c) const { return grid.count(first + c); }
  Index segments(Index c) const { return grid.segments(first + c); }
  Index segment_row(Index c, Index s) const { return grid.segment_row(first + c, s); }
  Index segment_length(Index c, Index s) const { return grid.segment_length(first + c, s); }
  Index band_end(Index c) const { return std::min(n, grid.band_end(first + c) - first); }
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

namespace impl {

/// sums[0, W·P) += run[t·ldx + ·] for the rows t < n that kept(t) accepts, in order, W Packets (of P
/// values) held in registers; Packet = Scalar is one column.
template <int W, class Packet, class Scalar, class Kept>
void add_rows_down(Scalar* sums, const Scalar* run, Index ldx, Index n, const Kept& kept) {
  constexpr Index kP = Eigen::internal::unpacket_traits<Packet>::size;
  Packet acc[W];
  for (int i = 0; i < W; ++i) acc[i] = Eigen::internal::ploadu<Packet>(sums + i * kP);
  for (Index t = 0; t < n; ++t) {
    if (!kept(t)) continue;
    for (int i = 0; i < W; ++i)
      acc[i] = Eigen::internal::padd(acc[i], Eigen::internal::ploadu<Packet>(run + t * ldx + i * kP));
  }
  for (int i = 0; i < W; ++i) Eigen::internal::pstoreu(sums + i * kP, acc[i]);
}

/// chunk_mean and chunk_mean_where: the mean of the tokens `keep(c, j)` accepts, NaN where none;
/// chunk_sum (Mean false): their sum.
template <class Scalar, class Grid, class Keep, bool Mean = true>
void chunk_mean_of(const char* kernel, const ConstRowMatrixRef<Scalar>& x, const Grid& grid, const Keep& keep,
                   RowMatrixRef<Scalar> out, const kernels::KernelOptions& options) {
  grid.check(kernel);
  detail::check_shape(kernel, "x", x, grid.tokens(), x.cols());
  detail::check_shape(kernel, "out", out, grid.blocks(), x.cols());
  const double work = detail::kElementWork * static_cast<double>(grid.tokens() * x.cols());
  using Packet = typename cpu::GemmBlocking<Scalar>::Packet;
  constexpr Index kP = cpu::GemmBlocking<Scalar>::kP;
  constexpr int kStrip = 8;  // packets of columns summed in registers down a run
  const Index d = x.cols(), ldx = x.outerStride();
  detail::parallel_for(grid.blocks(), options.num_threads(), work, [&](Index c, int) {
    typename RowMatrixRef<Scalar>::RowXpr o = out.row(c);
    o.setZero();
    Scalar* const sums = o.data();
    Index kept = 0;
    for (Index s = 0, j = 0; s < grid.segments(c); ++s) {
      const Index r0 = grid.segment_row(c, s), n = grid.segment_length(c, s);
      const Scalar* const run = x.data() + r0 * ldx;
      // Every column adds the run's kept rows in token order (the bits of adding row after row), a strip
      // of kStrip packets of columns at a time in registers: the sums are not reloaded and stored for
      // every row (the A/B: "Block means in register strips" in
      // git show 9944106:docs/benchmarks.md). Then the whole
      // packets left, then the columns left.
      const auto kept_row = [&](Index t) { return keep(c, j + t); };
      Index k0 = 0;
      for (; k0 + kStrip * kP <= d; k0 += kStrip * kP)
        add_rows_down<kStrip, Packet>(sums + k0, run + k0, ldx, n, kept_row);
      for (; k0 + kP <= d; k0 += kP) add_rows_down<1, Packet>(sums + k0, run + k0, ldx, n, kept_row);
      for (; k0 < d; ++k0) add_rows_down<1, Scalar>(sums + k0, run + k0, ldx, n, kept_row);
      for (Index t = 0; t < n; ++t, ++j) kept += keep(c, j) ? 1 : 0;
    }
    if constexpr (Mean) {
      if (kept == 0) {
        o.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      } else {
        o /= static_cast<Scalar>(kept);
      }
    }
  });
}

/// broadcast_chunks, broadcast_chunks_add and (Mean) chunk_mean_backward_add.
template <bool Add, class Scalar, class Grid, bool Mean = false>
void broadcast_rows(const char* kernel, const ConstRowMatrixRef<Scalar>& chunk_rows, const Grid& grid,
                    RowMatrixRef<Scalar> y, const kernels::KernelOptions& options) {
  grid.check(kernel);
  detail::check_shape(kernel, "chunk_rows", chunk_rows, grid.blocks(), y.cols());
  detail::check_shape(kernel, "y", y, grid.tokens(), chunk_rows.cols());
  const double work = detail::kElementWork * static_cast<double>(grid.tokens() * y.cols());
  // A large overwritten output is written with streaming stores (cpu/stream_store.hpp), unless it is
  // fresh memory (KernelOptions::fresh_output).
  const bool stream = !Add && !options.fresh_output() && cpu::has_stream_stores<Scalar>() &&
                      static_cast<std::size_t>(grid.tokens() * y.cols()) * sizeof(Scalar) >= cpu::kStreamStoreMinBytes;
  // A band per task, the task of its first block (the others have nothing to do): run s of every block
  // of the band, then run s + 1 — in address order.
  detail::parallel_for(grid.blocks(), options.num_threads(), work, [&](Index first, int) {
    if (first > 0 && grid.band_end(first - 1) != first) return;
    const Index end = grid.band_end(first);
    Index runs = 0;
    for (Index c = first; c < end; ++c) runs = std::max(runs, grid.segments(c));
    for (Index s = 0; s < runs; ++s) {
      for (Index c = first; c < end; ++c) {
        if (s >= grid.segments(c)) continue;
        typename RowMatrixRef<Scalar>::RowsBlockXpr rows =
            y.middleRows(grid.segment_row(c, s), grid.segment_length(c, s));
        if constexpr (Mean) {
          rows.rowwise() += chunk_rows.row(c) / static_cast<Scalar>(grid.count(c));
        } else if constexpr (Add) {
          rows.rowwise() += chunk_rows.row(c);
        } else if (stream) {
          for (Index r = 0; r < rows.rows(); ++r) cpu::copy_streaming(chunk_rows.row(c).data(), &rows(r, 0), y.cols());
        } else {
          rows.rowwise() = chunk_rows.row(c);
        }
      }
    }
    if (stream) cpu::stream_fence();
  });
}

}  // namespace impl

/// out[c] = mean of the real tokens of block c. x [rows, d], out [blocks, d]; `grid` is a ChunkGrid or
/// another block grid (see the file comment). Rows are added one after the other in token order,
/// streaming through memory (2.4× the bandwidth of Eigen's column-by-column colwise().sum() on a
/// 64-row run at d = 512).
/// Overwrites out.
template <class Scalar, class Grid>
void chunk_mean(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, RowMatrixRef<Scalar> out,
                const KernelOptions& options) {
  impl::chunk_mean_of(
      "chunk_mean", x, grid, [](Index, Index) { return true; }, out, options);
}

/// chunk_mean over the tokens `keep(c, j)` accepts (token j of block c, in the block's order): the mean of
/// those, or NaN in every feature when a block keeps none (a summary that ranks below every other in a
/// selection). With keep always true, the bits of chunk_mean.
template <class Scalar, class Grid, class Keep>
void chunk_mean_where(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, Keep&& keep, RowMatrixRef<Scalar> out,
                      const KernelOptions& options) {
  impl::chunk_mean_of("chunk_mean_where", x, grid, keep, out, options);
}

/// out[c] = the sum of the real tokens of block c (overwritten), added in token order: the backward pass
/// of broadcast_chunks (every token of a block read the block's row). x [rows, d], out [blocks, d].
template <class Scalar, class Grid>
void chunk_sum(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, RowMatrixRef<Scalar> out,
               const KernelOptions& options) {
  const auto all = [](Index, Index) { return true; };
  impl::chunk_mean_of<Scalar, Grid, decltype(all), false>("chunk_sum", x, grid, all, out, options);
}

/// y[token] = chunk_rows[block of token] for every real token (overwritten; rows of y that belong to
/// no block are left as they are). chunk_rows [blocks, d], y [rows, d]; `grid` is a ChunkGrid or
/// another block grid.
template <class Scalar, class Grid>
void broadcast_chunks(const ConstRowMatrixRef<Scalar>& chunk_rows, const Grid& grid, RowMatrixRef<Scalar> y,
                      const KernelOptions& options) {
  impl::broadcast_rows<false, Scalar>("broadcast_chunks", chunk_rows, grid, y, options);
}

/// broadcast_chunks, adding: y[token] += chunk_rows[block of token].
template <class Scalar, class Grid>
void broadcast_chunks_add(const ConstRowMatrixRef<Scalar>& chunk_rows, const Grid& grid, RowMatrixRef<Scalar> y,
                          const KernelOptions& options) {
  impl::broadcast_rows<true, Scalar>("broadcast_chunks_add", chunk_rows, grid, y, options);
}

/// The backward pass of chunk_mean: dx[token] += dmeans[block of token] / count(block) for every real
/// token (a partial block divides by its own count). dmeans [blocks, d], dx [rows, d]; rows of dx that
/// belong to no block are left as they are.
template <class Scalar, class Grid>
void chunk_mean_backward_add(const ConstRowMatrixRef<Scalar>& dmeans, const Grid& grid, RowMatrixRef<Scalar> dx,
                             const KernelOptions& options) {
  impl::broadcast_rows<true, Scalar, Grid, true>("chunk_mean_backward_add", dmeans, grid, dx, options);
}

}  // namespace kernels
}  // namespace c2f
