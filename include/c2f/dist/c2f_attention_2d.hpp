// c2f dist — sequence-parallel C2FAttention2D: the token grid of an image sharded by rows of blocks.
//
// Rank r holds image rows [y_r, y_r + rows_r) of every batch item (all `width` columns; the tokens
// [y_r·width, (y_r + rows_r)·width) of the row-major flattened grid), each non-empty shard starting on a
// multiple of block_h: so it holds whole rows of blocks, the blocks [y_r/block_h · Mw, …) of each
// image, the last shard with the partial bottom row of blocks. Then, as dist::C2FAttention:
//   1. each rank averages its own blocks and projects their means to the coarse queries, keys, values;
//   2. one MPI_Allgatherv of the keys and values of every block (2d values per block);
//   3. each rank runs the coarse attention of its own blocks' queries over all Mh·Mw blocks, with the
//      rows of its blocks in the relative position bias (MaskView::rows);
//   4. each rank runs the folded fine stage inside its own blocks.
// The output rows are bit-identical to c2f::C2FAttention2D::forward on the whole grid, for any number of
// ranks and any plan aligned on block rows (the products of both stages are row-independent).
// (docs/distributed.md)
#pragma once

#include "c2f/dist/coarse_stage.hpp"
#include "c2f/kernels/block2d.hpp"
#include "c2f/layers/c2f_attention_2d.hpp"

#include <utility>
#include <vector>

namespace c2f {
namespace dist {

/// C2FAttention2D over an image grid sharded by rows of blocks across the ranks of a communicator.
/// Every rank holds the full weights (module()) and calls forward() at the same time with its rows:
/// x [B, rows·width, d], rows starting at a multiple of block_h (dist::even_shard(height, block_h, r, P)
/// gives the even plan in image rows; a rank may hold none). Takes no masks, as the module.
template <class Scalar>
class C2FAttention2D : public detail::DistLayer<C2FAttention2D<Scalar>, c2f::C2FAttention2D<Scalar>, Scalar> {
  C2F_DIST_LAYER_BASICS(C2FAttention2D);
  using Base::Base;  // (comm, sizes…, options = {}) or (comm, module): detail::DistLayer

  // comm() and module() (detail::DistLayer); forward takes the grid's rows and width.

  /// This rank's output rows [B, rows·width, d] for its image rows x [B, rows·width, d].
  Output<Scalar> forward(ConstTensor3Ref<Scalar> x, Index rows, Index width, const Masks<Scalar>& masks = {}) const {
    return detail::fresh_forward<Scalar>(x, module_.embed_dim(),
                                         [&](RowMatrixRef<Scalar> out) { forward_into(x, rows, width, out, masks); });
  }

  /// forward() into caller memory: out [B·rows·width, d].
  void forward_into(ConstTensor3Ref<Scalar> x, Index rows, Index width, RowMatrixRef<Scalar> out,
                    const Masks<Scalar>& masks = {}) const {
    const Index d = module_.embed_dim(), b = x.batch(), bh = module_.block_h(), bw = module_.block_w();
    const MultiHeadAttention<Scalar>& coarse = module_.coarse_attn().as_multihead_attention();
    // 1. This rank's block means and their coarse q and k | v, and one exchange of what every rank was given.
    RowMatrix<Scalar> q, kv;
    const std::vector<detail::Field> fields = {
        {"the batch size", b, true},
        {"the input's feature size", x.features(), true},
        {"embed_dim", d, true},
        {"num_heads", module_.num_heads(), true},
        {"block_h", bh, true},
        {"block_w", bw, true},
        {"the grid width", width, true},
        {"relative_position_bias", module_.options().relative_position_bias() ? 1 : 0, true},
        {"the scalar size (float or double)", static_cast<std::int64_t>(sizeof(Scalar)), true},
        {"the shard's image rows", rows, false},
    };
    const std::vector<std::vector<std::int64_t>> reports = detail::exchange(comm_, type_name, fields, [&] {
      c2f::detail::check_mask_fields(masks, "C2FAttention2D", Module::mask_fields);
      if (rows < 0) c2f::detail::fail("C2FAttention2D: a shard's image rows must be >= 0, got ", rows);
      c2f::detail::check_out("C2FAttention2D", out, module_.output_shape(x, rows, width));
      detail::check_coarse_kernel(type_name, coarse);
      const Tensor3<Scalar> means = module_.coarse_input(x, rows, width);
      q.resize(b * means.dimension(1), d);
      kv.resize(b * means.dimension(1), 2 * d);
      coarse.project_into(means, means, means, q, c2f::detail::cols_of(kv, 0, d), c2f::detail::cols_of(kv, d, d));
    });

    // 2. The plan the shards form (each one starts on a row of blocks), and every block's coarse key and value.
    const std::vector<Index> begin = detail::aligned_starts(type_name, reports, bh, "image row", "block_h");
    const Index height = begin.back(), blocks_w = height == 0 || width == 0 ? 0 : c2f::detail::ceil_div(width, bw);
    const detail::BlockPlan plan = detail::block_plan(begin, bh, blocks_w);
    const RowMatrix<Scalar> all = detail::gather_blocks(comm_, type_name, kv, b, plan);

    // 3. The coarse stage for this rank's blocks over all blocks, then the fine stage inside them; a failure
    // anywhere (a grid larger than the bias table) is every rank's.
    detail::all_or_none(comm_, type_name, [&] {
      if (plan.blocks == 0) return;  // an empty grid
      const AttnMask<Scalar> mask = module_.coarse_mask(c2f::detail::ceil_div(height, bh), blocks_w);
      const int me = comm_.rank();
      const RowMatrix<Scalar> context =
          detail::coarse_rows(coarse, q, all, b, plan.first[me], plan.count[me], plan.blocks, mask);
      module_.fine_attn().forward_blocks(x.rows(), kernels::BlockGrid2D{b, rows, width, bh, bw}, context, out);
    });
  }
};

}  // namespace dist
}  // namespace c2f
