// Shared by the benchmark binaries: the thread count, fast deterministic inputs, the common counters and
// the machine's rooflines measured in the same run as the entries they are compared with: the FMA peaks
// (fp32 and, where the CPU has them, bf16 dot products: AVX512_BF16's vdpbf16ps and AMX's tile product)
// and the memory bandwidths.
#pragma once

#include <benchmark/benchmark.h>

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/detail/parallel.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define C2F_BENCH_X86 1
#else
#define C2F_BENCH_X86 0
#endif

namespace c2f_bench {

using Eigen::Index;

/// Threads of every entry: C2F_BENCH_THREADS, default 2 (the machine's cores).
inline int bench_threads() {
  const char* env = std::getenv("C2F_BENCH_THREADS");
  return env != nullptr ? std::atoi(env) : 2;
}

/// Wall-clock seconds since `start` (steady clock).
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Fills with uniform values in [-1, 1) from a counter-based hash: fast, parallel, deterministic.
inline void fill(float* data, Index n, std::uint64_t seed) {
  c2f::detail::parallel_for((n + 65535) / 65536, bench_threads(), [&](Index task, int) {
    const Index end = std::min(n, (task + 1) * 65536);
    for (Index i = task * 65536; i < end; ++i) {
      std::uint64_t z = (seed + static_cast<std::uint64_t>(i)) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z ^= z >> 27;
      data[i] = static_cast<float>(static_cast<double>(z >> 40) * 0x1.0p-23 - 1.0);
    }
  });
}

/// FLOP and GFLOPS, bytes, GB/s (when bytes > 0), tokens/s and L (when tokens > 0), threads.
inline void set_counters(benchmark::State& state, double flop, double bytes, Index tokens) {
  state.counters["FLOP"] = flop;
  state.counters["GFLOPS"] = benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  if (bytes > 0) {
    state.counters["bytes"] = bytes;
    state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  }
  if (tokens > 0) {
    state.counters["tokens/s"] = benchmark::Counter(double(tokens), benchmark::Counter::kIsIterationInvariantRate);
    state.counters["L"] = double(tokens);
  }
  state.counters["threads"] = bench_threads();
}

/// STREAM's copy, y = x over two buffers of range(0) bytes each, allocated and touched before timing;
/// bytes = 2 × size (STREAM's count: one read and one write per element) — the memory roofline.
inline void BM_Copy(benchmark::State& state) {
  const Index n = state.range(0) / Index(sizeof(float));
  Eigen::VectorXf x(n), y(n);
  fill(x.data(), n, 1);
  y.setZero();  // touch every page before timing
  const int threads = bench_threads();
  constexpr Index kPart = 1 << 20;
  for (auto _ : state) {
    c2f::detail::parallel_for((n + kPart - 1) / kPart, threads, [&](Index task, int) {
      const Index begin = task * kPart, len = std::min(kPart, n - begin);
      y.segment(begin, len) = x.segment(begin, len);
    });
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, 0.0, 2.0 * double(n) * sizeof(float), 0);
}

/// A read-only stream: the sum of a buffer of range(0) bytes; bytes = size — the roofline of a kernel
/// that only reads (decoding's key/value scan).
inline void BM_Read(benchmark::State& state) {
  const Index n = state.range(0) / Index(sizeof(float));
  Eigen::VectorXf x(n);
  fill(x.data(), n, 2);
  const int threads = bench_threads();
  constexpr Index kPart = 1 << 20;
  const Index parts = (n + kPart - 1) / kPart;
  Eigen::VectorXf partial(parts);
  for (auto _ : state) {
    c2f::detail::parallel_for(parts, threads, [&](Index task, int) {
      const Index begin = task * kPart, len = std::min(kPart, n - begin);
      partial[task] = x.segment(begin, len).sum();
    });
    benchmark::DoNotOptimize(partial.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, 0.0, double(n) * sizeof(float), 0);
}

// The compute roofline: register-only loops of independent multiply-adds, the widest the CPU has (checked
// at run time, so a portable build measures the same peak as a native one). kAccumulators independent
// chains hide the FMA latency on two FMA pipes (latency 4–5 cycles × 2 pipes ≤ 12); the values stay
// finite (x ← x·a + b with a < 1) and are summed at the end so the loop cannot be removed.
// GCC 12 at -O1 (the dev preset, which builds bench_attention) reports the _mm256_undefined_pd() inside
// _mm512_reduce_add_ps as used uninitialized: a false positive of the intrinsic's own header.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
namespace peak {
constexpr int kAccumulators = 12;

#if C2F_BENCH_X86
__attribute__((target("avx512f"))) inline float fma_avx512(std::int64_t iterations) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(0.001f * float(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
  for (std::int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx2,fma"))) inline float fma_avx2(std::int64_t iterations) {
  __m256 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_set1_ps(0.001f * float(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-6f);
  for (std::int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm256_add_ps(sum, acc[i]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.0f;
  for (float v : lanes) total += v;
  return total;
}

// The fp32 FMA peak with a GEMM's loads: c2f's register-blocked micro-kernel (c2f::cpu::gemm_tile: a kMR ×
// kNR tile of C in registers, each k-step loading kNP vectors of a packed B panel and broadcasting kMR
// values of A) on operands that stay in L1 (A kMR × 256, B 256 × kNR), call after call. Its ceiling on
// this CPU; the register-only loop above has no loads. Returns FLOP per iteration (one k-step).
inline double gemm_tile_l1(std::int64_t iterations, float* sink) {
  using B = c2f::cpu::GemmBlocking<float>;
  constexpr c2f::Index kDepth = 256;
  std::vector<float> a(static_cast<std::size_t>(B::kMR * kDepth), 1e-3f),
      b(static_cast<std::size_t>(kDepth * B::kNR), 1e-3f), c(static_cast<std::size_t>(B::kMR * B::kNR), 0.0f);
  for (std::int64_t it = 0; it < iterations; it += kDepth) {
    c2f::cpu::gemm_tile<float, B::kMR>(kDepth, a.data(), kDepth, b.data(), c.data(), B::kNR, B::kNR, it == 0, nullptr);
  }
  *sink += c[0];
  return 2.0 * B::kMR * B::kNR;
}

// vdpbf16ps: 16 lanes × 2 bf16 products summed into fp32 — 64 FLOP per instruction.
__attribute__((target("avx512f,avx512bf16"))) inline float bf16_avx512(std::int64_t iterations) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(0.001f * float(i));
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(-1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
  for (std::int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 sum = acc[0];
  for (int i = 1; i < kAccumulators; ++i) sum = _mm512_add_ps(sum, acc[i]);
  return _mm512_reduce_add_ps(sum);
}

// AMX (Sapphire Rapids on): tdpbf16ps multiplies a tile of 16 × 32 bf16 by one of 32 × 16 into a 16 × 16
// fp32 tile, 16·16·32·2 = 16384 FLOP per instruction. Four accumulator tiles (0-3) from two A tiles (4, 5)
// and two B tiles (6, 7) that stay in the tile registers: no memory operand in the loop. The tile layout is
// c2f's bf16 engine's (eight tiles of 16 rows × 64 bytes, c2f/cpu/bf16_gemm.hpp).
#if C2F_AMX_POSSIBLE
__attribute__((target("amx-tile,amx-bf16"))) inline float amx_bf16(std::int64_t iterations) {
  c2f::cpu::amx_configure();
  alignas(64) std::uint16_t ab[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) ab[i] = i % 2 ? 0x3a83 : 0xba83;  // ±1e-3 in bf16: the sums stay small
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (std::int64_t it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[4][16 * 16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  _tile_release();
  float sum = 0.0f;
  for (const auto& tile : c) {
    for (float v : tile) sum += v;
  }
  return sum;
}
#endif  // C2F_AMX_POSSIBLE
#endif

/// Whether the CPU has AMX-BF16 and Linux lets this process use the tile registers (c2f's own check, which
/// asks for the permission once per process).
inline bool has_amx_bf16() { return c2f::cpu::cpu_has_amx_bf16(); }

/// The widest fp32 FMA this CPU runs: "avx512f" (16 lanes), "avx2+fma" (8 lanes), or "" (none).
inline std::string fp32_isa() {
#if C2F_BENCH_X86
  if (__builtin_cpu_supports("avx512f")) return "avx512f";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2+fma";
#endif
  return "";
}

/// Whether the CPU has AVX512_BF16's vdpbf16ps.
inline bool has_bf16_dot() {
#if C2F_BENCH_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

/// FLOP of one loop iteration of `kind` ("fp32", "bf16" or "amx_bf16") on this CPU, and runs `iterations` of it.
inline double run(const std::string& kind, std::int64_t iterations, float* sink) {
#if C2F_BENCH_X86
  const std::string isa = fp32_isa();
  if (kind == "bf16") {
    *sink += bf16_avx512(iterations);
    return 64.0 * kAccumulators;
  }
  if (kind == "fp32_tile") return gemm_tile_l1(iterations / 2, sink) / 2.0;  // a k-step: 2·kMR multiply-adds
  if (kind == "amx_bf16") {  // a trip is 16 times longer than the vector loops': 1/16 of the trips
#if C2F_AMX_POSSIBLE
    *sink += amx_bf16(iterations / 16);
#endif
    return 4.0 * 16384.0 / 16.0;
  }
  if (isa == "avx512f") {
    *sink += fma_avx512(iterations);
    return 32.0 * kAccumulators;
  }
  *sink += fma_avx2(iterations);
  return 16.0 * kAccumulators;
#else
  (void)kind;
  (void)iterations;
  (void)sink;
  return 0.0;
#endif
}
}  // namespace peak
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// Runs `kind` for `iterations` on `sinks.size()` threads at once, one std::thread per loop (not c2f's pool,
/// whose workers claim tasks: one could run two loops); returns the FLOP of one iteration.
inline double run_on_threads(const std::string& kind, std::int64_t iterations, std::vector<float>& sinks) {
  std::vector<std::thread> team;
  for (std::size_t t = 1; t < sinks.size(); ++t) team.emplace_back([&, t] { peak::run(kind, iterations, &sinks[t]); });
  const double flop_per_iteration = peak::run(kind, iterations, &sinks[0]);
  for (std::thread& member : team) member.join();
  benchmark::DoNotOptimize(sinks.data());
  return flop_per_iteration;
}

/// The FMA peak of `kind` ("fp32", "fp32_tile", "bf16", "amx_bf16") on range(0) threads: each thread runs the
/// loop for the same number of iterations at once. Skipped (with the reason) where the CPU lacks the ISA.
/// GFLOPS is the rate of the fastest timed call (GFLOPS_mean: of all of them): a register-only loop does
/// the same work every call, so a slower call is time the VM gave to others (steal), which would lower the
/// limit every entry is divided by. bench_machine gives each peak 2 s of calls, to outlast a VM's short
/// slow phases (docs/benchmarks.md#rooflines).
inline void BM_Peak(benchmark::State& state, const std::string& kind) {
  const int threads = static_cast<int>(state.range(0));
  const bool runs = kind == "bf16"       ? peak::has_bf16_dot()
                    : kind == "amx_bf16" ? peak::has_amx_bf16()
                                         : !peak::fp32_isa().empty();
  if (!runs) {
    state.SkipWithError(kind == "bf16"       ? "this CPU has no AVX512_BF16 (vdpbf16ps)"
                        : kind == "amx_bf16" ? "this CPU or kernel has no AMX-BF16 (tdpbf16ps)"
                                             : "this CPU has no AVX2+FMA or AVX-512");
    return;
  }
  constexpr std::int64_t kIterations = 1 << 24;
  std::vector<float> sinks(static_cast<std::size_t>(threads), 0.0f);
  double flop_per_iteration = 0.0, fastest = std::numeric_limits<double>::infinity();
  for (auto _ : state) {
    const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    flop_per_iteration = run_on_threads(kind, kIterations, sinks);
    fastest = std::min(fastest, seconds_since(start));
  }
  const double flop = flop_per_iteration * double(kIterations) * threads;
  state.counters["FLOP"] = flop;
  state.counters["GFLOPS"] = flop * 1e-9 / fastest;
  state.counters["GFLOPS_mean"] = benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
  state.SetLabel(kind == "fp32" || kind == "fp32_tile" ? peak::fp32_isa() : kind == "bf16" ? "avx512bf16" : "amx-bf16");
}

/// The fp32 FMA peaks measured next to each timed call of an entry, on a machine whose speed moves between
/// (and within) entries: a VM whose host gives it more or less of its cores from one second to the next,
/// or whose cores' other hyperthreads run someone else's loads (docs/benchmarks.md#layer-entries-and-paired-peaks).
/// measure() runs, on `threads` std::threads at once, the register-only loop ("fp32") and then c2f's
/// micro-kernel on L1-resident operands ("fp32_tile"), each for about `seconds`, and returns both in
/// GFLOP/s. An entry divides each call's rate by the readings taken just before it: a phase in which the
/// VM gets less of the cores lowers both the call and the readings and leaves their ratio; one in which a
/// neighbour competes for the loads shows as a tile reading below the register-only one.
class PairedPeak {
 public:
  struct Reading {
    double fma = 0.0, tile = 0.0;  ///< GFLOP/s of the register-only loop and of the L1-resident tile
  };

  explicit PairedPeak(int threads) : sinks_(static_cast<std::size_t>(std::max(1, threads)), 0.0f) {}

  /// Whether this CPU has a loop to measure (AVX2+FMA or AVX-512).
  static bool available() { return !peak::fp32_isa().empty(); }

  Reading measure(double seconds) {
    return {rate("fp32", seconds, fma_per_second_), rate("fp32_tile", seconds, tile_per_second_)};
  }

 private:
  /// GFLOP/s of `kind` on the threads for about `seconds`; `per_second` (iterations per second per
  /// thread) sizes the run from the last one (calibrated on a short run the first time) and is updated.
  double rate(const char* kind, double seconds, double& per_second) {
    constexpr std::int64_t kCalibration = 1 << 16, kMinIterations = 1 << 12;
    if (per_second <= 0.0) {
      const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
      peak::run(kind, kCalibration, &sinks_[0]);
      per_second = double(kCalibration) / seconds_since(start);
    }
    const std::int64_t iterations =
        std::max<std::int64_t>(kMinIterations, static_cast<std::int64_t>(seconds * per_second));
    const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    const double flop_per_iteration = run_on_threads(kind, iterations, sinks_);
    const double elapsed = seconds_since(start);
    per_second = double(iterations) / elapsed;
    return flop_per_iteration * double(iterations) * double(sinks_.size()) * 1e-9 / elapsed;
  }

  std::vector<float> sinks_;  ///< one per thread
  double fma_per_second_ = 0.0, tile_per_second_ = 0.0;
};

}  // namespace c2f_bench
