// The public kernel contract in a Release build: every public kernel checks its arguments at entry and
// throws std::invalid_argument on a wrong shape even with NDEBUG (where eigen_assert is compiled out
// and a missing check would read out of bounds). This translation unit is built with -DNDEBUG.
#ifndef NDEBUG
#error "test_kernel_contract must be compiled with NDEBUG, as Release builds are"
#endif

#include "c2f/c2f.hpp"

#include <gtest/gtest.h>

#include <string>

namespace {

using c2f::Index;
using c2f::RowMatrix;
namespace kernels = c2f::kernels;

RowMatrix<float> ones(Index rows, Index cols) { return RowMatrix<float>::Ones(rows, cols); }

// The message names the kernel.
template <class Fn>
void expect_rejected(const char* kernel, Fn&& fn) {
  try {
    fn();
    ADD_FAILURE() << kernel << ": no std::invalid_argument for a wrong shape";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(kernel), std::string::npos) << e.what();
  }
}

TEST(KernelContract, LinearAndMatmulRows) {
  RowMatrix<float> y = ones(4, 5);
  expect_rejected("linear",
                  [&] { kernels::linear<float>(ones(4, 3), ones(5, 2), nullptr, y, c2f::kernels::with_threads(1)); });
  expect_rejected("linear_naive", [&] { kernels::linear_naive<float>(ones(4, 3), ones(5, 2), nullptr, y); });
  expect_rejected("matmul_rows", [&] {
    kernels::matmul_rows<float>(ones(4, 3), ones(2, 5), nullptr, y, c2f::kernels::with_threads(1));
  });
}

TEST(KernelContract, Conv1d) {
  const kernels::Conv1dShape shape{4, 6, 3, 1, 1};
  const RowMatrix<float> taps = ones(3 * 6, 4), w = ones(6, 4 * 3);
  RowMatrix<float> y = ones(2 * 10, 6);
  expect_rejected("conv1d", [&] {
    kernels::conv1d<float>(ones(2 * 9, 4), 2, 10, shape, taps, nullptr, y, c2f::kernels::with_threads(1));
  });
  expect_rejected("conv1d", [&] {
    kernels::conv1d<float>(ones(2 * 10, 4), 2, 10, shape, ones(3 * 6, 3), nullptr, y, c2f::kernels::with_threads(1));
  });
  expect_rejected("conv1d_naive",
                  [&] { kernels::conv1d_naive<float>(ones(2 * 10, 5), 2, 10, shape, w.data(), nullptr, y); });
  expect_rejected("Conv1d", [&] { kernels::conv1d_taps<float>(w.data(), kernels::Conv1dShape{4, 6, 3, 1, 4}); });
}

TEST(KernelContract, Sdpa) {
  const RowMatrix<float> q = ones(2 * 5, 8), k = ones(2 * 7, 8);
  RowMatrix<float> out = ones(2 * 5, 8);
  const kernels::HeadsView<const float> qv = kernels::heads_view(q, 2, 5, 2), kv = kernels::heads_view(k, 2, 7, 2);
  const kernels::HeadsView<const float> wrong_k = kernels::heads_view<const float>(k.data(), 2, 7, 8, 0, 2, 3);
  const kernels::HeadsView<float> ov = kernels::heads_view(out, 2, 5, 2);
  const c2f::KeyPaddingMask<float> lengths = c2f::KeyPaddingMask<float>::lengths({5, 5});
  const c2f::MaskView<float> other_problem({}, lengths, 2, 2, 5, 5);  // keys 5, not 7
  for (const std::string kernel : {"sdpa_naive", "sdpa_streaming", "sdpa_split_keys"}) {
    const auto call = [&](const kernels::HeadsView<const float>& kk, const c2f::MaskView<float>& mask, float scale) {
      if (kernel == "sdpa_naive") {
        kernels::sdpa_naive<float>(qv, kk, kk, ov, mask, scale, {});
      } else if (kernel == "sdpa_streaming") {
        kernels::sdpa_streaming<float>(qv, kk, kk, ov, mask, scale, {});
      } else {
        kernels::sdpa_split_keys<float>(qv, kk, kk, ov, mask, scale, {});
      }
    };
    expect_rejected(kernel.c_str(), [&] { call(wrong_k, {}, 0.5f); });
    expect_rejected(kernel.c_str(), [&] { call(kv, other_problem, 0.5f); });
    expect_rejected(kernel.c_str(), [&] { call(kv, {}, 0.0f); });  // the scale is explicit: 0 is not "default"
  }
}

TEST(KernelContract, TrainingKernels) {
  const RowMatrix<float> q = ones(2 * 5, 8), k = ones(2 * 7, 8), lse_wrong = ones(4, 6);
  RowMatrix<float> out = ones(2 * 5, 8), lse = ones(4, 5), lse_bad = ones(4, 6), lse_transposed = ones(5, 4);
  RowMatrix<float> dq = ones(2 * 5, 8), dk = ones(2 * 7, 8), dv = ones(2 * 7, 8);
  const kernels::HeadsView<const float> qv = kernels::heads_view(q, 2, 5, 2), kv = kernels::heads_view(k, 2, 7, 2);
  const kernels::HeadsView<float> ov = kernels::heads_view(out, 2, 5, 2), dqv = kernels::heads_view(dq, 2, 5, 2),
                                  dkv = kernels::heads_view(dk, 2, 7, 2), dvv = kernels::heads_view(dv, 2, 7, 2);
  const kernels::AttnDropout none, certain{1.0, 0, 0};
  expect_rejected("sdpa_train", [&] { kernels::sdpa_train<float>(qv, kv, kv, ov, lse_bad, {}, none, 0.5f, {}); });
  expect_rejected("sdpa_train", [&] { kernels::sdpa_train<float>(qv, kv, kv, ov, lse, {}, certain, 0.5f, {}); });
  expect_rejected("sdpa_naive_train",
                  [&] { kernels::sdpa_naive_train<float>(qv, kv, kv, ov, lse_transposed, {}, none, 0.5f, {}); });
  expect_rejected("sdpa_backward", [&] {
    kernels::sdpa_backward<float>(qv, kv, kv, ov, lse_wrong, ov, dqv, dkv, dvv, {}, none, 0.5f, {});
  });
  expect_rejected("sdpa_backward",
                  [&] { kernels::sdpa_backward<float>(qv, kv, kv, ov, lse, ov, dqv, dqv, dvv, {}, none, 0.5f, {}); });
  expect_rejected("sdpa_backward",
                  [&] { kernels::sdpa_backward<float>(qv, kv, kv, ov, lse, ov, dqv, dkv, dvv, {}, none, 0.0f, {}); });
  expect_rejected("sdpa_backward_naive",
                  [&] { kernels::sdpa_backward_naive<float>(qv, kv, kv, ov, dqv, dkv, dqv, {}, none, 0.5f, {}); });
  expect_rejected("sdpa_backward_naive",
                  [&] { kernels::sdpa_backward_naive<float>(qv, kv, kv, ov, dqv, dkv, dvv, {}, certain, 0.5f, {}); });
  RowMatrix<float> dx = ones(4, 3), dw = ones(5, 3), dw_transposed = ones(3, 5), dx_narrow = ones(4, 2);
  expect_rejected("linear_backward",
                  [&] { kernels::linear_backward<float>(ones(4, 3), ones(5, 3), ones(4, 4), dx, dw, nullptr, {}); });
  expect_rejected("linear_backward", [&] {
    kernels::linear_backward<float>(ones(4, 3), ones(5, 3), ones(4, 5), dx, dw_transposed, nullptr, {});
  });
  expect_rejected("linear_backward_naive", [&] {
    kernels::linear_backward_naive<float>(ones(4, 3), ones(5, 3), ones(4, 5), dx_narrow, dw, nullptr);
  });
}

TEST(KernelContract, Chunks) {
  const kernels::ChunkGrid grid{2, 10, 4};  // 3 chunks per batch item, 6 in all
  RowMatrix<float> rows = ones(6, 8), tokens = ones(20, 8), five_rows = ones(5, 8), mass3 = ones(6, 3);
  expect_rejected("chunk_mean",
                  [&] { kernels::chunk_mean<float>(ones(19, 8), grid, rows, c2f::kernels::with_threads(1)); });
  expect_rejected("chunk_mean",
                  [&] { kernels::chunk_mean<float>(tokens, grid, five_rows, c2f::kernels::with_threads(1)); });
  expect_rejected("chunk_mean", [&] {
    kernels::chunk_mean<float>(tokens, kernels::ChunkGrid{2, 10, 0}, rows, c2f::kernels::with_threads(1));
  });
  expect_rejected("broadcast_chunks",
                  [&] { kernels::broadcast_chunks<float>(ones(5, 8), grid, tokens, c2f::kernels::with_threads(1)); });
  RowMatrix<float> pooled = ones(6, 2 * 8), mass = ones(6, 2);
  const auto no_bias = [](Index, Index, Index) { return 0.0f; };
  expect_rejected("fine_attention_folded", [&] {
    kernels::fine_attention_folded<float>(tokens, grid, ones(6, 2 * 7), 2, pooled, mass, no_bias,
                                          c2f::kernels::with_threads(1));
  });
  expect_rejected("fine_attention_folded", [&] {
    kernels::fine_attention_folded<float>(tokens, grid, ones(6, 2 * 8), 2, pooled, mass3, no_bias,
                                          c2f::kernels::with_threads(1));
  });
}

TEST(KernelContract, HierarchicalLevels) {
  const kernels::ChunkGrid grid{2, 10, 4};
  const RowMatrix<float> q = ones(20, 8), short_k = ones(19, 8), means = ones(6, 8);
  RowMatrix<float> out = ones(20, 8);
  expect_rejected("window_attention", [&] {
    kernels::window_attention_add<float>(q, short_k, q, grid, 2, out, false, 0.5f, c2f::kernels::with_threads(1));
  });
  expect_rejected("window_attention", [&] {
    kernels::window_attention_add<float>(q, q, q, grid, 3, out, false, 0.5f, c2f::kernels::with_threads(1));
  });
  expect_rejected("window_summary_attention", [&] {
    kernels::window_summary_attention_add<float>(q, ones(5, 8), means, grid, 2, out, 0.5f,
                                                 c2f::kernels::with_threads(1));
  });
  expect_rejected("sparse_global_attention", [&] {
    kernels::sparse_global_attention_add<float>(q, short_k, q, 2, 10, 2, out, true, 0.5f,
                                                c2f::kernels::with_threads(1));
  });
  expect_rejected("sparse_global_attention", [&] {
    kernels::sparse_global_attention_add<float>(q, q, q, 2, 10, 2, out, true, -1.0f, c2f::kernels::with_threads(1));
  });
}

TEST(KernelContract, ChunkSparse) {
  const kernels::ChunkGrid grid{1, 20, 4};
  const RowMatrix<float> q = ones(20, 8), short_k = ones(19, 8);
  RowMatrix<float> out = ones(20, 8);
  expect_rejected("select_chunks",
                  [&] { kernels::select_chunks<float>(q, short_k, grid, 2, 2, c2f::kernels::with_threads(1)); });
  expect_rejected("select_chunks",
                  [&] { kernels::select_chunks<float>(q, q, grid, 2, 0, c2f::kernels::with_threads(1)); });
  expect_rejected("select_chunks_per_token", [&] {
    kernels::select_chunks_per_token<float>(q, ones(3, 8), grid, 2, 2, true, c2f::kernels::with_threads(1));
  });
  expect_rejected("select_chunks_per_token", [&] {
    kernels::select_chunks_per_token<float>(ones(21, 8), ones(5, 8), grid, 2, 2, true, c2f::kernels::with_threads(1));
  });
  const kernels::ChunkSelection per_chunk =
      kernels::select_chunks<float>(q, q, grid, 2, 2, c2f::kernels::with_threads(1));
  const kernels::ChunkSelection per_token =
      kernels::select_chunks_per_token<float>(q, ones(5, 8), grid, 2, 2, true, c2f::kernels::with_threads(1));
  expect_rejected("chunk_sparse_attention", [&] {
    kernels::chunk_sparse_attention<float>(q, short_k, q, grid, 2, per_chunk, out, {}, 0.5f,
                                           c2f::kernels::with_threads(1));
  });
  expect_rejected("chunk_sparse_attention", [&] {
    kernels::chunk_sparse_attention<float>(q, q, q, grid, 2, per_token, out, {}, 0.5f, c2f::kernels::with_threads(1));
  });
  kernels::ChunkSelection corrupt = per_chunk;
  corrupt.index[0] = 5;  // chunk 5 of 5
  expect_rejected("chunk_sparse_attention", [&] {
    kernels::chunk_sparse_attention<float>(q, q, q, grid, 2, corrupt, out, {}, 0.5f, c2f::kernels::with_threads(1));
  });
  expect_rejected("token_sparse_attention", [&] {
    kernels::token_sparse_attention<float>(q, q, short_k, grid, 2, per_token, out, true, {}, 0.5f,
                                           c2f::kernels::with_threads(1));
  });
  expect_rejected("token_sparse_attention", [&] {
    kernels::token_sparse_attention<float>(q, q, q, grid, 2, per_chunk, out, true, {}, 0.5f,
                                           c2f::kernels::with_threads(1));
  });
}

}  // namespace
