// Counts heap memory by interposing malloc/calloc/realloc/free (glibc) in the binary that includes
// this header. Include it in exactly one translation unit of a test or benchmark executable.
//
// Everything c2f and Eigen allocate goes through malloc (Eigen's aligned_malloc and operator new
// both end there), so the counter sees every buffer, including any [queries, keys] score matrix.
// Not usable under AddressSanitizer, which owns malloc itself: `available()` is false there.
#pragma once

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <cstddef>

#if defined(__SANITIZE_ADDRESS__)
#define C2F_MALLOC_COUNTER_AVAILABLE 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(memory_sanitizer) || __has_feature(thread_sanitizer)
#define C2F_MALLOC_COUNTER_AVAILABLE 0
#endif
#endif
#ifndef C2F_MALLOC_COUNTER_AVAILABLE
#define C2F_MALLOC_COUNTER_AVAILABLE 1
#endif

namespace c2f_memory {

struct Counters {
  std::atomic<bool> enabled{false};
  std::atomic<long long> live{0};     // bytes allocated since reset() and not yet freed
  std::atomic<long long> peak{0};     // maximum of `live` since reset()
  std::atomic<long long> largest{0};  // largest single request since reset()
  std::atomic<long long> count{0};    // number of allocations since reset()
};

inline Counters& counters() {
  static Counters c;
  return c;
}

inline bool available() { return C2F_MALLOC_COUNTER_AVAILABLE != 0; }

/// Starts counting from zero.
inline void reset() {
  Counters& c = counters();
  c.enabled = false;
  c.live = 0;
  c.peak = 0;
  c.largest = 0;
  c.count = 0;
  c.enabled = true;
}
inline void stop() { counters().enabled = false; }

/// Peak bytes held at once (allocated after reset()) — the working memory of the measured code.
inline long long peak_bytes() { return counters().peak.load(); }
inline long long largest_allocation() { return counters().largest.load(); }
inline long long allocation_count() { return counters().count.load(); }

namespace detail {
inline void on_alloc(void* p, std::size_t requested) {
  Counters& c = counters();
  if (p == nullptr || !c.enabled.load(std::memory_order_relaxed)) return;
  const long long n = static_cast<long long>(malloc_usable_size(p));
  const long long live = c.live.fetch_add(n) + n;
  long long peak = c.peak.load();
  while (live > peak && !c.peak.compare_exchange_weak(peak, live)) {
  }
  long long largest = c.largest.load();
  const long long req = static_cast<long long>(requested);
  while (req > largest && !c.largest.compare_exchange_weak(largest, req)) {
  }
  c.count.fetch_add(1);
}
inline void on_free(void* p) {
  Counters& c = counters();
  if (p == nullptr || !c.enabled.load(std::memory_order_relaxed)) return;
  // Frees of blocks allocated before reset() can drive `live` below zero; the peak is unaffected.
  c.live.fetch_sub(static_cast<long long>(malloc_usable_size(p)));
}
}  // namespace detail
}  // namespace c2f_memory

#if C2F_MALLOC_COUNTER_AVAILABLE
extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void __libc_free(void*);

void* malloc(std::size_t n) {
  void* p = __libc_malloc(n);
  c2f_memory::detail::on_alloc(p, n);
  return p;
}
void* calloc(std::size_t n, std::size_t size) {
  void* p = __libc_calloc(n, size);
  c2f_memory::detail::on_alloc(p, n * size);
  return p;
}
void* realloc(void* old, std::size_t n) {
  c2f_memory::detail::on_free(old);
  void* p = __libc_realloc(old, n);
  c2f_memory::detail::on_alloc(p, n);
  return p;
}
void free(void* p) {
  c2f_memory::detail::on_free(p);
  __libc_free(p);
}
}
#endif
