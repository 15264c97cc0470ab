// Shared by the benchmark binaries: the thread count, fast deterministic inputs, the common counters and
// the machine's memory rooflines measured in the same run as the entries they are compared with.
#pragma once

#include <benchmark/benchmark.h>

#include "c2f/core.hpp"
#include "c2f/detail/parallel.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace c2f_bench {

using Eigen::Index;

/// Threads of every entry: C2F_BENCH_THREADS, default 2 (the machine's cores).
inline int bench_threads() {
  const char* env = std::getenv("C2F_BENCH_THREADS");
  return env != nullptr ? std::atoi(env) : 2;
}

/// Fills with uniform values in [-1, 1) from a counter-based hash: fast, parallel, deterministic.
inline void fill(float* data, Index n, std::uint64_t seed) {
  c2f::detail::parallel_for((n + 65535) / 65536, bench_threads(), [&](Index task, int) {
    const Index end = std::min(n, (task + 1) * 65536);
    for (Index i = task * 65536; i < end; ++i) {
      std::uint64_t z = (seed + static_cast<std::uint64_t>(i)) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z ^= z >> 27;
      data[i] = static_cast<float>(static_cast<double>(z >> 40) * 0x1.0p-23 - 1.0);
    }
  });
}

/// FLOP and GFLOPS, bytes, GB/s (when bytes > 0), tokens/s and L (when tokens > 0), threads.
inline void set_counters(benchmark::State& state, double flop, double bytes, Index tokens) {
  state.counters["FLOP"] = flop;
  state.counters["GFLOPS"] = benchmark::Counter(flop * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  if (bytes > 0) {
    state.counters["bytes"] = bytes;
    state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  }
  if (tokens > 0) {
    state.counters["tokens/s"] = benchmark::Counter(double(tokens), benchmark::Counter::kIsIterationInvariantRate);
    state.counters["L"] = double(tokens);
  }
  state.counters["threads"] = bench_threads();
}

/// STREAM's copy, y = x over two buffers of range(0) bytes each, allocated and touched before timing;
/// bytes = 2 × size (STREAM's count: one read and one write per element) — the memory roofline.
inline void BM_Copy(benchmark::State& state) {
  const Index n = state.range(0) / Index(sizeof(float));
  Eigen::VectorXf x(n), y(n);
  fill(x.data(), n, 1);
  y.setZero();  // touch every page before timing
  const int threads = bench_threads();
  constexpr Index kPart = 1 << 20;
  for (auto _ : state) {
    c2f::detail::parallel_for((n + kPart - 1) / kPart, threads, [&](Index task, int) {
      const Index begin = task * kPart, len = std::min(kPart, n - begin);
      y.segment(begin, len) = x.segment(begin, len);
    });
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, 0.0, 2.0 * double(n) * sizeof(float), 0);
}

/// A read-only stream: the sum of a buffer of range(0) bytes; bytes = size — the roofline of a kernel
/// that only reads (decoding's key/value scan).
inline void BM_Read(benchmark::State& state) {
  const Index n = state.range(0) / Index(sizeof(float));
  Eigen::VectorXf x(n);
  fill(x.data(), n, 2);
  const int threads = bench_threads();
  constexpr Index kPart = 1 << 20;
  const Index parts = (n + kPart - 1) / kPart;
  Eigen::VectorXf partial(parts);
  for (auto _ : state) {
    c2f::detail::parallel_for(parts, threads, [&](Index task, int) {
      const Index begin = task * kPart, len = std::min(kPart, n - begin);
      partial[task] = x.segment(begin, len).sum();
    });
    benchmark::DoNotOptimize(partial.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, 0.0, double(n) * sizeof(float), 0);
}

}  // namespace c2f_bench
