// The packed weight layouts (the same on every tier; see amx/w8a8.cpp, amx/q4k.cpp and
// amx/bf16.cpp for what they hold and why), the exact Q4_K dequantiser the tests check the
// packing with, and the memory bandwidth probe.
#include "common.h"
#include "q4k_scales.h"

namespace verispec {

// int8 [n, k] row-major -> packed row blocks [begin, end): byte 4r + j of group g is
// q[16 nb + r][4g + j] + 128 (rows past n hold q = 0).
void w8a8_pack(const int8_t* q, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end) {
  const int64_t groups = k / 4;
  for (int64_t nb = begin; nb < end; ++nb)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* dst = packed + (nb * groups + g) * 64;
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = nb * kRows + r;
        for (int j = 0; j < 4; ++j)  // q + 128 as an unsigned byte is q with its top bit flipped
          dst[4 * r + j] = static_cast<uint8_t>((row < n ? static_cast<uint8_t>(q[row * k + 4 * g + j]) : 0) ^ 0x80);
      }
    }
}

// GGUF blocks [n, ceil(k / 256) * 144] -> records of row blocks [begin, end) (a half record last
// when k % 256 = 128: common.h).
void q4k_pack(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end) {
  const int64_t nsb = (k + kQ4KSuper - 1) / kQ4KSuper;
  for (int64_t nb = begin; nb < end; ++nb)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const int quarters = q4k_quarters(k, sb);
      uint8_t* rec = packed + nb * q4k_row_block_bytes(k) + sb * kQ4KRecord;
      std::memset(rec, 0, kQ4KHeader + 512 * quarters);
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = nb * kRows + r;
        if (row >= n) break;  // padding rows stay zero
        const uint8_t* blk = blocks + (row * nsb + sb) * kQ4KBlock;
        std::memcpy(rec + 2 * r, blk, 2);           // d
        std::memcpy(rec + 32 + 2 * r, blk + 2, 2);  // dmin
        for (int word = 0; word < 3; ++word) std::memcpy(rec + 64 + 64 * word + 4 * r, blk + 4 + 4 * word, 4);
        const uint8_t* qs = blk + 16;
        for (int i = 0; i < quarters; ++i)
          for (int g = 0; g < 8; ++g)
            std::memcpy(rec + kQ4KHeader + 512 * i + 64 * g + 4 * r, qs + 32 * i + 4 * g, 4);
      }
    }
}

bool q4k_tail_is_zero(const uint8_t* blocks, int64_t n, int64_t k) {
  if (k % kQ4KSuper == 0) return true;
  const int64_t nsb = (k + kQ4KSuper - 1) / kQ4KSuper;
  for (int64_t row = 0; row < n; ++row) {
    const uint8_t* q = blocks + (row * nsb + nsb - 1) * kQ4KBlock + 4;  // the 12 bytes of 6-bit scales and mins
    for (int j = 4; j < 8; ++j) {  // get_scale_min_k4 (ggml-quants.c) for sub-blocks 4-7
      const int scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      if (scale != 0 || min != 0) return false;
    }
  }
  return true;
}

// The fp32 weights rows of blocks [begin, end) stand for, computed as ggml and gguf-py do
// ((d * scale) * q - dmin * min, fp32).
void q4k_dequantize(const uint8_t* packed, int64_t k, float* w, int64_t begin, int64_t end) {
  const int64_t nsb = (k + kQ4KSuper - 1) / kQ4KSuper;
  vec::SubScales s;
  for (int64_t nb = begin; nb < end; ++nb) {
    const uint8_t* rec = packed + nb * q4k_row_block_bytes(k);
    for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
      vec::decode_scales(rec, s);
      for (int i = 0; i < q4k_quarters(k, sb); ++i)
        for (int g = 0; g < 8; ++g)
          for (int b = 0; b < 64; ++b) {
            const int r = b / 4;
            const int64_t col = sb * kQ4KSuper + 64 * i + 4 * g + b % 4;
            const uint8_t byte = rec[kQ4KHeader + 512 * i + 64 * g + b];
            float* row = w + (nb * kRows + r) * k;
            row[col] = s.ds[2 * i][r] * float(byte & 15) - s.dm[2 * i][r];
            row[col + 32] = s.ds[2 * i + 1][r] * float(byte >> 4) - s.dm[2 * i + 1][r];
          }
    }
  }
}

namespace {

// The 256 6-bit codes (0..63) of one GGUF block_q6_K, in input order (dequantize_row_q6_K,
// ggml-quants.c: input 128 h + 32 c + l takes its low 4 bits from ql[64 h + l + 32 (c & 1)], the
// high nibble for c >= 2, and its top 2 from bits 2c, 2c + 1 of qh[32 h + l]).
void q6k_codes_of(const uint8_t* blk, uint8_t* codes) {
  const uint8_t *ql = blk, *qh = blk + 128;
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = ql[64 * h + l + 32 * (c & 1)];
        codes[128 * h + 32 * c + l] = static_cast<uint8_t>(((c >= 2 ? low >> 4 : low) & 0x0F) |
                                                           (((qh[32 * h + l] >> (2 * c)) & 3) << 4));
      }
}

}  // namespace

void q6k_pack(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end) {
  const int64_t nsb = k / 256;
  uint8_t codes[256];
  for (int64_t nb = begin; nb < end; ++nb)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      uint8_t* rec = packed + (nb * nsb + sb) * kQ6KRecord;
      std::memset(rec, 0, kQ6KRecord);
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = nb * kRows + r;
        if (row >= n) break;  // padding rows stay zero
        const uint8_t* blk = blocks + (row * nsb + sb) * kQ6KBlock;
        std::memcpy(rec + 2 * r, blk + 208, 2);                                // d
        for (int j = 0; j < 16; ++j) rec[64 + 16 * j + r] = blk[192 + j];    // sc
        q6k_codes_of(blk, codes);
        for (int i = 0; i < 4; ++i) {
          uint8_t* q = rec + kQ6KHeader + kQ6KQuarter * i;
          const uint8_t* c = codes + 64 * i;
          for (int g = 0; g < 8; ++g)
            for (int j = 0; j < 4; ++j)
              q[64 * g + 4 * r + j] = static_cast<uint8_t>((c[4 * g + j] & 0x0F) | ((c[32 + 4 * g + j] & 0x0F) << 4));
          for (int g = 0; g < 4; ++g)
            for (int j = 0; j < 4; ++j) {
              uint8_t top = 0;
              for (int sub = 0; sub < 4; ++sub) top |= static_cast<uint8_t>((c[16 * sub + 4 * g + j] >> 4) << (2 * sub));
              q[512 + 64 * g + 4 * r + j] = top;
            }
        }
      }
    }
}

void q6k_dequantize(const uint8_t* packed, int64_t k, float* w, int64_t begin, int64_t end) {
  const int64_t nsb = k / 256;
  for (int64_t nb = begin; nb < end; ++nb)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* rec = packed + (nb * nsb + sb) * kQ6KRecord;
      for (int r = 0; r < kRows; ++r) {
        uint16_t half;
        std::memcpy(&half, rec + 2 * r, 2);
        const float d = vec::half_to_float(half);
        float* row = w + (nb * kRows + r) * k + sb * 256;
        for (int i = 0; i < 4; ++i) {
          const uint8_t* q = rec + kQ6KHeader + kQ6KQuarter * i;
          for (int e = 0; e < 64; ++e) {  // input 64 i + e
            const int g = (e % 32) / 4, j = e % 4, sub = e / 16;
            const uint8_t nib = q[64 * g + 4 * r + j], top = q[512 + 64 * ((e % 16) / 4) + 4 * r + j];
            const int code = ((e >= 32 ? nib >> 4 : nib) & 0x0F) | (((top >> (2 * sub)) & 3) << 4);
            const int sc = static_cast<int8_t>(rec[64 + 16 * (4 * i + sub) + r]);
            row[64 * i + e] = d * static_cast<float>(sc * (code - 32));  // sc (q - 32): 13 bits, d x it exact
          }
        }
      }
    }
}

// bf16 [n, k] row-major -> packed row blocks [begin, end): bytes 4r .. 4r + 3 of group g are
// w[16 nb + r][2g], w[16 nb + r][2g + 1].
void bf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed, int64_t begin, int64_t end) {
  const int64_t pairs = k / 2;
  for (int64_t nb = begin; nb < end; ++nb) {
    uint16_t* dst = packed + nb * pairs * kRows * 2;
    for (int64_t g = 0; g < pairs; ++g)
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = nb * kRows + r;
        dst[(g * kRows + r) * 2] = row < n ? w[row * k + 2 * g] : 0;
        dst[(g * kRows + r) * 2 + 1] = row < n ? w[row * k + 2 * g + 1] : 0;
      }
  }
}

uint64_t stream_xor(const uint8_t* p, int64_t bytes) {
  using namespace vec;
  I16 s0 = izero(), s1 = izero(), s2 = izero(), s3 = izero();  // four chains of 64-byte loads
  int64_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    for (int line = 0; line < 256; line += 64) __builtin_prefetch(p + i + 2048 + line);  // (as the kernels do)
    s0 = ixor(s0, iload(p + i));
    s1 = ixor(s1, iload(p + i + 64));
    s2 = ixor(s2, iload(p + i + 128));
    s3 = ixor(s3, iload(p + i + 192));
  }
  alignas(64) uint64_t lanes[8];
  istore(lanes, ixor(ixor(s0, s1), ixor(s2, s3)));
  uint64_t total = 0;
  for (uint64_t v : lanes) total ^= v;
  for (; i < bytes; ++i) total ^= p[i];
  return total;
}

}  // namespace verispec
