// Attention one query row at a time, in a fixed order of operations: the result of a row depends
// on that row's query and the keys and values it may see, and on nothing else (not the number of
// new tokens in the pass, not the other rows, not the span of the buffers). So the verification
// pass of speculative decoding, which attends for K + 1 new tokens at once, computes for each of
// them the bits a one-token decode step computes for it (Thinking Machines, "Defeating
// Nondeterminism in LLM Inference", 2025: batch-invariant kernels) — with bf16 weights, int8
// activations or any other lossy arithmetic, greedy speculative output then equals greedy plain
// output token for token. torch's scaled_dot_product_attention splits and masks the keys by the
// shape of the pass, so a query's sums round differently at T = 1 and T = K + 1.
//
// For a row (batch b, new token t, query head h, its key/value head h / G):
//   s_j = scale * (q . k_j)         for the visible keys j in increasing order; the dot product
//                                   is D/16 vector FMAs in order, then vec.h's fixed lane reduction
//                                   (reduce_add, or the same trees 16 at a time: reduce_add16)
//   m = max_j s_j,  p_j = exp(s_j - m)   (exp: vec.h's, the same for every row and tier)
//   l = sum_j p_j                   (16 lanes in parallel over j, then the fixed lane reduction)
//   o = (sum_j p_j v_j) / l         (fp32 vector FMAs in order of j), rounded to the output dtype
// All in fp32 from bf16 (or fp32) inputs.
// (On the amx tier, bf16 rows with a head size of 32 to 128 take their scores and values from AMX
// tiles, amx/attention_tiles.cpp, in another order, and their softmax from here.)
//
// Speed, with the same operations per row: the query heads that share a key/value head (grouped-
// query attention) at the same position see the same keys and values, so up to kAttnGroupRows of
// them go together: each key and value row is loaded and widened once for all of them, and their dot
// products are independent chains of FMAs instead of one chain waiting on each FMA's latency.
// The dot products of 16 keys are reduced together (vec.h's reduce_add16, the same trees): the
// kernel alone 0.69x at T = 1 and 0.70x at T = 8 over 2048 keys on an Intel Xeon with AMX
// (benchmarks/results/attention_reduce16_intel.md). Head sizes of 64, 128 and 256 have their loops
// unrolled at compile time; other head sizes run the same operations in loops.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "vec.h"

namespace verispec {
namespace {
using namespace vec;

constexpr int kMaxHeadDim = 256;
// The values are weighed 32 columns at a time (the registers hold no more for 8 rows), so each
// value row is read D / 32 times, 64 bytes each time: a strided stream the hardware prefetchers
// follow poorly once the cache no longer holds the layer's values (a decode pass reads them back
// from memory). The first pass prefetches whole rows kValuesAhead visible keys ahead, and the later
// passes find them in cache. Whole passes of the 1.5B int4, prefetch over none (benchmarks/
// kernels_ab.py, Intel Xeon with AMX, amx tier, 2 threads): with 2048 cached tokens 0.96 at T = 1
// and 0.93-0.96 at T = 8, with 512 0.98 / 1.00, with 128 1.00 / 0.99.
constexpr int kValuesAhead = 16;

template <bool BF16>
inline F16 load_row16(const void* base, int64_t offset) {
  if constexpr (BF16) return load_bf16(static_cast<const uint16_t*>(base) + offset);
  return load(static_cast<const float*>(base) + offset);
}

// Where a query row's keys and values start, and which positions it sees.
struct RowPlace {
  int64_t k0, v0;
  const uint8_t* vis;
};
inline RowPlace place_of(const AttnArgs& a, int64_t row) {
  const int64_t h = row % a.H, bt = row / a.H, b = bt / a.T;
  const int64_t kvh = h / (a.H / a.Hkv);
  const int64_t br = a.rows ? a.rows[b] : b;  // the buffer row holding this row's keys and values
  return {br * a.k_sb + kvh * a.k_sh, br * a.v_sb + kvh * a.v_sh, a.visible + bt * a.span};
}

// The scores s_j of NR consecutive query rows from row0 that share their keys (same batch row,
// position and key/value head): score[r * span + n] for the n-th visible key, its position in
// index[n]; returns the number of visible keys and each row's max in m[r]. VD = D / 16, or 0 for
// a head size known only at run time. The dot products of 16 visible keys wait in part[r] and
// are summed together (vec.h's reduce_add16: each score's own lane tree, so the bits of one
// reduce_add per score, for a third of the operations).
template <int VD, int NR, bool BF16>
int64_t score_rows(const AttnArgs& a, int64_t row0, float* score, int32_t* index, float* m) {
  const int vd = VD ? VD : static_cast<int>(a.D / 16);
  alignas(64) float q[NR][kMaxHeadDim];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < vd; ++i) store(&q[r][16 * i], load_row16<BF16>(a.q, (row0 + r) * a.D + 16 * i));
  const RowPlace at = place_of(a, row0);
  for (int r = 0; r < NR; ++r) m[r] = -INFINITY;
  F16 part[NR][16];
  const F16 scale = set1(a.scale);
  int64_t n = 0;  // scores written
  int waiting = 0;  // dot products in part, of the keys index[n .. n + waiting)
  const auto flush = [&]() {
    for (int r = 0; r < NR; ++r) {
      float* out = score + r * a.span + n;
      if (waiting == 16) {
        store(out, mul(reduce_add16(part[r]), scale));
      } else {
        for (int u = 0; u < waiting; ++u) out[u] = reduce_add(part[r][u]) * a.scale;
      }
      for (int u = 0; u < waiting; ++u) m[r] = std::max(m[r], out[u]);
    }
    n += waiting;
    waiting = 0;
  };
  for (int64_t j = 0; j < a.span; ++j) {
    if (!at.vis[j]) continue;
    const int64_t kj = at.k0 + j * a.D;
    F16 acc[NR];
    const F16 k0 = load_row16<BF16>(a.k, kj);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) acc[r] = mul(load(&q[r][0]), k0);
#pragma GCC unroll 16
    for (int i = 1; i < vd; ++i) {
      const F16 ki = load_row16<BF16>(a.k, kj + 16 * i);
#pragma GCC unroll 8
      for (int r = 0; r < NR; ++r) acc[r] = fma(load(&q[r][16 * i]), ki, acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) part[r][waiting] = acc[r];
    index[n + waiting] = static_cast<int32_t>(j);
    if (++waiting == 16) flush();
  }
  if (waiting) flush();
  return n;
}

// Columns [col0, col0 + 16 NV) of o = sum_j p_j v_j / l for NR rows that share their values, from
// their weights p[r * span + u] (u < n, the visible keys in order) and sums l[r]: each value row is
// loaded once for the NR rows, and each output coordinate adds its own p_j v_j in the order of j.
// With bf16 values and NV = 2, a 64-byte group of 32 values is widened as its even and odd halves
// (vec.h's load_bf16_pairs: two cheap lane operations instead of two widening shuffles), and the
// halves are put back in order at the end.
template <int NR, int NV, bool BF16>
void weigh_columns(const AttnArgs& a, int64_t row0, const float* p, const int32_t* index, int64_t n, const float* l,
                   int64_t col0) {
  constexpr bool kPairs = BF16 && NV == 2;
  const int64_t v0 = place_of(a, row0).v0 + col0;
  F16 o[NR][NV];  // kPairs: o[r][0] the even, o[r][1] the odd coordinates
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int i = 0; i < NV; ++i) o[r][i] = zero();
  constexpr int64_t kElement = BF16 ? 2 : 4;  // bytes of a value
  const int64_t row_bytes = a.D * kElement;
  for (int64_t u = 0; u < n; ++u) {
    const int64_t vrow = v0 + static_cast<int64_t>(index[u]) * a.D;
    if (col0 == 0 && u + kValuesAhead < n) {  // the whole value row, for this pass and the next ones
      const char* ahead = static_cast<const char*>(a.v) + (v0 + index[u + kValuesAhead] * a.D) * kElement;
      for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);
    }
    F16 v[NV];
    if constexpr (kPairs) {
      load_bf16_pairs(static_cast<const uint16_t*>(a.v) + vrow, v[0], v[1]);
    } else {
#pragma GCC unroll 2
      for (int i = 0; i < NV; ++i) v[i] = load_row16<BF16>(a.v, vrow + 16 * i);
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const F16 w = set1(p[r * a.span + u]);
#pragma GCC unroll 2
      for (int i = 0; i < NV; ++i) o[r][i] = fma(w, v[i], o[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    const F16 lr = set1(l[r]);
    const int64_t out = (row0 + r) * a.D + col0;
    if constexpr (kPairs) {
      alignas(64) float even[16], odd[16], both[32];
      store(even, div(o[r][0], lr));
      store(odd, div(o[r][1], lr));
      for (int e = 0; e < 16; ++e) both[2 * e] = even[e], both[2 * e + 1] = odd[e];
      store_columns(a.out, true, out, load(both), 16);
      store_columns(a.out, true, out + 16, load(both + 16), 16);
    } else {
      for (int i = 0; i < NV; ++i) store_columns(a.out, BF16, out + 16 * i, div(o[r][i], lr), 16);
    }
  }
}

// The attention of NR consecutive query rows from row0 sharing their keys and values.
template <int VD, int NR, bool BF16>
void attend(const AttnArgs& a, int64_t row0, float* score, int32_t* index) {
  float m[NR], l[NR];
  const int64_t n = score_rows<VD, NR, BF16>(a, row0, score, index, m);
  attention_softmax(a, NR, score, n, m, l);  // p_j = exp(s_j - m) in place of s_j, and l = sum_j p_j
  int64_t col = 0;
  for (; col + 32 <= a.D; col += 32) weigh_columns<NR, 2, BF16>(a, row0, score, index, n, l, col);
  if (col < a.D) weigh_columns<NR, 1, BF16>(a, row0, score, index, n, l, col);
}

template <int VD, bool BF16>
void attend_rows(const AttnArgs& a, int64_t row0, int nr, float* score, int32_t* index) {
  switch (nr) {
    case 1: return attend<VD, 1, BF16>(a, row0, score, index);
    case 2: return attend<VD, 2, BF16>(a, row0, score, index);
    case 3: return attend<VD, 3, BF16>(a, row0, score, index);
    case 4: return attend<VD, 4, BF16>(a, row0, score, index);
    case 5: return attend<VD, 5, BF16>(a, row0, score, index);
    case 6: return attend<VD, 6, BF16>(a, row0, score, index);
    case 7: return attend<VD, 7, BF16>(a, row0, score, index);
    default: return attend<VD, 8, BF16>(a, row0, score, index);
  }
}

template <bool BF16>
void attend_any(const AttnArgs& a, int64_t row0, int nr, float* score, int32_t* index) {
  switch (a.D) {
    case 64: return attend_rows<4, BF16>(a, row0, nr, score, index);
    case 128: return attend_rows<8, BF16>(a, row0, nr, score, index);
    case 256: return attend_rows<16, BF16>(a, row0, nr, score, index);
    default: return attend_rows<0, BF16>(a, row0, nr, score, index);
  }
}

}  // namespace

void attention_rows(const AttnArgs& a, int64_t begin, int64_t end) {
  std::vector<float> score(kAttnGroupRows * a.span);
  std::vector<int32_t> index(a.span);
  const int64_t group = a.H / a.Hkv;  // query heads per key/value head
  for (int64_t row = begin; row < end;) {
    // the rows from here that share this row's keys: the rest of its head group, within [begin, end)
    const int64_t in_group = group - (row % a.H) % group;
    const int nr = static_cast<int>(std::min<int64_t>({kAttnGroupRows, in_group, end - row}));
    if (a.bf16)
      attend_any<true>(a, row, nr, score.data(), index.data());
    else
      attend_any<false>(a, row, nr, score.data(), index.data());
    row += nr;
  }
}

// p_j = exp(s_j - m[r]) in place of each row's scores, l[r] = sum_j p_j (16 lanes over j, then
// the fixed lane reduction; 1 when no key is visible).
void attention_softmax(const AttnArgs& a, int nr, float* score, int64_t n, const float* m, float* l) {
  for (int r = 0; r < nr; ++r) {
    float* pr = score + r * a.span;
    const F16 mv = set1(m[r]);
    F16 lsum = zero();
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int cnt = static_cast<int>(std::min<int64_t>(16, n - j0));
      const F16 p = keep_first(vec::exp(sub(load_n(pr + j0, cnt), mv)), cnt);
      lsum = add(lsum, p);
      store_n(pr + j0, p, cnt);
    }
    l[r] = n ? reduce_add(lsum) : 1.0f;
  }
}

}  // namespace verispec
