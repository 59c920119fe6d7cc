// The greedy draft token of one row of scores (verispec.drafters.model's greedy drafting): the id
// of the largest score, ties to the smallest id (torch's argmax over the ids in ascending order), and
// that token's confidence, its probability at temperature 1 = 1 / sum_j exp(x_j - max) (fp32: 16
// lanes adding in column order, vec::exp, then the fixed lane reduction; the same bits on every
// tier). A row holding a NaN, or whose largest score is not finite (every score -inf, or +inf),
// has no greedy token (PickResult::ok false), as verispec.sampling.build_laws finds it.
//
// The scores are one or two segments (a restricted head's ids, then the request's own ids scored
// by a second head: drafters/model.py), each column named by its id, the ids ascending within a
// segment (a segment's tie goes to its first column holding the largest score); a column that
// `blocked` marks counts as -inf (an id another request brought).
#include <algorithm>
#include <cmath>
#include <limits>

#include "common.h"
#include "vec.h"

namespace verispec {
using namespace vec;

namespace {

template <typename T>
inline float value_at(const T* x, int64_t j) {
  if constexpr (std::is_same_v<T, float>)
    return x[j];
  else
    return bf16_float(x[j]);
}

template <typename T>
inline F16 load_at(const T* x, int64_t j, int n) {
  if constexpr (std::is_same_v<T, float>)
    return load_n(x + j, n);
  else
    return load_bf16_n(x + j, n);
}

// The largest score of a segment and the id of its first column holding it (the smallest id, as
// a segment's ids ascend), folded into best / best_id (ties between segments: the smaller id); NaN
// noted. Whole vectors of 16 columns by a lane-wise max, NaN by the sum of x * 2^-100 (finite for
// every finite score, NaN only with a NaN or with both infinities, and +inf fails the row anyway);
// the last columns, and a segment with blocked columns, one by one.
template <typename T>
void scan_segment(const PickSegment& s, float& best, int64_t& best_id, bool& nan) {
  const T* x = static_cast<const T*>(s.scores);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float top = neg_inf;
  int64_t j = 0;
  if (!s.blocked && s.width >= 16) {
    F16 lanes = set1(neg_inf), probe = zero();
    const F16 tiny = set1(0x1p-100f);
    for (; j + 16 <= s.width; j += 16) {
      const F16 v = load_at(x, j, 16);
      lanes = max(lanes, v);
      probe = fma(v, tiny, probe);
    }
    if (std::isnan(reduce_add(probe))) nan = true;
    top = reduce_max(lanes);
  }
  for (; j < s.width; ++j) {
    if (s.blocked && s.blocked[j]) continue;
    const float v = value_at(x, j);
    if (v != v)
      nan = true;
    else if (v > top)
      top = v;
  }
  if (nan || top == neg_inf) return;
  for (int64_t c = 0; c < s.width; ++c)
    if (value_at(x, c) == top && !(s.blocked && s.blocked[c])) {
      const int64_t id = s.ids ? s.ids[c] : c;
      if (best_id < 0 || top > best || (top == best && id < best_id)) best = top, best_id = id;
      return;
    }
}

// sum exp(x_j - max) over a segment's columns into 16 lanes (blocked columns add 0).
template <typename T>
F16 exp_sum_segment(const PickSegment& s, float max, F16 acc) {
  const T* x = static_cast<const T*>(s.scores);
  const F16 m = set1(max);
  for (int64_t j = 0; j < s.width; j += 16) {
    const int n = static_cast<int>(std::min<int64_t>(s.width - j, 16));
    F16 v = load_at(x, j, n);
    if (s.blocked) {
      alignas(64) float masked[16];
      store(masked, v);
      for (int i = 0; i < n; ++i)
        if (s.blocked[j + i]) masked[i] = -std::numeric_limits<float>::infinity();
      v = load(masked);
    }
    acc = add(acc, keep_first(vec::exp(sub(v, m)), n));
  }
  return acc;
}

}  // namespace

PickResult pick_greedy(const PickSegment* segments, int count) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_id = -1;
  bool nan = false;
  for (int i = 0; i < count; ++i) {
    if (segments[i].bf16)
      scan_segment<uint16_t>(segments[i], best, best_id, nan);
    else
      scan_segment<float>(segments[i], best, best_id, nan);
    if (nan) return {-1, 0.0f, false};
  }
  if (nan || best_id < 0 || !std::isfinite(best)) return {-1, 0.0f, false};
  F16 acc = zero();
  for (int i = 0; i < count; ++i)
    acc = segments[i].bf16 ? exp_sum_segment<uint16_t>(segments[i], best, acc)
                           : exp_sum_segment<float>(segments[i], best, acc);
  return {best_id, 1.0f / reduce_add(acc), true};
}

}  // namespace verispec
