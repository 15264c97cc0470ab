// The second translation unit of test_odr: it includes every public header and instantiates the same
// layers as odr_a.cpp. A function defined in a header without `inline` (or a non-inline variable)
// would be defined twice and the link would fail.
#include "c2f/c2f.hpp"
#include "c2f/io/safetensors.hpp"

c2f::Tensor3<float> odr_b_forward(const c2f::Tensor3<float>& x) {
  const c2f::MultiHeadAttention<float> mha(8, 2, c2f::MultiHeadAttention<float>::Options().seed(7));
  const c2f::C2FAttention<float> c2f_attn(8, 2, 4, c2f::C2FAttention<float>::Options().seed(7));
  const c2f::HMHA<float> hmha(8, 2, 4, c2f::HMHA<float>::Options().seed(7));
  const c2f::SparseC2FAttention<float> sparse(8, 2, 4, 2, c2f::SparseC2FAttention<float>::Options().seed(7));
  const std::vector<std::uint8_t> bytes = c2f::serialize_safetensors(mha.state_dict());
  const c2f::StateDict sd = c2f::parse_safetensors(bytes.data(), bytes.size());
  c2f::MultiHeadAttention<float> loaded(8, 2);
  loaded.load_state_dict(sd);
  c2f::Tensor3<float> y = loaded.forward(x);
  y += c2f_attn.forward(x) + hmha.forward(x) + sparse.forward(x);
  return y;
}
