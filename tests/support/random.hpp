// Random inputs for the C++ tests. The base seed is printed and can be overridden with the
// environment variable C2F_TEST_SEED to reproduce or widen a run.
#pragma once

#include "c2f/core.hpp"

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <random>

namespace c2f_test {

inline std::uint64_t base_seed() {
  static const std::uint64_t seed = [] {
    const char* env = std::getenv("C2F_TEST_SEED");
    const std::uint64_t s = env != nullptr ? std::strtoull(env, nullptr, 10) : 20261129ull;
    std::cout << "[c2f] random test seed: " << s << " (set C2F_TEST_SEED to change)\n";
    return s;
  }();
  return seed;
}

class TestRng {
 public:
  explicit TestRng(std::uint64_t salt) : gen_(base_seed() * 0x9E3779B97F4A7C15ull + salt) {}
  std::mt19937_64& gen() { return gen_; }
  c2f::Index uniform_int(c2f::Index lo, c2f::Index hi) {
    return std::uniform_int_distribution<c2f::Index>(lo, hi)(gen_);
  }
  double normal() { return std::normal_distribution<double>(0.0, 1.0)(gen_); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(gen_); }
  bool coin(double p = 0.5) { return uniform(0.0, 1.0) < p; }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<std::size_t>(uniform_int(0, static_cast<c2f::Index>(v.size()) - 1))];
  }

  template <class Scalar>
  c2f::RowMatrix<Scalar> matrix(c2f::Index rows, c2f::Index cols, double stddev = 1.0) {
    c2f::RowMatrix<Scalar> m(rows, cols);
    for (c2f::Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(stddev * normal());
    return m;
  }
  template <class Scalar>
  c2f::Tensor3<Scalar> tensor(c2f::Index b, c2f::Index l, c2f::Index f, double stddev = 1.0) {
    c2f::Tensor3<Scalar> t(b, l, f);
    for (c2f::Index i = 0; i < t.size(); ++i) t.data()[i] = static_cast<Scalar>(stddev * normal());
    return t;
  }

 private:
  std::mt19937_64 gen_;
};

}  // namespace c2f_test
