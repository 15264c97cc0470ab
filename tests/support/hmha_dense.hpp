// The obviously-correct twin of HMHA's windowed kernels: every level as full softmax attention
// (kernels::sdpa_naive) under an explicit [L, L] (or [m, m]) keep mask built position by position from
// the definition. Test-only: it materialises L × L masks and scores.
#pragma once

#include "c2f/mask_view.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/layers/hmha.hpp"

namespace c2f_test {

/// Softmax attention of q [batch·lq, dim] over k, v [batch·lk, dim] under keep [lq, lk].
template <class Scalar>
void dense_attention(const c2f::RowMatrix<Scalar>& q, const c2f::RowMatrix<Scalar>& k, const c2f::RowMatrix<Scalar>& v,
                     c2f::Index batch, c2f::Index heads, const c2f::BoolTensor2& keep, c2f::RowMatrix<Scalar>& out) {
  const c2f::Index dim = q.cols(), dh = dim / heads, lq = keep.dimension(0), lk = keep.dimension(1);
  const c2f::AttnMask<Scalar> mask = c2f::AttnMask<Scalar>::keep(keep);
  const c2f::MaskView<Scalar> plan(mask, c2f::KeyPaddingMask<Scalar>(), batch, heads, lq, lk);
  out.resize(batch * lq, dim);
  c2f::kernels::KernelOptions options;
  options.num_threads(1);
  c2f::kernels::sdpa_naive<Scalar>(c2f::kernels::heads_view<const Scalar>(q.data(), batch, lq, dim, 0, heads, dh),
                                   c2f::kernels::heads_view<const Scalar>(k.data(), batch, lk, dim, 0, heads, dh),
                                   c2f::kernels::heads_view<const Scalar>(v.data(), batch, lk, dim, 0, heads, dh),
                                   c2f::kernels::heads_view<Scalar>(out.data(), batch, lq, dim, 0, heads, dh), plan,
                                   c2f::kernels::default_scale<Scalar>(dh), options);
}

/// o1 + o2 + o3 (the levels that are on) for projections q, k, v [batch·length, dim].
template <class Scalar>
c2f::RowMatrix<Scalar> hmha_dense(const c2f::RowMatrix<Scalar>& q, const c2f::RowMatrix<Scalar>& k,
                                  const c2f::RowMatrix<Scalar>& v, c2f::Index batch, c2f::Index length,
                                  c2f::Index heads, c2f::Index window, bool causal, c2f::HMHALevels levels) {
  using c2f::Index;
  const Index dim = q.cols();
  c2f::RowMatrix<Scalar> o = c2f::RowMatrix<Scalar>::Zero(batch * length, dim), part;
  if (levels.local) {
    c2f::BoolTensor2 keep(length, length);
    for (Index i = 0; i < length; ++i) {
      for (Index t = 0; t < length; ++t) keep(i, t) = i / window == t / window && (!causal || t <= i);
    }
    dense_attention(q, k, v, batch, heads, keep, part);
    o += part;
  }
  if (levels.cross && length > 0) {
    const Index m = (length + window - 1) / window;
    c2f::RowMatrix<Scalar> qm = c2f::RowMatrix<Scalar>::Zero(batch * m, dim), km = qm, vm = qm;
    for (Index b = 0; b < batch; ++b) {
      for (Index t = 0; t < length; ++t) {
        const Index j = t / window, count = std::min(window, length - j * window);
        qm.row(b * m + j) += q.row(b * length + t) / Scalar(count);
        km.row(b * m + j) += k.row(b * length + t) / Scalar(count);
        vm.row(b * m + j) += v.row(b * length + t) / Scalar(count);
      }
    }
    if (causal) {
      // Token i, with its own query, over the summaries of the windows before its own.
      c2f::BoolTensor2 keep(length, m);
      for (Index i = 0; i < length; ++i) {
        for (Index j = 0; j < m; ++j) keep(i, j) = j < i / window;
      }
      dense_attention(q, km, vm, batch, heads, keep, part);
      o += part;
    } else {
      c2f::BoolTensor2 keep(m, m);
      keep.setConstant(true);
      c2f::RowMatrix<Scalar> c;
      dense_attention(qm, km, vm, batch, heads, keep, c);
      for (Index b = 0; b < batch; ++b) {
        for (Index t = 0; t < length; ++t) o.row(b * length + t) += c.row(b * m + t / window);
      }
    }
  }
  if (levels.global) {
    c2f::BoolTensor2 keep(length, length);
    keep.setConstant(false);
    for (Index i = 0; i < length; ++i) {
      keep(i, i) = true;
      for (Index step = 1; step < length; step *= 2) {
        if (i - step >= 0) keep(i, i - step) = true;
        if (!causal && i + step < length) keep(i, i + step) = true;
      }
    }
    dense_attention(q, k, v, batch, heads, keep, part);
    o += part;
  }
  return o;
}

}  // namespace c2f_test
