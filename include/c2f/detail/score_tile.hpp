// c2f — QKᵀ tiles that end in the online softmax's exponentials: the fused step of sdpa_streaming.
//
// The plain online-softmax step (softmax.hpp) makes three passes over a block's scores: QKᵀ stores them,
// a pass finds each row's max over the block, and a pass takes exp(s − max) and the row sums, since the
// shift must be known before any exponential. After a row's first key block its running max m is known.
// The fused step shifts by that max instead: each QKᵀ tile takes exp(s − m) in its epilogue, while the
// scores are still in registers, and adds them to the row's sum lanes, its scores to the row's max lanes.
// A row whose block max exceeds m by more than kStaleMaxSlack (ln 256: no exponential above 256) keeps
// none of it: its scores are computed again (the same bits: gemm_tile_sums) and it takes the plain step,
// as does a row without a finite running max. A kept row's max, sum and accumulator are then relative to
// m instead of the block's new max: the same softmax, rounded differently (measured: docs/benchmarks.md,
// "The online softmax in the QKᵀ tile").
//
// AVX-512 builds only (kFusedScores); the plain step stays every build's path and the fused step's twin
// (tests/test_kernels.cpp, FusedScores).
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/packed_gemm.hpp"
#include "c2f/detail/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace c2f {
namespace detail {

/// Whether this build has the fused step: AVX-512's exp kernel and 32-column panels of packed_gemm.
#if C2F_EXP_SIMD == 16
constexpr bool kFusedScores = true;
#else
constexpr bool kFusedScores = false;
#endif

/// How far a block's scores may exceed a row's running max for the fused step to keep them: ln 256, so
/// that no exponential exceeds 256 (well inside float's range, whatever the sums add up to).
constexpr float kStaleMaxSlack = 5.54517744f;

#if C2F_EXP_SIMD == 16
/// The QKᵀ tile of MR rows of a (A read in place, rows lda apart) and a packed panel b over kc steps
/// (gemm_tile_sums), ended by the fused step's epilogue: for j < cols, c[i·ldc + j] = exp(score − shift[i])
/// (exp_avx512), the 16 lanes at sums + 16·i add the row's two packets of exponentials, those at maxes + 16·i
/// take the max with its two packets of scores. Columns from cols on are neither stored nor counted.
template <int MR>
void score_exp_tile(Index kc, const float* a, Index lda, const float* b, Index cols, const float* shift, float* c,
                    Index ldc, float* sums, float* maxes) {
  static_assert(GemmBlocking<float>::kNP == 2 && GemmBlocking<float>::kP == 16, "AVX-512: two packets of 16 floats per row");
  __m512 acc[MR][2];
  gemm_tile_sums<float, MR>(kc, a, lda, b, acc);
  if (cols == 32) {
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const __m512 s = _mm512_set1_ps(shift[i]);
      _mm512_storeu_ps(maxes + 16 * i, _mm512_max_ps(_mm512_loadu_ps(maxes + 16 * i), _mm512_max_ps(acc[i][0], acc[i][1])));
      const __m512 e0 = exp_avx512(_mm512_sub_ps(acc[i][0], s)), e1 = exp_avx512(_mm512_sub_ps(acc[i][1], s));
      _mm512_storeu_ps(c + i * ldc, e0);
      _mm512_storeu_ps(c + i * ldc + 16, e1);
      _mm512_storeu_ps(sums + 16 * i, _mm512_add_ps(_mm512_loadu_ps(sums + 16 * i), _mm512_add_ps(e0, e1)));
    }
    return;
  }
  // The last panel of the keys: the columns past cols become −inf (exponential 0) and are not stored.
  const __mmask16 k0 = cols >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1u);
  const __mmask16 k1 = cols <= 16 ? __mmask16(0) : static_cast<__mmask16>((1u << (cols - 16)) - 1u);
  const __m512 hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < MR; ++i) {
    const __m512 s = _mm512_set1_ps(shift[i]);
    const __m512 x0 = _mm512_mask_mov_ps(hidden, k0, acc[i][0]), x1 = _mm512_mask_mov_ps(hidden, k1, acc[i][1]);
    _mm512_storeu_ps(maxes + 16 * i, _mm512_max_ps(_mm512_loadu_ps(maxes + 16 * i), _mm512_max_ps(x0, x1)));
    const __m512 e0 = exp_avx512(_mm512_sub_ps(x0, s)), e1 = exp_avx512(_mm512_sub_ps(x1, s));
    _mm512_mask_storeu_ps(c + i * ldc, k0, e0);
    _mm512_mask_storeu_ps(c + i * ldc + 16, k1, e1);
    _mm512_storeu_ps(sums + 16 * i, _mm512_add_ps(_mm512_loadu_ps(sums + 16 * i), _mm512_add_ps(e0, e1)));
  }
}

/// score_exp_tile for the last `rows` (< kMR) rows of a block: the kernel of exactly that many rows.
template <int MR = GemmBlocking<float>::kMR - 1>
void score_exp_tile_rows(Index rows, Index kc, const float* a, Index lda, const float* b, Index cols, const float* shift,
                         float* c, Index ldc, float* sums, float* maxes) {
  if constexpr (MR >= 1) {
    if (rows == MR) {
      score_exp_tile<MR>(kc, a, lda, b, cols, shift, c, ldc, sums, maxes);
    } else {
      score_exp_tile_rows<MR - 1>(rows, kc, a, lda, b, cols, shift, c, ldc, sums, maxes);
    }
  }
}

/// The fused online-softmax step over the keys [j0, j0 + nj) of a packed K (`k`: Kᵀ [depth, keys] packed,
/// depth ≤ kKC, j0 a multiple of kNR) for `rows` queries q (row-major, ldq apart; already scaled): s (rows
/// lds apart) receives the block's exponentials and m, l, alpha are updated as online_softmax_step does;
/// returns whether any alpha differs from 1. A row with a finite running max m and a block max within
/// kStaleMaxSlack of it keeps exp(score − m) (alpha 1, l += their sum); any other row gets its scores
/// again and online_softmax_step. `lanes`: 32·rows floats of scratch. Each row's bits depend on its own
/// query and the keys only, not on the rows beside it.
template <class Max, class Sum, class Alpha>
bool fused_online_softmax_step(const float* q, Index ldq, Index rows, const PackedB<float>& k, Index depth, Index j0, Index nj,
                               float* s, Index lds, Max&& m, Sum&& l, Alpha&& alpha, float* lanes) {
  using B = GemmBlocking<float>;
  float* const sums = lanes;
  float* const maxes = lanes + 16 * rows;
  std::fill_n(sums, 16 * rows, 0.0f);
  std::fill_n(maxes, 16 * rows, -std::numeric_limits<float>::infinity());
  const float* const shift = m.data();
  const Index full = rows / B::kMR, rest = rows - full * B::kMR;
  for (Index p = j0 / B::kNR; p * B::kNR < j0 + nj; ++p) {
    const float* panel = k.panel(0, p);
    const Index j = p * B::kNR - j0, cols = std::min<Index>(B::kNR, nj - j);
    for (Index t = 0; t < full; ++t) {
      const Index r = t * B::kMR;
      score_exp_tile<B::kMR>(depth, q + r * ldq, ldq, panel, cols, shift + r, s + r * lds + j, lds, sums + 16 * r, maxes + 16 * r);
    }
    if (rest > 0) {
      const Index r = full * B::kMR;
      score_exp_tile_rows(rest, depth, q + r * ldq, ldq, panel, cols, shift + r, s + r * lds + j, lds, sums + 16 * r,
                          maxes + 16 * r);
    }
  }
  bool rescale = false;
  for (Index r = 0; r < rows; ++r) {
    const float block_max = _mm512_reduce_max_ps(_mm512_loadu_ps(maxes + 16 * r));
    if (std::isfinite(m[r]) && block_max <= m[r] + kStaleMaxSlack) {  // false for a NaN
      l[r] += _mm512_reduce_add_ps(_mm512_loadu_ps(sums + 16 * r));  // online_softmax_step's fma(alpha = 1, l, sum)
      alpha[r] = 1.0f;
    } else {
      packed_gemm_range<float>(q + r * ldq, ldq, 1, k, 0, depth, j0, nj, nullptr, false, s + r * lds, lds);
      Eigen::Map<RowMatrix<float>> row(s + r * lds, 1, nj);
      rescale = online_softmax_step(row, m.segment(r, 1), l.segment(r, 1), alpha.segment(r, 1)) || rescale;
    }
  }
  return rescale;
}
#endif

}  // namespace detail
}  // namespace c2f
