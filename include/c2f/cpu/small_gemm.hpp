// c2f — small products read in place without packing: the two of the folded fine attention, and the
// row-streaming products of the split-key (decode) kernel.
//
// For one run of n tokens x [n, d] (rows `ldx` apart) and `heads` query rows q [heads, d]:
//   scores   s [heads, n] = q xᵀ
//   pooled   o [heads, d] = p x      (p [heads, n], the softmax weights)
// Each x element takes part in only `heads` multiply-adds per product, so a general GEMM spends about
// as long packing x as multiplying (measured: Eigen's packing was 43 % of the GEMM time at 8 heads and
// d = 512). These kernels read x where it lies: register tiles of 8 (AVX-512) or 4 query rows × 2 tokens
// (scores, vectorised along d) and of 8 or 4 query rows × 2 packets of columns (pooled), on Eigen's packet primitives,
// so the same code is SSE, AVX, AVX-512 or NEON as the build selects. The summation order differs from
// Eigen's GEMM; kernels::fine_attention_folded's tests compare with a naive twin. The tile loops are
// unrolled (#pragma GCC unroll) so that the accumulator arrays live in registers: without it GCC kept
// them on the stack on AVX-512 (the A/B: "C2F's folded pass with its accumulators in
// registers" in git show 9944106:docs/benchmarks.md).
// dot_tile's set-up and final sums are unrolled only for two or more key rows: decoding's one-row tiles
// were 6-10 % slower with them unrolled.
//
// For a decode step (few queries over a long cache of keys [keys, heads·d], every head's d values side by
// side in a row), head_scores_by_row and head_values_by_row walk the rows of the cache once, front to
// back, and do every head's work on a row while it is in cache: the read is sequential, as a copy's is,
// instead of one strided pass per head. kernels::sdpa_split_keys's tests compare with sdpa_naive.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/packed_gemm.hpp"

#include <algorithm>
#include <type_traits>

namespace c2f {
namespace cpu {

/// Asks the cache for the 64-byte lines of p[0, count): rows the caller reads next that the hardware
/// prefetcher cannot guess (not in order).
template <class X>
inline void prefetch_values(const X* p, Index count) {
  constexpr Index kLine = 64 / static_cast<Index>(sizeof(X));
  for (Index k = 0; k < count; k += kLine) Eigen::internal::prefetch(p + k);
}

/// A packet of Scalar from kP values of X at p: Scalar itself, or (Scalar float) bfloat16 widened — exact,
/// the 16 bits are the float's top half — so a bfloat16 cache is read in place, at half the bytes.
template <class Packet, class Scalar, class X>
inline Packet load_widened(const X* p) {
  if constexpr (std::is_same<X, Scalar>::value) {
    return Eigen::internal::ploadu<Packet>(p);
  } else {
    static_assert(std::is_same<Scalar, float>::value && std::is_same<X, Eigen::bfloat16>::value,
                  "load_widened: float from float or bfloat16");
    constexpr int kP = Eigen::internal::unpacket_traits<Packet>::size;
#if defined(EIGEN_VECTORIZE_AVX512)
    if constexpr (kP == 16) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
#endif
#if defined(EIGEN_VECTORIZE_AVX2)
    if constexpr (kP == 8) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
#endif
    alignas(64) float wide[kP];
    for (int i = 0; i < kP; ++i) wide[i] = static_cast<float>(p[i]);
    return Eigen::internal::pload<Packet>(wide);
  }
}

#if defined(EIGEN_VECTORIZE_AVX512DQ)
/// sums[i] = predux(v[i]) for the `count` ≤ 16 packets v: every sum with predux<Packet16f>'s additions in
/// its order (halves, then quarters, then pairs: the same bits), the 16 reductions interleaved in one tree
/// of 45 instructions instead of about 130 for one at a time.
inline void predux_many(const __m512* v, int count, float* sums) {
  __m512 w[8], u[4];
  const auto at = [&](int i) { return i < count ? v[i] : _mm512_setzero_ps(); };
  for (int m = 0; m < 8; ++m) {  // 128-bit lanes 0, 1: v[2m]'s L0 + L2, L1 + L3; lanes 2, 3: v[2m + 1]'s
    const __m512 a = at(2 * m), b = at(2 * m + 1);
    w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int n = 0; n < 4; ++n) {  // 128-bit lane t: v[4n + t]'s (L0 + L2) + (L1 + L3)
    u[n] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * n], w[2 * n + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * n], w[2 * n + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // y = a 128-bit lane of u: (y0 + y2, y1 + y3) of u[0] and u[1] interleaved, then of u[2] and u[3] …
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  // … and their sums: element e of 128-bit lane t is predux(v[4e + t]).
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, r);
  for (int i = 0; i < count; ++i) sums[i] = lanes[4 * (i % 4) + i / 4];
}
#endif

template <class Scalar>
struct SmallGemm {
  using Packet = typename GemmBlocking<Scalar>::Packet;
  static constexpr Index kP = GemmBlocking<Scalar>::kP;

  /// s[i·lds + j] = Σ_k q[(h0+i)·d + k] · x[(j0+j)·ldx + k] for i < MR, j < NR; x of Scalar or (float)
  /// bfloat16 values (load_widened).
  template <int MR, int NR, class X = Scalar>
  static void dot_tile(const Scalar* q, Index d, const X* x, Index ldx, Scalar* s, Index lds) {
    Packet acc[MR][NR];
    if constexpr (NR > 1) {
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) acc[i][j] = Eigen::internal::pset1<Packet>(Scalar(0));
      }
    } else {  // one key row (a decode step's): plain loops, see the file comment
      for (int i = 0; i < MR; ++i) acc[i][0] = Eigen::internal::pset1<Packet>(Scalar(0));
    }
    Index k = 0;
    for (; k + kP <= d; k += kP) {
      Packet xv[NR];
#pragma GCC unroll 8
      for (int j = 0; j < NR; ++j) {
        xv[j] = load_widened<Packet, Scalar>(x + j * ldx + k);
        keep_in_register(xv[j]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        Packet qv = Eigen::internal::ploadu<Packet>(q + i * d + k);
        keep_in_register(qv);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) acc[i][j] = Eigen::internal::pmadd(qv, xv[j], acc[i][j]);
      }
    }
    if constexpr (NR > 1) {
#if defined(EIGEN_VECTORIZE_AVX512DQ)
      if constexpr (std::is_same<Scalar, float>::value && kP == 16 && MR * NR <= 16) {
        float sums[MR * NR];
        predux_many(&acc[0][0], MR * NR, sums);
        for (int i = 0; i < MR; ++i) {
          for (int j = 0; j < NR; ++j) s[i * lds + j] = add_rest(sums[i * NR + j], q + i * d, x + j * ldx, k, d);
        }
        return;
      }
#endif
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) s[i * lds + j] = reduce(acc[i][j], q + i * d, x + j * ldx, k, d);
      }
    } else {
      for (int i = 0; i < MR; ++i) s[i * lds] = reduce(acc[i][0], q + i * d, x, k, d);
    }
  }

  /// The sum of acc's lanes plus the products q[kk]·x[kk] of the columns kk in [k, d) left over.
  template <class X>
  static Scalar reduce(const Packet& acc, const Scalar* q, const X* x, Index k, Index d) {
    return add_rest(Eigen::internal::predux(acc), q, x, k, d);
  }
  /// v plus the products q[kk]·x[kk] of the columns kk in [k, d), in order.
  template <class X>
  static Scalar add_rest(Scalar v, const Scalar* q, const X* x, Index k, Index d) {
    for (Index kk = k; kk < d; ++kk) v += q[kk] * static_cast<Scalar>(x[kk]);
    return v;
  }

  /// o[i·ldo + c] = Σ_j p[i·ldp + j] · x[j·ldx + c] for i < MR and the NC·kP columns c from col0.
  template <int MR, int NC>
  static void axpy_tile(const Scalar* p, Index ldp, Index n, const Scalar* x, Index ldx, Scalar* o, Index ldo) {
    Packet acc[MR][NC];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[i][c] = Eigen::internal::pset1<Packet>(Scalar(0));
    }
    for (Index j = 0; j < n; ++j) {
      Packet xv[NC];
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        xv[c] = Eigen::internal::ploadu<Packet>(x + j * ldx + c * kP);
        keep_in_register(xv[c]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const Packet pv = Eigen::internal::pset1<Packet>(p[i * ldp + j]);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) acc[i][c] = Eigen::internal::pmadd(pv, xv[c], acc[i][c]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) Eigen::internal::pstoreu(o + i * ldo + c * kP, acc[i][c]);
    }
  }

  /// y[k] += w · x[k] for k < d; x of Scalar or (float) bfloat16 values (load_widened).
  template <class X = Scalar>
  static void axpy(Scalar w, const X* x, Scalar* y, Index d) {
    const Packet wv = Eigen::internal::pset1<Packet>(w);
    Index k = 0;
    for (; k + kP <= d; k += kP) {
      Eigen::internal::pstoreu(y + k, Eigen::internal::pmadd(wv, load_widened<Packet, Scalar>(x + k),
                                                             Eigen::internal::ploadu<Packet>(y + k)));
    }
    for (; k < d; ++k) y[k] += w * static_cast<Scalar>(x[k]);
  }

  /// Also asks the cache for rows [pf_begin, pf_end) of `next` (rows ldx apart), spread over the tiles:
  /// the caller's next run, which the hardware prefetcher cannot guess when it is not contiguous.
  template <int MR>
  static void dot_rows_mr(const Scalar* q, Index d, const Scalar* x, Index ldx, Index n, Scalar* s, Index lds,
                          const Scalar* next, Index pf_begin, Index pf_end) {
    const Index tiles = (n + 1) / 2;
    for (Index t = 0, j = 0; j < n; ++t, j += 2) {
      const Index r0 = pf_begin + (pf_end - pf_begin) * t / tiles,
                  r1 = pf_begin + (pf_end - pf_begin) * (t + 1) / tiles;
      for (Index r = r0; r < r1; ++r) {
        prefetch_values(next + r * ldx, d);
      }
      if (j + 2 <= n) {
        dot_tile<MR, 2>(q, d, x + j * ldx, ldx, s + j, lds);
      } else {
        dot_tile<MR, 1>(q, d, x + j * ldx, ldx, s + j, lds);
      }
    }
  }

  template <int MR>
  static void axpy_rows_mr(const Scalar* p, Index ldp, Index n, const Scalar* x, Index ldx, Index d, Scalar* o,
                           Index ldo) {
    Index c = 0;
    for (; c + 2 * kP <= d; c += 2 * kP) axpy_tile<MR, 2>(p, ldp, n, x + c, ldx, o + c, ldo);
    for (; c + kP <= d; c += kP) axpy_tile<MR, 1>(p, ldp, n, x + c, ldx, o + c, ldo);
    for (; c < d; ++c) {  // columns left over from whole packets
      for (int i = 0; i < MR; ++i) {
        Scalar v = 0;
        for (Index j = 0; j < n; ++j) v += p[i * ldp + j] * x[j * ldx + c];
        o[i * ldo + c] = v;
      }
    }
  }
};

/// fn(std::integral_constant<int, R>{}) with R = min(4, rows), rows ≥ 1: the register tile of 4 query
/// rows, or the kernel of exactly the rows left at the end.
template <class Fn>
void with_rows_upto_4(Index rows, Fn&& fn) {
  switch (std::min<Index>(4, rows)) {
    case 4:
      fn(std::integral_constant<int, 4>{});
      break;
    case 3:
      fn(std::integral_constant<int, 3>{});
      break;
    case 2:
      fn(std::integral_constant<int, 2>{});
      break;
    default:
      fn(std::integral_constant<int, 1>{});
      break;
  }
}

/// Query rows per register tile of dot_rows and weighted_rows: 8 where the build has 32 vector registers
/// (AVX-512: 8 × 2 accumulators and three operands), else 4 (AVX2's 16 registers hold 4 × 2 and three).
/// With 8 heads, the 8-row tile reads a run of tokens once per product instead of twice.
#if defined(EIGEN_VECTORIZE_AVX512)
constexpr Index kFoldRows = 8;
#else
constexpr Index kFoldRows = 4;
#endif

/// fn(std::integral_constant<int, R>{}) for the tile of the rows left (rows ≥ 1): 8 while 8 are left
/// (kFoldRows = 8), else with_rows_upto_4's. Returns R.
template <class Fn>
Index with_fold_rows(Index rows, Fn&& fn) {
  if constexpr (kFoldRows == 8) {
    if (rows >= 8) {
      fn(std::integral_constant<int, 8>{});
      return 8;
    }
  }
  with_rows_upto_4(rows, fn);
  return std::min<Index>(4, rows);
}

/// The number of tiles with_fold_rows walks over `rows` rows.
inline Index fold_tiles(Index rows) {
  const Index eights = kFoldRows == 8 ? rows / 8 : 0;
  return eights + detail::ceil_div(rows - 8 * eights, 4);
}

/// s [rows, n] (row stride lds) = q [rows, d] (contiguous rows) · xᵀ, x [n, d] with row stride ldx.
/// `next` (next_n rows, stride ldx; may be null) is prefetched along the way: the run to come.
/// The bits do not depend on the tile: every score sums over d in the same order.
template <class Scalar>
void dot_rows(const Scalar* q, Index rows, Index d, const Scalar* x, Index ldx, Index n, Scalar* s, Index lds,
              const Scalar* next = nullptr, Index next_n = 0) {
  using G = SmallGemm<Scalar>;
  if (next == nullptr) next_n = 0;
  const Index groups = fold_tiles(rows);
  for (Index g = 0, h = 0; h < rows; ++g) {  // tile g prefetches its share of the next run
    const Index b = next_n * g / groups, e = next_n * (g + 1) / groups;
    h += with_fold_rows(rows - h, [&](auto r) {
      G::template dot_rows_mr<decltype(r)::value>(q + h * d, d, x, ldx, n, s + h * lds, lds, next, b, e);
    });
  }
}

/// o [rows, d] (row stride ldo) = p [rows, n] (row stride ldp) · x, x [n, d] with row stride ldx.
template <class Scalar>
void weighted_rows(const Scalar* p, Index ldp, Index rows, Index n, const Scalar* x, Index ldx, Index d, Scalar* o,
                   Index ldo) {
  using G = SmallGemm<Scalar>;
  for (Index h = 0; h < rows;) {
    h += with_fold_rows(rows - h, [&](auto r) {
      G::template axpy_rows_mr<decltype(r)::value>(p + h * ldp, ldp, n, x, ldx, d, o + h * ldo, ldo);
    });
  }
}

/// Rows ahead of the one in use that the row-by-row kernels ask the cache for.
constexpr Index kRowsAhead = 8;
/// Asks the cache for the `width` values of row j + kRowsAhead of x (rows ldx apart), if it is one of the
/// `rows`: the hardware prefetcher alone left a bfloat16 cache's scan at 14.5 GB/s on 2 cores.
template <class X>
inline void prefetch_row_ahead(const X* x, Index ldx, Index width, Index j, Index rows) {
  if (j + kRowsAhead >= rows) return;
  prefetch_values(x + (j + kRowsAhead) * ldx, width);
}

/// Every head's scores against `keys` rows of x, x [keys, heads·d] with row stride ldx (head h's d values
/// at column h·d), one pass over x's rows in order:
///   s[(h·n + i)·lds + j] = Σ_k q[(h·n + i)·d + k] · x[j·ldx + h·d + k]
/// for h < heads, i < n, j < keys; q [heads·n, d] with contiguous rows. x holds Scalar or (Scalar float)
/// bfloat16 values, read in place (the same bits as on the values widened first).
template <class Scalar, class X = Scalar>
void head_scores_by_row(const Scalar* q, Index heads, Index n, Index d, const X* x, Index ldx, Index keys, Scalar* s,
                        Index lds) {
  using G = SmallGemm<Scalar>;
  for (Index j = 0; j < keys; ++j) {
    const X* row = x + j * ldx;
    prefetch_row_ahead(x, ldx, heads * d, j, keys);
    for (Index h = 0; h < heads; ++h) {  // a head's queries share each packet of its keys, 4 at a time
      for (Index i = 0; i < n; i += 4) {
        const Scalar* qi = q + (h * n + i) * d;
        Scalar* si = s + (h * n + i) * lds + j;
        with_rows_upto_4(
            n - i, [&](auto r) { G::template dot_tile<decltype(r)::value, 1, X>(qi, d, row + h * d, ldx, si, lds); });
      }
    }
  }
}

/// The weighted sum of `keys` value rows added to every head's accumulator, one pass over x's rows in
/// order, x [keys, heads·dv] with row stride ldx:
///   o[(h·n + i)·dv + c] += Σ_j p[(h·n + i)·ldp + j] · x[j·ldx + h·dv + c]   (j in order)
/// for the heads h with skip == nullptr or !skip[h], i < n, c < dv; o [heads·n, dv] with contiguous rows.
/// x holds Scalar or (Scalar float) bfloat16 values, read in place.
template <class Scalar, class X = Scalar>
void head_values_by_row(const Scalar* p, Index ldp, Index heads, Index n, const X* x, Index ldx, Index keys, Index dv,
                        Scalar* o, const unsigned char* skip = nullptr) {
  for (Index j = 0; j < keys; ++j) {
    const X* row = x + j * ldx;
    prefetch_row_ahead(x, ldx, heads * dv, j, keys);
    for (Index h = 0; h < heads; ++h) {
      if (skip != nullptr && skip[h]) continue;
      for (Index i = 0; i < n; ++i) {
        SmallGemm<Scalar>::template axpy<X>(p[(h * n + i) * ldp + j], row + h * dv, o + (h * n + i) * dv, dv);
      }
    }
  }
}

}  // namespace cpu
}  // namespace c2f
