// c2f — core types shared by every module: tensors, views, errors, and overflow-checked sizes.
#pragma once

// GCC 12's AVX-512 intrinsics (Debian 12's compiler, -march=native on an AVX-512 CPU) trip its own
// -Wuninitialized / -Wmaybe-uninitialized on `__m512 __Y = __Y` in _mm512_undefined_ps (GCC bug 105593,
// fixed in GCC 13): silenced for the lines of the headers included here, so -Werror builds pass.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic pop
#endif

#include <array>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace c2f {

using Index = Eigen::Index;

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

/// The largest buffer c2f allocates: 2^40 bytes (1 TiB), far beyond the machines c2f runs on and far
/// below where 64-bit sizes wrap. A tensor, weight, workspace or state that would need more is refused
/// with std::invalid_argument ("… needs N bytes, more than the 1 TiB c2f allocates at most") before
/// anything is allocated; below it, a machine without the memory gives std::bad_alloc. docs/errors.md.
constexpr std::int64_t kMaxBufferBytes = std::int64_t(1) << 40;

/// a · b for sizes a, b >= 0; "c2f: <what>: a x b overflows" when the product does not fit an Index.
inline Index checked_mul(Index a, Index b, const char* what) {
  Index r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) fail(what, ": ", a, " x ", b, " overflows");
  return r;
}

/// a + b for sizes a, b >= 0; "c2f: <what>: a + b overflows" when the sum does not fit an Index.
inline Index checked_add(Index a, Index b, const char* what) {
  Index r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) fail(what, ": ", a, " + ", b, " overflows");
  return r;
}

/// The product of sizes >= 0, checked step by step.
inline Index checked_product(const char* what, std::initializer_list<Index> sizes) {
  Index r = 1;
  for (Index s : sizes) r = checked_mul(r, s, what);
  return r;
}

/// (2·max_h − 1)·(2·max_w − 1), the rows of a relative position bias table covering grids of up to max_h x
/// max_w positions (max_h, max_w >= 1); "c2f: <what>: a x b overflows" when it does not fit an Index.
inline Index relative_table_entries(Index max_h, Index max_w, const char* what) {
  return checked_mul(checked_mul(2, max_h, what) - 1, checked_mul(2, max_w, what) - 1, what);
}

/// ceil(a / b) for a >= 0 and b >= 1, without the overflow of (a + b − 1) / b.
inline Index ceil_div(Index a, Index b) { return a <= 0 ? 0 : 1 + (a - 1) / b; }

/// Throws unless `elements` values of `bytes_each` bytes fit in kMaxBufferBytes: "c2f: <what> needs N
/// bytes, more than the 1 TiB c2f allocates at most". Returns the byte count.
inline std::int64_t check_buffer(const char* what, Index elements, std::size_t bytes_each) {
  const Index bytes = checked_mul(elements, static_cast<Index>(bytes_each), what);
  if (bytes > kMaxBufferBytes)
    fail(what, " needs ", bytes, " bytes, more than the 1 TiB (2^40 bytes) c2f allocates at most");
  return bytes;
}

/// check_buffer on the product of `sizes`, for elements of type T.
template <class T>
std::int64_t check_buffer_of(const char* what, std::initializer_list<Index> sizes) {
  return check_buffer(what, checked_product(what, sizes), sizeof(T));
}

}  // namespace detail

/// Activations, laid out [batch, seq, features] — PyTorch's `batch_first=True` order.
template <class Scalar>
using Tensor3 = Eigen::Tensor<Scalar, 3, Eigen::RowMajor>;

/// Attention weights, laid out [batch, heads, query, key].
template <class Scalar>
using Tensor4 = Eigen::Tensor<Scalar, 4, Eigen::RowMajor>;

/// Row-major matrix: the layout of PyTorch's 2-D tensors (`Linear.weight` is [out, in]).
template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A writable view of a row-major matrix — a matrix, a block of rows or columns, a Map of the caller's
/// memory — without a copy: what kernels and forward_into write.
template <class Scalar>
using RowMatrixRef = Eigen::Ref<RowMatrix<Scalar>>;
/// A read-only view of a row-major matrix (or of any expression Eigen can view, copied only when it
/// cannot): what kernels read.
template <class Scalar>
using ConstRowMatrixRef = Eigen::Ref<const RowMatrix<Scalar>>;

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

  /// Throws std::invalid_argument when a size is negative or their product overflows an Index.
  ConstTensorRef(const Scalar* data, const std::array<Index, Rank>& dims) : data_(data), dims_(dims) {
    Index n = 1;
    for (Index d : dims) {
      if (d < 0) throw std::invalid_argument("c2f: tensor sizes must be non-negative");
      if (__builtin_mul_overflow(n, d, &n)) {
        detail::fail("a tensor of sizes ", detail::shape_string(std::vector<std::int64_t>(dims.begin(), dims.end())),
                     ": their product overflows");
      }
    }
    size_ = n;
  }
  ConstTensorRef(const Tensor& t) : ConstTensorRef(t.data(), t.dimensions()) {}                    // NOLINT
  ConstTensorRef(const Eigen::TensorMap<Tensor>& t) : ConstTensorRef(t.data(), t.dimensions()) {}  // NOLINT
  ConstTensorRef(const Eigen::TensorMap<const Tensor>& t)  // NOLINT(google-explicit-constructor)
      : ConstTensorRef(t.data(), t.dimensions()) {}

  const Scalar* data() const { return data_; }
  Index dimension(int i) const { return dims_[static_cast<std::size_t>(i)]; }
  const std::array<Index, Rank>& dimensions() const { return dims_; }
  Index size() const { return size_; }

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
  Index size_ = 0;
};

/// [batch, seq, features] input of every layer.
template <class Scalar>
using ConstTensor3Ref = ConstTensorRef<Scalar, 3>;
/// [batch, chunks, chunk, features] input of FineAttention.
template <class Scalar>
using ConstTensor4Ref = ConstTensorRef<Scalar, 4>;

namespace detail {

/// Rethrows the std::invalid_argument being handled as "c2f: <layer>: <its message>" — unless it already
/// names that layer first. Call it from a catch block.
[[noreturn]] inline void rethrow_named(const char* layer, const std::invalid_argument& e) {
  const std::string prefix = std::string("c2f: ") + layer, msg = e.what();
  const bool named_already = msg.compare(0, prefix.size(), prefix) == 0 &&
                             (msg.size() == prefix.size() || msg[prefix.size()] == ':' || msg[prefix.size()] == ' ');
  if (named_already) throw;
  throw std::invalid_argument(prefix + ": " + (msg.compare(0, 5, "c2f: ") == 0 ? msg.substr(5) : msg));
}

/// fn(), with the errors it raises in the name of `layer`, the layer the user called (a wrapped layer or
/// a kernel adds its own name after it).
template <class Fn>
decltype(auto) with_layer_name(const char* layer, Fn&& fn) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    rethrow_named(layer, e);
  }
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

/// p + offset, or null for a null p: the data of an empty matrix may be null, and an offset from null is
/// undefined even when nothing is read (clang's UBSan reports it).
template <class T>
T* offset_or_null(T* p, Index offset) {
  return p == nullptr ? nullptr : p + offset;
}

/// Columns [c0, c0 + n) of m, as m.middleCols(c0, n) but without offsetting the null data of an empty
/// matrix (Eigen's blocks do).
/// M: a row-major matrix, map or Ref (const for a read-only view).
template <class M, class Data = std::remove_pointer_t<decltype(std::declval<M&>().data())>>
Eigen::Map<std::conditional_t<std::is_const<Data>::value, const RowMatrix<std::remove_const_t<Data>>,
                              RowMatrix<std::remove_const_t<Data>>>,
           0, Eigen::OuterStride<>>
cols_of(M& m, Index c0, Index n) {
  static_assert(static_cast<bool>(M::IsRowMajor), "cols_of views a row-major matrix");
  return {offset_or_null(m.data(), c0), m.rows(), n, Eigen::OuterStride<>(m.outerStride())};
}

template <class Scalar>
constexpr void check_scalar() {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "c2f layers are defined for float and double");
}

}  // namespace detail
}  // namespace c2f
