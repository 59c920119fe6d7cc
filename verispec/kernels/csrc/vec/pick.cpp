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
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

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

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The largest of x [w] but its blocked columns (-inf when none is left), a NaN noted in nan.
// Whole vectors of 16 columns by a lane-wise max and the fixed lane tree, NaN by the sum of
// x * 2^-100 (finite for every finite score, NaN only with a NaN or with both infinities, and +inf
// fails the row anyway); the last columns, and a row with blocked columns, one by one.
template <typename T>
float largest(const T* x, int64_t w, const bool* blocked, bool& nan) {
  float top = kNegInf;
  int64_t j = 0;
  if (!blocked && w >= 16) {
    F16 lanes = set1(kNegInf), probe = zero();
    const F16 tiny = set1(0x1p-100f);
    for (; j + 16 <= w; j += 16) {
      const F16 v = load_at(x, j, 16);
      lanes = max(lanes, v);
      probe = fma(v, tiny, probe);
    }
    if (std::isnan(reduce_add(probe))) nan = true;
    top = reduce_max(lanes);
  }
  for (; j < w; ++j) {
    if (blocked && blocked[j]) continue;
    const float v = value_at(x, j);
    if (v != v)
      nan = true;
    else if (v > top)
      top = v;
  }
  return top;
}

// The largest score of a segment and the id of its first column holding it (the smallest id, as
// a segment's ids ascend), folded into best / best_id (ties between segments: the smaller id); NaN
// noted.
template <typename T>
void scan_segment(const PickSegment& s, float& best, int64_t& best_id, bool& nan) {
  const T* x = static_cast<const T*>(s.scores);
  const float top = largest(x, s.width, s.blocked, nan);
  if (nan || top == kNegInf) return;
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

// ------------------------------------------------------------------------------------ sampled

namespace {

// x [w] /= d in place (IEEE division, vector by vector).
void divide_row(float* x, int64_t w, float d) {
  const F16 by = set1(d);
  for (int64_t j = 0; j < w; j += 16) {
    const int n = static_cast<int>(std::min<int64_t>(w - j, 16));
    store_n(x + j, div(load_n(x + j, n), by), n);
  }
}

// e [w] = exp(x - top) (0 where x is -inf or more than 87.3 below top); returns their sum (16
// lanes adding in column order, then the fixed lane tree).
float exp_row(const float* x, int64_t w, float top, float* e) {
  const F16 m = set1(top);
  F16 acc = zero();
  for (int64_t j = 0; j < w; j += 16) {
    const int n = static_cast<int>(std::min<int64_t>(w - j, 16));
    const F16 v = keep_first(vec::exp(sub(load_n(x + j, n), m)), n);
    store_n(e + j, v, n);
    acc = add(acc, v);
  }
  return reduce_add(acc);
}

// Top-p on x [w] (exp_row's e [w] = exp(x - top) and their sum, total): keeps the smallest set of
// most probable columns (e descending, the lowest column first among equals) whose float64 mass
// (e / total a column) reaches top_p, the mass before each kept column being below top_p; sets the
// others to -inf. Only candidates are sorted: the columns within a ratio of the most probable
// (1e-2, 1e-4, 1e-7) once they hold top_p of the mass, else every column of positive mass.
void keep_nucleus(float* x, int64_t w, const float* e, float total, double top_p) {
  std::vector<int64_t> cand;
  for (const float ratio : {1e-2f, 1e-4f, 1e-7f, 0.0f}) {
    cand.clear();
    double mass = 0.0;
    for (int64_t j = 0; j < w; ++j)
      if (e[j] > 0.0f && e[j] >= ratio) cand.push_back(j), mass += e[j] / total;
    if (mass >= top_p + 1e-6) break;  // (a margin far above the float64 sums' rounding)
  }
  // sort keys: e's bits (>= 0: ordered as the numbers), then the column reversed
  std::vector<uint64_t> keys(cand.size());
  for (size_t i = 0; i < cand.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, e + cand[i], 4);
    keys[i] = (static_cast<uint64_t>(bits) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(cand[i]));
  }
  std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
  const auto column = [](uint64_t key) { return static_cast<int64_t>(0xFFFFFFFFu - static_cast<uint32_t>(key)); };
  double before = 0.0;
  size_t kept = 0;
  while (kept < keys.size() && before < top_p) before += e[column(keys[kept++])] / total;
  const int64_t last = column(keys[kept - 1]);  // (the most probable is always kept)
  const float least = e[last];
  for (int64_t j = 0; j < w; ++j)
    if (!(e[j] > least || (e[j] == least && j <= last))) x[j] = kNegInf;
}

}  // namespace

bool sampled_law(float* x, int64_t w, const SampleRule& rule, float* law) {
  bool nan = false;
  float top = largest(x, w, nullptr, nan);
  if (nan || !std::isfinite(top)) return false;
  if (rule.temperature != 1.0f) {
    divide_row(x, w, rule.temperature);
    top /= rule.temperature;  // (division by a positive number keeps the order: still the largest)
    if (!std::isfinite(top)) return false;
  }
  if (rule.top_k > 0 && rule.top_k < w) {  // keep the scores >= the k-th largest (ties kept)
    std::copy(x, x + w, law);
    std::nth_element(law, law + rule.top_k - 1, law + w, std::greater<float>());
    const float kth = law[rule.top_k - 1];
    for (int64_t j = 0; j < w; ++j)
      if (x[j] < kth) x[j] = kNegInf;
  }
  if (rule.top_p < 1.0) keep_nucleus(x, w, law, exp_row(x, w, top, law), rule.top_p);
  if (rule.min_p > 0.0f) {  // drop the columns below min_p times the largest probability
    const float total = exp_row(x, w, top, law), floor = rule.min_p * (1.0f / total);
    for (int64_t j = 0; j < w; ++j)
      if (law[j] / total < floor) x[j] = kNegInf;
  }
  divide_row(law, w, exp_row(x, w, top, law));  // the law: softmax of what is left
  return true;
}

int64_t draw_column(const float* law, int64_t w, double u) {
  // The cumulative mass by blocks of 64 columns: each block's sum in column order, the blocks'
  // sums in order (independent chains of additions, which the CPU overlaps); the same sums find
  // the block and then the column, so the columns' shares of [0, total) are their masses.
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (w + kBlock - 1) / kBlock;
  std::vector<double> sums(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    double s = 0.0;
    for (int64_t j = b * kBlock; j < std::min(w, (b + 1) * kBlock); ++j) s += law[j];
    sums[b] = s;
  }
  double total = 0.0;
  for (const double s : sums) total += s;
  const double target = u * total;
  double before = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (before + sums[b] <= target) {
      before += sums[b];
      continue;
    }
    int64_t last = -1;
    for (int64_t j = b * kBlock; j < std::min(w, (b + 1) * kBlock); ++j)
      if (law[j] > 0.0f) {
        before += law[j];
        last = j;
        if (before > target) return j;
      }
    return last;  // (the block's mass ran out by rounding: its last column of positive mass)
  }
  return -1;  // (no column of positive mass: u < 1 makes u * total < total in float64 otherwise)
}

}  // namespace verispec
