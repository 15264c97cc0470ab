// A downstream program that links only c2f::c2f: the layers without the safetensors reader, so without
// nlohmann/json. It fails to compile if c2f's core headers pull nlohmann/json in.
#include <c2f/c2f.hpp>

#ifdef INCLUDE_NLOHMANN_JSON_HPP_
#error "c2f/c2f.hpp included nlohmann/json: the core target must not need it"
#endif

#include <cstdio>

int main() {
  c2f::MultiHeadAttention<float> mha(8, 2, c2f::MultiHeadAttention<float>::Options().causal(true).seed(1));
  c2f::Tensor3<float> x(1, 5, 8);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(i % 7) * 0.25f - 0.5f;
  const c2f::Tensor3<float> y = mha.forward(x);
  // Causal: the first token attends to itself only, whatever the later tokens hold.
  c2f::Tensor3<float> x2 = x;
  for (Eigen::Index i = 8; i < x2.size(); ++i) x2.data()[i] = 1.0f;
  const c2f::Tensor3<float> y2 = mha.forward(x2);
  for (Eigen::Index j = 0; j < 8; ++j) {
    if (!(y(0, 0, j) == y2(0, 0, j))) {
      std::fprintf(stderr, "causal output of token 0 changed\n");
      return 1;
    }
  }
  std::printf("c2f core consumer OK: output[0, 0, 0] = %g\n", static_cast<double>(y(0, 0, 0)));
  return 0;
}
