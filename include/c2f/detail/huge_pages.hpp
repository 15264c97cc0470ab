// c2f — transparent huge pages for large fresh buffers.
//
// A layer's output and its large temporaries are fresh allocations: glibc serves anything above its
// mmap threshold (at most 32 MiB) with a new mapping, and the first write to every 4 KiB page of it
// faults into the kernel, which zeroes the page. For a C2F forward at L = 16384 (a 32 MiB output and
// two 8 MiB temporaries) that costs about as much as the arithmetic. Backing the buffers with 2 MiB
// pages makes it 512 times fewer faults. Linux only asks for it per range (madvise(MADV_HUGEPAGE)) when
// /sys/kernel/mm/transparent_hugepage/enabled is `madvise` (Debian's and Ubuntu's default); with
// `always` it happens anyway, with `never` the advice is ignored. Elsewhere this is a no-op.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace c2f {
namespace detail {

constexpr std::size_t kHugePageBytes = std::size_t(2) << 20;
/// Buffers below this size are left alone (a partly covered 2 MiB page gains little).
constexpr std::size_t kHugePageMinBytes = std::size_t(8) << 20;

/// The whole 2 MiB pages inside [data, data + bytes), as byte offsets from data: [begin, end). When none
/// fits, begin == end == bytes (the whole buffer lies outside them).
struct WholeHugePages {
  std::size_t begin;
  std::size_t end;
};
inline WholeHugePages whole_huge_pages(const void* data, std::size_t bytes) noexcept {
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t mask = ~(std::uintptr_t(kHugePageBytes) - 1);
  const std::uintptr_t begin = (first + kHugePageBytes - 1) & mask;
  const std::uintptr_t end = (first + bytes) & mask;
  if (end <= begin) return {bytes, bytes};
  return {static_cast<std::size_t>(begin - first), static_cast<std::size_t>(end - first)};
}

/// Advises the kernel to back the whole 2 MiB pages inside [data, data + bytes) with huge pages. Call it
/// before the buffer is first written. Failures are ignored: it is only a hint.
inline void advise_huge_pages(const void* data, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (data == nullptr || bytes < kHugePageMinBytes) return;
  const WholeHugePages whole = whole_huge_pages(data, bytes);
  if (whole.end > whole.begin) {
    (void)::madvise(static_cast<char*>(const_cast<void*>(data)) + whole.begin, whole.end - whole.begin, MADV_HUGEPAGE);
  }
#else
  (void)data;
  (void)bytes;
#endif
}

/// Whether advise_huge_pages() takes effect: Linux with /sys/kernel/mm/transparent_hugepage/enabled set
/// to `always` or `madvise` (read once per process).
inline bool huge_pages_enabled() {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string modes;
    std::getline(f, modes);
    return modes.find("[always]") != std::string::npos || modes.find("[madvise]") != std::string::npos;
  }();
  return enabled;
#else
  return false;
#endif
}

/// advise_huge_pages() on a freshly allocated Eigen matrix or tensor (anything with data() and size());
/// returns it, so that `T t = prefer_huge_pages(T(rows, cols));` reads naturally.
template <class Buffer>
Buffer&& prefer_huge_pages(Buffer&& buffer) noexcept {
  advise_huge_pages(buffer.data(), sizeof(*buffer.data()) * static_cast<std::size_t>(buffer.size()));
  return static_cast<Buffer&&>(buffer);
}

}  // namespace detail
}  // namespace c2f
