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

#include "c2f/core.hpp"
#include "c2f/options.hpp"
#include "c2f/state_dict.hpp"

#include <array>
#include <limits>
#include <utility>
#include <vector>

namespace c2f {

enum class MaskKind {
  None,      ///< nothing masked
  Keep,      ///< boolean, true = may attend (stored internally as keep flags)
  Ignore,    ///< boolean, true = masked out (converted to keep flags on construction)
  Additive,  ///< floating point, added to the scores
  Causal,    ///< key j visible from query i iff j <= i + diagonal
  Lengths,   ///< key padding by valid length per batch
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
template <class Scalar>
std::vector<Scalar> normalize_additive(std::vector<Scalar> v) {
  const Scalar threshold = static_cast<Scalar>(std::numeric_limits<float>::lowest());
  for (Scalar& x : v) {
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

/// Keep flags from a BOOL/U8 state-dict tensor (non-zero = true).
inline std::vector<std::uint8_t> tensor_flags(const TensorData& t, bool invert) {
  if (t.dtype() != DType::BOOL && t.dtype() != DType::U8) {
    fail("a boolean mask needs a BOOL or U8 tensor, got ", dtype_name(t.dtype()));
  }
  return bool_flags(t.bytes().data(), static_cast<Index>(t.bytes().size()), invert);
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

  /// From a state-dict tensor (e.g. a mask saved by PyTorch): `kind` Keep or Ignore reads a BOOL/U8
  /// tensor, Additive a floating-point one. Shape [queries, keys], or [..., queries, keys] with the
  /// leading dimensions flattened into n (so PyTorch's [B, H, L, S] becomes [B·H, L, S] and the
  /// coarse-to-fine module's fine mask [B, m, k, k] becomes [B·m, k, k]).
  static AttnMask from_tensor(MaskKind kind, const TensorData& t) {
    const std::vector<std::int64_t>& s = t.shape();
    if (s.size() < 2) {
      detail::fail("an attention mask is [queries, keys] or [..., queries, keys], got ", detail::shape_string(s));
    }
    Index n = 1;
    for (std::size_t i = 0; i + 2 < s.size(); ++i) n *= s[i];
    const std::array<Index, 3> dims{n, s[s.size() - 2], s[s.size() - 1]};
    switch (kind) {
      case MaskKind::Keep: return flags(kind, dims, detail::tensor_flags(t, false));
      case MaskKind::Ignore: return flags(kind, dims, detail::tensor_flags(t, true));
      case MaskKind::Additive: return values(dims, t.to_vector<Scalar>());
      default: detail::fail("AttnMask::from_tensor takes MaskKind Keep, Ignore or Additive");
    }
  }

  MaskKind kind() const { return kind_; }
  bool is_none() const { return kind_ == MaskKind::None; }
  /// Causal masks: the last visible key of query i is i + diagonal().
  Index diagonal() const { return diagonal_; }
  /// [n, queries, keys] of a tensor mask (n = 1 for a 2-D mask); zeros for none/causal.
  const std::array<Index, 3>& dims() const { return dims_; }
  /// Keep flags (1 = may attend), row-major over dims(); only for Keep/Ignore.
  const std::vector<std::uint8_t>& keep_flags() const { return keep_; }
  /// Additive values, row-major over dims(); only for Additive.
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
  static KeyPaddingMask keep(const BoolTensor2& m) {
    return flags(MaskKind::Keep, m, false);
  }
  /// Boolean [batch, keys], true = the key is padding (nn.MultiheadAttention's key_padding_mask).
  static KeyPaddingMask ignore(const BoolTensor2& m) {
    return flags(MaskKind::Ignore, m, true);
  }
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
  /// From a state-dict tensor [batch, keys]: Keep/Ignore read BOOL/U8, Additive floating point.
  static KeyPaddingMask from_tensor(MaskKind kind, const TensorData& t) {
    if (t.shape().size() != 2) {
      detail::fail("a key padding mask is [batch, keys], got ", detail::shape_string(t.shape()));
    }
    KeyPaddingMask k;
    k.kind_ = kind;
    k.dims_ = {t.shape()[0], t.shape()[1]};
    switch (kind) {
      case MaskKind::Keep: k.keep_ = detail::tensor_flags(t, false); break;
      case MaskKind::Ignore: k.keep_ = detail::tensor_flags(t, true); break;
      case MaskKind::Additive: k.add_ = detail::normalize_additive(t.to_vector<Scalar>()); break;
      default: detail::fail("KeyPaddingMask::from_tensor takes MaskKind Keep, Ignore or Additive");
    }
    return k;
  }

  MaskKind kind() const { return kind_; }
  bool is_none() const { return kind_ == MaskKind::None; }
  /// [batch, keys]; keys is 0 for lengths().
  const std::array<Index, 2>& dims() const { return dims_; }
  const std::vector<std::uint8_t>& keep_flags() const { return keep_; }
  const std::vector<Scalar>& additive_values() const { return add_; }
  const std::vector<Index>& valid_lengths() const { return lengths_; }

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
void check_mask_fields(const Masks<Scalar>& masks, const char* layer, bool attn, bool key_padding, bool fine) {
  const char* unused = !attn && !masks.attn_mask().is_none()                 ? "attn_mask"
                       : !key_padding && !masks.key_padding_mask().is_none() ? "key_padding_mask"
                       : !fine && !masks.fine_attn_mask().is_none()          ? "fine_attn_mask"
                                                                             : nullptr;
  if (unused != nullptr) fail(layer, " takes no ", unused, " (see c2f::Masks for the fields each layer uses)");
}

}  // namespace detail
}  // namespace c2f
