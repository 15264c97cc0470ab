// Fast kernels against their naive twins on random shapes (awkward sizes included), thread-count
// bit identity, and the masking edge cases every attention kernel must get right.
#include "support/eigen_assert_throws.hpp"

#include "c2f/cpu/score_tile.hpp"
#include "c2f/cpu/small_gemm.hpp"
#include "c2f/cpu/softmax.hpp"
#include "c2f/detail/top_picks.hpp"
#include "c2f/kernels/block2d.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/conv1d.hpp"
#include "c2f/kernels/fine_folded.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "support/attention_problems.hpp"
#include "support/bf16.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace {

using c2f::Index;
using c2f::RowMatrix;
using c2f_test::bitwise_equal;
using c2f_test::expect_close;
using c2f_test::kAwkward;
using c2f_test::Problem;
using c2f_test::random_problem;
using c2f_test::TestRng;
using c2f_test::tolerance;

template <class T>
class KernelTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(KernelTest, Scalars);

TYPED_TEST(KernelTest, LinearMatchesNaiveOnAwkwardShapes) {
  using Scalar = TypeParam;
  TestRng rng(1);
  for (int rep = 0; rep < 30; ++rep) {
    // Some shapes span several row chunks, some (few rows) several column chunks, some both. Every 7th
    // has a right-hand side of more than kPackedWholeColsBytes, which the packed path splits into column
    // chunks below kPackedMinRowTasks row chunks; a smaller one it keeps whole once the rows make more
    // chunks than threads.
    const Index n = rng.pick(kAwkward) + (rep % 3 == 0 ? c2f::kernels::kLinearTaskRows : 0) +
                    (rep % 5 == 0 ? c2f::kernels::kLinearMinRowTasks * c2f::kernels::kLinearTaskRows : 0);
    const Index in = rep % 7 == 6 ? 1031 : rng.pick(kAwkward);
    const Index out = rng.pick(kAwkward) + (rep % 2 == 1 ? c2f::kernels::kLinearTaskCols : 0);
    const bool with_bias = rng.coin();
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(n, in), w = rng.matrix<Scalar>(out, in);
    const c2f::Vector<Scalar> b = rng.matrix<Scalar>(out, 1);
    RowMatrix<Scalar> fast(n, out), naive(n, out), fast2(n, out);
    c2f::kernels::linear<Scalar>(x, w, with_bias ? b.data() : nullptr, fast, c2f::kernels::with_threads(1));
    c2f::kernels::linear<Scalar>(x, w, with_bias ? b.data() : nullptr, fast2, c2f::kernels::with_threads(2));
    c2f::kernels::linear_naive<Scalar>(x, w, with_bias ? b.data() : nullptr, naive);
    std::ostringstream what;
    what << "linear n=" << n << " in=" << in << " out=" << out << " bias=" << with_bias;
    expect_close(fast, naive, tolerance<Scalar>() * std::sqrt(double(in)), tolerance<Scalar>(), what.str());
    EXPECT_TRUE(bitwise_equal(fast, fast2)) << what.str() << ": 1 and 2 threads differ";
  }
}

// c2f::cpu::packed_gemm, the fast path of matmul_rows where the build has FMA vectors, called directly so
// that every build tests it (on its own packets): shapes one either side of the micro-kernel's rows
// (kMR), columns (kNR) and k-block (kKC), primes and 1; column ranges starting at panel boundaries; with
// and without bias. Each element is the same sum whatever the partition: two different partitions of
// the rows and columns give the same bits.
TYPED_TEST(KernelTest, PackedGemmMatchesNaiveOnAwkwardShapes) {
  using Scalar = TypeParam;
  using B = c2f::cpu::GemmBlocking<Scalar>;
  TestRng rng(17);
  const std::vector<Index> rows = {1, 2, B::kMR - 1, B::kMR, B::kMR + 1, 2 * B::kMR + 1, 37, 121};
  const std::vector<Index> depths = {1, 3, 31, B::kKC - 1, B::kKC, B::kKC + 1, 2 * B::kKC + 7};
  const std::vector<Index> widths = {1, B::kNR - 1, B::kNR, B::kNR + 1, 3 * B::kNR + 5, 97};
  for (int rep = 0; rep < 40; ++rep) {
    const Index n = rng.pick(rows), k = rng.pick(depths), out = rng.pick(widths);
    const bool with_bias = rng.coin();
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(n, k), w = rng.matrix<Scalar>(out, k);
    const c2f::Vector<Scalar> b = rng.matrix<Scalar>(out, 1);
    const Scalar* bias = with_bias ? b.data() : nullptr;
    RowMatrix<Scalar> naive(n, out), whole(n, out), split(n, out);
    c2f::kernels::linear_naive<Scalar>(x, w, bias, naive);
    c2f::cpu::PackedB<Scalar> packed;
    packed.pack(w.transpose());
    c2f::cpu::packed_gemm<Scalar>(x.data(), k, n, packed, 0, out, bias, whole.data(), out);
    // The same product in pieces: rows split after r, columns after the panel boundary c.
    const Index r = n / 2, c = std::min<Index>(out, B::kNR * ((out / B::kNR + 1) / 2));
    for (const auto& [r0, nr] : {std::pair<Index, Index>{0, r}, std::pair<Index, Index>{r, n - r}}) {
      if (nr == 0) continue;
      for (const auto& [c0, nc] : {std::pair<Index, Index>{0, c}, std::pair<Index, Index>{c, out - c}}) {
        if (nc > 0) {
          c2f::cpu::packed_gemm<Scalar>(x.data() + r0 * k, k, nr, packed, c0, nc, with_bias ? bias + c0 : nullptr,
                                        split.data() + r0 * out + c0, out);
        }
      }
    }
    std::ostringstream what;
    what << "packed_gemm n=" << n << " k=" << k << " out=" << out << " bias=" << with_bias << " (kMR " << B::kMR
         << ", kNR " << B::kNR << ")";
    expect_close(whole, naive, tolerance<Scalar>() * std::sqrt(double(k)), tolerance<Scalar>(), what.str());
    EXPECT_TRUE(bitwise_equal(whole, split)) << what.str() << ": a different partition gave other bits";
    // A range of B's rows that starts and ends anywhere (inside a k-block: sdpa_streaming's key blocks),
    // accumulated onto the bias-only product: the naive product of those columns of x and w.
    const Index k_begin = rng.uniform_int(0, k - 1), k_end = rng.uniform_int(k_begin + 1, k);
    RowMatrix<Scalar> range_naive(n, out), range(n, out);
    const RowMatrix<Scalar> xs = x.middleCols(k_begin, k_end - k_begin), ws = w.middleCols(k_begin, k_end - k_begin);
    c2f::kernels::linear_naive<Scalar>(xs, ws, bias, range_naive);
    c2f::cpu::packed_gemm_range<Scalar>(x.data(), k, n, packed, 0, 0, 0, out, bias, false, range.data(),
                                        out);  // bias only
    c2f::cpu::packed_gemm_range<Scalar>(x.data() + k_begin, k, n, packed, k_begin, k_end, 0, out, nullptr, true,
                                        range.data(), out);
    expect_close(range, range_naive, tolerance<Scalar>() * std::sqrt(double(k)), tolerance<Scalar>(),
                 what.str() + " rows [" + std::to_string(k_begin) + ", " + std::to_string(k_end) + ")");
    // TransA (sdpa_backward's Pᵀ and dSᵀ): A read in place from its transpose, stored with a row stride
    // wider than A's rows — the bits of the same range with A copied.
    const Index pad = 3;
    RowMatrix<Scalar> xt = RowMatrix<Scalar>::Constant(k, n + pad, Scalar(7)), range_t(n, out);
    xt.leftCols(n) = x.transpose();
    c2f::cpu::packed_gemm_range<Scalar>(x.data(), k, n, packed, 0, 0, 0, out, bias, false, range_t.data(), out);
    c2f::cpu::packed_gemm_range<Scalar, true>(xt.data() + k_begin * (n + pad), n + pad, n, packed, k_begin, k_end, 0,
                                              out, nullptr, true, range_t.data(), out);
    EXPECT_TRUE(bitwise_equal(range_t, range)) << what.str() << ": TransA gave other bits";
  }
}

// The packed right-hand side of an expression that is not a plain matrix (matmul_rows' callers pass
// scaled and transposed blocks) and of a row-major one: the same panels as the matrix it evaluates to.
TYPED_TEST(KernelTest, PackedGemmPacksExpressions) {
  using Scalar = TypeParam;
  TestRng rng(18);
  const RowMatrix<Scalar> x = rng.matrix<Scalar>(45, 70), w = rng.matrix<Scalar>(70, 29);
  RowMatrix<Scalar> want(45, 29), got(45, 29);
  want.noalias() = x * (w * Scalar(0.5));
  c2f::cpu::PackedB<Scalar> packed;
  packed.pack(w * Scalar(0.5));
  c2f::cpu::packed_gemm<Scalar>(x.data(), 70, 45, packed, 0, 29, nullptr, got.data(), 29);
  expect_close(got, want, tolerance<Scalar>() * std::sqrt(70.0), tolerance<Scalar>(), "row-major scaled B");
  packed.pack(w.transpose().transpose());
  c2f::cpu::packed_gemm<Scalar>(x.data(), 70, 45, packed, 0, 29, nullptr, got.data(), 29);
  want.noalias() = x * w;
  expect_close(got, want, tolerance<Scalar>() * std::sqrt(70.0), tolerance<Scalar>(), "row-major B");
  // k = 0: the bias alone.
  const RowMatrix<Scalar> x0(3, 0), w0(0, 5);
  const c2f::Vector<Scalar> b = rng.matrix<Scalar>(5, 1);
  RowMatrix<Scalar> y0(3, 5);
  packed.pack(w0);
  c2f::cpu::packed_gemm<Scalar>(x0.data(), 0, 3, packed, 0, 5, b.data(), y0.data(), 5);
  for (Index i = 0; i < 3; ++i) EXPECT_EQ(RowMatrix<Scalar>(y0.row(i)), RowMatrix<Scalar>(b.transpose()));
}

// conv1d on lengths where it runs on the packed micro-kernel (from kPackedGemmMinRows output rows on, in
// builds with c2f::cpu::kPackedGemm; Eigen's product otherwise), channels either side of a panel: the
// defining sum, and the same bits for 1 and 2 threads.
TYPED_TEST(KernelTest, Conv1dMatchesNaiveOnPanelShapes) {
  using Scalar = TypeParam;
  using B = c2f::cpu::GemmBlocking<Scalar>;
  TestRng rng(19);
  const std::vector<Index> channels = {1, B::kNR - 1, B::kNR, B::kNR + 1, 2 * B::kNR + 3};
  for (int rep = 0; rep < 24; ++rep) {
    const Index groups = rng.pick(std::vector<Index>{1, 1, 2});
    const Index in = groups * rng.pick(channels), out = groups * rng.pick(channels);
    const Index kernel = rng.pick(std::vector<Index>{1, 2, 3, 5});
    const bool causal = rng.coin(0.3);
    const Index padding = causal ? 0 : rng.uniform_int(0, kernel - 1);
    const Index length = rng.pick(std::vector<Index>{32, 33, 127, 129, 300}), batch = rng.uniform_int(1, 2);
    const c2f::kernels::Conv1dShape shape{in, out, kernel, padding, groups, causal};
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(batch * length, in);
    const RowMatrix<Scalar> w = rng.matrix<Scalar>(out, in / groups * kernel);
    const c2f::Vector<Scalar> b = rng.matrix<Scalar>(out, 1);
    const Scalar* bias = rng.coin() ? b.data() : nullptr;
    const RowMatrix<Scalar> taps = c2f::kernels::conv1d_taps(w.data(), shape);
    const Index rows = batch * shape.out_length(length);
    RowMatrix<Scalar> one(rows, out), two(rows, out), naive(rows, out);
    c2f::kernels::conv1d<Scalar>(x, batch, length, shape, taps, bias, one, c2f::kernels::with_threads(1));
    c2f::kernels::conv1d<Scalar>(x, batch, length, shape, taps, bias, two, c2f::kernels::with_threads(2));
    c2f::kernels::conv1d_naive<Scalar>(x, batch, length, shape, w.data(), bias, naive);
    std::ostringstream what;
    what << "conv1d batch=" << batch << " L=" << length << " in=" << in << " out=" << out << " k=" << kernel
         << " padding=" << padding << " groups=" << groups << " causal=" << causal << " bias=" << (bias != nullptr);
    expect_close(one, naive, tolerance<Scalar>() * std::sqrt(double(in * kernel)), tolerance<Scalar>(), what.str());
    EXPECT_TRUE(bitwise_equal(one, two)) << what.str() << ": 1 and 2 threads gave other bits";
  }
}

TYPED_TEST(KernelTest, LinearRejectsMismatchedShapes) {
  using Scalar = TypeParam;
  RowMatrix<Scalar> x(4, 3), w(5, 2), y(4, 5);
  x.setOnes();
  w.setOnes();
  EXPECT_THROW(c2f::kernels::linear<Scalar>(x, w, nullptr, y, c2f::kernels::with_threads(1)), std::invalid_argument);
}

// sdpa_streaming_lse: the output bits of sdpa_streaming, and each row's log-sum-exp of its scaled,
// masked scores (computed here in long double), −inf for a row with no visible key.
TYPED_TEST(KernelTest, StreamingLseIsTheLogSumExpOfTheScores) {
  using Scalar = TypeParam;
  TestRng rng(12);
  for (int rep = 0; rep < 40; ++rep) {
    const Problem<Scalar> p = random_problem<Scalar>(rng, rep);
    c2f::kernels::KernelOptions opt;
    opt.query_block(rng.pick(std::vector<Index>{1, 7, 64})).key_block(rng.pick(std::vector<Index>{1, 5, 32, 300}));
    opt.num_threads(2);
    SCOPED_TRACE(p.description);
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    RowMatrix<Scalar> plain(p.batch * p.lq, p.heads * p.dv), with_lse = plain, lse(p.batch * p.heads, p.lq);
    c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(plain), plan, p.scale(), opt);
    c2f::kernels::sdpa_streaming_lse<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(with_lse), lse, plan, p.scale(), opt);
    EXPECT_TRUE(plain.cwiseEqual(with_lse).all());
    for (Index b = 0; b < p.batch; ++b) {
      for (Index h = 0; h < p.heads; ++h) {
        for (Index i = 0; i < p.lq; ++i) {
          std::vector<long double> s;
          for (Index j = 0; j < p.lk; ++j) {
            const Scalar bias = plan.bias(b, h, i, j);
            if (bias == -std::numeric_limits<Scalar>::infinity()) continue;
            long double dot = 0;
            for (Index c = 0; c < p.dk; ++c) {
              dot += static_cast<long double>(p.q(b * p.lq + i, h * p.dk + c)) * p.k(b * p.lk + j, h * p.dk + c);
            }
            s.push_back(dot * p.scale() + bias);
          }
          const Scalar got = lse(b * p.heads + h, i);
          if (s.empty()) {
            EXPECT_EQ(got, -std::numeric_limits<Scalar>::infinity());
            continue;
          }
          const long double m = *std::max_element(s.begin(), s.end());
          long double sum = 0;
          for (long double v : s) sum += std::exp(v - m);
          const long double want = m + std::log(sum);
          EXPECT_NEAR(got, static_cast<double>(want),
                      1e3 * std::numeric_limits<Scalar>::epsilon() * (1 + std::abs(static_cast<double>(want))))
              << "b=" << b << " h=" << h << " i=" << i;
        }
      }
    }
  }
  RowMatrix<Scalar> wrong(1, 1);
  const Problem<Scalar> p = random_problem<Scalar>(rng, 0);
  RowMatrix<Scalar> out(p.batch * p.lq, p.heads * p.dv);
  EXPECT_THROW(
      c2f::kernels::sdpa_streaming_lse<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(out), wrong, c2f::MaskView<Scalar>(),
                                               p.scale(), c2f::kernels::KernelOptions()),
      std::invalid_argument);
}

TYPED_TEST(KernelTest, StreamingAndSplitKeysMatchNaiveOnRandomShapes) {
  using Scalar = TypeParam;
  TestRng rng(2);
  constexpr int kShapes = 60;
  for (int rep = 0; rep < kShapes; ++rep) {
    const Problem<Scalar> p = random_problem<Scalar>(rng, rep);
    c2f::kernels::KernelOptions opt;
    opt.query_block(rng.pick(std::vector<Index>{1, 7, 16, 64}));
    opt.key_block(rng.pick(std::vector<Index>{1, 5, 32, 64, 300}));
    opt.key_part(rng.pick(std::vector<Index>{1, 3, 16, 33, 64, 1024}));
    opt.num_threads(1);
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    RowMatrix<Scalar> naive(p.batch * p.lq, p.heads * p.dv), fast(p.batch * p.lq, p.heads * p.dv), split = fast;
    c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt);
    c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(fast), plan, p.scale(), opt);
    c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(split), plan, p.scale(), opt);
    std::ostringstream what;
    what << p.description << " query_block=" << opt.query_block() << " key_block=" << opt.key_block()
         << " key_part=" << opt.key_part();
    SCOPED_TRACE(what.str());
    ASSERT_TRUE(fast.allFinite());
    ASSERT_TRUE(split.allFinite());
    expect_close(fast, naive, tolerance<Scalar>(), tolerance<Scalar>(), what.str());
    expect_close(split, naive, tolerance<Scalar>(), tolerance<Scalar>(), what.str() + " (split keys)");
  }
}

// sdpa_streaming's packed path gives a task two query blocks when a head's keys and values take 1 MiB or
// more (kernels::impl::streaming_query_group): the task walks the keys once for both. Every query block's rows get
// the bits of a call on that block's queries alone (one block per task), and the whole matches the naive
// kernel — without a mask, causal, with padded keys, and both. rows_independent puts every build on the
// packed path; 201 queries are blocks of 64, 64, 64 and 9, so the second task holds a short block.
TYPED_TEST(KernelTest, StreamingTasksOfTwoQueryBlocksGiveEachRowItsBitsAlone) {
  using Scalar = TypeParam;
  TestRng rng(41);
  Problem<Scalar> p;
  p.batch = 2;
  p.heads = 2;
  p.lq = 201;
  p.lk = 1100;
  p.dk = p.dv = 128;  // 1100 keys · 256 · 4 bytes ≥ 1 MiB
  p.q = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dk, 2.0);
  p.k = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dk, 2.0);
  p.v = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dv);
  c2f::kernels::KernelOptions opt;
  opt.rows_independent(true).num_threads(2);
  // From 1 MiB of a head's keys and values on: 1024 keys here in float, 512 in double.
  const Index from = static_cast<Index>(c2f::kernels::impl::kStreamingGroupBytes / (sizeof(Scalar) * (p.dk + p.dv)));
  EXPECT_EQ((c2f::kernels::impl::streaming_query_group<Scalar>(opt, p.lq, from - 1, p.dk, p.dv)), 1);
  EXPECT_EQ((c2f::kernels::impl::streaming_query_group<Scalar>(opt, p.lq, from, p.dk, p.dv)), 2);
  ASSERT_EQ((c2f::kernels::impl::streaming_query_group<Scalar>(opt, p.lq, p.lk, p.dk, p.dv)), 2);
  const c2f::KeyPaddingMask<Scalar> pad = c2f::KeyPaddingMask<Scalar>::lengths({1100, 517}), no_pad;
  const c2f::AttnMask<Scalar> no_attn;  // a MaskView refers to its masks: they outlive it
  for (int kind = 0; kind < 4; ++kind) {
    const bool causal = kind % 2 == 1;
    const c2f::MaskView<Scalar> plan(no_attn, kind >= 2 ? pad : no_pad, p.batch, p.heads, p.lq, p.lk, causal);
    const std::string what = std::string(causal ? "causal" : "not causal") + (kind >= 2 ? ", padded keys" : "");
    RowMatrix<Scalar> whole(p.batch * p.lq, p.heads * p.dv), naive = whole;
    c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(whole), plan, p.scale(), opt);
    c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt);
    expect_close(whole, naive, tolerance<Scalar>(), tolerance<Scalar>(), what);
    for (Index first = 0; first < p.lq; first += 64) {
      const Index count = std::min<Index>(64, p.lq - first);
      RowMatrix<Scalar> q(p.batch * count, p.heads * p.dk), alone(p.batch * count, p.heads * p.dv), want = alone;
      for (Index b = 0; b < p.batch; ++b) {
        q.middleRows(b * count, count) = p.q.middleRows(b * p.lq + first, count);
        want.middleRows(b * count, count) = whole.middleRows(b * p.lq + first, count);
      }
      c2f::kernels::sdpa_streaming<Scalar>(
          c2f::kernels::heads_view<const Scalar>(q.data(), p.batch, count, p.heads * p.dk, 0, p.heads, p.dk), p.kv(),
          p.vv(), c2f::kernels::heads_view<Scalar>(alone.data(), p.batch, count, p.heads * p.dv, 0, p.heads, p.dv),
          plan.rows(first, count), p.scale(), opt);
      EXPECT_TRUE((alone.array() == want.array()).all())
          << what << ": queries [" << first << ", " << first + count << ")";
    }
  }
}

// The in-place small products of the folded kernel (cpu/small_gemm.hpp) against Eigen's products:
// every tile shape (rows 1 to 19: the 8-row tiles of an AVX-512 build, the 4-row ones and what is left
// after them; tokens mod 2; columns mod the packet), strided x, a prefetched next run.
TYPED_TEST(KernelTest, SmallProductsMatchEigenProducts) {
  using Scalar = TypeParam;
  TestRng rng(153);
  for (int rep = 0; rep < 80; ++rep) {
    const Index rows = rng.uniform_int(1, 19), n = rng.uniform_int(1, 40), d = rng.uniform_int(1, 70);
    const Index ldx = d + rng.uniform_int(0, 5);
    const RowMatrix<Scalar> q = rng.matrix<Scalar>(rows, d), p = rng.matrix<Scalar>(rows, n);
    const RowMatrix<Scalar> xs = rng.matrix<Scalar>(2 * n, ldx);  // rows [0, n) are the run, [n, 2n) the next one
    const Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> x(xs.data(), n, d, Eigen::OuterStride<>(ldx));
    RowMatrix<Scalar> s(rows, n), o(rows, d);
    c2f::cpu::dot_rows(q.data(), rows, d, xs.data(), ldx, n, s.data(), n, xs.data() + n * ldx, n);
    c2f::cpu::weighted_rows(p.data(), n, rows, n, xs.data(), ldx, d, o.data(), d);
    const RowMatrix<Scalar> s_want = q * x.transpose(), o_want = p * x;
    const std::string what = "rows " + std::to_string(rows) + ", n " + std::to_string(n) + ", d " + std::to_string(d);
    expect_close(s, s_want, tolerance<Scalar>() * 20, tolerance<Scalar>() * 20, what + " scores");
    expect_close(o, o_want, tolerance<Scalar>() * 20, tolerance<Scalar>() * 20, what + " pooled");
  }
}

#if defined(EIGEN_VECTORIZE_AVX512DQ)
// c2f::cpu::predux_many (dot_rows' final sums on AVX-512) gives every packet the bits of Eigen's predux,
// for 1 to 16 packets: a lane mapping or an addition order that differs fails here.
TEST(SmallProducts, ManyLaneSumsHaveTheBitsOfOneAtATime) {
  TestRng rng(171);
  for (int rep = 0; rep < 50; ++rep) {
    for (int count = 1; count <= 16; ++count) {
      alignas(64) float values[16 * 16];
      for (float& v : values) v = static_cast<float>(rng.normal() * std::pow(10.0, rng.uniform_int(-3, 3)));
      __m512 packets[16];
      for (int i = 0; i < count; ++i) packets[i] = _mm512_load_ps(values + 16 * i);
      float sums[16];
      c2f::cpu::predux_many(packets, count, sums);
      for (int i = 0; i < count; ++i) {
        const float want = Eigen::internal::predux(packets[i]);
        EXPECT_EQ(std::memcmp(&sums[i], &want, sizeof(float)), 0)
            << "packet " << i << " of " << count << ": " << sums[i] << " vs " << want;
      }
    }
  }
}
#endif

// chunk_mean adds every block's rows in token order, as its contract says: the bits of a row-by-row sum
// divided by the count, for widths around its register strips (8 packets of columns) and what is left
// after them, on chunk and 2-D grids; chunk_mean_where with a random selection, the same over its kept rows.
TYPED_TEST(KernelTest, BlockMeansAddRowsInTokenOrder) {
  using Scalar = TypeParam;
  TestRng rng(173);
  for (int rep = 0; rep < 24; ++rep) {
    const Index d = rng.pick(std::vector<Index>{1, 7, 16, 17, 63, 64, 65, 127, 128, 129, 130, 300});
    const bool two_d = rng.coin(0.5);
    const c2f::kernels::BlockGrid2D g2{rng.uniform_int(1, 2), rng.uniform_int(1, 9), rng.uniform_int(1, 9),
                                       rng.uniform_int(1, 4), rng.uniform_int(1, 4)};
    const c2f::kernels::ChunkGrid g1{rng.uniform_int(1, 2), rng.uniform_int(1, 40),
                                     rng.pick(std::vector<Index>{1, 3, 8, 33})};
    const Index tokens = two_d ? g2.tokens() : g1.tokens(), blocks = two_d ? g2.blocks() : g1.chunks();
    const Index ldx = d + rng.uniform_int(0, 3);
    const RowMatrix<Scalar> xs = rng.matrix<Scalar>(tokens, ldx);
    const Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> x(xs.data(), tokens, d,
                                                                         Eigen::OuterStride<>(ldx));
    std::vector<char> keep(static_cast<std::size_t>(tokens * 4));
    for (char& k : keep) k = rng.coin(0.7);
    const auto kept = [&](Index c, Index j) { return keep[static_cast<std::size_t>(c * 16 + j) % keep.size()] != 0; };
    RowMatrix<Scalar> mean(blocks, d), mean_where(blocks, d);
    const auto run = [&](const auto& grid) {
      c2f::kernels::chunk_mean<Scalar>(x, grid, mean, c2f::kernels::with_threads(2));
      c2f::kernels::chunk_mean_where<Scalar>(x, grid, kept, mean_where, c2f::kernels::with_threads(2));
      for (Index c = 0; c < blocks; ++c) {
        RowMatrix<Scalar> sum = RowMatrix<Scalar>::Zero(1, d), sum_kept = RowMatrix<Scalar>::Zero(1, d);
        Index n_kept = 0;
        for (Index s = 0, j = 0; s < grid.segments(c); ++s) {
          for (Index r = grid.segment_row(c, s); r < grid.segment_row(c, s) + grid.segment_length(c, s); ++r, ++j) {
            for (Index k = 0; k < d; ++k) sum(0, k) += x(r, k);
            if (!kept(c, j)) continue;
            for (Index k = 0; k < d; ++k) sum_kept(0, k) += x(r, k);
            ++n_kept;
          }
        }
        const std::string what =
            "rep " + std::to_string(rep) + ", block " + std::to_string(c) + ", d " + std::to_string(d);
        const RowMatrix<Scalar> want = sum / static_cast<Scalar>(grid.count(c)), got = mean.row(c);
        EXPECT_TRUE(bitwise_equal(got, want)) << what;
        if (n_kept > 0) {
          const RowMatrix<Scalar> want_kept = sum_kept / static_cast<Scalar>(n_kept), got_kept = mean_where.row(c);
          EXPECT_TRUE(bitwise_equal(got_kept, want_kept)) << what << " (kept tokens)";
        } else {
          EXPECT_TRUE(mean_where.row(c).array().isNaN().all()) << what << " (no kept token)";
        }
      }
    };
    if (two_d) {
      run(g2);
    } else {
      run(g1);
    }
  }
}

// The folded fine-attention kernel (kernels/fine_folded.hpp) with the heads of real layers (1 to 19: the
// 8-row register tiles and what is left after them) on grids of up to a few hundred blocks, so that a
// task holds several consecutive blocks and reads the next one ahead, against its naive twin; 1, 2 and 3
// threads give the same bits. Sequences are one image row of 1 × chunk blocks; some keys are masked.
TYPED_TEST(KernelTest, FoldedAttentionWithManyHeadsAndBlocksMatchesItsTwin) {
  using Scalar = TypeParam;
  TestRng rng(161);
  constexpr Scalar kMasked = -std::numeric_limits<Scalar>::infinity();
  for (int rep = 0; rep < 12; ++rep) {
    const Index chunk = rng.pick(std::vector<Index>{1, 7, 8, 9, 32}), heads = rng.uniform_int(1, 19);
    const Index d = rng.pick(std::vector<Index>{1, 15, 16, 17, 64});
    const c2f::kernels::BlockGrid2D g{rng.uniform_int(1, 2), 1, rng.uniform_int(1, 300), 1, chunk};
    std::ostringstream what;
    what << "rep " << rep << ": batch " << g.batch << ", length " << g.width << ", chunk " << chunk << ", heads "
         << heads << ", d " << d << " (" << g.blocks() << " blocks)";
    SCOPED_TRACE(what.str());
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(g.batch * g.width, d),
                            qk = rng.matrix<Scalar>(g.blocks(), heads * d);
    std::vector<Scalar> bias(static_cast<std::size_t>(g.blocks() * heads * chunk));
    for (Scalar& b : bias) b = rng.coin(0.1) ? kMasked : Scalar(rng.normal());
    const auto bias_fn = [&](Index c, Index h, Index j) {
      return bias[static_cast<std::size_t>((c * heads + h) * chunk + j)];
    };
    RowMatrix<Scalar> pooled[3], mass[3], pooled_naive(g.blocks(), heads * d), mass_naive(g.blocks(), heads);
    for (int threads : {1, 2, 3}) {
      pooled[threads - 1].resize(g.blocks(), heads * d);
      mass[threads - 1].resize(g.blocks(), heads);
      c2f::kernels::fine_attention_folded<Scalar>(x, g, qk, heads, pooled[threads - 1], mass[threads - 1], bias_fn,
                                                  c2f::kernels::with_threads(threads));
    }
    c2f::kernels::fine_attention_folded_naive<Scalar>(x, g, qk, heads, pooled_naive, mass_naive, bias_fn);
    EXPECT_TRUE(bitwise_equal(pooled[0], pooled[1]) && bitwise_equal(pooled[0], pooled[2]) && mass[0] == mass[1] &&
                mass[0] == mass[2])
        << "bits differ between 1, 2 and 3 threads";
    EXPECT_TRUE(mass[0] == mass_naive);
    expect_close(pooled[0], pooled_naive, tolerance<Scalar>() * 2, tolerance<Scalar>() * 2, "pooled");
  }
}

// MaskView::rows(first, count) is the mask of query rows [first, first + count): attention on those rows
// alone gives the rows of the whole problem, for every mask kind (c2f/dist runs kernels on such slices).
TYPED_TEST(KernelTest, MaskViewRowsAreTheRowsOfTheWholeProblem) {
  using Scalar = TypeParam;
  TestRng rng(31);
  const auto check = [&](const Problem<Scalar>& p, const c2f::MaskView<Scalar>& plan, const std::string& what) {
    c2f::kernels::KernelOptions opt;
    opt.num_threads(1);
    RowMatrix<Scalar> whole(p.batch * p.lq, p.heads * p.dv);
    c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(whole), plan, p.scale(), opt);
    const Index first = rng.uniform_int(0, p.lq - 1), count = rng.uniform_int(0, p.lq - first);
    SCOPED_TRACE(what + " rows [" + std::to_string(first) + ", " + std::to_string(first + count) + ")");
    RowMatrix<Scalar> q(p.batch * count, p.heads * p.dk), part(p.batch * count, p.heads * p.dv), want = part;
    for (Index b = 0; b < p.batch; ++b) {
      q.middleRows(b * count, count) = p.q.middleRows(b * p.lq + first, count);
      want.middleRows(b * count, count) = whole.middleRows(b * p.lq + first, count);
    }
    const auto view = [&](auto& m, Index dim) {
      return c2f::kernels::heads_view<std::remove_reference_t<decltype(*m.data())>>(m.data(), p.batch, count,
                                                                                    p.heads * dim, 0, p.heads, dim);
    };
    c2f::kernels::sdpa_naive<Scalar>(view(std::as_const(q), p.dk), p.kv(), p.vv(), view(part, p.dv),
                                     plan.rows(first, count), p.scale(), opt);
    expect_close(part, want, tolerance<Scalar>(), tolerance<Scalar>(), what);
  };
  for (int rep = 0; rep < 40; ++rep) {
    const Problem<Scalar> p = random_problem<Scalar>(rng, rep);
    check(p, c2f::MaskView<Scalar>(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk, rng.coin(0.3)), p.description);
  }
  // Swin's relative position bias on a 5 x 7 grid: a row's bias depends on its grid position.
  Problem<Scalar> p = random_problem<Scalar>(rng, 0);
  p.lq = p.lk = 35;
  p.q = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dk, 2.0);
  p.k = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dk, 2.0);
  p.v = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dv);
  const RowMatrix<Scalar> table = rng.matrix<Scalar>(11 * 13, p.heads, 3.0);
  const c2f::AttnMask<Scalar> bias = c2f::AttnMask<Scalar>::relative_position(table, 5, 7, 6, 7);
  for (int rep = 0; rep < 8; ++rep) {
    check(p, c2f::MaskView<Scalar>(bias, c2f::KeyPaddingMask<Scalar>(), p.batch, p.heads, p.lq, p.lk),
          "relative position");
  }
  const c2f::MaskView<Scalar> plan(bias, c2f::KeyPaddingMask<Scalar>(), p.batch, p.heads, p.lq, p.lk);
  EXPECT_THROW(plan.rows(30, 6), std::invalid_argument);
  EXPECT_THROW(plan.rows(-1, 2), std::invalid_argument);
}

// The split-key kernel reading keys and values stored as half or bfloat16 computes what it computes on
// the same values widened to Scalar first (the conversion is exact; only the code path differs).
TYPED_TEST(KernelTest, SplitKeysReadsNarrowKeysAndValuesExactly) {
  using Scalar = TypeParam;
  TestRng rng(9);
  for (int rep = 0; rep < 12; ++rep) {
    const Problem<Scalar> p = random_problem<Scalar>(rng, rep);
    c2f::kernels::KernelOptions opt;
    opt.key_block(rng.pick(std::vector<Index>{1, 5, 32, 300}));
    opt.key_part(rng.pick(std::vector<Index>{3, 16, 1024}));
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    const RowMatrix<Eigen::bfloat16> kn = p.k.template cast<Eigen::bfloat16>(),
                                     vn = p.v.template cast<Eigen::bfloat16>();
    Problem<Scalar> wide = p;
    wide.k = kn.template cast<Scalar>();
    wide.v = vn.template cast<Scalar>();
    RowMatrix<Scalar> want(p.batch * p.lq, p.heads * p.dv), got = want;
    c2f::kernels::sdpa_split_keys<Scalar>(wide.qv(), wide.kv(), wide.vv(), wide.out_view(want), plan, p.scale(), opt);
    c2f::kernels::sdpa_split_keys<Scalar, Eigen::bfloat16>(
        p.qv(),
        c2f::kernels::heads_view<const Eigen::bfloat16>(kn.data(), p.batch, p.lk, p.heads * p.dk, 0, p.heads, p.dk),
        c2f::kernels::heads_view<const Eigen::bfloat16>(vn.data(), p.batch, p.lk, p.heads * p.dv, 0, p.heads, p.dv),
        p.out_view(got), plan, p.scale(), opt);
    expect_close(got, want, tolerance<Scalar>(), tolerance<Scalar>(), p.description);
  }
}

TYPED_TEST(KernelTest, OutputBitsDoNotDependOnThreadCount) {
  using Scalar = TypeParam;
  TestRng rng(3);
  for (int rep = 0; rep < 10; ++rep) {
    const Problem<Scalar> p = random_problem<Scalar>(rng, rep);
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    c2f::kernels::KernelOptions opt;
    opt.query_block(16);
    opt.key_block(32);
    opt.key_part(16);
    RowMatrix<Scalar> outs[2][3];
    for (int threads = 1; threads <= 2; ++threads) {
      opt.num_threads(threads);
      for (RowMatrix<Scalar>& o : outs[threads - 1]) o.resize(p.batch * p.lq, p.heads * p.dv);
      c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(outs[threads - 1][0]), plan, p.scale(),
                                           opt);
      c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(outs[threads - 1][1]), plan, p.scale(), opt);
      c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(outs[threads - 1][2]), plan, p.scale(),
                                            opt);
    }
    EXPECT_TRUE(bitwise_equal(outs[0][0], outs[1][0])) << p.description << ": streaming kernel";
    EXPECT_TRUE(bitwise_equal(outs[0][1], outs[1][1])) << p.description << ": naive kernel";
    EXPECT_TRUE(bitwise_equal(outs[0][2], outs[1][2])) << p.description << ": split-key kernel";
  }
}

// A query row whose every key is masked outputs zeros (and zero weights) in both kernels; the other
// rows are unaffected.
TYPED_TEST(KernelTest, FullyMaskedRowsGiveZeros) {
  using Scalar = TypeParam;
  TestRng rng(4);
  Problem<Scalar> p;
  p.batch = 2, p.heads = 2, p.lq = 9, p.lk = 70, p.dk = 4, p.dv = 4;
  p.q = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dk);
  p.k = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dk);
  p.v = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dv);
  c2f::BoolTensor2 keep(p.lq, p.lk);
  keep.setConstant(true);
  for (Index j = 0; j < p.lk; ++j) keep(3, j) = false;  // row 3: nothing visible
  p.attn = c2f::AttnMask<Scalar>::keep(keep);
  p.pad = c2f::KeyPaddingMask<Scalar>::lengths({p.lk, 0});  // batch 1: no key at all
  const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
  c2f::kernels::KernelOptions opt;
  opt.key_block(16);
  RowMatrix<Scalar> naive(p.batch * p.lq, p.heads * p.dv), fast(p.batch * p.lq, p.heads * p.dv);
  c2f::Tensor4<Scalar> weights(p.batch, p.heads, p.lq, p.lk);
  c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt, weights.data());
  c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(fast), plan, p.scale(), opt);
  RowMatrix<Scalar> split(p.batch * p.lq, p.heads * p.dv);
  opt.key_part(20);
  c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(split), plan, p.scale(), opt);
  expect_close(split, naive, tolerance<Scalar>(), tolerance<Scalar>(), "fully masked rows (split keys)");
  for (Index b = 0; b < p.batch; ++b) {
    for (Index i = 0; i < p.lq; ++i) {
      const bool empty_row = b == 1 || i == 3;
      const Index r = b * p.lq + i;
      EXPECT_EQ(empty_row, fast.row(r).isZero(0)) << "batch " << b << " row " << i;
      EXPECT_EQ(empty_row, split.row(r).isZero(0)) << "batch " << b << " row " << i;
      EXPECT_EQ(empty_row, naive.row(r).isZero(0)) << "batch " << b << " row " << i;
      for (Index h = 0; h < p.heads; ++h) {
        Scalar sum = 0;
        for (Index j = 0; j < p.lk; ++j) sum += weights(b, h, i, j);
        EXPECT_NEAR(sum, empty_row ? 0.0 : 1.0, 1e-6);
      }
    }
  }
  expect_close(fast, naive, tolerance<Scalar>(), tolerance<Scalar>(), "fully masked rows");
}

// PyTorch issue #127055: a chunked kernel returned NaN when a whole key block was masked though the
// row had visible keys in other blocks. Banded -inf mask: each row sees only a window of keys.
TYPED_TEST(KernelTest, WholeMaskedKeyBlockStaysFinite) {
  using Scalar = TypeParam;
  TestRng rng(5);
  Problem<Scalar> p;
  p.batch = 1, p.heads = 2, p.lq = 100, p.lk = 100, p.dk = 8, p.dv = 8;
  p.q = rng.matrix<Scalar>(p.lq, p.heads * p.dk);
  p.k = rng.matrix<Scalar>(p.lk, p.heads * p.dk);
  p.v = rng.matrix<Scalar>(p.lk, p.heads * p.dv);
  Eigen::Tensor<Scalar, 2, Eigen::RowMajor> band(p.lq, p.lk);
  for (Index i = 0; i < p.lq; ++i) {
    for (Index j = 0; j < p.lk; ++j) {
      band(i, j) = std::abs(i - j) <= 3 ? Scalar(0) : -std::numeric_limits<Scalar>::infinity();
    }
  }
  p.attn = c2f::AttnMask<Scalar>::additive(band);
  const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
  c2f::kernels::KernelOptions opt;
  opt.query_block(8);
  opt.key_block(8);
  RowMatrix<Scalar> naive(p.lq, p.heads * p.dv), fast(p.lq, p.heads * p.dv);
  c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt);
  c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(fast), plan, p.scale(), opt);
  ASSERT_TRUE(fast.allFinite());
  ASSERT_FALSE(fast.isZero(0));
  expect_close(fast, naive, tolerance<Scalar>(), tolerance<Scalar>(), "banded mask");
  RowMatrix<Scalar> split(p.lq, p.heads * p.dv);
  opt.key_part(24);  // most parts hold no visible key of a row
  c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(split), plan, p.scale(), opt);
  ASSERT_TRUE(split.allFinite());
  expect_close(split, naive, tolerance<Scalar>(), tolerance<Scalar>(), "banded mask (split keys)");
}

// Logits of about ±1e4 must not overflow the softmax; the result equals the naive kernel's.
TYPED_TEST(KernelTest, LargeLogitsStayFinite) {
  using Scalar = TypeParam;
  TestRng rng(6);
  Problem<Scalar> p;
  p.batch = 1, p.heads = 1, p.lq = 20, p.lk = 50, p.dk = 4, p.dv = 3;
  p.q = rng.matrix<Scalar>(p.lq, p.dk, 60.0);
  p.k = rng.matrix<Scalar>(p.lk, p.dk, 60.0);
  p.v = rng.matrix<Scalar>(p.lk, p.dv);
  const c2f::MaskView<Scalar> plan;
  c2f::kernels::KernelOptions opt;
  opt.key_block(7);
  RowMatrix<Scalar> naive(p.lq, p.dv), fast(p.lq, p.dv);
  c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt);
  c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(fast), plan, p.scale(), opt);
  const Scalar max_logit = (p.q * p.k.transpose()).cwiseAbs().maxCoeff() / Scalar(2);
  EXPECT_GT(max_logit, Scalar(1000));
  ASSERT_TRUE(fast.allFinite());
  expect_close(fast, naive, 1e-4, 1e-4, "large logits");
  RowMatrix<Scalar> split(p.lq, p.dv);
  opt.key_part(10);
  c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(split), plan, p.scale(), opt);
  ASSERT_TRUE(split.allFinite());
  expect_close(split, naive, 1e-4, 1e-4, "large logits (split keys)");
}

// A NaN in an unmasked input must reach the output, not be hidden as a "masked" row.
TYPED_TEST(KernelTest, NanInVisibleInputPropagates) {
  using Scalar = TypeParam;
  TestRng rng(7);
  Problem<Scalar> p;
  p.batch = 1, p.heads = 1, p.lq = 4, p.lk = 10, p.dk = 4, p.dv = 2;
  p.q = rng.matrix<Scalar>(p.lq, p.dk);
  p.k = rng.matrix<Scalar>(p.lk, p.dk);
  p.v = rng.matrix<Scalar>(p.lk, p.dv);
  p.q(2, 1) = std::numeric_limits<Scalar>::quiet_NaN();
  const c2f::MaskView<Scalar> plan;
  c2f::kernels::KernelOptions opt;
  opt.key_block(3);
  RowMatrix<Scalar> naive(p.lq, p.dv), fast(p.lq, p.dv);
  c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt);
  c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(fast), plan, p.scale(), opt);
  RowMatrix<Scalar> split(p.lq, p.dv);
  opt.key_part(4);
  c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(split), plan, p.scale(), opt);
  for (Index i = 0; i < p.lq; ++i) {
    EXPECT_EQ(i == 2, std::isnan(fast(i, 0))) << "row " << i;
    EXPECT_EQ(i == 2, std::isnan(split(i, 0))) << "row " << i;
    EXPECT_EQ(i == 2, std::isnan(naive(i, 0))) << "row " << i;
  }
}

// NaN and Inf in the keys and values a mask hides change no output bit, on the packed path (which
// KernelOptions::rows_independent takes on every build) as on Eigen's, with key blocks that cross the
// packed values' k-blocks (96) and that do not (256).
TYPED_TEST(KernelTest, NonFiniteKeysBehindTheMaskChangeNoBitOnEitherPath) {
  using Scalar = TypeParam;
  TestRng rng(31);
  Problem<Scalar> p;
  p.batch = 2, p.heads = 2, p.lq = 40, p.lk = 600, p.dk = 8, p.dv = 5;
  p.q = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dk);
  p.k = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dk);
  p.v = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dv);
  p.pad = c2f::KeyPaddingMask<Scalar>::lengths({550, 130});
  const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
  Problem<Scalar> poisoned = p;
  for (Index b = 0; b < p.batch; ++b) {
    for (Index j = b == 0 ? 550 : 130; j < p.lk; j += 3) {
      poisoned.k.row(b * p.lk + j).setConstant(std::numeric_limits<Scalar>::infinity());
      poisoned.v.row(b * p.lk + j)
          .setConstant(j % 2 ? std::numeric_limits<Scalar>::quiet_NaN() : -std::numeric_limits<Scalar>::infinity());
    }
  }
  for (const bool independent : {false, true}) {
    for (const Index bk : {Index(96), Index(256)}) {
      c2f::kernels::KernelOptions opt;
      opt.key_block(bk).rows_independent(independent).num_threads(2);
      RowMatrix<Scalar> clean(p.batch * p.lq, p.heads * p.dv), dirty = clean;
      c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(clean), plan, p.scale(), opt);
      c2f::kernels::sdpa_streaming<Scalar>(poisoned.qv(), poisoned.kv(), poisoned.vv(), poisoned.out_view(dirty), plan,
                                           p.scale(), opt);
      EXPECT_TRUE(bitwise_equal(clean, dirty)) << "rows_independent " << independent << ", key_block " << bk;
    }
  }
}

// The split-key kernel on both sides of its row-by-row limit (kernels::impl::kSplitKeysByRowMaxQueries queries,
// a decode step: every head on each cached row at once; above it head by head): the naive kernel's
// result, with head widths off the packet size, blocks the padding cuts through, and NaN and Inf in the
// hidden keys and values changing no output bit.
TYPED_TEST(KernelTest, SplitKeysRowAndHeadPathsAtTheirLimit) {
  using Scalar = TypeParam;
  TestRng rng(43);
  const Index limit = c2f::kernels::impl::kSplitKeysByRowMaxQueries;
  for (const Index lq : {Index(1), limit - 1, limit, limit + 1, 2 * limit + 1}) {
    Problem<Scalar> p;
    p.batch = 2, p.heads = 3, p.lq = lq, p.lk = 77, p.dk = 11, p.dv = 9;
    p.q = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dk, 2.0);
    p.k = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dk, 2.0);
    p.v = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dv);
    p.pad = c2f::KeyPaddingMask<Scalar>::lengths({58, 77});
    const c2f::MaskView<Scalar> plan(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    Problem<Scalar> poisoned = p;
    for (Index j = 58; j < p.lk; j += 2) {
      poisoned.k.row(j).setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      poisoned.v.row(j).setConstant(j % 4 == 0 ? std::numeric_limits<Scalar>::infinity()
                                               : std::numeric_limits<Scalar>::quiet_NaN());
    }
    c2f::kernels::KernelOptions opt;
    opt.key_block(16).key_part(40).num_threads(2);
    RowMatrix<Scalar> naive(p.batch * p.lq, p.heads * p.dv), clean = naive, dirty = naive;
    c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt);
    c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(clean), plan, p.scale(), opt);
    c2f::kernels::sdpa_split_keys<Scalar>(poisoned.qv(), poisoned.kv(), poisoned.vv(), poisoned.out_view(dirty), plan,
                                          p.scale(), opt);
    const std::string what = "lq " + std::to_string(lq);
    ASSERT_TRUE(clean.allFinite()) << what;
    expect_close(clean, naive, tolerance<Scalar>(), tolerance<Scalar>(), what);
    EXPECT_TRUE(bitwise_equal(clean, dirty)) << what;
  }
}

// Masked keys get exactly zero weight (Eigen 3.4's vectorised exp(-inf) is ~1e-38, not 0): huge values
// behind the mask, e.g. uninitialised padding, must not leak into the output.
TYPED_TEST(KernelTest, MaskedKeysGetExactlyZeroWeight) {
  using Scalar = TypeParam;
  TestRng rng(8);
  Problem<Scalar> p;
  p.batch = 1, p.heads = 1, p.lq = 6, p.lk = 37, p.dk = 4, p.dv = 3;
  p.q = rng.matrix<Scalar>(p.lq, p.dk);
  p.k = rng.matrix<Scalar>(p.lk, p.dk);
  p.v = rng.matrix<Scalar>(p.lk, p.dv);
  p.pad = c2f::KeyPaddingMask<Scalar>::lengths({30});
  const c2f::MaskView<Scalar> plan(p.attn, p.pad, 1, 1, p.lq, p.lk);
  c2f::kernels::KernelOptions opt;
  opt.key_block(16);
  RowMatrix<Scalar> clean(p.lq, p.dv), fast(p.lq, p.dv), naive(p.lq, p.dv);
  opt.key_part(12);
  RowMatrix<Scalar> split_clean(p.lq, p.dv), split(p.lq, p.dv);
  c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(clean), plan, p.scale(), opt);
  c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(split_clean), plan, p.scale(), opt);
  p.v.bottomRows(7).setConstant(std::numeric_limits<Scalar>::max() / 4);  // behind the padding mask
  c2f::Tensor4<Scalar> weights(1, 1, p.lq, p.lk);
  c2f::kernels::sdpa_streaming<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(fast), plan, p.scale(), opt);
  c2f::kernels::sdpa_split_keys<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(split), plan, p.scale(), opt);
  EXPECT_TRUE(bitwise_equal(split_clean, split));
  c2f::kernels::sdpa_naive<Scalar>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt, weights.data());
  EXPECT_TRUE(bitwise_equal(clean, fast));
  expect_close(naive, clean, tolerance<Scalar>(), tolerance<Scalar>(), "naive with garbage behind the mask");
  for (Index i = 0; i < p.lq; ++i) {
    for (Index j = 30; j < p.lk; ++j) EXPECT_EQ(weights(0, 0, i, j), Scalar(0)) << i << ", " << j;
  }
}

TYPED_TEST(KernelTest, MaskShapeErrorsNameBothShapes) {
  using Scalar = TypeParam;
  c2f::BoolTensor2 m(5, 6);
  m.setConstant(true);
  const c2f::AttnMask<Scalar> attn = c2f::AttnMask<Scalar>::keep(m);
  const c2f::KeyPaddingMask<Scalar> none;
  try {
    c2f::MaskView<Scalar> plan(attn, none, 2, 4, 5, 7);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[5, 7]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[5, 6]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(
      (c2f::MaskView<Scalar>(c2f::AttnMask<Scalar>(), c2f::KeyPaddingMask<Scalar>::lengths({3, 8}), 2, 1, 5, 7)),
      std::invalid_argument);  // length 8 > 7 keys
  EXPECT_THROW((c2f::MaskView<Scalar>(c2f::AttnMask<Scalar>(), c2f::KeyPaddingMask<Scalar>::lengths({3}), 2, 1, 5, 7)),
               std::invalid_argument);  // one length for two batches
}

// The softmax's exp micro-kernel (built with -march=native: c2f::cpu::exp_avx512 on AVX-512 CPUs,
// c2f::cpu::exp_avx2 on AVX2 + FMA ones) against the correctly rounded exp (double precision, rounded
// once): relative error within 2^−22 + |x|·2^−23 over the whole range the softmax feeds it (the |x| term
// is the rounding of t = x·log2 e, as large as that of the subtraction that made x), 2 ulp where
// |x| ≤ 1, exactly 1 at 0, exactly 0 for −inf and below, NaN for NaN, inf above FLT_MAX; and
// exp_shifted_sum against its Eigen twin (exp_shifted, then sum) on rows of every tail length, masked
// entries included.
#if C2F_EXP_SIMD
namespace {
float exp_simd(float x) {
#if C2F_EXP_SIMD == 16
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, c2f::cpu::exp_avx512(_mm512_set1_ps(x)));
#else
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, c2f::cpu::exp_avx2(_mm256_set1_ps(x)));
#endif
  return lanes[0];
}

// The kernels' bound on the relative error of exp(x).
double exp_simd_bound(double x) { return std::ldexp(1.0, -22) + std::abs(x) * std::ldexp(1.0, -23); }
}  // namespace
#endif

TEST(ExpSimd, MatchesCorrectlyRoundedExpAndItsEigenTwin) {
  if (c2f::cpu::kExpSimdLanes == 0) GTEST_SKIP() << "this build has no exp micro-kernel (the native build runs it)";
#if C2F_EXP_SIMD
  constexpr float kInf = std::numeric_limits<float>::infinity();
  double worst_ulp = 0.0, worst_of_bound = 0.0;
  // From where both kernels give normal results (AVX2 flushes below 2^−125) to FLT_MAX.
  for (float x = -86.6f; x <= 88.7f; x += 0.00173f) {
    const double want = std::exp(static_cast<double>(x));
    const float got = exp_simd(x), rounded = static_cast<float>(want);
    const double ulp = std::nextafter(rounded, kInf) - rounded;
    if (std::abs(x) <= 1.0f) worst_ulp = std::max(worst_ulp, std::abs(got - want) / ulp);
    worst_of_bound = std::max(worst_of_bound, std::abs(got - want) / want / exp_simd_bound(x));
  }
  EXPECT_LE(worst_ulp, 2.0);
  EXPECT_LE(worst_of_bound, 1.0);
  std::printf("exp micro-kernel (%d lanes): worst error %.2f ulp over [-1, 1], %.2f of the bound over [-86.6, 88.7]\n",
              c2f::cpu::kExpSimdLanes, worst_ulp, worst_of_bound);
  EXPECT_EQ(exp_simd(0.0f), 1.0f);
  EXPECT_EQ(exp_simd(-kInf), 0.0f);
  EXPECT_EQ(exp_simd(-200.0f), 0.0f);
  if (c2f::cpu::kExpSimdLanes == 16) {
    const float subnormal = static_cast<float>(std::exp(-100.0));  // vscalefps keeps subnormal results
    EXPECT_NEAR(exp_simd(-100.0f), subnormal, std::numeric_limits<float>::denorm_min());
    EXPECT_GT(exp_simd(-100.0f), 0.0f);
  } else {
    EXPECT_EQ(exp_simd(-87.0f), 0.0f);  // AVX2: flushed below 2^−125
  }
  const double near_max = std::exp(static_cast<double>(88.72f));  // 2^128 · 0.997: m = 127, still finite
  EXPECT_NEAR(exp_simd(88.72f), near_max, exp_simd_bound(88.72) * near_max);
  EXPECT_EQ(exp_simd(88.8f), kInf);
  EXPECT_EQ(exp_simd(100.0f), kInf);
  EXPECT_EQ(exp_simd(kInf), kInf);
  EXPECT_TRUE(std::isnan(exp_simd(std::numeric_limits<float>::quiet_NaN())));

  TestRng rng(5);
  for (const Index n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 255, 256, 257}) {
    RowMatrix<float> row = rng.matrix<float>(1, n, 4.0);
    for (Index j = 0; j < n; j += 3) row(0, j) = -kInf;
    const float shift = row.maxCoeff() == -kInf ? 0.0f : row.maxCoeff();
    const RowMatrix<float> scores = row;
    RowMatrix<float> twin = row;
    c2f::cpu::exp_shifted(twin.row(0), shift);
    const float twin_sum = twin.sum();
    const float sum = c2f::cpu::exp_shifted_sum(row.row(0), shift);
    for (Index j = 0; j < n; ++j) {
      if (j % 3 == 0) {
        EXPECT_EQ(row(0, j), 0.0f) << "n=" << n << " j=" << j << ": a masked score must give exactly 0";
      } else {
        // The kernel's bound plus 2 ulp for Eigen's exp.
        const double x = static_cast<double>(scores(0, j)) - shift;
        EXPECT_NEAR(row(0, j), twin(0, j), (exp_simd_bound(x) + 2.4e-7) * twin(0, j)) << "n=" << n << " j=" << j;
      }
    }
    EXPECT_NEAR(sum, twin_sum, 1e-6f * twin_sum) << "n=" << n;
  }
  // A row that is not a multiple of the lanes leaves what follows it alone (the masked tail store).
  RowMatrix<float> wide = RowMatrix<float>::Constant(1, 12, 5.0f);
  const float tail_sum = c2f::cpu::exp_shifted_sum(wide.row(0).head(11), 5.0f);
  EXPECT_EQ(tail_sum, 11.0f);
  EXPECT_EQ(wide(0, 10), 1.0f);
  EXPECT_EQ(wide(0, 11), 5.0f);
#endif
}

// The softmax's max kernel (row_max_rows, on the build's packets; row_max for one row) against Eigen's
// maxCoeff, on rows of every tail length around the lanes, with masked (−inf) entries, a row with nothing
// visible and an empty row; several rows at once must give each row's own max.
TEST(RowMax, MatchesMaxCoeffOnEveryTailLength) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  TestRng rng(29);
  for (const Index n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 255, 256, 257}) {
    RowMatrix<float> rows = rng.matrix<float>(4, n + 5, 8.0);
    for (Index j = 0; j < n; j += 3) rows(1, j) = -kInf;
    rows.row(2).head(n).setConstant(-kInf);
    if (n > 2) rows(3, n - 1) = 50.0f;    // the max in the last (tail) lane
    rows.rightCols(5).setConstant(1e9f);  // past the row's end: never read
    const std::string where = "n=" + std::to_string(n);
    for (Index r = 0; r < 4 && n > 0; ++r) {  // (maxCoeff has no empty case: online_softmax_step never asks)
      EXPECT_EQ(c2f::cpu::row_max(rows.row(r).head(n)), rows.row(r).head(n).maxCoeff()) << where << " row " << r;
    }
    float together[4];
    c2f::cpu::row_max_rows<4>(rows.data(), rows.outerStride(), n, together);
    for (Index r = 0; r < 4; ++r) {
      EXPECT_EQ(together[r], n == 0 ? -kInf : rows.row(r).head(n).maxCoeff()) << where << " row " << r;
    }
  }
}

// online_softmax_step passes float rows of a row-major block through the exp kernel kExpRows at a time:
// each row must get the bits it gets alone (a one-row block takes the row-by-row path) — scores, running
// max and sum, alpha — with masked keys, a row with no visible key, a row not seen before (max −inf),
// NaN, a padded row stride and lengths that are not a multiple of the lanes.
TEST(OnlineSoftmaxStep, RowsTakenTogetherGetTheBitsOfEachRowAlone) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  TestRng rng(17);
  for (const Index rows : {1, 2, 3, 4, 5, 8, 9, 13}) {
    for (const Index cols : {1, 7, 8, 16, 17, 255, 256, 257}) {
      RowMatrix<float> scores = rng.matrix<float>(rows, cols + 3, 4.0);
      for (Index j = 0; j < cols; j += 5) scores(rows / 2, j) = -kInf;
      if (rows > 2) scores.row(1).setConstant(-kInf);
      if (rows > 3) scores(3, cols / 2) = std::numeric_limits<float>::quiet_NaN();
      const RowMatrix<float> start_m = rng.matrix<float>(rows, 1, 4.0);
      Eigen::VectorXf m0 = Eigen::Map<const Eigen::VectorXf>(start_m.data(), rows);
      m0[0] = -kInf;  // nothing seen yet
      const Eigen::VectorXf l0 = m0.array().isInf().select(0.0f, m0.array().abs() + 1.0f).matrix();

      RowMatrix<float> together = scores;
      Eigen::VectorXf m = m0, l = l0, alpha = Eigen::VectorXf::Zero(rows);
      Eigen::Block<RowMatrix<float>> block = together.block(0, 0, rows, cols);
      const bool rescale = c2f::cpu::online_softmax_step(block, m, l, alpha);

      RowMatrix<float> alone = scores;
      Eigen::VectorXf m1 = m0, l1 = l0, alpha1 = Eigen::VectorXf::Zero(rows);
      bool rescale_alone = false;
      for (Index r = 0; r < rows; ++r) {
        Eigen::Block<RowMatrix<float>> row = alone.block(r, 0, 1, cols);
        Eigen::VectorBlock<Eigen::VectorXf> mr = m1.segment(r, 1), lr = l1.segment(r, 1), ar = alpha1.segment(r, 1);
        rescale_alone = c2f::cpu::online_softmax_step(row, mr, lr, ar) || rescale_alone;
      }
      const auto same = [](const Eigen::VectorXf& a, const Eigen::VectorXf& b) {
        return std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())) == 0;
      };
      const std::string where = "rows=" + std::to_string(rows) + " cols=" + std::to_string(cols);
      EXPECT_TRUE(bitwise_equal(together, alone)) << where;
      EXPECT_TRUE(same(m, m1)) << where;
      EXPECT_TRUE(same(l, l1)) << where;
      EXPECT_TRUE(same(alpha, alpha1)) << where;
      EXPECT_EQ(rescale, rescale_alone) << where;
    }
  }
}

// The fused online-softmax step (cpu/score_tile.hpp) against the plain one on the same scores: tile
// rows (1, kMR ± 1, a whole tile and a tail), depths (1, 7, 64, 65, kKC), key ranges starting on a later
// panel and ending inside one (1, 15, 16, 17, 31, 33, 100, 256 keys). In a block after others, a row with
// a finite running max and a block max within kStaleMaxSlack of it keeps exp(score − m) — the exp
// kernel's bits on the tile's scores — with alpha 1, m as it was and l + their sum; every other row (none
// seen yet, a block max 10 above m) gets the plain step's bits. In a block that opens every row, the shift
// is the max of the row's first 32 scores: a row whose block max is within the slack of it keeps
// exp(score − shift) with m = the shift, l = their sum and alpha 0; the others get the plain step's bits.
// A row of NaN queries stays NaN; the columns past the range are not written.
TEST(FusedScores, StepKeepsRowsNearTheirMaxAndGivesTheOthersThePlainStep) {
  if (!c2f::cpu::kFusedScores) GTEST_SKIP() << "this build has no fused step (the native AVX-512 build runs it)";
#if C2F_EXP_SIMD == 16
  using B = c2f::cpu::GemmBlocking<float>;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  TestRng rng(67);
  int kept = 0, plain = 0, opened = 0, opened_plain = 0;
  for (const bool opening : {false, true}) {
    for (const Index rows : {Index(1), Index(B::kMR - 1), Index(B::kMR), Index(B::kMR + 1), Index(2 * B::kMR + 5)}) {
      for (const Index depth : {Index(1), Index(7), Index(64), Index(65), B::kKC}) {
        for (const Index nj : {1, 15, 16, 17, 31, 33, 100, 256}) {
          const Index j0 = B::kNR * rng.uniform_int(0, 2), keys = j0 + nj + rng.uniform_int(0, 40), ldq = depth + 3,
                      lds = 260;
          RowMatrix<float> q = rng.matrix<float>(rows, ldq, 1.5);
          if (rows > 3) q(3, 0) = std::numeric_limits<float>::quiet_NaN();
          const RowMatrix<float> k = rng.matrix<float>(keys, depth, 1.5);
          c2f::cpu::PackedB<float> packed;
          packed.pack(k.transpose());
          RowMatrix<float> scores(rows, lds);
          c2f::cpu::packed_gemm_range<float>(q.data(), ldq, rows, packed, 0, depth, j0, nj, nullptr, false,
                                             scores.data(), lds);
          // Each row's running max: none yet, just below its block max (kept), above it (kept), or 10 below
          // (plain); or none on every row (opening).
          Eigen::VectorXf m0(rows), l0(rows);
          for (Index r = 0; r < rows; ++r) {
            const float top = scores.row(r).head(nj).maxCoeff();
            const int kind = opening ? 0 : static_cast<int>(r % 4);
            m0[r] = kind == 0 ? -kInf : kind == 1 ? top - 1.0f : kind == 2 ? top + 3.0f : top - 10.0f;
            l0[r] = kind == 0 ? 0.0f : static_cast<float>(rng.uniform(0.5, 4.0));
          }
          RowMatrix<float> fused = RowMatrix<float>::Constant(rows, lds, 7.0f), want = scores;
          Eigen::VectorXf m = m0, l = l0, alpha = Eigen::VectorXf::Zero(rows);
          const bool opens = (m0.array() == -kInf).all();  // (one row of none yet opens too)
          Eigen::VectorXf lanes(32 * rows);
          const bool rescale = c2f::cpu::fused_online_softmax_step(q.data(), ldq, rows, packed, depth, j0, nj,
                                                                   fused.data(), lds, m, l, alpha, lanes.data());
          Eigen::VectorXf pm = m0, pl = l0, palpha = Eigen::VectorXf::Zero(rows);
          Eigen::Block<RowMatrix<float>> block = want.block(0, 0, rows, nj);
          c2f::cpu::online_softmax_step(block, pm, pl, palpha);
          const std::string where = std::string(opening ? "opening " : "") + "rows=" + std::to_string(rows) +
                                    " depth=" + std::to_string(depth) + " j0=" + std::to_string(j0) +
                                    " nj=" + std::to_string(nj);
          bool any_alpha = false;
          for (Index r = 0; r < rows; ++r) {
            const std::string row = where + " row " + std::to_string(r);
            EXPECT_TRUE((fused.row(r).tail(lds - nj).array() == 7.0f).all()) << row << ": wrote past the keys";
            if (r == 3) {
              EXPECT_TRUE(std::isnan(l[r])) << row << ": NaN queries";
              continue;
            }
            const float shift = opens ? scores.row(r).head(std::min<Index>(nj, 32)).maxCoeff() : m0[r];
            const bool keep =
                std::isfinite(shift) && scores.row(r).head(nj).maxCoeff() <= shift + c2f::cpu::kStaleMaxSlack;
            if (!opens) {
              ASSERT_EQ(keep, r % 4 == 1 || r % 4 == 2) << row;
            }
            if (keep) {
              ++(opens ? opened : kept);
              RowMatrix<float> e = scores.row(r).head(nj);
              const float sum = c2f::cpu::exp_shifted_sum_simd(e.data(), nj, shift);
              EXPECT_TRUE(bitwise_equal(RowMatrix<float>(fused.row(r).head(nj)), e)) << row;
              EXPECT_EQ(m[r], shift) << row;
              EXPECT_EQ(alpha[r], opens ? 0.0f : 1.0f) << row;
              any_alpha = any_alpha || opens;
              EXPECT_NEAR(l[r], l0[r] + sum, 1e-6 * (l0[r] + sum)) << row;
            } else {
              ++(opens ? opened_plain : plain);
              any_alpha = any_alpha || palpha[r] != 1.0f;
              EXPECT_TRUE(
                  bitwise_equal(RowMatrix<float>(fused.row(r).head(nj)), RowMatrix<float>(want.row(r).head(nj))))
                  << row;
              EXPECT_EQ(m[r], pm[r]) << row;
              EXPECT_EQ(l[r], pl[r]) << row;
              EXPECT_EQ(alpha[r], palpha[r]) << row;
            }
          }
          EXPECT_EQ(rescale, any_alpha) << where;
        }
      }
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(plain, 0);
  EXPECT_GT(opened, 0);
  EXPECT_GT(opened_plain, 0);
#endif
}

// sdpa_streaming with the fused step (asserted taken: fp32, enough queries, keys beyond one block) against
// the naive kernel: head widths 1, 17, 64 and kKC (and kKC + 1, which takes the plain step), key counts
// around the 256-key blocks and a prime, no mask, causal, padded keys; and keys whose scores rise along
// the sequence, each block's far above the last (beyond exp's range: kept, they would overflow), which
// the rows must take through the plain step. Two threads give one thread's bits.
TEST(FusedScores, StreamingMatchesNaiveAndRisingScoresStayFinite) {
  using B = c2f::cpu::GemmBlocking<float>;
  TestRng rng(71);
  const c2f::AttnMask<float> no_attn, causal = c2f::AttnMask<float>::causal();
  for (int rep = 0; rep < 14; ++rep) {
    Problem<float> p;
    p.batch = rng.uniform_int(1, 2);
    p.heads = rng.uniform_int(1, 2);
    p.lq = rng.pick(std::vector<Index>{32, 65, 200});
    p.lk = rng.pick(std::vector<Index>{257, 300, 511, 513, 1031});
    p.dk = rep < 4 ? std::vector<Index>{1, 17, B::kKC, B::kKC + 1}[static_cast<std::size_t>(rep)] : Index(64);
    p.dv = rng.pick(std::vector<Index>{1, 33, 64});
    const bool rising = rep % 3 == 2;
    p.q = rng.matrix<float>(p.batch * p.lq, p.heads * p.dk, rising ? 0.0 : 2.0);
    p.k = rng.matrix<float>(p.batch * p.lk, p.heads * p.dk, 2.0);
    p.v = rng.matrix<float>(p.batch * p.lk, p.heads * p.dv);
    if (rising) {  // every score of key j is 3·j/8·√dk·scale⁻¹: +96 from one 256-key block to the next
      p.q.setConstant(1.0f);
      for (Index r = 0; r < p.k.rows(); ++r)
        p.k.row(r).setConstant(0.375f * static_cast<float>(r % p.lk) / std::sqrt(float(p.dk)));
    }
    const bool masked = rng.coin();
    std::vector<Index> lengths = {p.lk - 3, p.lk / 2};
    lengths.resize(static_cast<std::size_t>(p.batch));
    const c2f::KeyPaddingMask<float> pad =
        rng.coin() ? c2f::KeyPaddingMask<float>::lengths(lengths) : c2f::KeyPaddingMask<float>();
    const c2f::MaskView<float> plan(masked ? causal : no_attn, pad, p.batch, p.heads, p.lq, p.lk);
    c2f::kernels::KernelOptions opt;
    EXPECT_EQ((c2f::kernels::impl::streaming_fused<float>(opt, p.lq, p.lk, p.dk)),
              c2f::cpu::kFusedScores && p.dk <= B::kKC);
    RowMatrix<float> naive(p.batch * p.lq, p.heads * p.dv), one = naive, two = naive;
    c2f::kernels::sdpa_naive<float>(p.qv(), p.kv(), p.vv(), p.out_view(naive), plan, p.scale(), opt);
    c2f::kernels::sdpa_streaming<float>(p.qv(), p.kv(), p.vv(), p.out_view(one), plan, p.scale(), opt.num_threads(1));
    c2f::kernels::sdpa_streaming<float>(p.qv(), p.kv(), p.vv(), p.out_view(two), plan, p.scale(), opt.num_threads(2));
    std::ostringstream what;
    what << "lq=" << p.lq << " lk=" << p.lk << " dk=" << p.dk << " dv=" << p.dv << (rising ? " rising" : "")
         << (masked ? " causal" : "") << (pad.is_none() ? "" : " padded");
    ASSERT_TRUE(one.allFinite()) << what.str();
    expect_close(one, naive, tolerance<float>(), tolerance<float>(), what.str());
    EXPECT_TRUE(bitwise_equal(one, two)) << what.str() << ": 1 and 2 threads differ";
  }
}

TEST(KernelWorkspace, StreamingScratchDoesNotGrowWithSequenceLength) {
  c2f::kernels::KernelOptions opt;
  // query_block·dk + query_block·key_block + query_block·dv + 3·query_block floats, whatever the lengths —
  // the queries' part (queries, accumulator, row state) twice once a task takes two query blocks (a head's
  // keys and values of 1 MiB or more, on the packed path: kernels::impl::streaming_query_group)…
  for (Index length : {Index(256), Index(100000), Index(10000000)}) {
    const std::size_t g = length > 256 && c2f::cpu::kPackedGemm ? 2 : 1;
    // (AVX-512 builds: the fused step's 32 lanes per query of a block, cpu/score_tile.hpp.)
    const std::size_t lanes = c2f::cpu::kFusedScores ? 32 * 64 : 0;
    EXPECT_EQ(c2f::kernels::sdpa_streaming_workspace_bytes<float>(opt, 64, 64, length, length),
              sizeof(float) * (g * 64 * 64 + 64 * 256 + g * 64 * 64 + 3 * g * 64 + lanes))
        << length;
  }
  // …and blocks longer than the sequence are the sequence (a query_block of 2^20 on 5 queries).
  opt.query_block(Index(1) << 20);
  // (The rows of scores are padded to whole aligned packets: 7 keys take 8 floats on SSE and AVX, 16 on
  // AVX-512.)
  const Index stride = (7 + EIGEN_MAX_ALIGN_BYTES / 4 - 1) / (EIGEN_MAX_ALIGN_BYTES / 4) * (EIGEN_MAX_ALIGN_BYTES / 4);
  EXPECT_EQ(c2f::kernels::sdpa_streaming_workspace_bytes<float>(opt, 64, 64, 5, 7),
            sizeof(float) * static_cast<std::size_t>(5 * 64 + 5 * stride + 5 * 64 + 3 * 5));
}

// --- bfloat16 products (Compute::BFloat16, cpu/bf16_gemm.hpp) ---------------------------------------

TEST(Bf16Round, NearestEvenWithInfinityAndNaNKept) {
  using c2f::cpu::round_bf16;
  EXPECT_EQ(c2f::cpu::round_bf16(1.0f), 1.0f);
  // 7 stored bits: the neighbours of 1 are 1 and 1 + 2^-7.
  EXPECT_EQ(c2f::cpu::round_bf16(1.0f + 0x1p-8f), 1.0f);                // a tie: to the even neighbour 1
  EXPECT_EQ(c2f::cpu::round_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);  // a tie: to the even neighbour 1 + 2^-6
  EXPECT_EQ(c2f::cpu::round_bf16(1.0f + 0x1p-8f + 0x1p-20f), 1.0f + 0x1p-7f);
  EXPECT_EQ(c2f::cpu::round_bf16(-2.5f), -2.5f);
  EXPECT_EQ(c2f::cpu::round_bf16(std::numeric_limits<float>::max()), std::numeric_limits<float>::infinity());
  EXPECT_EQ(c2f::cpu::round_bf16(-std::numeric_limits<float>::infinity()), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(c2f::cpu::round_bf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(c2f::cpu::round_bf16(0x1p-130f), 0x1p-130f);  // a subnormal that fits in 7 bits stays
}

// TopPicks::offer_row (on AVX-512 builds a vector max per pick) picks what offer() one candidate at a time
// picks, on rows of awkward lengths with ties, NaN, ±inf, the skipped index anywhere (or outside the row)
// and any number of picks. A tie broken to the higher index, a NaN ranked above −inf, a lane past the row
// read, or the skipped candidate picked fails here.
TEST(TopPicks, RowOfferPicksWhatSingleOffersPick) {
  TestRng rng(0x7091);
  const float inf = std::numeric_limits<float>::infinity();
  for (const Index n : {1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 257, 300}) {
    for (int rep = 0; rep < 60; ++rep) {
      std::vector<float> row(static_cast<std::size_t>(n) + 16, 1e30f);  // past n: values that would win
      for (Index j = 0; j < n; ++j) {
        const Index kind = rng.uniform_int(0, 7);
        row[static_cast<std::size_t>(j)] = kind == 4   ? 0.5f
                                           : kind == 5 ? std::numeric_limits<float>::quiet_NaN()
                                           : kind == 6 ? -inf
                                           : kind == 7 ? inf
                                                       : static_cast<float>(rng.uniform(-1.0, 1.0));
      }
      const Index picks = rng.pick(std::vector<Index>{0, 1, 3, 7, 15, 16, 17, n}),
                  skip = rng.pick(std::vector<Index>{-1, 0, n / 2, n - 1, n});
      c2f::detail::TopPicks<float> vector_picks(picks), single_picks(picks);
      vector_picks.clear();
      vector_picks.offer_row(row.data(), n, skip);
      single_picks.clear();
      for (Index j = 0; j < n; ++j) {
        if (j != skip) single_picks.offer(row[static_cast<std::size_t>(j)], j);
      }
      std::vector<Index> got(static_cast<std::size_t>(picks) + 1, -2), want(got);
      vector_picks.write(skip, got.data());
      single_picks.write(skip, want.data());
      EXPECT_EQ(got, want) << "n=" << n << " picks=" << picks << " skip=" << skip;
    }
  }
}

#if C2F_AMX_POSSIBLE
// The vector rounding of the Dot and Tiles engines' operands (bf16_words: vcvtneps2bf16 in a build for a
// CPU with AVX512_BF16, else the integer rounding) gives bf16_bits' bits on every float but a subnormal,
// which the instruction makes a signed zero (the engines' products read subnormal bfloat16 as zero
// anyway). A rounding that truncates, or loses a NaN or the sign, fails here.
__attribute__((target("avx512f,avx512bw"))) void vector_words(const float* x, std::uint16_t* one, std::uint16_t* two) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(one), c2f::cpu::bf16_words(_mm512_loadu_ps(x)));
  _mm512_storeu_si512(two, c2f::cpu::bf16_words(_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)));
}
TEST(Bf16Round, VectorWordsAreTheScalarBits) {
  if (!c2f::cpu::cpu_has_avx512_bf16()) GTEST_SKIP() << "no AVX512_BF16 (nor a CPU for the blocked engines)";
  TestRng rng(0xbf17);
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               1.0f + 0x1p-8f,
                               1.0f + 3 * 0x1p-8f,
                               -(1.0f + 0x1p-8f + 0x1p-20f),
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               -std::numeric_limits<float>::quiet_NaN(),
                               0x1p-126f,
                               -0x1p-126f,
                               0x1p-130f,
                               -0x1p-149f};
  for (int i = 0; i < 4096; ++i) values.push_back(std::ldexp(rng.matrix<float>(1, 1)(0, 0), int(i % 200) - 100));
  values.resize((values.size() + 31) / 32 * 32, 2.0f);
  for (std::size_t at = 0; at < values.size(); at += 32) {
    alignas(64) std::uint16_t one[16], two[32];
    vector_words(&values[at], one, two);
    for (std::size_t j = 0; j < 32; ++j) {
      const float x = values[at + j];
      std::uint16_t want = c2f::cpu::bf16_bits(x);
#if defined(__AVX512BF16__)
      if (std::fpclassify(x) == FP_SUBNORMAL) want = std::signbit(x) ? 0x8000 : 0;
#endif
      if (j < 16) {
        EXPECT_EQ(one[j], want) << "x = " << x;
      }
      EXPECT_EQ(two[j], want) << "x = " << x;
    }
  }
}
#endif

// linear() in bfloat16 on awkward shapes, both engines, against a double product of the rounded operands:
// the products of bfloat16 values are exact in fp32, so the only error is the fp32 summation, bounded by
// 1e-5 · Σ|x w| per element. Forgetting to round an operand misses that bound by 10× at these depths.
TEST(Bf16Gemm, MatchesTheRoundedProductOnAwkwardShapes) {
  TestRng rng(0xbf16);
  c2f_test::on_each_bf16_engine([&](const char* engine) {
    for (int rep = 0; rep < 24; ++rep) {
      Index n = rng.pick(kAwkward), out = rng.pick(std::vector<Index>{1, 15, 16, 17, 31, 32, 33, 100, 129, 513});
      Index k = rng.pick(std::vector<Index>{1, 7, 31, 32, 33, 64, 129, 257, 512});
      // The first reps: a depth whose packed B is split into more than four column tasks, which then share
      // the rounded rows of x (kernels::impl::bf16_split); one, two and three row chunks. On 2 threads the rows
      // are split finer than on 1 (down to 32 rows a task): the bits must not change.
      if (rep < 3) {
        n = std::vector<Index>{65, 129, 257}[static_cast<std::size_t>(rep)], out = 641, k = 3073;
        EXPECT_TRUE(c2f::kernels::impl::bf16_split(n, k, out, 2).rows_shared())
            << "n=" << n << ": the shared rows are not covered";
      }
      const RowMatrix<float> x = rng.matrix<float>(n, k), w = rng.matrix<float>(out, k);
      const Eigen::VectorXf bias = rng.matrix<float>(out, 1);
      const bool with_bias = rng.coin();
      RowMatrix<float> y(n, out), y1(n, out);
      c2f::kernels::KernelOptions o;
      o.compute(c2f::Compute::BFloat16).num_threads(2);
      c2f::kernels::linear<float>(x, w, with_bias ? bias.data() : nullptr, y, o);
      c2f::kernels::linear<float>(x, w, with_bias ? bias.data() : nullptr, y1, o.num_threads(1));
      EXPECT_TRUE(bitwise_equal(y, y1)) << engine << ": 1 and 2 threads differ";
      const Eigen::MatrixXd xr = x.unaryExpr(c2f::cpu::RoundBf16<float>()).cast<double>();
      const Eigen::MatrixXd wr = w.unaryExpr(c2f::cpu::RoundBf16<float>()).cast<double>();
      Eigen::MatrixXd want = xr * wr.transpose();
      if (with_bias) want.rowwise() += bias.cast<double>().transpose();
      const Eigen::MatrixXd bound = (xr.cwiseAbs() * wr.cwiseAbs().transpose()).array() * 1e-5 + 1e-6;
      const Eigen::MatrixXd err = (y.cast<double>() - want).cwiseAbs();
      EXPECT_TRUE((err.array() <= bound.array()).all())
          << engine << " n=" << n << " k=" << k << " out=" << out << ": max error " << err.maxCoeff();
    }
  });
}

// The blocked engines' packing of B from contiguous columns (a transposed row-major weight, keys) and from
// contiguous rows (values) shuffles whole vectors; an expression without direct access is packed value
// by value. Both must give the same VNNI blocks, bit for bit, on awkward shapes with NaN, ±Inf and
// values that round up, and the padding past k and n must be zero. A transposition or interleaving
// error moves values between blocks or lanes and fails here.
TEST(Bf16Gemm, VectorPackingEqualsTheValueByValuePacking) {
  const c2f::Bf16Engine blocked =
      c2f::bf16_engine_available(c2f::Bf16Engine::Tiles) ? c2f::Bf16Engine::Tiles : c2f::Bf16Engine::Dot;
  if (!c2f::bf16_engine_available(blocked)) GTEST_SKIP() << "neither AMX-BF16 nor AVX512_BF16 on this CPU";
  const auto engine_setting = c2f_test::scoped_bf16_engine(blocked);
  TestRng rng(0xbf18);
  for (const Index k : {1, 2, 15, 31, 32, 33, 64, 97}) {
    for (const Index n : {1, 15, 16, 17, 31, 33, 64}) {
      RowMatrix<float> w = rng.matrix<float>(n, k), v = rng.matrix<float>(k, n);
      w(0, 0) = std::numeric_limits<float>::quiet_NaN();
      v(k - 1, n - 1) = -std::numeric_limits<float>::infinity();
      w(n - 1, k - 1) = 1.0f + 3 * 0x1p-8f;  // a tie, rounded up to the even neighbour
      const auto same = [](float x) { return x; };
      c2f::cpu::Bf16PackedB fast, slow;
      for (int layout = 0; layout < 2; ++layout) {
        if (layout == 0) {  // columns contiguous: B = wᵀ
          fast.pack(w.transpose(), 2);
          slow.pack(w.transpose().unaryExpr(same), 1);
        } else {  // rows contiguous: B = v
          fast.pack(v, 2);
          slow.pack(v.unaryExpr(same), 1);
        }
        ASSERT_TRUE(fast.engine() == blocked && slow.engine() == blocked);
        bool equal = true;
        for (Index p = 0; p < (n + 31) / 32; ++p) {
          for (Index t = 0; t < (k + 31) / 32; ++t) {
            equal = equal && std::memcmp(fast.block(t, p), slow.block(t, p), 1024 * sizeof(std::uint16_t)) == 0;
          }
        }
        EXPECT_TRUE(equal) << (layout == 0 ? "columns" : "rows") << " k=" << k << " n=" << n;
      }
    }
  }
}

// The engine choice: Auto follows the rule (Tiles with AMX, Dot on AMD with AVX512_BF16, else the fallback);
// a forced engine is the one a packing and a layer's products then use; an engine the CPU lacks, or a name
// that is none, is refused with what was asked and what is missing.
TEST(Bf16Engines, ForcedChoiceIsUsedAndUnavailableOnesAreRefused) {
  const c2f::Bf16Engine rule = c2f::bf16_engine_rule();
  if (c2f::cpu::cpu_has_amx_bf16()) {
    EXPECT_EQ(rule, c2f::Bf16Engine::Tiles);
  } else if (c2f::cpu::cpu_has_avx512_bf16() && c2f::cpu::cpu_is_amd()) {
    EXPECT_EQ(rule, c2f::Bf16Engine::Dot);
  } else {
    EXPECT_EQ(rule, c2f::Bf16Engine::Fallback);
  }
  {
    const auto setting = c2f_test::scoped_bf16_engine(c2f::Bf16Engine::Auto);
    EXPECT_EQ(c2f::bf16_engine(), rule);
  }
  TestRng rng(0xbf19);
  const RowMatrix<float> w = rng.matrix<float>(40, 70);
  for (c2f::Bf16Engine e : {c2f::Bf16Engine::Fallback, c2f::Bf16Engine::Dot, c2f::Bf16Engine::Tiles}) {
    if (!c2f::bf16_engine_available(e)) {
      std::printf("[bf16] engine %s: not on this CPU, its refusal checked instead\n", c2f::bf16_engine_name(e));
      try {
        c2f::set_bf16_engine(e);
        ADD_FAILURE() << c2f::bf16_engine_name(e) << ": no exception";
      } catch (const std::invalid_argument& err) {
        EXPECT_NE(std::string(err.what()).find(c2f::bf16_engine_name(e)), std::string::npos) << err.what();
        EXPECT_NE(std::string(err.what()).find("lacks"), std::string::npos) << err.what();
      }
      continue;
    }
    const auto setting = c2f_test::scoped_bf16_engine(e);
    EXPECT_EQ(c2f::bf16_engine(), e);
    c2f::cpu::Bf16PackedB packed;
    packed.pack(w.transpose());
    EXPECT_EQ(packed.engine(), e);
    packed.pack(w.transpose(), 1, /*allow_blocked=*/false);
    EXPECT_EQ(packed.engine(), c2f::Bf16Engine::Fallback);
  }
  EXPECT_THROW(c2f::detail::parse_bf16_engine("amx", "C2F_BF16_ENGINE"), std::invalid_argument);
  EXPECT_EQ(c2f::detail::parse_bf16_engine("fallback", "C2F_BF16_ENGINE"), c2f::Bf16Engine::Fallback);
  EXPECT_EQ(c2f::detail::parse_bf16_engine("auto", "C2F_BF16_ENGINE"), c2f::Bf16Engine::Auto);
}

// The Dot engine's product, block by block, on awkward shapes and k ranges (the key blocks of attention:
// k_begin a multiple of 32, k_end one or B's last row), accumulating and with a bias, against a double
// product of the rounded operands within 1e-5 · Σ|a b|; skipped without AVX512_BF16.
TEST(Bf16Engines, DotProductsOnAwkwardRangesMatchTheRoundedProduct) {
  if (!c2f::bf16_engine_available(c2f::Bf16Engine::Dot)) GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  const auto setting = c2f_test::scoped_bf16_engine(c2f::Bf16Engine::Dot);
  TestRng rng(0xbf1a);
  for (int rep = 0; rep < 40; ++rep) {
    const Index rows = rng.pick(std::vector<Index>{1, 7, 8, 9, 31, 33, 64, 97});
    const Index k = rng.pick(std::vector<Index>{1, 2, 31, 32, 33, 64, 95, 160});
    const Index n = rng.pick(std::vector<Index>{1, 15, 16, 17, 31, 32, 33, 64, 97});
    const Index k_begin = rng.pick(std::vector<Index>{0, 32, 64}) % (((k - 1) / 32) * 32 + 32);
    const Index k_end = rng.coin() ? k : std::min(k, k_begin + 32);
    const Index c0 = n > 32 && rng.coin() ? 32 : 0, cols = n - c0;
    const bool accumulate = rng.coin(), with_bias = !accumulate && rng.coin();
    const RowMatrix<float> a = rng.matrix<float>(rows, k_end - k_begin), b = rng.matrix<float>(k, n);
    const Eigen::VectorXf bias = rng.matrix<float>(n, 1);
    RowMatrix<float> c = rng.matrix<float>(rows, cols);
    const RowMatrix<float> c_in = c;
    c2f::cpu::Bf16PackedB packed;
    packed.pack(b);
    ASSERT_EQ(packed.engine(), c2f::Bf16Engine::Dot);
    c2f::cpu::Bf16A pa;
    pa.prepare(a.data(), a.outerStride(), rows, k_end - k_begin, c2f::Bf16Engine::Dot);
    c2f::cpu::bf16_gemm(pa, packed, k_begin, k_end, c0, cols, with_bias ? bias.data() + c0 : nullptr, accumulate,
                        c.data(), c.outerStride());
    const Eigen::MatrixXd ar = a.unaryExpr(c2f::cpu::RoundBf16<float>()).cast<double>();
    const Eigen::MatrixXd br =
        b.block(k_begin, c0, k_end - k_begin, cols).unaryExpr(c2f::cpu::RoundBf16<float>()).cast<double>();
    Eigen::MatrixXd want = ar * br;
    if (accumulate) want += c_in.cast<double>();
    if (with_bias) want.rowwise() += bias.segment(c0, cols).cast<double>().transpose();
    const Eigen::MatrixXd bound = (ar.cwiseAbs() * br.cwiseAbs()).array() * 1e-5 + 1e-6 +
                                  c_in.cast<double>().cwiseAbs().array() * (accumulate ? 1e-6 : 0.0);
    const Eigen::MatrixXd err = (c.cast<double>() - want).cwiseAbs();
    EXPECT_TRUE((err.array() <= bound.array()).all())
        << "rows=" << rows << " k=" << k << " [" << k_begin << ", " << k_end << ") n=" << n << " c0=" << c0
        << (accumulate ? " accumulate" : "") << (with_bias ? " bias" : "") << ": max error " << err.maxCoeff();
  }
}

// sdpa_streaming in bfloat16 against sdpa_naive in bfloat16 on random problems (masks, padding, awkward
// lengths), with one key block and with several. Both round q·scale, k, v and the unnormalised
// probabilities exp(s − running max); the running max differs between key blocks, and the two exps
// differ in their last bits, so a probability may round to the neighbouring bfloat16 value: 2^-8 of it.
// Bound per element: 2^-8 · (P|V|) + 1e-5 (P the probabilities, |V| the rounded values' magnitudes).
// Every engine against the first: the same roundings, only the fp32 sums' order differs (1e-5).
TEST(Bf16Sdpa, StreamingMatchesNaiveAndTheEnginesAgree) {
  TestRng rng(0xbf17);
  for (int rep = 0; rep < 40; ++rep) {
    const c2f_test::Problem<float> p = random_problem<float>(rng, rep);
    const c2f::MaskView<float> mask(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
    c2f::kernels::KernelOptions o;
    o.compute(c2f::Compute::BFloat16).num_threads(2).query_block(rng.pick(std::vector<Index>{16, 64}));
    RowMatrix<float> naive(p.batch * p.lq, p.heads * p.dv), magnitude(naive.rows(), naive.cols());
    c2f::kernels::sdpa_naive<float>(p.qv(), p.kv(), p.vv(), p.out_view(naive), mask, p.scale(), o);
    const RowMatrix<float> abs_v = p.v.unaryExpr(c2f::cpu::RoundBf16<float>()).cwiseAbs();
    c2f::kernels::sdpa_naive<float>(p.qv(), p.kv(), p.view(abs_v, p.lk, p.dv), p.out_view(magnitude), mask, p.scale(),
                                    c2f::kernels::KernelOptions());
    for (Index key_block : {Index(32), Index(4096)}) {
      std::vector<RowMatrix<float>> engines;
      std::vector<std::string> names;
      c2f_test::on_each_bf16_engine([&](const char* engine) {
        engines.emplace_back();
        names.emplace_back(engine);
        RowMatrix<float>& out = engines.back();
        out.resize(naive.rows(), naive.cols());
        c2f::kernels::sdpa_streaming<float>(p.qv(), p.kv(), p.vv(), p.out_view(out), mask, p.scale(),
                                            o.key_block(key_block));
        const RowMatrix<float> bound = magnitude.array() * 0x1p-8f + 1e-5f;
        const RowMatrix<float> err = (out - naive).cwiseAbs();
        EXPECT_TRUE((err.array() <= bound.array()).all())
            << engine << " key_block " << key_block << ", " << p.description << ": max error " << err.maxCoeff();
        RowMatrix<float> one(out.rows(), out.cols());
        c2f::kernels::sdpa_streaming<float>(p.qv(), p.kv(), p.vv(), p.out_view(one), mask, p.scale(), o.num_threads(1));
        o.num_threads(2);
        EXPECT_TRUE(bitwise_equal(out, one)) << engine << ": 1 and 2 threads differ, " << p.description;
      });
      for (std::size_t e = 1; e < engines.size(); ++e) {
        const RowMatrix<float> bound = magnitude.array() * 1e-5f + 1e-6f;
        EXPECT_TRUE(((engines[0] - engines[e]).cwiseAbs().array() <= bound.array()).all())
            << names[e] << " vs " << names[0] << ", key_block " << key_block << ", " << p.description
            << ": max difference " << (engines[0] - engines[e]).cwiseAbs().maxCoeff();
      }
    }
  }
}

// A bfloat16 call rounds: on inputs whose bfloat16 values differ from their floats, its output differs
// from the fp32 one's by far more than fp32 summation order could (else Compute::BFloat16 would be
// silently fp32).
TEST(Bf16Sdpa, RoundsTheOperands) {
  TestRng rng(0xbf18);
  c2f_test::Problem<float> p = random_problem<float>(rng, 0);
  p.batch = 1, p.heads = 1, p.lq = p.lk = 64, p.dk = p.dv = 16;
  p.q = rng.matrix<float>(64, 16), p.k = rng.matrix<float>(64, 16), p.v = rng.matrix<float>(64, 16);
  p.attn = c2f::AttnMask<float>(), p.pad = c2f::KeyPaddingMask<float>();
  const c2f::MaskView<float> mask(p.attn, p.pad, 1, 1, 64, 64);
  RowMatrix<float> fp32(64, 16), bf16(64, 16);
  c2f::kernels::KernelOptions o;
  c2f::kernels::sdpa_streaming<float>(p.qv(), p.kv(), p.vv(), p.out_view(fp32), mask, p.scale(), o);
  c2f::kernels::sdpa_streaming<float>(p.qv(), p.kv(), p.vv(), p.out_view(bf16), mask, p.scale(),
                                      o.compute(c2f::Compute::BFloat16));
  EXPECT_GT((fp32 - bf16).cwiseAbs().maxCoeff(), 1e-4f);
  EXPECT_LT((fp32 - bf16).cwiseAbs().maxCoeff(), 5e-2f);
}

TEST(Bf16Sdpa, DoubleIsRefusedWithTheTypes) {
  TestRng rng(0xbf19);
  const c2f_test::Problem<double> p = random_problem<double>(rng, 0);
  const c2f::MaskView<double> mask(p.attn, p.pad, p.batch, p.heads, p.lq, p.lk);
  RowMatrix<double> out(p.batch * p.lq, p.heads * p.dv);
  c2f::kernels::KernelOptions o;
  o.compute(c2f::Compute::BFloat16);
  try {
    c2f::kernels::sdpa_streaming<double>(p.qv(), p.kv(), p.vv(), p.out_view(out), mask, p.scale(), o);
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("compute BFloat16 needs float queries, keys and values, got double"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
