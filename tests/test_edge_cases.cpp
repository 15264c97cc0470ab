// A defined result for every awkward input, for every layer: empty batches and sequences, length 1,
// chunks and windows longer than the sequence, bad shapes and weights, masks that hide everything,
// huge logits, NaN, and -inf versus lowest() masks. Each case's documented result is in the README
// ("Edge cases").
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

namespace {

using c2f::Index;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::error_of;
using c2f_test::expect_close;
using c2f_test::randomize;
using c2f_test::same_bits;
using c2f_test::TestRng;

constexpr float kInf = std::numeric_limits<float>::infinity();

bool all_finite(const Tensor3<float>& t) { return Eigen::Map<const Eigen::ArrayXf>(t.data(), t.size()).allFinite(); }
bool any_nan(const Tensor3<float>& t) { return Eigen::Map<const Eigen::ArrayXf>(t.data(), t.size()).isNaN().any(); }

// Every layer behind one signature: x [B, L, d] → [B, L, d].
struct Layer {
  std::string name;
  std::function<Tensor3<float>(const Tensor3<float>&)> forward;
  std::function<StateDict()> state_dict;
  std::function<void(const StateDict&)> load;
};

std::vector<Layer> all_layers(TestRng& rng, Index d, Index heads) {
  auto mha = std::make_shared<c2f::MultiHeadAttention<float>>(d, heads);
  auto coarse = std::make_shared<c2f::CoarseAttention<float>>(d, heads);
  auto c2f_attn = std::make_shared<c2f::C2FAttention<float>>(d, heads, 4);
  auto c3k2 = std::make_shared<c2f::C3K2Projection<float>>(d, heads);
  auto hmha = std::make_shared<c2f::HMHA<float>>(d, heads, 4);
  auto conv = std::make_shared<c2f::Conv1d<float>>(d, d, 3, c2f::Conv1d<float>::Options().padding(1).groups(2));
  randomize(*mha, rng);
  randomize(*coarse, rng);
  randomize(*c2f_attn, rng);
  randomize(*c3k2, rng);
  randomize(*hmha, rng);
  randomize(*conv, rng);
  return {
      {"MultiHeadAttention", [mha](const Tensor3<float>& x) { return mha->forward(x); },
       [mha] { return mha->state_dict(); }, [mha](const StateDict& sd) { mha->load_state_dict(sd); }},
      {"CoarseAttention", [coarse](const Tensor3<float>& x) { return coarse->forward(x); },
       [coarse] { return coarse->state_dict(); }, [coarse](const StateDict& sd) { coarse->load_state_dict(sd); }},
      {"C2FAttention", [c2f_attn](const Tensor3<float>& x) { return c2f_attn->forward(x); },
       [c2f_attn] { return c2f_attn->state_dict(); },
       [c2f_attn](const StateDict& sd) { c2f_attn->load_state_dict(sd); }},
      {"C3K2Projection", [c3k2](const Tensor3<float>& x) { return c3k2->forward(x); },
       [c3k2] { return c3k2->state_dict(); }, [c3k2](const StateDict& sd) { c3k2->load_state_dict(sd); }},
      {"HMHA", [hmha](const Tensor3<float>& x) { return hmha->forward(x); }, [hmha] { return hmha->state_dict(); },
       [hmha](const StateDict& sd) { hmha->load_state_dict(sd); }},
      {"Conv1d", [conv](const Tensor3<float>& x) { return conv->forward(x); }, [conv] { return conv->state_dict(); },
       [conv](const StateDict& sd) { conv->load_state_dict(sd); }},
  };
}

// ------------------------------------------------------------------------------------------------
// Shapes

// Batch 0 and length 0 give an empty output of the right shape (no error): an empty batch is a
// normal thing for a serving loop to pass.
TEST(EdgeShapes, EmptyBatchAndEmptySequenceGiveEmptyOutputs) {
  TestRng rng(51);
  for (const Layer& layer : all_layers(rng, 8, 2)) {
    for (const auto& [b, l] : std::vector<std::pair<Index, Index>>{{0, 5}, {2, 0}, {0, 0}}) {
      const Tensor3<float> y = layer.forward(rng.tensor<float>(b, l, 8));
      EXPECT_EQ(y.dimension(0), b) << layer.name;
      EXPECT_EQ(y.dimension(1), l) << layer.name;
      EXPECT_EQ(y.dimension(2), 8) << layer.name;
    }
  }
  // FineAttention's own interface with zero chunks.
  c2f::FineAttention<float> fine(8, 2);
  const c2f::Tensor4<float> y = fine.forward(c2f::Tensor4<float>(2, 0, 4, 8), Tensor3<float>(2, 0, 8));
  EXPECT_EQ(y.size(), 0);
}

// Cross-attention to an empty memory (Lk = 0): every query has nothing to attend to, so the attention
// is zero and the output is out_proj.bias.
TEST(EdgeShapes, CrossAttentionToNoKeysOutputsOutProjBias) {
  TestRng rng(52);
  c2f::MultiHeadAttention<float> mha(8, 2);
  randomize(mha, rng);
  const Tensor3<float> y = mha.forward(rng.tensor<float>(2, 3, 8), Tensor3<float>(2, 0, 8), Tensor3<float>(2, 0, 8));
  for (Index b = 0; b < 2; ++b) {
    for (Index i = 0; i < 3; ++i) {
      for (Index j = 0; j < 8; ++j) EXPECT_EQ(y(b, i, j), mha.out_proj().bias()[j]);
    }
  }
}

// Length 1: the softmax has one key with weight 1, so MHA is out_proj(v_proj(x)).
TEST(EdgeShapes, LengthOneIsOutProjOfValueProjection) {
  TestRng rng(53);
  c2f::MultiHeadAttention<double> mha(8, 2);
  randomize(mha, rng);
  const Tensor3<double> x = rng.tensor<double>(3, 1, 8);
  const Tensor3<double> y = mha.forward(x);
  const StateDict sd = mha.state_dict();
  const std::vector<double> w = sd.at("in_proj_weight").to_vector<double>(), b = sd.at("in_proj_bias").to_vector<double>();
  const Eigen::Map<const RowMatrix<double>> W(w.data(), 24, 8), X(x.data(), 3, 8);
  const RowMatrix<double> v = (X * W.bottomRows(8).transpose()).rowwise() +
                              Eigen::Map<const Eigen::RowVectorXd>(b.data() + 16, 8);
  const RowMatrix<double> want = (v * mha.out_proj().weight().transpose()).rowwise() +
                                 mha.out_proj().bias().transpose();
  expect_close(y.data(), want.data(), y.size(), 1e-12, 1e-12, "MHA L = 1");

  // HMHA at L = 1: every level sees only token 0, so o = v (level 1) + v (level 2) + v (level 3);
  // causal drops level 2 (no earlier window).
  for (bool causal : {false, true}) {
    c2f::HMHA<double>::Options o;
    o.causal(causal);
    c2f::HMHA<double> hmha(8, 2, 4, o);
    randomize(hmha, rng);
    const Tensor3<double> hv = hmha.v_proj().forward(x);
    RowMatrix<double> expect_o = Eigen::Map<const RowMatrix<double>>(hv.data(), 3, 8) * (causal ? 2.0 : 3.0);
    RowMatrix<double> expect_y(3, 8);
    hmha.out_proj().forward_rows(expect_o, expect_y);
    const Tensor3<double> y_hmha = hmha.forward(x);
    expect_close(y_hmha.data(), expect_y.data(), y_hmha.size(), 1e-12, 1e-12, causal ? "HMHA L = 1 causal" : "HMHA L = 1");
  }
}

// A chunk or window longer than the sequence is one partial chunk/window: the same as chunk = L.
TEST(EdgeShapes, ChunkOrWindowLongerThanTheSequence) {
  TestRng rng(54);
  const Tensor3<float> x = rng.tensor<float>(2, 10, 8);
  c2f::C2FAttention<float> long_chunk(8, 2, 64), exact_chunk(8, 2, 10);
  randomize(long_chunk, rng);
  exact_chunk.load_state_dict(long_chunk.state_dict());
  const Tensor3<float> a = long_chunk.forward(x), b = exact_chunk.forward(x);
  expect_close(a.data(), b.data(), a.size(), 1e-6, 1e-6, "C2F chunk 64 vs chunk 10 at L = 10");

  c2f::HMHA<float> long_window(8, 2, 100), exact_window(8, 2, 10);
  randomize(long_window, rng);
  exact_window.load_state_dict(long_window.state_dict());
  const Tensor3<float> c = long_window.forward(x), d = exact_window.forward(x);
  expect_close(c.data(), d.data(), c.size(), 1e-6, 1e-6, "HMHA window 100 vs window 10 at L = 10");
}

// Window 1 with only level 2: the window means are the tokens, so level 2 is full attention.
TEST(EdgeShapes, WindowOneCrossLevelIsFullAttention) {
  TestRng rng(55);
  c2f::HMHA<double>::Options o;
  o.levels({false, true, false});
  c2f::HMHA<double> hmha(8, 2, 1, o);
  const RowMatrix<double> q = rng.matrix<double>(14, 8), k = rng.matrix<double>(14, 8), v = rng.matrix<double>(14, 8);
  RowMatrix<double> got = RowMatrix<double>::Zero(14, 8), want(14, 8);
  hmha.attend(q, k, v, 2, 7, got);
  c2f::kernels::sdpa_naive<double>(c2f::kernels::heads_view<const double>(q.data(), 2, 7, 8, 0, 2, 4),
                                   c2f::kernels::heads_view<const double>(k.data(), 2, 7, 8, 0, 2, 4),
                                   c2f::kernels::heads_view<const double>(v.data(), 2, 7, 8, 0, 2, 4),
                                   c2f::kernels::heads_view<double>(want.data(), 2, 7, 8, 0, 2, 4), {}, 0.5, {});
  EXPECT_LT((got - want).cwiseAbs().maxCoeff(), 1e-12);
}

TEST(EdgeShapes, HeadsMustDivideTheWidthAtConstruction) {
  EXPECT_NE(error_of([] { c2f::MultiHeadAttention<float>(10, 4); }).find("divisible"), std::string::npos);
  EXPECT_NE(error_of([] { c2f::CoarseAttention<float>(10, 4); }).find("divisible"), std::string::npos);
  EXPECT_NE(error_of([] { c2f::FineAttention<float>(10, 4); }).find("divisible"), std::string::npos);
  EXPECT_NE(error_of([] { c2f::C2FAttention<float>(10, 4, 8); }).find("divisible"), std::string::npos);
  EXPECT_NE(error_of([] { c2f::C3K2Projection<float>(10, 4); }).find("divisible"), std::string::npos);
  EXPECT_NE(error_of([] { c2f::HMHA<float>(10, 4); }).find("divisible"), std::string::npos);
  EXPECT_THROW(c2f::MultiHeadAttention<float>(8, 0), std::invalid_argument);
  EXPECT_THROW(c2f::HMHA<float>(8, -2), std::invalid_argument);
}

// A wrong feature size is an error naming the expected width and the given shape.
TEST(EdgeShapes, WrongFeatureSizeNamesBothShapes) {
  TestRng rng(56);
  for (const Layer& layer : all_layers(rng, 8, 2)) {
    const std::string msg = error_of([&] { layer.forward(rng.tensor<float>(2, 5, 6)); });
    EXPECT_NE(msg.find("[2, 5, 6]"), std::string::npos) << layer.name << ": " << msg;
    EXPECT_NE(msg.find("8"), std::string::npos) << layer.name << ": " << msg;
  }
}

TEST(EdgeShapes, MismatchedBatchesNameBothShapes) {
  TestRng rng(57);
  c2f::MultiHeadAttention<float> mha(8, 2);
  std::string msg = error_of([&] {
    mha.forward(rng.tensor<float>(2, 5, 8), rng.tensor<float>(3, 4, 8), rng.tensor<float>(3, 4, 8));
  });
  EXPECT_NE(msg.find("[2, 5, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 4, 8]"), std::string::npos) << msg;
  c2f::FineAttention<float> fine(8, 2);
  msg = error_of([&] { fine.forward_chunked(rng.tensor<float>(2, 8, 8), 4, rng.tensor<float>(3, 2, 8)); });
  EXPECT_NE(msg.find("[2, 2, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 2, 8]"), std::string::npos) << msg;
}

// ------------------------------------------------------------------------------------------------
// Weights files

// Every layer's strict loading: a missing key, an extra key and a wrong shape are errors that name
// the key (and, for the shape, both shapes).
TEST(EdgeWeights, MissingExtraAndMisshapenKeysAreNamed) {
  TestRng rng(58);
  for (const Layer& layer : all_layers(rng, 8, 2)) {
    const StateDict good = layer.state_dict();
    const std::string victim = good.begin()->first;
    StateDict missing;
    for (const auto& [key, t] : good) {
      if (key != victim) missing.set(key, t);
    }
    EXPECT_NE(error_of([&] { layer.load(missing); }).find("missing key '" + victim + "'"), std::string::npos)
        << layer.name;
    StateDict extra = good;
    extra.set("surprise.weight", c2f::TensorData::from_values(std::vector<float>(3).data(), {3}));
    EXPECT_NE(error_of([&] { layer.load(extra); }).find("unexpected key 'surprise.weight'"), std::string::npos)
        << layer.name;
    StateDict misshapen = good;
    const c2f::TensorData& t = good.at(victim);
    std::vector<std::int64_t> shape = t.shape();
    shape[0] += 1;
    std::vector<float> values(static_cast<std::size_t>(t.numel() / t.shape()[0] * shape[0]));
    misshapen.set(victim, c2f::TensorData::from_values(values.data(), shape));
    const std::string msg = error_of([&] { layer.load(misshapen); });
    EXPECT_NE(msg.find(victim), std::string::npos) << layer.name << ": " << msg;
    EXPECT_NE(msg.find(c2f::detail::shape_string(shape)), std::string::npos) << layer.name << ": " << msg;
    EXPECT_NE(msg.find(c2f::detail::shape_string(t.shape())), std::string::npos) << layer.name << ": " << msg;
    EXPECT_NO_THROW(layer.load(good)) << layer.name;
  }
}

// ------------------------------------------------------------------------------------------------
// Masks and numerics

// A query row whose every key is masked outputs zero attention, and the other rows are untouched —
// also when whole key blocks of the streaming kernel (256 keys) are masked for rows that still see
// other keys (PyTorch issue #127055).
TEST(EdgeMasks, FullyMaskedRowsAndFullyMaskedKeyBlocks) {
  TestRng rng(59);
  c2f::MultiHeadAttention<float> mha(8, 2);
  randomize(mha, rng);
  const Index L = 600;
  const Tensor3<float> x = rng.tensor<float>(1, L, 8);
  c2f::BoolTensor2 keep(L, L);
  for (Index i = 0; i < L; ++i) {
    for (Index j = 0; j < L; ++j) keep(i, j) = i == 5 ? false : (j >= 512 || j == i);  // key blocks 0, 1 hidden
  }
  const c2f::Masks<float> masks = c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::keep(keep));
  const Tensor3<float> streaming = mha.forward(x, masks);
  mha.set_kernel(c2f::AttnKernel::Naive);
  const Tensor3<float> naive = mha.forward(x, masks);
  ASSERT_TRUE(all_finite(streaming));
  expect_close(streaming.data(), naive.data(), streaming.size(), 1e-5, 1e-5, "streaming vs naive");
  for (Index j = 0; j < 8; ++j) EXPECT_EQ(streaming(0, 5, j), mha.out_proj().bias()[j]);

  // C2F: a coarse row with no visible chunk gets zero coarse attention; the output stays finite.
  c2f::C2FAttention<float> c2f_attn(8, 2, 4);
  randomize(c2f_attn, rng);
  c2f::BoolTensor2 coarse(3, 3);
  coarse.setConstant(true);
  for (Index j = 0; j < 3; ++j) coarse(1, j) = false;
  const Tensor3<float> y = c2f_attn.forward(rng.tensor<float>(1, 12, 8),
                                             c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::keep(coarse)));
  EXPECT_TRUE(all_finite(y));
}

// One Masks type for every layer: a layer rejects the fields it has no use for, naming the field.
TEST(EdgeMasks, LayersRejectMaskFieldsTheyDoNotUse) {
  TestRng rng(64);
  const Tensor3<float> x = rng.tensor<float>(1, 8, 8);
  const c2f::Masks<float> attn = c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::causal());
  const c2f::Masks<float> fine = c2f::Masks<float>().fine_attn_mask(c2f::AttnMask<float>::causal());
  const c2f::Masks<float> pad = c2f::Masks<float>().key_padding_mask(c2f::KeyPaddingMask<float>::lengths({4}));
  const c2f::HMHA<float> hmha(8, 2, 4);
  EXPECT_NE(c2f_test::error_of([&] { hmha.forward(x, attn); }).find("HMHA takes no attn_mask"), std::string::npos);
  const c2f::MultiHeadAttention<float> mha(8, 2);
  EXPECT_NE(c2f_test::error_of([&] { mha.forward(x, fine); }).find("takes no fine_attn_mask"), std::string::npos);
  const c2f::C2FAttention<float> c2f_attn(8, 2, 4);
  EXPECT_NE(c2f_test::error_of([&] { c2f_attn.forward(x, pad); }).find("C2FAttention takes no key_padding_mask"),
            std::string::npos);
  const c2f::SparseC2FAttention<float> sparse(8, 2, 4, 2);
  EXPECT_NE(c2f_test::error_of([&] { sparse.forward(x, fine); }).find("takes no fine_attn_mask"), std::string::npos);
  // The fields a layer uses are accepted.
  EXPECT_EQ(mha.forward(x, pad).size(), x.size());
  EXPECT_EQ(c2f_attn.forward(x, fine).size(), x.size());
}

// -inf and lowest() (torch.finfo(float32).min, Hugging Face's "-inf") give the same result, including
// for rows that they mask completely.
TEST(EdgeMasks, MinusInfinityAndLowestMasksAgree) {
  TestRng rng(60);
  c2f::MultiHeadAttention<float> mha(8, 2);
  randomize(mha, rng);
  const Tensor3<float> x = rng.tensor<float>(2, 9, 8);
  Eigen::Tensor<float, 2, Eigen::RowMajor> with_inf(9, 9), with_lowest(9, 9);
  for (Index i = 0; i < 9; ++i) {
    for (Index j = 0; j < 9; ++j) {
      const bool masked = i == 4 || (i + j) % 3 == 0;  // row 4 fully masked
      with_inf(i, j) = masked ? -kInf : float(rng.normal());
      with_lowest(i, j) = masked ? std::numeric_limits<float>::lowest() : with_inf(i, j);
    }
  }
  Eigen::Tensor<float, 2, Eigen::RowMajor> pad_inf(2, 9), pad_lowest(2, 9);
  for (Index j = 0; j < 9; ++j) {
    pad_inf(0, j) = j == 8 ? -kInf : 0.f;
    pad_inf(1, j) = 0.f;
    pad_lowest(0, j) = j == 8 ? std::numeric_limits<float>::lowest() : 0.f;
    pad_lowest(1, j) = 0.f;
  }
  for (c2f::AttnKernel kernel : {c2f::AttnKernel::Streaming, c2f::AttnKernel::Naive}) {
    mha.set_kernel(kernel);
    const Tensor3<float> a = mha.forward(x, c2f::Masks<float>()
                                                .attn_mask(c2f::AttnMask<float>::additive(with_inf))
                                                .key_padding_mask(c2f::KeyPaddingMask<float>::additive(pad_inf)));
    const Tensor3<float> b = mha.forward(x, c2f::Masks<float>()
                                                .attn_mask(c2f::AttnMask<float>::additive(with_lowest))
                                                .key_padding_mask(c2f::KeyPaddingMask<float>::additive(pad_lowest)));
    EXPECT_TRUE(same_bits(a, b));
    EXPECT_TRUE(all_finite(a));
    for (Index j = 0; j < 8; ++j) EXPECT_EQ(a(0, 4, j), mha.out_proj().bias()[j]);
  }
  // The same for a double module reading float's lowest from a file-like tensor.
  const std::vector<float> lowest_row = {0.f, std::numeric_limits<float>::lowest()};
  const c2f::AttnMask<double> m =
      c2f::AttnMask<double>::from_tensor(c2f::MaskKind::Additive, c2f::TensorData::from_values(lowest_row.data(), {1, 2}));
  EXPECT_EQ(m.additive_values()[1], -std::numeric_limits<double>::infinity());
}

// Logits around 1e4 stay finite and match a double-precision evaluation of the same module.
TEST(EdgeNumerics, LogitsAroundTenThousandStayFinite) {
  TestRng rng(61);
  c2f::MultiHeadAttention<double> ref(8, 2);
  randomize(ref, rng, 1.0);
  c2f::MultiHeadAttention<float> mha(8, 2);
  mha.load_state_dict(ref.state_dict());
  const Tensor3<double> xd = rng.tensor<double>(1, 50, 8, 16.0);
  Tensor3<float> xf(1, 50, 8);
  for (Index i = 0; i < xd.size(); ++i) xf.data()[i] = static_cast<float>(xd.data()[i]);
  // The largest |q·k| / sqrt(dh) of this input, to show the logits really are ~1e4.
  const StateDict sd = ref.state_dict();
  const std::vector<double> w = sd.at("in_proj_weight").to_vector<double>();
  const Eigen::Map<const RowMatrix<double>> W(w.data(), 24, 8), X(xd.data(), 50, 8);
  const RowMatrix<double> q = X * W.topRows(8).transpose(), k = X * W.middleRows(8, 8).transpose();
  const double max_logit = (q.leftCols(4) * k.leftCols(4).transpose()).cwiseAbs().maxCoeff() / 2.0;
  EXPECT_GT(max_logit, 5e3);
  EXPECT_LT(max_logit, 5e4);
  const Tensor3<float> y = mha.forward(xf);
  const Tensor3<double> yd = ref.forward(xd);
  ASSERT_TRUE(all_finite(y));
  // float holds the logits to ~1e-3 absolute, so a near-tie can move; compare loosely against double.
  double max_abs = 0.0, max_ref = 0.0;
  for (Index i = 0; i < y.size(); ++i) {
    max_abs = std::max(max_abs, std::abs(double(y.data()[i]) - yd.data()[i]));
    max_ref = std::max(max_ref, std::abs(yd.data()[i]));
  }
  EXPECT_LT(max_abs, 1e-2 * max_ref);
}

// A NaN in an unmasked input reaches the output of every layer (it is not mistaken for a masked row).
TEST(EdgeNumerics, NanInAnUnmaskedInputPropagates) {
  TestRng rng(62);
  for (const Layer& layer : all_layers(rng, 8, 2)) {
    Tensor3<float> x = rng.tensor<float>(1, 12, 8);
    x(0, 6, 3) = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(any_nan(layer.forward(x))) << layer.name;
  }
}

// q = k = constant: every score is equal, so each head's attention is the mean of v — in both kernels.
TEST(EdgeMetamorphic, ConstantQueriesAndKeysAverageTheValues) {
  TestRng rng(63);
  const Index B = 2, L = 300, H = 2, dh = 4;
  RowMatrix<double> q(B * L, H * dh), k(B * L, H * dh);
  q.rowwise() = rng.matrix<double>(1, H * dh).row(0);
  k.rowwise() = rng.matrix<double>(1, H * dh).row(0);
  const RowMatrix<double> v = rng.matrix<double>(B * L, H * dh);
  for (c2f::AttnKernel kernel : {c2f::AttnKernel::Streaming, c2f::AttnKernel::Naive}) {
    RowMatrix<double> out(B * L, H * dh);
    const c2f::kernels::HeadsView<const double> qv = c2f::kernels::heads_view<const double>(q.data(), B, L, H * dh, 0, H, dh),
                                                kv = c2f::kernels::heads_view<const double>(k.data(), B, L, H * dh, 0, H, dh),
                                                vv = c2f::kernels::heads_view<const double>(v.data(), B, L, H * dh, 0, H, dh);
    const c2f::kernels::HeadsView<double> ov = c2f::kernels::heads_view<double>(out.data(), B, L, H * dh, 0, H, dh);
    if (kernel == c2f::AttnKernel::Streaming) {
      c2f::kernels::sdpa_streaming<double>(qv, kv, vv, ov, {}, 0.5, {});
    } else {
      c2f::kernels::sdpa_naive<double>(qv, kv, vv, ov, {}, 0.5, {});
    }
    for (Index b = 0; b < B; ++b) {
      const Eigen::RowVectorXd mean = v.middleRows(b * L, L).colwise().mean();
      for (Index i = 0; i < L; ++i) EXPECT_LT((out.row(b * L + i) - mean).cwiseAbs().maxCoeff(), 1e-12);
    }
  }
  // At layer level: with W_q = W_k = 0 the scores are b_q·b_k for every key, so MHA outputs
  // out_proj(mean over keys of v_proj(x)) for every query.
  c2f::MultiHeadAttention<double> mha(8, 2);
  randomize(mha, rng);
  StateDict sd = mha.state_dict();
  std::vector<double> w = sd.at("in_proj_weight").to_vector<double>();
  std::fill(w.begin(), w.begin() + 2 * 8 * 8, 0.0);
  sd.set("in_proj_weight", c2f::TensorData::from_values(w.data(), {24, 8}));
  mha.load_state_dict(sd);
  const Tensor3<double> x = rng.tensor<double>(1, 20, 8);
  const Tensor3<double> y = mha.forward(x);
  const std::vector<double> bias = sd.at("in_proj_bias").to_vector<double>();
  const Eigen::Map<const RowMatrix<double>> W(w.data(), 24, 8), X(x.data(), 20, 8);
  const Eigen::RowVectorXd vmean = ((X * W.bottomRows(8).transpose()).rowwise() +
                                    Eigen::Map<const Eigen::RowVectorXd>(bias.data() + 16, 8))
                                       .colwise()
                                       .mean();
  const Eigen::RowVectorXd want = vmean * mha.out_proj().weight().transpose() + mha.out_proj().bias().transpose();
  for (Index i = 0; i < 20; ++i) {
    for (Index j = 0; j < 8; ++j) EXPECT_NEAR(y(0, i, j), want[j], 1e-12);
  }
}

}  // namespace
