// Training of Conv1d, C3K2Projection and HMHA (docs/training.md):
//   - the backward kernels against naive twins on random shapes with awkward sizes (1, block − 1, block + 1,
//     primes): conv1d_backward against conv1d_backward_naive; HMHA's three level backwards against
//     sdpa_backward_naive under the dense masks of the definition (support/hmha_dense.hpp); and
//     HMHA::attend_backward against the whole dense backward for random subsets of levels — each with the
//     same bits for 1, 2 and 3 threads;
//   - rows that see no summary (causal level 2, window 0): zero gradients, no NaN; NaN and Inf a causal
//     window hides reach no gradient of the rows that hide them;
//   - every layer against PyTorch's autograd (tests/data/train_hmha, tests/reference/train_hmha.py): the
//     inputs' and parameters' .grad after y.backward(dy), fp64 1e-10, fp32 atol 1e-5 / rtol 5e-6;
//   - central finite differences in double of every input and parameter element;
//   - HMHA's every subset of levels trains: forward_train = forward bit for bit, gradient bits independent
//     of the thread count, the levels forward_train saw kept for backward;
//   - the heap peak of HMHA's forward_train + backward grows linearly in L, no block beyond one [L, E]
//     activation (no [L, L] or [L, L/W] buffer); the same check fails on the dense twin.
// The layer contract's training properties are in test_layer_contract.cpp (the Conv1d, C3K2Projection and
// HMHA entries).
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/attention_problems.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/hmha_dense.hpp"
#include "support/layer_entries.hpp"
#include "support/random.hpp"
#include "support/train_checks.hpp"
#include "tools/malloc_counter.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace {

using c2f::HMHA;
using c2f::HMHALevels;
using c2f::Index;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::Comparison;
using c2f_test::LayerCalls;  // the entries of C2F_LAYER
using c2f_test::meta_index;
using c2f_test::ScalarOf;
using c2f_test::TestRng;

namespace kernels = c2f::kernels;

template <class T>
class TrainHmhaKernel : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(TrainHmhaKernel, Scalars);

/// dq, dk, dv of a level backward.
template <class Scalar>
struct QkvGrads {
  RowMatrix<Scalar> dq, dk, dv;
  bool operator==(const QkvGrads& o) const {
    return c2f_test::bitwise_equal(dq, o.dq) && c2f_test::bitwise_equal(dk, o.dk) && c2f_test::bitwise_equal(dv, o.dv);
  }
};

/// A random HMHA attention problem: sizes, q, k, v (N(0, 1.5²)) and dout.
template <class Scalar>
struct LevelProblem {
  Index batch = 1, length = 1, heads = 1, dim = 1, window = 1;
  bool causal = false;
  RowMatrix<Scalar> q, k, v, dout;
  std::string description() const {
    return "batch=" + std::to_string(batch) + " L=" + std::to_string(length) + " W=" + std::to_string(window) +
           " heads=" + std::to_string(heads) + " dim=" + std::to_string(dim) + (causal ? " causal" : "");
  }
  Scalar scale() const { return kernels::default_scale<Scalar>(dim / heads); }
  kernels::ChunkGrid grid() const { return {batch, length, window}; }
  /// New q, k, v and dout for `length` tokens per batch item.
  void draw(TestRng& rng, Index new_length) {
    length = new_length;
    q = rng.matrix<Scalar>(batch * length, dim, 1.5);
    k = rng.matrix<Scalar>(batch * length, dim, 1.5);
    v = rng.matrix<Scalar>(batch * length, dim);
    dout = rng.matrix<Scalar>(batch * length, dim);
  }
};

/// Sizes around the blocks of the kernels: windows 1 … 64, lengths 1, W ± 1, primes and the query/key blocks
/// of level 3 (kSparseRowBlock ± 1).
template <class Scalar>
LevelProblem<Scalar> random_level_problem(TestRng& rng) {
  LevelProblem<Scalar> p;
  p.heads = rng.pick(std::vector<Index>{1, 2, 3});
  p.dim = p.heads * rng.pick(std::vector<Index>{1, 2, 3, 4});
  p.window = rng.pick(std::vector<Index>{1, 2, 3, 7, 8, 16, 64});
  const Index w = p.window;
  p.batch = rng.uniform_int(1, 3);
  p.causal = rng.coin();
  p.draw(rng, std::max<Index>(1, rng.pick(std::vector<Index>{1, w - 1, w, w + 1, 2 * w + 1, 37, 63, 64, 65, 131})));
  return p;
}

/// kernel(grads, threads) adds a level backward to random starting dq [queries, dim] and dk, dv [key_rows,
/// dim] with 1, 2 and 3 threads — the same bits each time — and twin(grads) adds the dense twin's to the same
/// start: both agree within the precision's tolerance times sqrt(n), and are finite.
template <class Scalar, class Kernel, class Twin>
void expect_level_twin(TestRng& rng, const LevelProblem<Scalar>& p, Index key_rows, Index n, Kernel&& kernel,
                       Twin&& twin, const std::string& what) {
  const QkvGrads<Scalar> start{rng.matrix<Scalar>(p.q.rows(), p.dim), rng.matrix<Scalar>(key_rows, p.dim),
                               rng.matrix<Scalar>(key_rows, p.dim)};
  QkvGrads<Scalar> got = start, want = start;
  kernel(got, 1);
  for (int threads : {2, 3}) {
    QkvGrads<Scalar> other = start;
    kernel(other, threads);
    EXPECT_TRUE(other == got) << what << ": " << threads << " threads differ from 1";
  }
  twin(want);
  const double tol = c2f_test::tolerance<Scalar>() * std::sqrt(static_cast<double>(std::max<Index>(n, 1)));
  c2f_test::expect_close(got.dq, want.dq, tol, tol, what + " dq");
  c2f_test::expect_close(got.dk, want.dk, tol, tol, what + " dk");
  c2f_test::expect_close(got.dv, want.dv, tol, tol, what + " dv");
  EXPECT_TRUE(got.dq.allFinite() && got.dk.allFinite() && got.dv.allFinite()) << what;
}

// ------------------------------------------------------------------------------------------------
// The backward kernels against their twins

// conv1d_backward against the defining sums: groups, kernel sizes, padding and causal padding, lengths
// around the row chunk (kConv1dTaskRows ± 1) and channels around the weight tile (kConv1dGradTile ± 1) now
// and then; dx overwritten and added to; bias and none; 1, 2, 3 threads bit for bit.
TYPED_TEST(TrainHmhaKernel, Conv1dBackwardEqualsTheNaiveTwin) {
  using Scalar = TypeParam;
  TestRng rng(61);
  c2f::set_num_threads(4);
  for (int rep = 0; rep < 40; ++rep) {
    const Index groups = rng.pick(std::vector<Index>{1, 2, 3});
    const std::vector<Index> widths =
        rep % 8 == 0 ? std::vector<Index>{kernels::kConv1dGradTile - 1, kernels::kConv1dGradTile + 1}
                     : std::vector<Index>{1, 2, 3, 5};
    const Index in = groups * rng.pick(widths), out = groups * rng.pick(widths);
    const Index kernel = rng.pick(std::vector<Index>{1, 2, 3, 5, 7});
    const bool causal = rng.coin(0.3);
    const Index padding = causal ? 0 : rng.uniform_int(0, kernel);
    const Index length = std::max<Index>(causal ? 0 : kernel - 2 * padding, 0) +
                         rng.pick(std::vector<Index>{0, 1, 2, 13, 127, 128, 129, 131});
    const Index batch = rng.uniform_int(1, 3);
    const bool bias = rng.coin(), add_dx = rng.coin();
    const kernels::Conv1dShape shape{in, out, kernel, padding, groups, causal};
    const Index out_len = shape.out_length(length);
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(batch * length, in), dy = rng.matrix<Scalar>(batch * out_len, out);
    const RowMatrix<Scalar> w = rng.matrix<Scalar>(out, in / groups * kernel);  // PyTorch's layout
    const RowMatrix<Scalar> taps = kernels::conv1d_taps(w.data(), shape), dx0 = rng.matrix<Scalar>(batch * length, in);
    const std::string what = "rep " + std::to_string(rep) + ": batch=" + std::to_string(batch) +
                             " L=" + std::to_string(length) + " in=" + std::to_string(in) +
                             " out=" + std::to_string(out) + " k=" + std::to_string(kernel) +
                             " padding=" + std::to_string(padding) + " groups=" + std::to_string(groups) +
                             (causal ? " causal" : "") + (add_dx ? " add" : "");
    RowMatrix<Scalar> dx1, dtaps1;
    c2f::Vector<Scalar> db1;
    for (int threads : {1, 2, 3}) {
      RowMatrix<Scalar> dx = add_dx ? dx0 : RowMatrix<Scalar>::Constant(batch * length, in, Scalar(7));
      RowMatrix<Scalar> dtaps = RowMatrix<Scalar>::Constant(taps.rows(), taps.cols(), Scalar(7));
      c2f::Vector<Scalar> db = c2f::Vector<Scalar>::Constant(out, Scalar(7));
      kernels::conv1d_backward<Scalar>(x, batch, length, shape, taps, dy, dx, dtaps, bias ? db.data() : nullptr,
                                       kernels::with_threads(threads), add_dx);
      if (threads == 1) {
        dx1 = dx;
        dtaps1 = dtaps;
        db1 = db;
      } else {
        EXPECT_TRUE(c2f_test::bitwise_equal(dx, dx1) && c2f_test::bitwise_equal(dtaps, dtaps1) && db == db1)
            << what << ": " << threads << " threads differ from 1";
      }
    }
    RowMatrix<Scalar> dx_naive(batch * length, in), dw_naive(w.rows(), w.cols());
    c2f::Vector<Scalar> db_naive(out);
    kernels::conv1d_backward_naive<Scalar>(x, batch, length, shape, w.data(), dy, dx_naive, dw_naive.data(),
                                           db_naive.data());
    if (add_dx) dx_naive += dx0;
    const double tol =
        c2f_test::tolerance<Scalar>() * std::sqrt(static_cast<double>(std::max<Index>(batch * length, 1) * kernel));
    c2f_test::expect_close(dx1, dx_naive, tol, tol, what + " dx");
    const std::vector<Scalar> dw = kernels::conv1d_torch_weight(dtaps1, shape);
    c2f_test::expect_close(RowMatrix<Scalar>(Eigen::Map<const RowMatrix<Scalar>>(dw.data(), w.rows(), w.cols())),
                           dw_naive, tol, tol, what + " dweight");
    if (bias) {
      c2f_test::expect_close(RowMatrix<Scalar>(db1.transpose()), RowMatrix<Scalar>(db_naive.transpose()), tol, tol,
                             what + " dbias");
    }
  }
  c2f::set_num_threads(0);
}

// Level 1's backward against sdpa_backward_naive under the window mask (causal: and t ≤ i).
TYPED_TEST(TrainHmhaKernel, WindowAttentionBackwardEqualsTheDenseTwin) {
  using Scalar = TypeParam;
  TestRng rng(62);
  c2f::set_num_threads(4);
  for (int rep = 0; rep < 40; ++rep) {
    const LevelProblem<Scalar> p = random_level_problem<Scalar>(rng);
    expect_level_twin(
        rng, p, p.k.rows(), std::min(p.length, p.window) * p.dim,
        [&](QkvGrads<Scalar>& g, int threads) {
          kernels::window_attention_backward_add<Scalar>(p.q, p.k, p.v, p.dout, p.grid(), p.heads, g.dq, g.dk, g.dv,
                                                         p.causal, p.scale(), kernels::with_threads(threads));
        },
        [&](QkvGrads<Scalar>& g) {
          c2f_test::dense_attention_backward_add(p.q, p.k, p.v, p.dout, p.batch, p.heads,
                                                 c2f_test::local_keep(p.length, p.window, p.causal), g.dq, g.dk, g.dv);
        },
        "rep " + std::to_string(rep) + " " + p.description());
  }
  c2f::set_num_threads(0);
}

// Causal level 2's backward against sdpa_backward_naive of the queries over the window summaries under the
// mask "summary j before the query's window", with random summaries; window counts around the summary
// block (kSummaryBlock ± 1) now and then.
TYPED_TEST(TrainHmhaKernel, WindowSummaryBackwardEqualsTheDenseTwin) {
  using Scalar = TypeParam;
  TestRng rng(63);
  c2f::set_num_threads(4);
  for (int rep = 0; rep < 40; ++rep) {
    LevelProblem<Scalar> p = random_level_problem<Scalar>(rng);
    if (rep % 4 == 0) {  // m = kSummaryBlock ± 1 or 2·kSummaryBlock + 1 windows, the last one partial or not
      p.window = rng.pick(std::vector<Index>{1, 2, 3});
      p.draw(rng, p.window * rng.pick(std::vector<Index>{kernels::kSummaryBlock - 1, kernels::kSummaryBlock + 1,
                                                         2 * kernels::kSummaryBlock + 1}) -
                      (p.window > 1 ? rng.uniform_int(0, 1) : 0));
    }
    const Index m = p.grid().chunks_per_batch();
    const RowMatrix<Scalar> km = rng.matrix<Scalar>(p.batch * m, p.dim, 1.5),
                            vm = rng.matrix<Scalar>(p.batch * m, p.dim);
    expect_level_twin(
        rng, p, km.rows(), p.length * p.dim,
        [&](QkvGrads<Scalar>& g, int threads) {
          kernels::window_summary_attention_backward_add<Scalar>(p.q, km, vm, p.dout, p.grid(), p.heads, g.dq, g.dk,
                                                                 g.dv, p.scale(), kernels::with_threads(threads));
        },
        [&](QkvGrads<Scalar>& g) {
          c2f_test::dense_attention_backward_add(p.q, km, vm, p.dout, p.batch, p.heads,
                                                 c2f_test::summary_keep(p.length, p.window), g.dq, g.dk, g.dv);
        },
        "rep " + std::to_string(rep) + " m=" + std::to_string(m) + " " + p.description());
  }
  c2f::set_num_threads(0);
}

// Level 3's backward against sdpa_backward_naive under the mask of the log-spaced sets S(i), on lengths
// around its row blocks (kSparseRowBlock ± 1) and primes.
TYPED_TEST(TrainHmhaKernel, SparseGlobalBackwardEqualsTheDenseTwin) {
  using Scalar = TypeParam;
  TestRng rng(64);
  c2f::set_num_threads(4);
  for (int rep = 0; rep < 40; ++rep) {
    LevelProblem<Scalar> p = random_level_problem<Scalar>(rng);
    if (rep % 3 == 0) {
      p.draw(rng, rng.pick(std::vector<Index>{kernels::kSparseRowBlock - 1, kernels::kSparseRowBlock + 1,
                                              2 * kernels::kSparseRowBlock + 1, 257}));
    }
    expect_level_twin(
        rng, p, p.k.rows(), 2 * p.dim,
        [&](QkvGrads<Scalar>& g, int threads) {
          kernels::sparse_global_attention_backward_add<Scalar>(p.q, p.k, p.v, p.dout, p.batch, p.length, p.heads, g.dq,
                                                                g.dk, g.dv, p.causal, p.scale(),
                                                                kernels::with_threads(threads));
        },
        [&](QkvGrads<Scalar>& g) {
          c2f_test::dense_attention_backward_add(p.q, p.k, p.v, p.dout, p.batch, p.heads,
                                                 c2f_test::global_keep(p.length, p.causal), g.dq, g.dk, g.dv);
        },
        "rep " + std::to_string(rep) + " " + p.description());
  }
  c2f::set_num_threads(0);
}

// HMHA::attend_backward — the levels summed, level 2 through the window means (causal: the summary kernel;
// else sdpa_backward on the means, chunk_sum and chunk_mean_backward_add) — against the dense backward of
// the whole definition, for a random subset of levels.
TYPED_TEST(TrainHmhaKernel, AttendBackwardEqualsTheDenseTwin) {
  using Scalar = TypeParam;
  TestRng rng(65);
  c2f::set_num_threads(4);
  for (int rep = 0; rep < 40; ++rep) {
    const LevelProblem<Scalar> p = random_level_problem<Scalar>(rng);
    const HMHALevels levels{rng.coin(0.6), rep % 2 == 0 || rng.coin(0.6), rng.coin(0.6)};
    if (p.dim < 2) continue;  // HMHA's C3K2 projections need embed_dim >= 2
    HMHA<Scalar> hmha(p.dim, p.heads, p.window, typename HMHA<Scalar>::Options().causal(p.causal));
    const std::string what = "rep " + std::to_string(rep) + " " + p.description() + " levels " +
                             std::to_string(levels.local) + std::to_string(levels.cross) +
                             std::to_string(levels.global);
    expect_level_twin(
        rng, p, p.k.rows(), p.length * p.dim,
        [&](QkvGrads<Scalar>& g, int threads) {
          hmha.set_num_threads(threads);
          hmha.attend_backward(p.q, p.k, p.v, p.dout, p.batch, p.length, g.dq, g.dk, g.dv, levels);
        },
        [&](QkvGrads<Scalar>& g) {
          QkvGrads<Scalar> dense;
          c2f_test::hmha_dense_backward(p.q, p.k, p.v, p.dout, p.batch, p.length, p.heads, p.window, p.causal, levels,
                                        dense.dq, dense.dk, dense.dv);
          g.dq += dense.dq;
          g.dk += dense.dk;
          g.dv += dense.dv;
        },
        what);
  }
  c2f::set_num_threads(0);
}

// Causal level 2: the tokens of window 0 see no summary — zero dq from the level, no NaN; the last window's
// summary is seen by no token — zero dk, dv for its tokens. A sequence of one window gets nothing at all.
TEST(TrainHmhaKernelEdges, TokensThatSeeNoSummaryGetZeroGradients) {
  TestRng rng(66);
  for (const Index length : {Index(5), Index(8), Index(21)}) {
    HMHA<double> hmha(8, 2, 8, HMHA<double>::Options().causal(true).levels({false, true, false}));
    const RowMatrix<double> q = rng.matrix<double>(2 * length, 8), k = rng.matrix<double>(2 * length, 8),
                            v = rng.matrix<double>(2 * length, 8), dout = rng.matrix<double>(2 * length, 8);
    RowMatrix<double> dq = RowMatrix<double>::Zero(2 * length, 8), dk = dq, dv = dq;
    hmha.attend_backward(q, k, v, dout, 2, length, dq, dk, dv, hmha.options().levels());
    ASSERT_TRUE(dq.allFinite() && dk.allFinite() && dv.allFinite()) << "L=" << length;
    const Index last = (length - 1) / 8 * 8;  // the first token of the last window
    for (Index b = 0; b < 2; ++b) {
      EXPECT_TRUE(dq.middleRows(b * length, std::min<Index>(8, length)).isZero(0))
          << "L=" << length << ": window 0's dq";
      EXPECT_TRUE(dk.middleRows(b * length + last, length - last).isZero(0) &&
                  dv.middleRows(b * length + last, length - last).isZero(0))
          << "L=" << length << ": the last window's dk, dv";
    }
    if (length > 8) {
      EXPECT_FALSE(dq.isZero(0)) << "L=" << length;
    }
  }
}

// A NaN or Inf in a key or value that a causal window hides from earlier queries reaches none of their
// gradients: every bit of their dq, and every row of the other windows, is the clean run's.
TEST(TrainHmhaKernelEdges, NonFiniteKeysACausalWindowHidesReachNoGradient) {
  TestRng rng(67);
  const Index length = 20, window = 8, dim = 6, heads = 2;
  const kernels::ChunkGrid grid{1, length, window};
  const RowMatrix<float> q = rng.matrix<float>(length, dim), v = rng.matrix<float>(length, dim),
                         dout = rng.matrix<float>(length, dim);
  RowMatrix<float> k = rng.matrix<float>(length, dim);
  const auto run = [&](const RowMatrix<float>& keys, const RowMatrix<float>& values) {
    QkvGrads<float> g{RowMatrix<float>::Zero(length, dim), RowMatrix<float>::Zero(length, dim),
                      RowMatrix<float>::Zero(length, dim)};
    kernels::window_attention_backward_add<float>(q, keys, values, dout, grid, heads, g.dq, g.dk, g.dv, true, 0.5f,
                                                  kernels::with_threads(2));
    return g;
  };
  const QkvGrads<float> clean = run(k, v);
  RowMatrix<float> bad_k = k, bad_v = v;
  bad_k(13, 1) = std::numeric_limits<float>::quiet_NaN();  // window 1 (tokens 8 … 15): token 13
  bad_v.row(11).setConstant(std::numeric_limits<float>::infinity());
  const QkvGrads<float> got = run(bad_k, bad_v);
  EXPECT_TRUE(
      c2f_test::bitwise_equal(RowMatrix<float>(got.dq.middleRows(8, 3)), RowMatrix<float>(clean.dq.middleRows(8, 3))))
      << "queries 8 … 10 hide keys 11 and 13";
  for (Index r : {Index(0), Index(16)}) {
    const Index n = r == 0 ? 8 : 4;
    EXPECT_TRUE(
        c2f_test::bitwise_equal(RowMatrix<float>(got.dq.middleRows(r, n)),
                                RowMatrix<float>(clean.dq.middleRows(r, n))) &&
        c2f_test::bitwise_equal(RowMatrix<float>(got.dk.middleRows(r, n)),
                                RowMatrix<float>(clean.dk.middleRows(r, n))) &&
        c2f_test::bitwise_equal(RowMatrix<float>(got.dv.middleRows(r, n)), RowMatrix<float>(clean.dv.middleRows(r, n))))
        << "the window of token " << r;
  }
  EXPECT_TRUE(got.dq.row(13).array().isNaN().any()) << "query 13 sees its own NaN key";
}

// ------------------------------------------------------------------------------------------------
// Against PyTorch's autograd (tests/data/train_hmha)

/// The level configurations of an hmha fixture: the suffix of its tensors' names and the levels.
const std::vector<std::pair<std::string, HMHALevels>> kLevelConfigs = {{"l1", {true, false, false}},
                                                                       {"l2", {false, true, false}},
                                                                       {"l3", {false, false, true}},
                                                                       {"all", {true, true, true}}};

/// Largest |c2f − torch| per module and precision over the cases run (printed at the end of the suite).
std::map<std::string, double>& worst_per_module() {
  static std::map<std::string, double> worst;
  return worst;
}

template <class Scalar>
void check_train_hmha_case(const nlohmann::json& c) {
  const StateDict sd =
      c2f::load_safetensors(c2f_test::data_path(c.at("files").at(c2f_test::Tolerance<Scalar>::file_key)));
  const std::string module = sd.metadata().at("module");
  const bool causal = sd.metadata().at("causal") == "true";
  Comparison cmp;
  if (module == "conv1d") {
    typename c2f::Conv1d<Scalar>::Options o;
    o.padding(meta_index(sd, "padding"))
        .groups(meta_index(sd, "groups"))
        .bias(sd.metadata().at("bias") == "true")
        .causal(causal);
    c2f::Conv1d<Scalar> conv(meta_index(sd, "in_channels"), meta_index(sd, "out_channels"),
                             meta_index(sd, "kernel_size"), o);
    c2f_test::check_one_input_case<Scalar>(conv, sd, {}, "conv.", cmp);
  } else if (module == "c3k2") {
    c2f::C3K2Projection<Scalar> proj(meta_index(sd, "dim"), meta_index(sd, "heads"),
                                     typename c2f::C3K2Projection<Scalar>::Options().causal(causal));
    c2f_test::check_one_input_case<Scalar>(proj, sd, {}, "c3k2.", cmp);
  } else {
    ASSERT_EQ(module, "hmha");
    HMHA<Scalar> hmha(meta_index(sd, "dim"), meta_index(sd, "heads"), meta_index(sd, "window"),
                      typename HMHA<Scalar>::Options().causal(causal));
    hmha.load_state_dict(sd, "hmha.");
    const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x"), dy = c2f_test::tensor3<Scalar>(sd, "grad_output");
    for (const auto& [config, levels] : kLevelConfigs) {
      hmha.set_levels(levels);
      for (int threads : {1, 2}) {
        hmha.set_num_threads(threads);
        const auto [y, saved] = hmha.forward_train(x);
        const c2f::Grads<Scalar> g = hmha.backward(saved, dy);
        const std::string what = config + " threads " + std::to_string(threads);
        cmp.check(y, sd, "output." + config, what);
        cmp.check(g.input, sd, "grad." + config + ".input", what);
        cmp.template check_params<Scalar>(g.params, sd, config + ".hmha.", what);
      }
    }
  }
  double& worst = worst_per_module()[module + " " + c2f_test::Tolerance<Scalar>::file_key];
  worst = std::max(worst, cmp.max_diff);
  std::cout << "[train_hmha] " << c.at("name").get<std::string>() << " " << c2f_test::Tolerance<Scalar>::file_key
            << ": max |c2f - torch| " << cmp.max_diff << "; at most " << cmp.max_share << " of the tolerance, at "
            << cmp.worst << " (largest so far for " << module << ": " << worst << ")\n";
}

C2F_FIXTURE_TEST(TrainHmhaFixture, MatchesPyTorch, "train_hmha", check_train_hmha_case);

// The cases the issue asks for: L = 1, windows ± 1, partial windows, B = 3, causal and not, every module.
TEST(TrainHmhaFixtures, CoverTheRequiredShapes) {
  std::map<std::string, int> modules;
  bool l1 = false, window_minus = false, window_plus = false, partial = false, batch3 = false, causal = false,
       plain = false;
  for (const nlohmann::json& c : c2f_test::manifest_cases("train_hmha")) {
    const std::string module = c.at("module");
    ++modules[module];
    if (module != "hmha") continue;
    const Index L = std::stoll(c.at("seq_len").get<std::string>()), W = std::stoll(c.at("window").get<std::string>());
    l1 = l1 || L == 1;
    window_minus = window_minus || L == W - 1;
    window_plus = window_plus || L == W + 1;
    partial = partial || (L > W && L % W != 0);
    batch3 = batch3 || c.at("batch") == "3";
    (c.at("causal") == "true" ? causal : plain) = true;
  }
  EXPECT_GE(modules["conv1d"], 4);
  EXPECT_GE(modules["c3k2"], 4);
  EXPECT_GE(modules["hmha"], 10);
  EXPECT_TRUE(l1 && window_minus && window_plus && partial && batch3 && causal && plain);
}

// ------------------------------------------------------------------------------------------------
// Finite differences, independent of the fixtures (double)

template <class E>
class FiniteDifferencesHmha : public ::testing::Test {};

// clang-format off
C2F_LAYER(Conv1dF64, c2f::Conv1d<double>, c2f_test::kWidth, 6, 3, o.groups(2).padding(1));
C2F_LAYER(CausalConv1dF64, c2f::Conv1d<double>, c2f_test::kWidth, 4, 5, o.causal(true));
C2F_LAYER(Conv1dK5NoBiasF64, c2f::Conv1d<double>, c2f_test::kWidth, 6, 5, o.bias(false));
C2F_LAYER(C3K2F64, c2f::C3K2Projection<double>, c2f_test::kWidth, 2, o);
C2F_LAYER(CausalC3K2F64, c2f::C3K2Projection<double>, c2f_test::kWidth, 2, o.causal(true));
C2F_LAYER(HmhaF64, c2f::HMHA<double>, c2f_test::kWidth, 2, 3, o);
C2F_LAYER(CausalHmhaF64, c2f::HMHA<double>, c2f_test::kWidth, 2, 3, o.causal(true));
C2F_LAYER(HmhaCrossOnlyF64, c2f::HMHA<double>, c2f_test::kWidth, 2, 2, o.levels({false, true, false}));
C2F_LAYER(CausalHmhaLocalGlobalF64, c2f::HMHA<double>, c2f_test::kWidth, 4, 4, o.causal(true).levels({true, false, true}));
// clang-format on
using HmhaTrainEntries = ::testing::Types<Conv1dF64, CausalConv1dF64, Conv1dK5NoBiasF64, C3K2F64, CausalC3K2F64,
                                          HmhaF64, CausalHmhaF64, HmhaCrossOnlyF64, CausalHmhaLocalGlobalF64>;
TYPED_TEST_SUITE(FiniteDifferencesHmha, HmhaTrainEntries, c2f_test::EntryNames);

// B = 2 at L = 7 (windows of 2 … 4: partial last windows; a kernel of 5 without padding: L_out = 3) and L = 1.
TYPED_TEST(FiniteDifferencesHmha, GradientsEqualCentralDifferences) {
  using Layer = typename TypeParam::Layer;
  TestRng rng(68);
  Layer layer = TypeParam::make(typename TypeParam::Options().seed(5).num_threads(2));
  c2f_test::randomize(layer, rng, 0.5);
  double worst = 0;
  for (const Index length : {Index(7), Index(1)}) {
    const Tensor3<double> x = rng.tensor<double>(2, length, c2f_test::kWidth);
    worst = std::max(worst, c2f_test::finite_difference_check<TypeParam>(layer, x, {}, rng));
  }
  std::cout << "[train_hmha] finite differences " << TypeParam::name
            << ": worst |fd - g| / (1e-5 + 1e-3 |fd|) = " << worst << "\n";
}

// ------------------------------------------------------------------------------------------------
// HMHA's levels

// Every subset of the levels, causal and not: forward_train has forward's bits, the gradients the same bits
// for 1, 2 and 3 threads; backward uses the levels forward_train saw, whatever set_levels() did since.
TEST(TrainHmhaLayer, EverySubsetOfLevelsTrains) {
  TestRng rng(69);
  const Tensor3<float> x = rng.tensor<float>(2, 29, 8), dy = rng.tensor<float>(2, 29, 8);
  for (const bool causal : {false, true}) {
    HMHA<float> hmha(8, 2, 4, HMHA<float>::Options().causal(causal));
    c2f_test::randomize(hmha, rng);
    for (int mask = 0; mask < 8; ++mask) {
      const HMHALevels levels{(mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0};
      const std::string what = std::string(causal ? "causal" : "non-causal") + " levels " + std::to_string(mask);
      hmha.set_levels(levels);
      hmha.set_num_threads(1);
      const auto [y, saved] = hmha.forward_train(x);
      EXPECT_TRUE(c2f_test::same_bits(y, hmha.forward(x))) << what;
      const c2f::Grads<float> one = hmha.backward(saved, dy);
      EXPECT_TRUE(c2f_test::same_bits(one.input, hmha.backward(saved, dy).input)) << what;
      for (int threads : {2, 3}) {
        hmha.set_num_threads(threads);
        const c2f::Grads<float> g = hmha.backward(hmha.forward_train(x).saved, dy);
        EXPECT_TRUE(c2f_test::same_bits(g.input, one.input)) << what << ", " << threads << " threads";
        for (const auto& [key, t] : g.params) EXPECT_EQ(t.bytes(), one.params.at(key).bytes()) << what << " " << key;
      }
      hmha.set_levels({!levels.local, !levels.cross, !levels.global});
      EXPECT_TRUE(c2f_test::same_bits(hmha.backward(saved, dy).input, one.input)) << what << ": the saved levels";
      if (mask == 0) {
        EXPECT_TRUE(Eigen::Map<const Eigen::ArrayXf>(one.input.data(), one.input.size()).isZero(0))
            << "no level: y = out_proj.bias";
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Memory: forward_train + backward of HMHA

struct Measured {
  long long peak, largest;
};

/// The heap held at once at the peak of run() and its largest block, from an empty scratch cache.
Measured measure(const std::function<void()>& run) {
  c2f::release_scratch_cache();
  c2f_memory::reset();
  run();
  c2f_memory::stop();
  return {c2f_memory::peak_bytes(), c2f_memory::largest_allocation()};
}

constexpr Index kMemoryEmbed = 64, kMemoryWindow = 16;

/// forward_train + backward of HMHA (E = 64, 2 heads, window 16, every level, B = 1, float, 2 threads) at
/// `length`, its layer and inputs made beforehand.
std::function<void()> hmha_training(bool causal, Index length) {
  const HMHA<float> hmha(kMemoryEmbed, 2, kMemoryWindow, HMHA<float>::Options().causal(causal).num_threads(2));
  TestRng rng(70);
  const Tensor3<float> x = rng.tensor<float>(1, length, kMemoryEmbed), dy = rng.tensor<float>(1, length, kMemoryEmbed);
  return [hmha, x, dy, length] {
    const auto [y, saved] = hmha.forward_train(x);
    const c2f::Grads<float> g = hmha.backward(saved, dy);
    EXPECT_EQ(g.input.dimension(1), length);
  };
}

/// The same step on the dense twin: hmha_dense and hmha_dense_backward on given projections ([L, L] masks
/// and probabilities).
std::function<void()> dense_twin_training(bool causal, Index length) {
  TestRng rng(71);
  const RowMatrix<float> q = rng.matrix<float>(length, kMemoryEmbed), k = rng.matrix<float>(length, kMemoryEmbed),
                         v = rng.matrix<float>(length, kMemoryEmbed), dout = rng.matrix<float>(length, kMemoryEmbed);
  return [q, k, v, dout, causal, length] {
    const RowMatrix<float> o = c2f_test::hmha_dense(q, k, v, 1, length, 2, kMemoryWindow, causal, HMHALevels{});
    RowMatrix<float> dq, dk, dv;
    c2f_test::hmha_dense_backward(q, k, v, dout, 1, length, 2, kMemoryWindow, causal, HMHALevels{}, dq, dk, dv);
    EXPECT_EQ(o.rows() + dq.rows(), 2 * length);
  };
}

/// From `short_length` to 4× it the peak grows about 4× (16× would be quadratic) and the largest block is at
/// most one [L, E] activation: an [L, L / W] block (L / W = 512 > E at the long length) or an [L, L] one fails.
/// Prints the bytes per token.
void expect_linear_training_memory(const std::function<std::function<void()>(bool, Index)>& step, const char* what,
                                   Index short_length) {
  constexpr long long align = std::max<long long>(EIGEN_MAX_ALIGN_BYTES, c2f::detail::kScratchAlign);
  for (const bool causal : {false, true}) {
    const Index long_length = 4 * short_length;
    const Measured small = measure(step(causal, short_length)), large = measure(step(causal, long_length));
    const double ratio = double(large.peak) / double(small.peak);
    std::cout << "[memory] " << what << (causal ? " causal" : "") << " forward_train + backward, E=" << kMemoryEmbed
              << " H=2 W=" << kMemoryWindow << " B=1 float: L=" << short_length << " " << small.peak / short_length
              << " bytes/token, L=" << long_length << " " << large.peak / long_length << " bytes/token (peak "
              << large.peak << " bytes, largest block " << large.largest << ")\n";
    EXPECT_GT(ratio, 3.0) << what;
    EXPECT_LT(ratio, 4.5) << what << (causal ? " causal" : "") << ": the peak grew " << ratio << "x for 4x the length";
    EXPECT_LE(large.largest, long_length * kMemoryEmbed * static_cast<long long>(sizeof(float)) + align)
        << what << (causal ? " causal" : "") << ": a block of " << large.largest << " bytes at L=" << long_length;
  }
}

class TrainHmhaMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!c2f_memory::available()) GTEST_SKIP() << "malloc counting is unavailable under sanitizers";
  }
};

TEST_F(TrainHmhaMemory, PeakIsLinearInLength) { expect_linear_training_memory(hmha_training, "HMHA", 2048); }

// The same check on the dense twin, which holds [L, L] masks and probabilities: it must fail. Disabled: the
// ctest train_hmha.catches_dense_memory runs it and passes only when it fails.
TEST_F(TrainHmhaMemory, DISABLED_PeakCheckCatchesTheDenseTwin) {
  expect_linear_training_memory(dense_twin_training, "dense twin", 128);
}

}  // namespace
