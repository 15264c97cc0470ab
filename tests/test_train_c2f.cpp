// Training of the coarse-to-fine layers (docs/training.md): FineAttention (both fine paths), C2FAttention,
// C2FAttention2D (with its relative position bias table) and SparseC2FAttention (the selection constant).
//   - the new backward kernels against naive twins on random shapes with awkward sizes (1, block − 1,
//     block + 1, primes): the folded fine attention's, the chunk sums and the mean pooling's;
//   - every layer against PyTorch's autograd (tests/data/train_c2f, tests/reference/train_c2f.py): inputs'
//     and parameters' .grad after y.backward(dy), fp64 1e-10, fp32 atol 1e-5 / rtol 5e-6;
//   - the folded and the general fine path give equal gradients;
//   - central finite differences in double of every input and parameter element;
//   - fully masked rows: zero gradients, no NaN;
//   - the memory of forward_train + backward of C2FAttention grows linearly in L (malloc counting).
// The layer contract's training properties (names, shapes, thread bits, refused saved states) are in
// test_layer_contract.cpp.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "c2f/io/masks.hpp"
#include "support/attention_problems.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/layer_entries.hpp"
#include "support/random.hpp"
#include "support/train_checks.hpp"
#include "tools/malloc_counter.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using c2f::FinePath;
using c2f::Index;
using c2f::Masks;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::check_central;
using c2f_test::check_parameters;
using c2f_test::Comparison;
using c2f_test::LayerCalls;  // the entries of C2F_LAYER
using c2f_test::ScalarOf;
using c2f_test::TestRng;

namespace kernels = c2f::kernels;

template <class T>
class TrainC2FKernel : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TrainC2FKernel, Scalars);

/// A bias(c, h, j) of random values with about a fifth −inf, and some (block, head) pairs that see nothing.
template <class Scalar>
struct RandomBias {
  Index heads = 1, width = 1;
  std::vector<Scalar> values;
  RandomBias(TestRng& rng, Index blocks, Index heads_, Index width_) : heads(heads_), width(width_) {
    values.resize(static_cast<std::size_t>(blocks * heads * width));
    const Scalar inf = std::numeric_limits<Scalar>::infinity();
    for (Scalar& v : values) v = rng.coin(0.2) ? -inf : static_cast<Scalar>(rng.normal());
    for (Index c = 0; c < blocks; c += 3) {  // every third block: head 0 sees no token
      for (Index j = 0; j < width; ++j) values[static_cast<std::size_t>((c * heads) * width + j)] = -inf;
    }
  }
  Scalar operator()(Index c, Index h, Index j) const {
    return values[static_cast<std::size_t>((c * heads + h) * width + j)];
  }
};

/// The folded backward and its twin on one grid: dx, dqk; 1 and 3 threads bit for bit; with and without bias.
template <class Scalar, class Grid>
void check_folded_backward_twin(TestRng& rng, const Grid& grid, Index heads, Index d, Index widest,
                                const std::string& what) {
  const RowMatrix<Scalar> x = rng.matrix<Scalar>(grid.tokens(), d),
                          qk = rng.matrix<Scalar>(grid.blocks(), heads * d, 0.5),
                          dpooled = rng.matrix<Scalar>(grid.blocks(), heads * d);
  const RandomBias<Scalar> bias(rng, grid.blocks(), heads, widest);
  const auto none = [](Index, Index, Index) { return Scalar(0); };
  const double tol = c2f_test::tolerance<Scalar>() * std::sqrt(double(std::max<Index>(widest, d)));
  for (bool masked : {false, true}) {
    RowMatrix<Scalar> dx = RowMatrix<Scalar>::Constant(grid.tokens(), d, Scalar(7)), dqk(grid.blocks(), heads * d);
    RowMatrix<Scalar> dx3 = dx, dqk3(grid.blocks(), heads * d), dxn = dx, dqkn(grid.blocks(), heads * d);
    if (masked) {
      kernels::fine_attention_folded_backward<Scalar>(x, grid, qk, heads, dpooled, bias, dx, dqk,
                                                      kernels::with_threads(1));
      kernels::fine_attention_folded_backward<Scalar>(x, grid, qk, heads, dpooled, bias, dx3, dqk3,
                                                      kernels::with_threads(3));
      kernels::fine_attention_folded_backward_naive<Scalar>(x, grid, qk, heads, dpooled, bias, dxn, dqkn);
    } else {
      kernels::fine_attention_folded_backward<Scalar>(x, grid, qk, heads, dpooled, none, dx, dqk,
                                                      kernels::with_threads(1));
      kernels::fine_attention_folded_backward<Scalar>(x, grid, qk, heads, dpooled, none, dx3, dqk3,
                                                      kernels::with_threads(3));
      kernels::fine_attention_folded_backward_naive<Scalar>(x, grid, qk, heads, dpooled, none, dxn, dqkn);
    }
    const std::string where = what + (masked ? " masked" : "");
    c2f_test::expect_close(dx, dxn, tol, tol, where + " dx");
    c2f_test::expect_close(dqk, dqkn, tol, tol, where + " dqk");
    EXPECT_TRUE(c2f_test::bitwise_equal(dx, dx3) && c2f_test::bitwise_equal(dqk, dqk3)) << where << ": 1 and 3 threads";
    ASSERT_TRUE(dx.allFinite() && dqk.allFinite()) << where;
  }
}

// fine_attention_folded_backward against its twin on chunk grids (lengths and chunks of awkward sizes: 1,
// block ± 1, primes) and on 2-D block grids with partial edge blocks.
TYPED_TEST(TrainC2FKernel, FoldedBackwardEqualsTheNaiveTwin) {
  using Scalar = TypeParam;
  TestRng rng(61);
  for (int rep = 0; rep < 24; ++rep) {
    const Index chunk = rng.pick(std::vector<Index>{1, 2, 7, 8, 9, 31, 32, 33}), length = rng.pick(c2f_test::kAwkward);
    const Index heads = rng.pick(std::vector<Index>{1, 2, 3}), d = rng.pick(std::vector<Index>{1, 4, 5, 16});
    const kernels::ChunkGrid grid{1 + rep % 3, length, chunk};
    check_folded_backward_twin<Scalar>(rng, grid, heads, d, chunk,
                                       "chunks L=" + std::to_string(length) + " chunk=" + std::to_string(chunk));
  }
  for (int rep = 0; rep < 12; ++rep) {
    const kernels::BlockGrid2D grid{1 + rep % 2, rng.pick(std::vector<Index>{1, 5, 7, 13}),
                                    rng.pick(std::vector<Index>{1, 4, 9, 11}), rng.pick(std::vector<Index>{1, 2, 3, 4}),
                                    rng.pick(std::vector<Index>{1, 3, 4, 5})};
    check_folded_backward_twin<Scalar>(rng, grid, 2, 6, grid.block_h * grid.block_w,
                                       "2-D " + std::to_string(grid.height) + "x" + std::to_string(grid.width) +
                                           " blocks " + std::to_string(grid.block_h) + "x" +
                                           std::to_string(grid.block_w));
  }
}

// chunk_sum and chunk_mean_backward_add against loops over the tokens: every token adds itself to its block's
// sum; every token receives its block's gradient over the block's count (a partial block its own count).
TYPED_TEST(TrainC2FKernel, ChunkSumAndMeanBackwardEqualTheirLoops) {
  using Scalar = TypeParam;
  TestRng rng(62);
  for (int rep = 0; rep < 16; ++rep) {
    const kernels::ChunkGrid grid{1 + rep % 3, rng.pick(c2f_test::kAwkward),
                                  rng.pick(std::vector<Index>{1, 7, 8, 9, 13})};
    const Index d = rng.pick(std::vector<Index>{1, 3, 8});
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(grid.tokens(), d), g = rng.matrix<Scalar>(grid.blocks(), d);
    RowMatrix<Scalar> sum(grid.blocks(), d), sum_loop = RowMatrix<Scalar>::Zero(grid.blocks(), d);
    RowMatrix<Scalar> dx = rng.matrix<Scalar>(grid.tokens(), d), dx_loop = dx;
    kernels::chunk_sum<Scalar>(x, grid, sum, kernels::with_threads(2));
    kernels::chunk_mean_backward_add<Scalar>(g, grid, dx, kernels::with_threads(2));
    for (Index c = 0; c < grid.blocks(); ++c) {
      for (Index t = grid.row(c); t < grid.row(c) + grid.count(c); ++t) {
        sum_loop.row(c) += x.row(t);
        dx_loop.row(t) += g.row(c) / static_cast<Scalar>(grid.count(c));
      }
    }
    const double tol = c2f_test::tolerance<Scalar>() * std::sqrt(double(grid.chunk));
    c2f_test::expect_close(sum, sum_loop, tol, tol, "chunk_sum");
    c2f_test::expect_close(dx, dx_loop, tol, tol, "chunk_mean_backward_add");
  }
}

// relative_position_bias_backward against its twin: self-attention over grids of awkward sizes (1 × 1, a row,
// a column, primes) with tables larger than the grid, random tables, key padding on some; 1 and 3 threads
// bit for bit.
TYPED_TEST(TrainC2FKernel, RelativePositionBiasBackwardEqualsTheNaiveTwin) {
  using Scalar = TypeParam;
  TestRng rng(67);
  for (int rep = 0; rep < 20; ++rep) {
    const Index gh = rng.pick(std::vector<Index>{1, 2, 3, 5, 7}), gw = rng.pick(std::vector<Index>{1, 2, 4, 7, 13});
    const Index max_h = gh + rng.uniform_int(0, 2), max_w = gw + rng.uniform_int(0, 2), n = gh * gw;
    c2f_test::Problem<Scalar> p;
    p.batch = 1 + rep % 2;
    p.heads = 1 + rep % 3;
    p.lq = p.lk = n;
    p.dk = p.dv = rng.pick(std::vector<Index>{1, 3, 8});
    p.q = rng.matrix<Scalar>(p.batch * n, p.heads * p.dk);
    p.k = rng.matrix<Scalar>(p.batch * n, p.heads * p.dk);
    p.v = rng.matrix<Scalar>(p.batch * n, p.heads * p.dv);
    const RowMatrix<Scalar> table = rng.matrix<Scalar>((2 * max_h - 1) * (2 * max_w - 1), p.heads);
    const c2f::AttnMask<Scalar> bias = c2f::AttnMask<Scalar>::relative_position(table, gh, gw, max_h, max_w);
    const c2f::KeyPaddingMask<Scalar> pad = rep % 3 == 0
                                                ? c2f::KeyPaddingMask<Scalar>::lengths(std::vector<Index>(
                                                      static_cast<std::size_t>(p.batch), std::max<Index>(1, n / 2)))
                                                : c2f::KeyPaddingMask<Scalar>();
    const c2f::MaskView<Scalar> plan(bias, pad, p.batch, p.heads, n, n);
    RowMatrix<Scalar> out(p.batch * n, p.heads * p.dv), lse(p.batch * p.heads, n);
    kernels::sdpa_train<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(out), lse, plan, {}, p.scale(),
                                kernels::with_threads(2));
    const RowMatrix<Scalar> dout = rng.matrix<Scalar>(p.batch * n, p.heads * p.dv);
    const kernels::HeadsView<const Scalar> ov = p.view(out, n, p.dv), gv = p.view(dout, n, p.dv);
    RowMatrix<Scalar> fast(table.rows(), p.heads), fast3(table.rows(), p.heads), naive(table.rows(), p.heads);
    kernels::relative_position_bias_backward<Scalar>(p.qv(), p.kv(), p.vv(), ov, lse, gv, plan, gh, gw, max_h, max_w,
                                                     p.scale(), fast, kernels::with_threads(1));
    kernels::relative_position_bias_backward<Scalar>(p.qv(), p.kv(), p.vv(), ov, lse, gv, plan, gh, gw, max_h, max_w,
                                                     p.scale(), fast3, kernels::with_threads(3));
    kernels::relative_position_bias_backward_naive<Scalar>(p.qv(), p.kv(), p.vv(), gv, plan, gh, gw, max_h, max_w,
                                                           p.scale(), naive);
    const std::string what = std::to_string(gh) + "x" + std::to_string(gw) + " in " + std::to_string(max_h) + "x" +
                             std::to_string(max_w) + " heads " + std::to_string(p.heads);
    const double tol = c2f_test::tolerance<Scalar>() * std::sqrt(double(p.batch * n * n));
    c2f_test::expect_close(fast, naive, tol, tol, what);
    EXPECT_TRUE(c2f_test::bitwise_equal(fast, fast3)) << what << ": 1 and 3 threads";
  }
}

// sparse_attention_backward against its dense twin: both gatings (per token causal or not), selections made by
// the forward's own gating on random q and k, lengths and chunks of awkward sizes (1, chunk ± 1, primes),
// top_k 1 to 4, with and without masks (a random keep mask, key padding by lengths down to an empty item);
// 1 and 3 threads bit for bit; no NaN.
TYPED_TEST(TrainC2FKernel, SparseAttentionBackwardEqualsTheDenseTwin) {
  using Scalar = TypeParam;
  TestRng rng(68);
  for (int rep = 0; rep < 30; ++rep) {
    const Index chunk = rng.pick(std::vector<Index>{1, 3, 7, 8, 9}),
                length = rng.pick(std::vector<Index>{1, 2, 7, 8, 9, 13, 31, 37});
    const Index batch = 1 + rep % 2, heads = 1 + rep % 3, dh = rng.pick(std::vector<Index>{1, 4, 5}), cols = heads * dh;
    const Index top_k = 1 + rep % 4;
    const int gating = rep % 3;  // 0: per chunk, 1: per token causal, 2: per token
    const bool causal = gating == 1;
    const kernels::ChunkGrid grid{batch, length, chunk};
    const RowMatrix<Scalar> q = rng.matrix<Scalar>(batch * length, cols), k = rng.matrix<Scalar>(batch * length, cols),
                            v = rng.matrix<Scalar>(batch * length, cols),
                            dout = rng.matrix<Scalar>(batch * length, cols);
    const kernels::KernelOptions one = kernels::with_threads(1);
    kernels::ChunkSelection selection;
    if (gating == 0) {
      selection = kernels::select_chunks<Scalar>(q, k, grid, heads, top_k, one);
    } else {
      RowMatrix<Scalar> k_means(grid.chunks(), cols);
      kernels::chunk_mean<Scalar>(k, grid, k_means, one);
      selection = kernels::select_chunks_per_token<Scalar>(q, k_means, grid, heads, top_k, causal, one);
    }
    c2f::AttnMask<Scalar> attn;
    c2f::KeyPaddingMask<Scalar> pad;
    if (rep % 4 >= 2) {
      c2f::BoolTensor2 keep(length, length);
      for (Index i = 0; i < keep.size(); ++i) keep.data()[i] = rng.coin(0.7);
      attn = c2f::AttnMask<Scalar>::keep(keep);
      std::vector<Index> lengths{length};
      if (batch == 2) lengths.push_back(rep % 8 >= 6 ? 0 : length / 2);
      pad = c2f::KeyPaddingMask<Scalar>::lengths(lengths);
    }
    const c2f::MaskView<Scalar> plan(attn, pad, batch, heads, length, length);
    const Scalar scale = kernels::default_scale<Scalar>(dh);
    RowMatrix<Scalar> dq(q.rows(), cols), dk(q.rows(), cols), dv(q.rows(), cols), dq3 = dq, dk3 = dk, dv3 = dv,
                                                                                  dqn = dq, dkn = dk, dvn = dv;
    kernels::sparse_attention_backward<Scalar>(q, k, v, grid, heads, selection, dout, dq, dk, dv, causal, plan, scale,
                                               one);
    kernels::sparse_attention_backward<Scalar>(q, k, v, grid, heads, selection, dout, dq3, dk3, dv3, causal, plan,
                                               scale, kernels::with_threads(3));
    kernels::sparse_attention_backward_naive<Scalar>(q, k, v, grid, heads, selection, dout, dqn, dkn, dvn, causal, plan,
                                                     scale);
    const std::string what = "L=" + std::to_string(length) + " chunk=" + std::to_string(chunk) +
                             " top_k=" + std::to_string(top_k) + " gating " + std::to_string(gating) +
                             (rep % 4 >= 2 ? " masked" : "");
    const double tol = c2f_test::tolerance<Scalar>() * std::sqrt(double(length * dh));
    c2f_test::expect_close(dq, dqn, tol, tol, what + " dq");
    c2f_test::expect_close(dk, dkn, tol, tol, what + " dk");
    c2f_test::expect_close(dv, dvn, tol, tol, what + " dv");
    EXPECT_TRUE(c2f_test::bitwise_equal(dq, dq3) && c2f_test::bitwise_equal(dk, dk3) &&
                c2f_test::bitwise_equal(dv, dv3))
        << what << ": 1 and 3 threads";
    ASSERT_TRUE(dq.allFinite() && dk.allFinite() && dv.allFinite()) << what;
  }
}

// NaN and Inf in the keys and values of padded positions reach no gradient (every bit as with finite values
// there); a row that sees no key gets zero dq.
TYPED_TEST(TrainC2FKernel, SparseBackwardIgnoresNonFiniteHiddenKeys) {
  using Scalar = TypeParam;
  TestRng rng(69);
  const kernels::ChunkGrid grid{2, 29, 8};
  const Index heads = 2, cols = 8;
  const RowMatrix<Scalar> q = rng.matrix<Scalar>(58, cols), dout = rng.matrix<Scalar>(58, cols);
  RowMatrix<Scalar> k = rng.matrix<Scalar>(58, cols), v = rng.matrix<Scalar>(58, cols);
  const c2f::KeyPaddingMask<Scalar> pad = c2f::KeyPaddingMask<Scalar>::lengths({29, 12});
  const c2f::MaskView<Scalar> plan(c2f::AttnMask<Scalar>(), pad, 2, heads, 29, 29);
  for (bool per_token : {false, true}) {
    const kernels::ChunkSelection selection =
        per_token ? kernels::select_chunks_per_token<Scalar>(q, RowMatrix<Scalar>::Ones(grid.chunks(), cols), grid,
                                                             heads, 2, true, kernels::with_threads(1))
                  : kernels::select_chunks<Scalar>(q, k, grid, heads, 2, kernels::with_threads(1));
    const auto run = [&](const RowMatrix<Scalar>& kk, const RowMatrix<Scalar>& vv) {
      std::array<RowMatrix<Scalar>, 3> g{RowMatrix<Scalar>(58, cols), RowMatrix<Scalar>(58, cols),
                                         RowMatrix<Scalar>(58, cols)};
      kernels::sparse_attention_backward<Scalar>(q, kk, vv, grid, heads, selection, dout, g[0], g[1], g[2], per_token,
                                                 plan, kernels::default_scale<Scalar>(4), kernels::with_threads(2));
      return g;
    };
    const std::array<RowMatrix<Scalar>, 3> clean = run(k, v);
    RowMatrix<Scalar> kp = k, vp = v;
    kp.row(29 + 20).setConstant(std::numeric_limits<Scalar>::quiet_NaN());  // batch item 1, padded position 20
    vp.row(29 + 15).setConstant(std::numeric_limits<Scalar>::infinity());
    const std::array<RowMatrix<Scalar>, 3> got = run(kp, vp);
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(c2f_test::bitwise_equal(got[i], clean[i])) << "per_token " << per_token << " gradient " << i;
    if (per_token) {  // causal: token 0 of a batch item sees key 0 only; padded tokens of item 1 in chunk 2+ may see
                      // none
      EXPECT_TRUE(clean[0].allFinite());
    }
  }
}

// ------------------------------------------------------------------------------------------------
// FineAttention: both paths, finite differences

/// loss = Σ forward_train(x, chunk, context, masks).output · dy.
double fine_loss(const c2f::FineAttention<double>& layer, const Tensor3<double>& x, Index chunk,
                 const Tensor3<double>& context, const Masks<double>& masks, const Tensor3<double>& dy) {
  const Tensor3<double> y = layer.forward_train(x, chunk, context, masks).output;
  return (Eigen::Map<const Eigen::ArrayXd>(y.data(), y.size()) * Eigen::Map<const Eigen::ArrayXd>(dy.data(), dy.size()))
      .sum();
}

/// Every element of x, of the coarse context and of every parameter by central differences. Returns the
/// worst ratio |fd − g| / (1e-5 + 1e-3·|fd|).
double fine_finite_differences(const c2f::FineAttention<double>& layer, const Tensor3<double>& x, Index chunk,
                               const Tensor3<double>& context, const Masks<double>& masks, TestRng& rng) {
  const auto [y, saved] = layer.forward_train(x, chunk, context, masks);
  const Tensor3<double> dy = rng.tensor<double>(y.dimension(0), y.dimension(1), y.dimension(2));
  const c2f::Grads<double> g = layer.backward(saved, dy);
  EXPECT_EQ(g.context.dimensions(), context.dimensions());
  const auto flat = [](const Tensor3<double>& t) { return std::vector<double>(t.data(), t.data() + t.size()); };
  double worst = check_central(
      flat(x), flat(g.input),
      [&](std::size_t i, double value) {
        Tensor3<double> moved = x;
        moved.data()[i] = value;
        return fine_loss(layer, moved, chunk, context, masks, dy);
      },
      "dx");
  worst = std::max(worst, check_central(
                              flat(context), flat(g.context),
                              [&](std::size_t i, double value) {
                                Tensor3<double> moved = context;
                                moved.data()[i] = value;
                                return fine_loss(layer, x, chunk, moved, masks, dy);
                              },
                              "dcontext"));
  return std::max(worst, check_parameters(layer, g.params, [&](const c2f::FineAttention<double>& other) {
                    return fine_loss(other, x, chunk, context, masks, dy);
                  }));
}

// Both paths, without a mask, with a per-chunk key mask (rows equal: folded) and a per-token mask (general),
// L = 13 with chunk 4 (a partial last chunk) and L = 3 with chunk 5 (one chunk shorter than the chunk size).
TEST(FineAttentionTrain, GradientsEqualCentralDifferences) {
  using Fine = c2f::FineAttention<double>;
  TestRng rng(63);
  double worst = 0;
  for (const auto& [length, chunk] : std::vector<std::pair<Index, Index>>{{13, 4}, {3, 5}}) {
    const Index k = std::min(chunk, length), m = c2f::detail::ceil_div(length, k);
    const Tensor3<double> x = rng.tensor<double>(2, length, 8), context = rng.tensor<double>(2, m, 8);
    c2f::BoolTensor3 per_token(2 * m, chunk, chunk), per_key(2 * m, chunk, chunk);
    for (Index n = 0; n < 2 * m; ++n) {
      for (Index j = 0; j < chunk; ++j) {
        const bool key = j != 1;
        for (Index i = 0; i < chunk; ++i) {
          per_token(n, i, j) = (i + j + n) % 3 != 0 || j == 0;
          per_key(n, i, j) = key;
        }
      }
    }
    const std::vector<Masks<double>> sets{Masks<double>(),
                                          Masks<double>().attn_mask(c2f::AttnMask<double>::keep(per_key)),
                                          Masks<double>().attn_mask(c2f::AttnMask<double>::keep(per_token))};
    for (std::size_t s = 0; s < sets.size(); ++s) {
      for (FinePath path : {FinePath::Folded, FinePath::General}) {
        if (s == 2 && path == FinePath::Folded) continue;  // rows differ: the general path only
        Fine fine(8, 2, Fine::Options().fine_path(path).query_block(3).key_block(2).num_threads(2));
        c2f_test::randomize(fine, rng, 0.5);
        worst = std::max(worst, fine_finite_differences(fine, x, chunk, context, sets[s], rng));
      }
    }
  }
  std::cout << "[train] finite differences FineAttention: worst |fd - g| / (1e-5 + 1e-3 |fd|) = " << worst << "\n";
}

/// The gradients of one layer call, every tensor flattened in a fixed order (input, context, params).
template <class Scalar>
std::vector<Scalar> flat_grads(const c2f::Grads<Scalar>& g) {
  std::vector<Scalar> out(g.input.data(), g.input.data() + g.input.size());
  out.insert(out.end(), g.context.data(), g.context.data() + g.context.size());
  for (const auto& [key, t] : g.params) {
    const std::vector<Scalar> v = t.template to_vector<Scalar>();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// The folded and the general path give the same gradients (and outputs) without a mask and with a mask whose
// rows are equal in each chunk, on awkward lengths and chunks; B = 3.
TYPED_TEST(TrainC2FKernel, FineAttentionPathsGiveEqualGradients) {
  using Scalar = TypeParam;
  using Fine = c2f::FineAttention<Scalar>;
  TestRng rng(64);
  for (int rep = 0; rep < 10; ++rep) {
    const Index length = rng.pick(std::vector<Index>{1, 2, 7, 9, 13, 31, 33, 64}),
                chunk = rng.pick(std::vector<Index>{1, 3, 8, 16});
    const Index k = std::min(chunk, length), m = c2f::detail::ceil_div(length, k), d = 12,
                heads = rng.pick(std::vector<Index>{1, 2, 4});
    const Tensor3<Scalar> x = rng.tensor<Scalar>(3, length, d), context = rng.tensor<Scalar>(3, m, d);
    Masks<Scalar> masks;
    if (rep % 2 == 1) {  // a per-chunk key mask: every row of a chunk keeps the same keys, some chunks none
      c2f::BoolTensor3 keep(3 * m, chunk, chunk);
      for (Index n = 0; n < 3 * m; ++n) {
        for (Index j = 0; j < chunk; ++j) {
          const bool kept = n % 4 != 1 && (j + n) % 3 != 1;
          for (Index i = 0; i < chunk; ++i) keep(n, i, j) = kept;
        }
      }
      masks.attn_mask(c2f::AttnMask<Scalar>::keep(keep));
    }
    Fine folded(d, heads, typename Fine::Options().fine_path(FinePath::Folded).seed(rep));
    c2f_test::randomize(folded, rng);
    Fine general(d, heads, typename Fine::Options().fine_path(FinePath::General).query_block(5).key_block(3));
    general.load_state_dict(folded.state_dict());
    const Tensor3<Scalar> dy = rng.tensor<Scalar>(3, length, d);
    const auto [yf, sf] = folded.forward_train(x, chunk, context, masks);
    const auto [yg, sg] = general.forward_train(x, chunk, context, masks);
    const std::vector<Scalar> gf = flat_grads(folded.backward(sf, dy)), gg = flat_grads(general.backward(sg, dy));
    const std::string what =
        "L=" + std::to_string(length) + " chunk=" + std::to_string(chunk) + " heads=" + std::to_string(heads);
    const double tol = c2f_test::tolerance<Scalar>() * 10;
    c2f_test::expect_close(yf.data(), yg.data(), yf.size(), tol, tol, what + " output");
    ASSERT_EQ(gf.size(), gg.size());
    c2f_test::expect_close(gf.data(), gg.data(), static_cast<Index>(gf.size()), tol, tol, what + " gradients");
    for (Scalar v : gf) ASSERT_TRUE(std::isfinite(v)) << what;
  }
}

// ------------------------------------------------------------------------------------------------
// Against PyTorch's autograd (tests/data/train_c2f)

/// The fixture's keep mask `name` (True = keep), or none.
template <class Scalar>
c2f::AttnMask<Scalar> keep_mask(const StateDict& sd, const std::string& name) {
  return sd.contains(name) ? c2f::attn_mask_from_tensor<Scalar>(c2f::MaskKind::Keep, sd.at(name))
                           : c2f::AttnMask<Scalar>();
}

/// A [B, m, k, d] fixture tensor as the [B, m·k, d] tokens of chunks of k.
template <class Scalar>
Tensor3<Scalar> tokens_of(const StateDict& sd, const std::string& name) {
  const std::vector<std::int64_t>& s = sd.at(name).shape();
  Tensor3<Scalar> t(s[0], s[1] * s[2], s[3]);
  sd.at(name).copy_to(t.data());
  return t;
}

/// The fine paths a fixture's mask allows: Auto and General, and Folded when its rows are equal in every chunk.
std::vector<FinePath> fine_paths(bool rows_equal) {
  std::vector<FinePath> paths{FinePath::Auto, FinePath::General};
  if (rows_equal) paths.push_back(FinePath::Folded);
  return paths;
}

std::string path_name(FinePath path) {
  return path == FinePath::Auto ? "auto" : path == FinePath::Folded ? "folded" : "general";
}

// The article's FineAttention: x [B, m, k, d] as tokens in chunks of k, its coarse context, the mask
// [B, m, k, k]; output, grad.x, grad.coarse_context and every parameter's gradient, on every path the mask
// allows, 1 and 2 threads.
template <class Scalar>
void check_fine_case(const StateDict& sd, Comparison& cmp) {
  using Fine = c2f::FineAttention<Scalar>;
  const Tensor3<Scalar> x = tokens_of<Scalar>(sd, "x"), dy = tokens_of<Scalar>(sd, "grad_output");
  const Tensor3<Scalar> context = c2f_test::tensor3<Scalar>(sd, "coarse_context");
  const Masks<Scalar> masks = Masks<Scalar>().attn_mask(keep_mask<Scalar>(sd, "mask"));
  for (FinePath path : fine_paths(sd.metadata().at("mask_rows_equal") == "true")) {
    for (int threads : {1, 2}) {
      Fine fine(c2f_test::meta_index(sd, "d_model"), c2f_test::meta_index(sd, "n_heads"),
                typename Fine::Options().fine_path(path).num_threads(threads).query_block(3).key_block(4));
      fine.load_state_dict(sd, "fine.");
      const auto [y, saved] = fine.forward_train(x, c2f_test::meta_index(sd, "chunk_len"), context, masks);
      const c2f::Grads<Scalar> g = fine.backward(saved, dy);
      const std::string what = path_name(path) + " threads " + std::to_string(threads);
      cmp.check(y, sd, "output", what);
      cmp.check(g.input, sd, "grad.x", what);
      cmp.check(g.context, sd, "grad.coarse_context", what);
      cmp.template check_params<Scalar>(g.params, sd, "fine.", what);
    }
  }
}

// The article's C2FAttention (x [B, L, d], the coarse and the fine keep masks): output, grad.input and every
// parameter's gradient, on every fine path the mask allows, 1 and 2 threads, small attention blocks.
template <class Scalar>
void check_c2f_case(const StateDict& sd, Comparison& cmp) {
  using C2F = c2f::C2FAttention<Scalar>;
  const Masks<Scalar> masks = Masks<Scalar>()
                                  .attn_mask(keep_mask<Scalar>(sd, "coarse_mask"))
                                  .fine_attn_mask(keep_mask<Scalar>(sd, "fine_mask"));
  for (FinePath path : fine_paths(sd.metadata().at("fine_mask_rows_equal") == "true")) {
    C2F layer(c2f_test::meta_index(sd, "d_model"), c2f_test::meta_index(sd, "n_heads"),
              c2f_test::meta_index(sd, "chunk_size"),
              typename C2F::Options().fine_path(path).query_block(3).key_block(4));
    c2f_test::check_one_input_case<Scalar>(layer, sd, masks, "c2f.", cmp);
  }
}

// C2FAttention2D (x [B, H·W, d] on its grid, the relative position bias table a parameter): output, grad.input
// and every parameter's gradient, 1 and 2 threads, small attention blocks.
template <class Scalar>
void check_c2f2d_case(const StateDict& sd, Comparison& cmp) {
  using C2F2D = c2f::C2FAttention2D<Scalar>;
  const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x"), dy = c2f_test::tensor3<Scalar>(sd, "grad_output");
  for (int threads : {1, 2}) {
    C2F2D layer(c2f_test::meta_index(sd, "d_model"), c2f_test::meta_index(sd, "n_heads"),
                c2f_test::meta_index(sd, "block_h"), c2f_test::meta_index(sd, "block_w"),
                typename C2F2D::Options()
                    .max_blocks_h(c2f_test::meta_index(sd, "max_blocks_h"))
                    .max_blocks_w(c2f_test::meta_index(sd, "max_blocks_w"))
                    .relative_position_bias(sd.metadata().at("relative_position_bias") == "true")
                    .num_threads(threads)
                    .query_block(3)
                    .key_block(4));
    layer.load_state_dict(sd, "c2f2d.");
    const auto [y, saved] =
        layer.forward_train(x, c2f_test::meta_index(sd, "height"), c2f_test::meta_index(sd, "width"));
    const c2f::Grads<Scalar> g = layer.backward(saved, dy);
    const std::string what = "threads " + std::to_string(threads);
    cmp.check(y, sd, "output", what);
    cmp.check(g.input, sd, "grad.input", what);
    cmp.template check_params<Scalar>(g.params, sd, "c2f2d.", what);
  }
}

// SparseC2FAttention with nn.MultiheadAttention's weights: c2f's selection equals the fixture's (`selected`),
// then output, grad.input and every parameter's gradient (the selection constant), 1 and 2 threads.
template <class Scalar>
void check_sparse_case(const StateDict& sd, Comparison& cmp) {
  using Sparse = c2f::SparseC2FAttention<Scalar>;
  const bool per_token = sd.metadata().at("gating") == "token";
  Sparse layer(c2f_test::meta_index(sd, "embed_dim"), c2f_test::meta_index(sd, "num_heads"),
               c2f_test::meta_index(sd, "chunk_size"), c2f_test::meta_index(sd, "top_k"),
               typename Sparse::Options()
                   .gating(per_token ? c2f::Gating::PerToken : c2f::Gating::PerChunk)
                   .causal(sd.metadata().at("causal") == "true"));
  Masks<Scalar> masks;
  if (sd.contains("key_padding_mask")) {
    masks.key_padding_mask(c2f::key_padding_mask_from_tensor<Scalar>(c2f::MaskKind::Ignore, sd.at("key_padding_mask")));
  }
  layer.load_state_dict(sd, "mha.");
  // c2f caps top_k at the m chunks; the fixture pads its rows with −1 up to top_k.
  const std::vector<std::int64_t> want = c2f_test::int64_values(sd, "selected");
  const kernels::ChunkSelection got = layer.forward_with_selection(c2f_test::tensor3<Scalar>(sd, "x"), masks).selection;
  const std::size_t rows = static_cast<std::size_t>(got.batch * got.heads * got.queries),
                    k = static_cast<std::size_t>(got.top_k);
  const std::size_t wk = static_cast<std::size_t>(sd.at("selected").shape().back());
  ASSERT_EQ(rows * wk, want.size());
  for (std::size_t r = 0; r < rows; ++r) {
    for (std::size_t t = 0; t < wk; ++t) {
      ASSERT_EQ(t < k ? got.index[r * k + t] : Index(-1), want[r * wk + t]) << "selection row " << r << ", entry " << t;
    }
  }
  c2f_test::check_one_input_case<Scalar>(layer, sd, masks, "mha.", cmp);
}

template <class Scalar>
void check_train_c2f_case(const nlohmann::json& c) {
  const StateDict sd =
      c2f::load_safetensors(c2f_test::data_path(c.at("files").at(c2f_test::Tolerance<Scalar>::file_key)));
  const std::string module = sd.metadata().at("module");
  Comparison cmp;
  if (module == "fine") {
    check_fine_case<Scalar>(sd, cmp);
  } else if (module == "c2f") {
    check_c2f_case<Scalar>(sd, cmp);
  } else if (module == "c2f2d") {
    check_c2f2d_case<Scalar>(sd, cmp);
  } else if (module == "sparse") {
    check_sparse_case<Scalar>(sd, cmp);
  } else {
    FAIL() << "unknown module " << module;
  }
  std::cout << "[train] " << c.at("name").get<std::string>() << " " << c2f_test::Tolerance<Scalar>::file_key
            << ": max |c2f - torch| " << cmp.max_diff << "; at most " << cmp.max_share << " of the tolerance, at "
            << cmp.worst << "\n";
}

C2F_FIXTURE_TEST(TrainC2FFixture, MatchesPyTorch, "train_c2f", check_train_c2f_case);

// The cases the issue asks for are in the fixture set: per module, L = 1, B = 3, rows with no visible key.
TEST(TrainC2FFixtures, CoverTheRequiredShapes) {
  std::map<std::string, int> modules, fully_masked, batch3;
  for (const nlohmann::json& c : c2f_test::manifest_cases("train_c2f")) {
    const std::string m = c.at("module");
    ++modules[m];
    fully_masked[m] += c.value("fully_masked_rows", std::string()) == "true";
    batch3[m] += c.at("batch") == "3";
  }
  for (const char* m : {"fine", "c2f", "c2f2d", "sparse"}) {
    EXPECT_GE(modules[m], 5) << m;
    if (std::string(m) != "c2f2d") {  // C2FAttention2D takes no mask: every row sees its block
      EXPECT_GE(fully_masked[m], 1) << m;
    }
    EXPECT_GE(batch3[m], 1) << m;
  }
}

// ------------------------------------------------------------------------------------------------
// Finite differences of the layers that take x [B, L, d], in double

template <class E>
class FiniteDifferencesC2F : public ::testing::Test {};

// clang-format off
C2F_LAYER(C2FF64, c2f::C2FAttention<double>, c2f_test::kWidth, 2, 3, o.query_block(2).key_block(3));
C2F_LAYER(C2FGeneralF64, c2f::C2FAttention<double>, c2f_test::kWidth, 4, 4, o.fine_path(c2f::FinePath::General).query_block(3));
C2F_LAYER(C2FChunk1F64, c2f::C2FAttention<double>, c2f_test::kWidth, 1, 1, o);
C2F_LAYER(C2F2DF64, c2f::C2FAttention2D<double>, c2f_test::kWidth, 2, 2, 3, o.max_blocks_h(3).max_blocks_w(2).query_block(2));
C2F_LAYER(C2F2DNoBiasF64, c2f::C2FAttention2D<double>, c2f_test::kWidth, 4, 2, 2, o.relative_position_bias(false));
C2F_LAYER(SparseF64, c2f::SparseC2FAttention<double>, c2f_test::kWidth, 2, 3, 2, o);
C2F_LAYER(CausalSparseF64, c2f::SparseC2FAttention<double>, c2f_test::kWidth, 2, 2, 2, o.causal(true));
C2F_LAYER(TokenSparseNoBiasF64, c2f::SparseC2FAttention<double>, c2f_test::kWidth, 4, 3, 3, o.gating(c2f::Gating::PerToken).bias(false));
// clang-format on
using C2FEntries = ::testing::Types<C2FF64, C2FGeneralF64, C2FChunk1F64, C2F2DF64, C2F2DNoBiasF64, SparseF64,
                                    CausalSparseF64, TokenSparseNoBiasF64>;
TYPED_TEST_SUITE(FiniteDifferencesC2F, C2FEntries, c2f_test::EntryNames);

// B = 2, L = 7: chunks of 3 (the last holds one token), of 4 (the last three), of 1; without masks and with
// causal coarse and fine masks (the fine one sends the auto path to the general one). C2FAttention2D on a
// 3 × 4 grid (L = 12) in blocks of 2 × 3 (partial in both directions; a table of 3 × 2 blocks, larger than
// the 2 × 2 grid of blocks) and 2 × 2. SparseC2FAttention at L = 7: per-chunk gating in chunks of 3 with top_k
// 2, per-token causal in chunks of 2, per-token without bias in chunks of 3 with top_k 3; with causal attention
// masks and key padding (the selection, a constant of the backward, stays the same under the differences).
TYPED_TEST(FiniteDifferencesC2F, GradientsEqualCentralDifferences) {
  TestRng rng(65);
  c2f_test::entry_finite_differences<TypeParam>(
      rng, std::is_same<typename TypeParam::Layer, c2f::C2FAttention2D<double>>::value ? 12 : 7);
}

// ------------------------------------------------------------------------------------------------
// Memory

// forward_train + backward of C2FAttention (d = 64, 4 heads, chunk 32, B = 1, float, 2 threads) at length L
// from an empty scratch cache: the heap held at once at the peak and the largest block.
struct Measured {
  long long peak, largest;
};
Measured measure_c2f_training(Index length) {
  c2f::C2FAttention<float> layer(64, 4, 32, c2f::C2FAttention<float>::Options().num_threads(2));
  TestRng rng(66);
  const Tensor3<float> x = rng.tensor<float>(1, length, 64), dy = rng.tensor<float>(1, length, 64);
  c2f::release_scratch_cache();
  c2f_memory::reset();
  {
    const auto [y, saved] = layer.forward_train(x);
    const c2f::Grads<float> g = layer.backward(saved, dy);
    EXPECT_EQ(g.input.dimension(1), length);
  }
  c2f_memory::stop();
  return {c2f_memory::peak_bytes(), c2f_memory::largest_allocation()};
}

// No term in L²: from L = 2048 to 8192 the peak grows about 4× (16× would be quadratic), and the largest block
// is one [L, d] activation. Prints the bytes per token.
TEST(TrainC2FMemory, PeakIsLinearInLength) {
  if (!c2f_memory::available()) GTEST_SKIP() << "malloc counting is unavailable under sanitizers";
  const Index short_length = 2048, long_length = 4 * short_length;
  const Measured small = measure_c2f_training(short_length), large = measure_c2f_training(long_length);
  const double ratio = double(large.peak) / double(small.peak);
  std::cout << "[memory] C2FAttention forward_train + backward, d=64 H=4 chunk=32 B=1 float: L=" << short_length << " "
            << small.peak / short_length << " bytes/token, L=" << long_length << " " << large.peak / long_length
            << " bytes/token (peak " << large.peak << " bytes, largest block " << large.largest << ")\n";
  EXPECT_GT(ratio, 3.0);
  EXPECT_LT(ratio, 4.5) << "the peak grew " << ratio << "x for 4x the length";
  EXPECT_LE(large.largest, long_length * 64 * static_cast<long long>(sizeof(float)) + 64)
      << "a block larger than [L, d]";
}

}  // namespace
