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
//   - vectors for up to kQ4KVectorRows rows (vec/linear.cpp, the avx512 tier's code): per 16
//     weight rows x 64 inputs (512 bytes of codes), 8 loads and 16 AND/shift unpack the nibbles
//     into two VPDPBUSD operands, then each activation row takes 16 VPDPBUSD and the fp32 steps:
//     memory-bound at one to a few rows, until VPDPBUSD's throughput takes over;
//   - AMX (this file) for more rows: the unpacked codes of a sub-block are an int8 B tile (8 groups x 64
//     bytes), so TDPBSUD gives S_j for up to 16 rows at once; the next block's multiply runs
//     while a block's sums are stored and scaled. The unpacking, the tile stores and the per-row
//     fp32 steps bound it, not the multiplies: on an Intel Xeon with AMX it is slower than the
//     vectors up to 8 rows, as fast from 9 to 12 and faster from 14 (kQ4KVectorRows).
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
#include "amx.h"
#include "../vec/q4k_scales.h"

namespace verispec {
namespace {
using vec::SubScales;
using vec::decode_scales;

// t + the terms of block b (sub-blocks 2i, 2i + 1 of the record decoded into s) for one
// activation row, from its integer sums s0, s1 (vec/q4k_scales.h's four fused multiply-adds).
inline __m512 add_pair(const W8A8Args& a, const SubScales& s, int i, int64_t row, int64_t b, __m512i s0, __m512i s1,
                       __m512 t) {
  const float* xmin = a.xmin + row * (a.K / 32) + 2 * b;
  return vec::q4k_add_pair(s, i, a.xscale[row * (a.K / 64) + b], xmin[0], xmin[1], vec::I16{s0},
                           vec::I16{s1}, vec::F16{t})
      .v;
}

// y of block nb's 16 output columns for one activation row, from its sum t.
inline void finish_row(const W8A8Args& a, int64_t nb, int64_t row, __m512 t) {
  const int64_t n0 = nb * kRows;
  const int n_valid = static_cast<int>(a.N - n0 < kRows ? a.N - n0 : kRows);
  store_columns(a.y, a.out_bf16, row * a.N + n0, vec::plus_bias(a.bias, n0, n_valid, vec::F16{t}).v, n_valid);
}

inline void prefetch_record(const uint8_t* rec) {
  // (prefetches never fault: past the row block they fetch the next one, which comes next anyway)
  for (int line = 0; line < kQ4KRecord; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(rec + 2 * kQ4KRecord + line), _MM_HINT_T0);
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
    const uint8_t* q = rec + kQ4KHeader;
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
constexpr auto kAmxFns = rows_table<16>([](auto r) { return &amx_rows<decltype(r)::value>; });

}  // namespace

// Every row, 16 at a time (then the rest) over the same row block, whose records are then in L2:
// one tile configuration per chunk size.
void q4k_linear_amx(const W8A8Args& a, int64_t begin, int64_t end) {
  const int64_t full = a.M / kRows, rest = a.M % kRows;
  if (full) {
    configure_q4k_tiles(kRows);
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t c = 0; c < full; ++c) amx_rows<kRows>(a, nb, c * kRows);
  }
  if (rest) {
    configure_q4k_tiles(static_cast<int>(rest));
    const RowsFn tail = pick_rows(kAmxFns, rest);
    for (int64_t nb = begin; nb < end; ++nb) tail(a, nb, full * kRows);
  }
  _tile_release();
}

}  // namespace verispec
