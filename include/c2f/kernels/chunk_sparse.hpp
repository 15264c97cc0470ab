// c2f kernels — coarse-guided chunk-sparse attention (NSA / MoBA-style block selection) on the
// projections of a multi-head attention.
//
// q, k, v, out are [batch·length, heads·dh] row-major matrices (head h = columns [h·dh, (h+1)·dh)).
// Chunks of `grid` (the last may be partial) serve both as query chunks and as key chunks.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/mask_plan.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/softmax.hpp"
#include "c2f/kernels/chunk.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace c2f {
namespace kernels {

/// Selected key chunks of every (batch, head, query chunk), ascending, −1 where fewer than top_k
/// chunks are eligible: a row-major [batch, heads, chunks_per_batch, top_k] array.
struct ChunkSelection {
  Index batch = 0, heads = 0, chunks = 0, top_k = 0;
  std::vector<Index> index;

  Index* row(Index b, Index h, Index i) { return index.data() + ((b * heads + h) * chunks + i) * top_k; }
  const Index* row(Index b, Index h, Index i) const { return index.data() + ((b * heads + h) * chunks + i) * top_k; }
};

/// Coarse stage: per (batch, head), q̄_i and k̄_j are the means of the projected queries and keys of
/// chunk i and j; query chunk i keeps itself and the (top_k − 1) eligible chunks j ≠ i with the highest
/// q̄_i·k̄_j (ties to the lower index); eligible = all chunks, or j ≤ i with `causal`.
template <class Scalar>
ChunkSelection select_chunks(const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
                             const ChunkGrid& grid, Index heads, Index top_k, bool causal, int num_threads) {
  if (top_k < 1) detail::fail("select_chunks: top_k must be >= 1, got ", top_k);
  const Index m = grid.chunks_per_batch(), dim = q.cols(), dh = dim / heads;
  ChunkSelection sel{grid.batch, heads, m, top_k, std::vector<Index>(static_cast<std::size_t>(grid.batch * heads * m * top_k), -1)};
  RowMatrix<Scalar> qm(grid.chunks(), dim), km(grid.chunks(), dim);
  chunk_mean<Scalar>(q, grid, qm, num_threads);
  chunk_mean<Scalar>(k, grid, km, num_threads);
  detail::parallel_for(grid.batch * heads, num_threads, [&](Index task, int) {
    const Index b = task / heads, h = task % heads;
    const RowMatrix<Scalar> s = qm.block(b * m, h * dh, m, dh) * km.block(b * m, h * dh, m, dh).transpose();
    std::vector<Index> candidates;
    for (Index i = 0; i < m; ++i) {
      const Index eligible = causal ? i + 1 : m;
      candidates.clear();
      for (Index j = 0; j < eligible; ++j) {
        if (j != i) candidates.push_back(j);
      }
      const Index others = std::min<Index>(top_k - 1, static_cast<Index>(candidates.size()));
      // Highest score first, ties to the lower index; a NaN score ranks like -inf.
      const auto score = [&](Index j) { return std::isnan(s(i, j)) ? -std::numeric_limits<Scalar>::infinity() : s(i, j); };
      std::partial_sort(candidates.begin(), candidates.begin() + others, candidates.end(), [&](Index x, Index y) {
        return score(x) > score(y) || (score(x) == score(y) && x < y);
      });
      Index* out = sel.row(b, h, i);
      out[0] = i;
      std::copy(candidates.begin(), candidates.begin() + others, out + 1);
      std::sort(out, out + others + 1);
    }
  });
  return sel;
}

/// Fine stage: every query of chunk i attends, with one softmax (scale 1/sqrt(dh)), to the keys of its
/// selected chunks; with `causal` only to keys at positions ≤ its own; `mask` (the library's masks,
/// absolute positions) combines. out[rows of chunk i, head h] = softmax(q kᵀ / sqrt(dh) + mask) v.
/// Tasks are (batch, head, query chunk); the selected keys and values of a task are gathered into one
/// block, so each task is two GEMMs: [chunk, dh] × [dh, selected keys] and back.
template <class Scalar>
void chunk_sparse_attention(const Eigen::Ref<const RowMatrix<Scalar>>& q, const Eigen::Ref<const RowMatrix<Scalar>>& k,
                            const Eigen::Ref<const RowMatrix<Scalar>>& v, const ChunkGrid& grid, Index heads,
                            const ChunkSelection& selection, bool causal, const detail::MaskPlan<Scalar>& mask,
                            Eigen::Ref<RowMatrix<Scalar>> out, int num_threads) {
  const Index m = grid.chunks_per_batch(), dh = q.cols() / heads, top_k = selection.top_k;
  const Scalar scale = static_cast<Scalar>(1.0 / std::sqrt(static_cast<double>(dh)));
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  struct Workspace {
    RowMatrix<Scalar> kg, vg, s;
  };
  const Index tasks = grid.batch * heads * m;
  std::vector<Workspace> work(static_cast<std::size_t>(detail::resolve_threads(num_threads, tasks)));
  detail::parallel_for(tasks, num_threads, [&](Index task, int worker) {
    const Index i = task % m, bh = task / m, b = bh / heads, h = bh % heads;
    const Index c = b * m + i, rows = grid.count(c), q_row = grid.row(c), i0 = grid.first(c);
    const Index* chosen = selection.row(b, h, i);
    Index n = 0;
    for (Index t = 0; t < top_k && chosen[t] >= 0; ++t) n += grid.count(b * m + chosen[t]);
    Workspace& ws = work[static_cast<std::size_t>(worker)];
    ws.kg.resize(n, dh);
    ws.vg.resize(n, dh);
    Index filled = 0;
    for (Index t = 0; t < top_k && chosen[t] >= 0; ++t) {
      const Index kc = b * m + chosen[t], count = grid.count(kc);
      ws.kg.middleRows(filled, count) = k.block(grid.row(kc), h * dh, count, dh);
      ws.vg.middleRows(filled, count) = v.block(grid.row(kc), h * dh, count, dh);
      filled += count;
    }
    ws.s.resize(rows, n);
    ws.s.noalias() = (q.block(q_row, h * dh, rows, dh) * scale) * ws.kg.transpose();
    filled = 0;
    for (Index t = 0; t < top_k && chosen[t] >= 0; ++t) {
      const Index kc = b * m + chosen[t], count = grid.count(kc), j0 = grid.first(kc);
      Eigen::Block<RowMatrix<Scalar>> block = ws.s.middleCols(filled, count);
      if (!mask.empty()) mask.apply(b, h, i0, j0, block);
      if (causal && j0 + count - 1 > i0) {
        for (Index r = 0; r < rows; ++r) {
          for (Index col = std::max<Index>(0, i0 + r + 1 - j0); col < count; ++col) block(r, col) = kNegInf;
        }
      }
      filled += count;
    }
    for (Index r = 0; r < rows; ++r) detail::softmax_row(ws.s.row(r));
    out.block(q_row, h * dh, rows, dh).noalias() = ws.s * ws.vg;
  });
}

}  // namespace kernels
}  // namespace c2f
