// c2f kernels — the attention levels of HMHA (hierarchical multi-head attention): local windows, the
// causal window-summary level, and the log-spaced sparse level.
//
// k, v are [batch·T, heads·head_dim] row-major matrices: the keys and values of positions 0 … T − 1 of
// every batch item (head h = columns [h·head_dim, (h+1)·head_dim)); q and out are [batch·n, …]: the
// queries of the LAST n positions, T − n … T − 1 (a forward pass has n = T; incremental decoding
// passes the new tokens' queries and the cached keys). Keys and values may be stored in another type
// `KV` (a KVCache's Eigen::half / bfloat16), converted block by block. Every kernel adds its result to
// `out` (out += …: the `_add` of the names), so the levels sum into one buffer. Scores are q·k · scale. Arguments are checked at entry
// (std::invalid_argument, every build type).
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/detail/masked_values.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/softmax.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/kernel_options.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace c2f {
namespace kernels {

/// Level 1: the query at position p of window c attends to the tokens of window c (with `causal`, to
/// those ≤ p): out[p] += softmax_t(q_p·k_t · scale) v_t per head. Windows are the chunks of `grid`.
/// Tasks are (batch item, window holding queries); each is one score block per head.
template <class Scalar, class KV = Scalar>
void window_attention_add(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                          const detail::NoDeduce<Eigen::Ref<const RowMatrix<KV>>>& k,
                          const detail::NoDeduce<Eigen::Ref<const RowMatrix<KV>>>& v, const ChunkGrid& grid, Index heads,
                          Eigen::Ref<RowMatrix<Scalar>> out, bool causal, Scalar scale, const KernelOptions& options) {
  const char* kernel = "window_attention_add";
  const Index n = detail::check_last_queries(kernel, q, out, k, v, grid, heads, scale);
  const Index dh = q.cols() / heads, T = grid.length;
  const QueryChunks windows(grid, n);
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  struct Workspace {
    RowMatrix<Scalar> s, kv;
    detail::MaskedValues<Scalar> masked;
  };
  const Index tasks = grid.batch * windows.count;
  const double work = detail::attention_work(grid.batch * heads, n, std::min(grid.chunk, T), dh, dh);
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    const Index b = task / windows.count, c = windows.first + task % windows.count;
    const Index w0 = c * grid.chunk, w1 = std::min(w0 + grid.chunk, T);  // keys [w0, w1)
    const Index p0 = std::max(w0, windows.first_position);                 // queries [p0, w1)
    const Index nq = w1 - p0, nk = w1 - w0;
    const Index q_row = b * n + p0 - windows.first_position, k_row = b * T + w0;
    ws.s.resize(nq, nk);
    for (Index h = 0; h < heads; ++h) {
      detail::as_scalar(k.block(k_row, h * dh, nk, dh), ws.kv,
                        [&](const auto& kb) { ws.s.noalias() = (q.block(q_row, h * dh, nq, dh) * scale) * kb.transpose(); });
      if (causal) {
        for (Index i = 0; i < nq; ++i) {
          const Index visible = p0 - w0 + i + 1;  // keys w0 … p0 + i
          if (visible < nk) ws.s.row(i).tail(nk - visible).setConstant(kNegInf);
        }
      }
      detail::as_scalar(v.block(k_row, h * dh, nk, dh), ws.kv, [&](const auto& vb) {
        // Future keys of the window may hold non-finite values: leave them out (masked_values.hpp).
        const bool guard = causal && ws.masked.find(vb);
        if (guard) ws.masked.remember_hidden(ws.s);
        for (Index i = 0; i < nq; ++i) detail::softmax_row(ws.s.row(i));
        if (guard) {
          ws.masked.template product<true>(out.block(q_row, h * dh, nq, dh), ws.s, vb);
        } else {
          out.block(q_row, h * dh, nq, dh).noalias() += ws.s * vb;
        }
      });
    }
  });
}

/// Causal level 2 (NSA's compressed branch): the query at position p of window c attends, with one
/// softmax, to the summaries of the complete windows before its own:
///   out[p] += softmax_j(q_p·k̄_j · scale) v̄_j per head, j = 0 … c − 1 (window 0 gets nothing).
/// k̄, v̄ [batch·m, heads·dh] hold the window means of each batch item (m ≥ the window of position
/// T − 1; a forward pass gives all windows, decoding the complete ones). Tasks are (batch item, window
/// holding queries); each is one [queries, c] score block per head, so a query's result never depends
/// on a later token.
template <class Scalar>
void window_summary_attention_add(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                  const Eigen::Ref<const RowMatrix<Scalar>>& k_mean,
                                  const Eigen::Ref<const RowMatrix<Scalar>>& v_mean, const ChunkGrid& grid, Index heads,
                                  Eigen::Ref<RowMatrix<Scalar>> out, Scalar scale, const KernelOptions& options) {
  const char* kernel = "window_summary_attention_add";
  const Index n = detail::check_last_queries(kernel, q, out, q, q, grid, heads, scale, /*keys_are_tokens=*/false);
  const Index dh = q.cols() / heads, T = grid.length;
  const QueryChunks windows(grid, n);
  const Index m = grid.batch > 0 ? k_mean.rows() / grid.batch : 0;
  if (k_mean.cols() != q.cols() || v_mean.cols() != q.cols() || k_mean.rows() != grid.batch * m ||
      v_mean.rows() != k_mean.rows() || (n > 0 && grid.batch > 0 && m < (T - 1) / grid.chunk)) {
    detail::fail(kernel, ": k_mean ", detail::shape_string({k_mean.rows(), k_mean.cols()}), " and v_mean ",
                 detail::shape_string({v_mean.rows(), v_mean.cols()}), " must be [batch·m, ", q.cols(),
                 "] with m >= ", (T - 1) / std::max<Index>(grid.chunk, 1), " windows per batch item");
  }
  const Index tasks = grid.batch * windows.count;
  const double work = detail::attention_work(grid.batch * heads, n, m, dh, dh);
  detail::parallel_for_each_worker<RowMatrix<Scalar>>(tasks, options.num_threads(), work, [&](Index task, RowMatrix<Scalar>& s) {
    const Index b = task / windows.count, c = windows.first + task % windows.count;
    if (c == 0) return;  // no window before the first
    const Index w0 = c * grid.chunk, w1 = std::min(w0 + grid.chunk, T);
    const Index p0 = std::max(w0, windows.first_position), nq = w1 - p0;
    const Index q_row = b * n + p0 - windows.first_position, first = b * m;
    s.resize(nq, c);
    for (Index h = 0; h < heads; ++h) {
      s.noalias() = (q.block(q_row, h * dh, nq, dh) * scale) * k_mean.block(first, h * dh, c, dh).transpose();
      for (Index i = 0; i < nq; ++i) detail::softmax_row(s.row(i));
      out.block(q_row, h * dh, nq, dh).noalias() += s * v_mean.block(first, h * dh, c, dh);
    }
  });
}

/// Offsets of the log-spaced key set of level 3, in the order the kernels visit them:
/// 0, −1, +1, −2, +2, −4, +4, … (|offset| < length); with `causal` only 0 and the negative ones.
inline std::vector<Index> sparse_offsets(Index length, bool causal) {
  std::vector<Index> offsets = {0};
  for (Index step = 1; step < length; step *= 2) {
    offsets.push_back(-step);
    if (!causal) offsets.push_back(step);
  }
  return offsets;
}

/// Query rows per task of sparse_global_attention_add(); fixed, so the bits do not depend on the thread count.
constexpr Index kSparseRowBlock = 64;

/// Where level 3 reads the keys and values at one offset δ (sparse_global_attention_rows_add): the key
/// and value of query i (position first_position + i) of batch item b at offset δ are row
/// b·batch_stride + i + δ + shift of k and of v — `rows` rows each, `k_stride` and `v_stride` apart
/// (v's rows contiguous, v_stride = their width, when they hold Scalar).
template <class KV>
struct OffsetRows {
  const KV* k = nullptr;
  const KV* v = nullptr;
  Index k_stride = 0, v_stride = 0, rows = 0;
  Index batch_stride = 0, shift = 0;
};

/// Level 3 for the queries of positions first_position … first_position + n − 1 of a sequence of
/// `length` positions (q, out [batch·n, heads·dh]), with the keys and values at offset
/// sparse_offsets(length, causal)[o] read from sources[o]: S(p) ∩ [0, length) as in
/// sparse_global_attention_add, which is this kernel with every offset's rows in one k and v. For a
/// shard of the sequence (c2f/dist), whose keys at each offset lie in local or fetched rows. Throws
/// unless every source holds the rows its offset's queries read.
///
/// The keys at one offset δ of a block of consecutive queries are a shifted block of consecutive key
/// rows, so the kernel works offset by offset on contiguous rows (no gather): scores for all rows and
/// heads at once, one softmax across offsets, then the weighted value rows.
template <class Scalar, class KV = Scalar>
void sparse_global_attention_rows_add(const Eigen::Ref<const RowMatrix<Scalar>>& q, Index batch, Index first_position,
                                      Index length, Index heads, Eigen::Ref<RowMatrix<Scalar>> out, bool causal,
                                      Scalar scale, const std::vector<OffsetRows<KV>>& sources,
                                      const KernelOptions& options) {
  const char* kernel = "sparse_global_attention_rows_add";
  if (batch < 0 || length < 0) detail::fail(kernel, ": batch and length must be >= 0");
  const Index n = batch > 0 ? q.rows() / batch : 0;
  if (first_position < 0 || first_position > length - n) {
    detail::fail(kernel, ": the queries' positions [", first_position, ", ", first_position + n, ") must lie in [0, ",
                 length, ")");
  }
  detail::check_last_queries(kernel, q, out, q, q, ChunkGrid{batch, n, 1}, heads, scale, /*keys_are_tokens=*/false);
  const Index dim = q.cols(), dh = dim / heads, T = length, p0 = first_position;
  if (out.outerStride() != dim) detail::fail(kernel, ": out must be a contiguous [rows, ", dim, "] matrix");
  const std::vector<Index> offsets = sparse_offsets(T, causal);
  const Index noff = static_cast<Index>(offsets.size());
  if (static_cast<Index>(sources.size()) != noff) {
    detail::fail(kernel, ": one source of key rows per offset (", noff, " offsets for length ", T, "), got ",
                 sources.size());
  }
  // Queries [i0, i1) of the n have a key at offset δ (inside [0, T)).
  const auto queries_with_key = [&](Index delta, Index a, Index nb, Index& i0, Index& i1) {
    i0 = std::max<Index>(0, -delta - p0 - a);
    i1 = std::min(nb, T - delta - p0 - a);
    return i1 > i0;
  };
  for (Index o = 0; o < noff && batch > 0; ++o) {
    const OffsetRows<KV>& s = sources[static_cast<std::size_t>(o)];
    const Index delta = offsets[static_cast<std::size_t>(o)];
    Index i0 = 0, i1 = 0;
    if (!queries_with_key(delta, 0, n, i0, i1)) continue;
    const Index lo = i0 + delta + s.shift, hi = (batch - 1) * s.batch_stride + i1 + delta + s.shift;
    const bool strides = s.k_stride >= dim && s.v_stride >= dim && (!std::is_same<KV, Scalar>::value || s.v_stride == dim);
    if (s.k == nullptr || s.v == nullptr || !strides || s.batch_stride < 0 || lo < 0 || hi > s.rows) {
      detail::fail(kernel, ": the source of offset ", delta, " must hold key and value rows [", lo, ", ", hi, ") of width ",
                   dim, " (value rows contiguous), got ", s.rows, " rows with strides ", s.k_stride, " and ", s.v_stride);
    }
  }
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index blocks_per_batch = (n + kSparseRowBlock - 1) / kSparseRowBlock;
  const double work = detail::attention_work(batch * heads, n, noff, dh, dh);
  using Rows = Eigen::Map<const RowMatrix<KV>, 0, Eigen::OuterStride<>>;
  detail::parallel_for(batch * blocks_per_batch, options.num_threads(), work, [&](Index task, int) {
    const Index b = task / blocks_per_batch;
    const Index a = (task % blocks_per_batch) * kSparseRowBlock, nb = std::min(kSparseRowBlock, n - a);
    const Index q_base = b * n + a;
    // Row of the key at offset o of query a + i.
    const auto key_row = [&](const OffsetRows<KV>& s, Index delta, Index i) { return b * s.batch_stride + a + i + delta + s.shift; };
    // scores(r·heads + h, o): query a + r, head h, key at offset offsets[o].
    RowMatrix<Scalar> scores = RowMatrix<Scalar>::Constant(nb * heads, noff, kNegInf);
    RowMatrix<Scalar> prod(nb, dim), kv;
    Index i0 = 0, i1 = 0;
    for (Index o = 0; o < noff; ++o) {
      const Index delta = offsets[static_cast<std::size_t>(o)];
      if (!queries_with_key(delta, a, nb, i0, i1)) continue;
      const OffsetRows<KV>& s = sources[static_cast<std::size_t>(o)];
      const Index rows = i1 - i0;
      const Rows kb(s.k + key_row(s, delta, i0) * s.k_stride, rows, dim, Eigen::OuterStride<>(s.k_stride));
      detail::as_scalar(kb, kv, [&](const auto& k) { prod.topRows(rows) = q.middleRows(q_base + i0, rows).cwiseProduct(k); });
      scores.col(o).segment(i0 * heads, rows * heads) =
          Eigen::Map<const RowMatrix<Scalar>>(prod.data(), rows * heads, dh).rowwise().sum() * scale;
    }
    for (Index r = 0; r < nb * heads; ++r) detail::softmax_row(scores.row(r));
    for (Index o = 0; o < noff; ++o) {
      const Index delta = offsets[static_cast<std::size_t>(o)];
      if (!queries_with_key(delta, a, nb, i0, i1)) continue;
      const OffsetRows<KV>& s = sources[static_cast<std::size_t>(o)];
      const Index rows = i1 - i0;
      // out rows as [rows·heads, dh]: each (query, head) row gains weight · its value row.
      Eigen::Map<RowMatrix<Scalar>> dst(out.row(q_base + i0).data(), rows * heads, dh);
      const Rows vb(s.v + key_row(s, delta, i0) * s.v_stride, rows, dim, Eigen::OuterStride<>(s.v_stride));
      detail::as_scalar(vb, kv, [&](const auto& v) {
        const Eigen::Map<const RowMatrix<Scalar>> src(v.data(), rows * heads, dh);
        dst.noalias() += scores.col(o).segment(i0 * heads, rows * heads).asDiagonal() * src;
      });
    }
  });
}

/// Level 3: the query at position p attends to S(p) = {p} ∪ {p − 2^i, p + 2^i : i ≥ 0} ∩ [0, T) (with
/// `causal`, {p} ∪ {p − 2^i}): out[p] += softmax_t(q_p·k_t · scale) v_t per head. out must be
/// contiguous, and v too when it holds Scalar. (sparse_global_attention_rows_add with every offset's
/// rows in k and v.)
template <class Scalar, class KV = Scalar>
void sparse_global_attention_add(const Eigen::Ref<const RowMatrix<Scalar>>& q,
                                 const detail::NoDeduce<Eigen::Ref<const RowMatrix<KV>>>& k,
                                 const detail::NoDeduce<Eigen::Ref<const RowMatrix<KV>>>& v, Index batch, Index length,
                                 Index heads, Eigen::Ref<RowMatrix<Scalar>> out, bool causal, Scalar scale,
                                 const KernelOptions& options) {
  const char* kernel = "sparse_global_attention_add";
  if (batch < 0 || length < 0) detail::fail(kernel, ": batch and length must be >= 0");
  const Index n = detail::check_last_queries(kernel, q, out, k, v, ChunkGrid{batch, length, 1}, heads, scale);
  if ((std::is_same<KV, Scalar>::value && v.outerStride() != q.cols()) || out.outerStride() != q.cols()) {
    detail::fail(kernel, ": v and out must be contiguous [rows, ", q.cols(), "] matrices");
  }
  // Query i (position T − n + i) of batch item b reads key row b·T + (T − n) + i + δ.
  OffsetRows<KV> all;
  all.k = k.data();
  all.v = v.data();
  all.k_stride = k.outerStride();
  all.v_stride = v.outerStride();
  all.rows = k.rows();
  all.batch_stride = length;
  all.shift = length - n;
  const std::vector<OffsetRows<KV>> sources(sparse_offsets(length, causal).size(), all);
  sparse_global_attention_rows_add<Scalar, KV>(q, batch, length - n, length, heads, out, causal, scale, sources, options);
}

}  // namespace kernels
}  // namespace c2f
