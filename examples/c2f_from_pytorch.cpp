// Builds a C2FAttention, loads weights that PyTorch wrote (the coarse-to-fine article's module, state-dict names
// coarse_attn.* / fine_attn.* under the prefix "c2f."), runs it and compares with PyTorch's output.
//
//   c2f_from_pytorch [file.safetensors]
//
// Without an argument it uses a test fixture (L = 61, chunk 8: the last chunk is partial). Write your
// own file with examples/export_c2f.py.
#include "example_support.hpp"

#include <c2f/c2f.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : std::string(C2F_EXAMPLE_DATA_DIR) + "/c2f/c2f_l61_c8_f32.safetensors";
  try {
    const c2f::StateDict sd = c2f::load_safetensors(path);
    const auto meta = [&](const char* key) { return std::stol(sd.metadata().at(key)); };
    c2f::C2FAttention<float> attn(meta("d_model"), meta("n_heads"), meta("chunk_size"));
    attn.load_state_dict(sd, "c2f.");
    std::printf("C2FAttention(d_model=%ld, n_heads=%ld, chunk_size=%ld) loaded from %s\n",
                static_cast<long>(attn.embed_dim()), static_cast<long>(attn.num_heads()),
                static_cast<long>(attn.chunk_size()), path.c_str());

    const c2f::Tensor3<float> x = example::tensor3(sd, "x");
    const c2f::Tensor3<float> y = attn.forward(x);
    const Eigen::Index L = y.dimension(1), k = attn.chunk_size();
    std::printf("input [%ld, %ld, %ld] -> output [%ld, %ld, %ld] (%ld chunks per sequence)\n",
                static_cast<long>(x.dimension(0)), static_cast<long>(L), static_cast<long>(x.dimension(2)),
                static_cast<long>(y.dimension(0)), static_cast<long>(L), static_cast<long>(y.dimension(2)),
                static_cast<long>((L + k - 1) / k));
    for (Eigen::Index t : {Eigen::Index(0), k - 1, k, L - 1}) {
      if (t < 0 || t >= L) continue;
      std::printf("  y[0, %3ld, :4] =", static_cast<long>(t));
      for (Eigen::Index j = 0; j < std::min<Eigen::Index>(4, y.dimension(2)); ++j) std::printf(" %+.6f", y(0, t, j));
      std::printf("\n");
    }
    return example::compare_with_pytorch(sd, y);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
