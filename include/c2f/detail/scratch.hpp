// c2f — reused scratch memory for the large temporaries of a call (projected q/k/v, packed GEMM
// panels, heads' outputs) and for the outputs forward() returns (c2f/output.hpp).
//
// Without it, every forward mallocs and frees the same large buffers: glibc serves those above its mmap
// threshold with fresh mappings (and trims its heap after the smaller ones), so each call faults its
// temporaries in again, page by page, and the kernel zeroes every page — measured 8–12 % of an MHA
// forward at L ≤ 2048 (docs/layers.md, "Scratch memory"). A process-wide cache keeps the blocks a call
// frees and hands them to the next request of a size they fit (at most twice the request), the way ONNX
// Runtime's arena and PyTorch's caching allocator do; blocks below kScratchMinBytes go straight to malloc,
// which serves those well. The cache holds at most c2f::scratch_cache_limit() bytes (set_scratch_cache_limit(),
// env C2F_SCRATCH_CACHE_BYTES, default a quarter of the machine's memory and at least 256 MiB; 0 turns it
// off) and c2f::release_scratch_cache() frees what it holds. One mutex guards it: a call takes a few dozen blocks at
// most. Under AddressSanitizer the cache is off, so that a use after free of a temporary is still caught.
#pragma once

#include "c2f/core.hpp"
#include "c2f/detail/huge_pages.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define C2F_SCRATCH_CACHE_DEFAULT_OFF 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define C2F_SCRATCH_CACHE_DEFAULT_OFF 1
#endif
#endif

namespace c2f {
namespace detail {

/// Requests below this size are not cached (malloc's own bins serve them without faulting pages).
constexpr std::size_t kScratchMinBytes = std::size_t(256) << 10;
constexpr std::size_t kScratchAlign = 64;

class ScratchCache {
 public:
  /// The process-wide cache; never destroyed, so that a block freed during static destruction still
  /// has somewhere to go.
  static ScratchCache& instance() {
    static ScratchCache* cache = new ScratchCache();
    return *cache;
  }

  /// A block of at least `bytes` (64-byte aligned), its real capacity, and whether it comes from the cache
  /// (its pages mapped and written by an earlier holder) rather than from malloc.
  struct Block {
    void* data;
    std::size_t capacity;
    bool reused;
  };
  Block take(std::size_t bytes) {
    if (bytes >= kScratchMinBytes) {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first / 2 <= bytes) {
        const Block block{it->second, it->first, true};
        cached_ -= it->first;
        free_.erase(it);
        return block;
      }
    }
    void* p = Eigen::internal::handmade_aligned_malloc(bytes, kScratchAlign);
    if (p == nullptr && bytes > 0) {
      release();  // the cache may hold what the allocation needs
      p = Eigen::internal::handmade_aligned_malloc(bytes, kScratchAlign);
      if (p == nullptr) throw std::bad_alloc();
    }
    advise_huge_pages(p, bytes);
    return {p, bytes, false};
  }

  /// Returns a block from take(): cached when it fits the limit — the blocks cached before it freed,
  /// smallest first, as far as it needs the room — freed otherwise.
  void give(void* p, std::size_t capacity) noexcept {
    if (p == nullptr) return;
    std::vector<void*> evicted;
    bool kept = false;
    if (capacity >= kScratchMinBytes) {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (capacity <= limit_) {
        try {
          if (cached_ + capacity > limit_) evicted.reserve(free_.size());
          while (cached_ + capacity > limit_ && !free_.empty()) {
            cached_ -= free_.begin()->first;
            evicted.push_back(free_.begin()->second);
            free_.erase(free_.begin());
          }
          free_.emplace(capacity, p);
          cached_ += capacity;
          kept = true;
        } catch (...) {  // no memory for the bookkeeping: free the block instead
        }
      }
    }
    for (void* e : evicted) Eigen::internal::handmade_aligned_free(e);
    if (!kept) Eigen::internal::handmade_aligned_free(p);
  }

  /// Frees every cached block.
  void release() noexcept {
    std::multimap<std::size_t, void*> blocks;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
      cached_ = 0;
    }
    for (const std::pair<const std::size_t, void*>& b : blocks) Eigen::internal::handmade_aligned_free(b.second);
  }

  void set_limit(std::size_t bytes) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      limit_ = bytes;
      if (cached_ <= limit_) return;
    }
    release();
  }
  std::size_t limit() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return limit_;
  }
  /// Bytes the cache holds now.
  std::size_t cached() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return cached_;
  }

 private:
  ScratchCache() : limit_(initial_limit()) {}
  static std::size_t initial_limit() {
#if defined(C2F_SCRATCH_CACHE_DEFAULT_OFF)
    return 0;
#else
    const char* env = std::getenv("C2F_SCRATCH_CACHE_BYTES");
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      const unsigned long long v = std::strtoull(env, &end, 10);
      if (end != nullptr && *end == '\0') return static_cast<std::size_t>(v);
    }
    return default_limit();
#endif
  }
  /// A quarter of the machine's memory, at least 256 MiB: room for the largest outputs a loop reuses
  /// (C2FAttention2D's at 1024², d = 512, is 2 GiB).
  static std::size_t default_limit() {
    std::size_t limit = std::size_t(256) << 20;
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0)
      limit = std::max(limit, static_cast<std::size_t>(pages) / 4 * static_cast<std::size_t>(page));
#endif
    return limit;
  }

  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;  ///< capacity → block
  std::size_t cached_ = 0;
  std::size_t limit_;
};

/// Of a freed block of `bytes`, what the cache keeps (and so stays allocated for the rest of a call):
/// all of it when it is cached, else 0. For the workspace_bytes formulas.
inline std::size_t scratch_kept_bytes(std::size_t bytes) {
  return bytes >= kScratchMinBytes && ScratchCache::instance().limit() >= bytes ? bytes : 0;
}

/// A move-only owner of one scratch block of `count` Scalars (not initialised).
template <class Scalar>
class ScratchArray {
 public:
  ScratchArray() = default;
  explicit ScratchArray(std::size_t count) { reserve(count); }
  ScratchArray(ScratchArray&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)),
        capacity_(std::exchange(o.capacity_, 0)),
        reused_(std::exchange(o.reused_, false)) {}
  ScratchArray& operator=(ScratchArray&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      capacity_ = std::exchange(o.capacity_, 0);
      reused_ = std::exchange(o.reused_, false);
    }
    return *this;
  }
  ScratchArray(const ScratchArray&) = delete;
  ScratchArray& operator=(const ScratchArray&) = delete;
  ~ScratchArray() { reset(); }

  /// Room for at least `count` Scalars; the contents are lost when the block changes.
  void reserve(std::size_t count) {
    if (count <= capacity_ / sizeof(Scalar) && data_ != nullptr) return;
    reset();
    const ScratchCache::Block block = ScratchCache::instance().take(count * sizeof(Scalar));
    data_ = static_cast<Scalar*>(block.data);
    capacity_ = block.capacity;
    reused_ = block.reused;
  }
  void reset() noexcept {
    ScratchCache::instance().give(data_, capacity_);
    data_ = nullptr;
    capacity_ = 0;
    reused_ = false;
  }
  Scalar* data() const { return data_; }
  /// Whether the block came from the cache (mapped and written before) rather than from malloc.
  bool reused() const { return reused_; }

 private:
  Scalar* data_ = nullptr;
  std::size_t capacity_ = 0;  ///< bytes
  bool reused_ = false;
};

/// A row-major matrix that owns a scratch block: a layer's temporaries within one call, and what its
/// forward_train keeps for its backward (Saved), which a training loop allocates and frees every step —
/// from the cache, those blocks come back without being faulted in again. It is an Eigen::Map over its
/// block, so every Map expression and Eigen::Ref binds to it. resize() re-points it (the contents are
/// lost); assigning an Eigen expression resizes it first (the expression must not read the matrix
/// itself); copies are deep, and a move hands the block over.
template <class Scalar>
class ScratchRowMatrix : public Eigen::Map<RowMatrix<Scalar>, Eigen::Aligned64> {
 public:
  using Base = Eigen::Map<RowMatrix<Scalar>, Eigen::Aligned64>;

  ScratchRowMatrix() : Base(nullptr, 0, 0) {}
  ScratchRowMatrix(Index rows, Index cols) : Base(nullptr, 0, 0) { resize(rows, cols); }
  ScratchRowMatrix(const ScratchRowMatrix& o) : Base(nullptr, 0, 0) { assign(o); }
  ScratchRowMatrix(ScratchRowMatrix&& o) noexcept : Base(nullptr, 0, 0) { take(o); }
  ScratchRowMatrix& operator=(const ScratchRowMatrix& o) {
    if (this != &o) assign(o);
    return *this;
  }
  ScratchRowMatrix& operator=(ScratchRowMatrix&& o) noexcept {
    if (this != &o) take(o);
    return *this;
  }
  template <class Derived>
  ScratchRowMatrix& operator=(const Eigen::DenseBase<Derived>& e) {
    assign(e.derived());
    return *this;
  }

  /// [rows, cols], uninitialised unless the size is unchanged.
  void resize(Index rows, Index cols) {
    if (rows == this->rows() && cols == this->cols()) return;
    buffer_.reserve(static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols));
    rebind(buffer_.data(), rows, cols);
  }

 private:
  template <class Expr>
  void assign(const Expr& e) {
    resize(e.rows(), e.cols());
    if (e.size() > 0) static_cast<Base&>(*this) = e;
  }
  void take(ScratchRowMatrix& o) noexcept {
    const Index rows = o.rows(), cols = o.cols();
    buffer_ = std::move(o.buffer_);
    rebind(buffer_.data(), rows, cols);
    o.rebind(nullptr, 0, 0);
  }
  /// Eigen's way to re-point a Map: placement new (a Map has no other state).
  void rebind(Scalar* data, Index rows, Index cols) noexcept { new (static_cast<Base*>(this)) Base(data, rows, cols); }

  ScratchArray<Scalar> buffer_;
};

}  // namespace detail

/// Bytes of freed scratch memory and outputs c2f keeps for the next calls (default a quarter of the
/// machine's memory, at least 256 MiB, or the environment variable C2F_SCRATCH_CACHE_BYTES; 0 under
/// AddressSanitizer). See detail/scratch.hpp.
inline std::size_t scratch_cache_limit() { return detail::ScratchCache::instance().limit(); }
/// Sets that limit; 0 turns the cache off. Blocks over the new limit are freed.
inline void set_scratch_cache_limit(std::size_t bytes) { detail::ScratchCache::instance().set_limit(bytes); }
/// Bytes the cache holds now.
inline std::size_t scratch_cache_bytes() { return detail::ScratchCache::instance().cached(); }
/// Frees every block the cache holds (c2f keeps using it for later calls).
inline void release_scratch_cache() { detail::ScratchCache::instance().release(); }

}  // namespace c2f
