// MultiHeadAttention throughput next to the machine's GEMM throughput, measured in the same run.
//
// Shapes: batch 1, embed_dim E = 512, 8 heads, self-attention of length L, 2 threads.
// Analytic FLOPs (multiply-add = 2):
//   projections  4 · 2·L·E·E     (q, k, v and out_proj)
//   attention    2 · 2·L·L·E     (q kᵀ and p v over all heads; softmax not counted)
//   GEMM         2·L·E·E         (one [L, E] × [E, E] projection — the roofline reference)
#include <benchmark/benchmark.h>

#include "c2f/kernels/linear.hpp"
#include "c2f/layers/multihead_attention.hpp"

#include <random>

namespace {

constexpr Eigen::Index kEmbed = 512;
constexpr Eigen::Index kHeads = 8;
constexpr int kThreads = 2;

c2f::Tensor3<float> random_input(Eigen::Index length) {
  std::mt19937 gen(42);
  std::normal_distribution<float> normal;
  c2f::Tensor3<float> x(1, length, kEmbed);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = normal(gen);
  return x;
}

void set_counters(benchmark::State& state, double flops, Eigen::Index length) {
  state.counters["FLOP"] = flops;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(length), benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Gemm(benchmark::State& state) {
  const Eigen::Index length = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  const c2f::RowMatrix<float> x = c2f::RowMatrix<float>::Random(length, kEmbed);
  const c2f::RowMatrix<float> w = c2f::RowMatrix<float>::Random(kEmbed, kEmbed);
  c2f::RowMatrix<float> y(length, kEmbed);
  for (auto _ : state) {
    c2f::kernels::linear<float>(x, w, nullptr, y, threads);
    benchmark::DoNotOptimize(y.data());
  }
  set_counters(state, 2.0 * double(length) * kEmbed * kEmbed, length);
}

void BM_Mha(benchmark::State& state, c2f::AttentionKernel kernel) {
  const Eigen::Index length = state.range(0);
  c2f::MultiHeadAttention<float>::Options options;
  options.num_threads = kThreads;
  options.kernel = kernel;
  const c2f::MultiHeadAttention<float> mha(kEmbed, kHeads, options);
  const c2f::Tensor3<float> x = random_input(length);
  for (auto _ : state) {
    c2f::Tensor3<float> y = mha.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
  const double L = double(length), E = double(kEmbed);
  set_counters(state, 8.0 * L * E * E + 4.0 * L * L * E, length);
  state.counters["workspace_bytes"] = double(mha.workspace_bytes(1, length, length));
}

}  // namespace

BENCHMARK(BM_Gemm)->ArgsProduct({{1024, 4096}, {1, kThreads}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Mha, streaming, c2f::AttentionKernel::Streaming)
    ->RangeMultiplier(2)->Range(256, 4096)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Mha, naive, c2f::AttentionKernel::Naive)
    ->RangeMultiplier(2)->Range(256, 2048)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
