// The activations of the int8 and Q4_K kernels quantised to int8 in blocks of 64 inputs (the
// last one 32 when K % 64 == 32), the same on every tier (see amx/w8a8.cpp for why blocks):
//   amax = max |x[m][k]| over the block, scale_x = amax / 127, inv = 127 / amax (0 when amax = 0),
//   p[m][k] = round_half_even(x[m][k] * inv) clamped to -127..127,
// and the sums of p over each 32 inputs (the int8 kernels' offset correction, Q4_K's mins).
#include <algorithm>
#include <array>

#include "common.h"
#include "vec.h"

namespace verispec {

namespace {

// One row's blocks [b0, b1) (see w8a8_quantize). A block's 64 inputs are loaded once, into
// registers: their max, then their codes and the two sums from there; the max and the sums of
// the lanes by vec.h's shuffle trees (the same values as in lane order). Against loading the block
// once for the max and again for the codes, and reducing lane by lane through memory: 0.27 instead
// of 0.70 ns per input (one thread of the Intel Xeon with AMX, amx tier), 1.4 ms less per 8-token
// pass of the 1.5B int4 (benchmarks/kernels_ab.py, 0.983).
template <bool BF16>
void quantize_row(const void* x, int64_t m, int64_t x_cols, int64_t k, int8_t* xq, float* scale, int32_t* sum,
                  int64_t b0, int64_t b1) {
  using namespace vec;
  constexpr int kVectors = kW8A8Block / 16;
  const auto load16 = [&](int64_t i) -> F16 {  // (x_cols % 32 == 0: 16 inputs are all in x or all past it)
    if (i >= x_cols) return zero();
    if constexpr (BF16) return load_bf16(static_cast<const uint16_t*>(x) + m * x_cols + i);
    return load(static_cast<const float*>(x) + m * x_cols + i);
  };
  const I16 lo = iset1(-127), hi = iset1(127);
  const int64_t nblk = (k + kW8A8Block - 1) / kW8A8Block;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t i0 = b * kW8A8Block;
    const int n = static_cast<int>(std::min<int64_t>(kW8A8Block, k - i0)) / 16;  // 4 (2: a last half block)
    F16 v[kVectors];
    F16 amax = zero();
    for (int j = 0; j < n; ++j) {
      v[j] = load16(i0 + 16 * j);
      amax = max(amax, vec::abs(v[j]));
    }
    const float top = reduce_max(amax);
    scale[m * nblk + b] = top / 127.0f;
    const F16 inv = set1(top > 0.0f ? 127.0f / top : 0.0f);
    for (int h = 0; h < n; h += 2) {
      I16 total = izero();
      for (int j = h; j < h + 2; ++j) {
        const I16 q = imin(imax(cvt_nearest(mul(v[j], inv)), lo), hi);
        total = iadd(total, q);
        store_i8(xq + m * k + i0 + 16 * j, q);
      }
      sum[m * (k / 32) + (i0 + 16 * h) / 32] = ireduce_add(total);
    }
  }
}

}  // namespace

void w8a8_quantize(const void* x, bool bf16, int64_t x_cols, int64_t k, int8_t* xq, float* scale, int32_t* sum,
                   int64_t begin, int64_t end, int64_t b0, int64_t b1) {
  for (int64_t m = begin; m < end; ++m) {
    if (bf16)
      quantize_row<true>(x, m, x_cols, k, xq, scale, sum, b0, b1);
    else
      quantize_row<false>(x, m, x_cols, k, xq, scale, sum, b0, b1);
  }
}

void q4k_activation_mins(const float* scale, const int32_t* sum, int64_t k, float* xmin, int64_t begin, int64_t end,
                         int64_t h0, int64_t h1) {
  const int64_t halves = k / 32, nblk = (k + kW8A8Block - 1) / kW8A8Block;
  for (int64_t m = begin; m < end; ++m)
    for (int64_t h = h0; h < h1; ++h) xmin[m * halves + h] = static_cast<float>(sum[m * halves + h]) * scale[m * nblk + h / 2];
}

void interleave_rows(const uint32_t* src, int64_t m, int64_t per_row, int chunk, uint32_t* dst, int64_t e0,
                     int64_t e1) {
  for (int64_t r0 = 0; r0 < m; r0 += chunk) {
    const int64_t rows = std::min<int64_t>(chunk, m - r0);
    const uint32_t* in = src + r0 * per_row;
    uint32_t* out = dst + r0 * per_row;
    for (int64_t e = e0; e < e1; ++e)
      for (int64_t r = 0; r < rows; ++r) out[e * rows + r] = in[r * per_row + e];
  }
}

namespace {

// Elements (4 bytes each: xq's codes 4 to a word) per row of xq, the scales, the sums and Q4_K's
// mins.
std::array<int64_t, 4> row_elements(int64_t k) {
  const int64_t nblk = (k + kW8A8Block - 1) / kW8A8Block, halves = k / 32;
  return {k / 4, nblk, halves, halves};
}

// One of the four [M, per_row] arrays of quantised activations (xq's words, the scales, the sums,
// Q4_K's mins; src null when absent), the place of its interleaved copy in the rows buffer, and how
// many of its elements an activation block of 64 inputs holds.
struct ActivationPart {
  const uint32_t* src;
  int64_t per_row, per_block;
  uint32_t* copy;
};

std::array<ActivationPart, 4> parts_of(const ActivationBuffers& b, int64_t m, int64_t k) {
  const auto e = row_elements(k);
  std::array<ActivationPart, 4> parts{{{reinterpret_cast<const uint32_t*>(b.xq), e[0], 16, nullptr},
                                       {reinterpret_cast<const uint32_t*>(b.scale), e[1], 1, nullptr},
                                       {reinterpret_cast<const uint32_t*>(b.sum), e[2], 2, nullptr},
                                       {reinterpret_cast<const uint32_t*>(b.xmin), e[3], 2, nullptr}}};
  uint32_t* at = b.rows;
  for (auto& part : parts)
    if (at && part.src) {
      part.copy = at;
      at += m * part.per_row;
    }
  return parts;
}

}  // namespace

void quantize_activations(const void* x, bool bf16, int64_t m, int64_t x_cols, int64_t k, const ActivationBuffers& out,
                          int64_t b0, int64_t b1) {
  w8a8_quantize(x, bf16, x_cols, k, out.xq, out.scale, out.sum, 0, m, b0, b1);
  const int64_t halves = k / 32, h0 = 2 * b0, h1 = std::min<int64_t>(2 * b1, halves);  // (the last block may be half)
  if (out.xmin) q4k_activation_mins(out.scale, out.sum, k, out.xmin, 0, m, h0, h1);
  for (const auto& part : parts_of(out, m, k))
    if (part.copy)
      interleave_rows(part.src, m, part.per_row, vector_chunk_rows(), part.copy, part.per_block * b0,
                      std::min(part.per_block * b1, part.per_row));
}

ActivationLayout activation_layout(int64_t m, int64_t k, bool q4k, bool interleave) {
  const auto e = row_elements(k);
  ActivationLayout layout{-1, -1, -1, -1, -1, 0};
  auto place = [&](int64_t elements) {
    const int64_t at = layout.bytes;
    layout.bytes += (4 * m * elements + 63) / 64 * 64;
    return at;
  };
  layout.xq = place(e[0]);
  layout.scale = place(e[1]);
  layout.sum = place(e[2]);
  if (q4k) layout.xmin = place(e[3]);
  if (interleave && m > 1) layout.rows = place(e[0] + e[1] + e[2] + (q4k ? e[3] : 0));
  return layout;
}

ActivationBuffers activation_buffers_at(uint8_t* base, const ActivationLayout& layout) {
  auto at = [&](int64_t offset) -> void* { return offset < 0 ? nullptr : base + offset; };
  return {static_cast<int8_t*>(at(layout.xq)), static_cast<float*>(at(layout.scale)),
          static_cast<int32_t*>(at(layout.sum)), static_cast<float*>(at(layout.xmin)),
          static_cast<uint32_t*>(at(layout.rows))};
}

void point_at_activations(const ActivationBuffers& in, int64_t m, int64_t k, W8A8Args& a) {
  a.xq = in.xq;
  a.xscale = in.scale;
  a.xsum = in.sum;
  a.xmin = in.xmin;
  if (!in.rows && m > 1) return;  // no interleaved copies: for the AMX tiles only
  // one row: the interleaved order is the row itself
  const auto parts = parts_of(in, m, k);
  auto copy = [&](int i) { return in.rows ? parts[i].copy : parts[i].src; };
  a.xq_rows = reinterpret_cast<const int32_t*>(copy(0));
  a.xscale_rows = reinterpret_cast<const float*>(copy(1));
  a.xsum_rows = reinterpret_cast<const int32_t*>(copy(2));
  a.xmin_rows = reinterpret_cast<const float*>(copy(3));
}

}  // namespace verispec
