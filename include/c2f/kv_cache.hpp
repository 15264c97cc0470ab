// c2f — KVCache: the projected keys and values of the tokens a decoding layer has seen, per batch item,
// stored as float, double, Eigen::half or Eigen::bfloat16 (arithmetic stays in the layer's Scalar).
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/detail/module.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/sdpa.hpp"

#include <Eigen/Core>

#include <algorithm>
#include <type_traits>
#include <vector>

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

  Index batch() const { return batch_; }
  Index width() const { return width_; }
  Index length() const { return length_; }
  Index capacity() const { return capacity_; }
  /// Bytes held by the keys and values (capacity, not length).
  std::size_t memory_bytes() const { return 2 * sizeof(Storage) * static_cast<std::size_t>(k_.size()); }

  /// Room for `tokens` tokens per batch item without reallocation.
  void reserve(Index tokens) {
    if (tokens <= capacity_) return;
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
  void append(const Eigen::Ref<const RowMatrix<Scalar>>& k_new, const Eigen::Ref<const RowMatrix<Scalar>>& v_new,
              Index n) {
    if (n < 0 || k_new.rows() != batch_ * n || v_new.rows() != batch_ * n || k_new.cols() != width_ ||
        v_new.cols() != width_) {
      detail::fail("KVCache::append: keys ", detail::shape_string({k_new.rows(), k_new.cols()}), " and values ",
                   detail::shape_string({v_new.rows(), v_new.cols()}), " must be [batch·n, width] = ",
                   detail::shape_string({batch_ * n, width_}));
    }
    if (length_ + n > capacity_) reserve(std::max(length_ + n, 2 * capacity_));
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

  Index batch_, width_;
  Index length_ = 0, capacity_ = 0;
  Matrix k_, v_;
};

/// What every decoding state holds: the keys and values of the tokens so far. A layer's
/// DecodeStateOf<Cache> derives from it and adds what its attention needs.
template <class Cache>
class DecodeStateBase {
 public:
  Index batch() const { return cache_.batch(); }
  /// Tokens decoded so far (per sequence).
  Index length() const { return cache_.length(); }
  const KVCache<Cache>& cache() const { return cache_; }
  /// Room for `tokens` tokens per sequence without reallocation.
  void reserve(Index tokens) { cache_.reserve(tokens); }

 protected:
  DecodeStateBase(Index batch, Index width) : cache_(batch, width) {}
  KVCache<Cache> cache_;
};

namespace detail {

/// The decoding interface of a layer (CRTP): new_decode_state(), decode() and prefill(). `Layer`
/// provides DecodeStateOf<Cache>, make_decode_state<Cache>(batch) and run_decode(x, state, outputs),
/// which appends the tokens of x to the state and returns the outputs of its last `outputs` tokens.
template <class Layer, class Scalar>
class Decoder {
 public:
  /// An empty state for `batch` sequences, with room for `reserve` tokens each; keys and values stored
  /// as `Cache` (Scalar, or Eigen::half / Eigen::bfloat16 to halve the memory; the arithmetic stays in
  /// Scalar). One state per batch of sequences; the layer itself is shared.
  template <class Cache = Scalar, class L = Layer>  // L: Layer, looked up when the function is used
  typename L::template DecodeStateOf<Cache> new_decode_state(Index batch, Index reserve = 0) const {
    if (batch < 0 || reserve < 0) fail("new_decode_state: batch and reserve must be >= 0, got ", batch, " and ", reserve);
    typename L::template DecodeStateOf<Cache> state = layer().template make_decode_state<Cache>(batch);
    state.reserve(reserve);
    return state;
  }

  /// Appends x_new [B, n, E] (n ≥ 1 tokens of each of the state's B sequences) and returns their
  /// outputs [B, n, E]: the rows the causal forward() over every token so far gives them, however the
  /// tokens were split into calls. The layer must be causal.
  template <class State>
  Tensor3<Scalar> decode(ConstTensor3Ref<Scalar> x_new, State& state) const {
    return layer().run_decode(x_new, state, x_new.seq());
  }

  /// Appends x [B, n, E] like decode() but returns only the last token's output [B, 1, E] (a prompt
  /// whose other outputs are not needed): the attention of the other n − 1 tokens is not computed.
  template <class State>
  Tensor3<Scalar> prefill(ConstTensor3Ref<Scalar> x, State& state) const {
    return layer().run_decode(x, state, std::min<Index>(1, x.seq()));
  }

 private:
  const Layer& layer() const { return static_cast<const Layer&>(*this); }
};

/// A layer that loads and saves (Module) and decodes (Decoder).
template <class Layer, class Scalar>
class DecodingModule : public Module<Layer>, public Decoder<Layer, Scalar> {};

}  // namespace detail

/// Means of the complete chunks of a KVCache's keys (and, with `values`, values) per batch item, kept up
/// to date as tokens arrive — the chunk summaries a decoding step scores without re-reading the keys.
/// A mean is kernels::chunk_mean of the cached rows (converted to Scalar).
template <class Scalar>
class ChunkSummaries {
 public:
  ChunkSummaries(Index batch, Index width, Index chunk, bool values)
      : chunk_(chunk), values_(values), k_(static_cast<std::size_t>(std::max<Index>(batch, 0)), RowMatrix<Scalar>(0, width)),
        v_(values ? k_ : std::vector<RowMatrix<Scalar>>()) {
    if (chunk < 1) detail::fail("ChunkSummaries: chunk must be >= 1, got ", chunk);
  }

  /// Complete chunks per batch item.
  Index complete() const { return complete_; }
  /// The key (value) means of batch item b: [complete(), width].
  typename RowMatrix<Scalar>::ConstRowsBlockXpr keys(Index b) const { return k_[index(b)].topRows(complete_); }
  typename RowMatrix<Scalar>::ConstRowsBlockXpr values(Index b) const { return v_[index(b)].topRows(complete_); }
  std::size_t memory_bytes() const {
    std::size_t n = 0;
    for (const RowMatrix<Scalar>& m : k_) n += sizeof(Scalar) * static_cast<std::size_t>(m.size());
    return values_ ? 2 * n : n;
  }

  /// Adds the means of the chunks the cache's tokens have completed since the last update.
  template <class Storage>
  void update(const KVCache<Storage>& cache) {
    const Index complete = cache.length() / chunk_;
    if (complete == complete_) return;
    RowMatrix<Scalar> scratch;
    for (Index b = 0; b < cache.batch(); ++b) {
      grow(k_[index(b)], complete);
      if (values_) grow(v_[index(b)], complete);
      for (Index j = complete_; j < complete; ++j) {
        mean_into(cache.keys(b, j * chunk_, chunk_), k_[index(b)].row(j), scratch);
        if (values_) mean_into(cache.values(b, j * chunk_, chunk_), v_[index(b)].row(j), scratch);
      }
    }
    complete_ = complete;
  }

 private:
  static std::size_t index(Index b) { return static_cast<std::size_t>(b); }
  static void grow(RowMatrix<Scalar>& m, Index rows) {
    if (rows > m.rows()) m.conservativeResize(std::max(rows, 2 * m.rows()), Eigen::NoChange);
  }
  template <class Rows, class Row>
  void mean_into(const Rows& rows, Row&& out, RowMatrix<Scalar>& scratch) const {
    detail::as_scalar(rows, scratch, [&](const auto& r) {
      kernels::chunk_mean<Scalar>(r, kernels::ChunkGrid{1, chunk_, chunk_}, out, 1);
    });
  }

  Index chunk_;
  bool values_;
  Index complete_ = 0;
  std::vector<RowMatrix<Scalar>> k_, v_;
};

}  // namespace c2f
