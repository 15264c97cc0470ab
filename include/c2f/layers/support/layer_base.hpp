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
// and the causal ones new_decode_state(), decode(), prefill(); the trainable ones (those with a Saved
// type) forward_train(x, masks, step) and backward(saved, dy) (docs/training.md). FineAttention's inputs
// are tokens plus a coarse context and C2FAttention2D's a grid: their forward family takes those extra
// arguments.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/fresh_pages.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/layers/support/decoding.hpp"
#include "c2f/layers/support/module.hpp"
#include "c2f/mask.hpp"
#include "c2f/options.hpp"
#include "c2f/output.hpp"
#include "c2f/train.hpp"

#include <array>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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
  check_buffer_of<Scalar>(
      (std::string(layer) + ": its weights (about " + std::to_string(matrices) + " x embed_dim x embed_dim values)")
          .c_str(),
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
  if constexpr (std::is_base_of<ComputeOption<Options>, Options>::value) k.compute(o.compute());
  return k;
}

/// "<layer>: compute BFloat16 needs float, got double" when a double layer asks for bfloat16 products.
template <class Scalar>
void check_compute_option(const char* layer, Compute compute) {
  if (compute == Compute::BFloat16 && !std::is_same<Scalar, float>::value) {
    fail(layer, ": compute BFloat16 needs float, got double");
  }
}

/// "<layer>: forward_train needs compute Float32 (...)" when a layer asks for bfloat16 products in
/// training: the backward passes are fp32 (docs/bf16.md).
inline void check_train_compute(const char* layer, Compute compute) {
  if (compute == Compute::BFloat16) {
    fail(layer, ": forward_train needs compute Float32 (the backward pass is fp32; docs/bf16.md), got BFloat16");
  }
}

/// The options of a layer another one wraps, from the wrapper's: num_threads, seed + seed_offset and,
/// when both have them, the attention kernel's (kernel, query_block, key_block) and dropout.
template <class To, class From>
To inner_options(const From& from, std::uint64_t seed_offset = 0) {
  To to;
  to.num_threads(from.num_threads()).seed(from.seed() + seed_offset);
  if constexpr (std::is_base_of<AttnKernelOptions<To>, To>::value &&
                std::is_base_of<AttnKernelOptions<From>, From>::value) {
    to.kernel(from.kernel()).query_block(from.query_block()).key_block(from.key_block());
  }
  if constexpr (std::is_base_of<DropoutOption<To>, To>::value && std::is_base_of<DropoutOption<From>, From>::value) {
    to.dropout(from.dropout());
  }
  if constexpr (std::is_base_of<ComputeOption<To>, To>::value && std::is_base_of<ComputeOption<From>, From>::value) {
    to.compute(from.compute());
  }
  return to;
}

/// The contract's static members of a layer: its name (the one its messages use) and the fields of
/// c2f::Masks it takes.
#define C2F_LAYER_TRAITS(name, fields)           \
  static constexpr const char* type_name = name; \
  static constexpr ::c2f::MaskFields mask_fields = fields

/// "<layer>: out must be [batch·seq, features] = [rows, cols] for an output [B, L, F], got [r, c]" unless
/// out holds the rows of an output of shape `dims`.
template <class Scalar>
void check_out(const char* layer, const RowMatrixRef<Scalar>& out, const std::array<Index, 3>& dims) {
  if (out.rows() != dims[0] * dims[1] || out.cols() != dims[2]) {
    fail(layer, ": out must be [batch·seq, features] = ", shape_string({dims[0] * dims[1], dims[2]}), " for an output ",
         shape_string({dims[0], dims[1], dims[2]}), ", got ", shape_string({out.rows(), out.cols()}));
  }
}

/// The entry checks of a forward_into: only the mask fields the layer takes (`fields`), the output's
/// shape (`dims`, from output_shape(x), which validated x) and out's. Returns dims.
template <class Scalar>
std::array<Index, 3> check_call(const char* layer, const Masks<Scalar>& masks, MaskFields fields,
                                const std::array<Index, 3>& dims, const RowMatrixRef<Scalar>& out) {
  check_mask_fields(masks, layer, fields);
  check_out(layer, out, dims);
  return dims;
}

/// A [dims] output from the scratch cache (c2f/output.hpp) filled by fill(rows of it), or, with
/// FreshPages::OnFirstWrite, by fill(rows of it, whether its pages were left to the first writes); a
/// buffer new to the cache is readied first (prepare_fresh on `threads` threads, `pages` as asked), one the
/// cache kept from an earlier output is warm already. Refused before it is allocated when it would exceed
/// kMaxBufferBytes.
template <class Scalar, class Fill>
Output<Scalar> fresh_output(const char* layer, const std::array<Index, 3>& dims, int threads, Fill&& fill,
                            FreshPages pages = FreshPages::FaultIn) {
  Output<Scalar> y(dims, (std::string(layer) + ": an output " + shape_string({dims[0], dims[1], dims[2]})).c_str());
  const bool first_write = !y.reused_buffer() && prepare_fresh(y, threads, pages);
  RowMatrixRef<Scalar> out(Eigen::Map<RowMatrix<Scalar>>(y.data(), dims[0] * dims[1], dims[2]));
  if constexpr (std::is_invocable_v<Fill&, RowMatrixRef<Scalar>, bool>) {
    fill(out, first_write);
  } else {
    fill(out);
  }
  return y;
}

/// output_shape() of a layer that keeps the sequence: checks x's features and returns [batch, seq, width].
template <class Scalar>
std::array<Index, 3> same_length_shape(const ConstTensor3Ref<Scalar>& x, Index in_features, Index out_features,
                                       const char* layer, const char* width_name = "embed_dim") {
  check_features(x, in_features, layer, "x", width_name);
  return {x.batch(), x.seq(), out_features};
}

// ------------------------------------------------------------------------------------------------
// Training (docs/training.md): what forward_train and backward share on every layer.

/// What every layer's Saved state (forward_train → backward) holds besides its activations: the
/// parameters_id() of the layer object that made it (0: empty — default-constructed or moved from) and
/// the shape of its output, which backward() checks.
struct SavedBase {
  std::uint64_t made_by = 0;
  std::array<Index, 3> output_dims{0, 0, 0};

  SavedBase() = default;
  SavedBase(const SavedBase&) = default;
  SavedBase& operator=(const SavedBase&) = default;
  SavedBase(SavedBase&& o) noexcept : made_by(std::exchange(o.made_by, 0)), output_dims(o.output_dims) {}
  SavedBase& operator=(SavedBase&& o) noexcept {
    made_by = std::exchange(o.made_by, 0);
    output_dims = o.output_dims;
    return *this;
  }
  ~SavedBase() = default;
};

/// The door to a layer's private training members for the contract's bases and for a layer that runs a
/// wrapped one's (CoarseAttention runs MultiHeadAttention's): a layer declares `friend struct
/// detail::TrainAccess;` and provides
///   void compute_train(inputs…, RowMatrixRef<Scalar> out, const Masks<Scalar>&, std::uint64_t step, Saved&) const
///   void compute_backward(const Saved&, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
///                         Layer& grad) const
/// compute_backward writes the input gradients into g and the parameter gradients into the parameters of
/// `grad`, a copy of the layer whose parameters are zero (zeroed_copy): g.params is then grad.state_dict().
struct TrainAccess {
  template <class Layer, class... Args>
  static void train(const Layer& layer, Args&&... args) {
    layer.compute_train(std::forward<Args>(args)...);
  }
  template <class Layer, class... Args>
  static void backward(const Layer& layer, Args&&... args) {
    layer.compute_backward(std::forward<Args>(args)...);
  }
};

/// A copy of `layer` whose parameters are all zero (loaded through its own state_dict() names).
template <class Layer>
Layer zeroed_copy(const Layer& layer) {
  Layer copy = layer;
  StateDict zeros;
  for (const auto& [name, t] : layer.state_dict()) {
    zeros.set(name, TensorData(t.dtype(), t.shape(), std::vector<std::uint8_t>(t.bytes().size(), 0)));
  }
  copy.load_state_dict(zeros);
  return copy;
}

/// forward_train's frame: a fresh output of `dims` (fresh_output) and the Saved state, filled by
/// fill(out, saved), then stamped as `layer`'s for an output of `dims`.
template <class Scalar, class Saved, class Layer, class Fill>
TrainOutput<Scalar, Saved> train_output(const Layer& layer, const std::array<Index, 3>& dims, Fill&& fill) {
  TrainOutput<Scalar, Saved> result;
  result.output = fresh_output<Scalar>(Layer::type_name, dims, layer.options().num_threads(),
                                       [&](RowMatrixRef<Scalar> out) { fill(out, result.saved); });
  result.saved.made_by = layer.parameters_id();
  result.saved.output_dims = dims;
  return result;
}

/// backward's frame: refuses a saved state that is empty, that another layer object (or this one before
/// its parameters changed) made, or a dy not shaped like that forward's output; then runs
/// TrainAccess::backward(layer, saved, dy rows, g, grad) on a zeroed_copy of the layer and returns g with
/// g.params = grad.state_dict().
template <class Scalar, class Layer, class Saved>
Grads<Scalar> run_backward(const Layer& layer, const Saved& saved, const ConstTensor3Ref<Scalar>& dy) {
  static_assert(std::is_same<Saved, typename Layer::Saved>::value,
                "backward() takes the Saved state of this layer type's forward_train()");
  if (saved.made_by == 0) fail("backward: the saved state is empty (default-constructed or moved from)");
  if (saved.made_by != layer.parameters_id()) {
    fail(
        "backward: the saved state was made by another layer object, or before this layer's parameters changed "
        "(load_state_dict, an optimizer step): run forward_train again");
  }
  const std::array<Index, 3>& d = saved.output_dims;
  if (dy.batch() != d[0] || dy.dimension(1) != d[1] || dy.features() != d[2]) {
    fail("backward: dy must be shaped like the output of the forward_train that made the saved state, ",
         shape_string({d[0], d[1], d[2]}), ", got ", shape_string({dy.batch(), dy.dimension(1), dy.features()}));
  }
  Grads<Scalar> g;
  Layer grad = zeroed_copy(layer);
  TrainAccess::backward(layer, saved, dy.rows(), g, grad);
  g.params = grad.state_dict();
  return g;
}

/// The saved state of a layer that works row block by row block (RowLayerBase): its input.
template <class Scalar>
struct RowSaved : SavedBase {
  RowMatrix<Scalar> x;  ///< [batch·seq, in]
  Index batch = 0, seq = 0;
};

/// The contract's CRTP base of a layer on [batch, seq, features] input: state dicts (Module), and
/// forward(x, masks) and forward_into(x, out, masks), which check the mask fields, x and out, then run
/// Derived::compute(x, out, masks), with every error in the layer's name. For a layer that maps [B, L,
/// embed_dim] to [B, L, embed_dim] also output_shape(x). Derived provides
///   C2F_LAYER_TRAITS(name, fields);
///   void compute(const ConstTensor3Ref<Scalar>&, RowMatrixRef<Scalar>, const Masks<Scalar>&) const  (private;
///        friend LayerBase: the checks have run)
/// and embed_dim(), or its own output_shape(x) (which validates x). A layer with more forward overloads
/// brings these in with `using LayerBase<…>::forward;`.
template <class Derived, class Scalar>
class LayerBase : public Module<Derived> {
 public:
  /// x [batch, seq, features] → a fresh output of output_shape(x) (the same bits as forward_into).
  Output<Scalar> forward(ConstTensor3Ref<Scalar> x, const Masks<Scalar>& masks = {}) const {
    return with_layer_name(Derived::type_name, [&] {
      const std::array<Index, 3> dims = derived().output_shape(x);
      check_mask_fields(masks, Derived::type_name, Derived::mask_fields);
      return fresh_output<Scalar>(Derived::type_name, dims, derived().options().num_threads(),
                                  [&](RowMatrixRef<Scalar> out) { derived().compute(x, out, masks); });
    });
  }
  /// Into the caller's out [batch·seq, features] (overwritten; nothing outside it is written).
  void forward_into(ConstTensor3Ref<Scalar> x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks = {}) const {
    with_layer_name(Derived::type_name, [&] {
      check_call(Derived::type_name, masks, Derived::mask_fields, derived().output_shape(x), out);
      derived().compute(x, out, masks);
    });
  }
  /// x [B, L, embed_dim] → [B, L, embed_dim].
  std::array<Index, 3> output_shape(const ConstTensor3Ref<Scalar>& x) const {
    return same_length_shape(x, derived().embed_dim(), derived().embed_dim(), Derived::type_name);
  }

  /// Training (a layer with a Saved type): forward() in train mode and what backward() needs,
  /// `auto [output, saved] = layer.forward_train(x, masks, step)`. The output has forward()'s bits when the
  /// layer has no dropout (options().dropout() = 0); `step` keys the dropout masks (docs/training.md).
  template <class D = Derived>
  TrainOutput<Scalar, typename D::Saved> forward_train(ConstTensor3Ref<Scalar> x, const Masks<Scalar>& masks = {},
                                                       std::uint64_t step = 0) const {
    return with_layer_name(Derived::type_name, [&] {
      const std::array<Index, 3> dims = derived().output_shape(x);
      check_mask_fields(masks, Derived::type_name, Derived::mask_fields);
      using Options = std::decay_t<decltype(derived().options())>;
      if constexpr (std::is_base_of<ComputeOption<Options>, Options>::value) {
        check_train_compute(Derived::type_name, derived().options().compute());
      }
      return train_output<Scalar, typename D::Saved>(derived(), dims,
                                                     [&](RowMatrixRef<Scalar> out, typename D::Saved& saved) {
                                                       TrainAccess::train(derived(), x, out, masks, step, saved);
                                                     });
    });
  }
  /// The gradients of a loss L given dy = dL/dy of the output forward_train() returned with `saved`:
  /// g.input = dL/dx, g.params = dL/dθ under state_dict()'s names and shapes. Uses the layer's parameters
  /// as forward_train saw them (a saved state from another object, or older than a load_state_dict or an
  /// optimizer step, is refused).
  template <class Saved>
  Grads<Scalar> backward(const Saved& saved, ConstTensor3Ref<Scalar> dy) const {
    return with_layer_name(Derived::type_name, [&] { return run_backward<Scalar>(derived(), saved, dy); });
  }

 protected:
  LayerBase() = default;

 private:
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
};

/// A layer that works row block by row block (Linear, Conv1d, C3K2Projection): forward_into is
/// Derived::forward_rows(x rows, batch, seq, out), straight into out — no activation-sized temporary
/// (each defines workspace_bytes: its packed weights on the micro-kernel path).
/// Training: a RowLayerBase layer declares `using Saved = detail::RowSaved<Scalar>;` and provides
///   void backward_rows(x rows, Index batch, Index length, dy rows, RowMatrixRef<Scalar> dx, Derived& grad) const
/// (dx [batch·length, in] of x, overwritten; grad as TrainAccess says): forward_train saves x, and a layer
/// that runs a row layer inside it (HMHA its projections) calls the same member on its own rows.
template <class Derived, class Scalar>
class RowLayerBase : public LayerBase<Derived, Scalar> {
 protected:
  RowLayerBase() = default;

 private:
  friend class LayerBase<Derived, Scalar>;
  friend struct TrainAccess;
  const Derived& derived() const { return static_cast<const Derived&>(*this); }
  void compute(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>&) const {
    derived().forward_rows(x.rows(), x.batch(), x.seq(), out);
  }
  void compute_train(const ConstTensor3Ref<Scalar>& x, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                     std::uint64_t, RowSaved<Scalar>& saved) const {
    saved.x = x.rows();
    saved.batch = x.batch();
    saved.seq = x.seq();
    compute(x, out, masks);
  }
  void compute_backward(const RowSaved<Scalar>& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
                        Derived& grad) const {
    g.input = Tensor3<Scalar>(saved.batch, saved.seq, saved.x.cols());
    derived().backward_rows(saved.x, saved.batch, saved.seq, dy,
                            Eigen::Map<RowMatrix<Scalar>>(g.input.data(), saved.x.rows(), saved.x.cols()), grad);
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
