// c2f kernels — HeadsView: how the kernels see the heads of projected queries, keys and values inside
// one row-major matrix; and the usual softmax scale.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace c2f {
namespace kernels {

/// A [batch, seq, heads, dim] view: head h of token i of batch b starts at
/// data + b·batch_stride + i·row_stride + h·dim, and its `dim` values are contiguous. This is how the
/// projected q, k and v of every head sit inside one [batch·seq, heads·dim] (or packed [.., 3·E]) matrix.
template <class T>
struct HeadsView {
  using Scalar = std::remove_const_t<T>;
  using Block = Eigen::Map<std::conditional_t<std::is_const<T>::value, const RowMatrix<Scalar>, RowMatrix<Scalar>>, 0,
                           Eigen::OuterStride<>>;

  T* data = nullptr;
  Index batch = 0, seq = 0, heads = 0, dim = 0;
  Index row_stride = 0, batch_stride = 0;

  HeadsView() = default;
  /// A view of mutable data is also a read-only view.
  template <class U, class = std::enable_if_t<std::is_same<const U, T>::value && !std::is_const<U>::value>>
  HeadsView(const HeadsView<U>& o)  // NOLINT(google-explicit-constructor)
      : data(o.data),
        batch(o.batch),
        seq(o.seq),
        heads(o.heads),
        dim(o.dim),
        row_stride(o.row_stride),
        batch_stride(o.batch_stride) {}

  /// Rows [i0, i0 + n) of every head of batch b, as an n × (heads · dim) matrix.
  Block rows(Index b, Index i0, Index n) const {
    return Block(detail::offset_or_null(data, b * batch_stride + i0 * row_stride), n, heads * dim,
                 Eigen::OuterStride<>(row_stride));
  }

  /// Rows [i0, i0 + n) of head h of batch b, as an n × dim matrix.
  Block block(Index b, Index h, Index i0, Index n) const {
    return Block(detail::offset_or_null(data, b * batch_stride + i0 * row_stride + h * dim), n, dim,
                 Eigen::OuterStride<>(row_stride));
  }
};

/// Views the [batch·seq, cols] row-major matrix at `data` as heads of width `dim` starting at column
/// `col0` (so the q, k and v of a packed [.., 3·E] projection are three views of one matrix).
template <class T>
HeadsView<T> heads_view(T* data, Index batch, Index seq, Index cols, Index col0, Index heads, Index dim) {
  HeadsView<T> v;
  v.data = detail::offset_or_null(data, col0);
  v.batch = batch;
  v.seq = seq;
  v.heads = heads;
  v.dim = dim;
  v.row_stride = cols;
  v.batch_stride = seq * cols;
  return v;
}

/// The [rows, cols] row-major matrix at `data` (contiguous rows) as `heads` heads of dim = cols / heads,
/// checked to be [batch·seq, heads·dim].
template <class T>
HeadsView<T> checked_heads_view(T* data, Index rows, Index cols, Index batch, Index seq, Index heads) {
  if (rows != batch * seq || heads < 1 || cols % heads != 0) {
    detail::fail("heads_view: a [batch·seq, heads·dim] matrix for batch ", batch, ", seq ", seq, " and ", heads,
                 " heads, got ", detail::shape_string({rows, cols}));
  }
  return heads_view<T>(data, batch, seq, cols, 0, heads, cols / heads);
}

/// The [batch·seq, heads·dim] matrix `m` (a RowMatrix, or a Map of one such as scratch memory) as
/// `heads` heads of dim = cols / heads. The sequence length is given, not derived, so that a batch of 0
/// keeps the problem's lengths (the kernels check them against the mask's).
template <class Scalar>
HeadsView<const Scalar> heads_view(const RowMatrix<Scalar>& m, Index batch, Index seq, Index heads) {
  return checked_heads_view<const Scalar>(m.data(), m.rows(), m.cols(), batch, seq, heads);
}
template <class Scalar>
HeadsView<Scalar> heads_view(RowMatrix<Scalar>& m, Index batch, Index seq, Index heads) {
  return checked_heads_view<Scalar>(m.data(), m.rows(), m.cols(), batch, seq, heads);
}
template <class Scalar, int Options>
HeadsView<Scalar> heads_view(Eigen::Map<RowMatrix<Scalar>, Options> m, Index batch, Index seq, Index heads) {
  return checked_heads_view<Scalar>(m.data(), m.rows(), m.cols(), batch, seq, heads);
}

/// The usual softmax scale 1 / sqrt(head_dim).
template <class Scalar>
Scalar default_scale(Index head_dim) {
  return static_cast<Scalar>(1.0 / std::sqrt(static_cast<double>(std::max<Index>(head_dim, 1))));
}

}  // namespace kernels
}  // namespace c2f
