// c2f kernels — fixed-size chunks of a sequence: mean pooling, broadcasting chunk rows back to tokens,
// and the folded fine-attention step of coarse-to-fine attention; and, for training, their backward
// passes (chunk_sum, chunk_mean_backward_add, fine_attention_folded_backward and its naive twin).
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
#include "c2f/detail/bf16_gemm.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/masked_values.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/small_gemm.hpp"
#include "c2f/detail/softmax.hpp"
#include "c2f/detail/stream_store.hpp"
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

}  // namespace kernels
namespace detail {
/// sums[0, W·P) += run[t·ldx + ·] for the rows t < n that kept(t) accepts, in order, W Packets (of P
/// values) held in registers; Packet = Scalar is one column.
template <int W, class Packet, class Scalar, class Kept>
void add_rows_down(Scalar* sums, const Scalar* run, Index ldx, Index n, const Kept& kept) {
  constexpr Index kP = Eigen::internal::unpacket_traits<Packet>::size;
  Packet acc[W];
  for (int i = 0; i < W; ++i) acc[i] = Eigen::internal::ploadu<Packet>(sums + i * kP);
  for (Index t = 0; t < n; ++t) {
    if (!kept(t)) continue;
    for (int i = 0; i < W; ++i) acc[i] = Eigen::internal::padd(acc[i], Eigen::internal::ploadu<Packet>(run + t * ldx + i * kP));
  }
  for (int i = 0; i < W; ++i) Eigen::internal::pstoreu(sums + i * kP, acc[i]);
}

/// chunk_mean and chunk_mean_where: the mean of the tokens `keep(c, j)` accepts, NaN where none;
/// chunk_sum (Mean false): their sum.
template <class Scalar, class Grid, class Keep, bool Mean = true>
void chunk_mean_of(const char* kernel, const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid, const Keep& keep,
                   Eigen::Ref<RowMatrix<Scalar>> out, const kernels::KernelOptions& options) {
  grid.check(kernel);
  check_shape(kernel, "x", x, grid.tokens(), x.cols());
  check_shape(kernel, "out", out, grid.blocks(), x.cols());
  const double work = kElementWork * static_cast<double>(grid.tokens() * x.cols());
  using Packet = typename GemmBlocking<Scalar>::Packet;
  constexpr Index kP = GemmBlocking<Scalar>::kP;
  constexpr int kStrip = 8;  // packets of columns summed in registers down a run
  const Index d = x.cols(), ldx = x.outerStride();
  parallel_for(grid.blocks(), options.num_threads(), work, [&](Index c, int) {
    typename Eigen::Ref<RowMatrix<Scalar>>::RowXpr o = out.row(c);
    o.setZero();
    Scalar* const sums = o.data();
    Index kept = 0;
    for (Index s = 0, j = 0; s < grid.segments(c); ++s) {
      const Index r0 = grid.segment_row(c, s), n = grid.segment_length(c, s);
      const Scalar* const run = x.data() + r0 * ldx;
      // Every column adds the run's kept rows in token order (the bits of adding row after row), a strip
      // of kStrip packets of columns at a time in registers: the sums are not reloaded and stored for
      // every row (measured: docs/benchmarks.md, "Block means in register strips"). Then the whole
      // packets left, then the columns left.
      const auto kept_row = [&](Index t) { return keep(c, j + t); };
      Index k0 = 0;
      for (; k0 + kStrip * kP <= d; k0 += kStrip * kP) add_rows_down<kStrip, Packet>(sums + k0, run + k0, ldx, n, kept_row);
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

/// out[c] = the sum of the real tokens of block c (overwritten), added in token order: the backward pass
/// of broadcast_chunks (every token of a block read the block's row). x [rows, d], out [blocks, d].
template <class Scalar, class Grid>
void chunk_sum(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid, Eigen::Ref<RowMatrix<Scalar>> out,
               const KernelOptions& options) {
  const auto all = [](Index, Index) { return true; };
  detail::chunk_mean_of<Scalar, Grid, decltype(all), false>("chunk_sum", x, grid, all, out, options);
}

}  // namespace kernels
namespace detail {

/// broadcast_chunks, broadcast_chunks_add and (Mean) chunk_mean_backward_add.
template <bool Add, class Scalar, class Grid, bool Mean = false>
void broadcast_rows(const char* kernel, const Eigen::Ref<const RowMatrix<Scalar>>& chunk_rows, const Grid& grid,
                    Eigen::Ref<RowMatrix<Scalar>> y, const kernels::KernelOptions& options) {
  grid.check(kernel);
  check_shape(kernel, "chunk_rows", chunk_rows, grid.blocks(), y.cols());
  check_shape(kernel, "y", y, grid.tokens(), chunk_rows.cols());
  const double work = kElementWork * static_cast<double>(grid.tokens() * y.cols());
  // A large overwritten output is written with streaming stores (detail/stream_store.hpp), unless it is
  // fresh memory (KernelOptions::fresh_output).
  const bool stream = !Add && !options.fresh_output() && has_stream_stores<Scalar>() &&
                      static_cast<std::size_t>(grid.tokens() * y.cols()) * sizeof(Scalar) >= kStreamStoreMinBytes;
  // A band per task, the task of its first block (the others have nothing to do): run s of every block
  // of the band, then run s + 1 — in address order.
  parallel_for(grid.blocks(), options.num_threads(), work, [&](Index first, int) {
    if (first > 0 && grid.band_end(first - 1) != first) return;
    const Index end = grid.band_end(first);
    Index runs = 0;
    for (Index c = first; c < end; ++c) runs = std::max(runs, grid.segments(c));
    for (Index s = 0; s < runs; ++s) {
      for (Index c = first; c < end; ++c) {
        if (s >= grid.segments(c)) continue;
        typename Eigen::Ref<RowMatrix<Scalar>>::RowsBlockXpr rows = y.middleRows(grid.segment_row(c, s), grid.segment_length(c, s));
        if constexpr (Mean) {
          rows.rowwise() += chunk_rows.row(c) / static_cast<Scalar>(grid.count(c));
        } else if constexpr (Add) {
          rows.rowwise() += chunk_rows.row(c);
        } else if (stream) {
          for (Index r = 0; r < rows.rows(); ++r) copy_streaming(chunk_rows.row(c).data(), &rows(r, 0), y.cols());
        } else {
          rows.rowwise() = chunk_rows.row(c);
        }
      }
    }
    if (stream) stream_fence();
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

/// The backward pass of chunk_mean: dx[token] += dmeans[block of token] / count(block) for every real
/// token (a partial block divides by its own count). dmeans [blocks, d], dx [rows, d]; rows of dx that
/// belong to no block are left as they are.
template <class Scalar, class Grid>
void chunk_mean_backward_add(const Eigen::Ref<const RowMatrix<Scalar>>& dmeans, const Grid& grid,
                             Eigen::Ref<RowMatrix<Scalar>> dx, const KernelOptions& options) {
  detail::broadcast_rows<true, Scalar, Grid, true>("chunk_mean_backward_add", dmeans, grid, dx, options);
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
/// softmax then Σ p x. Working memory: heads × (longest run + d) values per worker (bfloat16: also
/// (heads + longest run) × d). In fp32 the two products per run read the run in place
/// (detail/small_gemm.hpp): no packed copy of x.
/// With options.compute() == Compute::BFloat16 (float only) the products' operands are rounded to
/// bfloat16 — qk, x (a rounded copy of each run, made once) and the probabilities — and summed in fp32
/// (docs/bf16.md).
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
  const bool bf16 = detail::check_compute<Scalar>("fine_attention_folded", options.compute());
  struct Workspace {
    RowMatrix<Scalar> p, o;            // one run: scores [heads, run length] and pooled rows [heads, d]
    Vector<Scalar> max, sum;           // per head: the block's running max and softmax sum
    Vector<Scalar> run_max, run_sum;   // per head: the run's
    RowMatrix<Scalar> q16, x16;        // Compute::BFloat16: the block's qk and the run's tokens, rounded
  };
  // The run's two products. Compute::BFloat16 rounds the run's tokens once into x16 (one sequential
  // pass; the products then read every value several times, from cache) and the probabilities in place.
  const auto scores = [&](const Scalar* q, const Scalar* xs, Index ldx, Index n, Scalar* p, const Scalar* next, Index next_n) {
    detail::dot_rows<Scalar>(q, heads, d, xs, ldx, n, p, n, next, next_n);
  };
  const auto pool = [&](Scalar* p, Index n, const Scalar* xs, Index ldx, Scalar* o) {
    if (bf16) detail::round_bf16_rows(p, heads, n, n);
    detail::weighted_rows<Scalar>(p, n, heads, n, xs, ldx, d, o, d);
  };
  const double work = static_cast<double>(grid.tokens() * heads) * (4.0 * static_cast<double>(d) + detail::kElementWork);
  // A task is a range of consecutive blocks, so that while one block is scored the next one's tokens can
  // be asked for (`next` below): a worker claims tasks one at a time, and with one block per task the
  // next block was usually another worker's. Every block is computed alone: the bits do not depend on
  // the grouping or the thread count.
  const Index blocks = grid.blocks();
  const Index workers = detail::resolve_threads(options.num_threads(), blocks);
  const Index per_task = std::max<Index>(1, std::min<Index>(16, blocks / (4 * workers)));
  const Index tasks = detail::ceil_div(blocks, per_task);
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    const Index c_end = std::min(blocks, (task + 1) * per_task);
    for (Index c = task * per_task; c < c_end; ++c) {
      if (ws.max.size() != heads) {
        ws.max.resize(heads);
        ws.sum.resize(heads);
        ws.run_max.resize(heads);
        ws.run_sum.resize(heads);
      }
      const Scalar* q = qk.row(c).data();
      if (bf16) {
        if (ws.q16.rows() != heads || ws.q16.cols() != d) ws.q16.resize(heads, d);
        detail::round_bf16_rows<Scalar>(q, d, heads, d, ws.q16.data(), d);
        q = ws.q16.data();
      }
      Eigen::Map<RowMatrix<Scalar>> acc(pooled.row(c).data(), heads, d);
      for (Index s = 0, j0 = 0; s < grid.segments(c); ++s) {
        const Index n = grid.segment_length(c, s);
        const typename Eigen::Ref<const RowMatrix<Scalar>>::ConstRowsBlockXpr xs = x.middleRows(grid.segment_row(c, s), n);
        if (ws.p.rows() != heads || ws.p.cols() != n) ws.p.resize(heads, n);
        const Scalar* xd = xs.data();
        Index ldx = x.outerStride();
        if (bf16) {
          if (ws.x16.rows() != n || ws.x16.cols() != d) ws.x16.resize(n, d);
          detail::round_bf16_rows<Scalar>(xs.data(), x.outerStride(), n, d, ws.x16.data(), d);
          xd = ws.x16.data();
          ldx = d;
        }
        // The next run — of this block, or the first of the task's next block — read ahead while this
        // one is scored.
        const bool more = s + 1 < grid.segments(c), ahead = more || c + 1 < c_end;
        const Index next_c = more ? c : c + 1, next_s = more ? s + 1 : 0;
        const Scalar* next = ahead ? x.data() + grid.segment_row(next_c, next_s) * x.outerStride() : nullptr;
        scores(q, xd, ldx, n, ws.p.data(), next, ahead ? grid.segment_length(next_c, next_s) : 0);  // p = q xsᵀ
        for (Index h = 0; h < heads; ++h) {
          for (Index j = 0; j < n; ++j) ws.p(h, j) = detail::add_bias(ws.p(h, j), bias(c, h, j0 + j));
          const bool visible = detail::softmax_row(ws.p.row(h), &ws.run_max[h], &ws.run_sum[h]);
          if (s == 0) mass(c, h) = visible ? Scalar(1) : Scalar(0);
        }
        j0 += n;
        if (s == 0) {
          pool(ws.p.data(), n, xd, ldx, acc.data());  // p xs
          ws.max = ws.run_max;
          ws.sum = ws.run_sum;
          continue;
        }
        // Merge the run into the block: o_block = (L·e^(M−M')·o_block + l·e^(m−M')·o_run) / (L·e^(M−M') + l·e^(m−M')).
        if (ws.o.rows() != heads || ws.o.cols() != d) ws.o.resize(heads, d);
        pool(ws.p.data(), n, xd, ldx, ws.o.data());
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
    }
  });
}


}  // namespace kernels
namespace detail {
/// The entry checks of fine_attention_folded_backward and its twin.
template <class Scalar, class Grid>
void check_folded_backward(const char* kernel, const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid,
                           const Eigen::Ref<const RowMatrix<Scalar>>& qk, Index heads,
                           const Eigen::Ref<const RowMatrix<Scalar>>& dpooled, const Eigen::Ref<RowMatrix<Scalar>>& dx,
                           const Eigen::Ref<RowMatrix<Scalar>>& dqk) {
  const Index d = x.cols();
  grid.check(kernel);
  check_heads(kernel, heads * d, heads);
  check_shape(kernel, "x", x, grid.tokens(), d);
  check_shape(kernel, "qk", qk, grid.blocks(), heads * d);
  check_shape(kernel, "dpooled", dpooled, grid.blocks(), heads * d);
  check_shape(kernel, "dx", dx, grid.tokens(), d);
  check_shape(kernel, "dqk", dqk, grid.blocks(), heads * d);
}
}  // namespace detail
namespace kernels {

/// The backward pass of fine_attention_folded for dpooled = dL/dpooled [blocks, heads·d] (mass needs none:
/// it is 1 or 0 whatever x and qk are). For every block c and head h, with p_j the forward's softmax
/// weights over the block's real tokens (recomputed from x, qk and bias):
///   r_j = dpooled[c, h]·x_j,   D = Σ_j p_j r_j,   ds_j = p_j (r_j − D)
///   dx_j = Σ_h p_hj dpooled[c, h] + ds_hj qk[c, h]      (overwritten, every real token of the block)
///   dqk[c, h] = Σ_j ds_hj x_j                            (overwritten)
/// A head that sees no token of a block (every bias −inf) gives zero there. Tasks are blocks: a block's rows
/// of dx and its row of dqk are its own, so the bits do not depend on the thread count. Working memory:
/// two [heads, count] blocks per worker. Twin: fine_attention_folded_backward_naive.
template <class Scalar, class Grid, class Bias>
void fine_attention_folded_backward(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid,
                                    const Eigen::Ref<const RowMatrix<Scalar>>& qk, Index heads,
                                    const Eigen::Ref<const RowMatrix<Scalar>>& dpooled, Bias&& bias,
                                    Eigen::Ref<RowMatrix<Scalar>> dx, Eigen::Ref<RowMatrix<Scalar>> dqk,
                                    const KernelOptions& options) {
  const char* kernel = "fine_attention_folded_backward";
  const Index d = x.cols();
  detail::check_folded_backward(kernel, x, grid, qk, heads, dpooled, dx, dqk);
  struct Workspace {
    RowMatrix<Scalar> p, ds;  // [heads, count]: the weights, then r and ds = p ∘ (r − D)
  };
  const double work = static_cast<double>(grid.tokens() * heads) * (8.0 * static_cast<double>(d) + detail::kElementWork);
  detail::parallel_for_each_worker<Workspace>(grid.blocks(), options.num_threads(), work, [&](Index c, Workspace& ws) {
    const Index n = grid.count(c);
    ws.p.resize(heads, n);
    ws.ds.resize(heads, n);
    const Eigen::Map<const RowMatrix<Scalar>> q(qk.row(c).data(), heads, d), g(dpooled.row(c).data(), heads, d);
    Eigen::Map<RowMatrix<Scalar>> dq(dqk.row(c).data(), heads, d);
    for (Index s = 0, j0 = 0; s < grid.segments(c); ++s) {
      const Index len = grid.segment_length(c, s);
      const typename Eigen::Ref<const RowMatrix<Scalar>>::ConstRowsBlockXpr xs = x.middleRows(grid.segment_row(c, s), len);
      ws.p.middleCols(j0, len).noalias() = q * xs.transpose();
      ws.ds.middleCols(j0, len).noalias() = g * xs.transpose();  // r
      j0 += len;
    }
    for (Index h = 0; h < heads; ++h) {
      for (Index j = 0; j < n; ++j) ws.p(h, j) = detail::add_bias(ws.p(h, j), bias(c, h, j));
      detail::softmax_row(ws.p.row(h));
      const Scalar rowdot = ws.p.row(h).dot(ws.ds.row(h));
      ws.ds.row(h) = ws.p.row(h).cwiseProduct((ws.ds.row(h).array() - rowdot).matrix());
    }
    dq.setZero();
    for (Index s = 0, j0 = 0; s < grid.segments(c); ++s) {
      const Index r0 = grid.segment_row(c, s), len = grid.segment_length(c, s);
      typename Eigen::Ref<RowMatrix<Scalar>>::RowsBlockXpr dxs = dx.middleRows(r0, len);
      dxs.noalias() = ws.p.middleCols(j0, len).transpose() * g;
      dxs.noalias() += ws.ds.middleCols(j0, len).transpose() * q;
      dq.noalias() += ws.ds.middleCols(j0, len) * x.middleRows(r0, len);
      j0 += len;
    }
  });
}

/// Twin of fine_attention_folded_backward, obviously correct and slow: per block, its token rows listed run
/// after run; per head one scalar loop per formula — the weights p by softmax_row of the scores, dp_j =
/// dpooled·x_j, ds_j = p_j (dp_j − Σ_i p_i dp_i), then dx_j += p_j dpooled + ds_j qk and dqk += ds_j x_j.
template <class Scalar, class Grid, class Bias>
void fine_attention_folded_backward_naive(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid,
                                          const Eigen::Ref<const RowMatrix<Scalar>>& qk, Index heads,
                                          const Eigen::Ref<const RowMatrix<Scalar>>& dpooled, Bias&& bias,
                                          Eigen::Ref<RowMatrix<Scalar>> dx, Eigen::Ref<RowMatrix<Scalar>> dqk) {
  const Index d = x.cols();
  detail::check_folded_backward("fine_attention_folded_backward_naive", x, grid, qk, heads, dpooled, dx, dqk);
  for (Index c = 0; c < grid.blocks(); ++c) {
    std::vector<Index> tokens;
    for (Index s = 0; s < grid.segments(c); ++s) {
      for (Index r = 0; r < grid.segment_length(c, s); ++r) tokens.push_back(grid.segment_row(c, s) + r);
    }
    const Index n = static_cast<Index>(tokens.size());
    for (Index t : tokens) dx.row(t).setZero();
    dqk.row(c).setZero();
    for (Index h = 0; h < heads; ++h) {
      Eigen::Matrix<Scalar, 1, Eigen::Dynamic> p(n), dp(n);
      for (Index j = 0; j < n; ++j) {
        Scalar s = 0, r = 0;
        for (Index k = 0; k < d; ++k) {
          s += qk(c, h * d + k) * x(tokens[static_cast<std::size_t>(j)], k);
          r += dpooled(c, h * d + k) * x(tokens[static_cast<std::size_t>(j)], k);
        }
        p[j] = detail::add_bias(s, bias(c, h, j));
        dp[j] = r;
      }
      detail::softmax_row(p);
      Scalar rowdot = 0;
      for (Index j = 0; j < n; ++j) rowdot += p[j] * dp[j];
      for (Index j = 0; j < n; ++j) {
        const Index t = tokens[static_cast<std::size_t>(j)];
        const Scalar ds = p[j] * (dp[j] - rowdot);
        for (Index k = 0; k < d; ++k) {
          dx(t, k) += p[j] * dpooled(c, h * d + k) + ds * qk(c, h * d + k);
          dqk(c, h * d + k) += ds * x(t, k);
        }
      }
    }
  }
}

}  // namespace kernels
}  // namespace c2f
