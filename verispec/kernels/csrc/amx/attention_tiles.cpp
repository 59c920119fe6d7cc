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
// hi + lo is p_j to about 2^-17 of it), and weighed in the order of the row's visible keys (not of
// their positions): a tile's rows see each a prefix of one sequence of keys (a chain's rows the
// first n positions, a tree's rows on one path their ancestors; runs that do not fit start a new
// tile), a row's A operand holds the pair (hi, lo) of its u-th visible key at u and (0, 0) past
// its last, and the B operand the u-th key's value twice, so one TDPBF16PS adds hi v + lo v (both
// products exact) for 16 keys x 16 dimensions; C accumulates over u = 0, 16, ... in order from 0,
// o = C / l (fp32), rounded to bf16. The keys past a row's last add exact zeros (their values are
// finite when the model's are: another row of the pass sees them), so a row's sums depend on its
// own visible keys in order alone: a tree's node gets the bits of the chain decoding its path
// (tested), whose keys lie side by side.
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

inline int64_t whole_blocks(int64_t keys) { return (keys + kKeys - 1) / kKeys * kKeys; }  // keys rounded up to 16

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
    const __mmask16 valid = vec::first(cnt);
    const __m128i bytes = _mm_maskz_loadu_epi8(valid, vis + j);
    const __mmask16 seen = _mm_test_epi8_mask(bytes, bytes);
    const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j)));
    _mm512_storeu_si512(index + n, _mm512_maskz_compress_epi32(seen, at));
    n += __builtin_popcount(seen);
  }
  return n;
}

// A thread's buffers for attention_rows_amx.
struct Scratch {
  std::vector<float> s;           // C tiles of the scores: [keys, 16]
  std::vector<float> score;       // a run's scores, then weights, of its visible keys: [kAttnGroupRows, span]
  std::vector<int32_t> keys;      // the tile's visible positions in order, the longest run's (span + 16)
  std::vector<int32_t> next;      // the next run's (span + 16)
  std::vector<uint32_t> w;        // the query rows' weights as A operands: [rows, visible keys] (hi, lo) pairs
  alignas(64) uint32_t qt[kMaxSteps * 16 * kQueries];  // the queries as B tiles
  alignas(64) float o[kQueries * 32 * kMaxSteps];       // o before its division by l: [rows, D]
};

// A query tile: up to 16 query rows of one batch row and key/value head, in runs of one new
// token's consecutive heads (the same visible keys), whose visible positions are each a prefix of
// one sequence (the tile's keys: a chain's rows see the first n positions, a tree's rows on one
// path their ancestors), so that every row's values are weighed in the order of its own visible
// keys, as the row alone would weigh them.
struct Tile {
  int nq = 0, runs = 0;
  int64_t rows[kQueries];
  int start[kQueries + 1] = {0};  // run r: rows [start[r], start[r + 1])
  int64_t seen[kQueries];   // run r sees the first seen[r] of the tile's keys
  int64_t count = 0;        // the tile's keys (the longest run's)
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

// A query row's weights as an A operand over the tile's keys: its n weights (of the first n keys) as
// (hi, lo) pairs, then zeros up to `keys`.
void weight_row(const float* p, int64_t n, int64_t keys, uint32_t* row) {
  for (int64_t u = 0; u < n; u += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n - u));
    const __mmask16 k = vec::first(cnt);
    _mm512_mask_storeu_epi32(row + u, k, weight_pairs(_mm512_maskz_loadu_ps(k, p + u)));
  }
  std::memset(row + n, 0, static_cast<size_t>(keys - n) * 4);
}

// The values of the tile's keys [u0, u0 + 16) (positions at, `count` of them: zeros past it; d
// values each at v), dimensions [d0, d0 + 16 NC), each value twice, as NC B tiles at dup (tile c:
// 16 rows of 32 bf16 at dup + 512 c).
template <int NC>
inline void doubled_values(const uint16_t* v, int64_t d, const int32_t* at, int64_t u0, int64_t count, int64_t d0,
                           uint16_t* dup) {
  const __m512i twice = _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8, 7, 7, 6, 6, 5, 5,
                                         4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (int i = 0; i < kKeys; ++i) {
    const bool real = u0 + i < count;
    const uint16_t* row = v + (real ? at[u0 + i] : 0) * d + d0;
    for (int c = 0; c < NC; ++c) {
      const __m512i w = real ? _mm512_permutexvar_epi16(twice, _mm512_castsi256_si512(_mm256_loadu_si256(
                                                                   reinterpret_cast<const __m256i*>(row + 16 * c))))
                             : _mm512_setzero_si512();
      _mm512_store_si512(dup + 512 * c + 32 * i, w);
    }
  }
}

// o's dimensions [d0, d0 + 16 NC) of the rows the tiles are configured with: the weight rows at w
// (stride `keys` pairs, keys: count rounded up to 16) against the values of the tile's keys
// (positions at), stored at o (fp32, row stride d).
template <int NC>
void value_columns(const uint16_t* v, int64_t d, const int32_t* at, int64_t count, int64_t keys, int64_t d0,
                   const uint32_t* w, float* o) {
  alignas(64) uint16_t dup[4 * 512];
  _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  for (int64_t u0 = 0; u0 < keys; u0 += kKeys) {
    if (u0 + (kAhead + 1) * kKeys <= count)  // (the values stream from memory in a decoding pass)
      for (int i = 0; i < kKeys; ++i)
        for (int line = 0; line < 32 * NC; line += 32)
          _mm_prefetch(reinterpret_cast<const char*>(v + at[u0 + kAhead * kKeys + i] * d + d0 + line), _MM_HINT_T0);
    doubled_values<NC>(v, d, at, u0, count, d0, dup);
    VS_TILE_LOADD(4, w + u0, keys * 4);
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

// A tile's query rows (of batch row b, key/value head kvh) attended: scores on tiles, the softmax on
// vectors (vec/attention.cpp), o on tiles.
template <int STEPS>
void attend_tile(const AttnArgs& a, int64_t b, int64_t kvh, const Tile& tile, Scratch& x) {
  constexpr int64_t kD = 32 * STEPS;
  const int nq = tile.nq;
  const int32_t* at = x.keys.data();
  configure_score_tiles();
  query_tiles(static_cast<const uint16_t*>(a.q), kD, tile.rows, nq, x.qt);
  load_query_tiles(x.qt, STEPS);
  // scores of every position up to the last one a row sees (a row's are its own whatever the others)
  const int64_t last = tile.count ? at[tile.count - 1] + 1 : 0;
  const int64_t br = a.rows ? a.rows[b] : b;  // the buffer row holding this row's keys and values
  key_scores<STEPS>(static_cast<const uint16_t*>(a.k) + br * a.k_sb + kvh * a.k_sh, a.span, whole_blocks(last),
                    x.s.data());
  // each run: its scores of its visible keys in order, their softmax, its weights
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int64_t keys = whole_blocks(tile.count);
  float l[kQueries];
  x.w.resize(static_cast<size_t>(nq * keys));
  for (int r = 0; r < tile.runs; ++r) {
    const int c0 = tile.start[r], nr = tile.start[r + 1] - c0;
    const int64_t n = tile.seen[r];
    float m[kAttnGroupRows];
    for (int i = 0; i < nr; ++i) {
      const __m512i column = _mm512_set1_epi32(c0 + i);
      float* out = x.score.data() + i * a.span;
      __m512 best = _mm512_set1_ps(-INFINITY);
      for (int64_t u = 0; u < n; u += 16) {
        const int cnt = static_cast<int>(std::min<int64_t>(16, n - u));
        const __mmask16 k = vec::first(cnt);
        const __m512i j = _mm512_add_epi32(_mm512_slli_epi32(_mm512_maskz_loadu_epi32(k, at + u), 4), column);
        const __m512 v = _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, j, x.s.data(), 4), scale);
        _mm512_mask_storeu_ps(out + u, k, v);
        best = _mm512_mask_max_ps(best, k, v, best);  // (a NaN score is passed over, as std::max does)
      }
      m[i] = _mm512_reduce_max_ps(best);
    }
    attention_softmax(a, nr, x.score.data(), n, m, l + c0);
    for (int i = 0; i < nr; ++i) weight_row(x.score.data() + i * a.span, n, keys, x.w.data() + (c0 + i) * keys);
  }
  // o = sum_u p_u v_u / l over the tile's keys in order, 64 dimensions at a time
  configure_value_tiles(nq);
  const uint16_t* v = static_cast<const uint16_t*>(a.v) + br * a.v_sb + kvh * a.v_sh;
  float* o = x.o;
  if constexpr (STEPS >= 2) value_columns<4>(v, kD, at, tile.count, keys, 0, x.w.data(), o);
  if constexpr (STEPS == 1) value_columns<2>(v, kD, at, tile.count, keys, 0, x.w.data(), o);
  if constexpr (STEPS == 3) value_columns<2>(v, kD, at, tile.count, keys, 64, x.w.data(), o);
  if constexpr (STEPS == 4) value_columns<4>(v, kD, at, tile.count, keys, 64, x.w.data(), o);
  for (int c = 0; c < nq; ++c) {
    const __m512 lc = _mm512_set1_ps(l[c]);
    for (int64_t d0 = 0; d0 < kD; d0 += 16)
      store_columns(a.out, true, tile.rows[c] * kD + d0, _mm512_div_ps(_mm512_load_ps(o + c * kD + d0), lc), 16);
  }
}

template <int STEPS>
void attend_rows_of(const AttnArgs& a, int64_t begin, int64_t end, Scratch& x) {
  const int64_t group = a.H / a.Hkv;  // query heads per key/value head
  const int64_t b0 = begin / a.H / a.T, b1 = (end - 1) / a.H / a.T;
  Tile tile;
  for (int64_t b = b0; b <= b1; ++b)
    for (int64_t kvh = 0; kvh < a.Hkv; ++kvh) {
      tile = Tile{};
      for (int64_t t = 0; t < a.T; ++t) {
        const int64_t bt = b * a.T + t;
        // this token's query rows on key/value head kvh within [begin, end)
        const int64_t h0 = std::max(bt * a.H + kvh * group, begin), h1 = std::min(bt * a.H + (kvh + 1) * group, end);
        if (h0 >= h1) continue;
        const int64_t n = visible_positions(a.visible + bt * a.span, a.span, x.next.data());
        for (int64_t row = h0; row < h1;) {
          const int nr = static_cast<int>(std::min<int64_t>(kAttnGroupRows, h1 - row));
          const int64_t common = std::min(n, tile.count);
          const bool fits = std::equal(x.next.begin(), x.next.begin() + common, x.keys.begin());
          if (tile.nq + nr > kQueries || !fits) {
            if (tile.nq) attend_tile<STEPS>(a, b, kvh, tile, x);
            tile = Tile{};
          }
          if (n > tile.count) {
            std::copy(x.next.begin(), x.next.begin() + n, x.keys.begin());
            tile.count = n;
          }
          tile.seen[tile.runs++] = n;
          for (int i = 0; i < nr; ++i) tile.rows[tile.nq++] = row + i;
          tile.start[tile.runs] = tile.nq;
          row += nr;
        }
      }
      if (tile.nq) attend_tile<STEPS>(a, b, kvh, tile, x);
    }
}

}  // namespace

void attention_rows_amx(const AttnArgs& a, int64_t begin, int64_t end) {
  const int steps = static_cast<int>(a.D / 32);
  if (!a.bf16 || a.D % 32 != 0 || steps > kMaxSteps || !amx_permitted()) return attention_rows(a, begin, end);
  static thread_local Scratch x;
  x.s.resize(static_cast<size_t>(whole_blocks(a.span) * kQueries));
  x.score.resize(static_cast<size_t>(kAttnGroupRows * a.span));
  x.keys.resize(static_cast<size_t>(a.span + 16));
  x.next.resize(static_cast<size_t>(a.span + 16));
  switch (steps) {
    case 1: attend_rows_of<1>(a, begin, end, x); break;
    case 2: attend_rows_of<2>(a, begin, end, x); break;
    case 3: attend_rows_of<3>(a, begin, end, x); break;
    default: attend_rows_of<4>(a, begin, end, x); break;
  }
  _tile_release();
}

void attention_scores_amx(const uint16_t* q, int64_t m, const uint16_t* k, int64_t n, int64_t d, float* out) {
  const int steps = static_cast<int>(d / 32);
  const int64_t padded = whole_blocks(n);
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
