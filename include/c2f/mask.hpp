// c2f — the one mask vocabulary of the library.
//
// Every mask is one of these two types, so no caller has to remember whether `true` means "keep" or
// "drop"; a forward call takes them in one Masks struct (at the end of this file):
//
//   AttnMask<S>::keep(m)      boolean, true  = the query MAY attend to that key
//                             (torch.nn.functional.scaled_dot_product_attention's convention)
//   AttnMask<S>::ignore(m)    boolean, true  = the key is MASKED OUT for that query
//                             (torch.nn.MultiheadAttention's `attn_mask` convention)
//   AttnMask<S>::additive(m)  floating point, added to the scaled scores; -inf masks a key, and so
//                             does any value <= -3.4028235e38 (float's lowest, torch.finfo(float32).min,
//                             which Hugging Face uses as "-inf"), so both give the same result
//                             (a float `attn_mask` in either PyTorch API)
//   AttnMask<S>::causal()     query i sees keys j <= i (top-left aligned, like SDPA's is_causal);
//                             causal(diagonal) shifts the edge: keys j <= i + diagonal (diagonal -1 =
//                             strictly earlier keys; torch.triu(ones, diagonal + 1) in ignore form)
//   AttnMask<S>::relative_position(table, grid_h, grid_w, max_h, max_w)
//                             Swin's 2-D relative position bias, one per head, for queries = keys =
//                             the grid_h × grid_w positions of a grid flattened row-major: added to
//                             score (h, i, j) is table[(r_i − r_j + max_h − 1)·(2·max_w − 1) +
//                             (c_i − c_j + max_w − 1), h], (r, c) = (i / grid_w, i % grid_w). Stored as
//                             the table, never as [heads, queries, keys]
//
//   KeyPaddingMask<S>::keep(m) / ::ignore(m)   boolean [batch, keys], same conventions as above
//                             (nn.MultiheadAttention's `key_padding_mask`: true = ignore)
//   KeyPaddingMask<S>::additive(m)             floating point [batch, keys], added
//   KeyPaddingMask<S>::lengths(len)            keys j >= len[b] of batch b are ignored
//
// An attention mask is [queries, keys] (shared by every batch and head) or [n, queries, keys] with
// n = 1, batch (shared by the heads of a batch) or batch·heads (PyTorch's 3-D layout, index b·heads+h).
// Both masks may be given together; they combine like PyTorch does (a key is masked when either
// masks it; additive values add).
//
// A query row that ends up with no key to attend to outputs zeros (and zero weights) — never NaN.
// (nn.MultiheadAttention returns NaN there; SDPA, FlashAttention and ggml return zeros.)
#pragma once

#include "c2f/arg.hpp"
#include "c2f/core.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace c2f {

enum class MaskKind {
  None,              ///< nothing masked
  Keep,              ///< boolean, true = may attend (stored internally as keep flags)
  Ignore,            ///< boolean, true = masked out (converted to keep flags on construction)
  Additive,          ///< floating point, added to the scores
  Causal,            ///< key j visible from query i iff j <= i + diagonal
  Lengths,           ///< key padding by valid length per batch
  RelativePosition,  ///< per-head additive bias looked up by 2-D relative position (Swin)
};

using BoolTensor2 = Eigen::Tensor<bool, 2, Eigen::RowMajor>;
using BoolTensor3 = Eigen::Tensor<bool, 3, Eigen::RowMajor>;

namespace detail {

template <class T, int Rank>
std::vector<T> tensor_values(const Eigen::Tensor<T, Rank, Eigen::RowMajor>& t) {
  return std::vector<T>(t.data(), t.data() + t.size());
}

/// Additive mask values at or below float's lowest (torch.finfo(torch.float32).min, used as "-inf" by
/// Hugging Face) become -inf: such a key is masked, exactly as with -inf. Without this, a row whose
/// every key carried lowest() would softmax to a uniform average instead of the zeros of a masked row.
/// +inf and NaN have no meaning as a score bias (+inf would make the softmax inf/inf = NaN) and are
/// refused with std::invalid_argument.
template <class Scalar>
std::vector<Scalar> normalize_additive(std::vector<Scalar> v) {
  const Scalar threshold = static_cast<Scalar>(std::numeric_limits<float>::lowest());
  for (std::size_t i = 0; i < v.size(); ++i) {
    Scalar& x = v[i];
    if (std::isnan(x) || x == std::numeric_limits<Scalar>::infinity()) {
      fail("an additive mask's values must be finite or -inf, got ", x, " at element ", i);
    }
    if (x <= threshold) x = -std::numeric_limits<Scalar>::infinity();
  }
  return v;
}

/// Bools (or bytes, non-zero = true) → keep flags (1 = may attend); `invert` for the "true = ignore"
/// convention.
template <class T>
std::vector<std::uint8_t> bool_flags(const T* p, Index n, bool invert) {
  std::vector<std::uint8_t> out(static_cast<std::size_t>(n));
  for (Index i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = ((p[i] != T(0)) != invert) ? 1 : 0;
  return out;
}

}  // namespace detail

/// Attention mask over (query, key) pairs; see the file comment for the conventions.
template <class Scalar>
class AttnMask {
 public:
  /// No mask.
  AttnMask() = default;

  static AttnMask none() { return AttnMask(); }
  /// Query i sees keys j <= i + diagonal (default 0: itself and earlier keys).
  static AttnMask causal(Index diagonal = 0) {
    AttnMask m;
    m.kind_ = MaskKind::Causal;
    m.diagonal_ = diagonal;
    return m;
  }

  /// Boolean, true = may attend. [queries, keys] or [n, queries, keys].
  static AttnMask keep(const BoolTensor2& m) {
    return flags(MaskKind::Keep, {1, m.dimension(0), m.dimension(1)}, detail::bool_flags(m.data(), m.size(), false));
  }
  static AttnMask keep(const BoolTensor3& m) {
    return flags(MaskKind::Keep, {m.dimension(0), m.dimension(1), m.dimension(2)},
                 detail::bool_flags(m.data(), m.size(), false));
  }
  /// Boolean, true = masked out (nn.MultiheadAttention's convention). Same shapes as keep().
  static AttnMask ignore(const BoolTensor2& m) {
    return flags(MaskKind::Ignore, {1, m.dimension(0), m.dimension(1)}, detail::bool_flags(m.data(), m.size(), true));
  }
  static AttnMask ignore(const BoolTensor3& m) {
    return flags(MaskKind::Ignore, {m.dimension(0), m.dimension(1), m.dimension(2)},
                 detail::bool_flags(m.data(), m.size(), true));
  }
  /// Added to the scaled scores; -inf masks the key. Same shapes as keep().
  static AttnMask additive(const Eigen::Tensor<Scalar, 2, Eigen::RowMajor>& m) {
    return values({1, m.dimension(0), m.dimension(1)}, detail::tensor_values(m));
  }
  static AttnMask additive(const Tensor3<Scalar>& m) {
    return values({m.dimension(0), m.dimension(1), m.dimension(2)}, detail::tensor_values(m));
  }

  /// Swin's relative position bias (see the file comment): table [(2·max_h − 1)·(2·max_w − 1), heads]
  /// (Swin's `relative_position_bias_table`), for a grid of grid_h × grid_w positions flattened row-major,
  /// grid_h ≤ max_h and grid_w ≤ max_w. Its plan needs queries = keys = grid_h·grid_w and the table's
  /// number of heads.
  static AttnMask relative_position(const ConstRowMatrixRef<Scalar>& table, Index grid_h, Index grid_w, Index max_h,
                                    Index max_w) {
    if (max_h < 1 || max_w < 1 || grid_h < 0 || grid_w < 0 || grid_h > max_h || grid_w > max_w) {
      detail::fail("relative position bias: a grid of grid_h x grid_w <= max_h x max_w positions, got grid ", grid_h,
                   " x ", grid_w, " for max ", max_h, " x ", max_w);
    }
    // Checked: maxima whose product wraps around could otherwise match the table's row count.
    const Index entries =
        detail::relative_table_entries(max_h, max_w, "relative position bias: the table for max_h x max_w");
    if (table.rows() != entries || table.cols() < 1) {
      detail::fail("relative position bias table must be [(2*max_h - 1)*(2*max_w - 1), heads] = [", entries,
                   ", heads] for max ", max_h, " x ", max_w, ", got ",
                   detail::shape_string({table.rows(), table.cols()}));
    }
    AttnMask m;
    m.kind_ = MaskKind::RelativePosition;
    m.dims_ = {table.cols(), grid_h * grid_w, grid_h * grid_w};
    m.grid_ = {grid_h, grid_w, max_h, max_w};
    const RowMatrix<Scalar> per_head = table.transpose();  // [heads, entries]: one contiguous table per head
    m.add_.assign(per_head.data(), per_head.data() + per_head.size());
    return m;
  }

  MaskKind kind() const { return kind_; }
  bool is_none() const { return kind_ == MaskKind::None; }
  /// Causal masks: the last visible key of query i is i + diagonal().
  Index diagonal() const { return diagonal_; }
  /// [n, queries, keys] of a tensor mask (n = 1 for a 2-D mask); zeros for none/causal; [heads,
  /// positions, positions] for a relative position bias.
  const std::array<Index, 3>& dims() const { return dims_; }
  /// Relative position bias: {grid_h, grid_w, max_h, max_w}.
  const std::array<Index, 4>& relative_grid() const { return grid_; }
  /// Relative position bias of head h between positions i and j (kind RelativePosition only).
  Scalar relative_position_bias(Index h, Index i, Index j) const {
    const Index gw = grid_[1], mh = grid_[2], mw = grid_[3];
    const Index entry = (i / gw - j / gw + mh - 1) * (2 * mw - 1) + (i % gw - j % gw + mw - 1);
    return add_[static_cast<std::size_t>(h * (2 * mh - 1) * (2 * mw - 1) + entry)];
  }
  /// Keep flags (1 = may attend), row-major over dims(); only for Keep/Ignore.
  const std::vector<std::uint8_t>& keep_flags() const { return keep_; }
  /// Additive values, row-major over dims(); only for Additive. (For RelativePosition: the table
  /// transposed, [heads, entries].)
  const std::vector<Scalar>& additive_values() const { return add_; }

 private:
  static AttnMask flags(MaskKind kind, std::array<Index, 3> dims, std::vector<std::uint8_t> keep) {
    AttnMask m;
    m.kind_ = kind;
    m.dims_ = dims;
    m.keep_ = std::move(keep);
    return m;
  }
  static AttnMask values(std::array<Index, 3> dims, std::vector<Scalar> add) {
    AttnMask m;
    m.kind_ = MaskKind::Additive;
    m.dims_ = dims;
    m.add_ = detail::normalize_additive(std::move(add));
    return m;
  }

  MaskKind kind_ = MaskKind::None;
  Index diagonal_ = 0;
  std::array<Index, 3> dims_{0, 0, 0};
  std::array<Index, 4> grid_{0, 0, 0, 0};
  std::vector<std::uint8_t> keep_;
  std::vector<Scalar> add_;
};

/// Mask over keys, per batch: padding at the end of variable-length sequences.
template <class Scalar>
class KeyPaddingMask {
 public:
  KeyPaddingMask() = default;
  static KeyPaddingMask none() { return KeyPaddingMask(); }

  /// Boolean [batch, keys], true = the key takes part.
  static KeyPaddingMask keep(const BoolTensor2& m) { return flags(MaskKind::Keep, m, false); }
  /// Boolean [batch, keys], true = the key is padding (nn.MultiheadAttention's key_padding_mask).
  static KeyPaddingMask ignore(const BoolTensor2& m) { return flags(MaskKind::Ignore, m, true); }
  /// Floating point [batch, keys], added to every query's scores.
  static KeyPaddingMask additive(const Eigen::Tensor<Scalar, 2, Eigen::RowMajor>& m) {
    KeyPaddingMask k;
    k.kind_ = MaskKind::Additive;
    k.dims_ = {m.dimension(0), m.dimension(1)};
    k.add_ = detail::normalize_additive(detail::tensor_values(m));
    return k;
  }
  /// Batch b attends to keys [0, lengths[b]); lengths must lie in [0, keys].
  static KeyPaddingMask lengths(std::vector<Index> lengths) {
    KeyPaddingMask k;
    k.kind_ = MaskKind::Lengths;
    k.dims_ = {static_cast<Index>(lengths.size()), 0};
    k.lengths_ = std::move(lengths);
    return k;
  }
  MaskKind kind() const { return kind_; }
  bool is_none() const { return kind_ == MaskKind::None; }
  /// [batch, keys]; keys is 0 for lengths().
  const std::array<Index, 2>& dims() const { return dims_; }
  const std::vector<std::uint8_t>& keep_flags() const { return keep_; }
  const std::vector<Scalar>& additive_values() const { return add_; }
  const std::vector<Index>& valid_lengths() const { return lengths_; }
  /// Whether key j of batch item b is masked out (a length, a false keep flag, −inf), on a mask checked
  /// against the problem's [batch, keys] (c2f::MaskView's constructor checks it).
  bool hides(Index b, Index j) const {
    switch (kind_) {
      case MaskKind::None:
        return false;
      case MaskKind::Lengths:
        return j >= lengths_[static_cast<std::size_t>(b)];
      case MaskKind::Additive:
        return add_[static_cast<std::size_t>(b * dims_[1] + j)] == -std::numeric_limits<Scalar>::infinity();
      default:
        return keep_[static_cast<std::size_t>(b * dims_[1] + j)] == 0;
    }
  }

 private:
  static KeyPaddingMask flags(MaskKind kind, const BoolTensor2& m, bool invert) {
    KeyPaddingMask k;
    k.kind_ = kind;
    k.dims_ = {m.dimension(0), m.dimension(1)};
    k.keep_ = detail::bool_flags(m.data(), m.size(), invert);
    return k;
  }

  MaskKind kind_ = MaskKind::None;
  std::array<Index, 2> dims_{0, 0};
  std::vector<std::uint8_t> keep_;
  std::vector<Scalar> add_;
  std::vector<Index> lengths_;
};

/// The fields of c2f::Masks, as a set: what a layer takes (every layer's `mask_fields`).
enum class MaskFields : unsigned {
  None = 0,
  AttnMask = 1,        ///< Masks::attn_mask
  KeyPaddingMask = 2,  ///< Masks::key_padding_mask
  FineAttnMask = 4,    ///< Masks::fine_attn_mask
};
constexpr MaskFields operator|(MaskFields a, MaskFields b) {
  return static_cast<MaskFields>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
/// Whether the set `fields` holds `field`.
constexpr bool takes(MaskFields fields, MaskFields field) {
  return (static_cast<unsigned>(fields) & static_cast<unsigned>(field)) != 0;
}

/// The masks of one forward call: the library's one masks type, taken by every layer. A layer uses
/// the fields its attention has and rejects the others with std::invalid_argument (never ignores them):
///   MultiHeadAttention, SparseC2FAttention   attn_mask [queries, keys], key_padding_mask [batch, keys]
///   CoarseAttention                          attn_mask [chunks, chunks], key_padding_mask [batch, chunks]
///   FineAttention                            attn_mask [chunk, chunk] (inside every chunk)
///   C2FAttention                             attn_mask: the coarse stage's; fine_attn_mask: the fine stage's
///   HMHA, C2FAttention2D                     none
///
/// Named, chainable setters like the layers' options:
///   mha.forward(x, c2f::Masks<float>().attn_mask(c2f::AttnMask<float>::causal()).key_padding_mask(pad));
template <class Scalar>
class Masks {
  /// Over (query, key) pairs.
  C2F_ARG(AttnMask<Scalar>, attn_mask);
  /// Over keys, per batch item.
  C2F_ARG(KeyPaddingMask<Scalar>, key_padding_mask);
  /// Coarse-to-fine layers: the mask inside the chunks.
  C2F_ARG(AttnMask<Scalar>, fine_attn_mask);
};

namespace detail {

/// Throws unless only the fields a layer takes are set: "<layer> takes no <field>".
template <class Scalar>
void check_mask_fields(const Masks<Scalar>& masks, const char* layer, MaskFields accepted) {
  const char* unused =
      !takes(accepted, MaskFields::AttnMask) && !masks.attn_mask().is_none()                ? "attn_mask"
      : !takes(accepted, MaskFields::KeyPaddingMask) && !masks.key_padding_mask().is_none() ? "key_padding_mask"
      : !takes(accepted, MaskFields::FineAttnMask) && !masks.fine_attn_mask().is_none()     ? "fine_attn_mask"
                                                                                            : nullptr;
  if (unused != nullptr) fail(layer, " takes no ", unused, " (see c2f::Masks for the fields each layer uses)");
}

}  // namespace detail
}  // namespace c2f
