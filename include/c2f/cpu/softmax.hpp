// c2f — softmax over one row of scores in which -inf marks a masked key.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace c2f {
namespace cpu {

/// What Eigen's vectorised exp returns for −inf. Eigen 3.4 clamps the argument of its packet exp, so
/// exp(−inf) is ~3e-39 (float, SSE) or ~6e-309 (double) instead of 0; with AVX it may be 0.
template <class Scalar>
Scalar vectorized_exp_floor() {
  static const Scalar floor = [] {
    Eigen::Array<Scalar, 16, 1> a = Eigen::Array<Scalar, 16, 1>::Constant(-std::numeric_limits<Scalar>::infinity());
    const Eigen::Array<Scalar, 16, 1> e = a.exp();
    return e.maxCoeff();
  }();
  return floor;
}

/// row ← exp(row − shift), with masked (−inf) entries exactly 0 and the whole row vectorised:
/// max(exp(x) − floor, 0) where floor = vectorized_exp_floor() (Eigen 3.4's select() is not
/// vectorised, and a scalar expf per score costs a fifth of a whole attention forward). Subtracting
/// the floor moves only values below ~1e-38 (float) / ~1e-307 (double); NaN stays NaN.
template <class Row, class Scalar>
void exp_shifted(Row&& row, Scalar shift) {
  const Scalar floor = vectorized_exp_floor<Scalar>();
  // max(·, 0) that keeps NaN (Eigen 3.4 exposes NaN-propagating max only as this functor). The 0 also
  // catches scalar tail elements, whose std::exp(−inf) is an exact 0 and would go to −floor.
  using NanMax = Eigen::internal::scalar_max_op<Scalar, Scalar, Eigen::PropagateNaN>;
  using Plain = typename std::decay_t<Row>::PlainObject;
  row.array() = ((row.array() - shift).exp() - floor).binaryExpr(Plain::Zero(row.rows(), row.cols()).array(), NanMax());
}

/// The softmax's exp micro-kernel: builds with AVX-512 compute exp_shifted_sum on float rows with
/// exp_avx512, builds with AVX2 + FMA with exp_avx2; the others, and double everywhere, with Eigen's
/// packet exp — the tested twin of both (tests/test_kernels.cpp, ExpSimd). C2F_EXP_SIMD is the lanes of
/// the build's kernel (16, 8, or 0 for none).
#if defined(C2F_NO_MICROKERNELS)
#define C2F_EXP_SIMD 0
#elif defined(EIGEN_VECTORIZE_AVX512)
#define C2F_EXP_SIMD 16
#elif defined(EIGEN_VECTORIZE_AVX2) && defined(EIGEN_VECTORIZE_FMA)
#define C2F_EXP_SIMD 8
#else
#define C2F_EXP_SIMD 0
#endif
constexpr int kExpSimdLanes = C2F_EXP_SIMD;

/// Both kernels compute exp(x) = 2^t with t = x·log2 e rounded once, as m = floor(t) and f = t − m
/// ∈ [0, 1) (exact where |t| ≥ 1), 2^f by a degree-6 polynomial fitted for relative error on [0, 1)
/// (Horner, ~1 ulp) and 2^m applied exactly; they differ in how they apply it. Rounding t moves 2^t by up
/// to |x|·2^−24 relative, as much as the rounding of the subtraction x = score − shift that made x: the
/// relative error is within 2^−22 + |x|·2^−23, and 2 ulp where |x| ≤ 1 (ExpSimd). Against the kernels
/// before them (Cephes' exp(r) of degree 7 after ln 2 in two parts, ~1 ulp everywhere) they cut the
/// online softmax step by a third (the A/B: "A cheaper exp in the online softmax" in
/// git show 9944106:docs/benchmarks.md).

/// 2^f for f ∈ [0, 1), the kernels' polynomial (1 at f = 0 exactly); `Scale` multiplies every
/// coefficient (AVX2 computes 2·2^f: the same bits times 2).
#define C2F_EXP2_POLY(fmadd, set1, f, Scale)                                                                 \
  fmadd(fmadd(fmadd(fmadd(fmadd(fmadd(set1(Scale * 2.161292068e-04f), f, set1(Scale * 1.246784464e-03f)), f, \
                                set1(Scale * 9.675451554e-03f)),                                             \
                          f, set1(Scale * 5.548528209e-02f)),                                                \
                    f, set1(Scale * 2.402293086e-01f)),                                                      \
              f, set1(Scale * 6.931470633e-01f)),                                                            \
        f, set1(Scale * 1.0f))

#if C2F_EXP_SIMD == 16

/// exp of 16 floats: f by vreduceps (t − floor(t) in one instruction) and 2^floor(t) by vscalefps
/// (which floors t itself), which also gives 0 below the smallest subnormal and inf above FLT_MAX. ±inf
/// need no clamp: vreduceps gives 0 for them, so −inf (a masked score) → 1·2^−inf = exactly 0 and +inf →
/// inf; NaN stays NaN (ExpSimd). 10 instructions.
inline __m512 exp_avx512(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(C2F_EXP2_POLY(_mm512_fmadd_ps, _mm512_set1_ps, f, 1.0f), t);
}

/// The vector operations of exp_shifted_sum_rows_simd on AVX-512: 16 floats, tails by a lane mask.
struct ExpVec {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr Index kLanes = 16;
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V exp(V x) { return exp_avx512(x); }
  /// The lanes below n (0 < n < kLanes).
  static Mask tail(Index n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static V load(Mask k, const float* p) { return _mm512_maskz_loadu_ps(k, p); }
  static void store(Mask k, float* p, V v) { _mm512_mask_storeu_ps(p, k, v); }
  /// v on the lanes of k, 0 elsewhere.
  static V keep(Mask k, V v) { return _mm512_maskz_mov_ps(k, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};

/// Rows that online_softmax_step passes through the exp kernel together.
constexpr int kExpRows = 4;

#elif C2F_EXP_SIMD == 8

/// exp of 8 floats. AVX2 has no vscalefps: 2^(m−1) is built in the exponent field (normal for
/// m ∈ [−125, 128]) and the polynomial is computed doubled (the same bits as doubling it: the
/// coefficients are the same times 2), so 2·2^f·2^(m−1) is exp(x), and inf for t ≥ 128 by itself. Where
/// the result is normal its bits are exp_avx512's, but for t ∈ (−1, 0), where f = t + 1 is rounded:
/// vreduceps may round it the other way (1 ulp of f). Below t = −125 (x ≈ −86.64: a weight under
/// 2.4e-38 of the row's largest) the result is exactly 0, −inf (a masked score) included; NaN stays NaN.
/// 15 instructions.
inline __m256 exp_avx2(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  t = _mm256_min_ps(_mm256_set1_ps(128.0f), t);   // m ≤ 128; vminps returns its second operand when one is NaN
  t = _mm256_max_ps(_mm256_set1_ps(-126.0f), t);  // m ≥ −126
  const __m256 m = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, m);
  const __m256 y = C2F_EXP2_POLY(_mm256_fmadd_ps, _mm256_set1_ps, f, 2.0f);
  // 2^(m−1): the biased exponent m − 1 + 127 in bits 23…30; m = −126 gives the field 0, the float 0.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(m), _mm256_set1_epi32(126)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

/// The vector operations of exp_shifted_sum_rows_simd on AVX2: 8 floats, tails by a lane mask of all
/// bits set (vmaskmovps).
struct ExpVec {
  using V = __m256;
  using Mask = __m256i;
  static constexpr Index kLanes = 8;
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V exp(V x) { return exp_avx2(x); }
  /// The lanes below n (0 < n < kLanes): all bits set.
  static Mask tail(Index n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load(Mask k, const float* p) { return _mm256_maskload_ps(p, k); }
  static void store(Mask k, float* p, V v) { _mm256_maskstore_ps(p, k, v); }
  /// v on the lanes of k, 0 elsewhere.
  static V keep(Mask k, V v) { return _mm256_and_ps(v, _mm256_castsi256_ps(k)); }
  static float sum(V v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
};

/// Rows that online_softmax_step passes through the exp kernel together (16 vector registers).
constexpr int kExpRows = 2;

#endif
#undef C2F_EXP2_POLY

#if C2F_EXP_SIMD
/// Where exp_shifted_sum_rows_simd puts the exponentials: back into the rows (p + r·ld).
struct ExpInPlace {
  float* p;
  Index ld;
  void operator()(int r, Index j, ExpVec::V e) const { ExpVec::store(p + r * ld + j, e); }
  void operator()(int r, Index j, ExpVec::V e, ExpVec::Mask k) const { ExpVec::store(k, p + r * ld + j, e); }
};

/// For the R rows p + r·ld (r < R): e = exp(p[r·ld + j] − shift[r]) for j < n, handed to `sink` a vector
/// at a time (sink(r, j, e) for whole vectors, sink(r, j, e, tail mask) for the last one; ExpInPlace
/// stores them back), and sum[r] ← their sum (one accumulator per row, lanes added at the end), on the
/// build's ExpVec. Each row gets the same operations in the same order as alone (R = 1); the R rows'
/// independent chains overlap the exp's latency.
template <int R, class Sink>
inline void exp_shifted_sum_rows_simd(const float* p, Index ld, Index n, const float* shift, float* sum,
                                      const Sink& sink) {
  using V = ExpVec::V;
  V s[R], acc[R];
  for (int r = 0; r < R; ++r) {
    s[r] = ExpVec::set1(shift[r]);
    acc[r] = ExpVec::zero();
  }
  Index j = 0;
  for (; j + ExpVec::kLanes <= n; j += ExpVec::kLanes) {
    for (int r = 0; r < R; ++r) {
      const V e = ExpVec::exp(ExpVec::sub(ExpVec::load(p + r * ld + j), s[r]));
      sink(r, j, e);
      acc[r] = ExpVec::add(acc[r], e);
    }
  }
  if (j < n) {
    const ExpVec::Mask k = ExpVec::tail(n - j);
    for (int r = 0; r < R; ++r) {
      const V e = ExpVec::exp(ExpVec::sub(ExpVec::load(k, p + r * ld + j), s[r]));
      sink(r, j, e, k);
      acc[r] = ExpVec::add(acc[r], ExpVec::keep(k, e));
    }
  }
  for (int r = 0; r < R; ++r) sum[r] = ExpVec::sum(acc[r]);
}
/// exp_shifted_sum_rows_simd with the exponentials stored back into the rows.
template <int R>
inline void exp_shifted_sum_rows_simd(float* p, Index ld, Index n, const float* shift, float* sum) {
  exp_shifted_sum_rows_simd<R>(p, ld, n, shift, sum, ExpInPlace{p, ld});
}

/// p[j] ← exp(p[j] − shift) for j < n; returns their sum (one accumulator, lanes added at the end).
inline float exp_shifted_sum_simd(float* p, Index n, float shift) {
  float sum = 0.0f;
  exp_shifted_sum_rows_simd<1>(p, 0, n, &shift, &sum);
  return sum;
}
#endif

/// For the R rows p + r·ld: mx[r] ← the largest of p[r·ld + j], j < n (−inf when n = 0), on the build's
/// packets: one chain per row, its lanes reduced, then the elements past the last whole packet. Each row
/// gets the same operations in the same order as alone (R = 1). A NaN may or may not reach the max; the
/// row's exponentials are NaN either way.
template <int R, class Scalar>
void row_max_rows(const Scalar* p, Index ld, Index n, Scalar* mx) {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  constexpr Index kLanes = Eigen::internal::packet_traits<Scalar>::size;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  Packet acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Eigen::internal::pset1<Packet>(kNegInf);
  Index j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int r = 0; r < R; ++r) acc[r] = Eigen::internal::pmax(acc[r], Eigen::internal::ploadu<Packet>(p + r * ld + j));
  }
  for (int r = 0; r < R; ++r) {
    mx[r] = Eigen::internal::predux_max(acc[r]);
    for (Index t = j; t < n; ++t) mx[r] = std::max(mx[r], p[r * ld + t]);
  }
}

/// The largest coefficient of `row` (a row or column vector): rows of contiguous memory by row_max_rows
/// (the kernel online_softmax_step runs on several rows at once), the rest by Eigen's maxCoeff.
template <class Row>
typename Row::Scalar row_max(const Row& row) {
  using Scalar = typename Row::Scalar;
  if constexpr ((Eigen::internal::traits<Row>::Flags & Eigen::DirectAccessBit) != 0 &&
                Eigen::internal::packet_traits<Scalar>::Vectorizable) {
    if (row.innerStride() == 1 && (row.rows() == 1 || row.cols() == 1)) {
      Scalar mx;
      row_max_rows<1>(row.data(), 0, row.size(), &mx);
      return mx;
    }
  }
  return row.maxCoeff();
}

/// exp_shifted(row, shift), returning the sum of the row afterwards. Float rows of contiguous memory
/// take the build's exp micro-kernel (kExpSimdLanes > 0); the rest exp_shifted then Eigen's sum.
template <class Row, class Scalar>
Scalar exp_shifted_sum(Row&& row, Scalar shift) {
#if C2F_EXP_SIMD
  using R = std::decay_t<Row>;
  if constexpr (std::is_same<Scalar, float>::value &&
                (Eigen::internal::traits<R>::Flags & Eigen::DirectAccessBit) != 0) {
    if (row.innerStride() == 1 && (row.rows() == 1 || row.cols() == 1))
      return exp_shifted_sum_simd(row.data(), row.size(), shift);
  }
#endif
  exp_shifted(row, shift);
  return row.sum();
}

namespace impl {
/// Row r's shift for an online-softmax step whose block max is `block_max`: updates its running max
/// m[r] and sets alpha[r], the factor earlier accumulations are scaled by (`rescale` ← true when it is
/// not 1).
template <class Scalar, class Max, class Alpha>
Scalar softmax_shift(Index r, Scalar block_max, Max& m, Alpha& alpha, bool& rescale) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  const Scalar m_new = std::max(m[r], block_max);
  // All keys so far hidden: shift by 0, not by -inf (which would give exp(-inf + inf) = NaN).
  const Scalar shift = m_new == kNegInf ? Scalar(0) : m_new;
  // A max that did not move (most blocks after the first few) needs no exp: exp(0) is 1 exactly
  // (+inf − +inf is NaN, not 0, and keeps its exp).
  const Scalar moved = m[r] - shift;
  alpha[r] = moved == Scalar(0) ? Scalar(1) : std::exp(moved);
  rescale = rescale || alpha[r] != Scalar(1);
  m[r] = m_new;
  return shift;
}
#if C2F_EXP_SIMD
/// The online-softmax step on the float rows p + r·ld, r < rows, R rows at a time through the exp kernel:
/// each group's exponentials go to sink_of(first row of the group) (exp_shifted_sum_rows_simd's sink).
/// Returns the rows done (a multiple of R); the caller does the rest.
template <int R, class Max, class Sum, class Alpha, class SinkOf>
Index online_softmax_rows(const float* p, Index ld, Index rows, Index cols, Max&& m, Sum&& l, Alpha&& alpha,
                          bool& rescale, const SinkOf& sink_of) {
  Index r = 0;
  for (; r + R <= rows; r += R) {
    float block_max[R], shift[R], sum[R];
    row_max_rows<R>(p + r * ld, ld, cols, block_max);
    for (int i = 0; i < R; ++i) shift[i] = softmax_shift(r + i, block_max[i], m, alpha, rescale);
    exp_shifted_sum_rows_simd<R>(p + r * ld, ld, cols, shift, sum, sink_of(r));
    for (int i = 0; i < R; ++i) l[r + i] = std::fma(alpha[r + i], l[r + i], sum[i]);
  }
  return r;
}
#endif
}  // namespace impl

/// One online-softmax step over a block of scores s [rows, cols] (−inf = masked): updates each row's
/// running max m and sum l, turns s into exp(s − the new max) and sets alpha to the factor earlier
/// accumulations of the row must be scaled by. Returns whether any alpha differs from 1. Each row gets
/// the same bits whatever rows share the block and whatever the compiler contracts: l ← fma(alpha, l,
/// the block's sum) is one rounding on every build (a·b + c may or may not become an FMA).
template <class Scores, class Max, class Sum, class Alpha>
bool online_softmax_step(Scores& s, Max&& m, Sum&& l, Alpha&& alpha) {
  using S = std::decay_t<Scores>;
  using Scalar = typename S::Scalar;
  bool rescale = false;
  Index r = 0;
#if C2F_EXP_SIMD
  // Float blocks of contiguous rows: kExpRows rows at a time through the exp kernel, whose independent
  // chains hide its latency (the A/B: "The online softmax four rows at a
  // time" in git show 9944106:docs/benchmarks.md).
  constexpr bool kRowsInPlace = std::is_same<Scalar, float>::value &&
                                (Eigen::internal::traits<S>::Flags & Eigen::DirectAccessBit) != 0 &&
                                (Eigen::internal::traits<S>::Flags & Eigen::RowMajorBit) != 0;
  if constexpr (kRowsInPlace) {
    if (s.innerStride() == 1) {
      r = impl::online_softmax_rows<kExpRows>(s.data(), s.outerStride(), s.rows(), s.cols(), m, l, alpha, rescale,
                                              [&](Index r0) {
                                                return ExpInPlace{s.data() + r0 * s.outerStride(), s.outerStride()};
                                              });
    }
  }
#endif
  for (; r < s.rows(); ++r) {
    const Scalar shift = impl::softmax_shift(r, row_max(s.row(r)), m, alpha, rescale);
    l[r] = std::fma(alpha[r], l[r], exp_shifted_sum(s.row(r), shift));
  }
  return rescale;
}

/// Normalised softmax of `row` in place. A row whose every entry is −inf (no visible key) becomes all
/// zeros and the function returns false; NaN counts as visible, so it propagates instead of vanishing.
/// `max_out` and `sum_out`, when given, receive the shift (the row's max) and the sum of the shifted
/// exponentials — what a later merge with another part of the same softmax needs (−inf and 0 when
/// nothing is visible).
template <class Row>
bool softmax_row(Row&& row, typename std::decay_t<Row>::Scalar* max_out = nullptr,
                 typename std::decay_t<Row>::Scalar* sum_out = nullptr) {
  using Scalar = typename std::decay_t<Row>::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  bool any_visible = false;
  for (Index j = 0; j < row.size(); ++j) any_visible = any_visible || !(row(j) == kNegInf);
  if (!any_visible) {
    row.setZero();
    if (max_out != nullptr) *max_out = kNegInf;
    if (sum_out != nullptr) *sum_out = Scalar(0);
    return false;
  }
  const Scalar max = row.maxCoeff();
  const Scalar sum = exp_shifted_sum(row, max);
  row /= sum;
  if (max_out != nullptr) *max_out = max;
  if (sum_out != nullptr) *sum_out = sum;
  return true;
}

/// dst.row(r) = acc.row(r) / sum[r], the end of an online softmax; 0 where sum[r] is 0, which happens
/// only when every key was masked (a visible key contributes exp(0) = 1 at the max).
template <class Acc, class Sum, class Dst>
void divide_by_sums(const Acc& acc, const Sum& sum, Dst&& dst) {
  for (Index r = 0; r < acc.rows(); ++r) {
    if (sum[r] == 0) {
      dst.row(r).setZero();
    } else {
      dst.row(r) = acc.row(r) / sum[r];
    }
  }
}

/// The row stride of a block of scores for blocks of bk keys (sdpa_streaming's, chunk_sparse_attention's):
/// bk rounded up to whole aligned packets, so that every row of scores starts on the same alignment and
/// Eigen's vectorised exp and sum split each row the same way, whatever its place in the query block
/// (each row's bits do not depend on which rows share its block: KernelOptions::rows_independent).
template <class Scalar>
Index score_stride(Index bk) {
  constexpr Index kAlign = std::max<Index>(1, EIGEN_MAX_ALIGN_BYTES / static_cast<Index>(sizeof(Scalar)));
  return (bk + kAlign - 1) / kAlign * kAlign;
}

}  // namespace cpu
}  // namespace c2f
