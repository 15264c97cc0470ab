// c2f — what the decoding layers share (CRTP mixins, in namespace detail): the state every decoding
// state derives from, new_decode_state() / decode() / prefill(), and the running chunk means of a
// cache. Layers include it; users reach it through a layer's DecodeState and decode().
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/convert.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kv_cache.hpp"
#include "c2f/output.hpp"

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace c2f {
namespace detail {

template <class Layer, class Scalar>
class Decoder;

/// What every decoding state holds: the keys and values of the tokens so far, and which layer
/// configuration made it. A layer's DecodeStateOf<Cache> derives from it and adds what its attention
/// needs. States are values: a copy continues independently (a fork); a moved-from state is empty
/// (length 0) and refused by decode(). One call at a time uses a state: a second call while one runs
/// throws std::logic_error (docs/decoding.md).
template <class Cache>
class DecodeStateBase {
 public:
  Index batch() const { return cache_.batch(); }
  /// Tokens decoded so far (per sequence).
  Index length() const { return cache_.length(); }
  const KVCache<Cache>& cache() const { return cache_; }
  /// Room for `tokens` tokens per sequence without reallocation.
  void reserve(Index tokens) { cache_.reserve(tokens); }
  /// The configuration of the layer that made the state, e.g. "MultiHeadAttention(embed_dim=8,
  /// num_heads=2)"; empty once moved from.
  const std::string& made_by() const { return made_by_; }

  DecodeStateBase(const DecodeStateBase& o) : cache_(o.cache_), made_by_(o.made_by_) {}
  DecodeStateBase(DecodeStateBase&& o) noexcept : cache_(std::move(o.cache_)), made_by_(std::move(o.made_by_)) {
    o.made_by_.clear();
  }
  DecodeStateBase& operator=(const DecodeStateBase& o) {
    cache_ = o.cache_;
    made_by_ = o.made_by_;
    return *this;
  }
  DecodeStateBase& operator=(DecodeStateBase&& o) noexcept {
    if (this != &o) {
      cache_ = std::move(o.cache_);
      made_by_ = std::move(o.made_by_);
      o.made_by_.clear();
    }
    return *this;
  }

 protected:
  DecodeStateBase(Index batch, Index width, std::string made_by) : cache_(batch, width), made_by_(std::move(made_by)) {}
  KVCache<Cache> cache_;

 private:
  template <class, class>
  friend class Decoder;

  /// Marks the state in use by one decode() call for its lifetime.
  class Use {
   public:
    Use(const char* layer, std::atomic<bool>& busy) : busy_(busy) {
      if (busy_.exchange(true, std::memory_order_acquire)) {
        throw std::logic_error(std::string("c2f: ") + layer +
                               "::decode: this state is in use by another call (a state "
                               "serves one call at a time; give each thread its own)");
      }
    }
    ~Use() { busy_.store(false, std::memory_order_release); }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    std::atomic<bool>& busy_;
  };
  /// Throws unless the state was made by a layer configured as `config`; then marks it in use.
  Use begin_use(const char* layer, const std::string& config) {
    if (made_by_.empty()) {
      fail(layer, "::decode: the state was moved from; make a new one with new_decode_state()");
    }
    if (made_by_ != config) fail(layer, "::decode: the state was made by ", made_by_, ", not by this ", config);
    return Use(layer, busy_);
  }

  std::string made_by_;
  std::atomic<bool> busy_{false};
};

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
    return with_layer_name(L::type_name, [&] {
      if (batch < 0 || reserve < 0)
        fail("new_decode_state: batch and reserve must be >= 0, got ", batch, " and ", reserve);
      check_buffer_of<Cache>("new_decode_state: the keys (and as many values) of [batch, reserve, embed_dim]",
                             {batch, reserve, layer().embed_dim()});
      typename L::template DecodeStateOf<Cache> state = layer().template make_decode_state<Cache>(batch);
      state.reserve(reserve);
      return state;
    });
  }

  /// Appends x_new [B, n, E] (n ≥ 1 tokens of each of the state's B sequences) and returns their
  /// outputs [B, n, E]: the rows the causal forward() over every token so far gives them, however the
  /// tokens were split into calls. The layer must be causal, and the state made by a layer configured
  /// as this one (new_decode_state()); one call at a time per state.
  template <class State>
  Output<Scalar> decode(ConstTensor3Ref<Scalar> x_new, State& state) const {
    return run(x_new, state, x_new.seq());
  }

  /// Appends x [B, n, E] like decode() but returns only the last token's output [B, 1, E] (a prompt
  /// whose other outputs are not needed): the attention of the other n − 1 tokens is not computed.
  template <class State>
  Output<Scalar> prefill(ConstTensor3Ref<Scalar> x, State& state) const {
    return run(x, state, std::min<Index>(1, x.seq()));
  }

 private:
  const Layer& layer() const { return static_cast<const Layer&>(*this); }
  template <class State>
  Output<Scalar> run(const ConstTensor3Ref<Scalar>& x, State& state, Index outputs) const {
    return with_layer_name(Layer::type_name, [&] {
      const auto use = state.begin_use(Layer::type_name, layer().decode_config());
      return layer().run_decode(x, state, outputs);
    });
  }
};

/// Means of the complete chunks of a KVCache's keys (and, with `values`, values) per batch item, kept up
/// to date as tokens arrive — the chunk summaries a decoding step scores without re-reading the keys.
/// A mean is kernels::chunk_mean of the cached rows (converted to Scalar).
template <class Scalar>
class ChunkSummaries {
 public:
  ChunkSummaries(Index batch, Index width, Index chunk, bool values)
      : chunk_(chunk),
        values_(values),
        k_(checked_count(batch), RowMatrix<Scalar>(0, width)),
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
  static std::size_t checked_count(Index batch) {
    check_buffer("decode state: the chunk means of every sequence", std::max<Index>(batch, 0),
                 2 * sizeof(RowMatrix<Scalar>));
    return static_cast<std::size_t>(std::max<Index>(batch, 0));
  }
  static std::size_t index(Index b) { return static_cast<std::size_t>(b); }
  static void grow(RowMatrix<Scalar>& m, Index rows) {
    if (rows > m.rows()) m.conservativeResize(std::max(rows, 2 * m.rows()), Eigen::NoChange);
  }
  template <class Rows, class Row>
  void mean_into(const Rows& rows, Row&& out, RowMatrix<Scalar>& scratch) const {
    detail::as_scalar(rows, scratch, [&](const auto& r) {
      kernels::chunk_mean<Scalar>(r, kernels::ChunkGrid{1, chunk_, chunk_}, out, kernels::with_threads(1));
    });
  }

  Index chunk_;
  bool values_;
  Index complete_ = 0;
  std::vector<RowMatrix<Scalar>> k_, v_;
};

}  // namespace detail
}  // namespace c2f
