// c2f — softmax over one row of scores in which -inf marks a masked key.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace c2f {
namespace detail {

/// What Eigen's vectorised exp returns for −inf. Eigen 3.4 clamps the argument of its packet exp, so
/// exp(−inf) is ~3e-39 (float, SSE) or ~6e-309 (double) instead of 0; with AVX it may be 0.
template <class Scalar>
Scalar vectorized_exp_floor() {
  static const Scalar floor = [] {
    Eigen::Array<Scalar, 16, 1> a = Eigen::Array<Scalar, 16, 1>::Constant(-std::numeric_limits<Scalar>::infinity());
    const Eigen::Array<Scalar, 16, 1> e = a.exp();
    return e.maxCoeff();
  }();
  return floor;
}

/// row ← exp(row − shift), with masked (−inf) entries exactly 0 and the whole row vectorised:
/// max(exp(x) − floor, 0) where floor = vectorized_exp_floor() (Eigen 3.4's select() is not
/// vectorised, and a scalar expf per score costs a fifth of a whole attention forward). Subtracting
/// the floor moves only values below ~1e-38 (float) / ~1e-307 (double); NaN stays NaN.
template <class Row, class Scalar>
void exp_shifted(Row&& row, Scalar shift) {
  const Scalar floor = vectorized_exp_floor<Scalar>();
  // max(·, 0) that keeps NaN (Eigen 3.4 exposes NaN-propagating max only as this functor). The 0 also
  // catches scalar tail elements, whose std::exp(−inf) is an exact 0 and would go to −floor.
  using NanMax = Eigen::internal::scalar_max_op<Scalar, Scalar, Eigen::PropagateNaN>;
  using Plain = typename std::decay_t<Row>::PlainObject;
  row.array() = ((row.array() - shift).exp() - floor).binaryExpr(Plain::Zero(row.rows(), row.cols()).array(), NanMax());
}

/// One online-softmax step over a block of scores s [rows, cols] (−inf = masked): updates each row's
/// running max m and sum l, turns s into exp(s − the new max) and sets alpha to the factor earlier
/// accumulations of the row must be scaled by. Returns whether any alpha differs from 1.
template <class Scores, class Max, class Sum, class Alpha>
bool online_softmax_step(Scores& s, Max&& m, Sum&& l, Alpha&& alpha) {
  using Scalar = typename std::decay_t<Scores>::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  bool rescale = false;
  for (Index r = 0; r < s.rows(); ++r) {
    const Scalar m_new = std::max(m[r], s.row(r).maxCoeff());
    // All keys so far hidden: shift by 0, not by -inf (which would give exp(-inf + inf) = NaN).
    const Scalar shift = m_new == kNegInf ? Scalar(0) : m_new;
    alpha[r] = std::exp(m[r] - shift);
    rescale = rescale || alpha[r] != Scalar(1);
    m[r] = m_new;
    exp_shifted(s.row(r), shift);
    l[r] = alpha[r] * l[r] + s.row(r).sum();
  }
  return rescale;
}

/// Normalised softmax of `row` in place. A row whose every entry is −inf (no visible key) becomes all
/// zeros and the function returns false; NaN counts as visible, so it propagates instead of vanishing.
/// `max_out` and `sum_out`, when given, receive the shift (the row's max) and the sum of the shifted
/// exponentials — what a later merge with another part of the same softmax needs (−inf and 0 when
/// nothing is visible).
template <class Row>
bool softmax_row(Row&& row, typename std::decay_t<Row>::Scalar* max_out = nullptr,
                 typename std::decay_t<Row>::Scalar* sum_out = nullptr) {
  using Scalar = typename std::decay_t<Row>::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  bool any_visible = false;
  for (Index j = 0; j < row.size(); ++j) any_visible = any_visible || !(row(j) == kNegInf);
  if (!any_visible) {
    row.setZero();
    if (max_out != nullptr) *max_out = kNegInf;
    if (sum_out != nullptr) *sum_out = Scalar(0);
    return false;
  }
  const Scalar max = row.maxCoeff();
  exp_shifted(row, max);
  const Scalar sum = row.sum();
  row /= sum;
  if (max_out != nullptr) *max_out = max;
  if (sum_out != nullptr) *sum_out = sum;
  return true;
}

}  // namespace detail
}  // namespace c2f
