// c2f — the thread runtime: one process-wide pool of worker threads serves every parallel loop.
//
//   c2f::set_num_threads(n)   at most n threads per call: the calling thread plus n − 1 pool workers
//                             (0 = back to the default: C2F_NUM_THREADS, else the CPUs this process
//                             may run on)
//   c2f::get_num_threads()
//   c2f::set_min_parallel_work(w)  loops announcing less work than w run on the calling thread
//
// The pool is Eigen's non-blocking thread pool (unsupported/Eigen/CXX11/ThreadPool, the one behind
// the Tensor module's ThreadPoolDevice), created on first use and kept for the life of the process.
// A module's own num_threads caps its calls below get_num_threads(). See detail/parallel.hpp for the
// loop itself.
#pragma once

#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/ThreadPool>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__linux__)
#include <sched.h>
#endif

namespace c2f {
namespace detail {

/// Work announced by a loop below which it runs on the calling thread; the unit is a floating-point
/// operation (a multiply-add counts 2). Measured on this project's machine (2-vCPU VM, AVX-512) with
/// bench_runtime's `loop` entries (README, section "Threads"; two runs on a shared machine): a second
/// thread pays from 0.13–2 M FLOP when the pool worker is awake, but only from 8–34 M FLOP when it has
/// been idle and must be woken (tens to hundreds of µs on a VM). A call cannot know which it will get,
/// so the threshold is the idle break-even: a loop is split only when it costs about 200 µs on one thread.
constexpr double kDefaultMinParallelWork = 1.6e7;

/// CPUs this process may run on: its affinity mask on Linux (so `taskset` and container CPU sets
/// count), otherwise std::thread::hardware_concurrency().
inline int available_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

/// The value of environment variable `name` as a number ≥ `lowest`, or `fallback` when it is unset
/// or empty. Anything else (text, trailing characters, out of range) throws std::invalid_argument.
inline double env_number(const char* name, double lowest, double fallback, bool integer) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text, &end);
  const bool whole = v == static_cast<double>(static_cast<long long>(v));
  if (end == text || *end != '\0' || errno != 0 || !(v >= lowest) || v > 1e18 || (integer && !whole)) {
    throw std::invalid_argument(std::string("c2f: environment variable ") + name + " must be " +
                                (integer ? "an integer" : "a number") +
                                " >= " + std::to_string(static_cast<long long>(lowest)) + ", got '" + text + "'");
  }
  return v;
}

/// True on a thread that is running a c2f task (a pool worker, or a caller inside parallel_for): a
/// parallel loop started there runs inline.
inline bool& in_parallel_region() {
  static thread_local bool flag = false;
  return flag;
}

/// Eigen::ThreadPool's standard environment, plus set-up of every worker thread: it counts as inside a
/// parallel region (nested loops run inline), and with OpenMP its nthreads ICV is 1, so Eigen's
/// products on it never start an OpenMP team (Eigen asks omp_get_max_threads(), which reads the
/// calling thread's ICV).
struct PoolEnvironment {
  using Task = Eigen::StlThreadEnvironment::Task;
  using EnvThread = Eigen::StlThreadEnvironment::EnvThread;

  EnvThread* CreateThread(std::function<void()> f) {
    return new EnvThread([f = std::move(f)] {
      in_parallel_region() = true;
#if defined(_OPENMP)
      omp_set_num_threads(1);
#endif
      f();
    });
  }
  Task CreateTask(std::function<void()> f) { return Task{std::move(f)}; }
  void ExecuteTask(const Task& t) { t.f(); }
};

using Pool = Eigen::ThreadPoolTempl<PoolEnvironment>;

/// The process-wide settings and the pool. Created on first use and never destroyed, so that c2f
/// stays usable from static destructors and from threads that outlive main().
class Runtime {
 public:
  static Runtime& get() {
    static Runtime* const runtime = new Runtime();
    return *runtime;
  }

  int num_threads() {
    const int n = threads_.load(std::memory_order_acquire);
    return n > 0 ? n : resolve_default();
  }

  void set_num_threads(int n) {
    if (n < 0) {
      throw std::invalid_argument("c2f::set_num_threads: expected a thread count >= 1 (or 0 for the default), got " +
                                  std::to_string(n));
    }
    const int value = n > 0 ? n : default_threads();
    std::lock_guard<std::mutex> lock(mutex_);
    threads_.store(value, std::memory_order_release);
    // A pool of another size is released; loops running on it keep it alive until they finish.
    if (pool_ && pool_->NumThreads() != value - 1) pool_.reset();
  }

  double min_parallel_work() {
    const double w = min_work_.load(std::memory_order_acquire);
    if (w >= 0) return w;
    const double fallback = env_number("C2F_MIN_PARALLEL_WORK", 0, kDefaultMinParallelWork, false);
    min_work_.store(fallback, std::memory_order_release);
    return fallback;
  }

  void set_min_parallel_work(double work) {
    if (!(work >= 0)) {
      throw std::invalid_argument("c2f::set_min_parallel_work: expected a work amount >= 0, got " +
                                  std::to_string(work));
    }
    min_work_.store(work, std::memory_order_release);
  }

  /// The pool of num_threads() − 1 workers, created on first use; null when num_threads() is 1.
  std::shared_ptr<Pool> pool() {
    const int threads = num_threads();
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pool_ && threads > 1) {
      pool_ = std::make_shared<Pool>(threads - 1);
      workers_created_ += threads - 1;
    }
    return pool_;
  }

  /// Worker threads started since the process began (for tests: a call never creates threads).
  long long workers_created() {
    std::lock_guard<std::mutex> lock(mutex_);
    return workers_created_;
  }

 private:
  Runtime() = default;

  static int default_threads() {
    return static_cast<int>(env_number("C2F_NUM_THREADS", 1, static_cast<double>(available_cpus()), true));
  }

  int resolve_default() {
    const int value = default_threads();  // throws on a malformed C2F_NUM_THREADS, every time it is read
    int expected = 0;
    threads_.compare_exchange_strong(expected, value, std::memory_order_acq_rel);
    return threads_.load(std::memory_order_acquire);
  }

  std::mutex mutex_;
  std::atomic<int> threads_{0};         // 0 = not resolved yet
  std::atomic<double> min_work_{-1.0};  // < 0 = not resolved yet
  std::shared_ptr<Pool> pool_;
  long long workers_created_ = 0;
};

}  // namespace detail

/// The most threads one c2f call uses: the calling thread plus get_num_threads() − 1 workers of c2f's
/// pool. Defaults to C2F_NUM_THREADS when set, else the CPUs this process may run on.
inline int get_num_threads() { return detail::Runtime::get().num_threads(); }

/// Sets get_num_threads() for the whole process (n ≥ 1; 0 restores the default). A module's own
/// num_threads caps its calls further. Call it at start-up, or while no other thread is inside a c2f
/// call: a running call sizes its per-worker scratch from the count. Results never depend on it.
inline void set_num_threads(int n) { detail::Runtime::get().set_num_threads(n); }

/// Loops that announce less work than this (in floating-point operations) run on the calling thread,
/// where waking a worker would cost more than it saves. Default: C2F_MIN_PARALLEL_WORK when set, else
/// a value measured on this project's machine; 0 parallelises every loop with more than one task.
inline double get_min_parallel_work() { return detail::Runtime::get().min_parallel_work(); }
inline void set_min_parallel_work(double flop) { detail::Runtime::get().set_min_parallel_work(flop); }

}  // namespace c2f
