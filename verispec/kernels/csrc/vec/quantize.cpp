// The activations of the int8 and Q4_K kernels quantised to int8 in blocks of 64 inputs (the
// last one 32 when K % 64 == 32), the same on every tier (see amx/w8a8.cpp for why blocks):
//   amax = max |x[m][k]| over the block, scale_x = amax / 127, inv = 127 / amax (0 when amax = 0),
//   p[m][k] = round_half_even(x[m][k] * inv) clamped to -127..127,
// and the sums of p over each 32 inputs (the int8 kernels' offset correction, Q4_K's mins).
#include <algorithm>

#include "common.h"
#include "vec.h"

namespace verispec {

void w8a8_quantize(const void* x, bool bf16, int64_t k, int8_t* xq, float* scale, int32_t* sum, int64_t begin,
                   int64_t end) {
  using namespace vec;
  auto load16 = [&](int64_t m, int64_t i) -> F16 {
    if (bf16) return load_bf16(static_cast<const uint16_t*>(x) + m * k + i);
    return load(static_cast<const float*>(x) + m * k + i);
  };
  const I16 lo = iset1(-127), hi = iset1(127);
  const int64_t nblk = (k + kW8A8Block - 1) / kW8A8Block;
  for (int64_t m = begin; m < end; ++m)
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t i0 = b * kW8A8Block, i1 = std::min<int64_t>(i0 + kW8A8Block, k);
      F16 amax = zero();
      for (int64_t i = i0; i < i1; i += 16) amax = max(amax, vec::abs(load16(m, i)));
      const float top = reduce_max(amax);
      scale[m * nblk + b] = top / 127.0f;
      const F16 inv = set1(top > 0.0f ? 127.0f / top : 0.0f);
      for (int64_t h = i0; h < i1; h += 32) {
        I16 total = izero();
        for (int64_t i = h; i < h + 32; i += 16) {
          const I16 q = imin(imax(cvt_nearest(mul(load16(m, i), inv)), lo), hi);
          total = iadd(total, q);
          store_i8(xq + m * k + i, q);
        }
        sum[m * (k / 32) + h / 32] = ireduce_add(total);
      }
    }
}

void q4k_activation_mins(const float* scale, const int32_t* sum, int64_t k, float* xmin, int64_t begin, int64_t end) {
  const int64_t halves = k / 32, nblk = (k + kW8A8Block - 1) / kW8A8Block;
  for (int64_t m = begin; m < end; ++m)
    for (int64_t h = 0; h < halves; ++h) xmin[m * halves + h] = static_cast<float>(sum[m * halves + h]) * scale[m * nblk + h / 2];
}

void interleave_rows(const uint32_t* src, int64_t m, int64_t per_row, int chunk, uint32_t* dst) {
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t rows = std::min<int64_t>(chunk, m - r0);
    uint32_t* out = dst + r0 * per_row;
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t* in = src + (r0 + r) * per_row;
      for (int64_t e = 0; e < per_row; ++e) out[e * rows + r] = in[e];
    }
  }
}

}  // namespace verispec
