// Causality as a property that can fail: a causal layer's output for token i never changes when a
// token at or after t > i changes. For every causal mode of the library the outputs before t must stay
// bit-identical whatever is written into tokens t, t+1, …; the same check run on the non-causal modes
// must see a change (so the check itself can fail).
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>

namespace {

using c2f::Index;
using c2f::Tensor3;
using c2f_test::randomize;
using c2f_test::TestRng;

template <class Scalar>
using Forward = std::function<Tensor3<Scalar>(const Tensor3<Scalar>&)>;

/// What perturbing every token ≥ t did to the outputs of the tokens < t.
struct Leak {
  Index t = 0;
  Index first_changed = -1;  ///< the first token < t whose output bits changed, or -1
  double max_change = 0.0;   ///< max |Δ| over the outputs of tokens < t
};

/// Perturbs tokens [t, L) of every batch item of x with fresh random values (twice, with different
/// draws) and compares the outputs of tokens [0, t) bit for bit.
template <class Scalar>
Leak perturb_future(const Forward<Scalar>& forward, const Tensor3<Scalar>& x, Index t, TestRng& rng) {
  const Tensor3<Scalar> y = forward(x);
  const Index batch = x.dimension(0), length = x.dimension(1), e = x.dimension(2), out_e = y.dimension(2);
  Leak leak;
  leak.t = t;
  for (int draw = 0; draw < 2; ++draw) {
    Tensor3<Scalar> xp = x;
    for (Index b = 0; b < batch; ++b) {
      for (Index i = t; i < length; ++i) {
        for (Index f = 0; f < e; ++f) xp(b, i, f) = static_cast<Scalar>(3.0 * rng.normal());
      }
    }
    const Tensor3<Scalar> yp = forward(xp);
    for (Index b = 0; b < batch; ++b) {
      for (Index i = 0; i < t; ++i) {
        const bool same = std::memcmp(&y(b, i, 0), &yp(b, i, 0), sizeof(Scalar) * static_cast<std::size_t>(out_e)) == 0;
        if (!same && (leak.first_changed < 0 || i < leak.first_changed)) leak.first_changed = i;
        for (Index f = 0; f < out_e; ++f) {
          leak.max_change = std::max(leak.max_change, std::abs(static_cast<double>(y(b, i, f)) - yp(b, i, f)));
        }
      }
    }
  }
  return leak;
}

/// Cut points: 1, the chunk/window boundaries ± 1 (every `period` tokens), and L − 1.
std::vector<Index> cut_points(Index length, Index period) {
  std::vector<Index> ts = {1};
  for (Index p = period; p < length; p += period) {
    for (Index t : {p - 1, p, p + 1}) {
      if (t > ts.back() && t < length) ts.push_back(t);
    }
  }
  if (length - 1 > ts.back()) ts.push_back(length - 1);
  return ts;
}

std::string describe(const Leak& leak) {
  std::ostringstream os;
  os << "perturbing tokens >= " << leak.t << " changed token " << leak.first_changed << " by up to " << leak.max_change;
  return os.str();
}

/// Every cut keeps the earlier outputs bit-identical.
template <class Scalar>
void expect_causal(const Forward<Scalar>& forward, const Tensor3<Scalar>& x, Index period, TestRng& rng,
                   const std::string& what) {
  std::ostringstream leaks;
  int cuts = 0, leaking = 0;
  for (Index t : cut_points(x.dimension(1), period)) {
    const Leak leak = perturb_future(forward, x, t, rng);
    ++cuts;
    if (leak.first_changed >= 0) {
      if (leaking++ < 3) leaks << "\n  " << describe(leak);
    }
  }
  EXPECT_EQ(leaking, 0) << what << ": " << leaking << " of " << cuts << " cuts leak the future, e.g." << leaks.str();
}

/// Some cut changes an earlier output: the check detects a layer that reads the future.
template <class Scalar>
void expect_not_causal(const Forward<Scalar>& forward, const Tensor3<Scalar>& x, Index period, TestRng& rng,
                       const std::string& what) {
  bool seen = false;
  for (Index t : cut_points(x.dimension(1), period))
    seen = seen || perturb_future(forward, x, t, rng).first_changed >= 0;
  EXPECT_TRUE(seen) << what << ": no perturbation of later tokens changed an earlier output";
}

template <class T>
class CausalTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(CausalTyped, Scalars);

TYPED_TEST(CausalTyped, MultiHeadAttentionWithCausalMask) {
  using Scalar = TypeParam;
  TestRng rng(301);
  for (c2f::AttnKernel kernel : {c2f::AttnKernel::Streaming, c2f::AttnKernel::Naive}) {
    typename c2f::MultiHeadAttention<Scalar>::Options o;
    o.kernel(kernel);
    o.query_block(8);  // several query and key blocks, so block skipping is exercised
    o.key_block(16);
    c2f::MultiHeadAttention<Scalar> mha(16, 4, o);
    randomize(mha, rng);
    const Tensor3<Scalar> x = rng.tensor<Scalar>(2, 45, 16);
    c2f::Masks<Scalar> causal;
    causal.attn_mask(c2f::AttnMask<Scalar>::causal());
    const std::string name = kernel == c2f::AttnKernel::Naive ? "naive" : "streaming";
    expect_causal<Scalar>([&](const Tensor3<Scalar>& in) { return mha.forward(in, causal); }, x, 8, rng,
                          "MHA causal " + name);
    expect_not_causal<Scalar>([&](const Tensor3<Scalar>& in) { return mha.forward(in); }, x, 8, rng,
                              "MHA without mask " + name);
  }
}

// The construction option gives the same numbers as the call-time causal mask, and is causal.
TYPED_TEST(CausalTyped, MultiHeadAttentionCausalOption) {
  using Scalar = TypeParam;
  TestRng rng(304);
  c2f::MultiHeadAttention<Scalar> causal(16, 4, typename c2f::MultiHeadAttention<Scalar>::Options().causal(true));
  randomize(causal, rng);
  c2f::MultiHeadAttention<Scalar> plain(16, 4);
  plain.load_state_dict(causal.state_dict());
  const Tensor3<Scalar> x = rng.tensor<Scalar>(2, 37, 16);
  EXPECT_TRUE(c2f_test::same_bits(causal.forward(x),
                                  plain.forward(x, c2f::Masks<Scalar>().attn_mask(c2f::AttnMask<Scalar>::causal()))));
  expect_causal<Scalar>([&](const Tensor3<Scalar>& in) { return causal.forward(in); }, x, 8, rng,
                        "MHA Options::causal");
  // Combined with a key padding mask, both rules hold.
  const c2f::Masks<Scalar> pad = c2f::Masks<Scalar>().key_padding_mask(c2f::KeyPaddingMask<Scalar>::lengths({30, 37}));
  expect_causal<Scalar>([&](const Tensor3<Scalar>& in) { return causal.forward(in, pad); }, x, 8, rng,
                        "MHA Options::causal with key padding");
}

TYPED_TEST(CausalTyped, Hmha) {
  using Scalar = TypeParam;
  TestRng rng(302);
  for (Index window : {1, 4, 5}) {
    for (bool causal : {true, false}) {
      typename c2f::HMHA<Scalar>::Options o;
      o.causal(causal);
      c2f::HMHA<Scalar> hmha(16, 4, window, o);
      randomize(hmha, rng);
      const Tensor3<Scalar> x = rng.tensor<Scalar>(2, 23, 16);
      const std::string what = "HMHA window " + std::to_string(window);
      const Forward<Scalar> f = [&](const Tensor3<Scalar>& in) { return hmha.forward(in); };
      if (causal) {
        expect_causal<Scalar>(f, x, window, rng, what + " causal");
      } else {
        expect_not_causal<Scalar>(f, x, window, rng, what + " non-causal");
      }
    }
  }
}

TYPED_TEST(CausalTyped, SparseC2FAttention) {
  using Scalar = TypeParam;
  TestRng rng(303);
  for (Index chunk : {1, 4, 5}) {
    for (Index top_k : {1, 2, 3}) {
      for (c2f::Gating gating : {c2f::Gating::Auto, c2f::Gating::PerChunk, c2f::Gating::PerToken}) {
        const bool causal = gating == c2f::Gating::Auto;  // causal: per-token gating
        typename c2f::SparseC2FAttention<Scalar>::Options o;
        o.gating(gating);
        c2f::SparseC2FAttention<Scalar> sparse(16, 2, chunk, top_k, o.causal(causal));
        randomize(sparse, rng, 0.6);
        const Tensor3<Scalar> x = rng.tensor<Scalar>(2, 33, 16);
        const std::string what = "SparseC2F chunk " + std::to_string(chunk) + " top_k " + std::to_string(top_k) +
                                 (sparse.gating() == c2f::Gating::PerToken ? " per token" : " per chunk");
        const Forward<Scalar> f = [&](const Tensor3<Scalar>& in) { return sparse.forward(in); };
        if (causal) {
          expect_causal<Scalar>(f, x, chunk, rng, what + " causal");
        } else if (chunk > 1 || top_k > 1) {  // chunk 1, top_k 1: every token attends to itself only
          expect_not_causal<Scalar>(f, x, chunk, rng, what + " non-causal");
        }
      }
    }
  }
}

}  // namespace
