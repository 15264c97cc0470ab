// MultiHeadAttention against torch.nn.MultiheadAttention fixtures, plus loading, validation and
// threading behaviour.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "c2f/io/masks.hpp"
#include "support/bf16.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/mha_fixtures.hpp"
#include "support/random.hpp"
#include "support/settings.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

namespace {

using c2f::Index;
using c2f::MultiHeadAttention;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::error_of;
using c2f_test::mask_variants;
using c2f_test::meta_index;
using c2f_test::options_from;
using c2f_test::relative_error;
using c2f_test::Tolerance;

// Compares c2f's values with torch's. Where torch has NaN (a fully masked query row: torch's
// documented NaN, c2f's documented zeros) `on_torch_nan` decides what c2f must hold instead.
template <class Scalar, class OnNan>
void expect_matches_torch(const Scalar* got, const std::vector<Scalar>& want, const std::string& what,
                          OnNan on_torch_nan) {
  int reported = 0;
  for (std::size_t i = 0; i < want.size() && reported < 5; ++i) {
    if (std::isnan(want[i])) {
      if (!on_torch_nan(i, got[i])) {
        ADD_FAILURE() << what << "[" << i << "]: torch NaN (fully masked row), c2f " << got[i];
        ++reported;
      }
      continue;
    }
    const double err = std::abs(double(got[i]) - double(want[i]));
    if (!(err <= Tolerance<Scalar>::atol + Tolerance<Scalar>::rtol * std::abs(double(want[i])))) {
      ADD_FAILURE() << what << "[" << i << "]: c2f " << got[i] << ", torch " << want[i] << ", |diff| " << err;
      ++reported;
    }
  }
}

template <class Scalar>
void check_case(const nlohmann::json& c) {
  const std::string name = c.at("name");
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path(c.at("files").at(Tolerance<Scalar>::file_key)));
  const Index embed_dim = meta_index(sd, "embed_dim"), heads = meta_index(sd, "num_heads");
  const Tensor3<Scalar> q = c2f_test::tensor3<Scalar>(sd, "query");
  const Tensor3<Scalar> k = c2f_test::tensor3<Scalar>(sd, "key");
  const Tensor3<Scalar> v = c2f_test::tensor3<Scalar>(sd, "value");
  const std::vector<Scalar> want = c2f_test::values<Scalar>(sd, "output");
  const std::string weights_mode = sd.metadata().at("need_weights");

  MultiHeadAttention<Scalar> mha(embed_dim, heads, options_from<Scalar>(sd));
  mha.load_state_dict(sd, "mha.");
  // Where torch has NaN (fully masked query row), c2f's attention is 0, so the output is out_proj.bias.
  const auto out_is_bias = [&](std::size_t i, Scalar got) {
    const Scalar bias =
        mha.options().bias() ? mha.out_proj().bias()[static_cast<Index>(i % std::size_t(embed_dim))] : 0;
    return got == bias;
  };

  for (const auto& [mask_name, masks] : mask_variants<Scalar>(sd)) {
    for (c2f::AttnKernel kernel : {c2f::AttnKernel::Streaming, c2f::AttnKernel::Naive}) {
      for (int threads : {1, 2}) {
        mha.set_num_threads(threads);
        mha.set_kernel(kernel);
        const std::string what = name + " (" + mask_name + ", " +
                                 (kernel == c2f::AttnKernel::Naive ? "naive" : "streaming") + ", " +
                                 std::to_string(threads) + " threads) output";
        const Tensor3<Scalar> out = mha.forward(q, k, v, masks);
        ASSERT_EQ(out.dimension(0), q.dimension(0));
        ASSERT_EQ(out.dimension(1), q.dimension(1));
        ASSERT_EQ(out.dimension(2), embed_dim);
        ASSERT_EQ(static_cast<std::size_t>(out.size()), want.size());
        expect_matches_torch(out.data(), want, what, out_is_bias);
      }
    }
    if (weights_mode != "none") {
      const c2f::AttnWeights mode = weights_mode == "average" ? c2f::AttnWeights::Averaged : c2f::AttnWeights::PerHead;
      const c2f::AttnOutput<Scalar> r = mha.forward_with_weights(q, k, v, masks, mode);
      const std::vector<Scalar> want_w = c2f_test::values<Scalar>(sd, "weights");
      ASSERT_EQ(r.weights.dimension(1), mode == c2f::AttnWeights::Averaged ? 1 : heads);
      ASSERT_EQ(static_cast<std::size_t>(r.weights.size()), want_w.size());
      expect_matches_torch(r.output.data(), want, name + " (" + mask_name + ") output with weights", out_is_bias);
      expect_matches_torch(r.weights.data(), want_w, name + " (" + mask_name + ") weights",
                           [](std::size_t, Scalar got) { return got == Scalar(0); });
    }
  }
}

// One gtest entry per fixture file: Fixtures/MhaFixture.MatchesTorchMultiheadAttention/<case>_<f32|f64>.
C2F_FIXTURE_TEST(MhaFixture, MatchesTorchMultiheadAttention, "mha", check_case);

// The fixture set covers the required cases; a test so that a trimmed generator cannot pass silently.
TEST(MhaFixtureCoverage, CoversTheRequiredCases) {
  const std::vector<nlohmann::json> cases = c2f_test::manifest_cases("mha");
  ASSERT_GE(cases.size(), 15u);
  std::set<std::string> lengths, attn_masks, pads, weights;
  bool cross_kv_dims = false, cross_len = false, no_bias = false, causal = false, fully_masked = false;
  for (const nlohmann::json& c : cases) {
    lengths.insert(c.at("lq").get<std::string>());
    attn_masks.insert(c.at("attn_mask").get<std::string>());
    pads.insert(c.at("key_padding_mask").get<std::string>());
    weights.insert(c.at("need_weights").get<std::string>());
    cross_kv_dims |= c.at("kdim") != c.at("embed_dim") && c.at("vdim") != c.at("embed_dim") && c.at("lq") != c.at("lk");
    cross_len |= c.at("lq") != c.at("lk");
    no_bias |= c.at("bias") == "false";
    causal |= c.at("causal") == "true";
    fully_masked |= c.at("fully_masked_rows") == "true";
  }
  for (const char* l : {"1", "7", "37", "128"}) EXPECT_TRUE(lengths.count(l)) << "length " << l;
  EXPECT_EQ(attn_masks, (std::set<std::string>{"none", "bool", "float"}));
  EXPECT_EQ(pads, (std::set<std::string>{"none", "bool", "float"}));
  EXPECT_EQ(weights, (std::set<std::string>{"none", "average", "per_head"}));
  EXPECT_TRUE(cross_kv_dims && cross_len && no_bias && causal && fully_masked);
}

StateDict fixture(const std::string& name, const std::string& dtype = "f32") {
  return c2f::load_safetensors(c2f_test::data_path("mha/" + name + "_" + dtype + ".safetensors"));
}

// The c2f multi-head attention article's C2FMultiHeadAttention calls the packed projection `qkv_proj` (a Linear): same
// layout.
TEST(MhaLoading, AcceptsMultiHeadArticleNames) {
  const StateDict sd = fixture("self_l7");
  StateDict renamed;
  for (const auto& [key, t] : sd) {
    if (key == "mha.in_proj_weight")
      renamed.set("qkv_proj.weight", t);
    else if (key == "mha.in_proj_bias")
      renamed.set("qkv_proj.bias", t);
    else if (key.rfind("mha.out_proj.", 0) == 0)
      renamed.set(key.substr(4), t);
  }
  MultiHeadAttention<float> torch_names(16, 4), article_names(16, 4);
  torch_names.load_state_dict(sd, "mha");
  article_names.load_state_dict(renamed);
  const Tensor3<float> x = c2f_test::tensor3<float>(sd, "query");
  const Tensor3<float> a = torch_names.forward(x), b = article_names.forward(x);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())));
  expect_matches_torch(b.data(), c2f_test::values<float>(sd, "output"), "the multi-head article's qkv_proj names",
                       [](std::size_t, float) { return false; });
}

TEST(MhaLoading, StateDictRoundTripUsesTorchNames) {
  MultiHeadAttention<double>::Options o;
  o.kdim(12);
  o.vdim(20);
  o.seed(7);
  MultiHeadAttention<double> a(16, 2, o);
  const StateDict sd = a.state_dict("attn");
  std::vector<std::string> keys;
  for (const auto& kv : sd) keys.push_back(kv.first);
  EXPECT_EQ(keys, (std::vector<std::string>{"attn.in_proj_bias", "attn.k_proj_weight", "attn.out_proj.bias",
                                            "attn.out_proj.weight", "attn.q_proj_weight", "attn.v_proj_weight"}));
  EXPECT_EQ(sd.at("attn.k_proj_weight").shape(), (std::vector<std::int64_t>{16, 12}));
  EXPECT_EQ(sd.at("attn.k_proj_weight").dtype(), c2f::DType::F64);

  MultiHeadAttention<double> b(16, 2, [&] {
    MultiHeadAttention<double>::Options ob = o;
    ob.seed(99);  // different initial weights, replaced by the load
    return ob;
  }());
  b.load_state_dict(sd, "attn");
  c2f_test::TestRng rng(11);
  const Tensor3<double> q = rng.tensor<double>(2, 5, 16), k = rng.tensor<double>(2, 9, 12),
                        v = rng.tensor<double>(2, 9, 20);
  const Tensor3<double> ya = a.forward(q, k, v), yb = b.forward(q, k, v);
  EXPECT_EQ(0, std::memcmp(ya.data(), yb.data(), sizeof(double) * static_cast<std::size_t>(ya.size())));

  // Through a file, too.
  const std::string path = ::testing::TempDir() + "/c2f_mha_roundtrip.safetensors";
  c2f::save_safetensors(path, sd);
  MultiHeadAttention<double> c(16, 2, o);
  c.load_state_dict(c2f::load_safetensors(path), "attn.");
  const Tensor3<double> yc = c.forward(q, k, v);
  EXPECT_EQ(0, std::memcmp(ya.data(), yc.data(), sizeof(double) * static_cast<std::size_t>(ya.size())));
}

// Weights stored as F16/BF16 load as exactly the rounded values.
TEST(MhaLoading, HalfPrecisionWeightsLoadAsRoundedValues) {
  const StateDict sd = fixture("self_l7");
  for (c2f::DType dt : {c2f::DType::F16, c2f::DType::BF16}) {
    StateDict low;
    std::map<std::string, std::vector<float>> rounded;
    for (const auto& [key, t] : sd) {
      if (key.rfind("mha.", 0) != 0) continue;
      const std::vector<float> v = t.to_vector<float>();
      std::vector<std::uint8_t> bytes(v.size() * 2);
      std::vector<float>& r = rounded[key];
      for (std::size_t i = 0; i < v.size(); ++i) {
        std::uint16_t bits;
        if (dt == c2f::DType::F16) {
          const Eigen::half h(v[i]);
          bits = Eigen::numext::bit_cast<std::uint16_t>(h);
          r.push_back(static_cast<float>(h));
        } else {
          const Eigen::bfloat16 h(v[i]);
          bits = Eigen::numext::bit_cast<std::uint16_t>(h);
          r.push_back(static_cast<float>(h));
        }
        std::memcpy(bytes.data() + 2 * i, &bits, 2);
      }
      low.set(key, c2f::TensorData(dt, t.shape(), bytes));
    }
    MultiHeadAttention<float> mha(16, 4);
    mha.load_state_dict(low, "mha.");
    const StateDict back = mha.state_dict("mha.");
    for (const auto& [key, r] : rounded) {
      EXPECT_EQ(back.at(key).to_vector<float>(), r) << c2f::dtype_name(dt) << " " << key;
    }
  }
}

TEST(MhaValidation, RejectsBadShapesWithBothShapesInTheMessage) {
  EXPECT_NE(error_of([] { MultiHeadAttention<float>(10, 3); }).find("divisible"), std::string::npos);
  EXPECT_THROW(MultiHeadAttention<float>(0, 1), std::invalid_argument);
  MultiHeadAttention<float> mha(8, 2);
  c2f_test::TestRng rng(12);
  const Tensor3<float> x = rng.tensor<float>(2, 5, 8), wrong_features = rng.tensor<float>(2, 5, 6),
                       other_batch = rng.tensor<float>(3, 5, 8), other_len = rng.tensor<float>(2, 4, 8);
  std::string msg = error_of([&] { mha.forward(wrong_features); });
  EXPECT_NE(msg.find("embed_dim=8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 5, 6]"), std::string::npos) << msg;
  msg = error_of([&] { mha.forward(x, other_batch, other_batch); });
  EXPECT_NE(msg.find("[2, 5, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 5, 8]"), std::string::npos) << msg;
  EXPECT_THROW(mha.forward(x, x, other_len), std::invalid_argument);
  c2f::BoolTensor2 bad_mask(5, 4);
  bad_mask.setConstant(false);
  msg = error_of([&] { mha.forward(x, c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::ignore(bad_mask))); });
  EXPECT_NE(msg.find("[5, 5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[5, 4]"), std::string::npos) << msg;
}

TEST(MhaInputs, AcceptsTensorMapsOverCallerMemory) {
  MultiHeadAttention<float> mha(8, 2);
  c2f_test::TestRng rng(13);
  const Tensor3<float> x = rng.tensor<float>(2, 6, 8);
  std::vector<float> buffer(x.data(), x.data() + x.size());
  const Eigen::TensorMap<const Tensor3<float>> cmap(buffer.data(), 2, 6, 8);
  const Eigen::TensorMap<Tensor3<float>> map(buffer.data(), 2, 6, 8);
  const Tensor3<float> a = mha.forward(x), b = mha.forward(cmap), c = mha.forward(map, map, map);
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())));
  EXPECT_EQ(0, std::memcmp(a.data(), c.data(), sizeof(float) * static_cast<std::size_t>(a.size())));
}

// --- Compute::BFloat16 (docs/bf16.md) -------------------------------------------------------------------

// The bf16 fixtures: torch.nn.MultiheadAttention in fp32 and under torch.autocast("cpu", bfloat16) on the
// same weights. c2f's bfloat16 layer lies within 2e-2 · max|y| of both (the accuracy bound; the
// measured figures are printed and quoted in docs/bf16.md), on both engines and any thread count. The
// engines' sums differ in order only, but a last-bit difference in a projection can move a later operand
// to the neighbouring bfloat16 value (2^-8 of it): the layers agree within 1e-3 · max|y| (measured 1-2e-4;
// the kernels' own tests bound the engines' difference to the fp32 sums' order).
TEST(MhaBf16, MatchesTorchAutocastAndFp32WithinTheStatedBound) {
  for (const char* name : {"mha_self_l128", "mha_causal_l128"}) {
    const c2f::StateDict sd =
        c2f::load_safetensors(c2f_test::data_path(std::string("bf16/") + name + "_f32.safetensors"));
    const Tensor3<float> x = c2f_test::tensor3<float>(sd, "query");
    const std::vector<float> fp32 = c2f_test::values<float>(sd, "output"),
                             autocast = c2f_test::values<float>(sd, "output_autocast");
    const bool causal = sd.metadata().at("causal") == "true";
    MultiHeadAttention<float> mha(meta_index(sd, "embed_dim"), meta_index(sd, "num_heads"),
                                  MultiHeadAttention<float>::Options().causal(causal).compute(c2f::Compute::BFloat16));
    mha.load_state_dict(sd, "mha.");
    std::vector<Tensor3<float>> outputs;
    for (c2f::Bf16Engine e : c2f_test::available_bf16_engines()) {
      const auto engine_setting = c2f_test::scoped_bf16_engine(e);
      const char* engine = c2f::bf16_engine_name(e);
      mha.set_num_threads(2);
      const Tensor3<float> y = mha.forward(x);
      mha.set_num_threads(1);
      const Tensor3<float> y1 = mha.forward(x);
      EXPECT_EQ(0, std::memcmp(y.data(), y1.data(), sizeof(float) * static_cast<std::size_t>(y.size())))
          << name << " " << engine;
      c2f_test::expect_bf16_accuracy(std::string(name) + ", " + engine, y.data(), fp32, autocast);
      outputs.push_back(y);
    }
    const std::vector<float> first(outputs[0].data(), outputs[0].data() + outputs[0].size());
    for (std::size_t e = 1; e < outputs.size(); ++e)
      EXPECT_LE(relative_error(outputs[e].data(), first), 1e-3) << name << ": engine " << e << " vs the first";
  }
}

// Decoding in bfloat16 (the split-key kernel rounds as the streaming one does) follows the causal forward
// to within the bfloat16 bound, and a double layer refuses the option with the types in the message.
TEST(MhaBf16, DecodesWithinTheBoundAndDoubleIsRefused) {
  c2f_test::TestRng rng(0xbf20);
  const Tensor3<float> x = rng.tensor<float>(2, 40, 32);
  const MultiHeadAttention<float> mha(
      32, 4, MultiHeadAttention<float>::Options().causal(true).compute(c2f::Compute::BFloat16).seed(7));
  const Tensor3<float> whole = mha.forward(x);
  MultiHeadAttention<float>::DecodeState state = mha.new_decode_state(2);
  std::vector<float> stepped(static_cast<std::size_t>(whole.size()));
  for (Index t = 0; t < 40; ++t) {
    Tensor3<float> token(2, 1, 32);
    for (Index b = 0; b < 2; ++b) {
      for (Index f = 0; f < 32; ++f) token(b, 0, f) = x(b, t, f);
    }
    const Tensor3<float> y = mha.decode(token, state);
    for (Index b = 0; b < 2; ++b) {
      for (Index f = 0; f < 32; ++f) stepped[static_cast<std::size_t>((b * 40 + t) * 32 + f)] = y(b, 0, f);
    }
  }
  EXPECT_LE(relative_error(whole.data(), stepped), 2e-2);
  try {
    (void)mha.forward_train(x, c2f::Masks<float>(), 0);
    ADD_FAILURE() << "forward_train in bfloat16: no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("forward_train needs compute Float32"), std::string::npos) << e.what();
  }
  try {
    MultiHeadAttention<double> bad(32, 4, MultiHeadAttention<double>::Options().compute(c2f::Compute::BFloat16));
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "c2f: MultiHeadAttention: compute BFloat16 needs float, got double");
  }
}

}  // namespace
