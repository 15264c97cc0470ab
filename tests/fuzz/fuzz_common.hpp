// Helpers shared by the safetensors fuzz targets: a property check that aborts (so libFuzzer records
// the input as a crash) and a field-by-field StateDict comparison.
#pragma once

#include "c2f/io/safetensors.hpp"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

/// Aborts with a message when a property of c2f's reader/writer does not hold.
#define C2F_FUZZ_CHECK(cond, what)                                                                   \
  do {                                                                                               \
    if (!(cond)) {                                                                                   \
      std::fprintf(stderr, "c2f fuzz: property violated at %s:%d: %s\n  (%s)\n", __FILE__, __LINE__, \
                   std::string(what).c_str(), #cond);                                                \
      __builtin_trap();                                                                              \
    }                                                                                                \
  } while (false)

namespace c2f_fuzz {

/// Empty when `a` and `b` hold the same names, dtypes, shapes, bytes and metadata; else the first
/// difference.
inline std::string state_dict_difference(const c2f::StateDict& a, const c2f::StateDict& b) {
  if (a.size() != b.size()) {
    return "tensor count " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  }
  auto ia = a.begin();
  auto ib = b.begin();
  for (; ia != a.end(); ++ia, ++ib) {
    const std::string name = c2f::detail::quoted(ia->first);
    if (ia->first != ib->first) return "tensor name " + name + " vs " + c2f::detail::quoted(ib->first);
    const c2f::TensorData& ta = ia->second;
    const c2f::TensorData& tb = ib->second;
    if (ta.dtype() != tb.dtype()) {
      return "dtype of " + name + ": " + c2f::dtype_name(ta.dtype()) + " vs " + c2f::dtype_name(tb.dtype());
    }
    if (ta.shape() != tb.shape()) {
      return "shape of " + name + ": " + c2f::detail::shape_string(ta.shape()) + " vs " +
             c2f::detail::shape_string(tb.shape());
    }
    if (ta.bytes() != tb.bytes()) return "bytes of " + name;
  }
  if (a.metadata() != b.metadata()) return "metadata";
  return {};
}

/// numel(shape) × dtype_size computed without c2f's helpers (128-bit arithmetic); false when it does
/// not fit 64 bits or a dimension is negative.
inline bool expected_nbytes(const c2f::TensorData& t, std::uint64_t& out) {
  unsigned __int128 n = c2f::dtype_size(t.dtype());
  bool zero = false;
  bool overflow = false;
  for (std::int64_t d : t.shape()) {
    if (d < 0) return false;
    if (d == 0) zero = true;
    n *= static_cast<std::uint64_t>(d);
    if (n > UINT64_MAX) {
      overflow = true;
      n = 1;  // keep multiplying without wrapping; only `zero` can still rescue the product
    }
  }
  if (zero) {
    out = 0;
    return true;
  }
  if (overflow) return false;
  out = static_cast<std::uint64_t>(n);
  return true;
}

/// Parses `encoded` (the writer's output for `sd`), checks it gives `sd` back and re-serialises to the
/// same bytes; `what` names the round trip in the failure message.
inline void check_round_trip(const c2f::StateDict& sd, const std::vector<std::uint8_t>& encoded,
                             const std::string& what) {
  c2f::StateDict back;
  try {
    back = c2f::parse_safetensors(encoded.data(), encoded.size());
  } catch (const c2f::SafetensorsError& e) {
    C2F_FUZZ_CHECK(false, std::string("the writer's output does not parse: ") + e.what());
  }
  const std::string diff = state_dict_difference(sd, back);
  C2F_FUZZ_CHECK(diff.empty(), what + " differs: " + diff);
  C2F_FUZZ_CHECK(c2f::serialize_safetensors(back) == encoded, "serialising twice gives different bytes");
}

}  // namespace c2f_fuzz
