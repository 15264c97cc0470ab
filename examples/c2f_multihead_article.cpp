// The c2f multi-head attention article's C2FMultiHeadAttention is full multi-head attention whose packed projection is
// called `qkv_proj` (a Linear d → 3d, chunked q, k, v) next to `out_proj`: the same parameters and math as
// torch.nn.MultiheadAttention (and as the coarse-to-fine article's CoarseAttention). c2f::MultiHeadAttention loads
// those names directly.
//
//   c2f_multihead_article [file.safetensors [prefix]]
//
// Without arguments it loads a fixture written by PyTorch whose module (the coarse-to-fine article's CoarseAttention)
// has exactly the c2f multi-head article's parameter names under the prefix "coarse.".
#include "example_support.hpp"

#include <c2f/c2f.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : std::string(C2F_EXAMPLE_DATA_DIR) + "/c2f/coarse_m7_f32.safetensors";
  const std::string prefix = argc > 2 ? argv[2] : "coarse.";
  try {
    const c2f::StateDict sd = c2f::load_safetensors(path);
    for (const std::string& key : sd.keys(prefix)) {
      std::printf("  %-28s %s\n", key.c_str(), example::shape_text(sd.at(key).shape()).c_str());
    }
    c2f::MultiHeadAttention<float> mha(std::stol(sd.metadata().at("d_model")), std::stol(sd.metadata().at("n_heads")));
    mha.load_state_dict(sd, prefix);  // qkv_proj.* is accepted as in_proj_*

    const c2f::Tensor3<float> x = example::tensor3(sd, "x");
    const c2f::Tensor3<float> y = mha.forward(x);
    std::printf(
        "MultiHeadAttention(%ld, %ld) with the multi-head article's names: y[0, 0, :4] = %+.6f %+.6f %+.6f %+.6f\n",
        static_cast<long>(mha.embed_dim()), static_cast<long>(mha.num_heads()), y(0, 0, 0), y(0, 0, 1), y(0, 0, 2),
        y(0, 0, 3));
    return example::compare_with_pytorch(sd, y);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
