// int8 and Q4_K projections of a prompt's rows on AMX bf16 tiles: the amx tier's compute-optimised
// path for prefill, which plain and speculative decoding share (a prompt's chunk goes through it,
// never a decoding step or a verification pass).
//
// Why: with many rows the int8 and Q4_K tile kernels (w8a8.cpp, q4k.cpp) are bound by their fp32
// steps after each block of 64 inputs (per row, block and 16 outputs: conversions and
// multiply-adds, since the activations' scale changes every 64 inputs, and Q4_K's every 32), not
// by their tiles. Here the weights of a group of row blocks are dequantised once per call, to bf16
// in bf16.cpp's pair layout (a thread's scratch, in L2), and multiplied by the bf16 activations
// with TDPBF16PS, whose tiles add over the whole input (bf16.cpp's kernel, with no step per
// block). Intel Xeon with AMX, 2 threads, one call: [17920 x 1536] (a 1.5B layer's gate and up)
// in Q4_K, 512 rows 16.5 ms against q4k.cpp's 36.8, 128 rows 4.9 against 9.2, 16 rows 2.2 against
// 1.4 (the dequantisation, ~1.9 ms, is paid whatever the rows); in int8, 512 rows 14.8 against
// w8a8.cpp's 19.5, 128 rows 4.2 against 4.5; [1536 x 8960] int8, 512 rows 8.0 against 12.5, 128
// rows 2.5 against 2.3.
//
//   y[m][n] = bf16.cpp's sums of x[m] (bf16, as given) and w16[n], + bias, where w16 is the exact
//   fp32 weight rounded to bf16 (nearest even):
//     Q4_K: ds_j * q - dm_j (q4k.cpp; the product is exact, so one rounding in fp32, as ggml's
//           dequantize_row_q4_K);
//     int8: float(code) * scale (one rounding, as Int8Linear.dequantize).
//
// So y is a bf16 projection of the weights rounded to bf16 (a relative error of at most 2^-9 each)
// where the decoding kernels quantise the activations to int8 per 64 inputs instead: another
// rounding of nearly the same sums, still computed row by row (row i of an M-row call equals the
// one-row call: the order does not depend on M). A prompt fed this way gives keys, values and
// logits that differ by rounding from feeding its tokens one at a time; decoding after it is the
// same code as ever. Q6_K and bf16 projections keep their kernels.
#include <algorithm>
#include <vector>

#include "amx.h"
#include "../vec/q4k_scales.h"

namespace verispec {
namespace {

constexpr int kGroupWords = 32;  // one pair-layout group: 16 weight rows x 2 inputs, bf16

// Interleaves two vectors of 16 bf16 (lo = input 2p of rows 0..15, hi = input 2p + 1) into one
// pair-layout group: word 2r = lo[r], word 2r + 1 = hi[r]. cvtne2ps rounds to nearest even.
inline __m512i pair_group(__m512 lo, __m512 hi) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // words 0..15 lo, 16..31 hi
  return _mm512_permutexvar_epi16(order, halves);
}

// Byte j of each 32-bit lane of v (lane r: row r), masked, as 16 floats.
template <int J>
inline __m512 byte_of(__m512i v, __m512i mask) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * J), mask));
}

// One Q4_K record (16 rows x 256 inputs, or 128 in a half record: `quarters` 4 or 2) -> its
// weights in pair layout at out (group p: inputs 2p, 2p + 1 of the record).
void q4k_record_to_bf16(const uint8_t* rec, int quarters, uint16_t* out) {
  vec::SubScales s;
  vec::decode_scales(rec, s);
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  for (int i = 0; i < quarters; ++i) {
    const __m512 ds0 = _mm512_load_ps(s.ds[2 * i]), dm0 = _mm512_load_ps(s.dm[2 * i]);
    const __m512 ds1 = _mm512_load_ps(s.ds[2 * i + 1]), dm1 = _mm512_load_ps(s.dm[2 * i + 1]);
    for (int g = 0; g < 8; ++g) {
      // lane r: row r's codes of inputs 64i + 4g + j (low nibbles) and 64i + 32 + 4g + j (high)
      const __m512i v = _mm512_load_si512(rec + kQ4KHeader + 512 * i + 64 * g);
      const __m512i lo = v, hi = _mm512_srli_epi32(v, 4);
      uint16_t* first = out + (32 * i + 2 * g) * kGroupWords;  // inputs 64i + 4g, + 1; then + 2, + 3
      uint16_t* second = first + 16 * kGroupWords;             // inputs 64i + 32 + 4g, ...
      _mm512_storeu_si512(first, pair_group(_mm512_fmsub_ps(ds0, byte_of<0>(lo, nibble), dm0),
                                           _mm512_fmsub_ps(ds0, byte_of<1>(lo, nibble), dm0)));
      _mm512_storeu_si512(first + kGroupWords, pair_group(_mm512_fmsub_ps(ds0, byte_of<2>(lo, nibble), dm0),
                                                         _mm512_fmsub_ps(ds0, byte_of<3>(lo, nibble), dm0)));
      _mm512_storeu_si512(second, pair_group(_mm512_fmsub_ps(ds1, byte_of<0>(hi, nibble), dm1),
                                            _mm512_fmsub_ps(ds1, byte_of<1>(hi, nibble), dm1)));
      _mm512_storeu_si512(second + kGroupWords, pair_group(_mm512_fmsub_ps(ds1, byte_of<2>(hi, nibble), dm1),
                                                          _mm512_fmsub_ps(ds1, byte_of<3>(hi, nibble), dm1)));
    }
  }
}

// Row block nb of packed Q4_K weights (k packed inputs) -> pair layout at out (k * 16 values).
void q4k_block_to_bf16(const uint8_t* packed, int64_t k, int64_t nb, uint16_t* out) {
  const uint8_t* rec = packed + nb * q4k_row_block_bytes(k);
  const int64_t records = (k + kQ4KSuper - 1) / kQ4KSuper;
  for (int64_t sb = 0; sb < records; ++sb, rec += kQ4KRecord)
    q4k_record_to_bf16(rec, q4k_quarters(k, sb), out + sb * (kQ4KSuper / 2) * kGroupWords);
}

// Row block nb of packed int8 codes (w8a8.cpp's layout: group g of 64 bytes, byte 4r + j = the code
// of row r, input 4g + j, plus 128) and its 16 scales -> pair layout at out.
void int8_block_to_bf16(const uint8_t* packed, const float* scales, int64_t k, int64_t nb, uint16_t* out) {
  const uint8_t* w = packed + nb * kRows * k;
  const __m512 scale = _mm512_loadu_ps(scales + nb * kRows);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  const __m512 offset = _mm512_set1_ps(128.0f);
  // (code + 128) - 128 is exact in fp32; then the product rounded once, as float(code) * scale
  const auto weight = [&](__m512 biased) { return _mm512_mul_ps(_mm512_sub_ps(biased, offset), scale); };
  for (int64_t g = 0; g < k / 4; ++g) {
    const __m512i v = _mm512_load_si512(w + 64 * g);
    _mm512_storeu_si512(out + 2 * g * kGroupWords, pair_group(weight(byte_of<0>(v, byte)), weight(byte_of<1>(v, byte))));
    _mm512_storeu_si512(out + (2 * g + 1) * kGroupWords,
                        pair_group(weight(byte_of<2>(v, byte)), weight(byte_of<3>(v, byte))));
  }
}

// Row blocks [begin, end), a group of kBf16GroupBlocks at a time: dequantise(nb, out) writes row
// block nb's weights in pair layout to out, then bf16.cpp multiplies the group.
template <typename Dequantise>
void prefill_blocks(const Bf16Args& a, int64_t begin, int64_t end, Dequantise dequantise) {
  static thread_local std::vector<uint16_t> scratch;  // a group's weights in bf16 (at most 1.1 MB at K = 8960)
  const int64_t block_values = a.K * kRows;
  scratch.resize(static_cast<size_t>(kBf16GroupBlocks * block_values));
  int configured = 0;
  for (int64_t nb = begin; nb < end; nb += kBf16GroupBlocks) {
    const int blocks = static_cast<int>(std::min<int64_t>(end - nb, kBf16GroupBlocks));
    for (int j = 0; j < blocks; ++j) dequantise(nb + j, scratch.data() + j * block_values);
    bf16_blocks_amx(a, scratch.data(), nb, blocks, configured);
  }
  if (configured) _tile_release();
}

}  // namespace

void q4k_prefill_amx(const uint8_t* q4k, const Bf16Args& a, int64_t begin, int64_t end) {
  prefill_blocks(a, begin, end, [&](int64_t nb, uint16_t* out) { q4k_block_to_bf16(q4k, a.K, nb, out); });
}

void int8_prefill_amx(const uint8_t* codes, const float* scales, const Bf16Args& a, int64_t begin, int64_t end) {
  prefill_blocks(a, begin, end, [&](int64_t nb, uint16_t* out) { int8_block_to_bf16(codes, scales, a.K, nb, out); });
}

}  // namespace verispec
