// c2f — KVCache: the projected keys and values of the tokens a decoding layer has seen, per batch item,
// stored as float, double, Eigen::half or Eigen::bfloat16 (arithmetic stays in the layer's Scalar).
// The decoding states built on it and the layers' decode() are in c2f/layers/support/decoding.hpp.
#pragma once

#include "c2f/core.hpp"
#include "c2f/kernels/heads_view.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <utility>

namespace c2f {

/// Keys and values [batch, length, width] of every batch item (all items advance together), in
/// `Storage`. Capacity grows by doubling (reserve() avoids it); rows of batch item b are contiguous.
template <class Storage>
class KVCache {
 public:
  using Matrix = RowMatrix<Storage>;
  using Rows = Eigen::Block<const Matrix>;

  KVCache(Index batch, Index width) : batch_(batch), width_(width) {
    if (batch < 0 || width <= 0) detail::fail("KVCache needs batch >= 0 and width > 0, got ", batch, " and ", width);
    k_.resize(0, width_);
    v_.resize(0, width_);
  }
  KVCache(const KVCache&) = default;
  KVCache& operator=(const KVCache&) = default;
  /// A moved-from cache is empty (length and capacity 0) and still usable.
  KVCache(KVCache&& o) noexcept : batch_(o.batch_), width_(o.width_) {
    k_.resize(0, width_);
    v_.resize(0, width_);
    swap_contents(o);
  }
  KVCache& operator=(KVCache&& o) noexcept {
    if (this != &o) {
      batch_ = o.batch_;
      width_ = o.width_;
      k_.resize(0, width_);
      v_.resize(0, width_);
      length_ = capacity_ = 0;
      swap_contents(o);
    }
    return *this;
  }

  Index batch() const { return batch_; }
  Index width() const { return width_; }
  Index length() const { return length_; }
  Index capacity() const { return capacity_; }
  /// Bytes held by the keys and values (capacity, not length).
  std::size_t memory_bytes() const { return 2 * sizeof(Storage) * static_cast<std::size_t>(k_.size()); }

  /// Room for `tokens` tokens per batch item without reallocation. Refused (std::invalid_argument) when
  /// the keys and values would exceed the largest buffer c2f allocates (c2f/core.hpp).
  void reserve(Index tokens) {
    if (tokens <= capacity_) return;
    detail::check_buffer_of<Storage>("decode state: the keys (and as many values) of [batch, tokens, width]",
                                     {batch_, tokens, width_});
    Matrix k(batch_ * tokens, width_), v(batch_ * tokens, width_);
    for (Index b = 0; b < batch_; ++b) {
      k.middleRows(b * tokens, length_) = k_.middleRows(b * capacity_, length_);
      v.middleRows(b * tokens, length_) = v_.middleRows(b * capacity_, length_);
    }
    k_.swap(k);
    v_.swap(v);
    capacity_ = tokens;
  }

  /// Appends n tokens per batch item: k_new, v_new [batch·n, width], batch-major (row b·n + i),
  /// converted to Storage.
  template <class Scalar>
  void append(const ConstRowMatrixRef<Scalar>& k_new, const ConstRowMatrixRef<Scalar>& v_new, Index n) {
    if (n < 0 || k_new.rows() != batch_ * n || v_new.rows() != batch_ * n || k_new.cols() != width_ ||
        v_new.cols() != width_) {
      detail::fail("KVCache::append: keys ", detail::shape_string({k_new.rows(), k_new.cols()}), " and values ",
                   detail::shape_string({v_new.rows(), v_new.cols()}),
                   " must be [batch·n, width] = ", detail::shape_string({batch_ * n, width_}));
    }
    const Index need = detail::checked_add(length_, n, "decode state: tokens so far + new tokens");
    if (need > capacity_) reserve(capacity_ <= need / 2 ? need : 2 * capacity_);  // max(need, 2·capacity), no overflow
    for (Index b = 0; b < batch_; ++b) {
      k_.middleRows(b * capacity_ + length_, n) = k_new.middleRows(b * n, n).template cast<Storage>();
      v_.middleRows(b * capacity_ + length_, n) = v_new.middleRows(b * n, n).template cast<Storage>();
    }
    length_ += n;
  }

  /// Rows [first, first + count) of batch item b: [count, width].
  Rows keys(Index b, Index first, Index count) const { return k_.block(b * capacity_ + first, 0, count, width_); }
  Rows values(Index b, Index first, Index count) const { return v_.block(b * capacity_ + first, 0, count, width_); }

  /// Every cached key (value) as `heads` heads: a [batch, length, heads, width / heads] view.
  kernels::HeadsView<const Storage> key_heads(Index heads) const { return view(k_, heads); }
  kernels::HeadsView<const Storage> value_heads(Index heads) const { return view(v_, heads); }

 private:
  kernels::HeadsView<const Storage> view(const Matrix& m, Index heads) const {
    kernels::HeadsView<const Storage> h =
        kernels::heads_view<const Storage>(m.data(), batch_, length_, width_, 0, heads, width_ / heads);
    h.batch_stride = capacity_ * width_;
    return h;
  }

  void swap_contents(KVCache& o) noexcept {
    k_.swap(o.k_);
    v_.swap(o.v_);
    std::swap(length_, o.length_);
    std::swap(capacity_, o.capacity_);
  }

  Index batch_, width_;
  Index length_ = 0, capacity_ = 0;
  Matrix k_, v_;
};

}  // namespace c2f
