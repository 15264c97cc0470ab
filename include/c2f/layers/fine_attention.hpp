// c2f layers — FineAttention, the fine stage of the coarse-to-fine attention article's module: attention
// inside each chunk, guided by the chunk's coarse context.
//
// Semantics (eval mode), for d = embed_dim, H = num_heads, d_k = d / H: tokens [B, m, k, d] and coarse
// context [B, m, d] → [B, m, k, d]. The query of every token of chunk i is q_proj(coarse_context_i) (the
// same for the whole chunk, as in the article); k, v = chunks of kv_proj(tokens) (Linear d → 2d);
// attention only inside the chunk; out_proj. Optional mask [k, k] or [B·m, k, k] (PyTorch's [B, m, k, k]
// flattened; broadcast over heads; a [B·m·H, k, k] mask gives each head its own). On a sequence
// (forward_chunked) the last chunk may be partial: its padded keys are masked and its padded query rows
// do not exist in the output.
//
// The article's code has two bugs, fixed here: FineAttention no longer overwrites the chunk length k
// with the key tensor, and the masks broadcast over heads. The article fills masked scores with -1e9;
// c2f masks with -inf, which gives the same result except for a row with no visible key: c2f outputs
// zero attention there (the article's code would average every value uniformly).
//
// Fast path (FinePath::Folded, the default where the mask allows it): the fine query is the same for
// every token of a chunk, so without a mask (or with one whose rows are equal within each chunk) every
// token of a chunk has the same output, and the key/value projections fold into the query and into the
// pooled tokens: no [L, 2d] key/value tensor is ever formed (c2f/kernels/fine_folded.hpp derives it and
// runs it). FinePath::General computes the article's formula literally (kv_proj of every token, one
// attention row per token) and is the path for per-token masks.
#pragma once

#include "c2f/detail/random.hpp"
#include "c2f/detail/scratch.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/fine_folded.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/kernels/sdpa_backward.hpp"
#include "c2f/kernels/weight_cache.hpp"
#include "c2f/layers/linear.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/mask_view.hpp"
#include "c2f/options.hpp"

#include <algorithm>
#include <array>
#include <string>
#include <vector>

namespace c2f {

/// How FineAttention computes the attention inside the chunks.
enum class FinePath {
  Auto,     ///< Folded when the mask allows it, else General
  Folded,   ///< one attention row per chunk with kv_proj folded in; throws if mask rows differ in a chunk
  General,  ///< the article's formula: kv_proj of every token, one masked attention row per token
};

/// The coarse-to-fine module's FineAttention: attention inside each chunk, guided by the chunk's coarse
/// context. Masks: attn_mask [k, k] or [n, k, k] (n = 1, B·m or B·m·H) over the padded chunk grid.
template <class Scalar>
class FineAttention : public detail::Module<FineAttention<Scalar>> {
 public:
  /// seed: kaiming_normal_(q_proj.weight, mode='fan_out'), nn.Linear's default for the other weights,
  /// zero biases. The kernel options serve FinePath::General (and, in C2FAttention, the coarse stage).
  class Options : public RuntimeOptions<Options>, public AttnKernelOptions<Options>, public ComputeOption<Options> {
    C2F_ARG(FinePath, fine_path) = FinePath::Auto;
  };

  /// attn_mask [k, k] or [n, k, k] (n = 1, B·m or B·m·H) over the padded chunk grid.
  C2F_LAYER_TRAITS("FineAttention", MaskFields::AttnMask);

  FineAttention(Index embed_dim, Index num_heads, Options options = Options())
      : shape_(detail::checked_heads<Scalar>("FineAttention", embed_dim, num_heads, 1, 4)),
        d_(embed_dim),
        heads_(num_heads),
        options_(options),
        q_proj_(embed_dim, embed_dim, linear_options(options), detail::NoInit{}),
        kv_proj_(embed_dim, 2 * embed_dim, linear_options(options), detail::NoInit{}),
        out_proj_(embed_dim, embed_dim, linear_options(options), detail::NoInit{}) {
    detail::check_scalar<Scalar>();
    reset_parameters(options.seed());
  }

  Index embed_dim() const { return d_; }
  Index num_heads() const { return heads_; }
  Index head_dim() const { return shape_.head_dim(); }
  void set_num_threads(int n) { this->set_num_threads_of(options_, n); }
  void set_fine_path(FinePath path) { options_.fine_path(path); }
  const Options& options() const { return options_; }

  /// The module's init: nn.init.kaiming_normal_(q_proj.weight, mode='fan_out'); kv_proj and out_proj
  /// weights nn.Linear's default (U(±1/sqrt(d))); zero biases. Deterministic in `seed`.
  void reset_parameters(std::uint64_t seed) {
    detail::Rng rng(seed);
    detail::kaiming_normal_fan_out(q_proj_.weight(), rng);
    detail::linear_default_uniform(kv_proj_.weight(), rng);
    detail::linear_default_uniform(out_proj_.weight(), rng);
    q_proj_.bias().setZero();
    kv_proj_.bias().setZero();
    out_proj_.bias().setZero();
  }

  /// State dict: `q_proj.*`, `kv_proj.*`, `out_proj.*`.
  template <class Self, class Fn>
  static void children(Self& self, Fn&& fn) {
    fn("q_proj.", self.q_proj_);
    fn("kv_proj.", self.kv_proj_);
    fn("out_proj.", self.out_proj_);
  }

  /// The module's interface: x [B, m, k, d], coarse_context [B, m, d] → [B, m, k, d].
  Output<Scalar, 4> forward(ConstTensor4Ref<Scalar> x, ConstTensor3Ref<Scalar> coarse_context,
                            const Masks<Scalar>& masks = {}) const {
    return detail::with_layer_name(type_name, [&] {
      const Index b = x.dimension(0), m = x.dimension(1), k = x.dimension(2), f = x.dimension(3);
      if (coarse_context.batch() != b || coarse_context.seq() != m) {
        detail::fail("FineAttention: coarse_context must be [batch, chunks, d] = ", detail::shape_string({b, m, d_}),
                     " for x ", detail::shape_string({b, m, k, f}), ", got ",
                     detail::shape_string({coarse_context.batch(), coarse_context.seq(), coarse_context.features()}));
      }
      if (k == 0 && m > 0) detail::fail("FineAttention: chunks of length 0 in x ", detail::shape_string({b, m, k, f}));
      Output<Scalar, 4> out({b, m, k, d_});
      forward_chunked_into(ConstTensor3Ref<Scalar>(x.data(), {b, m * k, f}), std::max<Index>(k, 1), coarse_context,
                           Eigen::Map<RowMatrix<Scalar>>(out.data(), b * m * k, d_), masks);
      return out;
    });
  }

  /// Tokens x [B, L, d] cut into chunks of `chunk` (the last one may be partial), coarse_context
  /// [B, ceil(L / chunk), d], attn_mask over the padded grid ([chunk, chunk] or [n, chunk, chunk],
  /// n = 1, B·m or B·m·H; entries at padded positions are ignored) → [B, L, d].
  Output<Scalar> forward_chunked(ConstTensor3Ref<Scalar> x, Index chunk, ConstTensor3Ref<Scalar> coarse_context,
                                 const Masks<Scalar>& masks = {}) const {
    return detail::with_layer_name(type_name, [&] {
      detail::check_features(x, d_, "FineAttention", "tokens", "embed_dim");
      return detail::fresh_output<Scalar>(
          type_name, {x.batch(), x.seq(), d_}, options_.num_threads(),
          [&](RowMatrixRef<Scalar> out) { forward_chunked_into(x, chunk, coarse_context, out, masks); });
    });
  }

  /// forward_chunked() into caller memory: out [B·L, embed_dim] (e.g. a buffer reused across calls).
  void forward_chunked_into(ConstTensor3Ref<Scalar> x, Index chunk, ConstTensor3Ref<Scalar> coarse_context,
                            RowMatrixRef<Scalar> out, const Masks<Scalar>& masks = {}) const {
    detail::with_layer_name(type_name, [&] { run_chunked(x, chunk, x.seq(), coarse_context, out, masks); });
  }

  /// forward_chunked_into() on a shard of a sequence of `sequence_length` tokens (c2f/dist): x [B, n, d]
  /// holds whole chunks of that sequence (the last one may be its partial last chunk), coarse_context
  /// and the mask the shard's chunks. Every output row has the bits forward_chunked_into() gives it on
  /// the whole sequence.
  void forward_shard_into(ConstTensor3Ref<Scalar> x, Index chunk, Index sequence_length,
                          ConstTensor3Ref<Scalar> coarse_context, RowMatrixRef<Scalar> out,
                          const Masks<Scalar>& masks = {}) const {
    detail::with_layer_name(type_name, [&] { run_chunked(x, chunk, sequence_length, coarse_context, out, masks); });
  }

  /// The folded fine stage, without a mask, on any block grid of c2f/kernels/chunk.hpp (a ChunkGrid, a
  /// kernels::BlockGrid2D, ...): tokens x [rows, embed_dim], coarse_context [blocks, embed_dim] (one row
  /// per block) → out [rows, embed_dim], where every real token of block c gets block c's output row. x is
  /// read in place, block by block; rows of `out` that belong to no block are left as they are.
  /// `fresh_out`: out is fresh memory whose pages the system maps on their first write
  /// (detail::FreshPages::OnFirstWrite, as C2FAttention2D::forward allocates it): it is then written with
  /// ordinary stores instead of streaming ones (KernelOptions::fresh_output). The same bits either way.
  template <class Grid>
  void forward_blocks(const ConstRowMatrixRef<Scalar>& x, const Grid& grid,
                      const ConstRowMatrixRef<Scalar>& coarse_context, RowMatrixRef<Scalar> out,
                      bool fresh_out = false) const {
    detail::with_layer_name(type_name, [&] { run_blocks(x, grid, coarse_context, out, nullptr, fresh_out); });
  }

  /// Bytes of temporary memory the folded fine stage holds at its peak for `blocks` block rows whose
  /// longest run of tokens is `longest_run` (a chunk; a 2-D block's width): q [blocks, d], q_proj's
  /// product and kernels::fine_folded_workspace_bytes.
  std::size_t folded_workspace_bytes(Index blocks, Index longest_run) const {
    return sizeof(Scalar) * static_cast<std::size_t>(blocks * d_) + q_proj_.rows_workspace_bytes(blocks, true) +
           kernels::fine_folded_workspace_bytes<Scalar>(blocks, longest_run, d_, heads_,
                                                        detail::kernel_options(options_));
  }
  /// Bytes of temporary memory one forward_chunked_into() holds at its peak, besides the output (and
  /// Eigen's GEMM packing buffers, which Eigen keeps on the stack below 128 KiB). On the folded path —
  /// FinePath::Folded, or Auto without a mask that differs inside a chunk — q, the folded queries, the
  /// pooled tokens and the chunk outputs: O((L / chunk) · H · d). On the general path (FinePath::General,
  /// or Auto with such a mask: ask with `general`) the article's [L, 2d] keys and values too.
  std::size_t workspace_bytes(Index batch, Index seq, Index chunk, bool general = false) const {
    chunk = std::min(std::max<Index>(chunk, 1), std::max<Index>(seq, 1));  // as the forward pass: k = min(chunk, L)
    const kernels::ChunkGrid grid{batch, seq, chunk};
    const std::size_t s = sizeof(Scalar), c = static_cast<std::size_t>(grid.chunks());
    const std::size_t d = static_cast<std::size_t>(d_), h = static_cast<std::size_t>(heads_), dk = d / h;
    const std::size_t lengths = 2 * sizeof(Index) * c;  // the real keys of every chunk, and their mask
    if (general || options_.fine_path() == FinePath::General) {
      const std::size_t k = static_cast<std::size_t>(chunk), padded = grid.length % chunk == 0 ? 0 : c * k * d;
      const std::size_t workers =
          static_cast<std::size_t>(detail::resolve_threads(options_.num_threads(), grid.chunks() * heads_));
      // + the largest packed projection weight (micro-kernel builds; one projection runs at a time).
      const std::size_t packed = std::max({q_proj_.rows_workspace_bytes(grid.chunks(), true),
                                           kv_proj_.rows_workspace_bytes(grid.chunks() * chunk, true),
                                           out_proj_.rows_workspace_bytes(grid.chunks() * chunk, true)});
      // + the attention kernel's per-worker scratch and what it shares (keys and values packed per chunk
      // and head, where it packs them).
      const kernels::KernelOptions ko = detail::kernel_options(options_);
      return lengths + packed + s * (c * d + padded + 4 * c * k * d) +
             workers * kernels::sdpa_streaming_workspace_bytes<Scalar>(ko, dk, dk, chunk, chunk) +
             kernels::sdpa_streaming_shared_bytes<Scalar>(ko, grid.chunks() * heads_, dk, dk, chunk, chunk);
    }
    return lengths + folded_workspace_bytes(grid.chunks(), chunk);
  }

  /// Training. What forward_train() keeps for backward(): the tokens, the coarse context and its query
  /// projection, the fine mask and the chunk grid; on the folded path the per-chunk FineFoldedState, on the
  /// general path the article's keys and values [L, 2d], the heads' output and each attention row's
  /// log-sum-exp — O(L·d) values, no [L, L] term.
  struct Saved : detail::SavedBase {
    detail::ScratchRowMatrix<Scalar> x, context, q;  ///< tokens [B·L, d], coarse context [chunks, d], q_proj(context)
    AttnMask<Scalar> mask;                    ///< the fine mask over the grid (cropped to k when the chunk exceeds L)
    kernels::ChunkGrid grid;                  ///< the chunks (forward_train's form)
    bool general = false;                     ///< which path ran
    kernels::FineFoldedState<Scalar> folded;  ///< the folded path's (kernels::fine_folded_forward)
    detail::ScratchRowMatrix<Scalar> kv, attn,
        lse;  ///< the general path's: [chunks·k, 2d], [chunks·k, d], [chunks·H, k]
  };

  /// forward_chunked() in train mode (FineAttention has no dropout: its output has forward_chunked()'s
  /// bits) and what backward() needs. `step` is the contract's (it keys no mask here).
  TrainOutput<Scalar, Saved> forward_train(ConstTensor3Ref<Scalar> x, Index chunk,
                                           ConstTensor3Ref<Scalar> coarse_context, const Masks<Scalar>& masks = {},
                                           std::uint64_t step = 0) const {
    return detail::with_layer_name(type_name, [&] {
      detail::check_features(x, d_, "FineAttention", "tokens", "embed_dim");
      detail::check_train_compute("FineAttention", options_.compute());
      return detail::train_output<Scalar, Saved>(*this, {x.batch(), x.seq(), d_},
                                                 [&](RowMatrixRef<Scalar> out, Saved& saved) {
                                                   compute_train(x, chunk, coarse_context, out, masks, step, saved);
                                                 });
    });
  }
  /// The gradients of a loss given dy = dL/dy of forward_train()'s output: g.input = dL/dx [B, L, d],
  /// g.context = dL/dcoarse_context [B, m, d], g.params under state_dict()'s names. Both paths give the
  /// same gradients (up to rounding); a saved state of another object, or older than a change of the
  /// parameters, is refused (docs/training.md).
  Grads<Scalar> backward(const Saved& saved, ConstTensor3Ref<Scalar> dy) const {
    return detail::with_layer_name(type_name, [&] { return detail::run_backward<Scalar>(*this, saved, dy); });
  }

 private:
  friend struct detail::TrainAccess;
  void compute_train(const ConstTensor3Ref<Scalar>& x, Index chunk, const ConstTensor3Ref<Scalar>& coarse_context,
                     RowMatrixRef<Scalar> out, const Masks<Scalar>& masks, std::uint64_t, Saved& saved) const {
    run_chunked(x, chunk, x.seq(), coarse_context, out, masks, &saved);
  }
  /// The folded path on a block grid (C2FAttention2D's) in train mode: forward_blocks() and its state.
  template <class Grid>
  void compute_train(const ConstRowMatrixRef<Scalar>& x, const Grid& grid,
                     const ConstRowMatrixRef<Scalar>& coarse_context, RowMatrixRef<Scalar> out, Saved& saved) const {
    run_blocks(x, grid, coarse_context, out, &saved);
  }
  void compute_backward(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
                        FineAttention& grad) const {
    const kernels::ChunkGrid& grid = saved.grid;
    g.input = Tensor3<Scalar>(grid.batch, grid.length, d_);
    g.context = Tensor3<Scalar>(grid.batch, grid.chunks_per_batch(), d_);
    Eigen::Map<RowMatrix<Scalar>> dx(g.input.data(), grid.tokens(), d_), dcontext(g.context.data(), grid.chunks(), d_);
    if (grid.chunks() == 0) return;  // no tokens: the parameters' gradients stay zero
    if (saved.general) {
      backward_general(saved, dy, dx, dcontext, grad);
    } else {
      const KeyPaddingMask<Scalar> padding = padding_of(grid);
      const MaskView<Scalar> plan = chunk_plan(saved.mask, padding, grid);
      backward_blocks(
          saved, grid, [&](Index c, Index h, Index j) { return plan.bias(c, h, 0, j); }, dy, dx, dcontext, grad);
    }
  }
  /// The folded path's backward on a block grid without a mask (forward_blocks()'s, C2FAttention2D's).
  template <class Grid>
  void compute_backward(const Saved& saved, const Grid& grid, const ConstRowMatrixRef<Scalar>& dy,
                        RowMatrixRef<Scalar> dx, RowMatrixRef<Scalar> dcontext, FineAttention& grad) const {
    backward_blocks(
        saved, grid, [](Index, Index, Index) { return Scalar(0); }, dy, dx, dcontext, grad);
  }
  /// The folded path's backward on a block grid (bias(c, h, j) as in the forward): dx [rows, d] (every
  /// real token's row overwritten), dcontext [blocks, d] (overwritten) and the parameters' gradients into
  /// `grad`'s.
  template <class Grid, class Bias>
  void backward_blocks(const Saved& saved, const Grid& grid, const Bias& bias, const ConstRowMatrixRef<Scalar>& dy,
                       RowMatrixRef<Scalar> dx, RowMatrixRef<Scalar> dcontext, FineAttention& grad) const {
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    detail::ScratchRowMatrix<Scalar> dq(grid.blocks(), d_);
    kernels::fine_folded_backward<Scalar>(
        saved.x, grid, saved.q, heads_, folded_weights(), saved.folded, bias, dy, dx, dq,
        kernels::FineFoldedGrads<Scalar>{grad.kv_proj_.weight(), grad.kv_proj_.bias(), grad.out_proj_.weight(),
                                         grad.out_proj_.bias().data()},
        threads);
    kernels::linear_backward<Scalar>(saved.context, q_proj_.weight(), dq, dcontext, grad.q_proj_.weight(),
                                     grad.q_proj_.bias().data(), threads);
  }
  /// The general path's backward: out_proj, the attention (sdpa_backward; every token of a chunk reads its
  /// one query, so a chunk's dq sums its rows), kv_proj, q_proj.
  void backward_general(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, RowMatrixRef<Scalar> dx,
                        RowMatrixRef<Scalar> dcontext, FineAttention& grad) const {
    const kernels::ChunkGrid& grid = saved.grid;
    const Index chunks = grid.chunks(), k = grid.chunk, dk = head_dim();
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    const RowMatrix<Scalar> tokens = padded_tokens(saved.x, grid);  // the padded grid's rows (padded rows zero)
    RowMatrix<Scalar> dprojected = RowMatrix<Scalar>::Zero(chunks * k, d_), dattn(chunks * k, d_);
    for (Index c = 0; c < chunks; ++c)
      dprojected.middleRows(c * k, grid.count(c)) = dy.middleRows(grid.row(c), grid.count(c));
    kernels::linear_backward<Scalar>(saved.attn, out_proj_.weight(), dprojected, dattn, grad.out_proj_.weight(),
                                     grad.out_proj_.bias().data(), threads);
    dprojected.resize(0, 0);
    RowMatrix<Scalar> dq_rows(chunks * k, d_), dkv(chunks * k, 2 * d_);
    {
      const KeyPaddingMask<Scalar> padding = padding_of(grid);
      const MaskView<Scalar> plan = chunk_plan(saved.mask, padding, grid);
      const kernels::HeadsView<const Scalar> kview =
          kernels::heads_view<const Scalar>(saved.kv.data(), chunks, k, 2 * d_, 0, heads_, dk);
      const kernels::HeadsView<const Scalar> vview =
          kernels::heads_view<const Scalar>(saved.kv.data(), chunks, k, 2 * d_, d_, heads_, dk);
      kernels::sdpa_backward<Scalar>(chunk_queries(saved.q, chunks, k), kview, vview,
                                     kernels::heads_view<const Scalar>(saved.attn.data(), chunks, k, d_, 0, heads_, dk),
                                     saved.lse,
                                     kernels::heads_view<const Scalar>(dattn.data(), chunks, k, d_, 0, heads_, dk),
                                     kernels::heads_view<Scalar>(dq_rows.data(), chunks, k, d_, 0, heads_, dk),
                                     kernels::heads_view<Scalar>(dkv.data(), chunks, k, 2 * d_, 0, heads_, dk),
                                     kernels::heads_view<Scalar>(dkv.data(), chunks, k, 2 * d_, d_, heads_, dk), plan,
                                     kernels::AttnDropout{}, kernels::default_scale<Scalar>(dk), threads);
    }
    dattn.resize(0, 0);
    RowMatrix<Scalar> dq(chunks, d_), dtokens(chunks * k, d_);
    for (Index c = 0; c < chunks; ++c) dq.row(c) = dq_rows.middleRows(c * k, k).colwise().sum();
    kernels::linear_backward<Scalar>(tokens, kv_proj_.weight(), dkv, dtokens, grad.kv_proj_.weight(),
                                     grad.kv_proj_.bias().data(), threads);
    for (Index c = 0; c < chunks; ++c)
      dx.middleRows(grid.row(c), grid.count(c)) = dtokens.middleRows(c * k, grid.count(c));
    kernels::linear_backward<Scalar>(saved.context, q_proj_.weight(), dq, dcontext, grad.q_proj_.weight(),
                                     grad.q_proj_.bias().data(), threads);
  }

  /// Chunk c sees only its real keys: a key-length mask per chunk (on top of the caller's mask).
  static KeyPaddingMask<Scalar> padding_of(const kernels::ChunkGrid& grid) {
    std::vector<Index> real_keys(static_cast<std::size_t>(grid.chunks()));
    for (Index c = 0; c < grid.chunks(); ++c) real_keys[static_cast<std::size_t>(c)] = grid.count(c);
    return KeyPaddingMask<Scalar>::lengths(real_keys);
  }
  /// The plan of the chunks' attention problems: chunks × heads, k queries over k keys.
  MaskView<Scalar> chunk_plan(const AttnMask<Scalar>& mask, const KeyPaddingMask<Scalar>& padding,
                              const kernels::ChunkGrid& grid) const {
    return MaskView<Scalar>(mask, padding, grid.chunks(), heads_, grid.chunk, grid.chunk);
  }
  /// The queries of the general path: every token of chunk c reads the chunk's q row (a row stride of 0).
  kernels::HeadsView<const Scalar> chunk_queries(const ConstRowMatrixRef<Scalar>& q, Index chunks, Index k) const {
    kernels::HeadsView<const Scalar> qv =
        kernels::heads_view<const Scalar>(q.data(), chunks, k, d_, 0, heads_, head_dim());
    qv.row_stride = 0;
    qv.batch_stride = d_;
    return qv;
  }
  /// The tokens on the padded grid [chunks·k, d]: x itself when L is divisible, else a copy whose padded
  /// rows are zeros (their keys are masked).
  static RowMatrix<Scalar> padded_tokens(const ConstRowMatrixRef<Scalar>& x, const kernels::ChunkGrid& grid) {
    const Index k = grid.chunk;
    if (grid.length % k == 0) return x;
    RowMatrix<Scalar> padded = RowMatrix<Scalar>::Zero(grid.chunks() * k, x.cols());
    for (Index c = 0; c < grid.chunks(); ++c)
      padded.middleRows(c * k, grid.count(c)) = x.middleRows(grid.row(c), grid.count(c));
    return padded;
  }

  void run_chunked(const ConstTensor3Ref<Scalar>& x, Index chunk, Index sequence_length,
                   const ConstTensor3Ref<Scalar>& coarse_context, RowMatrixRef<Scalar> out, const Masks<Scalar>& masks,
                   Saved* saved = nullptr) const {
    detail::check_mask_fields(masks, "FineAttention", mask_fields);
    if (chunk < 1) detail::fail("FineAttention: chunk size must be >= 1, got ", chunk);
    detail::check_features(x, d_, "FineAttention", "tokens", "embed_dim");
    // A chunk longer than the sequence is the sequence: the grid, and the general path's padded grid,
    // use k = min(chunk, L) (the mask, over the user's chunk, is checked against it and cropped). L is
    // the whole sequence's length, also for a shard of it.
    const Index k = std::min(chunk, std::max<Index>(sequence_length, 1));
    const kernels::ChunkGrid grid{x.batch(), x.seq(), k};
    const Index m = grid.chunks_per_batch(), chunks = grid.chunks();
    if (coarse_context.batch() != x.batch() || coarse_context.seq() != m || coarse_context.features() != d_) {
      detail::fail("FineAttention: coarse_context must be [batch, ceil(seq / chunk), embed_dim] = ",
                   detail::shape_string({x.batch(), m, d_}), " for tokens ",
                   detail::shape_string({x.batch(), x.seq(), x.features()}), " and chunk ", chunk, ", got ",
                   detail::shape_string({coarse_context.batch(), coarse_context.seq(), coarse_context.features()}));
    }
    detail::check_out("FineAttention", out, {x.batch(), x.seq(), d_});
    const AttnMask<Scalar> mask = fine_mask(masks.attn_mask(), chunks, chunk, k);
    if (saved != nullptr) {
      saved->x = x.rows();
      saved->context = coarse_context.rows();
      saved->mask = mask;
      saved->grid = grid;
    }
    if (chunks == 0) return;

    // Chunk c sees only its real keys: a key-length mask per chunk on top of the caller's mask.
    const KeyPaddingMask<Scalar> padding = padding_of(grid);
    const MaskView<Scalar> plan = chunk_plan(mask, padding, grid);

    detail::ScratchRowMatrix<Scalar> q(chunks, d_);
    q_proj_.forward_rows_independent(coarse_context.rows(), q);

    const bool rows_equal = mask.is_none() || mask_rows_equal_in_chunks(plan, grid);
    if (options_.fine_path() == FinePath::Folded && !rows_equal) {
      detail::fail("FineAttention: FinePath::Folded needs a mask whose rows are equal within each chunk");
    }
    const bool general = options_.fine_path() == FinePath::General || !rows_equal;
    if (general) {
      forward_general(x, grid, q, plan, out, saved);
    } else {
      forward_folded(
          x.rows(), grid, q, [&](Index c, Index h, Index j) { return plan.bias(c, h, 0, j); }, out,
          saved != nullptr ? &saved->folded : nullptr);
    }
    if (saved != nullptr) {
      saved->general = general;
      saved->q = std::move(q);
    }
  }

  /// The fine mask, checked against the chunk grid (B·m chunks of `chunk` positions): [chunk, chunk] or
  /// [n, chunk, chunk] with n = 1, B·m or B·m·H; cropped to [n, k, k] when the chunk is longer than the
  /// sequence (k = L).
  AttnMask<Scalar> fine_mask(const AttnMask<Scalar>& mask, Index chunks, Index chunk, Index k) const {
    const MaskKind kind = mask.kind();
    if (kind == MaskKind::None || kind == MaskKind::Causal) return mask;
    const std::array<Index, 3>& d = mask.dims();
    const bool n_ok =
        d[0] == 1 || d[0] == chunks || d[0] == detail::checked_mul(chunks, heads_, "FineAttention: B·m·H");
    if (kind == MaskKind::RelativePosition || !n_ok || d[1] != chunk || d[2] != chunk) {
      detail::fail(
          "FineAttention: the fine attention mask must be [chunk, chunk] = ", detail::shape_string({chunk, chunk}),
          " or [n, chunk, chunk] with n = 1, B·m (", chunks, " chunks) or B·m·H (", chunks * heads_, "), got ",
          d[0] == 1 ? detail::shape_string({d[1], d[2]}) : detail::shape_string({d[0], d[1], d[2]}));
    }
    if (k == chunk) return mask;
    if (kind == MaskKind::Additive) {
      Tensor3<Scalar> cropped(d[0], k, k);
      for (Index n = 0; n < d[0]; ++n) {
        for (Index i = 0; i < k; ++i) {
          for (Index j = 0; j < k; ++j)
            cropped(n, i, j) = mask.additive_values()[static_cast<std::size_t>((n * chunk + i) * chunk + j)];
        }
      }
      return AttnMask<Scalar>::additive(cropped);
    }
    BoolTensor3 keep(d[0], k, k);
    for (Index n = 0; n < d[0]; ++n) {
      for (Index i = 0; i < k; ++i) {
        for (Index j = 0; j < k; ++j)
          keep(n, i, j) = mask.keep_flags()[static_cast<std::size_t>((n * chunk + i) * chunk + j)] != 0;
      }
    }
    return AttnMask<Scalar>::keep(keep);
  }

  template <class Grid>
  void run_blocks(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, const ConstRowMatrixRef<Scalar>& coarse_context,
                  RowMatrixRef<Scalar> out, Saved* saved = nullptr, bool fresh_out = false) const {
    if (x.cols() != d_ || out.cols() != d_ || out.rows() != x.rows() || coarse_context.rows() != grid.blocks() ||
        coarse_context.cols() != d_) {
      detail::fail("FineAttention: forward_blocks needs x [rows, embed_dim=", d_,
                   "], coarse_context [blocks=", grid.blocks(), ", ", d_, "] and out of x's shape, got x ",
                   detail::shape_string({x.rows(), x.cols()}), ", coarse_context ",
                   detail::shape_string({coarse_context.rows(), coarse_context.cols()}), " and out ",
                   detail::shape_string({out.rows(), out.cols()}));
    }
    if (saved != nullptr) {
      saved->x = x;
      saved->context = coarse_context;
    }
    if (grid.blocks() == 0) return;
    detail::ScratchRowMatrix<Scalar> q(grid.blocks(), d_);
    q_proj_.forward_rows_independent(coarse_context, q);
    forward_folded(
        x, grid, q, [](Index, Index, Index) { return Scalar(0); }, out, saved != nullptr ? &saved->folded : nullptr,
        fresh_out);
    if (saved != nullptr) saved->q = std::move(q);
  }

  static typename Linear<Scalar>::Options linear_options(const Options& o) {
    detail::check_compute_option<Scalar>("FineAttention", o.compute());  // before a Linear refuses it in its name
    return detail::inner_options<typename Linear<Scalar>::Options>(o);
  }

  /// True when, in every chunk and head, each real query row of the mask equals row 0 on the real keys.
  bool mask_rows_equal_in_chunks(const MaskView<Scalar>& plan, const kernels::ChunkGrid& grid) const {
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

  /// The parameters of the folded chain (kernels::fine_folded_forward), with the packings the layer keeps.
  kernels::FineFoldedWeights<Scalar> folded_weights() const {
    return {kv_proj_.weight(), kv_proj_.bias(), packed_, kv_proj_.weight_stamp(), out_proj_.cached()};
  }

  /// The folded path (kernels::fine_folded_forward): `bias(c, h, j)` is added to the score of token j of
  /// block c for head h (0, a value or -inf); `keep`: nullptr, or where training keeps the chain's state;
  /// `fresh_out`: out is fresh memory left to its first writes (KernelOptions::fresh_output).
  template <class Grid, class Bias>
  void forward_folded(const ConstRowMatrixRef<Scalar>& x, const Grid& grid, const ConstRowMatrixRef<Scalar>& q,
                      const Bias& bias, RowMatrixRef<Scalar> out, kernels::FineFoldedState<Scalar>* keep = nullptr,
                      bool fresh_out = false) const {
    kernels::fine_folded_forward<Scalar>(x, grid, q, heads_, folded_weights(), bias, out,
                                         detail::kernel_options(options_).fresh_output(fresh_out), keep);
  }

  /// The article's formula: k, v = kv_proj(tokens); per token, softmax(q_chunk kᵀ / sqrt(dk) + mask) v.
  /// `saved`: nullptr, or training's state, which then holds k, v, the heads' output and the log-sum-exp
  /// (sdpa_train: the same output bits).
  void forward_general(const ConstTensor3Ref<Scalar>& x, const kernels::ChunkGrid& grid,
                       const ConstRowMatrixRef<Scalar>& q, const MaskView<Scalar>& plan, RowMatrixRef<Scalar> out,
                       Saved* saved = nullptr) const {
    const Index chunks = grid.chunks(), k = grid.chunk, dk = head_dim();
    // Tokens on the padded grid [chunks·k, d]; padded rows are zeros (their keys are masked).
    RowMatrix<Scalar> padded;
    const bool divisible = grid.length % k == 0;
    if (!divisible) padded = padded_tokens(x.rows(), grid);
    const ConstRowMatrixRef<Scalar> tokens =
        divisible ? ConstRowMatrixRef<Scalar>(x.rows()) : ConstRowMatrixRef<Scalar>(padded);

    // In reused scratch memory (detail/scratch.hpp); training keeps kv and attn (moved there at the end).
    detail::ScratchRowMatrix<Scalar> kv(chunks * k, 2 * d_), attn(chunks * k, d_);
    kv_proj_.forward_rows_independent(tokens, kv);
    // Every token of chunk c reads the chunk's one query: a row stride of 0.
    const kernels::HeadsView<const Scalar> qv = chunk_queries(q, chunks, k);
    const kernels::HeadsView<const Scalar> kview =
        kernels::heads_view<const Scalar>(kv.data(), chunks, k, 2 * d_, 0, heads_, dk);
    const kernels::HeadsView<const Scalar> vview =
        kernels::heads_view<const Scalar>(kv.data(), chunks, k, 2 * d_, d_, heads_, dk);
    const kernels::HeadsView<Scalar> oview = kernels::heads_view<Scalar>(attn.data(), chunks, k, d_, 0, heads_, dk);
    if (saved != nullptr) {
      saved->lse.resize(chunks * heads_, k);
      kernels::sdpa_train<Scalar>(qv, kview, vview, oview, saved->lse, plan, kernels::AttnDropout{},
                                  kernels::default_scale<Scalar>(dk), detail::kernel_options(options_));
    } else {
      kernels::sdpa_streaming<Scalar>(qv, kview, vview, oview, plan, kernels::default_scale<Scalar>(dk),
                                      detail::kernel_options(options_));
    }

    detail::ScratchRowMatrix<Scalar> projected(chunks * k, d_);
    out_proj_.forward_rows_independent(attn, projected);
    for (Index c = 0; c < chunks; ++c)
      out.middleRows(grid.row(c), grid.count(c)) = projected.middleRows(c * k, grid.count(c));
    if (saved != nullptr) {
      saved->kv = std::move(kv);
      saved->attn = std::move(attn);
    }
  }

  detail::HeadShape shape_;  // first: checked before the projections are built
  Index d_;
  Index heads_;
  Options options_;
  Linear<Scalar> q_proj_;
  Linear<Scalar> kv_proj_;
  Linear<Scalar> out_proj_;
  kernels::WeightCache<Scalar> packed_;  ///< folded path: W_k,h · scale and W_v,hᵀ per head, packed
};

}  // namespace c2f
