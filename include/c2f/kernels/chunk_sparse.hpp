// c2f kernels — coarse-guided chunk-sparse attention (NSA / MoBA-style block selection) on the
// projections of a multi-head attention.
//
// q, k, v, out are [batch·length, heads·dh] row-major matrices (head h = columns [h·dh, (h+1)·dh)).
// Chunks of `grid` (the last may be partial) serve both as query chunks and as key chunks. The fine
// stages OVERWRITE `out`; arguments are checked at entry (std::invalid_argument, every build type).
//
// Two gatings choose the key chunks a query attends to:
//   per chunk (select_chunks + chunk_sparse_attention): one choice per query chunk, from the mean query
//     of the chunk — it reads every query of the chunk, so it is not causal;
//   per token (select_chunks_per_token + token_sparse_attention, MoBA's gating): one choice per query
//     token, from its own query — causal when only earlier chunks are eligible.
// Training (docs/training.md): sparse_attention_backward, the fine stage's backward for either gating
// with the selection a constant (as MoBA and NSA train: the gradients flow through the selected chunks'
// keys only), and its dense twin sparse_attention_backward_naive.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/cpu/masked_values.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/cpu/small_gemm.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/top_picks.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/mask_view.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace c2f {
namespace kernels {

/// Selected key chunks of every (batch, head, query row), ascending, −1 where fewer than top_k chunks
/// are eligible: a row-major [batch, heads, queries, top_k] array. top_k is the one asked for, capped at
/// the number of chunks (no row can select more). A query row is a query chunk
/// (per-chunk gating, queries = chunks per batch item) or a query token (per-token gating, queries =
/// sequence length).
struct ChunkSelection {
  Index batch = 0, heads = 0, queries = 0, top_k = 0;
  bool per_token = false;
  std::vector<Index> index;

  Index* row(Index b, Index h, Index i) { return index.data() + ((b * heads + h) * queries + i) * top_k; }
  const Index* row(Index b, Index h, Index i) const { return index.data() + ((b * heads + h) * queries + i) * top_k; }

  /// Throws unless this is a per-chunk (or per-token) selection with `want` query rows per batch item
  /// over `grid` and `heads`, whose indices are valid chunks (or −1 padding).
  void check(const char* kernel, const ChunkGrid& grid, Index num_heads, bool per_token_rows, Index want) const {
    if (per_token != per_token_rows || batch != grid.batch || heads != num_heads || queries != want || top_k < 1 ||
        static_cast<Index>(index.size()) != batch * heads * queries * top_k) {
      detail::fail(kernel, ": the selection must be ", per_token_rows ? "per token" : "per chunk",
                   " over [batch, heads, queries] = ", detail::shape_string({grid.batch, num_heads, want}), ", got ",
                   per_token ? "per token " : "per chunk ", detail::shape_string({batch, heads, queries}),
                   " with top_k ", top_k);
    }
    const Index m = grid.chunks_per_batch();
    for (Index j : index) {
      if (j < -1 || j >= m) detail::fail(kernel, ": selected chunk ", j, " is outside [0, ", m, ")");
    }
  }
};

/// A selection of `rows` query rows per (batch, head) with every entry −1, top_k capped at the m chunks.
inline ChunkSelection empty_selection(const char* kernel, Index batch, Index heads, Index rows, Index top_k, Index m,
                                      bool per_token) {
  const Index k = std::max<Index>(1, std::min(top_k, m));
  const Index entries = detail::checked_product(kernel, {batch, heads, rows, k});
  detail::check_buffer(kernel, entries, sizeof(Index));
  return ChunkSelection{batch, heads, rows, k, per_token, std::vector<Index>(static_cast<std::size_t>(entries), -1)};
}

/// Per-chunk gating (non-causal): per (batch, head), q̄_i and k̄_j are the means of the projected queries
/// and keys of chunk i and j; query chunk i keeps itself and the (top_k − 1) chunks j ≠ i with the
/// highest q̄_i·k̄_j (ties to the lower index; all of them when fewer exist).
template <class Scalar>
ChunkSelection select_chunks_from_means(const ConstRowMatrixRef<Scalar>& qm, const ConstRowMatrixRef<Scalar>& km,
                                        const ChunkGrid& grid, Index heads, Index top_k, const KernelOptions& options);

template <class Scalar>
ChunkSelection select_chunks(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                             const ChunkGrid& grid, Index heads, Index top_k, const KernelOptions& options) {
  detail::check_selection_inputs("select_chunks", q, k, grid, heads, top_k);
  RowMatrix<Scalar> qm(grid.chunks(), q.cols()), km(grid.chunks(), q.cols());
  chunk_mean<Scalar>(q, grid, qm, options);
  chunk_mean<Scalar>(k, grid, km, options);
  return select_chunks_from_means<Scalar>(qm, km, grid, heads, top_k, options);
}

/// select_chunks from the chunk means q̄, k̄ [batch·m, cols] themselves (e.g. means over the tokens a
/// key padding mask keeps; a NaN mean ranks below every other chunk).
template <class Scalar>
ChunkSelection select_chunks_from_means(const ConstRowMatrixRef<Scalar>& qm, const ConstRowMatrixRef<Scalar>& km,
                                        const ChunkGrid& grid, Index heads, Index top_k, const KernelOptions& options) {
  const char* kernel = "select_chunks_from_means";
  detail::check_grid(kernel, grid);
  detail::check_heads(kernel, qm.cols(), heads);
  detail::check_shape(kernel, "qm", qm, grid.chunks(), qm.cols());
  detail::check_shape(kernel, "km", km, grid.chunks(), qm.cols());
  if (top_k < 1) detail::fail(kernel, ": top_k must be >= 1, got ", top_k);
  const Index m = grid.chunks_per_batch(), dim = qm.cols(), dh = dim / heads;
  ChunkSelection sel = empty_selection(kernel, grid.batch, heads, m, top_k, m, false);
  if (m == 0) return sel;  // no chunks: nothing to rank (and the means' null data takes no block offsets)
  const double work = 2.0 * static_cast<double>(grid.batch * m * m * dim);
  detail::parallel_for(grid.batch * heads, options.num_threads(), work, [&](Index task, int) {
    const Index b = task / heads, h = task % heads;
    const RowMatrix<Scalar> s = qm.block(b * m, h * dh, m, dh) * km.block(b * m, h * dh, m, dh).transpose();
    detail::TopPicks<Scalar> picks(std::min<Index>(top_k - 1, m - 1));
    for (Index i = 0; i < m; ++i) {
      picks.clear();
      picks.offer_row(s.data() + i * s.outerStride(), m, i);
      picks.write(i, sel.row(b, h, i));
    }
  });
  return sel;
}

/// Per-token gating (MoBA's): the query at position t of chunk c scores the eligible chunks j ≠ c by
/// q_t·k̄_j (k̄_j the mean of the projected keys of chunk j) and keeps c plus the (top_k − 1) highest
/// (ties to the lower index; all of them when fewer exist). Eligible: every chunk, or with `causal` the
/// chunks j < c (all complete), so the choice of token t reads nothing after t.
///
/// q [batch·n, cols] holds the queries of the last n positions T − n … T − 1 of every batch item (n = T
/// in a forward pass, the new tokens when decoding); `grid` covers the T keys; k_means [batch·mk, cols]
/// holds the chunk means of every batch item (chunk_mean over the grid), mk ≥ every eligible chunk.
/// The selection has one row per query (queries = n). Tasks are (batch, query chunk); each is one
/// [queries in the chunk, eligible] score GEMM per head.
template <class Scalar>
ChunkSelection select_chunks_per_token(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k_means,
                                       const ChunkGrid& grid, Index heads, Index top_k, bool causal,
                                       const KernelOptions& options) {
  const char* kernel = "select_chunks_per_token";
  const Index n = detail::check_last_queries(kernel, q, q, q, q, grid, heads, Scalar(1), /*keys_are_tokens=*/false);
  if (top_k < 1) detail::fail(kernel, ": top_k must be >= 1, got ", top_k);
  const Index m = grid.chunks_per_batch(), dim = q.cols(), dh = dim / heads;
  const QueryChunks chunks(grid, n);
  const Index mk = grid.batch > 0 ? k_means.rows() / grid.batch : 0;
  const Index needed = n == 0 || grid.batch == 0 ? 0 : (causal ? (grid.length - 1) / grid.chunk : m);
  if (k_means.cols() != dim || k_means.rows() != grid.batch * mk || mk < needed) {
    detail::fail(kernel, ": k_means ", detail::shape_string({k_means.rows(), k_means.cols()}), " must be [batch·m, ",
                 dim, "] with m >= ", needed, " chunk means per batch item");
  }
  ChunkSelection sel = empty_selection(kernel, grid.batch, heads, n, top_k, m, true);
  const Index tasks = grid.batch * chunks.count;
  const double work = 2.0 * static_cast<double>(grid.batch * n * m * dim);
  detail::parallel_for_each_worker<RowMatrix<Scalar>>(
      tasks, options.num_threads(), work, [&](Index task, RowMatrix<Scalar>& s) {
        const Index b = task / chunks.count, c = chunks.first + task % chunks.count;
        const Index p0 = std::max(c * grid.chunk, chunks.first_position),
                    p1 = std::min((c + 1) * grid.chunk, grid.length);
        const Index rows = p1 - p0, q_row = b * n + p0 - chunks.first_position;
        const Index eligible = causal ? c : m;  // chunks [0, eligible) are scored; the own chunk is skipped
        detail::TopPicks<Scalar> picks(std::min<Index>(top_k - 1, causal ? c : m - 1));
        for (Index h = 0; h < heads; ++h) {
          s.resize(rows, eligible);
          if (eligible > 0) {
            s.noalias() = q.block(q_row, h * dh, rows, dh) * k_means.block(b * mk, h * dh, eligible, dh).transpose();
          }
          for (Index r = 0; r < rows; ++r) {
            picks.clear();
            picks.offer_row(s.data() + r * s.outerStride(), eligible, c);
            picks.write(c, sel.row(b, h, q_row - b * n + r));
          }
        }
      });
  return sel;
}

/// Queries per GEMM in token_sparse_attention: min(kTokenGroupRows, n) for a call with n queries. Fixed
/// per call, so that a token's arithmetic depends only on n, its own data and its position among the
/// earlier tokens that chose the same key chunk — never on the thread count, and never on a later token
/// (the causal guarantee holds bit for bit). A decode step (n = 1) runs [1, dh] products, not 32 rows.
constexpr Index kTokenGroupRows = 32;

namespace impl {

/// Whether chunk_sparse_attention runs on the micro-kernel's panels (cpu::packed_gemm): fp32 compute
/// on a build that has the micro-kernel (or on any build with KernelOptions::rows_independent, as
/// sdpa_streaming), with every key chunk starting on a panel (the chunk a multiple of kNR columns, or one
/// chunk as long as the sequence). Else the portable path: each task gathers its selected keys and values
/// and runs two Eigen products.
template <class Scalar>
bool chunk_sparse_packed(const kernels::ChunkGrid& grid, const kernels::KernelOptions& options) {
  if (options.compute() == Compute::BFloat16) {  // on the blocked engines, chunks on their 32-key steps
    return std::is_same<Scalar, float>::value && cpu::bf16_blocked(bf16_engine()) &&
           (grid.chunk % cpu::kTileK == 0 || grid.chunk >= grid.length);
  }
  return (cpu::kPackedGemm || cpu::honoured_rows_independent(options.rows_independent())) &&
         (grid.chunk % cpu::GemmBlocking<Scalar>::kNR == 0 || grid.chunk >= grid.length);
}

/// Whether token_sparse_attention runs on the micro-kernel's panels: fp32 compute on keys and values
/// stored as Scalar, on a build that has the micro-kernel, for a call of at least kTokenGroupRows queries
/// (a forward pass; a decode step's few queries would pack each chunk for one row) — or on any build and
/// call with KernelOptions::rows_independent. Each output element's sum does not depend on the rows
/// around it, so the causal guarantee holds as on the portable path.
template <class Scalar, class KV>
bool token_sparse_packed(const kernels::KernelOptions& options, Index n) {
  const bool ri = cpu::honoured_rows_independent(options.rows_independent());
  return std::is_same<KV, Scalar>::value && options.compute() != Compute::BFloat16 && (cpu::kPackedGemm || ri) &&
         (n >= kernels::kTokenGroupRows || ri);
}

/// Keys chunk_sparse_attention's packed path takes per online-softmax step: whole key chunks, as many as
/// fit (at least one). The step's max, exp and rescale are then per this many keys, not per chunk.
constexpr Index kSparseStepKeys = 256;
/// Selected key chunks per online-softmax step of chunk_sparse_attention's packed path (fixed by the
/// chunk: the bits do not depend on anything else).
inline Index sparse_step_chunks(const kernels::ChunkGrid& grid) {
  return std::max<Index>(1, kSparseStepKeys / std::max<Index>(1, std::min(grid.chunk, grid.length)));
}

/// chunk_sparse_attention's packed path. Every (batch, head)'s keys (transposed) and values are packed once
/// into panels shared by its query chunks; a task (batch, head, query chunk) then walks its selected key
/// chunks in ascending order, sparse_step_chunks() at a time, with an online softmax — QKᵀ of each chunk
/// of the step into its columns of the scores, one softmax step over them, then PV of each chunk — on
/// those panels, as sdpa_streaming walks its key blocks. Every output element depends on its task's data
/// and selection only: not on the thread count.
template <class Scalar>
void chunk_sparse_attention_packed(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                                   const ConstRowMatrixRef<Scalar>& v, const kernels::ChunkGrid& grid, Index heads,
                                   const kernels::ChunkSelection& selection, RowMatrixRef<Scalar> out,
                                   const MaskView<Scalar>& mask, Scalar scale, const kernels::KernelOptions& options) {
  const Index m = grid.chunks_per_batch(), dh = q.cols() / heads, top_k = selection.top_k, length = grid.length;
  const Index pairs = grid.batch * heads, tasks = pairs * m, width = std::min(grid.chunk, length);
  const Index step = sparse_step_chunks(grid);
  if (tasks == 0) return;
  // Compute::BFloat16 (on the blocked engines: chunk_sparse_packed): the same steps with the products on
  // the engine — q·scale, the keys, the values and the unnormalised probabilities rounded, as
  // sdpa_streaming's.
  const bool bf16 = options.compute() == Compute::BFloat16;
  std::vector<cpu::PackedB<Scalar>> packed_k(bf16 ? 0 : static_cast<std::size_t>(pairs)), packed_v(packed_k.size());
  std::vector<cpu::Bf16PackedB> packed_k16(bf16 ? static_cast<std::size_t>(pairs) : 0), packed_v16(packed_k16.size());
  // Each pair packed by its first task, inside the loop (as sdpa_streaming's).
  const detail::GroupBlockTasks order(pairs, m, true);
  const auto pack_pair = [&](Index bh) {
    const Index b = bh / heads, h = bh % heads, row0 = b * length;
    if (bf16) {
      if constexpr (std::is_same<Scalar, float>::value) {
        packed_k16[static_cast<std::size_t>(bh)].pack(k.block(row0, h * dh, length, dh).transpose());
        packed_v16[static_cast<std::size_t>(bh)].pack(v.block(row0, h * dh, length, dh));
      }
      return;
    }
    packed_k[static_cast<std::size_t>(bh)].pack(k.block(row0, h * dh, length, dh).transpose());
    packed_v[static_cast<std::size_t>(bh)].pack(v.block(row0, h * dh, length, dh));
  };
  struct Workspace {
    cpu::Bf16A q16, p16;  // Compute::BFloat16: the scaled queries and a chunk's probabilities, rounded
    RowMatrix<Scalar> q, s, acc;
    Vector<Scalar> max, sum, alpha;
    std::vector<cpu::MaskedValues<Scalar>> masked;  // one per chunk of a step
    std::vector<unsigned char> guard;
  };
  using ValueBlock = Eigen::Block<const ConstRowMatrixRef<Scalar>>;
  const double work = detail::attention_work(pairs, length, std::min(top_k, m) * grid.chunk, dh, dh);
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    if (ws.q.size() == 0) {
      ws.q.resize(width, dh);
      ws.s.resize(width, cpu::score_stride<Scalar>(step * width));
      ws.acc.resize(width, dh);
      ws.max.resize(width);
      ws.sum.resize(width);
      ws.alpha.resize(width);
      ws.masked.resize(static_cast<std::size_t>(step));
      ws.guard.resize(static_cast<std::size_t>(step));
    }
    const std::pair<Index, Index> at = order.task(task);
    const Index bh = at.first, i = at.second, b = bh / heads, h = bh % heads;
    order.prepare(bh, pack_pair);
    const Index c = b * m + i, rows = grid.count(c), q_row = grid.row(c), i0 = grid.first(c);
    const Bf16Engine engine = bf16 ? packed_k16[static_cast<std::size_t>(bh)].engine() : Bf16Engine::Fallback;
    const cpu::Bf16Tiles tile_registers(engine);
    typename RowMatrix<Scalar>::RowsBlockXpr qs = ws.q.topRows(rows), acc = ws.acc.topRows(rows);
    qs = q.block(q_row, h * dh, rows, dh) * scale;
    if constexpr (std::is_same<Scalar, float>::value) {
      if (bf16) ws.q16.prepare(qs.data(), qs.outerStride(), rows, dh, engine);
    }
    // The product of the task's queries (or probabilities) with rows [j0, j0 + count) of a pair's packing.
    const auto scores_of = [&](Index j0, Index count, Eigen::Block<RowMatrix<Scalar>>& s) {
      if constexpr (std::is_same<Scalar, float>::value) {
        if (bf16) {
          cpu::bf16_gemm(ws.q16, packed_k16[static_cast<std::size_t>(bh)], 0, dh, j0, count, nullptr, false, s.data(),
                         s.outerStride());
          return;
        }
      }
      cpu::packed_gemm_range<Scalar>(qs.data(), qs.outerStride(), rows, packed_k[static_cast<std::size_t>(bh)], 0, dh,
                                     j0, count, nullptr, false, s.data(), s.outerStride());
    };
    acc.setZero();
    Eigen::VectorBlock<Vector<Scalar>> mx = ws.max.head(rows), l = ws.sum.head(rows), alpha = ws.alpha.head(rows);
    mx.setConstant(-std::numeric_limits<Scalar>::infinity());
    l.setZero();
    const Index* chosen = selection.row(b, h, i);
    Index picked = 0;
    while (picked < top_k && chosen[picked] >= 0) ++picked;
    for (Index t0 = 0; t0 < picked; t0 += step) {
      const Index n_step = std::min(step, picked - t0);
      // The chunks of a step side by side in the scores (only the sequence's last chunk is partial, and
      // it comes last: ascending selection).
      Index cols = 0;
      for (Index u = 0; u < n_step; ++u) {
        const Index kc = b * m + chosen[t0 + u], count = grid.count(kc), j0 = grid.first(kc);
        Eigen::Block<RowMatrix<Scalar>> s = ws.s.block(0, cols, rows, count);
        scores_of(j0, count, s);
        unsigned char& guard = ws.guard[static_cast<std::size_t>(u)];
        guard = 0;
        if (!mask.empty()) {
          mask.apply(b, h, i0, j0, s);
          // Keys the mask hides may hold non-finite values (in bfloat16, also finite values beyond its
          // range): leave them out (masked_values.hpp).
          cpu::MaskedValues<Scalar>& masked = ws.masked[static_cast<std::size_t>(u)];
          const ValueBlock vb(v.block(grid.row(kc), h * dh, count, dh));
          guard = bf16 ? masked.find(vb.unaryExpr(cpu::RoundBf16<Scalar>())) : masked.find(vb);
          if (guard) masked.remember_hidden(s);
        }
        cols += count;
      }
      Eigen::Block<RowMatrix<Scalar>> scores = ws.s.topLeftCorner(rows, cols);
      if (cpu::online_softmax_step(scores, mx, l, alpha)) acc = alpha.asDiagonal() * acc;
      cols = 0;
      for (Index u = 0; u < n_step; ++u) {
        const Index kc = b * m + chosen[t0 + u], count = grid.count(kc), j0 = grid.first(kc);
        Eigen::Block<RowMatrix<Scalar>> p = ws.s.block(0, cols, rows, count);
        const ValueBlock vb(v.block(grid.row(kc), h * dh, count, dh));
        const bool guard = ws.guard[static_cast<std::size_t>(u)] != 0;
        if constexpr (std::is_same<Scalar, float>::value) {
          if (bf16 && guard) {  // the probabilities and values rounded, the hidden keys left out
            cpu::round_bf16_rows(p.data(), rows, count, p.outerStride());
            ws.masked[static_cast<std::size_t>(u)].template product<true>(acc, p,
                                                                          vb.unaryExpr(cpu::RoundBf16<Scalar>()));
          } else if (bf16) {
            ws.p16.prepare(p.data(), p.outerStride(), rows, count, engine);
            cpu::bf16_gemm(ws.p16, packed_v16[static_cast<std::size_t>(bh)], j0, j0 + count, 0, dh, nullptr, true,
                           acc.data(), acc.outerStride());
          }
        }
        if (bf16) {
          cols += count;
          continue;
        }
        if (guard) {
          ws.masked[static_cast<std::size_t>(u)].product_packed_add(acc, p, vb, j0);
        } else {
          cpu::packed_gemm_range<Scalar>(p.data(), p.outerStride(), rows, packed_v[static_cast<std::size_t>(bh)], j0,
                                         j0 + count, 0, dh, nullptr, true, acc.data(), acc.outerStride());
        }
        cols += count;
      }
    }
    cpu::divide_by_sums(acc, l, out.block(q_row, h * dh, rows, dh));
  });
}

/// Bytes chunk_sparse_attention holds at its peak: on the packed path every (batch, head)'s keys and
/// values in panels, and per worker the scaled queries, scores, accumulator and three vectors of a chunk;
/// on the portable path per worker the gathered keys and values, the scores, and (bfloat16) the rounded
/// queries of a chunk.
template <class Scalar>
std::size_t chunk_sparse_workspace_bytes(const kernels::ChunkGrid& grid, Index heads, Index dh, Index top_k,
                                         const kernels::KernelOptions& options) {
  const Compute compute = options.compute();
  const std::size_t workers = static_cast<std::size_t>(
      detail::resolve_threads(options.num_threads(), grid.batch * heads * grid.chunks_per_batch()));
  const std::size_t s = sizeof(Scalar), width = static_cast<std::size_t>(std::min(grid.chunk, grid.length));
  const std::size_t d = static_cast<std::size_t>(dh);
  if (chunk_sparse_packed<Scalar>(grid, options)) {
    const std::size_t pairs = static_cast<std::size_t>(grid.batch * heads);
    const Index step_keys = sparse_step_chunks(grid) * static_cast<Index>(width);
    const Index w = static_cast<Index>(width);
    // Compute::BFloat16: the packings on the engine, and per worker the rounded queries and a chunk's
    // probabilities.
    const std::size_t packs = compute == Compute::BFloat16 ? cpu::Bf16PackedB::bytes(dh, grid.length, bf16_engine()) +
                                                                 cpu::Bf16PackedB::bytes(grid.length, dh, bf16_engine())
                                                           : cpu::PackedB<Scalar>::bytes(dh, grid.length) +
                                                                 cpu::PackedB<Scalar>::bytes(grid.length, dh);
    const std::size_t rounded = compute == Compute::BFloat16
                                    ? cpu::Bf16A::bytes(w, dh, bf16_engine()) + cpu::Bf16A::bytes(w, w, bf16_engine())
                                    : 0;
    return pairs * packs +
           workers *
               (rounded + s * (2 * width * d + width * static_cast<std::size_t>(cpu::score_stride<Scalar>(step_keys)) +
                               3 * width));
  }
  const std::size_t k = static_cast<std::size_t>(grid.chunk);
  const std::size_t picks = std::min(static_cast<std::size_t>(top_k),
                                     std::max<std::size_t>(static_cast<std::size_t>(grid.chunks_per_batch()), 1));
  // Compute::BFloat16: the scaled queries and the engine's operands of the task's two products.
  const Index keys = static_cast<Index>(picks * k), rows = static_cast<Index>(width);
  const std::size_t ops =
      compute == Compute::BFloat16 ? cpu::bf16_operands_bytes(rows, dh, keys, rows, keys, dh, bf16_engine()) : 0;
  return workers * (s * (2 * picks * k * d + k * picks * k + (compute == Compute::BFloat16 ? k * d : 0)) + ops);
}

/// Bytes token_sparse_attention holds at its peak for a forward pass (n = T queries): per worker the
/// accumulators and running max and sum of every query [T, dh + 2], a group's queries, scores and products
/// ([G, dh], [G, chunk], [G, dh]) and factors, the buckets of queries per key chunk, and a key chunk packed
/// (the packed path: its keys and values in panels) or, in bfloat16, rounded.
template <class Scalar, class KV = Scalar>
std::size_t token_sparse_workspace_bytes(const kernels::ChunkGrid& grid, Index heads, Index dh, Index top_k,
                                         const kernels::KernelOptions& options) {
  const std::size_t s = sizeof(Scalar), ix = sizeof(Index), len = static_cast<std::size_t>(grid.length);
  const std::size_t d = static_cast<std::size_t>(dh), k = static_cast<std::size_t>(grid.chunk);
  const std::size_t m = static_cast<std::size_t>(grid.chunks_per_batch());
  const std::size_t picks = std::min(static_cast<std::size_t>(top_k), std::max<std::size_t>(m, 1));
  const std::size_t g =
      std::min<std::size_t>(static_cast<std::size_t>(kernels::kTokenGroupRows), std::max<std::size_t>(len, 1));
  const std::size_t workers =
      static_cast<std::size_t>(detail::resolve_threads(options.num_threads(), grid.batch * heads));
  const bool bf16 = options.compute() == Compute::BFloat16;
  // Compute::BFloat16: a converted or rounded block of the chunk, its keys and values packed for the engine,
  // and a group's queries and probabilities rounded.
  const std::size_t chunk_copy =
      token_sparse_packed<Scalar, KV>(options, grid.length)
          ? cpu::PackedB<Scalar>::bytes(dh, grid.chunk) + cpu::PackedB<Scalar>::bytes(grid.chunk, dh)
          : (bf16 ? s * k * d + cpu::bf16_operands_bytes(static_cast<Index>(g), dh, grid.chunk, static_cast<Index>(g),
                                                         grid.chunk, dh, bf16_engine())
                  : 0);
  return workers * (s * (len * d + 2 * g * d + g * k + 2 * len + g) + chunk_copy + ix * (2 * m + 1 + len * picks));
}

/// The entry checks of sparse_attention_backward and its twin: the fine stage's (a forward pass of all
/// T = grid.length queries: n = T), dout shaped like q, dq, dk, dv like q, k, v.
template <class Scalar>
void check_sparse_backward(const char* kernel, const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                           const ConstRowMatrixRef<Scalar>& v, const ConstRowMatrixRef<Scalar>& dout,
                           const RowMatrixRef<Scalar>& dq, const RowMatrixRef<Scalar>& dk,
                           const RowMatrixRef<Scalar>& dv, const kernels::ChunkGrid& grid, Index heads,
                           const kernels::ChunkSelection& selection, const MaskView<Scalar>& mask, Scalar scale) {
  detail::check_sparse_fine_inputs(kernel, q, k, v, dout, grid, heads, selection, selection.per_token, mask, scale);
  if (q.rows() != grid.tokens())
    detail::fail(kernel, ": the queries of every position, [batch·length, cols], got ", q.rows(), " rows");
  detail::check_shape(kernel, "dq", dq, q.rows(), q.cols());
  detail::check_shape(kernel, "dk", dk, k.rows(), k.cols());
  detail::check_shape(kernel, "dv", dv, v.rows(), v.cols());
}

}  // namespace impl

/// Fine stage of per-chunk gating: every query of chunk i attends, with one softmax, to the keys of its
/// selected chunks; `mask` (the library's masks, absolute positions) combines.
/// out[rows of chunk i, head h] = softmax(q kᵀ · scale + mask) v (overwritten).
/// Tasks are (batch, head, query chunk); the selected keys and values of a task are gathered into one
/// block, so each task is two GEMMs: [chunk, dh] × [dh, selected keys] and back.
template <class Scalar>
void chunk_sparse_attention(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                            const ConstRowMatrixRef<Scalar>& v, const ChunkGrid& grid, Index heads,
                            const ChunkSelection& selection, RowMatrixRef<Scalar> out, const MaskView<Scalar>& mask,
                            Scalar scale, const KernelOptions& options) {
  detail::check_sparse_fine_inputs("chunk_sparse_attention", q, k, v, out, grid, heads, selection, false, mask, scale);
  const bool bf16 = cpu::check_compute<Scalar>("chunk_sparse_attention", options.compute());
  if (impl::chunk_sparse_packed<Scalar>(grid, options)) {
    impl::chunk_sparse_attention_packed<Scalar>(q, k, v, grid, heads, selection, out, mask, scale, options);
    return;
  }
  const Index m = grid.chunks_per_batch(), dh = q.cols() / heads, top_k = selection.top_k;
  struct Workspace {
    RowMatrix<Scalar> kg, vg, s, qs;  // qs: Compute::BFloat16's scaled queries
    cpu::MaskedValues<Scalar> masked;
    cpu::Bf16Operands ops;  // Compute::BFloat16: the gathered keys, then values packed for the engine
  };
  const Index tasks = grid.batch * heads * m;
  const double work = detail::attention_work(grid.batch * heads, grid.length, std::min(top_k, m) * grid.chunk, dh, dh);
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    const Index i = task % m, bh = task / m, b = bh / heads, h = bh % heads;
    const Index c = b * m + i, rows = grid.count(c), q_row = grid.row(c), i0 = grid.first(c);
    const Index* chosen = selection.row(b, h, i);
    Index n = 0;
    for (Index t = 0; t < top_k && chosen[t] >= 0; ++t) n += grid.count(b * m + chosen[t]);
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
    const cpu::Bf16Tiles tile_registers(bf16 ? bf16_engine() : Bf16Engine::Fallback);
    if constexpr (std::is_same<Scalar, float>::value) {
      if (bf16) {  // Compute::BFloat16: q·scale, the keys and values rounded, the products on the engine
        ws.qs = q.block(q_row, h * dh, rows, dh) * scale;
        cpu::round_bf16_matrix(ws.vg);  // a value beyond bfloat16's range is infinite there (the guard below)
        cpu::bf16_product(ws.qs.data(), ws.qs.outerStride(), rows, ws.kg.transpose(), false, ws.s.data(),
                          ws.s.outerStride(), ws.ops);
      }
    }
    if (!bf16) ws.s.noalias() = (q.block(q_row, h * dh, rows, dh) * scale) * ws.kg.transpose();
    if (!mask.empty()) {
      filled = 0;
      for (Index t = 0; t < top_k && chosen[t] >= 0; ++t) {
        const Index kc = b * m + chosen[t], count = grid.count(kc);
        Eigen::Block<RowMatrix<Scalar>> block = ws.s.middleCols(filled, count);
        mask.apply(b, h, i0, grid.first(kc), block);
        filled += count;
      }
    }
    // Keys the mask hides may hold non-finite values: leave them out (masked_values.hpp).
    const bool guard = !mask.empty() && ws.masked.find(ws.vg);
    if (guard) ws.masked.remember_hidden(ws.s);
    for (Index r = 0; r < rows; ++r) cpu::softmax_row(ws.s.row(r));
    if constexpr (std::is_same<Scalar, float>::value) {
      if (bf16 && !guard) {  // the probabilities rounded, their product with the values on the engine
        cpu::bf16_product(ws.s.data(), ws.s.outerStride(), rows, ws.vg, false, &out(q_row, h * dh), out.outerStride(),
                          ws.ops);
        return;
      }
    }
    if (bf16) cpu::round_bf16_matrix(ws.s);  // the probabilities
    if (guard) {
      ws.masked.template product<false>(out.block(q_row, h * dh, rows, dh), ws.s, ws.vg);
    } else {
      out.block(q_row, h * dh, rows, dh).noalias() = ws.s * ws.vg;
    }
  });
}

/// Fine stage of per-token gating: the query at position t attends, with one softmax (scores q·k ·
/// scale), to the keys of the chunks it selected; with `causal`, in its own chunk only to keys ≤ t (the
/// other selected chunks lie before it); `mask` ([batch, heads, n, T]) combines. out is overwritten.
/// q and out [batch·n, cols] are the last n positions of T; k, v [batch·T, cols] may be stored in a
/// narrower `KV` (converted chunk by chunk); the selection comes from select_chunks_per_token.
///
/// GEMM-shaped although every token chooses differently: per (batch, head), the queries are grouped by
/// the key chunk they selected; each key chunk j runs [group, dh] × [dh, chunk] and back over its
/// gathered queries (in groups of min(kTokenGroupRows, n), ascending position), and every query merges the
/// partial softmaxes of its chunks with a running max and sum (the log-sum-exp merge of split-K flash
/// decoding) in ascending key-chunk order. Working memory per worker: [n, dh] accumulators.
template <class Scalar, class KV = Scalar>
void token_sparse_attention(const ConstRowMatrixRef<Scalar>& q, const detail::NoDeduce<ConstRowMatrixRef<KV>>& k,
                            const detail::NoDeduce<ConstRowMatrixRef<KV>>& v, const ChunkGrid& grid, Index heads,
                            const ChunkSelection& selection, RowMatrixRef<Scalar> out, bool causal,
                            const MaskView<Scalar>& mask, Scalar scale, const KernelOptions& options) {
  const Index n = detail::check_sparse_fine_inputs("token_sparse_attention", q, k, v, out, grid, heads, selection, true,
                                                   mask, scale);
  const bool bf16 = cpu::check_compute<Scalar, KV>("token_sparse_attention", options.compute(), true);
  const Index m = grid.chunks_per_batch(), dh = q.cols() / heads, top_k = selection.top_k, T = grid.length;
  const Index p0 = T - n;  // position of query 0
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Index G = std::min(kTokenGroupRows, std::max<Index>(n, 1));
  // The packed path (impl::token_sparse_packed): each key chunk's keys and values packed once per
  // (batch, head) into the micro-kernel's panels, then QKᵀ and PV of its groups of queries on them.
  const bool packed = !bf16 && impl::token_sparse_packed<Scalar, KV>(options, n);
  struct Workspace {
    std::vector<Index> start, members, fill;  // queries per key chunk: members[start[j] .. start[j+1])
    RowMatrix<Scalar> acc, qg, s, pv, kv;  // kv: a chunk converted (KV ≠ Scalar) or, in bfloat16, its values rounded
    Vector<Scalar> run_max, run_sum, alpha;
    cpu::MaskedValues<Scalar> masked;
    cpu::PackedB<Scalar> keys, values;  // the packed path's chunk
    cpu::Bf16PackedB keys16, values16;  // Compute::BFloat16: the chunk's keys and values packed for the engine
    cpu::Bf16A q16, p16;                // Compute::BFloat16: a group's queries and probabilities, rounded
  };
  const Index tasks = grid.batch * heads;
  const double work = detail::attention_work(grid.batch * heads, n, std::min(top_k, m) * grid.chunk, dh, dh);
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    const Index b = task / heads, h = task % heads, q_base = b * n;
    // Bucket the queries by selected key chunk (counting sort: each bucket is in ascending order).
    ws.start.assign(static_cast<std::size_t>(m + 1), 0);
    for (Index r = 0; r < n; ++r) {
      const Index* chosen = selection.row(b, h, r);
      for (Index i = 0; i < top_k && chosen[i] >= 0; ++i) ++ws.start[static_cast<std::size_t>(chosen[i] + 1)];
    }
    for (Index j = 0; j < m; ++j) ws.start[static_cast<std::size_t>(j + 1)] += ws.start[static_cast<std::size_t>(j)];
    ws.members.resize(static_cast<std::size_t>(ws.start[static_cast<std::size_t>(m)]));
    ws.fill.assign(ws.start.begin(), ws.start.end() - 1);
    for (Index r = 0; r < n; ++r) {
      const Index* chosen = selection.row(b, h, r);
      for (Index i = 0; i < top_k && chosen[i] >= 0; ++i) {
        ws.members[static_cast<std::size_t>(ws.fill[static_cast<std::size_t>(chosen[i])]++)] = r;
      }
    }
    ws.acc.setZero(n, dh);
    ws.run_max.setConstant(n, kNegInf);
    ws.run_sum.setZero(n);
    ws.qg.resize(G, dh);
    ws.alpha.resize(G);
    ws.pv.resize(G, dh);
    const cpu::Bf16Tiles tile_registers(bf16 ? bf16_engine() : Bf16Engine::Fallback);
    for (Index j = 0; j < m; ++j) {
      const Index first = ws.start[static_cast<std::size_t>(j)], last = ws.start[static_cast<std::size_t>(j + 1)];
      if (first == last) continue;
      const Index kc = b * m + j, count = grid.count(kc), j0 = grid.first(kc), key_row = grid.row(kc);
      if constexpr (std::is_same<KV, Scalar>::value) {
        if (packed) {
          ws.keys.pack(k.block(key_row, h * dh, count, dh).transpose());
          ws.values.pack(v.block(key_row, h * dh, count, dh));
        }
      }
      if constexpr (std::is_same<Scalar, float>::value) {
        if (bf16) {  // Compute::BFloat16: the chunk's keys and values rounded and packed once for its groups
          detail::as_scalar(k.block(key_row, h * dh, count, dh), ws.kv,
                            [&](const auto& kb) { ws.keys16.pack(kb.transpose()); });
          detail::as_scalar(v.block(key_row, h * dh, count, dh), ws.kv, [&](const auto& vb) { ws.values16.pack(vb); });
          // The values rounded once per chunk, for its groups' guard against hidden non-finite values.
          if (causal || !mask.empty()) cpu::round_bf16_copy(v.block(key_row, h * dh, count, dh), ws.kv);
        }
      }
      for (Index g0 = first; g0 < last; g0 += G) {
        const Index rows = std::min(G, last - g0);
        const Index* queries = ws.members.data() + g0;
        // The next group's query rows and accumulator rows (this chunk's or the next's) are scattered over
        // [n, dh] arrays larger than L2 at long lengths: ask for them while this group computes.
        const Index next_end = std::min<Index>(g0 + rows + G, static_cast<Index>(ws.members.size()));
        for (Index u = g0 + rows; u < next_end; ++u) {
          const Index qi = ws.members[static_cast<std::size_t>(u)];
          cpu::prefetch_values(q.data() + (q_base + qi) * q.outerStride() + h * dh, dh);
          cpu::prefetch_values(ws.acc.data() + qi * dh, dh);
        }
        for (Index r = 0; r < rows; ++r) ws.qg.row(r) = q.block(q_base + queries[r], h * dh, 1, dh) * scale;
        if (rows < G) ws.qg.bottomRows(G - rows).setZero();  // fixed GEMM shape; these rows are discarded
        ws.s.resize(G, count);
        if (packed) {  // the real rows; the others 0, as the zero queries' scores would be
          cpu::packed_gemm_range<Scalar>(ws.qg.data(), ws.qg.outerStride(), rows, ws.keys, 0, dh, 0, count, nullptr,
                                         false, ws.s.data(), ws.s.outerStride());
          if (rows < G) ws.s.bottomRows(G - rows).setZero();
        } else if (bf16) {  // Compute::BFloat16: q·scale and the keys rounded, their product on the engine
          if constexpr (std::is_same<Scalar, float>::value) {
            ws.q16.prepare(ws.qg.data(), ws.qg.outerStride(), rows, dh, ws.keys16.engine());
            cpu::bf16_gemm(ws.q16, ws.keys16, 0, dh, 0, count, nullptr, false, ws.s.data(), ws.s.outerStride());
            if (rows < G) ws.s.bottomRows(G - rows).setZero();
          }
        } else {
          detail::as_scalar(k.block(key_row, h * dh, count, dh), ws.kv,
                            [&](const auto& kb) { ws.s.noalias() = ws.qg * kb.transpose(); });
        }
        for (Index r = 0; r < rows; ++r) {
          const Index qi = queries[r], t = p0 + qi;
          if (causal && t - j0 < count - 1)
            ws.s.row(r).tail(count - 1 - std::max<Index>(t - j0, -1)).setConstant(kNegInf);
          if (!mask.empty()) {
            Eigen::Block<RowMatrix<Scalar>> one = ws.s.block(r, 0, 1, count);
            mask.apply(b, h, qi, j0, one);
          }
        }
        const auto weigh_values = [&](const auto& vb) {
          // Keys hidden from a row (future ones, masked ones) may hold non-finite values: leave them out.
          const bool guard = (causal || !mask.empty()) && ws.masked.find(vb);
          if (guard) ws.masked.remember_hidden(ws.s);
          for (Index r = 0; r < rows; ++r) {
            const Index qi = queries[r];
            typename RowMatrix<Scalar>::RowXpr row = ws.s.row(r);
            const Scalar m_old = ws.run_max[qi], m_new = std::max(m_old, row.maxCoeff());
            const Scalar shift = m_new == kNegInf ? Scalar(0) : m_new;  // all hidden so far: no −inf − −inf
            ws.alpha[r] = std::exp(m_old - shift);
            ws.run_sum[qi] = ws.alpha[r] * ws.run_sum[qi] + cpu::exp_shifted_sum(row, shift);
            ws.run_max[qi] = m_new;
          }
          if (rows < G) ws.s.bottomRows(G - rows).setZero();
          if constexpr (std::is_same<Scalar, float>::value) {
            if (bf16 && !guard) {  // the unnormalised probabilities rounded (as sdpa_streaming's), PV on the engine
              ws.p16.prepare(ws.s.data(), ws.s.outerStride(), rows, count, ws.values16.engine());
              cpu::bf16_gemm(ws.p16, ws.values16, 0, count, 0, dh, nullptr, false, ws.pv.data(), ws.pv.outerStride());
              return;
            }
          }
          if (bf16) cpu::round_bf16_matrix(ws.s);  // the unnormalised probabilities, as sdpa_streaming's
          if (packed) {  // added to zeros on both branches: the same bits for a row that hides no bad key
            ws.pv.setZero(G, dh);
            if (guard) {
              ws.masked.product_packed_add(ws.pv, ws.s, vb, 0);
            } else {
              cpu::packed_gemm_range<Scalar>(ws.s.data(), ws.s.outerStride(), rows, ws.values, 0, count, 0, dh, nullptr,
                                             true, ws.pv.data(), ws.pv.outerStride());
            }
          } else if (guard) {
            ws.masked.template product<false>(ws.pv, ws.s, vb);
          } else {
            ws.pv.noalias() = ws.s * vb;
          }
        };
        if (bf16) {  // vb is read only by the guard (causal or masked), which took the rounded values
          weigh_values(static_cast<const RowMatrix<Scalar>&>(ws.kv));
        } else {
          detail::as_scalar(v.block(key_row, h * dh, count, dh), ws.kv, weigh_values);
        }
        for (Index r = 0; r < rows; ++r) {
          const Index qi = queries[r];
          ws.acc.row(qi) = ws.alpha[r] * ws.acc.row(qi) + ws.pv.row(r);
        }
      }
    }
    cpu::divide_by_sums(ws.acc, ws.run_sum, out.block(q_base, h * dh, n, dh));
  });
}

/// The backward pass of chunk_sparse_attention (a per-chunk selection) and token_sparse_attention (a
/// per-token one, causal or not) with the selection a constant — as MoBA and NSA train: the gradients flow
/// through the selected chunks' keys and values only, and none through the gating. For the output's
/// gradient dout, writes dq, dk, dv (overwritten; all [batch·length, heads·dh], the forward's q, k, v
/// layout). Per (batch, head) task, the query groups in ascending order — a query chunk, or with a per-token
/// selection one token — gather their selected keys and values, recompute the probabilities P (scores ·
/// scale, the mask, the causal edge in the own chunk) and add dv += Pᵀ dout, dS = P ∘ (dout vᵀ −
/// rowsum(P ∘ dout vᵀ)), dq = scale · dS k, dk += scale · dSᵀ q, back into the selected chunks' rows. A
/// task owns its head's columns, so the bits do not depend on the thread count. A row with no visible key
/// gets zero gradients and gives none; a key the mask hides receives none, NaN or Inf in it included.
/// Working memory per worker: the gathered keys and values of one group and its scores. Twin:
/// sparse_attention_backward_naive.
template <class Scalar>
void sparse_attention_backward(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                               const ConstRowMatrixRef<Scalar>& v, const ChunkGrid& grid, Index heads,
                               const ChunkSelection& selection, const ConstRowMatrixRef<Scalar>& dout,
                               RowMatrixRef<Scalar> dq, RowMatrixRef<Scalar> dk, RowMatrixRef<Scalar> dv, bool causal,
                               const MaskView<Scalar>& mask, Scalar scale, const KernelOptions& options) {
  impl::check_sparse_backward("sparse_attention_backward", q, k, v, dout, dq, dk, dv, grid, heads, selection, mask,
                              scale);
  if (grid.length == 0) return;  // no rows: nothing to write (and their null data takes no block offsets)
  const Index m = grid.chunks_per_batch(), dh = q.cols() / heads, top_k = selection.top_k;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  struct Workspace {
    RowMatrix<Scalar> kg, vg, s, dp, qs, dkg, dvg;
    Vector<Scalar> rowdot;
    cpu::MaskedValues<Scalar> hidden_k, hidden_v;
  };
  const double work =
      2.5 * detail::attention_work(grid.batch * heads, grid.length, std::min(top_k, m) * grid.chunk, dh, dh);
  detail::parallel_for_each_worker<Workspace>(
      grid.batch * heads, options.num_threads(), work, [&](Index task, Workspace& ws) {
        const Index b = task / heads, h = task % heads;
        dk.block(b * grid.length, h * dh, grid.length, dh).setZero();
        dv.block(b * grid.length, h * dh, grid.length, dh).setZero();
        // One group: `rows` queries from token row q_row (position t0 = its first query's), all with the
        // selection `chosen`; `own` is the chunk of a per-token query (−1 for a query chunk).
        const auto group = [&](Index q_row, Index rows, Index t0, const Index* chosen, Index own) {
          Index n = 0;
          for (Index t = 0; t < top_k && chosen[t] >= 0; ++t) n += grid.count(b * m + chosen[t]);
          ws.kg.resize(n, dh);
          ws.vg.resize(n, dh);
          ws.s.resize(rows, n);
          for (Index t = 0, filled = 0; t < top_k && chosen[t] >= 0; ++t) {
            const Index kc = b * m + chosen[t], count = grid.count(kc);
            ws.kg.middleRows(filled, count) = k.block(grid.row(kc), h * dh, count, dh);
            ws.vg.middleRows(filled, count) = v.block(grid.row(kc), h * dh, count, dh);
            filled += count;
          }
          ws.qs = q.block(q_row, h * dh, rows, dh) * scale;
          ws.s.noalias() = ws.qs * ws.kg.transpose();
          for (Index t = 0, filled = 0; t < top_k && chosen[t] >= 0; ++t) {
            const Index kc = b * m + chosen[t], count = grid.count(kc), j0 = grid.first(kc);
            Eigen::Block<RowMatrix<Scalar>> block = ws.s.middleCols(filled, count);
            if (causal && chosen[t] == own && t0 - j0 < count - 1) {
              block.rightCols(count - 1 - (t0 - j0)).setConstant(kNegInf);  // keys after the query
            }
            if (!mask.empty()) mask.apply(b, h, t0, j0, block);
            filled += count;
          }
          // Keys hidden from a row may hold non-finite values: they take no part (masked_values.hpp).
          const bool hides = causal || !mask.empty();
          const bool guard_k = hides && ws.hidden_k.find(ws.kg), guard_v = hides && ws.hidden_v.find(ws.vg);
          if (guard_k) ws.hidden_k.remember_hidden(ws.s);
          if (guard_v) ws.hidden_v.remember_hidden(ws.s);
          for (Index r = 0; r < rows; ++r) cpu::softmax_row(ws.s.row(r));
          const typename ConstRowMatrixRef<Scalar>::ConstBlockXpr g = dout.block(q_row, h * dh, rows, dh);
          ws.dvg.noalias() = ws.s.transpose() * g;
          ws.dp.noalias() = g * ws.vg.transpose();
          if (guard_v) ws.hidden_v.zero_hidden(ws.dp);  // 0 · Inf would poison the row's sum
          ws.rowdot = ws.s.cwiseProduct(ws.dp).rowwise().sum();
          ws.dp = ws.s.cwiseProduct(ws.dp.colwise() - ws.rowdot);  // dS
          typename RowMatrixRef<Scalar>::BlockXpr dqb = dq.block(q_row, h * dh, rows, dh);
          if (guard_k) {
            ws.hidden_k.template product<false>(dqb, ws.dp, ws.kg);
          } else {
            dqb.noalias() = ws.dp * ws.kg;
          }
          dqb *= scale;
          ws.dkg.noalias() = ws.dp.transpose() * ws.qs;  // qs = scale · q
          for (Index t = 0, filled = 0; t < top_k && chosen[t] >= 0; ++t) {
            const Index kc = b * m + chosen[t], count = grid.count(kc);
            dk.block(grid.row(kc), h * dh, count, dh) += ws.dkg.middleRows(filled, count);
            dv.block(grid.row(kc), h * dh, count, dh) += ws.dvg.middleRows(filled, count);
            filled += count;
          }
        };
        if (selection.per_token) {
          for (Index t = 0; t < grid.length; ++t)
            group(b * grid.length + t, 1, t, selection.row(b, h, t), t / grid.chunk);
        } else {
          for (Index i = 0; i < m; ++i) {
            const Index c = b * m + i;
            group(grid.row(c), grid.count(c), grid.first(c), selection.row(b, h, i), -1);
          }
        }
      });
}

/// Twin of sparse_attention_backward, obviously correct and slow: per (batch, head) the dense [T, T] matrix
/// of the keys each query may see (its selected chunks; with `causal` only keys up to the query), the
/// probabilities P of the scores with the mask's bias, then the textbook formulas dv = Pᵀ dout,
/// dS = P ∘ (dP − rowsum(P ∘ dP)), dq = scale · dS k, dk = scale · dSᵀ q.
template <class Scalar>
void sparse_attention_backward_naive(const ConstRowMatrixRef<Scalar>& q, const ConstRowMatrixRef<Scalar>& k,
                                     const ConstRowMatrixRef<Scalar>& v, const ChunkGrid& grid, Index heads,
                                     const ChunkSelection& selection, const ConstRowMatrixRef<Scalar>& dout,
                                     RowMatrixRef<Scalar> dq, RowMatrixRef<Scalar> dk, RowMatrixRef<Scalar> dv,
                                     bool causal, const MaskView<Scalar>& mask, Scalar scale) {
  impl::check_sparse_backward("sparse_attention_backward_naive", q, k, v, dout, dq, dk, dv, grid, heads, selection,
                              mask, scale);
  const Index T = grid.length, dh = q.cols() / heads;
  for (Index b = 0; b < grid.batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      const Index r0 = b * T, c0 = h * dh;
      RowMatrix<Scalar> p(T, T), dp(T, T);
      p.noalias() = (q.block(r0, c0, T, dh) * scale) * k.block(r0, c0, T, dh).transpose();
      for (Index i = 0; i < T; ++i) {
        const Index* chosen = selection.row(b, h, selection.per_token ? i : i / grid.chunk);
        for (Index j = 0; j < T; ++j) {
          bool selected = false;
          for (Index t = 0; t < selection.top_k; ++t) selected = selected || chosen[t] == j / grid.chunk;
          const bool visible = selected && !(causal && j > i);
          p(i, j) = visible ? cpu::add_bias(p(i, j), mask.empty() ? Scalar(0) : mask.bias(b, h, i, j))
                            : -std::numeric_limits<Scalar>::infinity();
        }
        cpu::softmax_row(p.row(i));
      }
      dp.noalias() = dout.block(r0, c0, T, dh) * v.block(r0, c0, T, dh).transpose();
      const Vector<Scalar> rowdot = p.cwiseProduct(dp).rowwise().sum();
      const RowMatrix<Scalar> ds = p.cwiseProduct(dp.colwise() - rowdot);
      dv.block(r0, c0, T, dh).noalias() = p.transpose() * dout.block(r0, c0, T, dh);
      dq.block(r0, c0, T, dh).noalias() = scale * (ds * k.block(r0, c0, T, dh));
      dk.block(r0, c0, T, dh).noalias() = scale * (ds.transpose() * q.block(r0, c0, T, dh));
    }
  }
}

}  // namespace kernels
}  // namespace c2f
