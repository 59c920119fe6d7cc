// Attention's scores on AMX tiles: the amx tier's attention of bf16 rows whose head size D is 32, 64,
// 96 or 128 (other rows: vec/attention.cpp alone). A verification pass attends for K + 1 new tokens
// over the same keys; with vectors each query row's dot products are D/16 FMAs per key, so at 8 new
// tokens and 2048 cached ones the scores were most of a 1.5B pass's growth over one token. Intel
// Xeon with AMX, 2 threads: one layer's attention (12 query heads on 2 key/value heads, D = 128)
// for 8 new tokens over 2048 keys 288 us against the vectors' 467 (1 token: 44 against 56); whole
// passes of the 1.5B int4 with 2048 cached tokens, T = 8: 62.5 / 63.3 ms against 69.1 / 69.3
// (T = 1: 43.5 / 43.9 against 43.7 / 43.7; 160 cached tokens: no change), alternating runs.
//
// Scores. For the query rows of one batch row and key/value head (every new token's heads of that
// group: up to 16 at a time, the columns of a B tile), a C tile of 16 keys x 16 queries is
//   C[j][c] = what TDPBF16PS accumulates over the steps s = 0 .. D/32 - 1 (32 dimensions each) in
//             order, from 0, with A = the keys' rows j as they lie in the cache and B = the queries'
//             dimensions in pairs (amx/bf16.cpp: per step C + (even + odd), the even and odd
//             products each a sequential fp32 sum over the step's 16 pairs; denormals as zero)
//   s_j = C[j][c] * scale                                                  (one fp32 rounding)
// which is Bf16Linear's "amx" order (linear.py: reference_bf16_linear) of q . k_j, scaled. Each C
// element is computed from its key's and its query's values alone, so a row's scores are the same
// whichever rows share its tile: a verification pass computes the bits of the decoding steps it
// stands for (batch invariance), as vec/attention.cpp's FMA chains do in another order (the tiers
// differ by rounding: the tests check both against float64 softmax attention).
//
// The rest is vec/attention.cpp's (attention_weigh): per query row, the scores of its visible keys
// in order, their maximum m, p_j = exp(s_j - m), l = sum_j p_j, o = sum_j p_j v_j / l in fp32.
#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"

namespace verispec {
namespace {

constexpr int kKeys = 16;     // keys per C tile (A rows)
constexpr int kQueries = 16;  // query rows per C tile (B columns)
constexpr int kMaxSteps = 4;  // D / 32 at most: one B tile per step stays loaded (tmm4 .. tmm7)

// tmm0, tmm1: C (16 keys x 16 fp32) of even and odd key blocks; tmm2, tmm3: A (16 keys x 32 bf16),
// in turn; tmm4 .. tmm7: B (16 dimension pairs x 16 queries) of steps 0 .. 3.
inline void configure_score_tiles() {
  const TileShape t{16, 64};
  configure_tiles({t, t, t, t, t, t, t, t});
}

// One key block's C tile: 16 keys at src (stride bytes apart) against the loaded B tiles, stored at
// out (16 rows of 16 fp32).
#define VS_KEY_BLOCK(C)                                              \
  template <int STEPS>                                               \
  inline void key_block_##C(const uint16_t* src, int64_t stride, float* out) { \
    _tile_zero(C);                                                   \
    VS_TILE_LOADD(2, src, stride);                                   \
    _tile_dpbf16ps(C, 2, 4);                                         \
    if constexpr (STEPS > 1) {                                       \
      VS_TILE_LOADD(3, src + 32, stride);                            \
      _tile_dpbf16ps(C, 3, 5);                                       \
    }                                                                \
    if constexpr (STEPS > 2) {                                       \
      VS_TILE_LOADD(2, src + 64, stride);                            \
      _tile_dpbf16ps(C, 2, 6);                                       \
    }                                                                \
    if constexpr (STEPS > 3) {                                       \
      VS_TILE_LOADD(3, src + 96, stride);                            \
      _tile_dpbf16ps(C, 3, 7);                                       \
    }                                                                \
    _tile_stored(C, out, 64);                                        \
  }
VS_KEY_BLOCK(0)
VS_KEY_BLOCK(1)
#undef VS_KEY_BLOCK

// C of keys [0, keys) (a multiple of 16) of the key rows at k (D values each, span of them readable;
// the rows past span are taken as zeros) against the queries in the B tiles: s[16 j + c], j the key.
template <int STEPS>
void key_scores(const uint16_t* k, int64_t span, int64_t keys, float* s) {
  constexpr int64_t kD = 32 * STEPS;
  alignas(64) uint16_t tail[kKeys * kD];
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    const uint16_t* src = k + j0 * kD;
    if (j0 + kKeys > span) {  // the last block, beyond the buffer: its rows copied, zeros after
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, src, static_cast<size_t>((span - j0) * kD * 2));
      src = tail;
    }
    if ((j0 / kKeys) % 2 == 0)
      key_block_0<STEPS>(src, kD * 2, s + j0 * kQueries);
    else
      key_block_1<STEPS>(src, kD * 2, s + j0 * kQueries);
  }
  __asm__ volatile("" ::: "memory");  // (the tile stores wrote s: GCC's tilestored does not say so)
}

// The B tiles of up to 16 query rows (bf16, D values each, at q + D * rows[c]): step s's tile at
// b + 256 s (u32), row p, column c = dimensions 32 s + 2 p, + 1 of query c; columns past n zero.
void query_tiles(const uint16_t* q, int64_t d, const int64_t* rows, int n, uint32_t* b) {
  std::memset(b, 0, sizeof(uint32_t) * kMaxSteps * 16 * kQueries);
  for (int c = 0; c < n; ++c) {
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q + rows[c] * d);
    for (int64_t i = 0; i < d / 2; ++i) b[(i / 16) * 256 + (i % 16) * kQueries + c] = pairs[i];
  }
}

inline void load_query_tiles(const uint32_t* b, int steps) {
  VS_TILE_LOADD(4, b, 64);
  if (steps > 1) VS_TILE_LOADD(5, b + 256, 64);
  if (steps > 2) VS_TILE_LOADD(6, b + 512, 64);
  if (steps > 3) VS_TILE_LOADD(7, b + 768, 64);
}

// The positions j < span that vis (span bytes) shows, in order, at index; returns how many.
// (index has room for span + 16: a block's compressed indices are stored whole.)
int64_t visible_positions(const uint8_t* vis, int64_t span, int32_t* index) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  int64_t n = 0;
  for (int64_t j = 0; j < span; j += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, span - j));
    const __mmask16 valid = cnt == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
    const __m128i bytes = _mm_maskz_loadu_epi8(valid, vis + j);
    const __mmask16 seen = _mm_test_epi8_mask(bytes, bytes);
    const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j)));
    _mm512_storeu_si512(index + n, _mm512_maskz_compress_epi32(seen, at));
    n += __builtin_popcount(seen);
  }
  return n;
}

// 1 + the last position vis (span bytes) shows, or 0.
int64_t visible_end(const uint8_t* vis, int64_t span) {
  for (int64_t j = span; j > 0; --j)
    if (vis[j - 1]) return j;
  return 0;
}

template <int STEPS>
void attend_keys(const AttnArgs& a, int64_t b, int64_t kvh, const int64_t* rows, int nq, float* s, uint32_t* qt,
                 float* score, int32_t* index) {
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  query_tiles(q, a.D, rows, nq, qt);
  load_query_tiles(qt, STEPS);
  int64_t keys = 0;  // the keys any of the rows sees lie before this
  for (int c = 0; c < nq; ++c)
    if (c == 0 || rows[c] / a.H != rows[c - 1] / a.H)
      keys = std::max(keys, visible_end(a.visible + rows[c] / a.H * a.span, a.span));
  keys = (keys + kKeys - 1) / kKeys * kKeys;
  const int64_t br = a.rows ? a.rows[b] : b;  // the buffer row holding this row's keys and values
  key_scores<STEPS>(static_cast<const uint16_t*>(a.k) + br * a.k_sb + kvh * a.k_sh, a.span, keys, s);
  // each run of rows of one new token (consecutive query heads, the same visible keys), up to
  // kAttnGroupRows at a time: its scores, then vec/attention.cpp's weighing
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int c0 = 0; c0 < nq;) {
    const int64_t bt = rows[c0] / a.H;
    int nr = 1;
    while (c0 + nr < nq && nr < kAttnGroupRows && rows[c0 + nr] == rows[c0] + nr && rows[c0 + nr] / a.H == bt)
      ++nr;
    const int64_t n = visible_positions(a.visible + bt * a.span, a.span, index);
    float m[kAttnGroupRows];
    for (int r = 0; r < nr; ++r) {
      const __m512i column = _mm512_set1_epi32(c0 + r);
      float* out = score + r * a.span;
      __m512 best = _mm512_set1_ps(-INFINITY);
      for (int64_t u = 0; u < n; u += 16) {
        const int cnt = static_cast<int>(std::min<int64_t>(16, n - u));
        const __mmask16 k = cnt == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
        const __m512i at = _mm512_add_epi32(_mm512_slli_epi32(_mm512_maskz_loadu_epi32(k, index + u), 4), column);
        const __m512 v = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, at, s, 4), scale);
        _mm512_mask_storeu_ps(out + u, k, v);
        best = _mm512_mask_max_ps(best, k, v, best);  // (a NaN score is passed over, as std::max does)
      }
      m[r] = _mm512_reduce_max_ps(best);
    }
    attention_weigh(a, rows[c0], nr, score, index, n, m);
    c0 += nr;
  }
}

}  // namespace

void attention_rows_amx(const AttnArgs& a, int64_t begin, int64_t end) {
  const int steps = static_cast<int>(a.D / 32);
  if (!a.bf16 || a.D % 32 != 0 || steps > kMaxSteps || !amx_permitted()) return attention_rows(a, begin, end);
  static thread_local std::vector<float> s;  // C tiles of one group's keys: [keys, 16]
  const int64_t padded = (a.span + kKeys - 1) / kKeys * kKeys;
  s.resize(static_cast<size_t>(padded * kQueries));
  alignas(64) uint32_t qt[kMaxSteps * 16 * kQueries];
  std::vector<float> score(kAttnGroupRows * a.span);
  std::vector<int32_t> index(a.span + 16);
  std::vector<int64_t> rows;
  configure_score_tiles();
  const int64_t group = a.H / a.Hkv;  // query heads per key/value head
  const int64_t b0 = begin / a.H / a.T, b1 = (end - 1) / a.H / a.T;
  for (int64_t b = b0; b <= b1; ++b)
    for (int64_t kvh = 0; kvh < a.Hkv; ++kvh) {
      rows.clear();  // this batch row's query rows on key/value head kvh within [begin, end), in order
      for (int64_t t = 0; t < a.T; ++t)
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          const int64_t row = (b * a.T + t) * a.H + h;
          if (row >= begin && row < end) rows.push_back(row);
        }
      for (size_t c = 0; c < rows.size(); c += kQueries) {
        const int nq = static_cast<int>(std::min<size_t>(kQueries, rows.size() - c));
        switch (steps) {
          case 1: attend_keys<1>(a, b, kvh, rows.data() + c, nq, s.data(), qt, score.data(), index.data()); break;
          case 2: attend_keys<2>(a, b, kvh, rows.data() + c, nq, s.data(), qt, score.data(), index.data()); break;
          case 3: attend_keys<3>(a, b, kvh, rows.data() + c, nq, s.data(), qt, score.data(), index.data()); break;
          default: attend_keys<4>(a, b, kvh, rows.data() + c, nq, s.data(), qt, score.data(), index.data()); break;
        }
      }
    }
  _tile_release();
}

void attention_scores_amx(const uint16_t* q, int64_t m, const uint16_t* k, int64_t n, int64_t d, float* out) {
  const int steps = static_cast<int>(d / 32);
  const int64_t padded = (n + kKeys - 1) / kKeys * kKeys;
  std::vector<float> s(static_cast<size_t>(padded * kQueries));
  alignas(64) uint32_t qt[kMaxSteps * 16 * kQueries];
  std::vector<int64_t> rows(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) rows[i] = i;
  configure_score_tiles();
  for (int64_t c = 0; c < m; c += kQueries) {
    const int nq = static_cast<int>(std::min<int64_t>(kQueries, m - c));
    query_tiles(q, d, rows.data() + c, nq, qt);
    load_query_tiles(qt, steps);
    switch (steps) {
      case 1: key_scores<1>(k, n, padded, s.data()); break;
      case 2: key_scores<2>(k, n, padded, s.data()); break;
      case 3: key_scores<3>(k, n, padded, s.data()); break;
      default: key_scores<4>(k, n, padded, s.data()); break;
    }
    for (int r = 0; r < nq; ++r)
      for (int64_t j = 0; j < n; ++j) out[(c + r) * n + j] = s[j * kQueries + r];
  }
  _tile_release();
}

}  // namespace verispec
