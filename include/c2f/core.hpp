// c2f — core types shared by every module: tensors, views, errors.
#pragma once

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

#include <array>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace c2f {

using Index = Eigen::Index;

/// Activations, laid out [batch, seq, features] — PyTorch's `batch_first=True` order.
template <class Scalar>
using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

/// Attention weights, laid out [batch, heads, query, key].
template <class Scalar>
using Tensor4 = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>;

/// Row-major matrix: the layout of PyTorch's 2-D tensors (`Linear.weight` is [out, in]).
template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

/// A read-only view of a row-major block of memory with `Rank` dimensions, the last one features.
///
/// Every `forward` takes this type, so it accepts an `Eigen::Tensor`, an `Eigen::TensorMap` over
/// caller memory (const or not), or a raw pointer with its sizes — without copying.
template <class Scalar, int Rank>
class ConstTensorRef {
 public:
  using Tensor = Eigen::Tensor<Scalar, Rank, Eigen::RowMajor>;

  ConstTensorRef(const Scalar* data, const std::array<Index, Rank>& dims) : data_(data), dims_(dims) {
    for (Index d : dims) {
      if (d < 0) throw std::invalid_argument("c2f: tensor sizes must be non-negative");
    }
  }
  ConstTensorRef(const Tensor& t) : ConstTensorRef(t.data(), t.dimensions()) {}  // NOLINT
  ConstTensorRef(const Eigen::TensorMap<Tensor>& t) : ConstTensorRef(t.data(), t.dimensions()) {}  // NOLINT
  ConstTensorRef(const Eigen::TensorMap<const Tensor>& t)  // NOLINT(google-explicit-constructor)
      : ConstTensorRef(t.data(), t.dimensions()) {}

  const Scalar* data() const { return data_; }
  Index dimension(int i) const { return dims_[static_cast<std::size_t>(i)]; }
  const std::array<Index, Rank>& dimensions() const { return dims_; }
  Index size() const {
    Index n = 1;
    for (Index d : dims_) n *= d;
    return n;
  }

  /// [batch, seq, features] names for rank 3.
  Index batch() const { return dims_[0]; }
  Index seq() const {
    static_assert(Rank == 3, "seq() is the middle dimension of a [batch, seq, features] tensor");
    return dims_[1];
  }
  Index features() const { return dims_[Rank - 1]; }

  /// All rows as one [size / features, features] row-major matrix.
  Eigen::Map<const RowMatrix<Scalar>> rows() const {
    const Index f = features();
    return Eigen::Map<const RowMatrix<Scalar>>(data_, f == 0 ? 0 : size() / f, f);
  }

 private:
  template <class Dims>
  ConstTensorRef(const Scalar* data, const Dims& dims) : ConstTensorRef(data, to_array(dims)) {}
  template <class Dims>
  static std::array<Index, Rank> to_array(const Dims& dims) {
    std::array<Index, Rank> a{};
    for (int i = 0; i < Rank; ++i) a[static_cast<std::size_t>(i)] = dims[i];
    return a;
  }

  const Scalar* data_;
  std::array<Index, Rank> dims_;
};

/// [batch, seq, features] input of every layer.
template <class Scalar>
using ConstTensor3Ref = ConstTensorRef<Scalar, 3>;
/// [batch, chunks, chunk, features] input of FineAttention.
template <class Scalar>
using ConstTensor4Ref = ConstTensorRef<Scalar, 4>;

namespace detail {

inline std::string shape_string(std::initializer_list<Index> dims) {
  std::ostringstream os;
  os << '[';
  bool first = true;
  for (Index d : dims) {
    if (!first) os << ", ";
    os << d;
    first = false;
  }
  os << ']';
  return os.str();
}

inline std::string shape_string(const std::vector<std::int64_t>& dims) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < dims.size(); ++i) os << (i ? ", " : "") << dims[i];
  os << ']';
  return os.str();
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream os;
  os << "c2f: ";
  (os << ... << parts);
  throw std::invalid_argument(os.str());
}

/// Throws "<layer>: <what> must be [batch, seq, <width_name>=<width>], got [b, l, f]" unless the
/// input's last dimension is `width`.
template <class Scalar>
void check_features(const ConstTensorRef<Scalar, 3>& x, Index width, const char* layer, const char* what,
                    const char* width_name) {
  if (x.features() != width) {
    fail(layer, ": ", what, " must be [batch, seq, ", width_name, "=", width, "], got ",
         shape_string({x.batch(), x.seq(), x.features()}));
  }
}

template <class Scalar>
constexpr void check_scalar() {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "c2f layers are defined for float and double");
}

}  // namespace detail
}  // namespace c2f
