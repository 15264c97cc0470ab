// c2f — layer options: named, chainable setters (PyTorch C++'s TORCH_ARG style) instead of positional
// aggregates, and the option groups several layers share.
//
//   c2f::MultiHeadAttention<float> mha(512, 8, c2f::MultiHeadAttention<float>::Options().causal(true).num_threads(2));
//   mha.options().num_threads();  // 2
//
// Every option is a getter `name()` and a setter `name(value)` that returns the options object, so
// setters chain. Options that mean the same thing have the same name on every layer (num_threads, seed,
// bias, causal, kernel, query_block, key_block, fine_path), and a layer that wraps another takes the
// wrapped layer's options too.
#pragma once

#include "c2f/core.hpp"

#include <cstdint>

/// Declares option `name` of type `T`: a getter `name()`, a chainable setter `name(value)` returning
/// the options object, and the private field `name_`, whose default follows:
///   C2F_ARG(bool, causal) = false;
#define C2F_ARG(T, name)                                      \
 public:                                                      \
  auto name(const T& new_##name)->decltype(*this) {           \
    this->name##_ = new_##name;                               \
    return *this;                                             \
  }                                                           \
  const T& name() const noexcept { return this->name##_; }   \
                                                              \
 private:                                                     \
  T name##_

/// C2F_ARG for an option group shared by several options types (a base class template over the
/// options type `Derived`): the setter returns `Derived&`, so chains go on with Derived's setters.
#define C2F_SHARED_ARG(T, name)                               \
 public:                                                      \
  Derived& name(const T& new_##name) {                        \
    this->name##_ = new_##name;                               \
    return static_cast<Derived&>(*this);                      \
  }                                                           \
  const T& name() const noexcept { return this->name##_; }   \
                                                              \
 private:                                                     \
  T name##_

namespace c2f {

/// Which kernel computes softmax(q kᵀ · scale) v when no attention weights are asked for.
enum class AttnKernel {
  Streaming,  ///< blocked online softmax, no [queries, keys] buffer (default)
  Naive,      ///< materialises the scores of one (batch, head) at a time; the reference
};

/// Options every layer has. `Derived` is the layer's options type (its setters return it).
template <class Derived>
class RuntimeOptions {
  /// Worker threads of one call: 0 = c2f::get_num_threads() (c2f/runtime.hpp), else a cap on it;
  /// results are bitwise the same for any count.
  C2F_SHARED_ARG(int, num_threads) = 0;
  /// Seed of the deterministic initialisation of a fresh layer (PyTorch's init distributions).
  C2F_SHARED_ARG(std::uint64_t, seed) = 0;
};

/// Options of the dense softmax-attention kernel, on every layer built on MultiHeadAttention.
template <class Derived>
class AttnKernelOptions {
  C2F_SHARED_ARG(AttnKernel, kernel) = AttnKernel::Streaming;
  /// Streaming kernel: query rows per task.
  C2F_SHARED_ARG(Index, query_block) = 64;
  /// Streaming kernel: keys per online-softmax step.
  C2F_SHARED_ARG(Index, key_block) = 256;
};

namespace detail {

/// The options of a layer another one wraps, from the wrapper's: num_threads, and seed + seed_offset.
template <class To, class From>
To runtime_options(const From& from, std::uint64_t seed_offset = 0) {
  To to;
  to.num_threads(from.num_threads()).seed(from.seed() + seed_offset);
  return to;
}

/// runtime_options, and the attention kernel's: kernel, query_block, key_block.
template <class To, class From>
To attention_options(const From& from, std::uint64_t seed_offset = 0) {
  To to = runtime_options<To>(from, seed_offset);
  to.kernel(from.kernel()).query_block(from.query_block()).key_block(from.key_block());
  return to;
}

/// "<layer> needs embed_dim > 0 and num_heads > 0 dividing it": the check of every attention layer.
inline void check_embed_heads(const char* layer, Index embed_dim, Index num_heads) {
  if (embed_dim <= 0 || num_heads <= 0) {
    fail(layer, " needs embed_dim > 0 and num_heads > 0, got embed_dim=", embed_dim, ", num_heads=", num_heads);
  }
  if (embed_dim % num_heads != 0) {
    fail(layer, ": embed_dim (", embed_dim, ") must be divisible by num_heads (", num_heads, ")");
  }
}

}  // namespace detail
}  // namespace c2f
