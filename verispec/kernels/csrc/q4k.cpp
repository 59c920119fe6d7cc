// GGUF Q4_K weights, used exactly, times activations quantised to int8 in blocks of 64 inputs
// (w8a8.cpp's quantisation): integer dot products of the 4-bit codes (AVX512-VNNI, or AMX for
// many rows), as llama.cpp's ggml_vec_dot_q4_K_q8_K does with its Q8_K activations.
//
// The GGUF format (llama.cpp, ggml-common.h: block_q4_K; ggml-quants.c: dequantize_row_q4_K and
// get_scale_min_k4). A row of K inputs is K/256 super-blocks of 144 bytes:
//   bytes [0, 2)     d     fp16  super-block scale of the sub-block scales
//   bytes [2, 4)     dmin  fp16  super-block scale of the sub-block mins
//   bytes [4, 16)    8 (scale, min) pairs of 6 bits each, packed: for sub-block j < 4, scale =
//                    s[j] & 63 and min = s[j+4] & 63; for j >= 4, scale = (s[j+4] & 15) | (s[j-4] >> 6) << 4
//                    and min = (s[j+4] >> 4) | (s[j] >> 6) << 4  (s = these 12 bytes)
//   bytes [16, 144)  128 bytes qs of 4-bit codes: byte 32i + l holds input 64i + l in its low
//                    nibble and input 64i + 32 + l in its high nibble (i = 0..3, l = 0..31)
// Sub-block j covers inputs [32j, 32j + 32) and w = ds_j * q - dm_j with ds_j = d * scale_j and
// dm_j = dmin * min_j (both exact in fp32: an fp16 times a 6-bit integer), q in 0..15.
//
// Numerics. The weights are never rounded: the kernel works on the codes q and the factors ds,
// dm. With p, scale_x the activations quantised per block of 64 inputs (w8a8.cpp), a block b is
// the sub-blocks j0 = 2b, j1 = 2b + 1 (in row order: super-block b / 4, its pair b % 4), and
//   S_j = sum_{k in j} p[m][k] q[n][k]     (int32, exact: VPDPBUSD of the codes as unsigned bytes)
//   P_j = sum_{k in j} p[m][k]             (int32, exact, with the quantisation)
//   a_j = float(P_j) * scale_x[m][b]
//   u = fma(float(S_j1), ds_j1, float(S_j0) * ds_j0)
//   t = fma(-a_j1, dm_j1, fma(-a_j0, dm_j0, fma(u, scale_x[m][b], t)))
// over b = 0, 1, ... in order from t = 0 (fp32; fma(x, y, z) = x * y + z rounded once), then
// y = t + bias.
// That is sum_k (scale_x p[m][k]) * w[n][k] with the exact weights: the activations' 8-bit
// rounding is the one approximation. Each row's result is the same code on that row's data
// alone, so an M-row call equals M one-row calls bit for bit.
//
// Two engines compute the same S_j on the same packed records (and share the fp32 steps), so
// they give the same bits:
//   - AVX512-VNNI for up to kVnniRows rows: per 16 weight rows x 64 inputs (512 bytes of codes),
//     8 loads and 16 AND/shift unpack the nibbles into two VPDPBUSD operands, then each activation
//     row takes 16 VPDPBUSD (its signed operand a 4-byte broadcast from the quantised row) and
//     the fp32 steps: memory-bound at one to a few rows, until VPDPBUSD's throughput (one per
//     cycle) takes over. Rows go 8 at a time over the same weights (a row block's records stay
//     in L2);
//   - AMX for more rows: the unpacked codes of a sub-block are an int8 B tile (8 groups x 64
//     bytes), so TDPBSUD gives S_j for up to 16 rows at once; the next block's multiply runs
//     while a block's sums are stored and scaled.
//
// Packed layout ("records"): the same bytes as the GGUF blocks, permuted, nothing re-quantised.
// One record per (block of 16 weight rows, super-block), 2304 = 16 x 144 bytes, records ordered
// row block major; rows past N (padding to a multiple of 16) are all-zero blocks (d = dmin = 0,
// so w = 0):
//   [0, 32)      d of the 16 rows, fp16          [32, 64)   dmin of the 16 rows, fp16
//   [64, 256)    the 12 scale bytes of each row as three u32 words, word major: w0[16] w1[16] w2[16]
//   [256, 2304)  for each pair of sub-blocks i = 0..3 (inputs 64i .. 64i+63), 8 groups g of 64
//                bytes: byte 4r + j of group g is qs[32i + 4g + j] of row r. The low nibbles of a
//                group are one VPDPBUSD operand (lane r: inputs 64i + 4g .. +3 of row r), the high
//                nibbles another (inputs 64i + 32 + 4g .. +3).
#include <cstdlib>
#include <initializer_list>

#include "common.h"

namespace verispec {
namespace {

constexpr int kSubPerSuper = 8;
constexpr int kHeader = 256;         // bytes of a record before the codes
constexpr int kPrefetchRecords = 2;  // how far ahead of its loads the weight stream is prefetched
constexpr int kVnniChunk = 8;        // activation rows per VNNI pass over the weights
constexpr int kVnniRows = 6;         // calls with at most this many rows run on VNNI, others on AMX

// The fp32 factors of one record: ds[j][r] = d * scale_j and dm[j][r] = dmin * min_j of row r.
struct SubScales {
  alignas(64) float ds[kSubPerSuper][kRows];
  alignas(64) float dm[kSubPerSuper][kRows];
};

// Sub-block j's factors from byte SHIFT/8 of each lane of the packed 6-bit scales and mins.
template <int SHIFT>
inline void store_subblock(SubScales& s, int j, __m512 d, __m512 dmin, __m512i sc, __m512i mn) {
  const __m512i byte = _mm512_set1_epi32(0xFF);
  _mm512_store_ps(s.ds[j], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(sc, SHIFT), byte))));
  _mm512_store_ps(s.dm[j], _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(mn, SHIFT), byte))));
}

// get_scale_min_k4 for 16 rows at once (one row per 32-bit lane).
inline void decode_scales(const uint8_t* rec, SubScales& s) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
  const __m512i w0 = _mm512_loadu_si512(rec + 64);   // s[0..3]
  const __m512i w1 = _mm512_loadu_si512(rec + 128);  // s[4..7]
  const __m512i w2 = _mm512_loadu_si512(rec + 192);  // s[8..11]
  const __m512i six = _mm512_set1_epi32(0x3F3F3F3F), top = _mm512_set1_epi32(0x30303030),
                low = _mm512_set1_epi32(0x0F0F0F0F);
  // byte j of sc_lo / mn_lo: scale / min of sub-block j; byte j of sc_hi / mn_hi: of sub-block 4 + j
  const __m512i sc_lo = _mm512_and_si512(w0, six);
  const __m512i mn_lo = _mm512_and_si512(w1, six);
  const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(w2, low), _mm512_and_si512(_mm512_srli_epi32(w0, 2), top));
  const __m512i mn_hi =
      _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low), _mm512_and_si512(_mm512_srli_epi32(w1, 2), top));
  store_subblock<0>(s, 0, d, dmin, sc_lo, mn_lo);
  store_subblock<8>(s, 1, d, dmin, sc_lo, mn_lo);
  store_subblock<16>(s, 2, d, dmin, sc_lo, mn_lo);
  store_subblock<24>(s, 3, d, dmin, sc_lo, mn_lo);
  store_subblock<0>(s, 4, d, dmin, sc_hi, mn_hi);
  store_subblock<8>(s, 5, d, dmin, sc_hi, mn_hi);
  store_subblock<16>(s, 6, d, dmin, sc_hi, mn_hi);
  store_subblock<24>(s, 7, d, dmin, sc_hi, mn_hi);
}

// t + the terms of block b (sub-blocks 2i, 2i + 1 of the record decoded into s) for one
// activation row, from its integer sums s0, s1 (see the top: four fused multiply-adds).
inline __m512 add_pair(const W8A8Args& a, const SubScales& s, int i, int64_t row, int64_t b, __m512i s0, __m512i s1,
                       __m512 t) {
  const __m512 u = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_load_ps(s.ds[2 * i + 1]),
                                   _mm512_mul_ps(_mm512_cvtepi32_ps(s0), _mm512_load_ps(s.ds[2 * i])));
  t = _mm512_fmadd_ps(u, _mm512_set1_ps(a.xscale[row * (a.K / 64) + b]), t);
  const float* xm = a.xmin + row * (a.K / 32) + 2 * b;
  t = _mm512_fnmadd_ps(_mm512_set1_ps(xm[0]), _mm512_load_ps(s.dm[2 * i]), t);
  return _mm512_fnmadd_ps(_mm512_set1_ps(xm[1]), _mm512_load_ps(s.dm[2 * i + 1]), t);
}

// y of block nb's 16 output columns for one activation row, from its sum t.
inline void finish_row(const W8A8Args& a, int64_t nb, int64_t row, __m512 t) {
  const int64_t n0 = nb * kRows;
  const int n_valid = static_cast<int>(a.N - n0 < kRows ? a.N - n0 : kRows);
  const __mmask16 mask = n_valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n_valid) - 1);
  const __m512 v = a.bias ? _mm512_add_ps(t, _mm512_maskz_loadu_ps(mask, a.bias + n0)) : t;
  store_columns(a.y, a.out_bf16, row * a.N + n0, v, n_valid);
}

inline void prefetch_record(const uint8_t* rec) {
  // (prefetches never fault: past the row block they fetch the next one, which comes next anyway)
  for (int line = 0; line < kQ4KRecord; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchRecords * kQ4KRecord + line), _MM_HINT_T0);
}

// VNNI: rows row0 .. row0 + R of x against the 16 weight rows of block nb.
template <int R>
void vnni_rows(const W8A8Args& a, int64_t nb, int64_t row0) {
  constexpr int U = R <= 2 ? 2 : 1;  // accumulator chains per sub-block and row
  const int64_t nsb = a.K / kQ4KSuper;
  const uint8_t* rec = a.w + nb * nsb * kQ4KRecord;
  const int32_t* xr[R];
  for (int m = 0; m < R; ++m) xr[m] = reinterpret_cast<const int32_t*>(a.xq + (row0 + m) * a.K);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 t[R];
  for (int m = 0; m < R; ++m) t[m] = _mm512_setzero_ps();
  SubScales s;
  for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
    prefetch_record(rec);
    decode_scales(rec, s);
    for (int i = 0; i < 4; ++i) {
      const int64_t b = 4 * sb + i;
      const uint8_t* q = rec + kHeader + 512 * i;
      __m512i acc0[R][U], acc1[R][U];
      for (int m = 0; m < R; ++m)
        for (int u = 0; u < U; ++u) acc0[m][u] = acc1[m][u] = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += U) {
        __m512i lo[U], hi[U];
        for (int u = 0; u < U; ++u) {
          const __m512i v = _mm512_load_si512(q + 64 * (g + u));
          lo[u] = _mm512_and_si512(v, nibble);
          hi[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
        // inputs 64b + 4(g+u) (low nibbles) and 64b + 32 + 4(g+u) (high) as int32 words of the row
        for (int m = 0; m < R; ++m)
          for (int u = 0; u < U; ++u) {
            acc0[m][u] = _mm512_dpbusd_epi32(acc0[m][u], lo[u], _mm512_set1_epi32(xr[m][16 * b + g + u]));
            acc1[m][u] = _mm512_dpbusd_epi32(acc1[m][u], hi[u], _mm512_set1_epi32(xr[m][16 * b + 8 + g + u]));
          }
      }
      for (int m = 0; m < R; ++m) {
        __m512i s0 = acc0[m][0], s1 = acc1[m][0];
        for (int u = 1; u < U; ++u) {
          s0 = _mm512_add_epi32(s0, acc0[m][u]);
          s1 = _mm512_add_epi32(s1, acc1[m][u]);
        }
        t[m] = add_pair(a, s, i, row0 + m, b, s0, s1, t[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) finish_row(a, nb, row0 + m, t[m]);
}

// AMX tiles: tmm0, tmm1 and tmm6, tmm7 C (rows x 16 int32) of sub-blocks 2i, 2i + 1 of even and
// odd blocks (one block's sums are stored and added while the next one's multiply runs); tmm2,
// tmm3 A (rows x 32 activation bytes) of the same; tmm4, tmm5 B (8 groups x 64 bytes: the codes
// of 16 weight rows x 32 inputs, unpacked from the nibbles). TDPBSUD C += A . B: signed A,
// unsigned B.
inline void configure_q4k_tiles(int rows) {
  const TileShape c{rows, 64}, a{rows, 32}, b{8, 64};
  configure_tiles({c, c, a, a, b, b, c, c});
}

// Unpacks the codes of block b (record q) into buf and multiplies them into C tiles C0, C1.
#define VS_ISSUE(C0, C1, q, buf, b)                                                      \
  for (int g = 0; g < 8; ++g) {                                                          \
    const __m512i v = _mm512_load_si512((q) + 64 * g);                                   \
    _mm512_store_si512((buf) + 64 * g, _mm512_and_si512(v, nibble));                     \
    _mm512_store_si512((buf) + 512 + 64 * g, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)); \
  }                                                                                      \
  _tile_zero(C0);                                                                        \
  _tile_zero(C1);                                                                        \
  VS_TILE_LOADD(2, xc + 64 * (b), a.K);                                                  \
  VS_TILE_LOADD(4, (buf), 64);                                                           \
  VS_TILE_LOADD(3, xc + 64 * (b) + 32, a.K);                                             \
  VS_TILE_LOADD(5, (buf) + 512, 64);                                                     \
  _tile_dpbsud(C0, 2, 4);                                                                \
  _tile_dpbsud(C1, 3, 5);
// Adds the sums of block b (pair i of the record decoded into ss) from C tiles C0, C1 to t.
#define VS_DRAIN(C0, C1, ss, i, b)                                                                       \
  _tile_stored(C0, c0, 64);                                                                              \
  _tile_stored(C1, c1, 64);                                                                              \
  for (int m = 0; m < R; ++m)                                                                            \
    t[m] = add_pair(a, ss, i, row0 + m, b, _mm512_load_si512(c0 + 16 * m), _mm512_load_si512(c1 + 16 * m), t[m]);

// AMX: rows row0 .. row0 + R of x (the rows the tiles are configured with) against block nb.
template <int R>
void amx_rows(const W8A8Args& a, int64_t nb, int64_t row0) {
  alignas(64) uint8_t buf0[1024], buf1[1024];
  alignas(64) int32_t c0[R * 16], c1[R * 16];
  const int64_t nsb = a.K / kQ4KSuper;
  const uint8_t* rec = a.w + nb * nsb * kQ4KRecord;
  const int8_t* xc = a.xq + row0 * a.K;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 t[R];
  for (int m = 0; m < R; ++m) t[m] = _mm512_setzero_ps();
  SubScales s[2];  // of the current record and the one before
  for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
    prefetch_record(rec);
    SubScales& cur = s[sb & 1];
    const SubScales& prev = s[(sb & 1) ^ 1];
    decode_scales(rec, cur);
    const uint8_t* q = rec + kHeader;
    const int64_t b = 4 * sb;
    VS_ISSUE(0, 1, q, buf0, b)
    if (sb > 0) {
      VS_DRAIN(6, 7, prev, 3, b - 1)
    }
    VS_ISSUE(6, 7, q + 512, buf1, b + 1)
    VS_DRAIN(0, 1, cur, 0, b)
    VS_ISSUE(0, 1, q + 1024, buf0, b + 2)
    VS_DRAIN(6, 7, cur, 1, b + 1)
    VS_ISSUE(6, 7, q + 1536, buf1, b + 3)
    VS_DRAIN(0, 1, cur, 2, b + 2)
  }
  VS_DRAIN(6, 7, s[(nsb - 1) & 1], 3, 4 * nsb - 1)
  for (int m = 0; m < R; ++m) finish_row(a, nb, row0 + m, t[m]);
}
#undef VS_ISSUE
#undef VS_DRAIN

using RowsFn = void (*)(const W8A8Args&, int64_t, int64_t);
constexpr auto kVnniFns = rows_table<8>([](auto r) { return &vnni_rows<decltype(r)::value>; });
constexpr auto kAmxFns = rows_table<16>([](auto r) { return &amx_rows<decltype(r)::value>; });

}  // namespace

bool q4k_uses_amx(int64_t m, int engine) { return engine == kEngineAmx || (engine == kEngineAuto && m > kVnniRows); }

// Every row, in chunks (8 rows on VNNI, 16 on AMX) over the same row block, whose records are
// then in L2.
void q4k_linear(const W8A8Args& a, int64_t begin, int64_t end, int engine) {
  const bool amx = q4k_uses_amx(a.M, engine);
  const int64_t chunk = amx ? kRows : kVnniChunk;
  const int64_t full = a.M / chunk, rest = a.M % chunk;
  const RowsFn body = amx ? pick_rows(kAmxFns, chunk) : pick_rows(kVnniFns, chunk);
  const RowsFn tail = amx ? pick_rows(kAmxFns, rest) : pick_rows(kVnniFns, rest);
  if (amx) {  // one tile configuration per chunk size
    if (full) {
      configure_q4k_tiles(kRows);
      for (int64_t nb = begin; nb < end; ++nb)
        for (int64_t c = 0; c < full; ++c) body(a, nb, c * chunk);
    }
    if (tail) {
      configure_q4k_tiles(static_cast<int>(rest));
      for (int64_t nb = begin; nb < end; ++nb) tail(a, nb, full * chunk);
    }
    _tile_release();
    return;
  }
  for (int64_t nb = begin; nb < end; ++nb) {
    for (int64_t c = 0; c < full; ++c) body(a, nb, c * chunk);
    if (tail) tail(a, nb, full * chunk);
  }
}

// GGUF blocks [n, k/256 * 144] -> records of row blocks [begin, end) (see the layout above).
void q4k_pack(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end) {
  const int64_t nsb = k / kQ4KSuper;
  for (int64_t nb = begin; nb < end; ++nb)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      uint8_t* rec = packed + (nb * nsb + sb) * kQ4KRecord;
      std::memset(rec, 0, kQ4KRecord);
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = nb * kRows + r;
        if (row >= n) break;  // padding rows stay zero
        const uint8_t* blk = blocks + (row * nsb + sb) * kQ4KBlock;
        std::memcpy(rec + 2 * r, blk, 2);           // d
        std::memcpy(rec + 32 + 2 * r, blk + 2, 2);  // dmin
        for (int word = 0; word < 3; ++word) std::memcpy(rec + 64 + 64 * word + 4 * r, blk + 4 + 4 * word, 4);
        const uint8_t* qs = blk + 16;
        for (int i = 0; i < 4; ++i)
          for (int g = 0; g < 8; ++g) std::memcpy(rec + kHeader + 512 * i + 64 * g + 4 * r, qs + 32 * i + 4 * g, 4);
      }
    }
}

// The fp32 weights rows of blocks [begin, end) stand for, computed as ggml and gguf-py do
// ((d * scale) * q - dmin * min, fp32): the tests check the packing against them bit for bit.
void q4k_dequantize(const uint8_t* packed, int64_t k, float* w, int64_t begin, int64_t end) {
  const int64_t nsb = k / kQ4KSuper;
  SubScales s;
  for (int64_t nb = begin; nb < end; ++nb) {
    const uint8_t* rec = packed + nb * nsb * kQ4KRecord;
    for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
      decode_scales(rec, s);
      for (int i = 0; i < 4; ++i)
        for (int g = 0; g < 8; ++g)
          for (int b = 0; b < 64; ++b) {
            const int r = b / 4;
            const int64_t col = sb * kQ4KSuper + 64 * i + 4 * g + b % 4;
            const uint8_t byte = rec[kHeader + 512 * i + 64 * g + b];
            float* row = w + (nb * kRows + r) * k;
            row[col] = s.ds[2 * i][r] * float(byte & 15) - s.dm[2 * i][r];
            row[col + 32] = s.ds[2 * i + 1][r] * float(byte >> 4) - s.dm[2 * i + 1][r];
          }
    }
  }
}

}  // namespace verispec
