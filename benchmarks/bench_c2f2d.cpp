// Two-dimensional coarse-to-fine attention (C2FAttention2D) against the machine's two rooflines, all in one run.
//
//   bench_c2f2d [--c2f2d_sweep=full|quick] [Google Benchmark flags]
//
// full (default): square grids of 32², 64², 128², 256², 512², 1024² tokens × blocks 8², 16², 32², 64²
// (blocks no larger than the grid); quick: grids to 256² plus the 1024² grid with 64 × 64 blocks.
// Every entry: batch 1, d = 512, 8 heads, float, relative position bias on (table = the block grid),
// C2F_BENCH_THREADS threads (default 2).
//
// Entries:
//   copy          STREAM's copy, y = x over 2 × 256 MiB, buffers allocated and touched before timing:
//                 bytes = 2 × size (STREAM's count: one read and one write per element) — the memory
//                 roofline
//   gemm          [4096, 512] × [512, 512] as kernels::linear — the compute roofline (GFLOPS)
//   c2f2d         C2FAttention2D::forward (returns a freshly allocated output)
//   c2f2d_into    C2FAttention2D::forward_into a caller buffer reused across calls (1024² only): the same
//                 work without the first-touch page faults of a fresh 2 GiB output
//   new_output    allocate a fresh [L, d] float tensor, prepare it as forward() does
//                 (detail::prepare_fresh: huge pages advised, pages faulted in on the threads) and write
//                 each row once (1024² only): what forward() pays for a new 2 GiB output before any
//                 attention
//   mha           MultiHeadAttention on the same tokens (32², 64², 128²; beyond, the summary
//                 extrapolates its fitted log-log slope)
//
// Counters:
//   FLOP        analytic floating-point operations of one forward (a multiply-add counts 2; softmax and
//               normalisation are not counted). c2f2d, m blocks, L tokens, E = 512, H = 8:
//                 16·m·E² + 4·m²·E + 4·L·H·E + L·E
//               (coarse qkv + out 8·m·E², coarse attention 4·m²·E, fine q_proj + key fold + value fold +
//               out_proj 8·m·E², per-block scores + pooling 4·L·H·E, block means L·E); mha 8·L·E² + 4·L²·E
//   bytes       c2f2d: the [L, E] traffic counted like STREAM: x read twice (block means, then the fine
//               stage) and y written once, 3·L·E·4 bytes (weights and per-block rows are < 1 % and not
//               counted); copy: 2 × size
//   GFLOPS, GB/s, tokens/s   per wall-clock second
//   peak_bytes  heap held at once during one forward beyond what existed before it (the input and the
//               weights), measured by counting every malloc (tools/malloc_counter.hpp); includes the output
#include <benchmark/benchmark.h>

#include "benchmarks/csv_reporter.hpp"
#include "benchmarks/rooflines.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/layers/c2f_attention_2d.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "tools/malloc_counter.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

using c2f_bench::bench_threads;
using c2f_bench::BM_Copy;
using c2f_bench::fill;
using c2f_bench::set_counters;
using Eigen::Index;

constexpr Index kEmbed = 512;
constexpr Index kHeads = 8;

// One input per grid side, made once (the 1024² input is 2 GiB).
const c2f::Tensor3<float>& input(Index side) {
  static std::map<Index, std::unique_ptr<c2f::Tensor3<float>>> cache;
  std::unique_ptr<c2f::Tensor3<float>>& x = cache[side];
  if (!x) {
    x = std::make_unique<c2f::Tensor3<float>>(1, side * side, kEmbed);
    fill(x->data(), x->size(), static_cast<std::uint64_t>(side));
  }
  return *x;
}

double c2f2d_flop(Index tokens, Index blocks) {
  const double L = double(tokens), m = double(blocks), E = double(kEmbed), H = double(kHeads);
  return 16.0 * m * E * E + 4.0 * m * m * E + 4.0 * L * H * E + L * E;
}

void BM_Gemm(benchmark::State& state) {
  const Index length = state.range(0);
  const c2f::RowMatrix<float> x = c2f::RowMatrix<float>::Random(length, kEmbed);
  const c2f::RowMatrix<float> w = c2f::RowMatrix<float>::Random(kEmbed, kEmbed);
  c2f::RowMatrix<float> y(length, kEmbed);
  const int threads = bench_threads();
  for (auto _ : state) {
    c2f::kernels::linear<float>(x, w, nullptr, y, c2f::kernels::with_threads(threads));
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, 2.0 * double(length) * kEmbed * kEmbed, 0.0, length);
}

c2f::C2FAttention2D<float> make_layer(Index side, Index block) {
  const Index blocks = (side + block - 1) / block;
  return c2f::C2FAttention2D<float>(
      kEmbed, kHeads, block, block,
      c2f::C2FAttention2D<float>::Options().max_blocks_h(blocks).max_blocks_w(blocks).num_threads(bench_threads()));
}

void BM_C2F2D(benchmark::State& state) {
  const Index side = state.range(0), block = state.range(1), tokens = side * side;
  const c2f::C2FAttention2D<float> attn = make_layer(side, block);
  const c2f::Tensor3<float>& x = input(side);
  c2f::release_scratch_cache();  // the first call allocates every temporary
  c2f_memory::reset();
  for (auto _ : state) {
    c2f::Tensor3<float> y = attn.forward(x, side, side);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  c2f_memory::stop();
  const Index m = ((side + block - 1) / block) * ((side + block - 1) / block);
  set_counters(state, c2f2d_flop(tokens, m), 3.0 * double(tokens) * kEmbed * sizeof(float), tokens);
  state.counters["peak_bytes"] = double(c2f_memory::peak_bytes());
  state.counters["input_bytes"] = double(x.size()) * sizeof(float);
  state.counters["blocks"] = double(m);
  state.counters["block"] = double(block);
}

void BM_C2F2DInto(benchmark::State& state) {
  const Index side = state.range(0), block = state.range(1), tokens = side * side;
  const c2f::C2FAttention2D<float> attn = make_layer(side, block);
  const c2f::Tensor3<float>& x = input(side);
  c2f::RowMatrix<float> out(tokens, kEmbed);
  attn.forward_into(x, side, side, out);  // touches the output's pages
  c2f::release_scratch_cache();           // the first call allocates every temporary
  c2f_memory::reset();
  for (auto _ : state) {
    attn.forward_into(x, side, side, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  c2f_memory::stop();
  const Index m = ((side + block - 1) / block) * ((side + block - 1) / block);
  set_counters(state, c2f2d_flop(tokens, m), 3.0 * double(tokens) * kEmbed * sizeof(float), tokens);
  state.counters["peak_bytes"] = double(c2f_memory::peak_bytes());
  state.counters["blocks"] = double(m);
  state.counters["block"] = double(block);
}

// What a fresh [L, d] output costs before any attention: allocate it and write every row once (the
// operating system maps and zeroes each new page on first touch).
void BM_NewOutput(benchmark::State& state) {
  const Index side = state.range(0), tokens = side * side;
  const Eigen::Matrix<float, 1, Eigen::Dynamic> row = Eigen::Matrix<float, 1, Eigen::Dynamic>::Constant(kEmbed, 0.5f);
  const int threads = bench_threads();
  for (auto _ : state) {
    c2f::Tensor3<float> y(1, tokens, kEmbed);
    c2f::detail::prepare_fresh(y, threads);  // as forward() prepares its output (detail::fresh_output)
    Eigen::Map<c2f::RowMatrix<float>> rows(y.data(), tokens, kEmbed);
    c2f::detail::parallel_for((tokens + 4095) / 4096, threads, [&](Index task, int) {
      const Index begin = task * 4096;
      rows.middleRows(begin, std::min<Index>(4096, tokens - begin)).rowwise() = row;
    });
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, 0.0, double(tokens) * kEmbed * sizeof(float), tokens);
}

void BM_Mha(benchmark::State& state) {
  const Index side = state.range(0), tokens = side * side;
  c2f::MultiHeadAttention<float>::Options options;
  options.num_threads(bench_threads());
  const c2f::MultiHeadAttention<float> mha(kEmbed, kHeads, options);
  const c2f::Tensor3<float>& x = input(side);
  c2f::release_scratch_cache();  // the first call allocates every temporary
  c2f_memory::reset();
  for (auto _ : state) {
    c2f::Tensor3<float> y = mha.forward(x);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  c2f_memory::stop();
  const double L = double(tokens), E = double(kEmbed);
  set_counters(state, 8.0 * L * E * E + 4.0 * L * L * E, 0.0, tokens);
  state.counters["peak_bytes"] = double(c2f_memory::peak_bytes());
}

// Seconds one forward should take on 2 cores (~25 GFLOPS, ~10 GB/s): sets repetitions and iterations so
// that cheap entries repeat often and a minute-long one runs once.
double estimated_seconds(double flop, double bytes) { return flop / 25e9 + bytes / 10e9; }

void configure(benchmark::internal::Benchmark* b, double seconds) {
  b->Unit(benchmark::kMillisecond)->UseRealTime();
  if (seconds < 0.05) {
    b->MinTime(0.2)->Repetitions(5);
  } else {
    b->Iterations(1)->Repetitions(seconds < 3.0 ? 5 : (seconds < 15.0 ? 3 : 1));
  }
  b->ReportAggregatesOnly(true);
}

void register_sweep(bool quick) {
  configure(benchmark::RegisterBenchmark("copy", BM_Copy)->Arg(Index(256) << 20), 0.01);
  configure(benchmark::RegisterBenchmark("gemm", BM_Gemm)->Arg(4096), 0.01);
  const std::vector<Index> sides = {32, 64, 128, 256, 512, 1024};
  for (Index side : sides) {
    for (Index block : {8, 16, 32, 64}) {
      if (block > side || (quick && side > 256 && !(side == 1024 && block == 64))) continue;
      const Index tokens = side * side, m = ((side + block - 1) / block) * ((side + block - 1) / block);
      const double bytes = 3.0 * double(tokens) * kEmbed * sizeof(float);
      configure(benchmark::RegisterBenchmark("c2f2d", BM_C2F2D)->Args({side, block}),
                estimated_seconds(c2f2d_flop(tokens, m), bytes));
      if (side == 1024 && block == 64) {
        configure(benchmark::RegisterBenchmark("c2f2d_into", BM_C2F2DInto)->Args({side, block}),
                  estimated_seconds(c2f2d_flop(tokens, m), bytes));
        configure(benchmark::RegisterBenchmark("new_output", BM_NewOutput)->Arg(side), 0.5);
      }
    }
    if (side <= 128) {
      const double L = double(side * side), E = double(kEmbed);
      configure(benchmark::RegisterBenchmark("mha", BM_Mha)->Arg(side),
                estimated_seconds(8 * L * E * E + 4 * L * L * E, 0));
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--c2f2d_sweep=quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--c2f2d_sweep=full") != 0) {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  register_sweep(quick);
  c2f_bench::Runner runner(&n, args.data());  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("c2f2d_sweep", quick ? "quick" : "full");
  benchmark::AddCustomContext("c2f_threads", std::to_string(bench_threads()));
  benchmark::AddCustomContext("c2f_isa", Eigen::SimdInstructionSetsInUse());
  runner.run();
  benchmark::Shutdown();
  return 0;
}
