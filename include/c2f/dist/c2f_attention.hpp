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

#include "c2f/dist/comm.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/sdpa.hpp"
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
class C2FAttention {
 public:
  using Module = c2f::C2FAttention<Scalar>;
  using Options = typename Module::Options;
  static constexpr const char* type_name = "dist::C2FAttention";

  C2FAttention(Comm comm, Index embed_dim, Index num_heads, Index chunk_size, Options options = Options())
      : comm_(comm), module_(embed_dim, num_heads, chunk_size, options) {}
  /// Wraps a built (e.g. loaded) single-process layer.
  C2FAttention(Comm comm, Module module) : comm_(comm), module_(std::move(module)) {}

  const Comm& comm() const { return comm_; }
  /// The single-process layer: its weights (load_state_dict, state_dict), options and shape.
  Module& module() { return module_; }
  const Module& module() const { return module_; }

  /// This rank's output rows [B, n_r, d].
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x, const Masks<Scalar>& masks = {}) const {
    return detail::fresh_forward<Scalar>(*this, x, masks, module_.embed_dim());
  }

  /// forward() into caller memory: out [B·n_r, d].
  void forward_into(ConstTensor3Ref<Scalar> x, Eigen::Ref<RowMatrix<Scalar>> out, const Masks<Scalar>& masks = {}) const {
    const Index d = module_.embed_dim(), k = module_.chunk_size(), b = x.batch(), h = module_.num_heads();
    const MultiHeadAttention<Scalar>& coarse = module_.coarse_attn().as_multihead_attention();
    const AttnMask<Scalar>& coarse_mask = masks.attn_mask();
    const AttnMask<Scalar>& fine_mask = masks.fine_attn_mask();
    const kernels::KernelOptions attention = c2f::detail::kernel_options(coarse.options()).rows_independent(true);
    // 1. This rank's chunk means and their coarse q and k | v, and one exchange of what every rank was given.
    RowMatrix<Scalar> q, kv;
    const std::vector<detail::Field> fields = {
        {"the batch size", b, true},
        {"the input's feature size", x.features(), true},
        {"embed_dim", d, true},
        {"num_heads", h, true},
        {"chunk_size", k, true},
        {"the scalar size (float or double)", static_cast<std::int64_t>(sizeof(Scalar)), true},
        {"attn_mask's kind", static_cast<std::int64_t>(coarse_mask.kind()), true},
        {"attn_mask's first size", coarse_mask.dims()[0], true},
        {"attn_mask's second size", coarse_mask.dims()[1], true},
        {"attn_mask's third size", coarse_mask.dims()[2], true},
        {"fine_attn_mask's kind", static_cast<std::int64_t>(fine_mask.kind()), true},
        {"the shard's length", x.seq(), false},
    };
    const std::vector<std::vector<std::int64_t>> reports = detail::exchange(comm_, type_name, fields, [&] {
      c2f::detail::check_mask_fields(masks, "C2FAttention", Module::mask_fields);
      c2f::detail::check_features(x, d, "C2FAttention", "x", "embed_dim");
      c2f::detail::check_out("C2FAttention", out, {b, x.seq(), d});
      // The coarse stage's queries are sharded: it must give each row the same bits whatever rows
      // share its call (the streaming kernel, key blocks on the packed panels).
      if (coarse.options().kernel() != AttnKernel::Streaming ||
          coarse.options().key_block() % c2f::detail::GemmBlocking<Scalar>::kNR != 0) {
        c2f::detail::fail(type_name, " runs the streaming kernel with a key_block that is a multiple of ",
                          c2f::detail::GemmBlocking<Scalar>::kNR, ", got ",
                          coarse.options().kernel() == AttnKernel::Streaming ? "key_block " : "the naive kernel, key_block ",
                          coarse.options().key_block());
      }
      const Tensor3<Scalar> means = module_.coarse_input(x);
      q.resize(b * means.dimension(1), d);
      kv.resize(b * means.dimension(1), 2 * d);
      coarse.project_into(means, means, means, q, kv.leftCols(d), kv.rightCols(d));
    });

    // 2. The plan the shards form: each one must start on a chunk.
    const int ranks = comm_.size(), me = comm_.rank();
    std::vector<Index> begin(static_cast<std::size_t>(ranks) + 1, 0);
    for (int r = 0; r < ranks; ++r) begin[r + 1] = begin[r] + reports[r].back();
    for (int r = 0; r < ranks; ++r) {
      if (reports[r].back() > 0 && begin[r] % k != 0) {
        std::string lengths;
        for (int p = 0; p < ranks; ++p) lengths += (p ? ", " : "") + std::to_string(reports[p].back());
        c2f::detail::fail(type_name, ": rank ", r, "'s shard starts at token ", begin[r],
                          ", not on a chunk (a multiple of chunk_size = ", k, "); the shards' lengths are [", lengths,
                          "] (dist::even_shard gives a chunk-aligned plan)");
      }
    }
    const Index length = begin[ranks], m = (length + k - 1) / k;

    // 3. Every chunk's coarse key and value, [B·m, 2d] (one MPI_Allgatherv of whole rows).
    std::vector<int> counts(static_cast<std::size_t>(ranks)), displs(static_cast<std::size_t>(ranks));
    for (int r = 0, at = 0; r < ranks; ++r) {
      counts[r] = detail::mpi_count(b * ((reports[r].back() + k - 1) / k), type_name, "a shard's chunks");
      displs[r] = at;
      at = detail::mpi_count(static_cast<Index>(at) + counts[r], type_name, "the chunks of all shards");
    }
    RowMatrix<Scalar> gathered(displs.back() + counts.back(), 2 * d);
    MPI_Datatype row;
    MPI_Type_contiguous(detail::mpi_count(2 * d, type_name, "2·embed_dim"), detail::mpi_type<Scalar>(), &row);
    MPI_Type_commit(&row);
    MPI_Allgatherv(kv.data(), counts[me], row, gathered.data(), counts.data(), displs.data(), row, comm_.get());
    MPI_Type_free(&row);

    // 4. The coarse stage for this rank's chunks over all chunks, then the fine stage on them; a failure
    // anywhere is every rank's.
    detail::all_or_none(comm_, type_name, [&] {
      RowMatrix<Scalar> all(b * m, 2 * d);
      for (int r = 0; r < ranks; ++r) {
        const Index c0 = begin[r] / k, mr = counts[r] / std::max<Index>(b, 1);
        for (Index i = 0; i < b; ++i) all.middleRows(i * m + c0, mr) = gathered.middleRows(displs[r] + i * mr, mr);
      }
      const Index c0 = begin[me] / k, mr = counts[me] / std::max<Index>(b, 1);
      // The coarse mask, checked against all chunks, then its rows of this rank's chunks.
      const MaskView<Scalar> whole(coarse_mask, KeyPaddingMask<Scalar>(), b, h, m, m);
      (void)whole;
      const AttnMask<Scalar> rows = mask_rows(coarse_mask, c0, mr, m);
      RowMatrix<Scalar> heads(b * mr, d), context(b * mr, d);
      if (b * mr > 0) {
        const Index dk = coarse.head_dim();
        kernels::sdpa_streaming<Scalar>(kernels::heads_view(std::as_const(q), b, mr, h),
                                        kernels::heads_view<const Scalar>(all.data(), b, m, 2 * d, 0, h, dk),
                                        kernels::heads_view<const Scalar>(all.data(), b, m, 2 * d, d, h, dk),
                                        kernels::heads_view(heads, b, mr, h),
                                        MaskView<Scalar>(rows, KeyPaddingMask<Scalar>(), b, h, mr, m),
                                        kernels::default_scale<Scalar>(dk), attention);
        coarse.out_proj().forward_rows_independent(heads, context);
      }
      module_.fine_attn().forward_shard_into(x, k, length, ConstTensor3Ref<Scalar>(context.data(), {b, mr, d}), out,
                                             Masks<Scalar>().attn_mask(fine_mask));
    });
  }

 private:
  /// Rows [c0, c0 + rows) of a coarse mask over [m, m] chunks (or [n, m, m]).
  static AttnMask<Scalar> mask_rows(const AttnMask<Scalar>& mask, Index c0, Index rows, Index m) {
    switch (mask.kind()) {
      case MaskKind::None: return mask;
      case MaskKind::Causal: return AttnMask<Scalar>::causal(mask.diagonal() + c0);
      case MaskKind::Additive: {
        const Index n = mask.dims()[0];
        Tensor3<Scalar> part(n, rows, m);
        for (Index i = 0; i < n; ++i) {
          std::copy_n(mask.additive_values().data() + (i * m + c0) * m, rows * m, part.data() + i * rows * m);
        }
        return AttnMask<Scalar>::additive(part);
      }
      case MaskKind::Keep:
      case MaskKind::Ignore: {
        const Index n = mask.dims()[0];
        BoolTensor3 part(n, rows, m);
        for (Index i = 0; i < n; ++i) {
          for (Index j = 0; j < rows * m; ++j) part.data()[i * rows * m + j] = mask.keep_flags()[static_cast<std::size_t>((i * m + c0) * m + j)] != 0;
        }
        return AttnMask<Scalar>::keep(part);
      }
      default:
        c2f::detail::fail(type_name, ": the coarse attn_mask must be causal, boolean or additive (a relative position ",
                          "bias is for the 2-D layer)");
    }
  }

  Comm comm_;
  Module module_;
};

}  // namespace dist
}  // namespace c2f
