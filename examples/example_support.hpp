// Shared by the examples: reading an input tensor from a safetensors file and comparing an output with
// the one PyTorch stored next to it.
#pragma once

#include <c2f/c2f.hpp>
#include <c2f/io/safetensors.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace example {

/// "[2, 3, 4]".
inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

/// A [batch, seq, features] tensor of the file, converted to float.
inline c2f::Tensor3<float> tensor3(const c2f::StateDict& sd, const std::string& name) {
  const c2f::TensorData& t = sd.at(name);
  if (t.shape().size() != 3) throw std::invalid_argument(name + " is not a [batch, seq, features] tensor");
  c2f::Tensor3<float> x(t.shape()[0], t.shape()[1], t.shape()[2]);
  t.copy_to(x.data());
  return x;
}

/// Prints max |y − output| when the file holds PyTorch's "output"; the process exit code: 0 when
/// within 1e-5 (or nothing to compare), 1 otherwise.
inline int compare_with_pytorch(const c2f::StateDict& sd, const c2f::Tensor3<float>& y) {
  if (!sd.contains("output")) return 0;
  const std::vector<float> want = sd.at("output").to_vector<float>();
  if (want.size() != static_cast<std::size_t>(y.size())) {
    std::printf("PyTorch's output has %zu values, c2f's %ld\n", want.size(), static_cast<long>(y.size()));
    return 1;
  }
  double max_diff = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) max_diff = std::max(max_diff, double(std::abs(y.data()[i] - want[i])));
  std::printf("max |c2f - PyTorch| = %.3g over %zu values\n", max_diff, want.size());
  return max_diff <= 1e-5 ? 0 : 1;
}

}  // namespace example
