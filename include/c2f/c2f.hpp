// c2f — header-only attention layers on Eigen. Include this umbrella header, or the focused ones.
#pragma once

#include "c2f/core.hpp"
#include "c2f/io/safetensors.hpp"
#include "c2f/kernels/chunk.hpp"
#include "c2f/kernels/chunk_sparse.hpp"
#include "c2f/kernels/conv1d.hpp"
#include "c2f/kernels/hierarchical.hpp"
#include "c2f/kernels/linear.hpp"
#include "c2f/kernels/sdpa.hpp"
#include "c2f/layers/c2f_attention.hpp"
#include "c2f/layers/conv1d.hpp"
#include "c2f/layers/hmha.hpp"
#include "c2f/layers/linear.hpp"
#include "c2f/layers/multihead_attention.hpp"
#include "c2f/layers/sparse_c2f_attention.hpp"
#include "c2f/mask.hpp"
#include "c2f/state_dict.hpp"
