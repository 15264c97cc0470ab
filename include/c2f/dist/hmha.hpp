// c2f dist — sequence-parallel HMHA: each rank holds a window-aligned shard of the sequence.
//
// Rank r holds positions [s_r, e_r) of every batch item, s_r a multiple of the window W (the last
// shard may end on a partial window; a rank may hold none). Per call (docs/distributed.md):
//   projections  the C3K2 convolutions (k = 3) read one position either side (causal: the two before):
//                that halo is fetched from the neighbouring shards (one MPI_Alltoallv of input rows);
//   level 1      windows lie inside shards: local;
//   level 2      one MPI_Allgatherv of every window's key and value means (2E values per window); each
//                rank attends its own windows' mean queries over all windows (causal: its tokens over
//                the complete windows before theirs);
//   level 3      the keys and values at power-of-two distances: those within D of the shard (D the
//                largest power of two <= the shard's length) form one contiguous range on each side;
//                each farther distance δ needs the shard-sized range [s_r + δ, e_r + δ) — about
//                2·log2(L / D) shard-sized ranges, fetched with one MPI_Alltoallv for the keys and
//                one for the values; the kernel reads each offset's rows where they lie
//                (kernels::sparse_global_attention_rows_add);
//   out_proj     local.
// Outputs equal c2f::HMHA::forward on the whole sequence to rounding (products over other row
// groupings): within 1e-5 in float, 1e-10 in double (tests/dist).
#pragma once

#include "c2f/dist/coarse_stage.hpp"
#include "c2f/dist/fetch.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/hierarchical.hpp"
#include "c2f/layers/hmha.hpp"

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

namespace c2f {
namespace dist {
namespace detail {

/// The rows level 3 of the shard [s, e) of a sequence of `length` positions reads besides its own: the
/// ranges `near` before and after it (within `reach` positions; after only without causal), then one
/// range per offset farther than `reach`, in the order of kernels::sparse_offsets.
struct GlobalRows {
  Index reach = 0;
  std::vector<Range> ranges;  ///< before, after, then the far offsets'
  std::vector<Index> far;     ///< the far offsets, in that order
};

inline GlobalRows global_rows(Index s, Index e, Index length, bool causal) {
  GlobalRows g;
  if (e <= s) return g;  // an empty shard reads nothing
  for (Index step = 1; step < length && step <= e - s; step *= 2) g.reach = step;
  g.ranges.push_back(Range{std::max<Index>(0, s - g.reach), s});
  g.ranges.push_back(Range{e, causal ? e : std::min(length, e + g.reach)});
  for (const Index delta : kernels::sparse_offsets(length, causal)) {
    if (std::abs(delta) <= g.reach) continue;
    const Index lo = std::min(length, std::max<Index>(0, s + delta));
    g.ranges.push_back(Range{lo, std::max(lo, std::min(length, e + delta))});
    g.far.push_back(delta);
  }
  return g;
}

/// Per batch item, `lead` rows, own's n rows and `trail` rows: before [batch·a, width] (a <= lead) fills
/// the end of the lead, after [batch·c, width] (c <= trail) the start of the trail, zeros the rest.
template <class Scalar>
RowMatrix<Scalar> join_rows(const RowMatrix<Scalar>& before, const ConstRowMatrixRef<Scalar>& own,
                            const RowMatrix<Scalar>& after, Index batch, Index lead, Index trail) {
  const Index n = own.rows() / batch, span = lead + n + trail, a = before.rows() / batch, c = after.rows() / batch;
  RowMatrix<Scalar> joined = RowMatrix<Scalar>::Zero(batch * span, own.cols());
  for (Index i = 0; i < batch; ++i) {
    joined.middleRows(i * span + lead - a, a) = before.middleRows(i * a, a);
    joined.middleRows(i * span + lead, n) = own.middleRows(i * n, n);
    joined.middleRows(i * span + lead + n, c) = after.middleRows(i * c, c);
  }
  return joined;
}

}  // namespace detail

/// HMHA over a sequence sharded by windows across the ranks of a communicator. Every rank holds the full
/// weights (module()) and calls forward() at the same time with its shard x [B, n_r, E]: n_r positions
/// starting at a multiple of the window (dist::even_shard(L, window, r, P) gives the even plan). Takes no
/// masks; causal and the levels are the module's options.
template <class Scalar>
class HMHA : public detail::DistLayer<HMHA<Scalar>, c2f::HMHA<Scalar>, Scalar> {
  C2F_DIST_LAYER_BASICS(HMHA);
  using Base::Base;  // (comm, sizes…, options = {}) or (comm, module): detail::DistLayer

  // comm(), module() and forward(x, masks) → this rank's output rows [B, n_r, E] (detail::DistLayer).

  /// forward() into caller memory: out [B·n_r, E].
  void forward_into(ConstTensor3Ref<Scalar> x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks = {}) const {
    const Index e = module_.embed_dim(), h = module_.num_heads(), w = module_.window(), b = x.batch(), n = x.seq();
    const bool causal = module_.causal();
    const HMHALevels levels = module_.options().levels();
    const std::vector<detail::Field> fields =
        this->call_fields(b, x.features(),
                          {{"window", w, true},
                           {"causal", causal ? 1 : 0, true},
                           {"the levels (local, cross, global)",
                            (levels.local ? 1 : 0) + (levels.cross ? 2 : 0) + (levels.global ? 4 : 0), true}},
                          {}, {"the shard's length", n, false});
    const std::vector<std::vector<std::int64_t>> reports = detail::exchange(comm_, type_name, fields, [&] {
      c2f::detail::check_mask_fields(masks, "HMHA", Module::mask_fields);
      c2f::detail::check_features(x, e, "HMHA", "x", "embed_dim");
      c2f::detail::check_out("HMHA", out, {b, n, e});
    });
    const std::vector<Index> begin = detail::aligned_starts(type_name, reports, w, "token", "window");
    const int me = comm_.rank();
    const Index s = begin[me], length = begin.back();
    const kernels::KernelOptions threads = c2f::detail::kernel_options(module_.options());
    const Scalar scale = kernels::default_scale<Scalar>(module_.head_dim());
    const kernels::ChunkGrid windows{b, n, w};  // this shard's windows (it starts on one)

    // 1. The projections, on the shard with its halo: 1 position either side (causal: 2 before).
    const Index before = causal ? 2 : 1, after = causal ? 0 : 1, span = before + n + after;
    const std::vector<RowMatrix<Scalar>> halo =
        detail::fetch_rows<Scalar>(comm_, type_name, x.rows(), b, begin, [&](int r) {
          const Index rs = begin[r], re = begin[r + 1];
          if (re == rs) return std::vector<detail::Range>{};
          return std::vector<detail::Range>{{std::max<Index>(0, rs - before), rs}, {re, std::min(length, re + after)}};
        });
    RowMatrix<Scalar> q(b * n, e), k(b * n, e), v(b * n, e), o = RowMatrix<Scalar>::Zero(b * n, e);
    RowMatrix<Scalar> kv_means(levels.cross ? windows.chunks() : 0, 2 * e);
    const bool empty = b * n == 0;
    detail::all_or_none(comm_, type_name, [&] {
      if (empty) return;
      const RowMatrix<Scalar> ext = detail::join_rows<Scalar>(halo[0], x.rows(), halo[1], b, before, after);
      RowMatrix<Scalar> projected(b * span, e);
      const auto project = [&](const C3K2Projection<Scalar>& proj, RowMatrix<Scalar>& dst) {
        proj.forward_rows(ext, b, span, projected);
        for (Index i = 0; i < b; ++i) dst.middleRows(i * n, n) = projected.middleRows(i * span + before, n);
      };
      project(module_.q_proj(), q);
      project(module_.k_proj(), k);
      project(module_.v_proj(), v);
      // 2. Level 1 (local), and this shard's window means of the keys and values for level 2.
      if (levels.local) kernels::window_attention_add<Scalar>(q, k, v, windows, h, o, causal, scale, threads);
      if (levels.cross) {
        kernels::chunk_mean<Scalar>(k, windows, kv_means.leftCols(e), threads);
        kernels::chunk_mean<Scalar>(v, windows, kv_means.rightCols(e), threads);
      }
    });

    // 3. Every window's key and value means (level 2), and the key and value rows level 3 reads.
    const detail::BlockPlan plan = detail::block_plan(begin, w);
    const RowMatrix<Scalar> all =
        levels.cross ? detail::gather_blocks(comm_, type_name, kv_means, b, plan) : RowMatrix<Scalar>();
    const auto wanted = [&](int r) { return detail::global_rows(begin[r], begin[r + 1], length, causal).ranges; };
    std::vector<RowMatrix<Scalar>> far_k, far_v;
    if (levels.global) {
      far_k = detail::fetch_rows<Scalar>(comm_, type_name, k, b, begin, wanted);
      far_v = detail::fetch_rows<Scalar>(comm_, type_name, v, b, begin, wanted);
    }

    // 4. Levels 2 and 3, and out_proj.
    detail::all_or_none(comm_, type_name, [&] {
      if (empty) return;
      if (levels.cross && causal) {
        kernels::window_summary_attention_add<Scalar>(q, all.leftCols(e), all.rightCols(e),
                                                      kernels::ChunkGrid{b, s + n, w}, h, o, scale, threads);
      } else if (levels.cross) {
        RowMatrix<Scalar> q_means(windows.chunks(), e), c(windows.chunks(), e);
        kernels::chunk_mean<Scalar>(q, windows, q_means, threads);
        const Index m = plan.blocks, mr = windows.chunks_per_batch(), dh = module_.head_dim();
        kernels::sdpa_streaming<Scalar>(kernels::heads_view(std::as_const(q_means), b, mr, h),
                                        kernels::heads_view<const Scalar>(all.data(), b, m, 2 * e, 0, h, dh),
                                        kernels::heads_view<const Scalar>(all.data(), b, m, 2 * e, e, h, dh),
                                        kernels::heads_view(c, b, mr, h), MaskView<Scalar>(), scale, threads);
        kernels::broadcast_chunks_add<Scalar>(c, windows, o, threads);
      }
      if (levels.global) global_level(q, k, v, far_k, far_v, b, s, length, scale, o);
      module_.out_proj().forward_rows(o, out);
    });
  }

 private:
  /// Level 3 of this shard (positions [s, s + n)): the keys and values within reach of it in one
  /// contiguous block (fetched before | own | fetched after), the farther ones where they were fetched.
  void global_level(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k, const RowMatrix<Scalar>& v,
                    const std::vector<RowMatrix<Scalar>>& far_k, const std::vector<RowMatrix<Scalar>>& far_v,
                    Index batch, Index s, Index length, Scalar scale, RowMatrix<Scalar>& o) const {
    const Index n = q.rows() / batch, e = q.cols();
    const bool causal = module_.causal();
    const detail::GlobalRows g = detail::global_rows(s, s + n, length, causal);
    const Index lo = g.ranges[0].size(), hi = g.ranges[1].size();
    const RowMatrix<Scalar> near_k = detail::join_rows<Scalar>(far_k[0], k, far_k[1], batch, lo, hi);
    const RowMatrix<Scalar> near_v = detail::join_rows<Scalar>(far_v[0], v, far_v[1], batch, lo, hi);
    const auto rows_of = [&](const RowMatrix<Scalar>& keys, const RowMatrix<Scalar>& values, Index first) {
      kernels::OffsetRows<Scalar> r;
      r.k = keys.data();
      r.v = values.data();
      r.k_stride = r.v_stride = e;
      r.rows = keys.rows();
      r.batch_stride = batch > 0 ? keys.rows() / batch : 0;
      r.shift = s - first;  // row of position p: p − first
      return r;
    };
    std::vector<kernels::OffsetRows<Scalar>> sources;
    std::size_t far = 0;
    for (const Index delta : kernels::sparse_offsets(length, causal)) {
      if (std::abs(delta) <= g.reach) {
        sources.push_back(rows_of(near_k, near_v, s - lo));
      } else {
        sources.push_back(rows_of(far_k[2 + far], far_v[2 + far], g.ranges[2 + far].begin));
        ++far;
      }
    }
    kernels::sparse_global_attention_rows_add<Scalar>(q, batch, s, length, module_.num_heads(), o, causal, scale,
                                                      sources, c2f::detail::kernel_options(module_.options()));
  }
};

}  // namespace dist
}  // namespace c2f
