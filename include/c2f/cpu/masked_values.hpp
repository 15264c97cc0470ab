// c2f — the value product of attention with the values of masked keys left out, NaN and Inf included.
//
// Attention adds p · v over a block of keys, where p is 0 for every key a mask hides from a row. When
// a hidden key's value row holds NaN or Inf, 0 · NaN = NaN would reach the output of a row that never
// saw the key — a future token poisoning the past. So a kernel asks find() whether a block's value rows
// are all finite (one pass over the block, and only for blocks a mask cuts through); when they are not,
// it records before the softmax which rows hide each non-finite key (score −inf), and product() runs the
// same GEMM on a copy of the block with those rows zeroed — the same bits as with finite values for every
// row that does not see them — then adds each non-finite row's true contribution to the rows that see
// it, so NaN in a visible key still propagates.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/packed_gemm.hpp"

#include <algorithm>
#include <limits>
#include <vector>

namespace c2f {
namespace cpu {

template <class Scalar>
class MaskedValues {
 public:
  /// Whether v (a [keys, dv] block of value rows) has non-finite rows; remembers which.
  template <class V>
  bool find(const V& v) {
    bad_.clear();
    if (v.allFinite()) return false;
    for (Index j = 0; j < v.rows(); ++j) {
      if (!v.row(j).allFinite()) bad_.push_back(j);
    }
    return true;
  }

  /// Before the softmax: which rows of the scores s [rows, keys] hide each non-finite key (score −inf).
  template <class S>
  void remember_hidden(const S& s) {
    rows_ = s.rows();
    hidden_.assign(bad_.size() * static_cast<std::size_t>(rows_), 0);
    for (std::size_t k = 0; k < bad_.size(); ++k) {
      for (Index r = 0; r < rows_; ++r) {
        hidden_[k * static_cast<std::size_t>(rows_) + static_cast<std::size_t>(r)] =
            s(r, bad_[k]) == -std::numeric_limits<Scalar>::infinity();
      }
    }
  }

  /// out = p · v (Add false) or out += p · v, with each non-finite row of v left out of the rows that
  /// hide it. p [rows, keys] are the softmax weights of the scores remember_hidden() saw.
  template <bool Add, class Out, class P, class V>
  void product(Out&& out, const P& p, const V& v) {
    clean_ = v;
    for (Index j : bad_) clean_.row(j).setZero();
    if constexpr (Add) {
      out.noalias() += p * clean_;
    } else {
      out.noalias() = p * clean_;
    }
    add_visible(out, p, v);
  }

  /// product<true>() for a kernel whose clean product is its own: `add(clean)` adds p · clean to out,
  /// clean the block with the non-finite rows zeroed, as the kernel adds p · v for a finite block (so the
  /// rows that hide those keys get that product's bits); then each non-finite row's true contribution.
  template <class Out, class P, class V, class Add>
  void product_add_with(Out&& out, const P& p, const V& v, Add&& add) {
    clean_ = v;
    for (Index j : bad_) clean_.row(j).setZero();
    add(static_cast<const RowMatrix<Scalar>&>(clean_));
    add_visible(out, p, v);
  }

  /// Sets m(r, j) = 0 for each non-finite row j of the last find() and each row r that hides it (the
  /// attention backward's dS, whose entries there are 0 · NaN from the hidden value's dP).
  template <class M>
  void zero_hidden(M&& m) const {
    for (std::size_t k = 0; k < bad_.size(); ++k) {
      for (Index r = 0; r < rows_; ++r) {
        if (hidden_[k * static_cast<std::size_t>(rows_) + static_cast<std::size_t>(r)]) m(r, bad_[k]) = 0;
      }
    }
  }

  /// product<true>() for a kernel whose clean product runs on packed_gemm over keys [j0, j0 + keys) of
  /// values packed from key 0 (sdpa_streaming's packed path): the clean copy's product on packed_gemm too,
  /// split where that packing splits its k-blocks, so a row that hides the non-finite keys gets the bits of
  /// the packed product on finite values. out [rows, dv] with contiguous rows; p's rows contiguous.
  template <class Out, class P, class V>
  void product_packed_add(Out&& out, const P& p, const V& v, Index j0) {
    using B = GemmBlocking<Scalar>;
    clean_ = v;
    for (Index j : bad_) clean_.row(j).setZero();
    const Index end = j0 + v.rows();
    for (Index a = j0; a < end;) {
      const Index b = std::min(end, (a / B::kKC + 1) * B::kKC);
      packed_.pack(clean_.middleRows(a - j0, b - a));
      packed_gemm_range<Scalar>(p.data() + (a - j0), p.outerStride(), p.rows(), packed_, 0, b - a, 0, v.cols(), nullptr,
                                true, out.data(), out.outerStride());
      a = b;
    }
    add_visible(out, p, v);
  }

 private:
  /// The true contribution of each non-finite value row to the rows that see it.
  template <class Out, class P, class V>
  void add_visible(Out& out, const P& p, const V& v) const {
    for (std::size_t k = 0; k < bad_.size(); ++k) {
      for (Index r = 0; r < rows_; ++r) {
        if (!hidden_[k * static_cast<std::size_t>(rows_) + static_cast<std::size_t>(r)]) {
          out.row(r) += p(r, bad_[k]) * v.row(bad_[k]);
        }
      }
    }
  }

  std::vector<Index> bad_;
  std::vector<unsigned char> hidden_;
  Index rows_ = 0;
  RowMatrix<Scalar> clean_;
  PackedB<Scalar> packed_;
};

/// score + bias, where a bias of −inf masks the key whatever the score (NaN included: NaN + −inf would
/// stay NaN and take part in the softmax).
template <class Scalar>
Scalar add_bias(Scalar score, Scalar bias) {
  return bias == -std::numeric_limits<Scalar>::infinity() ? bias : score + bias;
}

}  // namespace cpu
}  // namespace c2f
