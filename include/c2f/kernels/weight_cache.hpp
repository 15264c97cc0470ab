// c2f — a layer's packed weights, kept between calls (docs/layers.md, "Packed weights kept by the layer").
//
// The micro-kernel GEMM (cpu::packed_gemm) and the bfloat16 engines (cpu::bf16_gemm) read B packed
// into panels. For a weight that is the same in every call, packing it per call costs about as long as
// its product with 128 rows; a layer keeps the packings instead, as ONNX Runtime prepacks its weights.
#pragma once

#include "c2f/core.hpp"
#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/cpu/packed_gemm.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace c2f {
namespace kernels {

/// A layer's packings of its weights, kept between calls: slot i holds the packings of one weight operand
/// — for fp32 compute the micro-kernel's (PackedB<Scalar>), for Compute::BFloat16 the engine's
/// (Bf16PackedB) — each made by the first product that needs it and reused while the `stamp` the layer
/// passes (a number that changes whenever the weight may have: Linear::weight_stamp()) and, for bfloat16,
/// the engine (bf16_engine()) stay the same. A packing holds as many bytes as the weight (half on the
/// Dot and Tiles engines). Thread-safe — the const forwards of several threads share it; a mutex guards the making
/// — and a copy starts empty (the copy packs its own).
template <class Scalar>
class WeightCache {
 public:
  WeightCache() = default;
  WeightCache(const WeightCache&) noexcept {}
  WeightCache& operator=(const WeightCache&) noexcept {
    clear();
    return *this;
  }
  ~WeightCache() = default;

  /// Slot `slot`'s micro-kernel packing for `stamp`; `make(PackedB<Scalar>&)` packs it when the slot is
  /// empty or stale. The packing stays alive while the returned pointer does.
  template <class Make>
  std::shared_ptr<const cpu::PackedB<Scalar>> packed(std::size_t slot, std::uint64_t stamp, Make&& make) const {
    return get(packed_, slot, stamp, Bf16Engine::Fallback, make);
  }
  /// Slot `slot`'s bfloat16 packing for `stamp` on the current engine, as packed().
  template <class Make>
  std::shared_ptr<const cpu::Bf16PackedB> bf16(std::size_t slot, std::uint64_t stamp, Make&& make) const {
    return get(bf16_, slot, stamp, bf16_engine(), make);
  }
  /// Drops every packing.
  void clear() noexcept {
    const std::lock_guard<std::mutex> lock(mutex_);
    packed_.clear();
    bf16_.clear();
  }

 private:
  template <class P>
  struct Slot {
    std::shared_ptr<const P> packed;
    std::uint64_t stamp = 0;
    Bf16Engine engine = Bf16Engine::Fallback;  ///< the bfloat16 engine it was made for
  };
  template <class P, class Make>
  std::shared_ptr<const P> get(std::vector<Slot<P>>& slots, std::size_t slot, std::uint64_t stamp, Bf16Engine engine,
                               Make& make) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (slots.size() <= slot) slots.resize(slot + 1);
    Slot<P>& s = slots[slot];
    if (s.packed == nullptr || s.stamp != stamp || s.engine != engine) {
      s.packed.reset();  // the stale packing's memory back first
      std::shared_ptr<P> fresh = std::make_shared<P>();
      make(*fresh);
      s.packed = std::move(fresh);
      s.stamp = stamp;
      s.engine = engine;
    }
    return s.packed;
  }
  mutable std::mutex mutex_;
  mutable std::vector<Slot<cpu::PackedB<Scalar>>> packed_;
  mutable std::vector<Slot<cpu::Bf16PackedB>> bf16_;
};

}  // namespace kernels
}  // namespace c2f
