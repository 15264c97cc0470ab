// Working memory, measured by counting every heap allocation (tests/support/malloc_counter.hpp):
// the streaming path allocates no [queries, keys] buffer and grows linearly in the sequence length.
#include "support/eigen_assert_throws.hpp"

#include "c2f/layers/multihead_attention.hpp"
#include "support/malloc_counter.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

namespace {

using c2f::Index;

struct Measured {
  long long peak, largest;
};

Measured measure_forward(c2f::MultiHeadAttention<float>& mha, const c2f::Tensor3<float>& x, bool weights) {
  c2f_memory::reset();
  if (weights) {
    const c2f::AttentionOutput<float> out = mha.forward_with_weights(x, x, x);
    EXPECT_EQ(out.weights.dimension(2), x.dimension(1));
  } else {
    const c2f::Tensor3<float> out = mha.forward(x);
    EXPECT_EQ(out.dimension(1), x.dimension(1));
  }
  c2f_memory::stop();
  return {c2f_memory::peak_bytes(), c2f_memory::largest_allocation()};
}

class MemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!c2f_memory::available()) GTEST_SKIP() << "malloc counting is unavailable under sanitizers";
  }
};

TEST_F(MemoryTest, CounterSeesTheScoreMatrixWhenWeightsAreRequested) {
  const Index L = 1024;
  c2f::MultiHeadAttention<float> mha(64, 4);
  mha.set_num_threads(1);
  c2f_test::TestRng rng(21);
  const c2f::Tensor3<float> x = rng.tensor<float>(1, L, 64);
  const Measured m = measure_forward(mha, x, /*weights=*/true);
  // The naive path holds one head's L×L scores and returns [1, 1, L, L] weights (plus the per-head
  // [1, 4, L, L] array they are averaged from).
  EXPECT_GE(m.largest, static_cast<long long>(4 * L * L * sizeof(float)));
  EXPECT_GE(m.peak, static_cast<long long>(5 * L * L * sizeof(float)));
}

TEST_F(MemoryTest, StreamingForwardAllocatesNoQueryKeyBuffer) {
  c2f::MultiHeadAttention<float> mha(64, 4);
  c2f_test::TestRng rng(22);
  Measured at[2];
  const Index lengths[2] = {1024, 4096};
  for (int threads : {1, 2}) {
    mha.set_num_threads(threads);
    for (int i = 0; i < 2; ++i) {
      const Index L = lengths[i];
      const c2f::Tensor3<float> x = rng.tensor<float>(1, L, 64);
      at[i] = measure_forward(mha, x, /*weights=*/false);
      // The largest block is one [L, E] activation (E = 64 ≪ L), never an [L, L] score matrix...
      EXPECT_EQ(at[i].largest, static_cast<long long>(L * 64 * sizeof(float))) << "L=" << L << " threads=" << threads;
      // ...and the total held at once is what workspace_bytes() reports, plus the output (and
      // malloc's rounding and the threads' bookkeeping).
      const long long predicted = static_cast<long long>(mha.workspace_bytes(1, L, L)) + L * 64 * 4;
      EXPECT_LE(at[i].peak, predicted + 64 * 1024) << "L=" << L << " threads=" << threads;
      EXPECT_GE(at[i].peak, predicted) << "L=" << L << " threads=" << threads;
    }
    // Linear growth: 4× the length costs about 4× the memory (16× would be quadratic).
    const double ratio = double(at[1].peak) / double(at[0].peak);
    EXPECT_GT(ratio, 3.0) << "threads=" << threads;
    EXPECT_LT(ratio, 4.5) << "threads=" << threads;
  }
}

}  // namespace
