// Conv1d, C3K2Projection and HMHA (the C3K2/HMHA article): PyTorch fixtures from a dense formulation, the fast
// kernels against their naive twins, the metamorphic full-attention case, and the layers' contracts.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/bf16.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/hmha_dense.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

namespace {

using c2f::HMHA;
using c2f::Index;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::expect_close;
using c2f_test::meta_index;
using c2f_test::randomize;
using c2f_test::TestRng;
using c2f_test::Tolerance;

template <class T>
class HmhaTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(HmhaTyped, Scalars);

// ------------------------------------------------------------------------------------------------
// PyTorch fixtures

template <class Scalar>
void check_conv_case(const nlohmann::json& c) {
  const std::string name = c.at("name");
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path(c.at("files").at(Tolerance<Scalar>::file_key)));
  const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x");
  const std::vector<Scalar> want = c2f_test::values<Scalar>(sd, "output");
  Tensor3<Scalar> y;
  for (int threads : {1, 2}) {
    if (sd.metadata().at("module") == "conv1d") {
      typename c2f::Conv1d<Scalar>::Options o;
      o.padding(meta_index(sd, "padding"));
      o.groups(meta_index(sd, "groups"));
      o.bias(sd.metadata().at("bias") == "true");
      o.num_threads(threads);
      c2f::Conv1d<Scalar> conv(meta_index(sd, "in_channels"), meta_index(sd, "out_channels"),
                               meta_index(sd, "kernel_size"), o);
      conv.load_state_dict(sd, "conv");
      y = conv.forward(x);
    } else {
      ASSERT_EQ(sd.metadata().at("module"), "c3k2");
      typename c2f::C3K2Projection<Scalar>::Options o;
      o.num_threads(threads);
      o.causal(sd.metadata().at("causal") == "true");
      c2f::C3K2Projection<Scalar> proj(meta_index(sd, "dim"), meta_index(sd, "heads"), o);
      proj.load_state_dict(sd, "c3k2");
      y = proj.forward(x);
    }
    ASSERT_EQ(static_cast<std::size_t>(y.size()), want.size());
    expect_close(y.data(), want.data(), y.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                 name + " " + std::to_string(threads) + " threads");
  }
}

template <class Scalar>
void check_hmha_case(const nlohmann::json& c) {
  const std::vector<std::pair<std::string, c2f::HMHALevels>> configs = {{"output_l1", {true, false, false}},
                                                                        {"output_l2", {false, true, false}},
                                                                        {"output_l3", {false, false, true}},
                                                                        {"output_all", {true, true, true}}};
  const std::string name = c.at("name");
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path(c.at("files").at(Tolerance<Scalar>::file_key)));
  typename HMHA<Scalar>::Options o;
  o.causal(sd.metadata().at("causal") == "true");
  HMHA<Scalar> hmha(meta_index(sd, "dim"), meta_index(sd, "heads"), meta_index(sd, "window"), o);
  hmha.load_state_dict(sd, "hmha.");
  const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x");
  const Tensor3<Scalar> q = hmha.q_proj().forward(x);
  const std::vector<Scalar> want_q = c2f_test::values<Scalar>(sd, "q");
  expect_close(q.data(), want_q.data(), q.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol, name + " q");
  for (int threads : {1, 2}) {
    hmha.set_num_threads(threads);
    for (const auto& [key, levels] : configs) {
      hmha.set_levels(levels);
      const Tensor3<Scalar> y = hmha.forward(x);
      const std::vector<Scalar> want = c2f_test::values<Scalar>(sd, key);
      ASSERT_EQ(static_cast<std::size_t>(y.size()), want.size());
      expect_close(y.data(), want.data(), y.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                   name + " " + key + " " + std::to_string(threads) + " threads");
    }
  }
}

// One gtest entry per fixture file: Fixtures/<Family>Fixture.<test>/<case>_<f32|f64>.
C2F_FIXTURE_TEST(ConvFixture, Conv1dAndC3K2MatchTorch, "conv1d", check_conv_case);

C2F_FIXTURE_TEST(HmhaFixture, MatchesDenseTorchFormulation, "hmha", check_hmha_case);

TEST(HmhaFixtureCoverage, CoversTheRequiredGrid) {
  ASSERT_GE(c2f_test::manifest_cases("conv1d").size(), 10u);
  ASSERT_GE(c2f_test::manifest_cases("hmha").size(), 30u);
  std::set<std::tuple<std::string, std::string, std::string>> seen;
  for (const nlohmann::json& c : c2f_test::manifest_cases("hmha")) {
    seen.insert(
        {c.at("seq_len").get<std::string>(), c.at("window").get<std::string>(), c.at("causal").get<std::string>()});
  }
  for (const char* L : {"1", "5", "64", "150", "257"}) {
    for (const char* W : {"4", "16", "64"}) {
      for (const char* causal : {"false", "true"})
        EXPECT_TRUE(seen.count({L, W, causal})) << L << " " << W << " " << causal;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Fast kernels against their naive twins

TYPED_TEST(HmhaTyped, Conv1dMatchesNaiveOnRandomShapes) {
  using Scalar = TypeParam;
  TestRng rng(41);
  for (int rep = 0; rep < 40; ++rep) {
    const Index groups = rng.pick(std::vector<Index>{1, 2, 3});
    const Index in = groups * rng.uniform_int(1, 5), out = groups * rng.uniform_int(1, 5);
    const Index kernel = rng.pick(std::vector<Index>{1, 2, 3, 5, 7});
    const bool causal = rng.coin(0.3);  // kernel − 1 zeros on the left only
    const Index padding = causal ? 0 : rng.uniform_int(0, kernel);
    const Index length = std::max<Index>(causal ? 0 : kernel - 2 * padding, 0) +
                         rng.pick(std::vector<Index>{0, 1, 2, 13, 127, 128, 129, 300});
    const Index batch = rng.uniform_int(1, 3);
    const c2f::kernels::Conv1dShape shape{in, out, kernel, padding, groups, causal};
    const RowMatrix<Scalar> x = rng.matrix<Scalar>(batch * length, in);
    const RowMatrix<Scalar> w = rng.matrix<Scalar>(out, in / groups * kernel);  // PyTorch layout, flattened
    const RowMatrix<Scalar> bias = rng.matrix<Scalar>(1, out);
    const RowMatrix<Scalar> taps = c2f::kernels::conv1d_taps(w.data(), shape);
    const Index out_len = shape.out_length(length);
    RowMatrix<Scalar> fast(batch * out_len, out), naive(batch * out_len, out);
    c2f::kernels::conv1d<Scalar>(x, batch, length, shape, taps, bias.data(), fast,
                                 c2f::kernels::with_threads(static_cast<int>(rng.uniform_int(1, 2))));
    c2f::kernels::conv1d_naive<Scalar>(x, batch, length, shape, w.data(), bias.data(), naive);
    std::ostringstream what;
    what << "rep " << rep << ": batch=" << batch << " L=" << length << " in=" << in << " out=" << out << " k=" << kernel
         << " padding=" << padding << " groups=" << groups << " causal=" << causal;
    const double tol = std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
    expect_close(fast.data(), naive.data(), fast.size(), tol, tol, what.str());
    EXPECT_EQ(c2f::kernels::conv1d_torch_weight(taps, shape), std::vector<Scalar>(w.data(), w.data() + w.size()));
  }
}

TYPED_TEST(HmhaTyped, WindowedKernelsMatchDenseTwinOnRandomShapes) {
  using Scalar = TypeParam;
  TestRng rng(42);
  for (int rep = 0; rep < 40; ++rep) {
    const Index heads = rng.pick(std::vector<Index>{1, 2, 4});
    const Index dim = heads * rng.pick(std::vector<Index>{2, 3, 4});  // C3K2 needs dim >= 2
    const Index window = rng.pick(std::vector<Index>{1, 2, 3, 7, 8, 16, 64});
    const Index length =
        std::max<Index>(1, rng.pick(std::vector<Index>{1, window - 1, window, window + 1, 37, 64, 65, 131}));
    const Index batch = rng.uniform_int(1, 2);
    typename HMHA<Scalar>::Options o;
    o.causal(rng.coin());
    o.levels({rng.coin(0.7), rng.coin(0.7), rng.coin(0.7)});
    o.num_threads(static_cast<int>(rng.uniform_int(1, 2)));
    const HMHA<Scalar> hmha(dim, heads, window, o);
    const RowMatrix<Scalar> q = rng.matrix<Scalar>(batch * length, dim, 1.5),
                            k = rng.matrix<Scalar>(batch * length, dim, 1.5),
                            v = rng.matrix<Scalar>(batch * length, dim);
    RowMatrix<Scalar> fast = RowMatrix<Scalar>::Zero(batch * length, dim);
    hmha.attend(q, k, v, batch, length, fast);
    const RowMatrix<Scalar> dense = c2f_test::hmha_dense(q, k, v, batch, length, heads, window, o.causal(), o.levels());
    std::ostringstream what;
    what << "rep " << rep << ": batch=" << batch << " L=" << length << " W=" << window << " dim=" << dim
         << " heads=" << heads << " causal=" << o.causal() << " levels=" << o.levels().local << o.levels().cross
         << o.levels().global;
    const double tol = std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
    expect_close(fast.data(), dense.data(), fast.size(), tol, tol, what.str());
  }
}

// ------------------------------------------------------------------------------------------------
// Compute::BFloat16 (docs/bf16.md)

// conv1d in bf16 is conv1d_naive on the rounded input and weights: every product of two bfloat16 values
// is exact in fp32, so only the order of the fp32 additions differs — within 1e-5 · Σ|x w| (+ the bias).
// Awkward shapes around the 32-row packing threshold and the 128-row tasks; 1 and 2 threads bit-identical.
TEST(HmhaBf16, Conv1dMatchesTheNaiveTwinOnRoundedOperands) {
  TestRng rng(0xbf31);
  c2f_test::on_each_bf16_engine([&](const char* engine) {
    for (int rep = 0; rep < 30; ++rep) {
      const Index groups = rng.pick(std::vector<Index>{1, 2});
      const Index in = groups * rng.pick(std::vector<Index>{1, 5, 16, 33}),
                  out = groups * rng.pick(std::vector<Index>{1, 7, 32, 40});
      const Index kernel = rng.pick(std::vector<Index>{1, 3}), padding = kernel / 2, batch = rng.uniform_int(1, 2);
      const Index length = rng.pick(std::vector<Index>{1, 31, 32, 33, 129, 200});
      const c2f::kernels::Conv1dShape shape{in, out, kernel, padding, groups, false};
      const RowMatrix<float> x = rng.matrix<float>(batch * length, in),
                             w = rng.matrix<float>(out, in / groups * kernel);
      const RowMatrix<float> bias = rng.matrix<float>(1, out);
      const RowMatrix<float> xr = x.unaryExpr(c2f::cpu::RoundBf16<float>()),
                             wr = w.unaryExpr(c2f::cpu::RoundBf16<float>());
      const RowMatrix<float> xa = xr.cwiseAbs(), wa = wr.cwiseAbs(), ba = bias.cwiseAbs();
      const Index out_len = shape.out_length(length);
      RowMatrix<float> fast(batch * out_len, out), one(batch * out_len, out), naive(batch * out_len, out),
          size(batch * out_len, out);
      c2f::kernels::KernelOptions o;
      o.compute(c2f::Compute::BFloat16).num_threads(2);
      const RowMatrix<float> taps = c2f::kernels::conv1d_taps(w.data(), shape);
      c2f::kernels::conv1d<float>(x, batch, length, shape, taps, bias.data(), fast, o);
      c2f::kernels::conv1d<float>(x, batch, length, shape, taps, bias.data(), one, o.num_threads(1));
      c2f::kernels::conv1d_naive<float>(xr, batch, length, shape, wr.data(), bias.data(), naive);
      c2f::kernels::conv1d_naive<float>(xa, batch, length, shape, wa.data(), ba.data(), size);
      const RowMatrix<float> err = (fast - naive).cwiseAbs(), bound = size.array() * 1e-5f + 1e-6f;
      EXPECT_TRUE((err.array() <= bound.array()).all())
          << engine << " rep " << rep << ": L=" << length << " in=" << in << " out=" << out << " k=" << kernel
          << " groups=" << groups << ": max error " << err.maxCoeff();
      EXPECT_TRUE(c2f_test::same_bits(fast.data(), one.data(), fast.size())) << engine << " rep " << rep;
    }
  });
}

// Each level of HMHA::attend in bf16 rounds its operands: its output differs from the fp32 level's by
// more than fp32 summation order could and stays within the bound docs/bf16.md states.
TEST(HmhaBf16, EveryLevelRoundsItsOperands) {
  TestRng rng(0xbf32);
  const Index batch = 2, length = 70, dim = 64, heads = 4, window = 16;
  const RowMatrix<float> q = rng.matrix<float>(batch * length, dim), k = rng.matrix<float>(batch * length, dim),
                         v = rng.matrix<float>(batch * length, dim);
  for (bool causal : {false, true}) {
    for (int level = 0; level < 3; ++level) {
      typename HMHA<float>::Options o;
      o.causal(causal).levels({level == 0, level == 1, level == 2}).num_threads(2);
      const HMHA<float> fp32(dim, heads, window, o), bf16(dim, heads, window, o.compute(c2f::Compute::BFloat16));
      RowMatrix<float> a = RowMatrix<float>::Zero(batch * length, dim), b = a;
      fp32.attend(q, k, v, batch, length, a);
      bf16.attend(q, k, v, batch, length, b);
      const double diff = (a - b).cwiseAbs().maxCoeff(), size = a.cwiseAbs().maxCoeff();
      EXPECT_GT(diff, 1e-5 * size) << "level " << level + 1 << (causal ? " causal" : "") << ": no rounding";
      EXPECT_LE(diff, 2e-2 * size) << "level " << level + 1 << (causal ? " causal" : "");
    }
  }
}

// Conv1d (grouped) and C3K2Projection alone in bf16 against torch.autocast("cpu", bfloat16) and fp32 on the
// same weights (tests/data/bf16), on both engines; thread-independent. The printed figures are
// docs/bf16.md's.
TEST(Conv1dBf16, MatchesTorchAutocastAndFp32WithinTheStatedBound) {
  for (const char* name : {"conv1d_k3_p1_g2_l50_bf16", "c3k2_d64_l50_bf16"}) {
    const StateDict sd = c2f::load_safetensors(c2f_test::data_path(std::string("bf16/") + name + "_f32.safetensors"));
    const Tensor3<float> x = c2f_test::tensor3<float>(sd, "x");
    const std::vector<float> fp32 = c2f_test::values<float>(sd, "output"),
                             autocast = c2f_test::values<float>(sd, "output_autocast");
    c2f_test::on_each_bf16_engine([&](const char* engine) {
      Tensor3<float> y, y1;
      const auto run = [&](auto& layer) {  // on 2 threads, then on 1
        y = layer.forward(x);
        layer.set_num_threads(1);
        y1 = layer.forward(x);
      };
      if (sd.metadata().at("module") == "conv1d") {
        c2f::Conv1d<float> conv(meta_index(sd, "in_channels"), meta_index(sd, "out_channels"),
                                meta_index(sd, "kernel_size"),
                                c2f::Conv1d<float>::Options()
                                    .padding(meta_index(sd, "padding"))
                                    .groups(meta_index(sd, "groups"))
                                    .num_threads(2)
                                    .compute(c2f::Compute::BFloat16));
        conv.load_state_dict(sd, "conv");
        run(conv);
      } else {
        c2f::C3K2Projection<float> proj(
            meta_index(sd, "dim"), meta_index(sd, "heads"),
            c2f::C3K2Projection<float>::Options().num_threads(2).compute(c2f::Compute::BFloat16));
        proj.load_state_dict(sd, "c3k2");
        run(proj);
      }
      ASSERT_EQ(static_cast<std::size_t>(y.size()), fp32.size()) << name;
      EXPECT_TRUE(c2f_test::same_bits(y1, y)) << name << " " << engine;
      c2f_test::expect_bf16_accuracy(std::string(name) + ", " + engine, y.data(), fp32, autocast);
    });
  }
}

// HMHA in bf16 against torch.autocast("cpu", bfloat16) and fp32 on the same weights (tests/data/bf16),
// not causal and causal, on both engines; thread-independent; training and double refused.
TEST(HmhaBf16, MatchesTorchAutocastAndFp32WithinTheStatedBound) {
  for (const char* name : {"hmha_l100_w16_bf16", "hmha_l100_w16_causal_bf16"}) {
    const StateDict sd = c2f::load_safetensors(c2f_test::data_path(std::string("bf16/") + name + "_f32.safetensors"));
    const Tensor3<float> x = c2f_test::tensor3<float>(sd, "x");
    const std::vector<float> fp32 = c2f_test::values<float>(sd, "output"),
                             autocast = c2f_test::values<float>(sd, "output_autocast");
    const bool causal = sd.metadata().at("causal") == "true";
    c2f_test::on_each_bf16_engine([&](const char* engine) {
      HMHA<float> m(meta_index(sd, "dim"), meta_index(sd, "heads"), meta_index(sd, "window"),
                    HMHA<float>::Options().causal(causal).num_threads(2).compute(c2f::Compute::BFloat16));
      m.load_state_dict(sd, "hmha.");
      const Tensor3<float> y = m.forward(x);
      m.set_num_threads(1);
      EXPECT_TRUE(c2f_test::same_bits(m.forward(x), y)) << name << " " << engine;
      c2f_test::expect_bf16_accuracy(std::string("HMHA ") + name + ", " + engine, y.data(), fp32, autocast);
    });
  }
  TestRng rng(0xbf33);
  const HMHA<float> bf16(8, 2, 4, HMHA<float>::Options().compute(c2f::Compute::BFloat16));
  EXPECT_THROW((void)bf16.forward_train(rng.tensor<float>(1, 9, 8)), std::invalid_argument);
  for (const char* layer : {"HMHA", "C3K2Projection", "Conv1d"}) {
    try {
      if (std::string(layer) == "HMHA") HMHA<double>(8, 2, 4, HMHA<double>::Options().compute(c2f::Compute::BFloat16));
      if (std::string(layer) == "C3K2Projection") {
        c2f::C3K2Projection<double>(8, 2, c2f::C3K2Projection<double>::Options().compute(c2f::Compute::BFloat16));
      }
      if (std::string(layer) == "Conv1d")
        c2f::Conv1d<double>(8, 8, 3, c2f::Conv1d<double>::Options().compute(c2f::Compute::BFloat16));
      ADD_FAILURE() << layer << ": no exception";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(layer) + ": compute BFloat16 needs float, got double"),
                std::string::npos)
          << e.what();
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Metamorphic and contract tests

// W ≥ L with only level 1 on: one window holds every token, so HMHA is full softmax attention on the
// same projections followed by out_proj.
TEST(HmhaMetamorphic, WindowCoveringTheSequenceIsFullAttention) {
  TestRng rng(43);
  for (bool causal : {false, true}) {
    typename HMHA<double>::Options o;
    o.levels({true, false, false});
    o.causal(causal);
    HMHA<double> hmha(12, 3, 64, o);
    randomize(hmha, rng);
    const Tensor3<double> x = rng.tensor<double>(2, 50, 12);
    const Tensor3<double> y = hmha.forward(x);
    const Tensor3<double> q = hmha.q_proj().forward(x), k = hmha.k_proj().forward(x), v = hmha.v_proj().forward(x);
    const c2f::AttnMask<double> mask = causal ? c2f::AttnMask<double>::causal() : c2f::AttnMask<double>();
    const c2f::MaskView<double> plan(mask, {}, 2, 3, 50, 50);
    RowMatrix<double> attn(100, 12), want(100, 12);
    c2f::kernels::sdpa_naive<double>(c2f::kernels::heads_view<const double>(q.data(), 2, 50, 12, 0, 3, 4),
                                     c2f::kernels::heads_view<const double>(k.data(), 2, 50, 12, 0, 3, 4),
                                     c2f::kernels::heads_view<const double>(v.data(), 2, 50, 12, 0, 3, 4),
                                     c2f::kernels::heads_view<double>(attn.data(), 2, 50, 12, 0, 3, 4), plan, 0.5, {});
    hmha.out_proj().forward_rows(attn, want);
    expect_close(y.data(), want.data(), y.size(), 1e-12, 1e-12, causal ? "causal" : "non-causal");
  }
}

// The C3K2/HMHA article claims C3K2 has about 40 % fewer parameters than a linear projection; it has about twice as
// many.
TEST(C3K2, ParameterCountAgainstLinear) {
  const c2f::C3K2Projection<float> c3k2(512, 8);
  const c2f::Linear<float> linear(512, 512);
  Index from_state_dict = 0;
  for (const auto& kv : c3k2.state_dict()) from_state_dict += kv.second.numel();
  EXPECT_EQ(c3k2.parameter_count(), from_state_dict);
  EXPECT_EQ(c3k2.parameter_count(), 3 * 512 * 256 + 256 + 512 * 256 + 256);  // 524,800
  EXPECT_EQ(512 * 512 + 512, 262656);
  EXPECT_EQ(static_cast<Index>(linear.weight().size() + linear.bias().size()), 262656);
  // Odd dim: conv3 gets dim/2 channels, conv2 the rest.
  const c2f::C3K2Projection<float> odd(15, 3);
  EXPECT_EQ(odd.parameter_count(), 3 * 15 * 7 + 7 + 15 * 8 + 8);
}

TEST(HmhaStateDict, NamesAndShapesAndConstructorChecks) {
  HMHA<float> hmha(16, 4, 8);
  std::vector<std::string> keys;
  for (const auto& kv : hmha.state_dict()) keys.push_back(kv.first);
  EXPECT_EQ(keys.size(), 14u);
  EXPECT_EQ(keys.front(), "k_proj.conv2.bias");
  EXPECT_EQ(hmha.state_dict().at("q_proj.conv3.weight").shape(), (std::vector<std::int64_t>{8, 16, 3}));
  EXPECT_EQ(hmha.state_dict().at("v_proj.conv2.weight").shape(), (std::vector<std::int64_t>{8, 16, 1}));
  EXPECT_THROW(HMHA<float>(10, 3, 4), std::invalid_argument);
  EXPECT_THROW(HMHA<float>(16, 4, 0), std::invalid_argument);
  TestRng rng(45);
  EXPECT_THROW(c2f::Conv1d<float>(4, 6, 3, c2f::Conv1d<float>::Options().groups(4)), std::invalid_argument);  // 6 % 4
  EXPECT_THROW(c2f::Conv1d<float>(4, 4, 3, c2f::Conv1d<float>::Options().padding(1).causal(true)),
               std::invalid_argument);
  // An input shorter than the kernel has no output position: an empty output, as for length 0.
  c2f::Conv1d<float> conv(4, 4, 5);
  EXPECT_EQ(conv.forward(rng.tensor<float>(1, 3, 4)).dimension(1), 0);
  EXPECT_EQ(conv.forward(rng.tensor<float>(1, 5, 4)).dimension(1), 1);
}

}  // namespace
