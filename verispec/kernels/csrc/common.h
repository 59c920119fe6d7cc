// Shared pieces of verispec's weight-only-quantised linear kernels (see q4k.cpp and int8.cpp):
// AMX tile setup, the argument block every kernel takes, and the kernel entry points that
// bindings.cpp calls. No torch header here: the kernels see raw pointers only, so they compile
// in seconds and read as plain C++.
//
// Conventions: the weight matrix W is [N, K] (N output features, K input features), activations
// x are bf16 [M, K] row-major, y = x @ W.T + bias is [M, N] (fp32 or bf16), and outputs are
// produced 16 columns (= 16 weight rows) at a time. Each entry point computes the output columns
// of weight-row blocks [begin, end) for all M rows of x; bindings.cpp splits the blocks among
// threads.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace verispec {

constexpr int kRows = 16;  // weight rows (= output columns) per tile, and the most rows of an A tile

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

// The tiles every kernel uses:
//   tmm0, tmm1: C, [R x 16] fp32 (R activation rows x 16 output columns)
//   tmm2, tmm3: A, [R x 32] bf16 (R activation rows x 32 inputs), read straight from x
//   tmm4, tmm5: B, [16 x 32] bf16 in VNNI order: row p holds inputs (2p, 2p+1) of 16 weight rows
// TDPBF16PS C += A . B then gives C[m][n] += sum over 32 inputs k of x[m][k] * w[n][k].
inline void configure_tiles(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = kRows;
    cfg.colsb[t] = 64;
  }
  VS_TILE_LOADCONFIG(&cfg);
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

// What every kernel is given. x holds `rows` activation rows, a multiple of 16 when there are
// more than 16 (bindings.cpp pads), of which the first M are real; y is [M, N].
struct LinearArgs {
  const uint8_t* w;    // packed weights (layout of the kernel's format)
  const float* scale;  // int8: [N_padded] per-row scales; unused by Q4_K
  const uint16_t* x;   // bf16 [rows, K]
  const float* xsum;   // Q4_K: [rows, K/32] fp32 sums of each 32-input sub-block of x; else null
  const float* bias;   // [N] fp32, or null
  void* y;             // [M, N] fp32 or bf16
  int64_t M, rows, N, K;
  bool out_bf16;
};

// ---- Q4_K (q4k.cpp)
constexpr int kQ4KSuper = 256;    // inputs per super-block
constexpr int kQ4KBlock = 144;    // bytes of one GGUF block_q4_K
constexpr int kQ4KRecord = 2304;  // bytes of one packed record: 16 rows x one super-block
void q4k_pack(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end);
void q4k_dequantize(const uint8_t* packed, int64_t k, float* w, int64_t begin, int64_t end);
void q4k_linear(const LinearArgs& a, int64_t begin, int64_t end);
void subblock_sums(const uint16_t* x, int64_t rows, int64_t k, float* xsum);

// ---- per-channel int8 (int8.cpp)
void int8_pack(const int8_t* q, int64_t n, int64_t k, int8_t* packed, int64_t begin, int64_t end);
void int8_linear(const LinearArgs& a, int64_t begin, int64_t end);

}  // namespace verispec
