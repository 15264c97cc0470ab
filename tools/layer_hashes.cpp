// layer_hashes: one FNV-1a hash of the output bits of every layer — forward, the gradients of
// forward_train + backward, and for the causal layers decode in pieces — on fixed random weights and
// inputs (B = 2, L = 1000 by default, d = 128, 4 heads), on 1 and on 2 threads.
//
//   build/<preset>/tools/layer_hashes [--seq L]
//
// For a change that must not move any output bit (a refactor, a new file layout): run it before and
// after on the same machine and build flags, and compare the two listings line by line. The bits depend
// on the CPU's instruction set and the compiler flags, so the hashes are not a fixture: only the two runs
// of one machine compare.
#include "c2f/c2f.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using c2f::Index;
using c2f::Tensor3;

struct Hash {
  std::uint64_t h = 1469598103934665603ULL;
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ULL;
  }
  template <class S>
  void tensor(const Tensor3<S>& t) {
    bytes(t.data(), sizeof(S) * static_cast<std::size_t>(t.size()));
  }
  void state(const c2f::StateDict& sd) {
    for (const auto& [name, t] : sd) {
      bytes(name.data(), name.size());
      bytes(t.bytes().data(), t.bytes().size());
    }
  }
};

template <class S>
Tensor3<S> random_input(Index batch, Index seq, Index width, std::uint64_t seed) {
  Tensor3<S> x(batch, seq, width);
  std::uint64_t s = seed * 2862933555777941757ULL + 3037000493ULL;
  for (Index i = 0; i < x.size(); ++i) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    x.data()[i] = static_cast<S>(static_cast<double>(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  }
  return x;
}

template <class T, class = void>
struct Trains : std::false_type {};
template <class T>
struct Trains<T, std::void_t<typename T::Saved>> : std::true_type {};

template <class T, class = void>
struct Decodes : std::false_type {};
template <class T>
struct Decodes<T, std::void_t<decltype(std::declval<const T&>().new_decode_state(1))>> : std::true_type {};

/// How a layer is called on x: the [batch, seq, features] form, or the grid / chunked form.
template <class L, class S>
struct Call {
  static Tensor3<S> forward(const L& l, const Tensor3<S>& x) { return l.forward(x); }
  static auto train(const L& l, const Tensor3<S>& x) { return l.forward_train(x); }
};
template <class S>
struct Call<c2f::FineAttention<S>, S> {
  static constexpr Index kChunk = 16;
  static Tensor3<S> context(const Tensor3<S>& x) {
    return random_input<S>(x.dimension(0), (x.dimension(1) + kChunk - 1) / kChunk, x.dimension(2), 77);
  }
  static Tensor3<S> forward(const c2f::FineAttention<S>& l, const Tensor3<S>& x) {
    return l.forward_chunked(x, kChunk, context(x));
  }
  static auto train(const c2f::FineAttention<S>& l, const Tensor3<S>& x) {
    return l.forward_train(x, kChunk, context(x));
  }
};
template <class S>
struct Call<c2f::C2FAttention2D<S>, S> {
  // L = 1000 as a 25 × 40 grid.
  static std::pair<Index, Index> grid(Index seq) {
    Index h = 1;
    for (Index d = 1; d * d <= seq; ++d) {
      if (seq % d == 0) h = d;
    }
    return {h, seq / h};
  }
  static Tensor3<S> forward(const c2f::C2FAttention2D<S>& l, const Tensor3<S>& x) {
    const auto [h, w] = grid(x.dimension(1));
    return l.forward(x, h, w);
  }
  static auto train(const c2f::C2FAttention2D<S>& l, const Tensor3<S>& x) {
    const auto [h, w] = grid(x.dimension(1));
    return l.forward_train(x, h, w);
  }
};

template <class T>
struct ScalarOf;
template <template <class> class L, class S>
struct ScalarOf<L<S>> {
  using type = S;
};

template <class L>
void run(const char* name, const L& layer, Index width, Index seq) {
  using Scalar = typename ScalarOf<L>::type;
  const Tensor3<Scalar> x = random_input<Scalar>(2, seq, width, 1);
  for (int threads : {1, 2}) {
    c2f::set_num_threads(threads);
    Hash fwd;
    fwd.tensor(Call<L, Scalar>::forward(layer, x));
    std::printf("%-32s threads %d  forward  %016llx", name, threads, static_cast<unsigned long long>(fwd.h));
    if constexpr (Trains<L>::value) {
      if (layer.options().compute() == c2f::Compute::Float32) {  // the backward pass is fp32 only
        auto [y, saved] = Call<L, Scalar>::train(layer, x);
        const Tensor3<Scalar> dy = random_input<Scalar>(y.dimension(0), y.dimension(1), y.dimension(2), 2);
        const c2f::Grads<Scalar> g = layer.backward(saved, dy);
        Hash grad;
        grad.tensor(y);
        grad.tensor(g.input);
        grad.tensor(g.context);
        grad.state(g.params);
        std::printf("  backward %016llx", static_cast<unsigned long long>(grad.h));
      }
    }
    if constexpr (Decodes<L>::value) {
      if (!layer.options().causal()) {
        std::printf("\n");
        continue;
      }
      auto state = layer.new_decode_state(x.dimension(0));
      Hash dec;
      Index at = 0;
      for (Index piece : {Index(1), Index(5), Index(200), x.dimension(1)}) {
        const Index n = std::min(piece, x.dimension(1) - at);
        if (n <= 0) break;
        Tensor3<Scalar> part(x.dimension(0), n, width);
        for (Index b = 0; b < x.dimension(0); ++b) {
          std::memcpy(part.data() + b * n * width, x.data() + (b * x.dimension(1) + at) * width,
                      sizeof(Scalar) * static_cast<std::size_t>(n * width));
        }
        dec.tensor(layer.decode(part, state));
        at += n;
      }
      std::printf("  decode %016llx", static_cast<unsigned long long>(dec.h));
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  Index seq = 1000;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seq") == 0 && i + 1 < argc) {
      seq = std::atol(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: layer_hashes [--seq L]\n");
      return 2;
    }
  }
  constexpr Index d = 128;
  constexpr Index h = 4;
  const c2f::Compute bf16 = c2f::Compute::BFloat16;
  using c2f::FinePath;
  {
    using L = c2f::Linear<float>;
    run("Linear", L(d, d, L::Options().seed(1)), d, seq);
    run("LinearBf16", L(d, d, L::Options().seed(1).compute(bf16)), d, seq);
  }
  {
    using L = c2f::Conv1d<float>;
    run("Conv1d", L(d, d, 3, L::Options().seed(2).groups(2)), d, seq);
    run("CausalConv1d", L(d, d, 3, L::Options().seed(2).causal(true)), d, seq);
    run("Conv1dBf16", L(d, d, 3, L::Options().seed(2).compute(bf16)), d, seq);
  }
  {
    using L = c2f::C3K2Projection<float>;
    run("C3K2Projection", L(d, h, L::Options().seed(3)), d, seq);
    run("CausalC3K2Projection", L(d, h, L::Options().seed(3).causal(true)), d, seq);
    run("C3K2ProjectionBf16", L(d, h, L::Options().seed(3).compute(bf16)), d, seq);
  }
  {
    using L = c2f::MultiHeadAttention<float>;
    run("MultiHeadAttention", L(d, h, L::Options().seed(4)), d, seq);
    run("MultiHeadAttentionNaive", L(d, h, L::Options().seed(4).kernel(c2f::AttnKernel::Naive)), d, seq);
    run("CausalMultiHeadAttention", L(d, h, L::Options().seed(4).causal(true)), d, seq);
    run("MultiHeadAttentionBf16", L(d, h, L::Options().seed(4).compute(bf16)), d, seq);
    run("CausalMultiHeadAttentionBf16", L(d, h, L::Options().seed(4).causal(true).compute(bf16)), d, seq);
    using D = c2f::MultiHeadAttention<double>;
    run("MultiHeadAttentionF64", D(d, h, D::Options().seed(4)), d, seq);
  }
  {
    using L = c2f::CoarseAttention<float>;
    run("CoarseAttention", L(d, h, L::Options().seed(5)), d, seq);
    using F = c2f::FineAttention<float>;
    run("FineAttention", F(d, h, F::Options().seed(6)), d, seq);
  }
  {
    using L = c2f::C2FAttention<float>;
    for (Index chunk : {Index(16), Index(32), Index(37)}) {
      const std::string c = std::to_string(chunk);
      run(("C2FAttention/" + c).c_str(), L(d, h, chunk, L::Options().seed(7)), d, seq);
      run(("C2FAttentionGeneral/" + c).c_str(), L(d, h, chunk, L::Options().seed(7).fine_path(FinePath::General)), d,
          seq);
      run(("C2FAttentionBf16/" + c).c_str(), L(d, h, chunk, L::Options().seed(7).compute(bf16)), d, seq);
    }
    using D = c2f::C2FAttention<double>;
    run("C2FAttentionF64/32", D(d, h, 32, D::Options().seed(7)), d, seq);
  }
  {
    using L = c2f::C2FAttention2D<float>;
    run("C2FAttention2D/4x8", L(d, h, 4, 8, L::Options().seed(8)), d, seq);
    run("C2FAttention2DBf16/4x8", L(d, h, 4, 8, L::Options().seed(8).compute(bf16)), d, seq);
  }
  {
    using L = c2f::HMHA<float>;
    run("HMHA/64", L(d, h, 64, L::Options().seed(9)), d, seq);
    run("CausalHMHA/64", L(d, h, 64, L::Options().seed(9).causal(true)), d, seq);
    run("HMHABf16/64", L(d, h, 64, L::Options().seed(9).compute(bf16)), d, seq);
    run("CausalHMHABf16/64", L(d, h, 64, L::Options().seed(9).causal(true).compute(bf16)), d, seq);
  }
  {
    using L = c2f::SparseC2FAttention<float>;
    run("SparseC2FAttention/32/4", L(d, h, 32, 4, L::Options().seed(10)), d, seq);
    run("CausalSparseC2FAttention/32/4", L(d, h, 32, 4, L::Options().seed(10).causal(true)), d, seq);
    run("SparseC2FAttentionBf16/32/4", L(d, h, 32, 4, L::Options().seed(10).compute(bf16)), d, seq);
    run("CausalSparseC2FAttentionBf16/32/4", L(d, h, 32, 4, L::Options().seed(10).causal(true).compute(bf16)), d, seq);
  }
  return 0;
}
