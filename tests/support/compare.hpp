// Comparisons and helpers shared by the C++ test suites.
#pragma once

#include "c2f/core.hpp"
#include "c2f/output.hpp"
#include "c2f/state_dict.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace c2f_test {

/// The tolerances against PyTorch fixtures: fp32 atol = rtol = 1e-5, fp64 1e-10; and which fixture file.
template <class Scalar>
struct Tolerance;
template <>
struct Tolerance<float> {
  static constexpr double atol = 1e-5, rtol = 1e-5;
  static constexpr const char* file_key = "f32";
};
template <>
struct Tolerance<double> {
  static constexpr double atol = 1e-10, rtol = 1e-10;
  static constexpr const char* file_key = "f64";
};

/// |got − want| ≤ atol + rtol·|want| element by element (NaN fails); reports the first five misses.
template <class Scalar>
void expect_close(const Scalar* got, const Scalar* want, c2f::Index n, double atol, double rtol,
                  const std::string& what) {
  int reported = 0;
  for (c2f::Index i = 0; i < n && reported < 5; ++i) {
    const double g = got[i], w = want[i];
    if (!(std::abs(g - w) <= atol + rtol * std::abs(w))) {
      ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w << ", |diff| " << std::abs(g - w);
      ++reported;
    }
  }
}

/// Whether n values at a and b have the same bits. n = 0 is true without reading: memcmp on the null
/// data() of an empty Eigen object is undefined, and GCC then drops later null checks (a native build's
/// aligned free of that object crashed).
template <class Scalar>
bool same_bits(const Scalar* a, const Scalar* b, c2f::Index n) {
  return n == 0 || std::memcmp(a, b, sizeof(Scalar) * static_cast<std::size_t>(n)) == 0;
}

/// Whether a forward's output came from a buffer the scratch cache kept (c2f/output.hpp); false for a
/// layer whose forward returns a plain tensor.
template <class Scalar, int Rank>
bool reused_output(const c2f::Output<Scalar, Rank>& y) {
  return y.reused_buffer();
}
template <class T>
bool reused_output(const T&) {
  return false;
}

/// Whether two tensors (Eigen::Tensor or c2f::Output, of the same rank) have the same sizes and bits.
template <class A, class B, class = std::enable_if_t<!std::is_pointer<A>::value && !std::is_pointer<B>::value>>
bool same_bits(const A& a, const B& b) {
  return a.dimensions() == b.dimensions() && same_bits(a.data(), b.data(), a.size());
}

/// Replaces every parameter of a layer with N(0, scale²) values — biases included, so that bias
/// handling is exercised (fresh layers have zero biases).
template <class Module>
void randomize(Module& module, TestRng& rng, double scale = 0.3) {
  c2f::StateDict random;
  for (const auto& [key, t] : module.state_dict()) {
    std::vector<double> v(static_cast<std::size_t>(t.numel()));
    for (double& x : v) x = scale * rng.normal();
    random.set(key, c2f::TensorData::from_values(v.data(), t.shape()));
  }
  module.load_state_dict(random);
}

/// The message of the std::invalid_argument `fn` throws, or a marker when it throws none.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "<no std::invalid_argument thrown>";
}

/// max |a − b| / max |b| over b's values (a holds as many): the bfloat16 tests' accuracy figure.
inline double relative_error(const float* a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::abs(double(b[i])));
  }
  return diff / scale;
}

}  // namespace c2f_test
