// c2f — training: what a layer's backward() returns (Grads; forward_train()'s TrainOutput is in
// c2f/output.hpp), and the training utilities the coarse-to-fine attention article asks for — gradient norms per
// parameter, clip_grad_norm (torch.nn.utils.clip_grad_norm_), and the optimizers SGD and AdamW, which match torch.optim
// step for step and update a layer's parameters in place through its state dict. docs/training.md.
//
//   auto [y, saved] = layer.forward_train(x, masks);
//   c2f::Grads<float> g = layer.backward(saved, dy);   // g.input = dL/dx, g.params = dL/dθ by name
//   c2f::clip_grad_norm(g.params, 1.0);
//   opt.step(layer, g.params);
#pragma once

#include "c2f/arg.hpp"
#include "c2f/core.hpp"
#include "c2f/state_dict.hpp"

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace c2f {

/// What backward() returns. Nothing accumulates implicitly: each call's gradients are its own, and a
/// caller that wants a sum adds them (accumulate_grads).
template <class Scalar>
struct Grads {
  /// dL/dx, shaped like the forward's input x — for cross-attention (MultiHeadAttention's
  /// forward_train(query, key, value)) dL/dquery.
  Tensor3<Scalar> input;
  /// Cross-attention only: dL/dkey and dL/dvalue (empty for self-attention, whose `input` sums the query,
  /// key and value paths).
  Tensor3<Scalar> key, value;
  /// FineAttention only: dL/dcoarse_context, shaped like the coarse context [B, chunks, embed_dim] (empty
  /// for every other layer).
  Tensor3<Scalar> context;
  /// dL/dθ: exactly the names, shapes and dtype of the layer's state_dict() — the gradients are written by
  /// the same walk over the layer's parameters that writes state_dict().
  StateDict params;
};

namespace detail {

/// The values of a gradient (or parameter) tensor `name` as Scalar; "<what>: '<name>' has dtype X: F32 or
/// F64 expected" for another dtype.
template <class Scalar>
std::vector<Scalar> float_values(const char* what, const std::string& name, const TensorData& t) {
  if (t.dtype() != DType::F32 && t.dtype() != DType::F64) {
    fail(what, ": '", name, "' has dtype ", dtype_name(t.dtype()), ": F32 or F64 expected");
  }
  return t.to_vector<Scalar>();
}

/// Calls fn(values) on the tensor `name` of `sd` as a vector of its own type (float for F32, double for
/// F64), and stores what fn leaves in it back under the same name, dtype and shape.
template <class Fn>
void update_in_place(const char* what, StateDict& sd, const std::string& name, Fn&& fn) {
  const TensorData& t = sd.at(name);
  if (t.dtype() == DType::F32) {
    std::vector<float> v = float_values<float>(what, name, t);
    fn(v);
    sd.set(name, TensorData::from_values(v.data(), t.shape()));
  } else {
    std::vector<double> v = float_values<double>(what, name, t);
    fn(v);
    sd.set(name, TensorData::from_values(v.data(), t.shape()));
  }
}

/// "<what>: <name> must be <rule>, got <value>" unless ok.
inline void check_hyper(bool ok, const char* what, const char* name, const char* rule, double value) {
  if (!ok) fail(what, ": ", name, " must be ", rule, ", got ", value);
}

}  // namespace detail

/// The 2-norm of each gradient tensor, by name (the per-layer monitoring of the article: a norm that grows
/// or vanishes step after step shows where training goes wrong). Computed in double.
inline std::map<std::string, double> grad_norms(const StateDict& grads) {
  std::map<std::string, double> out;
  for (const auto& [name, t] : grads) {
    double sum = 0;
    for (double v : detail::float_values<double>("grad_norms", name, t)) sum += v * v;
    out[name] = std::sqrt(sum);
  }
  return out;
}

/// The total 2-norm of all gradient tensors together, as if concatenated into one vector:
/// sqrt(Σ norm²) over grad_norms().
inline double total_grad_norm(const StateDict& grads) {
  double sum = 0;
  for (const auto& [name, norm] : grad_norms(grads)) sum += norm * norm;
  return std::sqrt(sum);
}

/// torch.nn.utils.clip_grad_norm_(parameters, max_norm): the total 2-norm N of all tensors of `grads`;
/// when max_norm / (N + 1e-6) < 1, every gradient is multiplied by that factor (in its own precision).
/// Returns N. As in torch, a non-finite N scales the gradients by a NaN or zero factor: check the returned
/// norm. max_norm must be >= 0.
inline double clip_grad_norm(StateDict& grads, double max_norm) {
  detail::check_hyper(max_norm >= 0, "clip_grad_norm", "max_norm", ">= 0", max_norm);
  const double norm = total_grad_norm(grads);
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef >= 1.0)) {  // NaN scales too, as torch's clamp(coef, max=1) does
    for (const std::string& name : grads.keys()) {
      detail::update_in_place("clip_grad_norm", grads, name, [&](auto& v) {
        using S = typename std::decay_t<decltype(v)>::value_type;
        for (S& x : v) x *= static_cast<S>(coef);
      });
    }
  }
  return norm;
}

/// total += grads, tensor by tensor (an empty `total` becomes a copy of grads): gradient accumulation over
/// micro-batches. The two must have the same names, shapes and dtypes.
inline void accumulate_grads(StateDict& total, const StateDict& grads) {
  if (total.empty()) {
    total = grads;
    return;
  }
  if (total.keys() != grads.keys()) detail::fail("accumulate_grads: the two state dicts have different names");
  for (const auto& entry : grads) {
    // Named references, not a structured binding: C++17 lambdas cannot capture bindings (clang refuses).
    const std::string& name = entry.first;
    const auto& g = entry.second;
    if (total.at(name).shape() != g.shape() || total.at(name).dtype() != g.dtype()) {
      detail::fail("accumulate_grads: '", name, "' is ", dtype_name(total.at(name).dtype()), " ",
                   detail::shape_string(total.at(name).shape()), " in the sum and ", dtype_name(g.dtype()), " ",
                   detail::shape_string(g.shape()), " in the gradients");
    }
    detail::update_in_place("accumulate_grads", total, name, [&](auto& v) {
      using S = typename std::decay_t<decltype(v)>::value_type;
      const std::vector<S> add = g.to_vector<S>();
      for (std::size_t i = 0; i < v.size(); ++i) v[i] += add[i];
    });
  }
}

namespace detail {

/// What SGD and AdamW share: one step on a layer's parameters, each updated by Derived::update(name,
/// param, grad) on vectors of its own precision, the state kept per parameter under `<layer name>.<key>`.
template <class Derived>
class Optimizer {
 public:
  /// One step on `layer`'s parameters with the gradients `grads` (a layer's backward().params: the names,
  /// shapes and dtypes of layer.state_dict()), written back with load_state_dict (strict: all or nothing).
  /// One optimizer steps several layers when each has its own `name` (its key in the optimizer's state).
  template <class Layer>
  void step(Layer& layer, const StateDict& grads, std::string_view name = "") {
    const char* what = Derived::kName;
    StateDict params = layer.state_dict();
    for (const auto& [key, g] : grads) {
      if (!params.contains(key)) fail(what, "::step: the gradient '", key, "' names no parameter of the layer");
    }
    const std::string prefix = name.empty() ? std::string() : std::string(name) + ".";
    for (const std::string& key : params.keys()) {
      if (!grads.contains(key)) fail(what, "::step: no gradient for the parameter '", key, "'");
      const TensorData& g = grads.at(key);
      if (g.shape() != params.at(key).shape() || g.dtype() != params.at(key).dtype()) {
        fail(what, "::step: the gradient '", key, "' is ", dtype_name(g.dtype()), " ", shape_string(g.shape()),
             ", the parameter ", dtype_name(params.at(key).dtype()), " ", shape_string(params.at(key).shape()));
      }
      update_in_place(what, params, key, [&](auto& p) {
        using S = typename std::decay_t<decltype(p)>::value_type;
        static_cast<Derived&>(*this).update(prefix + key, p, float_values<S>(what, key, g));
      });
    }
    layer.load_state_dict(params);
  }

  /// Steps taken on the parameter `key` (`<layer name>.<parameter>`, or the parameter's name for a layer
  /// stepped without a name); 0 before the first.
  std::int64_t steps(std::string_view key) const {
    const auto it = steps_.find(std::string(key));
    return it == steps_.end() ? 0 : it->second;
  }
  /// The optimizer's buffers by `<key>.<buffer>` (SGD: momentum_buffer; AdamW: exp_avg, exp_avg_sq), in
  /// the parameters' dtypes and shapes flattened.
  const StateDict& state() const { return state_; }

 protected:
  Optimizer() = default;
  /// Buffer `buffer` of parameter `key` as a vector of n values of S; `fresh` when it did not exist (then
  /// zeros).
  template <class S>
  std::vector<S> buffer(const std::string& key, const char* buffer, std::size_t n, bool* fresh = nullptr) const {
    const std::string name = key + "." + buffer;
    if (fresh != nullptr) *fresh = !state_.contains(name);
    if (!state_.contains(name)) return std::vector<S>(n, S(0));
    return state_.at(name).template to_vector<S>();
  }
  template <class S>
  void set_buffer(const std::string& key, const char* buffer, const std::vector<S>& values) {
    state_.set(key + "." + buffer, TensorData::from_values(values.data(), {static_cast<std::int64_t>(values.size())}));
  }
  std::int64_t next_step(const std::string& key) { return ++steps_[key]; }

 private:
  StateDict state_;
  std::map<std::string, std::int64_t> steps_;
};

}  // namespace detail

/// SGD's options (torch.optim.SGD's defaults): SGD::Options.
class SGDOptions {
  C2F_ARG(double, momentum) = 0;
  C2F_ARG(double, dampening) = 0;
  C2F_ARG(double, weight_decay) = 0;
  C2F_ARG(bool, nesterov) = false;
};

/// AdamW's options (torch.optim.AdamW's defaults; betas = (beta1, beta2)): AdamW::Options.
class AdamWOptions {
  C2F_ARG(double, lr) = 1e-3;
  C2F_ARG(double, beta1) = 0.9;
  C2F_ARG(double, beta2) = 0.999;
  C2F_ARG(double, eps) = 1e-8;
  C2F_ARG(double, weight_decay) = 1e-2;
};

/// torch.optim.SGD(params, lr, momentum, dampening, weight_decay, nesterov), step for step:
///   g ← grad + weight_decay · param;  with momentum: buf ← g (first step), else momentum · buf +
///   (1 − dampening) · g; g ← g + momentum · buf (nesterov) or buf;  param ← param − lr · g.
class SGD : public detail::Optimizer<SGD> {
 public:
  using Options = SGDOptions;
  static constexpr const char* kName = "SGD";

  /// lr >= 0, momentum >= 0, weight_decay >= 0; nesterov needs momentum > 0 and dampening 0 (torch's
  /// checks).
  explicit SGD(double lr, Options options = Options()) : lr_(lr), o_(options) {
    detail::check_hyper(lr >= 0, kName, "lr", ">= 0", lr);
    detail::check_hyper(o_.momentum() >= 0, kName, "momentum", ">= 0", o_.momentum());
    detail::check_hyper(o_.weight_decay() >= 0, kName, "weight_decay", ">= 0", o_.weight_decay());
    if (o_.nesterov() && (o_.momentum() <= 0 || o_.dampening() != 0)) {
      detail::fail("SGD: nesterov needs momentum > 0 and dampening 0, got momentum ", o_.momentum(), " and dampening ",
                   o_.dampening());
    }
  }
  double lr() const { return lr_; }
  /// Sets the learning rate of the next steps (a schedule).
  void set_lr(double lr) {
    detail::check_hyper(lr >= 0, kName, "lr", ">= 0", lr);
    lr_ = lr;
  }
  const Options& options() const { return o_; }

  /// One parameter's step (the arithmetic of torch's _single_tensor_sgd, in the parameter's precision).
  template <class S>
  void update(const std::string& key, std::vector<S>& param, std::vector<S> grad) {
    next_step(key);
    const S wd = static_cast<S>(o_.weight_decay()), mom = static_cast<S>(o_.momentum());
    if (o_.weight_decay() != 0) {
      for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = grad[i] + wd * param[i];
    }
    if (o_.momentum() != 0) {
      bool fresh = false;
      std::vector<S> buf = buffer<S>(key, "momentum_buffer", grad.size(), &fresh);
      const S keep = static_cast<S>(1 - o_.dampening());
      for (std::size_t i = 0; i < grad.size(); ++i) buf[i] = fresh ? grad[i] : buf[i] * mom + keep * grad[i];
      for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = o_.nesterov() ? grad[i] + mom * buf[i] : buf[i];
      set_buffer(key, "momentum_buffer", buf);
    }
    const S minus_lr = static_cast<S>(-lr_);
    for (std::size_t i = 0; i < param.size(); ++i) param[i] = param[i] + minus_lr * grad[i];
  }

 private:
  double lr_;
  Options o_;
};

/// torch.optim.AdamW(params, lr, betas, eps, weight_decay) (amsgrad off), step for step, with step t
/// counted per parameter:
///   param ← param · (1 − lr · weight_decay);  m ← β1 · m + (1 − β1) · g;  v ← β2 · v + (1 − β2) · g²;
///   param ← param − lr / (1 − β1^t) · m / (sqrt(v) / sqrt(1 − β2^t) + eps).
class AdamW : public detail::Optimizer<AdamW> {
 public:
  using Options = AdamWOptions;
  static constexpr const char* kName = "AdamW";

  /// lr >= 0, eps >= 0, betas in [0, 1), weight_decay >= 0 (torch's checks).
  explicit AdamW(Options options = Options()) : o_(options) {
    detail::check_hyper(o_.lr() >= 0, kName, "lr", ">= 0", o_.lr());
    detail::check_hyper(o_.eps() >= 0, kName, "eps", ">= 0", o_.eps());
    detail::check_hyper(o_.beta1() >= 0 && o_.beta1() < 1, kName, "beta1", "in [0, 1)", o_.beta1());
    detail::check_hyper(o_.beta2() >= 0 && o_.beta2() < 1, kName, "beta2", "in [0, 1)", o_.beta2());
    detail::check_hyper(o_.weight_decay() >= 0, kName, "weight_decay", ">= 0", o_.weight_decay());
  }
  const Options& options() const { return o_; }
  /// Sets the learning rate of the next steps (a schedule).
  void set_lr(double lr) {
    detail::check_hyper(lr >= 0, kName, "lr", ">= 0", lr);
    o_.lr(lr);
  }

  /// One parameter's step (the arithmetic of torch's _single_tensor_adamw: scalars in double, the
  /// element-wise operations in the parameter's precision and torch's order).
  template <class S>
  void update(const std::string& key, std::vector<S>& param, const std::vector<S>& grad) {
    const double t = static_cast<double>(next_step(key));
    std::vector<S> m = buffer<S>(key, "exp_avg", grad.size()), v = buffer<S>(key, "exp_avg_sq", grad.size());
    const S decay = static_cast<S>(1 - o_.lr() * o_.weight_decay()), b1 = static_cast<S>(o_.beta1()),
            b2 = static_cast<S>(o_.beta2()), one_b1 = static_cast<S>(1 - o_.beta1()),
            one_b2 = static_cast<S>(1 - o_.beta2()), eps = static_cast<S>(o_.eps());
    const double correction1 = 1 - std::pow(o_.beta1(), t), correction2 = 1 - std::pow(o_.beta2(), t);
    const S minus_step = static_cast<S>(-(o_.lr() / correction1)), root2 = static_cast<S>(std::sqrt(correction2));
    for (std::size_t i = 0; i < param.size(); ++i) {
      param[i] = param[i] * decay;
      m[i] = m[i] * b1 + one_b1 * grad[i];
      v[i] = v[i] * b2 + one_b2 * grad[i] * grad[i];
      const S denom = std::sqrt(v[i]) / root2 + eps;
      param[i] = param[i] + minus_step * m[i] / denom;
    }
    set_buffer(key, "exp_avg", m);
    set_buffer(key, "exp_avg_sq", v);
  }

 private:
  Options o_;
};

}  // namespace c2f
