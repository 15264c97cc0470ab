// Working memory, measured by counting every heap allocation (tools/malloc_counter.hpp):
// the streaming path allocates no [queries, keys] buffer and grows linearly in the sequence length.
#include "support/eigen_assert_throws.hpp"

#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "tools/malloc_counter.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <string>

namespace {

using c2f::Index;

struct Measured {
  long long peak, largest;
};

Measured measure_forward(c2f::MultiHeadAttention<float>& mha, const c2f::Tensor3<float>& x, bool weights) {
  c2f_memory::reset();
  if (weights) {
    const c2f::AttnOutput<float> out = mha.forward_with_weights(x, x, x);
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

// The largest allocation is one block of `bytes`: Eigen adds its alignment to a request where malloc's
// alignment is less than the build's vectors need (32 bytes with AVX, 64 with AVX-512).
void expect_one_block(long long largest, std::size_t bytes, const std::string& what) {
  EXPECT_GE(largest, static_cast<long long>(bytes)) << what;
  EXPECT_LE(largest, static_cast<long long>(bytes) + EIGEN_MAX_ALIGN_BYTES) << what;
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
      expect_one_block(at[i].largest, L * 64 * sizeof(float), "L=" + std::to_string(L) + " threads=" + std::to_string(threads));
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

// C2FAttention's folded path never forms the [L, 2d] key/value tensor of the article's formula: its
// largest block is the [L, d] output, and its working memory grows linearly in L.
TEST_F(MemoryTest, C2FFoldedPathHasNoTokenLevelKeyValueTensor) {
  const Index d = 64, chunk = 32;
  c2f::C2FAttention<float> m(d, 4, chunk);
  c2f_test::TestRng rng(23);
  long long peak[2];
  const Index lengths[2] = {4096, 16384};
  for (int i = 0; i < 2; ++i) {
    const Index L = lengths[i];
    const c2f::Tensor3<float> x = rng.tensor<float>(1, L, d);
    for (c2f::FinePath path : {c2f::FinePath::General, c2f::FinePath::Folded}) {
      m.set_fine_path(path);
      c2f_memory::reset();
      const c2f::Tensor3<float> y = m.forward(x);
      c2f_memory::stop();
      EXPECT_EQ(y.dimension(1), L);
      const long long kv_bytes = static_cast<long long>(L * 2 * d * sizeof(float));
      if (path == c2f::FinePath::General) {
        EXPECT_GE(c2f_memory::largest_allocation(), kv_bytes) << "the counter must see the general path's kv";
      } else {
        expect_one_block(c2f_memory::largest_allocation(), L * d * sizeof(float), "L=" + std::to_string(L));
        // Output + (summaries, context, q, out per chunk) + per-chunk folded queries and pooled tokens.
        const long long predicted = static_cast<long long>(L * d * sizeof(float) +
                                                           m.fine_attn().workspace_bytes(1, L, chunk));
        EXPECT_LE(c2f_memory::peak_bytes(), predicted + predicted / 4) << "L=" << L;
        peak[i] = c2f_memory::peak_bytes();
      }
    }
  }
  const double ratio = double(peak[1]) / double(peak[0]);
  EXPECT_GT(ratio, 3.0);
  EXPECT_LT(ratio, 4.5);
}

}  // namespace
