// The thread runtime: one persistent pool, thread counts, nested loops, the small-work threshold,
// errors. Every test that changes a process-wide setting restores the default at the end.
#include "support/eigen_assert_throws.hpp"
#include "support/settings.hpp"

#include "c2f/detail/parallel.hpp"
#include "c2f/detail/scratch.hpp"
#include "c2f/output.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using c2f::Index;
using c2f::detail::parallel_for;
using c2f::detail::resolve_threads;

// Restores the process-wide settings when a test ends, however it ends.
struct RuntimeSettings {
  RuntimeSettings(int threads, double min_work) {
    c2f::set_num_threads(threads);
    c2f::set_min_parallel_work(min_work);
  }
  ~RuntimeSettings() {
    c2f::set_num_threads(0);
    c2f::set_min_parallel_work(c2f::detail::kDefaultMinParallelWork);
  }
};

void busy_wait(std::chrono::microseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) {
  }
}

// Runs `tasks` tasks and checks: each runs exactly once; worker < resolve_threads; no two tasks run
// with the same worker at the same time. Returns the threads that ran tasks.
std::set<std::thread::id> run_and_check(Index tasks, int threads, double work, std::chrono::microseconds task_time) {
  const int workers = resolve_threads(threads, tasks);
  std::vector<std::atomic<int>> runs(static_cast<std::size_t>(tasks));
  std::vector<std::atomic<int>> busy(static_cast<std::size_t>(workers));
  std::atomic<int> bad_worker{0}, overlap{0};
  std::mutex mutex;
  std::set<std::thread::id> ids;
  parallel_for(tasks, threads, work, [&](Index t, int worker) {
    if (worker < 0 || worker >= workers) {
      ++bad_worker;
      return;
    }
    if (busy[static_cast<std::size_t>(worker)].exchange(1) != 0) ++overlap;
    ++runs[static_cast<std::size_t>(t)];
    if (task_time.count() > 0) busy_wait(task_time);
    {
      std::lock_guard<std::mutex> lock(mutex);
      ids.insert(std::this_thread::get_id());
    }
    busy[static_cast<std::size_t>(worker)] = 0;
  });
  EXPECT_EQ(bad_worker.load(), 0) << tasks << " tasks, threads " << threads;
  EXPECT_EQ(overlap.load(), 0) << tasks << " tasks, threads " << threads;
  for (Index t = 0; t < tasks; ++t) {
    EXPECT_EQ(runs[static_cast<std::size_t>(t)].load(), 1) << "task " << t << " of " << tasks;
  }
  return ids;
}

TEST(Runtime, EveryTaskRunsOnceOnAValidWorker) {
  const RuntimeSettings settings(3, 0);
  for (int threads : {0, 1, 2, 3, 5}) {
    for (Index tasks : {1, 2, 3, 7, 64, 1000}) run_and_check(tasks, threads, c2f::detail::kUnknownWork, {});
  }
}

TEST(Runtime, ThreadCountsResolveAndCap) {
  const RuntimeSettings settings(3, 0);
  EXPECT_EQ(c2f::get_num_threads(), 3);
  EXPECT_EQ(resolve_threads(0, 100), 3);
  EXPECT_EQ(resolve_threads(2, 100), 2);
  EXPECT_EQ(resolve_threads(8, 100), 3);  // a module's count only caps
  EXPECT_EQ(resolve_threads(0, 2), 2);    // never more than the tasks
  EXPECT_EQ(resolve_threads(0, 0), 1);
  c2f::set_num_threads(0);
  const char* env = std::getenv("C2F_NUM_THREADS");
  EXPECT_EQ(c2f::get_num_threads(), env != nullptr ? std::atoi(env) : c2f::detail::available_cpus());
  EXPECT_THROW(c2f::set_num_threads(-1), std::invalid_argument);
  EXPECT_THROW(c2f::set_min_parallel_work(-1.0), std::invalid_argument);
}

TEST(Runtime, LargeLoopsUseAPoolThread) {
  const RuntimeSettings settings(2, 0);
  // 200 tasks of 0.5 ms: the caller cannot take them all before the pool worker wakes up, even with
  // other test processes on the cores.
  const std::set<std::thread::id> ids =
      run_and_check(200, 0, c2f::detail::kUnknownWork, std::chrono::microseconds(500));
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids.count(std::this_thread::get_id()), 1u);
}

TEST(Runtime, SmallLoopsRunOnTheCallingThread) {
  const RuntimeSettings settings(2, 1e6);
  for (double work : {0.0, 1e3, 0.99e6}) {
    const std::set<std::thread::id> ids = run_and_check(40, 0, work, std::chrono::microseconds(100));
    ASSERT_EQ(ids.size(), 1u) << "work " << work;
    EXPECT_EQ(*ids.begin(), std::this_thread::get_id()) << "work " << work;
  }
  // At the threshold, the second thread joins.
  EXPECT_EQ(run_and_check(200, 0, 2e6, std::chrono::microseconds(500)).size(), 2u);
}

TEST(Runtime, ThePoolIsCreatedOnceAndReused) {
  const RuntimeSettings settings(3, 0);
  run_and_check(16, 0, c2f::detail::kUnknownWork, std::chrono::microseconds(200));  // creates the pool if needed
  const long long created = c2f::detail::Runtime::get().workers_created();
  std::set<std::thread::id> all;
  for (int call = 0; call < 200; ++call) {
    const std::set<std::thread::id> ids = run_and_check(6, 0, c2f::detail::kUnknownWork, std::chrono::microseconds(20));
    all.insert(ids.begin(), ids.end());
  }
  EXPECT_EQ(c2f::detail::Runtime::get().workers_created(), created) << "a call created threads";
  EXPECT_LE(all.size(), 3u) << "tasks ran on more threads than the caller and the 2 pool workers";
  EXPECT_GE(all.size(), 2u);
}

TEST(Runtime, ChangingTheThreadCountReplacesThePool) {
  const RuntimeSettings settings(3, 0);
  run_and_check(8, 0, c2f::detail::kUnknownWork, {});
  const long long before = c2f::detail::Runtime::get().workers_created();
  c2f::set_num_threads(2);
  const std::set<std::thread::id> ids =
      run_and_check(200, 0, c2f::detail::kUnknownWork, std::chrono::microseconds(300));
  EXPECT_EQ(c2f::detail::Runtime::get().workers_created(), before + 1);
  EXPECT_EQ(ids.size(), 2u);
  c2f::set_num_threads(2);  // the same count keeps the pool
  run_and_check(8, 0, c2f::detail::kUnknownWork, {});
  EXPECT_EQ(c2f::detail::Runtime::get().workers_created(), before + 1);
}

TEST(Runtime, NestedLoopsRunInline) {
  const RuntimeSettings settings(2, 0);
  std::atomic<int> wrong{0}, inner_runs{0};
  parallel_for(8, 0, [&](Index, int) {
    if (resolve_threads(0, 100) != 1) ++wrong;
    const std::thread::id outer = std::this_thread::get_id();
    parallel_for(5, 0, [&](Index, int worker) {
      if (worker != 0 || std::this_thread::get_id() != outer) ++wrong;
      ++inner_runs;
    });
    busy_wait(std::chrono::microseconds(200));
  });
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(inner_runs.load(), 40);
  // Outside any task, loops are parallel again.
  EXPECT_EQ(resolve_threads(0, 100), 2);
}

TEST(Runtime, TheFirstExceptionIsRethrownAndThePoolStaysUsable) {
  const RuntimeSettings settings(2, 0);
  // The other worker keeps claiming tasks while the thrower unwinds, which under ThreadSanitizer can
  // take milliseconds (a CI run saw all of 100 × 20 µs tasks run). 20 000 tasks need 0.4 s of work, so
  // "stopped early" does not depend on how fast an exception unwinds.
  constexpr int kTasks = 20000;
  for (int rep = 0; rep < 20; ++rep) {
    std::atomic<int> ran{0};
    EXPECT_THROW(parallel_for(kTasks, 0,
                              [&](Index t, int) {
                                ++ran;
                                if (t == 10 + rep) throw std::runtime_error("task failed");
                                busy_wait(std::chrono::microseconds(20));
                              }),
                 std::runtime_error);
    EXPECT_LT(ran.load(), kTasks);  // the loop stopped early
  }
  run_and_check(50, 0, c2f::detail::kUnknownWork, std::chrono::microseconds(50));
}

// detail::GroupBlockTasks (sdpa_streaming's and chunk_sparse_attention's order): every (group, block) is one
// task; with preparation, the first `groups` tasks are the groups' block 0, each group is prepared once,
// and no task of a group runs before its preparation finished — even when the other workers reach the
// group while it is being prepared (2 groups of 8 blocks on 3 threads: the third task is group 0's
// block 1 while group 0 is being prepared for 300 µs).
TEST(Runtime, LeadTasksPrepareEachGroupOnceBeforeItsBlocks) {
  const RuntimeSettings settings(3, 0);
  for (bool prepared : {false, true}) {
    for (const std::pair<Index, Index>& shape :
         {std::pair<Index, Index>{1, 1}, {1, 5}, {3, 1}, {4, 4}, {7, 3}, {2, 8}, {8, 16}}) {
      const Index groups = shape.first, blocks = shape.second, tasks = groups * blocks;
      const c2f::detail::GroupBlockTasks order(groups, blocks, prepared);
      std::vector<std::atomic<int>> seen(static_cast<std::size_t>(tasks)),
          preparations(static_cast<std::size_t>(groups));
      std::vector<std::atomic<bool>> ready(static_cast<std::size_t>(groups));
      std::atomic<int> early{0}, bad_lead{0};
      parallel_for(tasks, 0, [&](Index t, int) {
        const std::pair<Index, Index> at = order.task(t);
        ASSERT_TRUE(at.first >= 0 && at.first < groups && at.second >= 0 && at.second < blocks) << "task " << t;
        ++seen[static_cast<std::size_t>(at.first * blocks + at.second)];
        if (prepared && t < groups && at != std::pair<Index, Index>{t, 0}) ++bad_lead;
        order.prepare(at.first, [&](Index g) {
          ++preparations[static_cast<std::size_t>(g)];
          busy_wait(std::chrono::microseconds(300));
          ready[static_cast<std::size_t>(g)] = true;
        });
        if (prepared && !ready[static_cast<std::size_t>(at.first)]) ++early;
      });
      const std::string where =
          std::to_string(groups) + " × " + std::to_string(blocks) + (prepared ? ", prepared" : "");
      for (Index i = 0; i < tasks; ++i)
        EXPECT_EQ(seen[static_cast<std::size_t>(i)].load(), 1) << where << ": (group, block) " << i;
      for (Index g = 0; g < groups; ++g) {
        EXPECT_EQ(preparations[static_cast<std::size_t>(g)].load(), prepared ? 1 : 0) << where << ": group " << g;
      }
      EXPECT_EQ(early.load(), 0) << where;
      EXPECT_EQ(bad_lead.load(), 0) << where;
    }
  }
}

TEST(Runtime, BadInputToALoopIsHarmless) {
  int runs = 0;
  parallel_for(0, 0, [&](Index, int) { ++runs; });
  parallel_for(-3, 2, [&](Index, int) { ++runs; });
  EXPECT_EQ(runs, 0);
}

// The scratch cache (detail/scratch.hpp) is shared by every thread: callers on several threads take and
// return blocks, and change or empty the cache, at once. A block is never handed to two holders at a
// time (each fills its block with its own mark and finds it intact), and under TSan (the tsan preset
// runs this suite) the cache's bookkeeping shows no race. Block sizes are above kScratchMinBytes, so
// the cache is used (below it malloc serves them directly).
TEST(Runtime, ScratchCacheServesConcurrentHolders) {
  const auto cache_setting = c2f_test::scoped_scratch_cache_limit(std::size_t(64) << 20);
  constexpr int kThreads = 4, kRounds = 200;
  const std::size_t base = c2f::detail::kScratchMinBytes / sizeof(int);
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        const std::size_t count = base * static_cast<std::size_t>(1 + (t + r) % 3);
        c2f::detail::ScratchArray<int> block(count);
        const int mark = t * kRounds + r;
        for (std::size_t i = 0; i < count; i += 1024) block.data()[i] = mark;
        std::this_thread::yield();
        for (std::size_t i = 0; i < count; i += 1024) {
          if (block.data()[i] != mark) ++corrupted;
        }
        if (t == 0 && r % 50 == 0) c2f::release_scratch_cache();
        if (t == 1 && r % 70 == 0) c2f::set_scratch_cache_limit(std::size_t(32 + r % 3) << 20);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_LE(c2f::scratch_cache_bytes(), c2f::scratch_cache_limit());
}

// c2f::Output (what forward returns): a TensorMap that owns a scratch block. Copies are deep, moves hand
// the block over, assignment of an expression writes the values, and a dead Output's block serves the next
// one of a size it fits.
TEST(Output, CopiesAreDeepAndMovesHandTheBufferOver) {
  c2f::Output<float> a({2, 3, 4});
  for (Index i = 0; i < a.size(); ++i) a.data()[i] = static_cast<float>(i);
  c2f::Output<float> b = a;
  ASSERT_EQ(b.dimensions(), a.dimensions());
  EXPECT_NE(b.data(), a.data());
  EXPECT_EQ(b(1, 2, 3), 23.0f);
  float* const data = a.data();
  c2f::Output<float> c = std::move(a);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(a.size(), 0);  // NOLINT(bugprone-use-after-move): a moved-from Output is empty
  EXPECT_EQ(a.data(), nullptr);
  c = c * 2.0f;  // an expression: written into c's own buffer
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c(1, 2, 3), 46.0f);
  const c2f::Tensor3<float> t = c + b;  // a plain tensor from an expression of Outputs
  EXPECT_EQ(t(1, 2, 3), 69.0f);
  c2f::Output<float> d({1, 1, 1});
  d = c;  // copy-assignment takes the other's shape
  EXPECT_EQ(d.dimensions(), c.dimensions());
  EXPECT_EQ(d(0, 1, 2), c(0, 1, 2));
  EXPECT_NE(d.data(), c.data());
  d.swap(b);
  EXPECT_EQ(d(1, 2, 3), 23.0f);
  EXPECT_EQ(b(1, 2, 3), 46.0f);
  const c2f::Output<float> empty;
  EXPECT_EQ(empty.size(), 0);
  EXPECT_THROW(c2f::Output<float>({-1, 2, 3}), std::invalid_argument);
  EXPECT_THROW(c2f::Output<float>({Index(1) << 40, Index(1) << 40, 4}), std::invalid_argument);
  EXPECT_THROW(c2f::Output<float>({Index(1) << 20, Index(1) << 20, 1 << 10}), std::invalid_argument);  // > 1 TiB
}

TEST(Output, ADeadOutputsBufferServesTheNext) {
  if (c2f::scratch_cache_limit() == 0) GTEST_SKIP() << "the scratch cache is off (an AddressSanitizer build)";
  c2f::release_scratch_cache();
  const std::array<Index, 3> dims{1, 512, 256};  // 512 KiB, above kScratchMinBytes
  const float* first = nullptr;
  {
    c2f::Output<float> y(dims);
    EXPECT_FALSE(y.reused_buffer());
    first = y.data();
  }
  EXPECT_GE(c2f::scratch_cache_bytes(), std::size_t(512) << 10);
  {
    const c2f::Output<float> y(dims);
    EXPECT_TRUE(y.reused_buffer());
    EXPECT_EQ(y.data(), first);
    const c2f::Output<float> z(dims);  // the one block is taken: z's is new
    EXPECT_FALSE(z.reused_buffer());
  }
  {  // the control: with the cache off, nothing comes back
    const auto off = c2f_test::scoped_scratch_cache_limit(0);
    { const c2f::Output<float> y(dims); }
    EXPECT_EQ(c2f::scratch_cache_bytes(), 0u);
    const c2f::Output<float> y(dims);
    EXPECT_FALSE(y.reused_buffer());
  }
  c2f::release_scratch_cache();
}

// A block given back to a full cache evicts smaller ones kept before it, as far as it needs the room.
TEST(Output, AFullCacheMakesRoomForTheLatestBlock) {
  if (c2f::scratch_cache_limit() == 0) GTEST_SKIP() << "the scratch cache is off (an AddressSanitizer build)";
  c2f::release_scratch_cache();
  const auto limit = c2f_test::scoped_scratch_cache_limit(std::size_t(3) << 20);
  { const c2f::Output<float> small({1, 256, 1024}), other({1, 256, 1024}); }  // 2 × 1 MiB kept
  EXPECT_EQ(c2f::scratch_cache_bytes(), std::size_t(2) << 20);
  { const c2f::Output<float> big({1, 512, 1024}); }  // 2 MiB: one of the small ones goes
  EXPECT_EQ(c2f::scratch_cache_bytes(), std::size_t(3) << 20);
  const c2f::Output<float> again({1, 512, 1024});
  EXPECT_TRUE(again.reused_buffer());
  { const c2f::Output<float> too_big({1, 1024, 1024}); }  // 4 MiB > the limit: freed, nothing evicted
  EXPECT_EQ(c2f::scratch_cache_bytes(), std::size_t(1) << 20);
  c2f::release_scratch_cache();
}

// Outputs made on one thread die on another while others make theirs (the TSan preset runs this suite).
TEST(Output, OutputsLiveAndDieOnAnyThread) {
  constexpr int kThreads = 4, kRounds = 100;
  std::atomic<int> corrupted{0};
  std::mutex handoff_mutex;
  std::vector<c2f::Output<int>> handoff;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        c2f::Output<int> y({1, 256 + 64 * ((t + r) % 3), 256});
        const int mark = t * kRounds + r;
        std::fill(y.data(), y.data() + y.size(), mark);
        if (y(0, y.dimension(1) - 1, 255) != mark || y(0, 0, 0) != mark) ++corrupted;
        const std::lock_guard<std::mutex> lock(handoff_mutex);
        handoff.push_back(std::move(y));
        if (handoff.size() > 3) handoff.erase(handoff.begin());  // another thread's output dies here
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(corrupted.load(), 0);
  handoff.clear();
  EXPECT_LE(c2f::scratch_cache_bytes(), c2f::scratch_cache_limit());
}

// Registered separately with C2F_NUM_THREADS / C2F_MIN_PARALLEL_WORK set (tests/CMakeLists.txt);
// C2F_TEST_EXPECT names what the environment should produce.
TEST(RuntimeEnvironment, VariablesSetTheDefaults) {
  const char* expect = std::getenv("C2F_TEST_EXPECT");
  if (expect == nullptr) GTEST_SKIP() << "run by the runtime.env_* tests with the environment set";
  const std::string e = expect;
  if (e == "threads=3") {
    EXPECT_EQ(c2f::get_num_threads(), 3);
    EXPECT_EQ(resolve_threads(0, 100), 3);
    EXPECT_EQ(c2f::get_min_parallel_work(), 12345.0);
  } else if (e == "invalid") {
    try {
      c2f::get_num_threads();
      ADD_FAILURE() << "a malformed C2F_NUM_THREADS was accepted";
    } catch (const std::invalid_argument& error) {
      EXPECT_NE(std::string(error.what()).find("C2F_NUM_THREADS"), std::string::npos) << error.what();
      EXPECT_NE(std::string(error.what()).find(std::getenv("C2F_NUM_THREADS")), std::string::npos) << error.what();
    }
    // An explicit count still works.
    c2f::set_num_threads(2);
    EXPECT_EQ(c2f::get_num_threads(), 2);
  } else {
    FAIL() << "unknown C2F_TEST_EXPECT=" << e;
  }
}

}  // namespace
