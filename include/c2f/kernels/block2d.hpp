// c2f kernels — two-dimensional blocks of an image-like token grid (ViT patch tokens).
//
// Tokens of an H × W grid are flattened row-major (token y·W + x), [batch, H·W, d], as ViT patch
// embeddings are. The grid is cut into Mh = ceil(H / block_h) × Mw = ceil(W / block_w) blocks; block
// (r, c) holds rows [r·block_h, min((r+1)·block_h, H)) × columns [c·block_w, min((c+1)·block_w, W)) — edge
// blocks may be partial. Blocks are numbered row-major, n = r·Mw + c, and block n of batch b has index
// b·Mh·Mw + n; its tokens are numbered row-major inside the block.
//
// BlockGrid2D is a block grid in the sense of c2f/kernels/chunk.hpp: each block is one run of
// consecutive token rows per image row it covers, so chunk_mean, broadcast_chunks and
// fine_attention_folded work on it unchanged, reading the tokens in place — no permuted copy of x.
// The *_naive functions below are the obviously-correct twins: they find a block's tokens from their
// coordinates, one token at a time.
//
// For training: relative_position_bias_backward, the gradient of Swin's relative position bias table
// (AttnMask::relative_position: the coarse stage's score bias between blocks), and its naive twin.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/masked_values.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/mask_view.hpp"

#include <algorithm>
#include <limits>
#include <vector>

namespace c2f {
namespace kernels {

/// The 2-D blocks of a [batch, height·width] token grid.
struct BlockGrid2D {
  Index batch = 0, height = 0, width = 0, block_h = 1, block_w = 1;

  Index blocks_h() const { return height == 0 || width == 0 ? 0 : detail::ceil_div(height, block_h); }
  Index blocks_w() const { return height == 0 || width == 0 ? 0 : detail::ceil_div(width, block_w); }
  Index blocks_per_batch() const { return blocks_h() * blocks_w(); }
  /// Block c = b·Mh·Mw + r·Mw + col: its block row r and block column col.
  Index block_row(Index c) const { return (c % blocks_per_batch()) / blocks_w(); }
  Index block_col(Index c) const { return (c % blocks_per_batch()) % blocks_w(); }
  /// Image rows and columns block c covers.
  Index rows(Index c) const { return std::min(block_h, height - block_row(c) * block_h); }
  Index cols(Index c) const { return std::min(block_w, width - block_col(c) * block_w); }

  // The block-grid interface of c2f/kernels/chunk.hpp.
  Index blocks() const { return batch * blocks_per_batch(); }
  /// Rows of the token matrix.
  Index tokens() const { return batch * height * width; }
  /// Throws unless the sizes are >= 0 and the blocks >= 1 × 1.
  void check(const char* kernel) const {
    if (batch < 0 || height < 0 || width < 0 || block_h < 1 || block_w < 1) {
      detail::fail(kernel, ": the block grid needs batch, height, width >= 0 and blocks >= 1 x 1, got batch=", batch,
                   ", ", height, " x ", width, " in blocks of ", block_h, " x ", block_w);
    }
  }
  Index count(Index c) const { return rows(c) * cols(c); }
  Index segments(Index c) const { return rows(c); }
  /// Token row (in the [batch·height·width, d] matrix) of the first token of image row s of block c.
  Index segment_row(Index c, Index s) const {
    const Index b = c / blocks_per_batch();
    return (b * height + block_row(c) * block_h + s) * width + block_col(c) * block_w;
  }
  Index segment_length(Index c, Index) const { return cols(c); }
  /// The end of block c's block row: its blocks' runs interleave image row by image row.
  Index band_end(Index c) const { return c - block_col(c) + blocks_w(); }
};

/// Row of token (y, x) of batch b in the [batch·height·width, d] token matrix, and its block index.
inline Index token_row(const BlockGrid2D& g, Index b, Index y, Index x) { return (b * g.height + y) * g.width + x; }
inline Index token_block(const BlockGrid2D& g, Index b, Index y, Index x) {
  return b * g.blocks_per_batch() + (y / g.block_h) * g.blocks_w() + x / g.block_w;
}

/// Twin of chunk_mean on a BlockGrid2D: every token adds itself to its block's sum, then each sum is
/// divided by its block's token count. x [batch·H·W, d], out [blocks, d].
template <class Scalar>
void block_mean_naive(const ConstRowMatrixRef<Scalar>& x, const BlockGrid2D& g, RowMatrixRef<Scalar> out) {
  out.setZero();
  std::vector<Index> count(static_cast<std::size_t>(g.blocks()), 0);
  for (Index b = 0; b < g.batch; ++b) {
    for (Index y = 0; y < g.height; ++y) {
      for (Index xi = 0; xi < g.width; ++xi) {
        const Index c = token_block(g, b, y, xi);
        out.row(c) += x.row(token_row(g, b, y, xi));
        ++count[static_cast<std::size_t>(c)];
      }
    }
  }
  for (Index c = 0; c < g.blocks(); ++c) out.row(c) /= static_cast<Scalar>(count[static_cast<std::size_t>(c)]);
}

/// Twin of fine_attention_folded on a BlockGrid2D: gathers each block's tokens by their coordinates
/// (row-major inside the block), takes one softmax over all of them per head, and sums p_j x_j.
template <class Scalar, class Bias>
void fine_attention_folded_naive(const ConstRowMatrixRef<Scalar>& x, const BlockGrid2D& g,
                                 const ConstRowMatrixRef<Scalar>& qk, Index heads, RowMatrixRef<Scalar> pooled,
                                 RowMatrixRef<Scalar> mass, Bias&& bias) {
  const Index d = x.cols();
  for (Index c = 0; c < g.blocks(); ++c) {
    const Index b = c / g.blocks_per_batch();
    std::vector<Index> tokens;
    for (Index y = 0; y < g.height; ++y) {
      for (Index xi = 0; xi < g.width; ++xi) {
        if (token_block(g, b, y, xi) == c) tokens.push_back(token_row(g, b, y, xi));
      }
    }
    for (Index h = 0; h < heads; ++h) {
      Eigen::Matrix<Scalar, 1, Eigen::Dynamic> p(static_cast<Index>(tokens.size()));
      for (std::size_t j = 0; j < tokens.size(); ++j) {
        Scalar s = 0;
        for (Index k = 0; k < d; ++k) s += qk(c, h * d + k) * x(tokens[j], k);
        p[static_cast<Index>(j)] = cpu::add_bias(s, bias(c, h, static_cast<Index>(j)));
      }
      mass(c, h) = cpu::softmax_row(p) ? Scalar(1) : Scalar(0);
      for (Index k = 0; k < d; ++k) {
        Scalar acc = 0;
        for (std::size_t j = 0; j < tokens.size(); ++j) acc += p[static_cast<Index>(j)] * x(tokens[j], k);
        pooled(c, h * d + k) = acc;
      }
    }
  }
}

namespace impl {

/// Row of the relative position bias table between positions i and j of a grid_w-wide grid, for a table
/// covering max_h × max_w (AttnMask::relative_position's index).
inline Index relative_position_entry(Index i, Index j, Index grid_w, Index max_h, Index max_w) {
  return (i / grid_w - j / grid_w + max_h - 1) * (2 * max_w - 1) + (i % grid_w - j % grid_w + max_w - 1);
}

/// The entry checks of relative_position_bias_backward and its twin: a self-attention problem over the
/// grid_h · grid_w positions, dout shaped like out, dtable [(2·max_h − 1)·(2·max_w − 1), heads].
template <class Scalar>
void check_table_backward(const char* kernel, const kernels::HeadsView<const Scalar>& q,
                          const kernels::HeadsView<const Scalar>& k, const kernels::HeadsView<const Scalar>& v,
                          const kernels::HeadsView<const Scalar>& dout, const MaskView<Scalar>& mask, Index grid_h,
                          Index grid_w, Index max_h, Index max_w, Scalar scale, const RowMatrixRef<Scalar>& dtable) {
  detail::check_sdpa(kernel, q, k, v, dout, mask, scale);
  const auto refuse = [&] {
    detail::fail(kernel, ": a self-attention problem over a grid of grid_h x grid_w <= max_h x max_w positions, got ",
                 q.seq, " queries, ", k.seq, " keys, grid ", grid_h, " x ", grid_w, " and max ", max_h, " x ", max_w);
  };
  if (max_h < 1 || max_w < 1 || grid_h < 0 || grid_w < 0 || grid_h > max_h || grid_w > max_w) refuse();
  // The table's rows, checked: they bound grid_h · grid_w too.
  const Index entries = detail::relative_table_entries(max_h, max_w, kernel);
  if (q.seq != grid_h * grid_w || k.seq != q.seq) refuse();
  detail::check_shape(kernel, "dtable", dtable, entries, q.heads);
}

}  // namespace impl

/// The gradient of a relative position bias table (AttnMask::relative_position(table, grid_h, grid_w,
/// max_h, max_w), added to the scores of self-attention over the grid's positions) from the attention's
/// forward — q, k, v, its output `out` and per-row log-sum-exp `lse` [batch·heads, positions]
/// (sdpa_train, the same mask and scale) — and the output's gradient dout: for every (b, h, i, j) the
/// score's gradient dS = P_ij (dout_i · v_j − dout_i · out_i), P = exp(scale · q_i·k_j + mask − lse_i)
/// recomputed, summed into dtable[entry(i, j), h] (overwritten, [(2·max_h − 1)·(2·max_w − 1), heads]).
/// Tasks are heads (each owns its column, summed in double in (b, i, j) order), so the bits do not depend
/// on the thread count; working memory one block of 64 query rows × the positions per worker.
/// Twin: relative_position_bias_backward_naive.
template <class Scalar>
void relative_position_bias_backward(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                                     const HeadsView<const Scalar>& v, const HeadsView<const Scalar>& out,
                                     const ConstRowMatrixRef<Scalar>& lse, const HeadsView<const Scalar>& dout,
                                     const MaskView<Scalar>& mask, Index grid_h, Index grid_w, Index max_h, Index max_w,
                                     Scalar scale, RowMatrixRef<Scalar> dtable, const KernelOptions& options) {
  const char* kernel = "relative_position_bias_backward";
  impl::check_table_backward(kernel, q, k, v, dout, mask, grid_h, grid_w, max_h, max_w, scale, dtable);
  detail::check_sdpa(kernel, q, k, v, out, mask, scale);
  impl::check_lse(kernel, q, lse);
  const Index n = q.seq, heads = q.heads;
  constexpr Index kRows = 64;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const double work = 2.0 * detail::attention_work(q.batch * heads, n, n, q.dim, v.dim);
  detail::parallel_for(heads, options.num_threads(), work, [&](Index h, int) {
    Eigen::Matrix<double, Eigen::Dynamic, 1> sum = Eigen::Matrix<double, Eigen::Dynamic, 1>::Zero(dtable.rows());
    RowMatrix<Scalar> s, dp;
    Vector<Scalar> rowdot;
    for (Index b = 0; b < q.batch; ++b) {
      const Index bh = b * heads + h;
      for (Index i0 = 0; i0 < n; i0 += kRows) {
        const Index ni = std::min(kRows, n - i0);
        s.noalias() = (q.block(b, h, i0, ni) * scale) * k.block(b, h, 0, n).transpose();
        mask.apply(b, h, i0, 0, s);
        for (Index r = 0; r < ni; ++r) {
          if (lse(bh, i0 + r) == kNegInf) {
            s.row(r).setZero();  // a row that sees no key gives no gradient
          } else {
            cpu::exp_shifted(s.row(r), lse(bh, i0 + r));
          }
        }
        const typename HeadsView<const Scalar>::Block g = dout.block(b, h, i0, ni);
        dp.noalias() = g * v.block(b, h, 0, n).transpose();
        rowdot = g.cwiseProduct(out.block(b, h, i0, ni)).rowwise().sum();
        for (Index r = 0; r < ni; ++r) {
          for (Index j = 0; j < n; ++j) {
            if (s(r, j) == Scalar(0)) continue;  // masked (or underflowed): no gradient, even from a NaN dp
            sum[impl::relative_position_entry(i0 + r, j, grid_w, max_h, max_w)] +=
                static_cast<double>(s(r, j) * (dp(r, j) - rowdot[r]));
          }
        }
      }
    }
    dtable.col(h) = sum.template cast<Scalar>();
  });
}

/// Twin of relative_position_bias_backward, obviously correct and slow: per (batch, head) the
/// probabilities P [positions, positions] from q, k and the mask (softmax_row), dP = dout vᵀ,
/// dS = P ∘ (dP − rowsum(P ∘ dP)), and each dS_ij added to the table row of the two positions' grid
/// coordinates. Needs no forward output or lse.
template <class Scalar>
void relative_position_bias_backward_naive(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                                           const HeadsView<const Scalar>& v, const HeadsView<const Scalar>& dout,
                                           const MaskView<Scalar>& mask, Index grid_h, Index grid_w, Index max_h,
                                           Index max_w, Scalar scale, RowMatrixRef<Scalar> dtable) {
  impl::check_table_backward("relative_position_bias_backward_naive", q, k, v, dout, mask, grid_h, grid_w, max_h, max_w,
                             scale, dtable);
  const Index n = q.seq;
  dtable.setZero();
  for (Index b = 0; b < q.batch; ++b) {
    for (Index h = 0; h < q.heads; ++h) {
      RowMatrix<Scalar> p(n, n), dp(n, n);
      p.noalias() = (q.block(b, h, 0, n) * scale) * k.block(b, h, 0, n).transpose();
      for (Index i = 0; i < n; ++i) {
        for (Index j = 0; j < n; ++j) p(i, j) = c2f::cpu::add_bias(p(i, j), mask.bias(b, h, i, j));
        c2f::cpu::softmax_row(p.row(i));
      }
      dp.noalias() = dout.block(b, h, 0, n) * v.block(b, h, 0, n).transpose();
      for (Index i = 0; i < n; ++i) {
        const Scalar rowdot = p.row(i).dot(dp.row(i));
        for (Index j = 0; j < n; ++j) {
          const Index entry =
              ((i / grid_w) - (j / grid_w) + max_h - 1) * (2 * max_w - 1) + (i % grid_w) - (j % grid_w) + max_w - 1;
          dtable(entry, h) += p(i, j) * (dp(i, j) - rowdot);
        }
      }
    }
  }
}

}  // namespace kernels
}  // namespace c2f
