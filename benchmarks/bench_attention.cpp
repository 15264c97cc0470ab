// c2f's benchmark sweep: attention layers next to the machine's GEMM throughput, all in one run.
//
//   bench_attention [--c2f_sweep=quick|long] [Google Benchmark flags]
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
//   GFLOPS     FLOP / wall time
//   tokens/s   L / wall time
//   peak_bytes heap memory held at once during one forward, beyond what existed before it (input and
//              weights), measured by counting every malloc (tools/malloc_counter.hpp); includes the output
//   rel_error  (sparse entries) ‖y − y_MHA‖ / ‖y_MHA‖ against full MultiHeadAttention (causal for the
//              causal entries) with the same weights on the same input: a smooth random walk plus noise
//              (inputs with local structure)
#include <benchmark/benchmark.h>

#include "c2f/kernels/linear.hpp"
#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/sparse_c2f_attention.hpp"
#include "tools/malloc_counter.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using Eigen::Index;

constexpr Index kEmbed = 512;
constexpr Index kHeads = 8;
constexpr Index kWindow = 64;

int bench_threads() {
  const char* env = std::getenv("C2F_BENCH_THREADS");
  return env != nullptr ? std::atoi(env) : 2;
}

c2f::Tensor3<float> random_input(Index length) {
  std::mt19937 gen(42);
  std::normal_distribution<float> normal;
  c2f::Tensor3<float> x(1, length, kEmbed);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(gen);
  return x;
}

// Times `forward` and records the counters; the malloc counter runs during the timed loop (each
// iteration frees what it allocated, so the peak over the loop is the peak of one forward).
template <class Forward>
void run(benchmark::State& state, double flops, Index length, Forward&& forward) {
  c2f_memory::reset();
  for (auto _ : state) {
    c2f::Tensor3<float> y = forward();
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  c2f_memory::stop();
  state.counters["FLOP"] = flops;
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(double(length), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_bytes"] = double(c2f_memory::peak_bytes());
  state.counters["L"] = double(length);
  state.counters["threads"] = bench_threads();
}

void BM_Gemm(benchmark::State& state) {
  const Index length = state.range(0);
  const c2f::RowMatrix<float> x = c2f::RowMatrix<float>::Random(length, kEmbed);
  const c2f::RowMatrix<float> w = c2f::RowMatrix<float>::Random(kEmbed, kEmbed);
  const int threads = bench_threads();
  run(state, 2.0 * double(length) * kEmbed * kEmbed, length, [&] {
    c2f::Tensor3<float> y(1, length, kEmbed);
    Eigen::Map<c2f::RowMatrix<float>> out(y.data(), length, kEmbed);
    c2f::kernels::linear<float>(x, w, nullptr, out, threads);
    return y;
  });
}

void BM_Mha(benchmark::State& state, c2f::AttnKernel kernel) {
  const Index length = state.range(0);
  const c2f::MultiHeadAttention<float> mha(
      kEmbed, kHeads, c2f::MultiHeadAttention<float>::Options().num_threads(bench_threads()).kernel(kernel));
  const c2f::Tensor3<float> x = random_input(length);
  const double L = double(length), E = double(kEmbed);
  run(state, 8.0 * L * E * E + 4.0 * L * L * E, length, [&] { return mha.forward(x); });
}

void BM_C2F(benchmark::State& state) {
  const Index length = state.range(0), chunk = state.range(1);
  const c2f::C2FAttention<float> attn(kEmbed, kHeads, chunk, c2f::C2FAttention<float>::Options().num_threads(bench_threads()));
  const c2f::Tensor3<float> x = random_input(length);
  const double L = double(length), E = double(kEmbed), H = double(kHeads);
  const double m = double((length + chunk - 1) / chunk);
  run(state, 16.0 * m * E * E + 4.0 * m * m * E + 4.0 * L * H * E + L * E, length, [&] { return attn.forward(x); });
  state.counters["chunk"] = double(chunk);
}

void BM_HMHA(benchmark::State& state) {
  const Index length = state.range(0), window = state.range(1);
  const c2f::HMHA<float> hmha(kEmbed, kHeads, window, c2f::HMHA<float>::Options().num_threads(bench_threads()));
  const c2f::Tensor3<float> x = random_input(length);
  const double L = double(length), E = double(kEmbed), W = double(window);
  const double n = double((length + window - 1) / window);
  const double keys = 2.0 * std::ceil(std::log2(L)) + 1.0;
  run(state, 14.0 * L * E * E + 4.0 * L * W * E + 4.0 * n * n * E + 4.0 * L * keys * E, length,
      [&] { return hmha.forward(x); });
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

void BM_Sparse(benchmark::State& state) {
  const Index length = state.range(0), chunk = state.range(1), top_k = state.range(2), mode = state.range(3);
  const bool causal = mode == kPerTokenCausal;
  const c2f::SparseC2FAttention<float> sparse(
      kEmbed, kHeads, chunk, top_k,
      c2f::SparseC2FAttention<float>::Options()
          .num_threads(bench_threads())
          .causal(causal)
          .gating(mode == kPerChunk ? c2f::Gating::PerChunk : c2f::Gating::PerToken));
  const SparseReference& ref = sparse_reference(sparse.as_multihead_attention(), length, causal);
  const Index m = (length + chunk - 1) / chunk;
  const double L = double(length), E = double(kEmbed), keys = double(std::min(top_k, m) * chunk);
  // Chunk scores: m² summaries (per chunk) or L·m (per token; causal: about half of them).
  const double scores = mode == kPerChunk ? double(m * m) : (causal ? 0.5 : 1.0) * L * double(m);
  run(state, 8.0 * L * E * E + 2.0 * scores * E + 4.0 * L * keys * E, length,
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
  for (Index L : lengths) {
    benchmark::RegisterBenchmark("gemm", BM_Gemm)->Arg(L)->Unit(benchmark::kMillisecond)->UseRealTime();
    benchmark::RegisterBenchmark("mha_streaming", BM_Mha, c2f::AttnKernel::Streaming)
        ->Arg(L)->Unit(benchmark::kMillisecond)->UseRealTime();
    if (L <= naive_max) {
      benchmark::RegisterBenchmark("mha_naive", BM_Mha, c2f::AttnKernel::Naive)
          ->Arg(L)->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    for (Index chunk : chunks) {
      benchmark::RegisterBenchmark("c2f", BM_C2F)->Args({L, chunk})->Unit(benchmark::kMillisecond)->UseRealTime();
    }
  }
  for (Index L : hmha_lengths) {
    benchmark::RegisterBenchmark("hmha", BM_HMHA)->Args({L, kWindow})->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  for (Index L : {Index(4096), Index(16384)}) {
    for (Index top_k : {1, 2, 4, 8, 16, 32}) {
      for (Index mode : {kPerChunk, kPerToken, kPerTokenCausal}) {
        const char* name = mode == kPerChunk ? "sparse" : (mode == kPerToken ? "sparse_token" : "sparse_token_causal");
        benchmark::RegisterBenchmark(name, BM_Sparse)->Args({L, 64, top_k, mode})->Unit(benchmark::kMillisecond)->UseRealTime();
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool long_sweep = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--c2f_sweep=long") == 0) {
      long_sweep = true;
    } else if (std::strcmp(argv[i], "--c2f_sweep=quick") != 0) {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  register_sweep(long_sweep);
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("c2f_sweep", long_sweep ? "long" : "quick");
  benchmark::AddCustomContext("c2f_threads", std::to_string(bench_threads()));
  benchmark::AddCustomContext("c2f_isa", Eigen::SimdInstructionSetsInUse());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
