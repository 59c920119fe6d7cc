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
//   - AMX (this file) for more rows: the unpacked codes of a block are an int8 B tile (16 groups
//     x 64 bytes), against an A tile that holds each activation row twice, once per sub-block with
//     the other's 32 inputs zero (tile_rows paired, up to 8 rows), so that one TDPBSUD gives S_j0
//     and S_j1 of every row; with more rows, a sub-block's codes (8 groups) against the rows' 32
//     inputs (tile_rows in halves, up to 16 rows a call, two multiplies a block). A record's codes
//     are unpacked while the one before it multiplies, and a block's sums are scaled two blocks
//     after their multiply. The tile operations cost by the rows they move, not the multiplies
//     (alone, [8960 x 1536]: 0.29 / 0.32 / 0.38 ms at 1 / 4 / 8 rows paired, 0.37 at 1 to 8 in
//     halves; the vectors' one row 0.27; whole kernels paired 0.29 / 0.32 / 0.38, in halves 0.43 /
//     - / 0.43-0.48). On an Intel Xeon with AMX the tiles are faster than the vectors from 5 rows
//     (6 / 8 rows 0.34 / 0.38 ms against 0.37 / 0.41; 12 rows 0.48 against 0.56;
//     benchmarks/kernel_stream.py), so calls of up to kQ4KVectorRows rows stay on vectors.
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
#include <algorithm>
#include <cstring>
#include <vector>

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

// AMX tiles in halves: tmm0, tmm1 and tmm2, tmm3 C (rows x 16 int32) of sub-blocks 2i, 2i + 1 of
// even and odd blocks; tmm4, tmm5 A (rows x 32 activation bytes) of the same; tmm6, tmm7 B (8
// groups x 64 bytes: the codes of 16 weight rows x 32 inputs, unpacked from the nibbles). TDPBSUD
// C += A . B: signed A, unsigned B.
inline void configure_q4k_tiles(int rows) {
  const TileShape c{rows, 64}, a{rows, 32}, b{8, 64};
  configure_tiles({c, c, c, c, a, a, b, b});
}

// How far behind its multiply a block's sums are read back (in blocks), and the slots of sums in
// flight. No read follows the stores it reads at once: a record's codes are unpacked (vector
// stores) while the one before it is multiplied, and a block's sums (tile stores) are added to the
// rows' totals kDrainLag blocks after its tiles were stored, into a slot of the ring. Both together,
// against a kernel whose tile loads and vector loads each followed their stores at once
// (kernel_stream.py --kinds q4k-amx, [8960 x 1536], 2 threads, Intel Xeon with AMX): 8 / 16 rows
// 0.44-0.48 / 0.58 ms per matrix instead of 0.53 / 0.69 (which of the two earned what was not
// measured apart; a lag of 5 blocks: no better than 2).
constexpr int kDrainLag = 2;
constexpr int kSlots = 4;  // > kDrainLag + 1, a power of two
static_assert(kSlots > kDrainLag + 1 && (kSlots & (kSlots - 1)) == 0, "ring of sums");
static_assert(kDrainLag + 1 <= 4, "the blocks drained lie in this record or the one before (two SubScales)");

// The weight stream is prefetched kRecordsAhead records ahead into L2 (the unpacking's loads bring
// a line to L1 when it is needed): with L1 as the target the weights evicted the paired
// activations, which every row block reads again (kernel_stream.py --kinds q4k-amx, [8960 x 1536],
// 2 threads, Intel Xeon with AMX, paired tiles: 8 rows 0.40 ms per matrix instead of 0.46; 16 rows
// in halves 0.548 instead of 0.560). The paired activations of block b + kPairedAhead are
// prefetched into L1 (8 rows: 0.38 instead of 0.40; 0.35 when every block read the same, L1-hot
// activations, the most this could give).
constexpr int kRecordsAhead = 3;
constexpr int kPairedAhead = 2;

// The codes of one quarter of a record (512 bytes: 16 rows x 64 inputs) unpacked into the B
// operands of its two sub-blocks: low nibbles at buf, high nibbles at buf + 512.
inline void unpack_quarter(const uint8_t* q, uint8_t* buf) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int g = 0; g < 8; ++g) {
    const __m512i v = _mm512_load_si512(q + 64 * g);
    _mm512_store_si512(buf + 64 * g, _mm512_and_si512(v, nibble));
    _mm512_store_si512(buf + 512 + 64 * g, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
  }
}

// Up to kPairedRows rows: both sub-blocks of a block in one tile multiply. The A tile holds
// 2R rows, row 2m the activations of row m over the block's first 32 inputs then 32 zeros, row
// 2m + 1 32 zeros then its last 32 (made once per call: paired_activations); the B tile is the
// block's 64 inputs (both unpacked halves, as unpack_quarter lays them out: 16 groups). So C row
// 2m is S_j0 of row m and row 2m + 1 its S_j1: one zeroing, two tile loads, one multiply and one
// store per block, where the halves (more rows) take two of each. The tile operations cost by the
// rows they move, so pairing halves them at few rows and gives little at 8 (the figures: this file's
// top).
constexpr int kPairedRows = 8;

// Paired: A (2R rows x 64 activation bytes) tiles 2, 3, B (16 groups x 64 bytes) tiles 4, 5 and C
// (2R rows x 16 int32) tiles 0, 1, for even and odd blocks.
inline void configure_paired_tiles(int rows) {
  const TileShape c{2 * rows, 64}, a{2 * rows, 64}, b{16, 64}, none{0, 0};
  configure_tiles({c, c, a, a, b, b, none, none});
}

// x's rows [row0, row0 + rows) paired as the A tiles take them: block b's 2 rows x 64 bytes at
// out + 128 rows b.
void paired_activations(const W8A8Args& a, int64_t row0, int rows, int8_t* out) {
  const int64_t nblk = a.K / 64;
  for (int64_t b = 0; b < nblk; ++b)
    for (int m = 0; m < rows; ++m) {
      const int8_t* x = a.xq + (row0 + m) * a.K + 64 * b;
      int8_t* o = out + (b * rows + m) * 128;
      std::memcpy(o, x, 32);
      std::memset(o + 32, 0, 64);
      std::memcpy(o + 96, x + 32, 32);
    }
}

// Block b's multiplies from zero, against its unpacked codes at buf. Halves: activations of its
// two sub-blocks (A tiles 4, 5 from x itself) into C tiles C0, C1; paired: into C tile C.
#define VS_HALVES(C0, C1, buf, b)                  \
  _tile_zero(C0);                                  \
  _tile_zero(C1);                                  \
  VS_TILE_LOADD(4, x + 64 * (b), a.K);             \
  VS_TILE_LOADD(6, (buf), 64);                     \
  _tile_dpbsud(C0, 4, 6);                          \
  VS_TILE_LOADD(5, x + 64 * (b) + 32, a.K);        \
  VS_TILE_LOADD(7, (buf) + 512, 64);               \
  _tile_dpbsud(C1, 5, 7);
#define VS_STORE_HALVES(C0, C1, b)                         \
  _tile_stored(C0, sums[(b) & (kSlots - 1)], 64);          \
  _tile_stored(C1, sums[(b) & (kSlots - 1)] + 16 * R, 64);
#define VS_PAIRED(C, A, B, buf, b)                \
  _tile_zero(C);                                  \
  VS_TILE_LOADD(A, x + 128 * R * (b), 64);        \
  VS_TILE_LOADD(B, (buf), 64);                    \
  _tile_dpbsud(C, A, B);
#define VS_STORE_PAIRED(C, b) _tile_stored(C, sums[(b) & (kSlots - 1)], 64);

// AMX: rows row0 .. row0 + R (the rows the tiles are configured with) against row block nb; x:
// their activations, a.xq's rows (halves) or paired_activations' (Paired, R <= kPairedRows).
// Block b (record b / 4, quarter b % 4) is multiplied on the even block's C tiles or the odd
// one's; its sums are stored while block b + 1 multiplies, and added to t kDrainLag blocks later,
// in block order. A record's codes are unpacked while the one before it is multiplied.
template <int R, bool Paired>
void tile_rows(const W8A8Args& a, const int8_t* x, int64_t nb, int64_t row0) {
  static_assert(!Paired || R <= kPairedRows, "paired rows: 2R rows of a tile");
  alignas(64) uint8_t codes[2][4 * 1024];    // unpacked codes of two records: this one, the next
  alignas(64) int32_t sums[kSlots][2 * R * 16];  // C tiles stored: the ring
  SubScales s[2];                                // of this record and the one before
  // records of the row block: whole ones, then a half one when K % 256 = 128 (common.h)
  const int64_t records = (a.K + kQ4KSuper - 1) / kQ4KSuper, nblk = a.K / 64;  // nblk: even
  const uint8_t* rec0 = a.w + nb * q4k_row_block_bytes(a.K);
  __m512 t[R];
  for (int m = 0; m < R; ++m) t[m] = _mm512_setzero_ps();
  auto drain = [&](int64_t b) {
    const SubScales& ss = s[(b >> 2) & 1];
    const int32_t* c = sums[b & (kSlots - 1)];
    for (int m = 0; m < R; ++m) {  // (S_j0, S_j1 of row m: C rows 2m, 2m + 1, or row m of each half)
      const int32_t* s0 = Paired ? c + 32 * m : c + 16 * m;
      const int32_t* s1 = Paired ? s0 + 16 : s0 + 16 * R;
      t[m] = add_pair(a, ss, static_cast<int>(b & 3), row0 + m, b, _mm512_load_si512(s0), _mm512_load_si512(s1), t[m]);
    }
  };
  for (int i = 0; i < q4k_quarters(a.K, 0); ++i) unpack_quarter(rec0 + kQ4KHeader + 512 * i, codes[0] + 1024 * i);
  for (int64_t sb = 0; sb < records; ++sb) {
    const uint8_t* rec = rec0 + sb * kQ4KRecord;
    decode_scales(rec, s[sb & 1]);  // (over record sb - 2's, whose last block was drained in sb - 1)
    const uint8_t* here = codes[sb & 1];
    uint8_t* next = codes[(sb & 1) ^ 1];
    const int quarters = q4k_quarters(a.K, sb), next_quarters = sb + 1 < records ? q4k_quarters(a.K, sb + 1) : 0;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if (i == quarters) break;
      // (prefetches never fault: past the row block they fetch the next one, which comes next anyway)
      for (int line = 576 * i; line < 576 * (i + 1); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kRecordsAhead * kQ4KRecord + line), _MM_HINT_T1);
      const int64_t b = 4 * sb + i;
      const uint8_t* buf = here + 1024 * i;
      if constexpr (Paired) {
        if (b + kPairedAhead < nblk)
          for (int line = 0; line < 2 * R; ++line)
            _mm_prefetch(reinterpret_cast<const char*>(x + 128 * R * (b + kPairedAhead) + 64 * line), _MM_HINT_T0);
        if (i % 2 == 0) {
          VS_PAIRED(0, 2, 4, buf, b)
          if (b > 0) {
            VS_STORE_PAIRED(1, b - 1)
          }
        } else {
          VS_PAIRED(1, 3, 5, buf, b)
          VS_STORE_PAIRED(0, b - 1)
        }
      } else {
        if (i % 2 == 0) {
          VS_HALVES(0, 1, buf, b)
          if (b > 0) {
            VS_STORE_HALVES(2, 3, b - 1)
          }
        } else {
          VS_HALVES(2, 3, buf, b)
          VS_STORE_HALVES(0, 1, b - 1)
        }
      }
      if (b - 1 - kDrainLag >= 0) drain(b - 1 - kDrainLag);
      if (i < next_quarters) unpack_quarter(rec + kQ4KRecord + kQ4KHeader + 512 * i, next + 1024 * i);
    }
  }
  // (the last block is odd: K is a multiple of 128)
  if constexpr (Paired) {
    VS_STORE_PAIRED(1, nblk - 1)
  } else {
    VS_STORE_HALVES(2, 3, nblk - 1)
  }
  for (int64_t b = std::max<int64_t>(0, nblk - 1 - kDrainLag); b < nblk; ++b) drain(b);
  for (int m = 0; m < R; ++m) finish_row(a, nb, row0 + m, t[m]);
}
#undef VS_HALVES
#undef VS_STORE_HALVES
#undef VS_PAIRED
#undef VS_STORE_PAIRED

using RowsFn = void (*)(const W8A8Args&, const int8_t*, int64_t, int64_t);
constexpr auto kHalvesFns = rows_table<16>([](auto r) { return &tile_rows<decltype(r)::value, false>; });
constexpr auto kPairedFns = rows_table<kPairedRows>([](auto r) { return &tile_rows<decltype(r)::value, true>; });

}  // namespace

// Every row, 16 at a time (then the rest) over the same row block, whose records are then in L2:
// one tile configuration per chunk size; a rest of up to kPairedRows rows paired.
void q4k_linear_amx(const W8A8Args& a, int64_t begin, int64_t end) {
  const int64_t full = a.M / kRows, rest = a.M % kRows;
  if (full) {
    configure_q4k_tiles(kRows);
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t c = 0; c < full; ++c) tile_rows<kRows, false>(a, a.xq + c * kRows * a.K, nb, c * kRows);
  }
  if (rest && rest <= kPairedRows) {
    static thread_local std::vector<int8_t> paired;  // (this thread's: at most 16 x K bytes)
    paired.resize(static_cast<size_t>(a.K * 2 * rest));
    paired_activations(a, full * kRows, static_cast<int>(rest), paired.data());
    configure_paired_tiles(static_cast<int>(rest));
    const RowsFn tail = pick_rows(kPairedFns, rest);
    for (int64_t nb = begin; nb < end; ++nb) tail(a, paired.data(), nb, full * kRows);
  } else if (rest) {
    configure_q4k_tiles(static_cast<int>(rest));
    const RowsFn tail = pick_rows(kHalvesFns, rest);
    for (int64_t nb = begin; nb < end; ++nb) tail(a, a.xq + full * kRows * a.K, nb, full * kRows);
  }
  _tile_release();
}

}  // namespace verispec
