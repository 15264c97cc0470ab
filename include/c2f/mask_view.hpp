// c2f — MaskView: the masks of one attention problem, checked against its sizes, in the two forms
// kernels read them: element by element (reference kernels) and block by block (fast kernels).
//
// A MaskView combines an attention mask, a key padding mask (see c2f/mask.hpp for both) and, optionally,
// a causal rule (query i sees keys j <= i + diagonal): a key is masked when any of them masks it, and
// additive values add. It is what every public attention kernel takes; it does not own the masks, which
// must outlive it. An empty MaskView masks nothing.
#pragma once

#include "c2f/mask.hpp"

#include <algorithm>
#include <limits>

namespace c2f {

/// What a block of (query, key) pairs needs from the mask.
enum class BlockMask {
  Skip,     ///< every pair is masked: the block contributes nothing
  Clear,    ///< no pair is masked and nothing is added: use the scores as they are
  Partial,  ///< apply the mask to the block
};

template <class Scalar>
class MaskView {
 public:
  static constexpr Scalar kMasked = -std::numeric_limits<Scalar>::infinity();

  /// No mask at all.
  MaskView() = default;

  /// Checks both masks against [batch, heads, queries, keys]; throws std::invalid_argument naming the
  /// expected and the given shape. With `causal`, query i also sees only keys j <= i (top-left aligned).
  MaskView(const AttnMask<Scalar>& attn, const KeyPaddingMask<Scalar>& padding, Index batch, Index heads, Index queries,
           Index keys, bool causal = false)
      : attn_(attn.is_none() || attn.kind() == MaskKind::Causal ? nullptr : &attn),
        pad_(padding.is_none() ? nullptr : &padding),
        batch_(batch),
        heads_(heads),
        queries_(queries),
        keys_(keys),
        mask_queries_(queries) {
    // A causal attention mask and the causal rule are one edge: the stricter diagonal wins.
    if (attn.kind() == MaskKind::Causal) causal_edge(attn.diagonal());
    if (causal) causal_edge(0);
    if (attn_ && attn.kind() == MaskKind::RelativePosition) {
      const std::array<Index, 3>& d = attn.dims();
      if (d[0] != heads || d[1] != queries || d[2] != keys) {
        detail::fail("relative position bias for ", d[0], " heads on ", attn.relative_grid()[0], " x ",
                     attn.relative_grid()[1], " = ", d[1], " positions needs ", heads,
                     " heads and queries = keys = positions, got ", heads, " heads, ", queries, " queries and ", keys,
                     " keys");
      }
    } else if (attn_) {
      const std::array<Index, 3>& d = attn.dims();
      const bool n_ok = d[0] == 1 || d[0] == batch || d[0] == batch * heads;
      if (!n_ok || d[1] != queries || d[2] != keys) {
        detail::fail("attention mask must be [queries, keys] = ", detail::shape_string({queries, keys}),
                     " or [n, queries, keys] with n = 1, batch (", batch, ") or batch*heads (", batch * heads,
                     "), got ",
                     d[0] == 1 ? detail::shape_string({d[1], d[2]}) : detail::shape_string({d[0], d[1], d[2]}));
      }
    }
    if (pad_) {
      const std::array<Index, 2>& d = padding.dims();
      if (padding.kind() == MaskKind::Lengths) {
        if (d[0] != batch) detail::fail("key padding lengths must be one per batch item (", batch, "), got ", d[0]);
        for (Index len : padding.valid_lengths()) {
          if (len < 0 || len > keys) detail::fail("key padding lengths must lie in [0, keys = ", keys, "], got ", len);
        }
      } else if (d[0] != batch || d[1] != keys) {
        detail::fail("key padding mask must be [batch, keys] = ", detail::shape_string({batch, keys}), ", got ",
                     detail::shape_string({d[0], d[1]}));
      }
    }
  }

  /// Masks of one call, in the library's one masks type: attn_mask and key_padding_mask.
  MaskView(const Masks<Scalar>& masks, Index batch, Index heads, Index queries, Index keys, bool causal = false)
      : MaskView(masks.attn_mask(), masks.key_padding_mask(), batch, heads, queries, keys, causal) {}

  /// The view of query rows [first, first + count) of this problem: row i of the result is row first + i
  /// here (its causal edge, its rows of a tensor mask, its grid position in a relative position bias).
  /// For a kernel that runs on a slice of the queries (c2f/dist shards them); throws unless
  /// 0 <= first <= first + count <= queries().
  MaskView rows(Index first, Index count) const {
    if (first < 0 || count < 0 || first > queries_ - count) {
      detail::fail("MaskView::rows: rows [first, first + count) within the ", queries_, " queries, got first ", first,
                   " and count ", count);
    }
    MaskView v = *this;
    v.row0_ += first;
    v.queries_ = count;
    // j − (i + first) > diagonal  ⇔  j − i > diagonal + first; diagonal stays clamped to ±2^62.
    if (causal_) v.diagonal_ = std::min(kFar, diagonal_ + first);
    return v;
  }

  bool empty() const { return attn_ == nullptr && pad_ == nullptr && !causal_; }
  /// The problem's sizes the masks were checked against.
  Index batch() const { return batch_; }
  Index heads() const { return heads_; }
  Index queries() const { return queries_; }
  Index keys() const { return keys_; }

  /// What is added to score (b, h, i, j): 0, an additive value, or -inf when masked (add it with
  /// cpu::add_bias, so that −inf masks a NaN score too).
  Scalar bias(Index b, Index h, Index i, Index j) const {
    Scalar out = Scalar(0);
    if (causal_ && j - i > diagonal_) return kMasked;
    if (attn_) {
      switch (attn_->kind()) {
        case MaskKind::Additive:
          out += attn_->additive_values()[attn_index(b, h, i, j)];
          break;
        case MaskKind::RelativePosition:
          out += attn_->relative_position_bias(h, row0_ + i, j);
          break;
        default:
          if (!attn_->keep_flags()[attn_index(b, h, i, j)]) return kMasked;
      }
    }
    if (pad_) {
      switch (pad_->kind()) {
        case MaskKind::Lengths:
          if (j >= pad_->valid_lengths()[static_cast<std::size_t>(b)]) return kMasked;
          break;
        case MaskKind::Additive:
          out += pad_->additive_values()[pad_index(b, j)];
          break;
        default:
          if (!pad_->keep_flags()[pad_index(b, j)]) return kMasked;
      }
    }
    return out;
  }

  /// Classifies the block of queries [i0, i0+ni) × keys [j0, j0+nj) of (b, h).
  BlockMask classify(Index b, Index i0, Index ni, Index j0, Index nj) const {
    BlockMask out = BlockMask::Clear;
    if (causal_) {
      // Key j is visible from row i when j − i <= diagonal (no sum can overflow: |diagonal| <= 2^62).
      if (j0 - (i0 + ni - 1) > diagonal_) return BlockMask::Skip;  // past the last row's edge
      if (j0 + nj - 1 - i0 > diagonal_) out = BlockMask::Partial;
    }
    if (attn_) out = BlockMask::Partial;
    if (pad_) {
      if (pad_->kind() == MaskKind::Lengths) {
        const Index len = pad_->valid_lengths()[static_cast<std::size_t>(b)];
        if (j0 >= len) return BlockMask::Skip;
        if (j0 + nj > len) out = BlockMask::Partial;
      } else {
        out = BlockMask::Partial;
      }
    }
    return out;
  }

  /// Adds the mask to the score block S = scores[b, h, i0:i0+rows, j0:j0+cols] in place.
  template <class Derived>
  void apply(Index b, Index h, Index i0, Index j0, Eigen::MatrixBase<Derived>& S) const {
    const Index rows = S.rows();
    const Index cols = S.cols();
    if (causal_) {
      for (Index r = 0; r < rows; ++r) {
        // The first hidden column: key i0 + r + diagonal + 1, clamped to [0, cols].
        const Index edge = i0 + r - j0;  // |edge| < 2^62
        const Index first = diagonal_ >= cols - edge ? cols : std::max<Index>(0, edge + diagonal_ + 1);
        for (Index c = first; c < cols; ++c) S(r, c) = kMasked;
      }
    }
    if (attn_) {
      switch (attn_->kind()) {
        case MaskKind::Additive:
          for (Index r = 0; r < rows; ++r) {
            const Scalar* add = attn_->additive_values().data() + attn_index(b, h, i0 + r, j0);
            for (Index c = 0; c < cols; ++c) S(r, c) = add[c] == kMasked ? kMasked : S(r, c) + add[c];
          }
          break;
        case MaskKind::RelativePosition:
          apply_relative_position(h, row0_ + i0, j0, S);
          break;
        default:
          for (Index r = 0; r < rows; ++r) {
            const std::uint8_t* keep = attn_->keep_flags().data() + attn_index(b, h, i0 + r, j0);
            for (Index c = 0; c < cols; ++c) {
              if (!keep[c]) S(r, c) = kMasked;
            }
          }
      }
    }
    if (pad_) {
      switch (pad_->kind()) {
        case MaskKind::Lengths: {
          const Index first = std::max<Index>(0, pad_->valid_lengths()[static_cast<std::size_t>(b)] - j0);
          for (Index r = 0; r < rows; ++r) {
            for (Index c = first; c < cols; ++c) S(r, c) = kMasked;
          }
          break;
        }
        case MaskKind::Additive: {
          const Scalar* add = pad_->additive_values().data() + pad_index(b, j0);
          for (Index r = 0; r < rows; ++r) {
            for (Index c = 0; c < cols; ++c) S(r, c) = add[c] == kMasked ? kMasked : S(r, c) + add[c];
          }
          break;
        }
        default: {
          const std::uint8_t* keep = pad_->keep_flags().data() + pad_index(b, j0);
          for (Index r = 0; r < rows; ++r) {
            for (Index c = 0; c < cols; ++c) {
              if (!keep[c]) S(r, c) = kMasked;
            }
          }
        }
      }
    }
  }

 private:
  /// A diagonal beyond ±2^62 hides (or shows) every key of any problem c2f can index: clamped there, so
  /// that no index arithmetic on it can overflow.
  static constexpr Index kFar = Index(1) << 62;
  void causal_edge(Index diagonal) {
    diagonal = std::max(-kFar, std::min(kFar, diagonal));
    diagonal_ = causal_ ? std::min(diagonal_, diagonal) : diagonal;
    causal_ = true;
  }
  /// S(r, c) += bias of head h between positions i0 + r and j0 + c, walking the keys one grid row at a
  /// time: along a grid row the table entry falls by one per key.
  template <class Derived>
  void apply_relative_position(Index h, Index i0, Index j0, Eigen::MatrixBase<Derived>& S) const {
    const std::array<Index, 4>& g = attn_->relative_grid();
    const Index gw = g[1], mh = g[2], mw = g[3], row_entries = 2 * mw - 1;
    const Scalar* table = attn_->additive_values().data() + h * (2 * mh - 1) * row_entries;
    for (Index r = 0; r < S.rows(); ++r) {
      const Index ri = (i0 + r) / gw, ci = (i0 + r) % gw;
      for (Index c = 0; c < S.cols();) {
        const Index j = j0 + c, rj = j / gw, cj = j % gw;
        const Index run = std::min(S.cols() - c, gw - cj);  // keys left on grid row rj
        const Scalar* t = table + (ri - rj + mh - 1) * row_entries + (ci - cj + mw - 1);
        for (Index k = 0; k < run; ++k) S(r, c + k) += t[-k];
        c += run;
      }
    }
  }

  std::size_t attn_index(Index b, Index h, Index i, Index j) const {
    const Index n = attn_->dims()[0];
    const Index slice = n == 1 ? 0 : (n == batch_ * heads_ ? b * heads_ + h : b);
    return static_cast<std::size_t>((slice * mask_queries_ + row0_ + i) * keys_ + j);
  }
  std::size_t pad_index(Index b, Index j) const { return static_cast<std::size_t>(b * keys_ + j); }

  const AttnMask<Scalar>* attn_ = nullptr;  ///< a tensor mask (keep / ignore / additive), or none
  const KeyPaddingMask<Scalar>* pad_ = nullptr;
  bool causal_ = false;  ///< key j masked for query i when j > i + diagonal_
  Index diagonal_ = 0;
  Index batch_ = 0;
  Index heads_ = 0;
  Index queries_ = 0;
  Index keys_ = 0;
  Index mask_queries_ = 0;  ///< the query rows of the tensor mask (queries_ unless a view of rows())
  Index row0_ = 0;          ///< query row 0 is row row0_ of the masks (rows())
};

}  // namespace c2f
