// c2f python — the layers of the module, one entry each: the C++ layer, the names of its positional
// sizes and its own options (the shared ones — num_threads, seed, bias, causal, kernel, query_block,
// key_block — come from its option groups). Everything else comes from the layer contract
// (bind_layer.hpp). Adding a layer to Python is one C2F_PY_LAYER line here and its entry in Layers.
#pragma once

#include "bind_layer.hpp"

namespace c2f_py {

/// The size names of an entry: size_names("embed_dim", "num_heads").
template <class... Names>
constexpr std::array<const char*, sizeof...(Names)> size_names(Names... names) {
  return {names...};
}

/// The own options of an entry: own_options<Options>(C2F_PY_OPTION(kdim), ...), or none.
template <class Options, class... Specs>
std::vector<OptionSpec<Options>> own_options(Specs... specs) {
  return {specs...};
}

/// Entry `Name` for c2f::Name<S>: Sizes is a parenthesised list of the constructor's size names, Own a
/// parenthesised list of the C2F_PY_OPTION(...) of the layer's own options (possibly empty).
#define C2F_PY_LAYER(Name, Sizes, Own)                                                     \
  template <class S>                                                                       \
  struct Name##Entry {                                                                     \
    using Layer = c2f::Name<S>;                                                            \
    using Options = typename Layer::Options;                                               \
    using Scalar = S;                                                                      \
    static constexpr const char* name = #Name;                                             \
    static constexpr auto sizes() { return size_names Sizes; }                             \
    static std::vector<OptionSpec<Options>> options() { return own_options<Options> Own; } \
  }

// clang-format off
C2F_PY_LAYER(Linear, ("in_features", "out_features"), ());
C2F_PY_LAYER(Conv1d, ("in_channels", "out_channels", "kernel_size"), (C2F_PY_OPTION(padding), C2F_PY_OPTION(groups)));
C2F_PY_LAYER(C3K2Projection, ("embed_dim", "num_heads"), ());
C2F_PY_LAYER(MultiHeadAttention, ("embed_dim", "num_heads"), (C2F_PY_OPTION(kdim), C2F_PY_OPTION(vdim), C2F_PY_OPTION(rows_independent)));
C2F_PY_LAYER(CoarseAttention, ("embed_dim", "num_heads"), ());
C2F_PY_LAYER(FineAttention, ("embed_dim", "num_heads"), (C2F_PY_OPTION(fine_path)));
C2F_PY_LAYER(C2FAttention, ("embed_dim", "num_heads", "chunk_size"), (C2F_PY_OPTION(fine_path)));
C2F_PY_LAYER(C2FAttention2D, ("embed_dim", "num_heads", "block_h", "block_w"), (C2F_PY_OPTION(max_blocks_h), C2F_PY_OPTION(max_blocks_w), C2F_PY_OPTION(relative_position_bias)));
C2F_PY_LAYER(HMHA, ("embed_dim", "num_heads", "window"), (C2F_PY_OPTION(levels)));
C2F_PY_LAYER(SparseC2FAttention, ("embed_dim", "num_heads", "chunk_size", "top_k"), (C2F_PY_OPTION(gating)));
// clang-format on

template <template <class> class... Entries>
struct LayerList {
  template <class S>
  static void bind(py::module_& m) {
    (bind_layer<Entries<S>>(m), ...);
  }
};
using Layers =
    LayerList<LinearEntry, Conv1dEntry, C3K2ProjectionEntry, MultiHeadAttentionEntry, CoarseAttentionEntry,
              FineAttentionEntry, C2FAttentionEntry, C2FAttention2DEntry, HMHAEntry, SparseC2FAttentionEntry>;

/// Binds every entry in S (one translation unit per S: layers_float32.cpp, layers_float64.cpp).
template <class S>
void bind_layers(py::module_& m) {
  Layers::bind<S>(m);
}

extern template void bind_layers<float>(py::module_&);
extern template void bind_layers<double>(py::module_&);

}  // namespace c2f_py
