// Training step benchmarks (docs/training.md#benchmark): forward_train + backward of c2f's
// layers, batch 1, d = E = 512, 8 heads (bench_attention's layers), float, C2F_BENCH_THREADS threads
// (default 2).
//
// Entries (Google Benchmark; wall-clock, manual time = the training step):
//   train_mha/L          MultiHeadAttention (streaming kernel), L = 1024 … 8192
//   train_c2f/L/32       C2FAttention, chunk 32, L = 4096 … 16384
//   train_hmha/L/64      HMHA, window 64, every level, L = 4096
// Each iteration runs forward() (eval), forward_train() and backward() and times each; the entry's time is
// the training step (forward_train + backward). Counters (ms, medians over the iterations):
//   forward_ms, forward_train_ms, backward_ms, step_ms; bwd_over_fwd = backward / forward (target ≤ 3);
//   peak_bytes / bytes_per_token: the heap peak of one forward_train + backward from an empty scratch
//   cache (tools/malloc_counter.hpp), measured once before the timed loop, with x, dy and the gradients
//   it returns (the weights are outside the count).
//
// Check mode (benchmarks/torch_train_peer.py): bench_train --c2f_train_check=DIR reads DIR/weights
// .safetensors (metadata: layer = mha | c2f | hmha, embed_dim, num_heads, chunk_size or window) and
// DIR/input.safetensors (x and dy, [1, L, E] float), builds the layer as the entries build it, and writes
// DIR/c2f.safetensors: y, grad.input and grad.<parameter name> for every parameter.
#include <c2f/c2f.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "benchmarks/csv_reporter.hpp"
#include "benchmarks/rooflines.hpp"
#include "tools/malloc_counter.hpp"
#if C2F_BENCH_PEER
#include <c2f/io/safetensors.hpp>
#endif

namespace {

using c2f::Index;
using c2f_bench::bench_threads;

constexpr Index kEmbed = 512;
constexpr Index kHeads = 8;
constexpr Index kChunk = 32;
constexpr Index kWindow = 64;

/// [1, length, E] of uniform values in [-1, 1) (c2f_bench::fill).
c2f::Tensor3<float> random_tensor(Index length, std::uint64_t seed) {
  c2f::Tensor3<float> x(1, length, kEmbed);
  c2f_bench::fill(x.data(), x.size(), seed);
  return x;
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

template <class Layer>
void run(benchmark::State& state, const Layer& layer, Index length) {
  const c2f::Tensor3<float> x = random_tensor(length, 42), dy = random_tensor(length, 7);
  // The memory of one step from an empty scratch cache (not timed).
  c2f::release_scratch_cache();
  c2f_memory::reset();
  {
    auto [y, saved] = layer.forward_train(x);
    const c2f::Grads<float> g = layer.backward(saved, dy);
    benchmark::DoNotOptimize(g.input.data());
  }
  c2f_memory::stop();
  const double peak = double(c2f_memory::peak_bytes());
  std::vector<double> fwd, fwd_train, bwd;
  for (auto _ : state) {
    auto start = std::chrono::steady_clock::now();
    {
      const c2f::Tensor3<float> y = layer.forward(x);
      benchmark::DoNotOptimize(y.data());
    }
    fwd.push_back(ms_since(start));
    start = std::chrono::steady_clock::now();
    auto [y, saved] = layer.forward_train(x);
    benchmark::DoNotOptimize(y.data());
    fwd_train.push_back(ms_since(start));
    start = std::chrono::steady_clock::now();
    const c2f::Grads<float> g = layer.backward(saved, dy);
    benchmark::DoNotOptimize(g.input.data());
    benchmark::ClobberMemory();
    bwd.push_back(ms_since(start));
    state.SetIterationTime((fwd_train.back() + bwd.back()) * 1e-3);
  }
  const double f = median(fwd), ft = median(fwd_train), b = median(bwd);
  state.counters["forward_ms"] = f;
  state.counters["forward_train_ms"] = ft;
  state.counters["backward_ms"] = b;
  state.counters["step_ms"] = ft + b;
  state.counters["bwd_over_fwd"] = f > 0 ? b / f : 0;
  state.counters["peak_bytes"] = peak;
  state.counters["bytes_per_token"] = peak / double(length);
  state.counters["L"] = double(length);
  state.counters["threads"] = bench_threads();
}

c2f::MultiHeadAttention<float> make_mha() {
  return c2f::MultiHeadAttention<float>(
      kEmbed, kHeads,
      c2f::MultiHeadAttention<float>::Options().num_threads(bench_threads()).kernel(c2f::AttnKernel::Streaming));
}
c2f::C2FAttention<float> make_c2f(Index chunk) {
  return c2f::C2FAttention<float>(kEmbed, kHeads, chunk,
                                  c2f::C2FAttention<float>::Options().num_threads(bench_threads()));
}
c2f::HMHA<float> make_hmha(Index window) {
  return c2f::HMHA<float>(kEmbed, kHeads, window, c2f::HMHA<float>::Options().num_threads(bench_threads()));
}

void BM_TrainMha(benchmark::State& state) { run(state, make_mha(), state.range(0)); }
void BM_TrainC2F(benchmark::State& state) { run(state, make_c2f(state.range(1)), state.range(0)); }
void BM_TrainHmha(benchmark::State& state) { run(state, make_hmha(state.range(1)), state.range(0)); }

void register_entries() {
  const auto timed = [](benchmark::internal::Benchmark* b) {
    b->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
  };
  for (Index L : {1024, 2048, 4096, 8192}) timed(benchmark::RegisterBenchmark("train_mha", BM_TrainMha)->Arg(L));
  for (Index L : {4096, 8192, 16384}) timed(benchmark::RegisterBenchmark("train_c2f", BM_TrainC2F)->Args({L, kChunk}));
  timed(benchmark::RegisterBenchmark("train_hmha", BM_TrainHmha)->Args({4096, kWindow}));
}

#if C2F_BENCH_PEER
std::string meta(const c2f::StateDict& sd, const std::string& key) {
  const auto it = sd.metadata().find(key);
  if (it == sd.metadata().end()) throw std::invalid_argument("weights.safetensors: __metadata__ has no '" + key + "'");
  return it->second;
}

template <class Layer>
void check(Layer layer, const c2f::StateDict& weights, const c2f::StateDict& input, const std::string& out_path) {
  layer.load_state_dict(weights);
  const c2f::TensorData& xt = input.at("x");
  const c2f::TensorData& dyt = input.at("dy");
  if (xt.shape().size() != 3 || xt.shape()[0] != 1 || xt.shape()[2] != kEmbed || dyt.shape() != xt.shape()) {
    throw std::invalid_argument("input.safetensors: expected x and dy of shape [1, L, 512]");
  }
  c2f::Tensor3<float> x(1, xt.shape()[1], kEmbed), dy(1, xt.shape()[1], kEmbed);
  xt.copy_to(x.data());
  dyt.copy_to(dy.data());
  auto [y, saved] = layer.forward_train(x);
  const c2f::Grads<float> g = layer.backward(saved, dy);
  c2f::StateDict out;
  out.set("y", c2f::TensorData::from_values(y.data(), {1, x.dimension(1), kEmbed}));
  out.set("grad.input", c2f::TensorData::from_values(g.input.data(), {1, x.dimension(1), kEmbed}));
  out.merge(g.params, "grad.");
  out.metadata()["c2f_threads"] = std::to_string(bench_threads());
  c2f::save_safetensors(out_path, out);
}

int run_check(const std::string& dir) {
  try {
    const c2f::StateDict weights = c2f::load_safetensors(dir + "/weights.safetensors");
    const c2f::StateDict input = c2f::load_safetensors(dir + "/input.safetensors");
    const std::string layer = meta(weights, "layer"), out = dir + "/c2f.safetensors";
    if (std::stoll(meta(weights, "embed_dim")) != kEmbed || std::stoll(meta(weights, "num_heads")) != kHeads) {
      throw std::invalid_argument("weights.safetensors: expected embed_dim 512 and num_heads 8");
    }
    if (layer == "mha") {
      check(make_mha(), weights, input, out);
    } else if (layer == "c2f") {
      check(make_c2f(std::stoll(meta(weights, "chunk_size"))), weights, input, out);
    } else if (layer == "hmha") {
      check(make_hmha(std::stoll(meta(weights, "window"))), weights, input, out);
    } else {
      throw std::invalid_argument("weights.safetensors: __metadata__ layer must be mha, c2f or hmha, got '" + layer +
                                  "'");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train: check mode failed: %s\n", e.what());
    return 1;
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--c2f_train_check=", 18) == 0) {
#if C2F_BENCH_PEER
      return run_check(argv[i] + 18);
#else
      std::fprintf(stderr, "bench_train: built without c2f::safetensors (nlohmann-json3-dev): no check mode\n");
      return 1;
#endif
    }
    args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  register_entries();
  c2f_bench::Runner runner(&n, args.data());  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("c2f_threads", std::to_string(bench_threads()));
  benchmark::AddCustomContext("c2f_isa", Eigen::SimdInstructionSetsInUse());
  runner.run();
  benchmark::Shutdown();
  return 0;
}
