// Token-by-token decoding with a causal attention layer: prefill a prompt into a decoding state, then
// generate one token at a time, each step's input made from the previous step's output (as a decoder
// feeds back what it produced). Prints the prefill and decode rates, the state's memory, and checks the
// decoded outputs against the layer's causal forward() over the whole sequence.
//
//   decode_stream [prompt_tokens=4096] [new_tokens=256] [batch=1] [threads=0 (all)]
//
// Layers (d = 512, 8 heads, random weights): MultiHeadAttention (float and bfloat16 caches),
// SparseC2FAttention (chunk 64, top_k 8, per-token gating) and HMHA (window 64). Exit code 1 when an
// MHA or HMHA output differs from forward() by more than 1e-4 (float cache). SparseC2F's difference is
// printed only: a decode step and forward() compute the chunk scores with differently shaped products,
// and a near-tie between two chunks can legitimately select differently.
#include <c2f/c2f.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace {

using c2f::Index;
using c2f::Tensor3;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The next step's input from a step's output: each row rescaled to norm sqrt(d) (a stand-in for the
// embedding of the token a model would have sampled).
Tensor3<float> next_input(const Tensor3<float>& y) {
  Tensor3<float> x = y;
  const Index d = y.dimension(2);
  for (Index b = 0; b < y.dimension(0); ++b) {
    Eigen::Map<Eigen::VectorXf> row(&x(b, 0, 0), d);
    const float norm = row.norm();
    if (norm > 0) row *= std::sqrt(float(d)) / norm;
  }
  return x;
}

// Prefills `prompt`, decodes `steps` tokens; returns max |decoded − forward| over the generated tokens.
template <class Layer, class Cache = float>
double run(const char* name, const Layer& layer, const Tensor3<float>& prompt, Index steps) {
  const Index batch = prompt.dimension(0), p = prompt.dimension(1), d = prompt.dimension(2);
  typename Layer::template DecodeStateOf<Cache> state = layer.template new_decode_state<Cache>(batch, p + steps);
  Tensor3<float> inputs(batch, p + steps, d), decoded(batch, steps, d);
  inputs.slice(Eigen::array<Index, 3>{0, 0, 0}, Eigen::array<Index, 3>{batch, p, d}) = prompt;

  const Clock::time_point t0 = Clock::now();
  Tensor3<float> y = layer.prefill(prompt, state);  // the prompt's last output only
  const double prefill_s = seconds_since(t0);

  const Clock::time_point t1 = Clock::now();
  for (Index t = 0; t < steps; ++t) {
    const Tensor3<float> x = next_input(y);
    inputs.slice(Eigen::array<Index, 3>{0, p + t, 0}, Eigen::array<Index, 3>{batch, 1, d}) = x;
    y = layer.decode(x, state);
    decoded.slice(Eigen::array<Index, 3>{0, t, 0}, Eigen::array<Index, 3>{batch, 1, d}) = y;
  }
  const double decode_s = seconds_since(t1);

  // The same rows from the causal forward over everything the state has seen.
  const Tensor3<float> full = layer.forward(inputs);
  double diff = 0.0;
  for (Index b = 0; b < batch; ++b) {
    for (Index t = 0; t < steps; ++t) {
      for (Index f = 0; f < d; ++f) diff = std::max(diff, double(std::abs(decoded(b, t, f) - full(b, p + t, f))));
    }
  }
  std::printf(
      "%-34s prefill %6ld tokens: %8.1f ms (%9.0f tokens/s) | decode %4ld steps: %8.0f tokens/s "
      "(%6.3f ms/step) | state %7.1f MiB | max |decode - forward| %.2g\n",
      name, static_cast<long>(p), prefill_s * 1e3, double(batch * p) / prefill_s, static_cast<long>(steps),
      double(batch * steps) / decode_s, decode_s * 1e3 / double(steps),
      double(state.memory_bytes()) / (1024.0 * 1024.0), diff);
  return diff;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Index prompt_tokens = argc > 1 ? std::stol(argv[1]) : 4096;
    const Index new_tokens = argc > 2 ? std::stol(argv[2]) : 256;
    const Index batch = argc > 3 ? std::stol(argv[3]) : 1;
    const int threads = argc > 4 ? std::atoi(argv[4]) : 0;
    if (prompt_tokens < 1 || new_tokens < 1 || batch < 1 || threads < 0) {
      std::fprintf(stderr, "usage: decode_stream [prompt_tokens >= 1] [new_tokens >= 1] [batch >= 1] [threads >= 0]\n");
      return 2;
    }
    if (threads > 0) c2f::set_num_threads(threads);
    constexpr Index d = 512, heads = 8;
    Tensor3<float> prompt(batch, prompt_tokens, d);
    prompt.setRandom();  // uniform in [0, 1): shift to [-1, 1)
    prompt = prompt * 2.0f - 1.0f;
    std::printf("d = %ld, %ld heads, batch %ld, %d threads\n", static_cast<long>(d), static_cast<long>(heads),
                static_cast<long>(batch), c2f::get_num_threads());

    const c2f::MultiHeadAttention<float> mha(d, heads, c2f::MultiHeadAttention<float>::Options().causal(true));
    const c2f::SparseC2FAttention<float> sparse(d, heads, 64, 8,
                                                c2f::SparseC2FAttention<float>::Options().causal(true));
    const c2f::HMHA<float> hmha(d, heads, 64, c2f::HMHA<float>::Options().causal(true));

    bool ok = true;
    ok = run("MultiHeadAttention", mha, prompt, new_tokens) <= 1e-4 && ok;
    run<c2f::MultiHeadAttention<float>, Eigen::bfloat16>("MultiHeadAttention, bfloat16 cache", mha, prompt, new_tokens);
    run("SparseC2FAttention(64, top_k 8)", sparse, prompt, new_tokens);
    ok = run("HMHA(window 64)", hmha, prompt, new_tokens) <= 1e-4 && ok;
    if (!ok) std::printf("decode and forward disagree beyond 1e-4\n");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
