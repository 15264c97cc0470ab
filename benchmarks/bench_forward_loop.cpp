// forward() in a user's loop against forward_into() into a reused buffer, for every layer at its largest
// benchmark size: what a program that writes `auto y = layer.forward(x);` pays for getting a new tensor
// on every call (c2f/output.hpp: outputs come back to the scratch cache when they die).
//
//   bench_forward_loop [--layers mha,c2f,hmha,sparse,c2f2d] [--pairs N]
//
// Each layer runs N pairs (default 5; MultiHeadAttention 3) of three calls in turn, after one untimed call of
// each: `{ auto y = layer.forward(x); }` (a new output every iteration, dropped at its end),
// `y = layer.forward(x)` into an Output that lives across the loop, and `layer.forward_into(x, out)` into one
// buffer. It prints the medians and forward ÷ forward_into; the target is ≤ 1.15. Batch 1, d = 512, 8 heads,
// float, C2F_BENCH_THREADS threads (default 2), the sizes of bench_attention's and bench_c2f2d's largest
// entries: MultiHeadAttention, C2FAttention (chunk 32), HMHA (W = 64) and SparseC2FAttention (chunk 64,
// top_k 8, per-chunk gating) at L = 16384; C2FAttention2D at 1024 × 1024 tokens with 64 × 64 blocks.
#include "benchmarks/rooflines.hpp"
#include "c2f/c2f.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

using c2f::Index;
using Clock = std::chrono::steady_clock;
constexpr Index kEmbed = 512, kHeads = 8;

double ms_since(Clock::time_point t) { return 1e3 * c2f_bench::seconds_since(t); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

c2f::Tensor3<float> input(Index tokens) {
  c2f::Tensor3<float> x(1, tokens, kEmbed);
  c2f_bench::fill(x.data(), x.size(), static_cast<std::uint64_t>(tokens));
  return x;
}

/// forward (a new Output each iteration), forward into an Output kept across iterations, forward_into.
struct Calls {
  std::function<void()> fresh, kept, into;
};

void run(const char* name, const Calls& calls, int pairs) {
  calls.fresh();
  calls.kept();
  calls.into();
  std::vector<double> fresh, kept, into;
  for (int p = 0; p < pairs; ++p) {
    Clock::time_point t = Clock::now();
    calls.fresh();
    fresh.push_back(ms_since(t));
    t = Clock::now();
    calls.kept();
    kept.push_back(ms_since(t));
    t = Clock::now();
    calls.into();
    into.push_back(ms_since(t));
  }
  const double f = median(fresh), k = median(kept), i = median(into);
  std::printf("| %s | %d | %.2f | %.2f | %.2f | %.3f | %.3f | %s |\n", name, pairs, f, k, i, f / i, k / i,
              std::max(f, k) / i <= 1.15 ? "yes" : "no");
  std::fflush(stdout);
}

template <class Layer>
Calls layer_calls(const Layer& layer, const c2f::Tensor3<float>& x, c2f::Output<float>& y, c2f::RowMatrix<float>& out) {
  return {[&] {
            const c2f::Output<float> local = layer.forward(x);
            (void)local;
          },
          [&] { y = layer.forward(x); }, [&] { layer.forward_into(x, out); }};
}

}  // namespace

int main(int argc, char** argv) {
  std::string layers = "mha,c2f,hmha,sparse,c2f2d";
  int pairs = 5;
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--layers" && a + 1 < argc) {
      layers = argv[++a];
    } else if (arg == "--pairs" && a + 1 < argc) {
      pairs = std::max(1, std::atoi(argv[++a]));
    } else {
      std::fprintf(stderr, "usage: bench_forward_loop [--layers mha,c2f,hmha,sparse,c2f2d] [--pairs N]\n");
      return 2;
    }
  }
  const auto wanted = [&](const std::string& name) {
    return ("," + layers + ",").find("," + name + ",") != std::string::npos;
  };
  const int threads = c2f_bench::bench_threads();

  std::printf("forward() in a loop against forward_into(), %d threads, scratch cache limit %zu MiB\n\n", threads,
              c2f::scratch_cache_limit() >> 20);
  std::printf(
      "| layer | pairs | forward, new Output each call (ms) | forward into a kept Output (ms) | "
      "forward_into (ms) | new ÷ into | kept ÷ into | ≤ 1.15 |\n|---|---:|---:|---:|---:|---:|---:|---|\n");
  c2f::Output<float> y;
  const Index L = 16384;
  if (wanted("mha") || wanted("c2f") || wanted("hmha") || wanted("sparse")) {
    const c2f::Tensor3<float> x = input(L);
    c2f::RowMatrix<float> out(L, kEmbed);
    if (wanted("mha")) {
      const c2f::MultiHeadAttention<float> m(kEmbed, kHeads,
                                             c2f::MultiHeadAttention<float>::Options().num_threads(threads));
      run("MultiHeadAttention, L = 16384", layer_calls(m, x, y, out), std::min(pairs, 3));
    }
    if (wanted("c2f")) {
      const c2f::C2FAttention<float> m(kEmbed, kHeads, 32, c2f::C2FAttention<float>::Options().num_threads(threads));
      run("C2FAttention chunk 32, L = 16384", layer_calls(m, x, y, out), pairs);
    }
    if (wanted("hmha")) {
      const c2f::HMHA<float> m(kEmbed, kHeads, 64, c2f::HMHA<float>::Options().num_threads(threads));
      run("HMHA W = 64, L = 16384", layer_calls(m, x, y, out), pairs);
    }
    if (wanted("sparse")) {
      const c2f::SparseC2FAttention<float> m(kEmbed, kHeads, 64, 8,
                                             c2f::SparseC2FAttention<float>::Options().num_threads(threads));
      run("SparseC2FAttention chunk 64 top_k 8, L = 16384", layer_calls(m, x, y, out), pairs);
    }
  }
  if (wanted("c2f2d")) {
    const Index side = 1024;
    const c2f::Tensor3<float> x = input(side * side);
    c2f::RowMatrix<float> out(side * side, kEmbed);
    const c2f::C2FAttention2D<float> m(kEmbed, kHeads, 64, 64,
                                       c2f::C2FAttention2D<float>::Options().num_threads(threads));
    const Calls calls{[&] {
                        const c2f::Output<float> local = m.forward(x, side, side);
                        (void)local;
                      },
                      [&] { y = m.forward(x, side, side); }, [&] { m.forward_into(x, side, side, out); }};
    run("C2FAttention2D 1024 x 1024, blocks 64 x 64", calls, pairs);
  }
  return 0;
}
