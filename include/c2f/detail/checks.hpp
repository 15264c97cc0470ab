// c2f — the entry checks of the public kernels: O(1) shape checks that run in every build type (they
// are not eigen_assert, which Release builds remove) and throw std::invalid_argument naming the kernel,
// the argument, the expected and the given shape.
#pragma once

#include "c2f/core.hpp"

#include <limits>

namespace c2f {
namespace detail {

/// "<kernel>: <what> must be [rows, cols], got [r, c]" unless m is rows × cols.
template <class M>
void check_shape(const char* kernel, const char* what, const M& m, Index rows, Index cols) {
  if (m.rows() != rows || m.cols() != cols) {
    fail(kernel, ": ", what, " must be ", shape_string({rows, cols}), ", got ", shape_string({m.rows(), m.cols()}));
  }
}

/// heads > 0 and `cols` splits into heads of equal width.
inline void check_heads(const char* kernel, Index cols, Index heads) {
  if (heads <= 0 || cols % heads != 0) {
    fail(kernel, ": ", cols, " columns do not split into ", heads, " heads of equal width");
  }
}

/// A chunk grid: batch >= 0, length >= 0, chunk >= 1.
template <class Grid>
void check_grid(const char* kernel, const Grid& grid) {
  if (grid.batch < 0 || grid.length < 0 || grid.chunk < 1) {
    fail(kernel, ": the chunk grid needs batch >= 0, length >= 0 and chunk >= 1, got batch=", grid.batch,
         ", length=", grid.length, ", chunk=", grid.chunk);
  }
}

/// A mask view checked against [batch, heads, queries, keys] (an empty view fits every problem).
template <class MaskView>
void check_mask_view(const char* kernel, const MaskView& mask, Index batch, Index heads, Index queries, Index keys) {
  if (!mask.empty() &&
      (mask.batch() != batch || mask.heads() != heads || mask.queries() != queries || mask.keys() != keys)) {
    fail(kernel, ": the mask view was checked for [batch, heads, queries, keys] = ",
         shape_string({mask.batch(), mask.heads(), mask.queries(), mask.keys()}), ", the problem is ",
         shape_string({batch, heads, queries, keys}));
  }
}

/// A positive, finite softmax scale.
template <class Scalar>
void check_scale(const char* kernel, Scalar scale) {
  if (!(scale > Scalar(0)) || !(scale < std::numeric_limits<Scalar>::infinity())) {
    fail(kernel, ": the scale must be positive and finite, got ", scale);
  }
}

/// q, k, v and out all [rows, q.cols()], q.cols() split into `heads`, and a positive finite scale.
template <class Q, class K, class V, class O, class Scalar>
void check_qkv_out(const char* kernel, const Q& q, const K& k, const V& v, const O& out, Index rows, Index heads,
                   Scalar scale) {
  check_heads(kernel, q.cols(), heads);
  check_shape(kernel, "q", q, rows, q.cols());
  check_shape(kernel, "k", k, rows, q.cols());
  check_shape(kernel, "v", v, rows, q.cols());
  check_shape(kernel, "out", out, rows, q.cols());
  check_scale(kernel, scale);
}

/// Kernels whose queries are the last n positions of T: q and out [batch·n, cols] (cols split into
/// heads), k and v [batch·T, cols] (when keys_are_tokens), n ≤ T. Returns n (T when the batch is empty:
/// nothing is computed then, and a forward pass's queries are all T positions).
template <class Q, class O, class K, class V, class Grid, class Scalar>
Index check_last_queries(const char* kernel, const Q& q, const O& out, const K& k, const V& v, const Grid& grid,
                         Index heads, Scalar scale, bool keys_are_tokens = true) {
  check_grid(kernel, grid);
  check_heads(kernel, q.cols(), heads);
  check_scale(kernel, scale);
  const Index n = grid.batch > 0 ? q.rows() / grid.batch : grid.length;
  if (q.rows() != grid.batch * n || n > grid.length) {
    fail(kernel, ": q ", shape_string({q.rows(), q.cols()}), " must be [batch·n, cols] with n <= length (batch ",
         grid.batch, ", length ", grid.length, ")");
  }
  check_shape(kernel, "out", out, q.rows(), q.cols());
  if (keys_are_tokens) {
    check_shape(kernel, "k", k, grid.batch * grid.length, q.cols());
    check_shape(kernel, "v", v, grid.batch * grid.length, q.cols());
  }
  return n;
}

/// Chunk selection: q, k [batch·length, cols] with cols split into heads, and top_k >= 1.
template <class Q, class K, class Grid>
void check_selection_inputs(const char* kernel, const Q& q, const K& k, const Grid& grid, Index heads, Index top_k) {
  check_grid(kernel, grid);
  check_heads(kernel, q.cols(), heads);
  check_shape(kernel, "q", q, grid.batch * grid.length, q.cols());
  check_shape(kernel, "k", k, grid.batch * grid.length, q.cols());
  if (top_k < 1) fail(kernel, ": top_k must be >= 1, got ", top_k);
}

/// Chunk-sparse fine stage: q and out [batch·n, cols] (the last n positions; n = length for per-chunk
/// gating), k and v [batch·length, cols] split into heads; the selection (per chunk or per token) and
/// the mask view ([batch, heads, n, length]) fit the problem. Returns n.
template <class Q, class K, class O, class Grid, class Selection, class MaskView, class Scalar>
Index check_sparse_fine_inputs(const char* kernel, const Q& q, const K& k, const K& v, const O& out, const Grid& grid,
                               Index heads, const Selection& selection, bool per_token, const MaskView& mask,
                               Scalar scale) {
  const Index n = check_last_queries(kernel, q, out, k, v, grid, heads, scale);
  if (!per_token && n != grid.length) fail(kernel, ": per-chunk gating needs a query for every key position");
  selection.check(kernel, grid, heads, per_token, per_token ? n : grid.chunks_per_batch());
  check_mask_view(kernel, mask, grid.batch, heads, n, grid.length);
  return n;
}

/// y = x · wᵀ: x [n, in], w [out, in], y [n, out].
template <class X, class W, class Y>
void check_linear_shapes(const char* kernel, const X& x, const W& w, const Y& y) {
  if (x.cols() != w.cols() || y.rows() != x.rows() || y.cols() != w.rows()) {
    fail(kernel, ": x ", shape_string({x.rows(), x.cols()}), ", weight ", shape_string({w.rows(), w.cols()}), " and y ",
         shape_string({y.rows(), y.cols()}), " do not fit y = x weightᵀ");
  }
}

/// The gradients of y = x wᵀ: x [n, in], w [out, in], dy [n, out], dx [n, in], dw [out, in].
template <class X, class W, class DY, class DX, class DW>
void check_linear_backward(const char* kernel, const X& x, const W& w, const DY& dy, const DX& dx, const DW& dw) {
  if (x.cols() != w.cols() || dy.rows() != x.rows() || dy.cols() != w.rows() || dx.rows() != x.rows() ||
      dx.cols() != x.cols() || dw.rows() != w.rows() || dw.cols() != w.cols()) {
    fail(kernel, ": x ", shape_string({x.rows(), x.cols()}), ", weight ", shape_string({w.rows(), w.cols()}), ", dy ",
         shape_string({dy.rows(), dy.cols()}), ", dx ", shape_string({dx.rows(), dx.cols()}), " and dweight ",
         shape_string({dw.rows(), dw.cols()}), " do not fit y = x weightᵀ (dx like x, dweight like weight, dy like y)");
  }
}

/// A convolution's input x [batch·length, in] and output y [batch·out_length, out] for a shape `s`
/// (a kernels::Conv1dShape, validated here too).
template <class X, class Y, class Shape>
void check_conv1d(const char* kernel, const X& x, const Y& y, Index batch, Index length, const Shape& s) {
  s.validate();
  const Index out_len = s.out_length(length);
  if (batch < 0 || length < 0) fail(kernel, ": batch and length must be >= 0, got ", batch, " and ", length);
  if (out_len < 0) {
    fail(kernel, ": input length ", length, " is shorter than kernel_size ", s.kernel, " - 2 x padding ", s.padding);
  }
  if (x.rows() != batch * length || x.cols() != s.in_channels || y.rows() != batch * out_len ||
      y.cols() != s.out_channels) {
    fail(kernel, ": x ", shape_string({x.rows(), x.cols()}), " and y ", shape_string({y.rows(), y.cols()}),
         " do not fit [batch·length, in] = ", shape_string({batch * length, s.in_channels}),
         " → [batch·out_length, out] = ", shape_string({batch * out_len, s.out_channels}));
  }
}

/// The q, k, v and out heads views of an sdpa kernel ([batch, seq, heads, dim] each) fit one problem,
/// the mask view was checked for it, and the scale is positive and finite.
template <class QView, class KVView, class OutView, class MaskView, class Scalar>
void check_sdpa(const char* kernel, const QView& q, const KVView& k, const KVView& v, const OutView& out,
                const MaskView& mask, Scalar scale) {
  if (k.batch != q.batch || v.batch != q.batch || out.batch != q.batch || k.heads != q.heads || v.heads != q.heads ||
      out.heads != q.heads || k.dim != q.dim || v.seq != k.seq || out.seq != q.seq || out.dim != v.dim || q.batch < 0 ||
      q.seq < 0 || k.seq < 0 || q.heads < 1) {
    fail(kernel, ": q ", shape_string({q.batch, q.seq, q.heads, q.dim}), ", k ",
         shape_string({k.batch, k.seq, k.heads, k.dim}), ", v ", shape_string({v.batch, v.seq, v.heads, v.dim}),
         " and out ", shape_string({out.batch, out.seq, out.heads, out.dim}), " ([batch, seq, heads, dim]) do not fit");
  }
  check_mask_view(kernel, mask, q.batch, q.heads, q.seq, k.seq);
  check_scale(kernel, scale);
}

/// An attention backward's views fit: the forward's problem (check_sdpa, `o` its output), dout shaped like
/// o, and dq, dk, dv like q, k, v ([batch, seq, heads, dim] each).
template <class In, class Out, class MaskView, class Scalar>
void check_sdpa_backward(const char* kernel, const In& q, const In& k, const In& v, const In& o, const In& dout,
                         const Out& dq, const Out& dk, const Out& dv, const MaskView& mask, Scalar scale) {
  check_sdpa(kernel, q, k, v, o, mask, scale);
  const auto dims = [](const auto& x) { return shape_string({x.batch, x.seq, x.heads, x.dim}); };
  if (dims(dout) != dims(o) || dims(dq) != dims(q) || dims(dk) != dims(k) || dims(dv) != dims(v)) {
    fail(kernel, ": dout, dq, dk and dv must be shaped like out ", dims(o), ", q ", dims(q), ", k ", dims(k), " and v ",
         dims(v), " ([batch, seq, heads, dim]), got ", dims(dout), ", ", dims(dq), ", ", dims(dk), " and ", dims(dv));
  }
}

/// decode(): a causal layer, x [state batch, n >= 1, width].
template <class X>
void check_decode(const char* layer, bool causal, const X& x, Index state_batch, Index width) {
  if (!causal)
    fail(layer, "::decode needs a causal layer (Options().causal(true)): a non-causal one reads later tokens");
  if (x.batch() != state_batch || x.seq() < 1 || x.features() != width) {
    fail(layer, "::decode: x_new must be [batch, n >= 1, embed_dim] = [", state_batch, ", n, ", width,
         "] for this state, got ", shape_string({x.batch(), x.seq(), x.features()}));
  }
}

}  // namespace detail
}  // namespace c2f
