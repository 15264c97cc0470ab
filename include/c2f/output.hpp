// c2f — what forward() returns: a tensor whose buffer goes back to c2f's scratch cache when it dies.
//
//   auto y = layer.forward(x);          // c2f::Output<float>: an Eigen::TensorMap that owns its buffer
//   y(b, t, f), y.dimension(0), y.data(), (y - z).abs().maximum(), ...   (every TensorMap operation)
//   c2f::Tensor3<float> t = layer.forward(x);   // a copy into a plain Eigen::Tensor, when one is needed
//
// An output of kScratchMinBytes (256 KiB) or more comes from the cache that serves the layers' temporaries
// (detail/scratch.hpp) and returns to it when the Output dies, so a loop
// `for (...) { auto y = layer.forward(x); ... }` computes into the same warm pages every call, as
// forward_into does with a caller's buffer. A buffer freed to glibc instead is memory the process has
// never touched on the next call: glibc maps a block of 32 MiB or more afresh every time and Linux zeroes
// it page by page (docs/layers.md, "Scratch memory"). What the cache may keep: c2f::scratch_cache_limit().
// An Output may die on any thread.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/scratch.hpp"

#include <array>
#include <cstddef>
#include <cstring>
#include <new>
#include <utility>

namespace c2f {

/// A row-major tensor of `Rank` dimensions that owns its buffer, from the scratch cache: what forward(),
/// decode() and forward_train() return. It is an `Eigen::TensorMap<Eigen::Tensor<Scalar, Rank,
/// Eigen::RowMajor>>`, so it reads, writes and takes part in tensor expressions as one, and every
/// `forward` takes it as input. Copying copies the values into a new buffer; moving moves the buffer;
/// assigning an expression (`y = y * 2.0f`) writes the values into this buffer (the shapes must agree).
/// `Eigen::Tensor<Scalar, Rank, Eigen::RowMajor> t = output;` copies it into a plain tensor.
template <class Scalar, int Rank = 3>
class Output : public Eigen::TensorMap<Eigen::Tensor<Scalar, Rank, Eigen::RowMajor>> {
 public:
  using Tensor = Eigen::Tensor<Scalar, Rank, Eigen::RowMajor>;
  using Map = Eigen::TensorMap<Tensor>;
  using Map::operator=;

  /// An empty output (every dimension 0, no buffer).
  Output() : Map(nullptr, std::array<Index, Rank>{}) {}
  /// An output of `dims`, its values not yet written. Throws std::invalid_argument naming `what` when a
  /// size is negative or the buffer would exceed 1 TiB, std::bad_alloc when the memory cannot be had.
  explicit Output(const std::array<Index, Rank>& dims, const char* what = "an output")
      : Map(nullptr, std::array<Index, Rank>{}) {
    Index elements = 1;
    for (Index d : dims) elements = detail::checked_mul(elements, d, what);
    detail::check_buffer(what, elements, sizeof(Scalar));
    if (elements > 0) buffer_.reserve(static_cast<std::size_t>(elements));
    rebind(buffer_.data(), dims);
  }
  Output(const Output& other) : Output(dims_of(other)) {
    if (other.size() > 0)
      std::memcpy(this->data(), other.data(), sizeof(Scalar) * static_cast<std::size_t>(other.size()));
  }
  Output(Output&& other) noexcept : Map(other), buffer_(std::move(other.buffer_)) {
    other.rebind(nullptr, std::array<Index, Rank>{});
  }
  /// A copy of another output's shape and values (this output's buffer is replaced).
  Output& operator=(const Output& other) {
    if (this != &other) {
      Output copy(other);
      swap(copy);
    }
    return *this;
  }
  /// Takes other's buffer; this output's own goes back to the cache.
  Output& operator=(Output&& other) noexcept {
    if (this != &other) {
      Output taken(std::move(other));
      swap(taken);
    }
    return *this;
  }
  void swap(Output& other) noexcept {
    std::swap(buffer_, other.buffer_);
    const std::array<Index, Rank> mine = dims_of(*this), theirs = dims_of(other);
    Scalar* const my_data = this->data();
    rebind(other.data(), theirs);
    other.rebind(my_data, mine);
  }

  /// Itself, for Eigen's operators (`output + other` names the Output's type in its result).
  Output& derived() { return *this; }
  const Output& derived() const { return *this; }

  /// Whether its buffer comes from the scratch cache (its pages mapped and written by an earlier holder)
  /// rather than from new memory.
  bool reused_buffer() const { return buffer_.reused(); }

 private:
  static std::array<Index, Rank> dims_of(const Map& m) {
    std::array<Index, Rank> d{};
    for (int i = 0; i < Rank; ++i) d[static_cast<std::size_t>(i)] = m.dimension(i);
    return d;
  }
  /// Points the map at `data` with `dims` (Eigen's way to re-seat a map: a new map in its place).
  void rebind(Scalar* data, const std::array<Index, Rank>& dims) noexcept {
    Map* self = this;
    new (self) Map(data, dims);
  }

  detail::ScratchArray<Scalar> buffer_;
};

/// What forward_train() returns: `auto [output, saved] = layer.forward_train(x, masks);`. `saved` is the
/// layer's Saved state, which its backward() takes.
template <class Scalar, class Saved>
struct TrainOutput {
  Output<Scalar> output;
  Saved saved;
};

}  // namespace c2f

// Eigen's tensor expressions read an Output as the TensorMap it is (an assignment `tensor = output` names
// the Output's own type).
namespace Eigen {
namespace internal {
template <class Scalar, int Rank>
struct traits<c2f::Output<Scalar, Rank>> : traits<TensorMap<Tensor<Scalar, Rank, RowMajor>>> {};
template <class Scalar, int Rank>
struct eval<c2f::Output<Scalar, Rank>, Eigen::Dense> : eval<TensorMap<Tensor<Scalar, Rank, RowMajor>>, Eigen::Dense> {};
template <class Scalar, int Rank>
struct eval<const c2f::Output<Scalar, Rank>, Eigen::Dense>
    : eval<TensorMap<Tensor<Scalar, Rank, RowMajor>>, Eigen::Dense> {};
template <class Scalar, int Rank>
struct nested<c2f::Output<Scalar, Rank>> : nested<TensorMap<Tensor<Scalar, Rank, RowMajor>>> {};
template <class Scalar, int Rank>
struct nested<const c2f::Output<Scalar, Rank>> : nested<TensorMap<Tensor<Scalar, Rank, RowMajor>>> {};
}  // namespace internal
template <class Scalar, int Rank, class Device>
struct TensorEvaluator<const c2f::Output<Scalar, Rank>, Device>
    : TensorEvaluator<const TensorMap<Tensor<Scalar, Rank, RowMajor>>, Device> {
  using TensorEvaluator<const TensorMap<Tensor<Scalar, Rank, RowMajor>>, Device>::TensorEvaluator;
};
template <class Scalar, int Rank, class Device>
struct TensorEvaluator<c2f::Output<Scalar, Rank>, Device>
    : TensorEvaluator<TensorMap<Tensor<Scalar, Rank, RowMajor>>, Device> {
  using TensorEvaluator<TensorMap<Tensor<Scalar, Rank, RowMajor>>, Device>::TensorEvaluator;
};
}  // namespace Eigen
