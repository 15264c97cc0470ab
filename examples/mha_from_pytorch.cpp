// Loads a torch.nn.MultiheadAttention saved by PyTorch as safetensors, runs c2f's MultiHeadAttention
// on the input stored next to it, and compares with PyTorch's output.
//
//   mha_from_pytorch [file.safetensors]
//
// The file holds the module's state_dict under the prefix "mha." and, optionally, "query" and "output"
// tensors, with embed_dim / num_heads in its metadata — the layout of examples/export_mha.py and of
// the test fixtures. Without an argument it uses a fixture written by tests/reference/generate.py.
#include "example_support.hpp"

#include <c2f/c2f.hpp>

#include <cmath>
#include <cstdio>
#include <exception>
#include <string>

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : std::string(C2F_EXAMPLE_DATA_DIR) + "/mha/self_l7_f32.safetensors";
  try {
    const c2f::StateDict sd = c2f::load_safetensors(path);
    const auto meta = [&](const char* key) { return std::stol(sd.metadata().at(key)); };
    std::printf("loaded %zu tensors from %s\n", sd.size(), path.c_str());
    for (const std::string& key : sd.keys("mha.")) {
      const c2f::TensorData& t = sd.at(key);
      std::printf("  %-24s %-4s %s\n", key.c_str(), c2f::dtype_name(t.dtype()), example::shape_text(t.shape()).c_str());
    }

    c2f::MultiHeadAttention<float> mha(meta("embed_dim"), meta("num_heads"));
    mha.load_state_dict(sd, "mha.");

    const c2f::Tensor3<float> x = example::tensor3(sd, "query");
    const c2f::Tensor3<float> y = mha.forward(x);  // self-attention, like mha(x, x, x) in PyTorch
    std::printf("output [%ld, %ld, %ld], first row:", static_cast<long>(y.dimension(0)),
                static_cast<long>(y.dimension(1)), static_cast<long>(y.dimension(2)));
    for (Eigen::Index j = 0; j < std::min<Eigen::Index>(6, y.dimension(2)); ++j) std::printf(" %+.6f", y(0, 0, j));
    std::printf(" ...\n");

    return example::compare_with_pytorch(sd, y);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
