// c2f layers — Conv1d (torch.nn.Conv1d on [batch, length, channels]) and seed 002's C3K2Projection.
#pragma once

#include "c2f/detail/module.hpp"
#include "c2f/detail/random.hpp"
#include "c2f/kernels/conv1d.hpp"

#include <string>

namespace c2f {

/// torch.nn.Conv1d(in, out, kernel_size, stride=1, padding, groups, bias) on inputs laid out
/// [batch, length, channels] (c2f's layout; PyTorch's Conv1d takes [batch, channels, length]).
/// State dict: `weight` [out, in/groups, kernel_size], `bias` [out].
template <class Scalar>
class Conv1d : public detail::Module<Conv1d<Scalar>> {
 public:
  struct Options {
    Index padding = 0;
    Index groups = 1;
    bool bias = true;
    int num_threads = 0;  ///< 0 = c2f::get_num_threads(); results are bitwise the same for any count
    std::uint64_t seed = 0;  ///< init like PyTorch: weight and bias U(±1/sqrt(in/groups · kernel_size))
  };

  Conv1d(Index in_channels, Index out_channels, Index kernel_size)
      : Conv1d(in_channels, out_channels, kernel_size, Options{}) {}
  Conv1d(Index in_channels, Index out_channels, Index kernel_size, Options options)
      : shape_{in_channels, out_channels, kernel_size, options.padding, options.groups}, options_(options) {
    detail::check_scalar<Scalar>();
    shape_.validate();
    reset_parameters(options.seed);
  }

  const kernels::Conv1dShape& shape() const { return shape_; }
  bool has_bias() const { return options_.bias; }
  void set_num_threads(int n) { options_.num_threads = n; }
  /// Parameters: out·in/groups·kernel_size (+ out with bias).
  Index parameter_count() const {
    return shape_.out_channels * shape_.in_per_group() * shape_.kernel + (options_.bias ? shape_.out_channels : 0);
  }

  void reset_parameters(std::uint64_t seed) {
    detail::Rng rng(seed);
    const double bound = 1.0 / std::sqrt(static_cast<double>(shape_.in_per_group() * shape_.kernel));
    taps_.resize(shape_.kernel * shape_.out_channels, shape_.in_per_group());
    detail::fill_uniform(taps_, rng, bound);
    bias_ = Vector<Scalar>::Zero(options_.bias ? shape_.out_channels : 0);
    if (options_.bias) {
      Eigen::Map<RowMatrix<Scalar>> b(bias_.data(), 1, bias_.size());
      detail::fill_uniform(b, rng, bound);
    }
  }

  void load(detail::StrictLoader& loader, const std::string& name) {
    RowMatrix<Scalar> w;  // [out, in/groups · kernel]: PyTorch's [out, in/groups, kernel] row-major
    loader.read(name + "weight", {shape_.out_channels, shape_.in_per_group(), shape_.kernel}, w);
    taps_ = kernels::conv1d_taps(w.data(), shape_);
    if (options_.bias) loader.read(name + "bias", {shape_.out_channels}, bias_);
  }
  void save(StateDict& sd, const std::string& name) const {
    const std::vector<Scalar> w = kernels::conv1d_torch_weight(taps_, shape_);
    sd.set(name + "weight",
           TensorData::from_values(w.data(), {shape_.out_channels, shape_.in_per_group(), shape_.kernel}));
    if (options_.bias) detail::store(sd, name + "bias", bias_, {shape_.out_channels});
  }

  /// x [B, L, in] → [B, L + 2·padding − kernel_size + 1, out].
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x) const {
    detail::check_features(x, shape_.in_channels, "Conv1d", "x", "in_channels");
    Tensor3<Scalar> y(x.batch(), std::max<Index>(0, shape_.out_length(x.seq())), shape_.out_channels);
    Eigen::Map<RowMatrix<Scalar>> out(y.data(), y.dimension(0) * y.dimension(1), shape_.out_channels);
    forward_rows(x.rows(), x.batch(), x.seq(), out);
    return y;
  }

  /// The same on rows: x [B·L, in] → y [B·L_out, out] (y may be a column block of a wider matrix).
  void forward_rows(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index batch, Index length,
                    Eigen::Ref<RowMatrix<Scalar>> y) const {
    kernels::conv1d<Scalar>(x, batch, length, shape_, taps_, options_.bias ? bias_.data() : nullptr, y,
                            options_.num_threads);
  }

 private:
  kernels::Conv1dShape shape_;
  Options options_;
  RowMatrix<Scalar> taps_;  ///< tap-major weights (kernels::conv1d_taps layout)
  Vector<Scalar> bias_;
};

/// Seed 002's "C3K2" projection: conv3 = Conv1d(dim → dim/2, k=3, padding=1) and
/// conv2 = Conv1d(dim → dim − dim/2, k=1), concatenated on channels: [B, L, dim] → [B, L, dim];
/// head h is channels [h·dim/heads, (h+1)·dim/heads). State dict: `conv3.*`, `conv2.*`.
///
/// Parameters: 3·dim·(dim/2) + dim·(dim − dim/2) + dim ≈ 2·dim² — about twice a Linear(dim, dim)
/// (dim² + dim), not the "40 % fewer" the seed claims (dim = 512: 524,800 vs 262,656).
template <class Scalar>
class C3K2Projection : public detail::Module<C3K2Projection<Scalar>> {
 public:
  struct Options {
    int num_threads = 0;
    std::uint64_t seed = 0;  ///< PyTorch's Conv1d init for both convolutions
  };

  C3K2Projection(Index dim, Index heads) : C3K2Projection(dim, heads, Options{}) {}
  C3K2Projection(Index dim, Index heads, Options options)
      : dim_(dim),
        heads_(heads),
        conv3_(std::max<Index>(dim, 2), std::max<Index>(dim / 2, 1), 3, {1, 1, true, options.num_threads, options.seed}),
        conv2_(std::max<Index>(dim, 2), std::max<Index>(dim - dim / 2, 1), 1,
               {0, 1, true, options.num_threads, options.seed + 1}) {
    if (dim < 2 || heads <= 0 || dim % heads != 0) {
      detail::fail("C3K2Projection needs dim >= 2 divisible by heads > 0, got dim=", dim, ", heads=", heads);
    }
  }

  Index dim() const { return dim_; }
  Index heads() const { return heads_; }
  void set_num_threads(int n) {
    conv3_.set_num_threads(n);
    conv2_.set_num_threads(n);
  }
  /// 3·dim·(dim/2) + dim/2 + dim·(dim − dim/2) + (dim − dim/2).
  Index parameter_count() const { return conv3_.parameter_count() + conv2_.parameter_count(); }
  void reset_parameters(std::uint64_t seed) {
    conv3_.reset_parameters(seed);
    conv2_.reset_parameters(seed + 1);
  }

  void load(detail::StrictLoader& loader, const std::string& name) {
    conv3_.load(loader, name + "conv3.");
    conv2_.load(loader, name + "conv2.");
  }
  void save(StateDict& sd, const std::string& name) const {
    conv3_.save(sd, name + "conv3.");
    conv2_.save(sd, name + "conv2.");
  }

  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x) const {
    detail::check_features(x, dim_, "C3K2Projection", "x", "dim");
    Tensor3<Scalar> y(x.batch(), x.seq(), dim_);
    Eigen::Map<RowMatrix<Scalar>> out(y.data(), x.batch() * x.seq(), dim_);
    forward_rows(x.rows(), x.batch(), x.seq(), out);
    return y;
  }

  /// x [B·L, dim] → y [B·L, dim]: conv3 into channels [0, dim/2), conv2 into [dim/2, dim).
  void forward_rows(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index batch, Index length,
                    Eigen::Ref<RowMatrix<Scalar>> y) const {
    conv3_.forward_rows(x, batch, length, y.leftCols(dim_ / 2));
    conv2_.forward_rows(x, batch, length, y.rightCols(dim_ - dim_ / 2));
  }

 private:
  Index dim_;
  Index heads_;
  Conv1d<Scalar> conv3_;
  Conv1d<Scalar> conv2_;
};

}  // namespace c2f
