// c2f — parallel_for: independent tasks spread over the calling thread and c2f's worker pool.
//
// Every loop runs on the calling thread (worker 0) plus up to resolve_threads() − 1 workers of the
// process-wide pool (c2f/runtime.hpp); tasks are claimed one by one from a shared counter. The caller
// never waits for a helper that has not started: it claims whatever is left itself and then waits only
// for tasks already running, so a busy pool (several callers at once) costs no idle time.
//
// With OpenMP (-fopenmp), Eigen's products inside a task run single-threaded: pool workers have their
// OpenMP thread count set to 1, and so does the calling thread while it runs tasks. A loop started
// inside a c2f task or inside an active OpenMP parallel region runs inline. Defining
// C2F_PARALLEL_OPENMP (with -fopenmp) runs the loops on OpenMP teams instead of the pool — the
// alternative measured in the README (section "Threads"); the default is the pool.
#pragma once

#include "c2f/core.hpp"
#include "c2f/runtime.hpp"

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(C2F_PARALLEL_OPENMP) && !defined(_OPENMP)
#error "C2F_PARALLEL_OPENMP runs c2f's loops on OpenMP: compile with -fopenmp"
#endif

namespace c2f {
namespace detail {

/// Work of a loop that did not announce it: it is never considered small.
constexpr double kUnknownWork = std::numeric_limits<double>::infinity();

/// Work estimates count floating-point operations of products (a multiply-add is 2); an element-wise,
/// memory-bound operation (a copy, an add of one element, one exp) counts kElementWork: it takes
/// about as long as that many product FLOP on the machines c2f targets.
constexpr double kElementWork = 8.0;

/// Participants parallel_for uses for a requested count: 0 means get_num_threads(); a positive count
/// is capped by get_num_threads(); never more than `tasks`; 1 inside a c2f task or an OpenMP parallel
/// region (nested loops run inline). Size per-worker scratch with this value.
inline int resolve_threads(int requested, Index tasks) {
  if (in_parallel_region()) return 1;
#if defined(_OPENMP)
  if (omp_in_parallel()) return 1;
#endif
  int n = Runtime::get().num_threads();
  if (requested > 0) n = std::min(n, requested);
  if (tasks < n) n = static_cast<int>(std::max<Index>(1, tasks));
  return n;
}

/// Marks the current thread as running c2f tasks for its lifetime.
class RegionScope {
 public:
  RegionScope() : saved_(in_parallel_region()) { in_parallel_region() = true; }
  ~RegionScope() { in_parallel_region() = saved_; }
  RegionScope(const RegionScope&) = delete;
  RegionScope& operator=(const RegionScope&) = delete;

 private:
  bool saved_;
};

/// With OpenMP: sets the calling thread's OpenMP thread count to 1 for its lifetime, so that Eigen's
/// products in the tasks it runs stay single-threaded; restores it afterwards. Without OpenMP: nothing.
class EigenSingleThreadScope {
 public:
#if defined(_OPENMP)
  EigenSingleThreadScope() : saved_(omp_get_max_threads()) {
    if (saved_ != 1) omp_set_num_threads(1);
  }
  ~EigenSingleThreadScope() {
    if (saved_ != 1) omp_set_num_threads(saved_);
  }

 private:
  int saved_;
#else
  EigenSingleThreadScope() = default;
#endif
  EigenSingleThreadScope(const EigenSingleThreadScope&) = delete;
  EigenSingleThreadScope& operator=(const EigenSingleThreadScope&) = delete;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

/// Shared state of one parallel loop: the task counter, the completion count and the first error.
/// Reference-counted: a helper that starts after the loop has finished still finds it alive (and no
/// task left), while the caller has already returned.
class LoopState {
 public:
  using Invoke = void (*)(void* fn, Index task, int worker);

  /// How long the caller spins for running tasks to finish before it blocks.
  static constexpr std::chrono::microseconds kSpin{20};

  LoopState(Index tasks, Invoke invoke, void* fn, int references)
      : tasks_(tasks), invoke_(invoke), fn_(fn), references_(references) {}

  /// Claims and runs tasks until none is left. The first exception stops the loop: unclaimed tasks
  /// are dropped and the caller rethrows it.
  void participate(int worker) noexcept {
    for (;;) {
      const Index task = next_.fetch_add(1, std::memory_order_relaxed);
      if (task >= tasks_) return;
      try {
        invoke_(fn_, task, worker);
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!error_) error_ = std::current_exception();
        }
        const Index unclaimed = next_.exchange(tasks_, std::memory_order_relaxed);
        if (unclaimed < tasks_) finish(tasks_ - unclaimed);
      }
      finish(1);
    }
  }

  /// Returns once every claimed task has finished (spinning briefly, then blocking).
  void wait() {
    if (done()) return;
    const std::chrono::steady_clock::time_point until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 1;; ++i) {
      cpu_relax();
      if (done()) return;
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lock(mutex_);
    finished_cv_.wait(lock, [this] { return done(); });
  }

  std::exception_ptr error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

  void release() {
    if (references_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  bool done() const { return finished_.load(std::memory_order_acquire) >= tasks_; }

  void finish(Index n) {
    if (finished_.fetch_add(n, std::memory_order_acq_rel) + n == tasks_) {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_cv_.notify_all();
    }
  }

  const Index tasks_;
  const Invoke invoke_;
  void* const fn_;
  std::atomic<Index> next_{0};
  std::atomic<Index> finished_{0};
  std::atomic<int> references_;
  std::mutex mutex_;
  std::condition_variable finished_cv_;
  std::exception_ptr error_;
};

template <class F>
void invoke_task(void* fn, Index task, int worker) {
  (*static_cast<F*>(fn))(task, worker);
}

/// Calls fn(task, worker) for every task in [0, tasks); worker ∈ [0, resolve_threads(threads, tasks))
/// indexes per-worker scratch space, and no two tasks run with the same worker at the same time.
/// `threads`: 0 = get_num_threads(), else a cap. `work`: the loop's total work in floating-point
/// operations (a multiply-add counts 2); below get_min_parallel_work() the loop runs on the calling
/// thread, and each participant beyond the first needs that much work.
///
/// Tasks are independent and each one's arithmetic is fixed by its index alone, so results are
/// bitwise identical whatever the thread count. The first exception thrown by a task is rethrown here.
template <class Fn>
void parallel_for(Index tasks, int threads, double work, Fn&& fn) {
  if (tasks <= 0) return;
  if (in_parallel_region()) {
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  int workers = resolve_threads(threads, tasks);
  if (workers > 1 && work < kUnknownWork) {
    const double min_work = Runtime::get().min_parallel_work();
    if (min_work > 0) workers = static_cast<int>(std::min<double>(workers, 1.0 + std::floor(work / min_work)));
  }
  const RegionScope region;
  [[maybe_unused]] const EigenSingleThreadScope single_threaded_eigen;
  if (workers == 1) {
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }

  using F = std::remove_reference_t<Fn>;
  void* const fn_ptr = const_cast<void*>(static_cast<const void*>(std::addressof(fn)));
#if defined(C2F_PARALLEL_OPENMP)
  LoopState state(tasks, &invoke_task<F>, fn_ptr, 0);
#pragma omp parallel num_threads(workers)
  {
    const RegionScope member;
    state.participate(omp_get_thread_num());
  }
  state.wait();
  const std::exception_ptr error = state.error();
#else
  const std::shared_ptr<Pool> pool = Runtime::get().pool();
  if (!pool) {  // the thread count was set to 1 meanwhile
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  workers = std::min(workers, pool->NumThreads() + 1);
  LoopState* const state = new LoopState(tasks, &invoke_task<F>, fn_ptr, workers);
  int scheduled = 1;
  try {
    for (; scheduled < workers; ++scheduled) {
      const int worker = scheduled;
      pool->Schedule([state, worker] {
        state->participate(worker);
        state->release();
      });
    }
  } catch (...) {  // out of memory while queueing: the helpers not queued never run
    for (int w = scheduled; w < workers; ++w) state->release();
  }
  state->participate(0);
  state->wait();
  const std::exception_ptr error = state->error();
  state->release();
#endif
  if (error) std::rethrow_exception(error);
}

/// parallel_for without a work estimate: parallel whenever there are several tasks and threads.
template <class Fn>
void parallel_for(Index tasks, int threads, Fn&& fn) {
  parallel_for(tasks, threads, kUnknownWork, std::forward<Fn>(fn));
}

/// parallel_for with one `Workspace` of scratch per worker: fn(task, workspace). The workspaces live
/// for the loop; their count caps the loop's participants, so a concurrent set_num_threads() cannot
/// give a worker index beyond them.
template <class Workspace, class Fn>
void parallel_for_each_worker(Index tasks, int threads, double work, Fn&& fn) {
  std::vector<Workspace> workspaces(static_cast<std::size_t>(resolve_threads(threads, tasks)));
  parallel_for(tasks, static_cast<int>(workspaces.size()), work,
               [&](Index task, int worker) { fn(task, workspaces[static_cast<std::size_t>(worker)]); });
}

/// The order of a loop over groups × blocks tasks whose groups each need a one-time preparation that all
/// of their blocks read (sdpa_streaming: a head's keys and values packed). With `prepared`, the first
/// `groups` tasks are each group's block 0 — the workers prepare different groups at once, each right
/// before the group's first block, while the data is in its cache — and the rest go group by group
/// (blocks 1, 2, …); prepare(g, fn) runs fn(g) once per group, in whichever task comes first, and a
/// second task of the group waits for it. Without, tasks go group by group from block 0 and prepare() does
/// nothing. A task's arithmetic depends on its (group, block) alone: the bits stay the same for any
/// thread count. The A/B: "Packing each head in its first task" in
/// git show 9944106:docs/benchmarks.md.
class GroupBlockTasks {
 public:
  GroupBlockTasks(Index groups, Index blocks, bool prepared)
      : groups_(groups),
        blocks_(blocks),
        once_(prepared ? new std::once_flag[static_cast<std::size_t>(groups)] : nullptr) {}

  /// Task t's (group, block).
  std::pair<Index, Index> task(Index t) const {
    if (!once_ || blocks_ == 1) return {t / blocks_, t % blocks_};
    if (t < groups_) return {t, 0};
    return {(t - groups_) / (blocks_ - 1), 1 + (t - groups_) % (blocks_ - 1)};
  }

  /// fn(g), once for group g (with `prepared`); every caller returns after it finished.
  template <class Fn>
  void prepare(Index g, Fn&& fn) const {
    if (once_) std::call_once(once_[static_cast<std::size_t>(g)], std::forward<Fn>(fn), g);
  }

 private:
  Index groups_, blocks_;
  std::unique_ptr<std::once_flag[]> once_;
};

/// Work (FLOP) of softmax attention of `pairs` (batch, head) pairs, lq queries over lk keys: q kᵀ and
/// p v, plus the softmax's exp, counted as kElementWork per score.
inline double attention_work(Index pairs, Index lq, Index lk, Index dk, Index dv) {
  return static_cast<double>(pairs) * static_cast<double>(lq) * static_cast<double>(lk) *
         (2.0 * static_cast<double>(dk + dv) + kElementWork);
}

}  // namespace detail
}  // namespace c2f
