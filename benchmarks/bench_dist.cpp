// The sequence-parallel layers (c2f/dist) under mpirun: time per call and bytes moved per rank, measured.
//
//   mpirun -np P bench_dist [Google Benchmark flags]      (benchmarks/run_dist.sh runs P = 1 and 2)
//
// Every entry: batch 1, d = E = 512, 8 heads, float; each rank holds its even shard of the L tokens and
// runs C2F_BENCH_THREADS threads (default: the machine's cores / P). Iteration counts are fixed (every
// rank must make the same collective calls); the time of an iteration is the slowest rank's (MPI_Allreduce
// MAX), from a barrier to the end of the call.
//
// Entries:
//   c2f/L          dist::C2FAttention, chunk 32
//   c2f_local/L    c2f::C2FAttention::forward_into on the whole sequence in this process (P = 1 only):
//                  the single-process layer the distributed one is compared with
//   ring/L         dist::MultiHeadAttention, SequenceParallel::Ring, non-causal
//   ring_causal/L  the same, causal, Layout::ZigZag
//   mha_local/L    c2f::MultiHeadAttention::forward_into in this process (P = 1 only)
//   c2f2d/S        dist::C2FAttention2D on an S × S grid in blocks of 32 × 32, sharded by rows of blocks
//   c2f2d_local/S  c2f::C2FAttention2D::forward_into in this process (P = 1 only)
//   hmha/L         dist::HMHA, window 64, all levels, non-causal
//   hmha_local/L   c2f::HMHA::forward_into in this process (P = 1 only)
//
// Counters (per call and rank, the largest over the ranks):
//   recv_bytes     bytes this rank received from other ranks, counted by wrapping MPI_Allgatherv,
//                  MPI_Alltoallv and MPI_Irecv through MPI's profiling interface (PMPI)
//   model_bytes    the formula: C2F Σ_{r ≠ me} B·m_r·2d·4 (every other rank's chunks' coarse keys and
//                  values: (P−1)/P · B·(L/k)·2d values);
//                  ring Σ_{s ≠ me} B·n_s·2E·4 ((P−1)/P · B·L·2E values);
//                  C2F2D as C2F, per block; HMHA: the input halo (1 row either side) ·E·4, every other
//                  rank's window means ·2E·4, and the global level's rows ·2E·4: D rows either side of
//                  the shard (D the largest power of two ≤ its length n) and [s + δ, e + δ) ∩ [0, L)
//                  for every |δ| = 2^p > D
//   control_bytes  the validation exchange (MPI_Allgather of one record per rank)
//   tokens/s       L per second
#include <benchmark/benchmark.h>
#include <mpi.h>

#include "benchmarks/csv_reporter.hpp"
#include "c2f/dist.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>

namespace {

// Bytes received from other ranks, by the wrapped MPI calls below.
std::int64_t g_recv_bytes = 0, g_control_bytes = 0;

int type_bytes(MPI_Datatype t) {
  int size = 0;
  PMPI_Type_size(t, &size);
  return size;
}

}  // namespace

// MPI's profiling interface: these definitions take the place of the library's, count, and call PMPI_*.
extern "C" {
int MPI_Allgatherv(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf, const int recvcounts[],
                   const int displs[], MPI_Datatype recvtype, MPI_Comm comm) {
  int rank = 0, size = 1;
  PMPI_Comm_rank(comm, &rank);
  PMPI_Comm_size(comm, &size);
  for (int r = 0; r < size; ++r) {
    if (r != rank) g_recv_bytes += static_cast<std::int64_t>(recvcounts[r]) * type_bytes(recvtype);
  }
  return PMPI_Allgatherv(sendbuf, sendcount, sendtype, recvbuf, recvcounts, displs, recvtype, comm);
}
int MPI_Alltoallv(const void* sendbuf, const int sendcounts[], const int sdispls[], MPI_Datatype sendtype,
                  void* recvbuf, const int recvcounts[], const int rdispls[], MPI_Datatype recvtype, MPI_Comm comm) {
  int rank = 0, size = 1;
  PMPI_Comm_rank(comm, &rank);
  PMPI_Comm_size(comm, &size);
  for (int r = 0; r < size; ++r) {
    if (r != rank) g_recv_bytes += static_cast<std::int64_t>(recvcounts[r]) * type_bytes(recvtype);
  }
  return PMPI_Alltoallv(sendbuf, sendcounts, sdispls, sendtype, recvbuf, recvcounts, rdispls, recvtype, comm);
}
int MPI_Irecv(void* buf, int count, MPI_Datatype datatype, int source, int tag, MPI_Comm comm, MPI_Request* request) {
  g_recv_bytes += static_cast<std::int64_t>(count) * type_bytes(datatype);
  return PMPI_Irecv(buf, count, datatype, source, tag, comm, request);
}
int MPI_Allgather(const void* sendbuf, int sendcount, MPI_Datatype sendtype, void* recvbuf, int recvcount,
                  MPI_Datatype recvtype, MPI_Comm comm) {
  int size = 1;
  PMPI_Comm_size(comm, &size);
  g_control_bytes += static_cast<std::int64_t>(size - 1) * recvcount * type_bytes(recvtype);
  return PMPI_Allgather(sendbuf, sendcount, sendtype, recvbuf, recvcount, recvtype, comm);
}
}

namespace {

using c2f::Index;
constexpr Index kDim = 512, kHeads = 8, kChunk = 32;

int threads_per_rank(int ranks) {
  if (const char* env = std::getenv("C2F_BENCH_THREADS")) return std::max(1, std::atoi(env));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
}

c2f::Tensor3<float> random_rows(Index length, std::uint64_t seed) {
  c2f::Tensor3<float> x(1, length, kDim);
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (Index i = 0; i < x.size(); ++i) x.data()[i] = u(gen);
  return x;
}

/// Runs `call` once per iteration between a barrier and the slowest rank's end; sets the counters.
template <class Call>
void timed(benchmark::State& state, const c2f::dist::Comm& comm, Index length, double model_bytes, Call&& call) {
  std::int64_t recv = 0, control = 0;
  for (auto _ : state) {
    MPI_Barrier(comm.get());
    const std::int64_t r0 = g_recv_bytes, c0 = g_control_bytes;
    const double t0 = MPI_Wtime();
    call();
    double elapsed = MPI_Wtime() - t0, slowest = 0;
    recv = g_recv_bytes - r0;
    control = g_control_bytes - c0;
    MPI_Allreduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm.get());
    state.SetIterationTime(slowest);
  }
  std::int64_t most[2] = {0, 0}, mine[2] = {recv, control};
  MPI_Allreduce(mine, most, 2, MPI_INT64_T, MPI_MAX, comm.get());
  double model = 0;
  MPI_Allreduce(&model_bytes, &model, 1, MPI_DOUBLE, MPI_MAX, comm.get());
  state.counters["recv_bytes"] = static_cast<double>(most[0]);
  state.counters["model_bytes"] = model;
  state.counters["control_bytes"] = static_cast<double>(most[1]);
  state.counters["ranks"] = comm.size();
  state.counters["threads"] = threads_per_rank(comm.size());
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(length), benchmark::Counter::kIsIterationInvariantRate);
}

/// A single-process entry (P = 1 only): make() builds the layer and the input and returns the call that
/// runs the layer on the whole input.
template <class Make>
void local_entry(benchmark::State& state, Index length, Make&& make) {
  const c2f::dist::Comm comm;
  if (comm.size() != 1) {
    state.SkipWithError("the single-process entry runs at P = 1");
    return;
  }
  auto call = make();
  timed(state, comm, length, 0, call);
}

void BM_c2f(benchmark::State& state) {
  const c2f::dist::Comm comm;
  const Index length = state.range(0);
  const c2f::dist::Shard shard = c2f::dist::even_shard(length, kChunk, comm.rank(), comm.size());
  const c2f::dist::C2FAttention<float> layer(
      comm, kDim, kHeads, kChunk,
      c2f::C2FAttention<float>::Options().seed(1).num_threads(threads_per_rank(comm.size())));
  const c2f::Tensor3<float> x = random_rows(shard.length, 7 + static_cast<std::uint64_t>(comm.rank()));
  c2f::RowMatrix<float> out(shard.length, kDim);
  double model = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (r != comm.rank())
      model += 4.0 * 2 * kDim * static_cast<double>(c2f::dist::even_shard(length, kChunk, r, comm.size()).chunks);
  }
  timed(state, comm, length, model, [&] { layer.forward_into(x, out); });
}

void BM_c2f_local(benchmark::State& state) {
  const Index length = state.range(0);
  local_entry(state, length, [&] {
    return [layer = c2f::C2FAttention<float>(
                kDim, kHeads, kChunk, c2f::C2FAttention<float>::Options().seed(1).num_threads(threads_per_rank(1))),
            x = random_rows(length, 7),
            out = c2f::RowMatrix<float>(length, kDim)]() mutable { layer.forward_into(x, out); };
  });
}

void ring(benchmark::State& state, bool causal) {
  const c2f::dist::Comm comm;
  const Index length = state.range(0);
  using Dist = c2f::dist::MultiHeadAttention<float>;
  const Dist layer(
      comm, kDim, kHeads,
      c2f::MultiHeadAttention<float>::Options().seed(1).causal(causal).num_threads(threads_per_rank(comm.size())),
      Dist::Options().layout(causal ? c2f::dist::Layout::ZigZag : c2f::dist::Layout::Contiguous));
  const auto rows_of = [&](int r) {
    if (causal) {
      const std::array<c2f::dist::Segment, 2> s = c2f::dist::zigzag_segments(length, r, comm.size());
      return s[0].length + s[1].length;
    }
    return c2f::dist::even_shard(length, 1, r, comm.size()).length;
  };
  const c2f::Tensor3<float> x = random_rows(rows_of(comm.rank()), 7 + static_cast<std::uint64_t>(comm.rank()));
  c2f::RowMatrix<float> out(x.dimension(1), kDim);
  double model = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (r != comm.rank()) model += 4.0 * 2 * kDim * static_cast<double>(rows_of(r));
  }
  timed(state, comm, length, model, [&] { layer.forward_into(x, out); });
}
void BM_ring(benchmark::State& state) { ring(state, false); }
void BM_ring_causal(benchmark::State& state) { ring(state, true); }

void BM_mha_local(benchmark::State& state) {
  const Index length = state.range(0);
  local_entry(state, length, [&] {
    return [layer = c2f::MultiHeadAttention<float>(
                kDim, kHeads, c2f::MultiHeadAttention<float>::Options().seed(1).num_threads(threads_per_rank(1))),
            x = random_rows(length, 7),
            out = c2f::RowMatrix<float>(length, kDim)]() mutable { layer.forward_into(x, out, c2f::Masks<float>()); };
  });
}

constexpr Index kBlock = 32, kWindow = 64;

c2f::C2FAttention2D<float> layer_2d(int ranks) {
  return c2f::C2FAttention2D<float>(kDim, kHeads, kBlock, kBlock,
                                    c2f::C2FAttention2D<float>::Options().seed(1).num_threads(threads_per_rank(ranks)));
}

void BM_c2f2d(benchmark::State& state) {
  const c2f::dist::Comm comm;
  const Index side = state.range(0), blocks_w = (side + kBlock - 1) / kBlock;
  const c2f::dist::Shard rows = c2f::dist::even_shard(side, kBlock, comm.rank(), comm.size());
  const c2f::dist::C2FAttention2D<float> layer(comm, layer_2d(comm.size()));
  const c2f::Tensor3<float> x = random_rows(rows.length * side, 7 + static_cast<std::uint64_t>(comm.rank()));
  c2f::RowMatrix<float> out(rows.length * side, kDim);
  double model = 0;
  for (int r = 0; r < comm.size(); ++r) {
    if (r != comm.rank())
      model +=
          4.0 * 2 * kDim * blocks_w * static_cast<double>(c2f::dist::even_shard(side, kBlock, r, comm.size()).chunks);
  }
  timed(state, comm, side * side, model, [&] { layer.forward_into(x, rows.length, side, out); });
}

void BM_c2f2d_local(benchmark::State& state) {
  const Index side = state.range(0);
  local_entry(state, side * side, [&] {
    return [layer = layer_2d(1), x = random_rows(side * side, 7), out = c2f::RowMatrix<float>(side * side, kDim),
            side]() mutable { layer.forward_into(x, side, side, out); };
  });
}

c2f::HMHA<float> layer_hmha(int ranks) {
  return c2f::HMHA<float>(kDim, kHeads, kWindow,
                          c2f::HMHA<float>::Options().seed(1).num_threads(threads_per_rank(ranks)));
}

/// Rows of [lo, hi) ∩ [0, length) outside [s, e).
Index outside(Index lo, Index hi, Index length, Index s, Index e) {
  lo = std::max<Index>(lo, 0);
  hi = std::min(hi, length);
  if (hi <= lo) return 0;
  return (hi - lo) - std::max<Index>(0, std::min(hi, e) - std::max(lo, s));
}

void BM_hmha(benchmark::State& state) {
  const c2f::dist::Comm comm;
  const Index length = state.range(0);
  const c2f::dist::Shard shard = c2f::dist::even_shard(length, kWindow, comm.rank(), comm.size());
  const c2f::dist::HMHA<float> layer(comm, layer_hmha(comm.size()));
  const c2f::Tensor3<float> x = random_rows(shard.length, 7 + static_cast<std::uint64_t>(comm.rank()));
  c2f::RowMatrix<float> out(shard.length, kDim);
  const Index s = shard.begin, e = s + shard.length;
  double rows = 0, kv_rows = 0;  // input rows (the halo); key and value rows (the global level)
  if (shard.length > 0) {
    rows = static_cast<double>(outside(s - 1, s, length, s, e) + outside(e, e + 1, length, s, e));
    Index reach = 1;
    while (2 * reach <= shard.length && 2 * reach < length) reach *= 2;
    double kv = static_cast<double>(outside(s - reach, s, length, s, e) + outside(e, e + reach, length, s, e));
    for (Index step = 2 * reach; step < length; step *= 2) {
      kv += static_cast<double>(outside(s - step, e - step, length, s, e) + outside(s + step, e + step, length, s, e));
    }
    kv_rows = kv;
  }
  double model = 4.0 * kDim * rows + 4.0 * 2 * kDim * kv_rows;
  for (int r = 0; r < comm.size(); ++r) {
    if (r != comm.rank())
      model += 4.0 * 2 * kDim * static_cast<double>(c2f::dist::even_shard(length, kWindow, r, comm.size()).chunks);
  }
  timed(state, comm, length, model, [&] { layer.forward_into(x, out); });
}

void BM_hmha_local(benchmark::State& state) {
  const Index length = state.range(0);
  local_entry(state, length, [&] {
    return [layer = layer_hmha(1), x = random_rows(length, 7), out = c2f::RowMatrix<float>(length, kDim)]() mutable {
      layer.forward_into(x, out, c2f::Masks<float>());
    };
  });
}

BENCHMARK(BM_c2f)->Name("c2f")->Arg(1 << 16)->Arg(1 << 18)->Arg(1 << 20)->Iterations(3)->UseManualTime()->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_c2f_local)
    ->Name("c2f_local")
    ->Arg(1 << 16)
    ->Arg(1 << 18)
    ->Arg(1 << 20)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ring)->Name("ring")->Arg(8192)->Arg(16384)->Arg(32768)->Iterations(1)->UseManualTime()->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_ring_causal)
    ->Name("ring_causal")
    ->Arg(8192)
    ->Arg(16384)
    ->Arg(32768)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_mha_local)
    ->Name("mha_local")
    ->Arg(8192)
    ->Arg(16384)
    ->Arg(32768)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_c2f2d)->Name("c2f2d")->Arg(256)->Arg(512)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_c2f2d_local)
    ->Name("c2f2d_local")
    ->Arg(256)
    ->Arg(512)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_hmha)->Name("hmha")->Arg(1 << 14)->Arg(1 << 16)->Iterations(3)->UseManualTime()->Unit(
    benchmark::kMillisecond);
BENCHMARK(BM_hmha_local)
    ->Name("hmha_local")
    ->Arg(1 << 14)
    ->Arg(1 << 16)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

/// Prints nothing: the reporter of every rank but 0.
class Silent : public benchmark::BenchmarkReporter {
 public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;  // c2f's worker threads never call MPI: only the calling thread does
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  c2f_bench::Runner runner(&argc, argv);  // before Initialize: it takes out the CSV flags
  benchmark::Initialize(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    runner.run();
  } else {
    Silent silent;
    benchmark::RunSpecifiedBenchmarks(&silent);
  }
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
