// c2f dist — sequence-parallel C2FAttention: each rank holds a chunk-aligned shard of the sequence.
//
//   1. each rank averages its own chunks (the coarse stage's input rows of its shard) and projects them
//      to the coarse queries, keys and values;
//   2. one MPI_Allgatherv of the keys and values: every rank then holds those of all B · m chunks;
//   3. each rank runs the coarse attention of its own chunks' queries over all chunks (the coarse stage's
//      m² work is shared out like the fine stage's, not repeated on every rank);
//   4. each rank runs the fine stage on its own chunks with its own rows of the coarse output.
// Nothing else crosses ranks: per rank (P−1)/P · B · m · 2d values arrive, m = ceil(L / chunk) — 1/chunk
// of ring attention's. The output rows are bit-identical to c2f::C2FAttention::forward on the
// concatenated sequence, for any number of ranks and any chunk-aligned plan: every product of both
// stages is row-independent (kernels::KernelOptions::rows_independent; CoarseAttention and
// FineAttention run them so), and the chunk means and the folded attention are per chunk.
// (docs/distributed.md)
#pragma once

#include "c2f/dist/coarse_stage.hpp"
#include "c2f/layers/c2f_attention.hpp"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace c2f {
namespace dist {

/// C2FAttention over a sequence sharded by chunks across the ranks of a communicator. Every rank holds
/// the full weights (module(): load the same state dict on every rank) and calls forward() at the same
/// time with its shard x [B, n_r, d] — n_r tokens starting at a multiple of chunk_size (dist::even_shard
/// gives the even plan; a rank may hold none). Masks: attn_mask is the coarse stage's, over all
/// m = ceil(L / chunk) chunks, the same on every rank; fine_attn_mask the fine stage's over the rank's
/// own chunks ([k, k], or [n, k, k] with n = 1, B·m_r or B·m_r·H, m_r the rank's chunks).
template <class Scalar>
class C2FAttention : public detail::DistLayer<C2FAttention<Scalar>, c2f::C2FAttention<Scalar>, Scalar> {
  C2F_DIST_LAYER_BASICS(C2FAttention);
  using Base::Base;  // (comm, sizes…, options = {}) or (comm, module): detail::DistLayer

  // comm(), module() and forward(x, masks) → this rank's output rows [B, n_r, d] (detail::DistLayer).

  /// forward() into caller memory: out [B·n_r, d].
  void forward_into(ConstTensor3Ref<Scalar> x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks = {}) const {
    const Index d = module_.embed_dim(), k = module_.chunk_size(), b = x.batch();
    const MultiHeadAttention<Scalar>& coarse = module_.coarse_attn().as_multihead_attention();
    const AttnMask<Scalar>& coarse_mask = masks.attn_mask();
    const AttnMask<Scalar>& fine_mask = masks.fine_attn_mask();
    // 1. This rank's chunk means and their coarse q and k | v, and one exchange of what every rank was given.
    RowMatrix<Scalar> q, kv;
    const std::vector<detail::Field> fields =
        this->call_fields(b, x.features(), {{"chunk_size", k, true}},
                          {{"attn_mask's kind", static_cast<std::int64_t>(coarse_mask.kind()), true},
                           {"attn_mask's first size", coarse_mask.dims()[0], true},
                           {"attn_mask's second size", coarse_mask.dims()[1], true},
                           {"attn_mask's third size", coarse_mask.dims()[2], true},
                           {"fine_attn_mask's kind", static_cast<std::int64_t>(fine_mask.kind()), true}},
                          {"the shard's length", x.seq(), false});
    const std::vector<std::vector<std::int64_t>> reports = detail::exchange(comm_, type_name, fields, [&] {
      c2f::detail::check_mask_fields(masks, "C2FAttention", Module::mask_fields);
      c2f::detail::check_features(x, d, "C2FAttention", "x", "embed_dim");
      c2f::detail::check_out("C2FAttention", out, {b, x.seq(), d});
      detail::check_coarse_kernel(type_name, coarse);
      const Tensor3<Scalar> means = module_.coarse_input(x);
      q.resize(b * means.dimension(1), d);
      kv.resize(b * means.dimension(1), 2 * d);
      coarse.project_into(means, means, means, q, c2f::detail::cols_of(kv, 0, d), c2f::detail::cols_of(kv, d, d));
    });

    // 2. The plan the shards form (each one starts on a chunk), and every chunk's coarse key and value.
    const std::vector<Index> begin = detail::aligned_starts(type_name, reports, k, "token", "chunk_size");
    const int me = comm_.rank();
    const Index length = begin.back();
    const detail::BlockPlan plan = detail::block_plan(begin, k);
    const RowMatrix<Scalar> all = detail::gather_blocks(comm_, type_name, kv, b, plan);

    // 3. The coarse stage for this rank's chunks over all chunks, then the fine stage on them; a failure
    // anywhere is every rank's.
    detail::all_or_none(comm_, type_name, [&] {
      const RowMatrix<Scalar> context =
          detail::coarse_rows(coarse, q, all, b, plan.first[me], plan.count[me], plan.blocks, coarse_mask);
      module_.fine_attn().forward_shard_into(x, k, length,
                                             ConstTensor3Ref<Scalar>(context.data(), {b, plan.count[me], d}), out,
                                             Masks<Scalar>().attn_mask(fine_mask));
    });
  }
};

}  // namespace dist
}  // namespace c2f
