// SparseC2FAttention: PyTorch fixtures of the selection semantics (dense masks), equality with
// nn.MultiheadAttention when top_k covers everything, and the kernels against dense twins.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "c2f/io/masks.hpp"
#include "support/bf16.hpp"
#include "support/compare.hpp"
#include "support/fixtures.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

namespace {

using c2f::Index;
using c2f::RowMatrix;
using c2f::SparseC2FAttention;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::expect_close;
using c2f_test::meta_index;
using c2f_test::randomize;
using c2f_test::TestRng;
using c2f_test::Tolerance;

template <class T>
class SparseTyped : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(SparseTyped, Scalars);

/// A selection's rows widened to `top_k` entries (−1 after its own, which stop at the number of chunks).
std::vector<Index> widened(const c2f::kernels::ChunkSelection& s, Index top_k) {
  std::vector<Index> out;
  for (std::size_t r = 0; r * static_cast<std::size_t>(s.top_k) < s.index.size(); ++r) {
    for (Index i = 0; i < top_k; ++i)
      out.push_back(i < s.top_k ? s.index[r * static_cast<std::size_t>(s.top_k) + static_cast<std::size_t>(i)] : -1);
  }
  return out;
}

template <class Scalar>
void check_case(const nlohmann::json& c) {
  const std::string name = c.at("name");
  const StateDict sd = c2f::load_safetensors(c2f_test::data_path(c.at("files").at(Tolerance<Scalar>::file_key)));
  const bool causal = sd.metadata().at("causal") == "true";
  typename SparseC2FAttention<Scalar>::Options o;
  o.gating(sd.metadata().at("gating") == "token" ? c2f::Gating::PerToken : c2f::Gating::PerChunk);
  SparseC2FAttention<Scalar> sparse(meta_index(sd, "embed_dim"), meta_index(sd, "num_heads"),
                                    meta_index(sd, "chunk_size"), meta_index(sd, "top_k"), o.causal(causal));
  sparse.load_state_dict(sd, "mha.");
  const Tensor3<Scalar> x = c2f_test::tensor3<Scalar>(sd, "x");
  c2f::Masks<Scalar> masks;
  if (sd.metadata().at("key_padding_mask") == "bool") {
    masks.key_padding_mask(c2f::key_padding_mask_from_tensor<Scalar>(c2f::MaskKind::Ignore, sd.at("key_padding_mask")));
  }
  const std::vector<std::int64_t> want_sel = c2f_test::int64_values(sd, "selected");
  const std::vector<Scalar> want = c2f_test::values<Scalar>(sd, "output");
  for (int threads : {1, 2}) {
    sparse.set_num_threads(threads);
    const c2f::SparseAttnOutput<Scalar> r = sparse.forward_with_selection(x, masks);
    const std::vector<Index> got_sel = widened(r.selection, meta_index(sd, "top_k"));
    ASSERT_EQ(got_sel.size(), want_sel.size());
    for (std::size_t i = 0; i < want_sel.size(); ++i) {
      ASSERT_EQ(got_sel[i], want_sel[i]) << "selection entry " << i;
    }
    ASSERT_EQ(static_cast<std::size_t>(r.output.size()), want.size());
    expect_close(r.output.data(), want.data(), r.output.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                 name + " " + std::to_string(threads) + " threads");
  }
  if (sd.metadata().at("covers_all") == "true") {
    // nn.MultiheadAttention's own output, and c2f's MultiHeadAttention on the same weights.
    const std::vector<Scalar> torch_mha = c2f_test::values<Scalar>(sd, "mha_output");
    const Tensor3<Scalar> y = sparse.forward(x, masks);
    expect_close(y.data(), torch_mha.data(), y.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                 name + " vs torch MHA");
    c2f::Masks<Scalar> dense_masks = masks;
    if (causal) dense_masks.attn_mask(c2f::AttnMask<Scalar>::causal());
    const Tensor3<Scalar> ours = sparse.as_multihead_attention().forward(x, dense_masks);
    expect_close(y.data(), ours.data(), y.size(), Tolerance<Scalar>::atol, Tolerance<Scalar>::rtol,
                 name + " vs c2f MHA");
  }
}

// One gtest entry per fixture file: Fixtures/SparseFixture.MatchesTorchSelectionSemantics/<case>_<f32|f64>.
C2F_FIXTURE_TEST(SparseFixture, MatchesTorchSelectionSemantics, "sparse", check_case);

// Per-chunk gating (non-causal), per-token gating non-causal and causal, each over
// top_k ∈ {1, 2, 4} × chunk ∈ {8, 16} × L ∈ {37, 128}; and top_k covering everything for each.
TEST(SparseFixtureCoverage, CoversTheRequiredGrid) {
  ASSERT_GE(c2f_test::manifest_cases("sparse").size(), 36u);
  std::set<std::string> seen, covers_all;
  for (const nlohmann::json& c : c2f_test::manifest_cases("sparse")) {
    const std::string mode = c.at("gating").get<std::string>() + "/" + c.at("causal").get<std::string>();
    seen.insert(c.at("top_k").get<std::string>() + "/" + c.at("chunk_size").get<std::string>() + "/" +
                c.at("seq_len").get<std::string>() + "/" + mode);
    if (c.at("covers_all") == "true") covers_all.insert(mode);
  }
  for (const char* mode : {"chunk/false", "token/false", "token/true"}) {
    for (const char* k : {"1", "2", "4"}) {
      for (const char* chunk : {"8", "16"}) {
        for (const char* L : {"37", "128"}) {
          EXPECT_TRUE(seen.count(std::string(k) + "/" + chunk + "/" + L + "/" + mode)) << k << chunk << L << mode;
        }
      }
    }
    EXPECT_TRUE(covers_all.count(mode)) << mode;
  }
}

// ------------------------------------------------------------------------------------------------
// Twins on random shapes

// The selection, brute force: rank every eligible other chunk by its score — the mean query of the
// query chunk (per chunk) or the token's own query (per token) dotted with the mean key of the chunk.
template <class Scalar>
std::vector<Index> brute_force_selection(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k, Index batch,
                                         Index length, Index heads, Index chunk, Index top_k, bool per_token,
                                         bool causal) {
  const Index m = (length + chunk - 1) / chunk, dh = q.cols() / heads, rows = per_token ? length : m;
  std::vector<Index> out(static_cast<std::size_t>(batch * heads * rows * top_k), -1);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      RowMatrix<Scalar> qm = RowMatrix<Scalar>::Zero(m, dh), km = RowMatrix<Scalar>::Zero(m, dh);
      for (Index t = 0; t < length; ++t) {
        const Index j = t / chunk, n = std::min(chunk, length - j * chunk);
        qm.row(j) += q.block(b * length + t, h * dh, 1, dh) / Scalar(n);
        km.row(j) += k.block(b * length + t, h * dh, 1, dh) / Scalar(n);
      }
      for (Index i = 0; i < rows; ++i) {
        const Index own = per_token ? i / chunk : i;
        const RowMatrix<Scalar> query =
            per_token ? RowMatrix<Scalar>(q.block(b * length + i, h * dh, 1, dh)) : RowMatrix<Scalar>(qm.row(i));
        std::vector<std::pair<Scalar, Index>> ranked;
        for (Index j = 0; j < (causal ? own : m); ++j) {
          if (j != own) ranked.push_back({-query.row(0).dot(km.row(j)), j});
        }
        std::sort(ranked.begin(), ranked.end());
        std::vector<Index> chosen = {own};
        for (Index r = 0; r < std::min<Index>(top_k - 1, static_cast<Index>(ranked.size())); ++r) {
          chosen.push_back(ranked[static_cast<std::size_t>(r)].second);
        }
        std::sort(chosen.begin(), chosen.end());
        std::copy(chosen.begin(), chosen.end(), out.begin() + ((b * heads + h) * rows + i) * top_k);
      }
    }
  }
  return out;
}

// The fine stage's twin: full attention (naive kernel) under the dense [B·H, L, L] keep mask that the
// selection (per query chunk or per token), the causal rule and the key padding define.
template <class Scalar>
RowMatrix<Scalar> dense_fine_stage(const RowMatrix<Scalar>& q, const RowMatrix<Scalar>& k, const RowMatrix<Scalar>& v,
                                   Index batch, Index length, Index heads, Index chunk,
                                   const std::vector<Index>& selection, Index top_k, bool per_token, bool causal,
                                   const std::vector<Index>& lengths) {
  const Index m = (length + chunk - 1) / chunk, dh = q.cols() / heads, rows = per_token ? length : m;
  c2f::BoolTensor3 keep(batch * heads, length, length);
  keep.setConstant(false);
  for (Index b = 0; b < batch; ++b) {
    for (Index h = 0; h < heads; ++h) {
      for (Index t = 0; t < length; ++t) {
        const Index* row = selection.data() + ((b * heads + h) * rows + (per_token ? t : t / chunk)) * top_k;
        for (Index s = 0; s < top_k && row[s] >= 0; ++s) {
          for (Index j = row[s] * chunk; j < std::min(length, (row[s] + 1) * chunk); ++j) {
            keep(b * heads + h, t, j) = (!causal || j <= t) && j < lengths[static_cast<std::size_t>(b)];
          }
        }
      }
    }
  }
  const c2f::AttnMask<Scalar> mask = c2f::AttnMask<Scalar>::keep(keep);
  const c2f::MaskView<Scalar> plan(mask, {}, batch, heads, length, length);
  RowMatrix<Scalar> out(batch * length, q.cols());
  c2f::kernels::sdpa_naive<Scalar>(
      c2f::kernels::heads_view<const Scalar>(q.data(), batch, length, q.cols(), 0, heads, dh),
      c2f::kernels::heads_view<const Scalar>(k.data(), batch, length, q.cols(), 0, heads, dh),
      c2f::kernels::heads_view<const Scalar>(v.data(), batch, length, q.cols(), 0, heads, dh),
      c2f::kernels::heads_view<Scalar>(out.data(), batch, length, q.cols(), 0, heads, dh), plan,
      c2f::kernels::default_scale<Scalar>(dh), {});
  return out;
}

template <class Scalar>
RowMatrix<Scalar> chunk_means(const RowMatrix<Scalar>& k, const c2f::kernels::ChunkGrid& grid) {
  RowMatrix<Scalar> means(grid.chunks(), k.cols());
  c2f::kernels::chunk_mean<Scalar>(k, grid, means, c2f::kernels::with_threads(1));
  return means;
}

// Both gatings' selection and fine kernels against the brute-force selection and the dense fine stage.
TYPED_TEST(SparseTyped, KernelsMatchTheirTwinsOnRandomShapes) {
  using Scalar = TypeParam;
  TestRng rng(71);
  for (int rep = 0; rep < 80; ++rep) {
    const bool per_token = rep % 2 == 1;  // 40 shapes per gating
    const Index heads = rng.pick(std::vector<Index>{1, 2, 4}), dh = rng.pick(std::vector<Index>{1, 3, 4});
    const Index chunk = rng.pick(std::vector<Index>{1, 2, 3, 7, 8, 16});
    const Index length = std::max<Index>(1, rng.pick(std::vector<Index>{1, chunk - 1, chunk, chunk + 1, 37, 61, 100}));
    const Index batch = rng.uniform_int(1, 2), top_k = rng.uniform_int(1, 6);
    const bool causal = per_token && rng.coin();  // per-chunk gating is never causal
    const int threads = static_cast<int>(rng.uniform_int(1, 2));
    const RowMatrix<Scalar> q = rng.matrix<Scalar>(batch * length, heads * dh),
                            k = rng.matrix<Scalar>(batch * length, heads * dh),
                            v = rng.matrix<Scalar>(batch * length, heads * dh);
    std::vector<Index> lengths(static_cast<std::size_t>(batch), length);
    if (rng.coin(0.3)) lengths[0] = rng.uniform_int(0, length);
    const c2f::KeyPaddingMask<Scalar> padding = c2f::KeyPaddingMask<Scalar>::lengths(lengths);
    const c2f::MaskView<Scalar> plan({}, padding, batch, heads, length, length);
    const c2f::kernels::ChunkGrid grid{batch, length, chunk};
    std::ostringstream what;
    what << "rep " << rep << ": batch=" << batch << " L=" << length << " chunk=" << chunk << " heads=" << heads
         << " dh=" << dh << " top_k=" << top_k << (per_token ? " per token" : " per chunk") << " causal=" << causal
         << " len0=" << lengths[0];
    SCOPED_TRACE(what.str());
    const c2f::kernels::ChunkSelection sel =
        per_token ? c2f::kernels::select_chunks_per_token<Scalar>(q, chunk_means(k, grid), grid, heads, top_k, causal,
                                                                  c2f::kernels::with_threads(threads))
                  : c2f::kernels::select_chunks<Scalar>(q, k, grid, heads, top_k, c2f::kernels::with_threads(threads));
    EXPECT_EQ(widened(sel, top_k), brute_force_selection(q, k, batch, length, heads, chunk, top_k, per_token, causal));
    RowMatrix<Scalar> fast(batch * length, heads * dh);
    const Scalar scale = c2f::kernels::default_scale<Scalar>(dh);
    if (per_token) {
      c2f::kernels::token_sparse_attention<Scalar>(q, k, v, grid, heads, sel, fast, causal, plan, scale,
                                                   c2f::kernels::with_threads(threads));
    } else {
      c2f::kernels::chunk_sparse_attention<Scalar>(q, k, v, grid, heads, sel, fast, plan, scale,
                                                   c2f::kernels::with_threads(threads));
    }
    const RowMatrix<Scalar> dense =
        dense_fine_stage(q, k, v, batch, length, heads, chunk, sel.index, sel.top_k, per_token, causal, lengths);
    const double tol = std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
    expect_close(fast.data(), dense.data(), fast.size(), tol, tol, what.str());
  }
}

// Both fine stages on the micro-kernel's panels (kernels::impl::chunk_sparse_packed: chunks a multiple of the
// panel width; kernels::impl::token_sparse_packed: calls of kTokenGroupRows queries or more; rows_independent
// takes both paths on every build and call): the dense twin on shapes — sequences of 1 token, of a chunk
// ± 1, with a partial last chunk, and per chunk selections of more chunks than one online-softmax step
// takes (sparse_step_chunks) — the same bits on 1 and 2 threads, NaN and Inf in the keys and values the
// padding hides changing no output value, and with causal per-token gating, tokens from a position on
// (NaN included) changing no earlier output bit.
TYPED_TEST(SparseTyped, PackedPathsMatchTheDenseTwin) {
  using Scalar = TypeParam;
  constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity(), kNaN = std::numeric_limits<Scalar>::quiet_NaN();
  const Index panel = c2f::cpu::GemmBlocking<Scalar>::kNR;
  TestRng rng(73);
  std::vector<std::array<Index, 3>> cases;  // chunk, length, top_k
  for (const Index chunk : {panel, 2 * panel}) {
    const Index step = c2f::kernels::impl::sparse_step_chunks(c2f::kernels::ChunkGrid{1, 100 * chunk, chunk});
    for (const Index length : {Index(1), chunk - 1, chunk + 1, 3 * chunk + 7, (step + 3) * chunk - 5}) {
      for (const Index top_k : {Index(2), step + 2}) cases.push_back({chunk, length, top_k});
    }
  }
  const auto options = [](int threads) { return c2f::kernels::with_threads(threads).rows_independent(true); };
  for (std::size_t rep = 0; rep < 3 * cases.size(); ++rep) {
    const Index chunk = cases[rep / 3][0], length = cases[rep / 3][1], top_k = cases[rep / 3][2];
    const bool per_token = rep % 3 != 0, causal = rep % 3 == 2;
    const Index heads = rng.pick(std::vector<Index>{1, 3}), dh = rng.pick(std::vector<Index>{1, 5, 64});
    const Index batch = rng.uniform_int(1, 2);
    const c2f::kernels::ChunkGrid grid{batch, length, chunk};
    std::ostringstream what;
    what << "rep " << rep << ": batch=" << batch << " L=" << length << " chunk=" << chunk << " heads=" << heads
         << " dh=" << dh << " top_k=" << top_k << (per_token ? " per token" : " per chunk") << " causal=" << causal;
    SCOPED_TRACE(what.str());
    const bool packed = per_token ? c2f::kernels::impl::token_sparse_packed<Scalar, Scalar>(options(1), length)
                                  : c2f::kernels::impl::chunk_sparse_packed<Scalar>(grid, options(1));
    ASSERT_TRUE(packed);
    const RowMatrix<Scalar> q = rng.matrix<Scalar>(batch * length, heads * dh, 2.0),
                            k = rng.matrix<Scalar>(batch * length, heads * dh, 2.0),
                            v = rng.matrix<Scalar>(batch * length, heads * dh);
    std::vector<Index> lengths(static_cast<std::size_t>(batch), length);
    lengths[0] = rng.uniform_int(0, length);
    const c2f::KeyPaddingMask<Scalar> padding = c2f::KeyPaddingMask<Scalar>::lengths(lengths);
    const c2f::MaskView<Scalar> plan({}, padding, batch, heads, length, length);
    const Scalar scale = c2f::kernels::default_scale<Scalar>(dh);
    // The selection from (q, k), then the fine stage on (q, k, v) with it.
    const auto run = [&](const RowMatrix<Scalar>& qi, const RowMatrix<Scalar>& ki, const RowMatrix<Scalar>& vi,
                         const c2f::kernels::ChunkSelection& sel, int threads) {
      RowMatrix<Scalar> out(batch * length, heads * dh);
      if (per_token) {
        c2f::kernels::token_sparse_attention<Scalar>(qi, ki, vi, grid, heads, sel, out, causal, plan, scale,
                                                     options(threads));
      } else {
        c2f::kernels::chunk_sparse_attention<Scalar>(qi, ki, vi, grid, heads, sel, out, plan, scale, options(threads));
      }
      return out;
    };
    const auto select = [&](const RowMatrix<Scalar>& qi, const RowMatrix<Scalar>& ki) {
      return per_token ? c2f::kernels::select_chunks_per_token<Scalar>(qi, chunk_means(ki, grid), grid, heads, top_k,
                                                                       causal, options(1))
                       : c2f::kernels::select_chunks<Scalar>(qi, ki, grid, heads, top_k, options(1));
    };
    const c2f::kernels::ChunkSelection sel = select(q, k);
    const RowMatrix<Scalar> one = run(q, k, v, sel, 1), two = run(q, k, v, sel, 2);
    const RowMatrix<Scalar> dense =
        dense_fine_stage(q, k, v, batch, length, heads, chunk, sel.index, sel.top_k, per_token, causal, lengths);
    const double tol = std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
    expect_close(one.data(), dense.data(), one.size(), tol, tol, what.str());
    EXPECT_EQ(0, std::memcmp(one.data(), two.data(), sizeof(Scalar) * static_cast<std::size_t>(one.size())))
        << "1 and 2 threads";
    RowMatrix<Scalar> poisoned_k = k, poisoned_v = v;
    for (Index j = lengths[0]; j < length; ++j) {
      poisoned_k.row(j).setConstant(j % 2 ? kInf : -kInf);
      poisoned_v.row(j).setConstant(j % 3 ? kNaN : kInf);
    }
    const RowMatrix<Scalar> dirty = run(q, poisoned_k, poisoned_v, sel, 2);
    // (A row with every selected key hidden is 0 on either input.)
    EXPECT_TRUE(dirty.allFinite() && (dirty.array() == one.array()).all())
        << "non-finite keys and values behind the padding";
    if (causal) {  // batch item 0 from position t on: new values, and NaN in its keys and values
      const Index t = rng.uniform_int(0, length - 1);
      RowMatrix<Scalar> q2 = q, k2 = k, v2 = v;
      q2.middleRows(t, length - t) = rng.matrix<Scalar>(length - t, heads * dh, 2.0);
      k2.middleRows(t, length - t).setConstant(kNaN);
      v2.middleRows(t, length - t).setConstant(kNaN);
      const RowMatrix<Scalar> later = run(q2, k2, v2, select(q2, k2), 2);
      EXPECT_EQ(0, std::memcmp(one.data(), later.data(), sizeof(Scalar) * static_cast<std::size_t>(t * heads * dh)))
          << "tokens from " << t << " on changed an earlier output";
    }
  }
}

// A selection of the wrong kind or shape is refused by the fine kernels.
// chunk_mean_where against the definition (the mean of the kept tokens, NaN without one), and with every
// token kept, chunk_mean bit for bit.
TEST(SparseKernels, ChunkMeanWhereMatchesItsDefinition) {
  TestRng rng(74);
  for (int rep = 0; rep < 20; ++rep) {
    const c2f::kernels::ChunkGrid grid{rng.uniform_int(1, 3), rng.uniform_int(0, 41),
                                       rng.pick(std::vector<Index>{1, 4, 7, 64})};
    const RowMatrix<double> x = rng.matrix<double>(grid.tokens(), 5);
    std::vector<char> keep(static_cast<std::size_t>(grid.tokens()));
    for (char& k : keep) k = rng.coin(0.6);
    const auto kept = [&](Index c, Index j) { return keep[static_cast<std::size_t>(grid.row(c) + j)] != 0; };
    RowMatrix<double> got(grid.chunks(), 5), all(grid.chunks(), 5), plain(grid.chunks(), 5);
    c2f::kernels::chunk_mean_where<double>(x, grid, kept, got, c2f::kernels::with_threads(2));
    for (Index c = 0; c < grid.chunks(); ++c) {
      Eigen::RowVectorXd sum = Eigen::RowVectorXd::Zero(5);
      Index n = 0;
      for (Index j = 0; j < grid.count(c); ++j) {
        if (kept(c, j)) {
          sum += x.row(grid.row(c) + j);
          ++n;
        }
      }
      if (n == 0) {
        EXPECT_TRUE(got.row(c).array().isNaN().all()) << "chunk " << c;
      } else {
        c2f_test::expect_close(got.row(c).data(), Eigen::RowVectorXd(sum / double(n)).data(), 5, 1e-14, 1e-14,
                               "chunk_mean_where");
      }
    }
    c2f::kernels::chunk_mean_where<double>(
        x, grid, [](Index, Index) { return true; }, all, c2f::kernels::with_threads(1));
    c2f::kernels::chunk_mean<double>(x, grid, plain, c2f::kernels::with_threads(1));
    EXPECT_TRUE(c2f_test::same_bits(all.data(), plain.data(), all.size()));
  }
}

TEST(SparseKernels, FineStagesRefuseAMismatchedSelection) {
  TestRng rng(74);
  const RowMatrix<float> q = rng.matrix<float>(20, 8), k = q, v = q;
  const c2f::kernels::ChunkGrid grid{1, 20, 4};
  RowMatrix<float> out(20, 8);
  const c2f::kernels::ChunkSelection per_chunk =
      c2f::kernels::select_chunks<float>(q, k, grid, 2, 2, c2f::kernels::with_threads(1));
  const c2f::kernels::ChunkSelection per_token =
      c2f::kernels::select_chunks_per_token<float>(q, k, grid, 2, 2, true, c2f::kernels::with_threads(1));
  EXPECT_EQ(per_chunk.queries, 5);
  EXPECT_EQ(per_token.queries, 20);
  EXPECT_THROW(c2f::kernels::token_sparse_attention<float>(q, k, v, grid, 2, per_chunk, out, true, {}, 0.5f,
                                                           c2f::kernels::with_threads(1)),
               std::invalid_argument);
  EXPECT_THROW(c2f::kernels::chunk_sparse_attention<float>(q, k, v, grid, 2, per_token, out, {}, 0.5f,
                                                           c2f::kernels::with_threads(1)),
               std::invalid_argument);
  EXPECT_THROW(c2f::kernels::chunk_sparse_attention<float>(q, k, v, grid, 4, per_chunk, out, {}, 0.5f,
                                                           c2f::kernels::with_threads(1)),
               std::invalid_argument);
}

// top_k ≥ the number of chunks: the layer is MultiHeadAttention (causal or not, either gating), on
// random shapes.
TEST(SparseLayer, CoveringTopKEqualsMultiHeadAttention) {
  TestRng rng(72);
  for (int rep = 0; rep < 18; ++rep) {
    const Index chunk = rng.pick(std::vector<Index>{1, 5, 8, 64}), length = rng.uniform_int(1, 90);
    const bool causal = rep % 3 == 1;
    SparseC2FAttention<double>::Options o;
    o.gating(rep % 3 == 2 ? c2f::Gating::PerToken : c2f::Gating::Auto);
    SparseC2FAttention<double> sparse(12, 3, chunk, (length + chunk - 1) / chunk + rng.uniform_int(0, 2),
                                      o.causal(causal));
    randomize(sparse, rng);
    const Tensor3<double> x = rng.tensor<double>(2, length, 12);
    c2f::Masks<double> masks;
    if (causal) masks.attn_mask(c2f::AttnMask<double>::causal());
    const Tensor3<double> a = sparse.forward(x), b = sparse.as_multihead_attention().forward(x, masks);
    expect_close(a.data(), b.data(), a.size(), 1e-12, 1e-12,
                 "L=" + std::to_string(length) + " chunk=" + std::to_string(chunk) + (causal ? " causal" : "") +
                     (sparse.gating() == c2f::Gating::PerToken ? " per token" : " per chunk"));
  }
}

// Compute::BFloat16 in the fine-stage kernels: with a selection covering every chunk each is attention over
// all keys, so sdpa_naive in bf16 (the twin that rounds the same operands) is its reference within
// 2^-8 · (P|V|) + 1e-5 (the probabilities are rounded before or after normalising; the products of the
// rounded values are exact in fp32). Random awkward shapes, causal and not; 1 and 2 threads bit-identical;
// and the bf16 output is not the fp32 one.
TEST(SparseBf16, FineStagesMatchTheNaiveTwinOnCoveringSelections) {
  TestRng rng(0xbf23);
  for (int rep = 0; rep < 24; ++rep) {
    const Index batch = rng.uniform_int(1, 2), heads = rng.uniform_int(1, 3),
                dh = rng.pick(std::vector<Index>{1, 4, 16, 17});
    const Index chunk = rng.pick(std::vector<Index>{1, 5, 8, 16}),
                length = rng.pick(std::vector<Index>{1, 7, 15, 17, 33, 64});
    const bool per_token = rep % 2 == 1, causal = per_token && rep % 4 == 3;
    const c2f::kernels::ChunkGrid grid{batch, length, chunk};
    const Index m = grid.chunks_per_batch(), e = heads * dh;
    const RowMatrix<float> q = rng.matrix<float>(batch * length, e), k = rng.matrix<float>(batch * length, e),
                           v = rng.matrix<float>(batch * length, e);
    const float scale = c2f::kernels::default_scale<float>(dh);
    c2f::kernels::KernelOptions o;
    o.compute(c2f::Compute::BFloat16).num_threads(2);
    const c2f::AttnMask<float> attn = causal ? c2f::AttnMask<float>::causal() : c2f::AttnMask<float>();
    const c2f::MaskView<float> dense_mask(attn, c2f::KeyPaddingMask<float>(), batch, heads, length, length);
    const auto view = [&](const RowMatrix<float>& x) { return c2f::kernels::heads_view(x, batch, length, heads); };
    RowMatrix<float> naive(batch * length, e), magnitude(batch * length, e);
    c2f::kernels::sdpa_naive<float>(view(q), view(k), view(v), c2f::kernels::heads_view(naive, batch, length, heads),
                                    dense_mask, scale, o);
    const RowMatrix<float> abs_v = v.unaryExpr(c2f::cpu::RoundBf16<float>()).cwiseAbs();
    c2f::kernels::sdpa_naive<float>(view(q), view(k), view(abs_v),
                                    c2f::kernels::heads_view(magnitude, batch, length, heads), dense_mask, scale,
                                    c2f::kernels::KernelOptions());
    const c2f::kernels::ChunkSelection selection =
        per_token ? c2f::kernels::select_chunks_per_token<float>(q, chunk_means(k, grid), grid, heads, m, causal, o)
                  : c2f::kernels::select_chunks<float>(q, k, grid, heads, m, o);
    const auto run = [&](const c2f::kernels::KernelOptions& ko, RowMatrix<float>& out) {
      out.resize(batch * length, e);
      if (per_token) {
        c2f::kernels::token_sparse_attention<float>(q, k, v, grid, heads, selection, out, causal,
                                                    c2f::MaskView<float>(), scale, ko);
      } else {
        c2f::kernels::chunk_sparse_attention<float>(q, k, v, grid, heads, selection, out, c2f::MaskView<float>(), scale,
                                                    ko);
      }
    };
    RowMatrix<float> out, one, fp32;
    run(o, out);
    const std::string what = std::string(per_token ? "per token" : "per chunk") + (causal ? " causal" : "") +
                             " B=" + std::to_string(batch) + " H=" + std::to_string(heads) +
                             " dh=" + std::to_string(dh) + " L=" + std::to_string(length) +
                             " chunk=" + std::to_string(chunk);
    const RowMatrix<float> bound = magnitude.array() * 0x1p-8f + 1e-5f;
    const RowMatrix<float> err = (out - naive).cwiseAbs();
    EXPECT_TRUE((err.array() <= bound.array()).all()) << what << ": max error " << err.maxCoeff();
    run(c2f::kernels::KernelOptions(o).num_threads(1), one);
    EXPECT_TRUE(c2f_test::same_bits(out.data(), one.data(), out.size())) << what << ": 1 and 2 threads differ";
    run(c2f::kernels::KernelOptions().num_threads(2), fp32);
    if (length >= 16 && dh >= 16) {
      EXPECT_GT((out - fp32).cwiseAbs().maxCoeff(), 1e-5f) << what << ": no rounding";
    }
  }
}

// Compute::BFloat16 (docs/bf16.md): with top_k covering every chunk the layer is MultiHeadAttention, so
// torch's nn.MultiheadAttention under torch.autocast("cpu", bfloat16) is its reference (tests/data/bf16):
// each gating, not causal and causal, on every bf16 engine the CPU has, within the bound docs/bf16.md states.
TEST(SparseBf16, CoveringTopKMatchesTorchAutocastWithinTheStatedBound) {
  for (const char* name : {"mha_self_l128", "mha_causal_l128"}) {
    const StateDict sd = c2f::load_safetensors(c2f_test::data_path(std::string("bf16/") + name + "_f32.safetensors"));
    const Tensor3<float> x = c2f_test::tensor3<float>(sd, "query");
    const std::vector<float> fp32 = c2f_test::values<float>(sd, "output"),
                             autocast = c2f_test::values<float>(sd, "output_autocast");
    const bool causal = sd.metadata().at("causal") == "true";
    const Index chunk = 16, top_k = (x.dimension(1) + chunk - 1) / chunk;
    for (c2f::Gating gating : {c2f::Gating::PerChunk, c2f::Gating::PerToken}) {
      if (causal && gating == c2f::Gating::PerChunk) continue;
      for (c2f::Bf16Engine e : c2f_test::available_bf16_engines()) {
        const auto engine_setting = c2f_test::scoped_bf16_engine(e);
        const char* engine = c2f::bf16_engine_name(e);
        SparseC2FAttention<float> m(
            meta_index(sd, "embed_dim"), meta_index(sd, "num_heads"), chunk, top_k,
            SparseC2FAttention<float>::Options().causal(causal).gating(gating).num_threads(2).compute(
                c2f::Compute::BFloat16));
        m.load_state_dict(sd, "mha.");
        const Tensor3<float> y = m.forward(x);
        m.set_num_threads(1);
        EXPECT_TRUE(c2f_test::same_bits(m.forward(x), y)) << name << " " << engine;
        const char* how = gating == c2f::Gating::PerToken ? "per token" : "per chunk";
        c2f_test::expect_bf16_accuracy(
            std::string("SparseC2FAttention ") + name + " (" + how + ", top_k covering), " + engine, y.data(), fp32,
            autocast);
      }
    }
  }
  try {
    SparseC2FAttention<double> bad(8, 2, 4, 2, SparseC2FAttention<double>::Options().compute(c2f::Compute::BFloat16));
    ADD_FAILURE() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("SparseC2FAttention: compute BFloat16 needs float, got double"),
              std::string::npos)
        << e.what();
  }
}

TEST(SparseLayer, NamesGatingAndErrors) {
  TestRng rng(73);
  SparseC2FAttention<float> sparse(32, 4, 16, 3, SparseC2FAttention<float>::Options().causal(true));
  // A trained nn.MultiheadAttention's state dict loads as is.
  std::vector<std::string> keys;
  for (const auto& kv : sparse.state_dict()) keys.push_back(kv.first);
  EXPECT_EQ(keys, (std::vector<std::string>{"in_proj_bias", "in_proj_weight", "out_proj.bias", "out_proj.weight"}));
  EXPECT_THROW(SparseC2FAttention<float>(32, 4, 0, 2), std::invalid_argument);
  EXPECT_THROW(SparseC2FAttention<float>(32, 4, 8, 0), std::invalid_argument);
  EXPECT_THROW(SparseC2FAttention<float>(30, 4, 8, 2), std::invalid_argument);
  // Gating: Auto resolves by causality; per-chunk gating reads the whole chunk and cannot be causal.
  EXPECT_EQ(sparse.gating(), c2f::Gating::PerToken);
  EXPECT_EQ(SparseC2FAttention<float>(32, 4, 16, 3).gating(), c2f::Gating::PerChunk);
  SparseC2FAttention<float>::Options per_chunk;
  per_chunk.gating(c2f::Gating::PerChunk);
  EXPECT_NE(c2f_test::error_of([&] {
              SparseC2FAttention<float>(32, 4, 16, 3, per_chunk.causal(true));
            }).find("cannot be causal"),
            std::string::npos);
  EXPECT_THROW(sparse.forward(rng.tensor<float>(1, 10, 16)), std::invalid_argument);
}

}  // namespace
