// c2f — non-temporal (streaming) stores for large outputs written once and not read back.
//
// An ordinary store to a line that is not in cache first reads the line from memory (read for
// ownership), so writing a B-byte output that does not fit in cache moves 2·B bytes. A non-temporal
// store (x86 `movntps`/`movntpd`) writes whole lines through write-combining buffers without reading
// them: B bytes. kernels::broadcast_chunks writes C2F's and C2FAttention2D's output this way when it is
// large (the A/B: "Streaming stores and register-held tiles" in
// git show 9944106:docs/benchmarks.md). Bits are the
// same as an ordinary copy's. Builds for other architectures copy with ordinary stores.
#pragma once

#include "c2f/core.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace c2f {
namespace cpu {

/// Outputs of at least this many bytes are written with streaming stores: well above the per-core
/// caches, so the written lines would be evicted before anyone reads them.
constexpr std::size_t kStreamStoreMinBytes = std::size_t(16) << 20;

/// Whether this build has streaming stores for Scalar (x86 with SSE2: float and double).
template <class Scalar>
constexpr bool has_stream_stores() {
#if defined(__SSE2__)
  return std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value;
#else
  return false;
#endif
}

/// dst[0, n) = src[0, n): streaming stores on the vector-aligned middle of dst, ordinary stores on its
/// unaligned ends. src may be unaligned. Call stream_fence() before another thread reads dst.
template <class Scalar>
inline void copy_streaming(const Scalar* src, Scalar* dst, Index n) noexcept {
  Index k = 0;
#if defined(__SSE2__)
  if constexpr (has_stream_stores<Scalar>()) {
#if defined(__AVX__)
    constexpr std::uintptr_t kAlign = 32;
#else
    constexpr std::uintptr_t kAlign = 16;
#endif
    constexpr Index kLanes = static_cast<Index>(kAlign / sizeof(Scalar));
    for (; k < n && (reinterpret_cast<std::uintptr_t>(dst + k) & (kAlign - 1)) != 0; ++k) dst[k] = src[k];
    for (; k + kLanes <= n; k += kLanes) {
      if constexpr (std::is_same<Scalar, float>::value) {
#if defined(__AVX__)
        _mm256_stream_ps(dst + k, _mm256_loadu_ps(src + k));
#else
        _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
#endif
      } else {
#if defined(__AVX__)
        _mm256_stream_pd(dst + k, _mm256_loadu_pd(src + k));
#else
        _mm_stream_pd(dst + k, _mm_loadu_pd(src + k));
#endif
      }
    }
  }
#endif
  for (; k < n; ++k) dst[k] = src[k];
}

/// Orders this thread's streaming stores before its later stores (and so before the pool's completion
/// signal): they are weakly ordered on x86.
inline void stream_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace cpu
}  // namespace c2f
