// GGUF Q4_K weights, used exactly: y = x @ W.T with W = dequantise(Q4_K), x in bf16, fp32 sums.
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
// Sub-block j covers inputs [32j, 32j + 32) and w = (d * scale_j) * q - (dmin * min_j), q in 0..15,
// computed in fp32 in that order by ggml and gguf-py alike.
//
// The kernel never rounds w. Per 32-input sub-block it multiplies the raw codes q (exact in bf16)
// by the bf16 activations on AMX, giving S[m][n] = sum_k x[m][k] q[n][k] in a C tile of its own,
// then applies the fp32 scales in the epilogue:
//     y[m][n] += (d*scale)[n] * S[m][n] - (dmin*min)[n] * X[m],    X[m] = sum of those 32 x[m][k],
// so the only rounding beyond fp32 arithmetic is the activations' to bf16. The weights are read
// and turned into B tiles once per call, however many activation rows there are: a pass over
// M = 1 .. 16 tokens costs about what one token costs (the rows only add AMX work, which is small
// next to the unpacking), and more rows are processed 16 at a time against the same B tiles.
// Every output element is computed by the same operations in the same order whatever M is and
// whatever the other rows hold, so row i of an M-row call equals the 1-row call, bit for bit.
//
// Packed layout ("records"): the same bytes as the GGUF blocks, permuted, nothing re-quantised.
// One record per (block of 16 weight rows, super-block), 2304 = 16 x 144 bytes, records ordered
// row block major; rows past N (padding to a multiple of 16) are all-zero blocks (d = dmin = 0,
// so w = 0):
//   [0, 32)      d of the 16 rows, fp16          [32, 64)   dmin of the 16 rows, fp16
//   [64, 256)    the 12 scale bytes of each row as three u32 words, word major: w0[16] w1[16] w2[16]
//   [256, 2304)  for each pair of sub-blocks i = 0..3 (inputs 64i .. 64i+63), 16 chunks p of 32
//                bytes: byte b of chunk p is qs[32i + 2p + b%2] of row b/2. Zero-extended to 16
//                bits, the low nibbles of a chunk are row p of the AMX B tile (VNNI order: inputs
//                2p, 2p+1 of 16 weight rows) of sub-block 2i, and the high nibbles that of 2i+1.
#include <cstdlib>

#include "common.h"

namespace verispec {
namespace {

constexpr int kSubPerSuper = 8;
constexpr int kHeader = 256;      // bytes of a record before the codes
constexpr int kPrefetchAhead = 8;  // records

// bf16 of 0..15, twice: VPERMW reads index bits 0..4 only, so a zero-extended byte's low nibble
// needs no masking when bit 4 selects the second copy.
inline __m512i code_table() {
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
                          0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

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

inline void prefetch_record(const uint8_t* rec, const uint8_t* end) {
  const uint8_t* p = rec + kPrefetchAhead * kQ4KRecord;
  if (p >= end) return;
  for (int line = 0; line < kQ4KRecord; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// The output columns of weight-row blocks [begin, end) for every row of x, R rows per A tile
// (R = M when M <= 16; else 16, and x has a.rows = a multiple of 16 rows).
template <int R>
void q4k_blocks(const LinearArgs& a, int64_t begin, int64_t end) {
  configure_tiles(R);
  const __m512i table = code_table();
  const int64_t nsb = a.K / kQ4KSuper, nsub = a.K / 32, chunks = a.rows / R;
  alignas(64) uint16_t b0[kRows * 32], b1[kRows * 32];  // B tiles of sub-blocks 2i and 2i+1
  alignas(64) float c0[R * 16], c1[R * 16];             // C tiles, stored for the epilogue
  __m512 racc[R];                                       // y of the only chunk, in registers
  SubScales s;
  const uint8_t* w_end = a.w + end * nsb * kQ4KRecord;
  // When there are several chunks their running sums live in memory (one 16-row slab each,
  // written back after every sub-block pair); a single chunk keeps them in registers.
  float* slabs = chunks > 1 ? static_cast<float*>(std::aligned_alloc(64, sizeof(float) * chunks * R * 16)) : nullptr;
  for (int64_t nb = begin; nb < end; ++nb) {
    for (int m = 0; m < R; ++m) racc[m] = _mm512_setzero_ps();
    if (slabs) std::memset(slabs, 0, sizeof(float) * chunks * R * 16);
    const uint8_t* rec = a.w + nb * nsb * kQ4KRecord;
    for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
      prefetch_record(rec, w_end);
      decode_scales(rec, s);
      for (int i = 0; i < 4; ++i) {
        // Unpack 16 rows x 64 inputs of codes into the B tiles of sub-blocks 2i and 2i+1.
        const uint8_t* q = rec + kHeader + i * 512;
        for (int p = 0; p < kRows; ++p) {
          const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p)));
          _mm512_store_si512(b0 + 32 * p, _mm512_permutexvar_epi16(w, table));
          _mm512_store_si512(b1 + 32 * p, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
        }
        VS_TILE_LOADD(4, b0, 64);
        VS_TILE_LOADD(5, b1, 64);
        const int64_t k0 = sb * kQ4KSuper + 64 * i, sub = sb * kSubPerSuper + 2 * i;
        const __m512 ds0 = _mm512_load_ps(s.ds[2 * i]), dm0 = _mm512_load_ps(s.dm[2 * i]);
        const __m512 ds1 = _mm512_load_ps(s.ds[2 * i + 1]), dm1 = _mm512_load_ps(s.dm[2 * i + 1]);
        for (int64_t c = 0; c < chunks; ++c) {
          const uint16_t* xc = a.x + c * R * a.K;
          VS_TILE_LOADD(2, xc + k0, a.K * 2);
          VS_TILE_LOADD(3, xc + k0 + 32, a.K * 2);
          _tile_zero(0);
          _tile_zero(1);
          _tile_dpbf16ps(0, 2, 4);
          _tile_dpbf16ps(1, 3, 5);
          _tile_stored(0, c0, 64);
          _tile_stored(1, c1, 64);
          // y += ds0 * S0 - dm0 * X0 + ds1 * S1 - dm1 * X1, in this order for every row.
          for (int m = 0; m < R; ++m) {
            const float* xs = a.xsum + (c * R + m) * nsub + sub;
            __m512 t = slabs ? _mm512_load_ps(slabs + (c * R + m) * 16) : racc[m];
            t = _mm512_fmadd_ps(_mm512_load_ps(c0 + 16 * m), ds0, t);
            t = _mm512_fnmadd_ps(_mm512_set1_ps(xs[0]), dm0, t);
            t = _mm512_fmadd_ps(_mm512_load_ps(c1 + 16 * m), ds1, t);
            t = _mm512_fnmadd_ps(_mm512_set1_ps(xs[1]), dm1, t);
            if (slabs)
              _mm512_store_ps(slabs + (c * R + m) * 16, t);
            else
              racc[m] = t;
          }
        }
      }
    }
    const int64_t n0 = nb * kRows;
    const int n_valid = static_cast<int>(a.N - n0 < kRows ? a.N - n0 : kRows);
    __m512 bias = _mm512_setzero_ps();
    if (a.bias) bias = _mm512_maskz_loadu_ps(n_valid >= 16 ? 0xFFFF : (1u << n_valid) - 1, a.bias + n0);
    for (int64_t m = 0; m < a.M; ++m) {
      const __m512 v = slabs ? _mm512_load_ps(slabs + m * 16) : racc[m];
      store_columns(a.y, a.out_bf16, m * a.N + n0, _mm512_add_ps(v, bias), n_valid);
    }
  }
  std::free(slabs);
  _tile_release();
}

}  // namespace

void q4k_linear(const LinearArgs& a, int64_t begin, int64_t end) {
  switch (a.rows > kRows ? kRows : a.rows) {
#define VS_CASE(r) \
  case r:          \
    q4k_blocks<r>(a, begin, end); \
    break;
    VS_CASE(1) VS_CASE(2) VS_CASE(3) VS_CASE(4) VS_CASE(5) VS_CASE(6) VS_CASE(7) VS_CASE(8)
    VS_CASE(9) VS_CASE(10) VS_CASE(11) VS_CASE(12) VS_CASE(13) VS_CASE(14) VS_CASE(15) VS_CASE(16)
#undef VS_CASE
    default:
      break;
  }
}

// X[m][t]: the fp32 sum of row m's 32 bf16 inputs of sub-block t, in a fixed order.
void subblock_sums(const uint16_t* x, int64_t rows, int64_t k, float* xsum) {
  const int64_t nsub = k / 32;
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t t = 0; t < nsub; ++t) {
      const __m512i v = _mm512_loadu_si512(x + m * k + 32 * t);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));  // bf16 -> fp32: shift into place
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
      xsum[m * nsub + t] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
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
          for (int p = 0; p < 16; ++p)
            for (int half = 0; half < 2; ++half) rec[kHeader + 512 * i + 32 * p + 2 * r + half] = qs[32 * i + 2 * p + half];
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
        for (int p = 0; p < 16; ++p)
          for (int b = 0; b < 32; ++b) {
            const int r = b / 2;
            const int64_t col = sb * kQ4KSuper + 64 * i + 2 * p + b % 2;
            const uint8_t byte = rec[kHeader + 512 * i + 32 * p + b];
            float* row = w + (nb * kRows + r) * k;
            row[col] = s.ds[2 * i][r] * float(byte & 15) - s.dm[2 * i][r];
            row[col + 32] = s.ds[2 * i + 1][r] * float(byte >> 4) - s.dm[2 * i + 1][r];
          }
    }
  }
}

}  // namespace verispec
