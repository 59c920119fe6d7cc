// The projections of the avx512bf16, avx512, avx2, neon and portable tiers (and the few-row int8 /
// Q4_K calls of the amx tier), written once over vec.h's 16-lane types: the same packed weights and
// the same arithmetic as the amx tier's tiles (amx/*.cpp document the layouts):
//
//   int8   per activation block b (64 inputs): acc = sum p q (int32, exact), then in fp32
//          t = t + float(acc) * scale_x[b], finally y = t * scale_w + bias (every step rounded)
//   Q4_K   per block b: S_j = sum p q_j (exact), then u = fma(S_1, ds_1, S_0 * ds_0),
//          t = fnma(a_1, dm_1, fnma(a_0, dm_0, fma(u, scale_x[b], t))) with a_j = P_j * scale_x[b],
//          finally y = t + bias
//   bf16   one fp32 sum per output, from 0, adding w[n][k] * x[m][k] for k = 0, 1, ..., K - 1 in
//          order with one rounding each (an FMA; the product of two bf16 is exact in fp32), then
//          + bias and one rounding to bf16 when the output is bf16; on avx512bf16 the inputs go
//          by pairs, k = 1, 0, 3, 2, ..., each still one FMA, with denormals as zero (VDPBF16PS)
//
// Q6_K's arithmetic is common.h's (exact integers per block, one fp32 step each).
//
// So int8 and Q4_K give the same bits on every tier, amx included (integer sums are exact in any
// order and the fp32 steps are these), and bf16 gives the same bits on avx512, avx2, neon and portable;
// the avx512bf16 tier's bf16 adds in VDPBF16PS's pairs (dots.h) and the amx tier's in TDPBF16PS's
// order (amx/bf16.cpp), each differing from these by fp32 rounding. Each row's result depends on
// that row alone: an M-row call equals M one-row calls bit for bit on every tier.
//
// Cost: each 16-row weight block is read once per call and multiplied into kChunk (int8, Q4_K)
// or a tiling's rows (bf16) activation rows at a time, the next chunk reading it again from L1/L2, so
// a pass over 1 to 16 rows is memory-bound until the multiplies catch up.
#include <algorithm>

#include "common.h"
#include "dots.h"
#include "q4k_scales.h"

namespace verispec {
namespace {
using namespace vec;

// Tilings of the bf16 kernel: G weight blocks x R activation rows of accumulators in registers,
// one for calls of few rows (several weight streams in flight) and one for more rows (fewer
// splits of each weight pair per multiply), and how far ahead of its reads each weight stream
// prefetches. The sums are the same whatever the tiling: a lane's chain of FMAs over k does not
// depend on G or R.
//
// Prefetch distance: with several activation rows per weight line, 1 KB ahead was less than a memory
// read early: an 8-row pass over a [8960 x 1536] bf16 matrix took 1.03 ms with 1 KB and 0.64-0.66 ms
// with 4 KB (2 KB 0.69, 6 KB 0.68-0.73, 8 KB 0.73; avx2 tier, 4 and 8 rows: 0.99 / 1.56 -> 0.70 /
// 1.30 ms; benchmarks/kernel_stream.py --kinds bf16, 2 threads, Zen 5). What counts is the whole pass
// (benchmarks/kernels_ab.py, the 1.5B in bf16, Zen 5): avx512's few-row tiling, four streams, keeps
// 1 KB (4 KB made T = 1 and 2 5-6% slower), its many-row one takes 4 KB (1 KB made T = 5 21%
// slower); the avx2 tier's two-stream few-row tiling takes 4 KB too (1 KB: T = 1 and 2 8% slower).
struct Tiling {
  int blocks, rows, prefetch_bytes;
};
#if VS_VEC_AVX512
constexpr int kChunk = 8;  // activation rows per pass over a weight block (int8, Q4_K)
#if VS_VEC_DPBF16
// VDPBF16PS needs no widened weight pairs: 3 x 8 accumulators, 3 lines and a broadcast fit the 32
// registers (an 8-row [8960 x 1536] bf16 matrix: 0.71-0.91 ms with 3 blocks, 0.92-0.97 with 2,
// 1.20-1.29 for the FMA tile; benchmarks/kernel_stream.py --kinds bf16, 2 threads, Zen 4)
constexpr Tiling kFewRows{4, 4, 1024}, kManyRows{3, 8, 4096};
#else
constexpr Tiling kFewRows{4, 4, 1024}, kManyRows{2, 8, 4096};  // 16 or 32 vector registers
#endif
#elif VS_VEC_AVX2
// Plain AVX2 takes 8 rows a chunk: with 4, a fifth row was a chunk of its own, splitting every Q4_K
// record again for one row (whole 1.5B passes, new / old: int4 T = 5 0.85, T = 8 0.93; int8 T = 5
// 0.87; benchmarks/kernels_ab.py, avx2 tier forced on Zen 5). The avx2vnni kernels keep 4: their
// accumulators for 8 rows would not fit in 16 registers.
#if defined(__AVXVNNI__)
constexpr int kChunk = 4;
#else
constexpr int kChunk = 8;
#endif
constexpr Tiling kFewRows{2, 2, 4096}, kManyRows{1, 4, 4096};  // 16 registers: (2 x 2 spills a little, but streams two)
#else  // NEON (32 registers of 4 lanes: an F16 takes 4) and plain C++ (distances not measured there)
constexpr int kChunk = 4;
constexpr Tiling kFewRows{1, 4, 1024}, kManyRows{1, 4, 1024};
#endif
constexpr int kBf16Blocks = kFewRows.blocks > kManyRows.blocks ? kFewRows.blocks : kManyRows.blocks;
constexpr int kBf16Rows = kFewRows.rows > kManyRows.rows ? kFewRows.rows : kManyRows.rows;

inline int valid_columns(int64_t n, int64_t nb) { return static_cast<int>(std::min<int64_t>(n - nb * kRows, kRows)); }

// ------------------------------------------------------------------------------------ int8

template <int R>
void int8_rows(const W8A8Args& a, int64_t nb, int64_t row0) {
  const int64_t groups = a.K / 4, nblk = (a.K + 63) / 64, halves = a.K / 32;
  const uint8_t* blk = a.w + nb * groups * 64;
  // this chunk's rows, interleaved (common.h): word g of row m at xw[g * R + m], and so on
  const int32_t* xw = a.xq_rows + row0 * groups;
  const float* xs = a.xscale_rows + row0 * nblk;
  const int32_t* sums = a.xsum_rows + row0 * halves;
  F16 t[R];
  for (int m = 0; m < R; ++m) t[m] = zero();
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t g0 = 16 * b, g1 = std::min<int64_t>(g0 + 16, groups);
    int32_t psum[R];
    I16 s[R];
    for (int m = 0; m < R; ++m) {
      psum[m] = 2 * b + 1 < halves ? sums[2 * b * R + m] + sums[(2 * b + 1) * R + m] : sums[2 * b * R + m];
      s[m] = izero();
    }
    int8_groups<R>(blk + g0 * 64, g1 - g0, xw + g0 * R, psum, s);
    for (int m = 0; m < R; ++m) t[m] = add(t[m], mul(to_float(s[m]), set1(xs[b * R + m])));
  }
  const int64_t n0 = nb * kRows;
  const int nv = valid_columns(a.N, nb);
  const F16 ws = load(a.wscale + n0);  // scales are padded to a multiple of 16
  for (int m = 0; m < R; ++m)
    store_columns(a.y, a.out_bf16, (row0 + m) * a.N + n0, plus_bias(a.bias, n0, nv, mul(t[m], ws)), nv);
}

// ------------------------------------------------------------------------------------ Q4_K

// The bytes of the weight stream each quarter of a record covers (its prefetch span below): 576 (9
// lines) in a whole record, 640 (10) in a half one (the header's share is larger there).
template <int Q>
constexpr int kQuarterSpan = (Q == 4 ? kQ4KRecord : kQ4KHalfRecord) / Q;
static_assert(kQuarterSpan<4> % 64 == 0 && kQuarterSpan<2> % 64 == 0, "a quarter's span is whole lines");

// t[m] + the terms of record rec's Q quarters (4, or 2 in a half record: common.h) for the chunk's
// R rows; b0: the record's first 64-input block. (Q a constant, so that the whole-record body
// compiles as it did before half records.)
template <int R, int Q>
inline __attribute__((always_inline)) void q4k_record(const uint8_t* rec, int64_t b0, const int32_t* xw,
                                                      const float* xs, const float* mins, SubScales& s, F16* t) {
  decode_scales(rec, s);
#pragma GCC unroll 4
  for (int i = 0; i < Q; ++i) {
    // The stream kQ4KPrefetchAhead bytes ahead (dots.h: two whole records, half of one on the
    // Intel tiers), a quarter's span (9 lines) before each quarter of this record (dots.h's
    // kPrefetchLocality): all 36 lines at once at the record's start held the
    // load pipe while they missed, which cost the many-row calls their multiplies (Zen 4, [8960 x
    // 1536], 2 threads: 8 rows 0.66 -> 0.41 ms, 4 rows 0.36 -> 0.27 ms, one row the same;
    // benchmarks/kernel_stream.py). Prefetches never fault: past the row block they fetch the
    // next one, which comes next anyway.
    for (int line = i * kQuarterSpan<Q>; line < (i + 1) * kQuarterSpan<Q>; line += 64)
      __builtin_prefetch(rec + kQ4KPrefetchAhead + line, 0, kPrefetchLocality);
    const int64_t b = b0 + i;
    I16 s0[R], s1[R];
    q4k_pair<R>(rec + kQ4KHeader + 512 * i, xw + 16 * b * R, s0, s1);
    for (int m = 0; m < R; ++m)
      t[m] = q4k_add_pair(s, i, xs[b * R + m], mins[2 * b * R + m], mins[(2 * b + 1) * R + m], s0[m], s1[m], t[m]);
  }
}

template <int R>
void q4k_rows(const W8A8Args& a, int64_t nb, int64_t row0) {
  const int64_t whole = a.K / kQ4KSuper, nblk = a.K / 64, halves = a.K / 32;
  const uint8_t* rec = a.w + nb * q4k_row_block_bytes(a.K);
  // this chunk's rows, interleaved (common.h): word g of row m at xw[g * R + m], and so on
  const int32_t* xw = a.xq_rows + row0 * (a.K / 4);
  const float* xs = a.xscale_rows + row0 * nblk;
  const float* mins = a.xmin_rows + row0 * halves;
  F16 t[R];
  for (int m = 0; m < R; ++m) t[m] = zero();
  SubScales s;
  for (int64_t sb = 0; sb < whole; ++sb, rec += kQ4KRecord) q4k_record<R, 4>(rec, 4 * sb, xw, xs, mins, s, t);
  if (a.K % kQ4KSuper) q4k_record<R, 2>(rec, 4 * whole, xw, xs, mins, s, t);  // the last 128 inputs: a half record
  const int64_t n0 = nb * kRows;
  const int nv = valid_columns(a.N, nb);
  for (int m = 0; m < R; ++m) store_columns(a.y, a.out_bf16, (row0 + m) * a.N + n0, plus_bias(a.bias, n0, nv, t[m]), nv);
}

// ------------------------------------------------------------------------------------ Q6_K

// The 4 code groups (64 bytes each: byte 4r + c the 6-bit code of row r, input c of the group) of
// sub-block S (inputs 16 S .. 16 S + 15) of a quarter's codes at q (common.h's Q6_K record): the
// low 4 bits from nibble group (4 S + g) mod 8 (the high nibbles for S >= 2), the top 2 from bits
// 2 S, 2 S + 1 of high group g, moved to bits 4-5. (Shifts of 32-bit lanes: the masks keep each
// byte's own bits.)
template <int S>
inline __attribute__((always_inline)) void q6k_codes(const uint8_t* q, I16 (&code)[4]) {
  const I16 low = iset1(0x0F0F0F0F), top = iset1(0x30303030);
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const I16 nib = iload(q + 64 * ((4 * S + g) & 7)), hb = iload(q + 512 + 64 * g);
    I16 hi;
    if constexpr (S == 0)
      hi = ishl<4>(hb);
    else if constexpr (S == 1)
      hi = ishl<2>(hb);
    else if constexpr (S == 2)
      hi = hb;
    else
      hi = ishr<2>(hb);
    code[g] = bitselect(low, S >= 2 ? ishr<4>(nib) : nib, iand(hi, top));  // low bits of the nibble, bits 4-5 of hi
  }
}

// acc[m] += sc_S * (sum of row m's codes x activations over sub-block S - 32 P16) for the chunk's R
// rows; xw: the words of the quarter's first input (16 per quarter, 4 per sub-block), p16: 32 x the
// chunk's 16-input sums from the quarter's first sub-block (premultiplied: one broadcast operand).
template <int R, int S>
inline __attribute__((always_inline)) void q6k_subblock(const uint8_t* q, I16 sc, const int32_t* xw, const int32_t* p16,
                                                        I16* acc) {
  I16 code[4];
  q6k_codes<S>(q, code);
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m)
    acc[m] = iadd(acc[m], imul(isub(u6_dot<R>(code, xw + 4 * S * R, m), iset1(p16[S * R + m])), sc));
}

template <int R>
void q6k_rows(const W8A8Args& a, int64_t nb, int64_t row0) {
  const int64_t nsb = a.K / 256, nblk = a.K / 64;
  const uint8_t* rec = a.w + nb * nsb * kQ6KRecord;
  // this chunk's rows, interleaved (common.h): word g of row m at xw[g * R + m], and so on
  const int32_t* xw = a.xq_rows + row0 * (a.K / 4);
  const float* xs = a.xscale_rows + row0 * nblk;
  const int32_t* p16 = a.xsum16_rows + row0 * (a.K / 16);
  F16 t[R];
  for (int m = 0; m < R; ++m) t[m] = zero();
  for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ6KRecord) {
    const F16 d = half16(reinterpret_cast<const uint16_t*>(rec));
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      // the stream two records ahead, a quarter of a record (14 lines) before each quarter
      for (int line = 896 * i; line < 896 * (i + 1); line += 64)
        __builtin_prefetch(rec + 2 * kQ6KRecord + line, 0, kPrefetchLocality);
      __asm__ volatile("" ::: "memory");  // (keeps the compiler from issuing every quarter's at once)
      const int64_t b = 4 * sb + i;
      const uint8_t* q = rec + kQ6KHeader + kQ6KQuarter * i;
      const int8_t* sc = reinterpret_cast<const int8_t*>(rec + 64 + 64 * i);  // scales of sub-blocks 4i .. 4i + 3
      const int32_t* w = xw + 16 * b * R;
      const int32_t* p = p16 + 4 * b * R;
      I16 acc[R];
      for (int m = 0; m < R; ++m) acc[m] = izero();
      q6k_subblock<R, 0>(q, iload_i8(sc), w, p, acc);
      q6k_subblock<R, 1>(q, iload_i8(sc + 16), w, p, acc);
      q6k_subblock<R, 2>(q, iload_i8(sc + 32), w, p, acc);
      q6k_subblock<R, 3>(q, iload_i8(sc + 48), w, p, acc);
      // (the block's scale times d, then one fused step: no second accumulator per row)
      for (int m = 0; m < R; ++m) t[m] = fma(to_float(acc[m]), mul(set1(xs[b * R + m]), d), t[m]);
    }
  }
  const int64_t n0 = nb * kRows;
  const int nv = valid_columns(a.N, nb);
  for (int m = 0; m < R; ++m) store_columns(a.y, a.out_bf16, (row0 + m) * a.N + n0, plus_bias(a.bias, n0, nv, t[m]), nv);
}

using RowsFn = void (*)(const W8A8Args&, int64_t, int64_t);
constexpr auto kInt8Fns = rows_table<kChunk>([](auto r) { return &int8_rows<decltype(r)::value>; });
constexpr auto kQ4KFns = rows_table<kChunk>([](auto r) { return &q4k_rows<decltype(r)::value>; });
constexpr auto kQ6KFns = rows_table<kChunk>([](auto r) { return &q6k_rows<decltype(r)::value>; });

// Every row, kChunk at a time (then the rest) over the same weight block.
template <typename Table>
void by_chunks(const W8A8Args& a, int64_t begin, int64_t end, const Table& fns) {
  const int64_t full = a.M / kChunk, rest = a.M % kChunk;
  const RowsFn body = pick_rows(fns, kChunk), tail = pick_rows(fns, rest);
  for (int64_t nb = begin; nb < end; ++nb) {
    for (int64_t c = 0; c < full; ++c) body(a, nb, c * kChunk);
    if (tail) tail(a, nb, full * kChunk);
  }
}

// ------------------------------------------------------------------------------------ bf16

// A bf16 tile's sums, G weight blocks from nb x R activation rows from row0: + bias, stored.
template <int G, int R>
inline void store_bf16_tile(const Bf16Args& a, int64_t nb, int64_t row0, const F16 (&acc)[G][R]) {
  for (int j = 0; j < G; ++j) {
    const int64_t n0 = (nb + j) * kRows;
    const int nv = valid_columns(a.N, nb + j);
    for (int m = 0; m < R; ++m)
      store_columns(a.y, a.out_bf16, (row0 + m) * a.N + n0, plus_bias(a.bias, n0, nv, acc[j][m]), nv);
  }
}

// G weight blocks from nb times the R activation rows from row0, each weight stream prefetched
// `ahead` values ahead.
template <int G, int R>
void bf16_tile(const Bf16Args& a, int64_t nb, int64_t row0, int64_t ahead) {
  const int64_t pairs = a.K / 2, block = a.K * kRows;  // bf16 values per packed block
  const uint16_t* w = a.w + nb * block;
  const float* x[R];  // (fp32: a broadcast is then one load)
  F16 acc[G][R];
  for (int m = 0; m < R; ++m) {
    x[m] = a.xf + (row0 + m) * a.K;
    for (int j = 0; j < G; ++j) acc[j][m] = zero();
  }
  for (int64_t g = 0; g < pairs; ++g) {
    F16 even[G], odd[G];
    for (int j = 0; j < G; ++j) {
      const uint16_t* p = w + j * block + g * 32;  // one 64-byte line per group
      __builtin_prefetch(p + ahead, 0, kPrefetchLocality);
      load_bf16_pairs(p, even[j], odd[j]);
    }
    for (int m = 0; m < R; ++m) {
      const F16 xe = set1(x[m][2 * g]), xo = set1(x[m][2 * g + 1]);
      for (int j = 0; j < G; ++j) {
        acc[j][m] = fma(even[j], xe, acc[j][m]);
        acc[j][m] = fma(odd[j], xo, acc[j][m]);
      }
    }
  }
  store_bf16_tile(a, nb, row0, acc);
}

#if VS_VEC_DPBF16
// The avx512bf16 tier's tile: the same tilings, the weight lines multiplied as they lie in memory
// (16 lanes of (even, odd) input pairs: VDPBF16PS's operand) by each row's activation pair, so an
// input pair costs one multiply per weight block and row where the FMA tile above takes two and
// widens the weights first. Its sums add each pair's odd product before its even one and count
// denormals as zero (dots.h), so its bits differ from the tile above by fp32 rounding.
template <int G, int R>
void bf16_pairs_tile(const Bf16Args& a, int64_t nb, int64_t row0, int64_t ahead) {
  const int64_t pairs = a.K / 2, block = a.K * kRows;  // bf16 values per packed block
  const uint16_t* w = a.w + nb * block;
  const uint16_t* x[R];
  F16 acc[G][R];
  for (int m = 0; m < R; ++m) {
    x[m] = a.x + (row0 + m) * a.K;
    for (int j = 0; j < G; ++j) acc[j][m] = zero();
  }
  for (int64_t g = 0; g < pairs; ++g) {
    __m512i line[G];
    for (int j = 0; j < G; ++j) {
      const uint16_t* p = w + j * block + g * 32;  // one 64-byte line per group
      __builtin_prefetch(p + ahead, 0, kPrefetchLocality);
      line[j] = _mm512_loadu_si512(p);
    }
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < G; ++j) acc[j][m].v = dpbf16_bcast(acc[j][m].v, line[j], x[m] + 2 * g);
  }
  store_bf16_tile(a, nb, row0, acc);
}
#endif

using Bf16Fn = void (*)(const Bf16Args&, int64_t, int64_t, int64_t);
#if VS_VEC_DPBF16
template <int G, int R>
constexpr Bf16Fn kBf16Tile = &bf16_pairs_tile<G, R>;
#else
template <int G, int R>
constexpr Bf16Fn kBf16Tile = &bf16_tile<G, R>;
#endif
constexpr auto kBf16Fns = rows_table<kBf16Blocks>([](auto g) {
  return rows_table<kBf16Rows>([](auto r) { return kBf16Tile<decltype(g)::value, decltype(r)::value>; });
});

}  // namespace

int vector_chunk_rows() { return kChunk; }

void w8a8_linear_vec(const W8A8Args& a, int64_t begin, int64_t end) { by_chunks(a, begin, end, kInt8Fns); }

void q4k_linear_vec(const W8A8Args& a, int64_t begin, int64_t end) { by_chunks(a, begin, end, kQ4KFns); }

void q6k_linear_vec(const W8A8Args& a, int64_t begin, int64_t end) { by_chunks(a, begin, end, kQ6KFns); }

void bf16_linear_vec(const Bf16Args& a, int64_t begin, int64_t end) {
  const Tiling tile = a.M <= kFewRows.rows ? kFewRows : kManyRows;
  for (int64_t nb = begin; nb < end; nb += tile.blocks) {
    const int g = static_cast<int>(std::min<int64_t>(end - nb, tile.blocks));
    for (int64_t row0 = 0; row0 < a.M; row0 += tile.rows) {
      const int r = static_cast<int>(std::min<int64_t>(a.M - row0, tile.rows));
      kBf16Fns[g - 1][r - 1](a, nb, row0, tile.prefetch_bytes / 2);
    }
  }
}

}  // namespace verispec
