// Attention throughput next to the machine's GEMM throughput, measured in the same run.
//
// Shapes: batch 1, d = E = 512, 8 heads, self-attention of length L, 2 threads.
// Analytic FLOPs (a multiply-add counts 2; softmax and exp are not counted):
//   GEMM          2·L·E·E                       one [L, E] × [E, E] projection: the roofline reference
//   MHA           8·L·E·E + 4·L·L·E             q, k, v, out projections; q kᵀ and p v over all heads
//   C2F (folded)  16·m·E·E + 4·m·m·E + 4·L·H·E + L·E,  m = ceil(L / chunk):
//                 coarse qkv + out (8·m·E²), coarse attention (4·m²·E), fine q_proj, key fold, value
//                 fold and out_proj (8·m·E²), per-chunk scores and pooling (4·L·H·E), chunk means (L·E)
//   HMHA          14·L·E·E + 4·L·W·E + 4·n·n·E + 4·L·|S|·E,  n = ceil(L / W), |S| = 2·ceil(log2 L) + 1:
//                 three C3K2 projections (conv3 3·L·E², conv2 L·E² each) and out_proj (2·L·E²), level 1
//                 (full windows), level 2 (window means), level 3 (|S| keys per token)
#include <benchmark/benchmark.h>

#include "c2f/kernels/linear.hpp"
#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/multihead_attention.hpp"

#include <cmath>
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
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
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

void BM_C2F(benchmark::State& state) {
  const Eigen::Index length = state.range(0), chunk = state.range(1);
  const c2f::C2FAttention<float> c2f_attn(kEmbed, kHeads, chunk, {kThreads, c2f::FinePath::Auto, 0});
  const c2f::Tensor3<float> x = random_input(length);
  for (auto _ : state) {
    c2f::Tensor3<float> y = c2f_attn.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
  const double L = double(length), E = double(kEmbed), H = double(kHeads);
  const double m = double((length + chunk - 1) / chunk);
  set_counters(state, 16.0 * m * E * E + 4.0 * m * m * E + 4.0 * L * H * E + L * E, length);
  state.counters["workspace_bytes"] = double(c2f_attn.fine_attn().folded_workspace_bytes(1, length, chunk));
}

void BM_HMHA(benchmark::State& state) {
  const Eigen::Index length = state.range(0), window = state.range(1);
  c2f::HMHA<float>::Options options;
  options.num_threads = kThreads;
  const c2f::HMHA<float> hmha(kEmbed, kHeads, window, options);
  const c2f::Tensor3<float> x = random_input(length);
  for (auto _ : state) {
    c2f::Tensor3<float> y = hmha.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
  const double L = double(length), E = double(kEmbed), W = double(window);
  const double n = double((length + window - 1) / window);
  const double keys = 2.0 * std::ceil(std::log2(L)) + 1.0;
  set_counters(state, 14.0 * L * E * E + 4.0 * L * W * E + 4.0 * n * n * E + 4.0 * L * keys * E, length);
}

}  // namespace

BENCHMARK(BM_Gemm)->ArgsProduct({{1024, 4096}, {1, kThreads}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Mha, streaming, c2f::AttentionKernel::Streaming)
    ->RangeMultiplier(4)->Range(1024, 16384)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Mha, naive, c2f::AttentionKernel::Naive)
    ->RangeMultiplier(2)->Range(256, 1024)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_C2F)->ArgsProduct({{1024, 4096, 16384}, {32}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_HMHA)
    ->ArgsProduct({{1024, 2048, 4096, 8192, 16384, 32768}, {64}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();
