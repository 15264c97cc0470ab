// c2f dist — rows of other ranks' shards, fetched by position: the halo of a convolution, the keys at
// power-of-two distances of HMHA's global level. One MPI_Alltoallv moves every rank's request at once;
// no rank sends a request: each computes every rank's from the shard plan, which all ranks share.
#pragma once

#include "c2f/dist/comm.hpp"

#include <algorithm>
#include <vector>

namespace c2f {
namespace dist {
namespace detail {

/// A run of positions [begin, end) of a sequence.
struct Range {
  Index begin = 0, end = 0;
  Index size() const { return end - begin; }
};

/// Positions held by the shards that start at begin[r] (begin[P] = the sequence's length): every rank
/// asks for the ranges wants(r) of positions inside [0, begin[P]) (its own positions too, if it likes),
/// and gets, for each of its ranges in order, a [batch·size, width] matrix: the range's rows of batch
/// item 0, then of item 1, …. local [batch·n, width] holds this rank's positions of every batch item.
/// Collective: every rank calls it with the same plan and the same function `wants`.
template <class Scalar, class Wants>
std::vector<RowMatrix<Scalar>> fetch_rows(const Comm& comm, const char* layer, const ConstRowMatrixRef<Scalar>& local,
                                          Index batch, const std::vector<Index>& begin, Wants&& wants) {
  const int ranks = comm.size(), me = comm.rank();
  const Index width = local.cols(), n = begin[me + 1] - begin[me];
  const auto piece = [&](const Range& r, int holder) {
    return Range{std::max(r.begin, begin[holder]), std::min(r.end, begin[holder + 1])};
  };
  // What every rank asks of this one, packed rank by rank, range by range, batch item by batch item.
  std::vector<int> send_counts(static_cast<std::size_t>(ranks)), send_displs(send_counts), recv_counts(send_counts),
      recv_displs(send_counts);
  std::vector<Range> pieces;
  std::vector<int> piece_rank;
  Index rows = 0;
  for (int p = 0; p < ranks; ++p) {
    const Index first = rows;
    for (const Range& r : wants(p)) {
      const Range part = piece(r, me);
      if (part.size() <= 0) continue;
      pieces.push_back(part);
      rows += batch * part.size();
    }
    send_displs[p] = mpi_count(first, layer, "the rows sent");
    send_counts[p] = mpi_count(rows - first, layer, "the rows sent to one rank");
  }
  RowMatrix<Scalar> sent(rows, width);
  Index at = 0;
  for (const Range& part : pieces) {
    for (Index b = 0; b < batch; ++b, at += part.size()) {
      sent.middleRows(at, part.size()) = local.middleRows(b * n + part.begin - begin[me], part.size());
    }
  }
  // What this rank receives, by holder.
  const std::vector<Range> mine = wants(me);
  rows = 0;
  for (int p = 0; p < ranks; ++p) {
    const Index first = rows;
    for (const Range& r : mine) rows += batch * std::max<Index>(0, piece(r, p).size());
    recv_displs[p] = mpi_count(first, layer, "the rows received");
    recv_counts[p] = mpi_count(rows - first, layer, "the rows received from one rank");
  }
  RowMatrix<Scalar> received(rows, width);
  const RowType<Scalar> row(width, layer);
  MPI_Alltoallv(sent.data(), send_counts.data(), send_displs.data(), row.get(), received.data(), recv_counts.data(),
                recv_displs.data(), row.get(), comm.get());
  // Unpacked into one matrix per range.
  std::vector<RowMatrix<Scalar>> out;
  for (const Range& r : mine) out.emplace_back(batch * std::max<Index>(0, r.size()), width);
  at = 0;
  for (int p = 0; p < ranks; ++p) {
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const Range part = piece(mine[i], p);
      if (part.size() <= 0) continue;
      for (Index b = 0; b < batch; ++b, at += part.size()) {
        out[i].middleRows(b * mine[i].size() + part.begin - mine[i].begin, part.size()) =
            received.middleRows(at, part.size());
      }
    }
  }
  return out;
}

}  // namespace detail
}  // namespace dist
}  // namespace c2f
