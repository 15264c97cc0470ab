// c2f layers — Conv1d (torch.nn.Conv1d on [batch, length, channels]) and the C3K2/HMHA article's
// C3K2Projection.
#pragma once

#include "c2f/detail/random.hpp"
#include "c2f/kernels/conv1d.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/options.hpp"

#include <algorithm>
#include <array>
#include <string>

namespace c2f {

/// torch.nn.Conv1d(in, out, kernel_size, stride=1, padding, groups, bias) on inputs laid out
/// [batch, length, channels] (c2f's layout; PyTorch's Conv1d takes [batch, channels, length]).
/// State dict: `weight` [out, in/groups, kernel_size], `bias` [out].
template <class Scalar>
class Conv1d : public detail::RowLayerBase<Conv1d<Scalar>, Scalar> {
 public:
  /// seed: init like PyTorch, weight and bias U(±1/sqrt(in/groups · kernel_size)).
  /// causal: pad kernel_size − 1 zeros on the left only (output i reads x[i − kernel_size + 1 … i]);
  /// padding must be 0. PyTorch: conv(F.pad(x, (kernel_size − 1, 0))) on a Conv1d with padding 0.
  class Options : public RuntimeOptions<Options>,
                  public BiasOption<Options>,
                  public CausalOption<Options>,
                  public ComputeOption<Options> {
    C2F_ARG(Index, padding) = 0;
    C2F_ARG(Index, groups) = 1;
  };

  C2F_LAYER_TRAITS("Conv1d", MaskFields::None);  // takes no masks

  Conv1d(Index in_channels, Index out_channels, Index kernel_size, Options options = Options())
      : shape_(checked_shape(kernels::Conv1dShape{in_channels, out_channels, kernel_size, options.padding(),
                                                  options.groups(), options.causal()})),
        options_((detail::check_compute_option<Scalar>("Conv1d", options.compute()), options)) {
    detail::check_scalar<Scalar>();
    reset_parameters(options.seed());
  }

  const kernels::Conv1dShape& shape() const { return shape_; }
  const Options& options() const { return options_; }
  bool causal() const { return options_.causal(); }
  void set_num_threads(int n) { options_.num_threads(n); }
  /// Parameters: out·in/groups·kernel_size (+ out with bias).
  Index parameter_count() const {
    return shape_.out_channels * shape_.in_per_group() * shape_.kernel + (options_.bias() ? shape_.out_channels : 0);
  }

  void reset_parameters(std::uint64_t seed) {
    detail::Rng rng(seed);
    const double bound = 1.0 / std::sqrt(static_cast<double>(shape_.in_per_group() * shape_.kernel));
    taps_.resize(shape_.kernel * shape_.out_channels, shape_.in_per_group());
    detail::fill_uniform(taps_, rng, bound);
    bias_ = Vector<Scalar>::Zero(options_.bias() ? shape_.out_channels : 0);
    if (options_.bias()) {
      Eigen::Map<RowMatrix<Scalar>> b(bias_.data(), 1, bias_.size());
      detail::fill_uniform(b, rng, bound);
    }
  }

  void load(detail::StrictLoader& loader, const std::string& name) {
    RowMatrix<Scalar> w;  // [out, in/groups · kernel]: PyTorch's [out, in/groups, kernel] row-major
    loader.read(name + "weight", {shape_.out_channels, shape_.in_per_group(), shape_.kernel}, w);
    taps_ = kernels::conv1d_taps(w.data(), shape_);
    if (options_.bias()) loader.read(name + "bias", {shape_.out_channels}, bias_);
  }
  void save(StateDict& sd, const std::string& name) const {
    const std::vector<Scalar> w = kernels::conv1d_torch_weight(taps_, shape_);
    sd.set(name + "weight",
           TensorData::from_values(w.data(), {shape_.out_channels, shape_.in_per_group(), shape_.kernel}));
    if (options_.bias()) detail::store(sd, name + "bias", bias_, {shape_.out_channels});
  }

  /// x [B, L, in] → [B, L_out, out], L_out = L + 2·padding − kernel_size + 1 (L when causal); an input
  /// shorter than the kernel gives L_out = 0.
  std::array<Index, 3> output_shape(const ConstTensor3Ref<Scalar>& x) const {
    detail::check_features(x, shape_.in_channels, "Conv1d", "x", "in_channels");
    return {x.batch(), out_length(x.seq()), shape_.out_channels};
  }
  /// The same on rows (forward_into(x, out, masks) is this on x's rows): x [B·L, in] → y [B·L_out, out] (y may be a
  /// column block of a wider matrix).
  void forward_rows(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, RowMatrixRef<Scalar> y) const {
    if (out_length(length) == 0) return;  // nothing to write (an input shorter than the kernel)
    kernels::conv1d<Scalar>(x, batch, length, shape_, taps_, options_.bias() ? bias_.data() : nullptr, y,
                            detail::kernel_options(options_));
  }
  /// Bytes of temporary memory one forward_into() holds: the packed taps on the micro-kernel path, else 0.
  std::size_t workspace_bytes(Index /*batch*/, Index seq) const {
    return kernels::conv1d_workspace_bytes<Scalar>(seq, shape_, options_.compute(), options_.num_threads());
  }

  /// Training (forward_train, backward: detail::RowLayerBase): the saved input x.
  using Saved = detail::RowSaved<Scalar>;
  /// The gradients on rows (kernels::conv1d_backward) of an input x [batch·length, in] for dy [batch·L_out,
  /// out] (a column block of a wider matrix too): dx (overwritten, or added to with add_dx), and grad's
  /// weight and bias, for `grad` a copy of this layer (backward() passes one with zero parameters). An input
  /// shorter than the kernel (L_out = 0) has zero gradients.
  void backward_rows(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, const ConstRowMatrixRef<Scalar>& dy,
                     RowMatrixRef<Scalar> dx, Conv1d& grad, bool add_dx = false) const {
    if (out_length(length) == 0) {
      if (!add_dx) dx.setZero();
      grad.taps_.setZero();
      grad.bias_.setZero();
      return;
    }
    kernels::conv1d_backward<Scalar>(x, batch, length, shape_, taps_, dy, dx, grad.taps_,
                                     options_.bias() ? grad.bias_.data() : nullptr, detail::kernel_options(options_),
                                     add_dx);
  }

 private:
  static kernels::Conv1dShape checked_shape(const kernels::Conv1dShape& s) {
    s.validate();
    detail::check_buffer_of<Scalar>("Conv1d: the weight [out_channels, in_channels / groups, kernel_size]",
                                    {s.out_channels, s.in_per_group(), s.kernel});
    return s;
  }
  Index out_length(Index length) const { return std::max<Index>(0, shape_.out_length(length)); }

  kernels::Conv1dShape shape_;  // first: validated before anything else is built
  Options options_;
  RowMatrix<Scalar> taps_;  ///< tap-major weights (kernels::conv1d_taps layout)
  Vector<Scalar> bias_;
};

/// The C3K2/HMHA article's "C3K2" projection: conv3 = Conv1d(E → E/2, k=3, padding=1) and
/// conv2 = Conv1d(E → E − E/2, k=1), concatenated on channels: [B, L, E] → [B, L, E] (E = embed_dim);
/// head h is channels [h·E/num_heads, (h+1)·E/num_heads). State dict: `conv3.*`, `conv2.*`.
/// With `causal`, conv3 pads 2 on the left and 0 on the right (position i reads x[i−2], x[i−1], x[i];
/// PyTorch: conv3(F.pad(x, (2, 0))) with the conv's padding 0); same weights.
///
/// Parameters: 3·E·(E/2) + E·(E − E/2) + E ≈ 2·E² — about twice a Linear(E, E) (E² + E), not the
/// "40 % fewer" the article claims (E = 512: 524,800 vs 262,656).
template <class Scalar>
class C3K2Projection : public detail::RowLayerBase<C3K2Projection<Scalar>, Scalar> {
 public:
  /// seed: PyTorch's Conv1d init for both convolutions; causal: conv3 reads x[i−2 … i] instead of
  /// x[i−1 … i+1].
  class Options : public RuntimeOptions<Options>, public CausalOption<Options>, public ComputeOption<Options> {};

  C2F_LAYER_TRAITS("C3K2Projection", MaskFields::None);  // takes no masks

  C3K2Projection(Index embed_dim, Index num_heads, Options options = Options())
      : shape_(detail::checked_heads<Scalar>("C3K2Projection", embed_dim, num_heads, /*min_embed=*/2, 2)),
        options_((detail::check_compute_option<Scalar>("C3K2Projection", options.compute()), options)),
        conv3_(embed_dim, embed_dim / 2, 3, conv_options(options, /*padding=*/1, 0)),
        conv2_(embed_dim, embed_dim - embed_dim / 2, 1, conv_options(options, /*padding=*/0, 1)) {}

  Index embed_dim() const { return shape_.embed_dim; }
  Index num_heads() const { return shape_.num_heads; }
  const Options& options() const { return options_; }
  bool causal() const { return options_.causal(); }
  void set_num_threads(int n) { this->set_num_threads_of(options_, n); }
  /// 3·E·(E/2) + E/2 + E·(E − E/2) + (E − E/2).
  Index parameter_count() const { return conv3_.parameter_count() + conv2_.parameter_count(); }

  /// conv3 then conv2: reset_parameters(seed) (from detail::Module) draws conv3 from seed, conv2 from
  /// seed + 1.
  template <class Self, class Fn>
  static void children(Self& self, Fn&& fn) {
    fn("conv3.", self.conv3_);
    fn("conv2.", self.conv2_);
  }

  /// x [B·L, E] → y [B·L, E] (forward_into(x, out, masks) is this on x's rows): conv3 into channels [0, E/2), conv2
  /// into [E/2, E).
  void forward_rows(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, RowMatrixRef<Scalar> y) const {
    const Index e = embed_dim();
    conv3_.forward_rows(x, batch, length, detail::cols_of(y, 0, e / 2));
    conv2_.forward_rows(x, batch, length, detail::cols_of(y, e / 2, e - e / 2));
  }
  /// Bytes of temporary memory one forward_into() holds: the larger convolution's (packed taps, bf16 rows;
  /// one runs at a time), plus conv3's while conv2 runs where the scratch cache keeps them.
  std::size_t workspace_bytes(Index batch, Index seq) const {
    const std::size_t conv3 = conv3_.workspace_bytes(batch, seq), conv2 = conv2_.workspace_bytes(batch, seq);
    return std::max(conv3, detail::scratch_kept_bytes(conv3) + conv2);
  }

  /// Training (forward_train, backward: detail::RowLayerBase): the saved input x.
  using Saved = detail::RowSaved<Scalar>;
  /// The gradients on rows of an input x [batch·length, E] for dy [batch·length, E]: conv3's (dy's channels
  /// [0, E/2)) then conv2's ([E/2, E)) input gradients summed into dx (overwritten, or added to with
  /// add_dx), their parameters' into grad's (Conv1d::backward_rows).
  void backward_rows(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, const ConstRowMatrixRef<Scalar>& dy,
                     RowMatrixRef<Scalar> dx, C3K2Projection& grad, bool add_dx = false) const {
    const Index e = embed_dim();
    conv3_.backward_rows(x, batch, length, detail::cols_of(dy, 0, e / 2), dx, grad.conv3_, add_dx);
    conv2_.backward_rows(x, batch, length, detail::cols_of(dy, e / 2, e - e / 2), dx, grad.conv2_, /*add_dx=*/true);
  }

 private:
  /// Causal: every convolution pads kernel_size − 1 on the left only (a no-op for conv2's k = 1).
  static typename Conv1d<Scalar>::Options conv_options(const Options& o, Index padding, std::uint64_t seed_offset) {
    return detail::inner_options<typename Conv1d<Scalar>::Options>(o, seed_offset)
        .padding(o.causal() ? 0 : padding)
        .causal(o.causal());
  }

  detail::HeadShape shape_;  // first: checked before the convolutions are built
  Options options_;
  Conv1d<Scalar> conv3_;
  Conv1d<Scalar> conv2_;
};

}  // namespace c2f
