// c2f kernels — the attention levels of HMHA (hierarchical multi-head attention): local windows, the
// causal window-summary level, and the log-spaced sparse level.
//
// k, v are [batch·T, heads·head_dim] row-major matrices: the keys and values of positions 0 … T − 1 of
// every batch item (head h = columns [h·head_dim, (h+1)·head_dim)); q and out are [batch·n, …]: the
// queries of the LAST n positions, T − n … T − 1 (a forward pass has n = T; incremental decoding
// passes the new tokens' queries and the cached keys). Keys and values may be stored in another type
// `KV` (a KVCache's Eigen::half / bfloat16), converted block by block. Every kernel adds its result to
// `out` (out += …: the `_add` of the names), so the levels sum into one buffer. Scores are q·k · scale. Arguments are
// checked at entry (std::invalid_argument, every build type).
//
// Training (docs/training.md): each level's backward pass (`…_backward_add`), queries at every position
// (n = T); the window means' and their broadcast's are chunk.hpp's chunk_mean_backward_add and chunk_sum.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/cpu/masked_values.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/detail/parallel.hpp"
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
void window_attention_add(const ConstRowMatrixRef<Scalar>& q, const detail::NoDeduce<ConstRowMatrixRef<KV>>& k,
                          const detail::NoDeduce<ConstRowMatrixRef<KV>>& v, const ChunkGrid& grid, Index heads,
                          RowMatrixRef<Scalar> out, bool causal, Scalar scale, const KernelOptions& options) {
  const char* kernel = "window_attention_add";
  const Index n = detail::check_last_queries(kernel, q, out, k, v, grid, heads, scale);
  const bool bf16 = cpu::check_compute<Scalar, KV>(kernel, options.compute(), true);
  const Index dh = q.cols() / heads, T = grid.length;
  const QueryChunks windows(grid, n);
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  struct Workspace {
    RowMatrix<Scalar> s, kv, qs;  // qs: Compute::BFloat16's q·scale
    cpu::MaskedValues<Scalar> masked;
    cpu::Bf16Operands ops;  // Compute::BFloat16: a head's keys or values packed for the engine, q or p rounded
  };
  const Index tasks = grid.batch * windows.count;
  const double work = detail::attention_work(grid.batch * heads, n, std::min(grid.chunk, T), dh, dh);
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    const Index b = task / windows.count, c = windows.first + task % windows.count;
    const Index w0 = c * grid.chunk, w1 = std::min(w0 + grid.chunk, T);  // keys [w0, w1)
    const Index p0 = std::max(w0, windows.first_position);               // queries [p0, w1)
    const Index nq = w1 - p0, nk = w1 - w0;
    const Index q_row = b * n + p0 - windows.first_position, k_row = b * T + w0;
    ws.s.resize(nq, nk);
    const cpu::Bf16Tiles tile_registers(bf16 ? bf16_engine() : Bf16Engine::Fallback);
    for (Index h = 0; h < heads; ++h) {
      if constexpr (std::is_same<Scalar, float>::value) {
        if (bf16) {  // Compute::BFloat16: q·scale and the keys rounded, their product on the engine
          ws.qs = q.block(q_row, h * dh, nq, dh) * scale;
          detail::as_scalar(k.block(k_row, h * dh, nk, dh), ws.kv, [&](const auto& kb) {
            cpu::bf16_product(ws.qs.data(), ws.qs.outerStride(), nq, kb.transpose(), false, ws.s.data(),
                              ws.s.outerStride(), ws.ops);
          });
        }
      }
      if (!bf16) {
        detail::as_scalar(k.block(k_row, h * dh, nk, dh), ws.kv, [&](const auto& kb) {
          ws.s.noalias() = (q.block(q_row, h * dh, nq, dh) * scale) * kb.transpose();
        });
      }
      if (causal) {
        for (Index i = 0; i < nq; ++i) {
          const Index visible = p0 - w0 + i + 1;  // keys w0 … p0 + i
          if (visible < nk) ws.s.row(i).tail(nk - visible).setConstant(kNegInf);
        }
      }
      cpu::as_scalar_rounded(v.block(k_row, h * dh, nk, dh), ws.kv, bf16, [&](const auto& vb) {
        // Future keys of the window may hold non-finite values: leave them out (masked_values.hpp).
        const bool guard = causal && ws.masked.find(vb);
        if (guard) ws.masked.remember_hidden(ws.s);
        for (Index i = 0; i < nq; ++i) cpu::softmax_row(ws.s.row(i));
        if (bf16 && !guard) {  // the probabilities and values rounded, their product on the engine
          if constexpr (std::is_same<Scalar, float>::value) {
            cpu::bf16_product(ws.s.data(), ws.s.outerStride(), nq, vb, true, &out(q_row, h * dh), out.outerStride(),
                              ws.ops);
          }
          return;
        }
        if (bf16) cpu::round_bf16_matrix(ws.s);  // the probabilities
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
void window_summary_attention_add(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k_mean,
                                  const ConstRowMatrixRef<Scalar>& v_mean, const ChunkGrid& grid, Index heads,
                                  RowMatrixRef<Scalar> out, Scalar scale, const KernelOptions& options) {
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
  const bool bf16 = cpu::check_compute<Scalar>(kernel, options.compute());
  const Index tasks = grid.batch * windows.count;
  const double work = detail::attention_work(grid.batch * heads, n, m, dh, dh);
  struct Workspace {
    RowMatrix<Scalar> s, qs;  // qs: Compute::BFloat16's q·scale
    cpu::Bf16Operands ops;    // Compute::BFloat16: the key means, then the value means packed for the engine
  };
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    const Index b = task / windows.count, c = windows.first + task % windows.count;
    if (c == 0) return;  // no window before the first
    const Index w0 = c * grid.chunk, w1 = std::min(w0 + grid.chunk, T);
    const Index p0 = std::max(w0, windows.first_position), nq = w1 - p0;
    const Index q_row = b * n + p0 - windows.first_position, first = b * m;
    RowMatrix<Scalar>& s = ws.s;
    s.resize(nq, c);
    const cpu::Bf16Tiles tile_registers(bf16 ? bf16_engine() : Bf16Engine::Fallback);
    for (Index h = 0; h < heads; ++h) {
      if constexpr (std::is_same<Scalar, float>::value) {
        if (bf16) {  // Compute::BFloat16: every operand rounded, the two products on the engine
          ws.qs = q.block(q_row, h * dh, nq, dh) * scale;
          cpu::bf16_product(ws.qs.data(), ws.qs.outerStride(), nq, k_mean.block(first, h * dh, c, dh).transpose(),
                            false, s.data(), s.outerStride(), ws.ops);
          for (Index i = 0; i < nq; ++i) cpu::softmax_row(s.row(i));
          cpu::bf16_product(s.data(), s.outerStride(), nq, v_mean.block(first, h * dh, c, dh), true,
                            &out(q_row, h * dh), out.outerStride(), ws.ops);
          continue;
        }
      }
      s.noalias() = (q.block(q_row, h * dh, nq, dh) * scale) * k_mean.block(first, h * dh, c, dh).transpose();
      for (Index i = 0; i < nq; ++i) cpu::softmax_row(s.row(i));
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
void sparse_global_attention_rows_add(const ConstRowMatrixRef<Scalar>& q, Index batch, Index first_position,
                                      Index length, Index heads, RowMatrixRef<Scalar> out, bool causal, Scalar scale,
                                      const std::vector<OffsetRows<KV>>& sources, const KernelOptions& options) {
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
    const bool strides =
        s.k_stride >= dim && s.v_stride >= dim && (!std::is_same<KV, Scalar>::value || s.v_stride == dim);
    if (s.k == nullptr || s.v == nullptr || !strides || s.batch_stride < 0 || lo < 0 || hi > s.rows) {
      detail::fail(kernel, ": the source of offset ", delta, " must hold key and value rows [", lo, ", ", hi,
                   ") of width ", dim, " (value rows contiguous), got ", s.rows, " rows with strides ", s.k_stride,
                   " and ", s.v_stride);
    }
  }
  const bool bf16 = cpu::check_compute<Scalar, KV>(kernel, options.compute(), true);
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index blocks_per_batch = (n + kSparseRowBlock - 1) / kSparseRowBlock;
  const double work = detail::attention_work(batch * heads, n, noff, dh, dh);
  using Rows = Eigen::Map<const RowMatrix<KV>, 0, Eigen::OuterStride<>>;
  // Per worker, kept across its tasks: a task's blocks (prod alone is 128 KiB at d = 512) allocated per
  // task were fresh pages from glibc on every one.
  struct Workspace {
    RowMatrix<Scalar> scores, prod, kv, qs;
  };
  detail::parallel_for_each_worker<Workspace>(
      batch * blocks_per_batch, options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index b = task / blocks_per_batch;
        const Index a = (task % blocks_per_batch) * kSparseRowBlock, nb = std::min(kSparseRowBlock, n - a);
        const Index q_base = b * n + a;
        // Row of the key at offset o of query a + i.
        const auto key_row = [&](const OffsetRows<KV>& s, Index delta, Index i) {
          return b * s.batch_stride + a + i + delta + s.shift;
        };
        // scores(r·heads + h, o): query a + r, head h, key at offset offsets[o].
        RowMatrix<Scalar>& scores = ws.scores;
        RowMatrix<Scalar>& prod = ws.prod;
        RowMatrix<Scalar>& kv = ws.kv;
        RowMatrix<Scalar>& qs = ws.qs;
        scores.setConstant(nb * heads, noff, kNegInf);
        prod.resize(nb, dim);
        // Compute::BFloat16 (float only, checked above): q·scale, the keys, probabilities and values rounded.
        if (bf16) {
          qs = q.middleRows(q_base, nb) * scale;
          cpu::round_bf16_matrix(qs);
        }
        Index i0 = 0, i1 = 0;
        for (Index o = 0; o < noff; ++o) {
          const Index delta = offsets[static_cast<std::size_t>(o)];
          if (!queries_with_key(delta, a, nb, i0, i1)) continue;
          const OffsetRows<KV>& s = sources[static_cast<std::size_t>(o)];
          const Index rows = i1 - i0;
          const Rows kb(s.k + key_row(s, delta, i0) * s.k_stride, rows, dim, Eigen::OuterStride<>(s.k_stride));
          if (bf16) {
            if constexpr (std::is_same<KV, float>::value && std::is_same<Scalar, float>::value) {
              prod.topRows(rows) = qs.middleRows(i0, rows).cwiseProduct(kb.unaryExpr(cpu::RoundBf16Floats()));
            } else {
              cpu::round_bf16_copy(kb, kv);
              prod.topRows(rows) = qs.middleRows(i0, rows).cwiseProduct(kv);
            }
            scores.col(o).segment(i0 * heads, rows * heads) =
                Eigen::Map<const RowMatrix<Scalar>>(prod.data(), rows * heads, dh).rowwise().sum();
            continue;
          }
          detail::as_scalar(
              kb, kv, [&](const auto& k) { prod.topRows(rows) = q.middleRows(q_base + i0, rows).cwiseProduct(k); });
          scores.col(o).segment(i0 * heads, rows * heads) =
              Eigen::Map<const RowMatrix<Scalar>>(prod.data(), rows * heads, dh).rowwise().sum() * scale;
        }
        for (Index r = 0; r < nb * heads; ++r) cpu::softmax_row(scores.row(r));
        if (bf16) cpu::round_bf16_matrix(scores);
        for (Index o = 0; o < noff; ++o) {
          const Index delta = offsets[static_cast<std::size_t>(o)];
          if (!queries_with_key(delta, a, nb, i0, i1)) continue;
          const OffsetRows<KV>& s = sources[static_cast<std::size_t>(o)];
          const Index rows = i1 - i0;
          // out rows as [rows·heads, dh]: each (query, head) row gains weight · its value row.
          Eigen::Map<RowMatrix<Scalar>> dst(out.row(q_base + i0).data(), rows * heads, dh);
          const Rows vb(s.v + key_row(s, delta, i0) * s.v_stride, rows, dim, Eigen::OuterStride<>(s.v_stride));
          if constexpr (std::is_same<KV, float>::value && std::is_same<Scalar, float>::value) {
            if (bf16) {  // the value rows rounded in registers (contiguous: v_stride = dim, checked above)
              const Eigen::Map<const RowMatrix<Scalar>> src(vb.data(), rows * heads, dh);
              dst.noalias() +=
                  scores.col(o).segment(i0 * heads, rows * heads).asDiagonal() * src.unaryExpr(cpu::RoundBf16Floats());
              continue;
            }
          }
          cpu::as_scalar_rounded(vb, kv, bf16, [&](const auto& v) {
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
void sparse_global_attention_add(const ConstRowMatrixRef<Scalar>& q, const detail::NoDeduce<ConstRowMatrixRef<KV>>& k,
                                 const detail::NoDeduce<ConstRowMatrixRef<KV>>& v, Index batch, Index length,
                                 Index heads, RowMatrixRef<Scalar> out, bool causal, Scalar scale,
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
  sparse_global_attention_rows_add<Scalar, KV>(q, batch, length - n, length, heads, out, causal, scale, sources,
                                               options);
}

// ------------------------------------------------------------------------------------------------
// Training: the levels' backward passes. Each ADDS its gradients to dq, dk, dv (… += …), so the levels sum
// into one buffer each as their outputs sum in the forward. Every gradient row is written by one task, its
// terms added in a fixed order: the bits depend on the shapes only, never on the thread count. The
// probabilities are recomputed from q and k (no [queries, keys] state is kept between the passes); where a
// key's gradient gathers from queries of other tasks (levels 2 causal and 3), a first pass over the queries
// keeps each (query, head)'s log-sum-exp and D = Σ_t p_t dp_t, O(T · heads), and a second pass over the
// keys recomputes p = exp(s − lse). Twins: tests/support/hmha_dense.hpp (sdpa_backward_naive under dense
// masks).

namespace impl {
/// A level backward's [rows, width] matrix (`what`); `contiguous`: its rows are read as [rows·heads, dh].
template <class M>
void check_level_matrix(const char* kernel, const char* what, const M& m, Index rows, Index width, bool contiguous) {
  detail::check_shape(kernel, what, m, rows, width);
  if (contiguous && m.outerStride() != width)
    detail::fail(kernel, ": ", what, " must be a contiguous [rows, ", width, "] matrix");
}

/// The arguments of a level backward: the grid, heads dividing q's width, the scale; q, dout, dq
/// [grid.tokens(), width]; k, v, dk, dv [key_rows, width].
template <class Scalar, class Q, class DQ>
void check_level_backward(const char* kernel, const kernels::ChunkGrid& grid, Index heads, Scalar scale, const Q& q,
                          const Q& k, const Q& v, const Q& dout, const DQ& dq, const DQ& dk, const DQ& dv,
                          Index key_rows, bool contiguous) {
  detail::check_grid(kernel, grid);
  detail::check_heads(kernel, q.cols(), heads);
  detail::check_scale(kernel, scale);
  const Index rows = grid.tokens(), width = q.cols();
  check_level_matrix(kernel, "q", q, rows, width, contiguous);
  check_level_matrix(kernel, "dout", dout, rows, width, contiguous);
  check_level_matrix(kernel, "dq", dq, rows, width, contiguous);
  check_level_matrix(kernel, "k", k, key_rows, width, contiguous);
  check_level_matrix(kernel, "v", v, key_rows, width, contiguous);
  check_level_matrix(kernel, "dk", dk, key_rows, width, contiguous);
  check_level_matrix(kernel, "dv", dv, key_rows, width, contiguous);
}

}  // namespace impl

/// Level 1's backward (window_attention_add with every position a query): per window and head the
/// probabilities p = softmax(q kᵀ · scale) of the window (causal: keys ≤ the query), dp = dout vᵀ,
/// D = rowsum(p ∘ dp), dS = p ∘ (dp − D); dq += scale · dS k, dk += scale · dSᵀ q, dv += pᵀ dout. A window's
/// rows of dq, dk, dv come from its own queries only: tasks are (batch item, window). A NaN or Inf in a key
/// or value a causal row hides reaches none of that row's gradients (masked_values.hpp). All matrices are
/// [batch·T, heads·dh].
template <class Scalar>
void window_attention_backward_add(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                                   const ConstRowMatrixRef<Scalar>& v, const ConstRowMatrixRef<Scalar>& dout,
                                   const ChunkGrid& grid, Index heads, RowMatrixRef<Scalar> dq, RowMatrixRef<Scalar> dk,
                                   RowMatrixRef<Scalar> dv, bool causal, Scalar scale, const KernelOptions& options) {
  const char* kernel = "window_attention_backward_add";
  impl::check_level_backward(kernel, grid, heads, scale, q, k, v, dout, dq, dk, dv, grid.tokens(), false);
  const Index dh = q.cols() / heads;
  using Block = typename ConstRowMatrixRef<Scalar>::ConstBlockXpr;
  using OutBlock = typename RowMatrixRef<Scalar>::BlockXpr;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  struct Workspace {
    RowMatrix<Scalar> p, ds;
    Vector<Scalar> rowdot;
    cpu::MaskedValues<Scalar> hidden_k, hidden_v;
  };
  const double work =
      2.5 * detail::attention_work(grid.batch * heads, grid.length, std::min(grid.chunk, grid.length), dh, dh);
  detail::parallel_for_each_worker<Workspace>(grid.chunks(), options.num_threads(), work, [&](Index c, Workspace& ws) {
    const Index row = grid.row(c), n = grid.count(c);
    ws.p.resize(n, n);
    ws.ds.resize(n, n);
    for (Index h = 0; h < heads; ++h) {
      const Block qb = q.block(row, h * dh, n, dh), kb = k.block(row, h * dh, n, dh), vb = v.block(row, h * dh, n, dh),
                  g = dout.block(row, h * dh, n, dh);
      ws.p.noalias() = (qb * scale) * kb.transpose();
      bool guard_k = false, guard_v = false;
      if (causal) {
        for (Index i = 0; i + 1 < n; ++i) ws.p.row(i).tail(n - i - 1).setConstant(kNegInf);
        guard_k = ws.hidden_k.find(kb);
        if (guard_k) ws.hidden_k.remember_hidden(ws.p);
        guard_v = ws.hidden_v.find(vb);
        if (guard_v) ws.hidden_v.remember_hidden(ws.p);
      }
      for (Index i = 0; i < n; ++i) cpu::softmax_row(ws.p.row(i));
      ws.ds.noalias() = g * vb.transpose();  // dp
      if (guard_v) ws.hidden_v.zero_hidden(ws.ds);
      ws.rowdot = ws.p.cwiseProduct(ws.ds).rowwise().sum();
      ws.ds = ws.p.cwiseProduct(ws.ds.colwise() - ws.rowdot) * scale;  // scale · dS
      OutBlock dq_h = dq.block(row, h * dh, n, dh);
      if (guard_k) {
        ws.hidden_k.template product<true>(dq_h, ws.ds, kb);
      } else {
        dq_h.noalias() += ws.ds * kb;
      }
      dk.block(row, h * dh, n, dh).noalias() += ws.ds.transpose() * qb;
      dv.block(row, h * dh, n, dh).noalias() += ws.p.transpose() * g;
    }
  });
}

/// Windows of summaries per task of window_summary_attention_backward_add's key pass; fixed, so the bits do
/// not depend on the thread count.
constexpr Index kSummaryBlock = 16;

/// Causal level 2's backward (window_summary_attention_add with every position a query): k̄, v̄ and dk̄, dv̄
/// [batch·m, heads·dh] with m = grid.chunks_per_batch(); q, dout, dq [batch·T, heads·dh]. Query pass, tasks
/// (batch item, window): p = softmax over the summaries before the query's window, dp = dout v̄ᵀ, D =
/// rowsum(p ∘ dp), dS = p ∘ (dp − D), dq += scale · dS k̄, and each (query, head)'s log-sum-exp and D kept.
/// Summary pass, tasks (batch item, kSummaryBlock summaries): every later window's queries in order, p =
/// exp(q·k̄ · scale − lse), dk̄ += scale · dSᵀ q, dv̄ += pᵀ dout. Memory: 2 values per (query, head) and a
/// [window, m] block per worker — no [T, m] buffer.
template <class Scalar>
void window_summary_attention_backward_add(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k_mean,
                                           const ConstRowMatrixRef<Scalar>& v_mean,
                                           const ConstRowMatrixRef<Scalar>& dout, const ChunkGrid& grid, Index heads,
                                           RowMatrixRef<Scalar> dq, RowMatrixRef<Scalar> dk_mean,
                                           RowMatrixRef<Scalar> dv_mean, Scalar scale, const KernelOptions& options) {
  const char* kernel = "window_summary_attention_backward_add";
  impl::check_level_backward(kernel, grid, heads, scale, q, k_mean, v_mean, dout, dq, dk_mean, dv_mean, grid.chunks(),
                             false);
  const Index dh = q.cols() / heads, m = grid.chunks_per_batch();
  using Block = typename ConstRowMatrixRef<Scalar>::ConstBlockXpr;
  struct Workspace {
    RowMatrix<Scalar> p, ds;
  };
  // Row h, column t: head h of the query at token row t.
  RowMatrix<Scalar> lse(heads, grid.tokens()), rowdot(heads, grid.tokens());
  const double work = 2.5 * detail::attention_work(grid.batch * heads, grid.length, m, dh, dh);
  detail::parallel_for_each_worker<Workspace>(
      grid.chunks(), options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index c = task % std::max<Index>(m, 1), first = task - c;  // summaries first … first + c − 1
        if (c == 0) return;                                              // no window before the first
        const Index row = grid.row(task), nq = grid.count(task);
        ws.p.resize(nq, c);
        ws.ds.resize(nq, c);
        for (Index h = 0; h < heads; ++h) {
          const Block qb = q.block(row, h * dh, nq, dh), g = dout.block(row, h * dh, nq, dh);
          const Block km = k_mean.block(first, h * dh, c, dh), vm = v_mean.block(first, h * dh, c, dh);
          ws.p.noalias() = (qb * scale) * km.transpose();
          for (Index i = 0; i < nq; ++i) {
            Scalar max = 0, sum = 0;
            cpu::softmax_row(ws.p.row(i), &max, &sum);
            lse(h, row + i) = max + std::log(sum);
          }
          ws.ds.noalias() = g * vm.transpose();  // dp
          rowdot.row(h).segment(row, nq) = ws.p.cwiseProduct(ws.ds).rowwise().sum().transpose();
          ws.ds = ws.p.cwiseProduct(ws.ds.colwise() - rowdot.row(h).segment(row, nq).transpose()) * scale;
          dq.block(row, h * dh, nq, dh).noalias() += ws.ds * km;
        }
      });
  const Index blocks = detail::ceil_div(m, kSummaryBlock);
  detail::parallel_for_each_worker<Workspace>(
      grid.batch * blocks, options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index b = task / blocks, j0 = (task % blocks) * kSummaryBlock, j1 = std::min(m, j0 + kSummaryBlock);
        for (Index c = j0 + 1; c < m; ++c) {  // the query windows that see summaries j0 …
          const Index seen = std::min(j1, c) - j0, row = grid.row(b * m + c), nq = grid.count(b * m + c);
          ws.p.resize(nq, seen);
          ws.ds.resize(nq, seen);
          for (Index h = 0; h < heads; ++h) {
            const Block qb = q.block(row, h * dh, nq, dh), g = dout.block(row, h * dh, nq, dh);
            ws.p.noalias() = (qb * scale) * k_mean.block(b * m + j0, h * dh, seen, dh).transpose();
            for (Index i = 0; i < nq; ++i) cpu::exp_shifted(ws.p.row(i), lse(h, row + i));
            ws.ds.noalias() = g * v_mean.block(b * m + j0, h * dh, seen, dh).transpose();  // dp
            ws.ds = ws.p.cwiseProduct(ws.ds.colwise() - rowdot.row(h).segment(row, nq).transpose()) * scale;
            dk_mean.block(b * m + j0, h * dh, seen, dh).noalias() += ws.ds.transpose() * qb;
            dv_mean.block(b * m + j0, h * dh, seen, dh).noalias() += ws.p.transpose() * g;
          }
        }
      });
}

/// Level 3's backward (sparse_global_attention_add with every position a query; every matrix a contiguous
/// [batch·length, heads·dh]). Query pass, tasks of kSparseRowBlock queries: the scores at every offset
/// (as the forward computes them), p = their softmax, dp = dout·v at each offset, D = rowsum(p ∘ dp),
/// dS = p ∘ (dp − D), dq += scale · Σ_δ dS_δ k_(i+δ), and each (query, head)'s log-sum-exp and D kept. Key
/// pass, tasks of kSparseRowBlock keys: for every offset δ in sparse_offsets' order, the queries j − δ that
/// read key j: p = exp(q·k · scale − lse), dk_j += scale · dS q_(j−δ), dv_j += p dout_(j−δ). Memory: 2
/// values per (query, head) and [rows, heads · offsets] blocks per worker.
template <class Scalar>
void sparse_global_attention_backward_add(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                                          const ConstRowMatrixRef<Scalar>& v, const ConstRowMatrixRef<Scalar>& dout,
                                          Index batch, Index length, Index heads, RowMatrixRef<Scalar> dq,
                                          RowMatrixRef<Scalar> dk, RowMatrixRef<Scalar> dv, bool causal, Scalar scale,
                                          const KernelOptions& options) {
  const char* kernel = "sparse_global_attention_backward_add";
  if (batch < 0 || length < 0) detail::fail(kernel, ": batch and length must be >= 0, got ", batch, " and ", length);
  const ChunkGrid tokens{batch, length, 1};
  impl::check_level_backward(kernel, tokens, heads, scale, q, k, v, dout, dq, dk, dv, tokens.tokens(), true);
  const Index dim = q.cols(), dh = dim / heads, T = length;
  const std::vector<Index> offsets = sparse_offsets(T, causal);
  const Index noff = static_cast<Index>(offsets.size());
  using Heads = Eigen::Map<const RowMatrix<Scalar>>;  // [rows·heads, dh]: one (token, head) per row
  using HeadsOut = Eigen::Map<RowMatrix<Scalar>>;
  // Head-rows (token row·heads + h) of lse and D.
  Vector<Scalar> lse(batch * T * heads), rowdot(batch * T * heads);
  struct Workspace {
    RowMatrix<Scalar> p, dp, prod;
    Vector<Scalar> s, d;
  };
  // a ∘ b for `rows` token rows, as [rows·heads, dh]: its row sums are the heads' dot products (the
  // forward's arithmetic).
  const auto head_products = [&](Workspace& ws, const Scalar* a, const Scalar* b_, Index rows) {
    ws.prod.resize(rows, dim);
    ws.prod = Heads(a, rows, dim).cwiseProduct(Heads(b_, rows, dim));
    return Heads(ws.prod.data(), rows * heads, dh);
  };
  const Index blocks_per_batch = detail::ceil_div(T, kSparseRowBlock);
  const double work = 2.0 * detail::attention_work(batch * heads, T, noff, dh, dh);
  // Query pass.
  detail::parallel_for_each_worker<Workspace>(
      batch * blocks_per_batch, options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index b = task / blocks_per_batch;
        const Index a = (task % blocks_per_batch) * kSparseRowBlock, nb = std::min(kSparseRowBlock, T - a),
                    base = b * T + a;
        ws.p.setConstant(nb * heads, noff, -std::numeric_limits<Scalar>::infinity());
        ws.dp.setZero(nb * heads, noff);
        for (Index o = 0; o < noff; ++o) {
          const Index delta = offsets[static_cast<std::size_t>(o)];
          const Index i0 = std::max<Index>(0, -delta - a), i1 = std::min(nb, T - delta - a);  // queries with a key at δ
          if (i1 <= i0) continue;
          const Index rows = i1 - i0, qr = base + i0;
          ws.p.col(o).segment(i0 * heads, rows * heads) =
              head_products(ws, q.row(qr).data(), k.row(qr + delta).data(), rows).rowwise().sum() * scale;
          ws.dp.col(o).segment(i0 * heads, rows * heads) =
              head_products(ws, dout.row(qr).data(), v.row(qr + delta).data(), rows).rowwise().sum();
        }
        for (Index r = 0; r < nb * heads; ++r) {
          Scalar max = 0, sum = 0;
          cpu::softmax_row(ws.p.row(r), &max, &sum);  // offset 0 is always there
          lse(base * heads + r) = max + std::log(sum);
        }
        rowdot.segment(base * heads, nb * heads) = ws.p.cwiseProduct(ws.dp).rowwise().sum();
        ws.dp = ws.p.cwiseProduct(ws.dp.colwise() - rowdot.segment(base * heads, nb * heads)) * scale;  // scale · dS
        for (Index o = 0; o < noff; ++o) {
          const Index delta = offsets[static_cast<std::size_t>(o)];
          const Index i0 = std::max<Index>(0, -delta - a), i1 = std::min(nb, T - delta - a);
          if (i1 <= i0) continue;
          const Index rows = i1 - i0, qr = base + i0;
          HeadsOut(dq.row(qr).data(), rows * heads, dh).noalias() +=
              ws.dp.col(o).segment(i0 * heads, rows * heads).asDiagonal() *
              Heads(k.row(qr + delta).data(), rows * heads, dh);
        }
      });
  // Key pass.
  detail::parallel_for_each_worker<Workspace>(
      batch * blocks_per_batch, options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index b = task / blocks_per_batch;
        const Index a = (task % blocks_per_batch) * kSparseRowBlock, nb = std::min(kSparseRowBlock, T - a),
                    base = b * T + a;
        for (Index o = 0; o < noff; ++o) {
          const Index delta = offsets[static_cast<std::size_t>(o)];
          const Index j0 = std::max<Index>(0, delta - a),
                      j1 = std::min(nb, T + delta - a);  // keys read from query j − δ
          if (j1 <= j0) continue;
          const Index rows = j1 - j0, kr = base + j0, qr = kr - delta, n = rows * heads;
          ws.s = head_products(ws, q.row(qr).data(), k.row(kr).data(), rows).rowwise().sum() * scale;
          ws.s = (ws.s - lse.segment(qr * heads, n)).array().exp().matrix();                      // p
          ws.d = head_products(ws, dout.row(qr).data(), v.row(kr).data(), rows).rowwise().sum();  // dp
          ws.d = ws.s.cwiseProduct(ws.d - rowdot.segment(qr * heads, n)) * scale;                 // scale · dS
          HeadsOut(dk.row(kr).data(), n, dh).noalias() += ws.d.asDiagonal() * Heads(q.row(qr).data(), n, dh);
          HeadsOut(dv.row(kr).data(), n, dh).noalias() += ws.s.asDiagonal() * Heads(dout.row(qr).data(), n, dh);
        }
      });
}

}  // namespace kernels
}  // namespace c2f
