// c2f — a minimal fork-join loop over independent tasks.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace c2f {
namespace detail {

/// Workers parallel_for uses for a requested count: 0 means "all hardware threads"; never more than `tasks`.
inline int resolve_threads(int requested, Index tasks) {
  int n = requested > 0 ? requested : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (tasks < n) n = static_cast<int>(std::max<Index>(1, tasks));
  return n;
}

/// Calls fn(task, worker) for every task in [0, tasks), spread over `threads` workers (0 = all
/// hardware threads); worker ∈ [0, number of workers) indexes per-worker scratch space.
///
/// Tasks are independent and each one's arithmetic is fixed by its index alone, so results are
/// bitwise identical whatever the thread count. The first exception thrown by a task is rethrown here.
template <class Fn>
void parallel_for(Index tasks, int threads, Fn&& fn) {
  if (tasks <= 0) return;
  const int workers = resolve_threads(threads, tasks);
  if (workers == 1) {
    for (Index t = 0; t < tasks; ++t) fn(t, 0);
    return;
  }
  std::atomic<Index> next{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&](int worker) {
    try {
      for (Index t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(t, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next.store(tasks);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(workers - 1));
  for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace detail
}  // namespace c2f
