// c2f dist — sequence-parallel self-attention: c2f::MultiHeadAttention over a sequence sharded across
// the ranks of a communicator, by one of two methods (docs/distributed.md):
//
//   Ring (default; ring attention): each rank projects its own rows; the key/value blocks travel
//     around the ring (MPI_Isend / MPI_Irecv, double-buffered, the next block in flight while the
//     current one is attended); each rank attends its queries to every block and merges the partial
//     outputs by the log-sum-exp rule (kernels::sdpa_streaming_lse). With causal, a block wholly in
//     a query segment's future is skipped; Layout::ZigZag balances that work (rank r holds half-chunks r
//     and 2P−1−r). Per rank and call, (P−1)/P · B · L · 2E values arrive.
//   Ulysses (DeepSpeed-Ulysses; num_heads % P == 0): one MPI_Alltoallv turns the sequence shards of
//     q, k, v into head shards (every position of H/P heads), each rank attends its heads over the whole
//     sequence, and one MPI_Alltoallv turns the output back into sequence shards.
//
// Masks: key_padding_mask over the whole sequence ([B, L] in position order, or lengths), the same on
// every rank; causal is the module's option. Outputs equal the single-process forward on the whole
// sequence to rounding (the partial outputs are summed in another order): within 1e-5 in float,
// 1e-10 in double (tests/dist).
#pragma once

#include "c2f/dist/comm.hpp"
#include "c2f/dist/shard.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/layers/multihead_attention.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace c2f {
namespace dist {

/// How dist::MultiHeadAttention spreads the work.
enum class SequenceParallel {
  Ring,     ///< key/value blocks around a ring, log-sum-exp merge (any head count)
  Ulysses,  ///< all-to-all to head shards and back (num_heads % ranks == 0)
};

/// Which positions each rank holds.
enum class Layout {
  Contiguous,  ///< rank r holds the r-th run of positions, any lengths (e.g. dist::even_shard with chunk 1)
  ZigZag,      ///< rank r holds dist::zigzag_segments(L, r, P), in that order: causal work is balanced
};

template <class Scalar>
class MultiHeadAttention
    : public detail::DistLayer<MultiHeadAttention<Scalar>, c2f::MultiHeadAttention<Scalar>, Scalar> {
  C2F_DIST_LAYER_BASICS(MultiHeadAttention);

  class Options {
    C2F_ARG(SequenceParallel, method) = SequenceParallel::Ring;
    C2F_ARG(Layout, layout) = Layout::Contiguous;
  };

  MultiHeadAttention(Comm comm, Index embed_dim, Index num_heads,
                     typename Module::Options module_options = typename Module::Options(), Options options = Options())
      : Base(comm, Module(embed_dim, num_heads, module_options)), options_(options) {}
  /// Wraps a built (e.g. loaded) single-process layer (self-attention: kdim = vdim = embed_dim).
  MultiHeadAttention(Comm comm, Module module, Options options = Options())
      : Base(comm, std::move(module)), options_(options) {}

  const Options& options() const { return options_; }
  // comm(), module() and forward(x, masks) → this rank's output rows [B, n_r, E] for its input rows x
  // [B, n_r, E], the positions options().layout() gives it (detail::DistLayer).

  /// forward() into caller memory: out [B·n_r, E].
  void forward_into(ConstTensor3Ref<Scalar> x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks = {}) const {
    const Index e = module_.embed_dim(), h = module_.num_heads(), b = x.batch(), n = x.seq();
    const KeyPaddingMask<Scalar>& pad = masks.key_padding_mask();
    const int ranks = comm_.size();
    const std::vector<detail::Field> fields =
        this->call_fields(b, x.features(),
                          {{"causal", module_.causal() ? 1 : 0, true},
                           {"the method (Ring or Ulysses)", static_cast<std::int64_t>(options_.method()), true},
                           {"the layout (Contiguous or ZigZag)", static_cast<std::int64_t>(options_.layout()), true}},
                          {{"key_padding_mask's kind", static_cast<std::int64_t>(pad.kind()), true},
                           {"key_padding_mask's first size", pad.dims()[0], true},
                           {"key_padding_mask's second size", pad.dims()[1], true}},
                          {"the shard's length", n, false});
    const std::vector<std::vector<std::int64_t>> reports = detail::exchange(comm_, type_name, fields, [&] {
      if (!masks.attn_mask().is_none() || !masks.fine_attn_mask().is_none()) {
        c2f::detail::fail("dist::MultiHeadAttention takes only a key_padding_mask (causal is the module's option)");
      }
      if (module_.kdim() != e || module_.vdim() != e) {
        c2f::detail::fail("dist::MultiHeadAttention is self-attention: kdim and vdim must equal embed_dim = ", e,
                          ", got ", module_.kdim(), " and ", module_.vdim());
      }
      c2f::detail::check_features(x, e, "MultiHeadAttention", "x", "embed_dim");
      c2f::detail::check_out("MultiHeadAttention", out, {b, n, e});
    });

    // Every rank's segments of the sequence, from the lengths they hold.
    std::vector<Index> lengths(static_cast<std::size_t>(ranks));
    Index total = 0;
    for (int r = 0; r < ranks; ++r) total += lengths[r] = reports[r].back();
    Segments segs(static_cast<std::size_t>(ranks));
    Index at = 0;
    for (int r = 0; r < ranks; ++r) {
      if (options_.layout() == Layout::ZigZag) {
        segs[r] = zigzag_segments(total, r, ranks);
        if (segs[r][0].length + segs[r][1].length != lengths[r]) {
          c2f::detail::fail(type_name, ": with Layout::ZigZag, rank ", r, " must hold dist::zigzag_segments(", total,
                            ", ", r, ", ", ranks, ") = ", segs[r][0].length + segs[r][1].length, " positions, got ",
                            lengths[r]);
        }
      } else {
        segs[r] = {Segment{at, lengths[r]}, Segment{at + lengths[r], 0}};
        at += lengths[r];
      }
    }
    if (options_.method() == SequenceParallel::Ulysses && h % ranks != 0) {
      c2f::detail::fail(type_name, ": SequenceParallel::Ulysses needs num_heads (", h, ") divisible by the ranks (",
                        ranks, "); SequenceParallel::Ring takes any");
    }

    // This rank's projections, [B·n, 3E] = q | k | v; the mask checked against the whole sequence.
    RowMatrix<Scalar> qkv(b * n, 3 * e);
    detail::all_or_none(comm_, type_name, [&] {
      const MaskView<Scalar> check(AttnMask<Scalar>(), pad, b, h, 1, total);  // throws unless pad fits [B, L]
      (void)check;
      module_.project_into(x, x, x, c2f::detail::cols_of(qkv, 0, e), c2f::detail::cols_of(qkv, e, e),
                           c2f::detail::cols_of(qkv, 2 * e, e));
    });
    RowMatrix<Scalar> attn(b * n, e);
    if (options_.method() == SequenceParallel::Ring) {
      ring(qkv, b, segs, lengths, pad, attn);
    } else {
      ulysses(qkv, b, segs, lengths, pad, total, attn);
    }
    module_.out_proj().forward_rows(attn, out);
  }

 private:
  using Segments = std::vector<std::array<Segment, 2>>;

  /// The key padding mask of keys [k0, k0 + nk) of every batch item.
  static KeyPaddingMask<Scalar> keys_of(const KeyPaddingMask<Scalar>& pad, Index batch, Index k0, Index nk) {
    switch (pad.kind()) {
      case MaskKind::None:
        return pad;
      case MaskKind::Lengths: {
        std::vector<Index> len(pad.valid_lengths().size());
        for (std::size_t i = 0; i < len.size(); ++i)
          len[i] = std::min(nk, std::max<Index>(0, pad.valid_lengths()[i] - k0));
        return KeyPaddingMask<Scalar>::lengths(std::move(len));
      }
      case MaskKind::Additive: {
        Eigen::Tensor<Scalar, 2, Eigen::RowMajor> add(batch, nk);
        for (Index i = 0; i < batch; ++i) {
          for (Index j = 0; j < nk; ++j)
            add(i, j) = pad.additive_values()[static_cast<std::size_t>(i * pad.dims()[1] + k0 + j)];
        }
        return KeyPaddingMask<Scalar>::additive(add);
      }
      default: {
        BoolTensor2 keep(batch, nk);
        for (Index i = 0; i < batch; ++i) {
          for (Index j = 0; j < nk; ++j)
            keep(i, j) = pad.keep_flags()[static_cast<std::size_t>(i * pad.dims()[1] + k0 + j)] != 0;
        }
        return KeyPaddingMask<Scalar>::keep(keep);
      }
    }
  }

  /// Merges a partial output (o, lse over other keys) into the running one, row by row and head by head.
  static void merge(const ConstRowMatrixRef<Scalar>& o, const ConstRowMatrixRef<Scalar>& lse, Index batch, Index heads,
                    Index dk, Index rows, Index row0, Index n, RowMatrixRef<Scalar> acc, RowMatrixRef<Scalar> acc_lse) {
    constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
    for (Index bi = 0; bi < batch; ++bi) {
      for (Index hh = 0; hh < heads; ++hh) {
        for (Index i = 0; i < rows; ++i) {
          const Scalar lb = lse(bi * heads + hh, i);
          if (lb == kNegInf) continue;  // no visible key in this block
          Scalar& la = acc_lse(bi * heads + hh, row0 + i);
          typename RowMatrixRef<Scalar>::RowXpr dst = acc.row(bi * n + row0 + i);
          const typename ConstRowMatrixRef<Scalar>::ConstRowXpr src = o.row(bi * rows + i);
          if (la == kNegInf) {
            dst.segment(hh * dk, dk) = src.segment(hh * dk, dk);
            la = lb;
            continue;
          }
          const Scalar m = std::max(la, lb), wa = std::exp(la - m), wb = std::exp(lb - m), w = wa + wb;
          dst.segment(hh * dk, dk) = dst.segment(hh * dk, dk) * (wa / w) + src.segment(hh * dk, dk) * (wb / w);
          la = m + std::log(w);
        }
      }
    }
  }

  void ring(const RowMatrix<Scalar>& qkv, Index batch, const Segments& segs, const std::vector<Index>& lengths,
            const KeyPaddingMask<Scalar>& pad, RowMatrixRef<Scalar> attn) const {
    const int ranks = comm_.size(), me = comm_.rank();
    const Index e = module_.embed_dim(), h = module_.num_heads(), dk = module_.head_dim(), n = lengths[me];
    const kernels::KernelOptions kopts = c2f::detail::kernel_options(module_.options());
    const Scalar scale = kernels::default_scale<Scalar>(dk);
    constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
    attn.setZero();
    RowMatrix<Scalar> acc_lse = RowMatrix<Scalar>::Constant(batch * h, n, kNegInf);

    // The block in hand and the one arriving: [B·n_s, 2E] = k | v of rank s.
    RowMatrix<Scalar> cur(batch * n, 2 * e), next;
    cur = c2f::detail::cols_of(qkv, e, 2 * e);
    const detail::RowType<Scalar> row(2 * e, type_name);
    for (int t = 0; t < ranks; ++t) {
      const int src = (me - t + ranks) % ranks;
      MPI_Request reqs[2];
      const bool more = t + 1 < ranks;
      if (more) {  // pass this block on while it is attended; receive the one before it
        const int from = (me - t - 1 + 2 * ranks) % ranks;
        next.resize(batch * lengths[from], 2 * e);
        MPI_Irecv(next.data(), detail::mpi_count(next.rows(), type_name, "a key/value block's rows"), row.get(),
                  (me - 1 + ranks) % ranks, t, comm_.get(), &reqs[0]);
        MPI_Isend(cur.data(), detail::mpi_count(cur.rows(), type_name, "a key/value block's rows"), row.get(),
                  (me + 1) % ranks, t, comm_.get(), &reqs[1]);
      }
      const Index ns = lengths[src];
      Index krow = 0;
      for (const Segment& ks : segs[src]) {
        Index qrow = 0;
        for (const Segment& qs : segs[me]) {
          const bool future = module_.causal() && ks.begin > qs.begin + qs.length - 1;
          if (ks.length > 0 && qs.length > 0 && !future) {
            kernels::HeadsView<const Scalar> qv =
                kernels::heads_view<const Scalar>(qkv.data() + qrow * 3 * e, batch, qs.length, 3 * e, 0, h, dk);
            qv.batch_stride = n * 3 * e;
            kernels::HeadsView<const Scalar> kv =
                kernels::heads_view<const Scalar>(cur.data() + krow * 2 * e, batch, ks.length, 2 * e, 0, h, dk);
            kernels::HeadsView<const Scalar> vv =
                kernels::heads_view<const Scalar>(cur.data() + krow * 2 * e, batch, ks.length, 2 * e, e, h, dk);
            kv.batch_stride = vv.batch_stride = ns * 2 * e;
            RowMatrix<Scalar> o(batch * qs.length, e), lse(batch * h, qs.length);
            const kernels::HeadsView<Scalar> ov = kernels::heads_view(o, batch, qs.length, h);
            const AttnMask<Scalar> causal =
                module_.causal() ? AttnMask<Scalar>::causal(qs.begin - ks.begin) : AttnMask<Scalar>();
            const KeyPaddingMask<Scalar> keys = keys_of(pad, batch, ks.begin, ks.length);
            kernels::sdpa_streaming_lse<Scalar>(
                qv, kv, vv, ov, lse, MaskView<Scalar>(causal, keys, batch, h, qs.length, ks.length), scale, kopts);
            merge(o, lse, batch, h, dk, qs.length, qrow, n, attn, acc_lse);
          }
          qrow += qs.length;
        }
        krow += ks.length;
      }
      if (more) {
        MPI_Waitall(2, reqs, MPI_STATUSES_IGNORE);
        cur.swap(next);
      }
    }
  }

  void ulysses(const RowMatrix<Scalar>& qkv, Index batch, const Segments& segs, const std::vector<Index>& lengths,
               const KeyPaddingMask<Scalar>& pad, Index total, RowMatrixRef<Scalar> attn) const {
    const int ranks = comm_.size(), me = comm_.rank();
    const Index e = module_.embed_dim(), h = module_.num_heads(), dk = module_.head_dim(), n = lengths[me];
    const Index hp = h / ranks, ep = hp * dk;
    // Rows of rank s's positions in an array over the whole sequence, batch item by batch item.
    const auto for_rows_of = [&](int s, auto&& fn) {  // fn(row in s's block, row in the whole)
      for (Index bi = 0, i = 0; bi < batch; ++bi) {
        for (const Segment& seg : segs[s]) {
          for (Index j = 0; j < seg.length; ++j, ++i) fn(i, bi * total + seg.begin + j);
        }
      }
    };
    // 1. q, k, v of head group d to rank d: [B·n, 3·ep] each; from every rank s its rows of this rank's heads.
    RowMatrix<Scalar> send(ranks * batch * n, 3 * ep), whole(batch * total, 3 * ep), recv(batch * total, 3 * ep);
    for (int d = 0; d < ranks; ++d) {
      for (Index i = 0; i < batch * n; ++i) {
        for (int part = 0; part < 3; ++part) {
          send.row(d * batch * n + i).segment(part * ep, ep) = qkv.row(i).segment(part * e + d * ep, ep);
        }
      }
    }
    std::vector<int> scount(static_cast<std::size_t>(ranks)), sdispl(scount.size()), rcount(scount.size()),
        rdispl(scount.size());
    for (int r = 0, at = 0; r < ranks; ++r) {
      scount[r] = detail::mpi_count(batch * n, type_name, "a shard's rows");
      sdispl[r] = detail::mpi_count(static_cast<Index>(r) * batch * n, type_name, "a shard's rows");
      rcount[r] = detail::mpi_count(batch * lengths[r], type_name, "a shard's rows");
      rdispl[r] = at;
      at += rcount[r];
    }
    alltoallv(send.data(), scount, sdispl, recv.data(), rcount, rdispl, 3 * ep);
    for (int s = 0; s < ranks; ++s) {
      for_rows_of(s, [&](Index i, Index w) { whole.row(w) = recv.row(rdispl[s] + i); });
    }
    // 2. This rank's heads over the whole sequence.
    RowMatrix<Scalar> o(batch * total, ep);
    kernels::sdpa_streaming<Scalar>(
        kernels::heads_view<const Scalar>(whole.data(), batch, total, 3 * ep, 0, hp, dk),
        kernels::heads_view<const Scalar>(whole.data(), batch, total, 3 * ep, ep, hp, dk),
        kernels::heads_view<const Scalar>(whole.data(), batch, total, 3 * ep, 2 * ep, hp, dk),
        kernels::heads_view(o, batch, total, hp),
        MaskView<Scalar>(AttnMask<Scalar>(), pad, batch, hp, total, total, module_.causal()),
        kernels::default_scale<Scalar>(dk), c2f::detail::kernel_options(module_.options()));
    // 3. Back: rank s's rows of these heads to rank s; from every rank d this rank's rows of its heads.
    RowMatrix<Scalar> back(batch * total, ep), mine(ranks * batch * n, ep);
    for (int s = 0; s < ranks; ++s) {
      for_rows_of(s, [&](Index i, Index w) { back.row(rdispl[s] + i) = o.row(w); });
    }
    alltoallv(back.data(), rcount, rdispl, mine.data(), scount, sdispl, ep);
    for (int d = 0; d < ranks; ++d) c2f::detail::cols_of(attn, d * ep, ep) = mine.middleRows(d * batch * n, batch * n);
  }

  /// MPI_Alltoallv of rows of `width` scalars (counts and displacements in rows).
  void alltoallv(const Scalar* send, const std::vector<int>& scount, const std::vector<int>& sdispl, Scalar* recv,
                 const std::vector<int>& rcount, const std::vector<int>& rdispl, Index width) const {
    const detail::RowType<Scalar> row(width, type_name);
    MPI_Alltoallv(send, scount.data(), sdispl.data(), row.get(), recv, rcount.data(), rdispl.data(), row.get(),
                  comm_.get());
  }

  Options options_;
};

}  // namespace dist
}  // namespace c2f
