// c2f in a program built with -fopenmp. Eigen parallelises a product with OpenMP unless it is already
// inside an OpenMP team; c2f's pool threads are not OpenMP threads, so c2f must keep Eigen
// single-threaded inside its tasks itself — otherwise every task starts a nested team (measured:
// MultiHeadAttention at L = 2048 took 100× longer). Built twice: test_openmp (c2f's pool, the default)
// and test_openmp_loops (-DC2F_PARALLEL_OPENMP: c2f's loops on OpenMP teams).
#include "support/eigen_assert_throws.hpp"

#include "c2f/detail/parallel.hpp"
#include "openmp/outputs.hpp"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#if !defined(_OPENMP)
#error "test_openmp must be built with OpenMP"
#endif

namespace {

using c2f::Index;

// Threads of this process, from /proc/self/status (-1 where unavailable).
int process_threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

// Runs after every test: back to the defaults.
class OpenMP : public ::testing::Test {
 protected:
  void SetUp() override {
    saved_ = omp_get_max_threads();
    omp_set_num_threads(4);  // outside c2f, Eigen would now use 4 threads per product
    c2f::set_num_threads(2);
    c2f::set_min_parallel_work(0);
  }
  void TearDown() override {
    omp_set_num_threads(saved_);
    c2f::set_num_threads(0);
    c2f::set_min_parallel_work(c2f::detail::kDefaultMinParallelWork);
  }
  int saved_ = 1;
};

TEST_F(OpenMP, EigenIsSingleThreadedInsideEveryTask) {
  ASSERT_EQ(Eigen::nbThreads(), 4) << "the test needs OpenMP active outside c2f";
  std::atomic<int> not_one{0};
  std::mutex mutex;
  std::set<std::thread::id> ids;
  for (int rep = 0; rep < 5; ++rep) {
    c2f::detail::parallel_for(64, 0, [&](Index, int) {
      if (Eigen::nbThreads() != 1 || omp_get_max_threads() != 1) ++not_one;
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while (std::chrono::steady_clock::now() < until) {
      }
      std::lock_guard<std::mutex> lock(mutex);
      ids.insert(std::this_thread::get_id());
    });
  }
  EXPECT_EQ(not_one.load(), 0) << "tasks saw Eigen::nbThreads() > 1";
  EXPECT_EQ(ids.size(), 2u) << "the tasks did not run on two threads";
  EXPECT_EQ(Eigen::nbThreads(), 4) << "the caller's OpenMP thread count was not restored";
  // A single-threaded call (inline on the caller) is guarded too.
  c2f::detail::parallel_for(3, 1, [&](Index, int) {
    if (Eigen::nbThreads() != 1) ++not_one;
  });
  EXPECT_EQ(not_one.load(), 0);
}

TEST_F(OpenMP, ForwardStartsNoOpenMPTeam) {
  const int before_pool = process_threads();
  if (before_pool < 0) GTEST_SKIP() << "/proc/self/status is not available";
  c2f::detail::parallel_for(8, 0, [](Index, int) {});  // c2f's own threads exist from here on
  const int with_pool = process_threads();
  EXPECT_LE(with_pool, before_pool + 1);
  const c2f_openmp::Outputs outputs = c2f_openmp::compute();
  EXPECT_EQ(outputs.size(), 8u);
  EXPECT_EQ(process_threads(), with_pool) << "a forward started OpenMP threads (a nested team)";

  // The probe sees a team when there is one: an Eigen product of the same size on a plain thread
  // that allows 3 OpenMP threads.
  int during = -1;
  std::thread([&] {
    omp_set_num_threads(3);
    const c2f::RowMatrix<float> a = c2f::RowMatrix<float>::Random(600, 64), b = c2f::RowMatrix<float>::Random(64, 64);
    c2f::RowMatrix<float> c(600, 64);
    c.noalias() = a * b;
    during = process_threads();
  }).join();
  EXPECT_GT(during, with_pool + 1) << "control: Eigen did not start a team, so the check above proves nothing";
}

TEST_F(OpenMP, ResultsEqualThePlainBuildBitForBit) {
  const char* path = std::getenv("C2F_OPENMP_PLAIN_OUTPUTS");
  if (path == nullptr)
    GTEST_SKIP() << "set C2F_OPENMP_PLAIN_OUTPUTS to the file openmp_plain_outputs wrote (ctest does)";
  const c2f_openmp::Outputs plain = c2f_openmp::read(path);
  const c2f_openmp::Outputs mine = c2f_openmp::compute();
  ASSERT_EQ(plain.size(), mine.size());
  for (const auto& [name, values] : mine) {
    const auto it = plain.find(name);
    ASSERT_NE(it, plain.end()) << name << " is missing from " << path;
    ASSERT_EQ(it->second.size(), values.size()) << name;
    EXPECT_EQ(0, std::memcmp(it->second.data(), values.data(), values.size() * sizeof(float)))
        << name << ": the -fopenmp build differs from the plain build";
  }
}

}  // namespace
