// A downstream program: builds a MultiHeadAttention, saves and reloads its weights (c2f::safetensors),
// runs it.
#include <c2f/c2f.hpp>
#include <c2f/io/safetensors.hpp>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  c2f::MultiHeadAttention<float> mha(8, 2);
  const std::string path = (argc > 1 ? std::string(argv[1]) : std::string(".")) + "/consumer_weights.safetensors";
  c2f::save_safetensors(path, mha.state_dict());
  c2f::MultiHeadAttention<float> loaded(8, 2, {});
  loaded.load_state_dict(c2f::load_safetensors(path));

  c2f::Tensor3<float> x(1, 5, 8);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(i % 7) * 0.25f - 0.5f;
  const c2f::Tensor3<float> a = mha.forward(x), b = loaded.forward(x);
  for (Eigen::Index i = 0; i < a.size(); ++i) {
    if (!(a.data()[i] == b.data()[i])) {
      std::fprintf(stderr, "reloaded module differs at %ld\n", static_cast<long>(i));
      return 1;
    }
  }
  std::printf("c2f consumer OK: output[0, 0, 0] = %g\n", static_cast<double>(a(0, 0, 0)));
  return 0;
}
