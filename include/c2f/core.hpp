// c2f — core types shared by every module: tensors, views, errors.
#pragma once

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

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

/// A read-only view of a [batch, seq, features] row-major block of memory.
///
/// Every `forward` takes this type, so it accepts a `Tensor3`, an `Eigen::TensorMap` over caller
/// memory (const or not), or a raw pointer with its three sizes — without copying.
template <class Scalar>
class ConstTensor3Ref {
 public:
  ConstTensor3Ref(const Scalar* data, Index batch, Index seq, Index features)
      : data_(data), batch_(batch), seq_(seq), features_(features) {
    if (batch < 0 || seq < 0 || features < 0) {
      throw std::invalid_argument("c2f: tensor sizes must be non-negative");
    }
  }
  ConstTensor3Ref(const Tensor3<Scalar>& t)  // NOLINT(google-explicit-constructor)
      : ConstTensor3Ref(t.data(), t.dimension(0), t.dimension(1), t.dimension(2)) {}
  ConstTensor3Ref(const Eigen::TensorMap<Tensor3<Scalar>>& t)  // NOLINT(google-explicit-constructor)
      : ConstTensor3Ref(t.data(), t.dimension(0), t.dimension(1), t.dimension(2)) {}
  ConstTensor3Ref(  // NOLINT(google-explicit-constructor)
      const Eigen::TensorMap<const Tensor3<Scalar>>& t)
      : ConstTensor3Ref(t.data(), t.dimension(0), t.dimension(1), t.dimension(2)) {}

  const Scalar* data() const { return data_; }
  Index batch() const { return batch_; }
  Index seq() const { return seq_; }
  Index features() const { return features_; }

  /// All tokens as one [batch·seq, features] row-major matrix.
  Eigen::Map<const RowMatrix<Scalar>> rows() const {
    return Eigen::Map<const RowMatrix<Scalar>>(data_, batch_ * seq_, features_);
  }

 private:
  const Scalar* data_;
  Index batch_;
  Index seq_;
  Index features_;
};

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

template <class Scalar>
constexpr void check_scalar() {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "c2f layers are defined for float and double");
}

}  // namespace detail
}  // namespace c2f
