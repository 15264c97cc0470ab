// c2f's thread runtime, measured: the OpenMP, latency and concurrency sweeps of the runtime targets, the cost of
// one parallel loop (which sets the small-work threshold) and the SIMD entries.
//
//   bench_runtime [--c2f_set=all|openmp|latency|concurrency|overhead|simd] [Google Benchmark flags]
//
// The same source is built four ways (benchmarks/CMakeLists.txt; the last two in Release builds only),
// and benchmarks/sweep.py puts them side by side:
//   bench_runtime            the build's own flags (-march=native with C2F_NATIVE, the main job's default)
//   bench_runtime_omp        + -fopenmp: c2f's pool, Eigen kept single-threaded inside c2f's tasks
//   bench_runtime_omploops   + -fopenmp -DC2F_PARALLEL_OPENMP: c2f's loops on OpenMP teams
//   bench_runtime_portable   no -march flag at all (SSE2 on x86-64), for the SIMD comparison
// Every entry: d = E = 512, 8 heads, float; C2F with chunk 32.
//
// Entries (arguments after the name, separated by '/'):
//   rt_gemm/L, rt_mha/L, rt_c2f/L/chunk     one forward with all of c2f's threads (get_num_threads())
//   lat_mha/B/L/threads/threshold           one forward of a [B, L, 512] input on 1 or 2 threads;
//   lat_c2f/B/L/threads/threshold           threshold 1 = the default small-work threshold, 0 = none
//   lat_gemm_mha/B, lat_gemm_c2f/B          the products alone that those layers compute at L = 1
//                                           (same kernels, preallocated outputs, 1 thread): the floor
//                                           the single-thread overhead is measured against
//   conc_mha/callers/threads                `callers` threads each calling forward once, at the same time,
//                                           on one shared MultiHeadAttention (L = 1024) with `threads`
//                                           threads per call; counter forwards_per_s = total throughput
//   loop/rows/threads/cold                  one parallel_for of 8 tasks, each a [rows, 64] × [64, 64]
//                                           product (work = 65536·rows FLOP), threshold off; cold 1 =
//                                           the pool has been idle for 2 ms before the loop (asleep)
#include <benchmark/benchmark.h>

#include "csv_reporter.hpp"

#include "c2f/kernels/linear.hpp"
#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/runtime.hpp"

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using c2f::RowMatrix;
using Eigen::Index;

constexpr Index kEmbed = 512;
constexpr Index kHeads = 8;
constexpr Index kChunk = 32;

c2f::Tensor3<float> random_input(Index batch, Index length, unsigned seed = 42) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  c2f::Tensor3<float> x(batch, length, kEmbed);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = normal(gen);
  return x;
}

// Restores the default small-work threshold when an entry ends.
struct Threshold {
  explicit Threshold(bool on) { c2f::set_min_parallel_work(on ? c2f::detail::kDefaultMinParallelWork : 0.0); }
  ~Threshold() { c2f::set_min_parallel_work(c2f::detail::kDefaultMinParallelWork); }
};

// ---- sweep (a): full-size forwards, all threads -------------------------------------------------

void BM_Gemm(benchmark::State& state) {
  const Index length = state.range(0);
  const RowMatrix<float> x = RowMatrix<float>::Random(length, kEmbed), w = RowMatrix<float>::Random(kEmbed, kEmbed);
  RowMatrix<float> y(length, kEmbed);
  for (auto _ : state) {
    c2f::kernels::linear<float>(x, w, nullptr, y, c2f::kernels::with_threads(0));
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * double(length) * kEmbed * kEmbed * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Mha(benchmark::State& state) {
  const Index length = state.range(0);
  const c2f::MultiHeadAttention<float> mha(kEmbed, kHeads);
  const c2f::Tensor3<float> x = random_input(1, length);
  for (auto _ : state) {
    c2f::Tensor3<float> y = mha.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
}

void BM_C2F(benchmark::State& state) {
  const Index length = state.range(0), chunk = state.range(1);
  const c2f::C2FAttention<float> attn(kEmbed, kHeads, chunk);
  const c2f::Tensor3<float> x = random_input(1, length);
  for (auto _ : state) {
    c2f::Tensor3<float> y = attn.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
}

// ---- sweep (b): latency of small calls -----------------------------------------------------------

void BM_LatencyMha(benchmark::State& state) {
  const Index batch = state.range(0), length = state.range(1);
  const Threshold threshold(state.range(3) != 0);
  const c2f::MultiHeadAttention<float> mha(
      kEmbed, kHeads, c2f::MultiHeadAttention<float>::Options().num_threads(static_cast<int>(state.range(2))));
  const c2f::Tensor3<float> x = random_input(batch, length);
  for (auto _ : state) {
    c2f::Tensor3<float> y = mha.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
}

void BM_LatencyC2F(benchmark::State& state) {
  const Index batch = state.range(0), length = state.range(1);
  const Threshold threshold(state.range(3) != 0);
  const c2f::C2FAttention<float> attn(
      kEmbed, kHeads, kChunk, c2f::C2FAttention<float>::Options().num_threads(static_cast<int>(state.range(2))));
  const c2f::Tensor3<float> x = random_input(batch, length);
  for (auto _ : state) {
    c2f::Tensor3<float> y = attn.forward(x);
    benchmark::DoNotOptimize(y.data());
  }
}

// MultiHeadAttention at L = 1 computes four [B, E] × [E, E] products (q, k, v and out projections).
void BM_LatencyGemmMha(benchmark::State& state) {
  const Index rows = state.range(0);
  const RowMatrix<float> x = RowMatrix<float>::Random(rows, kEmbed);
  std::vector<RowMatrix<float>> w(4, RowMatrix<float>::Random(kEmbed, kEmbed));
  const Eigen::VectorXf bias = Eigen::VectorXf::Random(kEmbed);
  RowMatrix<float> y(rows, kEmbed);
  for (auto _ : state) {
    for (const RowMatrix<float>& wi : w)
      c2f::kernels::linear<float>(x, wi, bias.data(), y, c2f::kernels::with_threads(1));
    benchmark::DoNotOptimize(y.data());
  }
}

// C2FAttention at L = 1 (one chunk per batch, B chunk rows) computes: the coarse MultiHeadAttention's
// four [B, E] × [E, E] products; the fine q_proj and out_proj ([B, E] × [E, E]); per head the key fold
// [B, dk] × [dk, E] and the value fold [B, E] × [E, dk].
void BM_LatencyGemmC2F(benchmark::State& state) {
  const Index rows = state.range(0), dk = kEmbed / kHeads;
  const RowMatrix<float> x = RowMatrix<float>::Random(rows, kEmbed);
  std::vector<RowMatrix<float>> w(6, RowMatrix<float>::Random(kEmbed, kEmbed));
  const RowMatrix<float> wkv = RowMatrix<float>::Random(2 * kEmbed, kEmbed);
  const Eigen::VectorXf bias = Eigen::VectorXf::Random(kEmbed);
  RowMatrix<float> y(rows, kEmbed), qk(rows, kHeads * kEmbed), o(rows, kEmbed);
  const RowMatrix<float> pooled = RowMatrix<float>::Random(rows, kHeads * kEmbed);
  for (auto _ : state) {
    for (const RowMatrix<float>& wi : w)
      c2f::kernels::linear<float>(x, wi, bias.data(), y, c2f::kernels::with_threads(1));
    for (Index h = 0; h < kHeads; ++h) {
      c2f::kernels::matmul_rows<float>(x.middleCols(h * dk, dk), wkv.topRows(kEmbed).middleRows(h * dk, dk) * 0.125f,
                                       nullptr, qk.middleCols(h * kEmbed, kEmbed), c2f::kernels::with_threads(1));
    }
    for (Index h = 0; h < kHeads; ++h) {
      c2f::kernels::matmul_rows<float>(pooled.middleCols(h * kEmbed, kEmbed),
                                       wkv.bottomRows(kEmbed).middleRows(h * dk, dk).transpose(), nullptr,
                                       o.middleCols(h * dk, dk), c2f::kernels::with_threads(1));
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::DoNotOptimize(qk.data());
    benchmark::DoNotOptimize(o.data());
  }
}

// ---- sweep (c): concurrent callers on one shared module -------------------------------------------

void BM_Concurrency(benchmark::State& state) {
  const int callers = static_cast<int>(state.range(0));
  const c2f::MultiHeadAttention<float> mha(
      kEmbed, kHeads, c2f::MultiHeadAttention<float>::Options().num_threads(static_cast<int>(state.range(1))));
  std::vector<c2f::Tensor3<float>> inputs;
  for (int k = 0; k < callers; ++k) inputs.push_back(random_input(1, 1024, 100 + static_cast<unsigned>(k)));
  for (auto _ : state) {
    std::vector<std::thread> others;
    for (int k = 1; k < callers; ++k) {
      others.emplace_back(
          [&, k] { benchmark::DoNotOptimize(mha.forward(inputs[static_cast<std::size_t>(k)]).data()); });
    }
    benchmark::DoNotOptimize(mha.forward(inputs[0]).data());
    for (std::thread& t : others) t.join();
  }
  state.counters["forwards_per_s"] = benchmark::Counter(double(callers), benchmark::Counter::kIsIterationInvariantRate);
}

// ---- the cost of one parallel loop ----------------------------------------------------------------

void BM_Loop(benchmark::State& state) {
  const Index rows = state.range(0), tasks = 8, dim = 64;
  const int threads = static_cast<int>(state.range(1));
  const bool cold = state.range(2) != 0;
  const Threshold threshold(false);
  const RowMatrix<float> x = RowMatrix<float>::Random(tasks * rows, dim), w = RowMatrix<float>::Random(dim, dim);
  RowMatrix<float> y(tasks * rows, dim);
  c2f::detail::parallel_for(tasks, threads, [&](Index, int) {});  // the pool exists before timing
  for (auto _ : state) {
    if (cold) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const auto start = std::chrono::steady_clock::now();
    c2f::detail::parallel_for(tasks, threads, [&](Index t, int) {
      y.middleRows(t * rows, rows).noalias() = x.middleRows(t * rows, rows) * w;
    });
    benchmark::DoNotOptimize(y.data());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  state.counters["work"] = double(2 * tasks * rows * dim * dim);
}

void register_entries(const std::string& set) {
  const bool all = set == "all";
  if (all || set == "openmp" || set == "simd") {
    if (all || set == "simd") {
      benchmark::RegisterBenchmark("rt_gemm", BM_Gemm)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    for (Index L : {256, 2048}) {
      benchmark::RegisterBenchmark("rt_mha", BM_Mha)->Arg(L)->Unit(benchmark::kMillisecond)->UseRealTime();
    }
    benchmark::RegisterBenchmark("rt_c2f", BM_C2F)->Args({16384, kChunk})->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  if (all || set == "latency") {
    for (Index B : {1, 8}) {
      for (Index L : {1, 8, 64, 256}) {
        for (int threads : {1, 2}) {
          for (int threshold : threads == 1 ? std::vector<int>{1} : std::vector<int>{1, 0}) {
            benchmark::RegisterBenchmark("lat_mha", BM_LatencyMha)
                ->Args({B, L, threads, threshold})
                ->Unit(benchmark::kMicrosecond)
                ->UseRealTime()
                ->MinTime(0.2);
            benchmark::RegisterBenchmark("lat_c2f", BM_LatencyC2F)
                ->Args({B, L, threads, threshold})
                ->Unit(benchmark::kMicrosecond)
                ->UseRealTime()
                ->MinTime(0.2);
          }
        }
      }
      benchmark::RegisterBenchmark("lat_gemm_mha", BM_LatencyGemmMha)
          ->Arg(B)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime()
          ->MinTime(0.2);
      benchmark::RegisterBenchmark("lat_gemm_c2f", BM_LatencyGemmC2F)
          ->Arg(B)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime()
          ->MinTime(0.2);
    }
  }
  if (all || set == "concurrency") {
    for (int callers : {1, 2, 4}) {
      for (int threads : {1, 2}) {
        benchmark::RegisterBenchmark("conc_mha", BM_Concurrency)
            ->Args({callers, threads})
            ->Unit(benchmark::kMillisecond)
            ->UseRealTime()
            ->MinTime(1.0);
      }
    }
  }
  if (all || set == "overhead") {
    for (int cold : {0, 1}) {
      for (Index rows : {1, 4, 16, 32, 64, 128, 256, 512}) {
        for (int threads : {1, 2}) {
          benchmark::internal::Benchmark* b = benchmark::RegisterBenchmark("loop", BM_Loop)
                                                  ->Args({rows, threads, cold})
                                                  ->Unit(benchmark::kMicrosecond)
                                                  ->UseManualTime();
          // Cold entries sleep 2 ms per iteration outside the timed part: a fixed count keeps them short.
          if (cold)
            b->Iterations(200);
          else
            b->MinTime(0.2);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string set = "all";
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--c2f_set=", 10) == 0) {
      set = argv[i] + 10;
    } else {
      args.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(args.size());
  register_entries(set);
  c2f_bench::Runner runner(&n, args.data());  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("c2f_isa", Eigen::SimdInstructionSetsInUse());
  benchmark::AddCustomContext("c2f_threads", std::to_string(c2f::get_num_threads()));
  benchmark::AddCustomContext("c2f_min_parallel_work", std::to_string(c2f::get_min_parallel_work()));
#if defined(C2F_PARALLEL_OPENMP)
  benchmark::AddCustomContext("c2f_runtime", "openmp-loops");
#elif defined(_OPENMP)
  benchmark::AddCustomContext("c2f_runtime", "pool+openmp");
#else
  benchmark::AddCustomContext("c2f_runtime", "pool");
#endif
  runner.run();
  benchmark::Shutdown();
  return 0;
}
