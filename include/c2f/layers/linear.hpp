// c2f layers — Linear: y = x Wᵀ + b with torch.nn.Linear's state-dict names and layout.
#pragma once

#include "c2f/detail/module.hpp"
#include "c2f/detail/random.hpp"
#include "c2f/kernels/linear.hpp"

#include <string>

namespace c2f {

template <class Scalar>
class Linear : public detail::Module<Linear<Scalar>> {
 public:
  /// weight [out, in] initialised like torch.nn.Linear (U(±1/sqrt(in)), here for the weight and the
  /// bias alike) from `seed`; call load_state_dict() to use trained weights.
  Linear(Index in_features, Index out_features, bool bias = true, std::uint64_t seed = 0)
      : weight_(out_features, in_features), bias_(bias ? out_features : 0), has_bias_(bias) {
    detail::check_scalar<Scalar>();
    if (in_features <= 0 || out_features <= 0) {
      detail::fail("Linear needs positive sizes, got in_features=", in_features, ", out_features=", out_features);
    }
    detail::Rng rng(seed);
    detail::linear_default_uniform(weight_, rng);
    if (has_bias_) {
      Eigen::Map<RowMatrix<Scalar>> b(bias_.data(), 1, bias_.size());
      detail::fill_uniform(b, rng, 1.0 / std::sqrt(static_cast<double>(in_features)));
    }
  }

  Index in_features() const { return weight_.cols(); }
  Index out_features() const { return weight_.rows(); }
  bool has_bias() const { return has_bias_; }
  const RowMatrix<Scalar>& weight() const { return weight_; }
  RowMatrix<Scalar>& weight() { return weight_; }
  const Vector<Scalar>& bias() const { return bias_; }
  Vector<Scalar>& bias() { return bias_; }
  const Scalar* bias_data() const { return has_bias_ ? bias_.data() : nullptr; }

  /// Reads `<prefix>weight` [out, in] and, with bias, `<prefix>bias` [out].
  void load(detail::StrictLoader& loader, const std::string& name) {
    loader.read(name + "weight", {out_features(), in_features()}, weight_);
    if (has_bias_) loader.read(name + "bias", {out_features()}, bias_);
  }
  void save(StateDict& sd, const std::string& prefix) const {
    detail::store(sd, prefix + "weight", weight_, {out_features(), in_features()});
    if (has_bias_) detail::store(sd, prefix + "bias", bias_, {out_features()});
  }

  /// y [n, out] = x [n, in] Wᵀ + b.
  void forward_rows(const Eigen::Ref<const RowMatrix<Scalar>>& x, Eigen::Ref<RowMatrix<Scalar>> y,
                    int num_threads) const {
    kernels::linear<Scalar>(x, weight_, bias_data(), y, num_threads);
  }

 private:
  RowMatrix<Scalar> weight_;
  Vector<Scalar> bias_;
  bool has_bias_;
};

}  // namespace c2f
