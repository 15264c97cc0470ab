// Random attention problems for the kernels' twin tests (test_kernels.cpp, test_train.cpp): q, k, v of
// awkward sizes and a random mask of every kind, plus the comparisons the twins use.
#pragma once

#include "c2f/kernels/heads_view.hpp"
#include "c2f/mask.hpp"
#include "support/random.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace c2f_test {

using c2f::Index;
using c2f::RowMatrix;

template <class Scalar>
double tolerance() {
  return std::is_same<Scalar, float>::value ? 1e-5 : 1e-12;
}

// Sizes that stress block edges: 1, primes, and one either side of the block sizes the tests pick.
const std::vector<Index> kAwkward = {1, 2, 3, 7, 13, 31, 32, 33, 37, 63, 64, 65, 97, 127, 128, 129, 257};

template <class Scalar>
void expect_close(const RowMatrix<Scalar>& got, const RowMatrix<Scalar>& want, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(got.rows(), want.rows()) << what;
  ASSERT_EQ(got.cols(), want.cols()) << what;
  for (Index i = 0; i < got.rows(); ++i) {
    for (Index j = 0; j < got.cols(); ++j) {
      const double g = got(i, j), w = want(i, j);
      ASSERT_LE(std::abs(g - w), atol + rtol * std::abs(w))
          << what << " at (" << i << ", " << j << "): got " << g << ", want " << w;
    }
  }
}

template <class Scalar>
bool bitwise_equal(const RowMatrix<Scalar>& a, const RowMatrix<Scalar>& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         (a.size() == 0 || std::memcmp(a.data(), b.data(), sizeof(Scalar) * static_cast<std::size_t>(a.size())) == 0);
}

// One random attention problem: q/k/v in [batch·seq, heads·dim] matrices, and a random mask pair.
template <class Scalar>
struct Problem {
  Index batch, heads, lq, lk, dk, dv;
  RowMatrix<Scalar> q, k, v;
  c2f::AttnMask<Scalar> attn;
  c2f::KeyPaddingMask<Scalar> pad;
  std::string description;

  c2f::kernels::HeadsView<const Scalar> qv() const { return view(q, lq, dk); }
  c2f::kernels::HeadsView<const Scalar> kv() const { return view(k, lk, dk); }
  c2f::kernels::HeadsView<const Scalar> vv() const { return view(v, lk, dv); }
  c2f::kernels::HeadsView<const Scalar> view(const RowMatrix<Scalar>& m, Index seq, Index dim) const {
    return c2f::kernels::heads_view<const Scalar>(m.data(), batch, seq, heads * dim, 0, heads, dim);
  }
  Scalar scale() const { return c2f::kernels::default_scale<Scalar>(dk); }
  c2f::kernels::HeadsView<Scalar> out_view(RowMatrix<Scalar>& m) const {
    return c2f::kernels::heads_view<Scalar>(m.data(), batch, lq, heads * dv, 0, heads, dv);
  }
};

template <class Scalar>
Problem<Scalar> random_problem(TestRng& rng, int rep) {
  Problem<Scalar> p;
  p.batch = rng.uniform_int(1, 3);
  p.heads = rng.uniform_int(1, 3);
  p.lq = rng.pick(kAwkward);
  p.lk = rng.coin(0.3) ? p.lq : rng.pick(kAwkward);
  p.dk = rng.pick(std::vector<Index>{1, 3, 8, 16});
  p.dv = rng.coin() ? p.dk : rng.pick(std::vector<Index>{1, 5, 8});
  p.q = rng.matrix<Scalar>(p.batch * p.lq, p.heads * p.dk, 2.0);
  p.k = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dk, 2.0);
  p.v = rng.matrix<Scalar>(p.batch * p.lk, p.heads * p.dv);
  std::ostringstream d;
  d << "rep " << rep << ": batch=" << p.batch << " heads=" << p.heads << " lq=" << p.lq << " lk=" << p.lk
    << " dk=" << p.dk << " dv=" << p.dv;
  const int attn_kind = static_cast<int>(rng.uniform_int(0, 4));
  const Index n = rng.pick(std::vector<Index>{1, p.batch, p.batch * p.heads});
  if (attn_kind == 1) {
    const Index diagonal = rng.pick(std::vector<Index>{0, 0, -1, 1, -5, 40});
    p.attn = c2f::AttnMask<Scalar>::causal(diagonal);
    d << " mask=causal(" << diagonal << ")";
  } else if (attn_kind == 2 || attn_kind == 3) {
    c2f::BoolTensor3 m(n, p.lq, p.lk);
    const double density = rng.uniform(0.05, 0.95);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = rng.coin(density);
    p.attn = attn_kind == 2 ? c2f::AttnMask<Scalar>::keep(m) : c2f::AttnMask<Scalar>::ignore(m);
    d << (attn_kind == 2 ? " mask=keep" : " mask=ignore") << "[n=" << n << "] density=" << density;
  } else if (attn_kind == 4) {
    c2f::Tensor3<Scalar> m(n, p.lq, p.lk);
    for (Index i = 0; i < m.size(); ++i) {
      m.data()[i] = rng.coin(0.2) ? -std::numeric_limits<Scalar>::infinity() : static_cast<Scalar>(rng.normal());
    }
    p.attn = c2f::AttnMask<Scalar>::additive(m);
    d << " mask=additive[n=" << n << "]";
  }
  const int pad_kind = static_cast<int>(rng.uniform_int(0, 3));
  if (pad_kind == 1) {
    std::vector<Index> lengths;
    for (Index b = 0; b < p.batch; ++b) lengths.push_back(rng.uniform_int(0, p.lk));
    p.pad = c2f::KeyPaddingMask<Scalar>::lengths(lengths);
    d << " pad=lengths";
  } else if (pad_kind == 2) {
    c2f::BoolTensor2 m(p.batch, p.lk);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = rng.coin(0.3);
    p.pad = c2f::KeyPaddingMask<Scalar>::ignore(m);
    d << " pad=ignore";
  } else if (pad_kind == 3) {
    Eigen::Tensor<Scalar, 2, Eigen::RowMajor> m(p.batch, p.lk);
    for (Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<Scalar>(rng.normal());
    p.pad = c2f::KeyPaddingMask<Scalar>::additive(m);
    d << " pad=additive";
  }
  p.description = d.str();
  return p;
}

}  // namespace c2f_test
