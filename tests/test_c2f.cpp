// Coarse-to-fine attention (the coarse-to-fine attention article): PyTorch fixtures, folded fast path against the
// general path, hand-derivable cases, masks, initialisation and state-dict names.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "c2f/io/masks.hpp"
#include "support/bf16.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/random.hpp"
#include "support/settings.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

namespace {

using c2f::C2FAttention;
using c2f::FinePath;
using c2f::Index;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::expect_close;
using c2f_test::meta_index;
using c2f_test::randomize;
using c2f_test::same_bits;
using c2f_test::TestRng;
using c2f_test::Tolerance;

// Masks of a C2FAttention call with only the fine stage's mask.
template <class Scalar>
c2f::Masks<Scalar> fine_only(const c2f::AttnMask<Scalar>& mask) {
  return c2f::Masks<Scalar>().fine_attn_mask(mask);
}

// ------------------------------------------------------------------------------------------------
// PyTorch fixtures (tests/reference/c2f_reference.py: the coarse-to-fine article's modules, the two bugs fixed,
// padding)

template <class Scalar>
c2f::AttnMask<Scalar> keep_mask(const StateDict& sd, const std::string& meta_key, const std::string& tensor) {
  if (sd.metadata().at(meta_key) == "none") return {};
  return c2f::attn_mask_from_tensor<Scalar>(c2f::MaskKind::Keep, sd.at(tensor));
}

template <class Scalar>
void check_fixture(const nlohmann::json& c) {
  const std::string name = c.at("name");
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path(c.at("files").at(Tolerance<Scalar>::file_key)));
  const std::string module = sd.metadata().at("module");
  const Index d = meta_index(sd, "d_model"), heads = meta_index(sd, "n_heads");
  const std::vector<Scalar> want = c2f_test::values<Scalar>(sd, "output");
  for (int threads : {1, 2}) {
    const std::string what = name + " (" + Tolerance<Scalar>::file_key + ", " + std::to_string(threads) + " threads)";
    if (module == "c2f") {
      C2FAttention<Scalar> m(d, heads, meta_index(sd, "chunk_size"));
      m.load_state_dict(sd, "c2f.");
      m.set_num_threads(threads);
      const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x");
      c2f::Masks<Scalar> masks;
      masks.attn_mask(keep_mask<Scalar>(sd, "coarse_mask", "coarse_mask"));
      masks.fine_attn_mask(keep_mask<Scalar>(sd, "fine_mask", "fine_mask"));
      const Tensor3<Scalar> summaries = m.coarse_input(x);
      const std::vector<Scalar> want_in = c2f_test::values<Scalar>(sd, "coarse_input");
      ASSERT_EQ(static_cast<std::size_t>(summaries.size()), want_in.size()) << what;
      expect_close(summaries.data(), want_in.data(), summaries.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                   what + " coarse_input");
      const std::vector<Scalar> want_ctx = c2f_test::values<Scalar>(sd, "coarse_output");
      const Tensor3<Scalar> ctx = m.coarse_attn().forward(summaries, c2f::Masks<Scalar>().attn_mask(masks.attn_mask()));
      expect_close(ctx.data(), want_ctx.data(), ctx.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                   what + " coarse_output");

      std::vector<FinePath> paths = {FinePath::Auto, FinePath::General};
      if (sd.metadata().at("fine_mask") == "none" || sd.metadata().at("fine_mask_rows_equal") == "true") {
        paths.push_back(FinePath::Folded);
      }
      for (FinePath path : paths) {
        m.set_fine_path(path);
        const Tensor3<Scalar> y = m.forward(x, masks);
        ASSERT_EQ(y.dimensions(), x.dimensions()) << what;
        expect_close(y.data(), want.data(), y.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                     what + " path " + std::to_string(static_cast<int>(path)));
      }
    } else if (module == "coarse") {
      c2f::CoarseAttention<Scalar> m(d, heads, typename c2f::CoarseAttention<Scalar>::Options().num_threads(threads));
      m.load_state_dict(sd, "coarse.");
      const Tensor3<Scalar> y = m.forward(c2f_test::tensor3<Scalar>(sd, "x"),
                                          c2f::Masks<Scalar>().attn_mask(keep_mask<Scalar>(sd, "mask", "mask")));
      ASSERT_EQ(static_cast<std::size_t>(y.size()), want.size()) << what;
      expect_close(y.data(), want.data(), y.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol, what);
    } else {
      ASSERT_EQ(module, "fine");
      c2f::FineAttention<Scalar> m(d, heads, typename c2f::FineAttention<Scalar>::Options().num_threads(threads));
      m.load_state_dict(sd, "fine.");
      const c2f::TensorData& xt = sd.at("x");
      c2f::Tensor4<Scalar> x(xt.shape()[0], xt.shape()[1], xt.shape()[2], xt.shape()[3]);
      xt.copy_to(x.data());
      for (FinePath path : {FinePath::Auto, FinePath::General}) {
        m.set_fine_path(path);
        const c2f::Tensor4<Scalar> y = m.forward(x, c2f_test::tensor3<Scalar>(sd, "coarse_context"),
                                                 c2f::Masks<Scalar>().attn_mask(keep_mask<Scalar>(sd, "mask", "mask")));
        ASSERT_EQ(y.dimensions(), x.dimensions()) << what;
        expect_close(y.data(), want.data(), y.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol, what);
      }
    }
  }
}

// One gtest entry per fixture file: Fixtures/C2FFixture.MatchesPyTorchModules/<case>_<f32|f64>.
C2F_FIXTURE_TEST(C2FFixture, MatchesPyTorchModules, "c2f", check_fixture);

// The required (L, chunk) pairs are all in the fixture set.
TEST(C2FFixtureCoverage, CoversTheRequiredShapes) {
  ASSERT_GE(c2f_test::manifest_cases("c2f").size(), 20u);
  bool divisible = false, l61_chunk8 = false, shorter = false, chunk1 = false, chunk_eq_l = false;
  bool coarse_mask = false, fine_mask = false;
  for (const nlohmann::json& c : c2f_test::manifest_cases("c2f")) {
    if (c.at("module") != "c2f") continue;
    const long L = std::stol(c.at("seq_len").get<std::string>()), k = std::stol(c.at("chunk_size").get<std::string>());
    divisible |= L % k == 0 && L > k;
    l61_chunk8 |= L == 61 && k == 8;
    shorter |= L < k;
    chunk1 |= k == 1;
    chunk_eq_l |= k == L;
    coarse_mask |= c.at("coarse_mask") == "bool";
    fine_mask |= c.at("fine_mask") == "bool";
  }
  EXPECT_TRUE(divisible && l61_chunk8 && shorter && chunk1 && chunk_eq_l && coarse_mask && fine_mask);
}

// ------------------------------------------------------------------------------------------------
// Folded fast path against the general (seed-literal) path

// A fine mask [chunks, chunk, chunk] whose rows are equal within each chunk (a per-chunk key mask, each
// key kept with probability 0.7), with about one chunk in ten fully masked.
template <class Scalar>
c2f::AttnMask<Scalar> per_chunk_key_mask(Index chunks, Index chunk, TestRng& rng) {
  c2f::BoolTensor3 keep(chunks, chunk, chunk);
  for (Index c = 0; c < chunks; ++c) {
    const bool all_masked = rng.coin(0.1);
    for (Index j = 0; j < chunk; ++j) {
      const bool kj = !all_masked && rng.coin(0.7);
      for (Index t = 0; t < chunk; ++t) keep(c, t, j) = kj;
    }
  }
  return c2f::AttnMask<Scalar>::keep(keep);
}

template <class T>
class C2FPathTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(C2FPathTest, Scalars);

TYPED_TEST(C2FPathTest, FoldedPathEqualsGeneralPathOnRandomShapes) {
  using Scalar = TypeParam;
  TestRng rng(31);
  const std::vector<Index> chunks = {1, 2, 3, 7, 8, 16, 31, 32, 33};
  constexpr int kShapes = 36;
  for (int rep = 0; rep < kShapes; ++rep) {
    const Index heads = rng.pick(std::vector<Index>{1, 2, 4});
    const Index d = heads * rng.pick(std::vector<Index>{1, 3, 4, 8});
    const Index chunk = rng.pick(chunks);
    // Lengths 1, chunk - 1, chunk, chunk + 1, primes and random ones.
    const Index length = std::max<Index>(
        1, rng.pick(std::vector<Index>{1, chunk - 1, chunk, chunk + 1, 37, 61, 97, rng.uniform_int(2, 150)}));
    const Index batch = rng.uniform_int(1, 3);
    C2FAttention<Scalar> m(d, heads, chunk,
                           typename C2FAttention<Scalar>::Options()
                               .num_threads(static_cast<int>(rng.uniform_int(1, 2)))
                               .fine_path(FinePath::Folded));
    randomize(m, rng);
    const Tensor3<Scalar> x = rng.tensor<Scalar>(batch, length, d);
    const Index nchunks = (length + chunk - 1) / chunk;

    // Half the shapes use a fine mask whose rows are equal within each chunk (a per-chunk key mask),
    // with some chunks fully masked; the folded path must accept it.
    c2f::Masks<Scalar> masks;
    std::string mask_desc = "none";
    if (rep % 2 == 1) {
      masks.fine_attn_mask(per_chunk_key_mask<Scalar>(batch * nchunks, chunk, rng));
      mask_desc = "per-chunk keys";
    }
    std::ostringstream what;
    what << "rep " << rep << ": batch=" << batch << " L=" << length << " chunk=" << chunk << " d=" << d
         << " heads=" << heads << " mask=" << mask_desc;
    SCOPED_TRACE(what.str());
    // forward_into() writes every row of the caller's buffer, with the bits of forward().
    const auto into = [&] {
      Tensor3<Scalar> out(batch, length, d);
      out.setConstant(Scalar(7));
      m.forward_into(x, Eigen::Map<c2f::RowMatrix<Scalar>>(out.data(), batch * length, d), masks);
      return out;
    };
    const Tensor3<Scalar> folded = m.forward(x, masks);
    EXPECT_TRUE(same_bits(folded, into())) << "forward_into, folded path";
    m.set_fine_path(FinePath::General);
    const Tensor3<Scalar> general = m.forward(x, masks);
    EXPECT_TRUE(same_bits(general, into())) << "forward_into, general path";
    ASSERT_TRUE(general.dimensions() == folded.dimensions());
    const double tol = std::is_same<Scalar, float>::value ? 2e-5 : 1e-12;
    expect_close(folded.data(), general.data(), folded.size(), tol, tol, what.str());
  }
}

// With several workers and enough chunks (here d = 512, 8 heads: groups of about 24 chunks, from 96
// chunks on), the folded stage runs its whole chain group by group (FineAttention::folded_groups). The
// bits must be those of one thread, which runs every product over all the chunks at once (the path
// FoldedPathEqualsGeneralPathOnRandomShapes checks), so every group must line up its rows, tokens and
// mask with the whole.
TYPED_TEST(C2FPathTest, FoldedGroupsKeepTheBitsOfOneThread) {
  using Scalar = TypeParam;
  TestRng rng(33);
  constexpr Index kD = 512, kHeads = 8;
  for (const Index chunk : {2, 3}) {
    const Index batch = 2, length = 50 * chunk - 1;  // 100 chunks, the last of each batch item partial
    const Index nchunks = (length + chunk - 1) / chunk;
    C2FAttention<Scalar> m(kD, kHeads, chunk, typename C2FAttention<Scalar>::Options().fine_path(FinePath::Folded));
    randomize(m, rng);
    const Tensor3<Scalar> x = rng.tensor<Scalar>(batch, length, kD);
    for (const bool masked : {false, true}) {
      c2f::Masks<Scalar> masks;
      if (masked) {  // a per-chunk key mask, some chunks fully masked
        masks.fine_attn_mask(per_chunk_key_mask<Scalar>(batch * nchunks, chunk, rng));
      }
      SCOPED_TRACE("chunk " + std::to_string(chunk) + (masked ? ", per-chunk key mask" : ", no mask"));
      m.set_num_threads(1);
      const Tensor3<Scalar> one = m.forward(x, masks);
      m.set_num_threads(2);
      const Tensor3<Scalar> two = m.forward(x, masks);
      EXPECT_TRUE(same_bits(one, two)) << "2 threads (groups of chunks) against 1 (one pass)";
    }
  }
}

TEST(C2FPath, FoldedPathRejectsMasksWhoseRowsDiffer) {
  C2FAttention<float> m(8, 2, 4, C2FAttention<float>::Options().num_threads(1).fine_path(FinePath::Folded));
  TestRng rng(32);
  const Tensor3<float> x = rng.tensor<float>(1, 8, 8);
  c2f::BoolTensor2 causal(4, 4);
  for (Index i = 0; i < 4; ++i) {
    for (Index j = 0; j < 4; ++j) causal(i, j) = j <= i;
  }
  EXPECT_THROW(m.forward(x, fine_only(c2f::AttnMask<float>::keep(causal))), std::invalid_argument);
  m.set_fine_path(FinePath::Auto);  // Auto falls back to the general path
  const Tensor3<float> y = m.forward(x, fine_only(c2f::AttnMask<float>::keep(causal)));
  EXPECT_TRUE(Eigen::Map<const Eigen::ArrayXf>(y.data(), y.size()).allFinite());
}

// ------------------------------------------------------------------------------------------------
// Hand-derivable cases

// chunk = 1: every chunk is one token, so the fine softmax has one key with weight 1 and the output is
// out_proj(v_proj(x)) whatever the query: y = (x W_vᵀ + b_v) W_oᵀ + b_o.
TEST(C2FMetamorphic, ChunkOneIsOutProjOfValueProjection) {
  TestRng rng(33);
  C2FAttention<double> m(12, 3, 1);
  randomize(m, rng);
  const Tensor3<double> x = rng.tensor<double>(2, 9, 12);
  const StateDict sd = m.state_dict();
  const std::vector<double> wkv = sd.at("fine_attn.kv_proj.weight").to_vector<double>(),
                            bkv = sd.at("fine_attn.kv_proj.bias").to_vector<double>(),
                            wo = sd.at("fine_attn.out_proj.weight").to_vector<double>(),
                            bo = sd.at("fine_attn.out_proj.bias").to_vector<double>();
  const Eigen::Map<const c2f::RowMatrix<double>> Wkv(wkv.data(), 24, 12), Wo(wo.data(), 12, 12);
  const Eigen::Map<const Eigen::VectorXd> Bkv(bkv.data(), 24), Bo(bo.data(), 12);
  const Eigen::Map<const c2f::RowMatrix<double>> X(x.data(), 18, 12);
  const c2f::RowMatrix<double> v = (X * Wkv.bottomRows(12).transpose()).rowwise() + Bkv.tail(12).transpose();
  const c2f::RowMatrix<double> want = (v * Wo.transpose()).rowwise() + Bo.transpose();
  for (FinePath path : {FinePath::Folded, FinePath::General}) {
    m.set_fine_path(path);
    const Tensor3<double> y = m.forward(x);
    expect_close(y.data(), want.data(), y.size(), 1e-12, 1e-12, "chunk 1");
  }
}

// chunk = L: one chunk, so the coarse stage sees one summary (softmax over one key: context =
// out_proj(v(mean x))) and every token gets the same output.
TEST(C2FMetamorphic, ChunkEqualToLengthGivesOneOutputRowPerBatch) {
  TestRng rng(34);
  C2FAttention<double> m(8, 2, 10);
  randomize(m, rng);
  const Tensor3<double> x = rng.tensor<double>(2, 10, 8);
  const Tensor3<double> y = m.forward(x);
  for (Index b = 0; b < 2; ++b) {
    for (Index t = 1; t < 10; ++t) {
      for (Index j = 0; j < 8; ++j) EXPECT_EQ(y(b, t, j), y(b, 0, j));
    }
  }
  // The coarse context of a single chunk is out_proj(W_v mean(x) + b_v) — no attention involved.
  const Tensor3<double> summaries = m.coarse_input(x);
  const Tensor3<double> ctx = m.coarse_attn().forward(summaries);
  const StateDict sd = m.state_dict();
  const std::vector<double> w = sd.at("coarse_attn.qkv_proj.weight").to_vector<double>(),
                            bqkv = sd.at("coarse_attn.qkv_proj.bias").to_vector<double>(),
                            wo = sd.at("coarse_attn.out_proj.weight").to_vector<double>(),
                            bo = sd.at("coarse_attn.out_proj.bias").to_vector<double>();
  const Eigen::Map<const c2f::RowMatrix<double>> W(w.data(), 24, 8), Wo(wo.data(), 8, 8);
  for (Index b = 0; b < 2; ++b) {
    Eigen::VectorXd mean = Eigen::VectorXd::Zero(8);
    for (Index t = 0; t < 10; ++t) {
      for (Index j = 0; j < 8; ++j) mean[j] += x(b, t, j) / 10.0;
    }
    const Eigen::VectorXd v = W.bottomRows(8) * mean + Eigen::Map<const Eigen::VectorXd>(bqkv.data() + 16, 8);
    const Eigen::VectorXd want = Wo * v + Eigen::Map<const Eigen::VectorXd>(bo.data(), 8);
    for (Index j = 0; j < 8; ++j) EXPECT_NEAR(ctx(b, 0, j), want[j], 1e-12);
  }
}

// A token whose fine-mask row hides every key gets zero attention: its output is out_proj.bias.
TEST(C2FMasks, FullyMaskedFineRowOutputsOutProjBias) {
  TestRng rng(35);
  C2FAttention<float> m(8, 2, 4);
  randomize(m, rng);
  const Tensor3<float> x = rng.tensor<float>(1, 8, 8);
  c2f::BoolTensor3 keep(2, 4, 4);
  keep.setConstant(true);
  for (Index j = 0; j < 4; ++j) keep(1, 2, j) = false;  // chunk 1, token 2 (= token 6) sees nothing
  const std::vector<float> bias = m.state_dict().at("fine_attn.out_proj.bias").to_vector<float>();
  const Tensor3<float> y = m.forward(x, fine_only(c2f::AttnMask<float>::keep(keep)));
  for (Index j = 0; j < 8; ++j) EXPECT_EQ(y(0, 6, j), bias[static_cast<std::size_t>(j)]);
  EXPECT_NE(y(0, 5, 0), bias[0]);
  // A whole chunk masked for every row: the folded path takes it, with the same result.
  c2f::BoolTensor3 chunk_hidden(2, 4, 4);
  chunk_hidden.setConstant(true);
  for (Index t = 0; t < 4; ++t) {
    for (Index j = 0; j < 4; ++j) chunk_hidden(0, t, j) = false;
  }
  for (FinePath path : {FinePath::Folded, FinePath::General}) {
    m.set_fine_path(path);
    const Tensor3<float> z = m.forward(x, fine_only(c2f::AttnMask<float>::keep(chunk_hidden)));
    for (Index t = 0; t < 4; ++t) {
      for (Index j = 0; j < 8; ++j) EXPECT_EQ(z(0, t, j), bias[static_cast<std::size_t>(j)]);
    }
  }
}

TEST(C2FMasks, WrongMaskShapesNameTheShapes) {
  C2FAttention<float> m(8, 2, 4);
  TestRng rng(36);
  const Tensor3<float> x = rng.tensor<float>(2, 10, 8);  // 3 chunks per batch
  c2f::BoolTensor3 fine(5, 4, 4), coarse(2, 3, 2);
  fine.setConstant(true);
  coarse.setConstant(true);
  try {
    m.forward(x, fine_only(c2f::AttnMask<float>::keep(fine)));
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("[5, 4, 4]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.forward(x, c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::keep(coarse))), std::invalid_argument);
  EXPECT_THROW(m.forward(rng.tensor<float>(2, 10, 6)), std::invalid_argument);
  c2f::RowMatrix<float> out(19, 8);
  try {
    m.forward_into(x, out);
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("= [20, 8] for an output [2, 10, 8], got [19, 8]"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(C2FAttention<float>(10, 3, 4), std::invalid_argument);
  EXPECT_THROW(C2FAttention<float>(8, 2, 0), std::invalid_argument);
}

// ------------------------------------------------------------------------------------------------
// Threads, initialisation, names

TEST(C2FInit, SeedAdviceIsFollowedDeterministically) {
  const Index d = 64;
  C2FAttention<double> a(d, 4, 8, C2FAttention<double>::Options().num_threads(1).seed(5)),
      b(d, 4, 8, C2FAttention<double>::Options().num_threads(1).seed(5)),
      c(d, 4, 8, C2FAttention<double>::Options().num_threads(1).seed(6));
  const StateDict sa = a.state_dict(), sb = b.state_dict(), sc = c.state_dict();
  for (const auto& [key, t] : sa) EXPECT_EQ(t.bytes(), sb.at(key).bytes()) << key;
  EXPECT_NE(sa.at("fine_attn.q_proj.weight").bytes(), sc.at("fine_attn.q_proj.weight").bytes());
  // Zero biases.
  for (const auto& [key, t] : sa) {
    if (key.size() > 4 && key.compare(key.size() - 4, 4, "bias") == 0) {
      for (double v : t.to_vector<double>()) EXPECT_EQ(v, 0.0) << key;
    }
  }
  // Xavier-uniform coarse qkv_proj.weight [3d, d]: |w| ≤ sqrt(6 / (d + 3d)), variance bound² / 3.
  const std::vector<double> qkv = sa.at("coarse_attn.qkv_proj.weight").to_vector<double>();
  const double bound = std::sqrt(6.0 / (4.0 * d));
  double sq = 0.0, max_abs = 0.0;
  for (double v : qkv) {
    sq += v * v;
    max_abs = std::max(max_abs, std::abs(v));
  }
  EXPECT_LE(max_abs, bound);
  EXPECT_GT(max_abs, 0.95 * bound);
  EXPECT_NEAR(sq / double(qkv.size()), bound * bound / 3.0, 0.05 * bound * bound / 3.0);
  // Kaiming-normal (fan_out) fine q_proj.weight [d, d]: std sqrt(2 / d).
  const std::vector<double> q = sa.at("fine_attn.q_proj.weight").to_vector<double>();
  double mean = 0.0, var = 0.0;
  for (double v : q) mean += v / double(q.size());
  for (double v : q) var += (v - mean) * (v - mean) / double(q.size());
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(var, 2.0 / d, 0.06 * 2.0 / d);
}

TEST(C2FStateDict, NamesAreThePyTorchModulesNames) {
  C2FAttention<float> m(16, 4, 8);
  std::vector<std::string> keys;
  for (const auto& kv : m.state_dict("c2f")) keys.push_back(kv.first);
  EXPECT_EQ(keys, (std::vector<std::string>{"c2f.coarse_attn.out_proj.bias", "c2f.coarse_attn.out_proj.weight",
                                            "c2f.coarse_attn.qkv_proj.bias", "c2f.coarse_attn.qkv_proj.weight",
                                            "c2f.fine_attn.kv_proj.bias", "c2f.fine_attn.kv_proj.weight",
                                            "c2f.fine_attn.out_proj.bias", "c2f.fine_attn.out_proj.weight",
                                            "c2f.fine_attn.q_proj.bias", "c2f.fine_attn.q_proj.weight"}));
  StateDict sd = m.state_dict("c2f");
  C2FAttention<float> other(16, 4, 8, C2FAttention<float>::Options().num_threads(1).seed(9));
  other.load_state_dict(sd, "c2f");
  sd.set("c2f.fine_attn.extra", c2f::TensorData::from_values(std::vector<float>(1).data(), {1}));
  try {
    other.load_state_dict(sd, "c2f");
    ADD_FAILURE() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("c2f.fine_attn.extra"), std::string::npos) << e.what();
  }
}

// The c2f multi-head attention article's C2FMultiHeadAttention is full MHA with qkv_proj/out_proj names:
// MultiHeadAttention loads it, and CoarseAttention is the same module (whose products are row-independent: the same
// bits as an MHA built so).
TEST(C2FMultiHeadArticle, CoarseAttentionIsMultiHeadAttentionWithQkvProjNames) {
  TestRng rng(38);
  c2f::CoarseAttention<double> coarse(8, 2);
  randomize(coarse, rng);
  const StateDict sd = coarse.state_dict();
  c2f::MultiHeadAttention<double> mha(8, 2, c2f::MultiHeadAttention<double>::Options().rows_independent(true));
  mha.load_state_dict(sd);
  const Tensor3<double> x = rng.tensor<double>(2, 5, 8);
  EXPECT_TRUE(same_bits(coarse.forward(x), mha.forward(x)));
}

// --- Compute::BFloat16 (docs/bf16.md) -------------------------------------------------------------------

// The article's C2FAttention in fp32 and under torch.autocast("cpu", bfloat16) (tests/data/bf16): c2f's
// bfloat16 layer within 2e-2 · max|y| of both on the folded and the general fine path, on every engine the CPU has,
// the same bits for 1 and 2 threads; the printed figures are docs/bf16.md's.
TEST(C2fBf16, MatchesTorchAutocastAndFp32WithinTheStatedBound) {
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path("bf16/c2f_chunk8_l64_f32.safetensors"));
  const Tensor3<float> x = c2f_test::tensor3<float>(sd, "x");
  const std::vector<float> fp32 = c2f_test::values<float>(sd, "output"),
                           autocast = c2f_test::values<float>(sd, "output_autocast");
  for (FinePath path : {FinePath::Folded, FinePath::General}) {
    for (c2f::Bf16Engine e : c2f_test::available_bf16_engines()) {
      const auto engine_setting = c2f_test::scoped_bf16_engine(e);
      const char* engine = c2f::bf16_engine_name(e);
      C2FAttention<float> m(
          meta_index(sd, "d_model"), meta_index(sd, "num_heads"), meta_index(sd, "chunk_size"),
          C2FAttention<float>::Options().fine_path(path).compute(c2f::Compute::BFloat16).num_threads(2));
      m.load_state_dict(sd, "c2f.");
      const Tensor3<float> y = m.forward(x);
      m.set_num_threads(1);
      EXPECT_TRUE(same_bits(m.forward(x), y)) << engine;
      c2f_test::expect_bf16_accuracy(
          std::string("c2f_chunk8_l64 (") + (path == FinePath::Folded ? "folded" : "general") + " path), " + engine,
          y.data(), fp32, autocast);
    }
  }
  TestRng rng(0xbf21);
  const Tensor3<float> tokens = rng.tensor<float>(1, 16, 8);
  const C2FAttention<float> bf16(8, 2, 4, C2FAttention<float>::Options().compute(c2f::Compute::BFloat16));
  EXPECT_THROW((void)bf16.forward_train(tokens, c2f::Masks<float>(), 0), std::invalid_argument);
  try {
    C2FAttention<double> bad(8, 2, 4, C2FAttention<double>::Options().compute(c2f::Compute::BFloat16));
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("compute BFloat16 needs float, got double"), std::string::npos) << e.what();
  }
}

}  // namespace
