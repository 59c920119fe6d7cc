// Sixteen lanes, four ways: the vector type every kernel of the avx512, avx2, neon and portable
// tiers is written in (and the row operations of the amx tier). F16 is 16 fp32 lanes, I16 16
// int32 lanes; each operation is defined per lane (or, for the reductions, as one fixed tree over
// the 16 lanes), so the same kernel source computes the same bits whether a lane lives in one
// __m512 (AVX-512), in two __m256 (AVX2), in four 128-bit registers (ARM NEON) or in a float[16]
// (plain C++): a kernel's result is the same on every tier, and only its speed depends on the CPU.
//
// Per-lane semantics, where the instruction sets differ:
//   max(a, b)       a > b ? a : b (x86's MAXPS: b when either is NaN)
//   cvt_nearest(a)  round half to even to int32, INT32_MIN when NaN or out of range (CVTPS2DQ)
//   to_bf16(a)      bf16 bits of a rounded to nearest even, NaN -> 0x7FC0 (torch's c10::BFloat16,
//                   denormals kept): every rounding to bf16 in the kernels
//   fma(a, b, c)    a * b + c rounded once (std::fmaf in plain C++)
//   reduce_add(a)   s8[i] = a[i] + a[i+8], s4[i] = s8[i] + s8[i+4], s2[i] = s4[i] + s4[i+2],
//                   s2[0] + s2[1] (GCC's _mm512_reduce_add_ps tree); reduce_add16 takes 16 at once
// The build compiles every source with -ffp-contract=off, so a * b + c stays two roundings
// unless a kernel asks for fma.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#define VS_VEC_AVX512 1
#if VS_VEC_DPBF16 && !defined(__AVX512BF16__)  // the avx512bf16 tier's build sets it (dots.h)
#error "VS_VEC_DPBF16 needs -mavx512bf16"
#endif
#include <immintrin.h>
#elif defined(__AVX2__)
#define VS_VEC_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define VS_VEC_NEON 1
#include <arm_neon.h>
#else
#define VS_VEC_SCALAR 1
#endif

namespace verispec {
namespace vec {

// fp16 bits -> fp32 (exact) and bf16 rounding, one value (the scalar tier and the tails).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // a denormal fp16 is a normal fp32
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t bf16_bits(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + (((u >> 16) & 1) + 0x7FFFu)) >> 16);
}
inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline int32_t cvt_nearest_one(float f) {
  const float r = std::nearbyint(f);  // the default rounding mode: to nearest, ties to even
  return (r >= -2147483648.0f && r < 2147483648.0f) ? static_cast<int32_t>(r) : INT32_MIN;
}

#if VS_VEC_AVX512
// ------------------------------------------------------------------------------------ AVX-512
struct F16 {
  __m512 v;
};
struct I16 {
  __m512i v;
};
inline __mmask16 first(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n < 0 ? 0 : n)) - 1); }
inline F16 zero() { return {_mm512_setzero_ps()}; }
inline F16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline void store_n(float* p, F16 a, int n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline F16 widen_bf16(__m256i b) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16))}; }
inline F16 load_bf16(const uint16_t* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline F16 load_bf16_n(const uint16_t* p, int n) { return widen_bf16(_mm256_maskz_loadu_epi16(first(n), p)); }
inline __m256i bf16_of(F16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                           _mm512_set1_epi32(0x7FFF))),
      16);
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}
inline void store_bf16(uint16_t* p, F16 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_of(a)); }
inline void store_bf16_n(uint16_t* p, F16 a, int n) { _mm256_mask_storeu_epi16(p, first(n), bf16_of(a)); }
inline F16 round_bf16(F16 a) { return widen_bf16(bf16_of(a)); }
// the two bf16 of each 32-bit lane of a 64-byte pair group: (low half, high half) as fp32
inline void load_bf16_pairs(const uint16_t* p, F16& even, F16& odd) {
  const __m512i v = _mm512_loadu_si512(p);
  even.v = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd.v = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline F16 add(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 sub(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 mul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 div(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b, rounded once
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 min(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 abs(F16 a) { return {_mm512_abs_ps(a.v)}; }
inline F16 nearest(F16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline F16 keep_first(F16 a, int n) { return {_mm512_maskz_mov_ps(first(n), a.v)}; }
inline F16 zero_where_less(F16 a, F16 x, F16 lo) {  // a, with 0 where x < lo
  return {_mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x.v, lo.v, _CMP_LT_OQ)), a.v)};
}
inline I16 cvt_nearest(F16 a) { return {_mm512_cvtps_epi32(a.v)}; }
inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline I16 izero() { return {_mm512_setzero_si512()}; }
inline I16 iset1(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline I16 iload(const void* p) { return {_mm512_loadu_si512(p)}; }
inline void istore(void* p, I16 a) { _mm512_storeu_si512(p, a.v); }
inline I16 iadd(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 isub(I16 a, I16 b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline I16 imax(I16 a, I16 b) { return {_mm512_max_epi32(a.v, b.v)}; }
inline I16 imin(I16 a, I16 b) { return {_mm512_min_epi32(a.v, b.v)}; }
inline I16 iand(I16 a, I16 b) { return {_mm512_and_si512(a.v, b.v)}; }
inline I16 ior(I16 a, I16 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline I16 ixor(I16 a, I16 b) { return {_mm512_xor_si512(a.v, b.v)}; }
template <int N>
inline I16 ishr(I16 a) {
  return {_mm512_srli_epi32(a.v, N)};
}
template <int N>
inline I16 ishl(I16 a) {
  return {_mm512_slli_epi32(a.v, N)};
}
inline I16 imul(I16 a, I16 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }  // the low 32 bits
// (a & mask) | (b & ~mask), bit by bit: one VPTERNLOGD (a is its destination, so that the mask,
// a constant, is not copied each time)
inline I16 bitselect(I16 mask, I16 a, I16 b) { return {_mm512_ternarylogic_epi32(a.v, b.v, mask.v, 0xE4)}; }
inline I16 iload_i8(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline F16 as_float(I16 a) { return {_mm512_castsi512_ps(a.v)}; }
inline I16 as_int(F16 a) { return {_mm512_castps_si512(a.v)}; }
inline I16 shl_lanes(I16 a, I16 n) { return {_mm512_sllv_epi32(a.v, n.v)}; }
inline void store_i8(int8_t* p, I16 a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v)); }
inline F16 half16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline float lane(F16 a, int i) {
  alignas(64) float t[16];
  _mm512_store_ps(t, a.v);
  return t[i];
}

#elif VS_VEC_AVX2
// ------------------------------------------------------------------------------------ AVX2
struct F16 {
  __m256 lo, hi;
};
struct I16 {
  __m256i lo, hi;
};
inline __m256i first8(int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 load_n(const float* p, int n) {
  if (n >= 16) return load(p);  // (whole vectors: plain loads, cheaper than masked ones)
  return {_mm256_maskload_ps(p, first8(n)), _mm256_maskload_ps(p + 8, first8(n - 8))};
}
inline void store(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store_n(float* p, F16 a, int n) {
  if (n >= 16) return store(p, a);  // (whole vectors: plain stores, cheaper than masked ones)
  _mm256_maskstore_ps(p, first8(n), a.lo);
  _mm256_maskstore_ps(p + 8, first8(n - 8), a.hi);
}
inline F16 widen_bf16(__m128i lo, __m128i hi) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
}
inline F16 load_bf16(const uint16_t* p) {
  return widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
}
inline F16 load_bf16_n(const uint16_t* p, int n) {
  if (n >= 16) return load_bf16(p);  // (whole vectors: no copy through the stack)
  alignas(32) uint16_t t[16] = {0};
  for (int i = 0; i < n && i < 16; ++i) t[i] = p[i];
  return load_bf16(t);
}
inline __m256i bf16_lanes(__m256 a) {  // the bf16 bits in the low half of each 32-bit lane
  const __m256i u = _mm256_castps_si256(a);
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                           _mm256_set1_epi32(0x7FFF))),
      16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m256i bf16_of(F16 a) {  // 16 bf16 in lane order
  const __m256i packed = _mm256_packus_epi32(bf16_lanes(a.lo), bf16_lanes(a.hi));  // per 128-bit half
  return _mm256_permute4x64_epi64(packed, 0xD8);
}
inline void store_bf16(uint16_t* p, F16 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_of(a)); }
inline void store_bf16_n(uint16_t* p, F16 a, int n) {
  if (n >= 16) return store_bf16(p, a);  // (whole vectors: no copy through the stack)
  alignas(32) uint16_t t[16];
  store_bf16(t, a);
  for (int i = 0; i < n && i < 16; ++i) p[i] = t[i];
}
inline F16 round_bf16(F16 a) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_lanes(a.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_lanes(a.hi), 16))};
}
inline void load_bf16_pairs(const uint16_t* p, F16& even, F16& odd) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i top = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(v0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(v0, top)), _mm256_castsi256_ps(_mm256_and_si256(v1, top))};
}
#define VS_F2(name, op) \
  inline F16 name(F16 a, F16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
VS_F2(add, _mm256_add_ps)
VS_F2(sub, _mm256_sub_ps)
VS_F2(mul, _mm256_mul_ps)
VS_F2(div, _mm256_div_ps)
VS_F2(max, _mm256_max_ps)
VS_F2(min, _mm256_min_ps)
#undef VS_F2
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnma(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 abs(F16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F16 nearest(F16 a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline F16 keep_first(F16 a, int n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(first8(n))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(first8(n - 8)))};
}
inline F16 zero_where_less(F16 a, F16 x, F16 lo) {
  return {_mm256_andnot_ps(_mm256_cmp_ps(x.lo, lo.lo, _CMP_LT_OQ), a.lo),
          _mm256_andnot_ps(_mm256_cmp_ps(x.hi, lo.hi, _CMP_LT_OQ), a.hi)};
}
inline I16 cvt_nearest(F16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline F16 to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 iset1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I16 iload(const void* p) {
  const auto* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline void istore(void* p, I16 a) {
  auto* q = static_cast<__m256i*>(p);
  _mm256_storeu_si256(q, a.lo);
  _mm256_storeu_si256(q + 1, a.hi);
}
#define VS_I2(name, op) \
  inline I16 name(I16 a, I16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
VS_I2(iadd, _mm256_add_epi32)
VS_I2(isub, _mm256_sub_epi32)
VS_I2(imax, _mm256_max_epi32)
VS_I2(imin, _mm256_min_epi32)
VS_I2(iand, _mm256_and_si256)
VS_I2(ior, _mm256_or_si256)
VS_I2(ixor, _mm256_xor_si256)
VS_I2(shl_lanes, _mm256_sllv_epi32)
#undef VS_I2
template <int N>
inline I16 ishr(I16 a) {
  return {_mm256_srli_epi32(a.lo, N), _mm256_srli_epi32(a.hi, N)};
}
template <int N>
inline I16 ishl(I16 a) {
  return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)};
}
inline I16 imul(I16 a, I16 b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline I16 bitselect(I16 mask, I16 a, I16 b) {  // (a & mask) | (b & ~mask), bit by bit
  return {_mm256_or_si256(_mm256_and_si256(mask.lo, a.lo), _mm256_andnot_si256(mask.lo, b.lo)),
          _mm256_or_si256(_mm256_and_si256(mask.hi, a.hi), _mm256_andnot_si256(mask.hi, b.hi))};
}
inline I16 iload_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))};
}
inline F16 as_float(I16 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
inline I16 as_int(F16 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
inline void store_i8(int8_t* p, I16 a) {  // values already within -127..127
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);  // 16 int16 in order
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
}
inline F16 half16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline float lane(F16 a, int i) {
  alignas(32) float t[16];
  store(t, a);
  return t[i];
}

#elif VS_VEC_NEON
// ------------------------------------------------------------------------------------ NEON
// Four 128-bit registers per 16 lanes: v[q] holds lanes 4q .. 4q + 3. Where an AArch64
// instruction's rule differs from the per-lane semantics above, a compare and select restores it:
// FMAX returns NaN when either operand is NaN (max here returns b), FCVTNS saturates and maps NaN
// to 0 (cvt_nearest here returns INT32_MIN for both), USHL shifts by the count's low byte (shl_lanes
// here gives 0 for counts above 31).
struct F16 {
  float32x4_t v[4];
};
struct I16 {
  int32x4_t v[4];
};
#define VS_Q(q) for (int q = 0; q < 4; ++q)
inline F16 set1(float x) {
  F16 r;
  VS_Q(q) r.v[q] = vdupq_n_f32(x);
  return r;
}
inline F16 zero() { return set1(0.0f); }
inline F16 load(const float* p) {
  F16 r;
  VS_Q(q) r.v[q] = vld1q_f32(p + 4 * q);
  return r;
}
inline F16 load_n(const float* p, int n) {
  if (n >= 16) return load(p);  // (whole vectors: no copy through the stack)
  alignas(16) float t[16] = {0};
  for (int i = 0; i < n && i < 16; ++i) t[i] = p[i];
  return load(t);
}
inline void store(float* p, F16 a) { VS_Q(q) vst1q_f32(p + 4 * q, a.v[q]); }
inline void store_n(float* p, F16 a, int n) {
  if (n >= 16) return store(p, a);  // (whole vectors: no copy through the stack)
  alignas(16) float t[16];
  store(t, a);
  for (int i = 0; i < n && i < 16; ++i) p[i] = t[i];
}
inline F16 load_bf16(const uint16_t* p) {
  F16 r;
  VS_Q(q) r.v[q] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * q), 16));
  return r;
}
inline F16 load_bf16_n(const uint16_t* p, int n) {
  if (n >= 16) return load_bf16(p);  // (whole vectors: no copy through the stack)
  alignas(16) uint16_t t[16] = {0};
  for (int i = 0; i < n && i < 16; ++i) t[i] = p[i];
  return load_bf16(t);
}
inline uint16x4_t bf16_quarter(float32x4_t a) {  // round to nearest even, NaN -> 0x7FC0
  const uint32x4_t u = vreinterpretq_u32_f32(a);
  const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)), vdupq_n_u32(0x7FFF))), 16);
  const uint32x4_t number = vceqq_f32(a, a);
  return vmovn_u32(vbslq_u32(number, r, vdupq_n_u32(0x7FC0)));
}
inline void store_bf16(uint16_t* p, F16 a) { VS_Q(q) vst1_u16(p + 4 * q, bf16_quarter(a.v[q])); }
inline void store_bf16_n(uint16_t* p, F16 a, int n) {
  if (n >= 16) return store_bf16(p, a);  // (whole vectors: no copy through the stack)
  alignas(16) uint16_t t[16];
  store_bf16(t, a);
  for (int i = 0; i < n && i < 16; ++i) p[i] = t[i];
}
inline F16 round_bf16(F16 a) {
  VS_Q(q) a.v[q] = vreinterpretq_f32_u32(vshll_n_u16(bf16_quarter(a.v[q]), 16));
  return a;
}
inline void load_bf16_pairs(const uint16_t* p, F16& even, F16& odd) {
  VS_Q(q) {
    const uint32x4_t v = vld1q_u32(reinterpret_cast<const uint32_t*>(p) + 4 * q);
    even.v[q] = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    odd.v[q] = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF0000u)));
  }
}
// a lane-wise binary operation of T (F16 or I16, registers of type R), x and y one register each
#define VS_LANEWISE(T, R, name, expr) \
  inline T name(T a, T b) {           \
    T r;                              \
    VS_Q(q) {                         \
      const R x = a.v[q], y = b.v[q]; \
      r.v[q] = (expr);                \
    }                                 \
    return r;                         \
  }
#define VS_F2(name, expr) VS_LANEWISE(F16, float32x4_t, name, expr)
VS_F2(add, vaddq_f32(x, y))
VS_F2(sub, vsubq_f32(x, y))
VS_F2(mul, vmulq_f32(x, y))
VS_F2(div, vdivq_f32(x, y))
VS_F2(max, vbslq_f32(vcgtq_f32(x, y), x, y))
VS_F2(min, vbslq_f32(vcltq_f32(x, y), x, y))
#undef VS_F2
inline F16 fma(F16 a, F16 b, F16 c) {
  VS_Q(q) c.v[q] = vfmaq_f32(c.v[q], a.v[q], b.v[q]);
  return c;
}
inline F16 fnma(F16 a, F16 b, F16 c) {  // c - a * b, rounded once
  VS_Q(q) c.v[q] = vfmsq_f32(c.v[q], a.v[q], b.v[q]);
  return c;
}
inline F16 abs(F16 a) {
  VS_Q(q) a.v[q] = vabsq_f32(a.v[q]);
  return a;
}
inline F16 nearest(F16 a) {
  VS_Q(q) a.v[q] = vrndnq_f32(a.v[q]);
  return a;
}
inline F16 keep_first(F16 a, int n) {
  alignas(16) float t[16];
  store(t, a);
  for (int i = n < 0 ? 0 : n; i < 16; ++i) t[i] = 0.0f;
  return load(t);
}
inline F16 zero_where_less(F16 a, F16 x, F16 lo) {
  VS_Q(q) a.v[q] = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(a.v[q]), vcltq_f32(x.v[q], lo.v[q])));
  return a;
}
inline I16 cvt_nearest(F16 a) {
  I16 r;
  VS_Q(q) {
    const uint32x4_t in_range =
        vandq_u32(vcgeq_f32(a.v[q], vdupq_n_f32(-2147483648.0f)), vcltq_f32(a.v[q], vdupq_n_f32(2147483648.0f)));
    r.v[q] = vbslq_s32(in_range, vcvtnq_s32_f32(a.v[q]), vdupq_n_s32(INT32_MIN));
  }
  return r;
}
inline F16 to_float(I16 a) {
  F16 r;
  VS_Q(q) r.v[q] = vcvtq_f32_s32(a.v[q]);
  return r;
}
inline I16 iset1(int32_t x) {
  I16 r;
  VS_Q(q) r.v[q] = vdupq_n_s32(x);
  return r;
}
inline I16 izero() { return iset1(0); }
inline I16 iload(const void* p) {
  I16 r;
  VS_Q(q) r.v[q] = vld1q_s32(static_cast<const int32_t*>(p) + 4 * q);
  return r;
}
inline void istore(void* p, I16 a) { VS_Q(q) vst1q_s32(static_cast<int32_t*>(p) + 4 * q, a.v[q]); }
#define VS_I2(name, expr) VS_LANEWISE(I16, int32x4_t, name, expr)
VS_I2(iadd, vaddq_s32(x, y))
VS_I2(isub, vsubq_s32(x, y))
VS_I2(imax, vmaxq_s32(x, y))
VS_I2(imin, vminq_s32(x, y))
VS_I2(iand, vandq_s32(x, y))
VS_I2(ior, vorrq_s32(x, y))
VS_I2(ixor, veorq_s32(x, y))
VS_I2(shl_lanes, vreinterpretq_s32_u32(vbicq_u32(vshlq_u32(vreinterpretq_u32_s32(x), y),
                                                 vcgtq_u32(vreinterpretq_u32_s32(y), vdupq_n_u32(31)))))
#undef VS_I2
#undef VS_LANEWISE
template <int N>
inline I16 ishr(I16 a) {
  if constexpr (N == 0) return a;
  else {
    VS_Q(q) a.v[q] = vreinterpretq_s32_u32(vshrq_n_u32(vreinterpretq_u32_s32(a.v[q]), N));
    return a;
  }
}
template <int N>
inline I16 ishl(I16 a) {
  if constexpr (N == 0) return a;
  else {
    VS_Q(q) a.v[q] = vreinterpretq_s32_u32(vshlq_n_u32(vreinterpretq_u32_s32(a.v[q]), N));
    return a;
  }
}
inline I16 imul(I16 a, I16 b) {
  VS_Q(q) a.v[q] = vmulq_s32(a.v[q], b.v[q]);
  return a;
}
inline I16 bitselect(I16 mask, I16 a, I16 b) {  // (a & mask) | (b & ~mask), bit by bit: BSL
  VS_Q(q) a.v[q] = vbslq_s32(vreinterpretq_u32_s32(mask.v[q]), a.v[q], b.v[q]);
  return a;
}
inline I16 iload_i8(const int8_t* p) {
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
  I16 r;
  r.v[0] = vmovl_s16(vget_low_s16(lo));
  r.v[1] = vmovl_s16(vget_high_s16(lo));
  r.v[2] = vmovl_s16(vget_low_s16(hi));
  r.v[3] = vmovl_s16(vget_high_s16(hi));
  return r;
}
inline F16 as_float(I16 a) {
  F16 r;
  VS_Q(q) r.v[q] = vreinterpretq_f32_s32(a.v[q]);
  return r;
}
inline I16 as_int(F16 a) {
  I16 r;
  VS_Q(q) r.v[q] = vreinterpretq_s32_f32(a.v[q]);
  return r;
}
inline void store_i8(int8_t* p, I16 a) {  // values already within -127..127
  const int16x8_t lo = vcombine_s16(vmovn_s32(a.v[0]), vmovn_s32(a.v[1]));
  const int16x8_t hi = vcombine_s16(vmovn_s32(a.v[2]), vmovn_s32(a.v[3]));
  vst1q_s8(p, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
}
inline F16 half16(const uint16_t* p) {
  F16 r;
  VS_Q(q) r.v[q] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * q)));
  return r;
}
inline float lane(F16 a, int i) {
  alignas(16) float t[16];
  store(t, a);
  return t[i];
}
#undef VS_Q

#else
// ------------------------------------------------------------------------------------ plain C++
struct F16 {
  float x[16];
};
struct I16 {
  int32_t x[16];
};
#define VS_LANES(i) for (int i = 0; i < 16; ++i)
inline F16 zero() { return F16{}; }
inline F16 set1(float v) {
  F16 r;
  VS_LANES(i) r.x[i] = v;
  return r;
}
inline F16 load(const float* p) {
  F16 r;
  std::memcpy(r.x, p, 64);
  return r;
}
inline F16 load_n(const float* p, int n) {
  F16 r{};
  for (int i = 0; i < n && i < 16; ++i) r.x[i] = p[i];
  return r;
}
inline void store(float* p, F16 a) { std::memcpy(p, a.x, 64); }
inline void store_n(float* p, F16 a, int n) {
  for (int i = 0; i < n && i < 16; ++i) p[i] = a.x[i];
}
inline F16 load_bf16(const uint16_t* p) {
  F16 r;
  VS_LANES(i) r.x[i] = bf16_float(p[i]);
  return r;
}
inline F16 load_bf16_n(const uint16_t* p, int n) {
  F16 r{};
  for (int i = 0; i < n && i < 16; ++i) r.x[i] = bf16_float(p[i]);
  return r;
}
inline void store_bf16(uint16_t* p, F16 a) { VS_LANES(i) p[i] = bf16_bits(a.x[i]); }
inline void store_bf16_n(uint16_t* p, F16 a, int n) {
  for (int i = 0; i < n && i < 16; ++i) p[i] = bf16_bits(a.x[i]);
}
inline F16 round_bf16(F16 a) {
  VS_LANES(i) a.x[i] = bf16_float(bf16_bits(a.x[i]));
  return a;
}
inline void load_bf16_pairs(const uint16_t* p, F16& even, F16& odd) {
  VS_LANES(i) {
    even.x[i] = bf16_float(p[2 * i]);
    odd.x[i] = bf16_float(p[2 * i + 1]);
  }
}
#define VS_F2(name, expr)           \
  inline F16 name(F16 a, F16 b) {   \
    F16 r;                          \
    VS_LANES(i) {                   \
      const float x = a.x[i], y = b.x[i]; \
      r.x[i] = (expr);              \
    }                               \
    return r;                       \
  }
VS_F2(add, x + y)
VS_F2(sub, x - y)
VS_F2(mul, x * y)
VS_F2(div, x / y)
VS_F2(max, x > y ? x : y)
VS_F2(min, x < y ? x : y)
#undef VS_F2
inline F16 fma(F16 a, F16 b, F16 c) {
  VS_LANES(i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
  return c;
}
inline F16 fnma(F16 a, F16 b, F16 c) {
  VS_LANES(i) c.x[i] = std::fma(-a.x[i], b.x[i], c.x[i]);
  return c;
}
inline F16 abs(F16 a) {
  VS_LANES(i) a.x[i] = std::fabs(a.x[i]);
  return a;
}
inline F16 nearest(F16 a) {
  VS_LANES(i) a.x[i] = std::nearbyint(a.x[i]);
  return a;
}
inline F16 keep_first(F16 a, int n) {
  for (int i = n < 0 ? 0 : n; i < 16; ++i) a.x[i] = 0.0f;
  return a;
}
inline F16 zero_where_less(F16 a, F16 x, F16 lo) {
  VS_LANES(i) if (x.x[i] < lo.x[i]) a.x[i] = 0.0f;
  return a;
}
inline I16 cvt_nearest(F16 a) {
  I16 r;
  VS_LANES(i) r.x[i] = cvt_nearest_one(a.x[i]);
  return r;
}
inline F16 to_float(I16 a) {
  F16 r;
  VS_LANES(i) r.x[i] = static_cast<float>(a.x[i]);
  return r;
}
inline I16 izero() { return I16{}; }
inline I16 iset1(int32_t v) {
  I16 r;
  VS_LANES(i) r.x[i] = v;
  return r;
}
inline I16 iload(const void* p) {
  I16 r;
  std::memcpy(r.x, p, 64);
  return r;
}
inline void istore(void* p, I16 a) { std::memcpy(p, a.x, 64); }
#define VS_I2(name, expr)         \
  inline I16 name(I16 a, I16 b) { \
    I16 r;                        \
    VS_LANES(i) {                 \
      const int32_t x = a.x[i], y = b.x[i]; \
      r.x[i] = (expr);            \
    }                             \
    return r;                     \
  }
VS_I2(iadd, static_cast<int32_t>(static_cast<uint32_t>(x) + static_cast<uint32_t>(y)))
VS_I2(isub, static_cast<int32_t>(static_cast<uint32_t>(x) - static_cast<uint32_t>(y)))
VS_I2(imax, x > y ? x : y)
VS_I2(imin, x < y ? x : y)
VS_I2(iand, x & y)
VS_I2(ior, x | y)
VS_I2(ixor, x ^ y)
VS_I2(shl_lanes, static_cast<uint32_t>(y) > 31 ? 0 : static_cast<int32_t>(static_cast<uint32_t>(x) << y))
#undef VS_I2
template <int N>
inline I16 ishr(I16 a) {
  VS_LANES(i) a.x[i] = static_cast<int32_t>(static_cast<uint32_t>(a.x[i]) >> N);
  return a;
}
template <int N>
inline I16 ishl(I16 a) {
  VS_LANES(i) a.x[i] = static_cast<int32_t>(static_cast<uint32_t>(a.x[i]) << N);
  return a;
}
inline I16 imul(I16 a, I16 b) {  // the low 32 bits
  VS_LANES(i) a.x[i] = static_cast<int32_t>(static_cast<uint32_t>(a.x[i]) * static_cast<uint32_t>(b.x[i]));
  return a;
}
inline I16 bitselect(I16 mask, I16 a, I16 b) {  // (a & mask) | (b & ~mask), bit by bit
  VS_LANES(i) a.x[i] = (a.x[i] & mask.x[i]) | (b.x[i] & ~mask.x[i]);
  return a;
}
inline I16 iload_i8(const int8_t* p) {
  I16 r;
  VS_LANES(i) r.x[i] = p[i];
  return r;
}
inline F16 as_float(I16 a) {
  F16 r;
  std::memcpy(r.x, a.x, 64);
  return r;
}
inline I16 as_int(F16 a) {
  I16 r;
  std::memcpy(r.x, a.x, 64);
  return r;
}
inline void store_i8(int8_t* p, I16 a) { VS_LANES(i) p[i] = static_cast<int8_t>(a.x[i]); }
inline F16 half16(const uint16_t* p) {
  F16 r;
  VS_LANES(i) r.x[i] = half_to_float(p[i]);
  return r;
}
inline float lane(F16 a, int i) { return a.x[i]; }
#undef VS_LANES
#endif

// ------------------------------------------------------------------------------------ every tier

// The fixed reduction trees (see the top). reduce_add on x86 adds the same pairs, in the same
// operand order, with vector instructions (GCC compiled the lane loop into about thirty scalar
// extracts and adds: a third of an attention score's cost).
inline float reduce_add(F16 a) {
#if VS_VEC_AVX512 || VS_VEC_AVX2
#if VS_VEC_AVX512
  const __m256 lo = _mm512_castps512_ps256(a.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1));
#else
  const __m256 lo = a.lo, hi = a.hi;
#endif
  const __m256 s8 = _mm256_add_ps(hi, lo);                                               // t[i + 8] + t[i]
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));  // s8[i + 4] + s8[i]
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // s4[0] + s4[2], s4[1] + s4[3]
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  alignas(64) float t[16];
  store(t, a);
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = t[i + 8] + t[i];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i + 4] + s8[i];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}
// reduce_add of 16 vectors at once: lane i of the result is reduce_add(a[i]) bit for bit (the
// same pairs added in the same operand order, NaN payloads included), with the 16 trees
// transposed into each other: on x86 about 3 operations a sum instead of 8 (attention's scores).
inline F16 reduce_add16(const F16* a) {
#if VS_VEC_AVX512
  // level 1, s8 = hi + lo: vectors 2k and 2k + 1 side by side in one (their low 8 lanes, then their high)
  __m512 t[8];
  for (int k = 0; k < 8; ++k) {
    const __m512 x = a[2 * k].v, y = a[2 * k + 1].v;
    t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)));
  }
  // level 2, s4 = hi + lo: vector 4j + i's four sums in quarter i of u[j]
  __m512 u[4];
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  // level 3, s2 = lo + hi inside each quarter q: lanes 0-1 vector 8i + q's, lanes 2-3 vector 8i + 4 + q's
  __m512 v[2];
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // level 4, s2[0] + s2[1]: lane l of quarter q holds vector 4l + q's sum; put it in lane 4l + q
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i where = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(where, r)};
#elif VS_VEC_AVX2
  // level 1, s8 = hi + lo, one __m256 per vector; level 2, s4 = hi + lo: vectors 2j, 2j + 1 in u[j]
  __m256 u[8];
  for (int j = 0; j < 8; ++j) {
    const __m256 x = _mm256_add_ps(a[2 * j].hi, a[2 * j].lo), y = _mm256_add_ps(a[2 * j + 1].hi, a[2 * j + 1].lo);
    u[j] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x31), _mm256_permute2f128_ps(x, y, 0x20));
  }
  // level 3, s2 = lo + hi inside each half h: lanes 0-1 vector 4i + h's, lanes 2-3 vector 4i + 2 + h's
  __m256 v[4];
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // level 4, s2[0] + s2[1]: lane l of half h holds vector 8c + 2l + h's sum; put it in lane 2l + h
  const __m256i where = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 r[2];
  for (int c = 0; c < 2; ++c)
    r[c] = _mm256_permutevar8x32_ps(
        _mm256_add_ps(_mm256_shuffle_ps(v[2 * c], v[2 * c + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm256_shuffle_ps(v[2 * c], v[2 * c + 1], _MM_SHUFFLE(3, 1, 3, 1))),
        where);
  return {r[0], r[1]};
#else
  alignas(64) float sums[16];
  for (int i = 0; i < 16; ++i) sums[i] = reduce_add(a[i]);
  return load(sums);
#endif
}
// Lanes in order: the max is exact; with NaN lanes the order decides, and it is the same on every tier.
inline float reduce_max_in_order(F16 a) {
  alignas(64) float t[16];
  store(t, a);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = t[i] > m ? t[i] : m;
  return m;
}
// The same value, by a shuffle tree where that is certainly the same bits: no lane is NaN and the
// max is not zero (so not -0 against +0, which compare equal), else in order.
inline float reduce_max(F16 a) {
#if VS_VEC_AVX512
  if (_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q) == 0) {
    const float m = _mm512_reduce_max_ps(a.v);
    if (m != 0.0f) return m;
  }
#elif VS_VEC_AVX2
  const __m256 nan_lo = _mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), nan_hi = _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q);
  if (_mm256_movemask_ps(_mm256_or_ps(nan_lo, nan_hi)) == 0) {
    __m256 x = _mm256_max_ps(a.lo, a.hi);
    __m128 y = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    y = _mm_max_ps(y, _mm_movehl_ps(y, y));
    y = _mm_max_ss(y, _mm_movehdup_ps(y));
    const float m = _mm_cvtss_f32(y);
    if (m != 0.0f) return m;
  }
#elif VS_VEC_NEON
  const uint32x4_t ordered = vandq_u32(vandq_u32(vceqq_f32(a.v[0], a.v[0]), vceqq_f32(a.v[1], a.v[1])),
                                       vandq_u32(vceqq_f32(a.v[2], a.v[2]), vceqq_f32(a.v[3], a.v[3])));
  if (vminvq_u32(ordered) != 0) {
    const float m = vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.v[0], a.v[1]), vmaxq_f32(a.v[2], a.v[3])));
    if (m != 0.0f) return m;
  }
#endif
  return reduce_max_in_order(a);
}
// The lanes' sum modulo 2^32: the same in any order.
inline int32_t ireduce_add(I16 a) {
#if VS_VEC_AVX512
  return _mm512_reduce_add_epi32(a.v);
#elif VS_VEC_AVX2
  const __m256i x = _mm256_add_epi32(a.lo, a.hi);
  __m128i y = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  y = _mm_add_epi32(y, _mm_shuffle_epi32(y, _MM_SHUFFLE(1, 0, 3, 2)));
  y = _mm_add_epi32(y, _mm_shuffle_epi32(y, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(y);
#elif VS_VEC_NEON
  return vaddvq_s32(vaddq_s32(vaddq_s32(a.v[0], a.v[1]), vaddq_s32(a.v[2], a.v[3])));
#else
  alignas(64) int32_t t[16];
  istore(t, a);
  uint32_t s = 0;
  for (int i = 0; i < 16; ++i) s += static_cast<uint32_t>(t[i]);
  return static_cast<int32_t>(s);
#endif
}

// exp(x) in fp32 (about 2 ulp): x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite), exp(r) by its
// degree-6 Taylor polynomial in Horner form, times 2^n (n <= 127 in one exact multiply, n = 128 as
// 2^127 * 2); 0 below -87.3, exp(88.7) above 88.7. The same operations for every lane and call,
// so a row's result never depends on its neighbours.
inline F16 exp(F16 x) {
  const F16 lo = set1(-87.3f);
  const F16 orig = x;
  x = min(max(x, lo), set1(88.7f));
  const F16 n = nearest(mul(x, set1(1.44269504088896341f)));
  F16 r = fnma(n, set1(0.693359375f), x);
  r = fnma(n, set1(-2.12194440e-4f), r);
  F16 p = set1(1.0f / 720.0f);
  p = fma(p, r, set1(1.0f / 120.0f));
  p = fma(p, r, set1(1.0f / 24.0f));
  p = fma(p, r, set1(1.0f / 6.0f));
  p = fma(p, r, set1(0.5f));
  p = fma(p, r, set1(1.0f));
  p = fma(p, r, set1(1.0f));
  const I16 ni = cvt_nearest(n);  // -126 .. 128
  const I16 e1 = imin(ni, iset1(127));
  const I16 e2 = isub(ni, e1);  // 0, or 1 when n = 128
  const F16 s1 = as_float(shl_lanes(iadd(e1, iset1(127)), iset1(23)));
  const F16 s2 = as_float(shl_lanes(iadd(e2, iset1(127)), iset1(23)));
  return zero_where_less(mul(mul(p, s1), s2), orig, lo);
}

// 16 output columns (fewer at the end) of one row, stored as fp32 or rounded to bf16; t + bias.
inline void store_columns(void* y, bool out_bf16, int64_t offset, F16 v, int n_valid) {
  if (out_bf16)
    store_bf16_n(static_cast<uint16_t*>(y) + offset, v, n_valid);
  else
    store_n(static_cast<float*>(y) + offset, v, n_valid);
}
inline F16 plus_bias(const float* bias, int64_t n0, int n_valid, F16 t) {
  return bias ? add(t, load_n(bias + n0, n_valid)) : t;
}

}  // namespace vec
}  // namespace verispec
