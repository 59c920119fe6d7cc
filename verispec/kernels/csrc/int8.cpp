// Per-output-channel symmetric int8 weights: w[n][k] = scale[n] * q[n][k], q in -128..127.
//
// y[m][n] = scale[n] * sum_k x[m][k] q[n][k] + bias[n]: the codes q are exact in bf16 (|q| <= 128
// fits bf16's 8-bit significand), so the AMX tiles multiply bf16 activations by the exact codes,
// C accumulates over all of K in fp32, and the scale is applied once at the end. As for Q4_K the
// weights are unpacked once per call whatever the number of activation rows (up to 16 rows share
// each B tile; more rows are processed 16 at a time against a 16-row stripe of unpacked weights
// kept in a buffer), and the result of a row does not depend on the other rows.
//
// Packed layout: per (block of 16 weight rows, 32 inputs t) 512 bytes, blocks row-block major:
// 16 chunks p of 32 bytes; byte b of chunk p is q[16 nb + b/2][32 t + 2p + b%2], i.e. a chunk
// converted to bf16 is row p of the AMX B tile in VNNI order. Rows past N are zero.
#include <vector>

#include "common.h"

namespace verispec {
namespace {

constexpr int kStep = 32;         // inputs per AMX step
constexpr int kStepBytes = 512;   // packed bytes per (16 rows, step)
constexpr int kPrefetchAhead = 16;  // steps

// 32 int8 codes -> 32 bf16 values, exactly.
inline __m512i codes_to_bf16(const int8_t* q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// One step's B tile (16 rows x 32 inputs, VNNI order) from its 512 packed bytes.
inline void unpack_step(const int8_t* src, uint16_t* dst) {
  for (int p = 0; p < kRows; ++p) _mm512_store_si512(dst + 32 * p, codes_to_bf16(src + 32 * p));
}

inline void prefetch_step(const int8_t* blk, const int8_t* end) {
  const int8_t* p = blk + kPrefetchAhead * kStepBytes;
  if (p + kStepBytes > end) return;
  for (int line = 0; line < kStepBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// y of one 16-column block from C tiles 0 and 1 (stored to c0, c1): R rows starting at row0.
template <int R>
inline void finish(const LinearArgs& a, int64_t nb, int64_t row0, const float* c0, const float* c1) {
  const int64_t n0 = nb * kRows;
  const int n_valid = static_cast<int>(a.N - n0 < kRows ? a.N - n0 : kRows);
  const __m512 scale = _mm512_loadu_ps(a.scale + n0);  // the scales are padded to a multiple of 16
  const __mmask16 mask = n_valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n_valid) - 1);
  const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < R && row0 + m < a.M; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(c0 + 16 * m), _mm512_load_ps(c1 + 16 * m));
    store_columns(a.y, a.out_bf16, (row0 + m) * a.N + n0, _mm512_fmadd_ps(v, scale, bias), n_valid);
  }
}

// M <= 16 (R = M): each pair of steps is unpacked into two B tiles and used at once.
template <int R>
void int8_blocks(const LinearArgs& a, int64_t begin, int64_t end) {
  configure_tiles(R);
  alignas(64) uint16_t b0[kRows * 32], b1[kRows * 32];
  alignas(64) float c0[R * 16], c1[R * 16];
  const int64_t steps = a.K / kStep;
  const int8_t* w = reinterpret_cast<const int8_t*>(a.w);
  const int8_t* w_end = w + end * steps * kStepBytes;
  for (int64_t nb = begin; nb < end; ++nb) {
    const int8_t* blk = w + nb * steps * kStepBytes;
    _tile_zero(0);
    _tile_zero(1);
    int64_t t = 0;
    for (; t + 2 <= steps; t += 2, blk += 2 * kStepBytes) {
      prefetch_step(blk, w_end);
      prefetch_step(blk + kStepBytes, w_end);
      for (int p = 0; p < kRows; ++p) {  // both tiles at once: more independent work in flight
        _mm512_store_si512(b0 + 32 * p, codes_to_bf16(blk + 32 * p));
        _mm512_store_si512(b1 + 32 * p, codes_to_bf16(blk + kStepBytes + 32 * p));
      }
      VS_TILE_LOADD(2, a.x + t * kStep, a.K * 2);
      VS_TILE_LOADD(3, a.x + (t + 1) * kStep, a.K * 2);
      VS_TILE_LOADD(4, b0, 64);
      VS_TILE_LOADD(5, b1, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 5);
    }
    if (t < steps) {  // K % 64 == 32: one step left
      unpack_step(blk, b0);
      VS_TILE_LOADD(2, a.x + t * kStep, a.K * 2);
      VS_TILE_LOADD(4, b0, 64);
      _tile_dpbf16ps(0, 2, 4);
    }
    _tile_stored(0, c0, 64);
    _tile_stored(1, c1, 64);
    finish<R>(a, nb, 0, c0, c1);
  }
  _tile_release();
}

// M > 16: a 16-row stripe of weights is unpacked once into a buffer (K x 16 bf16, in L2), then
// every 16-row chunk of x runs over it with the same step sequence as int8_blocks.
void int8_blocks_many(const LinearArgs& a, int64_t begin, int64_t end) {
  configure_tiles(kRows);
  const int64_t steps = a.K / kStep;
  std::vector<uint16_t> stripe_buf(steps * kRows * 32 + 32);
  uint16_t* stripe = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(stripe_buf.data()) + 63) & ~uintptr_t(63));
  alignas(64) float c0[kRows * 16], c1[kRows * 16];
  const int8_t* w = reinterpret_cast<const int8_t*>(a.w);
  for (int64_t nb = begin; nb < end; ++nb) {
    const int8_t* blk = w + nb * steps * kStepBytes;
    for (int64_t t = 0; t < steps; ++t) unpack_step(blk + t * kStepBytes, stripe + t * kRows * 32);
    for (int64_t row0 = 0; row0 < a.rows; row0 += kRows) {
      const uint16_t* xc = a.x + row0 * a.K;
      _tile_zero(0);
      _tile_zero(1);
      int64_t t = 0;
      for (; t + 2 <= steps; t += 2) {
        VS_TILE_LOADD(2, xc + t * kStep, a.K * 2);
        VS_TILE_LOADD(3, xc + (t + 1) * kStep, a.K * 2);
        VS_TILE_LOADD(4, stripe + t * kRows * 32, 64);
        VS_TILE_LOADD(5, stripe + (t + 1) * kRows * 32, 64);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 5);
      }
      if (t < steps) {
        VS_TILE_LOADD(2, xc + t * kStep, a.K * 2);
        VS_TILE_LOADD(4, stripe + t * kRows * 32, 64);
        _tile_dpbf16ps(0, 2, 4);
      }
      _tile_stored(0, c0, 64);
      _tile_stored(1, c1, 64);
      finish<kRows>(a, nb, row0, c0, c1);
    }
  }
  _tile_release();
}

}  // namespace

void int8_linear(const LinearArgs& a, int64_t begin, int64_t end) {
  if (a.rows > kRows) {
    int8_blocks_many(a, begin, end);
    return;
  }
  switch (a.rows) {
#define VS_CASE(r)                \
  case r:                         \
    int8_blocks<r>(a, begin, end); \
    break;
    VS_CASE(1) VS_CASE(2) VS_CASE(3) VS_CASE(4) VS_CASE(5) VS_CASE(6) VS_CASE(7) VS_CASE(8)
    VS_CASE(9) VS_CASE(10) VS_CASE(11) VS_CASE(12) VS_CASE(13) VS_CASE(14) VS_CASE(15) VS_CASE(16)
#undef VS_CASE
    default:
      break;
  }
}

// int8 [n, k] row-major -> packed row blocks [begin, end) (see the layout above).
void int8_pack(const int8_t* q, int64_t n, int64_t k, int8_t* packed, int64_t begin, int64_t end) {
  const int64_t steps = k / kStep;
  for (int64_t nb = begin; nb < end; ++nb)
    for (int64_t t = 0; t < steps; ++t) {
      int8_t* dst = packed + (nb * steps + t) * kStepBytes;
      for (int p = 0; p < 16; ++p)
        for (int b = 0; b < 32; ++b) {
          const int64_t row = nb * kRows + b / 2;
          dst[32 * p + b] = row < n ? q[row * k + kStep * t + 2 * p + b % 2] : int8_t(0);
        }
    }
}

}  // namespace verispec
