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
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/masked_values.hpp"
#include "c2f/detail/softmax.hpp"

#include <algorithm>
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
};

/// Row of token (y, x) of batch b in the [batch·height·width, d] token matrix, and its block index.
inline Index token_row(const BlockGrid2D& g, Index b, Index y, Index x) { return (b * g.height + y) * g.width + x; }
inline Index token_block(const BlockGrid2D& g, Index b, Index y, Index x) {
  return b * g.blocks_per_batch() + (y / g.block_h) * g.blocks_w() + x / g.block_w;
}

/// Twin of chunk_mean on a BlockGrid2D: every token adds itself to its block's sum, then each sum is
/// divided by its block's token count. x [batch·H·W, d], out [blocks, d].
template <class Scalar>
void block_mean_naive(const Eigen::Ref<const RowMatrix<Scalar>>& x, const BlockGrid2D& g,
                      Eigen::Ref<RowMatrix<Scalar>> out) {
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
void fine_attention_folded_naive(const Eigen::Ref<const RowMatrix<Scalar>>& x, const BlockGrid2D& g,
                                 const Eigen::Ref<const RowMatrix<Scalar>>& qk, Index heads,
                                 Eigen::Ref<RowMatrix<Scalar>> pooled, Eigen::Ref<RowMatrix<Scalar>> mass, Bias&& bias) {
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
        p[static_cast<Index>(j)] = detail::add_bias(s, bias(c, h, static_cast<Index>(j)));
      }
      mass(c, h) = detail::softmax_row(p) ? Scalar(1) : Scalar(0);
      for (Index k = 0; k < d; ++k) {
        Scalar acc = 0;
        for (std::size_t j = 0; j < tokens.size(); ++j) acc += p[static_cast<Index>(j)] * x(tokens[j], k);
        pooled(c, h * d + k) = acc;
      }
    }
  }
}

}  // namespace kernels
}  // namespace c2f
