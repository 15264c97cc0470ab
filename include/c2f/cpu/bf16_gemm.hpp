// c2f — products in bfloat16 with fp32 accumulation (Compute::BFloat16, docs/bf16.md): C [m, n] =
// round(A) [m, k] · round(B) [k, n] (+ bias), where round() is the nearest bfloat16 (ties to even) and
// every sum is accumulated in fp32.
//
// Three engines (Bf16Engine) with one contract:
//   Tiles     AMX (Sapphire Rapids on): B packed once into the tile unit's VNNI layout (pairs of k
//             interleaved, 32 columns × 32 k per 2 KiB block), A rounded into bf16 rows, and a 32 × 32
//             block of C in four 16 × 16 fp32 accumulator tiles per tdpbf16ps step (16384 FLOP each);
//   Dot       AVX512_BF16 (vdpbf16ps): the same packed B and A; a block of kDotRows × 32 of C in
//             2·kDotRows vector accumulators, each step one broadcast pair of A times one row of B's
//             block (16 columns × a pair of k);
//   Fallback  every CPU: the same rounded operands as fp32 values on cpu::packed_gemm.
// The product of two bfloat16 values is exact in fp32, so the engines differ only in the order of the
// fp32 additions. The engine is chosen at run time (bf16_engine(): CPUID, Linux's permission for the
// tile registers, and set_bf16_engine / C2F_BF16_ENGINE) — a portable build uses what the CPU has.
// Each element is the same sum whatever rows, task or thread surround it, so the bits do not depend on
// the thread count.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/detail/scratch.hpp"
#include "c2f/options.hpp"
#include "c2f/runtime.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define C2F_AMX_POSSIBLE 1
#else
#define C2F_AMX_POSSIBLE 0
#endif

namespace c2f {
namespace cpu {

/// The bfloat16 nearest to x (ties to even), as its 16 bits; a NaN stays a (quiet) NaN, ±Inf stays.
inline std::uint16_t bf16_bits(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/// The float of bfloat16 bits b.
inline float bf16_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float x = 0;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
/// x rounded to the nearest bfloat16, as a float.
inline float round_bf16(float x) { return bf16_float(bf16_bits(x)); }

/// x rounded to bfloat16 (Compute::BFloat16's operands), as a functor for Eigen's unaryExpr.
template <class Scalar>
struct RoundBf16 {
  template <class T>
  Scalar operator()(const T& x) const {
    return static_cast<Scalar>(round_bf16(static_cast<float>(x)));
  }
};

/// Whether `options` ask for bfloat16 products; "<kernel>: compute BFloat16 needs float ..." when they do
/// for another Scalar (or, unless `narrow_kv`, keys and values of another type).
template <class Scalar, class KV = Scalar>
bool check_compute(const char* kernel, Compute compute, bool narrow_kv = false) {
  if (compute != Compute::BFloat16) return false;
  if (!std::is_same<Scalar, float>::value ||
      !(std::is_same<KV, float>::value || (narrow_kv && !std::is_same<KV, double>::value))) {
    detail::fail(kernel, ": compute BFloat16 needs float queries, keys and values, got ",
                 std::is_same<Scalar, double>::value ? "double" : "float", " queries and ",
                 std::is_same<KV, float>::value ? "float" : (std::is_same<KV, double>::value ? "double" : "16-bit"),
                 " keys");
  }
  return true;
}

/// Whether this CPU has AMX-BF16 and Linux lets the process use the tile registers
/// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once; kernels before 5.16 refuse it).
inline bool cpu_has_amx_bf16() {
#if C2F_AMX_POSSIBLE
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = ((edx >> 24) & 1u) != 0, bf16 = ((edx >> 22) & 1u) != 0;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

/// Whether this CPU has AVX512_BF16 (vdpbf16ps) with AVX-512F and BW, and the OS saves the vector state.
inline bool cpu_has_avx512_bf16() {
#if C2F_AMX_POSSIBLE
  static const bool ok = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || ((ecx >> 27) & 1u) == 0) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xe6u) != 0xe6u) return false;  // SSE, AVX, opmask and both halves of the zmm registers
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool f = ((ebx >> 16) & 1u) != 0, bw = ((ebx >> 30) & 1u) != 0;
    if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
    return f && bw && ((eax >> 5) & 1u) != 0;
  }();
  return ok;
#else
  return false;
#endif
}

/// Whether the CPU's vendor is AMD ("AuthenticAMD"; asked once: CPUID traps to the hypervisor in a VM).
inline bool cpu_is_amd() {
#if C2F_AMX_POSSIBLE
  static const bool amd = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;
  }();
  return amd;
#else
  return false;
#endif
}

}  // namespace cpu

/// The name of an engine: "auto", "fallback", "dot", "tiles".
inline const char* bf16_engine_name(Bf16Engine engine) {
  switch (engine) {
    case Bf16Engine::Fallback:
      return "fallback";
    case Bf16Engine::Dot:
      return "dot";
    case Bf16Engine::Tiles:
      return "tiles";
    default:
      return "auto";
  }
}

/// Whether this machine can run `engine` (Auto and Fallback: always).
inline bool bf16_engine_available(Bf16Engine engine) {
  if (engine == Bf16Engine::Tiles) return cpu::cpu_has_amx_bf16();
  if (engine == Bf16Engine::Dot) return cpu::cpu_has_avx512_bf16();
  return engine == Bf16Engine::Auto || engine == Bf16Engine::Fallback;
}

/// The engine Auto picks on this machine: Tiles where the CPU has AMX; Dot on AMD CPUs with AVX512_BF16
/// (Zen 4 and 5 retire vdpbf16ps at twice the fp32 FMA's FLOP rate; Intel's Xeons measured at half,
/// docs/bf16.md#engines); else Fallback.
inline Bf16Engine bf16_engine_rule() {
  static const Bf16Engine rule = [] {
    if (cpu::cpu_has_amx_bf16()) return Bf16Engine::Tiles;
    if (cpu::cpu_has_avx512_bf16() && cpu::cpu_is_amd()) return Bf16Engine::Dot;
    return Bf16Engine::Fallback;
  }();
  return rule;
}

namespace detail {
/// The engine named `text` ("auto", "fallback", "dot", "tiles"); `what` names the source in the error.
inline Bf16Engine parse_bf16_engine(const std::string& text, const char* what) {
  for (Bf16Engine e : {Bf16Engine::Auto, Bf16Engine::Fallback, Bf16Engine::Dot, Bf16Engine::Tiles}) {
    if (text == bf16_engine_name(e)) {
      if (!bf16_engine_available(e)) {
        throw std::invalid_argument(std::string("c2f: ") + what + " asks for the bfloat16 engine '" + text +
                                    "', which this CPU lacks (" +
                                    (e == Bf16Engine::Tiles ? "AMX-BF16" : "AVX512_BF16 with AVX-512F/BW") + ")");
      }
      return e;
    }
  }
  throw std::invalid_argument(std::string("c2f: ") + what + " must be one of auto, fallback, dot, tiles, got '" + text +
                              "'");
}
/// The engine asked for: set_bf16_engine's last value, else C2F_BF16_ENGINE (unset or empty: auto),
/// read on first use.
inline std::atomic<Bf16Engine>& bf16_engine_request() {
  static std::atomic<Bf16Engine> request{[] {
    const char* text = std::getenv("C2F_BF16_ENGINE");
    return text == nullptr || *text == '\0' ? Bf16Engine::Auto
                                            : parse_bf16_engine(text, "environment variable C2F_BF16_ENGINE");
  }()};
  return request;
}
}  // namespace detail

/// Runs Compute::BFloat16's products on `engine` from the calls that start after it (Auto: the rule,
/// bf16_engine_rule()); std::invalid_argument for an engine this CPU lacks.
inline void set_bf16_engine(Bf16Engine engine) {
  if (!bf16_engine_available(engine)) {
    detail::parse_bf16_engine(bf16_engine_name(engine), "set_bf16_engine");  // throws, naming what is missing
  }
  detail::bf16_engine_request().store(engine, std::memory_order_relaxed);
}
/// The engine asked for (Auto unless set_bf16_engine or C2F_BF16_ENGINE named one).
inline Bf16Engine get_bf16_engine() { return detail::bf16_engine_request().load(std::memory_order_relaxed); }
/// The engine Compute::BFloat16's products run on now (never Auto).
inline Bf16Engine bf16_engine() {
  const Bf16Engine asked = get_bf16_engine();
  return asked == Bf16Engine::Auto ? bf16_engine_rule() : asked;
}

namespace cpu {

/// Whether `engine` reads the packed operands in VNNI blocks (Dot and Tiles) rather than as floats.
inline bool bf16_blocked(Bf16Engine engine) { return engine == Bf16Engine::Dot || engine == Bf16Engine::Tiles; }

/// The tile engine's blocking: a tile holds 16 rows of 64 bytes (32 bfloat16 or 16 floats); a block of
/// C is 2 × 2 tiles.
constexpr Index kTileK = 32;   ///< k per tile step (bf16 per tile row)
constexpr Index kTileMN = 32;  ///< rows and columns of a block of C

#if C2F_AMX_POSSIBLE
// GCC 12's _mm512_undefined_* (`__m512i __Y = __Y`) trips -Wmaybe-uninitialized where these intrinsics
// inline (GCC bug 105593, fixed in GCC 13; see core.hpp).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
/// bf16_bits of the 16 floats whose bits are u, each in the high half of its 32-bit lane (the low half
/// is left over from the rounding).
__attribute__((target("avx512f"))) inline __m512i bf16_round_lanes(__m512i u) {
  const __m512i rounding = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), quiet = _mm512_set1_epi32(0x400000);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs_mask), inf);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(rounding, lsb));
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, quiet));
}
#if defined(__AVX512BF16__)
/// The bfloat16 bits of 16 floats, ties to even. A build for a CPU with AVX512_BF16 (-march=native on
/// Zen 4/5, Sapphire Rapids) takes vcvtneps2bf16, one instruction for bf16_round_lanes' six: the same bits
/// but for a subnormal float, which it makes a signed zero — what the Dot and Tiles engines, the only
/// readers of the words, read it as anyway (their products treat subnormal inputs as zero).
inline __m256i bf16_words(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
/// The bfloat16 bits of 32 floats (lo's 16, then hi's), as bf16_words.
inline __m512i bf16_words(__m512 lo, __m512 hi) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)); }
#else
/// The bfloat16 bits of 16 floats, ties to even (bf16_round_lanes).
__attribute__((target("avx512f,avx512bw"))) inline __m256i bf16_words(__m512 x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_lanes(_mm512_castps_si512(x)), 16));
}
/// The bfloat16 bits of 32 floats (lo's 16, then hi's): the high halves of their rounded lanes.
__attribute__((target("avx512f,avx512bw"))) inline __m512i bf16_words(__m512 lo, __m512 hi) {
  alignas(64) static constexpr std::uint16_t kHighHalves[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                                23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                                45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  return _mm512_permutex2var_epi16(bf16_round_lanes(_mm512_castps_si512(lo)), _mm512_load_si512(kHighHalves),
                                   bf16_round_lanes(_mm512_castps_si512(hi)));
}
#endif
/// The mask of the first min(max(n, 0), 16) of 16 lanes.
inline __mmask16 first_lanes(Index n) {
  return n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << std::max<Index>(n, 0)) - 1u);
}
/// The floats of src[0 … n) (n ≤ 16; zero past n) as 32-bit lanes.
__attribute__((target("avx512f"))) inline __m512i load_lanes(const float* src, Index n) {
  return _mm512_castps_si512(_mm512_maskz_loadu_ps(first_lanes(n), src));
}

/// dst[c] = bf16_bits(src[c]) for c < n, 16 at a time (every CPU with the tile unit has AVX-512BW/VL).
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void bf16_bits_avx512(const float* src, Index n,
                                                                                  std::uint16_t* dst) {
  for (Index c = 0; c < n; c += 16)
    _mm256_mask_storeu_epi16(dst + c, first_lanes(n - c), bf16_words(_mm512_castsi512_ps(load_lanes(src + c, n - c))));
}
/// Transposes the 16 × 16 matrix of 32-bit words in r[0..15] (row i in r[i]) in place: four rounds of
/// 16 shuffles (pairs of words, pairs of pairs, then 128-bit lanes twice).
__attribute__((target("avx512f"))) inline void transpose_16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // t[i] lane L: r_i[4L], r_i+1[4L], r_i[4L+1], r_i+1[4L+1]
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + e] lane L: rows g..g+3, word 4L + e
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // word 4L + e of all 16 rows, from lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512i lo01 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), hi01 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xee);
    const __m512i lo23 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44),
                  hi23 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xee);
    r[e] = _mm512_shuffle_i32x4(lo01, lo23, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(lo01, lo23, 0xdd);
    r[8 + e] = _mm512_shuffle_i32x4(hi01, hi23, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(hi01, hi23, 0xdd);
  }
}

/// One half of a VNNI block (16 columns × 32 rows, 512 bf16) from B's columns col0 … col0 + cols − 1, each
/// contiguous (`cs` apart), rows row0 … row0 + rows − 1: tile word r·16 + j = (B[row0 + 2r, col0 + j],
/// B[row0 + 2r + 1, col0 + j]), zero past rows and cols. Each column's 32 values are rounded into one
/// vector of 16 words (in registers: a round trip through memory stalled on store forwarding), then the
/// 16 × 16 words transposed.
__attribute__((target("avx512f,avx512bw"))) inline void vnni_from_columns(const float* src, Index cs, Index row0,
                                                                          Index rows, Index col0, Index cols,
                                                                          std::uint16_t* tile) {
  __m512i r[16];
  for (Index j = 0; j < 16; ++j) {
    if (j < cols) {
      const float* column = src + (col0 + j) * cs + row0;
      r[j] = bf16_words(_mm512_castsi512_ps(load_lanes(column, rows)),
                        _mm512_castsi512_ps(load_lanes(column + 16, rows - 16)));
    } else {
      r[j] = _mm512_setzero_si512();
    }
  }
  transpose_16x16_epi32(r);
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + 32 * i, r[i]);
}

/// The same half block from B's rows, each contiguous (`rs` apart): tile row r holds rows row0 + 2r and
/// row0 + 2r + 1 interleaved value by value (zero past rows); only the cols words of each row are
/// written (the caller zeroed a partial block).
__attribute__((target("avx512f,avx512bw"))) inline void vnni_from_rows(const float* src, Index rs, Index row0,
                                                                       Index rows, Index col0, Index cols,
                                                                       std::uint16_t* tile) {
  if (cols <= 0) return;
  const __mmask16 lanes = first_lanes(cols);
  // Word 2j from the even row's value j, word 2j + 1 from the odd row's (at 16 + j in bf16_words(even, odd)).
  alignas(64) static constexpr std::uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                                21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                                11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (Index kk = 0; kk < rows; kk += 2) {
    const __m512 even = _mm512_castsi512_ps(load_lanes(src + (row0 + kk) * rs + col0, cols));
    const __m512 odd =
        kk + 1 < rows ? _mm512_castsi512_ps(load_lanes(src + (row0 + kk + 1) * rs + col0, cols)) : _mm512_setzero_ps();
    _mm512_mask_storeu_epi32(tile + (kk / 2) * 32, lanes, _mm512_permutexvar_epi16(interleave, bf16_words(even, odd)));
  }
}
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic pop
#endif

#endif

/// B [k, n] rounded to bfloat16 for bf16_gemm_range: on the Dot and Tiles engines in VNNI blocks — for
/// each panel of 32 columns and each k-step of 32 rows, two 16-column tiles of 16 rows, row r holding
/// (B[2r, j], B[2r + 1, j]) for each column j, zero past k and n (a tile row is the vector vdpbf16ps
/// reads); on the fallback as rounded floats in a PackedB.
class Bf16PackedB {
 public:
  /// Packs `rhs` [k, n] (any Eigen expression of floats) for the engine bf16_engine() names now (the
  /// fallback when not `allow_blocked`: the caller's ranges would not start on the blocks' k-steps), the
  /// panels split over `threads` (a copy: the bits do not depend on it); `work` as PackedB::pack's.
  template <class Rhs>
  void pack(const Rhs& rhs, int threads = 1, bool allow_blocked = true, double work = -1) {
    k_ = rhs.rows();
    n_ = rhs.cols();
    engine_ = allow_blocked ? bf16_engine() : Bf16Engine::Fallback;
    if (!bf16_blocked(engine_)) {
      fallback_.pack(rhs.unaryExpr([](float x) { return round_bf16(x); }), threads, work);
      return;
    }
    ksteps_ = detail::ceil_div(k_, kTileK);
    panels_ = detail::ceil_div(n_, kTileMN);
    vnni_.reserve(static_cast<std::size_t>(std::max<Index>(1, panels_ * ksteps_ * kBlock)));
    const Eigen::internal::evaluator<Rhs> ev(rhs);
    detail::parallel_for(
        panels_, threads, work >= 0 ? work : 2.0 * static_cast<double>(panels_ * ksteps_ * kBlock), [&](Index p, int) {
          std::uint16_t* dst = vnni_.data() + p * ksteps_ * kBlock;
          for (Index t = 0; t < ksteps_; ++t) {
            for (Index half = 0; half < 2; ++half) {
              std::uint16_t* tile = dst + t * kBlock + half * kBlock / 2;
              const Index col0 = p * kTileMN + half * 16, row0 = t * kTileK;
              const Index cols = std::clamp<Index>(n_ - col0, 0, 16), rows = std::min(kTileK, k_ - row0);
              if (cols < 16 || rows < kTileK) std::fill(tile, tile + kBlock / 2, std::uint16_t(0));
              // tile[(r·16 + j)·2 + e] = B[row0 + 2r + e, col0 + j]
              if constexpr ((Eigen::internal::traits<Rhs>::Flags & Eigen::DirectAccessBit) != 0) {
                const float* src = rhs.data();
                const Index rs = rhs.rowStride(), cs = rhs.colStride();
#if C2F_AMX_POSSIBLE
                // The blocked engines run on CPUs with AVX-512: contiguous columns (a weight's rows, keys) or
                // rows (values) rounded 16 at a time and placed as 32-bit words by vector shuffles.
                if (rs == 1) {
                  vnni_from_columns(src, cs, row0, rows, col0, cols, tile);
                  continue;
                }
                if (cs == 1) {
                  vnni_from_rows(src, rs, row0, rows, col0, cols, tile);
                  continue;
                }
#endif
                for (Index j = 0; j < cols; ++j) {
                  const float* column = src + (col0 + j) * cs + row0 * rs;
                  for (Index kk = 0; kk < rows; ++kk)
                    tile[((kk / 2) * 16 + j) * 2 + kk % 2] = bf16_bits(column[kk * rs]);
                }
              } else {
                for (Index j = 0; j < cols; ++j) {
                  for (Index kk = 0; kk < rows; ++kk) {
                    tile[((kk / 2) * 16 + j) * 2 + kk % 2] = bf16_bits(ev.coeff(row0 + kk, col0 + j));
                  }
                }
              }
            }
          }
        });
  }

  Index rows() const { return k_; }
  Index cols() const { return n_; }
  Bf16Engine engine() const { return engine_; }
  /// Dot and Tiles: the block of k-step t and panel p (two tiles of 16 × 32 bf16, 512 apart).
  const std::uint16_t* block(Index t, Index p) const { return vnni_.data() + (p * ksteps_ + t) * kBlock; }
  /// Fallback: the rounded floats.
  const PackedB<float>& fallback() const { return fallback_; }

  /// Bytes pack() holds for a [k, n] operand on `engine`.
  static std::size_t bytes(Index k, Index n, Bf16Engine engine) {
    return bf16_blocked(engine)
               ? sizeof(std::uint16_t) *
                     static_cast<std::size_t>(detail::ceil_div(k, kTileK) * detail::ceil_div(n, kTileMN) * kBlock)
               : PackedB<float>::bytes(k, n);
  }

 private:
  static constexpr Index kBlock = kTileK * kTileMN;  ///< bf16 of one (k-step, panel) block
  Index k_ = 0, n_ = 0, ksteps_ = 0, panels_ = 0;
  Bf16Engine engine_ = Bf16Engine::Fallback;
  detail::ScratchArray<std::uint16_t> vnni_;
  PackedB<float> fallback_;
};

#if C2F_AMX_POSSIBLE
/// The tile registers' layout (palette 1): eight tiles of 16 rows × 64 bytes.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

/// C's 32 × 32 block = init + A's 32 rows (bf16, `lda` apart, from the first k-step) · B's block column
/// p over k-steps [t0, t1): tiles 0–3 accumulate, 4–5 hold A, 6–7 hold B. `init` (floats, `ldi` apart;
/// ldi = 0 repeats one row: a bias) or nullptr for zeros; the result goes to `c` (`ldc` apart).
__attribute__((target("amx-tile,amx-bf16"))) inline void amx_block(const std::uint16_t* a, Index lda,
                                                                   const Bf16PackedB& b, Index t0, Index t1, Index p,
                                                                   const float* init, Index ldi, float* c, Index ldc) {
  if (init == nullptr) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    const long si = static_cast<long>(ldi * 4);
    _tile_loadd(0, init, si);
    _tile_loadd(1, init + 16, si);
    _tile_loadd(2, init + 16 * ldi, si);
    _tile_loadd(3, init + 16 * ldi + 16, si);
  }
  const long sa = static_cast<long>(lda * 2);
  for (Index t = t0; t < t1; ++t) {
    const std::uint16_t* at = a + (t - t0) * kTileK;
    const std::uint16_t* bt = b.block(t, p);
    _tile_loadd(4, at, sa);
    _tile_loadd(5, at + 16 * lda, sa);
    _tile_loadd(6, bt, 64);
    _tile_loadd(7, bt + kTileK * kTileMN / 2, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const long sc = static_cast<long>(ldc * 4);
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  _tile_stored(2, c + 16 * ldc, sc);
  _tile_stored(3, c + 16 * ldc + 16, sc);
}

__attribute__((target("amx-tile"))) inline void amx_configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  // ldtilecfg on the whole struct: GCC's _tile_loadconfig names only its first 8 bytes as the asm's
  // operand, so an optimiser may drop the stores of the rest (seen at -O1: #GP on the first tile load).
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
}
__attribute__((target("amx-tile"))) inline void amx_release() { _tile_release(); }
#endif

/// An A operand of bf16_gemm: rows × depth values rounded to bfloat16 — on the Dot and Tiles engines as
/// bf16 in whole 32-row blocks and 32-value steps (zero past rows and depth), on the fallback as floats.
/// Its storage comes from the scratch cache (detail/scratch.hpp) and grows with the largest operand.
class Bf16A {
 public:
  /// Rounds a [rows, depth] (rows `lda` apart) for `engine`.
  void prepare(const float* a, Index lda, Index rows, Index depth, Bf16Engine engine) {
    rows_ = rows, depth_ = depth, engine_ = engine;
    if (!bf16_blocked(engine)) {
      a32_.reserve(static_cast<std::size_t>(std::max<Index>(1, rows * depth)));
      float* dst = a32_.data();
      for (Index i = 0; i < rows; ++i) {
        for (Index kk = 0; kk < depth; ++kk) dst[i * depth + kk] = round_bf16(a[i * lda + kk]);
      }
      return;
    }
#if C2F_AMX_POSSIBLE
    std::uint16_t* dst = blocked(rows, depth, engine);
    for (Index i = 0; i < rows; ++i) bf16_bits_avx512(a + i * lda, depth, dst + i * ld_);
#endif
  }
#if C2F_AMX_POSSIBLE
  /// The blocked form (Dot, Tiles) of a [rows, depth] operand for the caller to write: rows bf16_stride()
  /// apart, the padding past rows and depth zeroed here; the values are the caller's to fill, rounded.
  std::uint16_t* blocked(Index rows, Index depth, Bf16Engine engine) {
    rows_ = rows, depth_ = depth, engine_ = engine;
    ld_ = detail::ceil_div(depth, kTileK) * kTileK;
    const Index padded = detail::ceil_div(rows, kTileMN) * kTileMN;
    a16_.reserve(static_cast<std::size_t>(std::max<Index>(1, padded * ld_)));
    if (ld_ > depth) {
      for (Index i = 0; i < rows; ++i)
        std::fill(a16_.data() + i * ld_ + depth, a16_.data() + (i + 1) * ld_, std::uint16_t(0));
    }
    std::fill(a16_.data() + rows * ld_, a16_.data() + padded * ld_, std::uint16_t(0));
    return a16_.data();
  }
#endif
  Index rows() const { return rows_; }
  Index depth() const { return depth_; }
  Bf16Engine engine() const { return engine_; }
  /// Bytes prepare() holds for rows × depth on `engine` (its storage keeps the largest).
  static std::size_t bytes(Index rows, Index depth, Bf16Engine engine) {
    if (!bf16_blocked(engine)) return sizeof(float) * static_cast<std::size_t>(std::max<Index>(1, rows * depth));
    return sizeof(std::uint16_t) *
           static_cast<std::size_t>(std::max<Index>(
               1, detail::ceil_div(rows, kTileMN) * kTileMN * detail::ceil_div(depth, kTileK) * kTileK));
  }
  const std::uint16_t* bf16() const { return a16_.data(); }
  Index bf16_stride() const { return ld_; }
  const float* floats() const { return a32_.data(); }

 private:
  Index rows_ = 0, depth_ = 0, ld_ = 0;
  Bf16Engine engine_ = Bf16Engine::Fallback;
  detail::ScratchArray<std::uint16_t> a16_;  ///< from the scratch cache (detail/scratch.hpp), as the packed operands
  detail::ScratchArray<float> a32_;
};

#if C2F_AMX_POSSIBLE
/// Rows of C per block of the Dot engine: 12 (24 accumulators, 2 registers of B, one broadcast), then
/// blocks of 8 and 4 for the rest of A's rows padded to 32.
constexpr Index kDotRows = 12;
/// Rows of A per run of the Dot engine's blocks (a multiple of 4).
constexpr Index kDotRunRows = 96;

/// The Dot engine's block: C's rows [0, ni) (ni ≤ MR) × the columns of `m0`, `m1` (the first and second
/// 16 of panel p) = init + A's MR rows (bf16, `lda` apart, from the first k-step; rows past ni are read,
/// zero in a prepared A) · B's panel p over k-steps [t0, t1). Every element is the sum, in k order, of
/// vdpbf16ps's pair steps (odd k, then even k of each pair, in fp32, denormals flushed), whatever MR.
/// `init` (floats, `ldi` apart; ldi = 0 repeats one row: a bias) or nullptr for zeros; the result to `c`.
template <int MR>
__attribute__((target("avx512f,avx512bf16"))) inline void dot_block(const std::uint16_t* a, Index lda, Index ni,
                                                                    const Bf16PackedB& b, Index t0, Index t1, Index p,
                                                                    __mmask16 m0, __mmask16 m1, const float* init,
                                                                    Index ldi, float* c, Index ldc) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) {
    if (init != nullptr && i < ni) {
      acc[i][0] = _mm512_maskz_loadu_ps(m0, init + i * ldi);
      acc[i][1] = _mm512_maskz_loadu_ps(m1, init + i * ldi + 16);
    } else {
      acc[i][0] = _mm512_setzero_ps();
      acc[i][1] = _mm512_setzero_ps();
    }
  }
  for (Index t = t0; t < t1; ++t) {
    const std::uint16_t* at = a + (t - t0) * kTileK;
    const std::uint16_t* bt = b.block(t, p);
    for (Index r = 0; r < kTileK / 2; ++r) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bt + 32 * r);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bt + kTileK * kTileMN / 2 + 32 * r);
      for (int i = 0; i < MR; ++i) {
        std::int32_t pair = 0;
        std::memcpy(&pair, at + i * lda + 2 * r, sizeof pair);
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (i >= ni) break;
    _mm512_mask_storeu_ps(c + i * ldc, m0, acc[i][0]);
    _mm512_mask_storeu_ps(c + i * ldc + 16, m1, acc[i][1]);
  }
}
#endif

/// packed_gemm_range in bfloat16 (the same contract, A and B rounded, sums in fp32), A prepared: for
/// i < a.rows(), j < cols
///   c[i·ldc + j] (= or +=) Σ_{kk ∈ [k_begin, k_end)} A[i, kk − k_begin] · B[kk, c0 + j] (+ bias[j])
/// — "=" (with the bias, if not nullptr) unless `accumulate`; a.depth() = k_end − k_begin and a and b on
/// one engine. On the Dot and Tiles engines c0 and k_begin are multiples of 32 and k_end one or B's last
/// row (the callers' key blocks); on Tiles the tile registers are configured on this thread (Bf16Tiles).
inline void bf16_gemm(const Bf16A& a, const Bf16PackedB& b, Index k_begin, Index k_end, Index c0, Index cols,
                      const float* bias, bool accumulate, float* c, Index ldc) {
  if (a.depth() != k_end - k_begin || a.engine() != b.engine()) {
    detail::fail("bf16_gemm: A of depth ", a.depth(), " on the ", bf16_engine_name(a.engine()), " engine for rows [",
                 k_begin, ", ", k_end, ") of B on the ", bf16_engine_name(b.engine()), " engine");
  }
  const Index rows = a.rows();
  if (!bf16_blocked(b.engine())) {
    packed_gemm_range<float>(a.floats(), a.depth(), rows, b.fallback(), k_begin, k_end, c0, cols, bias, accumulate, c,
                             ldc);
    return;
  }
#if C2F_AMX_POSSIBLE
  if (k_begin % kTileK != 0 || (k_end % kTileK != 0 && k_end != b.rows()) || c0 % kTileMN != 0) {
    detail::fail("bf16_gemm: the ", bf16_engine_name(b.engine()),
                 " engine needs k_begin and c0 multiples of 32 and k_end one or B's rows, got ", k_begin, ", ", c0,
                 ", ", k_end);
  }
  const Index t0 = k_begin / kTileK, t1 = detail::ceil_div(k_end, kTileK);
  const Index lda = a.bf16_stride();
  const Index p0 = c0 / kTileMN, p1 = detail::ceil_div(c0 + cols, kTileMN);
  if (b.engine() == Bf16Engine::Dot) {
    const Index padded = detail::ceil_div(rows, kTileMN) * kTileMN;
    // A's rows in runs of kDotRunRows (at depth 512, 96 KiB of bf16: in L2), each run panel by panel: a
    // panel's blocks (2 KiB per k-step) stay in L1 while the run's row blocks pass.
    for (Index r0 = 0; r0 < rows; r0 += kDotRunRows) {
      const Index r1 = std::min(rows, r0 + kDotRunRows);
      for (Index p = p0; p < p1; ++p) {
        const Index j = p * kTileMN - c0, nj = std::min(kTileMN, cols - j);
        const __mmask16 m0 = first_lanes(nj), m1 = first_lanes(nj - 16);
        for (Index i0 = r0; i0 < r1;) {
          float* cb = c + i0 * ldc + j;
          const float* init = accumulate ? cb : bias != nullptr ? bias + j : nullptr;
          const std::uint16_t* ab = a.bf16() + i0 * lda;
          const Index ldi = accumulate ? ldc : 0, left = r1 - i0;
          // A's rows are padded to 32 with zeros: a block may read past r1, never past the padding.
          if (left >= kDotRows || i0 + kDotRows <= padded) {
            dot_block<kDotRows>(ab, lda, std::min(kDotRows, left), b, t0, t1, p, m0, m1, init, ldi, cb, ldc);
            i0 += kDotRows;
          } else if (left > 4) {
            dot_block<8>(ab, lda, std::min<Index>(8, left), b, t0, t1, p, m0, m1, init, ldi, cb, ldc);
            i0 += 8;
          } else {
            dot_block<4>(ab, lda, left, b, t0, t1, p, m0, m1, init, ldi, cb, ldc);
            i0 += 4;
          }
        }
      }
    }
    return;
  }
  const Index row_blocks = detail::ceil_div(rows, kTileMN);
  alignas(64) float tmp[kTileMN * kTileMN];
  alignas(64) float bias_row[kTileMN];
  for (Index rb = 0; rb < row_blocks; ++rb) {
    const Index i0 = rb * kTileMN, ni = std::min(kTileMN, rows - i0);
    const std::uint16_t* ab = a.bf16() + i0 * lda;
    for (Index p = p0; p < p1; ++p) {
      const Index j = p * kTileMN - c0, nj = std::min(kTileMN, cols - j);
      float* cb = c + i0 * ldc + j;
      const bool full = ni == kTileMN && nj == kTileMN;
      const float* init = nullptr;
      Index ldi = 0;
      if (accumulate) {
        if (full) {
          init = cb, ldi = ldc;
        } else {
          std::fill(tmp, tmp + kTileMN * kTileMN, 0.0f);
          for (Index r = 0; r < ni; ++r) std::copy_n(cb + r * ldc, nj, tmp + r * kTileMN);
          init = tmp, ldi = kTileMN;
        }
      } else if (bias != nullptr) {
        std::fill(bias_row, bias_row + kTileMN, 0.0f);
        std::copy_n(bias + j, nj, bias_row);
        init = bias_row, ldi = 0;
      }
      if (full) {
        amx_block(ab, lda, b, t0, t1, p, init, ldi, cb, ldc);
      } else {
        amx_block(ab, lda, b, t0, t1, p, init, ldi, tmp, kTileMN);
        for (Index r = 0; r < ni; ++r) std::copy_n(tmp + r * kTileMN, nj, cb + r * ldc);
      }
    }
  }
#else
  detail::fail("bf16_gemm: no ", bf16_engine_name(b.engine()), " engine in this build");
#endif
}

/// bf16_gemm on a [rows, k_end − k_begin] (rows `lda` apart) rounded into this thread's scratch.
inline void bf16_gemm_range(const float* a, Index lda, Index rows, const Bf16PackedB& b, Index k_begin, Index k_end,
                            Index c0, Index cols, const float* bias, bool accumulate, float* c, Index ldc) {
  Bf16A scratch;  // from the scratch cache: a task's rows, counted per worker by the workspace_bytes formulas
  scratch.prepare(a, lda, rows, k_end - k_begin, b.engine());
  bf16_gemm(scratch, b, k_begin, k_end, c0, cols, bias, accumulate, c, ldc);
}

#if C2F_AMX_POSSIBLE && C2F_EXP_SIMD == 16
/// Where online_softmax_step_bf16 puts the exponentials: rounded to bfloat16 into rows `ld` apart.
struct ExpToBf16 {
  std::uint16_t* dst;
  Index ld;
  __attribute__((target("avx512f,avx512bw"))) void operator()(int r, Index j, __m512 e) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * ld + j), bf16_words(e));
  }
  __attribute__((target("avx512f,avx512bw,avx512vl"))) void operator()(int r, Index j, __m512 e, __mmask16 k) const {
    _mm256_mask_storeu_epi16(dst + r * ld + j, k, bf16_words(e));
  }
};
#define C2F_BF16_FUSED_SOFTMAX 1
#else
#define C2F_BF16_FUSED_SOFTMAX 0
#endif

/// online_softmax_step on the scores s (float rows, contiguous) with the exponentials written, rounded to
/// bfloat16, into `p` (the blocked form of A for the PV product on `engine`, Dot or Tiles) instead of back
/// into s: the same running maxima, sums and factors, and p holds the bits p.prepare(s) would after
/// online_softmax_step — one pass over the block instead of two. Where the build lacks AVX-512's exp
/// kernel (C2F_BF16_FUSED_SOFTMAX 0): online_softmax_step, then p.prepare.
template <class Scores, class Max, class Sum, class Alpha>
bool online_softmax_step_bf16(Scores& s, Max&& m, Sum&& l, Alpha&& alpha, Bf16A& p, Bf16Engine engine) {
#if C2F_BF16_FUSED_SOFTMAX
  std::uint16_t* dst = p.blocked(s.rows(), s.cols(), engine);
  const Index ld = p.bf16_stride();
  bool rescale = false;
  const auto sink_of = [&](Index r0) { return ExpToBf16{dst + r0 * ld, ld}; };
  Index r =
      impl::online_softmax_rows<kExpRows>(s.data(), s.outerStride(), s.rows(), s.cols(), m, l, alpha, rescale, sink_of);
  for (; r < s.rows(); ++r) {
    impl::online_softmax_rows<1>(s.data() + r * s.outerStride(), s.outerStride(), 1, s.cols(), m.segment(r, 1),
                                 l.segment(r, 1), alpha.segment(r, 1), rescale, [&](Index) { return sink_of(r); });
  }
  return rescale;
#else
  const bool rescale = online_softmax_step(s, m, l, alpha);
  p.prepare(s.data(), s.outerStride(), s.rows(), s.cols(), engine);
  return rescale;
#endif
}

/// A worker's operands of bf16_product: its packing of B and its rounded A, reused from call to call.
struct Bf16Operands {
  Bf16PackedB b;
  Bf16A a;
};

/// Bytes a Bf16Operands holds after bf16_product on [rows, k] · [k, n] and then on [rows2, k2] · [k2, n2]
/// (a task's QKᵀ and PV) on `engine`: each operand's storage keeps the larger; counted as both, since
/// growing takes the new block before the scratch cache has the old one back.
inline std::size_t bf16_operands_bytes(Index rows, Index k, Index n, Index rows2, Index k2, Index n2,
                                       Bf16Engine engine) {
  return Bf16PackedB::bytes(k, n, engine) + Bf16PackedB::bytes(k2, n2, engine) + Bf16A::bytes(rows, k, engine) +
         Bf16A::bytes(rows2, k2, engine);
}

/// c (= or, when `accumulate`, +=) round(a) · round(rhs) for a [rows, k] (rows `lda` apart) and `rhs`
/// any Eigen expression of floats [k, n], on the engine in use (bf16_engine()): the products of the
/// attention kernels whose blocks are made per task (the HMHA levels, the sparse fine stages). B is
/// packed into `ops` (one task's, at most a few hundred keys), then one bf16_gemm over the whole depth;
/// on Tiles the caller's task holds a Bf16Tiles. Each element is one sum whatever the task.
template <class Rhs>
void bf16_product(const float* a, Index lda, Index rows, const Rhs& rhs, bool accumulate, float* c, Index ldc,
                  Bf16Operands& ops) {
  if (rows == 0 || rhs.cols() == 0) return;
  ops.b.pack(rhs, 1);
  ops.a.prepare(a, lda, rows, rhs.rows(), ops.b.engine());
  bf16_gemm(ops.a, ops.b, 0, rhs.rows(), 0, rhs.cols(), nullptr, accumulate, c, ldc);
}

/// A packet of floats rounded to bfloat16 values (round_bf16 on each lane), in registers.
template <class Packet>
inline Packet round_bf16_packet(const Packet& x) {
  constexpr int kP = Eigen::internal::unpacket_traits<Packet>::size;
#if defined(EIGEN_VECTORIZE_AVX512)
  if constexpr (kP == 16) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 nan =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
#endif
#if defined(EIGEN_VECTORIZE_AVX2)
  if constexpr (kP == 8) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
#endif
  alignas(64) float lanes[kP];
  Eigen::internal::pstore(lanes, x);
  for (int i = 0; i < kP; ++i) lanes[i] = round_bf16(lanes[i]);
  return Eigen::internal::pload<Packet>(lanes);
}

/// A float rounded to the nearest bfloat16 value, as an Eigen functor that rounds a packet at a time where
/// the expression vectorises (RoundBf16 rounds value by value, from any input type): for operands rounded
/// inside an expression instead of into a copy.
struct RoundBf16Floats {
  float operator()(float x) const { return round_bf16(x); }
  template <class Packet>
  Packet packetOp(const Packet& x) const {
    return round_bf16_packet(x);
  }
};

/// out = x rounded to bfloat16 values, rows × cols values (x's rows `ldx` apart, out's `ldo`), a packet
/// of floats at a time, in one pass; out may be x (ldo = ldx).
template <class Scalar>
void round_bf16_rows(const Scalar* x, Index ldx, Index rows, Index cols, Scalar* out, Index ldo) {
  for (Index r = 0; r < rows; ++r) {
    const Scalar* row = x + r * ldx;
    Scalar* dst = out + r * ldo;
    Index c = 0;
    if constexpr (std::is_same<Scalar, float>::value) {
      using Packet = typename GemmBlocking<float>::Packet;
      for (; c + GemmBlocking<float>::kP <= cols; c += GemmBlocking<float>::kP) {
        Eigen::internal::pstoreu(dst + c, round_bf16_packet(Eigen::internal::ploadu<Packet>(row + c)));
      }
    }
    for (; c < cols; ++c) dst[c] = static_cast<Scalar>(round_bf16(static_cast<float>(row[c])));
  }
}

/// Rounds rows × cols values (rows `ld` apart) to bfloat16 values in place.
template <class Scalar>
void round_bf16_rows(Scalar* x, Index rows, Index cols, Index ld) {
  round_bf16_rows<Scalar>(x, ld, rows, cols, x, ld);
}

/// Rounds every value of m to a bfloat16 value in place: the operands of a kernel that keeps Compute::BFloat16
/// on Eigen's products (fp32 products of rounded values, as the fallback engine's).
template <class Scalar>
void round_bf16_matrix(RowMatrix<Scalar>& m) {
  round_bf16_rows(m.data(), m.rows(), m.cols(), m.cols());
}

/// out = `block` (float, Eigen::half or Eigen::bfloat16 values) converted to Scalar and rounded to bfloat16.
template <class Scalar, class Block>
void round_bf16_copy(const Block& block, RowMatrix<Scalar>& out) {
  detail::convert_block<Scalar>(block, out);
  round_bf16_matrix(out);
}

/// as_scalar(block, scratch, fn) — fn on `block` as a Scalar matrix — with the values rounded to bfloat16
/// first when `bf16` (Compute::BFloat16's keys and values in the kernels that keep Eigen's products).
template <class Scalar, class Block, class Fn>
void as_scalar_rounded(const Block& block, RowMatrix<Scalar>& scratch, bool bf16, Fn&& fn) {
  if (bf16) {
    round_bf16_copy(block, scratch);
    fn(static_cast<const RowMatrix<Scalar>&>(scratch));
  } else {
    detail::as_scalar(block, scratch, fn);
  }
}

/// Fewer rows than this take bf16_gemm_rows (no packing) in kernels::matmul_rows.
constexpr Index kBf16PackedMinRows = 32;

/// The bfloat16 product of few rows without packing B: for i < rows, o < cols
///   c[i·ldc + o] = Σ_k round(a[i·lda + k]) · round(w[o·ldw + k]) (+ bias[o])
/// — B = wᵀ read in place, w's rows rounded in registers; for a decode step, whose one row would not pay
/// for packing the weight. The sums are in fp32, in another order than bf16_gemm's.
inline void bf16_gemm_rows(const float* a, Index lda, Index rows, const float* w, Index ldw, Index depth, Index cols,
                           const float* bias, float* c, Index ldc) {
  using Packet = typename GemmBlocking<float>::Packet;
  constexpr Index kP = GemmBlocking<float>::kP;
  Bf16A rounded;  // A's rows rounded as floats, rows `depth` apart (the fallback's form)
  rounded.prepare(a, lda, rows, depth, Bf16Engine::Fallback);
  const float* ar = rounded.floats();
  for (Index i0 = 0; i0 < rows; i0 += 4) {
    const Index ni = std::min<Index>(4, rows - i0);
    for (Index o = 0; o < cols; ++o) {
      const float* wo = w + o * ldw;
      Packet acc[4] = {Eigen::internal::pset1<Packet>(0.0f), Eigen::internal::pset1<Packet>(0.0f),
                       Eigen::internal::pset1<Packet>(0.0f), Eigen::internal::pset1<Packet>(0.0f)};
      Index k = 0;
      for (; k + kP <= depth; k += kP) {
        const Packet wv = round_bf16_packet(Eigen::internal::ploadu<Packet>(wo + k));
        for (Index i = 0; i < ni; ++i) {
          acc[i] = Eigen::internal::pmadd(Eigen::internal::ploadu<Packet>(ar + (i0 + i) * depth + k), wv, acc[i]);
        }
      }
      for (Index i = 0; i < ni; ++i) {
        float sum = Eigen::internal::predux(acc[i]);
        for (Index kk = k; kk < depth; ++kk) sum += ar[(i0 + i) * depth + kk] * round_bf16(wo[kk]);
        c[(i0 + i) * ldc + o] = bias != nullptr ? bias[o] + sum : sum;
      }
    }
  }
}

/// Configures this thread's tile registers for bf16_gemm_range while it lives (where the engine is
/// Tiles; else nothing), and releases them after: construct one in each task that calls it.
class Bf16Tiles {
 public:
  explicit Bf16Tiles(Bf16Engine engine) : on_(engine == Bf16Engine::Tiles) {
#if C2F_AMX_POSSIBLE
    if (on_) amx_configure();
#endif
  }
  ~Bf16Tiles() {
#if C2F_AMX_POSSIBLE
    if (on_) amx_release();
#endif
  }
  Bf16Tiles(const Bf16Tiles&) = delete;
  Bf16Tiles& operator=(const Bf16Tiles&) = delete;

 private:
  bool on_;
};

}  // namespace cpu
}  // namespace c2f

namespace Eigen {
namespace internal {
template <>
struct functor_traits<c2f::cpu::RoundBf16Floats> {
  enum { Cost = 6, PacketAccess = true };
};
}  // namespace internal
}  // namespace Eigen
