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
#include "vec.h"

namespace verispec {
using namespace vec;

void rms_norm_rows(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* y, int64_t c, float eps,
                   int64_t begin, int64_t end) {
  for (int64_t m = begin; m < end; ++m) {
    uint16_t* hr = h + m * c;
    F16 sq = zero();
    for (int64_t i = 0; i < c; i += 16) {
      const int n = static_cast<int>(std::min<int64_t>(c - i, 16));
      F16 v = load_bf16_n(hr + i, n);
      if (delta) {
        v = round_bf16(add(v, load_bf16_n(delta + m * c + i, n)));
        store_bf16_n(hr + i, v, n);
      }
      sq = fma(v, v, sq);
    }
    const float r = 1.0f / std::sqrt(reduce_add(sq) / static_cast<float>(c) + eps);
    const F16 rv = set1(r);
    for (int64_t i = 0; i < c; i += 16) {
      const int n = static_cast<int>(std::min<int64_t>(c - i, 16));
      const F16 v = round_bf16(mul(load_bf16_n(hr + i, n), rv));
      store_bf16_n(y + m * c + i, mul(load_bf16_n(w + i, n), v), n);
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
        const F16 v = load_bf16(xr + i);
        const F16 partner = i < half ? sub(zero(), load_bf16(xr + i + half)) : load_bf16(xr + i - half);
        const F16 a = round_bf16(mul(v, load_bf16(cr + i)));
        const F16 b = round_bf16(mul(partner, load_bf16(sr + i)));
        store_bf16(yr + i, add(a, b));
      }
    }
  }
}

void silu_mul_rows(const uint16_t* gate, const uint16_t* up, int64_t stride, uint16_t* y, int64_t f, int64_t begin,
                   int64_t end, int64_t c0, int64_t c1) {
  const F16 one = set1(1.0f);
  for (int64_t m = begin; m < end; ++m) {
    for (int64_t i = c0; i < c1; i += 16) {
      const int n = static_cast<int>(std::min<int64_t>(c1 - i, 16));
      const F16 g = load_bf16_n(gate + m * stride + i, n);
      const F16 s = round_bf16(div(g, add(one, vec::exp(sub(zero(), g)))));
      store_bf16_n(y + m * f + i, mul(s, load_bf16_n(up + m * stride + i, n)), n);
    }
  }
}

}  // namespace verispec
