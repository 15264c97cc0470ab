// The mha fixture families' conventions (tests/data/mha, tests/data/train): a MultiHeadAttention's options
// from a fixture's metadata, and every way c2f can express the fixture's masks.
#pragma once

#include "c2f/io/masks.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "support/fixtures.hpp"

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace c2f_test {

using c2f::Index;

template <class Scalar>
typename c2f::MultiHeadAttention<Scalar>::Options options_from(const c2f::StateDict& sd) {
  typename c2f::MultiHeadAttention<Scalar>::Options o;
  o.bias(sd.metadata().at("bias") == "true");
  o.kdim(meta_index(sd, "kdim"));
  o.vdim(meta_index(sd, "vdim"));
  return o;
}

// The key padding mask as lengths, when it is "keys [0, len) valid, the rest padding" per batch.
inline std::optional<std::vector<Index>> lengths_of(const c2f::TensorData& ignore_mask) {
  const Index batch = ignore_mask.shape()[0], keys = ignore_mask.shape()[1];
  std::vector<Index> lengths;
  for (Index b = 0; b < batch; ++b) {
    Index len = 0;
    while (len < keys && ignore_mask.bytes()[static_cast<std::size_t>(b * keys + len)] == 0) ++len;
    for (Index j = len; j < keys; ++j) {
      if (ignore_mask.bytes()[static_cast<std::size_t>(b * keys + j)] == 0) return std::nullopt;
    }
    lengths.push_back(len);
  }
  return lengths;
}

// Every way c2f can express the fixture's masks: torch's tensors as given, the causal shorthand for
// torch's causal bool mask, key lengths for a suffix padding mask, and keep-convention masks.
template <class Scalar>
std::vector<std::pair<std::string, c2f::Masks<Scalar>>> mask_variants(const c2f::StateDict& sd) {
  const auto& meta = sd.metadata();
  std::vector<c2f::AttnMask<Scalar>> attn = {c2f::AttnMask<Scalar>()};
  std::vector<std::string> attn_names = {"none"};
  if (meta.at("attn_mask") == "bool") {
    attn = {c2f::attn_mask_from_tensor<Scalar>(c2f::MaskKind::Ignore, sd.at("attn_mask"))};
    attn_names = {"ignore(tensor)"};
    // The same mask in the keep convention: flip the bytes.
    c2f::TensorData t = sd.at("attn_mask");
    std::vector<std::uint8_t> flipped(t.bytes());
    for (std::uint8_t& b : flipped) b = b ? 0 : 1;
    attn.push_back(
        c2f::attn_mask_from_tensor<Scalar>(c2f::MaskKind::Keep, c2f::TensorData(t.dtype(), t.shape(), flipped)));
    attn_names.push_back("keep(flipped tensor)");
    if (meta.at("causal") == "true") {
      attn.push_back(c2f::AttnMask<Scalar>::causal());
      attn_names.push_back("causal()");
    }
  } else if (meta.at("attn_mask") == "float") {
    attn = {c2f::attn_mask_from_tensor<Scalar>(c2f::MaskKind::Additive, sd.at("attn_mask"))};
    attn_names = {"additive(tensor)"};
  }
  std::vector<c2f::KeyPaddingMask<Scalar>> pad = {c2f::KeyPaddingMask<Scalar>()};
  std::vector<std::string> pad_names = {"none"};
  if (meta.at("key_padding_mask") == "bool") {
    pad = {c2f::key_padding_mask_from_tensor<Scalar>(c2f::MaskKind::Ignore, sd.at("key_padding_mask"))};
    pad_names = {"ignore(tensor)"};
    if (std::optional<std::vector<Index>> lengths = lengths_of(sd.at("key_padding_mask"))) {
      pad.push_back(c2f::KeyPaddingMask<Scalar>::lengths(*lengths));
      pad_names.push_back("lengths()");
    }
  } else if (meta.at("key_padding_mask") == "float") {
    pad = {c2f::key_padding_mask_from_tensor<Scalar>(c2f::MaskKind::Additive, sd.at("key_padding_mask"))};
    pad_names = {"additive(tensor)"};
  }
  std::vector<std::pair<std::string, c2f::Masks<Scalar>>> out;
  for (std::size_t a = 0; a < attn.size(); ++a) {
    for (std::size_t p = 0; p < pad.size(); ++p) {
      out.push_back({"attn_mask=" + attn_names[a] + " key_padding_mask=" + pad_names[p],
                     c2f::Masks<Scalar>().attn_mask(attn[a]).key_padding_mask(pad[p])});
    }
  }
  return out;
}

}  // namespace c2f_test
