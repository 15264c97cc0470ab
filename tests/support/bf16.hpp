// Helpers of the bfloat16 compute tests (docs/bf16.md).
#pragma once

#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/runtime.hpp"
#include "support/compare.hpp"
#include "support/settings.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace c2f_test {

/// The bf16 engines this machine has: the fallback, Dot (AVX512_BF16) and Tiles (AMX) where the CPU has them.
inline std::vector<c2f::Bf16Engine> available_bf16_engines() {
  std::vector<c2f::Bf16Engine> engines;
  for (c2f::Bf16Engine e : {c2f::Bf16Engine::Tiles, c2f::Bf16Engine::Dot, c2f::Bf16Engine::Fallback}) {
    if (c2f::bf16_engine_available(e)) engines.push_back(e);
  }
  return engines;
}

/// Runs fn(engine name) once on each bf16 engine this machine has (available_bf16_engines()); restores
/// the caller's setting afterwards.
template <class Fn>
void on_each_bf16_engine(Fn&& fn) {
  for (c2f::Bf16Engine e : available_bf16_engines()) {
    const auto setting = scoped_bf16_engine(e);
    fn(c2f::bf16_engine_name(e));
  }
}

/// c2f's bfloat16 output y against torch's fp32 output and its torch.autocast("cpu", bfloat16) output on
/// the same weights: prints max|Δ| / max|y| against both and torch's own gap under `label` (docs/bf16.md's
/// figures), and expects both within 2e-2 and the fp32 one above 1e-5 (the products were rounded).
inline void expect_bf16_accuracy(const std::string& label, const float* y, const std::vector<float>& fp32,
                                 const std::vector<float>& autocast) {
  const double vs_autocast = relative_error(y, autocast), vs_fp32 = relative_error(y, fp32);
  std::printf(
      "[bf16] %s: max|c2f bf16 - torch autocast| / max|y| = %.2e, vs torch fp32 %.2e (torch autocast vs fp32 %.2e)\n",
      label.c_str(), vs_autocast, vs_fp32, relative_error(autocast.data(), fp32));
  EXPECT_LE(vs_autocast, 2e-2) << label;
  EXPECT_LE(vs_fp32, 2e-2) << label;
  EXPECT_GT(vs_fp32, 1e-5) << label << ": no rounding (fp32 products?)";
}

}  // namespace c2f_test
