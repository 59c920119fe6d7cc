// The amx tier's shared pieces: AMX tile plumbing, and the AVX-512 helpers its tile kernels
// (w8a8.cpp, q4k.cpp, bf16.cpp) use around the tiles. The tier's other operations (few-row int8 /
// Q4_K calls, attention, the layer operations, packing) are vec/'s, compiled with AVX-512.
#pragma once

#include <immintrin.h>

#include "../common.h"
#include "../vec/vec.h"

namespace verispec {

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

// y of 16 output columns (n_valid at the end) of one row from its fp32 sums: vec.h's stores
// (bf16 rounding as torch rounds), so the tile kernels store what the vector kernels store.
inline void store_columns(void* y, bool out_bf16, int64_t offset, __m512 v, int n_valid) {
  vec::store_columns(y, out_bf16, offset, vec::F16{v}, n_valid);
}

}  // namespace verispec
