// Shared pieces of verispec's linear kernels (w8a8.cpp: int8 weights, q4k.cpp: GGUF Q4_K weights,
// both times activations quantised to int8; bf16.cpp: bf16 weights times bf16 activations;
// attention.cpp: batch-invariant attention; layer_ops.cpp: norms, RoPE, SwiGLU): the AMX tile plumbing, the argument
// block the kernels take, and the entry points that bindings.cpp calls. No torch header here: the
// kernels see raw pointers only, so they compile in seconds and read as plain C++.
//
// Conventions: the weight matrix W is [N, K] (N output features, K input features), activations
// x are [M, K] row-major, y = x @ W.T + bias is [M, N] (fp32 or bf16), and outputs are produced
// 16 columns (= 16 weight rows, one packed row block) at a time. Each entry point computes the
// output columns of row blocks [begin, end) for all M rows of x; bindings.cpp splits the blocks
// among threads.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace verispec {

constexpr int kRows = 16;  // weight rows (= output columns) per packed block, and the most rows of an A tile

// GCC 12's AMX intrinsics are inline asm that under-declare their memory effects: ldtilecfg is
// told it reads 8 of the config's 64 bytes and tileloadd that it reads no memory at all, so the
// optimiser may drop or sink the stores that fill a config or a tile buffer. These say "memory".
#define VS_TILE_LOADCONFIG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(cfg)) : "memory")
#define VS_TILE_LOADD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(base)), "r"((long)(stride)) : "memory")

// The 64-byte operand of LDTILECFG (Intel SDM vol. 1, 18.2): palette 1, per tile its rows and
// bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads a tile configuration: (rows, bytes per row) of tiles tmm0 .. tmm7.
struct TileShape {
  int rows, colsb;
};
inline void configure_tiles(const std::array<TileShape, 8>& shapes) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(shapes[t].rows);
    cfg.colsb[t] = static_cast<uint16_t>(shapes[t].colsb);
  }
  VS_TILE_LOADCONFIG(&cfg);
}

// The instances of a kernel templated on its row count R = 1 .. N, indexed by R - 1:
// make(std::integral_constant<int, R>) returns &kernel<R> (a constexpr table, no switch per kernel).
template <int N, typename Make, int... I>
constexpr auto rows_table_of(Make make, std::integer_sequence<int, I...>) {
  return std::array{make(std::integral_constant<int, I + 1>{})...};
}
template <int N, typename Make>
constexpr auto rows_table(Make make) {
  return rows_table_of<N>(make, std::make_integer_sequence<int, N>{});
}
// table[rows - 1], or null outside 1 .. N.
template <typename Fn, std::size_t N>
inline Fn pick_rows(const std::array<Fn, N>& table, int64_t rows) {
  return rows >= 1 && rows <= static_cast<int64_t>(N) ? table[rows - 1] : nullptr;
}

// bf16 <-> fp32 for 16 lanes: a bf16 is the top half of the fp32 with the same value.
inline __m512 widen_bf16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 widen_bf16_masked(const uint16_t* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 round_to_bf16(__m512 v) {  // to the nearest bf16 (even on ties), back in fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// exp(x) in fp32 (about 2 ulp): x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite), exp(r) by its
// degree-6 Taylor polynomial in Horner form, times 2^n; 0 below -87.3, exp(88.7) above 88.7. The
// same instructions for every lane and call, so a row's result never depends on its neighbours.
inline __m512 exp_fp32(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.7f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_scalef_ps(p, n));
}

// Linux hands out the AMX tile-data state only to processes that ask (arch_prctl
// ARCH_REQ_XCOMP_PERM, XTILEDATA); false when the CPU or the kernel refuses.
bool amx_permitted();

// y[m][n0 .. n0+15] = v (+ nothing else); columns >= n_valid are not written.
inline void store_columns(void* y, bool out_bf16, int64_t offset, __m512 v, int n_valid) {
  const __mmask16 mask = n_valid >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n_valid) - 1);
  if (out_bf16)
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + offset, mask, (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_mask_storeu_ps(static_cast<float*>(y) + offset, mask, v);
}

// What the kernels are given: the packed weights and the activations quantised by w8a8_quantize.
struct W8A8Args {
  const uint8_t* w;       // packed weights (layout of the kernel's format)
  const float* wscale;    // int8: [N rounded up to 16] per-row weight scales (zero-padded); Q4_K: null
  const int8_t* xq;       // [M, K] quantised activations
  const float* xscale;    // [M, ceil(K / 64)] activation scales per block of 64 inputs
  const int32_t* xsum;    // [M, K / 32] sums of xq[m][k] over each 32 inputs
  const float* xmin;      // Q4_K: [M, K / 32] float(xsum) * the activation scale of its block; else null
  const float* bias;      // [N] fp32, or null
  void* y;                // [M, N] fp32 or bf16
  int64_t M, N, K;
  bool out_bf16;
};
constexpr int kW8A8Block = 64;  // inputs per activation block (one scale each)
void w8a8_quantize(const void* x, bool bf16, int64_t k, int8_t* xq, float* scale, int32_t* sum, int64_t begin,
                   int64_t end);

// Which instructions a kernel uses: by the number of rows (auto), or forced (for the tests).
constexpr int kEngineAuto = 0, kEngineVnni = 1, kEngineAmx = 2;

// ---- per-channel int8 weights (w8a8.cpp)
bool w8a8_uses_amx(int64_t m, int engine);
void w8a8_pack(const int8_t* q, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end);
void w8a8_linear(const W8A8Args& a, int64_t begin, int64_t end, int engine);

// ---- GGUF Q4_K weights (q4k.cpp)
constexpr int kQ4KSuper = 256;    // inputs per super-block
constexpr int kQ4KBlock = 144;    // bytes of one GGUF block_q4_K
constexpr int kQ4KRecord = 2304;  // bytes of one packed record: 16 rows x one super-block
void q4k_pack(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end);
void q4k_dequantize(const uint8_t* packed, int64_t k, float* w, int64_t begin, int64_t end);
bool q4k_uses_amx(int64_t m, int engine);
void q4k_linear(const W8A8Args& a, int64_t begin, int64_t end, int engine);

// ---- attention one query row at a time (attention.cpp)
struct AttnArgs {
  const void* q;        // [B, T, H, D] contiguous
  const void* k;        // keys of row b, kv head h, position j at b * k_sb + h * k_sh + j * D
  const void* v;        // values, likewise with v_sb, v_sh
  int64_t k_sb, k_sh, v_sb, v_sh;
  const uint8_t* visible;  // [B, T, span]: 1 where the query of (b, t) may see position j
  void* out;            // [B, T, H, D] contiguous, q's dtype
  int64_t B, T, H, Hkv, D, span;
  float scale;
  bool bf16;            // q, k, v and out are bf16 (else fp32)
};
void attention_rows(const AttnArgs& a, int64_t begin, int64_t end);  // rows (b * T + t) * H + h

// ---- the small operations between the projections, bf16 (layer_ops.cpp); rows [begin, end)
// h [M, C] (+= delta when delta is not null, in place), y = RMSNorm(h) * w
void rms_norm_rows(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* y, int64_t c, float eps,
                   int64_t begin, int64_t end);
// x [M, heads * d] (row stride x_stride), cos / sin [M, d] -> y [M, heads, d] (rotate-half RoPE)
void rotary_rows(const uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin, uint16_t* y,
                 int64_t heads, int64_t d, int64_t begin, int64_t end);
// gate, up [M, f] (row stride `stride`) -> y [M, f] = silu(gate) * up
void silu_mul_rows(const uint16_t* gate, const uint16_t* up, int64_t stride, uint16_t* y, int64_t f, int64_t begin,
                   int64_t end);

// ---- bf16 weights (bf16.cpp)
struct Bf16Args {
  const uint16_t* w;  // packed bf16 weights (bf16.cpp's layout)
  const uint16_t* x;  // [M, K] bf16 activations
  const float* bias;  // [N] fp32, or null
  void* y;            // [M, N] fp32 or bf16
  int64_t M, N, K;
  bool out_bf16;
};
constexpr int kBf16Align = 32;  // K must be a multiple of this (one AMX step)
void bf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed, int64_t begin, int64_t end);
void bf16_linear(const Bf16Args& a, int64_t begin, int64_t end);

}  // namespace verispec
