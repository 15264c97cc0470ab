// c2f — QKᵀ tiles that end in the online softmax's exponentials: the fused step of sdpa_streaming.
//
// The plain online-softmax step (softmax.hpp) makes three passes over a block's scores: QKᵀ stores them,
// a pass finds each row's max over the block, and a pass takes exp(s − max) and the row sums, since the
// shift must be known before any exponential. The fused step shifts by a max known before the block: the
// row's running max m, or, in a block that opens the rows' softmax, the max of the row's scores in the
// block's first panel (computed first). Each QKᵀ tile then takes exp(s − shift) in its epilogue, while
// the scores are still in registers, and adds them to the row's sum lanes, its scores to the row's max
// lanes. A row whose block max exceeds its shift by more than kStaleMaxSlack (ln 256: no exponential above
// 256) keeps none of it: its scores are computed again (the same bits: gemm_tile_sums) and it takes the
// plain step, as does a row without a finite shift. A kept row's max, sum and accumulator are then
// relative to the shift instead of the block's max: the same softmax, rounded differently
// (docs/benchmarks.md#where-multiheadattentions-time-goes; the A/B: "The online softmax in the QKᵀ tile" in git show
// 9944106:docs/benchmarks.md).
//
// AVX-512 builds only (kFusedScores); the plain step stays every build's path and the fused step's twin
// (tests/test_kernels.cpp, FusedScores).
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/cpu/softmax.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace c2f {
namespace cpu {

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
/// The end of one row of a tile: its scores x0, x1 (two packets; lanes past the keys −inf) shifted by
/// `shift` into exponentials stored at c (all 32, or where k0, k1 are set unless Whole), added to the
/// row's 16 sum lanes; the scores taken into its 16 max lanes.
template <bool Whole>
EIGEN_ALWAYS_INLINE void exp_into_lanes(__m512 x0, __m512 x1, float shift, float* c, __mmask16 k0, __mmask16 k1,
                                        float* sums, float* maxes) {
  const __m512 s = _mm512_set1_ps(shift);
  _mm512_storeu_ps(maxes, _mm512_max_ps(_mm512_loadu_ps(maxes), _mm512_max_ps(x0, x1)));
  const __m512 e0 = exp_avx512(_mm512_sub_ps(x0, s)), e1 = exp_avx512(_mm512_sub_ps(x1, s));
  if (Whole) {
    _mm512_storeu_ps(c, e0);
    _mm512_storeu_ps(c + 16, e1);
  } else {
    _mm512_mask_storeu_ps(c, k0, e0);
    _mm512_mask_storeu_ps(c + 16, k1, e1);
  }
  _mm512_storeu_ps(sums, _mm512_add_ps(_mm512_loadu_ps(sums), _mm512_add_ps(e0, e1)));
}

/// The masks of the first `cols` (≤ 32) of a row's two packets.
inline std::pair<__mmask16, __mmask16> lane_masks(Index cols) {
  return {cols >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1u),
          cols <= 16 ? __mmask16(0) : static_cast<__mmask16>((1u << (cols - 16)) - 1u)};
}

/// The QKᵀ tile of MR rows of a (A read in place, rows lda apart) and a packed panel b over kc steps
/// (gemm_tile_sums), ended by the fused step's epilogue (exp_into_lanes): for j < cols,
/// c[i·ldc + j] = exp(score − shift[i]) (exp_avx512), the lanes at sums + 16·i add the row's
/// exponentials, those at maxes + 16·i take its scores. Columns from cols on are neither stored nor counted.
template <int MR>
void score_exp_tile(Index kc, const float* a, Index lda, const float* b, Index cols, const float* shift, float* c,
                    Index ldc, float* sums, float* maxes) {
  static_assert(GemmBlocking<float>::kNP == 2 && GemmBlocking<float>::kP == 16,
                "AVX-512: two packets of 16 floats per row");
  __m512 acc[MR][2];
  gemm_tile_sums<float, MR>(kc, a, lda, b, acc);
  if (cols == 32) {
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      exp_into_lanes<true>(acc[i][0], acc[i][1], shift[i], c + i * ldc, 0, 0, sums + 16 * i, maxes + 16 * i);
    }
    return;
  }
  // The last panel of the keys: the columns past cols become −inf (exponential 0) and are not stored.
  const std::pair<__mmask16, __mmask16> k = lane_masks(cols);
  const __m512 hidden = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 12  // as gemm_tile's last panel: acc stays in registers
  for (int i = 0; i < MR; ++i) {
    exp_into_lanes<false>(_mm512_mask_mov_ps(hidden, k.first, acc[i][0]),
                          _mm512_mask_mov_ps(hidden, k.second, acc[i][1]), shift[i], c + i * ldc, k.first, k.second,
                          sums + 16 * i, maxes + 16 * i);
  }
}

/// score_exp_tile for the last `rows` (< kMR) rows of a block: the kernel of exactly that many rows.
inline void score_exp_tile_rows(Index rows, Index kc, const float* a, Index lda, const float* b, Index cols,
                                const float* shift, float* c, Index ldc, float* sums, float* maxes) {
  with_tile_rows<GemmBlocking<float>::kMR - 1>(
      rows, [&](auto mr) { score_exp_tile<decltype(mr)::value>(kc, a, lda, b, cols, shift, c, ldc, sums, maxes); });
}

/// The fused online-softmax step over the keys [j0, j0 + nj) of a packed K (`k`: Kᵀ [depth, keys] packed,
/// depth ≤ kKC, j0 a multiple of kNR) for `rows` queries q (row-major, ldq apart; already scaled): s (rows
/// lds apart) receives the block's exponentials and m, l, alpha are updated as online_softmax_step does;
/// returns whether any alpha differs from 1. The shift of a row is its running max m — or, in a block
/// that opens every row's softmax (m −inf on all rows: a query block's first), the max of the row's
/// scores in the block's first panel, which the plain tiles compute first. A row whose shift is finite
/// and whose block max is within kStaleMaxSlack of it keeps exp(score − shift): alpha 1 and l + their
/// sum (opening: m = the shift, l = their sum, alpha 0, as the plain step from m = −inf); any other row
/// gets its scores again and online_softmax_step. `lanes`: 32·rows floats of scratch. Each row's bits
/// depend on its own query, the keys and whether the block opens, not on the other rows' values.
template <class Max, class Sum, class Alpha>
bool fused_online_softmax_step(const float* q, Index ldq, Index rows, const PackedB<float>& k, Index depth, Index j0,
                               Index nj, float* s, Index lds, Max&& m, Sum&& l, Alpha&& alpha, float* lanes) {
  using B = GemmBlocking<float>;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float* const sums = lanes;
  float* const maxes = lanes + 16 * rows;
  std::fill_n(sums, 16 * rows, 0.0f);
  std::fill_n(maxes, 16 * rows, kNegInf);
  const Index full = rows / B::kMR, rest = rows - full * B::kMR;
  const bool opening = (m.array() == kNegInf).all();
  const float* shift = m.data();
  Index p = j0 / B::kNR;
  if (opening) {  // the first panel's scores, their row maxes in alpha as the shift, then their exponentials
    const Index cols = std::min<Index>(B::kNR, nj);
    const std::pair<__mmask16, __mmask16> mask = lane_masks(cols);
    const __m512 hidden = _mm512_set1_ps(kNegInf);
    packed_gemm_range<float>(q, ldq, rows, k, 0, depth, j0, cols, nullptr, false, s, lds);
    for (Index r = 0; r < rows; ++r) {
      float* row = s + r * lds;
      const __m512 x0 = _mm512_mask_loadu_ps(hidden, mask.first, row),
                   x1 = _mm512_mask_loadu_ps(hidden, mask.second, row + 16);
      alpha[r] = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
      exp_into_lanes<false>(x0, x1, alpha[r], row, mask.first, mask.second, sums + 16 * r, maxes + 16 * r);
    }
    shift = alpha.data();
    ++p;
  }
  for (; p * B::kNR < j0 + nj; ++p) {
    const float* panel = k.panel(0, p);
    const Index j = p * B::kNR - j0, cols = std::min<Index>(B::kNR, nj - j);
    for (Index t = 0; t < full; ++t) {
      const Index r = t * B::kMR;
      score_exp_tile<B::kMR>(depth, q + r * ldq, ldq, panel, cols, shift + r, s + r * lds + j, lds, sums + 16 * r,
                             maxes + 16 * r);
    }
    if (rest > 0) {
      const Index r = full * B::kMR;
      score_exp_tile_rows(rest, depth, q + r * ldq, ldq, panel, cols, shift + r, s + r * lds + j, lds, sums + 16 * r,
                          maxes + 16 * r);
    }
  }
  bool rescale = false;
  for (Index r = 0; r < rows; ++r) {
    const float block_max = _mm512_reduce_max_ps(_mm512_loadu_ps(maxes + 16 * r)), base = shift[r];
    if (std::isfinite(base) && block_max <= base + kStaleMaxSlack) {  // false for a NaN
      const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(sums + 16 * r));
      if (opening) {
        m[r] = base;
        l[r] = sum;
        alpha[r] = 0.0f;
        rescale = true;
      } else {
        l[r] += sum;  // online_softmax_step's fma(alpha = 1, l, sum)
        alpha[r] = 1.0f;
      }
    } else {
      packed_gemm_range<float>(q + r * ldq, ldq, 1, k, 0, depth, j0, nj, nullptr, false, s + r * lds, lds);
      Eigen::Map<RowMatrix<float>> row(s + r * lds, 1, nj);
      rescale = online_softmax_step(row, m.segment(r, 1), l.segment(r, 1), alpha.segment(r, 1)) || rescale;
    }
  }
  return rescale;
}
#endif

}  // namespace cpu
}  // namespace c2f
