// Trains a small model with c2f's backward passes, step for step against its PyTorch twin
// (examples/train_c2f.py, which writes the task and the initial parameters and runs this program):
//
//   Linear(8 → 32) → C2FAttention(32, 4 heads, chunk 8) → mean over the tokens → Linear(32 → 2),
//   cross-entropy on the whole training set, clip_grad_norm, AdamW (the hyperparameters the file says),
//
// in float64 and in float32, from the same initial parameters (float64 in the file; float32 rounds them
// as torch's .to(float32) does). Prints the two loss curves side by side and the accuracies, writes c2f's
// curves to <dir>/train_c2f_c2f.safetensors, and exits 1 unless they agree with PyTorch's: float64 every
// step within 1e-8 relative, float32 the last step within 1e-3.
//
//   /usr/bin/python3 examples/train_c2f.py --out /tmp/train_c2f --cpp build/release/examples/train_c2f
//   build/release/examples/train_c2f /tmp/train_c2f          (again, on the files the script wrote)
#include <c2f/c2f.hpp>
#include <c2f/io/safetensors.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

using c2f::Index;
using c2f::StateDict;
using c2f::Tensor3;

/// The hyperparameter `key` of the file's metadata.
double meta(const StateDict& sd, const std::string& key) { return std::stod(sd.metadata().at(key)); }
Index meta_index(const StateDict& sd, const std::string& key) {
  return static_cast<Index>(std::stoll(sd.metadata().at(key)));
}

/// The classes of an I64 tensor.
std::vector<std::int64_t> classes(const c2f::TensorData& t) {
  std::vector<std::int64_t> y(static_cast<std::size_t>(t.numel()));
  if (!y.empty()) std::memcpy(y.data(), t.bytes().data(), t.bytes().size());
  return y;
}

/// The tensors under `prefix`, without it.
StateDict under(const StateDict& sd, const std::string& prefix) {
  StateDict out;
  for (const std::string& key : sd.keys(prefix)) out.set(key.substr(prefix.size()), sd.at(key));
  return out;
}

template <class Scalar>
struct Model {
  c2f::Linear<Scalar> embed;
  c2f::C2FAttention<Scalar> attn;
  c2f::Linear<Scalar> head;

  explicit Model(const StateDict& file)
      : embed(meta_index(file, "features"), meta_index(file, "width")),
        attn(meta_index(file, "width"), meta_index(file, "heads"), meta_index(file, "chunk")),
        head(meta_index(file, "width"), meta_index(file, "classes")) {
    embed.load_state_dict(file, "init.embed.");
    attn.load_state_dict(file, "init.attn.");
    head.load_state_dict(file, "init.head.");
  }

  /// The mean over the tokens of h [B, L, W], as [B, 1, W].
  static Tensor3<Scalar> mean_tokens(const Tensor3<Scalar>& h) {
    const Eigen::array<Index, 3> dims{h.dimension(0), 1, h.dimension(2)};
    return h.mean(Eigen::array<Index, 1>{1}).reshape(dims);
  }

  /// The logits [B, 1, classes] of x (eval mode).
  Tensor3<Scalar> logits(const Tensor3<Scalar>& x) const {
    return head.forward(mean_tokens(attn.forward(embed.forward(x))));
  }

  /// The share of the sequences whose largest logit is their class.
  double accuracy(const Tensor3<Scalar>& x, const std::vector<std::int64_t>& y) const {
    const Tensor3<Scalar> z = logits(x);
    Index right = 0;
    for (Index b = 0; b < z.dimension(0); ++b) {
      Index best = 0;
      for (Index c = 1; c < z.dimension(2); ++c) best = z(b, 0, c) > z(b, 0, best) ? c : best;
      right += best == y[static_cast<std::size_t>(b)];
    }
    return double(right) / double(z.dimension(0));
  }
};

/// One training step (torch's loop: zero_grad, loss, backward, clip_grad_norm_, AdamW.step); returns the
/// loss before the update.
template <class Scalar>
double train_step(Model<Scalar>& m, const Tensor3<Scalar>& x, const std::vector<std::int64_t>& y, c2f::AdamW& opt,
                  double max_norm) {
  const Index batch = x.dimension(0), length = x.dimension(1);
  auto [h, saved_embed] = m.embed.forward_train(x);
  auto [a, saved_attn] = m.attn.forward_train(h);
  auto [z, saved_head] = m.head.forward_train(Model<Scalar>::mean_tokens(a));
  // Cross-entropy, mean over the batch: loss = mean(logsumexp(z_b) − z_b[y_b]); dz = (softmax(z_b) − onehot) / B.
  Tensor3<Scalar> dz(z.dimensions());
  double loss = 0;
  for (Index b = 0; b < batch; ++b) {
    double top = z(b, 0, 0), sum = 0;
    for (Index c = 1; c < z.dimension(2); ++c) top = std::max(top, double(z(b, 0, c)));
    for (Index c = 0; c < z.dimension(2); ++c) sum += std::exp(double(z(b, 0, c)) - top);
    const std::int64_t label = y[static_cast<std::size_t>(b)];
    loss += top + std::log(sum) - double(z(b, 0, label));
    for (Index c = 0; c < z.dimension(2); ++c) {
      dz(b, 0, c) =
          static_cast<Scalar>((std::exp(double(z(b, 0, c)) - top) / sum - (c == label ? 1.0 : 0.0)) / double(batch));
    }
  }
  const c2f::Grads<Scalar> g_head = m.head.backward(saved_head, dz);
  Tensor3<Scalar> da(a.dimensions());  // the mean's backward: every token gets dL/dpooled / L
  for (Index b = 0; b < batch; ++b) {
    for (Index t = 0; t < length; ++t) {
      for (Index f = 0; f < da.dimension(2); ++f) da(b, t, f) = g_head.input(b, 0, f) / static_cast<Scalar>(length);
    }
  }
  const c2f::Grads<Scalar> g_attn = m.attn.backward(saved_attn, da);
  const c2f::Grads<Scalar> g_embed = m.embed.backward(saved_embed, g_attn.input);
  StateDict grads;  // one clip over every parameter, as clip_grad_norm_(model.parameters())
  grads.merge(g_embed.params, "embed.");
  grads.merge(g_attn.params, "attn.");
  grads.merge(g_head.params, "head.");
  c2f::clip_grad_norm(grads, max_norm);
  opt.step(m.embed, under(grads, "embed."), "embed");
  opt.step(m.attn, under(grads, "attn."), "attn");
  opt.step(m.head, under(grads, "head."), "head");
  return loss / double(batch);
}

struct Run {
  std::vector<double> losses;
  double train_accuracy = 0, test_accuracy = 0;
};

template <class Scalar>
Run train(const StateDict& file, Index steps) {
  Model<Scalar> m(file);
  const auto tensor = [&](const char* name) {
    const c2f::TensorData& t = file.at(name);
    Tensor3<Scalar> out(t.shape()[0], t.shape()[1], t.shape()[2]);
    t.copy_to(out.data());
    return out;
  };
  const Tensor3<Scalar> x = tensor("x"), x_test = tensor("x_test");
  const std::vector<std::int64_t> y = classes(file.at("y")), y_test = classes(file.at("y_test"));
  c2f::AdamW opt(c2f::AdamW::Options().lr(meta(file, "lr")).weight_decay(meta(file, "weight_decay")));
  Run run;
  for (Index step = 0; step < steps; ++step) run.losses.push_back(train_step(m, x, y, opt, meta(file, "max_norm")));
  run.train_accuracy = m.accuracy(x, y);
  run.test_accuracy = m.accuracy(x_test, y_test);
  return run;
}

double relative(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR   (DIR: what examples/train_c2f.py --out DIR wrote)\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const StateDict file = c2f::load_safetensors(dir + "/train_c2f_init.safetensors");
  const StateDict torch = c2f::load_safetensors(dir + "/train_c2f_torch.safetensors");
  const Index steps = meta_index(file, "steps");
  const Run f64 = train<double>(file, steps), f32 = train<float>(file, steps);
  const std::vector<double> t64 = torch.at("loss_f64").to_vector<double>(),
                            t32 = torch.at("loss_f32").to_vector<double>();
  if (static_cast<Index>(t64.size()) != steps || static_cast<Index>(t32.size()) != steps) {
    std::printf("PyTorch's curves have %zu and %zu steps, not %ld\n", t64.size(), t32.size(), static_cast<long>(steps));
    return 1;
  }

  std::printf("%5s  %-14s %-14s %-9s  %-12s %-12s %-9s\n", "step", "torch f64", "c2f f64", "rel diff", "torch f32",
              "c2f f32", "rel diff");
  double worst64 = 0;
  for (Index s = 0; s < steps; ++s) {
    const std::size_t i = static_cast<std::size_t>(s);
    worst64 = std::max(worst64, relative(f64.losses[i], t64[i]));
    if (s < 10 || (s + 1) % 10 == 0) {
      std::printf("%5ld  %.12f %.12f %.2e  %.9f  %.9f  %.2e\n", static_cast<long>(s + 1), t64[i], f64.losses[i],
                  relative(f64.losses[i], t64[i]), t32[i], f32.losses[i], relative(f32.losses[i], t32[i]));
    }
  }
  const double last32 = relative(f32.losses.back(), t32.back());
  const std::vector<double> acc64 = torch.at("accuracy_f64").to_vector<double>(),
                            acc32 = torch.at("accuracy_f32").to_vector<double>();
  std::printf(
      "accuracy after %ld steps (train / test): c2f f64 %.3f / %.3f, torch f64 %.3f / %.3f; c2f f32 %.3f / %.3f, "
      "torch f32 %.3f / %.3f\n",
      static_cast<long>(steps), f64.train_accuracy, f64.test_accuracy, acc64[0], acc64[1], f32.train_accuracy,
      f32.test_accuracy, acc32[0], acc32[1]);
  std::printf(
      "float64: every step within %.2e of PyTorch (required 1e-8); float32: step %ld within %.2e (required 1e-3)\n",
      worst64, static_cast<long>(steps), last32);

  StateDict curves;
  curves.set("loss_f64", c2f::TensorData::from_values(f64.losses.data(), {steps}));
  std::vector<float> loss32(f32.losses.begin(), f32.losses.end());
  curves.set("loss_f32", c2f::TensorData::from_values(loss32.data(), {steps}));
  const double a64[2] = {f64.train_accuracy, f64.test_accuracy}, a32[2] = {f32.train_accuracy, f32.test_accuracy};
  curves.set("accuracy_f64", c2f::TensorData::from_values(a64, {2}));
  curves.set("accuracy_f32", c2f::TensorData::from_values(a32, {2}));
  c2f::save_safetensors(dir + "/train_c2f_c2f.safetensors", curves);
  const bool ok = worst64 <= 1e-8 && last32 <= 1e-3;
  std::printf("%s\n", ok ? "the loss curves agree with PyTorch's" : "FAILED: the loss curves differ from PyTorch's");
  return ok ? 0 : 1;
}
