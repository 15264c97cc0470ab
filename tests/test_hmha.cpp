// Conv1d, C3K2Projection and HMHA (the C3K2/HMHA article): PyTorch fixtures from a dense formulation, the fast
// kernels against their naive twins, the metamorphic full-attention case, and the layers' contracts.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/hmha_dense.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

namespace {

using c2f::HMHA;
using c2f::Index;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::meta_index;
using c2f_test::expect_close;
using c2f_test::randomize;
using c2f_test::Tolerance;
using c2f_test::TestRng;

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
  const std::vector<std::pair<std::string, c2f::HMHALevels>> configs = {
      {"output_l1", {true, false, false}},
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
    seen.insert({c.at("seq_len").get<std::string>(), c.at("window").get<std::string>(), c.at("causal").get<std::string>()});
  }
  for (const char* L : {"1", "5", "64", "150", "257"}) {
    for (const char* W : {"4", "16", "64"}) {
      for (const char* causal : {"false", "true"}) EXPECT_TRUE(seen.count({L, W, causal})) << L << " " << W << " " << causal;
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
    c2f::kernels::conv1d<Scalar>(x, batch, length, shape, taps, bias.data(), fast, c2f::kernels::with_threads(static_cast<int>(rng.uniform_int(1, 2))));
    c2f::kernels::conv1d_naive<Scalar>(x, batch, length, shape, w.data(), bias.data(), naive);
    std::ostringstream what;
    what << "rep " << rep << ": batch=" << batch << " L=" << length << " in=" << in << " out=" << out
         << " k=" << kernel << " padding=" << padding << " groups=" << groups << " causal=" << causal;
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
    const RowMatrix<Scalar> q = rng.matrix<Scalar>(batch * length, dim, 1.5), k = rng.matrix<Scalar>(batch * length, dim, 1.5),
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

// The C3K2/HMHA article claims C3K2 has about 40 % fewer parameters than a linear projection; it has about twice as many.
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
  EXPECT_THROW(c2f::Conv1d<float>(4, 4, 3, c2f::Conv1d<float>::Options().padding(1).causal(true)), std::invalid_argument);
  // An input shorter than the kernel has no output position: an empty output, as for length 0.
  c2f::Conv1d<float> conv(4, 4, 5);
  EXPECT_EQ(conv.forward(rng.tensor<float>(1, 3, 4)).dimension(1), 0);
  EXPECT_EQ(conv.forward(rng.tensor<float>(1, 5, 4)).dimension(1), 1);
}

}  // namespace
