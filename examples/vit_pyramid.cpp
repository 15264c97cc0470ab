// A ViT feature pyramid of two-dimensional coarse-to-fine attention (the coarse-to-fine article's closing idea): stages
// of C2FAttention2D on a shrinking token grid — 2 × 2 mean-pool patch merging between stages — with larger blocks in
// deeper stages. Loads the weights PyTorch wrote (examples/export_vit_pyramid.py, module ViTPyramid of
// tests/reference/c2f2d_reference.py), runs the pyramid and compares with PyTorch's output.
//
//   vit_pyramid [file.safetensors]
//
// Without an argument it uses the test fixture tests/data/c2f2d/pyramid_14x18_f32.safetensors (a 14 × 18
// grid, odd sizes on purpose: partial blocks and partial merge windows). Write your own file with
//   /usr/bin/python3 examples/export_vit_pyramid.py pyramid.safetensors
//
// Stage s: x ← x + C2FAttention2D_s(x, H, W). Patch merging: the token of merged cell (i, j) is the mean
// of the real tokens of the 2 × 2 window {2i, 2i+1} × {2j, 2j+1}; the grid becomes ceil(H/2) × ceil(W/2).
// That is the block mean of 2 × 2 blocks, so it is kernels::chunk_mean on a kernels::BlockGrid2D.
#include "example_support.hpp"

#include <c2f/c2f.hpp>
#include <c2f/io/safetensors.hpp>

#include <array>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

namespace {

using c2f::Index;

struct Stage {
  Index height, width;  // the grid this stage runs on
  c2f::C2FAttention2D<float> attention;
};

/// Parses the metadata entry "HxW:bhxbw:GhxGw,..." (one item per stage) written by the PyTorch side.
std::vector<std::array<Index, 6>> parse_stages(const std::string& text) {
  std::vector<std::array<Index, 6>> out;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    long h, w, bh, bw, gh, gw;
    if (std::sscanf(item.c_str(), "%ldx%ld:%ldx%ld:%ldx%ld", &h, &w, &bh, &bw, &gh, &gw) != 6) {
      throw std::invalid_argument("cannot parse stage '" + item + "' (expected HxW:bhxbw:GhxGw)");
    }
    out.push_back({h, w, bh, bw, gh, gw});
  }
  return out;
}

/// 2 × 2 mean-pool patch merging: [B, H·W, d] → [B, ceil(H/2)·ceil(W/2), d].
c2f::Tensor3<float> patch_merge(const c2f::Tensor3<float>& x, Index height, Index width) {
  const c2f::kernels::BlockGrid2D grid{x.dimension(0), height, width, 2, 2};
  c2f::Tensor3<float> merged(x.dimension(0), grid.blocks_per_batch(), x.dimension(2));
  c2f::kernels::chunk_mean<float>(c2f::ConstTensor3Ref<float>(x).rows(), grid,
                                  Eigen::Map<c2f::RowMatrix<float>>(merged.data(), grid.blocks(), x.dimension(2)),
                                  c2f::kernels::with_threads(0));
  return merged;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path =
      argc > 1 ? argv[1] : std::string(C2F_EXAMPLE_DATA_DIR) + "/c2f2d/pyramid_14x18_f32.safetensors";
  try {
    const c2f::StateDict sd = c2f::load_safetensors(path);
    const auto meta = [&](const char* key) { return static_cast<Index>(std::stol(sd.metadata().at(key))); };
    const Index d = meta("embed_dim"), heads = meta("num_heads");
    const bool bias = sd.metadata().at("relative_position_bias") == "true";

    std::vector<Stage> stages;
    for (const std::array<Index, 6>& s : parse_stages(sd.metadata().at("stages"))) {
      c2f::C2FAttention2D<float>::Options options;
      options.max_blocks_h(s[4]);
      options.max_blocks_w(s[5]);
      options.relative_position_bias(bias);
      stages.push_back({s[0], s[1], c2f::C2FAttention2D<float>(d, heads, s[2], s[3], options)});
      const std::string prefix = "pyramid.stages." + std::to_string(stages.size() - 1) + ".";
      stages.back().attention.load_state_dict(sd, prefix);
    }
    std::printf(
        "ViT pyramid of %zu C2FAttention2D stages (embed_dim %ld, %ld heads, relative position bias %s) from %s\n",
        stages.size(), static_cast<long>(d), static_cast<long>(heads), bias ? "on" : "off", path.c_str());

    c2f::Tensor3<float> x = example::tensor3(sd, "x");
    Index height = meta("height"), width = meta("width");
    for (std::size_t i = 0; i < stages.size(); ++i) {
      if (i > 0) {
        x = patch_merge(x, height, width);
        height = (height + 1) / 2;
        width = (width + 1) / 2;
      }
      const Stage& s = stages[i];
      if (s.height != height || s.width != width) {
        throw std::invalid_argument("stage " + std::to_string(i) + " expects a " + std::to_string(s.height) + " x " +
                                    std::to_string(s.width) + " grid, the pyramid is at " + std::to_string(height) +
                                    " x " + std::to_string(width));
      }
      const c2f::C2FAttention2D<float>& a = s.attention;
      const c2f::Tensor3<float> y = a.forward(x, height, width);
      x = (x + y).eval();
      std::printf("  stage %zu: %3ld x %-3ld tokens, blocks %ld x %ld -> %ld x %ld blocks (table %ld x %ld)\n", i,
                  static_cast<long>(height), static_cast<long>(width), static_cast<long>(a.block_h()),
                  static_cast<long>(a.block_w()), static_cast<long>((height + a.block_h() - 1) / a.block_h()),
                  static_cast<long>((width + a.block_w() - 1) / a.block_w()),
                  static_cast<long>(a.options().max_blocks_h()), static_cast<long>(a.options().max_blocks_w()));
    }
    std::printf("output [%ld, %ld, %ld] on a %ld x %ld grid\n", static_cast<long>(x.dimension(0)),
                static_cast<long>(x.dimension(1)), static_cast<long>(x.dimension(2)), static_cast<long>(height),
                static_cast<long>(width));
    return example::compare_with_pytorch(sd, x);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
