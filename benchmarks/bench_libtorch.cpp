// c2f's MultiHeadAttention against libtorch's torch::nn::MultiheadAttention in the same binary: same
// weights, same input, outputs checked equal before anything is timed.
//
//   bench_libtorch [--c2f_sweep=quick|long|peers] [--c2f_check_only] [Google Benchmark flags]
//
// quick: L ∈ {512, 2048}; long: L ∈ {512, 1024, 2048, 4096}; peers (the sweep's peer table, next to
// torch_peer.py): L ∈ {1024, 2048, 4096, 8192}. E = 512, 8 heads, batch 1, float,
// need_weights = false, both on C2F_BENCH_THREADS threads (default 2; torch via at::set_num_threads, and
// OpenBLAS — when it is the BLAS the process loaded — via openblas_set_num_threads).
// Counters as in bench_attention (FLOP = 8·L·E² + 4·L²·E); the CPU column is the whole process's CPU time
// (CPU ÷ wall = the cores an entry really got).
//
// The peer's setup goes into the results' context (and is printed as "peer: ..." lines):
//   blas_library      the real path of the shared library that provides sgemm_ — the BLAS symbol
//                     libtorch's float GEMMs call — as this process resolves it (dlsym + dladdr)
//   mapped_blas       the real path of every BLAS-like library mapped into this process (read from
//                     /proc/self/maps after libtorch's first matmul); liblapack.so.3 may map OpenBLAS even
//                     when libblas.so.3 is the reference BLAS, so blas_library is the one that counts
//   openblas_threads  OpenBLAS's own thread count (openblas_get_num_threads), or "n/a" without OpenBLAS
//   openblas_config   openblas_get_config(): version, build options and the kernel it chose for this CPU
//   torch_threads     at::get_num_threads();  c2f_threads  the c2f modules' num_threads
#include <benchmark/benchmark.h>

#include <torch/torch.h>
#include "csv_reporter.hpp"

#include "c2f/layers/multihead_attention.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
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

// The real paths of the BLAS libraries mapped into this process ("none found" when no mapped file looks
// like one): a file whose name starts with libblas, libopenblas, libmkl, libblis or libcblas.
std::string mapped_blas_libraries() {
  std::ifstream maps("/proc/self/maps");
  if (!maps) return "unknown (/proc/self/maps is not readable)";
  std::set<std::string> found;
  std::string line;
  while (std::getline(maps, line)) {
    const std::size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string name = path.substr(path.rfind('/') + 1);
    for (const char* prefix : {"libblas", "libopenblas", "libmkl", "libblis", "libcblas"}) {
      if (name.rfind(prefix, 0) == 0) {
        char real[4096];
        found.insert(realpath(path.c_str(), real) != nullptr ? std::string(real) : path);
      }
    }
  }
  if (found.empty()) return "none found";
  std::string out;
  for (const std::string& f : found) out += (out.empty() ? "" : ", ") + f;
  return out;
}

// The real path of the library whose sgemm_ this process calls, or a note why it is unknown.
std::string sgemm_provider() {
  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (sgemm == nullptr || dladdr(sgemm, &info) == 0 || info.dli_fname == nullptr) {
    return "unknown (no sgemm_ found)";
  }
  char real[4096];
  return realpath(info.dli_fname, real) != nullptr ? std::string(real) : std::string(info.dli_fname);
}

// OpenBLAS's thread control, when the BLAS this process loaded is OpenBLAS (looked up at run time: with
// the reference BLAS these symbols do not exist).
struct OpenBlas {
  using SetThreads = void (*)(int);
  using GetInt = int (*)();
  using GetString = char* (*)();
  SetThreads set_num_threads = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  GetInt get_num_threads = reinterpret_cast<GetInt>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  GetString get_config = reinterpret_cast<GetString>(dlsym(RTLD_DEFAULT, "openblas_get_config"));

  std::string threads() const { return get_num_threads ? std::to_string(get_num_threads()) : "n/a (not OpenBLAS)"; }
  std::string config() const { return get_config ? std::string(get_config()) : "n/a (not OpenBLAS)"; }
};

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
    for (Index i = 0; i < ours.size(); ++i)
      max_abs_diff = std::max(max_abs_diff, double(std::abs(ours.data()[i] - r[i])));
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
  std::string sweep = "quick";
  bool check_only = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--c2f_sweep=long") == 0 || std::strcmp(argv[i], "--c2f_sweep=peers") == 0) {
      sweep = argv[i] + 12;
    } else if (std::strcmp(argv[i], "--c2f_check_only") == 0) {
      check_only = true;
    } else if (std::strcmp(argv[i], "--c2f_sweep=quick") != 0) {
      args.push_back(argv[i]);
    }
  }
  const int threads = bench_threads();
  if (threads < 1) {
    std::fprintf(stderr, "bench_libtorch: C2F_BENCH_THREADS must be >= 1, got %d\n", threads);
    return 1;
  }
  at::set_num_threads(threads);
  const OpenBlas openblas;
  if (openblas.set_num_threads != nullptr) openblas.set_num_threads(threads);
  {
    // libtorch's first matmul: whatever BLAS it loads lazily is mapped after this.
    torch::NoGradGuard no_grad;
    benchmark::DoNotOptimize(torch::mm(torch::ones({64, 64}), torch::ones({64, 64})).data_ptr());
  }
  const std::string blas = sgemm_provider(), mapped = mapped_blas_libraries();
  std::printf("peer: libtorch %s, BLAS (sgemm_ from) %s, torch threads %d, OpenBLAS threads %s, c2f threads %d\n",
              TORCH_VERSION, blas.c_str(), at::get_num_threads(), openblas.threads().c_str(), threads);
  std::printf("peer: mapped BLAS libraries: %s; OpenBLAS config: %s\n", mapped.c_str(), openblas.config().c_str());
  const bool listing = std::any_of(args.begin(), args.end(),
                                   [](const char* a) { return std::strncmp(a, "--benchmark_list_tests", 22) == 0; });
  const std::vector<Index> lengths = sweep == "long"    ? std::vector<Index>{512, 1024, 2048, 4096}
                                     : sweep == "peers" ? std::vector<Index>{1024, 2048, 4096, 8192}
                                                        : std::vector<Index>{512, 2048};
  std::vector<std::shared_ptr<Peer>> peers;
  for (Index L : (check_only ? std::vector<Index>{7, 512} : lengths)) {
    auto peer = std::make_shared<Peer>(L);
    if (!listing && !peer->check()) return 1;  // equal outputs before any timing
    peers.push_back(peer);
  }
  if (check_only) return 0;

  for (const std::shared_ptr<Peer>& peer : peers) {
    benchmark::RegisterBenchmark("libtorch_mha",
                                 [peer](benchmark::State& state) {
                                   for (auto _ : state) benchmark::DoNotOptimize(peer->run_torch().data_ptr());
                                   set_counters(state, peer->length, peer->max_abs_diff);
                                 })
        ->Arg(peer->length)
        ->Unit(benchmark::kMillisecond)
        ->MeasureProcessCPUTime()
        ->UseRealTime();
    benchmark::RegisterBenchmark("c2f_mha",
                                 [peer](benchmark::State& state) {
                                   for (auto _ : state) benchmark::DoNotOptimize(peer->run_c2f().data());
                                   set_counters(state, peer->length, peer->max_abs_diff);
                                 })
        ->Arg(peer->length)
        ->Unit(benchmark::kMillisecond)
        ->MeasureProcessCPUTime()
        ->UseRealTime();
  }
  int n = static_cast<int>(args.size());
  c2f_bench::Runner runner(&n, args.data());  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  benchmark::AddCustomContext("c2f_sweep", sweep);
  benchmark::AddCustomContext("torch_version", TORCH_VERSION);
  benchmark::AddCustomContext("blas_library", blas);
  benchmark::AddCustomContext("mapped_blas", mapped);
  benchmark::AddCustomContext("openblas_threads", openblas.threads());
  benchmark::AddCustomContext("openblas_config", openblas.config());
  benchmark::AddCustomContext("torch_threads", std::to_string(at::get_num_threads()));
  benchmark::AddCustomContext("c2f_threads", std::to_string(threads));
  runner.run();
  benchmark::Shutdown();
  return 0;
}
