// c2f layers — Linear: y = x Wᵀ + b with torch.nn.Linear's state-dict names and layout.
#pragma once

#include "c2f/detail/random.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/options.hpp"

#include <array>
#include <string>

namespace c2f {
namespace detail {
/// Tag: construct a Linear without drawing its initial weights (its owner initialises them).
struct NoInit {};
}  // namespace detail

template <class Scalar>
class Linear : public detail::RowLayerBase<Linear<Scalar>, Scalar> {
 public:
  class Options : public RuntimeOptions<Options>, public BiasOption<Options>, public ComputeOption<Options> {};
  C2F_LAYER_TRAITS("Linear", MaskFields::None);  // takes no masks

  /// Zero weights and bias, for a layer that initialises its Linear members itself.
  Linear(Index in_features, Index out_features, Options options, detail::NoInit)
      : weight_(zero_weight(in_features, out_features)),
        bias_(Vector<Scalar>::Zero(options.bias() ? out_features : 0)),
        options_(options) {
    detail::check_scalar<Scalar>();
    detail::check_compute_option<Scalar>("Linear", options.compute());
  }
  /// weight [out, in] initialised like torch.nn.Linear (U(±1/sqrt(in)), here for the weight and the
  /// bias alike) from options.seed(); call load_state_dict() to use trained weights.
  Linear(Index in_features, Index out_features, Options options = Options())
      : Linear(in_features, out_features, options, detail::NoInit{}) {
    reset_parameters(options.seed());
  }

  Index in_features() const { return weight_.cols(); }
  Index out_features() const { return weight_.rows(); }
  const Options& options() const { return options_; }
  void set_num_threads(int n) { options_.num_threads(n); }
  const RowMatrix<Scalar>& weight() const { return weight_; }
  /// The weight, to change: a new weight_stamp(), so that the packing the layer keeps is made
  /// again. Write through the reference before the next forward; after one, call weight() again.
  RowMatrix<Scalar>& weight() {
    weight_stamp_ = detail::fresh_parameters_id();
    return weight_;
  }
  /// A number that changes whenever the weight may have (non-const weight(), load, reset_parameters):
  /// what the layer's packings of it (kernels::WeightCache) are checked against.
  std::uint64_t weight_stamp() const { return weight_stamp_; }
  const Vector<Scalar>& bias() const { return bias_; }
  Vector<Scalar>& bias() { return bias_; }
  const Scalar* bias_data() const { return options_.bias() ? bias_.data() : nullptr; }
  /// The weight, the bias and the packings the layer keeps of the weight, as the kernels read them
  /// (kernels::linear_cached): for a layer that runs this one's product inside a kernel of its own.
  kernels::CachedLinear<Scalar> cached() const { return {weight_, bias_data(), packed_, 0, weight_stamp_}; }

  /// torch.nn.Linear's init: weight and bias U(±1/sqrt(in_features)), drawn from `seed`.
  void reset_parameters(std::uint64_t seed) {
    detail::Rng rng(seed);
    detail::linear_default_uniform(weight(), rng);
    if (options_.bias()) {
      Eigen::Map<RowMatrix<Scalar>> b(bias_.data(), 1, bias_.size());
      detail::fill_uniform(b, rng, 1.0 / std::sqrt(static_cast<double>(in_features())));
    }
  }

  /// Reads `<prefix>weight` [out, in] and, with bias, `<prefix>bias` [out].
  void load(detail::StrictLoader& loader, const std::string& name) {
    loader.read(name + "weight", {out_features(), in_features()}, weight());
    if (options_.bias()) loader.read(name + "bias", {out_features()}, bias_);
  }
  void save(StateDict& sd, const std::string& prefix) const {
    detail::store(sd, prefix + "weight", weight_, {out_features(), in_features()});
    if (options_.bias()) detail::store(sd, prefix + "bias", bias_, {out_features()});
  }

  /// x [B, L, in] → [B, L, out].
  std::array<Index, 3> output_shape(const ConstTensor3Ref<Scalar>& x) const {
    return detail::same_length_shape(x, in_features(), out_features(), "Linear", "in_features");
  }
  /// The product on rows: y [n, out] = x [n, in] Wᵀ + b (overwritten), on options().num_threads() threads.
  /// (forward_into(x, out, masks) is this on x's rows.)
  void forward_rows(const ConstRowMatrixRef<Scalar>& x, RowMatrixRef<Scalar> y) const {
    kernels::linear_cached<Scalar>(x, cached(), y, detail::kernel_options(options_));
  }
  void forward_rows(const ConstRowMatrixRef<Scalar>& x, Index /*batch*/, Index /*length*/,
                    RowMatrixRef<Scalar> y) const {
    forward_rows(x, y);
  }
  /// forward_rows() where each output row has the bits of that row's product alone, whatever other rows
  /// the call holds (KernelOptions::rows_independent): FineAttention's products, so that a shard of the
  /// rows (c2f/dist) computes exactly the bits of the whole.
  void forward_rows_independent(const ConstRowMatrixRef<Scalar>& x, RowMatrixRef<Scalar> y) const {
    kernels::linear_cached<Scalar>(x, cached(), y, detail::kernel_options(options_).rows_independent(true));
  }
  /// Bytes of temporary memory forward_rows() (or, with `rows_independent`, forward_rows_independent())
  /// on `rows` rows holds: the packed weight on the micro-kernel path
  /// (kernels::matmul_rows_workspace_bytes), else 0. The layer keeps the packed weight from its first
  /// call on (kernels::WeightCache; not counted here: as many bytes as the weight, half on the tile engine).
  std::size_t rows_workspace_bytes(Index rows, bool rows_independent = false) const {
    return kernels::matmul_rows_workspace_bytes<Scalar>(rows, in_features(), out_features(), rows_independent,
                                                        options_.compute(), options_.num_threads(), true);
  }
  /// Bytes of temporary memory one forward_into() holds: rows_workspace_bytes(batch · seq).
  std::size_t workspace_bytes(Index batch, Index seq) const { return rows_workspace_bytes(batch * seq); }

  /// Training (forward_train, backward: detail::RowLayerBase): the saved input x.
  using Saved = detail::RowSaved<Scalar>;
  /// The gradients on the rows x [n, in] (kernels::linear_backward; batch and length do not matter to a
  /// Linear): dx = dy W (overwritten), and grad's weight = dyᵀ x and bias = Σ dy, for `grad` a copy of this
  /// layer (backward() passes one with zero parameters).
  void backward_rows(const ConstRowMatrixRef<Scalar>& x, Index /*batch*/, Index /*length*/,
                     const ConstRowMatrixRef<Scalar>& dy, RowMatrixRef<Scalar> dx, Linear& grad) const {
    kernels::linear_backward<Scalar>(x, weight_, dy, dx, grad.weight_, options_.bias() ? grad.bias_.data() : nullptr,
                                     detail::kernel_options(options_));
  }

 private:
  static RowMatrix<Scalar> zero_weight(Index in_features, Index out_features) {
    detail::checked_positive("Linear", "in_features", in_features);
    detail::checked_positive("Linear", "out_features", out_features);
    detail::check_buffer_of<Scalar>("Linear: the weight [out_features, in_features]", {out_features, in_features});
    return RowMatrix<Scalar>::Zero(out_features, in_features);
  }

  RowMatrix<Scalar> weight_;  // first: its sizes are checked before anything else is built
  Vector<Scalar> bias_;
  Options options_;
  std::uint64_t weight_stamp_ = detail::fresh_parameters_id();
  kernels::WeightCache<Scalar> packed_;  ///< the weight's transpose, packed (a copy starts empty)
};

}  // namespace c2f
