// Outputs of every layer at 1 and 2 threads per call, for comparing an OpenMP build of c2f with a
// plain one bit for bit. Shared by openmp_plain_outputs.cpp (built without OpenMP: writes them to a
// file) and test_openmp.cpp (built with -fopenmp: computes them again and compares).
#pragma once

#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/sparse_c2f_attention.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

#include <cstdint>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace c2f_openmp {

using Outputs = std::map<std::string, std::vector<float>>;

// Sizes where Eigen would split the products over OpenMP threads if it were allowed to: the
// projections are [600, 64] × [64, 64] (2.5 M multiply-adds, Eigen's threshold is 50 k).
constexpr c2f::Index kDim = 64, kHeads = 4, kBatch = 2, kLength = 300;

template <class Module>
void add(Outputs& out, const std::string& name, Module& module, const c2f::Tensor3<float>& x) {
  c2f_test::TestRng rng(777);
  c2f_test::randomize(module, rng);
  for (int threads : {1, 2}) {
    module.set_num_threads(threads);
    const c2f::Tensor3<float> y = module.forward(x);
    out[name + "/threads=" + std::to_string(threads)] = std::vector<float>(y.data(), y.data() + y.size());
  }
}

inline Outputs compute() {
  c2f::set_min_parallel_work(0);
  c2f_test::TestRng rng(778);
  const c2f::Tensor3<float> x = rng.tensor<float>(kBatch, kLength, kDim);
  Outputs out;
  c2f::MultiHeadAttention<float> mha(kDim, kHeads);
  add(out, "mha", mha, x);
  c2f::C2FAttention<float> attn(kDim, kHeads, 16);
  add(out, "c2f", attn, x);
  c2f::HMHA<float> hmha(kDim, kHeads, 32);
  add(out, "hmha", hmha, x);
  c2f::SparseC2FAttention<float> sparse(kDim, kHeads, 32, 3);
  add(out, "sparse_c2f", sparse, x);
  c2f::set_min_parallel_work(c2f::detail::kDefaultMinParallelWork);
  return out;
}

inline void write(const Outputs& outputs, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  for (const auto& [name, values] : outputs) {
    const std::uint64_t n = name.size(), m = values.size();
    f.write(reinterpret_cast<const char*>(&n), sizeof n);
    f.write(name.data(), static_cast<std::streamsize>(n));
    f.write(reinterpret_cast<const char*>(&m), sizeof m);
    f.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(m * sizeof(float)));
  }
  if (!f) throw std::runtime_error("cannot write " + path);
}

inline Outputs read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  Outputs out;
  std::uint64_t n = 0, m = 0;
  while (f.read(reinterpret_cast<char*>(&n), sizeof n)) {
    std::string name(n, '\0');
    f.read(name.data(), static_cast<std::streamsize>(n));
    f.read(reinterpret_cast<char*>(&m), sizeof m);
    std::vector<float> values(m);
    f.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(m * sizeof(float)));
    if (!f) throw std::runtime_error("truncated " + path);
    out[name] = std::move(values);
  }
  return out;
}

}  // namespace c2f_openmp
