// The small operations of a decoder layer between the projections, for bf16 activations, one
// call each instead of the five to eight torch operations they take in Python: RMSNorm (with the
// residual add before it), the rotary embedding, and SwiGLU's silu(gate) * up. Each row is
// computed from that row alone in a fixed order (batch-invariant), with the roundings to bf16
// where the torch formulation of verispec.models.transformer has them:
//   residual  h = bf16(h + d)
//   RMSNorm   r = 1 / sqrt(sum(h^2) / C + eps) (fp32; the sum over 16 lanes, then a fixed lane
//             reduction), y = bf16(w * bf16(h * r))
//   rotary    y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = [-x2, x1]
//   SwiGLU    y = bf16(bf16(silu(g)) * u), silu(g) = g / (1 + exp(-g)) in fp32
#include <algorithm>
#include <cmath>

#include "common.h"

namespace verispec {
namespace {

inline void narrow_store(uint16_t* p, __m512 v, __mmask16 m = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

}  // namespace

void rms_norm_rows(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* y, int64_t c, float eps,
                   int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    uint16_t* hr = h + m * c;
    __m512 sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < c; i += 16) {
      const __mmask16 k = tail_mask(c - i);
      __m512 v = widen_bf16_masked(hr + i, k);
      if (delta) {
        v = round_to_bf16(_mm512_add_ps(v, widen_bf16_masked(delta + m * c + i, k)));
        narrow_store(hr + i, v, k);
      }
      sq = _mm512_fmadd_ps(v, v, sq);
    }
    const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(c) + eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < c; i += 16) {
      const __mmask16 k = tail_mask(c - i);
      const __m512 v = round_to_bf16(_mm512_mul_ps(widen_bf16_masked(hr + i, k), rv));
      narrow_store(y + m * c + i, _mm512_mul_ps(widen_bf16_masked(w + i, k), v), k);
    }
  }
}

void rotary_rows(const uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin, uint16_t* y,
                 int64_t heads, int64_t d, int64_t begin, int64_t end) {
  const int64_t half = d / 2;
  for (int64_t m = begin; m < end; ++m) {
    const uint16_t* cr = cos + m * d;
    const uint16_t* sr = sin + m * d;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* xr = x + m * x_stride + h * d;
      uint16_t* yr = y + (m * heads + h) * d;
      for (int64_t i = 0; i < d; i += 16) {  // d % 32 == 0: a vector never straddles the halves
        const __m512 v = widen_bf16(xr + i);
        const __m512 partner = i < half ? _mm512_sub_ps(_mm512_setzero_ps(), widen_bf16(xr + i + half)) : widen_bf16(xr + i - half);
        const __m512 a = round_to_bf16(_mm512_mul_ps(v, widen_bf16(cr + i)));
        const __m512 b = round_to_bf16(_mm512_mul_ps(partner, widen_bf16(sr + i)));
        narrow_store(yr + i, _mm512_add_ps(a, b));
      }
    }
  }
}

void silu_mul_rows(const uint16_t* gate, const uint16_t* up, int64_t stride, uint16_t* y, int64_t f, int64_t begin,
                   int64_t end) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t m = begin; m < end; ++m) {
    for (int64_t i = 0; i < f; i += 16) {
      const __mmask16 k = tail_mask(f - i);
      const __m512 g = widen_bf16_masked(gate + m * stride + i, k);
      const __m512 s = round_to_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp_fp32(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
      narrow_store(y + m * f + i, _mm512_mul_ps(s, widen_bf16_masked(up + m * stride + i, k)), k);
    }
  }
}

}  // namespace verispec
