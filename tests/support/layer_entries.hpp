// The layers of the suite, one entry each, and how a test calls them: the list the layer contract
// (test_layer_contract.cpp) and the bad-input suite (test_bad_input.cpp) run over. Adding a layer is one
// C2F_LAYER line here and its name in their type lists.
#pragma once

#include "c2f/c2f.hpp"
#include "support/compare.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace c2f_test {

using c2f::Index;
using c2f::MaskFields;
using c2f::Masks;
using c2f::RowMatrix;
using c2f::Tensor3;

constexpr Index kWidth = 8;  // input features of every entry

// ------------------------------------------------------------------------------------------------
// How the tests call a layer. The default is the contract's [batch, seq, features] form; the two
// layers whose input is more than one tensor (FineAttention: tokens + coarse context; C2FAttention2D:
// a grid) adapt it.

template <class L, class S>
struct LayerCalls {
  static std::array<Index, 3> output_shape(const L& l, c2f::ConstTensor3Ref<S> x) { return l.output_shape(x); }
  static auto forward(const L& l, c2f::ConstTensor3Ref<S> x, const Masks<S>& m) { return l.forward(x, m); }
  static void forward_into(const L& l, c2f::ConstTensor3Ref<S> x, c2f::RowMatrixRef<S> out, const Masks<S>& m) {
    l.forward_into(x, out, m);
  }
  static std::size_t workspace_bytes(const L& l, Index batch, Index seq) { return l.workspace_bytes(batch, seq); }
  // Training (the layers with a Saved type, HasTrain).
  static auto forward_train(const L& l, c2f::ConstTensor3Ref<S> x, const Masks<S>& m, std::uint64_t step = 0) {
    return l.forward_train(x, m, step);
  }
  template <class Saved>
  static c2f::Grads<S> backward(const L& l, const Saved& saved, c2f::ConstTensor3Ref<S> dy) {
    return l.backward(saved, dy);
  }
};

// FineAttention on chunks of 4 tokens; the coarse context is the chunk means of x (any [B, m, d] would do).
template <class S>
struct LayerCalls<c2f::FineAttention<S>, S> {
  using L = c2f::FineAttention<S>;
  static constexpr Index kChunk = 4;
  static Tensor3<S> context(c2f::ConstTensor3Ref<S> x) {
    const c2f::kernels::ChunkGrid grid{x.dimension(0), x.dimension(1), kChunk};
    Tensor3<S> c(x.dimension(0), grid.chunks_per_batch(), x.dimension(2));
    c2f::kernels::chunk_mean<S>(x.rows(), grid, Eigen::Map<RowMatrix<S>>(c.data(), grid.chunks(), x.dimension(2)),
                                c2f::kernels::with_threads(1));
    return c;
  }
  static std::array<Index, 3> output_shape(const L& l, c2f::ConstTensor3Ref<S> x) {
    return {x.dimension(0), x.dimension(1), l.embed_dim()};
  }
  /// An input too large to read (a test declaring huge sizes over one value) gets a context of the right
  /// sizes over one value too: the layer must refuse both before reading them.
  static bool unreadable(c2f::ConstTensor3Ref<S> x) { return x.size() > (Index(1) << 24); }
  static c2f::ConstTensor3Ref<S> placeholder(c2f::ConstTensor3Ref<S> x) {
    static const S one[1] = {S(0)};
    return c2f::ConstTensor3Ref<S>(one, {x.batch(), c2f::detail::ceil_div(x.seq(), kChunk), x.features()});
  }
  static auto forward(const L& l, c2f::ConstTensor3Ref<S> x, const Masks<S>& m) {
    if (unreadable(x)) return l.forward_chunked(x, kChunk, placeholder(x), m);
    return l.forward_chunked(x, kChunk, context(x), m);
  }
  static void forward_into(const L& l, c2f::ConstTensor3Ref<S> x, c2f::RowMatrixRef<S> out, const Masks<S>& m) {
    l.forward_chunked_into(x, kChunk, context(x), out, m);
  }
  static std::size_t workspace_bytes(const L& l, Index batch, Index seq) {
    const Index chunks = batch * c2f::detail::ceil_div(seq, kChunk);
    return l.workspace_bytes(batch, seq, kChunk) + sizeof(S) * static_cast<std::size_t>(chunks * l.embed_dim());
  }
  // Training: the context is an input of its own (its gradient is g.context), not a function of x.
  static auto forward_train(const L& l, c2f::ConstTensor3Ref<S> x, const Masks<S>& m, std::uint64_t step = 0) {
    return l.forward_train(x, kChunk, context(x), m, step);
  }
  template <class Saved>
  static c2f::Grads<S> backward(const L& l, const Saved& saved, c2f::ConstTensor3Ref<S> dy) {
    return l.backward(saved, dy);
  }
};

// C2FAttention2D on the height × width grid with height the largest divisor of L up to sqrt(L).
template <class S>
struct LayerCalls<c2f::C2FAttention2D<S>, S> {
  using L = c2f::C2FAttention2D<S>;
  static std::pair<Index, Index> grid(Index seq) {
    Index h = 1;
    for (Index d = 1; d * d <= seq; ++d) {
      if (seq % d == 0) h = d;
    }
    return {h, seq == 0 ? 0 : seq / h};
  }
  static std::array<Index, 3> output_shape(const L& l, c2f::ConstTensor3Ref<S> x) {
    const auto [h, w] = grid(x.dimension(1));
    return l.output_shape(x, h, w);
  }
  static auto forward(const L& l, c2f::ConstTensor3Ref<S> x, const Masks<S>& m) {
    const auto [h, w] = grid(x.dimension(1));
    return l.forward(x, h, w, m);
  }
  static void forward_into(const L& l, c2f::ConstTensor3Ref<S> x, c2f::RowMatrixRef<S> out, const Masks<S>& m) {
    const auto [h, w] = grid(x.dimension(1));
    l.forward_into(x, h, w, out, m);
  }
  static std::size_t workspace_bytes(const L& l, Index batch, Index seq) {
    const auto [h, w] = grid(seq);
    return l.workspace_bytes(batch, h, w);
  }
  static auto forward_train(const L& l, c2f::ConstTensor3Ref<S> x, const Masks<S>& m, std::uint64_t step = 0) {
    const auto [h, w] = grid(x.dimension(1));
    return l.forward_train(x, h, w, m, step);
  }
  template <class Saved>
  static c2f::Grads<S> backward(const L& l, const Saved& saved, c2f::ConstTensor3Ref<S> dy) {
    return l.backward(saved, dy);
  }
};

/// The Scalar of a layer template instance (float for a layer class that is not a template, as the
/// contract test's deliberately broken layers).
template <class T>
struct ScalarOf {
  using type = float;
};
template <template <class> class L, class S>
struct ScalarOf<L<S>> {
  using type = S;
};

/// One entry of the list: the layer type and how to build it from options (seed, threads) — the
/// sizes are the entry's. Everything else comes from the contract.
#define C2F_LAYER(Entry, Type, ...)                             \
  struct Entry : LayerCalls<Type, ScalarOf<Type>::type> {       \
    using Layer = Type;                                         \
    using Scalar = ScalarOf<Type>::type;                        \
    using Options = Layer::Options;                             \
    static constexpr const char* name = #Entry;                 \
    static Layer make(Options o) { return Layer(__VA_ARGS__); } \
  }

// clang-format off
C2F_LAYER(Linear, c2f::Linear<float>, kWidth, 5, o);
C2F_LAYER(Conv1d, c2f::Conv1d<float>, kWidth, 6, 3, o.groups(2));
C2F_LAYER(CausalConv1d, c2f::Conv1d<float>, kWidth, 6, 3, o.causal(true));
C2F_LAYER(C3K2Projection, c2f::C3K2Projection<float>, kWidth, 2, o);
C2F_LAYER(CausalC3K2Projection, c2f::C3K2Projection<float>, kWidth, 2, o.causal(true));
C2F_LAYER(MultiHeadAttention, c2f::MultiHeadAttention<float>, kWidth, 2, o);
C2F_LAYER(MultiHeadAttentionF64, c2f::MultiHeadAttention<double>, kWidth, 4, o.query_block(5).key_block(7));
C2F_LAYER(CausalMultiHeadAttention, c2f::MultiHeadAttention<float>, kWidth, 2, o.causal(true).key_block(16));
C2F_LAYER(CoarseAttention, c2f::CoarseAttention<float>, kWidth, 2, o);
C2F_LAYER(FineAttention, c2f::FineAttention<float>, kWidth, 2, o);
C2F_LAYER(C2FAttention, c2f::C2FAttention<float>, kWidth, 2, 4, o);
C2F_LAYER(C2FAttentionGeneralPath, c2f::C2FAttention<float>, kWidth, 2, 6, o.fine_path(c2f::FinePath::General));
C2F_LAYER(C2FAttention2D, c2f::C2FAttention2D<float>, kWidth, 2, 2, 3, o);
C2F_LAYER(HMHA, c2f::HMHA<float>, kWidth, 2, 4, o);
C2F_LAYER(CausalHMHA, c2f::HMHA<float>, kWidth, 2, 6, o.causal(true));
C2F_LAYER(SparseC2FAttention, c2f::SparseC2FAttention<float>, kWidth, 2, 4, 3, o);
C2F_LAYER(CausalSparseC2FAttention, c2f::SparseC2FAttention<float>, kWidth, 2, 4, 16, o.causal(true));
// Compute::BFloat16 (docs/bf16.md): the layers that have it.
C2F_LAYER(LinearBf16, c2f::Linear<float>, kWidth, 5, o.compute(c2f::Compute::BFloat16));
C2F_LAYER(MultiHeadAttentionBf16, c2f::MultiHeadAttention<float>, kWidth, 2, o.compute(c2f::Compute::BFloat16));
C2F_LAYER(CausalMultiHeadAttentionBf16, c2f::MultiHeadAttention<float>, kWidth, 2,
          o.causal(true).key_block(32).compute(c2f::Compute::BFloat16));
C2F_LAYER(C2FAttentionBf16, c2f::C2FAttention<float>, kWidth, 2, 4, o.compute(c2f::Compute::BFloat16));
C2F_LAYER(C2FAttentionGeneralPathBf16, c2f::C2FAttention<float>, kWidth, 2, 6,
          o.fine_path(c2f::FinePath::General).compute(c2f::Compute::BFloat16));
C2F_LAYER(C2FAttention2DBf16, c2f::C2FAttention2D<float>, kWidth, 2, 2, 3, o.compute(c2f::Compute::BFloat16));
C2F_LAYER(Conv1dBf16, c2f::Conv1d<float>, kWidth, 6, 3, o.groups(2).compute(c2f::Compute::BFloat16));
C2F_LAYER(C3K2ProjectionBf16, c2f::C3K2Projection<float>, kWidth, 2, o.compute(c2f::Compute::BFloat16));
C2F_LAYER(HMHABf16, c2f::HMHA<float>, kWidth, 2, 4, o.compute(c2f::Compute::BFloat16));
C2F_LAYER(CausalHMHABf16, c2f::HMHA<float>, kWidth, 2, 6, o.causal(true).compute(c2f::Compute::BFloat16));
C2F_LAYER(SparseC2FAttentionBf16, c2f::SparseC2FAttention<float>, kWidth, 2, 4, 3, o.compute(c2f::Compute::BFloat16));
C2F_LAYER(CausalSparseC2FAttentionBf16, c2f::SparseC2FAttention<float>, kWidth, 2, 4, 16,
          o.causal(true).compute(c2f::Compute::BFloat16));
// clang-format on

// ------------------------------------------------------------------------------------------------
// Helpers

template <class T, class = void>
struct HasDecode : std::false_type {};
template <class T>
struct HasDecode<T, std::void_t<decltype(std::declval<const T&>().new_decode_state(1))>> : std::true_type {};

/// The layers that train (forward_train, backward): those with a Saved type.
template <class T, class = void>
struct HasTrain : std::false_type {};
template <class T>
struct HasTrain<T, std::void_t<typename T::Saved>> : std::true_type {};

template <class S>
bool all_nan(const c2f::ConstRowMatrixRef<S>& m) {
  return m.array().isNaN().all();
}

/// Every field of c2f::Masks set to a mask of valid shape for any self-attention-like layer whose
/// attention problems are square: causal attention masks (inside chunks for fine_attn_mask) and key
/// padding by lengths (batch item b keeps L − 1 − b keys, down to none).
template <class S>
Masks<S> every_mask(Index batch, Index seq, MaskFields fields) {
  Masks<S> m;
  if (c2f::takes(fields, MaskFields::AttnMask)) m.attn_mask(c2f::AttnMask<S>::causal());
  if (c2f::takes(fields, MaskFields::KeyPaddingMask)) {
    std::vector<Index> lengths;
    for (Index b = 0; b < batch; ++b) lengths.push_back(std::max<Index>(0, seq - 1 - b));
    m.key_padding_mask(c2f::KeyPaddingMask<S>::lengths(lengths));
  }
  if (c2f::takes(fields, MaskFields::FineAttnMask)) m.fine_attn_mask(c2f::AttnMask<S>::causal());
  return m;
}

/// Every layer, and the causal ones (each output depends on inputs up to its position only).
using AllLayers =
    ::testing::Types<Linear, Conv1d, CausalConv1d, C3K2Projection, CausalC3K2Projection, MultiHeadAttention,
                     MultiHeadAttentionF64, CausalMultiHeadAttention, CoarseAttention, FineAttention, C2FAttention,
                     C2FAttentionGeneralPath, C2FAttention2D, HMHA, CausalHMHA, SparseC2FAttention,
                     CausalSparseC2FAttention, LinearBf16, MultiHeadAttentionBf16, CausalMultiHeadAttentionBf16,
                     C2FAttentionBf16, C2FAttentionGeneralPathBf16, C2FAttention2DBf16, Conv1dBf16, C3K2ProjectionBf16,
                     HMHABf16, CausalHMHABf16, SparseC2FAttentionBf16, CausalSparseC2FAttentionBf16>;
using CausalLayers =
    ::testing::Types<CausalConv1d, CausalC3K2Projection, CausalMultiHeadAttention, CausalHMHA, CausalSparseC2FAttention,
                     CausalMultiHeadAttentionBf16, CausalHMHABf16, CausalSparseC2FAttentionBf16>;

/// gtest's names for the typed suites: the entry's name.
struct EntryNames {
  template <class E>
  static std::string GetName(int) {
    return E::name;
  }
};

}  // namespace c2f_test
