// c2f dist — shard plans: which part of a sequence each rank holds (contiguous and chunk-aligned for
// the coarse-to-fine layers; contiguous or zig-zag for MultiHeadAttention).
//
// A sequence of L tokens in chunks of k has m = ceil(L / k) chunks (the last one may be partial). The
// even plan gives rank r of P the chunks [⌊r·m/P⌋, ⌊(r+1)·m/P⌋): counts differ by at most one chunk, a
// rank may hold none (P > m), and the partial last chunk goes with the last rank that holds any. The
// layers accept any chunk-aligned plan (each rank's first token a multiple of k), not only this one.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <array>

namespace c2f {
namespace dist {

/// One rank's part of a sequence: chunks [first_chunk, first_chunk + chunks), tokens [begin, begin + length).
struct Shard {
  Index first_chunk = 0, chunks = 0, begin = 0, length = 0;
};

/// Rank `rank` of `ranks` in the even plan of a sequence of `length` tokens in chunks of `chunk`.
/// Throws std::invalid_argument unless length ≥ 0, chunk ≥ 1 and 0 ≤ rank < ranks.
inline Shard even_shard(Index length, Index chunk, int rank, int ranks) {
  if (length < 0 || chunk < 1 || ranks < 1 || rank < 0 || rank >= ranks) {
    c2f::detail::fail("dist::even_shard: needs length >= 0, chunk >= 1 and 0 <= rank < ranks, got length ", length,
                      ", chunk ", chunk, ", rank ", rank, " of ", ranks);
  }
  const Index m = (length + chunk - 1) / chunk;
  const Index c0 = m * rank / ranks, c1 = m * (rank + 1) / ranks;
  Shard s;
  s.first_chunk = c0;
  s.chunks = c1 - c0;
  s.begin = std::min(length, c0 * chunk);
  s.length = std::min(length, c1 * chunk) - s.begin;
  return s;
}

/// A run of positions [begin, begin + length) of a sequence.
struct Segment {
  Index begin = 0, length = 0;
};

/// Rank `rank` of `ranks` in the zig-zag plan of a sequence of `length` tokens, which balances causal
/// attention: the sequence is cut into 2P half-chunks at ⌊i·L/(2P)⌋ and rank r holds half-chunks r and
/// 2P−1−r, in that order (early rows see few keys, late rows many: each rank gets one of each).
inline std::array<Segment, 2> zigzag_segments(Index length, int rank, int ranks) {
  if (length < 0 || ranks < 1 || rank < 0 || rank >= ranks) {
    c2f::detail::fail("dist::zigzag_segments: needs length >= 0 and 0 <= rank < ranks, got length ", length, ", rank ",
                      rank, " of ", ranks);
  }
  const Index halves = 2 * static_cast<Index>(ranks);
  const auto edge = [&](Index i) { return length / halves * i + length % halves * i / halves; };
  const Index a = rank, b = halves - 1 - rank;
  return {Segment{edge(a), edge(a + 1) - edge(a)}, Segment{edge(b), edge(b + 1) - edge(b)}};
}

}  // namespace dist
}  // namespace c2f
