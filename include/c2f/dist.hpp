// c2f dist — sequence-parallel layers on MPI (CMake target c2f::dist): each rank holds a shard of the
// sequence and the full weights. See docs/distributed.md.
//
// compile: fragment(int argc, char** argv, c2f::Index length, const c2f::Tensor3<float>& my_tokens)
//   #include <c2f/dist.hpp>
//   #include <c2f/io/safetensors.hpp>                       // load_safetensors (target c2f::safetensors)
//
//   int provided;                                           // c2f's workers never call MPI:
//   MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);  // only the calling thread does
//   c2f::dist::Comm comm;                                   // MPI_COMM_WORLD
//   c2f::dist::C2FAttention<float> layer(comm, 512, 8, 32);
//   layer.module().load_state_dict(c2f::load_safetensors("c2f.safetensors"));
//   const c2f::dist::Shard s = c2f::dist::even_shard(length, 32, comm.rank(), comm.size());
//   c2f::Tensor3<float> y = layer.forward(my_tokens);      // my_tokens: [B, s.length, 512]
#pragma once

#include "c2f/dist/c2f_attention.hpp"
#include "c2f/dist/c2f_attention_2d.hpp"
#include "c2f/dist/comm.hpp"
#include "c2f/dist/hmha.hpp"
#include "c2f/dist/multihead_attention.hpp"
#include "c2f/dist/shard.hpp"
