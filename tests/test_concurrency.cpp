// Several threads calling forward() on one shared const module at once — the server case of seed
// 002 — get exactly the bits of a single-threaded call, also when callers × threads per call exceed
// the CPUs. Each caller has its own input, so a result leaking from one call into another shows.
#include "support/eigen_assert_throws.hpp"

#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/sparse_c2f_attention.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

using c2f::Index;
using c2f::Tensor3;

constexpr Index kDim = 32, kHeads = 4, kBatch = 2, kLength = 97;
constexpr int kCallsPerCaller = 3;

// Runs `callers` threads that each call forward(inputs[k]) kCallsPerCaller times on one shared module
// and returns how many results differ from `expected[k]` (computed single-threaded).
template <class Forward>
int mismatches(int callers, const std::vector<Tensor3<float>>& inputs, const std::vector<Tensor3<float>>& expected,
               const Forward& forward) {
  std::vector<int> wrong(static_cast<std::size_t>(callers), 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < callers; ++k) {
    threads.emplace_back([&, k] {
      const std::size_t i = static_cast<std::size_t>(k) % inputs.size();
      for (int call = 0; call < kCallsPerCaller; ++call) {
        const Tensor3<float> y = forward(inputs[i]);
        if (!c2f_test::same_bits(y, expected[i])) ++wrong[static_cast<std::size_t>(k)];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  int total = 0;
  for (int w : wrong) total += w;
  return total;
}

// For 1 thread per call (reference), then 2 and all threads per call, `callers` concurrent callers.
template <class Module>
void check_shared_module(Module& module, const std::string& name) {
  c2f::set_min_parallel_work(0);  // every loop with several tasks really runs on several threads
  c2f_test::TestRng rng(901);
  const int cpus = c2f::detail::available_cpus();
  const int callers = cpus + 2;
  std::vector<Tensor3<float>> inputs, expected;
  module.set_num_threads(1);
  for (int k = 0; k < callers; ++k) {
    inputs.push_back(rng.tensor<float>(kBatch, kLength, kDim));
    expected.push_back(module.forward(inputs.back()));
  }
  for (int threads : {2, 0}) {
    module.set_num_threads(threads);
    const Module& shared = module;
    const int per_call = c2f::detail::resolve_threads(threads, 1000);
    EXPECT_GT(callers * per_call, cpus);
    EXPECT_EQ(mismatches(callers, inputs, expected, [&](const Tensor3<float>& x) { return shared.forward(x); }), 0)
        << name << ": " << callers << " callers × " << per_call << " threads on " << cpus << " CPUs";
  }
  c2f::set_min_parallel_work(c2f::detail::kDefaultMinParallelWork);
}

template <class Module>
void randomize_module(Module& module) {
  c2f_test::TestRng rng(902);
  c2f_test::randomize(module, rng);
}

TEST(SharedModule, MultiHeadAttention) {
  c2f::MultiHeadAttention<float> mha(kDim, kHeads);
  randomize_module(mha);
  check_shared_module(mha, "MultiHeadAttention");
}

TEST(SharedModule, C2FAttention) {
  c2f::C2FAttention<float> attn(kDim, kHeads, 8);
  randomize_module(attn);
  check_shared_module(attn, "C2FAttention");
}

TEST(SharedModule, HMHA) {
  c2f::HMHA<float> hmha(kDim, kHeads, 16);
  randomize_module(hmha);
  check_shared_module(hmha, "HMHA");
}

TEST(SharedModule, SparseC2FAttention) {
  c2f::SparseC2FAttention<float> sparse(kDim, kHeads, 8, 3);
  randomize_module(sparse);
  check_shared_module(sparse, "SparseC2FAttention");
}

// Different modules and thread counts at the same time, with the default small-work threshold.
TEST(SharedModule, MixedModulesAtOnce) {
  c2f_test::TestRng rng(903);
  c2f::MultiHeadAttention<float> mha(kDim, kHeads);
  c2f::C2FAttention<float> attn(kDim, kHeads, 8);
  randomize_module(mha);
  randomize_module(attn);
  const Tensor3<float> x = rng.tensor<float>(kBatch, kLength, kDim);
  mha.set_num_threads(1);
  attn.set_num_threads(1);
  const Tensor3<float> mha_ref = mha.forward(x), c2f_ref = attn.forward(x);
  mha.set_num_threads(0);
  attn.set_num_threads(2);
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int call = 0; call < kCallsPerCaller; ++call) {
        const bool is_mha = k % 2 == 0;
        const Tensor3<float> y = is_mha ? mha.forward(x) : attn.forward(x);
        if (!c2f_test::same_bits(y, is_mha ? mha_ref : c2f_ref)) ++wrong[static_cast<std::size_t>(k)];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(wrong[static_cast<std::size_t>(k)], 0) << "caller " << k;
}

}  // namespace
