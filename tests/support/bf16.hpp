// Helpers of the bfloat16 compute tests (docs/bf16.md).
#pragma once

#include "c2f/detail/bf16_gemm.hpp"
#include "c2f/runtime.hpp"

namespace c2f_test {

/// Runs fn(engine name) once on each bf16 engine this machine has: the tile unit (where the CPU has AMX)
/// and the fallback; restores the caller's setting afterwards.
template <class Fn>
void on_each_bf16_engine(Fn&& fn) {
  const bool allowed = c2f::get_bf16_tiles();
  for (bool tiles : {true, false}) {
    if (tiles && !c2f::detail::cpu_has_amx_bf16()) continue;
    c2f::set_bf16_tiles(tiles);
    fn(tiles ? "tiles" : "fallback");
  }
  c2f::set_bf16_tiles(allowed);
}

}  // namespace c2f_test
