// Attention on AMX tiles: the amx tier's attention of bf16 rows whose head size D is 32, 64, 96 or
// 128 (other rows: vec/attention.cpp alone). A verification pass attends for K + 1 new tokens over
// the same keys and values; with vectors each query row costs D/16 FMAs per key for its scores and
// as many for its values, so at 8 new tokens and 2048 cached ones attention was most of a 1.5B
// pass's growth over one token. Here the query rows of one batch row and key/value head (every new
// token's heads of that group, up to 16 at a time) share each tile of keys and of values.
//
// Intel Xeon with AMX, 2 threads, the 1.5B's shape (12 query heads on 2 key/value heads, D = 128):
// one layer's attention for 8 new tokens over 2048 keys 217 us against the vectors' 483 (1 token:
// 47 against 59; 160 keys, 8 tokens: 22 against 39); whole passes of the 1.5B int4 with 2048 cached
// tokens, T = 8: 59.6 / 61.5 ms against 69.6 / 70.3, T = 1: 43.0 / 43.3 against 44.0 / 43.7 (160
// cached tokens: no change), alternating runs of the two builds. The keys and values are
// prefetched two blocks of 16 ahead: without, the same passes took 64.4-65.0 ms at T = 8.
//
// Scores. A C tile of 16 keys x 16 query rows is
//   C[j][c] = what TDPBF16PS accumulates over the steps s = 0 .. D/32 - 1 (32 dimensions each) in
//             order, from 0, with A = the keys' rows j as they lie in the cache and B = the queries'
//             dimensions in pairs (amx/bf16.cpp: per step C + (even + odd), the even and odd
//             products each a sequential fp32 sum over the step's 16 pairs; denormals as zero)
//   s_j = C[j][c] * scale                                                  (one fp32 rounding)
// which is Bf16Linear's "amx" order (linear.py: reference_bf16_linear) of q . k_j, scaled (tested
// bit for bit through attention_scores).
//
// Softmax (vec/attention.cpp's attention_softmax): per query row, the scores of its visible keys in
// order, their maximum m, p_j = exp(s_j - m) and l = sum_j p_j in fp32.
//
// Values. Each p_j is split into two bf16, hi = bf16(p_j) and lo = bf16(p_j - hi) (nearest even;
// hi + lo is p_j to about 2^-17 of it), a row's A operand holding the pair (hi, lo) of key j at
// every position the row may see and (0, 0) elsewhere, and the B operand each value twice, so one
// TDPBF16PS adds hi v + lo v (both products exact) for 16 keys x 16 dimensions; C accumulates over
// the key blocks j = 0, 16, ... in order from 0, o = C / l (fp32), rounded to bf16. A position a
// row does not see adds exact zeros (its value is finite: every position before the last one a
// row of the pass sees was written), so a row's sums do not depend on how far the other rows
// of its tile see.
//
// Each C element is computed from its own row's data alone, so a row's result is the same whichever
// rows share its tiles: a verification pass computes the bits of the decoding steps it stands for
// (batch invariance), as vec/attention.cpp's FMA chains do in another order and with p_j in fp32
// (the tiers differ by rounding: the tests check both against float64 softmax attention).
#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"

namespace verispec {
namespace {

constexpr int kKeys = 16;     // keys per C tile (A rows)
constexpr int kQueries = 16;  // query rows per C tile (B columns)
constexpr int kMaxSteps = 4;  // D / 32 at most: one B tile per step stays loaded (tmm4 .. tmm7)
constexpr int kAhead = 2;     // key blocks ahead that the keys and values are prefetched

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
    if (j0 + (kAhead + 1) * kKeys <= span)  // (the keys stream from memory in a decoding pass)
      for (int line = 0; line < kKeys * kD * 2; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(src + kAhead * kKeys * kD) + line, _MM_HINT_T0);
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

// A thread's buffers for attention_rows_amx.
struct Scratch {
  std::vector<float> s;         // C tiles of the scores: [keys, 16]
  std::vector<float> score;     // a run's scores, then weights, of its visible keys: [kAttnGroupRows, span]
  std::vector<int32_t> index;   // a run's visible positions (span + 16)
  std::vector<uint32_t> w;      // the query rows' weights as A operands: [rows, keys] (hi, lo) pairs
  alignas(64) uint32_t qt[kMaxSteps * 16 * kQueries];  // the queries as B tiles
  alignas(64) float o[kQueries * 32 * kMaxSteps];       // o before its division by l: [rows, D]
};

// ---- values: o = sum_j p_j v_j on tiles, p_j as the sum of two bf16 (hi, lo)

// tmm0 .. tmm3: C (rows x 16 fp32: 16 dimensions of o); tmm4: A (rows x 16 (hi, lo) pairs of
// weights); tmm5 .. tmm7: B (16 keys x 16 dimensions, each value twice), in turn.
inline void configure_value_tiles(int rows) {
  const TileShape c{rows, 64}, b{16, 64};
  configure_tiles({c, c, c, c, c, b, b, b});
}

// Each p of 16 lanes as the pair (hi, lo) of bf16 (nearest even: hi = bf16(p), lo = bf16(p - hi),
// the difference exact in fp32), hi in the low half of a 32-bit lane (the first of the pair).
inline __m512i weight_pairs(__m512 p) {
  const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  const __m512 rest = _mm512_sub_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
  const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest)));
  return _mm512_or_si512(hi, _mm512_slli_epi32(lo, 16));
}

// A query row's weights as an A operand over keys [0, keys): position j's pair at row[j], zero where
// the row sees nothing; p: its weights of the n visible keys in order (their positions in index).
void weight_row(const float* p, const int32_t* index, int64_t n, int64_t keys, uint32_t* row) {
  const bool prefix = n == 0 || index[n - 1] == n - 1;  // (a chain's: the first n positions)
  if (!prefix) std::memset(row, 0, static_cast<size_t>(keys) * 4);
  for (int64_t u = 0; u < n; u += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n - u));
    const __mmask16 k = cnt == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
    const __m512i w = weight_pairs(_mm512_maskz_loadu_ps(k, p + u));
    if (prefix)
      _mm512_mask_storeu_epi32(row + u, k, w);
    else
      _mm512_mask_i32scatter_epi32(row, k, _mm512_maskz_loadu_epi32(k, index + u), w, 4);
  }
  if (prefix) std::memset(row + n, 0, static_cast<size_t>(keys - n) * 4);
}

// The values of keys [j0, j0 + 16) (d each, at v; keys from `seen` on are taken as zeros: they may
// never have been written), dimensions [d0, d0 + 16 NC), each value twice, as NC B tiles at dup
// (tile c: 16 rows of 32 bf16 at dup + 512 c).
template <int NC>
inline void doubled_values(const uint16_t* v, int64_t d, int64_t j0, int64_t seen, int64_t d0, uint16_t* dup) {
  const __m512i twice = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5,
                                         4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (int i = 0; i < kKeys; ++i) {
    const uint16_t* row = v + (j0 + i) * d + d0;
    for (int c = 0; c < NC; ++c) {
      const __m512i w = j0 + i < seen
                            ? _mm512_permutexvar_epi16(twice, _mm512_castsi256_si512(_mm256_loadu_si256(
                                                                  reinterpret_cast<const __m256i*>(row + 16 * c))))
                            : _mm512_setzero_si512();
      _mm512_store_si512(dup + 512 * c + 32 * i, w);
    }
  }
}

// o's dimensions [d0, d0 + 16 NC) of the rows the tiles are configured with: the weight rows at w
// (stride `keys` pairs) against the values of keys [0, keys), stored at o (fp32, row stride d).
template <int NC>
void value_columns(const uint16_t* v, int64_t d, int64_t keys, int64_t seen, int64_t d0, const uint32_t* w,
                   float* o) {
  alignas(64) uint16_t dup[4 * 512];
  _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  for (int64_t j0 = 0; j0 < keys; j0 += kKeys) {
    if (j0 + (kAhead + 1) * kKeys <= seen)  // (the values stream from memory in a decoding pass)
      for (int i = 0; i < kKeys; ++i)
        for (int line = 0; line < 32 * NC; line += 32)
          _mm_prefetch(reinterpret_cast<const char*>(v + (j0 + kAhead * kKeys + i) * d + d0 + line), _MM_HINT_T0);
    doubled_values<NC>(v, d, j0, seen, d0, dup);
    VS_TILE_LOADD(4, w + j0, keys * 4);
    VS_TILE_LOADD(5, dup, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NC > 1) {
      VS_TILE_LOADD(6, dup + 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NC > 2) {
      VS_TILE_LOADD(7, dup + 1024, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NC > 3) {
      VS_TILE_LOADD(5, dup + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, o + d0, d * 4);
  if constexpr (NC > 1) _tile_stored(1, o + d0 + 16, d * 4);
  if constexpr (NC > 2) _tile_stored(2, o + d0 + 32, d * 4);
  if constexpr (NC > 3) _tile_stored(3, o + d0 + 48, d * 4);
  __asm__ volatile("" ::: "memory");  // (the tile stores wrote o)
}

// The query rows rows[0 .. nq) (row indices of a.q: one batch row b, key/value head kvh) attended:
// scores on tiles, the softmax on vectors (vec/attention.cpp), o on tiles.
template <int STEPS>
void attend_keys(const AttnArgs& a, int64_t b, int64_t kvh, const int64_t* rows, int nq, Scratch& x) {
  constexpr int64_t kD = 32 * STEPS;
  configure_score_tiles();
  query_tiles(static_cast<const uint16_t*>(a.q), kD, rows, nq, x.qt);
  load_query_tiles(x.qt, STEPS);
  int64_t seen = 0;  // the keys any of the rows sees lie before this
  for (int c = 0; c < nq; ++c)
    if (c == 0 || rows[c] / a.H != rows[c - 1] / a.H)
      seen = std::max(seen, visible_end(a.visible + rows[c] / a.H * a.span, a.span));
  const int64_t keys = (seen + kKeys - 1) / kKeys * kKeys;
  const int64_t br = a.rows ? a.rows[b] : b;  // the buffer row holding this row's keys and values
  key_scores<STEPS>(static_cast<const uint16_t*>(a.k) + br * a.k_sb + kvh * a.k_sh, a.span, keys, x.s.data());
  // each run of rows of one new token (consecutive query heads, the same visible keys), up to
  // kAttnGroupRows at a time: its scores of the visible keys in order, their softmax, its weights
  const __m512 scale = _mm512_set1_ps(a.scale);
  float l[kQueries];
  x.w.resize(static_cast<size_t>(nq * keys));
  for (int c0 = 0; c0 < nq;) {
    const int64_t bt = rows[c0] / a.H;
    int nr = 1;
    while (c0 + nr < nq && nr < kAttnGroupRows && rows[c0 + nr] == rows[c0] + nr && rows[c0 + nr] / a.H == bt)
      ++nr;
    int32_t* index = x.index.data();
    const int64_t n = visible_positions(a.visible + bt * a.span, a.span, index);
    float m[kAttnGroupRows];
    for (int r = 0; r < nr; ++r) {
      const __m512i column = _mm512_set1_epi32(c0 + r);
      float* out = x.score.data() + r * a.span;
      __m512 best = _mm512_set1_ps(-INFINITY);
      for (int64_t u = 0; u < n; u += 16) {
        const int cnt = static_cast<int>(std::min<int64_t>(16, n - u));
        const __mmask16 k = cnt == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cnt) - 1);
        const __m512i at = _mm512_add_epi32(_mm512_slli_epi32(_mm512_maskz_loadu_epi32(k, index + u), 4), column);
        const __m512 v = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, at, x.s.data(), 4), scale);
        _mm512_mask_storeu_ps(out + u, k, v);
        best = _mm512_mask_max_ps(best, k, v, best);  // (a NaN score is passed over, as std::max does)
      }
      m[r] = _mm512_reduce_max_ps(best);
    }
    attention_softmax(a, nr, x.score.data(), n, m, l + c0);
    for (int r = 0; r < nr; ++r) weight_row(x.score.data() + r * a.span, index, n, keys, x.w.data() + (c0 + r) * keys);
    c0 += nr;
  }
  // o = sum_j p_j v_j / l, 64 dimensions at a time
  configure_value_tiles(nq);
  const uint16_t* v = static_cast<const uint16_t*>(a.v) + br * a.v_sb + kvh * a.v_sh;
  float* o = x.o;
  if constexpr (STEPS >= 2) value_columns<4>(v, kD, keys, seen, 0, x.w.data(), o);
  if constexpr (STEPS == 1) value_columns<2>(v, kD, keys, seen, 0, x.w.data(), o);
  if constexpr (STEPS == 3) value_columns<2>(v, kD, keys, seen, 64, x.w.data(), o);
  if constexpr (STEPS == 4) value_columns<4>(v, kD, keys, seen, 64, x.w.data(), o);
  for (int c = 0; c < nq; ++c) {
    const __m512 lc = _mm512_set1_ps(l[c]);
    for (int64_t d0 = 0; d0 < kD; d0 += 16)
      store_columns(a.out, true, rows[c] * kD + d0, _mm512_div_ps(_mm512_load_ps(o + c * kD + d0), lc), 16);
  }
}

}  // namespace

void attention_rows_amx(const AttnArgs& a, int64_t begin, int64_t end) {
  const int steps = static_cast<int>(a.D / 32);
  if (!a.bf16 || a.D % 32 != 0 || steps > kMaxSteps || !amx_permitted()) return attention_rows(a, begin, end);
  static thread_local Scratch x;
  const int64_t padded = (a.span + kKeys - 1) / kKeys * kKeys;
  x.s.resize(static_cast<size_t>(padded * kQueries));
  x.score.resize(static_cast<size_t>(kAttnGroupRows * a.span));
  x.index.resize(static_cast<size_t>(a.span + 16));
  std::vector<int64_t> rows;
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
          case 1: attend_keys<1>(a, b, kvh, rows.data() + c, nq, x); break;
          case 2: attend_keys<2>(a, b, kvh, rows.data() + c, nq, x); break;
          case 3: attend_keys<3>(a, b, kvh, rows.data() + c, nq, x); break;
          default: attend_keys<4>(a, b, kvh, rows.data() + c, nq, x); break;
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
