// c2f kernels — KernelOptions: the one options argument every public kernel takes last.
//
// The calling convention of the kernels (c2f/kernels/*.hpp): the operands and the problem's shape (a
// chunk grid, the head count, a selection) and the outputs, then the mask or the causal flag, then the
// softmax scale, then `const KernelOptions&` last. A kernel overwrites its output, unless its name ends
// in `_add`: then it adds to it.
#pragma once

#include "c2f/arg.hpp"
#include "c2f/core.hpp"
#include "c2f/options.hpp"

namespace c2f {
namespace kernels {

/// Blocking and threads of the kernels. Each kernel reads the fields it uses; the block sizes are
/// fixed by the caller, never by the thread count, so the output bits do not depend on it.
class KernelOptions {
  /// Worker threads; 0 = c2f::get_num_threads(), else a cap on it.
  C2F_ARG(int, num_threads) = 0;
  /// Query rows per task (streaming attention).
  C2F_ARG(Index, query_block) = 64;
  /// Keys per online-softmax step (streaming and split-key attention).
  C2F_ARG(Index, key_block) = 256;
  /// Keys per task of the split-key attention.
  C2F_ARG(Index, key_part) = 1024;
  /// matmul_rows: every output row gets the bits it would get in a product of any other number of rows
  /// (the packed GEMM for every row count, on every build, instead of Eigen's product below
  /// cpu::kPackedGemmMinRows rows). A layer whose rows may be split across processes (c2f/dist) sets
  /// it, so that a shard computes exactly the rows of the whole.
  C2F_ARG(bool, rows_independent) = false;
  /// The products' arithmetic: Compute::BFloat16 rounds their operands to bfloat16 and sums in fp32
  /// (cpu/bf16_gemm.hpp), in the kernels that say they honour it (matmul_rows, linear, sdpa_naive,
  /// sdpa_streaming); float only.
  C2F_ARG(Compute, compute) = Compute::Float32;
  /// The output is fresh memory whose pages the system maps and zeroes on their first write (a forward's
  /// new tensor, detail::FreshPages::OnFirstWrite): broadcast_chunks, which writes band by band in address
  /// order, then uses ordinary stores, so that each page is overwritten while its zeroes are still in
  /// cache (docs/layers.md, "Fresh memory"). Otherwise a large output gets streaming stores.
  C2F_ARG(bool, fresh_output) = false;
};

/// KernelOptions with only the thread count set (the kernels that have no blocking).
inline KernelOptions with_threads(int num_threads) {
  KernelOptions o;
  o.num_threads(num_threads);
  return o;
}

}  // namespace kernels
}  // namespace c2f
