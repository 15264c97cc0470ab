// Incremental decoding: for every layer that decodes, the outputs of decode() over any split of a
// sequence into calls equal the rows of the causal forward() over the whole sequence; prefill() gives
// the last row; caches in half / bfloat16 stay within a stated tolerance of the float cache; a
// non-causal layer refuses to decode.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

namespace {

using c2f::Index;
using c2f::Tensor3;
using c2f_test::expect_close;
using c2f_test::randomize;
using c2f_test::TestRng;

// Largest |output(half or bfloat16 cache) − output(float cache)| relative to max |output| (measured:
// see the test's printout).
constexpr double kHalfTolerance = 2e-3, kBfloat16Tolerance = 2e-2;

template <class Scalar>
double tol() {
  return std::is_same<Scalar, float>::value ? 1e-5 : 1e-10;
}

/// Tokens [t0, t0 + n) of x.
template <class Scalar>
Tensor3<Scalar> slice(const Tensor3<Scalar>& x, Index t0, Index n) {
  Tensor3<Scalar> out(x.dimension(0), n, x.dimension(2));
  for (Index b = 0; b < x.dimension(0); ++b) {
    for (Index t = 0; t < n; ++t) {
      for (Index f = 0; f < x.dimension(2); ++f) out(b, t, f) = x(b, t0 + t, f);
    }
  }
  return out;
}

/// Random call sizes summing to `length`, drawn from `sizes` (the last one cut to fit).
std::vector<Index> random_split(Index length, const std::vector<Index>& sizes, TestRng& rng) {
  std::vector<Index> split;
  for (Index done = 0; done < length;) {
    const Index n = std::min(length - done, std::max<Index>(1, rng.pick(sizes)));
    split.push_back(n);
    done += n;
  }
  return split;
}

/// Decodes x call by call (the split) into one [B, L, E] tensor of outputs.
template <class Scalar, class Layer, class State>
Tensor3<Scalar> decode_all(const Layer& layer, State& state, const Tensor3<Scalar>& x,
                           const std::vector<Index>& split) {
  Tensor3<Scalar> y(x.dimension(0), x.dimension(1), x.dimension(2));
  Index t0 = 0;
  for (Index n : split) {
    const Tensor3<Scalar> part = layer.decode(slice(x, t0, n), state);
    EXPECT_EQ(part.dimension(1), n);
    for (Index b = 0; b < x.dimension(0); ++b) {
      for (Index t = 0; t < n; ++t) {
        for (Index f = 0; f < x.dimension(2); ++f) y(b, t0 + t, f) = part(b, t, f);
      }
    }
    t0 += n;
    EXPECT_EQ(state.length(), t0);
  }
  return y;
}

std::string describe(const std::vector<Index>& split) {
  std::ostringstream os;
  os << "split";
  for (Index n : split) os << ' ' << n;
  return os.str();
}

template <class T>
class DecodeTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DecodeTyped, Scalars);

TYPED_TEST(DecodeTyped, MultiHeadAttentionDecodeEqualsCausalForward) {
  using Scalar = TypeParam;
  TestRng rng(401);
  for (int rep = 0; rep < 12; ++rep) {
    const Index batch = rep % 2 == 0 ? 1 : 3, length = rng.uniform_int(1, 140);
    typename c2f::MultiHeadAttention<Scalar>::Options o;
    o.causal(true)
        .query_block(rng.pick(std::vector<Index>{1, 7, 64}))
        .key_block(rng.pick(std::vector<Index>{5, 32, 256}));
    c2f::MultiHeadAttention<Scalar> mha(16, 4, o);
    randomize(mha, rng);
    const Tensor3<Scalar> x = rng.tensor<Scalar>(batch, length, 16);
    const Tensor3<Scalar> want = mha.forward(x);
    const std::vector<Index> split = random_split(length, {1, 2, 7, 8, 9, 64, 100}, rng);
    typename c2f::MultiHeadAttention<Scalar>::DecodeState state = mha.new_decode_state(batch);
    const Tensor3<Scalar> got = decode_all(mha, state, x, split);
    expect_close(got.data(), want.data(), got.size(), tol<Scalar>(), tol<Scalar>(), describe(split));
    // prefill: the last row only, and the state continues from there.
    typename c2f::MultiHeadAttention<Scalar>::DecodeState pre = mha.new_decode_state(batch);
    const Index cut = rng.uniform_int(1, length);
    const Tensor3<Scalar> last = mha.prefill(slice(x, 0, cut), pre);
    ASSERT_EQ(last.dimension(1), 1);
    for (Index b = 0; b < batch; ++b) {
      expect_close(&last(b, 0, 0), &want(b, cut - 1, 0), 16, tol<Scalar>(), tol<Scalar>(), "prefill");
    }
    if (cut < length) {
      const Tensor3<Scalar> rest = mha.decode(slice(x, cut, length - cut), pre);
      const Tensor3<Scalar> want_rest = slice(want, cut, length - cut);
      expect_close(rest.data(), want_rest.data(), rest.size(), tol<Scalar>(), tol<Scalar>(), "decode after prefill");
    }
  }
}

// The smallest relative gap, over every (batch, head, token) that makes a choice, between the
// (top_k − 1)-th and the top_k-th best earlier chunk — the causal per-token gating's selection margin,
// from the layer's own float projections (computed in double). Decoding projects the new tokens apart
// from the rest, so its chunk scores differ from forward()'s in the last bits; inputs whose margin is
// below kMargin could select differently for rounding reasons alone and are drawn again.
constexpr double kMargin = 1e-4;

template <class Scalar>
double selection_margin(const c2f::SparseC2FAttention<Scalar>& sparse, const Tensor3<Scalar>& x) {
  c2f::RowMatrix<Scalar> q, k, v;
  sparse.as_multihead_attention().project(x, x, x, q, k, v);
  const Index batch = x.dimension(0), length = x.dimension(1), chunk = sparse.chunk_size();
  const c2f::kernels::ChunkGrid grid{batch, length, chunk};
  c2f::RowMatrix<Scalar> means(grid.chunks(), q.cols());
  c2f::kernels::chunk_mean<Scalar>(k, grid, means, c2f::kernels::with_threads(1));
  const Index m = grid.chunks_per_batch(), heads = sparse.num_heads(), dh = q.cols() / heads;
  const Index picks = sparse.top_k() - 1;
  double margin = std::numeric_limits<double>::infinity();
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index t = 0; t < length; ++t) {
        const Index c = t / chunk;
        if (picks < 1 || picks >= c) continue;  // no choice: everything or nothing fits
        std::vector<double> scores;
        for (Index j = 0; j < c; ++j) {
          scores.push_back(q.block(b * length + t, h * dh, 1, dh)
                               .template cast<double>()
                               .row(0)
                               .dot(means.block(b * m + j, h * dh, 1, dh).template cast<double>().row(0)));
        }
        std::sort(scores.rbegin(), scores.rend());
        const double a = scores[static_cast<std::size_t>(picks - 1)], z = scores[static_cast<std::size_t>(picks)];
        margin = std::min(margin, (a - z) / (1.0 + std::max(std::abs(a), std::abs(z))));
      }
    }
  }
  return margin;
}

TYPED_TEST(DecodeTyped, SparseC2FDecodeEqualsCausalForward) {
  using Scalar = TypeParam;
  TestRng rng(404);
  for (int rep = 0; rep < 12; ++rep) {
    const Index batch = rep % 2 == 0 ? 1 : 3, chunk = rng.pick(std::vector<Index>{1, 4, 8}),
                top_k = rng.uniform_int(1, 4);
    const Index length = rng.uniform_int(1, 120);
    c2f::SparseC2FAttention<Scalar> sparse(16, 2, chunk, top_k,
                                           typename c2f::SparseC2FAttention<Scalar>::Options().causal(true));
    Tensor3<Scalar> x;
    for (int attempt = 0;; ++attempt) {  // inputs whose selection is not decided by rounding
      ASSERT_LT(attempt, 50) << "no input with a selection margin >= " << kMargin;
      randomize(sparse, rng);
      x = rng.tensor<Scalar>(batch, length, 16);
      if (selection_margin(sparse, x) >= kMargin) break;
    }
    const Tensor3<Scalar> want = sparse.forward(x);
    const std::vector<Index> split = random_split(length, {1, chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 50}, rng);
    typename c2f::SparseC2FAttention<Scalar>::DecodeState state = sparse.new_decode_state(batch);
    const Tensor3<Scalar> got = decode_all(sparse, state, x, split);
    expect_close(got.data(), want.data(), got.size(), tol<Scalar>(), tol<Scalar>(),
                 "chunk " + std::to_string(chunk) + " top_k " + std::to_string(top_k) + " " + describe(split));
    typename c2f::SparseC2FAttention<Scalar>::DecodeState pre = sparse.new_decode_state(batch);
    const Tensor3<Scalar> last = sparse.prefill(x, pre);
    for (Index b = 0; b < batch; ++b) {
      expect_close(&last(b, 0, 0), &want(b, length - 1, 0), 16, tol<Scalar>(), tol<Scalar>(), "prefill");
    }
  }
}

TYPED_TEST(DecodeTyped, HmhaDecodeEqualsCausalForward) {
  using Scalar = TypeParam;
  TestRng rng(405);
  for (int rep = 0; rep < 12; ++rep) {
    const Index batch = rep % 2 == 0 ? 1 : 3, window = rng.pick(std::vector<Index>{1, 3, 4, 16});
    const Index length = rng.uniform_int(1, 130);
    typename c2f::HMHA<Scalar>::Options o;
    o.causal(true).levels({rng.coin(0.8), rng.coin(0.8), rng.coin(0.8)});
    c2f::HMHA<Scalar> hmha(16, 4, window, o);
    randomize(hmha, rng);
    const Tensor3<Scalar> x = rng.tensor<Scalar>(batch, length, 16);
    const Tensor3<Scalar> want = hmha.forward(x);
    const std::vector<Index> split = random_split(length, {1, window - 1, window, window + 1, 2, 40}, rng);
    typename c2f::HMHA<Scalar>::DecodeState state = hmha.new_decode_state(batch);
    const Tensor3<Scalar> got = decode_all(hmha, state, x, split);
    expect_close(got.data(), want.data(), got.size(), tol<Scalar>(), tol<Scalar>(),
                 "window " + std::to_string(window) + " " + describe(split));
    typename c2f::HMHA<Scalar>::DecodeState pre = hmha.new_decode_state(batch);
    const Index cut = rng.uniform_int(1, length);
    const Tensor3<Scalar> last = hmha.prefill(slice(x, 0, cut), pre);
    for (Index b = 0; b < batch; ++b) {
      expect_close(&last(b, 0, 0), &want(b, cut - 1, 0), 16, tol<Scalar>(), tol<Scalar>(), "prefill");
    }
    if (cut < length) {
      const Tensor3<Scalar> rest = hmha.decode(slice(x, cut, length - cut), pre);
      const Tensor3<Scalar> want_rest = slice(want, cut, length - cut);
      expect_close(rest.data(), want_rest.data(), rest.size(), tol<Scalar>(), tol<Scalar>(), "decode after prefill");
    }
  }
}

TEST(Decode, NonCausalLayersRefuseAndShapesAreChecked) {
  const c2f::MultiHeadAttention<float> plain(16, 4);
  c2f::MultiHeadAttention<float>::DecodeState s = plain.new_decode_state(1);
  TestRng rng(402);
  EXPECT_NE(c2f_test::error_of([&] { plain.decode(rng.tensor<float>(1, 3, 16), s); }).find("causal"),
            std::string::npos);
  const c2f::MultiHeadAttention<float> causal(16, 4, c2f::MultiHeadAttention<float>::Options().causal(true));
  c2f::MultiHeadAttention<float>::DecodeState two = causal.new_decode_state(2);
  EXPECT_THROW(causal.decode(rng.tensor<float>(1, 3, 16), two), std::invalid_argument);  // batch 1 for a state of 2
  EXPECT_THROW(causal.decode(rng.tensor<float>(2, 3, 12), two), std::invalid_argument);  // features
  EXPECT_THROW(causal.decode(rng.tensor<float>(2, 0, 16), two), std::invalid_argument);  // no token
  EXPECT_EQ(two.length(), 0);
  const c2f::SparseC2FAttention<float> sparse(16, 4, 4, 2);
  c2f::SparseC2FAttention<float>::DecodeState ss = sparse.new_decode_state(1);
  EXPECT_NE(c2f_test::error_of([&] { sparse.decode(rng.tensor<float>(1, 3, 16), ss); }).find("causal"),
            std::string::npos);
  const c2f::HMHA<float> hmha(16, 4, 4);
  c2f::HMHA<float>::DecodeState hs = hmha.new_decode_state(1);
  EXPECT_NE(c2f_test::error_of([&] { hmha.decode(rng.tensor<float>(1, 3, 16), hs); }).find("causal"),
            std::string::npos);
}

// Half and bfloat16 caches: the same outputs within the stated tolerance of the float cache, and half the
// memory for the keys and values. SparseC2F runs with top_k covering every chunk here: with fewer, a
// token whose two best chunks score within the cache's rounding may choose differently.
template <class Layer>
void check_narrow_caches(const Layer& layer, const std::string& name, TestRng& rng) {
  const Tensor3<float> x = rng.tensor<float>(2, 300, 32);
  typename Layer::DecodeState full = layer.new_decode_state(2, 300);
  typename Layer::template DecodeStateOf<Eigen::half> half = layer.template new_decode_state<Eigen::half>(2, 300);
  typename Layer::template DecodeStateOf<Eigen::bfloat16> bf16 =
      layer.template new_decode_state<Eigen::bfloat16>(2, 300);
  const std::vector<Index> split = random_split(300, {1, 5, 64}, rng);
  const Tensor3<float> a = decode_all(layer, full, x, split);
  const Tensor3<float> b = decode_all(layer, half, x, split);
  const Tensor3<float> c = decode_all(layer, bf16, x, split);
  EXPECT_EQ(half.cache().memory_bytes() * 2, full.cache().memory_bytes());
  EXPECT_EQ(bf16.cache().memory_bytes() * 2, full.cache().memory_bytes());
  double max_half = 0, max_bf16 = 0, scale = 0;
  for (Index i = 0; i < a.size(); ++i) {
    max_half = std::max(max_half, double(std::abs(a.data()[i] - b.data()[i])));
    max_bf16 = std::max(max_bf16, double(std::abs(a.data()[i] - c.data()[i])));
    scale = std::max(scale, double(std::abs(a.data()[i])));
  }
  std::cout << "[c2f] " << name << " decode, max |output - float cache| / max |output|: half " << max_half / scale
            << ", bfloat16 " << max_bf16 / scale << "\n";
  EXPECT_LE(max_half, kHalfTolerance * scale) << name;
  EXPECT_LE(max_bf16, kBfloat16Tolerance * scale) << name;
  EXPECT_GT(max_half, 0.0) << name << ": the cache really is stored in half";
}

TEST(Decode, HalfAndBfloat16CachesAgainstTheFloatCache) {
  TestRng rng(403);
  c2f::MultiHeadAttention<float> mha(32, 4, c2f::MultiHeadAttention<float>::Options().causal(true));
  randomize(mha, rng);
  check_narrow_caches(mha, "MHA", rng);
  c2f::SparseC2FAttention<float> sparse(32, 4, 16, 300 / 16 + 1,
                                        c2f::SparseC2FAttention<float>::Options().causal(true));
  randomize(sparse, rng);
  check_narrow_caches(sparse, "SparseC2F (top_k covering every chunk)", rng);
  c2f::HMHA<float> hmha(32, 4, 16, c2f::HMHA<float>::Options().causal(true));
  randomize(hmha, rng);
  check_narrow_caches(hmha, "HMHA", rng);
}

// The narrow caches are read through detail::widen (vectorisable bit operations): for every one of the
// 65536 bit patterns it gives exactly Eigen's own conversion (NaN for NaN).
template <class Narrow>
void expect_widen_matches_eigen(const char* name) {
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const Narrow x = Eigen::numext::bit_cast<Narrow>(static_cast<std::uint16_t>(bits));
    const float fast = c2f::detail::widen(x), eigen = static_cast<float>(x);
    if (std::isnan(eigen)) {
      ASSERT_TRUE(std::isnan(fast)) << name << " bits 0x" << std::hex << bits;
    } else {
      ASSERT_EQ(0, std::memcmp(&fast, &eigen, sizeof(float)))
          << name << " bits 0x" << std::hex << bits << ": " << fast << " instead of " << eigen;
    }
  }
}

TEST(Decode, WideningMatchesEigenForEveryBitPattern) {
  expect_widen_matches_eigen<Eigen::half>("half");
  expect_widen_matches_eigen<Eigen::bfloat16>("bfloat16");
  // A strided block converts row by row like Eigen's cast.
  c2f::RowMatrix<Eigen::half> m = c2f::RowMatrix<float>::Random(7, 13).cast<Eigen::half>();
  c2f::RowMatrix<float> out;
  c2f::detail::convert_block<float>(m.block(2, 3, 4, 5), out);
  EXPECT_TRUE(out == m.block(2, 3, 4, 5).cast<float>());
}

// Decoding is causal: outputs decoded before a token arrives do not change with it (the same split,
// inputs that differ from token t on).
template <class Layer, class Scalar>
void expect_decode_causal(const Layer& layer, const Tensor3<Scalar>& x, TestRng& rng, const std::string& name) {
  const Index length = x.dimension(1);
  const std::vector<Index> split = random_split(length, {1, 3, 8}, rng);
  for (Index t : {Index(1), length / 2, length - 1}) {
    Tensor3<Scalar> xp = x;
    for (Index b = 0; b < x.dimension(0); ++b) {
      for (Index i = t; i < length; ++i) {
        for (Index f = 0; f < x.dimension(2); ++f) xp(b, i, f) = static_cast<Scalar>(3.0 * rng.normal());
      }
    }
    typename Layer::DecodeState s1 = layer.new_decode_state(x.dimension(0)),
                                s2 = layer.new_decode_state(x.dimension(0));
    const Tensor3<Scalar> y = decode_all(layer, s1, x, split), yp = decode_all(layer, s2, xp, split);
    for (Index b = 0; b < x.dimension(0); ++b) {
      EXPECT_EQ(0,
                std::memcmp(&y(b, 0, 0), &yp(b, 0, 0), sizeof(Scalar) * static_cast<std::size_t>(t * x.dimension(2))))
          << name << ": perturbing tokens >= " << t << " changed earlier decoded outputs";
    }
  }
}

TEST(Decode, DecodedOutputsDoNotSeeLaterTokens) {
  TestRng rng(406);
  const Tensor3<float> x = rng.tensor<float>(2, 41, 16);
  c2f::MultiHeadAttention<float> mha(16, 4, c2f::MultiHeadAttention<float>::Options().causal(true));
  randomize(mha, rng);
  expect_decode_causal(mha, x, rng, "MHA");
  c2f::SparseC2FAttention<float> sparse(16, 4, 4, 3, c2f::SparseC2FAttention<float>::Options().causal(true));
  randomize(sparse, rng);
  expect_decode_causal(sparse, x, rng, "SparseC2F");
  c2f::HMHA<float> hmha(16, 4, 5, c2f::HMHA<float>::Options().causal(true));
  randomize(hmha, rng);
  expect_decode_causal(hmha, x, rng, "HMHA");
}

}  // namespace
