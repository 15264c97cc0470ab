// c2f — what every layer is built from: sizes checked in the first member initialiser, the options a
// layer hands to its kernels and to the layers it wraps, the output checks, and the contract's CRTP
// bases. docs/layers.md ("The layer contract") states the contract; CONTRIBUTING.md how to add a layer.
//
// The contract. Every layer L (Linear, Conv1d, C3K2Projection, MultiHeadAttention, CoarseAttention,
// FineAttention, C2FAttention, C2FAttention2D, HMHA, SparseC2FAttention) has
//   L(sizes…, Options options = Options())   positional sizes, then the options; validated at once
//   output_shape(x)          the [batch, seq, features] forward(x) returns (validates x)
//   forward(x, masks)        forward_into on a fresh buffer
//   forward_into(x, out, masks)   out [batch·seq, features] of the caller, overwritten
//   workspace_bytes(batch, seq)   the temporary memory of one forward_into at its peak
//   mask_fields              the c2f::Masks fields it takes (any other set field throws)
//   state_dict(), load_state_dict(sd)   PyTorch's names; strict loading
//   set_num_threads(n), options()
// and the causal ones new_decode_state(), decode(), prefill(). FineAttention's inputs are tokens plus
// a coarse context and C2FAttention2D's a grid: their forward family takes those extra arguments.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/decoding.hpp"
#include "c2f/detail/huge_pages.hpp"
#include "c2f/detail/module.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/mask.hpp"
#include "c2f/options.hpp"

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace c2f {
namespace detail {

/// embed_dim and num_heads of an attention layer.
struct HeadShape {
  Index embed_dim = 0, num_heads = 0;
  Index head_dim() const { return embed_dim / num_heads; }
};

/// "<layer> needs embed_dim >= min_embed and num_heads > 0 dividing it": the check of every layer with
/// heads, for its first member (so that no member is built from invalid sizes); and its weights, about
/// `matrices` of [embed_dim, embed_dim] Scalars, must be allocatable (c2f/core.hpp, kMaxBufferBytes).
template <class Scalar>
HeadShape checked_heads(const char* layer, Index embed_dim, Index num_heads, Index min_embed, Index matrices) {
  if (embed_dim < min_embed || num_heads <= 0) {
    fail(layer, " needs embed_dim >= ", min_embed, " and num_heads > 0, got embed_dim=", embed_dim,
         ", num_heads=", num_heads);
  }
  if (embed_dim % num_heads != 0) {
    fail(layer, ": embed_dim (", embed_dim, ") must be divisible by num_heads (", num_heads, ")");
  }
  check_buffer_of<Scalar>((std::string(layer) + ": its weights (about " + std::to_string(matrices) +
                           " x embed_dim x embed_dim values)").c_str(),
                          {matrices, embed_dim, embed_dim});
  return {embed_dim, num_heads};
}

/// `value` when it is >= 1, else "<layer>: <what> must be >= 1, got <value>".
inline Index checked_positive(const char* layer, const char* what, Index value) {
  if (value < 1) fail(layer, ": ", what, " must be >= 1, got ", value);
  return value;
}

/// The kernels' options of a layer's options: its threads and, when it has them, its attention blocks.
template <class Options>
kernels::KernelOptions kernel_options(const Options& o) {
  kernels::KernelOptions k;
  k.num_threads(o.num_threads());
  if constexpr (std::is_base_of<AttnKernelOptions<Options>, Options>::value) {
    k.query_block(o.query_block()).key_block(o.key_block());
  }
  return k;
}

/// The options of a layer another one wraps, from the wrapper's: num_threads, seed + seed_offset and,
/// when both have them, the attention kernel's (kernel, query_block, key_block).
template <class To, class From>
To inner_options(const From& from, std::uint64_t seed_offset = 0) {
  To to;
  to.num_threads(from.num_threads()).seed(from.seed() + seed_offset);
  if constexpr (std::is_base_of<AttnKernelOptions<To>, To>::value &&
                std::is_base_of<AttnKernelOptions<From>, From>::value) {
    to.kernel(from.kernel()).query_block(from.query_block()).key_block(from.key_block());
  }
  return to;
}

/// The contract's static members of a layer: its name (the one its messages use) and the fields of
/// c2f::Masks it takes.
#define C2F_LAYER_TRAITS(name, fields)          \
  static constexpr const char* type_name = name; \
  static constexpr ::c2f::MaskFields mask_fields = fields

/// Rows of the caller's output: [batch·seq, features], row-major.
template <class Scalar>
using OutRows = Eigen::Ref<RowMatrix<Scalar>>;

/// "<layer>: out must be [batch·seq, features] = [rows, cols] for an output [B, L, F], got [r, c]" unless
/// out holds the rows of an output of shape `dims`.
template <class Scalar>
void check_out(const char* layer, const OutRows<Scalar>& out, const std::array<Index, 3>& dims) {
  if (out.rows() != dims[0] * dims[1] || out.cols() != dims[2]) {
    fail(layer, ": out must be [batch·seq, features] = ", shape_string({dims[0] * dims[1], dims[2]}),
         " for an output ", shape_string({dims[0], dims[1], dims[2]}), ", got ", shape_string({out.rows(), out.cols()}));
  }
}

/// The entry checks of a forward_into: only the mask fields the layer takes (`fields`), the output's
/// shape (`dims`, from output_shape(x), which validated x) and out's. Returns dims.
template <class Scalar>
std::array<Index, 3> check_call(const char* layer, const Masks<Scalar>& masks, MaskFields fields,
                                const std::array<Index, 3>& dims, const OutRows<Scalar>& out) {
  check_mask_fields(masks, layer, fields);
  check_out(layer, out, dims);
  return dims;
}

/// A fresh [dims] output (huge pages advised when large) filled by fill(rows of it); refused before it
/// is allocated when it would exceed kMaxBufferBytes.
template <class Scalar, class Fill>
Tensor3<Scalar> fresh_output(const char* layer, const std::array<Index, 3>& dims, Fill&& fill) {
  check_buffer_of<Scalar>((std::string(layer) + ": an output " + shape_string({dims[0], dims[1], dims[2]})).c_str(),
                          {dims[0], dims[1], dims[2]});
  Tensor3<Scalar> y(dims[0], dims[1], dims[2]);
  prefer_huge_pages(y);
  fill(OutRows<Scalar>(Eigen::Map<RowMatrix<Scalar>>(y.data(), dims[0] * dims[1], dims[2])));
  return y;
}

/// output_shape() of a layer that keeps the sequence: checks x's features and returns [batch, seq, width].
template <class Scalar>
std::array<Index, 3> same_length_shape(const ConstTensor3Ref<Scalar>& x, Index in_features, Index out_features,
                                       const char* layer, const char* width_name = "embed_dim") {
  check_features(x, in_features, layer, "x", width_name);
  return {x.batch(), x.seq(), out_features};
}

/// The contract's CRTP base of a layer on [batch, seq, features] input: state dicts (Module), and
/// forward(x, masks) and forward_into(x, out, masks), which check the mask fields, x and out, then run
/// Derived::compute(x, out, masks), with every error in the layer's name. For a layer that maps [B, L,
/// embed_dim] to [B, L, embed_dim] also output_shape(x). Derived provides
///   C2F_LAYER_TRAITS(name, fields);
///   void compute(const ConstTensor3Ref<Scalar>&, OutRows<Scalar>, const Masks<Scalar>&) const  (private;
///        friend LayerBase: the checks have run)
/// and embed_dim(), or its own output_shape(x) (which validates x). A layer with more forward overloads
/// brings these in with `using LayerBase<…>::forward;`.
template <class Derived, class Scalar>
class LayerBase : public Module<Derived> {
 public:
  /// x [batch, seq, features] → a fresh output of output_shape(x) (the same bits as forward_into).
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x, const Masks<Scalar>& masks = {}) const {
    return named(Derived::type_name, [&] {
      const std::array<Index, 3> dims = derived().output_shape(x);
      check_mask_fields(masks, Derived::type_name, Derived::mask_fields);
      return fresh_output<Scalar>(Derived::type_name, dims, [&](OutRows<Scalar> out) { derived().compute(x, out, masks); });
    });
  }
  /// Into the caller's out [batch·seq, features] (overwritten; nothing outside it is written).
  void forward_into(ConstTensor3Ref<Scalar> x, OutRows<Scalar> out, const Masks<Scalar>& masks = {}) const {
    named(Derived::type_name, [&] {
      check_call(Derived::type_name, masks, Derived::mask_fields, derived().output_shape(x), out);
      derived().compute(x, out, masks);
    });
  }
  /// x [B, L, embed_dim] → [B, L, embed_dim].
  std::array<Index, 3> output_shape(const ConstTensor3Ref<Scalar>& x) const {
    return same_length_shape(x, derived().embed_dim(), derived().embed_dim(), Derived::type_name);
  }

 protected:
  LayerBase() = default;

 private:
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
};

/// A layer that works row block by row block (Linear, Conv1d, C3K2Projection): forward_into is
/// Derived::forward_rows(x rows, batch, seq, out), straight into out — no activation-sized temporary
/// (each defines workspace_bytes: its packed weights on the micro-kernel path).
template <class Derived, class Scalar>
class RowLayerBase : public LayerBase<Derived, Scalar> {
 protected:
  RowLayerBase() = default;

 private:
  friend class LayerBase<Derived, Scalar>;
  void compute(const ConstTensor3Ref<Scalar>& x, OutRows<Scalar> out, const Masks<Scalar>&) const {
    static_cast<const Derived&>(*this).forward_rows(x.rows(), x.batch(), x.seq(), out);
  }
};

/// A causal-capable layer: LayerBase and the decoding interface (Decoder).
template <class Derived, class Scalar>
class DecodingLayerBase : public LayerBase<Derived, Scalar>, public Decoder<Derived, Scalar> {
 protected:
  DecodingLayerBase() = default;
};


}  // namespace detail
}  // namespace c2f
