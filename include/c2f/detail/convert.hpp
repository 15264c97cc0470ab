// c2f — reading keys and values stored in a narrower type (a KVCache of Eigen::half or bfloat16) as the
// layer's Scalar.
#pragma once

#include "c2f/core.hpp"

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

/// Calls fn with `block` as a Scalar matrix: the block itself when it already holds Scalar, else its
/// values converted into `scratch`.
template <class Scalar, class Block, class Fn>
void as_scalar(const Block& block, RowMatrix<Scalar>& scratch, Fn&& fn) {
  if constexpr (std::is_same<typename Block::Scalar, Scalar>::value) {
    fn(block);
  } else {
    scratch = block.template cast<Scalar>();
    fn(static_cast<const RowMatrix<Scalar>&>(scratch));
  }
}

}  // namespace detail
}  // namespace c2f
