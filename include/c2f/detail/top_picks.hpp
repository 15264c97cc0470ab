// c2f — the best few candidates by score, as the chunk-selection kernels need them.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace c2f {
namespace detail {

/// The `picks` best candidates by score (highest first, ties to the lower index, NaN ranks like −inf),
/// kept while the candidates arrive in ascending index order.
template <class Scalar>
class TopPicks {
 public:
  explicit TopPicks(Index picks) : picks_(std::max<Index>(picks, 0)), best_(static_cast<std::size_t>(picks_)) {}
  void clear() { n_ = 0; }
  void offer(Scalar score, Index index) {
    if (picks_ == 0) return;
    if (std::isnan(score)) score = -std::numeric_limits<Scalar>::infinity();
    // An equal score arriving later has a higher index, so it ranks below: strict > only.
    if (n_ == picks_ && !(score > best_[static_cast<std::size_t>(n_ - 1)].first)) return;
    Index pos = n_ < picks_ ? n_++ : picks_ - 1;
    while (pos > 0 && score > best_[static_cast<std::size_t>(pos - 1)].first) {
      best_[static_cast<std::size_t>(pos)] = best_[static_cast<std::size_t>(pos - 1)];
      --pos;
    }
    best_[static_cast<std::size_t>(pos)] = {score, index};
  }
  /// Writes own ∪ the picks, ascending, into out[0 .. picks + 1).
  void write(Index own, Index* out) const {
    out[0] = own;
    for (Index r = 0; r < n_; ++r) out[r + 1] = best_[static_cast<std::size_t>(r)].second;
    std::sort(out, out + n_ + 1);
  }

 private:
  Index picks_ = 0, n_ = 0;
  std::vector<std::pair<Scalar, Index>> best_;
};

}  // namespace detail
}  // namespace c2f
