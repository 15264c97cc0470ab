// c2f — readying the pages of a fresh buffer before a layer computes into it: huge pages advised, then
// the pages faulted in on the call's threads, or left to the fill's first writes (docs/layers.md,
// "Fresh outputs").
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/huge_pages.hpp"
#include "c2f/detail/parallel.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace c2f {
namespace detail {

/// Maps the pages that hold [data, data + bytes) writable, on the calling thread: one
/// madvise(MADV_POPULATE_WRITE) where the kernel has it (Linux 5.14 on), which writes nothing (a page
/// shared with memory around the range is only mapped); elsewhere, or when the call fails, one byte per
/// 4 KiB page is written (the range holds no values yet).
inline void populate_pages(unsigned char* data, std::size_t bytes) {
  if (data == nullptr || bytes == 0) return;
  constexpr std::size_t kPage = 4096;
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  const std::uintptr_t from = reinterpret_cast<std::uintptr_t>(data) & ~std::uintptr_t(kPage - 1);
  const std::uintptr_t to = (reinterpret_cast<std::uintptr_t>(data + bytes) + kPage - 1) & ~std::uintptr_t(kPage - 1);
  if (::madvise(reinterpret_cast<void*>(from), to - from, MADV_POPULATE_WRITE) == 0) return;
#endif
  for (std::size_t at = 0; at < bytes; at += kPage) *static_cast<volatile unsigned char*>(data + at) = 0;
}

/// Faults in the pages of a fresh buffer of kHugePageMinBytes or more before a layer computes into it.
/// Each of `threads` threads (KernelOptions::num_threads convention; resolve_threads) takes one
/// contiguous run of whole 2 MiB pages in address order, so that no two threads fault the same huge page
/// and none hops between pages in the order of the layer's tasks (docs/benchmarks.md#forward-in-a-loop;
/// the A/B: "Fresh outputs faulted in before the layer computes" in git show 9944106:docs/benchmarks.md). A run is
/// populated by one madvise(MADV_POPULATE_WRITE) where the kernel has it (Linux 5.14 on), which maps its pages writable
/// and writes nothing: no page fault per 4 KiB page of the buffer's ends, outside its whole 2 MiB pages
/// (the A/B: "Fresh pages populated in one call" in
/// git show 9944106:docs/benchmarks.md). Elsewhere, or when the call
/// fails, one byte per 4 KiB page is written (the buffer holds no values yet: the layer then writes
/// every element). Smaller buffers are left alone.
inline void fault_in_pages(void* data, std::size_t bytes, int threads) {
  if (data == nullptr || bytes < kHugePageMinBytes) return;
  unsigned char* const begin = static_cast<unsigned char*>(data);
  const std::size_t pages = (bytes + kHugePageBytes - 1) / kHugePageBytes;
  const Index workers = resolve_threads(threads, static_cast<Index>(pages));
  const std::size_t per_worker =
      (pages + static_cast<std::size_t>(workers) - 1) / static_cast<std::size_t>(workers) * kHugePageBytes;
  parallel_for(workers, threads, kUnknownWork, [&](Index worker, int) {
    const std::size_t first = std::min(bytes, static_cast<std::size_t>(worker) * per_worker);
    populate_pages(begin + first, std::min(bytes, first + per_worker) - first);
  });
}

/// How a fresh output's pages are readied before a layer fills it.
enum class FreshPages {
  /// All faulted in first (fault_in_pages).
  FaultIn,
  /// Left to the fill's first writes, but for the 4 KiB pages at the buffer's two ends that no whole
  /// 2 MiB page covers: for a fill that writes every element once with ordinary stores in address order
  /// (KernelOptions::fresh_output), so that the system zeroes each huge page just before the fill
  /// overwrites it in cache, instead of in a pass of its own over memory (the A/B: "Fresh 2-D
  /// outputs written on first touch" in git show 9944106:docs/benchmarks.md). Taken only where transparent huge pages
  /// are on
  /// (huge_pages_enabled()): a first write per 4 KiB page would fault 512 times as often. Elsewhere
  /// prepare_fresh falls back to FaultIn.
  OnFirstWrite,
};

/// Readies a freshly allocated Eigen matrix or tensor for a layer to compute into: huge pages advised
/// (prefer_huge_pages), then its pages faulted in on `threads` threads (fault_in_pages) or, with
/// FreshPages::OnFirstWrite where huge pages are on, only the ends outside its whole huge pages; all only
/// when it is large. Returns whether the pages were left to the fill's first writes (OnFirstWrite taken):
/// the fill then writes with ordinary stores in address order (KernelOptions::fresh_output).
template <class Buffer>
bool prepare_fresh(Buffer& buffer, int threads, FreshPages pages = FreshPages::FaultIn) {
  prefer_huge_pages(buffer);
  const std::size_t bytes = sizeof(*buffer.data()) * static_cast<std::size_t>(buffer.size());
  if (pages == FreshPages::FaultIn || !huge_pages_enabled()) {
    fault_in_pages(buffer.data(), bytes, threads);
    return false;
  }
  if (bytes >= kHugePageMinBytes) {
    unsigned char* const data = reinterpret_cast<unsigned char*>(buffer.data());
    const WholeHugePages whole = whole_huge_pages(data, bytes);
    populate_pages(data, whole.begin);
    populate_pages(data + whole.end, bytes - whole.end);
  }
  return true;
}

}  // namespace detail
}  // namespace c2f
