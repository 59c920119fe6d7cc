// The integer dot products of the int8 and Q4_K kernels, one implementation per instruction set:
// for the 16 weight rows of a packed group (one per 32-bit lane, 4 consecutive inputs each) and
// R activation rows, exact int32 sums of weight code x activation code. Integer sums are exact
// in any order, so every implementation returns the same integers:
//   - AVX-512 VNNI: VPDPBUSD (unsigned weight byte x signed activation byte, 4 per lane);
//   - AVX2 with AVX-VNNI (the avx2vnni tier): VPDPBUSD on 256 bits, each 64-byte group as two
//     halves of 8 rows;
//   - AVX2: VPMADDUBSW (pairs of unsigned x signed bytes into int16) then VPMADDWD by ones into
//     int32; the int8 weights go through |q| and sign(p, q) so that no int16 pair sum saturates
//     (at most 2 * 128 * 127 = 32512), the 4-bit codes need nothing (2 * 15 * 127 = 3810, and up
//     to 8 groups are summed in int16 before widening: 30480);
//   - ARM NEON with the dot product extension: SDOT (signed byte x signed byte, 4 per lane, on
//     four 128-bit registers per 16 lanes); the int8 weights flipped back to signed (u ^ 0x80 = q),
//     so no offset to take off;
//   - plain C++: the sums as written.
#pragma once

#include "vec.h"

namespace verispec {
namespace vec {

// How far ahead of its reads the int8 kernel prefetches its weight stream. With up to 8 activation
// rows a 64-byte weight line takes ~4 cycles of VPDPBUSD, so a prefetch 2 KB ahead was issued only
// ~40 ns before its use, less than a memory read takes: an 8-row pass over a [8960 x 1536] int8
// matrix took 0.38-0.42 ms against 0.33-0.34 ms with 8 KB (benchmarks/kernel_stream.py, 2 threads,
// Zen 5; one row: the same). Prefetches never fault: past a row block they fetch the next one,
// which comes next anyway. On the tiers only Intel CPUs run by default (amx; avx512 and avx2vnni:
// the AMD CPUs with their flags also have AVX-512 BF16 and run avx512bf16) one-row calls prefetch
// 1 KiB ahead: on an Intel Xeon with AMX a one-row pass over the same matrix took 0.444 ms against
// 0.531 with 8 KiB (512 B 0.466, 1.5 KiB 0.463, 2 KiB 0.550, 4 KiB 0.624; 8 rows with 1 KiB: 0.756
// against 0.634, so they keep 8 KiB), on its avx512 tier 0.424-0.437 against 0.485-0.499, on
// avx2vnni 0.458-0.460 against 0.470 (benchmarks/kernel_stream.py, 2 threads).
#if defined(VS_TIER_AMX) || defined(VS_TIER_AVX512) || defined(VS_TIER_AVX2VNNI)
constexpr bool kIntelTier = true;  // (the distances below differ there)
#else
constexpr bool kIntelTier = false;
#endif
template <int R>
constexpr int kInt8PrefetchBytes = kIntelTier && R == 1 ? 1024 : 8192;

// How far ahead of a Q4_K record's quarter its prefetches reach (vec/linear.cpp): two whole
// records (Zen 4: linear.cpp), and half a record on the Intel tiers: an Intel Xeon with AMX
// took a [8960 x 1536] matrix at 1 / 4 / 6 / 8 rows in 0.270 / 0.332 / 0.391 / 0.417 ms with 1152
// bytes against 0.282 / 0.372 / 0.423 / 0.478 with two records (576 bytes: 0.292 / 0.345 / 0.395 /
// 0.416; into L1 instead of L2, 1152 bytes: 0.275 / 0.338 / 0.381 / 0.411; kernel_stream.py); on
// its avx512 tier, 1 / 4 / 8 rows 0.266-0.268 / 0.329-0.334 / 0.407-0.423 against 0.275-0.282 /
// 0.361-0.367 / 0.465-0.474, on avx2vnni 0.266-0.267 / 0.478-0.483 / 0.92-0.95 against 0.334-0.335
// / 0.618-0.625 / 1.07-1.11. (Measured on that Sapphire Rapids-class core: not on an Ice Lake, nor
// on an Alder Lake, whose P-cores are the same Golden Cove with a client's memory.)
constexpr int kQ4KPrefetchAhead = kIntelTier ? 1152 : 2 * kQ4KRecord;

// Where the weight prefetches of every vector kernel (int8, Q4_K, bf16) put the lines: L2
// (PREFETCHT1; the hardware brings them on into L1 as the loads come). Into L1 (PREFETCHT0), a
// kernel with several activation rows, bound by its multiplies, lost a quarter of its speed to
// the misses each prefetch held in the load pipe. [8960 x 1536] matrices streamed from memory,
// 8 rows, 2 threads, Zen 4 (benchmarks/kernel_stream.py, medians of interleaved runs, L1 -> L2):
// int8 0.67 -> 0.53 ms, bf16 1.28 -> 1.21 ms, Q4_K (with its prefetches spread over the record,
// linear.cpp) 0.66 -> 0.41 ms; one row: the same within the host's noise, except int8, whose
// one-row calls keep L1 (whole one-row int8 passes of the 1.5B, L2 / L1: 1.09, 1.09; R = 1 back
// to L1: 0.99 of that; benchmarks/kernels_ab.py).
constexpr int kPrefetchLocality = 2;
template <int R>
constexpr int kInt8PrefetchLocality = R == 1 ? 3 : kPrefetchLocality;  // (3: L1)

#if VS_VEC_AVX512
// acc += VPDPBUSD(w, the activation word *x broadcast to every lane), the broadcast folded into
// the instruction's memory operand (GCC emits a separate VPBROADCASTD for _mm512_set1_epi32).
inline void dpbusd_bcast(__m512i& acc, __m512i w, const int32_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
}
#endif

#if VS_VEC_DPBF16
// acc += VDPBF16PS(w, the activation pair at x broadcast to every lane): per lane, the product of
// the pairs' high (odd-input) halves and then that of their low (even-input) halves, each added
// with one rounding to nearest even (an FMA: a bf16 x bf16 product is exact), bf16 inputs and
// fp32 sums that are denormal counting as zero, whatever MXCSR says (the instruction's documented
// semantics; measured on Zen 4 against that emulation, 3.2 million random lanes and the denormal
// cases, all equal). The pair is read as one 32-bit word.
inline __m512 dpbf16_bcast(__m512 acc, __m512i w, const uint16_t* x) {
  uint32_t pair;
  std::memcpy(&pair, x, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)));
}
#endif

#if VS_VEC_AVX512
// int8_groups below for a known number of groups G (16: a whole activation block; 8: the last
// half block when K % 64 = 32), its loops unrolled whole so that the accumulators stay in
// registers (with a loop count known only at run time, GCC kept them on the stack: a load and a
// store around every VPDPBUSD, which made an eight-row pass a third slower on Zen 5).
template <int R, int G>
inline __attribute__((always_inline)) void int8_groups_fixed(const uint8_t* w, const int32_t* xw,
                                                             const int32_t* psum, I16* s) {
  __m512i acc[R];
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
    __builtin_prefetch(w + g * 64 + kInt8PrefetchBytes<R>, 0, kInt8PrefetchLocality<R>);
    const __m512i v = _mm512_loadu_si512(w + g * 64);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) dpbusd_bcast(acc[m], v, xw + g * R + m);
  }
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m)  // sum u p = sum q p + 128 sum p: take the second term off
    s[m].v = _mm512_add_epi32(s[m].v, _mm512_sub_epi32(acc[m], _mm512_set1_epi32(128 * psum[m])));
}
#elif VS_VEC_AVX2 && defined(__AVXVNNI__)
// The same on 256 bits: weight rows 0-7 (the first 32 bytes of each group), then 8-15.
template <int R, int G>
inline __attribute__((always_inline)) void int8_groups_fixed(const uint8_t* w, const int32_t* xw,
                                                             const int32_t* psum, I16* s) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256i acc[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      __builtin_prefetch(w + g * 64 + 32 * h + kInt8PrefetchBytes<R>, 0, kInt8PrefetchLocality<R>);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32 * h));
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) acc[m] = _mm256_dpbusd_avx_epi32(acc[m], v, _mm256_set1_epi32(xw[g * R + m]));
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {  // sum u p = sum q p + 128 sum p: take the second term off
      __m256i& half = h ? s[m].hi : s[m].lo;
      half = _mm256_add_epi32(half, _mm256_sub_epi32(acc[m], _mm256_set1_epi32(128 * psum[m])));
    }
  }
}
#endif

// int8 weights stored offset to unsigned, u = q + 128, in groups of 64 bytes (byte 4r + j: row
// r, input j of the group's 4). s[m] += sum over `groups` (16, or 8 for a last half block) groups
// g of q[r][4g + j] * p_m[4g + j], with p_m's word g (4 activation codes) at xw[g * R + m]
// (common.h's interleaved rows) and psum[m] the sum of those codes.
template <int R>
inline void int8_groups(const uint8_t* w, int64_t groups, const int32_t* xw, const int32_t* psum, I16* s) {
#if VS_VEC_AVX512 || (VS_VEC_AVX2 && defined(__AVXVNNI__))
  if (groups == 16)
    int8_groups_fixed<R, 16>(w, xw, psum, s);
  else
    int8_groups_fixed<R, 8>(w, xw, psum, s);
#elif VS_VEC_AVX2
  (void)psum;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {  // weight rows 0-7, then 8-15
    __m256i acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups; ++g) {
      __builtin_prefetch(w + g * 64 + 32 * h + kInt8PrefetchBytes<R>, 0, kInt8PrefetchLocality<R>);
      const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32 * h)), flip);
      const __m256i mag = _mm256_abs_epi8(q);
      for (int m = 0; m < R; ++m) {
        const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(xw[g * R + m]), q);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, signed_x), ones));
      }
    }
    for (int m = 0; m < R; ++m) {
      __m256i& half = h ? s[m].hi : s[m].lo;
      half = _mm256_add_epi32(half, acc[m]);
    }
  }
#elif VS_VEC_NEON
  (void)psum;
  const int8x16_t flip = vdupq_n_s8(-128);
  int32x4_t acc[R][4];
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) acc[m][i] = vdupq_n_s32(0);
  for (int64_t g = 0; g < groups; ++g) {
    int8x16_t q[4];  // q[i]: weight rows 4i .. 4i + 3, 4 inputs each
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) q[i] = veorq_s8(vreinterpretq_s8_u8(vld1q_u8(w + g * 64 + 16 * i)), flip);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const int8x16_t x = vreinterpretq_s8_s32(vld1q_dup_s32(xw + g * R + m));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[m][i] = vdotq_s32(acc[m][i], q[i], x);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) s[m].v[i] = vaddq_s32(s[m].v[i], acc[m][i]);
#else
  (void)psum;
  for (int m = 0; m < R; ++m) {
    for (int r = 0; r < 16; ++r) {
      int32_t t = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* p = reinterpret_cast<const int8_t*>(xw + g * R + m);
        for (int j = 0; j < 4; ++j) t += (static_cast<int32_t>(w[g * 64 + 4 * r + j]) - 128) * p[j];
      }
      s[m].x[r] += t;
    }
  }
#endif
}

#if VS_VEC_AVX2 && !defined(__AVXVNNI__)
// acc += x in int16 lanes, in acc's register (GCC otherwise added into x's register and copied
// the sum back, one extra instruction per multiply).
inline void add16_into(__m256i& acc, __m256i x) { __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(x)); }

// q4k_pair's plain AVX2 body for the N activation rows from m0 of a chunk of R: VPMADDUBSW (code x
// activation byte, pairs summed in int16) into int16 accumulators, at most 8 groups x 2 x 15 x 127
// = 30480 in magnitude (no saturation), widened to int32 once by VPMADDWD with ones.
template <int R, int N>
inline __attribute__((always_inline)) void q4k_avx2_rows(const __m256i (&nib)[8][4], const int32_t* xw, int m0,
                                                         I16* s0, I16* s1) {
  // The accumulators start as group 0's products rather than zeros plus them: 8 of 64 adds fewer
  // (8-row Q4_K [256 x 1536] in L2, one thread, Zen 4: 1.48-1.53 -> 1.58-1.60 G groups/s;
  // benchmarks/kernel_stream.cpp)
  __m256i acc[N][4];
#pragma GCC unroll 2
  for (int n = 0; n < N; ++n) {
    const __m256i lo = _mm256_set1_epi32(xw[m0 + n]), hi = _mm256_set1_epi32(xw[8 * R + m0 + n]);
    acc[n][0] = _mm256_maddubs_epi16(nib[0][0], lo);
    acc[n][1] = _mm256_maddubs_epi16(nib[0][1], hi);
    acc[n][2] = _mm256_maddubs_epi16(nib[0][2], lo);
    acc[n][3] = _mm256_maddubs_epi16(nib[0][3], hi);
  }
  // (not unrolled: unrolled, GCC reassociated the int16 sums, computed every product first and
  // spilled them to the stack)
#pragma GCC unroll 1
  for (int g = 1; g < 8; ++g)
#pragma GCC unroll 2
    for (int n = 0; n < N; ++n) {
      const __m256i lo = _mm256_set1_epi32(xw[g * R + m0 + n]), hi = _mm256_set1_epi32(xw[(8 + g) * R + m0 + n]);
      add16_into(acc[n][0], _mm256_maddubs_epi16(nib[g][0], lo));
      add16_into(acc[n][1], _mm256_maddubs_epi16(nib[g][1], hi));
      add16_into(acc[n][2], _mm256_maddubs_epi16(nib[g][2], lo));
      add16_into(acc[n][3], _mm256_maddubs_epi16(nib[g][3], hi));
    }
  const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 2
  for (int n = 0; n < N; ++n) {
    s0[m0 + n].lo = _mm256_madd_epi16(acc[n][0], ones);
    s1[m0 + n].lo = _mm256_madd_epi16(acc[n][1], ones);
    s0[m0 + n].hi = _mm256_madd_epi16(acc[n][2], ones);
    s1[m0 + n].hi = _mm256_madd_epi16(acc[n][3], ones);
  }
}
#endif

// Q4_K: 8 groups of 64 bytes, byte 4r + j of group g holding the codes of two sub-blocks of row
// r (low nibble: input 4g + j of the first, high nibble: of the second). For row m with words
// words g = 0..7 (first sub-block's activation codes) and 8..15 (second's), word g at
// xw[g * R + m] (common.h's interleaved rows): s0[m] = sum of the low codes x activations,
// s1[m] = the high ones.
template <int R>
inline void q4k_pair(const uint8_t* q, const int32_t* xw, I16* s0, I16* s1) {
#if VS_VEC_AVX512
  constexpr int U = R <= 2 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i acc0[R][U], acc1[R][U];
  for (int m = 0; m < R; ++m)
    for (int u = 0; u < U; ++u) acc0[m][u] = acc1[m][u] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int g = 0; g < 8; g += U) {
    __m512i lo[U], hi[U];
    for (int u = 0; u < U; ++u) {
      const __m512i v = _mm512_loadu_si512(q + 64 * (g + u));
      lo[u] = _mm512_and_si512(v, nibble);
      hi[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    for (int m = 0; m < R; ++m)
      for (int u = 0; u < U; ++u) {
        dpbusd_bcast(acc0[m][u], lo[u], xw + (g + u) * R + m);
        dpbusd_bcast(acc1[m][u], hi[u], xw + (8 + g + u) * R + m);
      }
  }
  for (int m = 0; m < R; ++m) {
    __m512i a = acc0[m][0], b = acc1[m][0];
    for (int u = 1; u < U; ++u) {
      a = _mm512_add_epi32(a, acc0[m][u]);
      b = _mm512_add_epi32(b, acc1[m][u]);
    }
    s0[m].v = a;
    s1[m].v = b;
  }
#elif VS_VEC_AVX2 && defined(__AVXVNNI__)
  const __m256i nibble = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // weight rows 0-7, then 8-15
    __m256i acc0[R], acc1[R];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) acc0[m] = acc1[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g + 32 * h));
      const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        acc0[m] = _mm256_dpbusd_avx_epi32(acc0[m], lo, _mm256_set1_epi32(xw[g * R + m]));
        acc1[m] = _mm256_dpbusd_avx_epi32(acc1[m], hi, _mm256_set1_epi32(xw[(8 + g) * R + m]));
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      (h ? s0[m].hi : s0[m].lo) = acc0[m];
      (h ? s1[m].hi : s1[m].lo) = acc1[m];
    }
  }
#elif VS_VEC_AVX2
  if constexpr (R == 1) {  // one row: each half's codes split where they are used
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {  // weight rows 0-7, then 8-15
      __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();  // int16 pair sums
      for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g + 32 * h));
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        acc0 = _mm256_add_epi16(acc0, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xw[g])));
        acc1 = _mm256_add_epi16(acc1, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xw[8 + g])));
      }
      (h ? s0[0].hi : s0[0].lo) = _mm256_madd_epi16(acc0, ones);
      (h ? s1[0].hi : s1[0].lo) = _mm256_madd_epi16(acc1, ones);
    }
  } else {
    // Several rows: the record's codes split once into nibbles, nib[g] = {low codes of rows 0-7,
    // high of rows 0-7, low of rows 8-15, high of rows 8-15} of group g, then two activation rows
    // at a time multiply all four (q4k_avx2_rows): each activation word is broadcast once per
    // group instead of once per half, and no accumulator leaves the registers. Whole passes of the
    // 1.5B against splitting per half (benchmarks/kernels_ab.py, avx2 tier forced on Zen 5): T = 2
    // 0.88x, T = 3 0.76x, T = 5 0.96x the time; two rows are now memory-bound, and from three on
    // the multiplier pipes bound both (VPMADDUBSW, VPMADDWD and the fp32 epilogue share them).
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i nib[8][4];
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g + 32));
      nib[g][0] = _mm256_and_si256(v0, nibble);
      nib[g][1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
      nib[g][2] = _mm256_and_si256(v1, nibble);
      nib[g][3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
    }
#pragma GCC unroll 8
    for (int m0 = 0; m0 + 1 < R; m0 += 2) q4k_avx2_rows<R, 2>(nib, xw, m0, s0, s1);
    if constexpr (R % 2 == 1) q4k_avx2_rows<R, 1>(nib, xw, R - 1, s0, s1);
  }
#elif VS_VEC_NEON
  const uint8x16_t nibble = vdupq_n_u8(0x0F);
  for (int h = 0; h < 2; ++h) {  // weight rows 0-7 (registers 0, 1 of a lane quad), then 8-15
    int32x4_t acc0[R][2], acc1[R][2];
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) acc0[m][i] = acc1[m][i] = vdupq_n_s32(0);
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      int8x16_t lo[2], hi[2];
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        const uint8x16_t v = vld1q_u8(q + 64 * g + 32 * h + 16 * i);
        lo[i] = vreinterpretq_s8_u8(vandq_u8(v, nibble));
        hi[i] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
      }
#pragma GCC unroll 16
      for (int m = 0; m < R; ++m) {
        const int8x16_t xl = vreinterpretq_s8_s32(vld1q_dup_s32(xw + g * R + m));
        const int8x16_t xh = vreinterpretq_s8_s32(vld1q_dup_s32(xw + (8 + g) * R + m));
#pragma GCC unroll 2
        for (int i = 0; i < 2; ++i) {
          acc0[m][i] = vdotq_s32(acc0[m][i], lo[i], xl);
          acc1[m][i] = vdotq_s32(acc1[m][i], hi[i], xh);
        }
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m)
#pragma GCC unroll 2
      for (int i = 0; i < 2; ++i) {
        s0[m].v[2 * h + i] = acc0[m][i];
        s1[m].v[2 * h + i] = acc1[m][i];
      }
  }
#else
  for (int m = 0; m < R; ++m) {
    for (int r = 0; r < 16; ++r) {
      int32_t a = 0, b = 0;
      for (int g = 0; g < 8; ++g) {
        const int8_t* lo = reinterpret_cast<const int8_t*>(xw + g * R + m);
        const int8_t* hi = reinterpret_cast<const int8_t*>(xw + (8 + g) * R + m);
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = q[64 * g + 4 * r + j];
          a += (byte & 15) * lo[j];
          b += (byte >> 4) * hi[j];
        }
      }
      s0[m].x[r] = a;
      s1[m].x[r] = b;
    }
  }
#endif
}

// Q6_K: the exact sums, lane r (weight row r), over the 4 groups of 64 bytes code[g] (byte 4r + c:
// row r's 6-bit code 0..63 of the group's input c) times activation row m's words g at
// xw[g * R + m] (common.h's interleaved rows), for one row m (the caller folds each row's sums in
// before the next: an 8-row chunk's sums all live at once spilled registers). The codes are
// unsigned bytes below 64: VPDPBUSD and VPMADDUBSW take them as they are (a pair of products at
// most 2 x 63 x 127 = 16002, two groups 32004 in int16: no saturation), and SDOT as positive
// signed bytes.
template <int R>
inline I16 u6_dot(const I16 (&code)[4], const int32_t* xw, int m) {
  I16 s;
#if VS_VEC_AVX512
  __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) dpbusd_bcast(acc, code[g].v, xw + g * R + m);
  s.v = acc;
#elif VS_VEC_AVX2 && defined(__AVXVNNI__)
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const __m256i x = _mm256_set1_epi32(xw[g * R + m]);
    lo = _mm256_dpbusd_avx_epi32(lo, code[g].lo, x);
    hi = _mm256_dpbusd_avx_epi32(hi, code[g].hi, x);
  }
  s.lo = lo;
  s.hi = hi;
#elif VS_VEC_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i x0 = _mm256_set1_epi32(xw[m]), x1 = _mm256_set1_epi32(xw[R + m]);
  const __m256i x2 = _mm256_set1_epi32(xw[2 * R + m]), x3 = _mm256_set1_epi32(xw[3 * R + m]);
  auto half = [&](__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
    const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(c0, x0), _mm256_maddubs_epi16(c1, x1));
    const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(c2, x2), _mm256_maddubs_epi16(c3, x3));
    return _mm256_add_epi32(_mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones));
  };
  s.lo = half(code[0].lo, code[1].lo, code[2].lo, code[3].lo);
  s.hi = half(code[0].hi, code[1].hi, code[2].hi, code[3].hi);
#elif VS_VEC_NEON
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    int32x4_t acc = vdupq_n_s32(0);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g)
      acc = vdotq_s32(acc, vreinterpretq_s8_s32(code[g].v[q]), vreinterpretq_s8_s32(vld1q_dup_s32(xw + g * R + m)));
    s.v[q] = acc;
  }
#else
  for (int r = 0; r < 16; ++r) {
    int32_t t = 0;
    for (int g = 0; g < 4; ++g) {
      uint8_t c[4];
      int8_t p[4];
      std::memcpy(c, &code[g].x[r], 4);
      std::memcpy(p, xw + g * R + m, 4);
      for (int j = 0; j < 4; ++j) t += c[j] * p[j];
    }
    s.x[r] = t;
  }
#endif
  return s;
}

}  // namespace vec
}  // namespace verispec
