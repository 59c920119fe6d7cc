// bf16 weights times bf16 activations on AMX (TDPBF16PS), fp32 sums: the amx tier's "bf16"
// projections at every row count (one summation order for 1 row and 16: batch invariance), at
// close to memory bandwidth. The other tiers add in another order (vec/linear.cpp).
//
//   y[m][n] = C[m][n] + bias[n]   (fp32, then rounded to nearest even to bf16 when y is bf16)
//
// where C is what TDPBF16PS accumulates over the input steps s = 0, 1, ... (32 inputs each) in
// order, starting from 0. Measured on Sapphire Rapids (and checked bit for bit by the tests
// against a reference in Python): one step adds to C the sum of its even-indexed products and
// the sum of its odd-indexed products, each a sequential fp32 sum from zero over the 16 pairs of
// the step (every bf16 x bf16 product is exact in fp32), as C + (even + odd); inputs and results
// that are denormal count as zero. Each row of a tile is computed from that row's data alone,
// so row i of an M-row call equals the one-row call on row i bit for bit (batch invariance): a
// verification pass computes the same logits rows as the decode steps it stands for.
//
// Why a kernel: at one to sixteen rows a projection is a matrix-vector product whose cost is
// reading the weights. torch's bf16 path reads them at ~15 GB/s on two cores here (about 2/3 of
// what the memory gives); one AMX multiply covers 32 inputs x 16 outputs x up to 16 rows per
// 1 KB tile load, so the loop is the weight stream and nothing else, and the same code serves
// 1 row or 16 (flat verify curve).
//
// Packed layout: blocks of 16 weight rows, row-block major; within a block, one 64-byte group per
// pair of inputs: bytes 4r .. 4r + 3 of group g are w[16 nb + r][2g], w[16 nb + r][2g + 1] (the
// pair layout of a TDPBF16PS B operand), so 16 consecutive groups (32 inputs) are one B tile as
// they lie in memory. Rows past N are zero and their outputs are never written.
#include <algorithm>

#include "amx.h"

namespace verispec {
namespace {

constexpr int kStepInputs = 32;                       // inputs per tile step
constexpr int kStepBytes = kRows * kStepInputs * 2;   // one B tile: 16 weight rows x 32 bf16
constexpr int kPrefetchSteps = 4;                     // how many steps ahead each stream is prefetched

// tmm0..3: C (rows x 16 fp32) of up to four row blocks; tmm4: A (rows x 32 bf16 activations);
// tmm5..7: B (16 pairs x 16 weight rows), used in turn.
inline void configure_bf16_tiles(int rows) {
  const TileShape c{rows, 64}, b{kRows, 64};
  configure_tiles({c, c, c, c, c, b, b, b});
}

// Prefetches step s + kPrefetchSteps of `blocks` row blocks of weights at w (block_bytes apart)
// into L1, unless it is past the last of `steps`.
inline void prefetch_step(const uint8_t* w, int64_t block_bytes, int blocks, int64_t s, int64_t steps) {
  if (s + kPrefetchSteps >= steps) return;
  for (int g = 0; g < blocks; ++g) {
    const char* ahead = reinterpret_cast<const char*>(w + g * block_bytes + (s + kPrefetchSteps) * kStepBytes);
    for (int line = 0; line < kStepBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
}

// The fp32 sums c of `rows` rows (a stored C tile) -> y (+ bias) for the 16 output columns of row block nb.
inline void store_block(const Bf16Args& a, int64_t nb, int64_t row0, int rows, const float* c) {
  const int64_t n0 = nb * kRows;
  const int n_valid = static_cast<int>(std::min<int64_t>(a.N - n0, kRows));
  const __mmask16 mask = n_valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n_valid) - 1);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < rows; ++m) {
    __m512 v = _mm512_load_ps(c + 16 * m);
    if (a.bias) v = _mm512_add_ps(v, bias);
    store_columns(a.y, a.out_bf16, (row0 + m) * a.N + n0, v, n_valid);
  }
}

// G (1..4) row blocks of weights at w (packed, one after another) against the R rows from row0
// (the rows the tiles are configured with): the output columns of row blocks nb .. nb + G - 1.
template <int G>
void amx_group(const Bf16Args& a, const uint8_t* w, int64_t nb, int64_t row0, int rows) {
  const int64_t steps = a.K / kStepInputs;
  const int64_t block_bytes = a.K * kRows * 2;
  const uint16_t* x = a.x + row0 * a.K;
  const int64_t x_stride = a.K * 2;
  _tile_zero(0);
  if (G > 1) _tile_zero(1);
  if (G > 2) _tile_zero(2);
  if (G > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    prefetch_step(w, block_bytes, G, s, steps);
    const uint8_t* ws = w + s * kStepBytes;
    VS_TILE_LOADD(4, x + s * kStepInputs, x_stride);
    VS_TILE_LOADD(5, ws, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (G > 1) {
      VS_TILE_LOADD(6, ws + block_bytes, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (G > 2) {
      VS_TILE_LOADD(7, ws + 2 * block_bytes, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (G > 3) {
      VS_TILE_LOADD(5, ws + 3 * block_bytes, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float c[kBf16GroupBlocks][kRows * 16];
  _tile_stored(0, c[0], 64);
  if (G > 1) _tile_stored(1, c[1], 64);
  if (G > 2) _tile_stored(2, c[2], 64);
  if (G > 3) _tile_stored(3, c[3], 64);
  for (int g = 0; g < G; ++g) store_block(a, nb + g, row0, rows, c[g]);
}

// G row blocks of weights at w (output row blocks from nb) for the rows from `first`, 16 at a time
// (then the rest): the group's weights are read from memory once and from L2 for the later row
// chunks. `configured` is the row count the tiles are configured with (0: none yet).
template <int G>
void amx_rows(const Bf16Args& a, const uint8_t* w, int64_t nb, int& configured, int64_t first) {
  for (int64_t row0 = first; row0 < a.M; row0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(a.M - row0, kRows));
    if (rows != configured) {
      configure_bf16_tiles(rows);
      configured = rows;
    }
    amx_group<G>(a, w, nb, row0, rows);
  }
}

// Many rows (a prompt's): two chunks of 16 rows against two row blocks at a time, on the tiles as
// configure_bf16_tiles(16) shapes them (all 16 rows x 64 bytes). tmm0, tmm1: C of chunk 0 with
// blocks 0, 1; tmm2, tmm3: C of chunk 1; tmm4, tmm5: A of the chunks; tmm6, tmm7: B of the blocks.
// Each step loads four tiles for four multiplies where amx_group's one A and four B tiles take
// five; every output still adds its steps in order, so the bits are amx_group's. Row blocks nb,
// nb + 1 (weights at w, one after the other) against rows row0 .. row0 + 31.
void amx_quad(const Bf16Args& a, const uint8_t* w, int64_t nb, int64_t row0) {
  const int64_t steps = a.K / kStepInputs;
  const int64_t block_bytes = a.K * kRows * 2;
  const uint16_t* x0 = a.x + row0 * a.K;
  const uint16_t* x1 = x0 + kRows * a.K;
  const int64_t x_stride = a.K * 2;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    prefetch_step(w, block_bytes, 2, s, steps);
    const uint8_t* ws = w + s * kStepBytes;
    VS_TILE_LOADD(4, x0 + s * kStepInputs, x_stride);
    VS_TILE_LOADD(6, ws, 64);
    _tile_dpbf16ps(0, 4, 6);
    VS_TILE_LOADD(7, ws + block_bytes, 64);
    _tile_dpbf16ps(1, 4, 7);
    VS_TILE_LOADD(5, x1 + s * kStepInputs, x_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[4][kRows * 16];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  _tile_stored(2, c[2], 64);
  _tile_stored(3, c[3], 64);
  store_block(a, nb, row0, kRows, c[0]);
  store_block(a, nb + 1, row0, kRows, c[1]);
  store_block(a, nb, row0 + kRows, kRows, c[2]);
  store_block(a, nb + 1, row0 + kRows, kRows, c[3]);
}

}  // namespace

void bf16_blocks_amx(const Bf16Args& a, const uint16_t* w, int64_t nb, int blocks, int& configured) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(w);
  const int64_t quads = a.M / (2 * kRows), block_bytes = a.K * kRows * 2;
  if (quads > 0 && blocks >= 2) {  // pairs of blocks over pairs of row chunks, then the rest
    if (configured != kRows) {
      configure_bf16_tiles(kRows);
      configured = kRows;
    }
    const int even = blocks & ~1;
    for (int j = 0; j < even; j += 2)
      for (int64_t q = 0; q < quads; ++q) amx_quad(a, bytes + j * block_bytes, nb + j, 2 * kRows * q);
    const int64_t rest = 2 * kRows * quads;  // the rows past the pairs, then an odd block's every row
    if (even == 4)
      amx_rows<4>(a, bytes, nb, configured, rest);
    else
      amx_rows<2>(a, bytes, nb, configured, rest);
    if (blocks & 1) amx_rows<1>(a, bytes + even * block_bytes, nb + even, configured, 0);
    return;
  }
  switch (blocks) {
    case 4: amx_rows<4>(a, bytes, nb, configured, 0); break;
    case 3: amx_rows<3>(a, bytes, nb, configured, 0); break;
    case 2: amx_rows<2>(a, bytes, nb, configured, 0); break;
    case 1: amx_rows<1>(a, bytes, nb, configured, 0); break;
    default: break;
  }
}

void bf16_linear_amx(const Bf16Args& a, int64_t begin, int64_t end) {
  int configured = 0;
  for (int64_t nb = begin; nb < end; nb += kBf16GroupBlocks) {
    const int blocks = static_cast<int>(std::min<int64_t>(end - nb, kBf16GroupBlocks));
    bf16_blocks_amx(a, a.w + nb * a.K * kRows, nb, blocks, configured);
  }
  if (configured) _tile_release();
}

}  // namespace verispec
