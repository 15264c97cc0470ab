// c2f — reading keys and values stored in a narrower type (a KVCache of Eigen::half or bfloat16) as the
// layer's Scalar.
#pragma once

#include "c2f/core.hpp"

#include <Eigen/Core>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace c2f {
namespace detail {

/// T in a non-deduced context: kernels take keys and values as NoDeduce<Ref<const RowMatrix<KV>>> so
/// that KV is given explicitly (or defaults to Scalar) and arguments convert as usual.
template <class T>
struct NoDeduceT {
  using type = T;
};
template <class T>
using NoDeduce = typename NoDeduceT<T>::type;

template <class T>
inline std::uint16_t bits16(const T& x) {
  static_assert(sizeof(T) == 2, "a 16-bit type");
  std::uint16_t u;
  std::memcpy(&u, &x, 2);
  return u;
}

inline float float_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// bfloat16 → float: the upper half of the float's bits (exact).
inline float widen(Eigen::bfloat16 x) { return float_from_bits(std::uint32_t(bits16(x)) << 16); }

/// IEEE half → float (exact, subnormals, infinities and NaN included) with integer and float operations
/// only, so that a loop of them vectorises: the exponent and mantissa moved into place as a float and
/// rescaled by 2^(127 − 15); exponent 31 (infinity, NaN) mapped to 255.
inline float widen(Eigen::half x) {
  const std::uint32_t h = bits16(x), sign = (h & 0x8000u) << 16, rest = (h & 0x7fffu) << 13;
  const float scaled = float_from_bits(rest) * 0x1.0p112f;
  std::uint32_t u;
  std::memcpy(&u, &scaled, 4);
  u = rest >= (0x7c00u << 13) ? (rest | 0x7f800000u) : u;
  return float_from_bits(u | sign);
}

/// out = block converted to Scalar, row by row: the fast widening above for half and bfloat16 (Eigen's
/// element-wise cast of them does not vectorise), Eigen's cast otherwise.
template <class Scalar, class Block>
void convert_block(const Block& block, RowMatrix<Scalar>& out) {
  using From = typename Block::Scalar;
  if constexpr (std::is_same<From, Eigen::half>::value || std::is_same<From, Eigen::bfloat16>::value) {
    const Index rows = block.rows(), cols = block.cols();
    out.resize(rows, cols);
    for (Index r = 0; r < rows; ++r) {
      const From* src = block.data() + r * block.outerStride();
      Scalar* dst = out.data() + r * cols;
      for (Index c = 0; c < cols; ++c) dst[c] = static_cast<Scalar>(widen(src[c]));
    }
  } else {
    out = block.template cast<Scalar>();
  }
}

/// Calls fn with `block` as a Scalar matrix: the block itself when it already holds Scalar, else its
/// values converted into `scratch`.
template <class Scalar, class Block, class Fn>
void as_scalar(const Block& block, RowMatrix<Scalar>& scratch, Fn&& fn) {
  if constexpr (std::is_same<typename Block::Scalar, Scalar>::value) {
    fn(block);
  } else {
    convert_block<Scalar>(block, scratch);
    fn(static_cast<const RowMatrix<Scalar>&>(scratch));
  }
}

}  // namespace detail
}  // namespace c2f
