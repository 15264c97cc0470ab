// The machine's rooflines, measured in the sweep's run before the layers are (benchmarks/sweep.py divides
// every layer entry by them):
//
//   peak_fp32/threads   register-only FMA loop, the widest the CPU has (AVX-512 or AVX2+FMA, checked at
//                       run time), 1 and 2 threads — the fp32 compute roofline
//   peak_bf16/threads   the same with vdpbf16ps (AVX512_BF16; skipped with the reason where the CPU lacks it)
//   peak_amx_bf16/threads   the same with AMX's tile product tdpbf16ps (skipped where the CPU or kernel lacks it)
//   peak_fp32_tile/threads   the fp32 FMA peak with a GEMM's loads: c2f's register-blocked micro-kernel
//                       (12 × 32 tile on AVX-512, 6 × 16 on AVX2) on operands that stay in L1 — the ceiling
//                       of its products on this CPU, below the register-only peak
//   copy                STREAM copy, 2 × 256 MiB — the memory roofline (bytes: one read + one write)
//   gemm_eigen/L/threads, gemm_c2f/L/threads, gemm_onednn/L/threads
//                       [L, 512] × [512, 512]ᵀ (a projection, W in torch's [out, in] layout) by Eigen's
//                       product, by c2f's kernels::linear and by oneDNN's matmul (when built with it): the
//                       reference points — what a library reaches on the same shape, as % of the peak;
//                       c2f and oneDNN pack W inside each call
//   gemm_c2f_layer/L/threads, gemm_onednn_packed/L/threads
//                       the same product with W packed once, before the timing, as a model runs it: c2f's
//                       Linear layer (its packing kept between calls, as in every c2f layer) and oneDNN's
//                       matmul on W reordered once into the layout its primitive picks (format_tag::any)
//   gemm_onednn_bf16/L/threads   oneDNN's bf16 matmul (bf16 inputs, fp32 output) where it has a kernel
//   gemm_c2f_layer_bf16_<engine>/L/threads   c2f's Linear layer in Compute::BFloat16 on each bfloat16 engine
//                       the CPU has (fallback, dot, tiles; docs/bf16.md#engines), W packed once; the label
//                       says whether it is the engine the rule picks on this CPU
//
// Every GEMM entry first checks its output against a double-precision product on a few rows.
#include <benchmark/benchmark.h>

#include "benchmarks/csv_reporter.hpp"
#include "benchmarks/rooflines.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/layers/linear.hpp"

#if C2F_BENCH_ONEDNN
#include <omp.h>
#include <dnnl.hpp>
#endif

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using c2f_bench::bench_threads;
using c2f_bench::fill;
using Eigen::Index;

constexpr Index kEmbed = 512;

struct GemmData {
  c2f::RowMatrix<float> x, w, y;
  explicit GemmData(Index length) : x(length, kEmbed), w(kEmbed, kEmbed), y(length, kEmbed) {
    fill(x.data(), x.size(), 11);
    fill(w.data(), w.size(), 12);
    y.setZero();
  }
  // max |y − x wᵀ| over a few rows, in double.
  double error() const {
    double worst = 0.0;
    for (Index r : {Index(0), x.rows() / 2, x.rows() - 1}) {
      for (Index c = 0; c < kEmbed; ++c) {
        double want = 0.0;
        for (Index k = 0; k < kEmbed; ++k) want += double(x(r, k)) * double(w(c, k));
        worst = std::max(worst, std::abs(want - double(y(r, c))));
      }
    }
    return worst;
  }
};

void gemm_counters(benchmark::State& state, Index length, int threads, double error) {
  const double flop = 2.0 * double(length) * kEmbed * kEmbed;
  state.counters["FLOP"] = flop;
  state.counters["GFLOPS"] = benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["L"] = double(length);
  state.counters["threads"] = threads;
  state.counters["max_abs_error"] = error;
}

// The bound of the output check: fp32 sums of 512 products of values in [-1, 1).
constexpr double kGemmTolerance = 1e-3;

bool check(benchmark::State& state, double error, double tolerance) {
  if (error <= tolerance) return true;
  state.SkipWithError(("output differs from the double product by " + std::to_string(error)).c_str());
  return false;
}

// Runs `once` (the product into d.y) once, checks it against the double product, then times it.
// Returns false when the check failed (the entry is then skipped with the error).
template <class Once>
bool timed_gemm(benchmark::State& state, const GemmData& d, Index length, int threads, const Once& once,
                double tolerance = kGemmTolerance) {
  once();
  const double error = d.error();
  if (!check(state, error, tolerance)) return false;
  for (auto _ : state) {
    once();
    benchmark::DoNotOptimize(d.y.data());
  }
  gemm_counters(state, length, threads, error);
  return true;
}

void BM_GemmEigen(benchmark::State& state) {
  const Index length = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  GemmData d(length);
  // Eigen's product, one slice of rows per thread (Eigen threads only under OpenMP).
  const Index slice = (length + threads - 1) / threads;
  const auto once = [&] {
    c2f::detail::parallel_for(threads, threads, [&](Index t, int) {
      const Index r0 = t * slice, rows = std::min(slice, length - r0);
      if (rows > 0) d.y.middleRows(r0, rows).noalias() = d.x.middleRows(r0, rows) * d.w.transpose();
    });
  };
  if (!timed_gemm(state, d, length, threads, once)) return;
  state.SetLabel("Eigen " EIGEN_MAKESTRING(EIGEN_WORLD_VERSION) "." EIGEN_MAKESTRING(
      EIGEN_MAJOR_VERSION) "." EIGEN_MAKESTRING(EIGEN_MINOR_VERSION));
}

void BM_GemmC2F(benchmark::State& state) {
  const Index length = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  GemmData d(length);
  const auto once = [&] { c2f::kernels::linear<float>(d.x, d.w, nullptr, d.y, c2f::kernels::with_threads(threads)); };
  timed_gemm(state, d, length, threads, once);
}

// c2f's Linear layer: its first call (timed_gemm's check) packs W, which it keeps for the timed calls.
void BM_GemmC2FLayer(benchmark::State& state) {
  const Index length = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  GemmData d(length);
  c2f::Linear<float> layer(kEmbed, kEmbed, c2f::Linear<float>::Options().bias(false).num_threads(threads));
  layer.weight() = d.w;
  timed_gemm(state, d, length, threads, [&] { layer.forward_rows(d.x, d.y); });
}

// c2f's Linear layer in bfloat16 on `engine` (forced for the entry, then back to the caller's choice).
void BM_GemmC2FLayerBf16(benchmark::State& state, c2f::Bf16Engine engine) {
  const Index length = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  GemmData d(length);
  const c2f::Bf16Engine asked = c2f::get_bf16_engine();
  c2f::set_bf16_engine(engine);
  c2f::Linear<float> layer(
      kEmbed, kEmbed, c2f::Linear<float>::Options().bias(false).num_threads(threads).compute(c2f::Compute::BFloat16));
  layer.weight() = d.w;
  // bf16 operands: the rounding (2^-9 relative per operand) bounds the error, not the fp32 tolerance.
  timed_gemm(
      state, d, length, threads, [&] { layer.forward_rows(d.x, d.y); }, 0.5);
  state.SetLabel(std::string(c2f::bf16_engine_name(engine)) +
                 (engine == c2f::bf16_engine_rule() ? " (the rule's pick)" : " (forced)"));
  c2f::set_bf16_engine(asked);
}

#if C2F_BENCH_ONEDNN
// oneDNN's matmul primitive, as a user who cares would run it: the primitive built once, weights in their
// [out, in] layout described as the transposed operand (format tag ba) — or, `packed`, in the layout the
// primitive picks (format tag any), reordered into it once before the timing — OpenMP threads = `threads`.
void BM_GemmOneDnn(benchmark::State& state, bool bf16, bool packed) {
  const Index length = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  omp_set_num_threads(threads);
  GemmData d(length);
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  const dt in = bf16 ? dt::bf16 : dt::f32;
  try {
    dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    dnnl::stream stream(engine);
    const dnnl::memory::desc a_md({length, kEmbed}, in, tag::ab),
        b_md({kEmbed, kEmbed}, in, packed ? tag::any : tag::ba), c_md({length, kEmbed}, dt::f32, tag::ab);
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), engine);
    const dnnl::matmul matmul(pd);
    dnnl::memory a(a_md, engine), b(pd.weights_desc(), engine), c(c_md, engine, d.y.data());
    dnnl::memory b32({{kEmbed, kEmbed}, dt::f32, tag::ba}, engine, d.w.data());
    if (bf16) {  // round the inputs to bf16 once, outside the timing (the reorder primitive)
      dnnl::memory a32({{length, kEmbed}, dt::f32, tag::ab}, engine, d.x.data());
      dnnl::reorder(a32, a).execute(stream, a32, a);
      dnnl::reorder(b32, b).execute(stream, b32, b);
      stream.wait();
    } else {
      a = dnnl::memory(a_md, engine, d.x.data());
      if (packed) {
        dnnl::reorder(b32, b).execute(stream, b32, b);
        stream.wait();
      } else {
        b = b32;
      }
    }
    const auto once = [&] {
      matmul.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
      stream.wait();
    };
    // bf16 inputs: the rounding (2^-9 relative per input) bounds the error, not the fp32 tolerance.
    if (!timed_gemm(state, d, length, threads, once, bf16 ? 0.5 : kGemmTolerance)) return;
    state.SetLabel(std::string("oneDNN ") + std::to_string(dnnl_version()->major) + "." +
                   std::to_string(dnnl_version()->minor) + " " + pd.impl_info_str());
  } catch (const dnnl::error& e) {
    state.SkipWithError((std::string("oneDNN has no kernel for this on this CPU: ") + e.what()).c_str());
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  c2f_bench::Runner runner(&argc, argv);  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&argc, argv);
  const int threads = bench_threads();
  const auto timed = [](benchmark::internal::Benchmark* b) {
    b->Unit(benchmark::kMillisecond)->MeasureProcessCPUTime()->UseRealTime();
  };
  // The peaks: the fastest of 2 s of calls each (BM_Peak), so that a short slow phase of a VM is outlasted.
  for (int t : {1, threads}) {
    for (const char* kind : {"fp32", "fp32_tile", "bf16", "amx_bf16"}) {
      const std::string name = std::string("peak_") + kind;
      timed(benchmark::RegisterBenchmark(name.c_str(), c2f_bench::BM_Peak, std::string(kind))->Arg(t)->MinTime(2.0));
    }
    if (threads == 1) break;
  }
  timed(benchmark::RegisterBenchmark("copy", c2f_bench::BM_Copy)->Arg(Index(256) << 20));
  for (Index L : {Index(512), Index(2048), Index(8192)}) {
    for (int t : {1, threads}) {
      timed(benchmark::RegisterBenchmark("gemm_eigen", BM_GemmEigen)->Args({L, t}));
      timed(benchmark::RegisterBenchmark("gemm_c2f", BM_GemmC2F)->Args({L, t}));
      timed(benchmark::RegisterBenchmark("gemm_c2f_layer", BM_GemmC2FLayer)->Args({L, t}));
      for (c2f::Bf16Engine e : {c2f::Bf16Engine::Fallback, c2f::Bf16Engine::Dot, c2f::Bf16Engine::Tiles}) {
        if (!c2f::bf16_engine_available(e)) continue;
        const std::string name = std::string("gemm_c2f_layer_bf16_") + c2f::bf16_engine_name(e);
        timed(benchmark::RegisterBenchmark(name.c_str(), BM_GemmC2FLayerBf16, e)->Args({L, t}));
      }
#if C2F_BENCH_ONEDNN
      timed(benchmark::RegisterBenchmark("gemm_onednn", BM_GemmOneDnn, false, false)->Args({L, t}));
      timed(benchmark::RegisterBenchmark("gemm_onednn_packed", BM_GemmOneDnn, false, true)->Args({L, t}));
      timed(benchmark::RegisterBenchmark("gemm_onednn_bf16", BM_GemmOneDnn, true, false)->Args({L, t}));
#endif
      if (threads == 1) break;
    }
  }
  runner.run();
  benchmark::Shutdown();
  return 0;
}
