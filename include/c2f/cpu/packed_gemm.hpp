// c2f — a register-blocked GEMM on packed panels (the BLIS / MLAS structure), on Eigen's packet
// primitives: C [m, n] = A [m, k] · B [k, n] (+ bias on every row), A row-major.
//
// B is packed once per call into panels of kNR columns (k-block by k-block, kKC deep); A is read in place
// (the last rows of a product by a kernel of that many rows); the micro-kernel keeps a kMR × kNR tile of C
// in registers (kMR · kNP packets) and per k step loads kNP packets of B and broadcasts kMR values of A:
// kMR · kNP multiply-adds per kNP + kMR loads. The blocking follows the build's vector registers: 16 (SSE,
// AVX2): 6 × 2 packets = 12 accumulators; 32 (AVX-512): 12 × 2 packets = 24. Every element of C is the
// same sum whatever tile, task or thread computes it: per k-block a multiply-add chain from 0 in k order,
// the blocks added to C (the first to the bias, or to nothing) in order — so the bits depend on the shape
// only.
//
// This is the fast path of kernels::matmul_rows (projections); Eigen's product stays the portable path
// and, with kernels::linear_naive, its tested twin (tests/test_kernels.cpp, GemmMicroKernel).
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/scratch.hpp"

#include <algorithm>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

namespace c2f {
namespace cpu {

/// The blocking of packed_gemm for Scalar on this build's SIMD.
template <class Scalar>
struct GemmBlocking {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  static constexpr int kP = Eigen::internal::unpacket_traits<Packet>::size;
  static constexpr int kMR = EIGEN_ARCH_DEFAULT_NUMBER_OF_REGISTERS >= 32 ? 12 : 6;
  static constexpr int kNP = 2;
  static constexpr int kNR = kNP * kP;
  /// Depth of a k-block: a B panel (kKC × kNR) stays in L1, a task's A block in L2.
  static constexpr Index kKC = 256;
};

/// Whether kernels::matmul_rows uses packed_gemm: builds with fused multiply-add vectors (AVX2+FMA,
/// AVX-512, NEON), unless C2F_NO_MICROKERNELS is defined (then Eigen's product everywhere).
#if !defined(C2F_NO_MICROKERNELS) && \
    (defined(EIGEN_VECTORIZE_FMA) || defined(EIGEN_VECTORIZE_AVX512) || defined(EIGEN_VECTORIZE_NEON))
constexpr bool kPackedGemm = true;
#else
constexpr bool kPackedGemm = false;
#endif
/// The products of fewer rows run on Eigen's product even where kPackedGemm holds: packing B would
/// cost as much as the multiply-adds of so few rows.
constexpr Index kPackedGemmMinRows = 32;
/// KernelOptions::rows_independent as the kernels honour it. Defining C2F_IGNORE_ROWS_INDEPENDENT turns
/// it off: a build for the test that shows c2f/dist's bit-identity depends on it (tests/CMakeLists.txt,
/// dist.catches_row_dependent_products.*).
inline bool honoured_rows_independent(bool asked) {
#if defined(C2F_IGNORE_ROWS_INDEPENDENT)
  (void)asked;
  return false;
#else
  return asked;
#endif
}

/// Whether kernels::matmul_rows runs an n-row product on packed_gemm: kPackedGemm builds from
/// kPackedGemmMinRows rows on; with `rows_independent` (KernelOptions) any n ≥ 1 on every build, since
/// each element of packed_gemm is the same sum whatever rows surround it, which Eigen's product does not
/// promise (its blocking and kernels change with the shape).
inline bool packed_gemm_for(Index n, bool rows_independent) {
  return n > 0 && (honoured_rows_independent(rows_independent) || (kPackedGemm && n >= kPackedGemmMinRows));
}

/// B [k, n] packed into k-blocks of kKC rows, each a run of panels of kNR columns, each panel
/// [kc][kNR] row by row (columns past n are zero).
template <class Scalar>
class PackedB {
 public:
  using B = GemmBlocking<Scalar>;

  /// Packs any Eigen expression `rhs` [k, n] (evaluated once; a matrix with direct access — a weight
  /// in torch's [out, in] layout, transposed, or a block of keys — is read through its pointer, the
  /// contiguous way), the panels split over `threads` (a copy: the bits do not depend on it). `work`:
  /// parallel_for's estimate, by default the copy's own; a caller whose product follows passes the
  /// product's, so that the packing runs on the threads the product will wake anyway.
  template <class Rhs>
  void pack(const Rhs& rhs, int threads = 1, double work = -1) {
    k_ = rhs.rows();
    n_ = rhs.cols();
    panels_ = (n_ + B::kNR - 1) / B::kNR;
    const std::size_t size = static_cast<std::size_t>(k_ * panels_ * B::kNR);
    data_.reserve(size);  // not zeroed: every element is written below; panels start on cache lines
    const Index kblocks = (k_ + B::kKC - 1) / B::kKC;
    const Eigen::internal::evaluator<Rhs> ev(rhs);
    detail::parallel_for(
        kblocks * panels_, threads, work >= 0 ? work : 2.0 * static_cast<double>(size), [&](Index task, int) {
          const Index k0 = (task / panels_) * B::kKC, p = task % panels_;
          const Index kc = std::min(B::kKC, k_ - k0), j0 = p * B::kNR, nr = std::min<Index>(B::kNR, n_ - j0);
          Scalar* dst = data_.data() + k0 * panels_ * B::kNR + p * kc * B::kNR;
          if (nr < B::kNR) {
            for (Index kk = 0; kk < kc; ++kk) std::fill(dst + kk * B::kNR + nr, dst + (kk + 1) * B::kNR, Scalar(0));
          }
          copy_panel(rhs, ev, k0, kc, j0, nr, dst);
        });
  }

  Index rows() const { return k_; }
  Index cols() const { return n_; }
  /// The panel of columns [p·kNR, (p+1)·kNR) in the k-block starting at row k0.
  const Scalar* panel(Index k0, Index p) const {
    return data_.data() + k0 * panels_ * B::kNR + p * std::min(B::kKC, k_ - k0) * B::kNR;
  }

  /// Bytes pack() holds for a [k, n] operand.
  static std::size_t bytes(Index k, Index n) {
    return sizeof(Scalar) * static_cast<std::size_t>(k * ((n + B::kNR - 1) / B::kNR) * B::kNR);
  }

 private:
  /// dst[kk·kNR + j] = rhs(k0 + kk, j0 + j) for kk < kc, j < nr.
  template <class Rhs>
  static void copy_panel(const Rhs& rhs, const Eigen::internal::evaluator<Rhs>& ev, Index k0, Index kc, Index j0,
                         Index nr, Scalar* dst) {
    constexpr bool kRowMajor = (Eigen::internal::traits<Rhs>::Flags & Eigen::RowMajorBit) != 0;
    if constexpr ((Eigen::internal::traits<Rhs>::Flags & Eigen::DirectAccessBit) != 0) {
      if (rhs.innerStride() == 1) {
        const Scalar* src = rhs.data();
        const Index stride = rhs.outerStride();
        if constexpr (kRowMajor) {  // row kk of the panel is contiguous in rhs
          for (Index kk = 0; kk < kc; ++kk) std::copy_n(src + (k0 + kk) * stride + j0, nr, dst + kk * B::kNR);
        } else {  // column j is contiguous in rhs: kP × kP blocks transposed in registers
          using Packet = typename B::Packet;
          constexpr int kP = B::kP;
          Index kk = 0;
          if (nr == B::kNR) {
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wignored-attributes"  // PacketBlock<__m256, 8>: as in Eigen's own code
#endif
            for (; kk + kP <= kc; kk += kP) {
              for (int g = 0; g < B::kNP; ++g) {
                Eigen::internal::PacketBlock<Packet, kP> block;
                for (int j = 0; j < kP; ++j) {
                  block.packet[j] = Eigen::internal::ploadu<Packet>(src + (j0 + g * kP + j) * stride + k0 + kk);
                }
                Eigen::internal::ptranspose(block);
                for (int i = 0; i < kP; ++i)
                  Eigen::internal::pstoreu(dst + (kk + i) * B::kNR + g * kP, block.packet[i]);
              }
            }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
          }
          for (Index j = 0; j < nr; ++j) {
            const Scalar* col = src + (j0 + j) * stride + k0;
            for (Index r = kk; r < kc; ++r) dst[r * B::kNR + j] = col[r];
          }
        }
        return;
      }
    }
    if constexpr (kRowMajor) {
      for (Index kk = 0; kk < kc; ++kk) {
        for (Index j = 0; j < nr; ++j) dst[kk * B::kNR + j] = ev.coeff(k0 + kk, j0 + j);
      }
    } else {
      for (Index j = 0; j < nr; ++j) {
        for (Index kk = 0; kk < kc; ++kk) dst[kk * B::kNR + j] = ev.coeff(k0 + kk, j0 + j);
      }
    }
  }

  Index k_ = 0, n_ = 0, panels_ = 0;
  detail::ScratchArray<Scalar> data_;  ///< reused between calls (detail/scratch.hpp)
};

/// Keeps a loaded packet in a vector register. Without it GCC may fold the load into every multiply-add
/// that uses the packet (a memory operand each time): one load per use instead of one per packet, and
/// a register tile becomes bound by the load ports instead of the multiply-add units.
template <class Packet>
inline void keep_in_register(Packet& packet) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__)
#if defined(__AVX512F__)
  __asm__("" : "+v"(packet));
#else
  __asm__("" : "+x"(packet));
#endif
#else
  (void)packet;
#endif
}

/// The micro-kernel's multiply-adds: acc[i][p] holds the MR × kNR tile Σ_kk A[i, kk] · b[kk][j] over kc
/// steps of a packed B panel (a chain from 0 in k order), A read in place — A[i, kk] at a[i·lda + kk], or
/// at a[kk·lda + i] when TransA (A stored transposed, as the [k, rows] row-major matrix Aᵀ). MR = kMR
/// for the full tiles, fewer for the last rows of a product: the same multiply-adds per element in the
/// same order, whatever MR or TransA. Inlined into each kernel that ends a tile its own way (gemm_tile;
/// cpu/score_tile.hpp), so the accumulators stay in registers.
template <class Scalar, int MR, bool TransA = false>
EIGEN_ALWAYS_INLINE void gemm_tile_sums(Index kc, const Scalar* a, Index lda, const Scalar* b,
                                        typename GemmBlocking<Scalar>::Packet (&acc)[MR][GemmBlocking<Scalar>::kNP]) {
  using B = GemmBlocking<Scalar>;
  using Packet = typename B::Packet;
  constexpr int kNP = B::kNP, kP = B::kP, kNR = B::kNR;
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    for (int p = 0; p < kNP; ++p) acc[i][p] = Eigen::internal::pset1<Packet>(Scalar(0));
  }
  for (Index kk = 0; kk < kc; ++kk) {
    Packet bv[kNP];
    for (int p = 0; p < kNP; ++p) {
      bv[p] = Eigen::internal::ploadu<Packet>(b + kk * kNR + p * kP);
      keep_in_register(bv[p]);
    }
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      const Packet av = Eigen::internal::pset1<Packet>(TransA ? a[kk * lda + i] : a[i * lda + kk]);
      for (int p = 0; p < kNP; ++p) acc[i][p] = Eigen::internal::pmadd(av, bv[p], acc[i][p]);
    }
  }
}

/// The micro-kernel: gemm_tile_sums, then c[i, j] = (first ? bias[j] (or 0) : c[i, j]) + tile for
/// j < cols.
template <class Scalar, int MR, bool TransA = false>
void gemm_tile(Index kc, const Scalar* a, Index lda, const Scalar* b, Scalar* c, Index ldc, Index cols, bool first,
               const Scalar* bias) {
  using B = GemmBlocking<Scalar>;
  using Packet = typename B::Packet;
  constexpr int kNP = B::kNP, kP = B::kP, kNR = B::kNR;
  Packet acc[MR][kNP];
  gemm_tile_sums<Scalar, MR, TransA>(kc, a, lda, b, acc);
  if (cols == kNR) {
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
      for (int p = 0; p < kNP; ++p) {
        Scalar* dst = c + i * ldc + p * kP;
        if (first && bias == nullptr) {
          Eigen::internal::pstoreu(dst, acc[i][p]);
        } else {
          const Packet base =
              first ? Eigen::internal::ploadu<Packet>(bias + p * kP) : Eigen::internal::ploadu<Packet>(dst);
          Eigen::internal::pstoreu(dst, Eigen::internal::padd(base, acc[i][p]));
        }
      }
    }
    return;
  }
  // The last panel of a product: the same additions, element by element, on the columns that exist.
  // Unrolled, like every loop over acc: a loop that indexes acc by a variable makes GCC keep the whole
  // tile in memory, storing its zeros before the multiply-adds and its sums after them on every call
  // (1.6 % of MultiHeadAttention at L = 1024: "Whole columns for short products, and the tile in
  // registers" in git show 9944106:docs/benchmarks.md).
  Scalar tile[MR][kNR];
#pragma GCC unroll 12
  for (int i = 0; i < MR; ++i) {
    for (int p = 0; p < kNP; ++p) Eigen::internal::pstoreu(&tile[i][p * kP], acc[i][p]);
  }
  for (int i = 0; i < MR; ++i) {
    for (Index j = 0; j < cols; ++j) {
      Scalar& dst = c[i * ldc + j];
      dst = first ? (bias != nullptr ? bias[j] + tile[i][j] : tile[i][j]) : dst + tile[i][j];
    }
  }
}

/// fn(std::integral_constant<int, rows>()) for 1 ≤ rows ≤ MR: the choice of a tile kernel of exactly
/// `rows` rows, for the last rows of a product (gemm_tile_rows; cpu/score_tile.hpp).
template <int MR, class Fn>
EIGEN_ALWAYS_INLINE void with_tile_rows(Index rows, Fn&& fn) {
  if constexpr (MR >= 1) {
    if (rows == MR) {
      fn(std::integral_constant<int, MR>());
    } else {
      with_tile_rows<MR - 1>(rows, fn);
    }
  }
}

/// gemm_tile for the last `rows` (< kMR) rows of a product: the kernel of exactly that many rows.
template <class Scalar, bool TransA = false>
void gemm_tile_rows(Index rows, Index kc, const Scalar* a, Index lda, const Scalar* b, Scalar* c, Index ldc, Index cols,
                    bool first, const Scalar* bias) {
  with_tile_rows<GemmBlocking<Scalar>::kMR - 1>(
      rows, [&](auto mr) { gemm_tile<Scalar, decltype(mr)::value, TransA>(kc, a, lda, b, c, ldc, cols, first, bias); });
}

/// The product of rows of A with the columns [c0, c0 + cols) (c0 a multiple of kNR) of the packed B,
/// over B's rows [k_begin, k_end) (any range: one that starts inside a k-block reads its panels from
/// that row on, and the sum is split at the k-blocks' ends):
///   c[i·ldc + j] (= or +=) Σ_{kk ∈ [k_begin, k_end)} a[i·lda + kk − k_begin] · B[kk, c0 + j] (+ bias[j])
/// for i < rows, j < cols — "=" (with the bias, if not nullptr) unless `accumulate`. `a` points to
/// A's column k_begin, `c` and `bias` to column c0. A is read in place; with TransA, A[i, kk] is
/// a[kk·lda + i] (Aᵀ row-major: a points to its row k_begin) — the same bits as A copied transposed.
template <class Scalar, bool TransA = false>
void packed_gemm_range(const Scalar* a, Index lda, Index rows, const PackedB<Scalar>& b, Index k_begin, Index k_end,
                       Index c0, Index cols, const Scalar* bias, bool accumulate, Scalar* c, Index ldc) {
  using B = GemmBlocking<Scalar>;
  const Index p0 = c0 / B::kNR, p1 = (c0 + cols + B::kNR - 1) / B::kNR;
  if (k_end <= k_begin && !accumulate) {  // an empty sum: the bias (or 0)
    for (Index i = 0; i < rows; ++i) {
      for (Index j = 0; j < cols; ++j) c[i * ldc + j] = bias != nullptr ? bias[j] : Scalar(0);
    }
    return;
  }
  const Index full = rows / B::kMR, rest = rows - full * B::kMR;
  for (Index k0 = k_begin; k0 < k_end;) {
    const Index block = k0 / B::kKC * B::kKC;  // the k-block holding row k0
    const Index kc = std::min(block + B::kKC, k_end) - k0;
    const bool first = k0 == k_begin && !accumulate;
    const Scalar* a_k = a + (k0 - k_begin) * (TransA ? lda : 1);
    const Index a_rows = TransA ? 1 : lda;  // from one row of A to the next
    for (Index p = p0; p < p1; ++p) {
      const Scalar* panel = b.panel(block, p) + (k0 - block) * B::kNR;
      const Index j = p * B::kNR - c0, nr = std::min<Index>(B::kNR, cols - j);
      const Scalar* bias_j = bias != nullptr ? bias + j : nullptr;
      for (Index t = 0; t < full; ++t) {
        gemm_tile<Scalar, B::kMR, TransA>(kc, a_k + t * B::kMR * a_rows, lda, panel, c + t * B::kMR * ldc + j, ldc, nr,
                                          first, bias_j);
      }
      if (rest > 0) {
        gemm_tile_rows<Scalar, TransA>(rest, kc, a_k + full * B::kMR * a_rows, lda, panel, c + full * B::kMR * ldc + j,
                                       ldc, nr, first, bias_j);
      }
    }
    k0 += kc;
  }
}

/// c [rows, cols] (rows `ldc` apart) = a [rows, k] (rows `lda` apart) · B[:, c0 : c0 + cols] (+ bias
/// [cols] on every row, or nullptr), B packed (c0 a multiple of kNR; `c` and `bias` point to column c0).
template <class Scalar>
void packed_gemm(const Scalar* a, Index lda, Index rows, const PackedB<Scalar>& b, Index c0, Index cols,
                 const Scalar* bias, Scalar* c, Index ldc) {
  packed_gemm_range<Scalar>(a, lda, rows, b, 0, b.rows(), c0, cols, bias, false, c, ldc);
}

}  // namespace cpu
}  // namespace c2f
