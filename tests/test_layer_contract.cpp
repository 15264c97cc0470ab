// The layer contract (docs/layers.md, "The layer contract"), tested once for every layer. Each layer is
// one entry — one C2F_LAYER line — in the list below; every property of the contract is a typed test
// over that list:
//   output bits independent of the thread count (1, 2, 3), with and without the masks it takes;
//   forward_into = forward, writing exactly its rows of the caller's buffer; output_shape = forward's;
//   workspace_bytes bounds the heap memory of forward_into (measured);
//   state_dict round trip, and strict loading that names the key (missing, unexpected, shape, dtype);
//   empty batch, empty sequence and length 1;
//   mask fields the layer does not take are refused, naming the layer and the field;
//   concurrent callers on one shared module get a single caller's bits;
//   decode = the causal forward for the causal layers (decode refused by the non-causal ones);
//   training (the layers with a Saved type, docs/training.md): forward_train has forward's bits without
//   dropout, the gradients have state_dict()'s names and shapes and the input's shape, their bits do not
//   depend on the thread count, and backward refuses a wrong dy and another object's or a stale saved state.
// Layers that each break one property (the Broken list at the end) show that each test can fail: the
// ctests contract.catches_* run them and pass only when the matching test fails.
#include "support/eigen_assert_throws.hpp"

#include "c2f/c2f.hpp"
#include "support/bf16.hpp"
#include "support/compare.hpp"
#include "support/layer_entries.hpp"
#include "support/random.hpp"
#include "support/settings.hpp"
#include "tools/malloc_counter.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using c2f::Index;
using c2f::MaskFields;
using c2f::Masks;
using c2f::RowMatrix;
using c2f::StateDict;
using c2f::Tensor3;
using c2f_test::error_of;
using c2f_test::same_bits;
using c2f_test::TestRng;

using c2f_test::every_mask;
using c2f_test::HasDecode;
using c2f_test::kWidth;
using c2f_test::LayerCalls;
using c2f_test::ScalarOf;
using namespace c2f_test;  // NOLINT: the entries of support/layer_entries.hpp

constexpr Index kBatch = 2, kLength = 35;  // partial chunks and windows; a 5 × 7 grid of partial 2-D blocks

template <class S>
bool all_nan(const c2f::ConstRowMatrixRef<S>& m) {
  return m.array().isNaN().all();
}

template <class E>
class LayerContract : public ::testing::Test {
 protected:
  using LayerType = typename E::Layer;
  using ScalarType = typename E::Scalar;
  using OptionsType = typename E::Options;

  void SetUp() override {
    saved_work_ = c2f::get_min_parallel_work();
    c2f::set_num_threads(4);        // so that a layer's cap of 3 threads really gives 3
    c2f::set_min_parallel_work(0);  // every loop with several tasks runs on several threads
  }
  void TearDown() override {
    c2f::set_num_threads(0);
    c2f::set_min_parallel_work(saved_work_);
  }

  /// A layer with random parameters (biases too), drawn from `seed`.
  static LayerType random_layer(std::uint64_t seed, int threads = 0) {
    LayerType layer = E::make(OptionsType().seed(seed).num_threads(threads));
    TestRng rng(seed);
    c2f_test::randomize(layer, rng);
    return layer;
  }
  static Tensor3<ScalarType> input(TestRng& rng, Index batch, Index seq) {
    return rng.tensor<ScalarType>(batch, seq, kWidth);
  }
  /// No masks, and every mask the layer takes.
  static std::vector<Masks<ScalarType>> mask_sets(Index batch, Index seq) {
    std::vector<Masks<ScalarType>> sets{Masks<ScalarType>()};
    if (LayerType::mask_fields != MaskFields::None)
      sets.push_back(every_mask<ScalarType>(batch, seq, LayerType::mask_fields));
    return sets;
  }
  static std::string what(const char* property, std::size_t mask_set) {
    return std::string(E::name) + ": " + property + (mask_set ? " (with masks)" : "");
  }
  /// Whether the entry computes in bfloat16 (docs/bf16.md).
  static bool bf16() {
    if constexpr (std::is_base_of<c2f::ComputeOption<OptionsType>, OptionsType>::value) {
      return E::make(OptionsType()).options().compute() == c2f::Compute::BFloat16;
    } else {
      return false;
    }
  }
  /// A bfloat16 layer's forward_train refuses, naming the reason (its backward pass is fp32).
  static void expect_training_refused() {
    TestRng rng(1016);
    const LayerType layer = random_layer(26);
    try {
      (void)E::forward_train(layer, input(rng, kBatch, kLength), {});
      ADD_FAILURE() << E::name << ": forward_train in bfloat16 did not refuse";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("forward_train needs compute Float32"), std::string::npos) << e.what();
    }
  }

 private:
  double saved_work_ = 0;
};

TYPED_TEST_SUITE_P(LayerContract);

// ------------------------------------------------------------------------------------------------
// The contract

// Several threads calling forward() on one shared const module at once get exactly the bits of a
// single-threaded call, also when callers × threads per call exceed the CPUs. Each caller has its own
// input, so a result leaking from one call into another shows.
TYPED_TEST_P(LayerContract, ConcurrentCallersShareOneModule) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1008);
  typename TestFixture::LayerType layer = TestFixture::random_layer(18, 1);
  const int callers = c2f::detail::available_cpus() + 2;
  std::vector<Tensor3<S>> inputs, expected;
  const std::vector<Masks<S>> sets = TestFixture::mask_sets(kBatch, kLength);
  for (int k = 0; k < callers; ++k) {
    inputs.push_back(TestFixture::input(rng, kBatch, kLength));
    expected.push_back(TypeParam::forward(layer, inputs.back(), sets[static_cast<std::size_t>(k) % sets.size()]));
  }
  for (int threads : {2, 0}) {
    layer.set_num_threads(threads);
    const typename TestFixture::LayerType& shared = layer;
    std::vector<int> wrong(static_cast<std::size_t>(callers), 0);
    std::vector<std::thread> pool;
    for (int k = 0; k < callers; ++k) {
      pool.emplace_back([&, k] {
        const std::size_t i = static_cast<std::size_t>(k);
        for (int call = 0; call < 3; ++call) {
          if (!same_bits(TypeParam::forward(shared, inputs[i], sets[i % sets.size()]), expected[i])) ++wrong[i];
        }
      });
    }
    for (std::thread& t : pool) t.join();
    int total = 0;
    for (int w : wrong) total += w;
    EXPECT_EQ(total, 0) << TypeParam::name << ": " << callers << " callers, " << threads << " threads per call";
  }
}

// The ThreadSanitizer build (the tsan preset defines C2F_CONTRACT_THREADS_ONLY) runs only the test above
// and SharedModule.*: it compiles only them, which saves minutes of its build.
#ifndef C2F_CONTRACT_THREADS_ONLY

TYPED_TEST_P(LayerContract, OutputBitsDoNotDependOnThreadCount) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1001);
  typename TestFixture::LayerType layer = TestFixture::random_layer(11);
  const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
  const std::vector<Masks<S>> sets = TestFixture::mask_sets(kBatch, kLength);
  for (std::size_t m = 0; m < sets.size(); ++m) {
    layer.set_num_threads(1);
    const Tensor3<S> one = TypeParam::forward(layer, x, sets[m]);
    for (int threads : {2, 3}) {
      layer.set_num_threads(threads);
      EXPECT_TRUE(same_bits(TypeParam::forward(layer, x, sets[m]), one))
          << TestFixture::what("the output bits differ between 1 and ", m) << threads << " threads";
    }
  }
}

TYPED_TEST_P(LayerContract, ForwardIntoWritesExactlyTheForwardOutput) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1002);
  const typename TestFixture::LayerType layer = TestFixture::random_layer(12);
  const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
  const std::vector<Masks<S>> sets = TestFixture::mask_sets(kBatch, kLength);
  for (std::size_t m = 0; m < sets.size(); ++m) {
    const Tensor3<S> want = TypeParam::forward(layer, x, sets[m]);
    const std::array<Index, 3> dims = TypeParam::output_shape(layer, x);
    ASSERT_EQ(want.dimensions(), (Eigen::array<Index, 3>{dims[0], dims[1], dims[2]}))
        << TestFixture::what("output_shape", m);
    // The caller's rows are a block of a wider buffer (outer stride ≠ width); the rest stays NaN.
    RowMatrix<S> wide = RowMatrix<S>::Constant(dims[0] * dims[1], dims[2] + 3, std::numeric_limits<S>::quiet_NaN());
    TypeParam::forward_into(layer, x, wide.leftCols(dims[2]), sets[m]);
    const RowMatrix<S> got = wide.leftCols(dims[2]);
    EXPECT_TRUE(c2f_test::same_bits(got.data(), want.data(), want.size()))
        << TestFixture::what("forward_into differs from forward", m);
    EXPECT_TRUE(all_nan<S>(wide.rightCols(3))) << TestFixture::what("forward_into wrote outside its rows", m);
  }
  RowMatrix<S> wrong(kBatch * kLength + 1, 4);
  EXPECT_NE(error_of([&] { TypeParam::forward_into(layer, x, wrong, {}); }).find("out must be"), std::string::npos)
      << TypeParam::name << ": a wrongly shaped out is refused";
}

// forward's output comes from the scratch cache (c2f/output.hpp): a loop gets back the buffer of the output
// before it, values and all. A stale buffer of NaN handed to forward must come back fully overwritten, with
// forward_into's bits (an output of at least the cache's smallest kept size, so that the cache keeps it).
TYPED_TEST_P(LayerContract, ForwardOverwritesAReusedBuffer) {
  using S = typename TestFixture::ScalarType;
  if (c2f::scratch_cache_limit() == 0) GTEST_SKIP() << "the scratch cache is off (an AddressSanitizer build)";
  TestRng rng(1014);
  const typename TestFixture::LayerType layer = TestFixture::random_layer(12);
  // As many batch items of kLength tokens as make the output that large.
  const std::array<Index, 3> one = TypeParam::output_shape(layer, TestFixture::input(rng, 1, kLength));
  const Index batch = c2f::detail::ceil_div(static_cast<Index>(c2f::detail::kScratchMinBytes),
                                            one[1] * one[2] * static_cast<Index>(sizeof(S)));
  const Tensor3<S> x = TestFixture::input(rng, batch, kLength);
  const std::array<Index, 3> dims = TypeParam::output_shape(layer, x);
  RowMatrix<S> want(dims[0] * dims[1], dims[2]);
  TypeParam::forward_into(layer, x, want, {});
  c2f::release_scratch_cache();
  {
    c2f::Output<S> stale(dims);
    stale.setConstant(std::numeric_limits<S>::quiet_NaN());
  }
  ASSERT_GE(c2f::scratch_cache_bytes(), sizeof(S) * static_cast<std::size_t>(want.size())) << TypeParam::name;
  const auto y = TypeParam::forward(layer, x, {});
  EXPECT_TRUE(c2f_test::reused_output(y)) << TypeParam::name << ": forward's output is not from the scratch cache";
  EXPECT_TRUE(c2f_test::same_bits(y.data(), want.data(), want.size()))
      << TypeParam::name << ": forward left elements of a reused buffer unwritten";
}

// workspace_bytes is an upper bound of what forward_into holds on the heap at its peak (output excluded:
// it is the caller's), and not a loose one.
TYPED_TEST_P(LayerContract, WorkspaceBytesBoundTheMeasuredPeak) {
  if (!c2f_memory::available()) GTEST_SKIP() << "malloc counting is unavailable under sanitizers";
  using S = typename TestFixture::ScalarType;
  TestRng rng(1003);
  typename TestFixture::LayerType layer = TestFixture::random_layer(13);
  for (const auto& [batch, seq] : std::vector<std::pair<Index, Index>>{{kBatch, kLength}, {1, 200}}) {
    const Tensor3<S> x = TestFixture::input(rng, batch, seq);
    const std::array<Index, 3> dims = TypeParam::output_shape(layer, x);
    RowMatrix<S> out(dims[0] * dims[1], dims[2]);
    for (int threads : {1, 2}) {
      layer.set_num_threads(threads);
      const long long bound = static_cast<long long>(TypeParam::workspace_bytes(layer, batch, seq));
      TypeParam::forward_into(layer, x, out, {});  // the pool's threads and queues are created on first use
      c2f::release_scratch_cache();                // measured from an empty scratch cache: every temporary is allocated
      c2f_memory::reset();
      TypeParam::forward_into(layer, x, out, {});
      c2f_memory::stop();
      const long long peak = c2f_memory::peak_bytes();
      // Slack for what no formula counts: the pool's per-loop state and malloc's rounding.
      EXPECT_LE(peak, bound + 16 * 1024) << TypeParam::name << ": B=" << batch << " L=" << seq
                                         << " threads=" << threads;
      EXPECT_LE(bound, 2 * peak + 16 * 1024)
          << TypeParam::name << ": B=" << batch << " L=" << seq << " threads=" << threads;
    }
  }
}

TYPED_TEST_P(LayerContract, StateDictRoundTrip) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1004);
  const typename TestFixture::LayerType a = TestFixture::random_layer(14);
  typename TestFixture::LayerType b = TypeParam::make(typename TestFixture::OptionsType().seed(99));
  const StateDict sd = a.state_dict();
  ASSERT_FALSE(sd.empty());
  b.load_state_dict(sd);
  const StateDict back = b.state_dict();
  ASSERT_EQ(back.keys(), sd.keys()) << TypeParam::name;
  for (const auto& [key, t] : sd) {
    EXPECT_EQ(back.at(key).dtype(), c2f::dtype_of<S>()) << TypeParam::name << " " << key;
    EXPECT_EQ(back.at(key).shape(), t.shape()) << TypeParam::name << " " << key;
    EXPECT_EQ(back.at(key).bytes(), t.bytes()) << TypeParam::name << " " << key;
  }
  const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
  EXPECT_TRUE(same_bits(TypeParam::forward(b, x, {}), TypeParam::forward(a, x, {}))) << TypeParam::name;
  // Under a prefix, "m" and "m." alike.
  typename TestFixture::LayerType c = TypeParam::make(typename TestFixture::OptionsType().seed(98));
  c.load_state_dict(a.state_dict("m"), "m.");
  EXPECT_TRUE(same_bits(TypeParam::forward(c, x, {}), TypeParam::forward(a, x, {}))) << TypeParam::name;
}

// A layer keeps its weights packed between calls (kernels::WeightCache; fp32 and bfloat16): parameters
// loaded or reset after a forward must give their own bits, the bits of a layer made with them.
TYPED_TEST_P(LayerContract, ParametersChangedAfterAForwardAreUsed) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1005);
  const typename TestFixture::LayerType a = TestFixture::random_layer(15);
  typename TestFixture::LayerType b = TestFixture::random_layer(16);
  const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
  const Tensor3<S> want = TypeParam::forward(a, x, {});
  ASSERT_FALSE(same_bits(TypeParam::forward(b, x, {}), want)) << TypeParam::name << ": the two layers must differ";
  b.load_state_dict(a.state_dict());
  EXPECT_TRUE(same_bits(TypeParam::forward(b, x, {}), want)) << TypeParam::name << ": load_state_dict after a forward";
  typename TestFixture::LayerType fresh = TypeParam::make(typename TestFixture::OptionsType().seed(5));
  fresh.reset_parameters(77);
  b.reset_parameters(77);
  EXPECT_TRUE(same_bits(TypeParam::forward(b, x, {}), TypeParam::forward(fresh, x, {})))
      << TypeParam::name << ": reset_parameters after a forward";
}

TYPED_TEST_P(LayerContract, StrictLoadingNamesTheKey) {
  typename TestFixture::LayerType layer = TestFixture::random_layer(15);
  const StateDict good = layer.state_dict();
  const std::string key = good.keys().back();
  const c2f::TensorData& t = good.at(key);
  const auto load = [&](const StateDict& sd) { return error_of([&] { layer.load_state_dict(sd); }); };

  StateDict missing;
  for (const auto& [k, v] : good) {
    if (k != key) missing.set(k, v);
  }
  const std::string e_missing = load(missing);
  EXPECT_NE(e_missing.find("missing key '" + key + "'"), std::string::npos) << TypeParam::name << ": " << e_missing;

  StateDict extra = good;
  extra.set("unexpected.weight", t);
  const std::string e_extra = load(extra);
  EXPECT_NE(e_extra.find("unexpected key 'unexpected.weight'"), std::string::npos)
      << TypeParam::name << ": " << e_extra;

  StateDict misshapen = good;
  std::vector<std::int64_t> shape = t.shape();
  shape.push_back(1);
  misshapen.set(key, c2f::TensorData(t.dtype(), shape, t.bytes()));
  const std::string e_shape = load(misshapen);
  EXPECT_NE(e_shape.find("'" + key + "' has shape"), std::string::npos) << TypeParam::name << ": " << e_shape;

  StateDict integer = good;
  integer.set(key, c2f::TensorData(c2f::DType::I32, t.shape(), std::vector<std::uint8_t>(4 * t.numel())));
  const std::string e_dtype = load(integer);
  EXPECT_NE(e_dtype.find("'" + key + "'"), std::string::npos) << TypeParam::name << ": " << e_dtype;
  EXPECT_NE(e_dtype.find("I32"), std::string::npos) << TypeParam::name << ": " << e_dtype;

  // Keys outside the prefix are not the layer's business; without a prefix every key is.
  StateDict nested = layer.state_dict("inner.");
  nested.set("other.weight", t);
  EXPECT_NO_THROW(layer.load_state_dict(nested, "inner.")) << TypeParam::name;
  EXPECT_NE(load(nested), "<no std::invalid_argument thrown>") << TypeParam::name;
}

TYPED_TEST_P(LayerContract, EmptyBatchEmptySequenceAndLengthOne) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1006);
  const typename TestFixture::LayerType layer = TestFixture::random_layer(16);
  for (const auto& [batch, seq] : std::vector<std::pair<Index, Index>>{{0, kLength}, {kBatch, 0}, {0, 0}, {3, 1}}) {
    const Tensor3<S> x = TestFixture::input(rng, batch, seq);
    const std::array<Index, 3> dims = TypeParam::output_shape(layer, x);
    const Tensor3<S> y = TypeParam::forward(layer, x, {});
    EXPECT_EQ(y.dimensions(), (Eigen::array<Index, 3>{dims[0], dims[1], dims[2]})) << TypeParam::name;
    EXPECT_EQ(dims[0], batch) << TypeParam::name;
    EXPECT_TRUE((Eigen::Map<const Eigen::Array<S, Eigen::Dynamic, 1>>(y.data(), y.size()).allFinite()))
        << TypeParam::name << ": B=" << batch << " L=" << seq;
  }
}

// A wrong feature size is an error naming the expected width and the given shape.
TYPED_TEST_P(LayerContract, WrongFeaturesNameBothShapes) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1010);
  const typename TestFixture::LayerType layer = TestFixture::random_layer(20);
  const Tensor3<S> x = rng.tensor<S>(2, 5, kWidth - 2);
  const std::string msg = error_of([&] { TypeParam::forward(layer, x, {}); });
  EXPECT_NE(msg.find("[2, 5, 6]"), std::string::npos) << TypeParam::name << ": " << msg;
  EXPECT_NE(msg.find("=8]"), std::string::npos) << TypeParam::name << ": " << msg;
}

// A NaN in an input that takes part reaches the output (it is not mistaken for a masked position).
TYPED_TEST_P(LayerContract, NanInAnInputReachesTheOutput) {
  using S = typename TestFixture::ScalarType;
  TestRng rng(1011);
  const typename TestFixture::LayerType layer = TestFixture::random_layer(21);
  Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
  x(1, 6, 3) = std::numeric_limits<S>::quiet_NaN();
  const Tensor3<S> y = TypeParam::forward(layer, x, {});
  EXPECT_TRUE((Eigen::Map<const Eigen::Array<S, Eigen::Dynamic, 1>>(y.data(), y.size()).isNaN().any()))
      << TypeParam::name;
}

TYPED_TEST_P(LayerContract, RefusesMaskFieldsItDoesNotTake) {
  using S = typename TestFixture::ScalarType;
  using Layer = typename TestFixture::LayerType;
  TestRng rng(1007);
  const Layer layer = TestFixture::random_layer(17);
  const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
  const std::pair<MaskFields, const char*> fields[] = {{MaskFields::AttnMask, "attn_mask"},
                                                       {MaskFields::KeyPaddingMask, "key_padding_mask"},
                                                       {MaskFields::FineAttnMask, "fine_attn_mask"}};
  for (const auto& [field, field_name] : fields) {
    const Masks<S> masks = every_mask<S>(kBatch, kLength, field);
    if (c2f::takes(Layer::mask_fields, field)) {
      EXPECT_NO_THROW(TypeParam::forward(layer, x, masks)) << TypeParam::name << " takes " << field_name;
      continue;
    }
    const std::string want = std::string(Layer::type_name) + " takes no " + field_name;
    EXPECT_NE(error_of([&] { TypeParam::forward(layer, x, masks); }).find(want), std::string::npos)
        << TypeParam::name << ": forward must refuse " << field_name;
    const std::array<Index, 3> dims = TypeParam::output_shape(layer, x);
    RowMatrix<S> out(dims[0] * dims[1], dims[2]);
    EXPECT_NE(error_of([&] { TypeParam::forward_into(layer, x, out, masks); }).find(want), std::string::npos)
        << TypeParam::name << ": forward_into must refuse " << field_name;
  }
}

/// The causal layers decode: the tokens fed in pieces give the causal forward's rows; prefill gives the
/// last row. The non-causal ones refuse to decode. Layers without decoding skip.
TYPED_TEST_P(LayerContract, DecodeEqualsTheCausalForward) {
  using Layer = typename TestFixture::LayerType;
  using S = typename TestFixture::ScalarType;
  if constexpr (!HasDecode<Layer>::value) {
    GTEST_SKIP() << TypeParam::name << " does not decode";
  } else {
    TestRng rng(1009);
    const Layer layer = TestFixture::random_layer(19);
    const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
    auto state = layer.new_decode_state(kBatch);
    if (!layer.causal()) {
      EXPECT_NE(error_of([&] { layer.decode(x, state); }).find("needs a causal layer"), std::string::npos)
          << TypeParam::name;
      return;
    }
    const Tensor3<S> want = TypeParam::forward(layer, x, {});
    const double tol = std::is_same<S, float>::value ? 1e-5 : 1e-12;
    Index done = 0;
    for (Index piece : {Index(1), Index(5), kLength - 6}) {
      const Eigen::array<Index, 3> at{0, done, 0}, size{kBatch, piece, kWidth};
      const Tensor3<S> part = x.slice(at, size), want_part = want.slice(at, size);
      const Tensor3<S> got = layer.decode(part, state);
      c2f_test::expect_close(got.data(), want_part.data(), got.size(), tol, tol,
                             std::string(TypeParam::name) + " decode");
      done += piece;
    }
    auto fresh = layer.new_decode_state(kBatch);
    const Tensor3<S> last = layer.prefill(x, fresh);
    const Tensor3<S> want_last =
        want.slice(Eigen::array<Index, 3>{0, kLength - 1, 0}, Eigen::array<Index, 3>{kBatch, 1, kWidth});
    c2f_test::expect_close(last.data(), want_last.data(), last.size(), tol, tol,
                           std::string(TypeParam::name) + " prefill");
  }
}

// ------------------------------------------------------------------------------------------------
// Training: the layers with a Saved type (c2f_test::HasTrain); the others skip.

/// Whether two backward() results have the same shapes and bits, every tensor.
template <class S>
bool same_grads(const c2f::Grads<S>& a, const c2f::Grads<S>& b) {
  if (!same_bits(a.input, b.input) || !same_bits(a.key, b.key) || !same_bits(a.value, b.value) ||
      !same_bits(a.context, b.context)) {
    return false;
  }
  if (a.params.keys() != b.params.keys()) return false;
  for (const auto& [key, t] : a.params) {
    if (t.shape() != b.params.at(key).shape() || t.bytes() != b.params.at(key).bytes()) return false;
  }
  return true;
}

TYPED_TEST_P(LayerContract, ForwardTrainWithoutDropoutHasTheForwardBits) {
  using S = typename TestFixture::ScalarType;
  if constexpr (!c2f_test::HasTrain<typename TestFixture::LayerType>::value) {
    GTEST_SKIP() << TypeParam::name << " does not train yet";
  } else if (TestFixture::bf16()) {
    TestFixture::expect_training_refused();
  } else {
    TestRng rng(1012);
    const typename TestFixture::LayerType layer = TestFixture::random_layer(22);
    const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
    const std::vector<Masks<S>> sets = TestFixture::mask_sets(kBatch, kLength);
    for (std::size_t m = 0; m < sets.size(); ++m) {
      EXPECT_TRUE(same_bits(TypeParam::forward_train(layer, x, sets[m]).output, TypeParam::forward(layer, x, sets[m])))
          << TestFixture::what("forward_train's output differs from forward's", m);
    }
  }
}

// g.params: state_dict()'s names, shapes and dtype; g.input: x's shape; all finite. Batch 0 and length 0
// give zero parameter gradients.
TYPED_TEST_P(LayerContract, GradientsHaveTheStateDictNamesAndTheInputShape) {
  using S = typename TestFixture::ScalarType;
  if constexpr (!c2f_test::HasTrain<typename TestFixture::LayerType>::value) {
    GTEST_SKIP() << TypeParam::name << " does not train yet";
  } else if (TestFixture::bf16()) {
    TestFixture::expect_training_refused();
  } else {
    TestRng rng(1013);
    const typename TestFixture::LayerType layer = TestFixture::random_layer(23);
    const StateDict sd = layer.state_dict();
    for (const auto& [batch, seq] :
         std::vector<std::pair<Index, Index>>{{kBatch, kLength}, {3, 1}, {0, kLength}, {kBatch, 0}}) {
      const std::string where =
          std::string(TypeParam::name) + " B=" + std::to_string(batch) + " L=" + std::to_string(seq);
      const Tensor3<S> x = TestFixture::input(rng, batch, seq);
      const auto [y, saved] = TypeParam::forward_train(layer, x, {});
      const Tensor3<S> dy = rng.tensor<S>(y.dimension(0), y.dimension(1), y.dimension(2));
      const c2f::Grads<S> g = TypeParam::backward(layer, saved, dy);
      EXPECT_EQ(g.input.dimensions(), x.dimensions()) << where;
      EXPECT_TRUE((Eigen::Map<const Eigen::Array<S, Eigen::Dynamic, 1>>(g.input.data(), g.input.size()).allFinite()))
          << where;
      ASSERT_EQ(g.params.keys(), sd.keys()) << where;
      for (const auto& [key, t] : sd) {
        EXPECT_EQ(g.params.at(key).shape(), t.shape()) << where << " " << key;
        EXPECT_EQ(g.params.at(key).dtype(), c2f::dtype_of<S>()) << where << " " << key;
        const std::vector<double> v = g.params.at(key).template to_vector<double>();
        for (double e : v) {
          ASSERT_TRUE(std::isfinite(e)) << where << " " << key;
          if (batch * seq == 0) {
            ASSERT_EQ(e, 0.0) << where << " " << key << ": no rows, no gradient";
          }
        }
      }
    }
  }
}

TYPED_TEST_P(LayerContract, GradientBitsDoNotDependOnThreadCount) {
  using S = typename TestFixture::ScalarType;
  if constexpr (!c2f_test::HasTrain<typename TestFixture::LayerType>::value) {
    GTEST_SKIP() << TypeParam::name << " does not train yet";
  } else if (TestFixture::bf16()) {
    TestFixture::expect_training_refused();
  } else {
    TestRng rng(1014);
    typename TestFixture::LayerType layer = TestFixture::random_layer(24);
    const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
    const std::vector<Masks<S>> sets = TestFixture::mask_sets(kBatch, kLength);
    for (std::size_t m = 0; m < sets.size(); ++m) {
      layer.set_num_threads(1);
      const auto [y, saved] = TypeParam::forward_train(layer, x, sets[m]);
      const Tensor3<S> dy = rng.tensor<S>(y.dimension(0), y.dimension(1), y.dimension(2));
      const c2f::Grads<S> one = TypeParam::backward(layer, saved, dy);
      for (int threads : {2, 3}) {
        layer.set_num_threads(threads);
        const auto [y_n, saved_n] = TypeParam::forward_train(layer, x, sets[m]);
        EXPECT_TRUE(same_grads(TypeParam::backward(layer, saved_n, dy), one))
            << TestFixture::what("the gradient bits differ between 1 and ", m) << threads << " threads";
      }
    }
  }
}

// A dy of another shape names both shapes; a saved state made by another object (a copy), before a
// load_state_dict, or moved from, is refused.
TYPED_TEST_P(LayerContract, BackwardRefusesAWrongDyOrAnotherSavedState) {
  using S = typename TestFixture::ScalarType;
  if constexpr (!c2f_test::HasTrain<typename TestFixture::LayerType>::value) {
    GTEST_SKIP() << TypeParam::name << " does not train yet";
  } else if (TestFixture::bf16()) {
    TestFixture::expect_training_refused();
  } else {
    TestRng rng(1015);
    typename TestFixture::LayerType layer = TestFixture::random_layer(25);
    const Tensor3<S> x = TestFixture::input(rng, kBatch, kLength);
    auto result = TypeParam::forward_train(layer, x, {});
    const Tensor3<S>& y = result.output;
    const Tensor3<S> dy = rng.tensor<S>(y.dimension(0), y.dimension(1), y.dimension(2));
    const Tensor3<S> wrong = rng.tensor<S>(y.dimension(0), y.dimension(1) + 1, y.dimension(2));
    const std::string e_shape = error_of([&] { TypeParam::backward(layer, result.saved, wrong); });
    EXPECT_NE(e_shape.find(std::string(TypeParam::Layer::type_name) + ": backward: dy must be"), std::string::npos)
        << e_shape;
    EXPECT_NE(e_shape.find(c2f::detail::shape_string({y.dimension(0), y.dimension(1), y.dimension(2)})),
              std::string::npos)
        << e_shape;
    EXPECT_NE(e_shape.find(c2f::detail::shape_string({wrong.dimension(0), wrong.dimension(1), wrong.dimension(2)})),
              std::string::npos)
        << e_shape;
    const typename TestFixture::LayerType copy = layer;
    EXPECT_NE(error_of([&] { TypeParam::backward(copy, result.saved, dy); }).find("another layer object"),
              std::string::npos)
        << TypeParam::name;
    EXPECT_NO_THROW(TypeParam::backward(layer, result.saved, dy)) << TypeParam::name;
    layer.load_state_dict(layer.state_dict());
    EXPECT_NE(error_of([&] { TypeParam::backward(layer, result.saved, dy); }).find("parameters changed"),
              std::string::npos)
        << TypeParam::name;
    auto fresh = TypeParam::forward_train(layer, x, {});
    const auto moved = std::move(fresh.saved);
    EXPECT_NE(error_of([&] { TypeParam::backward(layer, fresh.saved, dy); }).find("empty"),
              std::string::npos)  // NOLINT(bugprone-use-after-move)
        << TypeParam::name;
    EXPECT_NO_THROW(TypeParam::backward(layer, moved, dy)) << TypeParam::name;
  }
}

#endif  // C2F_CONTRACT_THREADS_ONLY

#ifdef C2F_CONTRACT_THREADS_ONLY
REGISTER_TYPED_TEST_SUITE_P(LayerContract, ConcurrentCallersShareOneModule);
#else
REGISTER_TYPED_TEST_SUITE_P(LayerContract, OutputBitsDoNotDependOnThreadCount, ForwardIntoWritesExactlyTheForwardOutput,
                            ForwardOverwritesAReusedBuffer, WorkspaceBytesBoundTheMeasuredPeak, StateDictRoundTrip,
                            ParametersChangedAfterAForwardAreUsed, StrictLoadingNamesTheKey,
                            EmptyBatchEmptySequenceAndLengthOne, WrongFeaturesNameBothShapes,
                            NanInAnInputReachesTheOutput, RefusesMaskFieldsItDoesNotTake,
                            ConcurrentCallersShareOneModule, DecodeEqualsTheCausalForward,
                            ForwardTrainWithoutDropoutHasTheForwardBits, GradientsHaveTheStateDictNamesAndTheInputShape,
                            GradientBitsDoNotDependOnThreadCount, BackwardRefusesAWrongDyOrAnotherSavedState);
#endif

using c2f_test::EntryNames;
INSTANTIATE_TYPED_TEST_SUITE_P(Layers, LayerContract, c2f_test::AllLayers, EntryNames);

// Linear hands out its weight to change (weight()): a change after a forward must reach the next one,
// through the packing the layer keeps (fp32 micro-kernel or bfloat16), and so must a switch of the
// bfloat16 engine. The rows-independent products pack on every build (a portable build's fp32 forward_rows
// runs Eigen's product, which packs nothing to keep).
TEST(WeightCache, LinearSeesAChangedWeightAndAnotherEngine) {
  for (const c2f::Compute compute : {c2f::Compute::Float32, c2f::Compute::BFloat16}) {
    SCOPED_TRACE(compute == c2f::Compute::Float32 ? "fp32" : "bf16");
    TestRng rng(1011);
    const c2f::Linear<float>::Options options = c2f::Linear<float>::Options().compute(compute).num_threads(2);
    c2f::Linear<float> lin(48, 40, options);
    const RowMatrix<float> x = rng.matrix<float>(70, 48);
    RowMatrix<float> y(70, 40), want(70, 40);
    const auto fresh_output = [&](const c2f::Linear<float>& like) {
      c2f::Linear<float> other(48, 40, options);
      other.load_state_dict(like.state_dict());
      other.forward_rows_independent(x, want);
      return want;
    };
    const auto equal = [](const RowMatrix<float>& a, const RowMatrix<float>& b) {
      return same_bits(a.data(), b.data(), a.size());
    };
    lin.forward_rows_independent(x, y);
    const RowMatrix<float> first = y;
    lin.weight()(3, 5) += 4.0f;  // row 3 of the weight is output column 3
    lin.forward_rows_independent(x, y);
    EXPECT_FALSE(equal(y.col(3), first.col(3))) << "the changed weight is not used";
    EXPECT_TRUE(equal(y, fresh_output(lin)));
    lin.weight() = rng.matrix<float>(40, 48);
    lin.forward_rows_independent(x, y);
    EXPECT_TRUE(equal(y, fresh_output(lin)));
    for (c2f::Bf16Engine e : c2f_test::available_bf16_engines()) {  // the packing of the engine in use
      const auto engine_setting = c2f_test::scoped_bf16_engine(e);
      lin.forward_rows_independent(x, y);
      EXPECT_TRUE(equal(y, fresh_output(lin))) << "engine " << c2f::bf16_engine_name(e);
    }
  }
}

// MultiHeadAttention's in-projection packings, fp32 on every build (rows_independent: the packed path):
// weights loaded or reset after a forward give their own bits.
TEST(WeightCache, MultiHeadAttentionUsesWeightsLoadedAfterAForward) {
  TestRng rng(1012);
  const auto options = c2f::MultiHeadAttention<float>::Options().rows_independent(true).num_threads(2);
  const c2f::MultiHeadAttention<float> a(32, 4, c2f::MultiHeadAttention<float>::Options(options).seed(1));
  c2f::MultiHeadAttention<float> b(32, 4, c2f::MultiHeadAttention<float>::Options(options).seed(2));
  const Tensor3<float> x = rng.tensor<float>(2, 35, 32);
  const Tensor3<float> want = a.forward(x);
  ASSERT_FALSE(same_bits(b.forward(x), want));
  b.load_state_dict(a.state_dict());
  EXPECT_TRUE(same_bits(b.forward(x), want)) << "load_state_dict after a forward";
  c2f::MultiHeadAttention<float> fresh(32, 4, options);
  fresh.reset_parameters(77);
  b.reset_parameters(77);
  EXPECT_TRUE(same_bits(b.forward(x), fresh.forward(x))) << "reset_parameters after a forward";
}

// Different modules and thread counts at the same time, with the default small-work threshold.
TEST(SharedModule, MixedModulesAtOnce) {
  TestRng rng(903);
  c2f::MultiHeadAttention<float> mha(32, 4);
  c2f::C2FAttention<float> attn(32, 4, 8);
  c2f_test::randomize(mha, rng);
  c2f_test::randomize(attn, rng);
  const Tensor3<float> x = rng.tensor<float>(2, 97, 32);
  mha.set_num_threads(1);
  attn.set_num_threads(1);
  const Tensor3<float> mha_ref = mha.forward(x), c2f_ref = attn.forward(x);
  mha.set_num_threads(0);
  attn.set_num_threads(2);
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int call = 0; call < 3; ++call) {
        const bool is_mha = k % 2 == 0;
        const Tensor3<float> y = is_mha ? mha.forward(x) : attn.forward(x);
        if (!same_bits(y, is_mha ? mha_ref : c2f_ref)) ++wrong[static_cast<std::size_t>(k)];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(wrong[static_cast<std::size_t>(k)], 0) << "caller " << k;
}

// ------------------------------------------------------------------------------------------------
// Broken layers: each breaks one property of the contract, so the matching test must fail on it (the
// ctests contract.catches_* check that it does). They are MultiHeadAttention with one thing changed.

using Mha = c2f::MultiHeadAttention<float>;
using Out = c2f::RowMatrixRef<float>;

/// Adds 1e-6 × its thread count to every output.
struct ThreadDependentLayer : Mha {
  using Mha::Mha;
  void forward_into(c2f::ConstTensor3Ref<float> x, Out out, const Masks<float>& m = {}) const {
    Mha::forward_into(x, out, m);
    out.array() += 1e-6f * static_cast<float>(c2f::detail::resolve_threads(options().num_threads(), 1 << 20));
  }
  Tensor3<float> forward(c2f::ConstTensor3Ref<float> x, const Masks<float>& m = {}) const {
    return c2f::detail::fresh_output<float>("ThreadDependentLayer", output_shape(x), options().num_threads(),
                                            [&](Out out) { forward_into(x, out, m); });
  }
};

/// forward_into leaves the last row alone.
struct IntoSkipsARowLayer : Mha {
  using Mha::Mha;
  void forward_into(c2f::ConstTensor3Ref<float> x, Out out, const Masks<float>& m = {}) const {
    const RowMatrix<float> last = out.bottomRows(1);
    Mha::forward_into(x, out, m);
    out.bottomRows(1) = last;
  }
};

/// forward() leaves the last row of its output as the buffer held it (as a layer that counts on fresh
/// memory being zero would).
struct UnwrittenRowLayer : Mha {
  using Mha::Mha;
  c2f::Output<float> forward(c2f::ConstTensor3Ref<float> x, const Masks<float>& m = {}) const {
    c2f::Output<float> y({x.batch(), x.seq(), embed_dim()});
    Eigen::Map<RowMatrix<float>> rows(y.data(), x.batch() * x.seq(), embed_dim());
    RowMatrix<float> all(rows.rows(), rows.cols());
    Mha::forward_into(x, all, m);
    rows.topRows(rows.rows() - 1) = all.topRows(rows.rows() - 1);
    return y;
  }
};

/// state_dict() saves out_proj.bias as zeros.
struct LossyStateDictLayer : Mha {
  using Mha::Mha;
  StateDict state_dict(std::string_view prefix = "") const {
    StateDict sd = Mha::state_dict(prefix);
    const std::string key = c2f::detail::normalize_prefix(prefix) + "out_proj.bias";
    const std::vector<float> zeros(static_cast<std::size_t>(embed_dim()), 0.0f);
    sd.set(key, c2f::TensorData::from_values(zeros.data(), {embed_dim()}));
    return sd;
  }
};

/// Says it takes no masks but ignores them instead of refusing them.
struct IgnoresMasksLayer : Mha {
  using Mha::Mha;
  static constexpr MaskFields mask_fields = MaskFields::None;
  Tensor3<float> forward(c2f::ConstTensor3Ref<float> x, const Masks<float>& = {}) const { return Mha::forward(x); }
  void forward_into(c2f::ConstTensor3Ref<float> x, Out out, const Masks<float>& = {}) const {
    Mha::forward_into(x, out);
  }
};

/// Keeps its output in a member buffer between the computation and the copy out: concurrent callers
/// overwrite each other's (the buffer never reallocates, so this stays memory-safe).
struct SharedScratchLayer : Mha {
  using Mha::Mha;
  Tensor3<float> forward(c2f::ConstTensor3Ref<float> x, const Masks<float>& m = {}) const {
    Tensor3<float> y = Mha::forward(x, m);
    std::copy(y.data(), y.data() + y.size(), scratch_.begin());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::copy(scratch_.begin(), scratch_.begin() + y.size(), y.data());
    return y;
  }
  mutable std::vector<float> scratch_ = std::vector<float>(std::size_t(1) << 16);
};

/// A causal layer whose decode() drifts by 1e-3.
struct DriftingDecodeLayer : Mha {
  using Mha::Mha;
  template <class State>
  Tensor3<float> decode(c2f::ConstTensor3Ref<float> x, State& state) const {
    Tensor3<float> y = Mha::decode(x, state);
    y = y + y.constant(1e-3f);
    return y;
  }
};

/// backward() sums out_proj.bias's gradient over one chunk of rows per thread, then adds the chunks: a
/// reduction whose order changes with the thread count (a deterministic kernel reduces in a fixed order).
struct ThreadDependentGradsLayer : Mha {
  using Mha::Mha;
  template <class Saved>
  c2f::Grads<float> backward(const Saved& saved, c2f::ConstTensor3Ref<float> dy) const {
    c2f::Grads<float> g = Mha::backward(saved, dy);
    const Eigen::Map<const RowMatrix<float>> rows = dy.rows();
    const Index threads = c2f::detail::resolve_threads(options().num_threads(), 1 << 20);
    const Index chunk = std::max<Index>(1, c2f::detail::ceil_div(rows.rows(), threads));
    Eigen::RowVectorXf total = Eigen::RowVectorXf::Zero(embed_dim());
    for (Index r0 = 0; r0 < rows.rows(); r0 += chunk) {
      total += rows.middleRows(r0, std::min(chunk, rows.rows() - r0)).colwise().sum();
    }
    g.params.set("out_proj.bias", c2f::TensorData::from_values(total.data(), {embed_dim()}));
    return g;
  }
};

/// Computes every forward with the parameters of its first one: a cache of packed weights that is never
/// made again when the parameters change (load_state_dict, reset_parameters).
struct StaleParametersLayer : Mha {
  using Mha::Mha;
  Tensor3<float> forward(c2f::ConstTensor3Ref<float> x, const Masks<float>& m = {}) const {
    return first().forward(x, m);
  }
  void forward_into(c2f::ConstTensor3Ref<float> x, Out out, const Masks<float>& m = {}) const {
    first().forward_into(x, out, m);
  }
  const Mha& first() const {
    if (first_ == nullptr) first_ = std::make_shared<const Mha>(static_cast<const Mha&>(*this));
    return *first_;
  }
  mutable std::shared_ptr<const Mha> first_;
};

// clang-format off
C2F_LAYER(ThreadDependent, ThreadDependentLayer, kWidth, 2, o);
C2F_LAYER(IntoSkipsARow, IntoSkipsARowLayer, kWidth, 2, o);
C2F_LAYER(UnwrittenRow, UnwrittenRowLayer, kWidth, 2, o);
C2F_LAYER(LossyStateDict, LossyStateDictLayer, kWidth, 2, o);
C2F_LAYER(IgnoresMasks, IgnoresMasksLayer, kWidth, 2, o);
C2F_LAYER(SharedScratch, SharedScratchLayer, kWidth, 2, o);
C2F_LAYER(DriftingDecode, DriftingDecodeLayer, kWidth, 2, o.causal(true));
C2F_LAYER(ThreadDependentGrads, ThreadDependentGradsLayer, kWidth, 2, o);
C2F_LAYER(StaleParameters, StaleParametersLayer, kWidth, 2, o.compute(c2f::Compute::BFloat16));
// clang-format on

using Broken = ::testing::Types<ThreadDependent, IntoSkipsARow, UnwrittenRow, LossyStateDict, IgnoresMasks,
                                SharedScratch, DriftingDecode, ThreadDependentGrads, StaleParameters>;
INSTANTIATE_TYPED_TEST_SUITE_P(Broken, LayerContract, Broken, EntryNames);

}  // namespace
