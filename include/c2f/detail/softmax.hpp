// c2f — softmax over one row of scores in which -inf marks a masked key.
#pragma once

#include "c2f/core.hpp"

#include <limits>

namespace c2f {
namespace detail {

/// row ← exp(row − shift), with masked (−inf) entries exactly 0. Eigen 3.4's vectorised exp clamps
/// its argument and returns ~1e-38 (float) / ~1e-308 (double) for −inf, so masked keys are zeroed
/// explicitly rather than trusted to exp. NaN stays NaN.
template <class Row, class Scalar>
void exp_shifted(Row&& row, Scalar shift) {
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  row = (row.array() == kNegInf).select(Scalar(0), (row.array() - shift).exp()).matrix();
}

/// Normalised softmax of `row` in place. A row whose every entry is −inf (no visible key) becomes all
/// zeros and the function returns false; NaN counts as visible, so it propagates instead of vanishing.
template <class Row>
bool softmax_row(Row&& row) {
  using Scalar = typename std::decay_t<Row>::Scalar;
  constexpr Scalar kNegInf = -std::numeric_limits<Scalar>::infinity();
  bool any_visible = false;
  for (Index j = 0; j < row.size(); ++j) any_visible = any_visible || !(row(j) == kNegInf);
  if (!any_visible) {
    row.setZero();
    return false;
  }
  exp_shifted(row, row.maxCoeff());
  row /= row.sum();
  return true;
}

}  // namespace detail
}  // namespace c2f
