// c2f's MultiHeadAttention against libtorch's torch::nn::MultiheadAttention in the same binary: same
// weights, same input, outputs checked equal before anything is timed.
//
//   bench_libtorch [--c2f_sweep=quick|long] [--c2f_check_only] [Google Benchmark flags]
//
// quick: L ∈ {512, 2048}; long: L ∈ {512, 1024, 2048, 4096}. E = 512, 8 heads, batch 1, float,
// need_weights = false, both on C2F_BENCH_THREADS threads (default 2; torch via at::set_num_threads).
// Counters as in bench_attention (FLOP = 8·L·E² + 4·L²·E).
#include <benchmark/benchmark.h>
#include <torch/torch.h>

#include "c2f/layers/multihead_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using Eigen::Index;

constexpr Index kEmbed = 512;
constexpr Index kHeads = 8;

int bench_threads() {
  const char* env = std::getenv("C2F_BENCH_THREADS");
  return env != nullptr ? std::atoi(env) : 2;
}

c2f::TensorData to_tensor_data(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kFloat32).contiguous();
  std::vector<std::int64_t> shape(c.sizes().begin(), c.sizes().end());
  return c2f::TensorData::from_values(c.data_ptr<float>(), shape);
}

// One pair of modules with identical weights, and an input shared by both ([L, 1, E] for torch is the
// same memory as [1, L, E] for c2f).
struct Peer {
  torch::nn::MultiheadAttention torch_mha{nullptr};
  std::unique_ptr<c2f::MultiHeadAttention<float>> c2f_mha;
  torch::Tensor x;
  Index length = 0;
  double max_abs_diff = 0.0;

  explicit Peer(Index L) : length(L) {
    torch::manual_seed(0);
    torch_mha = torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(kEmbed, kHeads));
    torch_mha->eval();
    c2f::StateDict sd;
    for (const auto& p : torch_mha->named_parameters()) sd.set(p.key(), to_tensor_data(p.value()));
    c2f::MultiHeadAttention<float>::Options options;
    options.num_threads(bench_threads());
    c2f_mha = std::make_unique<c2f::MultiHeadAttention<float>>(kEmbed, kHeads, options);
    c2f_mha->load_state_dict(sd);
    x = torch::randn({L, 1, kEmbed});
  }

  torch::Tensor run_torch() {
    torch::NoGradGuard no_grad;
    return std::get<0>(torch_mha->forward(x, x, x, /*key_padding_mask=*/{}, /*need_weights=*/false));
  }
  c2f::Tensor3<float> run_c2f() const {
    return c2f_mha->forward(c2f::ConstTensor3Ref<float>(x.data_ptr<float>(), {1, length, kEmbed}));
  }

  /// Both outputs agree to 1e-4 (fp32, different summation orders).
  bool check() {
    const torch::Tensor ref = run_torch().contiguous();
    const c2f::Tensor3<float> ours = run_c2f();
    const float* r = ref.data_ptr<float>();
    max_abs_diff = 0.0;
    for (Index i = 0; i < ours.size(); ++i) max_abs_diff = std::max(max_abs_diff, double(std::abs(ours.data()[i] - r[i])));
    const bool ok = ours.size() == ref.numel() && max_abs_diff <= 1e-4;
    std::printf("check L=%ld: max |c2f - libtorch| = %.3g %s\n", static_cast<long>(length), max_abs_diff,
                ok ? "OK" : "MISMATCH");
    return ok;
  }
};

void set_counters(benchmark::State& state, Index length, double max_abs_diff) {
  const double L = double(length), E = double(kEmbed), flops = 8.0 * L * E * E + 4.0 * L * L * E;
  state.counters["FLOP"] = flops;
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tokens/s"] = benchmark::Counter(L, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["L"] = L;
  state.counters["threads"] = bench_threads();
  state.counters["max_abs_diff"] = max_abs_diff;
}

}  // namespace

int main(int argc, char** argv) {
  bool long_sweep = false, check_only = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--c2f_sweep=long") == 0) {
      long_sweep = true;
    } else if (std::strcmp(argv[i], "--c2f_check_only") == 0) {
      check_only = true;
    } else if (std::strcmp(argv[i], "--c2f_sweep=quick") != 0) {
      args.push_back(argv[i]);
    }
  }
  at::set_num_threads(bench_threads());
  const bool listing = std::any_of(args.begin(), args.end(),
                                   [](const char* a) { return std::strncmp(a, "--benchmark_list_tests", 22) == 0; });
  const std::vector<Index> lengths = long_sweep ? std::vector<Index>{512, 1024, 2048, 4096} : std::vector<Index>{512, 2048};
  std::vector<std::shared_ptr<Peer>> peers;
  for (Index L : (check_only ? std::vector<Index>{7, 512} : lengths)) {
    auto peer = std::make_shared<Peer>(L);
    if (!listing && !peer->check()) return 1;  // equal outputs before any timing
    peers.push_back(peer);
  }
  if (check_only) return 0;

  for (const std::shared_ptr<Peer>& peer : peers) {
    benchmark::RegisterBenchmark("libtorch_mha", [peer](benchmark::State& state) {
      for (auto _ : state) benchmark::DoNotOptimize(peer->run_torch().data_ptr());
      set_counters(state, peer->length, peer->max_abs_diff);
    })->Arg(peer->length)->Unit(benchmark::kMillisecond)->UseRealTime();
    benchmark::RegisterBenchmark("c2f_mha", [peer](benchmark::State& state) {
      for (auto _ : state) benchmark::DoNotOptimize(peer->run_c2f().data());
      set_counters(state, peer->length, peer->max_abs_diff);
    })->Arg(peer->length)->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("c2f_sweep", long_sweep ? "long" : "quick");
  benchmark::AddCustomContext("torch_version", TORCH_VERSION);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
