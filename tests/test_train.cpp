// Training (docs/training.md): forward_train / backward, the training kernels and the training utilities.
//   - the attention backward (sdpa_backward) and the training forward (sdpa_train) against their naive
//     twins on 60 random problems per precision (awkward sizes, every mask kind, dropout on and off), rows
//     with no visible key (zero gradients, no NaN), NaN/Inf behind a mask, 1/2/3 threads bit for bit;
//     linear_backward against its twin;
//   - every layer that trains against PyTorch's autograd (tests/data/train: y.backward(dy) of nn.Linear,
//     nn.MultiheadAttention, the article's CoarseAttention): fp64 1e-10, fp32 atol 1e-5 / rtol 5e-6;
//   - central finite differences in double (eps 1e-6, gradcheck's atol 1e-5 / rtol 1e-3) of every input and
//     parameter of every layer that trains, dropout included — independent of the fixtures;
//   - dropout: the kept fraction, reproducible per (seed, step), independent of the thread count;
//   - clip_grad_norm, AdamW and SGD against torch step by step; grad norms, accumulation, bad input.
// The layer contract's training properties (forward_train = forward, names and shapes, thread bits, refused
// saved states) are in test_layer_contract.cpp; the memory of forward_train + backward in test_memory.cpp.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "c2f/io/masks.hpp"
#include "support/attention_problems.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/layer_entries.hpp"
#include "support/mha_fixtures.hpp"
#include "support/random.hpp"
#include "support/settings.hpp"
#include "support/train_checks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace {

using c2f::Index;
using c2f::Masks;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::check_central;
using c2f_test::check_one_input_case;
using c2f_test::check_parameters;
using c2f_test::Comparison;
using c2f_test::error_of;
using c2f_test::LayerCalls;  // the entries of C2F_LAYER
using c2f_test::meta_index;
using c2f_test::ScalarOf;
using c2f_test::TestRng;

namespace kernels = c2f::kernels;

template <class T>
class TrainKernel : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TrainKernel, Scalars);

/// The heads view of an [batch·seq, heads·dim] matrix of a problem.
template <class Scalar>
kernels::HeadsView<Scalar> view_of(RowMatrix<Scalar>& m, const c2f_test::Problem<Scalar>& p, Index seq, Index dim) {
  return kernels::heads_view<Scalar>(m.data(), p.batch, seq, p.heads * dim, 0, p.heads, dim);
}
template <class Scalar>
kernels::HeadsView<const Scalar> view_of(const RowMatrix<Scalar>& m, const c2f_test::Problem<Scalar>& p, Index seq,
                                         Index dim) {
  return p.view(m, seq, dim);
}

/// A problem of these sizes with random q, k, v (N(0, 1)) and no masks.
template <class Scalar>
c2f_test::Problem<Scalar> sized_problem(TestRng& rng, Index batch, Index heads, Index lq, Index lk, Index dk,
                                        Index dv) {
  c2f_test::Problem<Scalar> p;
  p.batch = batch;
  p.heads = heads;
  p.lq = lq;
  p.lk = lk;
  p.dk = dk;
  p.dv = dv;
  p.q = rng.matrix<Scalar>(batch * lq, heads * dk);
  p.k = rng.matrix<Scalar>(batch * lk, heads * dk);
  p.v = rng.matrix<Scalar>(batch * lk, heads * dv);
  p.description = "batch=" + std::to_string(batch) + " heads=" + std::to_string(heads) + " lq=" + std::to_string(lq) +
                  " lk=" + std::to_string(lk) + " dk=" + std::to_string(dk) + " dv=" + std::to_string(dv);
  return p;
}

/// dq, dk, dv of one backward call.
template <class Scalar>
struct AttnGrads {
  RowMatrix<Scalar> dq, dk, dv;
  bool operator==(const AttnGrads& o) const {
    return c2f_test::bitwise_equal(dq, o.dq) && c2f_test::bitwise_equal(dk, o.dk) && c2f_test::bitwise_equal(dv, o.dv);
  }
};

/// sdpa_train, then sdpa_backward on dout (or, `naive`, sdpa_naive_train and sdpa_backward_naive).
template <class Scalar>
AttnGrads<Scalar> attention_backward(const c2f_test::Problem<Scalar>& p, const RowMatrix<Scalar>& dout,
                                     const c2f::MaskView<Scalar>& plan, const kernels::AttnDropout& dropout,
                                     const kernels::KernelOptions& opt, bool naive,
                                     RowMatrix<Scalar>* out_copy = nullptr, RowMatrix<Scalar>* lse_copy = nullptr) {
  RowMatrix<Scalar> out(p.batch * p.lq, p.heads * p.dv), lse(p.batch * p.heads, p.lq);
  AttnGrads<Scalar> g{RowMatrix<Scalar>(p.q.rows(), p.q.cols()), RowMatrix<Scalar>(p.k.rows(), p.k.cols()),
                      RowMatrix<Scalar>(p.v.rows(), p.v.cols())};
  if (naive) {
    kernels::sdpa_naive_train<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(out), lse, plan, dropout, p.scale(), opt);
    kernels::sdpa_backward_naive<Scalar>(p.qv(), p.kv(), p.vv(), view_of(dout, p, p.lq, p.dv),
                                         view_of(g.dq, p, p.lq, p.dk), view_of(g.dk, p, p.lk, p.dk),
                                         view_of(g.dv, p, p.lk, p.dv), plan, dropout, p.scale(), opt);
  } else {
    kernels::sdpa_train<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(out), lse, plan, dropout, p.scale(), opt);
    kernels::sdpa_backward<Scalar>(p.qv(), p.kv(), p.vv(), view_of(std::as_const(out), p, p.lq, p.dv), lse,
                                   view_of(dout, p, p.lq, p.dv), view_of(g.dq, p, p.lq, p.dk),
                                   view_of(g.dk, p, p.lk, p.dk), view_of(g.dv, p, p.lk, p.dv), plan, dropout, p.scale(),
                                   opt);
  }
  if (out_copy != nullptr) *out_copy = out;
  if (lse_copy != nullptr) *lse_copy = lse;
  return g;
}

/// The twins' tolerance: the precision's (1e-5 float, 1e-12 double) times sqrt(length · head width).
template <class Scalar>
double twin_tolerance(const c2f_test::Problem<Scalar>& p) {
  return c2f_test::tolerance<Scalar>() * std::sqrt(double(std::max<Index>(p.lq, p.lk) * std::max(p.dk, p.dv)));
}

// The flash forward and backward against the naive twins, on the kernels' random problems (test_kernels:
// lengths 1, primes and block ± 1, dk ≠ dv, masks of every kind including whole rows and key blocks masked),
// blocks of 1 … 300, dropout on for about a third, 2 threads.
TYPED_TEST(TrainKernel, FlashBackwardEqualsTheNaiveTwin) {
  using Scalar = TypeParam;
  TestRng rng(41);
  for (int rep = 0; rep < 60; ++rep) {
    const c2f_test::Problem<Scalar> p = c2f_test::random_problem<Scalar>(rng, rep);
    kernels::KernelOptions opt;
    opt.query_block(rng.pick(std::vector<Index>{1, 7, 16, 64})).key_block(rng.pick(std::vector<Index>{1, 5, 32, 300}));
    opt.num_threads(2);
    kernels::AttnDropout dropout;
    if (rng.coin(0.35))
      dropout = {rng.pick(std::vector<double>{0.1, 0.5}), static_cast<std::uint64_t>(rng.uniform_int(0, 99)),
                 static_cast<std::uint64_t>(rng.uniform_int(0, 99))};
    SCOPED_TRACE(p.description + " blocks " + std::to_string(opt.query_block()) + "x" +
                 std::to_string(opt.key_block()) + " dropout " + std::to_string(dropout.p));
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    const RowMatrix<Scalar> dout = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dv);
    RowMatrix<Scalar> out, lse, out_naive, lse_naive;
    const AttnGrads<Scalar> fast = attention_backward(p, dout, plan, dropout, opt, false, &out, &lse);
    const AttnGrads<Scalar> naive = attention_backward(p, dout, plan, dropout, opt, true, &out_naive, &lse_naive);
    const double tol = twin_tolerance(p);
    c2f_test::expect_close(out, out_naive, tol, tol, "out");
    for (Index i = 0; i < lse.size(); ++i) {
      const Scalar a = lse.data()[i], b = lse_naive.data()[i];
      ASSERT_TRUE(std::isinf(a) == std::isinf(b) && (std::isinf(a) || std::abs(a - b) <= tol * (1 + std::abs(b))))
          << "lse[" << i << "]: " << a << " vs " << b;
    }
    c2f_test::expect_close(fast.dq, naive.dq, tol, tol, "dq");
    c2f_test::expect_close(fast.dk, naive.dk, tol, tol, "dk");
    c2f_test::expect_close(fast.dv, naive.dv, tol, tol, "dv");
    ASSERT_TRUE(fast.dq.allFinite() && fast.dk.allFinite() && fast.dv.allFinite());
  }
}

// sdpa_backward's packed path (builds with the micro-kernel — test_train_native —, no dropout, from 32
// queries on, key blocks on the micro-kernel's panels): lengths around the blocks (1, 31 … 33, 255 … 257,
// primes), head widths 5 … 64 with dk ≠ dv, the default blocks and blocks of 16 … 64, causal and not,
// against the naive twin; the thread count changes no bit. (In a portable build the same cases run the
// Eigen path.)
TYPED_TEST(TrainKernel, PackedBackwardEqualsTheNaiveTwin) {
  using Scalar = TypeParam;
  TestRng rng(43);
  const std::vector<Index> lengths{1, 31, 32, 33, 63, 65, 255, 257, 301};
  for (int rep = 0; rep < 16; ++rep) {
    const Index lq = rng.pick(lengths), lk = rep % 4 == 0 ? lq : rng.pick(lengths);
    const c2f_test::Problem<Scalar> p =
        sized_problem<Scalar>(rng, rng.pick(std::vector<Index>{1, 2}), rng.pick(std::vector<Index>{1, 3}), lq, lk,
                              rng.pick(std::vector<Index>{8, 17, 64}), rng.pick(std::vector<Index>{5, 64}));
    kernels::KernelOptions opt;
    if (rep % 2 == 1) {
      opt.query_block(rng.pick(std::vector<Index>{16, 32, 48, 64}))
          .key_block(rng.pick(std::vector<Index>{16, 32, 48, 64}));
    }
    const bool causal = rep % 4 == 0;
    SCOPED_TRACE(p.description + " blocks " + std::to_string(opt.query_block()) + "x" +
                 std::to_string(opt.key_block()) + (causal ? " causal" : ""));
    const c2f::MaskView<Scalar> plan(c2f::Masks<Scalar>{}, p.batch, p.heads, lq, lk, causal);
    const RowMatrix<Scalar> dout = rng.matrix<Scalar>(p.batch * lq, p.heads * p.dv);
    opt.num_threads(2);
    const AttnGrads<Scalar> fast = attention_backward(p, dout, plan, kernels::AttnDropout{}, opt, false);
    const AttnGrads<Scalar> naive = attention_backward(p, dout, plan, kernels::AttnDropout{}, opt, true);
    const double tol = twin_tolerance(p);
    c2f_test::expect_close(fast.dq, naive.dq, tol, tol, "dq");
    c2f_test::expect_close(fast.dk, naive.dk, tol, tol, "dk");
    c2f_test::expect_close(fast.dv, naive.dv, tol, tol, "dv");
    opt.num_threads(1);
    EXPECT_TRUE(attention_backward(p, dout, plan, kernels::AttnDropout{}, opt, false) == fast) << "1 thread";
    opt.num_threads(3);
    EXPECT_TRUE(attention_backward(p, dout, plan, kernels::AttnDropout{}, opt, false) == fast) << "3 threads";
  }
}

// Rows that see no key (a fully masked attention row, a batch item whose keys are all padding, the rows of
// a causal(−5) mask before position 5): zero dq, and no gradient from them; no NaN anywhere. A key no row
// sees gets zero dk and dv.
TYPED_TEST(TrainKernel, RowsWithoutAVisibleKeyHaveZeroGradients) {
  using Scalar = TypeParam;
  TestRng rng(42);
  for (int rep = 0; rep < 6; ++rep) {
    c2f_test::Problem<Scalar> p = sized_problem<Scalar>(rng, 2, 1 + rep % 3, 37, 29, 1 + rep, 4 - rep % 3);
    if (rep % 2 == 0) {
      c2f::BoolTensor2 m(p.lq, p.lk);
      for (Index i = 0; i < m.size(); ++i) m.data()[i] = rng.coin(0.7);
      for (Index j = 0; j < p.lk; ++j) m(3, j) = m(20, j) = false;  // rows 3 and 20 see nothing
      for (Index i = 0; i < p.lq; ++i) m(i, 11) = false;            // key 11 is seen by no row
      p.attn = c2f::AttnMask<Scalar>::keep(m);
    } else {
      p.attn = c2f::AttnMask<Scalar>::causal(-5);
    }
    p.pad = c2f::KeyPaddingMask<Scalar>::lengths({p.lk, 0});  // batch item 1 sees nothing
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    kernels::KernelOptions opt;
    opt.query_block(8).key_block(8).num_threads(2);
    const kernels::AttnDropout dropout{rep < 3 ? 0.0 : 0.3, 7, 1};
    const RowMatrix<Scalar> dout = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dv);
    for (bool naive : {false, true}) {
      const AttnGrads<Scalar> g = attention_backward(p, dout, plan, dropout, opt, naive);
      const std::string what = std::string(naive ? "naive" : "flash") + " rep " + std::to_string(rep);
      ASSERT_TRUE(g.dq.allFinite() && g.dk.allFinite() && g.dv.allFinite()) << what;
      for (Index i = 0; i < p.lq; ++i) {
        const bool blind = rep % 2 == 0 ? (i == 3 || i == 20) : i < 5;
        if (blind) {
          EXPECT_TRUE(g.dq.row(i).isZero(0)) << what << ": row " << i;
        }
        EXPECT_TRUE(g.dq.row(p.lq + i).isZero(0)) << what << ": batch item 1, row " << i;
      }
      EXPECT_TRUE(g.dk.bottomRows(p.lk).isZero(0) && g.dv.bottomRows(p.lk).isZero(0)) << what;
      if (rep % 2 == 0) {
        EXPECT_TRUE(g.dk.row(11).isZero(0) && g.dv.row(11).isZero(0)) << what << ": key 11";
      }
    }
  }
}

// NaN and Inf in the keys and values of padded (masked) positions never reach a gradient: every bit is the
// one a run with finite values there gives (the forward's guarantee, masked_values.hpp, carried to dq, dk,
// dv). A NaN in a key a row sees does reach that row's dq.
template <class Scalar>
void check_non_finite_masked_keys(Index lq, Index query_block, Index key_block) {
  TestRng rng(43);
  c2f_test::Problem<Scalar> p = sized_problem<Scalar>(rng, 2, 2, lq, 41, 4, 3);
  p.pad = c2f::KeyPaddingMask<Scalar>::lengths({30, 17});
  const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
  kernels::KernelOptions opt;
  opt.query_block(query_block).key_block(key_block).num_threads(2);
  const RowMatrix<Scalar> dout = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dv);
  const AttnGrads<Scalar> clean = attention_backward(p, dout, plan, {}, opt, false);
  c2f_test::Problem<Scalar> poisoned = p;
  poisoned.k.row(35) = RowMatrix<Scalar>::Constant(1, p.heads * p.dk, std::numeric_limits<Scalar>::quiet_NaN());
  poisoned.v.row(p.lk + 20).setConstant(std::numeric_limits<Scalar>::infinity());
  poisoned.v(p.lk + 18, 1) = std::numeric_limits<Scalar>::quiet_NaN();
  poisoned.k(31, 0) = -std::numeric_limits<Scalar>::infinity();
  const AttnGrads<Scalar> got = attention_backward(poisoned, dout, plan, {}, opt, false);
  EXPECT_TRUE(got == clean) << "a non-finite masked key or value changed a gradient";
  poisoned.k(3, 1) = std::numeric_limits<Scalar>::quiet_NaN();  // key 3 of batch item 0, seen by every row
  const AttnGrads<Scalar> seen = attention_backward(poisoned, dout, plan, {}, opt, false);
  EXPECT_TRUE(seen.dq.topLeftCorner(p.lq, p.dk).array().isNaN().all()) << "head 0 of batch item 0 sees the NaN";
  EXPECT_TRUE(seen.dq.topRightCorner(p.lq, p.dk) == clean.dq.topRightCorner(p.lq, p.dk)) << "head 1 does not";
  EXPECT_TRUE(seen.dq.bottomRows(p.lq) == clean.dq.bottomRows(p.lq)) << "batch item 1 does not";
}

// Twice: small blocks (Eigen's products), and 37 queries in key blocks of 32 (sdpa_backward's packed path in
// builds with the micro-kernel — test_train_native).
TYPED_TEST(TrainKernel, NonFiniteMaskedKeysReachNoGradient) {
  using Scalar = TypeParam;
  for (const auto& [lq, query_block, key_block] : {std::array<Index, 3>{23, 5, 8}, std::array<Index, 3>{37, 16, 32}}) {
    SCOPED_TRACE("lq " + std::to_string(lq) + ", blocks " + std::to_string(query_block) + " x " +
                 std::to_string(key_block));
    check_non_finite_masked_keys<Scalar>(lq, query_block, key_block);
  }
}

// The same bits for 1, 2 and 3 threads, on shapes where the query parts split each head (few heads, many
// query blocks), with a causal mask and dropout.
TYPED_TEST(TrainKernel, BackwardBitsDoNotDependOnThreadCount) {
  using Scalar = TypeParam;
  TestRng rng(44);
  const auto pool_threads = c2f_test::scoped_threads(4);
  for (int rep = 0; rep < 4; ++rep) {
    c2f_test::Problem<Scalar> p = sized_problem<Scalar>(rng, 1 + rep % 2, 1 + rep / 2, 201, rep == 3 ? 77 : 201, 8, 5);
    p.attn = rep % 2 == 0 ? c2f::AttnMask<Scalar>::causal() : c2f::AttnMask<Scalar>();
    p.pad = rep == 3 ? c2f::KeyPaddingMask<Scalar>::lengths(std::vector<Index>(static_cast<std::size_t>(p.batch), 50))
                     : c2f::KeyPaddingMask<Scalar>();
    ASSERT_GT(c2f::kernels::impl::backward_query_parts(p.batch * p.heads, c2f::detail::ceil_div(p.lq, 16)), 1);
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    const RowMatrix<Scalar> dout = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dv);
    const kernels::AttnDropout dropout{rep % 2 == 1 ? 0.2 : 0.0, 3, 9};
    kernels::KernelOptions opt;
    opt.query_block(16).key_block(32).num_threads(1);
    const AttnGrads<Scalar> one = attention_backward(p, dout, plan, dropout, opt, false);
    for (int threads : {2, 3}) {
      opt.num_threads(threads);
      EXPECT_TRUE(attention_backward(p, dout, plan, dropout, opt, false) == one)
          << p.description << ": " << threads << " threads";
    }
  }
}

// linear_backward against its twin on awkward shapes (several weight tiles, row chunks), with and without
// bias; 1 and 2 threads bit for bit.
TYPED_TEST(TrainKernel, LinearBackwardEqualsTheNaiveTwin) {
  using Scalar = TypeParam;
  TestRng rng(45);
  for (int rep = 0; rep < 24; ++rep) {
    const Index n = rng.pick(c2f_test::kAwkward) + (rep % 3 == 0 ? 300 : 0), in = rng.pick(c2f_test::kAwkward),
                out = rng.pick(c2f_test::kAwkward);
    const bool bias = rng.coin();
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(n, in), w = rng.matrix<Scalar>(out, in),
                            dy = rng.matrix<Scalar>(n, out);
    RowMatrix<Scalar> dx(n, in), dw(out, in), dx2(n, in), dw2(out, in), dxn(n, in), dwn(out, in);
    c2f::Vector<Scalar> db(out), db2(out), dbn(out);
    kernels::linear_backward<Scalar>(x, w, dy, dx, dw, bias ? db.data() : nullptr, kernels::with_threads(1));
    kernels::linear_backward<Scalar>(x, w, dy, dx2, dw2, bias ? db2.data() : nullptr, kernels::with_threads(2));
    kernels::linear_backward_naive<Scalar>(x, w, dy, dxn, dwn, bias ? dbn.data() : nullptr);
    const std::string what = "n=" + std::to_string(n) + " in=" + std::to_string(in) + " out=" + std::to_string(out);
    const double tol = c2f_test::tolerance<Scalar>() * std::sqrt(double(std::max(n, out)));
    c2f_test::expect_close(dx, dxn, tol, tol, what + " dx");
    c2f_test::expect_close(dw, dwn, tol, tol, what + " dw");
    EXPECT_TRUE(c2f_test::bitwise_equal(dx, dx2) && c2f_test::bitwise_equal(dw, dw2))
        << what << ": 1 and 2 threads differ";
    if (bias) {
      c2f_test::expect_close(RowMatrix<Scalar>(db.transpose()), RowMatrix<Scalar>(dbn.transpose()), tol, tol,
                             what + " db");
      EXPECT_TRUE(db == db2) << what;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Against PyTorch's autograd (tests/data/train)

template <class Scalar>
void check_linear_case(const StateDict& sd, Comparison& cmp) {
  c2f::Linear<Scalar> layer(meta_index(sd, "in_features"), meta_index(sd, "out_features"),
                            typename c2f::Linear<Scalar>::Options().bias(sd.metadata().at("bias") == "true"));
  check_one_input_case<Scalar>(layer, sd, {}, "linear.", cmp);
}

/// The article's keep mask [B, m, m] (True = keep) is an attention mask shared by the heads.
template <class Scalar>
void check_coarse_case(const StateDict& sd, Comparison& cmp) {
  c2f::CoarseAttention<Scalar> layer(meta_index(sd, "d_model"), meta_index(sd, "n_heads"));
  Masks<Scalar> masks;
  if (sd.contains("mask")) masks.attn_mask(c2f::attn_mask_from_tensor<Scalar>(c2f::MaskKind::Keep, sd.at("mask")));
  check_one_input_case<Scalar>(layer, sd, masks, "coarse.", cmp);
}

// Every mask form of the fixture (mask_variants), both kernels, 1 and 2 threads, the default blocks and
// small ones (several query and key blocks, query parts).
template <class Scalar>
void check_mha_case(const StateDict& sd, Comparison& cmp) {
  const bool self = sd.metadata().at("self_attention") == "true";
  const Tensor3<Scalar> q = c2f_test::tensor3<Scalar>(sd, "query"), dy = c2f_test::tensor3<Scalar>(sd, "grad_output");
  const Tensor3<Scalar> k = self ? q : c2f_test::tensor3<Scalar>(sd, "key"),
                        v = self ? q : c2f_test::tensor3<Scalar>(sd, "value");
  for (const auto& [mask_name, masks] : c2f_test::mask_variants<Scalar>(sd)) {
    for (c2f::AttnKernel kernel : {c2f::AttnKernel::Streaming, c2f::AttnKernel::Naive}) {
      for (const auto& [threads, blocks] :
           std::vector<std::pair<int, std::pair<Index, Index>>>{{1, {64, 256}}, {2, {5, 8}}}) {
        typename c2f::MultiHeadAttention<Scalar>::Options o = c2f_test::options_from<Scalar>(sd);
        o.kernel(kernel).num_threads(threads).query_block(blocks.first).key_block(blocks.second);
        c2f::MultiHeadAttention<Scalar> mha(meta_index(sd, "embed_dim"), meta_index(sd, "num_heads"), o);
        mha.load_state_dict(sd, "mha.");
        const std::string what = mask_name + (kernel == c2f::AttnKernel::Naive ? " naive" : " streaming") +
                                 " threads " + std::to_string(threads) + " blocks " + std::to_string(blocks.first) +
                                 "x" + std::to_string(blocks.second);
        const auto [y, saved] = self ? mha.forward_train(q, masks) : mha.forward_train(q, k, v, masks);
        const c2f::Grads<Scalar> g = mha.backward(saved, dy);
        cmp.check(y, sd, "output", what);
        if (self) {
          cmp.check(g.input, sd, "grad.input", what);
          EXPECT_EQ(g.key.size() + g.value.size(), 0) << what;
        } else {
          cmp.check(g.input, sd, "grad.query", what);
          cmp.check(g.key, sd, "grad.key", what);
          cmp.check(g.value, sd, "grad.value", what);
        }
        cmp.template check_params<Scalar>(g.params, sd, "mha.", what);
      }
    }
  }
}

/// Hyperparameter `name` of an optimizer fixture.
double hyper(const StateDict& sd, const std::string& name) { return std::stod(sd.metadata().at(name)); }

/// The gradients of a Linear under its state-dict names from the fixture's `<prefix>weight` / `<prefix>bias`.
StateDict linear_grads(const StateDict& sd, const std::string& prefix) {
  StateDict g;
  g.set("weight", sd.at(prefix + "weight"));
  g.set("bias", sd.at(prefix + "bias"));
  return g;
}

// The optimizers and clipping: the element-wise arithmetic in the parameter's precision, as torch does it:
// a few ulp (fp32 1e-6, fp64 1e-12) after every step.
template <class Scalar>
void check_optimizer_case(const StateDict& sd, Comparison& cmp) {
  const double tol = std::is_same<Scalar, float>::value ? 1e-6 : 1e-12;
  const std::string module = sd.metadata().at("module");
  c2f::Linear<Scalar> layer(meta_index(sd, "in_features"), meta_index(sd, "out_features"));
  layer.load_state_dict(sd, "linear.");
  if (module == "clip") {
    StateDict grads = linear_grads(sd, "grads.");
    const double norm = c2f::clip_grad_norm(grads, hyper(sd, "max_norm"));
    const Scalar norm_s = static_cast<Scalar>(norm);
    cmp.check(&norm_s, c2f_test::values<Scalar>(sd, "total_norm"), 1, tol, tol, "total_norm");
    for (const char* name : {"weight", "bias"}) {
      const std::vector<Scalar> got = grads.at(name).template to_vector<Scalar>();
      cmp.check(got.data(), c2f_test::values<Scalar>(sd, std::string("clipped.") + name), grads.at(name).numel(), tol,
                tol, std::string("clipped ") + name);
    }
    return;
  }
  const auto run = [&](auto& opt) {
    for (Index t = 1; t <= meta_index(sd, "steps"); ++t) {
      const std::string step = std::to_string(t);
      opt.step(layer, linear_grads(sd, "grads." + step + "."));
      for (const auto& [name, tensor] : layer.state_dict()) {
        const std::vector<Scalar> got = tensor.template to_vector<Scalar>();
        cmp.check(got.data(), c2f_test::values<Scalar>(sd, "expected." + step + "." + name), tensor.numel(), tol, tol,
                  "step " + step + " " + name);
      }
    }
  };
  if (module == "adamw") {
    c2f::AdamW opt(c2f::AdamW::Options()
                       .lr(hyper(sd, "lr"))
                       .beta1(hyper(sd, "beta1"))
                       .beta2(hyper(sd, "beta2"))
                       .eps(hyper(sd, "eps"))
                       .weight_decay(hyper(sd, "weight_decay")));
    run(opt);
    EXPECT_EQ(opt.steps("weight"), meta_index(sd, "steps"));
    EXPECT_TRUE(opt.state().contains("weight.exp_avg") && opt.state().contains("bias.exp_avg_sq"));
  } else {
    c2f::SGD opt(hyper(sd, "lr"), c2f::SGD::Options()
                                      .momentum(hyper(sd, "momentum"))
                                      .dampening(hyper(sd, "dampening"))
                                      .weight_decay(hyper(sd, "weight_decay"))
                                      .nesterov(hyper(sd, "nesterov") != 0));
    run(opt);
  }
}

template <class Scalar>
void check_train_case(const nlohmann::json& c) {
  const StateDict sd =
      c2f::load_safetensors(c2f_test::data_path(c.at("files").at(c2f_test::Tolerance<Scalar>::file_key)));
  const std::string module = sd.metadata().at("module");
  Comparison cmp;
  if (module == "linear") {
    check_linear_case<Scalar>(sd, cmp);
  } else if (module == "mha") {
    check_mha_case<Scalar>(sd, cmp);
  } else if (module == "coarse") {
    check_coarse_case<Scalar>(sd, cmp);
  } else {
    check_optimizer_case<Scalar>(sd, cmp);
  }
  std::cout << "[train] " << c.at("name").get<std::string>() << " " << c2f_test::Tolerance<Scalar>::file_key
            << ": max |c2f - torch| " << cmp.max_diff << "; at most " << cmp.max_share << " of the tolerance, at "
            << cmp.worst << "\n";
}

C2F_FIXTURE_TEST(TrainFixture, MatchesPyTorch, "train", check_train_case);

TEST(TrainFixtures, EveryModuleHasCases) {
  std::map<std::string, int> modules;
  for (const nlohmann::json& c : c2f_test::manifest_cases("train")) ++modules[c.at("module").get<std::string>()];
  for (const char* m : {"linear", "mha", "coarse", "adamw", "sgd", "clip"}) EXPECT_GE(modules[m], 1) << m;
  EXPECT_GE(modules["mha"], 12);
}

// ------------------------------------------------------------------------------------------------
// Finite differences, independent of the fixtures: every layer that trains, in double.

template <class E>
class FiniteDifferences : public ::testing::Test {};

// One entry per layer configuration that trains, in double: later layers join with one line here.
// clang-format off
C2F_LAYER(LinearF64, c2f::Linear<double>, c2f_test::kWidth, 5, o);
C2F_LAYER(MhaF64, c2f::MultiHeadAttention<double>, c2f_test::kWidth, 2, o.query_block(3).key_block(4));
C2F_LAYER(CausalMhaDropoutF64, c2f::MultiHeadAttention<double>, c2f_test::kWidth, 2, o.causal(true).dropout(0.25).query_block(4).key_block(3));
C2F_LAYER(NaiveMhaDropoutF64, c2f::MultiHeadAttention<double>, c2f_test::kWidth, 4, o.kernel(c2f::AttnKernel::Naive).dropout(0.1).bias(false));
C2F_LAYER(CoarseDropoutF64, c2f::CoarseAttention<double>, c2f_test::kWidth, 2, o.dropout(0.2).query_block(2).key_block(3));
// clang-format on
using TrainEntries = ::testing::Types<LinearF64, MhaF64, CausalMhaDropoutF64, NaiveMhaDropoutF64, CoarseDropoutF64>;
TYPED_TEST_SUITE(FiniteDifferences, TrainEntries, c2f_test::EntryNames);

// B = 2, L = 7 (several blocks of the small ones), without masks and with every mask the layer takes
// (causal and key padding; batch item 1 pads its last two keys).
TYPED_TEST(FiniteDifferences, GradientsEqualCentralDifferences) {
  TestRng rng(46);
  c2f_test::entry_finite_differences<TypeParam>(rng, 7);
}

// Cross-attention with kdim ≠ vdim ≠ embed_dim: dquery, dkey, dvalue and every parameter.
TEST(FiniteDifferencesCross, MultiHeadAttentionKdimVdim) {
  TestRng rng(47);
  using Mha = c2f::MultiHeadAttention<double>;
  Mha mha(8, 2, Mha::Options().kdim(5).vdim(3).query_block(2).key_block(4).dropout(0.2));
  c2f_test::randomize(mha, rng, 0.5);
  const Tensor3<double> q = rng.tensor<double>(2, 5, 8), k = rng.tensor<double>(2, 9, 5),
                        v = rng.tensor<double>(2, 9, 3);
  const Masks<double> masks = Masks<double>().key_padding_mask(c2f::KeyPaddingMask<double>::lengths({9, 4}));
  const auto [y, saved] = mha.forward_train(q, k, v, masks, 3);
  const Tensor3<double> dy = rng.tensor<double>(2, 5, 8);
  const c2f::Grads<double> g = mha.backward(saved, dy);
  const auto loss = [&](const Mha& m, const Tensor3<double>& a, const Tensor3<double>& b, const Tensor3<double>& c) {
    const Tensor3<double> out = m.forward_train(a, b, c, masks, 3).output;
    return (Eigen::Map<const Eigen::ArrayXd>(out.data(), out.size()) *
            Eigen::Map<const Eigen::ArrayXd>(dy.data(), dy.size()))
        .sum();
  };
  double worst = 0;
  const Tensor3<double>* inputs[3] = {&q, &k, &v};
  const Tensor3<double>* grads[3] = {&g.input, &g.key, &g.value};
  for (int which = 0; which < 3; ++which) {
    const Tensor3<double>& in = *inputs[which];
    ASSERT_EQ(grads[which]->dimensions(), in.dimensions());
    worst = std::max(worst, check_central(
                                std::vector<double>(in.data(), in.data() + in.size()),
                                std::vector<double>(grads[which]->data(), grads[which]->data() + in.size()),
                                [&](std::size_t i, double value) {
                                  Tensor3<double> moved[3] = {q, k, v};
                                  moved[which].data()[i] = value;
                                  return loss(mha, moved[0], moved[1], moved[2]);
                                },
                                "input " + std::to_string(which)));
  }
  worst = std::max(worst, check_parameters(mha, g.params, [&](const Mha& other) { return loss(other, q, k, v); }));
  std::cout << "[train] finite differences cross-attention kdim 5 vdim 3: worst ratio " << worst << "\n";
}

// ------------------------------------------------------------------------------------------------
// Dropout

// The kept fraction is 1 − p (over 400,000 draws: within 0.4 %); the decisions are a function of (seed,
// step, row, column) alone.
TEST(Dropout, KeepsOneMinusPOfTheProbabilities) {
  for (double p : {0.1, 0.5}) {
    const kernels::AttnDropout d{p, 17, 3};
    Index kept = 0, total = 0, same_other_step = 0;
    const kernels::AttnDropout other{p, 17, 4};
    for (Index row = 0; row < 400; ++row) {
      const c2f::kernels::impl::DropoutRow r(d, row % 7, row), r2(d, row % 7, row), o(other, row % 7, row);
      for (Index j = 0; j < 1000; ++j) {
        kept += r.keep(j);
        ASSERT_EQ(r.keep(j), r2.keep(j));
        same_other_step += r.keep(j) == o.keep(j);
        ++total;
      }
    }
    EXPECT_NEAR(double(kept) / double(total), 1 - p, 0.004) << "p = " << p;
    EXPECT_LT(double(same_other_step) / double(total), 1 - 2 * p * (1 - p) + 0.01) << "another step, another mask";
  }
  EXPECT_TRUE(c2f::kernels::impl::DropoutRow({0.0, 1, 2}, 0, 0).keep(5));
}

// A layer's dropout: the same bits for 1, 2 and 3 threads and on every call with the same step, output and
// gradients; another step or seed draws another mask; the layer's forward() never drops.
TEST(Dropout, ReproducibleAndIndependentOfTheThreadCount) {
  using Mha = c2f::MultiHeadAttention<float>;
  TestRng rng(48);
  const auto pool_threads = c2f_test::scoped_threads(4);
  Mha mha(16, 4, Mha::Options().dropout(0.1).causal(true).seed(9).query_block(16).key_block(32));
  c2f_test::randomize(mha, rng);
  const Tensor3<float> x = rng.tensor<float>(2, 67, 16), dy = rng.tensor<float>(2, 67, 16);
  mha.set_num_threads(1);
  const auto [y1, s1] = mha.forward_train(x, {}, 5);
  const c2f::Grads<float> g1 = mha.backward(s1, dy);
  for (int threads : {1, 2, 3}) {
    mha.set_num_threads(threads);
    const auto [y, s] = mha.forward_train(x, {}, 5);
    EXPECT_TRUE(c2f_test::same_bits(y, y1)) << threads << " threads";
    const c2f::Grads<float> g = mha.backward(s, dy);
    EXPECT_TRUE(c2f_test::same_bits(g.input, g1.input)) << threads << " threads";
    for (const auto& [key, t] : g.params)
      EXPECT_EQ(t.bytes(), g1.params.at(key).bytes()) << key << ", " << threads << " threads";
  }
  EXPECT_FALSE(c2f_test::same_bits(mha.forward_train(x, {}, 6).output, y1)) << "step 6 drew step 5's mask";
  const Tensor3<float> eval = mha.forward(x);
  EXPECT_FALSE(c2f_test::same_bits(eval, y1));
  Mha reseeded(16, 4, Mha::Options().dropout(0.1).causal(true).seed(10));
  reseeded.load_state_dict(mha.state_dict());
  EXPECT_FALSE(c2f_test::same_bits(reseeded.forward_train(x, {}, 5).output, y1)) << "another seed drew the same mask";
  Mha no_dropout(16, 4, Mha::Options().causal(true).query_block(16).key_block(32));
  no_dropout.load_state_dict(mha.state_dict());
  EXPECT_TRUE(c2f_test::same_bits(no_dropout.forward(x), eval)) << "forward() is eval mode: dropout never applies";
}

TEST(Dropout, OutsideZeroToOneIsRefusedNamingTheLayer) {
  EXPECT_NE(error_of([] {
              c2f::MultiHeadAttention<float>(8, 2, c2f::MultiHeadAttention<float>::Options().dropout(1.0));
            }).find("MultiHeadAttention: dropout must lie in [0, 1), got 1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              c2f::CoarseAttention<float>(8, 2, c2f::CoarseAttention<float>::Options().dropout(-0.1));
            }).find("CoarseAttention: dropout must lie in [0, 1)"),
            std::string::npos);
}

// ------------------------------------------------------------------------------------------------
// Layers at the edges

// A batch item whose keys are all padding, and attention rows that see nothing: zero gradient into those
// query rows (their output is out_proj.bias whatever x is), finite everywhere.
TEST(TrainLayers, RowsWithoutAVisibleKeyGiveZeroInputGradient) {
  using Mha = c2f::MultiHeadAttention<double>;
  TestRng rng(49);
  Mha mha(8, 2, Mha::Options().query_block(4).key_block(4));
  c2f_test::randomize(mha, rng);
  const Tensor3<double> x = rng.tensor<double>(2, 9, 8), dy = rng.tensor<double>(2, 9, 8);
  const Masks<double> masks = Masks<double>().key_padding_mask(c2f::KeyPaddingMask<double>::lengths({9, 0}));
  const auto [y, saved] = mha.forward_train(x, masks);
  const c2f::Grads<double> g = mha.backward(saved, dy);
  const Eigen::Map<const RowMatrix<double>> dx(g.input.data(), 18, 8);
  EXPECT_TRUE(dx.bottomRows(9).isZero(0));
  EXPECT_FALSE(dx.topRows(9).isZero(0));
  for (const auto& [key, t] : g.params) {
    for (double v : t.to_vector<double>()) ASSERT_TRUE(std::isfinite(v)) << key;
  }
}

// ------------------------------------------------------------------------------------------------
// Training utilities

StateDict grads_of(std::initializer_list<std::pair<const char*, std::vector<double>>> tensors) {
  StateDict sd;
  for (const auto& [name, v] : tensors)
    sd.set(name, c2f::TensorData::from_values(v.data(), {static_cast<std::int64_t>(v.size())}));
  return sd;
}

TEST(TrainUtilities, GradNormsAndAccumulation) {
  const StateDict g = grads_of({{"a", {3, 4}}, {"b", {12}}});
  const std::map<std::string, double> norms = c2f::grad_norms(g);
  EXPECT_EQ(norms.at("a"), 5.0);
  EXPECT_EQ(norms.at("b"), 12.0);
  EXPECT_EQ(c2f::total_grad_norm(g), 13.0);
  StateDict sum;
  c2f::accumulate_grads(sum, g);
  c2f::accumulate_grads(sum, g);
  EXPECT_EQ(sum.at("a").to_vector<double>(), (std::vector<double>{6, 8}));
  EXPECT_NE(error_of([&] {
              c2f::accumulate_grads(sum, grads_of({{"a", {1, 2}}}));
            }).find("different names"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              c2f::accumulate_grads(sum, grads_of({{"a", {1}}, {"b", {1}}}));
            }).find("'a' is F64 [2]"),
            std::string::npos);
  StateDict clipped = g;
  EXPECT_EQ(c2f::clip_grad_norm(clipped, 6.5), 13.0);
  EXPECT_NEAR(clipped.at("a").to_vector<double>()[0], 1.5, 1e-6);
  EXPECT_NE(error_of([&] { c2f::clip_grad_norm(clipped, -1); }).find("max_norm must be >= 0"), std::string::npos);
}

// An optimizer step needs exactly the layer's parameters: a missing, unknown or misshapen gradient is
// refused and the layer keeps its parameters. Hyperparameters outside torch's ranges are refused.
TEST(TrainUtilities, OptimizersRefuseBadInput) {
  c2f::Linear<float> layer(4, 3);
  const StateDict before = layer.state_dict();
  c2f::SGD sgd(0.1);
  StateDict missing;
  missing.set("weight", before.at("weight"));
  EXPECT_NE(error_of([&] { sgd.step(layer, missing); }).find("SGD::step: no gradient for the parameter 'bias'"),
            std::string::npos);
  StateDict extra = before;
  extra.set("other", before.at("bias"));
  EXPECT_NE(error_of([&] { sgd.step(layer, extra); }).find("'other' names no parameter"), std::string::npos);
  StateDict misshapen = before;
  misshapen.set("bias", before.at("weight"));
  EXPECT_NE(
      error_of([&] { sgd.step(layer, misshapen); }).find("the gradient 'bias' is F32 [3, 4], the parameter F32 [3]"),
      std::string::npos);
  EXPECT_EQ(layer.state_dict().at("weight").bytes(), before.at("weight").bytes());
  EXPECT_NE(error_of([] { c2f::SGD(-1.0); }).find("SGD: lr must be >= 0"), std::string::npos);
  EXPECT_NE(error_of([] { c2f::SGD(0.1, c2f::SGD::Options().nesterov(true)); }).find("nesterov needs momentum > 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { c2f::AdamW(c2f::AdamW::Options().beta2(1.0)); }).find("AdamW: beta2 must be in [0, 1)"),
            std::string::npos);
}

// forward_train → backward → clip → AdamW, repeated: a CoarseAttention learns to imitate another one's output
// (mean squared error); the loss falls. Every step is a new parameter state, so each saved state is used
// once, before its step.
TEST(TrainUtilities, AdamWStepsReduceTheLoss) {
  using Coarse = c2f::CoarseAttention<double>;
  TestRng rng(50);
  Coarse teacher(8, 2, Coarse::Options().seed(1)), student(8, 2, Coarse::Options().seed(2));
  const Tensor3<double> x = rng.tensor<double>(4, 6, 8), target = teacher.forward(x);
  c2f::AdamW opt(c2f::AdamW::Options().lr(3e-2).weight_decay(0));
  double first = 0, last = 0;
  for (int step = 0; step < 40; ++step) {
    auto [y, saved] = student.forward_train(x);
    Tensor3<double> dy = y - target;
    last = (Eigen::Map<const Eigen::ArrayXd>(dy.data(), dy.size()).square()).mean();
    if (step == 0) first = last;
    dy = dy * dy.constant(2.0 / static_cast<double>(dy.size()));
    c2f::Grads<double> g = student.backward(saved, dy);
    c2f::clip_grad_norm(g.params, 1.0);
    opt.step(student, g.params);
  }
  EXPECT_LT(last, 0.5 * first) << "loss " << first << " -> " << last;
}

}  // namespace
