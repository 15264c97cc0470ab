// test_odr: two translation units (this one and odr_b.cpp) include every public header and use the same
// layers; the program links (no header defines a non-inline function or variable) and both agree.
#include "c2f/c2f.hpp"
#include "c2f/io/safetensors.hpp"

#include <gtest/gtest.h>

#include <cstring>

c2f::Tensor3<float> odr_b_forward(const c2f::Tensor3<float>& x);

namespace {

c2f::Tensor3<float> odr_a_forward(const c2f::Tensor3<float>& x) {
  const c2f::MultiHeadAttention<float> mha(8, 2, c2f::MultiHeadAttention<float>::Options().seed(7));
  const c2f::C2FAttention<float> c2f_attn(8, 2, 4, c2f::C2FAttention<float>::Options().seed(7));
  const c2f::HMHA<float> hmha(8, 2, 4, c2f::HMHA<float>::Options().seed(7));
  const c2f::SparseC2FAttention<float> sparse(8, 2, 4, 2, c2f::SparseC2FAttention<float>::Options().seed(7));
  c2f::Tensor3<float> y = mha.forward(x);
  y += c2f_attn.forward(x) + hmha.forward(x) + sparse.forward(x);
  return y;
}

TEST(Odr, TwoTranslationUnitsLinkAndAgree) {
  c2f::Tensor3<float> x(1, 9, 8);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((i * 37) % 11) * 0.1f - 0.5f;
  const c2f::Tensor3<float> a = odr_a_forward(x), b = odr_b_forward(x);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(a.size())));
}

}  // namespace
