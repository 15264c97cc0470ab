// c2f — header-only attention layers on Eigen. Include this umbrella header (target c2f::c2f), or the
// focused ones. The safetensors reader and writer are apart: c2f/io/safetensors.hpp (target
// c2f::safetensors, which adds nlohmann_json).
#pragma once

#include "c2f/core.hpp"
#include "c2f/kernels/block2d.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/chunk_sparse.hpp"
#include "c2f/kernels/conv1d.hpp"
#include "c2f/kernels/heads_view.hpp"
#include "c2f/kernels/hierarchical.hpp"
#include "c2f/kernels/kernel_options.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/kv_cache.hpp"
#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/c2f_attention_2d.hpp"
#include "c2f/layers/conv1d.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/linear.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/sparse_c2f_attention.hpp"
#include "c2f/mask.hpp"
#include "c2f/mask_view.hpp"
#include "c2f/options.hpp"
#include "c2f/runtime.hpp"
#include "c2f/state_dict.hpp"
