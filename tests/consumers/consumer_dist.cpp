// A downstream program on c2f::dist: each rank runs its shard of a coarse-to-fine layer; rank 0 checks
// its rows against the single-process layer.
#include <c2f/c2f.hpp>
#include <c2f/dist.hpp>

#include <mpi.h>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  int provided = 0;  // c2f's worker threads never call MPI: only the calling thread does
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int bad = 0;
  {
    const c2f::dist::Comm comm;
    const c2f::dist::C2FAttention<float> layer(comm, 8, 2, 4);
    c2f::Tensor3<float> whole(1, 30, 8);
    for (Eigen::Index i = 0; i < whole.size(); ++i) whole.data()[i] = static_cast<float>(i % 11) * 0.125f - 0.5f;
    const c2f::dist::Shard s = c2f::dist::even_shard(30, 4, comm.rank(), comm.size());
    c2f::Tensor3<float> mine(1, s.length, 8);
    std::memcpy(mine.data(), whole.data() + s.begin * 8, sizeof(float) * static_cast<std::size_t>(mine.size()));
    const c2f::Tensor3<float> y = layer.forward(mine), want = layer.module().forward(whole);
    bad = std::memcmp(y.data(), want.data() + s.begin * 8, sizeof(float) * static_cast<std::size_t>(y.size())) != 0;
    int any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, comm.get());
    if (comm.rank() == 0)
      std::printf(any ? "c2f dist consumer: rows differ\n" : "c2f dist consumer OK on %d ranks\n", comm.size());
    bad = any;
  }
  MPI_Finalize();
  return bad;
}
