// W8A8: per-output-channel int8 weights times activations quantised to int8 in blocks of 64
// inputs, with exact integer dot products, as llama.cpp does with its Q8 activations.
//
//   weights      w[n][k] = scale_w[n] * q[n][k],  q int8 (-128..127), scale_w fp32
//   activations  x (fp32, or bf16 widened exactly) in blocks b of 64 inputs per row (the last one
//                32 when K % 64 == 32): amax = max |x[m][k]| over the block,
//                scale_x[m][b] = amax / 127,  inv = 127 / amax (fp32 divisions; 0 when amax = 0),
//                p[m][k] = round_half_even(x[m][k] * inv) clamped to -127..127
//   result       acc[m][b][n] = sum_{k in b} p[m][k] q[n][k]          (int32, exact)
//                t = 0; for b = 0, 1, ...: t = t + float(acc[m][b][n]) * scale_x[m][b]
//                y[m][n] = (t * scale_w[n]) + bias[n]       (fp32, every step rounded, no FMA)
// Blocks of 64 rather than one scale per row: Qwen's activations have outlier channels, and a
// per-row scale spends the 8 bits on them (Qwen2.5-Coder 0.5B / 1.5B in int8, mean KL of the
// next-token distribution to bf16's over 420 positions of 4 HumanEval prompts: 0.016 / 0.033
// with a scale per row, 0.0023 / 0.0024 in blocks of 64, 0.0015 / 0.0013 with bf16 activations).
//
// The products are unsigned x signed bytes (VPDPBUSD, TDPBSUD), so the weights are stored offset
// to unsigned, u = q + 128 (0..255), and the activations stay signed: the instructions give
// sum u p = acc + 128 * sum p, and the second term (one integer per row and block, computed with
// the quantisation) is subtracted. No step saturates (|sum| <= 64 * 255 * 127 per block).
//
// Two engines run the same arithmetic on the same packed weights:
//   - vectors for up to kW8A8VectorRows activation rows (vec/linear.cpp; on this tier VPDPBUSD):
//     each 64-byte weight load feeds one VPDPBUSD per row, whose signed operand is a 4-byte
//     broadcast straight from the quantised row. At one to five rows this keeps up with memory;
//     with more rows it becomes compute-bound (one VPDPBUSD per 64 weights and row),
//   - AMX (TDPBSUD, this file) for more rows: the 16 groups of a block (64 inputs) are one int8 B tile as they
//     lie in memory, so one tile load and one tile multiply cover 1024 weights for up to 16 rows.
// Integer sums are exact in any order and the float steps are the same code in the same order
// for every row, so both engines give the same bits, and an M-row call equals M one-row calls bit
// for bit, whichever engine runs.
//
// Packed layout: blocks of 16 weight rows, row-block major; within a block, one 64-byte group per
// 4 inputs: byte 4r + j of group g is u[16 nb + r][4g + j]. A group is one VPDPBUSD operand (lane
// r = output column 16 nb + r); 16 consecutive groups are one AMX B tile (16 rows of 64 bytes).
// Rows past N hold q = 0 (u = 128) and their outputs are never written.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "amx.h"

namespace verispec {

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

namespace {

constexpr int kGroup = 64;               // bytes per group of 4 inputs x 16 rows
constexpr int kStepBytes = 16 * kGroup;  // one AMX B tile: 64 inputs x 16 rows
// How far ahead of its loads the tile kernel prefetches the weight stream: [8960 x 1536] at 8 rows,
// 0.516 ms per matrix with 1 KiB, 0.522 with 512 B, 0.526-0.531 with 1.5-2 KiB, 0.568 with 4 KiB
// (benchmarks/kernel_stream.py --kinds int8-amx, 2 threads, Intel Xeon with AMX).
constexpr int kPrefetchBytes = 1024;

inline int64_t blocks_of(int64_t k) { return (k + kW8A8Block - 1) / kW8A8Block; }

// 128 * sum p of activation row `row`, block b (see the top): what the offset weights add.
inline int32_t block_offset(const W8A8Args& a, int64_t row, int64_t b) {
  const int64_t halves = a.K / 32;
  const int32_t* sums = a.xsum + row * halves + 2 * b;
  return 128 * (2 * b + 1 < halves ? sums[0] + sums[1] : sums[0]);
}

// t + float(s - offset) * scale_x of activation row `row`, block b, offset its block_offset.
inline __m512 add_block(const W8A8Args& a, int64_t row, int64_t b, int32_t offset, __m512i s, __m512 t) {
  s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset));
  return _mm512_add_ps(t, _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a.xscale[row * blocks_of(a.K) + b])));
}

// y of block nb's 16 output columns for one activation row, from its sum t.
inline void finish_row(const W8A8Args& a, int64_t nb, int64_t row, __m512 t) {
  const int64_t n0 = nb * kRows;
  const int n_valid = static_cast<int>(std::min<int64_t>(a.N - n0, kRows));
  const __m512 v = _mm512_mul_ps(t, _mm512_loadu_ps(a.wscale + n0));  // scales padded to a multiple of 16
  store_columns(a.y, a.out_bf16, row * a.N + n0, vec::plus_bias(a.bias, n0, n_valid, vec::F16{v}).v, n_valid);
}

using RowsFn = void (*)(const W8A8Args&, const int32_t*, int64_t, int64_t);

// AMX tiles: tmm0, tmm1 C (rows x 16 int32) of even and odd steps, tmm4, tmm5 A (rows x 64
// activation bytes) of the same, tmm6, tmm7 B (16 groups x 64 weight bytes); tmm2, tmm3 unused.
// TDPBSUD C += A . B: signed A, unsigned B.
inline void configure_int8_tiles(int rows) {
  const TileShape c{rows, 64}, a{rows, 64}, b{kRows, 64}, none{0, 0};
  configure_tiles({c, c, none, none, a, a, b, b});
}

// How many steps behind its multiply a step's sums are read back, and the slots of sums in flight:
// a step's sums are stored while the next step multiplies and added to the rows' totals kDrainLag
// steps later, as amx/q4k.cpp does. Here a lag of 1, 2 or 4 steps costs the same; with it, the
// offsets made once per call and the prefetch distance above, 8 rows of [8960 x 1536] take
// 0.51-0.52 ms instead of 0.62 when each pair of steps' sums was read back right after its stores
// (benchmarks/kernel_stream.py --kinds int8-amx, Intel Xeon with AMX).
constexpr int kDrainLag = 2;
constexpr int kSlots = 4;  // > kDrainLag + 1, a power of two
static_assert(kSlots > kDrainLag + 1 && (kSlots & (kSlots - 1)) == 0, "ring of sums");

// Step s (64 inputs: one activation block) into C tile C from zero, with A tile A and B tile B.
#define VS_STEP(C, A, B, s)                         \
  _tile_zero(C);                                    \
  VS_TILE_LOADD(A, xc + (s) * 64, a.K);             \
  VS_TILE_LOADD(B, blk + (s) * kStepBytes, 64);     \
  _tile_dpbsud(C, A, B);

// AMX: block nb for the R rows from row0 (the rows the tiles are configured with). A tile step
// (64 inputs) is one activation block: even steps run on C tile 0, odd ones on 1; a step's sums
// are stored while the next step multiplies and added to the row sums kDrainLag steps later, in
// step order.
// offsets: block_offset of every row and whole step, step major ([steps][M]), made once per call.
template <int R>
void amx_rows(const W8A8Args& a, const int32_t* offsets, int64_t nb, int64_t row0) {
  alignas(64) int32_t sums[kSlots][R * 16];
  __m512 t[R];
  for (int m = 0; m < R; ++m) t[m] = _mm512_setzero_ps();
  const int64_t steps = a.K / 64;
  const uint8_t* blk = a.w + nb * (a.K / 4) * kGroup;
  const int8_t* xc = a.xq + row0 * a.K;
  auto drain = [&](int64_t s) {
    const int32_t* c = sums[s & (kSlots - 1)];
    const int32_t* off = offsets + s * a.M + row0;
    for (int m = 0; m < R; ++m) t[m] = add_block(a, row0 + m, s, off[m], _mm512_load_si512(c + 16 * m), t[m]);
  };
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* ahead = blk + s * kStepBytes + kPrefetchBytes;
    for (int line = 0; line < kStepBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
    if (s % 2 == 0) {
      VS_STEP(0, 4, 6, s)
      if (s > 0) _tile_stored(1, sums[(s - 1) & (kSlots - 1)], 64);
    } else {
      VS_STEP(1, 5, 7, s)
      _tile_stored(0, sums[(s - 1) & (kSlots - 1)], 64);
    }
    if (s - 1 - kDrainLag >= 0) drain(s - 1 - kDrainLag);
  }
  if (steps > 0) {
    if ((steps - 1) % 2 == 0)
      _tile_stored(0, sums[(steps - 1) & (kSlots - 1)], 64);
    else
      _tile_stored(1, sums[(steps - 1) & (kSlots - 1)], 64);
    for (int64_t s = std::max<int64_t>(0, steps - 1 - kDrainLag); s < steps; ++s) drain(s);
  }
  const int64_t groups = a.K / 4;
  for (int m = 0; m < R; ++m) {
    if (steps * 16 < groups) {  // K % 64 == 32: the last block (8 groups) on VNNI
      const int32_t* xr = reinterpret_cast<const int32_t*>(a.xq + (row0 + m) * a.K);
      __m512i acc = _mm512_setzero_si512();
      for (int64_t g = steps * 16; g < groups; ++g)
        acc = _mm512_dpbusd_epi32(acc, _mm512_load_si512(blk + g * kGroup), _mm512_set1_epi32(xr[g]));
      t[m] = add_block(a, row0 + m, steps, block_offset(a, row0 + m, steps), acc, t[m]);
    }
    finish_row(a, nb, row0 + m, t[m]);
  }
}
#undef VS_STEP

constexpr auto kAmxFns = rows_table<16>([](auto r) { return &amx_rows<decltype(r)::value>; });

// AMX: every row, 16 at a time (then the rest) over the same block.
void amx_blocks(const W8A8Args& a, int64_t begin, int64_t end) {
  const int64_t steps = a.K / 64;
  std::vector<int32_t> offsets(steps * a.M);
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t m = 0; m < a.M; ++m) offsets[s * a.M + m] = block_offset(a, m, s);
  const int64_t full = a.M / kRows;
  const int rest = static_cast<int>(a.M % kRows);
  if (full) {
    configure_int8_tiles(kRows);
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t c = 0; c < full; ++c) amx_rows<kRows>(a, offsets.data(), nb, c * kRows);
  }
  if (rest) {
    configure_int8_tiles(rest);
    const RowsFn fn = pick_rows(kAmxFns, rest);
    for (int64_t nb = begin; nb < end; ++nb) fn(a, offsets.data(), nb, full * kRows);
  }
  _tile_release();
}

}  // namespace

void w8a8_linear_amx(const W8A8Args& a, int64_t begin, int64_t end) { amx_blocks(a, begin, end); }

}  // namespace verispec
