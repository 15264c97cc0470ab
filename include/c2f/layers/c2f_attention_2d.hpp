// c2f layers — two-dimensional coarse-to-fine attention for image tokens (the coarse-to-fine attention
// article's extension to vision Transformers).
//
// The article ends with how to carry coarse-to-fine attention to vision Transformers: cut the image into
// 2-D coarse blocks in both H and W, give the coarse stage a 2-D relative position bias as Swin does,
// and let deeper layers use larger blocks (a feature pyramid; see examples/vit_pyramid.cpp).
//
// Semantics (eval mode), for x [B, H·W, d]: the tokens of an H × W grid flattened row-major (token
// y·W + x, as ViT patch embeddings are), d = embed_dim, heads h = 1 … num_heads:
//
//   Blocks      Mh = ceil(H / block_h) × Mw = ceil(W / block_w); block (r, c) holds rows
//               [r·block_h, min((r+1)·block_h, H)) × columns [c·block_w, min((c+1)·block_w, W)) — edge
//               blocks may be partial; blocks numbered row-major n = r·Mw + c; tokens row-major inside.
//   Coarse      the mean of each block's real tokens → [B, Mh·Mw, d] → the article's CoarseAttention
//               (coarse_attn.qkv_proj, coarse_attn.out_proj) with, when relative_position_bias is on,
//               a learned per-head bias added to the scores between blocks n = (r, c) and n' = (r', c'):
//                 table[(r − r' + Gh − 1)·(2·Gw − 1) + (c − c' + Gw − 1), h],
//               Gh = max_blocks_h, Gw = max_blocks_w; table = coarse_attn.relative_position_bias_table
//               [(2·Gh − 1)·(2·Gw − 1), num_heads] (Swin's name and layout). A grid with Mh > Gh or
//               Mw > Gw is an std::invalid_argument.
//   Fine        the article's FineAttention inside each block (fine_attn.q_proj, fine_attn.kv_proj,
//               fine_attn.out_proj): the query of every token of block n is q_proj(coarse output of n);
//               keys and values are the block's real tokens. So every token of a block gets the same
//               output row, computed on the folded path of the 1-D layer (FineAttention::forward_blocks):
//               one attention row per block and head with kv_proj folded into the query and into the
//               pooled tokens — no [L, 2d] key/value tensor and no permuted copy of x. x is read in
//               place, one image row of a block at a time (kernels::BlockGrid2D).
//
// With H = 1 and the bias off this is C2FAttention with chunk_size = block_w, bit for bit.
// The PyTorch reference is tests/reference/c2f2d_reference.py.
//
// Training (docs/training.md): forward_train(x, height, width, masks, step) and backward(saved, dy): the
// folded fine stage's backward on the 2-D blocks, the coarse stage's, the relative position bias table's
// (kernels::relative_position_bias_backward) and the block means' (each real token of block n receives
// dL/dmean_n / n's token count).
#pragma once

#include "c2f/detail/huge_pages.hpp"
#include "c2f/detail/random.hpp"
#include "c2f/kernels/block2d.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/support/layer_base.hpp"
#include "c2f/mask.hpp"
#include "c2f/options.hpp"

#include <array>
#include <string>
#include <utility>

namespace c2f {

/// Two-dimensional coarse-to-fine attention (see the file comment). State dict:
/// `coarse_attn.qkv_proj.*`, `coarse_attn.out_proj.*`, `coarse_attn.relative_position_bias_table` (only
/// with the bias), `fine_attn.q_proj.*`, `fine_attn.kv_proj.*`, `fine_attn.out_proj.*`.
template <class Scalar>
class C2FAttention2D : public detail::Module<C2FAttention2D<Scalar>> {
 public:
  /// seed: initialisation (see reset_parameters). The kernel options serve the coarse stage; compute
  /// (docs/bf16.md) both stages' products.
  class Options : public RuntimeOptions<Options>, public AttnKernelOptions<Options>, public ComputeOption<Options> {
    /// Gh: the bias table covers block grids of up to Gh rows …
    C2F_ARG(Index, max_blocks_h) = 16;
    /// … and Gw columns of blocks.
    C2F_ARG(Index, max_blocks_w) = 16;
    /// Swin's 2-D relative position bias in the coarse stage.
    C2F_ARG(bool, relative_position_bias) = true;
  };

  C2F_LAYER_TRAITS("C2FAttention2D", MaskFields::None);  // takes no masks

  C2FAttention2D(Index embed_dim, Index num_heads, Index block_h, Index block_w, Options options = Options())
      : shape_(detail::checked_heads<Scalar>("C2FAttention2D", embed_dim, num_heads, 1, 8)),
        block_h_(detail::checked_positive("C2FAttention2D", "block_h", block_h)),
        block_w_(detail::checked_positive("C2FAttention2D", "block_w", block_w)),
        options_((detail::check_compute_option<Scalar>("C2FAttention2D", options.compute()), options)),
        table_entries_(checked_table_entries(options, num_heads)),
        coarse_(embed_dim, num_heads, detail::inner_options<typename CoarseAttention<Scalar>::Options>(options)),
        fine_(embed_dim, num_heads,
              detail::inner_options<typename FineAttention<Scalar>::Options>(options, 1).fine_path(FinePath::Folded)) {
    reset_parameters(options.seed());
  }

  Index embed_dim() const { return fine_.embed_dim(); }
  Index num_heads() const { return fine_.num_heads(); }
  Index head_dim() const { return fine_.head_dim(); }
  Index block_h() const { return block_h_; }
  Index block_w() const { return block_w_; }
  const Options& options() const { return options_; }
  const CoarseAttention<Scalar>& coarse_attn() const { return coarse_; }
  const FineAttention<Scalar>& fine_attn() const { return fine_; }
  /// [(2·Gh − 1)·(2·Gw − 1), num_heads]; empty without the bias.
  const RowMatrix<Scalar>& relative_position_bias_table() const { return table_; }
  void set_num_threads(int n) { this->set_num_threads_of(options_, n); }

  /// The coarse and the fine stage (the relative position bias table is loaded and saved beside them).
  template <class Self, class Fn>
  static void children(Self& self, Fn&& fn) {
    fn("coarse_attn.", self.coarse_);
    fn("fine_attn.", self.fine_);
  }

  /// The article's advice for the coarse and fine projections (as C2FAttention: Xavier-uniform coarse
  /// qkv_proj.weight, Kaiming-normal fan_out fine q_proj.weight, nn.Linear's default elsewhere, zero
  /// biases) and Swin's for the table: trunc_normal_(std=0.02) with torch's default bounds [−2, 2].
  /// Deterministic in `seed`.
  void reset_parameters(std::uint64_t seed) {
    coarse_.reset_parameters(seed);
    fine_.reset_parameters(seed + 1);
    table_.resize(0, 0);
    if (options_.relative_position_bias()) {
      table_.resize(table_entries(), num_heads());
      detail::Rng rng(seed + 2);
      detail::trunc_normal(table_, rng, 0.02, -2.0, 2.0);
    }
  }

  void load(detail::StrictLoader& loader, const std::string& name) {
    coarse_.load(loader, name + "coarse_attn.");
    if (options_.relative_position_bias()) {
      loader.read(name + "coarse_attn.relative_position_bias_table", {table_entries(), num_heads()}, table_);
    }
    fine_.load(loader, name + "fine_attn.");
  }
  void save(StateDict& sd, const std::string& name) const {
    coarse_.save(sd, name + "coarse_attn.");
    if (options_.relative_position_bias()) {
      detail::store(sd, name + "coarse_attn.relative_position_bias_table", table_, {table_entries(), num_heads()});
    }
    fine_.save(sd, name + "fine_attn.");
  }

  /// x [B, height·width, embed_dim], tokens of a height × width grid flattened row-major → [B, height·width,
  /// embed_dim] (validates x and the grid).
  std::array<Index, 3> output_shape(const ConstTensor3Ref<Scalar>& x, Index height, Index width) const {
    detail::with_layer_name(type_name, [&] { checked_grid(x, height, width); });
    return {x.batch(), x.seq(), embed_dim()};
  }
  /// forward_into on a fresh buffer, whose pages (where transparent huge pages are on) the system maps and
  /// zeroes as the fine stage writes them, band by band in address order (detail::FreshPages::OnFirstWrite).
  Output<Scalar> forward(ConstTensor3Ref<Scalar> x, Index height, Index width, const Masks<Scalar>& masks = {}) const {
    return detail::with_layer_name(type_name, [&] {
      const kernels::BlockGrid2D grid = checked_grid(x, height, width);
      detail::check_mask_fields(masks, type_name, mask_fields);
      return detail::fresh_output<Scalar>(
          type_name, {x.batch(), x.seq(), embed_dim()}, options_.num_threads(),
          [&](RowMatrixRef<Scalar> out, bool first_write) { run(x, grid, out, 0, nullptr, first_write); },
          detail::FreshPages::OnFirstWrite);
    });
  }
  /// Into caller memory: out [B·height·width, embed_dim] (overwritten; e.g. a buffer reused across calls).
  void forward_into(ConstTensor3Ref<Scalar> x, Index height, Index width, RowMatrixRef<Scalar> out,
                    const Masks<Scalar>& masks = {}) const {
    detail::with_layer_name(type_name, [&] {
      const kernels::BlockGrid2D grid = checked_grid(x, height, width);
      detail::check_call(type_name, masks, mask_fields, {x.batch(), x.seq(), embed_dim()}, out);
      run(x, grid, out);
    });
  }

  /// Training. What forward_train() keeps for backward(): the grid, the coarse stage's state (over the block
  /// means; its masks hold the relative position bias) and the fine stage's folded state (which keeps x) —
  /// O(L·d + blocks·H·d) values, no [L, L] term.
  struct Saved : detail::SavedBase {
    kernels::BlockGrid2D grid;
    typename CoarseAttention<Scalar>::Saved coarse;
    typename FineAttention<Scalar>::Saved fine;
  };
  /// forward() in train mode (no dropout: forward()'s bits) and what backward() needs.
  TrainOutput<Scalar, Saved> forward_train(ConstTensor3Ref<Scalar> x, Index height, Index width,
                                           const Masks<Scalar>& masks = {}, std::uint64_t step = 0) const {
    return detail::with_layer_name(type_name, [&] {
      detail::check_train_compute(type_name, options_.compute());
      const kernels::BlockGrid2D grid = checked_grid(x, height, width);
      detail::check_mask_fields(masks, type_name, mask_fields);
      return detail::train_output<Scalar, Saved>(
          *this, {x.batch(), x.seq(), embed_dim()},
          [&](RowMatrixRef<Scalar> out, Saved& saved) { run(x, grid, out, step, &saved); });
    });
  }
  /// The gradients of a loss given dy = dL/dy of forward_train()'s output: g.input = dL/dx, g.params under
  /// state_dict()'s names — `coarse_attn.relative_position_bias_table` included when the bias is on.
  Grads<Scalar> backward(const Saved& saved, ConstTensor3Ref<Scalar> dy) const {
    return detail::with_layer_name(type_name, [&] { return detail::run_backward<Scalar>(*this, saved, dy); });
  }

  /// The coarse stage's input: the mean of each block's real tokens, [B, Mh·Mw, embed_dim].
  Tensor3<Scalar> coarse_input(ConstTensor3Ref<Scalar> x, Index height, Index width) const {
    const kernels::BlockGrid2D grid =
        detail::with_layer_name(type_name, [&] { return checked_grid(x, height, width); });
    Tensor3<Scalar> summaries(x.batch(), grid.blocks_per_batch(), embed_dim());
    kernels::chunk_mean<Scalar>(x.rows(), grid,
                                Eigen::Map<RowMatrix<Scalar>>(summaries.data(), grid.blocks(), embed_dim()),
                                detail::kernel_options(options_));
    return summaries;
  }

  /// The coarse stage's score bias for a grid of blocks_h × blocks_w blocks: the relative position bias,
  /// or no mask when it is off. Throws when the grid exceeds max_blocks_h × max_blocks_w.
  AttnMask<Scalar> coarse_mask(Index blocks_h, Index blocks_w) const {
    if (!options_.relative_position_bias()) return {};
    if (blocks_h > options_.max_blocks_h() || blocks_w > options_.max_blocks_w()) {
      detail::fail("C2FAttention2D: a grid of ", blocks_h, " x ", blocks_w,
                   " blocks (Mh x Mw) exceeds the relative position bias table's max_blocks_h x max_blocks_w = ",
                   options_.max_blocks_h(), " x ", options_.max_blocks_w());
    }
    return AttnMask<Scalar>::relative_position(table_, blocks_h, blocks_w, options_.max_blocks_h(),
                                               options_.max_blocks_w());
  }

  /// Bytes of temporary memory one forward() holds at its peak besides x and the returned output: the
  /// block means, the coarse stage (its MultiHeadAttention workspace) and the folded fine stage's
  /// per-block rows — O(blocks · heads · embed_dim), nothing per token.
  std::size_t workspace_bytes(Index batch, Index height, Index width) const {
    const kernels::BlockGrid2D grid{batch, height, width, block_h_, block_w_};
    const Index m = grid.blocks(), d = embed_dim();
    const std::size_t coarse =
        sizeof(Scalar) * static_cast<std::size_t>(2 * m * d) + coarse_.workspace_bytes(batch, grid.blocks_per_batch());
    // forward_blocks: q [m, d] (counted by folded_workspace_bytes), then the folded fine stage.
    return coarse + fine_.folded_workspace_bytes(m, block_w_);
  }

 private:
  Index table_entries() const { return table_entries_; }
  /// (2·Gh − 1)·(2·Gw − 1) rows of the bias table (0 without the bias), refused when the table could not
  /// be allocated.
  static Index checked_table_entries(const Options& o, Index heads) {
    if (!o.relative_position_bias()) return 0;
    if (o.max_blocks_h() < 1 || o.max_blocks_w() < 1) {
      detail::fail("C2FAttention2D: relative_position_bias needs max_blocks_h >= 1 and max_blocks_w >= 1, got ",
                   o.max_blocks_h(), " and ", o.max_blocks_w());
    }
    const char* what = "C2FAttention2D: the relative position bias table";
    const Index entries = detail::relative_table_entries(o.max_blocks_h(), o.max_blocks_w(), what);
    detail::check_buffer_of<Scalar>(what, {entries, heads});
    return entries;
  }

  kernels::BlockGrid2D checked_grid(const ConstTensor3Ref<Scalar>& x, Index height, Index width) const {
    detail::check_features(x, embed_dim(), "C2FAttention2D", "x", "embed_dim");
    const Index tokens = detail::checked_mul(height, width, "C2FAttention2D: the grid height x width");
    if (x.seq() != tokens) {
      detail::fail("C2FAttention2D: x must be [batch, height·width = ", height, "·", width, " = ", tokens,
                   ", embed_dim] for a ", height, " x ", width, " grid, got ",
                   detail::shape_string({x.batch(), x.seq(), x.features()}));
    }
    const kernels::BlockGrid2D grid{x.batch(), height, width, block_h_, block_w_};
    if (options_.relative_position_bias() &&
        (grid.blocks_h() > options_.max_blocks_h() || grid.blocks_w() > options_.max_blocks_w())) {
      detail::fail("C2FAttention2D: a ", height, " x ", width, " grid in blocks of ", block_h_, " x ", block_w_,
                   " has ", grid.blocks_h(), " x ", grid.blocks_w(),
                   " blocks (Mh x Mw), more than the relative position bias table's max_blocks_h x max_blocks_w = ",
                   options_.max_blocks_h(), " x ", options_.max_blocks_w());
    }
    return grid;
  }

  /// The forward pass into out; `saved`: nullptr, or training's state (the same arithmetic, each stage
  /// keeping its state).
  void run(const ConstTensor3Ref<Scalar>& x, const kernels::BlockGrid2D& grid, RowMatrixRef<Scalar> out,
           std::uint64_t step = 0, Saved* saved = nullptr, bool fresh_out = false) const {
    if (saved != nullptr) saved->grid = grid;
    if (grid.blocks() == 0) return;
    const Index d = embed_dim();
    Tensor3<Scalar> summaries(x.batch(), grid.blocks_per_batch(), d);
    kernels::chunk_mean<Scalar>(x.rows(), grid, Eigen::Map<RowMatrix<Scalar>>(summaries.data(), grid.blocks(), d),
                                detail::kernel_options(options_));
    const Masks<Scalar> coarse_masks = Masks<Scalar>().attn_mask(coarse_mask(grid.blocks_h(), grid.blocks_w()));
    if (saved == nullptr) {
      const Tensor3<Scalar> context = coarse_.forward(summaries, coarse_masks);
      fine_.forward_blocks(x.rows(), grid, Eigen::Map<const RowMatrix<Scalar>>(context.data(), grid.blocks(), d), out,
                           fresh_out);
      return;
    }
    RowMatrix<Scalar> context(grid.blocks(), d);
    detail::TrainAccess::train(coarse_, ConstTensor3Ref<Scalar>(summaries), RowMatrixRef<Scalar>(context), coarse_masks,
                               step, saved->coarse);
    detail::TrainAccess::train(fine_, x.rows(), grid, context, out, saved->fine);
  }

  friend struct detail::TrainAccess;
  /// The folded fine stage's backward on the blocks (dL/dx through the fold, dL/dcontext), the coarse
  /// stage's on dL/dcontext (dL/dmeans and, from its saved attention, the bias table's gradient), and the
  /// block means'.
  void compute_backward(const Saved& saved, const ConstRowMatrixRef<Scalar>& dy, Grads<Scalar>& g,
                        C2FAttention2D& grad) const {
    const kernels::BlockGrid2D& grid = saved.grid;
    const Index d = embed_dim(), h = num_heads(), blocks = grid.blocks(), m = grid.blocks_per_batch();
    g.input = Tensor3<Scalar>(grid.batch, grid.height * grid.width, d);
    if (blocks == 0) return;  // no tokens: every gradient stays zero
    const kernels::KernelOptions threads = detail::kernel_options(options_);
    Eigen::Map<RowMatrix<Scalar>> dx(g.input.data(), grid.tokens(), d);
    RowMatrix<Scalar> dcontext(blocks, d);
    detail::TrainAccess::backward(fine_, saved.fine, grid, dy, dx, dcontext, grad.fine_);
    Grads<Scalar> coarse_g;
    detail::TrainAccess::backward(coarse_, saved.coarse, dcontext, coarse_g, grad.coarse_);
    if (options_.relative_position_bias()) {
      // The heads' output gradient of the coarse stage (out_proj's input), then the scores' gradient summed
      // per table entry.
      const typename CoarseAttention<Scalar>::Saved& c = saved.coarse;
      RowMatrix<Scalar> dattn(blocks, d);
      kernels::matmul_rows<Scalar>(dcontext, coarse_.as_multihead_attention().out_proj().weight(), nullptr, dattn,
                                   threads);
      const MaskView<Scalar> mask(c.masks, grid.batch, h, m, m);
      kernels::relative_position_bias_backward<Scalar>(
          kernels::heads_view(c.q, grid.batch, m, h), kernels::heads_view(c.k, grid.batch, m, h),
          kernels::heads_view(c.v, grid.batch, m, h), kernels::heads_view(c.attn, grid.batch, m, h), c.lse,
          kernels::heads_view(std::as_const(dattn), grid.batch, m, h), mask, grid.blocks_h(), grid.blocks_w(),
          options_.max_blocks_h(), options_.max_blocks_w(), kernels::default_scale<Scalar>(head_dim()), grad.table_,
          threads);
    }
    kernels::chunk_mean_backward_add<Scalar>(Eigen::Map<const RowMatrix<Scalar>>(coarse_g.input.data(), blocks, d),
                                             grid, dx, threads);
  }

  detail::HeadShape shape_;  // first: checked before the stages are built
  Index block_h_;
  Index block_w_;
  Options options_;
  Index table_entries_;
  CoarseAttention<Scalar> coarse_;
  FineAttention<Scalar> fine_;
  RowMatrix<Scalar> table_;  ///< [(2·Gh − 1)·(2·Gw − 1), num_heads]
};

}  // namespace c2f
