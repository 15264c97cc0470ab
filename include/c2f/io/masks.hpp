// c2f io — masks from state-dict tensors, such as a mask PyTorch saved with safetensors, beside the
// loaders: the mask types themselves (c2f/mask.hpp) know nothing of tensors. Core target (c2f::c2f).
//
// compile: fragment
//   #include <c2f/io/masks.hpp>
//   #include <c2f/io/safetensors.hpp>  // load_safetensors (target c2f::safetensors)
//
//   const c2f::StateDict sd = c2f::load_safetensors("masks.safetensors");
//   const auto attn = c2f::attn_mask_from_tensor<float>(c2f::MaskKind::Ignore, sd.at("attn_mask"));
#pragma once

#include "c2f/mask.hpp"
#include "c2f/state_dict.hpp"

#include <cstdint>
#include <vector>

namespace c2f {
namespace detail {

/// The elements of a BOOL/U8 tensor as bools (non-zero = true), in an Eigen tensor of `dims`.
template <int Rank>
Eigen::Tensor<bool, Rank, Eigen::RowMajor> bool_tensor(const TensorData& t, const std::array<Index, Rank>& dims) {
  if (t.dtype() != DType::BOOL && t.dtype() != DType::U8) {
    fail("a boolean mask needs a BOOL or U8 tensor, got ", dtype_name(t.dtype()));
  }
  Eigen::Tensor<bool, Rank, Eigen::RowMajor> m(dims);
  const std::vector<std::uint8_t>& bytes = t.bytes();
  for (std::size_t i = 0; i < bytes.size(); ++i) m.data()[i] = bytes[i] != 0;
  return m;
}

/// The elements of a floating-point tensor as Scalar, in an Eigen tensor of `dims`.
template <class Scalar, int Rank>
Eigen::Tensor<Scalar, Rank, Eigen::RowMajor> value_tensor(const TensorData& t, const std::array<Index, Rank>& dims) {
  Eigen::Tensor<Scalar, Rank, Eigen::RowMajor> m(dims);
  t.copy_to(m.data());
  return m;
}

/// A mask of type Mask (AttnMask or KeyPaddingMask) of `dims` from the tensor t: Keep and Ignore read its
/// BOOL/U8 elements, Additive its floating-point ones; "<loader> takes MaskKind Keep, Ignore or Additive"
/// for another kind.
template <class Mask, class Scalar, std::size_t Rank>
Mask mask_of_kind(const char* loader, MaskKind kind, const TensorData& t, const std::array<Index, Rank>& dims) {
  constexpr int kRank = static_cast<int>(Rank);
  switch (kind) {
    case MaskKind::Keep:
      return Mask::keep(bool_tensor<kRank>(t, dims));
    case MaskKind::Ignore:
      return Mask::ignore(bool_tensor<kRank>(t, dims));
    case MaskKind::Additive:
      return Mask::additive(value_tensor<Scalar, kRank>(t, dims));
    default:
      fail(loader, " takes MaskKind Keep, Ignore or Additive");
  }
}

}  // namespace detail

/// An attention mask from a tensor: `kind` Keep or Ignore reads a BOOL/U8 tensor, Additive a
/// floating-point one. Shape [queries, keys], or [..., queries, keys] with the leading dimensions
/// flattened into n (so PyTorch's [B, H, L, S] becomes [B·H, L, S] and the coarse-to-fine module's fine
/// mask [B, m, k, k] becomes [B·m, k, k]).
template <class Scalar>
AttnMask<Scalar> attn_mask_from_tensor(MaskKind kind, const TensorData& t) {
  const std::vector<std::int64_t>& s = t.shape();
  if (s.size() < 2) {
    detail::fail("an attention mask is [queries, keys] or [..., queries, keys], got ", detail::shape_string(s));
  }
  Index n = 1;
  for (std::size_t i = 0; i + 2 < s.size(); ++i)
    n = detail::checked_mul(n, s[i], "attn_mask_from_tensor: the leading dimensions");
  const std::array<Index, 3> dims{n, s[s.size() - 2], s[s.size() - 1]};
  return detail::mask_of_kind<AttnMask<Scalar>, Scalar>("attn_mask_from_tensor", kind, t, dims);
}

/// A key padding mask from a tensor [batch, keys]: Keep/Ignore read BOOL/U8, Additive floating point.
template <class Scalar>
KeyPaddingMask<Scalar> key_padding_mask_from_tensor(MaskKind kind, const TensorData& t) {
  if (t.shape().size() != 2) {
    detail::fail("a key padding mask is [batch, keys], got ", detail::shape_string(t.shape()));
  }
  const std::array<Index, 2> dims{t.shape()[0], t.shape()[1]};
  return detail::mask_of_kind<KeyPaddingMask<Scalar>, Scalar>("key_padding_mask_from_tensor", kind, t, dims);
}

}  // namespace c2f
