// c2f — deterministic, portable random numbers for parameter initialisation.
//
// std::uniform_real_distribution and std::normal_distribution are implementation-defined, so the
// same seed would give different weights with libstdc++ and libc++. These are fixed formulas. Also the
// counter-based draws of training's dropout (CounterRng): a value per coordinate, not a sequence.
#pragma once

#include "c2f/core.hpp"

#include <cmath>
#include <cstdint>

namespace c2f {
namespace detail {

/// SplitMix64's output function: a bijective mix of 64 bits (Steele, Lea & Flood, 2014).
constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/// SplitMix64's increment (the golden ratio in 64 bits).
constexpr std::uint64_t kGolden64 = 0x9E3779B97F4A7C15ull;

/// SplitMix64: a tiny, well-tested 64-bit generator (Steele, Lea & Flood, 2014).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next_u64() { return mix64(state_ += kGolden64); }
  /// Uniform in [0, 1) with 53 random bits.
  double uniform01() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform01(); }
  /// Standard normal by Box–Muller (one value per call; the pair's second half is dropped).
  double normal() {
    const double u1 = 1.0 - uniform01();  // (0, 1]
    const double u2 = uniform01();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t state_;
};

/// A counter-based generator: uniform 64-bit values that are a pure function of (key, counter) — the
/// i-th value of the SplitMix64 sequence started at the key — so any thread can draw value (key, i) in
/// any order and get the same bits (training's dropout masks, kernels::AttnDropout).
class CounterRng {
 public:
  /// The key of the coordinates (a, b, ...): each one mixed in turn.
  template <class... Coords>
  static std::uint64_t key(std::uint64_t first, Coords... rest) {
    std::uint64_t k = mix64(first + kGolden64);
    ((k = mix64(k ^ (static_cast<std::uint64_t>(rest) + kGolden64))), ...);
    return k;
  }
  /// Value `counter` of the sequence keyed `key`.
  static std::uint64_t at(std::uint64_t key, std::uint64_t counter) { return mix64(key + (counter + 1) * kGolden64); }
};

template <class Derived>
void fill_uniform(Eigen::MatrixBase<Derived>& m, Rng& rng, double bound) {
  for (Index i = 0; i < m.rows(); ++i) {
    for (Index j = 0; j < m.cols(); ++j) m(i, j) = static_cast<typename Derived::Scalar>(rng.uniform(-bound, bound));
  }
}

template <class Derived>
void fill_normal(Eigen::MatrixBase<Derived>& m, Rng& rng, double stddev) {
  for (Index i = 0; i < m.rows(); ++i) {
    for (Index j = 0; j < m.cols(); ++j) m(i, j) = static_cast<typename Derived::Scalar>(stddev * rng.normal());
  }
}

/// torch.nn.init.trunc_normal_(w, mean=0, std, a, b): N(0, std²) redrawn until inside [a, b] (a and b are
/// absolute values, as in torch; Swin's trunc_normal_(std=.02) keeps torch's default a = −2, b = 2).
template <class Derived>
void trunc_normal(Eigen::MatrixBase<Derived>& m, Rng& rng, double stddev, double a, double b) {
  for (Index i = 0; i < m.rows(); ++i) {
    for (Index j = 0; j < m.cols(); ++j) {
      double v = stddev * rng.normal();
      while (v < a || v > b) v = stddev * rng.normal();
      m(i, j) = static_cast<typename Derived::Scalar>(v);
    }
  }
}

/// torch.nn.init.xavier_uniform_ on a [fan_out, fan_in] weight: U(±sqrt(6 / (fan_in + fan_out))).
template <class Derived>
void xavier_uniform(Eigen::MatrixBase<Derived>& w, Rng& rng) {
  fill_uniform(w, rng, std::sqrt(6.0 / static_cast<double>(w.rows() + w.cols())));
}

/// torch.nn.Linear's default weight init (kaiming_uniform_ with a = sqrt(5)): U(±1/sqrt(fan_in)).
template <class Derived>
void linear_default_uniform(Eigen::MatrixBase<Derived>& w, Rng& rng) {
  fill_uniform(w, rng, 1.0 / std::sqrt(static_cast<double>(std::max<Index>(1, w.cols()))));
}

/// torch.nn.init.kaiming_normal_(mode='fan_out', nonlinearity='leaky_relu', a=0): N(0, 2 / fan_out).
template <class Derived>
void kaiming_normal_fan_out(Eigen::MatrixBase<Derived>& w, Rng& rng) {
  fill_normal(w, rng, std::sqrt(2.0 / static_cast<double>(std::max<Index>(1, w.rows()))));
}

}  // namespace detail
}  // namespace c2f
