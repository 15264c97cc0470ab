// The obviously-correct twin of HMHA's windowed kernels: every level as full softmax attention
// (kernels::sdpa_naive) under an explicit [L, L] (or [m, m]) keep mask built position by position from
// the definition — and, for training, their backward passes as kernels::sdpa_backward_naive under the
// same masks. Test-only: it materialises L × L masks and scores.
#pragma once

#include "c2f/kernels/sdpa.hpp"
#include "c2f/kernels/sdpa_backward.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/mask_view.hpp"

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

/// dense_attention's gradients for dout [batch·lq, dim] (sdpa_backward_naive under the same mask), ADDED
/// to dq [batch·lq, dim] and dk, dv [batch·lk, dim].
template <class Scalar>
void dense_attention_backward_add(const c2f::RowMatrix<Scalar>& q, const c2f::RowMatrix<Scalar>& k,
                                  const c2f::RowMatrix<Scalar>& v, const c2f::RowMatrix<Scalar>& dout, c2f::Index batch,
                                  c2f::Index heads, const c2f::BoolTensor2& keep, c2f::RowMatrix<Scalar>& dq,
                                  c2f::RowMatrix<Scalar>& dk, c2f::RowMatrix<Scalar>& dv) {
  const c2f::Index dim = q.cols(), dh = dim / heads, lq = keep.dimension(0), lk = keep.dimension(1);
  const c2f::AttnMask<Scalar> mask = c2f::AttnMask<Scalar>::keep(keep);
  const c2f::MaskView<Scalar> plan(mask, c2f::KeyPaddingMask<Scalar>(), batch, heads, lq, lk);
  c2f::RowMatrix<Scalar> gq(q.rows(), dim), gk(k.rows(), dim), gv(v.rows(), dim);
  const auto in = [&](const c2f::RowMatrix<Scalar>& m, c2f::Index seq) {
    return c2f::kernels::heads_view<const Scalar>(m.data(), batch, seq, dim, 0, heads, dh);
  };
  const auto out = [&](c2f::RowMatrix<Scalar>& m, c2f::Index seq) {
    return c2f::kernels::heads_view<Scalar>(m.data(), batch, seq, dim, 0, heads, dh);
  };
  c2f::kernels::sdpa_backward_naive<Scalar>(in(q, lq), in(k, lk), in(v, lk), in(dout, lq), out(gq, lq), out(gk, lk),
                                            out(gv, lk), plan, c2f::kernels::AttnDropout(),
                                            c2f::kernels::default_scale<Scalar>(dh), c2f::kernels::with_threads(1));
  dq += gq;
  dk += gk;
  dv += gv;
}

/// Level 1's keys of each query: its window (causal: up to itself).
inline c2f::BoolTensor2 local_keep(c2f::Index length, c2f::Index window, bool causal) {
  c2f::BoolTensor2 keep(length, length);
  for (c2f::Index i = 0; i < length; ++i) {
    for (c2f::Index t = 0; t < length; ++t) keep(i, t) = i / window == t / window && (!causal || t <= i);
  }
  return keep;
}

/// Causal level 2's summaries of each query: the windows before its own.
inline c2f::BoolTensor2 summary_keep(c2f::Index length, c2f::Index window) {
  const c2f::Index m = (length + window - 1) / window;
  c2f::BoolTensor2 keep(length, m);
  for (c2f::Index i = 0; i < length; ++i) {
    for (c2f::Index j = 0; j < m; ++j) keep(i, j) = j < i / window;
  }
  return keep;
}

/// Level 3's keys of each query: S(i) = {i} ∪ {i ± 2^p} (causal: {i} ∪ {i − 2^p}) inside [0, length).
inline c2f::BoolTensor2 global_keep(c2f::Index length, bool causal) {
  c2f::BoolTensor2 keep(length, length);
  keep.setConstant(false);
  for (c2f::Index i = 0; i < length; ++i) {
    keep(i, i) = true;
    for (c2f::Index step = 1; step < length; step *= 2) {
      if (i - step >= 0) keep(i, i - step) = true;
      if (!causal && i + step < length) keep(i, i + step) = true;
    }
  }
  return keep;
}

/// Window means of x [batch·length, dim] by one sum per window, and (`backward`) the token gradient of
/// d(means): each token gets its window's row divided by the window's real tokens.
template <class Scalar>
c2f::RowMatrix<Scalar> window_means(const c2f::RowMatrix<Scalar>& x, c2f::Index batch, c2f::Index length,
                                    c2f::Index window) {
  const c2f::Index m = (length + window - 1) / window;
  c2f::RowMatrix<Scalar> means = c2f::RowMatrix<Scalar>::Zero(batch * m, x.cols());
  for (c2f::Index b = 0; b < batch; ++b) {
    for (c2f::Index t = 0; t < length; ++t) {
      const c2f::Index j = t / window, count = std::min(window, length - j * window);
      means.row(b * m + j) += x.row(b * length + t) / Scalar(count);
    }
  }
  return means;
}
template <class Scalar>
void window_means_backward_add(const c2f::RowMatrix<Scalar>& dmeans, c2f::Index batch, c2f::Index length,
                               c2f::Index window, c2f::RowMatrix<Scalar>& dx) {
  const c2f::Index m = (length + window - 1) / window;
  for (c2f::Index b = 0; b < batch; ++b) {
    for (c2f::Index t = 0; t < length; ++t) {
      const c2f::Index j = t / window, count = std::min(window, length - j * window);
      dx.row(b * length + t) += dmeans.row(b * m + j) / Scalar(count);
    }
  }
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
    dense_attention(q, k, v, batch, heads, local_keep(length, window, causal), part);
    o += part;
  }
  if (levels.cross && length > 0) {
    const Index m = (length + window - 1) / window;
    const c2f::RowMatrix<Scalar> qm = window_means(q, batch, length, window),
                                 km = window_means(k, batch, length, window),
                                 vm = window_means(v, batch, length, window);
    if (causal) {
      // Token i, with its own query, over the summaries of the windows before its own.
      dense_attention(q, km, vm, batch, heads, summary_keep(length, window), part);
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
    dense_attention(q, k, v, batch, heads, global_keep(length, causal), part);
    o += part;
  }
  return o;
}

/// The gradients of hmha_dense's o for dout = dL/do [batch·length, dim]: dq, dk, dv (overwritten).
template <class Scalar>
void hmha_dense_backward(const c2f::RowMatrix<Scalar>& q, const c2f::RowMatrix<Scalar>& k,
                         const c2f::RowMatrix<Scalar>& v, const c2f::RowMatrix<Scalar>& dout, c2f::Index batch,
                         c2f::Index length, c2f::Index heads, c2f::Index window, bool causal, c2f::HMHALevels levels,
                         c2f::RowMatrix<Scalar>& dq, c2f::RowMatrix<Scalar>& dk, c2f::RowMatrix<Scalar>& dv) {
  using c2f::Index;
  const Index dim = q.cols();
  dq = dk = dv = c2f::RowMatrix<Scalar>::Zero(batch * length, dim);
  if (levels.local)
    dense_attention_backward_add(q, k, v, dout, batch, heads, local_keep(length, window, causal), dq, dk, dv);
  if (levels.cross && length > 0) {
    const Index m = (length + window - 1) / window;
    const c2f::RowMatrix<Scalar> km = window_means(k, batch, length, window),
                                 vm = window_means(v, batch, length, window);
    c2f::RowMatrix<Scalar> dkm = c2f::RowMatrix<Scalar>::Zero(batch * m, dim), dvm = dkm;
    if (causal) {
      dense_attention_backward_add(q, km, vm, dout, batch, heads, summary_keep(length, window), dq, dkm, dvm);
    } else {
      // o2[t] = c[window of t]: dc[j] sums dout over window j.
      const c2f::RowMatrix<Scalar> qm = window_means(q, batch, length, window);
      c2f::RowMatrix<Scalar> dc = c2f::RowMatrix<Scalar>::Zero(batch * m, dim), dqm = dc;
      for (Index b = 0; b < batch; ++b) {
        for (Index t = 0; t < length; ++t) dc.row(b * m + t / window) += dout.row(b * length + t);
      }
      c2f::BoolTensor2 keep(m, m);
      keep.setConstant(true);
      dense_attention_backward_add(qm, km, vm, dc, batch, heads, keep, dqm, dkm, dvm);
      window_means_backward_add(dqm, batch, length, window, dq);
    }
    window_means_backward_add(dkm, batch, length, window, dk);
    window_means_backward_add(dvm, batch, length, window, dv);
  }
  if (levels.global) dense_attention_backward_add(q, k, v, dout, batch, heads, global_keep(length, causal), dq, dk, dv);
}

}  // namespace c2f_test
