// c2f kernels — 1-D convolution with torch.nn.Conv1d's semantics (cross-correlation, stride 1,
// zero padding, groups) on [batch, length, channels] rows, computed as one GEMM per tap.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/checks.hpp"
#include "c2f/detail/packed_gemm.hpp"
#include "c2f/detail/parallel.hpp"
#include "c2f/kernels/kernel_options.hpp"

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
      detail::fail("Conv1d: in_channels, out_channels, kernel_size and groups must be positive and padding >= 0, got in=",
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
      for (Index t = 0; t < s.kernel; ++t) taps(t * s.out_channels + o, c) = torch_weight[(o * s.in_per_group() + c) * s.kernel + t];
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
constexpr Index kConv1dRowChunk = 128;

/// Heap bytes conv1d() holds while it runs on sequences of `length`: every tap of every group packed for
/// the micro-kernel on the packed path, else nothing.
template <class Scalar>
std::size_t conv1d_workspace_bytes(Index length, const Conv1dShape& s) {
  const bool packed = c2f::detail::kPackedGemm && s.out_length(length) >= c2f::detail::kPackedGemmMinRows;
  return packed ? static_cast<std::size_t>(s.kernel * s.groups) *
                      c2f::detail::PackedB<Scalar>::bytes(s.in_per_group(), s.out_per_group())
                : 0;
}

/// y[b, i, o] = bias[o] + Σ_t Σ_c W[o, c, t] · x[b, i + t − left_padding, g(o)·in/groups + c] (zero
/// outside the input), overwritten. x [batch·length, in], taps from conv1d_taps(), bias [out] or nullptr,
/// y [batch·out_length, out] (may be a column block of a wider matrix). From kPackedGemmMinRows output
/// rows on (where the build has detail::kPackedGemm) every tap of every group is packed once per call
/// and runs on the register-blocked micro-kernel, added tap by tap into the output; below, Eigen's
/// product. Either way the bits depend on the shapes only, not on the thread count.
template <class Scalar>
void conv1d(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index batch, Index length, const Conv1dShape& s,
            const RowMatrix<Scalar>& taps, const Scalar* bias, Eigen::Ref<RowMatrix<Scalar>> y,
            const KernelOptions& options) {
  detail::check_conv1d("conv1d", x, y, batch, length, s);
  detail::check_shape("conv1d", "taps", taps, s.kernel * s.out_channels, s.in_per_group());
  const Index out_len = s.out_length(length), cin = s.in_per_group(), cout = s.out_per_group();
  const Index chunks_per_batch = (out_len + kConv1dRowChunk - 1) / kConv1dRowChunk;
  const double work = 2.0 * static_cast<double>(batch * out_len) * static_cast<double>(s.kernel * cin * s.out_channels);
  const bool packed = c2f::detail::kPackedGemm && out_len >= c2f::detail::kPackedGemmMinRows;
  std::vector<c2f::detail::PackedB<Scalar>> packed_taps(packed ? static_cast<std::size_t>(s.kernel * s.groups) : 0);
  for (Index t = 0; packed && t < s.kernel; ++t) {
    for (Index g = 0; g < s.groups; ++g) {
      packed_taps[static_cast<std::size_t>(t * s.groups + g)].pack(
          taps.block(t * s.out_channels + g * cout, 0, cout, cin).transpose(), options.num_threads());
    }
  }
  c2f::detail::parallel_for(batch * chunks_per_batch, options.num_threads(), work, [&](Index task, int) {
    const Index b = task / chunks_per_batch;
    const Index r0 = (task % chunks_per_batch) * kConv1dRowChunk, r1 = std::min(out_len, r0 + kConv1dRowChunk);
    typename Eigen::Ref<RowMatrix<Scalar>>::RowsBlockXpr out = y.middleRows(b * out_len + r0, r1 - r0);
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
        if (packed) {
          const Scalar* in = x.data() + (b * length + i0 + shift) * x.outerStride() + g * cin;
          c2f::detail::packed_gemm_range<Scalar>(in, x.outerStride(), i1 - i0, packed_taps[static_cast<std::size_t>(t * s.groups + g)],
                                                 0, cin, 0, cout, nullptr, true, &out(i0 - r0, g * cout), y.outerStride());
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
void conv1d_naive(const Eigen::Ref<const RowMatrix<Scalar>>& x, Index batch, Index length, const Conv1dShape& s,
                  const Scalar* torch_weight, const Scalar* bias, Eigen::Ref<RowMatrix<Scalar>> y) {
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
          for (Index c = 0; c < cin; ++c) acc += torch_weight[(o * cin + c) * s.kernel + t] * x(b * length + src, g * cin + c);
        }
        y(b * out_len + i, o) = acc;
      }
    }
  }
}

}  // namespace kernels
}  // namespace c2f
