// c2f kernels — 1-D convolution with torch.nn.Conv1d's semantics (cross-correlation, stride 1,
// zero padding, groups) on [batch, length, channels] rows, computed as one GEMM per tap; and its
// gradients (conv1d_backward, for training: docs/training.md).
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/cpu/packed_gemm.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/kernel_options.hpp"

#include <algorithm>
#include <vector>

namespace c2f {
namespace kernels {

struct Conv1dShape {
  Index in_channels = 0, out_channels = 0, kernel = 1, padding = 0, groups = 1;
  /// Causal padding: kernel − 1 zeros on the left, none on the right (PyTorch: conv(F.pad(x, (k − 1, 0)))
  /// with padding 0), so output i reads inputs i − kernel + 1 … i and the length is kept. Needs padding 0.
  bool causal = false;

  Index in_per_group() const { return in_channels / groups; }
  Index out_per_group() const { return out_channels / groups; }
  /// Zeros before and after the input.
  Index left_padding() const { return causal ? kernel - 1 : padding; }
  Index right_padding() const { return causal ? 0 : padding; }
  /// Output length for an input of `length` (stride 1): length + left + right padding − kernel + 1.
  Index out_length(Index length) const { return length + left_padding() + right_padding() - kernel + 1; }

  void validate() const {
    if (in_channels <= 0 || out_channels <= 0 || kernel <= 0 || padding < 0 || groups <= 0) {
      detail::fail(
          "Conv1d: in_channels, out_channels, kernel_size and groups must be positive and padding >= 0, got in=",
          in_channels, " out=", out_channels, " kernel_size=", kernel, " padding=", padding, " groups=", groups);
    }
    if (padding > (Index(1) << 40)) detail::fail("Conv1d: padding must be at most 2^40, got ", padding);
    if (causal && padding != 0) {
      detail::fail("Conv1d: causal padding adds kernel_size - 1 zeros on the left; padding must be 0, got ", padding);
    }
    if (in_channels % groups != 0 || out_channels % groups != 0) {
      detail::fail("Conv1d: in_channels (", in_channels, ") and out_channels (", out_channels,
                   ") must be divisible by groups (", groups, ")");
    }
  }
};

/// PyTorch's weight [out, in/groups, kernel] rearranged tap-major: rows [t·out, (t+1)·out) hold W[:, :, t].
template <class Scalar>
RowMatrix<Scalar> conv1d_taps(const Scalar* torch_weight, const Conv1dShape& s) {
  s.validate();
  RowMatrix<Scalar> taps(s.kernel * s.out_channels, s.in_per_group());
  for (Index o = 0; o < s.out_channels; ++o) {
    for (Index c = 0; c < s.in_per_group(); ++c) {
      for (Index t = 0; t < s.kernel; ++t)
        taps(t * s.out_channels + o, c) = torch_weight[(o * s.in_per_group() + c) * s.kernel + t];
    }
  }
  return taps;
}

/// Inverse of conv1d_taps: the [out, in/groups, kernel] array PyTorch stores.
template <class Scalar>
std::vector<Scalar> conv1d_torch_weight(const RowMatrix<Scalar>& taps, const Conv1dShape& s) {
  std::vector<Scalar> w(static_cast<std::size_t>(s.out_channels * s.in_per_group() * s.kernel));
  for (Index o = 0; o < s.out_channels; ++o) {
    for (Index c = 0; c < s.in_per_group(); ++c) {
      for (Index t = 0; t < s.kernel; ++t) {
        w[static_cast<std::size_t>((o * s.in_per_group() + c) * s.kernel + t)] = taps(t * s.out_channels + o, c);
      }
    }
  }
  return w;
}

/// Output rows per task of conv1d(); fixed, so the result bits do not depend on the thread count.
constexpr Index kConv1dTaskRows = 128;

/// Heap bytes conv1d() holds while it runs on sequences of `length`: every tap of every group packed for
/// the micro-kernel on the packed path, else nothing.
/// Compute::BFloat16: the taps packed for cpu::bf16_gemm and, per worker of `threads`
/// (KernelOptions::num_threads), the rounded input rows of one task (a per-thread buffer that keeps its
/// largest size between calls); none below kBf16PackedMinRows output rows.
template <class Scalar>
std::size_t conv1d_workspace_bytes(Index length, const Conv1dShape& s, Compute compute = Compute::Float32,
                                   int threads = 0) {
  const std::size_t taps = static_cast<std::size_t>(s.kernel * s.groups);
  if (compute == Compute::BFloat16) {
    const Index out_len = s.out_length(length);
    if (out_len < c2f::cpu::kBf16PackedMinRows) return 0;
    const Bf16Engine engine = bf16_engine();
    const std::size_t workers = static_cast<std::size_t>(detail::resolve_threads(threads, out_len));
    return taps * c2f::cpu::Bf16PackedB::bytes(s.in_per_group(), s.out_per_group(), engine) +
           workers * c2f::cpu::Bf16A::bytes(std::min(out_len, kConv1dTaskRows), s.in_per_group(), engine);
  }
  const bool packed = c2f::cpu::kPackedGemm && s.out_length(length) >= c2f::cpu::kPackedGemmMinRows;
  return packed ? taps * c2f::cpu::PackedB<Scalar>::bytes(s.in_per_group(), s.out_per_group()) : 0;
}

/// y[b, i, o] = bias[o] + Σ_t Σ_c W[o, c, t] · x[b, i + t − left_padding, g(o)·in/groups + c] (zero
/// outside the input), overwritten. x [batch·length, in], taps from conv1d_taps(), bias [out] or nullptr,
/// y [batch·out_length, out] (may be a column block of a wider matrix). From kPackedGemmMinRows output
/// rows on (where the build has cpu::kPackedGemm) every tap of every group is packed once per call
/// and runs on the register-blocked micro-kernel, added tap by tap into the output; below, Eigen's
/// product. Either way the bits depend on the shapes only, not on the thread count.
/// With options.compute() == Compute::BFloat16 (float only) x and the weights are rounded to bfloat16
/// and the sums kept in fp32 (docs/bf16.md): from kBf16PackedMinRows output rows on every tap packed for
/// cpu::bf16_gemm (the tile unit where the CPU has it), below fp32 products of the rounded values.
template <class Scalar>
void conv1d(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, const Conv1dShape& s,
            const RowMatrix<Scalar>& taps, const Scalar* bias, RowMatrixRef<Scalar> y, const KernelOptions& options) {
  detail::check_conv1d("conv1d", x, y, batch, length, s);
  detail::check_shape("conv1d", "taps", taps, s.kernel * s.out_channels, s.in_per_group());
  const Index out_len = s.out_length(length), cin = s.in_per_group(), cout = s.out_per_group();
  const Index tasks_per_batch = (out_len + kConv1dTaskRows - 1) / kConv1dTaskRows;
  const double work = 2.0 * static_cast<double>(batch * out_len) * static_cast<double>(s.kernel * cin * s.out_channels);
  const bool bf16 = c2f::cpu::check_compute<Scalar>("conv1d", options.compute());
  const bool packed = !bf16 && c2f::cpu::kPackedGemm && out_len >= c2f::cpu::kPackedGemmMinRows;
  const bool packed16 = bf16 && out_len >= c2f::cpu::kBf16PackedMinRows;
  std::vector<c2f::cpu::PackedB<Scalar>> packed_taps(packed ? static_cast<std::size_t>(s.kernel * s.groups) : 0);
  std::vector<c2f::cpu::Bf16PackedB> packed_taps16(packed16 ? static_cast<std::size_t>(s.kernel * s.groups) : 0);
  for (Index t = 0; (packed || packed16) && t < s.kernel; ++t) {
    for (Index g = 0; g < s.groups; ++g) {
      const std::size_t i = static_cast<std::size_t>(t * s.groups + g);
      if constexpr (std::is_same<Scalar, float>::value) {
        if (packed16) {
          packed_taps16[i].pack(taps.block(t * s.out_channels + g * cout, 0, cout, cin).transpose(),
                                options.num_threads());
          continue;
        }
      }
      packed_taps[i].pack(taps.block(t * s.out_channels + g * cout, 0, cout, cin).transpose(), options.num_threads());
    }
  }
  detail::parallel_for(batch * tasks_per_batch, options.num_threads(), work, [&](Index task, int) {
    const c2f::cpu::Bf16Tiles tile_registers(packed16 ? packed_taps16.front().engine() : Bf16Engine::Fallback);
    const Index b = task / tasks_per_batch;
    const Index r0 = (task % tasks_per_batch) * kConv1dTaskRows, r1 = std::min(out_len, r0 + kConv1dTaskRows);
    typename RowMatrixRef<Scalar>::RowsBlockXpr out = y.middleRows(b * out_len + r0, r1 - r0);
    if (bias != nullptr) {
      out.rowwise() = Eigen::Map<const Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(bias, s.out_channels);
    } else {
      out.setZero();
    }
    for (Index t = 0; t < s.kernel; ++t) {
      // Output row i reads input row i + t − left padding; keep the rows where that lies inside [0, length).
      const Index shift = t - s.left_padding();
      const Index i0 = std::max(r0, -shift), i1 = std::min(r1, length - shift);
      if (i1 <= i0) continue;
      for (Index g = 0; g < s.groups; ++g) {
        if constexpr (std::is_same<Scalar, float>::value) {
          if (packed16) {
            const float* in = x.data() + (b * length + i0 + shift) * x.outerStride() + g * cin;
            c2f::cpu::bf16_gemm_range(in, x.outerStride(), i1 - i0,
                                      packed_taps16[static_cast<std::size_t>(t * s.groups + g)], 0, cin, 0, cout,
                                      nullptr, true, &out(i0 - r0, g * cout), y.outerStride());
            continue;
          }
        }
        if (bf16) {  // few rows: fp32 products of the rounded values
          out.block(i0 - r0, g * cout, i1 - i0, cout).noalias() +=
              x.block(b * length + i0 + shift, g * cin, i1 - i0, cin).unaryExpr(c2f::cpu::RoundBf16<Scalar>()) *
              taps.block(t * s.out_channels + g * cout, 0, cout, cin)
                  .transpose()
                  .unaryExpr(c2f::cpu::RoundBf16<Scalar>());
          continue;
        }
        if (packed) {
          const Scalar* in = x.data() + (b * length + i0 + shift) * x.outerStride() + g * cin;
          c2f::cpu::packed_gemm_range<Scalar>(in, x.outerStride(), i1 - i0,
                                              packed_taps[static_cast<std::size_t>(t * s.groups + g)], 0, cin, 0, cout,
                                              nullptr, true, &out(i0 - r0, g * cout), y.outerStride());
          continue;
        }
        out.block(i0 - r0, g * cout, i1 - i0, cout).noalias() +=
            x.block(b * length + i0 + shift, g * cin, i1 - i0, cin) *
            taps.block(t * s.out_channels + g * cout, 0, cout, cin).transpose();
      }
    }
  });
}

/// Reference twin of conv1d(): the defining sum, element by element, on PyTorch's weight layout.
template <class Scalar>
void conv1d_naive(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, const Conv1dShape& s,
                  const Scalar* torch_weight, const Scalar* bias, RowMatrixRef<Scalar> y) {
  detail::check_conv1d("conv1d_naive", x, y, batch, length, s);
  const Index out_len = s.out_length(length), cin = s.in_per_group(), cout = s.out_per_group();
  for (Index b = 0; b < batch; ++b) {
    for (Index i = 0; i < out_len; ++i) {
      for (Index o = 0; o < s.out_channels; ++o) {
        const Index g = o / cout;
        Scalar acc = bias != nullptr ? bias[o] : Scalar(0);
        for (Index t = 0; t < s.kernel; ++t) {
          const Index src = i + t - s.left_padding();
          if (src < 0 || src >= length) continue;
          for (Index c = 0; c < cin; ++c)
            acc += torch_weight[(o * cin + c) * s.kernel + t] * x(b * length + src, g * cin + c);
        }
        y(b * out_len + i, o) = acc;
      }
    }
  }
}

/// Weights per side of one task of conv1d_backward()'s weight gradient (a tile of one tap and group).
constexpr Index kConv1dGradTile = 64;

namespace impl {
/// conv1d_backward's arguments: x and dy as conv1d's x and y (check_conv1d), taps as conv1d's, dx shaped
/// like x and dtaps like taps.
template <class X, class Taps, class DY, class DX, class DTaps>
void check_conv1d_backward(const char* kernel, const X& x, const Taps& taps, const DY& dy, const DX& dx,
                           const DTaps& dtaps, Index batch, Index length, const kernels::Conv1dShape& s) {
  detail::check_conv1d(kernel, x, dy, batch, length, s);
  detail::check_shape(kernel, "taps", taps, s.kernel * s.out_channels, s.in_per_group());
  detail::check_shape(kernel, "dx", dx, x.rows(), x.cols());
  detail::check_shape(kernel, "dtaps", dtaps, taps.rows(), taps.cols());
}
}  // namespace impl

/// The gradients of conv1d() for the output's gradient dy [batch·out_length, out] (dy may be a column
/// block of a wider matrix):
///   dx[b, s, g·in/groups + c] = Σ_t Σ_(o in group g) dy[b, s − t + left_padding, o] · W[o, c, t]
///     (overwritten, or added to with `add_dx`) — tasks of kConv1dTaskRows input rows, taps in order;
///   dtaps (conv1d_taps' layout, overwritten) = Σ_b Σ_i dy[b, i, o] · x[b, i + t − left_padding, g·in/groups + c]
///     — each tile of kConv1dGradTile × kConv1dGradTile weights of one tap and group one task, summing the
///     batch items in order;
///   dbias[o] = Σ dy[:, o] (overwritten; nullptr: no bias), added in double (a bias gradient is a long sum
///     that cancels).
/// The bits depend on the shapes only, not on the thread count. Twin: conv1d_backward_naive().
template <class Scalar>
void conv1d_backward(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, const Conv1dShape& s,
                     const RowMatrix<Scalar>& taps, const ConstRowMatrixRef<Scalar>& dy, RowMatrixRef<Scalar> dx,
                     RowMatrixRef<Scalar> dtaps, Scalar* dbias, const KernelOptions& options, bool add_dx = false) {
  impl::check_conv1d_backward("conv1d_backward", x, taps, dy, dx, dtaps, batch, length, s);
  const Index out_len = s.out_length(length), cin = s.in_per_group(), cout = s.out_per_group(), lp = s.left_padding();
  const double work = 2.0 * static_cast<double>(batch * out_len) * static_cast<double>(s.kernel * cin * s.out_channels);
  // dx: input row r of batch item b is read by output row r − t + lp through tap t.
  const Index tasks_per_batch = detail::ceil_div(length, kConv1dTaskRows);
  detail::parallel_for(batch * tasks_per_batch, options.num_threads(), work, [&](Index task, int) {
    const Index b = task / tasks_per_batch;
    const Index r0 = (task % tasks_per_batch) * kConv1dTaskRows, r1 = std::min(length, r0 + kConv1dTaskRows);
    typename RowMatrixRef<Scalar>::RowsBlockXpr rows = dx.middleRows(b * length + r0, r1 - r0);
    if (!add_dx) rows.setZero();
    for (Index t = 0; t < s.kernel; ++t) {
      const Index shift = lp - t;  // input row r ↔ output row r + shift
      const Index i0 = std::max(r0, -shift), i1 = std::min(r1, out_len - shift);
      if (i1 <= i0) continue;
      for (Index g = 0; g < s.groups; ++g) {
        rows.block(i0 - r0, g * cin, i1 - i0, cin).noalias() +=
            dy.block(b * out_len + i0 + shift, g * cout, i1 - i0, cout) *
            taps.block(t * s.out_channels + g * cout, 0, cout, cin);
      }
    }
  });
  // dtaps and dbias: tiles of one tap and group, each summing over every output row.
  const Index tiles_o = detail::ceil_div(cout, kConv1dGradTile), tiles_c = detail::ceil_div(cin, kConv1dGradTile);
  const Index tiles = tiles_o * tiles_c;
  detail::parallel_for(s.kernel * s.groups * tiles, options.num_threads(), work, [&](Index task, int) {
    const Index t = task / (s.groups * tiles), g = (task / tiles) % s.groups;
    const Index o0 = (task % tiles) / tiles_c * kConv1dGradTile, c0 = (task % tiles_c) * kConv1dGradTile;
    const Index no = std::min(kConv1dGradTile, cout - o0), nc = std::min(kConv1dGradTile, cin - c0);
    typename RowMatrixRef<Scalar>::BlockXpr tile = dtaps.block(t * s.out_channels + g * cout + o0, c0, no, nc);
    tile.setZero();
    const Index shift = t - lp;  // output row i reads input row i + shift
    const Index i0 = std::max<Index>(0, -shift), i1 = std::min(out_len, length - shift);
    for (Index b = 0; b < batch && i1 > i0; ++b) {
      tile.noalias() += dy.block(b * out_len + i0, g * cout + o0, i1 - i0, no).transpose() *
                        x.block(b * length + i0 + shift, g * cin + c0, i1 - i0, nc);
    }
    if (dbias != nullptr && t == 0 && c0 == 0) {
      for (Index o = g * cout + o0; o < g * cout + o0 + no; ++o)
        dbias[o] = dy.rows() == 0 ? Scalar(0) : static_cast<Scalar>(dy.col(o).template cast<double>().sum());
    }
  });
}

/// Twin of conv1d_backward(): the defining sums, element by element, in index order, on PyTorch's weight
/// layout: dx (overwritten), dweight [out, in/groups, kernel] and dbias [out] (overwritten; nullptr: none).
template <class Scalar>
void conv1d_backward_naive(const ConstRowMatrixRef<Scalar>& x, Index batch, Index length, const Conv1dShape& s,
                           const Scalar* torch_weight, const ConstRowMatrixRef<Scalar>& dy, RowMatrixRef<Scalar> dx,
                           Scalar* dweight, Scalar* dbias) {
  detail::check_conv1d("conv1d_backward_naive", x, dy, batch, length, s);
  detail::check_shape("conv1d_backward_naive", "dx", dx, x.rows(), x.cols());
  const Index out_len = s.out_length(length), cin = s.in_per_group(), cout = s.out_per_group();
  dx.setZero();
  std::fill(dweight, dweight + s.out_channels * cin * s.kernel, Scalar(0));
  if (dbias != nullptr) std::fill(dbias, dbias + s.out_channels, Scalar(0));
  for (Index b = 0; b < batch; ++b) {
    for (Index i = 0; i < out_len; ++i) {
      for (Index o = 0; o < s.out_channels; ++o) {
        const Index g = o / cout;
        const Scalar d = dy(b * out_len + i, o);
        if (dbias != nullptr) dbias[o] += d;
        for (Index t = 0; t < s.kernel; ++t) {
          const Index src = i + t - s.left_padding();
          if (src < 0 || src >= length) continue;
          for (Index c = 0; c < cin; ++c) {
            dx(b * length + src, g * cin + c) += torch_weight[(o * cin + c) * s.kernel + t] * d;
            dweight[(o * cin + c) * s.kernel + t] += d * x(b * length + src, g * cin + c);
          }
        }
      }
    }
  }
}

}  // namespace kernels
}  // namespace c2f
