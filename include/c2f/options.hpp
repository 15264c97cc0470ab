// c2f — layer options: named, chainable setters (PyTorch C++'s TORCH_ARG style) instead of positional
// aggregates, and the option groups several layers share.
//
//   c2f::MultiHeadAttention<float> mha(512, 8, c2f::MultiHeadAttention<float>::Options().causal(true).num_threads(2));
//   mha.options().num_threads();  // 2
//
// Every option is a getter `name()` and a setter `name(value)` that returns the options object, so
// setters chain. Options that mean the same thing have the same name on every layer (num_threads, seed,
// bias, causal, dropout, kernel, query_block, key_block, fine_path), and a layer that wraps another takes the
// wrapped layer's options too.
#pragma once

#include "c2f/arg.hpp"
#include "c2f/core.hpp"

#include <cstdint>

namespace c2f {

/// Which kernel computes softmax(q kᵀ · scale) v when no attention weights are asked for.
enum class AttnKernel {
  Streaming,  ///< blocked online softmax, no [queries, keys] buffer (default)
  Naive,      ///< materialises the scores of one (batch, head) at a time; the reference
};

/// The arithmetic of a layer's products (docs/bf16.md).
enum class Compute {
  Float32,   ///< fp32 throughout (default)
  BFloat16,  ///< operands of the products rounded to bfloat16, sums, softmax and biases in fp32
};

/// The engine that runs Compute::BFloat16's products (docs/bf16.md#engines); all give the same rounded
/// operands and differ only in the order of the fp32 additions.
enum class Bf16Engine {
  Auto,      ///< the rule: Tiles where the CPU has AMX, Dot on AMD CPUs with AVX512_BF16, else Fallback
  Fallback,  ///< the rounded operands as fp32 values on the fp32 micro-kernel (every CPU)
  Dot,       ///< vdpbf16ps (AVX512_BF16): pairs of bfloat16 along the depth into fp32 accumulators
  Tiles,     ///< the AMX tile unit (tdpbf16ps)
};

/// Options every layer has. `Derived` is the layer's options type (its setters return it).
template <class Derived>
class RuntimeOptions {
  /// Worker threads of one call: 0 = c2f::get_num_threads() (c2f/runtime.hpp), else a cap on it;
  /// results are bitwise the same for any count.
  C2F_SHARED_ARG(int, num_threads) = 0;
  /// Seed of the deterministic initialisation of a fresh layer (PyTorch's init distributions).
  C2F_SHARED_ARG(std::uint64_t, seed) = 0;
};

/// The `bias` option of the layers with learned biases (Linear, Conv1d, MultiHeadAttention,
/// SparseC2FAttention): with false, no bias tensor exists.
template <class Derived>
class BiasOption {
  C2F_SHARED_ARG(bool, bias) = true;
};

/// The `causal` option (MultiHeadAttention, SparseC2FAttention, HMHA, Conv1d, C3K2Projection): every
/// output depends only on the inputs up to its own position; each layer's comment says how. Fixed at
/// construction.
template <class Derived>
class CausalOption {
  C2F_SHARED_ARG(bool, causal) = false;
};

/// The `dropout` option of the layers that train their attention (MultiHeadAttention, CoarseAttention): the
/// probability that forward_train() zeroes an attention probability (the survivors are scaled by 1 / (1 −
/// p), as torch.nn.Dropout), drawn from a counter-based generator keyed by (seed, step) and the element's
/// coordinates (docs/training.md). forward() is eval mode and never drops. In [0, 1); 0 = off.
template <class Derived>
class DropoutOption {
  C2F_SHARED_ARG(double, dropout) = 0.0;
};

/// The `compute` option of the layers whose products can run in bfloat16 (docs/bf16.md, which lists them).
template <class Derived>
class ComputeOption {
  C2F_SHARED_ARG(Compute, compute) = Compute::Float32;
};

/// Options of the dense softmax-attention kernel, on every layer built on MultiHeadAttention.
template <class Derived>
class AttnKernelOptions {
  C2F_SHARED_ARG(AttnKernel, kernel) = AttnKernel::Streaming;
  /// Streaming kernel: query rows per task.
  C2F_SHARED_ARG(Index, query_block) = 64;
  /// Streaming kernel: keys per online-softmax step.
  C2F_SHARED_ARG(Index, key_block) = 256;
};

}  // namespace c2f
