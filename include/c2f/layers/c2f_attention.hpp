// c2f layers — coarse-to-fine attention (seed 004): CoarseAttention, FineAttention, C2FAttention.
//
// Semantics (eval mode; dropout is the identity), for d = d_model, H = n_heads, d_k = d / H:
//
//   CoarseAttention   x [B, m, d] chunk summaries → [B, m, d]. q, k, v = chunks of qkv_proj(x)
//                     (Linear d → 3d, in that order), softmax(q kᵀ / sqrt(d_k) + mask) v per head, heads
//                     concatenated, out_proj. Optional mask [m, m] or [B, m, m] (broadcast over heads).
//                     This is MultiHeadAttention with seed 000/004's parameter names.
//
//   FineAttention     tokens [B, m, k, d] and coarse context [B, m, d] → [B, m, k, d]. The query of every
//                     token of chunk i is q_proj(coarse_context_i) (the same for the whole chunk, as in the
//                     seed); k, v = chunks of kv_proj(tokens) (Linear d → 2d); attention only inside the
//                     chunk; out_proj. Optional mask [k, k] or [B·m, k, k] (PyTorch's [B, m, k, k]
//                     flattened; broadcast over heads; a [B·m·H, k, k] mask gives each head its own).
//
//   C2FAttention      x [B, L, d] → chunks of chunk_size → mean over each chunk → CoarseAttention →
//                     FineAttention(x chunks, coarse output) → [B, L, d].
//                     Lengths not divisible by chunk_size: m = ceil(L / chunk_size) chunks, the last one
//                     partial. Its coarse mean averages only its real tokens; in the fine stage its padded
//                     keys are masked and its padded query rows do not exist in the output. L < chunk_size
//                     is one partial chunk. The fine mask is given over the padded grid [B·m, k, k]; its
//                     entries at padded positions are ignored.
//
// The seed's two bugs are fixed: FineAttention no longer overwrites the chunk length k with the key
// tensor, and the masks broadcast over heads. The seed fills masked scores with -1e9; c2f masks with
// -inf, which gives the same result except for a row with no visible key: c2f outputs zero attention
// there (the seed would average every value uniformly).
//
// Fast path: the fine query is the same for every token of a chunk, so without a mask (or with one whose
// rows are equal within each chunk) every token of a chunk has the same output, and the key/value
// projections fold into the query and into the pooled tokens (softmax weights sum to 1):
//   scores_j = q_h·(W_k,h x_j + b_k,h) / sqrt(d_k) = (q_h W_k,h / sqrt(d_k))·x_j + const   (const drops out)
//   o_h      = Σ_j p_j (W_v,h x_j + b_v,h) = W_v,h (Σ_j p_j x_j) + b_v,h
// so no [L, 2d] key/value tensor is ever formed. FinePath::General computes the seed's formula literally
// (kv_proj of every token, one attention row per token) and is the path for per-token masks.
#pragma once

#include "c2f/detail/mask_plan.hpp"
#include "c2f/detail/module.hpp"
#include "c2f/detail/random.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/layers/linear.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/mask.hpp"

#include <string>

namespace c2f {

/// Seed 004's CoarseAttention: attention between chunk summaries, parameters `qkv_proj`, `out_proj`.
template <class Scalar>
class CoarseAttention : public detail::Module<CoarseAttention<Scalar>> {
 public:
  struct Options {
    int num_threads = 0;     ///< 0 = all hardware threads; results are bitwise the same for any count
    std::uint64_t seed = 0;  ///< initialisation: Xavier-uniform qkv_proj.weight, zero biases
  };

  CoarseAttention(Index d_model, Index n_heads) : CoarseAttention(d_model, n_heads, Options{}) {}
  CoarseAttention(Index d_model, Index n_heads, Options options) : mha_(d_model, n_heads, mha_options(options)) {}

  Index d_model() const { return mha_.embed_dim(); }
  Index n_heads() const { return mha_.num_heads(); }
  void set_num_threads(int n) { mha_.set_num_threads(n); }
  /// The same module as a MultiHeadAttention (PyTorch names `in_proj_*` in its state_dict()).
  const MultiHeadAttention<Scalar>& as_multihead_attention() const { return mha_; }

  /// Seed init: nn.init.xavier_uniform_(qkv_proj.weight); out_proj.weight nn.Linear's default; zero biases.
  void reset_parameters(std::uint64_t seed) { mha_.reset_parameters(seed); }

  /// `qkv_proj.weight` [3d, d], `qkv_proj.bias` [3d], `out_proj.weight` [d, d], `out_proj.bias` [d].
  void load(detail::StrictLoader& loader, const std::string& name) {
    if (!loader.has(name + "qkv_proj.weight")) {
      detail::fail("missing key '", loader.prefix(), name, "qkv_proj.weight' (CoarseAttention)");
    }
    mha_.load(loader, name);
  }
  void save(StateDict& sd, const std::string& name) const { mha_.save(sd, name, /*qkv_proj_names=*/true); }

  /// x [B, m, d] → [B, m, d]. `mask` over [m, m] or [n, m, m], n = 1, B or B·H.
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x, const AttnMask<Scalar>& mask = {}) const {
    return mha_.forward(x, {mask, {}});
  }

 private:
  static typename MultiHeadAttention<Scalar>::Options mha_options(const Options& o) {
    typename MultiHeadAttention<Scalar>::Options m;
    m.num_threads = o.num_threads;
    m.seed = o.seed;
    return m;
  }

  MultiHeadAttention<Scalar> mha_;
};

/// How FineAttention computes the attention inside the chunks.
enum class FinePath {
  Auto,     ///< Folded when the mask allows it, else General
  Folded,   ///< one attention row per chunk with kv_proj folded in; throws if mask rows differ in a chunk
  General,  ///< the seed's formula: kv_proj of every token, one masked attention row per token
};

/// Seed 004's FineAttention: attention inside each chunk, guided by the chunk's coarse context.
template <class Scalar>
class FineAttention : public detail::Module<FineAttention<Scalar>> {
 public:
  struct Options {
    int num_threads = 0;  ///< 0 = all hardware threads; results are bitwise the same for any count
    FinePath path = FinePath::Auto;
    std::uint64_t seed = 0;  ///< init: kaiming_normal_(q_proj.weight, mode='fan_out'), zero biases
  };

  FineAttention(Index d_model, Index n_heads) : FineAttention(d_model, n_heads, Options{}) {}
  FineAttention(Index d_model, Index n_heads, Options options)
      : d_(d_model),
        heads_(n_heads),
        options_(options),
        q_proj_(std::max<Index>(d_model, 1), std::max<Index>(d_model, 1)),
        kv_proj_(std::max<Index>(d_model, 1), 2 * std::max<Index>(d_model, 1)),
        out_proj_(std::max<Index>(d_model, 1), std::max<Index>(d_model, 1)) {
    detail::check_scalar<Scalar>();
    check_heads("FineAttention", d_model, n_heads);
    reset_parameters(options.seed);
  }

  Index d_model() const { return d_; }
  Index n_heads() const { return heads_; }
  Index head_dim() const { return d_ / heads_; }
  void set_num_threads(int n) { options_.num_threads = n; }
  void set_path(FinePath path) { options_.path = path; }
  const Options& options() const { return options_; }

  /// Seed init: nn.init.kaiming_normal_(q_proj.weight, mode='fan_out'); kv_proj and out_proj weights
  /// nn.Linear's default (U(±1/sqrt(d))); zero biases. Deterministic in `seed`.
  void reset_parameters(std::uint64_t seed) {
    detail::Rng rng(seed);
    detail::kaiming_normal_fan_out(q_proj_.weight(), rng);
    detail::linear_default_uniform(kv_proj_.weight(), rng);
    detail::linear_default_uniform(out_proj_.weight(), rng);
    q_proj_.bias().setZero();
    kv_proj_.bias().setZero();
    out_proj_.bias().setZero();
  }

  void load(detail::StrictLoader& loader, const std::string& name) {
    q_proj_.load(loader, name + "q_proj.");
    kv_proj_.load(loader, name + "kv_proj.");
    out_proj_.load(loader, name + "out_proj.");
  }
  void save(StateDict& sd, const std::string& name) const {
    q_proj_.save(sd, name + "q_proj.");
    kv_proj_.save(sd, name + "kv_proj.");
    out_proj_.save(sd, name + "out_proj.");
  }

  /// The seed's interface: x [B, m, k, d], coarse_context [B, m, d], mask [k, k] or [n, k, k] with
  /// n = 1, B·m or B·m·H → [B, m, k, d].
  Tensor4<Scalar> forward(ConstTensor4Ref<Scalar> x, ConstTensor3Ref<Scalar> coarse_context,
                          const AttnMask<Scalar>& mask = {}) const {
    const Index b = x.dimension(0), m = x.dimension(1), k = x.dimension(2), f = x.dimension(3);
    if (coarse_context.batch() != b || coarse_context.seq() != m) {
      detail::fail("FineAttention: coarse_context must be [batch, chunks, d] = ",
                   detail::shape_string({b, m, d_}), " for x ", detail::shape_string({b, m, k, f}), ", got ",
                   detail::shape_string({coarse_context.batch(), coarse_context.seq(), coarse_context.features()}));
    }
    if (k == 0 && m > 0) detail::fail("FineAttention: chunks of length 0 in x ", detail::shape_string({b, m, k, f}));
    const Tensor3<Scalar> y =
        forward_chunked(ConstTensor3Ref<Scalar>(x.data(), {b, m * k, f}), std::max<Index>(k, 1), coarse_context, mask);
    Tensor4<Scalar> out(b, m, k, d_);
    std::copy(y.data(), y.data() + y.size(), out.data());
    return out;
  }

  /// Tokens x [B, L, d] cut into chunks of `chunk` (the last one may be partial), coarse_context
  /// [B, ceil(L / chunk), d], mask over the padded grid ([chunk, chunk] or [n, chunk, chunk], n = 1,
  /// B·m or B·m·H; entries at padded positions are ignored) → [B, L, d].
  Tensor3<Scalar> forward_chunked(ConstTensor3Ref<Scalar> x, Index chunk, ConstTensor3Ref<Scalar> coarse_context,
                                  const AttnMask<Scalar>& mask = {}) const {
    if (chunk < 1) detail::fail("FineAttention: chunk size must be >= 1, got ", chunk);
    detail::check_features(x, d_, "FineAttention", "tokens", "d_model");
    const kernels::ChunkGrid grid{x.batch(), x.seq(), chunk};
    const Index m = grid.chunks_per_batch(), chunks = grid.chunks();
    if (coarse_context.batch() != x.batch() || coarse_context.seq() != m || coarse_context.features() != d_) {
      detail::fail("FineAttention: coarse_context must be [batch, ceil(seq / chunk), d_model] = ",
                   detail::shape_string({x.batch(), m, d_}), " for tokens ",
                   detail::shape_string({x.batch(), x.seq(), x.features()}), " and chunk ", chunk, ", got ",
                   detail::shape_string({coarse_context.batch(), coarse_context.seq(), coarse_context.features()}));
    }
    Tensor3<Scalar> y(x.batch(), x.seq(), d_);
    if (chunks == 0) return y;

    // Chunk c sees only its real keys: a key-length mask per chunk on top of the caller's mask.
    std::vector<Index> real_keys(static_cast<std::size_t>(chunks));
    for (Index c = 0; c < chunks; ++c) real_keys[static_cast<std::size_t>(c)] = grid.count(c);
    const KeyPaddingMask<Scalar> padding = KeyPaddingMask<Scalar>::lengths(real_keys);
    const detail::MaskPlan<Scalar> plan(mask, padding, chunks, heads_, chunk, chunk);

    RowMatrix<Scalar> q(chunks, d_);
    q_proj_.forward_rows(coarse_context.rows(), q, options_.num_threads);
    Eigen::Map<RowMatrix<Scalar>> out(y.data(), x.batch() * x.seq(), d_);

    const bool rows_equal = mask.is_none() || mask_rows_equal_in_chunks(plan, grid);
    if (options_.path == FinePath::Folded && !rows_equal) {
      detail::fail("FineAttention: FinePath::Folded needs a mask whose rows are equal within each chunk");
    }
    if (options_.path == FinePath::General || !rows_equal) {
      forward_general(x, grid, q, plan, out);
    } else {
      forward_folded(x.rows(), grid, q, [&](Index c, Index h, Index j) { return plan.bias(c, h, 0, j); }, out);
    }
    return y;
  }

  /// The folded fine stage, without a mask, on any block grid of c2f/kernels/chunk.hpp (a ChunkGrid, a
  /// kernels::BlockGrid2D, ...): tokens x [rows, d_model], coarse_context [blocks, d_model] (one row per
  /// block) → out [rows, d_model], where every real token of block c gets block c's output row. x is
  /// read in place, block by block; rows of `out` that belong to no block are left as they are.
  template <class Grid>
  void forward_blocks(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid,
                      const Eigen::Ref<const RowMatrix<Scalar>>& coarse_context, Eigen::Ref<RowMatrix<Scalar>> out) const {
    if (x.cols() != d_ || out.cols() != d_ || out.rows() != x.rows() || coarse_context.rows() != grid.blocks() ||
        coarse_context.cols() != d_) {
      detail::fail("FineAttention: forward_blocks needs x [rows, d_model=", d_, "], coarse_context [blocks=",
                   grid.blocks(), ", ", d_, "] and out of x's shape, got x ", detail::shape_string({x.rows(), x.cols()}),
                   ", coarse_context ", detail::shape_string({coarse_context.rows(), coarse_context.cols()}), " and out ",
                   detail::shape_string({out.rows(), out.cols()}));
    }
    if (grid.blocks() == 0) return;
    RowMatrix<Scalar> q(grid.blocks(), d_);
    q_proj_.forward_rows(coarse_context, q, options_.num_threads);
    forward_folded(x, grid, q, [](Index, Index, Index) { return Scalar(0); }, out);
  }

  /// Working memory (bytes) of forward_chunked on the folded path, besides the output: q, the folded
  /// queries, the pooled tokens and the chunk outputs — O((L / chunk) · H · d).
  std::size_t folded_workspace_bytes(Index batch, Index seq, Index chunk) const {
    const kernels::ChunkGrid grid{batch, seq, chunk};
    const Index c = grid.chunks();
    return sizeof(Scalar) * static_cast<std::size_t>(c * (3 * d_ + 2 * heads_ * d_ + heads_));
  }

 private:
  static void check_heads(const char* what, Index d, Index h) {
    if (d <= 0 || h <= 0) detail::fail(what, " needs d_model > 0 and n_heads > 0, got d_model=", d, ", n_heads=", h);
    if (d % h != 0) detail::fail(what, ": d_model (", d, ") must be divisible by n_heads (", h, ")");
  }

  /// True when, in every chunk and head, each real query row of the mask equals row 0 on the real keys.
  bool mask_rows_equal_in_chunks(const detail::MaskPlan<Scalar>& plan, const kernels::ChunkGrid& grid) const {
    for (Index c = 0; c < grid.chunks(); ++c) {
      const Index n = grid.count(c);
      for (Index h = 0; h < heads_; ++h) {
        for (Index t = 1; t < n; ++t) {
          for (Index j = 0; j < n; ++j) {
            if (!(plan.bias(c, h, t, j) == plan.bias(c, h, 0, j))) return false;
          }
        }
      }
    }
    return true;
  }

  /// One attention row per block; kv_proj folded into the query (keys) and the pooled tokens (values).
  /// `bias(c, h, j)`: what is added to the score of token j of block c for head h (0, a value or -inf).
  template <class Grid, class Bias>
  void forward_folded(const Eigen::Ref<const RowMatrix<Scalar>>& x, const Grid& grid, const RowMatrix<Scalar>& q,
                      const Bias& bias, Eigen::Ref<RowMatrix<Scalar>> out) const {
    const Index chunks = grid.blocks(), dk = head_dim();
    const int threads = options_.num_threads;
    const Scalar scale = static_cast<Scalar>(1.0 / std::sqrt(static_cast<double>(dk)));
    const typename RowMatrix<Scalar>::ConstRowsBlockXpr wk = kv_proj_.weight().topRows(d_), wv = kv_proj_.weight().bottomRows(d_);

    // qk[c, h·d:(h+1)·d] = q[c, h·dk:(h+1)·dk] W_k,h / sqrt(dk)   (the key bias only shifts a softmax row)
    RowMatrix<Scalar> qk(chunks, heads_ * d_);
    for (Index h = 0; h < heads_; ++h) {
      kernels::matmul_rows<Scalar>(q.middleCols(h * dk, dk), wk.middleRows(h * dk, dk) * scale, nullptr,
                                   qk.middleCols(h * d_, d_), threads);
    }
    RowMatrix<Scalar> pooled(chunks, heads_ * d_), mass(chunks, heads_);
    kernels::fine_attention_folded<Scalar>(x, grid, qk, heads_, bias, pooled, mass, threads);

    // o[c, h·dk:(h+1)·dk] = pooled[c, h] W_v,hᵀ + mass[c, h] b_v,h
    RowMatrix<Scalar> o(chunks, d_), chunk_out(chunks, d_);
    for (Index h = 0; h < heads_; ++h) {
      kernels::matmul_rows<Scalar>(pooled.middleCols(h * d_, d_), wv.middleRows(h * dk, dk).transpose(), nullptr,
                                   o.middleCols(h * dk, dk), threads);
      o.middleCols(h * dk, dk).noalias() += mass.col(h) * kv_proj_.bias().segment(d_ + h * dk, dk).transpose();
    }
    out_proj_.forward_rows(o, chunk_out, threads);
    kernels::broadcast_chunks<Scalar>(chunk_out, grid, out, threads);
  }

  /// The seed's formula: k, v = kv_proj(tokens); per token, softmax(q_chunk kᵀ / sqrt(dk) + mask) v.
  void forward_general(const ConstTensor3Ref<Scalar>& x, const kernels::ChunkGrid& grid, const RowMatrix<Scalar>& q,
                       const detail::MaskPlan<Scalar>& plan, Eigen::Map<RowMatrix<Scalar>>& out) const {
    const Index chunks = grid.chunks(), k = grid.chunk, dk = head_dim();
    const int threads = options_.num_threads;
    // Tokens on the padded grid [chunks·k, d]; padded rows are zeros (their keys are masked).
    RowMatrix<Scalar> padded;
    const bool divisible = grid.length % k == 0;
    if (!divisible) {
      padded = RowMatrix<Scalar>::Zero(chunks * k, d_);
      for (Index c = 0; c < chunks; ++c) padded.middleRows(c * k, grid.count(c)) = x.rows().middleRows(grid.row(c), grid.count(c));
    }
    const Eigen::Ref<const RowMatrix<Scalar>> tokens =
        divisible ? Eigen::Ref<const RowMatrix<Scalar>>(x.rows()) : Eigen::Ref<const RowMatrix<Scalar>>(padded);

    RowMatrix<Scalar> kv(chunks * k, 2 * d_), attn(chunks * k, d_);
    kv_proj_.forward_rows(tokens, kv, threads);
    // Every token of chunk c reads the chunk's one query: a row stride of 0.
    kernels::HeadsView<const Scalar> qv = kernels::heads_view<const Scalar>(q.data(), chunks, k, d_, 0, heads_, dk);
    qv.row_stride = 0;
    qv.batch_stride = d_;
    const kernels::HeadsView<const Scalar> kview = kernels::heads_view<const Scalar>(kv.data(), chunks, k, 2 * d_, 0, heads_, dk);
    const kernels::HeadsView<const Scalar> vview = kernels::heads_view<const Scalar>(kv.data(), chunks, k, 2 * d_, d_, heads_, dk);
    const kernels::HeadsView<Scalar> oview = kernels::heads_view<Scalar>(attn.data(), chunks, k, d_, 0, heads_, dk);
    kernels::SdpaOptions sdpa;
    sdpa.num_threads = threads;
    kernels::sdpa_streaming<Scalar>(qv, kview, vview, oview, plan, sdpa);

    RowMatrix<Scalar> projected(chunks * k, d_);
    out_proj_.forward_rows(attn, projected, threads);
    for (Index c = 0; c < chunks; ++c) out.middleRows(grid.row(c), grid.count(c)) = projected.middleRows(c * k, grid.count(c));
  }

  Index d_;
  Index heads_;
  Options options_;
  Linear<Scalar> q_proj_;
  Linear<Scalar> kv_proj_;
  Linear<Scalar> out_proj_;
};

/// Masks of one C2FAttention call (both optional).
template <class Scalar>
struct C2FMasks {
  AttnMask<Scalar> coarse;  ///< over chunks: [m, m] or [n, m, m], n = 1, B or B·H
  AttnMask<Scalar> fine;    ///< inside chunks, over the padded grid: [k, k] or [n, k, k], n = 1, B·m or B·m·H
};

/// Seed 004's C2FAttention: mean-pooled chunks → CoarseAttention → FineAttention.
/// State dict: `coarse_attn.qkv_proj.*`, `coarse_attn.out_proj.*`, `fine_attn.q_proj.*`,
/// `fine_attn.kv_proj.*`, `fine_attn.out_proj.*` — exactly the PyTorch module's names.
template <class Scalar>
class C2FAttention : public detail::Module<C2FAttention<Scalar>> {
 public:
  struct Options {
    int num_threads = 0;  ///< 0 = all hardware threads; results are bitwise the same for any count
    FinePath fine_path = FinePath::Auto;
    std::uint64_t seed = 0;  ///< init as the seed advises (see reset_parameters)
  };

  C2FAttention(Index d_model, Index n_heads, Index chunk_size = 32) : C2FAttention(d_model, n_heads, chunk_size, Options{}) {}
  C2FAttention(Index d_model, Index n_heads, Index chunk_size, Options options)
      : chunk_(chunk_size),
        num_threads_(options.num_threads),
        coarse_(d_model, n_heads, {options.num_threads, options.seed}),
        fine_(d_model, n_heads, {options.num_threads, options.fine_path, options.seed + 1}) {
    if (chunk_size < 1) detail::fail("C2FAttention: chunk_size must be >= 1, got ", chunk_size);
  }

  Index d_model() const { return fine_.d_model(); }
  Index n_heads() const { return fine_.n_heads(); }
  Index chunk_size() const { return chunk_; }
  const CoarseAttention<Scalar>& coarse_attn() const { return coarse_; }
  const FineAttention<Scalar>& fine_attn() const { return fine_; }
  void set_num_threads(int n) {
    num_threads_ = n;
    coarse_.set_num_threads(n);
    fine_.set_num_threads(n);
  }
  void set_fine_path(FinePath path) { fine_.set_path(path); }

  /// The seed's advice: Xavier-uniform coarse qkv_proj.weight, Kaiming-normal (fan_out) fine
  /// q_proj.weight, nn.Linear's default for the other weights, zero biases; deterministic in `seed`.
  void reset_parameters(std::uint64_t seed) {
    coarse_.reset_parameters(seed);
    fine_.reset_parameters(seed + 1);
  }

  void load(detail::StrictLoader& loader, const std::string& name) {
    coarse_.load(loader, name + "coarse_attn.");
    fine_.load(loader, name + "fine_attn.");
  }
  void save(StateDict& sd, const std::string& name) const {
    coarse_.save(sd, name + "coarse_attn.");
    fine_.save(sd, name + "fine_attn.");
  }

  /// x [B, L, d] → [B, L, d]; any L ≥ 0 (see the file comment for partial chunks).
  Tensor3<Scalar> forward(ConstTensor3Ref<Scalar> x, const C2FMasks<Scalar>& masks = {}) const {
    detail::check_features(x, d_model(), "C2FAttention", "x", "d_model");
    const Tensor3<Scalar> summaries = coarse_input(x);
    const Tensor3<Scalar> context = coarse_.forward(summaries, masks.coarse);
    return fine_.forward_chunked(x, chunk_, context, masks.fine);
  }

  /// The coarse stage's input: the mean of the real tokens of every chunk, [B, ceil(L / chunk), d].
  Tensor3<Scalar> coarse_input(ConstTensor3Ref<Scalar> x) const {
    const kernels::ChunkGrid grid{x.batch(), x.seq(), chunk_};
    Tensor3<Scalar> summaries(x.batch(), grid.chunks_per_batch(), d_model());
    Eigen::Map<RowMatrix<Scalar>> rows(summaries.data(), grid.chunks(), d_model());
    kernels::chunk_mean<Scalar>(x.rows(), grid, rows, num_threads_);
    return summaries;
  }

 private:
  Index chunk_;
  int num_threads_;
  CoarseAttention<Scalar> coarse_;
  FineAttention<Scalar> fine_;
};

}  // namespace c2f
