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
//   m = max_j s_j,  p_j = exp(s_j - m)   (exp: vec.h's, the same for every row and tier)
//   l = sum_j p_j                   (16 lanes in parallel over j, then the fixed lane reduction)
//   o = (sum_j p_j v_j) / l         (fp32 vector FMAs in order of j), rounded to the output dtype
// All in fp32 from bf16 (or fp32) inputs.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common.h"
#include "vec.h"

namespace verispec {
namespace {
using namespace vec;

inline F16 load_row16(const void* base, bool bf16, int64_t offset) {
  if (bf16) return load_bf16(static_cast<const uint16_t*>(base) + offset);
  return load(static_cast<const float*>(base) + offset);
}

constexpr int kMaxHeadDim = 256;

void attention_row(const AttnArgs& a, int64_t row, std::vector<float>& score, std::vector<int32_t>& index) {
  const int64_t h = row % a.H, bt = row / a.H, b = bt / a.T;
  const int64_t kvh = h / (a.H / a.Hkv);
  const int vd = static_cast<int>(a.D / 16);
  F16 q[kMaxHeadDim / 16];
  for (int i = 0; i < vd; ++i) q[i] = load_row16(a.q, a.bf16, row * a.D + 16 * i);
  const int64_t br = a.rows ? a.rows[b] : b;  // the buffer row holding this row's keys and values
  const int64_t k0 = br * a.k_sb + kvh * a.k_sh, v0 = br * a.v_sb + kvh * a.v_sh;
  const uint8_t* vis = a.visible + bt * a.span;
  int64_t n = 0;
  float m = -INFINITY;
  for (int64_t j = 0; j < a.span; ++j) {
    if (!vis[j]) continue;
    F16 acc = mul(q[0], load_row16(a.k, a.bf16, k0 + j * a.D));
    for (int i = 1; i < vd; ++i) acc = fma(q[i], load_row16(a.k, a.bf16, k0 + j * a.D + 16 * i), acc);
    const float s = reduce_add(acc) * a.scale;
    score[n] = s;
    index[n] = static_cast<int32_t>(j);
    m = std::max(m, s);
    ++n;
  }
  F16 o[kMaxHeadDim / 16];
  for (int i = 0; i < vd; ++i) o[i] = zero();
  F16 lsum = zero();
  const F16 mv = set1(m);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n - j0));
    const F16 p = keep_first(vec::exp(sub(load_n(&score[j0], cnt), mv)), cnt);
    lsum = add(lsum, p);
    alignas(64) float pj[16];
    store(pj, p);
    for (int u = 0; u < cnt; ++u) {
      const F16 w = set1(pj[u]);
      const int64_t vrow = v0 + static_cast<int64_t>(index[j0 + u]) * a.D;
      for (int i = 0; i < vd; ++i) o[i] = fma(w, load_row16(a.v, a.bf16, vrow + 16 * i), o[i]);
    }
  }
  const F16 l = set1(n ? reduce_add(lsum) : 1.0f);
  for (int i = 0; i < vd; ++i) store_columns(a.out, a.bf16, row * a.D + 16 * i, div(o[i], l), 16);
}

}  // namespace

void attention_rows(const AttnArgs& a, int64_t begin, int64_t end) {
  std::vector<float> score(a.span);
  std::vector<int32_t> index(a.span);
  for (int64_t row = begin; row < end; ++row) attention_row(a, row, score, index);
}

}  // namespace verispec
