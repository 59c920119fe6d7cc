// The fp32 factors of a packed Q4_K record (16 weight rows x one super-block of 256 inputs; see
// amx/q4k.cpp for the GGUF format and the record layout): ds[j][r] = d * scale_j and
// dm[j][r] = dmin * min_j of row r, sub-blocks j = 0..7, exact in fp32 (an fp16 times a 6-bit
// integer). Shared by the Q4_K kernels of every tier and the dequantiser the tests check.
#pragma once

#include "vec.h"

namespace verispec {
namespace vec {

struct SubScales {
  alignas(64) float ds[8][16];
  alignas(64) float dm[8][16];
};

template <int SHIFT>
inline void store_subblock(SubScales& s, int j, F16 d, F16 dmin, I16 sc, I16 mn) {
  const I16 byte = iset1(0xFF);
  store(s.ds[j], mul(d, to_float(iand(ishr<SHIFT>(sc), byte))));
  store(s.dm[j], mul(dmin, to_float(iand(ishr<SHIFT>(mn), byte))));
}

// get_scale_min_k4 (ggml-quants.c) for 16 rows at once, one row per 32-bit lane.
inline void decode_scales(const uint8_t* rec, SubScales& s) {
  const F16 d = half16(reinterpret_cast<const uint16_t*>(rec));
  const F16 dmin = half16(reinterpret_cast<const uint16_t*>(rec + 32));
  const I16 w0 = iload(rec + 64), w1 = iload(rec + 128), w2 = iload(rec + 192);  // s[0..3], s[4..7], s[8..11]
  const I16 six = iset1(0x3F3F3F3F), top = iset1(0x30303030), low = iset1(0x0F0F0F0F);
  // byte j of sc_lo / mn_lo: scale / min of sub-block j; byte j of sc_hi / mn_hi: of sub-block 4 + j
  const I16 sc_lo = iand(w0, six), mn_lo = iand(w1, six);
  const I16 sc_hi = ior(iand(w2, low), iand(ishr<2>(w0), top));
  const I16 mn_hi = ior(iand(ishr<4>(w2), low), iand(ishr<2>(w1), top));
  store_subblock<0>(s, 0, d, dmin, sc_lo, mn_lo);
  store_subblock<8>(s, 1, d, dmin, sc_lo, mn_lo);
  store_subblock<16>(s, 2, d, dmin, sc_lo, mn_lo);
  store_subblock<24>(s, 3, d, dmin, sc_lo, mn_lo);
  store_subblock<0>(s, 4, d, dmin, sc_hi, mn_hi);
  store_subblock<8>(s, 5, d, dmin, sc_hi, mn_hi);
  store_subblock<16>(s, 6, d, dmin, sc_hi, mn_hi);
  store_subblock<24>(s, 7, d, dmin, sc_hi, mn_hi);
}

// t + the terms of activation block b (sub-blocks 2i, 2i + 1 of the record decoded into s) for
// one activation row, from its integer sums s0, s1 and its mins of the two sub-blocks
// (amx/q4k.cpp: four fused multiply-adds).
inline F16 q4k_add_pair(const SubScales& s, int i, float xscale, float xmin0, float xmin1, I16 s0, I16 s1, F16 t) {
  const F16 u = fma(to_float(s1), load(s.ds[2 * i + 1]), mul(to_float(s0), load(s.ds[2 * i])));
  t = fma(u, set1(xscale), t);
  t = fnma(set1(xmin0), load(s.dm[2 * i]), t);
  return fnma(set1(xmin1), load(s.dm[2 * i + 1]), t);
}

}  // namespace vec
}  // namespace verispec
