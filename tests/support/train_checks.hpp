// The training tests' checks, shared by tests/test_train.cpp and tests/test_train_c2f.cpp: a layer's
// gradients against a PyTorch fixture (fp64 1e-10, fp32 atol 1e-5 / rtol 5e-6), and central finite
// differences in double (eps 1e-6, torch.autograd.gradcheck's atol 1e-5 / rtol 1e-3) of every input and
// parameter element (docs/training.md#tests).
#pragma once

#include "c2f/c2f.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/layer_entries.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <string>
#include <type_traits>
#include <vector>

namespace c2f_test {

using c2f::Index;
using c2f::Masks;
using c2f::StateDict;
using c2f::Tensor3;

/// The fixtures' tolerance: fp64 1e-10; fp32 PyTorch's own fused-vs-math one, atol 1e-5, rtol 5e-6.
template <class Scalar>
struct GradTolerance {
  static constexpr double atol = std::is_same<Scalar, float>::value ? 1e-5 : 1e-10;
  static constexpr double rtol = std::is_same<Scalar, float>::value ? 5e-6 : 1e-10;
};

/// Compares n values with torch's within the tolerance; remembers the largest |diff| and the largest share
/// of the tolerance used, which the test prints per case.
struct Comparison {
  double max_diff = 0, max_share = 0;
  std::string worst;  ///< where the largest share of the tolerance was used
  template <class Scalar>
  void check(const Scalar* got, const std::vector<Scalar>& want, Index n, double atol, double rtol,
             const std::string& what) {
    ASSERT_EQ(static_cast<std::size_t>(n), want.size()) << what << ": size";
    int reported = 0;
    for (Index i = 0; i < n; ++i) {
      const double g = got[i], w = want[static_cast<std::size_t>(i)], diff = std::abs(g - w),
                   bound = atol + rtol * std::abs(w);
      max_diff = std::max(max_diff, diff);
      if (diff / bound > max_share) {
        max_share = diff / bound;
        worst = what + "[" + std::to_string(i) + "] (torch " + std::to_string(w) + ")";
      }
      if (!(diff <= bound) && reported++ < 5) {
        ADD_FAILURE() << what << "[" << i << "]: c2f " << g << ", torch " << w << ", |diff| " << diff;
      }
    }
  }
  template <class T, class Scalar = typename T::Scalar>  // a Tensor3 or an Output
  void check(const T& got, const StateDict& sd, const std::string& name, const std::string& what) {
    check(got.data(), c2f_test::values<Scalar>(sd, name), got.size(), GradTolerance<Scalar>::atol,
          GradTolerance<Scalar>::rtol, what + " " + name);
  }
  /// Every gradient of g.params against the fixture's grad.<prefix><name>, and no other name.
  template <class Scalar>
  void check_params(const StateDict& params, const StateDict& sd, const std::string& prefix, const std::string& what) {
    EXPECT_EQ(params.keys().size(), sd.keys("grad." + prefix).size()) << what;
    for (const auto& [key, t] : params) {
      const std::vector<Scalar> v = t.template to_vector<Scalar>();
      check(v.data(), c2f_test::values<Scalar>(sd, "grad." + prefix + key), t.numel(), GradTolerance<Scalar>::atol,
            GradTolerance<Scalar>::rtol, what + " grad." + prefix + key);
    }
  }
};

/// A layer of one input x against its fixture: output, grad.input and grad.<prefix>… (the parameters under
/// `prefix`), with 1 and 2 threads.
template <class Scalar, class Layer>
void check_one_input_case(Layer& layer, const StateDict& sd, const Masks<Scalar>& masks, const std::string& prefix,
                          Comparison& cmp) {
  layer.load_state_dict(sd, prefix);
  const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x"), dy = c2f_test::tensor3<Scalar>(sd, "grad_output");
  for (int threads : {1, 2}) {
    layer.set_num_threads(threads);
    const auto [y, saved] = layer.forward_train(x, masks);
    const c2f::Grads<Scalar> g = layer.backward(saved, dy);
    const std::string what = "threads " + std::to_string(threads);
    cmp.check(y, sd, "output", what);
    cmp.check(g.input, sd, "grad.input", what);
    cmp.template check_params<Scalar>(g.params, sd, prefix, what);
  }
}

/// loss = Σ forward_train(x, masks, step).output · dy: the loss whose gradient backward(saved, dy) is.
template <class E, class Layer>
double loss_of(const Layer& layer, const Tensor3<double>& x, const Masks<double>& masks, const Tensor3<double>& dy) {
  const Tensor3<double> y = E::forward_train(layer, x, masks, 11).output;
  return (Eigen::Map<const Eigen::ArrayXd>(y.data(), y.size()) * Eigen::Map<const Eigen::ArrayXd>(dy.data(), dy.size()))
      .sum();
}

/// Central differences of f at eps 1e-6 against the analytic gradient: |fd − g| ≤ 1e-5 + 1e-3·|fd|
/// (torch.autograd.gradcheck's tolerances). Returns the worst |fd − g| / (1e-5 + 1e-3·|fd|).
template <class F>
double check_central(const std::vector<double>& values, const std::vector<double>& grad, F&& f_at,
                     const std::string& what) {
  constexpr double eps = 1e-6, atol = 1e-5, rtol = 1e-3;
  double worst = 0;
  int reported = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double fd = (f_at(i, values[i] + eps) - f_at(i, values[i] - eps)) / (2 * eps);
    const double ratio = std::abs(fd - grad[i]) / (atol + rtol * std::abs(fd));
    worst = std::max(worst, ratio);
    if (!(ratio <= 1) && reported++ < 5)
      ADD_FAILURE() << what << "[" << i << "]: backward " << grad[i] << ", finite differences " << fd;
  }
  return worst;
}

/// check_central on every element of every parameter of `layer`: loss(a copy of the layer with that element
/// moved) against the gradient grads (a backward's g.params). Returns the worst ratio.
template <class Layer, class Loss>
double check_parameters(const Layer& layer, const StateDict& grads, Loss&& loss) {
  double worst = 0;
  for (const auto& [key, t] : layer.state_dict()) {
    const std::vector<double> values = t.template to_vector<double>();
    worst = std::max(worst, check_central(
                                values, grads.at(key).template to_vector<double>(),
                                [&, &name = key, &shape = t.shape()](std::size_t i, double value) {
                                  std::vector<double> moved = values;
                                  moved[i] = value;
                                  StateDict sd = layer.state_dict();
                                  sd.set(name, c2f::TensorData::from_values(moved.data(), shape));
                                  Layer other = layer;
                                  other.load_state_dict(sd);
                                  return loss(other);
                                },
                                key));
  }
  return worst;
}

/// Checks every element of x and of every parameter; returns the worst ratio.
template <class E, class Layer>
double finite_difference_check(const Layer& layer, const Tensor3<double>& x, const Masks<double>& masks, TestRng& rng) {
  const auto [y, saved] = E::forward_train(layer, x, masks, 11);
  const Tensor3<double> dy = rng.tensor<double>(y.dimension(0), y.dimension(1), y.dimension(2));
  const c2f::Grads<double> g = E::backward(layer, saved, dy);
  const std::vector<double> xs(x.data(), x.data() + x.size()), gx(g.input.data(), g.input.data() + g.input.size());
  double worst = check_central(
      xs, gx,
      [&](std::size_t i, double value) {
        Tensor3<double> moved = x;
        moved.data()[i] = value;
        return loss_of<E>(layer, moved, masks, dy);
      },
      "dx");
  return std::max(
      worst, check_parameters(layer, g.params, [&](const Layer& other) { return loss_of<E>(other, x, masks, dy); }));
}

/// finite_difference_check of a C2F_LAYER entry in double (seed 5, 2 threads, parameters N(0, 0.25)) on
/// x [2, length, kWidth], without masks and with every mask the layer takes (every_mask); prints and
/// returns the worst ratio.
template <class E>
double entry_finite_differences(TestRng& rng, Index length) {
  using Layer = typename E::Layer;
  Layer layer = E::make(typename E::Options().seed(5).num_threads(2));
  randomize(layer, rng, 0.5);
  const Tensor3<double> x = rng.tensor<double>(2, length, kWidth);
  std::vector<Masks<double>> sets{Masks<double>()};
  if (Layer::mask_fields != c2f::MaskFields::None) sets.push_back(every_mask<double>(2, length, Layer::mask_fields));
  double worst = 0;
  for (const Masks<double>& masks : sets) worst = std::max(worst, finite_difference_check<E>(layer, x, masks, rng));
  std::cout << "[train] finite differences " << E::name << ": worst |fd - g| / (1e-5 + 1e-3 |fd|) = " << worst << "\n";
  return worst;
}

}  // namespace c2f_test
