// c2f's benchmark sweep: attention layers next to the machine's GEMM throughput, all in one run.
//
//   bench_attention [--c2f_sweep=quick|long] [Google Benchmark flags]
//   bench_attention --c2f_peer_weights=W.safetensors --c2f_peer_input=X.safetensors --c2f_peer_output=Y.safetensors
//                   [--c2f_peer_time=R]
//
// The second form serves the peers (benchmarks/torch_peer.py, ort_peer.py), which need c2f's output on the
// peer's own weights and input before they time their own runtime. With --c2f_peer_time=R it then times R
// more forwards of the same layer on the same input (the first call, whose output it wrote, is the
// warm-up) and prints {"runs_ms": [...]} as its last line: ort_peer.py alternates such rounds with ORT's,
// so that both sides of a ratio run in the same minute of a shared machine. W holds a layer's PyTorch state dict
// and, in its __metadata__, the layer: layer = mha | c2f | hmha | sparse, embed_dim, num_heads, and
// chunk_size (c2f, sparse), window (hmha), top_k and gating = chunk | token (sparse). X holds "x"
// [1, L, embed_dim]. The layer is built as the benchmark entries build it (same options, threads) and
// its output is written to Y as "y".
//
// quick (default, about 2 minutes on 2 cores): L ∈ {256, 1024, 2048, 4096, 8192, 16384};
// long: L ∈ {256, 512, …, 16384} (HMHA to 32768), the naive kernel to 4096.
// Every entry: batch 1, d = E = 512, 8 heads, 2 threads (C2F_BENCH_THREADS overrides), float.
//
// Counters:
//   FLOP       analytic floating-point operations of one forward (a multiply-add counts 2; softmax, exp
//              and normalisation are not counted):
//                GEMM          2·L·E·E                  one [L, E] × [E, E] projection — the roofline
//                MHA           8·L·E·E + 4·L·L·E         q, k, v, out projections; q kᵀ and p v (all heads)
//                C2F (folded)  16·m·E·E + 4·m·m·E + 4·L·H·E + L·E,  m = ceil(L / chunk):
//                              coarse qkv + out (8·m·E²), coarse attention (4·m²·E), fine q_proj, key fold,
//                              value fold, out_proj (8·m·E²), per-chunk scores + pooling (4·L·H·E), means (L·E)
//                HMHA          14·L·E·E + 4·L·W·E + 4·n·n·E + 4·L·|S|·E,  n = ceil(L / W),
//                              |S| = 2·ceil(log2 L) + 1: three C3K2 projections (4·L·E² each) and out_proj
//                              (2·L·E²), level 1 (full windows), level 2 (window means), level 3
//                Sparse C2F    8·L·E² + 2·C·E + 4·L·S·E,  m = ceil(L / chunk), S = min(top_k, m)·chunk
//                              keys per query: projections, chunk scores, fine attention over the selection;
//                              C = m·m (per-chunk gating), L·m (per-token), L·m / 2 (per-token, causal)
//   bytes      bytes that must move between memory and the cores in one forward, at the least: read x
//              [L, E] and the weights, write y [L, E] (4 bytes a float); the weights are
//                GEMM 1 [E, E] matrix; MHA and Sparse C2F 4·E² + 4·E (in_proj, out_proj);
//                C2F 8·E² + 8·E (coarse qkv + out, fine q, kv, out); HMHA 7·E² + 4·E (three C3K2
//                projections, 2·E² + E each, and out_proj)
//              copy and triad (the memory roofline, STREAM's kernels and byte counts): copy y = x moves
//              2 × 4·n bytes, triad a = b + s·c moves 3 × 4·n bytes, over arrays of n = 64 Mi floats
//              (256 MiB each, 8 × this machine's 32 MiB L3), touched before timing; C2F_BENCH_THREADS
//              threads, each streaming its own contiguous parts
//   intensity  FLOP / bytes (arithmetic intensity). sweep.py compares it with the machine balance of the
//              same run (GEMM GFLOP/s ÷ copy GB/s): above it the GEMM roofline binds, below it memory
//   GFLOPS     FLOP / wall time
//   GB/s       bytes / wall time
// Every entry measures the CPU time of the whole process (Google Benchmark's "CPU" column): CPU ÷ wall
// time is the number of cores the entry really got — about C2F_BENCH_THREADS on a quiet machine, less
// when other processes share the cores.
//   tokens/s   L / wall time
//   peak_bytes heap memory held at once during one forward (from an empty scratch cache), beyond what existed before it
//   (input and
//              weights), measured by counting every malloc (tools/malloc_counter.hpp); includes the output
//   first_call_ms  wall time of the entry's first call, which is not timed: it allocates the scratch the
//              timed calls reuse (every entry times the calls after it)
//   paired_peak, pct_paired_peak, paired_tile_peak, pct_paired_tile_peak  (entries with FLOP, where the
//              CPU has AVX2+FMA or AVX-512, and whose calls take 5 ms or more) before each timed call,
//              untimed, the fp32 FMA peaks are read on the entry's threads, each for half as long as the
//              previous call took, at most 10 ms (rooflines.hpp, PairedPeak): the register-only loop
//              (paired_peak, their mean in GFLOP/s) and c2f's micro-kernel on L1-resident operands
//              (paired_tile_peak); pct_* is the median over the calls of 100 × the call's GFLOP/s ÷ the
//              reading just before it — the entry's fraction of each peak, read in the same moments
//   rel_error  (sparse entries) ‖y − y_MHA‖ / ‖y_MHA‖ against full MultiHeadAttention (causal for the
//              causal entries) with the same weights on the same input: a smooth random walk plus noise
//              (inputs with local structure)
#include <benchmark/benchmark.h>

#include "benchmarks/csv_reporter.hpp"
#include "benchmarks/rooflines.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/sparse_c2f_attention.hpp"
#include "tools/malloc_counter.hpp"
#if C2F_BENCH_PEER
#include "c2f/io/safetensors.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Eigen::Index;

constexpr Index kEmbed = 512;
constexpr Index kHeads = 8;
constexpr Index kWindow = 64;

using c2f_bench::bench_threads;

c2f::Tensor3<float> random_input(Index length) {
  std::mt19937 gen(42);
  std::normal_distribution<float> normal;
  c2f::Tensor3<float> x(1, length, kEmbed);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(gen);
  return x;
}

// Times `forward` and records the counters; the malloc counter runs from the first, untimed call through
// the timed loop (each call frees what it allocated, so the peak is the peak of one forward).
// Weights of each layer, in floats (the "bytes" counter above).
constexpr double kE = double(kEmbed);
constexpr double kMhaWeights = 4.0 * kE * kE + 4.0 * kE;
constexpr double kC2FWeights = 8.0 * kE * kE + 8.0 * kE;
constexpr double kHmhaWeights = 7.0 * kE * kE + 4.0 * kE;

// Bytes a forward must move: x and y ([L, E] floats each) and the weights.
double must_move_bytes(Index length, double weight_floats) { return 4.0 * (2.0 * double(length) * kE + weight_floats); }

template <class Forward>
void run(benchmark::State& state, double flops, double bytes, Index length, Forward&& forward) {
  // Each timed call follows readings of the FMA peaks (untimed), each half as long as the call, at most
  // 10 ms: the call's rate over them is its fraction of the machine at that moment (PairedPeak). Only
  // where the first call took kPairedMinSeconds or more: after a reading c2f's pool worker has gone to
  // sleep, and waking it (tens to hundreds of µs on a VM) would slow a shorter call. Set up before the
  // malloc counter starts (a reading allocates a few KiB, freed at once).
  constexpr double kPairedMinSeconds = 0.005;
  bool pair = flops > 0 && c2f_bench::PairedPeak::available();
  c2f_bench::PairedPeak paired(bench_threads());
  std::vector<double> fractions, tile_fractions;
  fractions.reserve(std::size_t(1) << 16);
  tile_fractions.reserve(fractions.capacity());
  c2f_bench::PairedPeak::Reading sums;
  c2f::release_scratch_cache();  // the first call allocates every temporary
  c2f_memory::reset();
  // The first call, untimed (counter first_call_ms): it allocates the scratch later calls reuse and
  // touches memory at a size no earlier entry touched (on a VM the host backs such pages then). Without
  // it an entry that Google Benchmark runs once (a call of ~0.5 s or more) timed a cold call alone.
  const auto call = [&] {
    decltype(auto) y = forward();  // a fresh tensor, or (forward_into) a reference to the reused one
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  };
  const std::chrono::steady_clock::time_point first = std::chrono::steady_clock::now();
  call();
  double last = c2f_bench::seconds_since(first);
  const double first_ms = 1e3 * last;
  pair = pair && last >= kPairedMinSeconds;
  for (auto _ : state) {
    c2f_bench::PairedPeak::Reading peak;
    if (pair) {
      state.PauseTiming();
      peak = paired.measure(std::min(0.01, last / 2));
      state.ResumeTiming();
    }
    const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    call();
    last = c2f_bench::seconds_since(start);
    if (pair && fractions.size() < fractions.capacity()) {
      fractions.push_back(flops * 1e-9 / last / peak.fma);
      tile_fractions.push_back(flops * 1e-9 / last / peak.tile);
      sums.fma += peak.fma;
      sums.tile += peak.tile;
    }
  }
  c2f_memory::stop();
  if (!fractions.empty()) {
    const auto median = [](std::vector<double>& v) {
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      return v[v.size() / 2];
    };
    state.counters["paired_peak"] = sums.fma / double(fractions.size());
    state.counters["paired_tile_peak"] = sums.tile / double(fractions.size());
    state.counters["pct_paired_peak"] = 100.0 * median(fractions);
    state.counters["pct_paired_tile_peak"] = 100.0 * median(tile_fractions);
  }
  state.counters["FLOP"] = flops;
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(double(length), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_bytes"] = double(c2f_memory::peak_bytes());
  state.counters["bytes"] = bytes;
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["intensity"] = flops / bytes;
  state.counters["L"] = double(length);
  state.counters["threads"] = bench_threads();
  state.counters["first_call_ms"] = first_ms;
}

// Uniform values in [-1, 1) from a counter-based hash, written by the benchmark's threads (so each
// thread first-touches the pages it streams later).
void fill(float* data, Index n, std::uint64_t seed, Index part, int threads) {
  c2f::detail::parallel_for((n + part - 1) / part, threads, [&](Index task, int) {
    const Index end = std::min(n, (task + 1) * part);
    for (Index i = task * part; i < end; ++i) {
      std::uint64_t z = (seed + static_cast<std::uint64_t>(i)) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z ^= z >> 27;
      data[i] = static_cast<float>(static_cast<double>(z >> 40) * 0x1.0p-23 - 1.0);
    }
  });
}

constexpr Index kStreamFloats = Index(64) << 20;  // 256 MiB per array
constexpr Index kStreamPart = Index(1) << 20;     // 4 MiB per task

void set_stream_counters(benchmark::State& state, double bytes) {
  state.counters["bytes"] = bytes;
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = bench_threads();
}

// STREAM's copy: y = x; 2 × 4·n bytes per pass (one read, one write per element, as STREAM counts).
void BM_Copy(benchmark::State& state) {
  const Index n = state.range(0);
  const int threads = bench_threads();
  std::vector<float> x(static_cast<std::size_t>(n)), y(static_cast<std::size_t>(n));
  fill(x.data(), n, 1, kStreamPart, threads);
  fill(y.data(), n, 2, kStreamPart, threads);
  for (auto _ : state) {
    c2f::detail::parallel_for((n + kStreamPart - 1) / kStreamPart, threads, [&](Index task, int) {
      const Index begin = task * kStreamPart, end = std::min(n, begin + kStreamPart);
      const float* __restrict src = x.data();
      float* __restrict dst = y.data();
      for (Index i = begin; i < end; ++i) dst[i] = src[i];
    });
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_stream_counters(state, 2.0 * 4.0 * double(n));
}

// STREAM's triad: a = b + s·c; 3 × 4·n bytes per pass (two reads, one write per element).
void BM_Triad(benchmark::State& state) {
  const Index n = state.range(0);
  const int threads = bench_threads();
  std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n)), c(static_cast<std::size_t>(n));
  fill(a.data(), n, 1, kStreamPart, threads);
  fill(b.data(), n, 2, kStreamPart, threads);
  fill(c.data(), n, 3, kStreamPart, threads);
  const float scalar = 3.0f;
  for (auto _ : state) {
    c2f::detail::parallel_for((n + kStreamPart - 1) / kStreamPart, threads, [&](Index task, int) {
      const Index begin = task * kStreamPart, end = std::min(n, begin + kStreamPart);
      float* __restrict out = a.data();
      const float* __restrict in1 = b.data();
      const float* __restrict in2 = c.data();
      for (Index i = begin; i < end; ++i) out[i] = in1[i] + scalar * in2[i];
    });
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  set_stream_counters(state, 3.0 * 4.0 * double(n));
}

void BM_Gemm(benchmark::State& state) {
  const Index length = state.range(0);
  const c2f::RowMatrix<float> x = c2f::RowMatrix<float>::Random(length, kEmbed);
  const c2f::RowMatrix<float> w = c2f::RowMatrix<float>::Random(kEmbed, kEmbed);
  const int threads = bench_threads();
  // The output is reused: the reference point times the product, not the page faults of a fresh output
  // (at L = 16384 a fresh 32 MiB output had made this entry 3-4x slower than L = 8192 per row).
  c2f::RowMatrix<float> y(length, kEmbed);
  run(state, 2.0 * double(length) * kEmbed * kEmbed, must_move_bytes(length, kE * kE), length,
      [&]() -> const c2f::RowMatrix<float>& {
        c2f::kernels::linear<float>(x, w, nullptr, y, c2f::kernels::with_threads(threads));
        return y;
      });
}

// MultiHeadAttention::forward() with `kernel`, its products in fp32 or (mha_bf16) bfloat16.
void BM_Mha(benchmark::State& state, c2f::AttnKernel kernel, c2f::Compute compute) {
  const Index length = state.range(0);
  const c2f::MultiHeadAttention<float> mha(
      kEmbed, kHeads,
      c2f::MultiHeadAttention<float>::Options().num_threads(bench_threads()).kernel(kernel).compute(compute));
  const c2f::Tensor3<float> x = random_input(length);
  const double L = double(length), E = double(kEmbed);
  run(state, 8.0 * L * E * E + 4.0 * L * L * E, must_move_bytes(length, kMhaWeights), length,
      [&] { return mha.forward(x); });
}

// C2FAttention::forward(), or with `into` forward_into() a buffer reused across iterations (no fresh
// output pages to fault in and zero); its products in fp32 or (c2f_bf16, c2f_bf16_into) bfloat16.
void BM_C2F(benchmark::State& state, bool into, c2f::Compute compute) {
  const Index length = state.range(0), chunk = state.range(1);
  const c2f::C2FAttention<float> attn(
      kEmbed, kHeads, chunk, c2f::C2FAttention<float>::Options().num_threads(bench_threads()).compute(compute));
  const c2f::Tensor3<float> x = random_input(length);
  c2f::Tensor3<float> out(1, into ? length : 0, kEmbed);
  out.setZero();
  const double L = double(length), E = double(kEmbed), H = double(kHeads);
  const double m = double((length + chunk - 1) / chunk);
  const double flops = 16.0 * m * E * E + 4.0 * m * m * E + 4.0 * L * H * E + L * E;
  if (into) {
    run(state, flops, must_move_bytes(length, kC2FWeights), length, [&]() -> const c2f::Tensor3<float>& {
      attn.forward_into(x, Eigen::Map<c2f::RowMatrix<float>>(out.data(), length, kEmbed));
      return out;
    });
  } else {
    run(state, flops, must_move_bytes(length, kC2FWeights), length, [&] { return attn.forward(x); });
  }
  state.counters["chunk"] = double(chunk);
}

// HMHA::forward(), its products in fp32 or (hmha_bf16) bfloat16.
void BM_HMHA(benchmark::State& state, c2f::Compute compute) {
  const Index length = state.range(0), window = state.range(1);
  const c2f::HMHA<float> hmha(kEmbed, kHeads, window,
                              c2f::HMHA<float>::Options().num_threads(bench_threads()).compute(compute));
  const c2f::Tensor3<float> x = random_input(length);
  const double L = double(length), E = double(kEmbed), W = double(window);
  const double n = double((length + window - 1) / window);
  const double keys = 2.0 * std::ceil(std::log2(L)) + 1.0;
  run(state, 14.0 * L * E * E + 4.0 * L * W * E + 4.0 * n * n * E + 4.0 * L * keys * E,
      must_move_bytes(length, kHmhaWeights), length, [&] { return hmha.forward(x); });
  state.counters["window"] = double(window);
}

// A smooth random walk plus noise along the sequence, per feature: nearby positions look alike.
c2f::Tensor3<float> random_walk_input(Index length) {
  std::mt19937 gen(7);
  std::normal_distribution<float> normal;
  c2f::Tensor3<float> x(1, length, kEmbed);
  std::vector<float> level(static_cast<std::size_t>(kEmbed), 0.f);
  for (Index t = 0; t < length; ++t) {
    for (Index j = 0; j < kEmbed; ++j) {
      level[static_cast<std::size_t>(j)] += 0.1f * normal(gen);
      x(0, t, j) = level[static_cast<std::size_t>(j)] + 0.3f * normal(gen);
    }
  }
  return x;
}

// Input and full-MHA output (causal or not) per length, computed once (outside any timing).
struct SparseReference {
  c2f::Tensor3<float> x, y;
};
const SparseReference& sparse_reference(const c2f::MultiHeadAttention<float>& mha, Index length, bool causal) {
  static std::map<std::pair<Index, bool>, SparseReference> cache;
  auto it = cache.find({length, causal});
  if (it == cache.end()) {
    SparseReference ref{random_walk_input(length), {}};
    c2f::Masks<float> masks;
    if (causal) masks.attn_mask(c2f::AttnMask<float>::causal());
    ref.y = mha.forward(ref.x, masks);
    it = cache.emplace(std::make_pair(length, causal), std::move(ref)).first;
  }
  return it->second;
}

// Sparse gating modes of the benchmark entries.
enum SparseMode : Index { kPerChunk = 0, kPerToken = 1, kPerTokenCausal = 2 };

// SparseC2FAttention::forward() in one gating, its products in fp32 or (sparse…_bf16) bfloat16.
void BM_Sparse(benchmark::State& state, c2f::Compute compute) {
  const Index length = state.range(0), chunk = state.range(1), top_k = state.range(2), mode = state.range(3);
  const bool causal = mode == kPerTokenCausal;
  const c2f::SparseC2FAttention<float> sparse(
      kEmbed, kHeads, chunk, top_k,
      c2f::SparseC2FAttention<float>::Options()
          .num_threads(bench_threads())
          .causal(causal)
          .gating(mode == kPerChunk ? c2f::Gating::PerChunk : c2f::Gating::PerToken)
          .compute(compute));
  const SparseReference& ref = sparse_reference(sparse.as_multihead_attention(), length, causal);
  const Index m = (length + chunk - 1) / chunk;
  const double L = double(length), E = double(kEmbed), keys = double(std::min(top_k, m) * chunk);
  // Chunk scores: m² summaries (per chunk) or L·m (per token; causal: about half of them).
  const double scores = mode == kPerChunk ? double(m * m) : (causal ? 0.5 : 1.0) * L * double(m);
  run(state, 8.0 * L * E * E + 2.0 * scores * E + 4.0 * L * keys * E, must_move_bytes(length, kMhaWeights), length,
      [&] { return sparse.forward(ref.x); });
  const c2f::Tensor3<float> y = sparse.forward(ref.x);
  double err = 0.0, norm = 0.0;
  for (Index i = 0; i < y.size(); ++i) {
    err += double(y.data()[i] - ref.y.data()[i]) * double(y.data()[i] - ref.y.data()[i]);
    norm += double(ref.y.data()[i]) * double(ref.y.data()[i]);
  }
  state.counters["rel_error"] = std::sqrt(err / norm);
  state.counters["chunk"] = double(chunk);
  state.counters["top_k"] = double(top_k);
}

void register_sweep(bool long_sweep) {
  std::vector<Index> lengths = {256, 1024, 2048, 4096, 8192, 16384};
  Index naive_max = 1024;
  std::vector<Index> hmha_lengths = lengths;
  if (long_sweep) {
    lengths = {256, 512, 1024, 2048, 4096, 8192, 16384};
    naive_max = 4096;
    hmha_lengths = lengths;
    hmha_lengths.push_back(32768);
  }
  const std::vector<Index> chunks = {8, 16, 32, 64, 128, 256};
  // Milliseconds, wall-clock time, and the whole process's CPU time (the cores an entry really got).
  const auto timed = [](benchmark::internal::Benchmark* b) {
    b->Unit(benchmark::kMillisecond)->MeasureProcessCPUTime()->UseRealTime();
  };
  // The memory roofline first (a short entry each; sweep.py divides by it).
  timed(benchmark::RegisterBenchmark("copy", BM_Copy)->Arg(kStreamFloats));
  timed(benchmark::RegisterBenchmark("triad", BM_Triad)->Arg(kStreamFloats));
  // MultiHeadAttention from L = 4096 on (a call of 0.1 s or more: Google Benchmark times a few calls, at
  // L >= 8192 one) reports the median of 3 repetitions, as the peers report a median of their runs.
  const auto median_of_3 = [&timed](benchmark::internal::Benchmark* b, Index L) {
    timed(b);
    if (L >= 4096) b->Repetitions(3)->ReportAggregatesOnly(true);
  };
  for (Index L : lengths) {
    timed(benchmark::RegisterBenchmark("gemm", BM_Gemm)->Arg(L));
    median_of_3(benchmark::RegisterBenchmark("mha_streaming", BM_Mha, c2f::AttnKernel::Streaming, c2f::Compute::Float32)
                    ->Arg(L),
                L);
    median_of_3(
        benchmark::RegisterBenchmark("mha_bf16", BM_Mha, c2f::AttnKernel::Streaming, c2f::Compute::BFloat16)->Arg(L),
        L);
    if (L <= naive_max) {
      timed(benchmark::RegisterBenchmark("mha_naive", BM_Mha, c2f::AttnKernel::Naive, c2f::Compute::Float32)->Arg(L));
    }
    for (Index chunk : chunks)
      timed(benchmark::RegisterBenchmark("c2f", BM_C2F, false, c2f::Compute::Float32)->Args({L, chunk}));
    if (L >= 4096) {
      timed(benchmark::RegisterBenchmark("c2f_into", BM_C2F, true, c2f::Compute::Float32)->Args({L, Index(32)}));
      timed(benchmark::RegisterBenchmark("c2f_bf16", BM_C2F, false, c2f::Compute::BFloat16)->Args({L, Index(32)}));
      timed(benchmark::RegisterBenchmark("c2f_bf16_into", BM_C2F, true, c2f::Compute::BFloat16)->Args({L, Index(32)}));
    }
  }
  for (Index L : hmha_lengths) {
    timed(benchmark::RegisterBenchmark("hmha", BM_HMHA, c2f::Compute::Float32)->Args({L, kWindow}));
    timed(benchmark::RegisterBenchmark("hmha_bf16", BM_HMHA, c2f::Compute::BFloat16)->Args({L, kWindow}));
  }
  for (Index L : {Index(4096), Index(16384)}) {
    for (Index top_k : {1, 2, 4, 8, 16, 32}) {
      for (Index mode : {kPerChunk, kPerToken, kPerTokenCausal}) {
        const std::string name =
            mode == kPerChunk ? "sparse" : (mode == kPerToken ? "sparse_token" : "sparse_token_causal");
        timed(benchmark::RegisterBenchmark(name.c_str(), BM_Sparse, c2f::Compute::Float32)->Args({L, 64, top_k, mode}));
        if (top_k == 8) {
          timed(benchmark::RegisterBenchmark((name + "_bf16").c_str(), BM_Sparse, c2f::Compute::BFloat16)
                    ->Args({L, 64, top_k, mode}));
        }
      }
    }
  }
}

#if C2F_BENCH_PEER
// The peer mode (see the file comment).
class PeerRun {
 public:
  PeerRun(const std::string& weights_path, const std::string& input_path)
      : weights_path_(weights_path), weights_(c2f::load_safetensors(weights_path)) {
    const c2f::StateDict input = c2f::load_safetensors(input_path);
    const c2f::TensorData& t = input.at("x");
    if (t.shape().size() != 3 || t.shape()[0] != 1 || t.shape()[2] != meta_index("embed_dim")) {
      throw std::invalid_argument(input_path + ": expected \"x\" of shape [1, L, " +
                                  std::to_string(meta_index("embed_dim")) + "], got " + shape_text(t.shape()));
    }
    x_ = c2f::Tensor3<float>(t.shape()[0], t.shape()[1], t.shape()[2]);
    t.copy_to(x_.data());
  }

  // The layer named by the weights' metadata, built as the benchmark entries build it; its output on x,
  // then the wall-clock time of `timed` more forwards in runs_ms.
  c2f::Tensor3<float> forward(int timed, std::vector<double>& runs_ms) const {
    const std::string layer = meta("layer");
    const Index E = meta_index("embed_dim"), H = meta_index("num_heads");
    const int threads = bench_threads();
    // __metadata__ compute = bfloat16 (optional): Compute::BFloat16, the entries mha_bf16 and c2f_bf16.
    const auto compute_entry = weights_.metadata().find("compute");
    const c2f::Compute compute = compute_entry != weights_.metadata().end() && compute_entry->second == "bfloat16"
                                     ? c2f::Compute::BFloat16
                                     : c2f::Compute::Float32;
    if (layer == "mha") {
      return loaded(c2f::MultiHeadAttention<float>(E, H,
                                                   c2f::MultiHeadAttention<float>::Options()
                                                       .num_threads(threads)
                                                       .kernel(c2f::AttnKernel::Streaming)
                                                       .compute(compute)),
                    timed, runs_ms);
    }
    if (layer == "c2f") {
      return loaded(c2f::C2FAttention<float>(E, H, meta_index("chunk_size"),
                                             c2f::C2FAttention<float>::Options().num_threads(threads).compute(compute)),
                    timed, runs_ms);
    }
    if (layer == "hmha") {
      return loaded(c2f::HMHA<float>(E, H, meta_index("window"), c2f::HMHA<float>::Options().num_threads(threads)),
                    timed, runs_ms);
    }
    if (layer == "sparse") {
      const std::string gating = meta("gating");
      if (gating != "chunk" && gating != "token") {
        throw std::invalid_argument(weights_path_ + ": __metadata__ gating must be chunk or token, got '" + gating +
                                    "'");
      }
      return loaded(
          c2f::SparseC2FAttention<float>(E, H, meta_index("chunk_size"), meta_index("top_k"),
                                         c2f::SparseC2FAttention<float>::Options().num_threads(threads).gating(
                                             gating == "chunk" ? c2f::Gating::PerChunk : c2f::Gating::PerToken)),
          timed, runs_ms);
    }
    throw std::invalid_argument(weights_path_ + ": __metadata__ layer must be mha, c2f, hmha or sparse, got '" + layer +
                                "'");
  }

  std::string describe() const {
    std::string out = meta("layer");
    for (const auto& [key, value] : weights_.metadata()) {
      if (key != "layer") out += " " + key + "=" + value;
    }
    return out + " L=" + std::to_string(x_.dimension(1));
  }

 private:
  static std::string shape_text(const std::vector<std::int64_t>& shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
  std::string meta(const std::string& key) const {
    const auto it = weights_.metadata().find(key);
    if (it == weights_.metadata().end()) {
      throw std::invalid_argument(weights_path_ + ": __metadata__ has no '" + key + "'");
    }
    return it->second;
  }
  Index meta_index(const std::string& key) const {
    const std::string v = meta(key);
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < 1) {
      throw std::invalid_argument(weights_path_ + ": __metadata__ " + key + " must be a positive integer, got '" + v +
                                  "'");
    }
    return static_cast<Index>(n);
  }
  template <class Layer>
  c2f::Tensor3<float> loaded(Layer layer, int timed, std::vector<double>& runs_ms) const {
    layer.load_state_dict(weights_);
    c2f::Tensor3<float> y = layer.forward(x_);
    for (int i = 0; i < timed; ++i) {
      const auto start = std::chrono::steady_clock::now();
      const c2f::Tensor3<float> again = layer.forward(x_);
      runs_ms.push_back(1e3 * c2f_bench::seconds_since(start));
      benchmark::DoNotOptimize(again.data());
    }
    return y;
  }

  std::string weights_path_;
  c2f::StateDict weights_;
  c2f::Tensor3<float> x_;
};

int run_peer(const std::string& weights, const std::string& input, const std::string& output, int timed) {
  try {
    const PeerRun peer(weights, input);
    std::vector<double> runs_ms;
    const c2f::Tensor3<float> y = peer.forward(timed, runs_ms);
    c2f::StateDict out;
    out.set("y", c2f::TensorData::from_values(y.data(), {y.dimension(0), y.dimension(1), y.dimension(2)}));
    out.metadata()["c2f_threads"] = std::to_string(bench_threads());
    out.metadata()["c2f_isa"] = Eigen::SimdInstructionSetsInUse();
    c2f::save_safetensors(output, out);
    std::printf("c2f peer: %s -> %s\n", peer.describe().c_str(), output.c_str());
    if (timed > 0) {
      std::string line = "{\"runs_ms\": [";
      for (std::size_t i = 0; i < runs_ms.size(); ++i) line += (i ? ", " : "") + std::to_string(runs_ms[i]);
      std::printf("%s]}\n", line.c_str());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: peer mode failed: %s\n", e.what());
    return 1;
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  bool long_sweep = false;
  std::vector<char*> args;
  std::map<std::string, std::string> peer;  // --c2f_peer_* values
  for (int i = 0; i < argc; ++i) {
    const char* eq = std::strchr(argv[i], '=');
    if (std::strcmp(argv[i], "--c2f_sweep=long") == 0) {
      long_sweep = true;
    } else if (std::strncmp(argv[i], "--c2f_peer_", 11) == 0 && eq != nullptr) {
      peer[std::string(argv[i] + 11, static_cast<std::size_t>(eq - (argv[i] + 11)))] = eq + 1;
    } else if (std::strcmp(argv[i], "--c2f_sweep=quick") != 0) {
      args.push_back(argv[i]);
    }
  }
  if (!peer.empty()) {
    int timed = 0;
    for (const auto& [key, value] : peer) {
      if (key == "time") {
        char* end = nullptr;
        const long r = std::strtol(value.c_str(), &end, 10);
        if (value.empty() || *end != '\0' || r < 1 || r > 100000) {
          std::fprintf(stderr, "bench_attention: --c2f_peer_time must be a count of runs in [1, 100000], got '%s'\n",
                       value.c_str());
          return 1;
        }
        timed = static_cast<int>(r);
      } else if ((key != "weights" && key != "input" && key != "output") || value.empty()) {
        std::fprintf(stderr,
                     "bench_attention: unknown or empty --c2f_peer_%s; the peer mode takes "
                     "--c2f_peer_weights=W --c2f_peer_input=X --c2f_peer_output=Y [--c2f_peer_time=R]\n",
                     key.c_str());
        return 1;
      }
    }
    if (peer.size() != 3u + (timed > 0 ? 1u : 0u)) {
      std::fprintf(stderr,
                   "bench_attention: the peer mode needs all of --c2f_peer_weights, --c2f_peer_input and "
                   "--c2f_peer_output\n");
      return 1;
    }
#if C2F_BENCH_PEER
    return run_peer(peer["weights"], peer["input"], peer["output"], timed);
#else
    std::fprintf(stderr, "bench_attention: built without c2f::safetensors (nlohmann-json3-dev): no peer mode\n");
    return 1;
#endif
  }
  int n = static_cast<int>(args.size());
  register_sweep(long_sweep);
  c2f_bench::Runner runner(&n, args.data());  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("c2f_sweep", long_sweep ? "long" : "quick");
  benchmark::AddCustomContext("c2f_threads", std::to_string(bench_threads()));
  benchmark::AddCustomContext("c2f_isa", Eigen::SimdInstructionSetsInUse());
  runner.run();
  benchmark::Shutdown();
  return 0;
}
