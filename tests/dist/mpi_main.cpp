// GoogleTest main for the tests that run under mpirun: every rank runs every test, and the process
// exits with the worst result over the ranks (MPI_Allreduce MAX), so a failure on any one rank fails
// the run. Rank 0 prints the usual output; the other ranks print only their failures, tagged with the
// rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

namespace {

/// Prints a failed assertion of a rank other than 0 (rank 0 has GoogleTest's own printer).
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                 result.line_number(), result.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed()) {
      std::fprintf(stderr, "[rank %d] [  FAILED  ] %s.%s\n", rank_, info.test_suite_name(), info.name());
    }
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;  // c2f's worker threads never call MPI: only the calling thread does
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int mine = RUN_ALL_TESTS();
  int worst = 0;
  MPI_Allreduce(&mine, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != 0 && mine == 0) std::fprintf(stderr, "[rank 0] another rank failed a test\n");
  MPI_Finalize();
  return worst;
}
