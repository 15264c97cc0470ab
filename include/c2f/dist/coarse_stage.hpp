// c2f dist — the coarse stage shared by the sharded coarse-to-fine layers (dist::C2FAttention and
// dist::C2FAttention2D) and the window summaries of dist::HMHA: each rank holds a contiguous run of the
// blocks (chunks, rows of 2-D blocks, windows) of every batch item; the blocks' keys and values are
// gathered with one MPI_Allgatherv, and each rank attends its own blocks' queries over all of them.
#pragma once

#include "c2f/dist/comm.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/mask_view.hpp"

#include <string>
#include <vector>

namespace c2f {
namespace dist {
namespace detail {

/// The coarse stage of a sharded coarse-to-fine layer (the 1-D and the 2-D one) runs on the streaming
/// kernel with key blocks on whole packed panels: then it gives each query row the same bits whatever
/// rows share its call. Throws otherwise.
template <class Scalar>
void check_coarse_kernel(const char* layer, const MultiHeadAttention<Scalar>& coarse) {
  const Index panel = c2f::cpu::GemmBlocking<Scalar>::kNR;
  if (coarse.options().kernel() != AttnKernel::Streaming || coarse.options().key_block() % panel != 0) {
    c2f::detail::fail(
        layer, " runs the streaming kernel with a key_block that is a multiple of ", panel, ", got ",
        coarse.options().kernel() == AttnKernel::Streaming ? "key_block " : "the naive kernel, key_block ",
        coarse.options().key_block());
  }
}

/// Where each rank's blocks lie among each batch item's m blocks: rank r holds blocks
/// [first[r], first[r] + count[r]) of every batch item.
struct BlockPlan {
  std::vector<Index> first, count;
  Index blocks = 0;  ///< m
};

/// The blocks of the shards that start at begin[r] (from aligned_starts; begin[P] is the whole extent)
/// in units of `align` (tokens of a chunk, image rows of a row of blocks), `per_unit` blocks per
/// aligned unit (1; the blocks across a 2-D grid's width).
inline BlockPlan block_plan(const std::vector<Index>& begin, Index align, Index per_unit = 1) {
  BlockPlan plan;
  const std::size_t ranks = begin.size() - 1;
  plan.blocks = c2f::detail::ceil_div(begin[ranks], align) * per_unit;
  for (std::size_t r = 0; r < ranks; ++r) {
    plan.first.push_back(begin[r] / align * per_unit);
    plan.count.push_back(c2f::detail::ceil_div(begin[r + 1] - begin[r], align) * per_unit);
  }
  return plan;
}

/// Every block's coarse key | value [B·m, 2d], batch item by batch item in block order, from each rank's
/// kv [B·count[me], 2d] (its blocks of batch item 0, then of item 1, …): one MPI_Allgatherv of whole
/// rows. Collective: every rank calls it with the same plan.
template <class Scalar>
RowMatrix<Scalar> gather_blocks(const Comm& comm, const char* layer, const RowMatrix<Scalar>& kv, Index batch,
                                const BlockPlan& plan) {
  const int ranks = comm.size();
  const Index width = kv.cols();
  std::vector<int> counts(static_cast<std::size_t>(ranks)), displs(static_cast<std::size_t>(ranks));
  for (int r = 0, at = 0; r < ranks; ++r) {
    counts[r] = mpi_count(batch * plan.count[r], layer, "a shard's blocks");
    displs[r] = at;
    at = mpi_count(static_cast<Index>(at) + counts[r], layer, "the blocks of all shards");
  }
  RowMatrix<Scalar> gathered(displs.back() + counts.back(), width);
  const RowType<Scalar> row(width, layer);
  MPI_Allgatherv(kv.data(), counts[comm.rank()], row.get(), gathered.data(), counts.data(), displs.data(), row.get(),
                 comm.get());
  // Rank-major → batch-major, block order.
  RowMatrix<Scalar> all(batch * plan.blocks, width);
  for (int r = 0; r < ranks; ++r) {
    for (Index i = 0; i < batch; ++i) {
      all.middleRows(i * plan.blocks + plan.first[r], plan.count[r]) =
          gathered.middleRows(displs[r] + i * plan.count[r], plan.count[r]);
    }
  }
  return all;
}

/// The coarse output of this rank's blocks [B·count, d]: the coarse attention of their queries q over all
/// blocks' keys and values (all, from gather_blocks) with the coarse mask over all m blocks (its rows
/// [first, first + count)), then out_proj — row by row the bits of the whole coarse stage.
template <class Scalar>
RowMatrix<Scalar> coarse_rows(const MultiHeadAttention<Scalar>& coarse, const RowMatrix<Scalar>& q,
                              const RowMatrix<Scalar>& all, Index batch, Index first, Index count, Index m,
                              const AttnMask<Scalar>& mask) {
  const Index d = coarse.embed_dim(), h = coarse.num_heads(), dk = coarse.head_dim();
  const MaskView<Scalar> rows = MaskView<Scalar>(mask, KeyPaddingMask<Scalar>(), batch, h, m, m).rows(first, count);
  RowMatrix<Scalar> heads(batch * count, d), context(batch * count, d);
  if (batch * count == 0) return context;
  kernels::sdpa_streaming<Scalar>(kernels::heads_view(q, batch, count, h),
                                  kernels::heads_view<const Scalar>(all.data(), batch, m, 2 * d, 0, h, dk),
                                  kernels::heads_view<const Scalar>(all.data(), batch, m, 2 * d, d, h, dk),
                                  kernels::heads_view(heads, batch, count, h), rows, kernels::default_scale<Scalar>(dk),
                                  c2f::detail::kernel_options(coarse.options()).rows_independent(true));
  coarse.out_proj().forward_rows_independent(heads, context);
  return context;
}

/// Where the shards start, from each rank's reported extent (the last value of its report: tokens, or
/// rows of an image): begin[r] for rank r and begin[P] = the whole extent. Throws unless each non-empty
/// shard starts on a multiple of `align` (the chunk, the block height, the window); `what` names the unit.
inline std::vector<Index> aligned_starts(const char* layer, const std::vector<std::vector<std::int64_t>>& reports,
                                         Index align, const char* what, const char* align_name) {
  const std::size_t ranks = reports.size();
  std::vector<Index> begin(ranks + 1, 0);
  for (std::size_t r = 0; r < ranks; ++r) begin[r + 1] = begin[r] + reports[r].back();
  for (std::size_t r = 0; r < ranks; ++r) {
    if (reports[r].back() > 0 && begin[r] % align != 0) {
      std::string lengths;
      for (std::size_t p = 0; p < ranks; ++p) lengths += (p ? ", " : "") + std::to_string(reports[p].back());
      c2f::detail::fail(layer, ": rank ", r, "'s shard starts at ", what, " ", begin[r], ", not on a multiple of ",
                        align_name, " = ", align, "; the shards hold [", lengths, "] ", what,
                        "s (dist::even_shard gives an aligned plan)");
    }
  }
  return begin;
}

}  // namespace detail
}  // namespace dist
}  // namespace c2f
