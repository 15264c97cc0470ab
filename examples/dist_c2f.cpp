// One sequence too long to want on one core, split over MPI ranks: coarse-to-fine attention with
// c2f::dist::C2FAttention, checked against the single-process layer.
//
//   mpirun -np 2 examples/dist_c2f [tokens (default 1048576)] [threads per rank (default 1)]
//
// Every rank builds the same seeded layer (in a real program: load one safetensors file on every rank)
// and generates only its own even shard of the tokens (token t's values depend on t alone). Rank 0 then
// runs the single-process layer on the whole sequence and checks that its own rows are bit-identical.
// Prints tokens/s and the bytes each rank received.
#include <c2f/c2f.hpp>
#include <c2f/dist.hpp>

#include <mpi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace {

constexpr c2f::Index kDim = 512, kHeads = 8, kChunk = 32;

/// Token t's features: a hash of (t, feature), in [-1, 1).
float value(c2f::Index t, c2f::Index f) {
  std::uint64_t s =
      static_cast<std::uint64_t>(t) * 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(f) * 0xC2B2AE3D27D4EB4Full;
  s ^= s >> 29;
  s *= 0xBF58476D1CE4E5B9ull;
  s ^= s >> 32;
  return static_cast<float>(static_cast<double>(s >> 40) / 8388608.0 - 1.0);
}

c2f::Tensor3<float> tokens(c2f::Index begin, c2f::Index length) {
  c2f::Tensor3<float> x(1, length, kDim);
  for (c2f::Index t = 0; t < length; ++t) {
    for (c2f::Index f = 0; f < kDim; ++f) x(0, t, f) = value(begin + t, f);
  }
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;  // c2f's worker threads never call MPI: only the calling thread does
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  int status = 0;
  {
    const c2f::Index length = argc > 1 ? std::atoll(argv[1]) : (c2f::Index{1} << 20);
    const int threads = argc > 2 ? std::atoi(argv[2]) : 1;
    const c2f::dist::Comm comm;
    const c2f::dist::C2FAttention<float> layer(comm, kDim, kHeads, kChunk,
                                               c2f::C2FAttention<float>::Options().seed(42).num_threads(threads));
    const c2f::dist::Shard shard = c2f::dist::even_shard(length, kChunk, comm.rank(), comm.size());
    const c2f::Tensor3<float> x = tokens(shard.begin, shard.length);

    MPI_Barrier(comm.get());
    const double t0 = MPI_Wtime();
    const c2f::Tensor3<float> y = layer.forward(x);
    double elapsed = MPI_Wtime() - t0, slowest = 0;
    MPI_Reduce(&elapsed, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, comm.get());
    // The coarse keys and values of the other ranks' chunks are what arrived here: (m − m_r) rows of 2d floats.
    const double received = 4.0 * 2 * kDim * static_cast<double>((length + kChunk - 1) / kChunk - shard.chunks);
    double most = 0;
    MPI_Reduce(&received, &most, 1, MPI_DOUBLE, MPI_MAX, 0, comm.get());

    if (comm.rank() == 0) {
      std::printf("dist_c2f: %lld tokens, d = %lld, %lld heads, chunk %lld, %d ranks x %d threads\n",
                  static_cast<long long>(length), static_cast<long long>(kDim), static_cast<long long>(kHeads),
                  static_cast<long long>(kChunk), comm.size(), threads);
      std::printf(
          "dist_c2f: %.3f s, %.3g tokens/s, at most %.3g MB received per rank (the other ranks' chunks' coarse keys "
          "and values)\n",
          slowest, static_cast<double>(length) / slowest, most / 1e6);
      // The single-process layer on the whole sequence: rank 0's rows must be the same bits.
      const c2f::Tensor3<float> whole = layer.module().forward(tokens(0, length));
      const bool same = std::memcmp(whole.data(), y.data(), sizeof(float) * static_cast<std::size_t>(y.size())) == 0;
      std::printf("dist_c2f: rank 0's %lld rows %s the single-process forward's\n",
                  static_cast<long long>(shard.length), same ? "are bit-identical to" : "DIFFER from");
      status = same ? 0 : 1;
    }
  }
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return status;
}
