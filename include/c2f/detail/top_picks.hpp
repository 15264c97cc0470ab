// c2f — the best few candidates by score, as the chunk-selection kernels need them.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
  /// offer(row[j], j) for every j ∈ [0, n) but `skip`, in order, after clear(). Float rows on AVX-512 builds
  /// take `picks` rounds of a vector max over the candidates left (the largest score, the lowest index
  /// among equal ones): the same picks, without a branch per candidate.
  void offer_row(const Scalar* row, Index n, Index skip) {
#if defined(__AVX512F__)
    if constexpr (std::is_same<Scalar, float>::value) {
      if (picks_ > 0 && n > 0) {
        offer_row_avx512(row, n, skip);
        return;
      }
    }
#endif
    for (Index j = 0; j < n; ++j) {
      if (j != skip) offer(row[j], j);
    }
  }
  /// Writes own ∪ the picks, ascending, into out[0 .. picks + 1).
  void write(Index own, Index* out) const {
    out[0] = own;
    for (Index r = 0; r < n_; ++r) out[r + 1] = best_[static_cast<std::size_t>(r)].second;
    std::sort(out, out + n_ + 1);
  }

 private:
#if defined(__AVX512F__)
  void offer_row_avx512(const float* row, Index n, Index skip) {
    const Index blocks = (n + 15) / 16;
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    values_.resize(static_cast<std::size_t>(blocks * 16));
    live_.resize(static_cast<std::size_t>(blocks));
    for (Index b = 0; b < blocks; ++b) {  // the candidates, NaN made −inf; the lanes past n and `skip` dead
      const Index left = n - 16 * b;
      const __mmask16 lanes = left >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
      const __m512 v = _mm512_maskz_loadu_ps(lanes, row + 16 * b);
      _mm512_storeu_ps(values_.data() + 16 * b, _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), lowest));
      live_[static_cast<std::size_t>(b)] = lanes;
    }
    Index candidates = n;
    if (skip >= 0 && skip < n) {
      live_[static_cast<std::size_t>(skip / 16)] &= static_cast<__mmask16>(~(1u << (skip % 16)));
      --candidates;
    }
    n_ = std::min(picks_, candidates);
    for (Index p = 0; p < n_; ++p) {
      __m512 top = lowest;
      for (Index b = 0; b < blocks; ++b) {
        top = _mm512_max_ps(top,
                            _mm512_mask_loadu_ps(lowest, live_[static_cast<std::size_t>(b)], values_.data() + 16 * b));
      }
      const float best = _mm512_reduce_max_ps(top);
      const __m512 wanted = _mm512_set1_ps(best);
      for (Index b = 0;; ++b) {  // the lowest live index that holds it (there is one)
        __mmask16& live = live_[static_cast<std::size_t>(b)];
        const unsigned hit =
            _mm512_mask_cmp_ps_mask(live, _mm512_loadu_ps(values_.data() + 16 * b), wanted, _CMP_EQ_OQ);
        if (hit != 0) {
          const int lane = __builtin_ctz(hit);
          live = static_cast<__mmask16>(live & ~(1u << lane));
          best_[static_cast<std::size_t>(p)] = {best, 16 * b + lane};
          break;
        }
      }
    }
  }
  std::vector<float> values_;
  std::vector<__mmask16> live_;
#endif
  Index picks_ = 0, n_ = 0;
  std::vector<std::pair<Scalar, Index>> best_;
};

}  // namespace detail
}  // namespace c2f
