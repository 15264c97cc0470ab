// Two-dimensional coarse-to-fine attention (the coarse-to-fine article's ViT extension): PyTorch fixtures, the
// block-grid kernels against their naive twins, the relative position bias mask, H = 1 equivalence with the 1-D layer,
// metamorphic cases, errors, initialisation, threads and working memory.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/bf16.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/random.hpp"
#include "support/settings.hpp"
#include "tools/malloc_counter.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using c2f::C2FAttention;
using c2f::C2FAttention2D;
using c2f::Index;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f::kernels::BlockGrid2D;
using c2f_test::error_of;
using c2f_test::expect_close;
using c2f_test::meta_index;
using c2f_test::randomize;
using c2f_test::same_bits;
using c2f_test::TestRng;
using c2f_test::Tolerance;

using Scalars = ::testing::Types<float, double>;

template <class Scalar>
double loose_tol() {
  return std::is_same<Scalar, float>::value ? 2e-5 : 1e-11;
}

template <class Scalar>
typename C2FAttention2D<Scalar>::Options options_of(bool bias, Index gh, Index gw, int threads,
                                                    std::uint64_t seed = 0) {
  typename C2FAttention2D<Scalar>::Options o;
  o.relative_position_bias(bias);
  o.max_blocks_h(gh);
  o.max_blocks_w(gw);
  o.num_threads(threads);
  o.seed(seed);
  return o;
}

// ------------------------------------------------------------------------------------------------
// PyTorch fixtures (tests/reference/c2f2d_reference.py: the coarse-to-fine article's modules on 2-D blocks + Swin's
// bias)

template <class Scalar>
void check_fixture(const nlohmann::json& c) {
  const std::string name = c.at("name");
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path(c.at("files").at(Tolerance<Scalar>::file_key)));
  ASSERT_EQ(sd.metadata().at("module"), "c2f2d");
  const Index H = meta_index(sd, "height"), W = meta_index(sd, "width");
  const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x");
  for (int threads : {1, 2}) {
    const std::string what = name + " (" + Tolerance<Scalar>::file_key + ", " + std::to_string(threads) + " threads)";
    C2FAttention2D<Scalar> m(
        meta_index(sd, "embed_dim"), meta_index(sd, "num_heads"), meta_index(sd, "block_h"), meta_index(sd, "block_w"),
        options_of<Scalar>(sd.metadata().at("relative_position_bias") == "true", meta_index(sd, "max_blocks_h"),
                           meta_index(sd, "max_blocks_w"), threads));
    m.load_state_dict(sd, "c2f2d.");
    const auto close = [&](const Tensor3<Scalar>& got, const std::string& tensor) {
      const std::vector<Scalar> want = c2f_test::values<Scalar>(sd, tensor);
      ASSERT_EQ(static_cast<std::size_t>(got.size()), want.size()) << what << " " << tensor;
      expect_close(got.data(), want.data(), got.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                   what + " " + tensor);
    };
    const Tensor3<Scalar> summaries = m.coarse_input(x, H, W);
    close(summaries, "coarse_input");
    close(m.coarse_attn().forward(summaries, c2f::Masks<Scalar>().attn_mask(m.coarse_mask(meta_index(sd, "blocks_h"),
                                                                                          meta_index(sd, "blocks_w")))),
          "coarse_output");
    const Tensor3<Scalar> y = m.forward(x, H, W);
    ASSERT_EQ(y.dimensions(), x.dimensions()) << what;
    close(y, "output");
    RowMatrix<Scalar> into(x.dimension(0) * x.dimension(1), x.dimension(2));
    m.forward_into(x, H, W, into);
    EXPECT_TRUE(c2f_test::same_bits(into.data(), y.data(), y.size())) << what;
  }
}

template <class T>
class C2F2DFixtureTest : public ::testing::Test {};
TYPED_TEST_SUITE(C2F2DFixtureTest, Scalars);

TYPED_TEST(C2F2DFixtureTest, MatchesPyTorchReference) {
  int layers = 0;
  for (const nlohmann::json& c : c2f_test::manifest_cases("c2f2d")) {
    if (c.at("module") != "c2f2d") continue;  // the pyramid case is checked by examples/vit_pyramid (ctest)
    SCOPED_TRACE(c.at("name").get<std::string>() + ": " + c.at("description").get<std::string>());
    check_fixture<TypeParam>(c);
    ++layers;
  }
  EXPECT_GE(layers, 10);
}

// The grids the 2-D layer is tested on (CONTRIBUTING.md, "Testing": 1 × 1, 1 × 37, 7 × 5, 16 × 16, 9 × 13)
// are in the fixture set, each with and without the bias, batch 2.
TEST(C2F2DFixtureCoverage, CoversTheRequiredGrids) {
  struct Want {
    Index H, W, bh, bw;
    bool with_bias = false, without_bias = false;
  };
  std::vector<Want> want = {{1, 1, 0, 0}, {1, 37, 1, 8}, {7, 5, 2, 3}, {16, 16, 4, 4}, {9, 13, 4, 4}};
  bool pyramid = false;
  for (const nlohmann::json& c : c2f_test::manifest_cases("c2f2d")) {
    if (c.at("module") == "pyramid") {
      pyramid = true;
      continue;
    }
    EXPECT_EQ(c.at("batch"), "2");
    const auto num = [&](const char* key) { return static_cast<Index>(std::stol(c.at(key).get<std::string>())); };
    for (Want& w : want) {
      if (num("height") == w.H && num("width") == w.W &&
          (w.bh == 0 || (num("block_h") == w.bh && num("block_w") == w.bw))) {
        (c.at("relative_position_bias") == "true" ? w.with_bias : w.without_bias) = true;
      }
    }
  }
  for (const Want& w : want) EXPECT_TRUE(w.with_bias && w.without_bias) << w.H << " x " << w.W;
  EXPECT_TRUE(pyramid);
}

// ------------------------------------------------------------------------------------------------
// Block grid and kernels against their naive twins

TEST(BlockGrid2D, RunsCoverEveryTokenOnceInRowMajorBlockOrder) {
  TestRng rng(140);
  for (int rep = 0; rep < 50; ++rep) {
    const BlockGrid2D g{rng.uniform_int(1, 3), rng.uniform_int(0, 23), rng.uniform_int(0, 23), rng.uniform_int(1, 9),
                        rng.uniform_int(1, 9)};
    std::vector<int> seen(static_cast<std::size_t>(g.batch * g.height * g.width), 0);
    for (Index c = 0; c < g.blocks(); ++c) {
      Index tokens = 0;
      for (Index s = 0; s < g.segments(c); ++s) {
        for (Index k = 0; k < g.segment_length(c, s); ++k) {
          const Index row = g.segment_row(c, s) + k;
          const Index b = row / (g.height * g.width), y = (row / g.width) % g.height, x = row % g.width;
          ASSERT_EQ(c2f::kernels::token_block(g, b, y, x), c);
          ++seen[static_cast<std::size_t>(row)];
          ++tokens;
        }
      }
      EXPECT_EQ(tokens, g.count(c));
    }
    for (int s : seen) ASSERT_EQ(s, 1);
  }
}

template <class T>
class BlockKernelTest : public ::testing::Test {};
TYPED_TEST_SUITE(BlockKernelTest, Scalars);

TYPED_TEST(BlockKernelTest, MeanBroadcastAndFoldedAttentionMatchTheNaiveTwins) {
  using Scalar = TypeParam;
  TestRng rng(141);
  constexpr Scalar kMasked = -std::numeric_limits<Scalar>::infinity();
  for (int rep = 0; rep < 40; ++rep) {
    const Index bh = rng.uniform_int(1, 6), bw = rng.uniform_int(1, 6);
    // Sides 1, block − 1, block, block + 1, primes and random ones.
    const auto side = [&](Index b) {
      return std::max<Index>(1, rng.pick(std::vector<Index>{1, b - 1, b, b + 1, 7, 13, rng.uniform_int(2, 20)}));
    };
    const BlockGrid2D g{rng.uniform_int(1, 2), side(bh), side(bw), bh, bw};
    const Index heads = rng.uniform_int(1, 3), d = rng.uniform_int(1, 9);
    std::ostringstream what;
    what << "rep " << rep << ": batch " << g.batch << ", " << g.height << " x " << g.width << " in " << bh << " x "
         << bw << ", heads " << heads << ", d " << d;
    SCOPED_TRACE(what.str());
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(g.batch * g.height * g.width, d);
    const RowMatrix<Scalar> qk = rng.matrix<Scalar>(g.blocks(), heads * d);
    // Biases: random values, single masked keys, whole masked image rows of a block (a run), whole
    // masked blocks of a head.
    const Index max_count = bh * bw;
    std::vector<Scalar> bias(static_cast<std::size_t>(g.blocks() * heads * max_count));
    for (Index c = 0; c < g.blocks(); ++c) {
      for (Index h = 0; h < heads; ++h) {
        const bool block_masked = rng.coin(0.1);
        const Index masked_run = rng.coin(0.3) ? rng.uniform_int(0, g.rows(c) - 1) : -1;
        for (Index j = 0; j < g.count(c); ++j) {
          const bool masked = block_masked || j / g.cols(c) == masked_run || rng.coin(0.1);
          bias[static_cast<std::size_t>((c * heads + h) * max_count + j)] = masked ? kMasked : Scalar(rng.normal());
        }
      }
    }
    const auto bias_fn = [&](Index c, Index h, Index j) {
      return bias[static_cast<std::size_t>((c * heads + h) * max_count + j)];
    };

    RowMatrix<Scalar> mean_fast(g.blocks(), d), mean_naive(g.blocks(), d);
    c2f::kernels::chunk_mean<Scalar>(x, g, mean_fast, c2f::kernels::with_threads(2));
    c2f::kernels::block_mean_naive<Scalar>(x, g, mean_naive);
    expect_close(mean_fast.data(), mean_naive.data(), mean_fast.size(), loose_tol<Scalar>(), loose_tol<Scalar>(),
                 "mean");

    RowMatrix<Scalar> y = RowMatrix<Scalar>::Constant(x.rows(), d, Scalar(7));
    c2f::kernels::broadcast_chunks<Scalar>(mean_fast, g, y, c2f::kernels::with_threads(2));
    for (Index b = 0; b < g.batch; ++b) {
      for (Index yy = 0; yy < g.height; ++yy) {
        for (Index xx = 0; xx < g.width; ++xx) {
          ASSERT_TRUE(y.row(c2f::kernels::token_row(g, b, yy, xx)) ==
                      mean_fast.row(c2f::kernels::token_block(g, b, yy, xx)));
        }
      }
    }

    RowMatrix<Scalar> pooled[2], mass[2], pooled_naive(g.blocks(), heads * d), mass_naive(g.blocks(), heads);
    for (int threads : {1, 2}) {
      pooled[threads - 1].resize(g.blocks(), heads * d);
      mass[threads - 1].resize(g.blocks(), heads);
      c2f::kernels::fine_attention_folded<Scalar>(x, g, qk, heads, pooled[threads - 1], mass[threads - 1], bias_fn,
                                                  c2f::kernels::with_threads(threads));
    }
    c2f::kernels::fine_attention_folded_naive<Scalar>(x, g, qk, heads, pooled_naive, mass_naive, bias_fn);
    EXPECT_TRUE(pooled[0] == pooled[1] && mass[0] == mass[1]) << "bits differ between 1 and 2 threads";
    EXPECT_TRUE(mass[0] == mass_naive);
    expect_close(pooled[0].data(), pooled_naive.data(), pooled_naive.size(), loose_tol<Scalar>(), loose_tol<Scalar>(),
                 "pooled");
  }
}

// The folded kernel in Compute::BFloat16 (docs/bf16.md) rounds qk, each run of tokens (once, into a copy)
// and the probabilities, and sums in fp32. Its twin is the naive kernel on the rounded qk and x: they
// differ by the rounding of the probabilities only, at most 2^-8 · max|x| per value (Σ p = 1). A head
// that sees one key of its block has p = 1 exactly: its pooled row is that token rounded, bit for bit
// (which fails when a run is not rounded or is read from the wrong rows). Blocks of one run and of several.
TEST(FoldedBf16, MatchesTheNaiveTwinOnRoundedOperands) {
  TestRng rng(157);
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  const auto rounded = [](const RowMatrix<float>& m) {
    return RowMatrix<float>(m.unaryExpr(c2f::cpu::RoundBf16<float>()));
  };
  for (int rep = 0; rep < 30; ++rep) {
    const Index bh = rng.uniform_int(1, 5), bw = rng.pick(std::vector<Index>{1, 15, 16, 17, 31, 32, 33});
    const BlockGrid2D g{rng.uniform_int(1, 2), rng.uniform_int(1, 2 * bh + 1), rng.uniform_int(1, 2 * bw + 1), bh, bw};
    const Index heads = rng.uniform_int(1, 5), d = rng.pick(std::vector<Index>{1, 15, 16, 17, 64, 67});
    std::ostringstream what;
    what << "rep " << rep << ": " << g.height << " x " << g.width << " in " << bh << " x " << bw << ", heads " << heads
         << ", d " << d;
    SCOPED_TRACE(what.str());
    const RowMatrix<float> x = rng.matrix<float>(g.batch * g.height * g.width, d);
    const RowMatrix<float> qk = rng.matrix<float>(g.blocks(), heads * d);
    // Head 0 of every block sees only its block's last token; the other heads see every token.
    const auto bias = [&](Index c, Index h, Index j) { return h == 0 && j != g.count(c) - 1 ? kMasked : 0.0f; };
    RowMatrix<float> pooled[2], mass[2], pooled_naive(g.blocks(), heads * d), mass_naive(g.blocks(), heads);
    for (int threads : {1, 2}) {
      pooled[threads - 1].resize(g.blocks(), heads * d);
      mass[threads - 1].resize(g.blocks(), heads);
      c2f::kernels::fine_attention_folded<float>(x, g, qk, heads, pooled[threads - 1], mass[threads - 1], bias,
                                                 c2f::kernels::with_threads(threads).compute(c2f::Compute::BFloat16));
    }
    const RowMatrix<float> xr = rounded(x);
    c2f::kernels::fine_attention_folded_naive<float>(xr, g, rounded(qk), heads, pooled_naive, mass_naive, bias);
    EXPECT_TRUE(pooled[0] == pooled[1] && mass[0] == mass[1]) << "bits differ between 1 and 2 threads";
    EXPECT_TRUE(mass[0] == mass_naive);
    const float tol = std::ldexp(xr.cwiseAbs().maxCoeff(), -8) + 1e-5f;
    EXPECT_LE((pooled[0] - pooled_naive).cwiseAbs().maxCoeff(), tol);
    for (Index b = 0; b < g.batch; ++b) {
      for (Index yy = 0; yy < g.height; ++yy) {
        for (Index xx = 0; xx < g.width; ++xx) {
          const Index c = c2f::kernels::token_block(g, b, yy, xx);
          const bool last =
              (yy == std::min(g.height, (yy / bh + 1) * bh) - 1) && (xx == std::min(g.width, (xx / bw + 1) * bw) - 1);
          if (last) {
            ASSERT_TRUE(pooled[0].row(c).head(d) == xr.row(c2f::kernels::token_row(g, b, yy, xx))) << "block " << c;
          }
        }
      }
    }
  }
}

// Large outputs are broadcast with streaming stores (cpu/stream_store.hpp): the same bits as an
// ordinary copy, with unaligned rows (a one-element offset, a prime width, a padded row stride), and
// nothing written outside the rows and columns of y.
TYPED_TEST(BlockKernelTest, LargeBroadcastWritesTheSameBitsWithStreamingStores) {
  using Scalar = TypeParam;
  TestRng rng(157);
  for (Index offset = 0; offset < 9; ++offset) {  // every alignment of dst within a 32-byte vector, and more
    for (Index n = 0; n < 41; ++n) {
      const RowMatrix<Scalar> src = rng.matrix<Scalar>(1, n);
      std::vector<Scalar> dst(static_cast<std::size_t>(offset + n + 1), Scalar(7));
      c2f::cpu::copy_streaming(src.data(), dst.data() + offset, n);
      c2f::cpu::stream_fence();
      for (Index k = 0; k < offset + n + 1; ++k) {
        const Scalar want = k >= offset && k < offset + n ? src(0, k - offset) : Scalar(7);
        ASSERT_TRUE(same_bits(&dst[static_cast<std::size_t>(k)], &want, 1))
            << "offset " << offset << ", n " << n << ", k " << k;
      }
    }
  }
  const BlockGrid2D g{1, 179, 181, 25, 27};  // partial blocks on both edges
  const Index d = 131, ld = d + 2, tokens = g.batch * g.height * g.width;
  ASSERT_GE(static_cast<std::size_t>(tokens * d) * sizeof(Scalar), c2f::cpu::kStreamStoreMinBytes)
      << "the output must be large enough for the streaming path";
  const RowMatrix<Scalar> rows = rng.matrix<Scalar>(g.blocks(), d);
  std::vector<Scalar> buffer(static_cast<std::size_t>(tokens * ld + 1), Scalar(-3));
  Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> y(buffer.data() + 1, tokens, d, Eigen::OuterStride<>(ld));
  for (const bool fresh : {false, true}) {  // streaming stores, then ordinary ones (KernelOptions::fresh_output)
    std::fill(buffer.begin(), buffer.end(), Scalar(-3));
    c2f::kernels::broadcast_chunks<Scalar>(rows, g, y, c2f::kernels::with_threads(2).fresh_output(fresh));
    ASSERT_EQ(buffer[0], Scalar(-3));
    for (Index yy = 0; yy < g.height; ++yy) {
      for (Index xx = 0; xx < g.width; ++xx) {
        const Index t = c2f::kernels::token_row(g, 0, yy, xx);
        ASSERT_TRUE(y.row(t) == rows.row(c2f::kernels::token_block(g, 0, yy, xx)))
            << "token " << t << ", fresh " << fresh;
        ASSERT_EQ(buffer[static_cast<std::size_t>(1 + t * ld + d)], Scalar(-3)) << "padding after token " << t;
        ASSERT_EQ(buffer[static_cast<std::size_t>(1 + t * ld + d + 1)], Scalar(-3)) << "padding after token " << t;
      }
    }
  }
}

// broadcast_chunks writes a 2-D grid's output band by band (a block row), image row by image row: in
// address order, which lets C2FAttention2D::forward's fresh output be zeroed by the system and overwritten
// while in cache (KernelOptions::fresh_output). The grid below records the runs in the order the kernel
// asks for them, on one thread and on a range of blocks that starts and ends inside block rows; the
// block-by-block order (every run of a block, then the next block) fails here.
TEST(BlockKernels, BroadcastWritesA2DGridInAddressOrder) {
  struct Recording {
    const BlockGrid2D& g;
    std::vector<Index>* runs;
    Index blocks() const { return g.blocks(); }
    Index tokens() const { return g.tokens(); }
    void check(const char* kernel) const { g.check(kernel); }
    Index count(Index c) const { return g.count(c); }
    Index segments(Index c) const { return g.segments(c); }
    Index segment_row(Index c, Index s) const {
      runs->push_back(g.segment_row(c, s));
      return g.segment_row(c, s);
    }
    Index segment_length(Index c, Index s) const { return g.segment_length(c, s); }
    Index band_end(Index c) const { return g.band_end(c); }
  };
  TestRng rng(158);
  const Index d = 3;
  for (const BlockGrid2D g : {BlockGrid2D{2, 13, 17, 4, 5}, BlockGrid2D{1, 9, 30, 2, 7}, BlockGrid2D{1, 5, 4, 2, 2}}) {
    std::vector<Index> runs;
    const Recording recording{g, &runs};
    const RowMatrix<float> rows = rng.matrix<float>(g.blocks(), d);
    RowMatrix<float> y = RowMatrix<float>::Zero(g.tokens(), d);
    c2f::kernels::broadcast_chunks<float>(rows, recording, y, c2f::kernels::with_threads(1));
    EXPECT_EQ(static_cast<Index>(runs.size()), g.batch * g.height * g.blocks_w());
    EXPECT_TRUE(std::is_sorted(runs.begin(), runs.end()) && std::adjacent_find(runs.begin(), runs.end()) == runs.end())
        << g.height << " x " << g.width << " in blocks of " << g.block_h << " x " << g.block_w;
    // Blocks [3, blocks − 2) of the grid: from inside the first block row to inside the last.
    const c2f::kernels::BlockRange<Recording> range{recording, 3, g.blocks() - 5};
    runs.clear();
    c2f::kernels::broadcast_chunks<float>(rows.middleRows(3, range.n), range, y, c2f::kernels::with_threads(1));
    EXPECT_TRUE(std::is_sorted(runs.begin(), runs.end()) && std::adjacent_find(runs.begin(), runs.end()) == runs.end())
        << "blocks 3 … " << g.blocks() - 3 << " of " << g.height << " x " << g.width;
  }
}

// ------------------------------------------------------------------------------------------------
// The relative position bias as a mask

template <class Scalar>
Scalar swin_bias(const RowMatrix<Scalar>& table, Index gw_grid, Index gh_max, Index gw_max, Index h, Index i, Index j) {
  const Index ri = i / gw_grid, ci = i % gw_grid, rj = j / gw_grid, cj = j % gw_grid;
  return table((ri - rj + gh_max - 1) * (2 * gw_max - 1) + (ci - cj + gw_max - 1), h);
}

TEST(RelativePositionMask, PlanAddsSwinsTableEntryPerHead) {
  TestRng rng(142);
  const Index gh = 5, gw = 6, mh = 3, mw = 4, heads = 3, L = mh * mw;
  const RowMatrix<double> table = rng.matrix<double>((2 * gh - 1) * (2 * gw - 1), heads);
  const c2f::AttnMask<double> mask = c2f::AttnMask<double>::relative_position(table, mh, mw, gh, gw);
  const c2f::MaskView<double> plan(mask, {}, 2, heads, L, L);
  for (Index h = 0; h < heads; ++h) {
    for (Index i = 0; i < L; ++i) {
      for (Index j = 0; j < L; ++j) {
        ASSERT_EQ(plan.bias(1, h, i, j), swin_bias(table, mw, gh, gw, h, i, j)) << h << " " << i << " " << j;
      }
    }
  }
  // apply() on blocks that start and end mid grid-row equals bias() element by element.
  for (int rep = 0; rep < 30; ++rep) {
    const Index i0 = rng.uniform_int(0, L - 1), j0 = rng.uniform_int(0, L - 1);
    const Index ni = rng.uniform_int(1, L - i0), nj = rng.uniform_int(1, L - j0), h = rng.uniform_int(0, heads - 1);
    RowMatrix<double> S = rng.matrix<double>(ni, nj), want = S;
    for (Index r = 0; r < ni; ++r) {
      for (Index c = 0; c < nj; ++c) want(r, c) += plan.bias(0, h, i0 + r, j0 + c);
    }
    plan.apply(0, h, i0, j0, S);
    ASSERT_TRUE(S == want) << "block " << i0 << "+" << ni << " x " << j0 << "+" << nj;
  }
}

// MultiHeadAttention with the compact mask equals MultiHeadAttention with the same bias written out
// as an additive [heads, L, L] mask, on the streaming kernel (small blocks: apply() across grid rows)
// and the naive one (bias()).
TEST(RelativePositionMask, EqualsTheMaterialisedAdditiveMask) {
  TestRng rng(143);
  const Index gh = 4, gw = 5, mh = 3, mw = 5, heads = 2, L = mh * mw, d = 8;
  const RowMatrix<double> table = rng.matrix<double>((2 * gh - 1) * (2 * gw - 1), heads);
  Tensor3<double> dense(heads, L, L);
  for (Index h = 0; h < heads; ++h) {
    for (Index i = 0; i < L; ++i) {
      for (Index j = 0; j < L; ++j) dense(h, i, j) = swin_bias(table, mw, gh, gw, h, i, j);
    }
  }
  c2f::MultiHeadAttention<double>::Options o;
  o.query_block(4);
  o.key_block(7);
  c2f::MultiHeadAttention<double> mha(d, heads, o);
  randomize(mha, rng);
  const Tensor3<double> x = rng.tensor<double>(1, L, d);
  const Tensor3<double> want = mha.forward(x, c2f::Masks<double>().attn_mask(c2f::AttnMask<double>::additive(dense)));
  for (c2f::AttnKernel kernel : {c2f::AttnKernel::Streaming, c2f::AttnKernel::Naive}) {
    mha.set_kernel(kernel);
    const Tensor3<double> got =
        mha.forward(x, c2f::Masks<double>().attn_mask(c2f::AttnMask<double>::relative_position(table, mh, mw, gh, gw)));
    expect_close(got.data(), want.data(), got.size(), 1e-13, 1e-13,
                 "kernel " + std::to_string(static_cast<int>(kernel)));
  }
}

TEST(RelativePositionMask, WrongSizesNameExpectedAndGiven) {
  const RowMatrix<float> table = RowMatrix<float>::Zero(3 * 5, 2);  // max 2 x 3
  EXPECT_NE(error_of([&] {
              c2f::AttnMask<float>::relative_position(table, 3, 3, 2, 3);
            }).find("got grid 3 x 3 for max 2 x 3"),
            std::string::npos);
  const std::string wrong_table = error_of([&] { c2f::AttnMask<float>::relative_position(table, 2, 2, 3, 3); });
  EXPECT_NE(wrong_table.find("[25, heads]"), std::string::npos) << wrong_table;
  EXPECT_NE(wrong_table.find("[15, 2]"), std::string::npos) << wrong_table;
  c2f::MultiHeadAttention<float> mha(8, 4);
  TestRng rng(144);
  const std::string heads = error_of([&] {
    mha.forward(rng.tensor<float>(1, 4, 8),
                c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::relative_position(table, 2, 2, 2, 3)));
  });
  EXPECT_NE(heads.find("needs 4 heads"), std::string::npos) << heads;
  EXPECT_NE(heads.find("for 2 heads"), std::string::npos) << heads;
}

// ------------------------------------------------------------------------------------------------
// Equivalences

// One grid row, bias off (or a zero table): the 1-D layer with chunk_size = block_w, bit for bit.
TEST(C2F2DEquivalence, OneRowIsTheOneDimensionalLayerBitForBit) {
  TestRng rng(145);
  for (int rep = 0; rep < 30; ++rep) {
    const Index heads = rng.pick(std::vector<Index>{1, 2, 4}), d = heads * rng.pick(std::vector<Index>{1, 3, 4});
    const Index bw = rng.pick(std::vector<Index>{1, 2, 3, 8, 16}), bh = rng.uniform_int(1, 5);
    const Index W =
        std::max<Index>(1, rng.pick(std::vector<Index>{1, bw - 1, bw, bw + 1, 37, 61, rng.uniform_int(2, 90)}));
    const Index batch = rng.uniform_int(1, 3);
    const int threads = static_cast<int>(rng.uniform_int(1, 2));
    const bool zero_table = rep % 2 == 1;
    std::ostringstream what;
    what << "rep " << rep << ": batch " << batch << ", 1 x " << W << " in " << bh << " x " << bw << ", d " << d
         << ", heads " << heads << (zero_table ? ", zero bias table" : ", no bias");
    SCOPED_TRACE(what.str());
    C2FAttention2D<float> two(d, heads, bh, bw, options_of<float>(zero_table, 1, (W + bw - 1) / bw, threads));
    randomize(two, rng);
    StateDict sd = two.state_dict(), one_sd;
    for (const auto& [key, t] : sd) {
      if (key.find("relative_position_bias_table") == std::string::npos) one_sd.set(key, t);
    }
    if (zero_table) {
      const std::string key = "coarse_attn.relative_position_bias_table";
      sd.set(key, c2f::TensorData::from_values(std::vector<float>(sd.at(key).numel(), 0.f).data(), sd.at(key).shape()));
      two.load_state_dict(sd);
    }
    C2FAttention<float> one(d, heads, bw, C2FAttention<float>::Options().num_threads(threads));
    one.load_state_dict(one_sd);
    const Tensor3<float> x = rng.tensor<float>(batch, W, d);
    EXPECT_TRUE(same_bits(two.forward(x, 1, W), one.forward(x)));
  }
}

// With several workers and enough blocks (d = 512, 8 heads: from 96 blocks on), the folded stage runs
// its whole chain group by group (FineAttention::folded_group), each block read run by run through a
// kernels::BlockRange: the bits of one thread, which runs every product over all the blocks at once. The
// groups are whole block rows where a block row fits in one (11 × 10 blocks: groups of 10), else they
// cut block rows (4 × 31 blocks: groups of 21), and broadcast_chunks then writes a part of a row.
TEST(C2F2DEquivalence, FoldedGroupsKeepTheBitsOfOneThread) {
  TestRng rng(147);
  constexpr Index kD = 512, kHeads = 8;
  struct Grid {
    Index H, W;
  };
  for (const Grid grid : {Grid{21, 19}, Grid{7, 61}}) {  // 2 × 2 blocks, partial ones on the right and bottom
    const Index bh = 2, bw = 2, mh = (grid.H + 1) / 2, mw = (grid.W + 1) / 2;
    for (const bool bias : {false, true}) {
      C2FAttention2D<float> m(kD, kHeads, bh, bw, options_of<float>(bias, mh, mw, 1));
      randomize(m, rng);
      const Tensor3<float> x = rng.tensor<float>(1, grid.H * grid.W, kD);
      const Tensor3<float> one = m.forward(x, grid.H, grid.W);
      m.set_num_threads(2);
      EXPECT_TRUE(same_bits(one, m.forward(x, grid.H, grid.W)))
          << mh << " x " << mw << " blocks, " << (bias ? "with" : "without") << " the relative position bias";
    }
  }
}

// forward writes its fresh output on first touch, band by band with ordinary stores
// (detail::FreshPages::OnFirstWrite, KernelOptions::fresh_output; a 9 MiB output, large enough for
// that path); forward_into writes a caller's buffer with streaming stores: the same bits.
TEST(C2F2DEquivalence, FreshOutputWrittenOnFirstTouchHasTheBitsOfForwardInto) {
  TestRng rng(148);
  const Index d = 64, heads = 4, H = 181, W = 190;  // 23 × 24 blocks of 8 × 8, partial ones on two edges
  C2FAttention2D<float> m(d, heads, 8, 8, options_of<float>(true, 23, 24, 2));
  randomize(m, rng);
  const Tensor3<float> x = rng.tensor<float>(1, H * W, d);
  ASSERT_GE(static_cast<std::size_t>(x.size()) * sizeof(float), c2f::detail::kHugePageMinBytes);
  const Tensor3<float> y = m.forward(x, H, W);
  RowMatrix<float> into = RowMatrix<float>::Constant(H * W, d, 7.0f);
  m.forward_into(x, H, W, into);
  EXPECT_TRUE(same_bits(into.data(), y.data(), y.size()));
}

// One grid column: block (r, 0) holds the consecutive tokens [r·block_h, …), so this is the 1-D layer
// with chunk_size = block_h — but each block is block_h runs of one token, merged run by run.
TEST(C2F2DEquivalence, OneColumnIsTheOneDimensionalLayerMergedRunByRun) {
  TestRng rng(146);
  for (int rep = 0; rep < 20; ++rep) {
    const Index heads = rng.pick(std::vector<Index>{1, 2, 4}), d = heads * rng.pick(std::vector<Index>{1, 3, 4});
    const Index bh = rng.pick(std::vector<Index>{1, 2, 5, 8}), bw = rng.uniform_int(1, 4);
    const Index H = std::max<Index>(1, rng.pick(std::vector<Index>{1, bh - 1, bh, bh + 1, 29, rng.uniform_int(2, 70)}));
    C2FAttention2D<double> two(d, heads, bh, bw, options_of<double>(false, 1, 1, 2));
    randomize(two, rng);
    C2FAttention<double> one(d, heads, bh);
    one.load_state_dict(two.state_dict());
    const Tensor3<double> x = rng.tensor<double>(2, H, d);
    const Tensor3<double> a = two.forward(x, H, 1), b = one.forward(x);
    expect_close(a.data(), b.data(), a.size(), 1e-12, 1e-12,
                 "H " + std::to_string(H) + ", block_h " + std::to_string(bh));
  }
}

// Transposing the image, the blocks and the table (Δr ↔ Δc) transposes the output.
TEST(C2F2DEquivalence, TransposedImageGivesTransposedOutput) {
  TestRng rng(147);
  const Index d = 12, heads = 3;
  for (int rep = 0; rep < 8; ++rep) {
    const Index H = rng.uniform_int(1, 17), W = rng.uniform_int(1, 17), bh = rng.uniform_int(1, 5),
                bw = rng.uniform_int(1, 5);
    const Index gh = (H + bh - 1) / bh + rng.uniform_int(0, 2), gw = (W + bw - 1) / bw + rng.uniform_int(0, 2);
    C2FAttention2D<double> m(d, heads, bh, bw, options_of<double>(true, gh, gw, 2));
    randomize(m, rng);
    StateDict sd = m.state_dict();
    const std::string key = "coarse_attn.relative_position_bias_table";
    const std::vector<double> t = sd.at(key).to_vector<double>();
    std::vector<double> tt(t.size());
    for (Index dr = 0; dr < 2 * gh - 1; ++dr) {
      for (Index dc = 0; dc < 2 * gw - 1; ++dc) {
        for (Index h = 0; h < heads; ++h) {
          tt[static_cast<std::size_t>((dc * (2 * gh - 1) + dr) * heads + h)] =
              t[static_cast<std::size_t>((dr * (2 * gw - 1) + dc) * heads + h)];
        }
      }
    }
    sd.set(key, c2f::TensorData::from_values(tt.data(), {(2 * gh - 1) * (2 * gw - 1), heads}));
    C2FAttention2D<double> mt(d, heads, bw, bh, options_of<double>(true, gw, gh, 1));
    mt.load_state_dict(sd);
    const Tensor3<double> x = rng.tensor<double>(2, H * W, d);
    Tensor3<double> xt(2, W * H, d);
    for (Index b = 0; b < 2; ++b) {
      for (Index y = 0; y < H; ++y) {
        for (Index xx = 0; xx < W; ++xx) {
          for (Index k = 0; k < d; ++k) xt(b, xx * H + y, k) = x(b, y * W + xx, k);
        }
      }
    }
    const Tensor3<double> y = m.forward(x, H, W), yt = mt.forward(xt, W, H);
    for (Index b = 0; b < 2; ++b) {
      for (Index yy = 0; yy < H; ++yy) {
        for (Index xx = 0; xx < W; ++xx) {
          for (Index k = 0; k < d; ++k) ASSERT_NEAR(y(b, yy * W + xx, k), yt(b, xx * H + yy, k), 1e-12);
        }
      }
    }
  }
}

// The bias matters: a table with one large entry (Δ = (0, +1): the block to the left) makes every block
// that has a left neighbour take its coarse context from that neighbour.
TEST(C2F2DEquivalence, ALargeTableEntrySteersTheCoarseStage) {
  TestRng rng(148);
  const Index d = 8, heads = 2, gh = 3, gw = 3;
  C2FAttention2D<double> m(d, heads, 2, 2, options_of<double>(true, gh, gw, 1));
  randomize(m, rng, 0.1);
  StateDict sd = m.state_dict();
  const std::string key = "coarse_attn.relative_position_bias_table";
  std::vector<double> t(static_cast<std::size_t>((2 * gh - 1) * (2 * gw - 1) * heads), 0.0);
  const Index left = (0 + gh - 1) * (2 * gw - 1) + (1 + gw - 1);  // r − r' = 0, c − c' = +1
  for (Index h = 0; h < heads; ++h) t[static_cast<std::size_t>(left * heads + h)] = 1e3;
  sd.set(key, c2f::TensorData::from_values(t.data(), {(2 * gh - 1) * (2 * gw - 1), heads}));
  m.load_state_dict(sd);
  const Tensor3<double> x = rng.tensor<double>(1, 6 * 6, d);
  const Tensor3<double> summaries = m.coarse_input(x, 6, 6);
  const Tensor3<double> ctx = m.coarse_attn().forward(summaries, c2f::Masks<double>().attn_mask(m.coarse_mask(3, 3)));
  // Without any bias, block (r, c) with c ≥ 1 attending only to (r, c − 1) = the coarse output of the
  // one-key softmax: out_proj(W_v summary(r, c − 1) + b_v).
  c2f::CoarseAttention<double> plain(d, heads);
  StateDict coarse_sd;
  for (const auto& [k, v] : sd) {
    if (k.rfind("coarse_attn.", 0) == 0 && k != key) coarse_sd.set(k.substr(12), v);
  }
  plain.load_state_dict(coarse_sd);
  for (Index r = 0; r < 3; ++r) {
    for (Index c = 1; c < 3; ++c) {
      Tensor3<double> one(1, 1, d);
      for (Index k = 0; k < d; ++k) one(0, 0, k) = summaries(0, r * 3 + c - 1, k);
      const Tensor3<double> want = plain.forward(one);
      for (Index k = 0; k < d; ++k) EXPECT_NEAR(ctx(0, r * 3 + c, k), want(0, 0, k), 1e-9) << r << ", " << c;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Errors, loading, initialisation, threads

TEST(C2F2DErrors, WrongSizesNameExpectedAndGiven) {
  C2FAttention2D<float> m(8, 2, 4, 4, options_of<float>(true, 3, 2, 1));
  TestRng rng(149);
  const std::string features = error_of([&] { m.forward(rng.tensor<float>(2, 12, 6), 3, 4); });
  EXPECT_NE(features.find("embed_dim=8"), std::string::npos) << features;
  EXPECT_NE(features.find("[2, 12, 6]"), std::string::npos) << features;
  const std::string tokens = error_of([&] { m.forward(rng.tensor<float>(2, 12, 8), 3, 5); });
  EXPECT_NE(tokens.find("3·5 = 15"), std::string::npos) << tokens;
  EXPECT_NE(tokens.find("[2, 12, 8]"), std::string::npos) << tokens;
  EXPECT_THROW(m.forward(rng.tensor<float>(1, 0, 8), -1, 0), std::invalid_argument);
  // 13 x 9 in blocks of 4 x 4 is 4 x 3 blocks; the table covers 3 x 2.
  const std::string grid = error_of([&] { m.forward(rng.tensor<float>(1, 13 * 9, 8), 13, 9); });
  EXPECT_NE(grid.find("4 x 3 blocks"), std::string::npos) << grid;
  EXPECT_NE(grid.find("max_blocks_h x max_blocks_w = 3 x 2"), std::string::npos) << grid;
  // Without the bias there is no table and no limit.
  C2FAttention2D<float> unbounded(8, 2, 4, 4, options_of<float>(false, 3, 2, 1));
  EXPECT_EQ(unbounded.forward(rng.tensor<float>(1, 13 * 9, 8), 13, 9).dimension(1), 13 * 9);
  RowMatrix<float> out(5, 8);
  const std::string into = error_of([&] { m.forward_into(rng.tensor<float>(1, 12, 8), 3, 4, out); });
  EXPECT_NE(into.find("[12, 8]"), std::string::npos) << into;
  EXPECT_NE(into.find("[5, 8]"), std::string::npos) << into;
  EXPECT_NE(error_of([] { C2FAttention2D<float>(8, 2, 0, 4); }).find("block_h must be >= 1, got 0"), std::string::npos);
  EXPECT_THROW(C2FAttention2D<float>(10, 3, 4, 4), std::invalid_argument);
  EXPECT_NE(
      error_of([] { C2FAttention2D<float>(8, 2, 4, 4, options_of<float>(true, 0, 2, 1)); }).find("max_blocks_h >= 1"),
      std::string::npos);
}

TEST(C2F2DStateDict, NamesAndStrictLoadingOfTheTable) {
  C2FAttention2D<float> m(16, 4, 4, 4, options_of<float>(true, 3, 5, 1));
  std::vector<std::string> keys;
  for (const auto& kv : m.state_dict("attn")) keys.push_back(kv.first);
  EXPECT_EQ(keys,
            (std::vector<std::string>{
                "attn.coarse_attn.out_proj.bias", "attn.coarse_attn.out_proj.weight", "attn.coarse_attn.qkv_proj.bias",
                "attn.coarse_attn.qkv_proj.weight", "attn.coarse_attn.relative_position_bias_table",
                "attn.fine_attn.kv_proj.bias", "attn.fine_attn.kv_proj.weight", "attn.fine_attn.out_proj.bias",
                "attn.fine_attn.out_proj.weight", "attn.fine_attn.q_proj.bias", "attn.fine_attn.q_proj.weight"}));
  EXPECT_EQ(m.state_dict().at("coarse_attn.relative_position_bias_table").shape(),
            (std::vector<std::int64_t>{5 * 9, 4}));

  const StateDict good = m.state_dict();
  StateDict missing, wrong_shape = good;
  for (const auto& [k, v] : good) {
    if (k != "coarse_attn.relative_position_bias_table") missing.set(k, v);
  }
  C2FAttention2D<float> other(16, 4, 4, 4, options_of<float>(true, 3, 5, 1, 7));
  const std::string miss = error_of([&] { other.load_state_dict(missing); });
  EXPECT_NE(miss.find("missing key 'coarse_attn.relative_position_bias_table' (expected shape [45, 4])"),
            std::string::npos)
      << miss;
  wrong_shape.set("coarse_attn.relative_position_bias_table",
                  c2f::TensorData::from_values(std::vector<float>(35 * 4).data(), {35, 4}));
  const std::string shape = error_of([&] { other.load_state_dict(wrong_shape); });
  EXPECT_NE(shape.find("has shape [35, 4], expected [45, 4]"), std::string::npos) << shape;
  // Without the bias the table is an unexpected key, and its absence is fine.
  C2FAttention2D<float> no_bias(16, 4, 4, 4, options_of<float>(false, 3, 5, 1));
  const std::string unexpected = error_of([&] { no_bias.load_state_dict(good); });
  EXPECT_NE(unexpected.find("unexpected key 'coarse_attn.relative_position_bias_table'"), std::string::npos)
      << unexpected;
  no_bias.load_state_dict(missing);
  other.load_state_dict(good);
  EXPECT_TRUE(other.relative_position_bias_table() == m.relative_position_bias_table());
}

TEST(C2F2DInit, TableIsSwinsTruncatedNormalAndDeterministic) {
  const Index gh = 16, gw = 16, heads = 8;
  C2FAttention2D<double> a(64, heads, 8, 8, options_of<double>(true, gh, gw, 1, 5)),
      b(64, heads, 8, 8, options_of<double>(true, gh, gw, 1, 5)),
      c(64, heads, 8, 8, options_of<double>(true, gh, gw, 1, 6));
  const RowMatrix<double>& t = a.relative_position_bias_table();
  ASSERT_EQ(t.rows(), 31 * 31);
  ASSERT_EQ(t.cols(), heads);
  EXPECT_TRUE(t == b.relative_position_bias_table());
  EXPECT_FALSE(t == c.relative_position_bias_table());
  const double mean = t.mean(), stddev = std::sqrt((t.array() - mean).square().mean());
  EXPECT_NEAR(mean, 0.0, 0.002);
  EXPECT_NEAR(stddev, 0.02, 0.001);
  EXPECT_LE(t.cwiseAbs().maxCoeff(), 2.0);
  // The projections follow the 1-D layer's initialisation with the same seed.
  C2FAttention<double> one(64, heads, 8, C2FAttention<double>::Options().num_threads(1).seed(5));
  for (const auto& [key, tensor] : one.state_dict()) EXPECT_EQ(tensor.bytes(), a.state_dict().at(key).bytes()) << key;
}

// ------------------------------------------------------------------------------------------------
// Working memory: no per-token buffer besides the output

TEST(C2F2DMemory, ForwardHoldsTheOutputAndPerBlockRowsOnly) {
  if (!c2f_memory::available()) GTEST_SKIP() << "malloc counting is unavailable under sanitizers";
  const Index d = 64, heads = 4;
  TestRng rng(152);
  for (Index side : {Index(128), Index(256)}) {
    C2FAttention2D<float> m(d, heads, 32, 32, options_of<float>(true, 8, 8, 2));
    const Tensor3<float> x = rng.tensor<float>(1, side * side, d);
    m.forward(x, side, side);  // the weights the layer packs on its first call and keeps: not temporaries
    c2f::release_scratch_cache();
    c2f_memory::reset();
    {
      const auto y = m.forward(x, side, side);  // a c2f::Output: no copy
      EXPECT_EQ(y.dimension(1), side * side);
    }
    c2f_memory::stop();
    const long long output = static_cast<long long>(side * side * d * sizeof(float));
    // The output is the largest block (the scratch cache adds its 64 bytes of alignment to the request).
    EXPECT_GE(c2f_memory::largest_allocation(), output) << side;
    EXPECT_LE(c2f_memory::largest_allocation(), output + static_cast<long long>(c2f::detail::kScratchAlign)) << side;
    EXPECT_LE(c2f_memory::peak_bytes(), output + static_cast<long long>(m.workspace_bytes(1, side, side)) + 64 * 1024)
        << side;
    // Working memory is per block: at most 10 % of input + output here.
    EXPECT_LE(c2f_memory::peak_bytes() - output, (2 * output) / 10) << side;
  }
}

// Compute::BFloat16 (docs/bf16.md) against torch.autocast("cpu", bfloat16) and fp32 on the same weights
// (tests/data/bf16, generate.py gen_bf16), on both engines; a bf16 layer stays thread-independent.
TEST(C2f2dBf16, MatchesTorchAutocastAndFp32WithinTheStatedBound) {
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path("bf16/c2f2d_9x13_b4x4_bf16_f32.safetensors"));
  const Tensor3<float> x = c2f_test::tensor3<float>(sd, "x");
  const std::vector<float> fp32 = c2f_test::values<float>(sd, "output"),
                           autocast = c2f_test::values<float>(sd, "output_autocast");
  const Index height = meta_index(sd, "height"), width = meta_index(sd, "width");
  for (c2f::Bf16Engine e : c2f_test::available_bf16_engines()) {
    const auto engine_setting = c2f_test::scoped_bf16_engine(e);
    const char* engine = c2f::bf16_engine_name(e);
    C2FAttention2D<float> m(meta_index(sd, "embed_dim"), meta_index(sd, "num_heads"), meta_index(sd, "block_h"),
                            meta_index(sd, "block_w"),
                            options_of<float>(true, meta_index(sd, "max_blocks_h"), meta_index(sd, "max_blocks_w"), 2)
                                .compute(c2f::Compute::BFloat16));
    m.load_state_dict(sd, "c2f2d.");
    const Tensor3<float> y = m.forward(x, height, width);
    m.set_num_threads(1);
    EXPECT_TRUE(same_bits(m.forward(x, height, width), y)) << engine;
    c2f_test::expect_bf16_accuracy(std::string("c2f2d_9x13_b4x4, ") + engine, y.data(), fp32, autocast);
  }
  const C2FAttention2D<float> bf16(8, 2, 2, 2, options_of<float>(true, 4, 4, 1).compute(c2f::Compute::BFloat16));
  TestRng rng(0xbf22);
  const Tensor3<float> tokens = rng.tensor<float>(1, 16, 8);
  EXPECT_THROW((void)bf16.forward_train(tokens, 4, 4), std::invalid_argument);
  try {
    C2FAttention2D<double> bad(8, 2, 2, 2, options_of<double>(true, 4, 4, 1).compute(c2f::Compute::BFloat16));
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("C2FAttention2D: compute BFloat16 needs float, got double"), std::string::npos)
        << e.what();
  }
}

}  // namespace
