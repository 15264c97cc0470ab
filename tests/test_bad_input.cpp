// No input breaks c2f (docs/errors.md): every class of bad input, on every layer where it applies, gives
// its defined result — a clear std::invalid_argument naming the layer, or a defined output — and never a
// crash, an out-of-bounds read, a wrapped size or a silent NaN. Run under ASan + UBSan by the asan preset.
//   sizes that overflow or cannot be allocated: refused before anything is read or allocated;
//   batch 0 with every mask the layer takes: an empty output;
//   masks of the wrong shape, key lengths out of range, +inf or NaN in an additive mask: refused;
//   a failed load_state_dict leaves the layer as it was;
//   NaN in keys that are masked or in the future never reaches an output: rows before a NaN token are
//   bit-identical to the NaN-free run, forward and decode agree on where the NaN is;
//   decode states know their layer, a moved-from state is refused, a state in use throws;
//   errors name the layer the user called.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "c2f/io/masks.hpp"
#include "support/compare.hpp"
#include "support/layer_entries.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

namespace {

using c2f::Index;
using c2f::MaskFields;
using c2f::Masks;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::error_of;
using c2f_test::kWidth;
using c2f_test::TestRng;

constexpr Index kBatch = 2, kLength = 35;
constexpr Index kHuge = Index(1) << 40;

std::string logic_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return "<no std::logic_error thrown>";
}

template <class E>
class BadInput : public ::testing::Test {
 protected:
  using LayerType = typename E::Layer;
  using ScalarType = typename E::Scalar;
  static LayerType random_layer(std::uint64_t seed) {
    LayerType layer = E::make(typename E::Options().seed(seed));
    TestRng rng(seed);
    c2f_test::randomize(layer, rng);
    return layer;
  }
};
TYPED_TEST_SUITE(BadInput, c2f_test::AllLayers, c2f_test::EntryNames);

// ------------------------------------------------------------------------------------------------
// Sizes

// An input that declares sizes whose product wraps, or whose output could not be allocated, is refused
// before any of it is read (the data pointer holds one value: ASan sees any read past it).
TYPED_TEST(BadInput, InputSizesThatOverflowOrCannotBeAllocatedAreRefused) {
  using S = typename TestFixture::ScalarType;
  const typename TestFixture::LayerType layer = TestFixture::random_layer(1);
  const S one[1] = {S(1)};
  const std::string wraps = error_of([&] {
    TypeParam::forward(layer, c2f::ConstTensor3Ref<S>(one, {Index(1) << 32, Index(1) << 32, kWidth}), {});
  });
  EXPECT_NE(wraps.find("overflows"), std::string::npos) << TypeParam::name << ": " << wraps;
  const std::string huge = error_of([&] {
    TypeParam::forward(layer, c2f::ConstTensor3Ref<S>(one, {1, kHuge, kWidth}), {});
  });
  // The output's size (1 TiB and more) — or, for the 2-D layer, its bias table's grid — is refused.
  EXPECT_NE(huge.find("more than"), std::string::npos) << TypeParam::name << ": " << huge;
  EXPECT_NE(huge.find(TypeParam::Layer::type_name), std::string::npos) << TypeParam::name << ": " << huge;
}

// ------------------------------------------------------------------------------------------------
// Shapes and masks

TYPED_TEST(BadInput, BatchZeroWithEveryMaskGivesAnEmptyOutput) {
  using S = typename TestFixture::ScalarType;
  const typename TestFixture::LayerType layer = TestFixture::random_layer(2);
  const Masks<S> masks = c2f_test::every_mask<S>(0, kLength, TypeParam::Layer::mask_fields);
  const Tensor3<S> y = TypeParam::forward(layer, Tensor3<S>(0, kLength, kWidth), masks);
  EXPECT_EQ(y.size(), 0) << TypeParam::name;
  EXPECT_EQ(y.dimension(1), TypeParam::output_shape(layer, Tensor3<S>(0, kLength, kWidth))[1]) << TypeParam::name;
}

// A bool mask tensor of the given shape with every entry set (a fresh Eigen tensor is uninitialised, and
// reading a bool that is neither 0 nor 1 is undefined: UBSan stops there).
template <class BoolTensor>
BoolTensor all_true(BoolTensor t) {
  t.setConstant(true);
  return t;
}

TYPED_TEST(BadInput, WrongMasksAreRefusedNamingTheLayer) {
  using S = typename TestFixture::ScalarType;
  using Layer = typename TestFixture::LayerType;
  TestRng rng(3);
  const Layer layer = TestFixture::random_layer(3);
  const Tensor3<S> x = rng.tensor<S>(kBatch, kLength, kWidth);
  const std::string name = Layer::type_name;
  std::vector<Masks<S>> wrong;
  if (c2f::takes(Layer::mask_fields, MaskFields::AttnMask)) {
    wrong.push_back(Masks<S>().attn_mask(c2f::AttnMask<S>::keep(all_true(c2f::BoolTensor2(kLength + 1, 3)))));
  }
  if (c2f::takes(Layer::mask_fields, MaskFields::KeyPaddingMask)) {
    wrong.push_back(Masks<S>().key_padding_mask(c2f::KeyPaddingMask<S>::lengths({kLength + 5, 0})));
    wrong.push_back(Masks<S>().key_padding_mask(c2f::KeyPaddingMask<S>::lengths({1})));
  }
  if (c2f::takes(Layer::mask_fields, MaskFields::FineAttnMask)) {
    wrong.push_back(Masks<S>().fine_attn_mask(c2f::AttnMask<S>::keep(all_true(c2f::BoolTensor2(2, 2)))));
  }
  if (wrong.empty()) GTEST_SKIP() << TypeParam::name << " takes no masks (refusing them: the layer contract)";
  for (const Masks<S>& masks : wrong) {
    const std::string msg = error_of([&] { TypeParam::forward(layer, x, masks); });
    EXPECT_NE(msg.find(name + ": "), std::string::npos) << TypeParam::name << ": " << msg;
    EXPECT_NE(msg.find("must "), std::string::npos) << TypeParam::name << ": " << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << TypeParam::name << ": " << msg;
  }
}

// A failed load (a wrong shape, an unexpected key, a wrong dtype) changes nothing: the layer keeps every
// weight it had, and its output.
TYPED_TEST(BadInput, FailedLoadLeavesTheLayerAsItWas) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(4);
  typename TestFixture::LayerType layer = TestFixture::random_layer(4);
  const StateDict before = layer.state_dict();
  const Tensor3<S> x = rng.tensor<S>(kBatch, kLength, kWidth);
  const Tensor3<S> y = TypeParam::forward(layer, x, {});
  StateDict other = TestFixture::random_layer(5).state_dict();  // a good dict of other weights…
  const std::string last = other.keys().back();
  std::vector<StateDict> bad(3, other);
  const c2f::TensorData& t = other.at(last);
  std::vector<std::int64_t> shape = t.shape();
  shape.push_back(1);
  bad[0].set(last, c2f::TensorData(t.dtype(), shape, t.bytes()));  // …with one wrong shape,
  bad[1].set("zzz.unexpected", t);                                 // an unexpected key,
  bad[2].set(last,
             c2f::TensorData(c2f::DType::I32, t.shape(), std::vector<std::uint8_t>(4 * t.numel())));  // an integer
  for (const StateDict& sd : bad) {
    EXPECT_THROW(layer.load_state_dict(sd), std::invalid_argument) << TypeParam::name;
    const StateDict after = layer.state_dict();
    for (const auto& [key, tensor] : before) {
      EXPECT_EQ(after.at(key).bytes(), tensor.bytes()) << TypeParam::name << ": " << key << " changed by a failed load";
    }
    EXPECT_TRUE(c2f_test::same_bits(TypeParam::forward(layer, x, {}), y)) << TypeParam::name;
  }
}

// ------------------------------------------------------------------------------------------------
// NaN and masked keys

// A key hidden by key padding never influences an output, NaN or Inf included: the rows whose queries
// are real are bit-identical to the run without them.
TYPED_TEST(BadInput, PaddedKeysNeverReachAnOutput) {
  using S = typename TestFixture::ScalarType;
  using Layer = typename TestFixture::LayerType;
  if (!c2f::takes(Layer::mask_fields, MaskFields::KeyPaddingMask))
    GTEST_SKIP() << TypeParam::name << " takes no key padding";
  TestRng rng(6);
  const Layer layer = TestFixture::random_layer(6);
  const Tensor3<S> x = rng.tensor<S>(kBatch, kLength, kWidth);
  const std::vector<Index> lengths = {kLength - 3, 9};
  const Masks<S> masks = Masks<S>().key_padding_mask(c2f::KeyPaddingMask<S>::lengths(lengths));
  const Tensor3<S> clean = TypeParam::forward(layer, x, masks);
  Tensor3<S> poisoned = x;
  for (Index b = 0; b < kBatch; ++b) {
    for (Index j = lengths[static_cast<std::size_t>(b)]; j < kLength; ++j) {
      for (Index f = 0; f < kWidth; ++f) {
        poisoned(b, j, f) = (j + f) % 2 ? std::numeric_limits<S>::quiet_NaN() : std::numeric_limits<S>::infinity();
      }
    }
  }
  const Tensor3<S> y = TypeParam::forward(layer, poisoned, masks);
  for (Index b = 0; b < kBatch; ++b) {
    const Index rows = lengths[static_cast<std::size_t>(b)] * y.dimension(2);
    EXPECT_EQ(std::memcmp(&y(b, 0, 0), &clean(b, 0, 0), sizeof(S) * static_cast<std::size_t>(rows)), 0)
        << TypeParam::name << ": a padded key changed batch " << b;
  }
}

template <class E>
class CausalBadInput : public BadInput<E> {};
TYPED_TEST_SUITE(CausalBadInput, c2f_test::CausalLayers, c2f_test::EntryNames);

/// True where any feature of row (b, i) is NaN.
template <class S>
std::vector<bool> nan_rows(const Tensor3<S>& y) {
  std::vector<bool> out;
  for (Index b = 0; b < y.dimension(0); ++b) {
    for (Index i = 0; i < y.dimension(1); ++i) {
      bool nan = false;
      for (Index f = 0; f < y.dimension(2); ++f) nan = nan || std::isnan(y(b, i, f));
      out.push_back(nan);
    }
  }
  return out;
}

// A NaN at token t of a causal layer: every row before t is finite and bit-identical to the NaN-free
// run, row t is NaN; decode gives the same NaN pattern as forward.
TYPED_TEST(CausalBadInput, NanStaysCausal) {
  using S = typename TestFixture::ScalarType;
  using Layer = typename TestFixture::LayerType;
  TestRng rng(7);
  const Layer layer = TestFixture::random_layer(7);
  const Tensor3<S> x = rng.tensor<S>(kBatch, kLength, kWidth);
  const Tensor3<S> clean = TypeParam::forward(layer, x, {});
  for (Index t : {Index(0), Index(3), Index(16), kLength - 1}) {
    Tensor3<S> poisoned = x;
    poisoned(1, t, 2) = std::numeric_limits<S>::quiet_NaN();
    const Tensor3<S> y = TypeParam::forward(layer, poisoned, {});
    const std::size_t before = sizeof(S) * static_cast<std::size_t>(t * y.dimension(2));
    EXPECT_EQ(std::memcmp(&y(1, 0, 0), &clean(1, 0, 0), before), 0)
        << TypeParam::name << ": a NaN at token " << t << " changed an earlier row";
    EXPECT_EQ(std::memcmp(&y(0, 0, 0), &clean(0, 0, 0), sizeof(S) * static_cast<std::size_t>(kLength * y.dimension(2))),
              0)
        << TypeParam::name << ": a NaN in batch item 1 changed batch item 0";
    EXPECT_TRUE(std::isnan(y(1, t, 0)) || nan_rows(y)[static_cast<std::size_t>(kLength + t)])
        << TypeParam::name << ": row " << t << " reads the NaN and must be NaN";
    if constexpr (c2f_test::HasDecode<Layer>::value) {
      auto state = layer.new_decode_state(kBatch);
      Tensor3<S> decoded(kBatch, kLength, y.dimension(2));
      for (Index i = 0; i < kLength; i += 4) {
        const Index n = std::min<Index>(4, kLength - i);
        const Eigen::array<Index, 3> at{0, i, 0}, size{kBatch, n, kWidth};
        const Tensor3<S> step = layer.decode(Tensor3<S>(poisoned.slice(at, size)), state);
        decoded.slice(at, Eigen::array<Index, 3>{kBatch, n, y.dimension(2)}) = step;
      }
      EXPECT_EQ(nan_rows(decoded), nan_rows(y))
          << TypeParam::name << ": decode and forward disagree on NaN rows (t = " << t << ")";
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Constructor and option sizes (each of these once crashed, wrapped or threw bad_alloc)

TEST(BadSizes, ConstructorsRefuseWhatCannotBeAllocatedNamingTheLayer) {
  const auto refused = [](const std::function<void()>& fn, const std::string& layer) {
    const std::string msg = error_of(fn);
    EXPECT_NE(msg.find(layer), std::string::npos) << msg;
    EXPECT_TRUE(msg.find("overflows") != std::string::npos || msg.find("bytes, more than") != std::string::npos) << msg;
  };
  refused([] { c2f::MultiHeadAttention<float>(kHuge, 1); }, "MultiHeadAttention");
  refused([] { c2f::Linear<float>(kHuge, kHuge); }, "Linear");
  refused([] { c2f::Conv1d<float>(1, Index(1) << 62, 4); }, "Conv1d");
  refused([] { c2f::Conv1d<float>(8, 8, kHuge); }, "Conv1d");
  refused([] { c2f::HMHA<float>(kHuge, 2, 4); }, "HMHA");
  refused([] { c2f::C2FAttention<float>(kHuge, 2, 4); }, "C2FAttention");
  refused(
      [] {
        c2f::C2FAttention2D<float>(8, 2, 2, 2, c2f::C2FAttention2D<float>::Options().max_blocks_h(Index(1) << 32));
      },
      "C2FAttention2D");
}

TEST(BadSizes, HugeStructuralSizesAreValidAndMeanTheWholeSequence) {
  TestRng rng(8);
  const Tensor3<float> x = rng.tensor<float>(1, 5, 8);
  const Index max = std::numeric_limits<Index>::max();
  // A chunk longer than the sequence is the sequence, INT64_MAX included; on both fine paths.
  for (c2f::FinePath path : {c2f::FinePath::Folded, c2f::FinePath::General}) {
    c2f::C2FAttention<float> huge(8, 2, max, c2f::C2FAttention<float>::Options().fine_path(path));
    c2f::C2FAttention<float> exact(8, 2, 5, c2f::C2FAttention<float>::Options().fine_path(path));
    c2f_test::randomize(huge, rng);
    exact.load_state_dict(huge.state_dict());
    EXPECT_TRUE(c2f_test::same_bits(huge.forward(x), exact.forward(x)));
    huge.set_fine_path(path);
    EXPECT_LE(huge.workspace_bytes(1, 5), exact.workspace_bytes(1, 5) + 1024);
  }
  // top_k beyond the chunks selects every chunk: MultiHeadAttention.
  c2f::SparseC2FAttention<float> sparse(8, 2, 2, max);
  c2f_test::randomize(sparse, rng);
  c2f_test::expect_close(sparse.forward(x).data(), sparse.as_multihead_attention().forward(x).data(), x.size(), 1e-6,
                         1e-6, "top_k = INT64_MAX");
  // Blocks longer than the sequence are the sequence: no workspace sized by the option.
  c2f::MultiHeadAttention<float> mha(
      8, 2, c2f::MultiHeadAttention<float>::Options().query_block(max).key_block(Index(1) << 20));
  c2f::MultiHeadAttention<float> plain(8, 2);
  c2f_test::randomize(mha, rng);
  plain.load_state_dict(mha.state_dict());
  EXPECT_TRUE(c2f_test::same_bits(mha.forward(x), plain.forward(x)));
  EXPECT_LT(mha.workspace_bytes(1, 5), std::size_t(64) << 10);
  // A causal edge beyond every key hides none of them.
  const Masks<float> far = Masks<float>().attn_mask(c2f::AttnMask<float>::causal(max));
  EXPECT_TRUE(c2f_test::same_bits(plain.forward(x, far), plain.forward(x)));
  const Masks<float> before_all = Masks<float>().attn_mask(c2f::AttnMask<float>::causal(-max));
  const Tensor3<float> hidden = plain.forward(x, before_all);  // every row sees nothing: out_proj.bias
  for (Index i = 0; i < 5; ++i) EXPECT_EQ(hidden(0, i, 3), plain.out_proj().bias()[3]);
}

TEST(BadSizes, GridsStatesAndMaskTensorsThatOverflowAreRefused) {
  c2f::C2FAttention2D<float> vit(8, 2, 2, 2, c2f::C2FAttention2D<float>::Options().relative_position_bias(false));
  const float one[1] = {1.0f};
  // 2^32 x 2^32 wraps to 0 = the sequence length of x [1, 0, 8].
  EXPECT_NE(error_of([&] {
              vit.forward(c2f::ConstTensor3Ref<float>(one, {1, 0, 8}), Index(1) << 32, Index(1) << 32);
            }).find("overflows"),
            std::string::npos);
  c2f::MultiHeadAttention<float> mha(8, 2, c2f::MultiHeadAttention<float>::Options().causal(true));
  const std::string state = error_of([&] { mha.new_decode_state(Index(1) << 30, Index(1) << 40); });
  EXPECT_NE(state.find("MultiHeadAttention"), std::string::npos) << state;
  auto small = mha.new_decode_state(1);
  EXPECT_NE(error_of([&] { small.reserve(kHuge); }).find("bytes, more than"), std::string::npos);
  // A BOOL tensor [2, 2^62, 0, 1] holds no element, but its leading dimensions multiply past 2^63.
  const c2f::TensorData empty(c2f::DType::BOOL, {2, std::int64_t(1) << 62, 0, 1}, {});
  EXPECT_NE(error_of([&] { c2f::attn_mask_from_tensor<float>(c2f::MaskKind::Keep, empty); }).find("overflows"),
            std::string::npos);
}

// A relative position bias's maxima give its table (2·max_h − 1)·(2·max_w − 1) rows: maxima whose product
// overflows are refused by name, also where it wraps to the given table's rows — 2^62 x 2^62 gives
// (2^63 − 1)^2, which is 1 modulo 2^64: a one-row table would otherwise be accepted and then indexed far
// outside itself. The table-gradient kernel checks its maxima the same way, before it multiplies the grid.
TEST(BadMasks, RelativePositionMaximaThatOverflowAreRefused) {
  const RowMatrix<float> one_row = RowMatrix<float>::Ones(1, 2);
  for (const Index max : {Index(1) << 32, Index(1) << 62}) {
    const std::string msg = error_of([&] { c2f::AttnMask<float>::relative_position(one_row, 1, 1, max, max); });
    EXPECT_NE(msg.find("relative position bias: the table for max_h x max_w"), std::string::npos) << msg;
    EXPECT_NE(msg.find("overflows"), std::string::npos) << msg;
  }
  // The largest maxima that fit: refused for the table's size, naming both.
  const std::string wrong =
      error_of([&] { c2f::AttnMask<float>::relative_position(one_row, 1, 1, 1, Index(1) << 30); });
  EXPECT_NE(wrong.find("[(2*max_h - 1)*(2*max_w - 1), heads] = [2147483647, heads]"), std::string::npos) << wrong;
  // relative_position_bias_backward on one query and key (grid 1 x 1) with maxima of 2^62.
  const float v[2] = {1.0f, 1.0f};
  float o[2] = {0.0f, 0.0f}, lse[1] = {0.0f};
  const c2f::kernels::HeadsView<const float> h1 = c2f::kernels::heads_view<const float>(v, 1, 1, 2, 0, 1, 2);
  Eigen::Map<RowMatrix<float>> lse_rows(lse, 1, 1), dtable(o, 1, 1);
  const std::string kernel = error_of([&] {
    c2f::kernels::relative_position_bias_backward<float>(h1, h1, h1, h1, lse_rows, h1, c2f::MaskView<float>(), 1, 1,
                                                         Index(1) << 62, Index(1) << 62, 1.0f, dtable,
                                                         c2f::kernels::with_threads(1));
  });
  EXPECT_NE(kernel.find("relative_position_bias_backward"), std::string::npos) << kernel;
  EXPECT_NE(kernel.find("overflows"), std::string::npos) << kernel;
}

TEST(BadMasks, InfinityAndNanInAnAdditiveMaskAreRefused) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    Eigen::Tensor<float, 2, Eigen::RowMajor> m(2, 2);
    m.setZero();
    m(1, 0) = bad;
    EXPECT_NE(error_of([&] { c2f::AttnMask<float>::additive(m); }).find("finite or -inf"), std::string::npos);
    EXPECT_NE(error_of([&] { c2f::KeyPaddingMask<float>::additive(m); }).find("finite or -inf"), std::string::npos);
  }
  // -inf and float's lowest stay valid: they mask.
  Eigen::Tensor<float, 2, Eigen::RowMajor> ok(2, 2);
  ok.setValues({{0.0f, -std::numeric_limits<float>::infinity()}, {std::numeric_limits<float>::lowest(), 1.5f}});
  EXPECT_NO_THROW(c2f::AttnMask<float>::additive(ok));
}

// ------------------------------------------------------------------------------------------------
// Decode states

template <class Layer>
void check_states(const Layer& layer, const Layer& other, const std::string& name) {
  TestRng rng(9);
  const Tensor3<float> x = rng.tensor<float>(1, 3, layer.embed_dim());
  auto state = layer.new_decode_state(1);
  layer.decode(x, state);
  // A state another configuration made is refused.
  auto foreign = other.new_decode_state(1);
  const std::string wrong = error_of([&] { layer.decode(x, foreign); });
  EXPECT_NE(wrong.find(name + "::decode: the state was made by"), std::string::npos) << wrong;
  // A moved-from state is empty and refused.
  auto moved = std::move(state);
  EXPECT_EQ(state.length(), 0);  // NOLINT(bugprone-use-after-move): the moved-from state is defined
  EXPECT_NE(error_of([&] { layer.decode(x, state); }).find("moved from"), std::string::npos);
  EXPECT_EQ(moved.length(), 3);
  EXPECT_EQ(layer.decode(x, moved).dimension(1), 3);
  // Two threads decoding into one state: one of them may find it in use (std::logic_error); none
  // corrupts it — the state holds exactly the tokens of the calls that succeeded.
  auto shared = layer.new_decode_state(1);
  const Tensor3<float> chunk = rng.tensor<float>(1, 512, layer.embed_dim());  // long calls: they overlap
  std::atomic<int> done{0}, busy{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 2; ++k) {
    threads.emplace_back([&] {
      for (int call = 0; call < 6; ++call) {
        const std::string e = logic_error_of([&] { layer.decode(chunk, shared); });
        if (e == "<no std::logic_error thrown>") {
          ++done;
        } else {
          EXPECT_NE(e.find("in use by another call"), std::string::npos) << e;
          ++busy;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(done + busy, 12);
  EXPECT_EQ(shared.length(), 512 * done) << name;
}

TEST(BadStates, DecodeStatesKnowTheirLayerAndRefuseMisuse) {
  using Mha = c2f::MultiHeadAttention<float>;
  using Sparse = c2f::SparseC2FAttention<float>;
  using Hmha = c2f::HMHA<float>;
  check_states(Mha(8, 2, Mha::Options().causal(true)), Mha(8, 4, Mha::Options().causal(true)), "MultiHeadAttention");
  check_states(Sparse(8, 2, 2, 2, Sparse::Options().causal(true)), Sparse(8, 2, 4, 2, Sparse::Options().causal(true)),
               "SparseC2FAttention");
  check_states(Hmha(8, 2, 2, Hmha::Options().causal(true)), Hmha(8, 2, 8, Hmha::Options().causal(true)), "HMHA");
}

// ------------------------------------------------------------------------------------------------
// Messages name the layer the user called

TEST(BadInputMessages, ErrorsNameTheLayerTheUserCalled) {
  TestRng rng(10);
  const Tensor3<float> narrow = rng.tensor<float>(1, 5, 6);
  const auto named = [](const std::function<void()>& fn, const std::string& layer) {
    const std::string msg = error_of(fn);
    EXPECT_EQ(msg.rfind("c2f: " + layer, 0), 0u) << msg;
  };
  named([] { c2f::CoarseAttention<float>(10, 4); }, "CoarseAttention");
  named([] { c2f::C2FAttention<float>(10, 4, 8); }, "C2FAttention");
  named([] { c2f::C2FAttention2D<float>(10, 4, 2, 2); }, "C2FAttention2D");
  named([] { c2f::SparseC2FAttention<float>(10, 4, 2, 2); }, "SparseC2FAttention");
  named([] { c2f::HMHA<float>(10, 4, 2); }, "HMHA");
  named([&] { c2f::CoarseAttention<float>(8, 2).forward(narrow); }, "CoarseAttention");
  named([&] { c2f::SparseC2FAttention<float>(8, 2, 2, 2).forward(narrow); }, "SparseC2FAttention");
  named([&] { c2f::HMHA<float>(8, 2, 2).forward(narrow); }, "HMHA");
  named([&] { c2f::C2FAttention<float>(8, 2, 2).forward(narrow); }, "C2FAttention");
  // C2F's fine mask is over B·m chunks: the message says so.
  const std::string fine = error_of([&] {
    c2f::C2FAttention<float>(8, 2, 2).forward(
        rng.tensor<float>(2, 6, 8),
        Masks<float>().fine_attn_mask(c2f::AttnMask<float>::keep(all_true(c2f::BoolTensor3(5, 2, 2)))));
  });
  EXPECT_NE(fine.find("B·m"), std::string::npos) << fine;
}

}  // namespace
