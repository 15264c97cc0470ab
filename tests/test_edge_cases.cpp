// A defined result for every awkward input, for every layer: empty batches and sequences, length 1,
// chunks and windows longer than the sequence, bad shapes and weights, masks that hide everything,
// huge logits, NaN, and -inf versus lowest() masks. Each case's documented result is in the README
// ("Edge cases").
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "c2f/io/masks.hpp"
#include "support/compare.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

// ------------------------------------------------------------------------------------------------
// Shapes

// FineAttention's module interface with zero chunks: an empty output. (Every layer's empty batch and
// sequence: tests/test_layer_contract.cpp.)
TEST(EdgeShapes, FineAttentionWithoutChunksGivesAnEmptyOutput) {
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
  const std::vector<double> w = sd.at("in_proj_weight").to_vector<double>(),
                            b = sd.at("in_proj_bias").to_vector<double>();
  const Eigen::Map<const RowMatrix<double>> W(w.data(), 24, 8), X(x.data(), 3, 8);
  const RowMatrix<double> v =
      (X * W.bottomRows(8).transpose()).rowwise() + Eigen::Map<const Eigen::RowVectorXd>(b.data() + 16, 8);
  const RowMatrix<double> want =
      (v * mha.out_proj().weight().transpose()).rowwise() + mha.out_proj().bias().transpose();
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
    expect_close(y_hmha.data(), expect_y.data(), y_hmha.size(), 1e-12, 1e-12,
                 causal ? "HMHA L = 1 causal" : "HMHA L = 1");
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
  EXPECT_NE(error_of([] { c2f::HMHA<float>(10, 4, 4); }).find("divisible"), std::string::npos);
  EXPECT_THROW(c2f::MultiHeadAttention<float>(8, 0), std::invalid_argument);
  EXPECT_THROW(c2f::HMHA<float>(8, -2, 4), std::invalid_argument);
}

TEST(EdgeShapes, MismatchedBatchesNameBothShapes) {
  TestRng rng(57);
  c2f::MultiHeadAttention<float> mha(8, 2);
  std::string msg = error_of(
      [&] { mha.forward(rng.tensor<float>(2, 5, 8), rng.tensor<float>(3, 4, 8), rng.tensor<float>(3, 4, 8)); });
  EXPECT_NE(msg.find("[2, 5, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 4, 8]"), std::string::npos) << msg;
  c2f::FineAttention<float> fine(8, 2);
  msg = error_of([&] { fine.forward_chunked(rng.tensor<float>(2, 8, 8), 4, rng.tensor<float>(3, 2, 8)); });
  EXPECT_NE(msg.find("[2, 2, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 2, 8]"), std::string::npos) << msg;
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
  const Tensor3<float> y =
      c2f_attn.forward(rng.tensor<float>(1, 12, 8), c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::keep(coarse)));
  EXPECT_TRUE(all_finite(y));
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
  const c2f::AttnMask<double> m = c2f::attn_mask_from_tensor<double>(
      c2f::MaskKind::Additive, c2f::TensorData::from_values(lowest_row.data(), {1, 2}));
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
    const c2f::kernels::HeadsView<const double> qv = c2f::kernels::heads_view<const double>(q.data(), B, L, H * dh, 0,
                                                                                            H, dh),
                                                kv = c2f::kernels::heads_view<const double>(k.data(), B, L, H * dh, 0,
                                                                                            H, dh),
                                                vv = c2f::kernels::heads_view<const double>(v.data(), B, L, H * dh, 0,
                                                                                            H, dh);
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
  const Eigen::RowVectorXd vmean =
      ((X * W.bottomRows(8).transpose()).rowwise() + Eigen::Map<const Eigen::RowVectorXd>(bias.data() + 16, 8))
          .colwise()
          .mean();
  const Eigen::RowVectorXd want = vmean * mha.out_proj().weight().transpose() + mha.out_proj().bias().transpose();
  for (Index i = 0; i < 20; ++i) {
    for (Index j = 0; j < 8; ++j) EXPECT_NEAR(y(0, i, j), want[j], 1e-12);
  }
}

}  // namespace
