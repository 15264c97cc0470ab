// c2f kernels — the folded fine stage of coarse-to-fine attention (FineAttention's fast path, also
// C2FAttention2D's): one attention row per block with the key and value projections folded into the
// query and into the pooled tokens, and its backward pass.
//
// For a block c with query q_c = q_proj(coarse context c) and tokens x_j, head h (d_k = d / H):
//   scores_j = q_c,h·(W_k,h x_j + b_k,h) / sqrt(d_k) = (q_c,h W_k,h / sqrt(d_k))·x_j + const  (const drops out)
//   o_c,h    = Σ_j p_j (W_v,h x_j + b_v,h) = W_v,h (Σ_j p_j x_j) + mass · b_v,h
// so no [L, 2d] key/value tensor is formed: fine_folded_forward runs the chain
//   qk = q W_k,h · scale (per head) → fine_attention_folded (pooled, mass) → o = pooled W_v,hᵀ + mass b_v,h
//   → out_proj → broadcast_chunks (every real token of a block gets the block's row)
// and fine_folded_backward its gradients. fine_attention_folded is the pass over the tokens; its twins
// (fine_attention_folded_naive in tests/support, fine_attention_folded_backward_naive here) are what the
// tests compare it with. The grids are those of c2f/kernels/chunk.hpp (a ChunkGrid, a BlockGrid2D, ...).
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/cpu/small_gemm.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/scratch.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/weight_cache.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace c2f {
namespace kernels {

/// The parameters the folded chain reads: FineAttention's kv_proj (W_k the top d rows, W_v the bottom d
/// rows; of its bias only the value half b_v: the key bias only shifts a softmax row) and out_proj; the
/// per-head packings of W_k,h · scale and W_v,hᵀ are kept in slots h and heads + h of `head_packs`,
/// current while `kv_stamp` is (a layer's Linear::weight_stamp()).
template <class Scalar>
struct FineFoldedWeights {
  ConstRowMatrixRef<Scalar> kv_weight;       ///< [2d, d]
  Eigen::Ref<const Vector<Scalar>> kv_bias;  ///< [2d]
  const WeightCache<Scalar>& head_packs;
  std::uint64_t kv_stamp;
  CachedLinear<Scalar> out;  ///< out_proj: [d, d] and its bias
};

/// What fine_folded_forward keeps for fine_folded_backward, one row per block: the folded queries qk
/// [blocks, H·d], the pooled tokens [blocks, H·d], the masses [blocks, H] and the heads' output o
/// [blocks, d].
template <class Scalar>
struct FineFoldedState {
  detail::ScratchRowMatrix<Scalar> qk, pooled, mass, o;
};

/// Where fine_folded_backward writes the gradients of the parameters of FineFoldedWeights (overwritten;
/// the rows of the key half of kv_weight's and all of kv_bias's — the key bias's gradient is zero).
template <class Scalar>
struct FineFoldedGrads {
  RowMatrixRef<Scalar> kv_weight;      ///< [2d, d]
  Eigen::Ref<Vector<Scalar>> kv_bias;  ///< [2d]
  RowMatrixRef<Scalar> out_weight;     ///< [d, d]
  Scalar* out_bias;                    ///< [d], or nullptr without a bias
};

namespace impl {

/// The entry checks of fine_attention_folded_backward and its twin.
template <class Scalar, class Grid>
void check_folded_backward(const char* kernel, const ConstRowMatrixRef<Scalar>& x, const Grid& grid,
                           const ConstRowMatrixRef<Scalar>& qk, Index heads, const ConstRowMatrixRef<Scalar>& dpooled,
                           const RowMatrixRef<Scalar>& dx, const RowMatrixRef<Scalar>& dqk) {
  const Index d = x.cols();
  grid.check(kernel);
  detail::check_heads(kernel, heads * d, heads);
  detail::check_shape(kernel, "x", x, grid.tokens(), d);
  detail::check_shape(kernel, "qk", qk, grid.blocks(), heads * d);
  detail::check_shape(kernel, "dpooled", dpooled, grid.blocks(), heads * d);
  detail::check_shape(kernel, "dx", dx, grid.tokens(), d);
  detail::check_shape(kernel, "dqk", dqk, grid.blocks(), heads * d);
}

/// Whether fine_folded_forward on `blocks` block rows keeps its per-head packings in the weights'
/// head_packs: where its products pack their right side.
template <class Scalar>
bool folded_weights_cached(Index blocks, const KernelOptions& options) {
  return options.compute() == Compute::BFloat16 || cpu::packed_gemm_for(blocks, true);
}

/// The blocks per group of fine_folded_forward on `grid` (d features, `heads` heads): about
/// kFoldedGroupBytes of qk and pooled rows per group, the group count rounded up to a multiple of the
/// workers (so that they share them evenly), then the group cut down to whole bands of the grid (a block
/// row of 2-D blocks, whose output rows interleave: broadcast_chunks then writes each group's output in
/// address order); or all the blocks — the whole chain product by product, each product on every worker
/// — on one worker or when there are fewer blocks than two groups' worth per worker.
template <class Scalar, class Grid>
Index folded_group(const Grid& grid, Index d, Index heads, int threads) {
  constexpr std::size_t kFoldedGroupBytes = std::size_t(768) << 10;
  const Index blocks = grid.blocks();
  const std::size_t row_bytes = 2 * sizeof(Scalar) * static_cast<std::size_t>(heads * d);
  const Index group = std::max<Index>(1, static_cast<Index>(kFoldedGroupBytes / row_bytes));
  const Index workers = detail::resolve_threads(threads, blocks);
  if (workers <= 1 || blocks < 2 * workers * group) return blocks;
  const Index size = detail::ceil_div(blocks, detail::ceil_div(detail::ceil_div(blocks, group), workers) * workers);
  const Index band = grid.band_end(0);
  return size >= band ? size / band * band : size;
}

}  // namespace impl

/// The folded fine-attention step. For every block c and head h, with one query per block:
///   p_c,h = softmax_j( qk[c, h] · x_j + bias(c, h, j) )  over the real tokens j of block c,
///   pooled[c, h] = Σ_j p_c,h[j] x_j   and   mass[c, h] = Σ_j p_c,h[j]  (1, or 0 if all keys are masked).
/// x [rows, d]; qk [blocks, heads·d] holds, per head, the query already multiplied into the key
/// projection and by the softmax scale (q_h W_k,h / sqrt(d_k)), so no scale is applied here; pooled
/// [blocks, heads·d] and mass [blocks, heads] are overwritten.
/// `bias(c, h, j)` returns 0, an additive value or -inf (masked). Masked keys get exactly 0 weight.
///
/// Blocks of several runs (2-D blocks) are read run by run, each once from memory: a run's softmax and
/// pooled sum are merged into the block's with the running-max rule (flash decoding's split-K merge, in
/// run order, so the bits do not depend on the thread count). A block of one run (a chunk) is exactly
/// softmax then Σ p x. Working memory: heads × (longest run + d) values per worker (bfloat16: also
/// (heads + longest run) × d). In fp32 the two products per run read the run in place
/// (cpu/small_gemm.hpp): no packed copy of x.
/// With options.compute() == Compute::BFloat16 (float only) the products' operands are rounded to
/// bfloat16 — qk, x (a rounded copy of each run, made once) and the probabilities — and summed in fp32
/// (docs/bf16.md).
template <class Scalar, class Grid, class Bias>
void fine_attention_folded(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, const ConstRowMatrixRef<Scalar>& qk,
                           Index heads, RowMatrixRef<Scalar> pooled, RowMatrixRef<Scalar> mass, Bias&& bias,
                           const KernelOptions& options) {
  const Index d = x.cols();
  grid.check("fine_attention_folded");
  detail::check_heads("fine_attention_folded", heads * d, heads);
  detail::check_shape("fine_attention_folded", "x", x, grid.tokens(), d);
  detail::check_shape("fine_attention_folded", "qk", qk, grid.blocks(), heads * d);
  detail::check_shape("fine_attention_folded", "pooled", pooled, grid.blocks(), heads * d);
  detail::check_shape("fine_attention_folded", "mass", mass, grid.blocks(), heads);
  const bool bf16 = cpu::check_compute<Scalar>("fine_attention_folded", options.compute());
  struct Workspace {
    RowMatrix<Scalar> p, o;           // one run: scores [heads, run length] and pooled rows [heads, d]
    Vector<Scalar> max, sum;          // per head: the block's running max and softmax sum
    Vector<Scalar> run_max, run_sum;  // per head: the run's
    RowMatrix<Scalar> q16, x16;       // Compute::BFloat16: the block's qk and the run's tokens, rounded
  };
  // The run's two products. Compute::BFloat16 rounds the run's tokens once into x16 (one sequential
  // pass; the products then read every value several times, from cache) and the probabilities in place.
  const auto scores = [&](const Scalar* q, const Scalar* xs, Index ldx, Index n, Scalar* p, const Scalar* next,
                          Index next_n) { cpu::dot_rows<Scalar>(q, heads, d, xs, ldx, n, p, n, next, next_n); };
  const auto pool = [&](Scalar* p, Index n, const Scalar* xs, Index ldx, Scalar* o) {
    if (bf16) cpu::round_bf16_rows(p, heads, n, n);
    cpu::weighted_rows<Scalar>(p, n, heads, n, xs, ldx, d, o, d);
  };
  const double work =
      static_cast<double>(grid.tokens() * heads) * (4.0 * static_cast<double>(d) + detail::kElementWork);
  // A task is a range of consecutive blocks, so that while one block is scored the next one's tokens can
  // be asked for (`next` below): a worker claims tasks one at a time, and with one block per task the
  // next block was usually another worker's. Every block is computed alone: the bits do not depend on
  // the grouping or the thread count.
  const Index blocks = grid.blocks();
  const Index workers = detail::resolve_threads(options.num_threads(), blocks);
  const Index per_task = std::max<Index>(1, std::min<Index>(16, blocks / (4 * workers)));
  const Index tasks = detail::ceil_div(blocks, per_task);
  detail::parallel_for_each_worker<Workspace>(tasks, options.num_threads(), work, [&](Index task, Workspace& ws) {
    const Index c_end = std::min(blocks, (task + 1) * per_task);
    for (Index c = task * per_task; c < c_end; ++c) {
      if (ws.max.size() != heads) {
        ws.max.resize(heads);
        ws.sum.resize(heads);
        ws.run_max.resize(heads);
        ws.run_sum.resize(heads);
      }
      const Scalar* q = qk.row(c).data();
      if (bf16) {
        if (ws.q16.rows() != heads || ws.q16.cols() != d) ws.q16.resize(heads, d);
        cpu::round_bf16_rows<Scalar>(q, d, heads, d, ws.q16.data(), d);
        q = ws.q16.data();
      }
      Eigen::Map<RowMatrix<Scalar>> acc(pooled.row(c).data(), heads, d);
      for (Index s = 0, j0 = 0; s < grid.segments(c); ++s) {
        const Index n = grid.segment_length(c, s);
        const typename ConstRowMatrixRef<Scalar>::ConstRowsBlockXpr xs = x.middleRows(grid.segment_row(c, s), n);
        if (ws.p.rows() != heads || ws.p.cols() != n) ws.p.resize(heads, n);
        const Scalar* xd = xs.data();
        Index ldx = x.outerStride();
        if (bf16) {
          if (ws.x16.rows() != n || ws.x16.cols() != d) ws.x16.resize(n, d);
          cpu::round_bf16_rows<Scalar>(xs.data(), x.outerStride(), n, d, ws.x16.data(), d);
          xd = ws.x16.data();
          ldx = d;
        }
        // The next run — of this block, or the first of the task's next block — read ahead while this
        // one is scored.
        const bool more = s + 1 < grid.segments(c), ahead = more || c + 1 < c_end;
        const Index next_c = more ? c : c + 1, next_s = more ? s + 1 : 0;
        const Scalar* next = ahead ? x.data() + grid.segment_row(next_c, next_s) * x.outerStride() : nullptr;
        scores(q, xd, ldx, n, ws.p.data(), next, ahead ? grid.segment_length(next_c, next_s) : 0);  // p = q xsᵀ
        for (Index h = 0; h < heads; ++h) {
          for (Index j = 0; j < n; ++j) ws.p(h, j) = cpu::add_bias(ws.p(h, j), bias(c, h, j0 + j));
          const bool visible = cpu::softmax_row(ws.p.row(h), &ws.run_max[h], &ws.run_sum[h]);
          if (s == 0) mass(c, h) = visible ? Scalar(1) : Scalar(0);
        }
        j0 += n;
        if (s == 0) {
          pool(ws.p.data(), n, xd, ldx, acc.data());  // p xs
          ws.max = ws.run_max;
          ws.sum = ws.run_sum;
          continue;
        }
        // Merge the run into the block: o_block = (L·e^(M−M')·o_block + l·e^(m−M')·o_run) / (L·e^(M−M') + l·e^(m−M')).
        if (ws.o.rows() != heads || ws.o.cols() != d) ws.o.resize(heads, d);
        pool(ws.p.data(), n, xd, ldx, ws.o.data());
        for (Index h = 0; h < heads; ++h) {
          const Scalar l = ws.run_sum[h], m = ws.run_max[h];
          if (l == Scalar(0)) continue;  // every key of this run is masked for head h
          if (ws.sum[h] == Scalar(0)) {  // the block's first run with a visible key
            acc.row(h) = ws.o.row(h);
            ws.max[h] = m;
            ws.sum[h] = l;
            mass(c, h) = Scalar(1);
            continue;
          }
          const Scalar m_new = std::max(ws.max[h], m);
          const Scalar a = ws.sum[h] * std::exp(ws.max[h] - m_new), b = l * std::exp(m - m_new);
          ws.sum[h] = a + b;
          ws.max[h] = m_new;
          acc.row(h) = acc.row(h) * (a / ws.sum[h]) + ws.o.row(h) * (b / ws.sum[h]);
        }
      }
    }
  });
}

/// The backward pass of fine_attention_folded for dpooled = dL/dpooled [blocks, heads·d] (mass needs none:
/// it is 1 or 0 whatever x and qk are). For every block c and head h, with p_j the forward's softmax
/// weights over the block's real tokens (recomputed from x, qk and bias):
///   r_j = dpooled[c, h]·x_j,   D = Σ_j p_j r_j,   ds_j = p_j (r_j − D)
///   dx_j = Σ_h p_hj dpooled[c, h] + ds_hj qk[c, h]      (overwritten, every real token of the block)
///   dqk[c, h] = Σ_j ds_hj x_j                            (overwritten)
/// A head that sees no token of a block (every bias −inf) gives zero there. Tasks are blocks: a block's rows
/// of dx and its row of dqk are its own, so the bits do not depend on the thread count. Working memory:
/// two [heads, count] blocks per worker. Twin: fine_attention_folded_backward_naive.
template <class Scalar, class Grid, class Bias>
void fine_attention_folded_backward(const ConstRowMatrixRef<Scalar>& x, const Grid& grid,
                                    const ConstRowMatrixRef<Scalar>& qk, Index heads,
                                    const ConstRowMatrixRef<Scalar>& dpooled, Bias&& bias, RowMatrixRef<Scalar> dx,
                                    RowMatrixRef<Scalar> dqk, const KernelOptions& options) {
  const char* kernel = "fine_attention_folded_backward";
  const Index d = x.cols();
  impl::check_folded_backward(kernel, x, grid, qk, heads, dpooled, dx, dqk);
  struct Workspace {
    RowMatrix<Scalar> p, ds;  // [heads, count]: the weights, then r and ds = p ∘ (r − D)
  };
  const double work =
      static_cast<double>(grid.tokens() * heads) * (8.0 * static_cast<double>(d) + detail::kElementWork);
  detail::parallel_for_each_worker<Workspace>(grid.blocks(), options.num_threads(), work, [&](Index c, Workspace& ws) {
    const Index n = grid.count(c);
    ws.p.resize(heads, n);
    ws.ds.resize(heads, n);
    const Eigen::Map<const RowMatrix<Scalar>> q(qk.row(c).data(), heads, d), g(dpooled.row(c).data(), heads, d);
    Eigen::Map<RowMatrix<Scalar>> dq(dqk.row(c).data(), heads, d);
    for (Index s = 0, j0 = 0; s < grid.segments(c); ++s) {
      const Index len = grid.segment_length(c, s);
      const typename ConstRowMatrixRef<Scalar>::ConstRowsBlockXpr xs = x.middleRows(grid.segment_row(c, s), len);
      ws.p.middleCols(j0, len).noalias() = q * xs.transpose();
      ws.ds.middleCols(j0, len).noalias() = g * xs.transpose();  // r
      j0 += len;
    }
    for (Index h = 0; h < heads; ++h) {
      for (Index j = 0; j < n; ++j) ws.p(h, j) = cpu::add_bias(ws.p(h, j), bias(c, h, j));
      cpu::softmax_row(ws.p.row(h));
      const Scalar rowdot = ws.p.row(h).dot(ws.ds.row(h));
      ws.ds.row(h) = ws.p.row(h).cwiseProduct((ws.ds.row(h).array() - rowdot).matrix());
    }
    dq.setZero();
    for (Index s = 0, j0 = 0; s < grid.segments(c); ++s) {
      const Index r0 = grid.segment_row(c, s), len = grid.segment_length(c, s);
      typename RowMatrixRef<Scalar>::RowsBlockXpr dxs = dx.middleRows(r0, len);
      dxs.noalias() = ws.p.middleCols(j0, len).transpose() * g;
      dxs.noalias() += ws.ds.middleCols(j0, len).transpose() * q;
      dq.noalias() += ws.ds.middleCols(j0, len) * x.middleRows(r0, len);
      j0 += len;
    }
  });
}

/// Twin of fine_attention_folded_backward, obviously correct and slow: per block, its token rows listed run
/// after run; per head one scalar loop per formula — the weights p by softmax_row of the scores, dp_j =
/// dpooled·x_j, ds_j = p_j (dp_j − Σ_i p_i dp_i), then dx_j += p_j dpooled + ds_j qk and dqk += ds_j x_j.
template <class Scalar, class Grid, class Bias>
void fine_attention_folded_backward_naive(const ConstRowMatrixRef<Scalar>& x, const Grid& grid,
                                          const ConstRowMatrixRef<Scalar>& qk, Index heads,
                                          const ConstRowMatrixRef<Scalar>& dpooled, Bias&& bias,
                                          RowMatrixRef<Scalar> dx, RowMatrixRef<Scalar> dqk) {
  const Index d = x.cols();
  impl::check_folded_backward("fine_attention_folded_backward_naive", x, grid, qk, heads, dpooled, dx, dqk);
  for (Index c = 0; c < grid.blocks(); ++c) {
    std::vector<Index> tokens;
    for (Index s = 0; s < grid.segments(c); ++s) {
      for (Index r = 0; r < grid.segment_length(c, s); ++r) tokens.push_back(grid.segment_row(c, s) + r);
    }
    const Index n = static_cast<Index>(tokens.size());
    for (Index t : tokens) dx.row(t).setZero();
    dqk.row(c).setZero();
    for (Index h = 0; h < heads; ++h) {
      Eigen::Matrix<Scalar, 1, Eigen::Dynamic> p(n), dp(n);
      for (Index j = 0; j < n; ++j) {
        Scalar s = 0, r = 0;
        for (Index k = 0; k < d; ++k) {
          s += qk(c, h * d + k) * x(tokens[static_cast<std::size_t>(j)], k);
          r += dpooled(c, h * d + k) * x(tokens[static_cast<std::size_t>(j)], k);
        }
        p[j] = cpu::add_bias(s, bias(c, h, j));
        dp[j] = r;
      }
      cpu::softmax_row(p);
      Scalar rowdot = 0;
      for (Index j = 0; j < n; ++j) rowdot += p[j] * dp[j];
      for (Index j = 0; j < n; ++j) {
        const Index t = tokens[static_cast<std::size_t>(j)];
        const Scalar ds = p[j] * (dp[j] - rowdot);
        for (Index k = 0; k < d; ++k) {
          dx(t, k) += p[j] * dpooled(c, h * d + k) + ds * qk(c, h * d + k);
          dqk(c, h * d + k) += ds * x(t, k);
        }
      }
    }
  }
}

/// The folded fine stage on `grid`: tokens x [rows, d], the blocks' queries q [blocks, d] (q_proj of
/// their coarse context), `bias(c, h, j)` added to the score of token j of block c for head h (0, a
/// value or -inf) → out [rows, d], where every real token of block c gets block c's row (rows of out
/// that belong to no block are left as they are). `keep`: nullptr, or where training keeps the chain's
/// intermediates (fine_folded_backward). options.fresh_output(): out is fresh memory left to its first
/// writes (broadcast_chunks). Every product is row by row independent (KernelOptions::rows_independent,
/// set here): a shard of the blocks (c2f/dist) computes the bits of the whole. The pass over the tokens
/// stays fp32 in either compute: it reads each token once for 4·H·d FLOP and is bound by memory, so
/// rounding its operands would cost time (a rounded copy of every run) and accuracy and save nothing
/// (docs/bf16.md).
template <class Scalar, class Grid, class Bias>
void fine_folded_forward(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, const ConstRowMatrixRef<Scalar>& q,
                         Index heads, const FineFoldedWeights<Scalar>& w, const Bias& bias, RowMatrixRef<Scalar> out,
                         const KernelOptions& options, FineFoldedState<Scalar>* keep = nullptr) {
  const Index chunks = grid.blocks(), d = x.cols(), dk = d / heads;
  const bool fresh_out = options.fresh_output();
  const KernelOptions threads = KernelOptions(options).rows_independent(true).fresh_output(false);
  const Scalar scale = default_scale<Scalar>(dk);
  const typename ConstRowMatrixRef<Scalar>::ConstRowsBlockXpr wk = w.kv_weight.topRows(d),
                                                              wv = w.kv_weight.bottomRows(d);

  // qk[c, h·d:(h+1)·d] = q[c, h·dk:(h+1)·dk] W_k,h / sqrt(dk)   (the key bias only shifts a softmax row)
  // The large temporaries live in reused scratch memory (detail/scratch.hpp).
  // Where the products pack their right side (the micro-kernel path, bfloat16), the per-head packings of
  // W_k,h · scale and W_v,hᵀ are kept (slots h and heads + h of head_packs, checked against kv_stamp), so
  // the expression is packed once. Eigen's product (a portable build that ignores rows_independent) gets
  // W_k,h · scale materialised first, as a plain matrix. The products are the same, so are the bits.
  detail::ScratchRowMatrix<Scalar> qk(chunks, heads * d), pooled(chunks, heads * d), mass(chunks, heads), o(chunks, d),
      chunk_out(chunks, d);
  const bool cached = impl::folded_weights_cached<Scalar>(chunks, options);
  const std::size_t slots = static_cast<std::size_t>(heads);
  detail::ScratchRowMatrix<Scalar> wk_scaled(cached ? 0 : dk, d);
  const ConstRowMatrixRef<Scalar> wk_h(wk_scaled);
  // The whole chain on blocks [c0, c0 + n): their rows of every product, their pass over the tokens and
  // their output rows.
  const auto run = [&](Index c0, Index n) {
    const BlockRange<Grid> range{grid, c0, n};
    for (Index h = 0; h < heads; ++h) {
      if (cached) {
        matmul_rows_cached<Scalar>(q.middleRows(c0, n).middleCols(h * dk, dk), wk.middleRows(h * dk, dk) * scale,
                                   nullptr, qk.middleRows(c0, n).middleCols(h * d, d), threads, w.head_packs,
                                   static_cast<std::size_t>(h), w.kv_stamp);
        continue;
      }
      wk_scaled = wk.middleRows(h * dk, dk) * scale;
      matmul_rows<Scalar>(q.middleRows(c0, n).middleCols(h * dk, dk), wk_h, nullptr,
                          qk.middleRows(c0, n).middleCols(h * d, d), threads);
    }
    fine_attention_folded<Scalar>(
        x, range, qk.middleRows(c0, n), heads, pooled.middleRows(c0, n), mass.middleRows(c0, n),
        [&](Index c, Index h, Index j) { return bias(c0 + c, h, j); },
        KernelOptions(threads).compute(Compute::Float32));
    // o[c, h·dk:(h+1)·dk] = pooled[c, h] W_v,hᵀ + mass[c, h] b_v,h
    for (Index h = 0; h < heads; ++h) {
      matmul_rows_cached<Scalar>(pooled.middleRows(c0, n).middleCols(h * d, d), wv.middleRows(h * dk, dk).transpose(),
                                 nullptr, o.middleRows(c0, n).middleCols(h * dk, dk), threads, w.head_packs,
                                 slots + static_cast<std::size_t>(h), w.kv_stamp);
      o.middleRows(c0, n).middleCols(h * dk, dk).noalias() +=
          mass.middleRows(c0, n).col(h) * w.kv_bias.segment(d + h * dk, dk).transpose();
    }
    linear_cached<Scalar>(o.middleRows(c0, n), w.out, chunk_out.middleRows(c0, n), threads);
    broadcast_chunks<Scalar>(chunk_out.middleRows(c0, n), range, out, KernelOptions(threads).fresh_output(fresh_out));
  };
  // Where the products' packings are kept (`cached`), every block's chain runs in one task, groups of
  // blocks on the workers at once: each group's qk and pooled rows stay in the worker's L2 from the
  // product that writes them to the pass that reads them, and one worker's pass over the tokens can
  // overlap the other's products (docs/benchmarks.md#why-c2fattention-stops-near-two-thirds-of-its-roofline).
  // Every product is row by row independent and every block is computed alone, so the bits are those of
  // one group of all the blocks, whatever the grouping or the thread count.
  const Index group = cached ? impl::folded_group<Scalar>(grid, d, heads, threads.num_threads()) : chunks;
  if (group >= chunks) {
    run(0, chunks);
  } else {
    const double work = 6.0 * static_cast<double>(chunks) * static_cast<double>(d) * static_cast<double>(d) +
                        4.0 * static_cast<double>(grid.tokens() * heads) * static_cast<double>(d);
    detail::parallel_for(detail::ceil_div(chunks, group), threads.num_threads(), work,
                         [&](Index g, int) { run(g * group, std::min(group, chunks - g * group)); });
  }
  if (keep != nullptr) {
    keep->qk = std::move(qk);
    keep->pooled = std::move(pooled);
    keep->mass = std::move(mass);
    keep->o = std::move(o);
  }
}

/// Bytes of temporary memory fine_folded_forward holds at its peak for `blocks` block rows of d features
/// whose longest run of tokens is `longest_run` (a chunk; a 2-D block's width): o, chunk_out [blocks, d];
/// qk, pooled [blocks, h·d]; mass [blocks, h]; the scaled key projection of a head [d / h, d] where the
/// packings are not kept; per worker the folded kernel's scores [h, run], run output [h, d] and four [h]
/// vectors (fp32 in either compute); and the largest packed operand of its products (micro-kernel builds;
/// one product runs at a time; the packings kept in head_packs and out.cache are not counted). The
/// caller's q [blocks, d] is not counted.
template <class Scalar>
std::size_t fine_folded_workspace_bytes(Index blocks, Index longest_run, Index d, Index heads,
                                        const KernelOptions& options) {
  const Compute c = options.compute();
  const int threads = options.num_threads();
  const bool cached = impl::folded_weights_cached<Scalar>(blocks, options);
  const Index dk = d / heads;
  const std::size_t packed = std::max({matmul_rows_workspace_bytes<Scalar>(blocks, dk, d, true, c, threads, cached),
                                       matmul_rows_workspace_bytes<Scalar>(blocks, d, dk, true, c, threads, cached),
                                       matmul_rows_workspace_bytes<Scalar>(blocks, d, d, true, c, threads, true)});
  const std::size_t m = static_cast<std::size_t>(blocks), run = static_cast<std::size_t>(longest_run);
  const std::size_t dd = static_cast<std::size_t>(d), h = static_cast<std::size_t>(heads), dkk = dd / h;
  const std::size_t workers = static_cast<std::size_t>(detail::resolve_threads(threads, blocks));
  return packed +
         sizeof(Scalar) * (m * (2 * dd + 2 * h * dd + h) + (cached ? 0 : dkk * dd) + workers * h * (run + dd + 4));
}

/// The backward pass of fine_folded_forward for dy = dL/dout [rows, d]: dx [rows, d] (every real token's
/// row overwritten), dq = dL/dq [blocks, d] (overwritten) and the parameters' gradients into g. `state` is
/// what fine_folded_forward kept, `bias` its bias.
///   out = broadcast(chunk_out), chunk_out = o W_oᵀ + b_o: dchunk = the blocks' sums of dy;
///   o_h = pooled_h W_v,hᵀ + mass_h b_v,h: dpooled_h = do_h W_v,h, dW_v,h = do_hᵀ pooled_h, db_v,h = Σ mass do_h;
///   fine_attention_folded_backward: dx, dqk;
///   qk_h = q_h (W_k,h · scale): dq_h = dqk_h (W_k,h · scale)ᵀ, dW_k,h = scale · q_hᵀ dqk_h.
template <class Scalar, class Grid, class Bias>
void fine_folded_backward(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, const ConstRowMatrixRef<Scalar>& q,
                          Index heads, const FineFoldedWeights<Scalar>& w, const FineFoldedState<Scalar>& state,
                          const Bias& bias, const ConstRowMatrixRef<Scalar>& dy, RowMatrixRef<Scalar> dx,
                          RowMatrixRef<Scalar> dq, FineFoldedGrads<Scalar> g, const KernelOptions& options) {
  const Index blocks = grid.blocks(), d = x.cols(), dk = d / heads;
  // The temporaries in reused scratch memory (detail/scratch.hpp), as the forward's.
  detail::ScratchRowMatrix<Scalar> dchunk(blocks, d), dout_heads(blocks, d);
  chunk_sum<Scalar>(dy, grid, dchunk, options);
  linear_backward<Scalar>(state.o, w.out.weight, dchunk, dout_heads, g.out_weight, g.out_bias, options);
  const Scalar scale = default_scale<Scalar>(dk);
  detail::ScratchRowMatrix<Scalar> dpooled(blocks, heads * d), dqk(blocks, heads * d);
  for (Index h = 0; h < heads; ++h) {
    linear_backward<Scalar>(state.pooled.middleCols(h * d, d), w.kv_weight.middleRows(d + h * dk, dk),
                            dout_heads.middleCols(h * dk, dk), dpooled.middleCols(h * d, d),
                            g.kv_weight.middleRows(d + h * dk, dk), nullptr, options);
    g.kv_bias.segment(d + h * dk, dk) = (state.mass.col(h).transpose().template cast<double>() *
                                         dout_heads.middleCols(h * dk, dk).template cast<double>())
                                            .transpose()
                                            .template cast<Scalar>();
  }
  fine_attention_folded_backward<Scalar>(x, grid, state.qk, heads, dpooled, bias, dx, dqk, options);
  // The key bias only shifts a softmax row: its gradient is zero.
  for (Index h = 0; h < heads; ++h) {
    matmul_rows<Scalar>(dqk.middleCols(h * d, d), w.kv_weight.middleRows(h * dk, dk).transpose() * scale, nullptr,
                        dq.middleCols(h * dk, dk), options);
    g.kv_weight.middleRows(h * dk, dk).noalias() =
        (q.middleCols(h * dk, dk).transpose() * dqk.middleCols(h * d, d)) * scale;
  }
}

}  // namespace kernels
}  // namespace c2f
