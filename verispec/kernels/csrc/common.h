// What every tier of verispec's CPU kernels shares: the argument blocks the kernels take, the
// packed weight layouts' constants, and the entry points bindings.cpp calls. No instruction-set
// header here: each tier (amx/, and vec/ compiled for AVX-512, AVX2 or plain C++) implements
// these functions, and the build compiles one tier per extension module with that tier's flags.
//
// Conventions: the weight matrix W is [N, K] (N output features, K input features), activations
// x are [M, K] row-major, y = x @ W.T + bias is [M, N] (fp32 or bf16), and outputs are produced
// 16 columns (= 16 weight rows, one packed row block) at a time. Each entry point computes the
// output columns of row blocks [begin, end) for all M rows of x; bindings.cpp splits the blocks
// among threads. The packed layouts are the same on every tier (a model packed once runs on any).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace verispec {

constexpr int kRows = 16;  // weight rows (= output columns) per packed block, and the most rows of an A tile

// The instances of a kernel templated on its row count R = 1 .. N, indexed by R - 1:
// make(std::integral_constant<int, R>) returns &kernel<R> (a constexpr table, no switch per kernel).
// (the element type is spelled out: std::array{x} of one std::array x would deduce a copy of x)
template <int N, typename Make, int... I>
constexpr auto rows_table_of(Make make, std::integer_sequence<int, I...>) {
  using Fn = decltype(make(std::integral_constant<int, 1>{}));
  return std::array<Fn, sizeof...(I)>{make(std::integral_constant<int, I + 1>{})...};
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

// Linux hands out the AMX tile-data state only to processes that ask (arch_prctl
// ARCH_REQ_XCOMP_PERM, XTILEDATA); false when the CPU or the kernel refuses, and on every tier
// but amx (amx/w8a8.cpp asks; bindings.cpp's stub answers for the other tiers).
bool amx_permitted();

// What the int8 and Q4_K kernels are given: the packed weights and the activations quantised by
// w8a8_quantize.
struct W8A8Args {
  const uint8_t* w;       // packed weights (layout of the kernel's format)
  const float* wscale;    // int8: [N rounded up to 16] per-row weight scales (zero-padded); Q4_K: null
  const int8_t* xq;       // [M, K] quantised activations
  const float* xscale;    // [M, ceil(K / 64)] activation scales per block of 64 inputs
  const int32_t* xsum;    // [M, K / 32] sums of xq[m][k] over each 32 inputs
  const float* xmin;      // Q4_K: [M, K / 32] float(xsum) * the activation scale of its block; else null
  // The same four, as the vector kernels read them: interleaved by chunks of vector_chunk_rows()
  // rows (the last chunk shorter), so that one pointer and fixed offsets reach every row of a
  // chunk. Element e of row r0 + m, in a chunk of R rows from row r0, is at [r0 * E + e * R + m]
  // (E elements per row: K / 4 words of 4 codes for xq, ceil(K / 64) scales, K / 32 sums or
  // mins). With M = 1 that is the [M, E] layout itself.
  const int32_t* xq_rows;
  const float* xscale_rows;
  const int32_t* xsum_rows;
  const float* xmin_rows;
  const int32_t* xsum16_rows;  // Q6_K: [M, K / 16] 32 x the sums of xq over each 16 inputs, interleaved as above
  const float* bias;      // [N] fp32, or null
  void* y;                // [M, N] fp32 or bf16
  int64_t M, N, K;
  bool out_bf16;
};
constexpr int kW8A8Block = 64;  // inputs per activation block (one scale each)
// Activation blocks [b0, b1) (of ceil(k / 64)) of rows [begin, end) of x [M, x_cols] (fp32 or
// bf16; x_cols <= k, a multiple of 32: the inputs from x_cols to k are zeros, a padded Q4_K input),
// quantised into xq [M, k], scale [M, ceil(k / 64)] and sum [M, k / 32] (vec/quantize.cpp).
void w8a8_quantize(const void* x, bool bf16, int64_t x_cols, int64_t k, int8_t* xq, float* scale, int32_t* sum,
                   int64_t begin, int64_t end, int64_t b0, int64_t b1);
// Q4_K's mins: xmin[m][h] = float(sum[m][h]) * scale[m][h / 2] (one fp32 rounding), rows
// [begin, end), h in [h0, h1) (h < k / 32).
void q4k_activation_mins(const float* scale, const int32_t* sum, int64_t k, float* xmin, int64_t begin, int64_t end,
                         int64_t h0, int64_t h1);
// Elements [e0, e1) of every row of src [m, per_row] (4-byte elements) -> dst in W8A8Args'
// chunk-interleaved order.
void interleave_rows(const uint32_t* src, int64_t m, int64_t per_row, int chunk, uint32_t* dst, int64_t e0,
                     int64_t e1);
int vector_chunk_rows();  // activation rows the vector kernels take per pass over a weight block

// Where one call's quantised activations go: the [M, ...] arrays of W8A8Args (xmin only for
// Q4_K, else null) and, when the vector kernels read interleaved rows (M > 1), one array `rows`
// holding their interleaved copies in turn (xq's words, the scales, the sums, the mins).
// quantize_activations fills activation blocks [b0, b1) of every row of x [M, x_cols] (zeros from
// x_cols to k, see w8a8_quantize); disjoint block ranges touch disjoint elements, so threads may
// share a call.
struct ActivationBuffers {
  int8_t* xq;
  float* scale;
  int32_t* sum;
  float* xmin;
  uint32_t* rows;
};
void quantize_activations(const void* x, bool bf16, int64_t m, int64_t x_cols, int64_t k, const ActivationBuffers& out,
                          int64_t b0, int64_t b1);
// All of them in one byte buffer of `bytes`, each part on its own cache lines: the byte offsets of
// xq, scale, sum, xmin (-1 unless q4k) and rows (-1 unless interleave and m > 1) for m rows of k
// inputs, and the buffers at those offsets from `base`.
struct ActivationLayout {
  int64_t xq, scale, sum, xmin, rows, bytes;
};
ActivationLayout activation_layout(int64_t m, int64_t k, bool q4k, bool interleave);
ActivationBuffers activation_buffers_at(uint8_t* base, const ActivationLayout& layout);
// W8A8Args' activation fields (xq .. xmin_rows) for buffers quantize_activations has filled (the
// *_rows ones null when M > 1 without interleaved copies: for the AMX tiles only).
void point_at_activations(const ActivationBuffers& in, int64_t m, int64_t k, W8A8Args& a);

// Which instructions a kernel uses: by the number of rows (auto), or forced (for the tests).
// Only the amx tier has a second engine; elsewhere 0 and 1 both name the vector kernels.
constexpr int kEngineAuto = 0, kEngineVector = 1, kEngineAmx = 2;

// ---- per-channel int8 weights (amx/w8a8.cpp: tiles; vec/linear.cpp: vectors)
void w8a8_pack(const int8_t* q, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end);
void w8a8_linear_vec(const W8A8Args& a, int64_t begin, int64_t end);
void w8a8_linear_amx(const W8A8Args& a, int64_t begin, int64_t end);
// amx tier: calls with at most this many rows run on vectors. Whole 1.5B int8 passes, vectors over
// tiles (kernels_ab.py, Intel Xeon with AMX, 2 cores, 35 GB/s): 0.89 / 0.93 at 4 / 5 rows, 1.04 /
// 1.00 / 0.99 at 6 / 7 / 8, 1.12 / 1.21 at 12 / 16. Since the tiles read their sums back two steps
// late (amx/w8a8.cpp), new tiles over old: 0.90 / 0.93 / 0.87 at 6 / 8 / 12 rows; tiles at every
// width over this threshold: 1.03 at one row, 1.07 at 5 (alone, the tiles stream one row faster:
// 0.44 against 0.50 ms per [8960 x 1536], benchmarks/kernel_stream.py; the whole pass does not
// follow, nor with only the 233 MB LM head on tiles: 1.005).
constexpr int kW8A8VectorRows = 5;

// ---- GGUF Q4_K weights (amx/q4k.cpp, vec/linear.cpp)
constexpr int kQ4KSuper = 256;    // inputs per super-block
constexpr int kQ4KBlock = 144;    // bytes of one GGUF block_q4_K
constexpr int kQ4KRecord = 2304;  // bytes of one packed record: 16 rows x one super-block
constexpr int kQ4KHeader = 256;   // bytes of a record before the codes
// A row block whose packed K is 256 s + 128 (a requantised projection padded to whole 128s, e.g.
// 896 inputs) ends with a half record: the header and the codes of sub-blocks 0-3 (quarters 0, 1);
// the zero half of its padded super-block is not stored (nor read: 11% of a [N x 896] matrix).
constexpr int kQ4KHalf = 128;                      // inputs of a half record
constexpr int kQ4KHalfRecord = kQ4KHeader + 1024;  // its bytes
// Bytes of one row block's records for k packed inputs (a multiple of 128).
inline int64_t q4k_row_block_bytes(int64_t k) {
  return (k / kQ4KSuper) * kQ4KRecord + (k % kQ4KSuper ? kQ4KHalfRecord : 0);
}
// The quarters (64-input blocks) of record sb of a row block of k packed inputs: 4, or 2 for a half record.
inline int q4k_quarters(int64_t k, int64_t sb) { return (sb + 1) * kQ4KSuper <= k ? 4 : 2; }
// blocks: GGUF blocks covering ceil(k / 256) super-blocks per row (k packed inputs, a multiple of 128)
void q4k_pack(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end);
// Whether rows [0, n) of those blocks hold zero weights past k (sub-blocks 4-7 of the last
// super-block when k % 256 = 128: scale and min 0, so ds = dm = 0 whatever the codes), as a half
// record needs; true when k is a multiple of 256.
bool q4k_tail_is_zero(const uint8_t* blocks, int64_t n, int64_t k);
void q4k_dequantize(const uint8_t* packed, int64_t k, float* w, int64_t begin, int64_t end);
void q4k_linear_vec(const W8A8Args& a, int64_t begin, int64_t end);
void q4k_linear_amx(const W8A8Args& a, int64_t begin, int64_t end);
// amx tier: calls with at most this many rows run on vectors. Whole 1.5B int4 passes, tiles over
// vectors (kernels_ab.py, Intel Xeon with AMX, 2 cores, 35 GB/s): 1.17 / 1.09 at 5 / 8 rows, 0.99 /
// 0.99 / 0.98 at 9 / 10 / 12, 0.93 / 0.92 at 14 / 16. Since the tiles unpack a record ahead and
// read their sums back two blocks late (amx/q4k.cpp): 0.985 / 0.946 / 0.944 at 6 / 7 / 8 rows
// (tiles over vectors, the same tool and machine class, 32 GB/s); then the vectors' prefetch half a
// record ahead on this tier (vec/dots.h) made them the faster again up to 8 rows: [8960 x 1536]
// at 6 / 8 / 12 rows 0.379 / 0.428 / 0.586 ms against the tiles' 0.427 / 0.457 / 0.529
// (kernel_stream.py); whole passes, vectors up to 8 over tiles from 7: 0.964 at T = 8. Then the
// tiles took both sub-blocks of up to 8 rows in one multiply (amx/q4k.cpp: tile_rows, paired):
// tiles from 5 rows over vectors up to 8, 0.986 / 0.968 / 0.971 at T = 5 / 6 / 8 (the 0.5B draft in
// int4-all 0.961 / 0.956 / 0.967); from 3 rows, 1.017 / 1.014 at T = 3 / 4.
constexpr int kQ4KVectorRows = 4;

// ---- GGUF Q6_K weights (vec/pack.cpp: the layout; vec/linear.cpp: the vector kernels, which every
// tier runs, amx included). A GGUF block_q6_K (210 bytes) holds 256 weights d * sc[i / 16] * (q[i] -
// 32): 6-bit codes q (low 4 bits in ql, top 2 in qh), 16 int8 scales sc and an fp16 d. A packed
// record holds one super-block of 16 rows (3392 bytes, 212 per row):
//   [0, 32)     d of rows 0..15 (fp16), then 32 zero bytes
//   [64, 320)   sc: byte 64 + 16 j + r = scale j (sub-block of inputs 16 j .. 16 j + 15) of row r
//   [320, ...)  per quarter of 64 inputs (i = 0..3), 768 bytes: 8 groups of 64 bytes whose byte
//               64 g + 4 r + c holds the low 4 bits of row r's code of input 64 i + 4 g + c (low
//               nibble) and of input 64 i + 32 + 4 g + c (high nibble), then 4 groups of 64 bytes
//               whose byte 512 + 64 g + 4 r + c holds the top 2 bits of the codes of inputs
//               64 i + 16 s + 4 g + c at bits 2 s, 2 s + 1 (s = 0..3)
// The arithmetic (every tier, bit for bit; xq, scale_x per 64 inputs and P16, the sums of xq over
// each 16 inputs, from the activations): per row and quarter (activation block b), the exact
// integer I = sum over its 4 sub-blocks j of sc_j * (sum q p - 32 P16_j); then in fp32
// t = fma(float(I), scale_x[b] * d, t) block by block from t = 0 (d: the row's of that
// super-block; the product rounded once); finally y = t + bias.
constexpr int kQ6KBlock = 210;     // bytes of one GGUF block_q6_K
constexpr int kQ6KRecord = 3392;   // bytes of one packed record: 16 rows x one super-block
constexpr int kQ6KHeader = 320;    // bytes of a record before the codes
constexpr int kQ6KQuarter = 768;   // bytes of one quarter's codes
// blocks: GGUF blocks [n, k / 256 * 210] (k a multiple of 256) -> records of row blocks [begin, end)
void q6k_pack(const uint8_t* blocks, int64_t n, int64_t k, uint8_t* packed, int64_t begin, int64_t end);
// The exact fp32 weights d * (sc * (q - 32)) of row blocks [begin, end) (w: [16 * blocks, k]).
void q6k_dequantize(const uint8_t* packed, int64_t k, float* w, int64_t begin, int64_t end);
void q6k_linear_vec(const W8A8Args& a, int64_t begin, int64_t end);

// ---- attention one query row at a time (vec/attention.cpp)
struct AttnArgs {
  const void* q;        // [B, T, H, D] contiguous
  const void* k;        // keys of row b, kv head h, position j at b * k_sb + h * k_sh + j * D
  const void* v;        // values, likewise with v_sb, v_sh
  int64_t k_sb, k_sh, v_sb, v_sh;
  const int64_t* rows;  // [B]: the buffer row of batch row b (null: b itself)
  const uint8_t* visible;  // [B, T, span]: 1 where the query of (b, t) may see position j
  void* out;            // [B, T, H, D] contiguous, q's dtype
  int64_t B, T, H, Hkv, D, span;
  float scale;
  bool bf16;            // q, k, v and out are bf16 (else fp32)
};
void attention_rows(const AttnArgs& a, int64_t begin, int64_t end);  // rows (b * T + t) * H + h
constexpr int kAttnGroupRows = 8;  // query rows attended together (sharing their keys and values)
// The softmax of nr (1..kAttnGroupRows) rows that share their n visible keys: score[r * span + u]
// the scaled score of row r and the u-th of them, m[r] the row's largest; p = exp(s - m[r]) in place
// of the scores, and l[r] = the sum of a row's p.
void attention_softmax(const AttnArgs& a, int nr, float* score, int64_t n, const float* m, float* l);
// The amx tier's (amx/attention_tiles.cpp): bf16 rows with a head size of 32, 64, 96 or 128 take
// their scores and values on AMX tiles and their softmax from attention_softmax; other rows as
// attention_rows.
void attention_rows_amx(const AttnArgs& a, int64_t begin, int64_t end);
// Its scores alone, unscaled, for tests: q [m, d] and k [n, d] bf16 (d = 32, 64, 96 or 128) ->
// out [m, n] fp32.
void attention_scores_amx(const uint16_t* q, int64_t m, const uint16_t* k, int64_t n, int64_t d, float* out);

// ---- the small operations between the projections, bf16 (vec/layer_ops.cpp); rows [begin, end)
// h [M, C] (+= delta when delta is not null, in place), y = RMSNorm(h) * w
void rms_norm_rows(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* y, int64_t c, float eps,
                   int64_t begin, int64_t end);
// x [M, heads * d] (row stride x_stride), cos / sin [M, d] -> y [M, heads, d] (rotate-half RoPE)
void rotary_rows(const uint16_t* x, int64_t x_stride, const uint16_t* cos, const uint16_t* sin, uint16_t* y,
                 int64_t heads, int64_t d, int64_t begin, int64_t end);
// gate, up [M, f] (row stride `stride`) -> y [M, f] = silu(gate) * up, rows [begin, end), columns
// [c0, c1) (c0 a multiple of 16)
void silu_mul_rows(const uint16_t* gate, const uint16_t* up, int64_t stride, uint16_t* y, int64_t f, int64_t begin,
                   int64_t end, int64_t c0, int64_t c1);

// ---- the greedy token of a row of scores (vec/pick.cpp)
struct PickSegment {
  const void* scores;      // [width] bf16 or fp32
  bool bf16;
  int64_t width;
  const int64_t* ids;      // [width]: each column's id (null: the column itself)
  const bool* blocked;     // [width]: columns that count as -inf (null: none)
};
struct PickResult {
  int64_t id;        // the largest score's id (ties: the smallest id); -1 when !ok
  float confidence;  // 1 / sum exp(x - max): that token's probability at temperature 1
  bool ok;           // false: a NaN, or a largest score that is not finite
};
PickResult pick_greedy(const PickSegment* segments, int count);

// ---- a sampled draft token (vec/pick.cpp): verispec.sampling.build_laws's steps on one row
struct SampleRule {
  float temperature;  // > 0 (1: none)
  int64_t top_k;      // 0: none
  double top_p;       // 1: none
  float min_p;        // 0: none
};
// x [w] fp32 scores of ascending ids (-inf: not allowed), transformed in place -> law [w] fp32
// (summing to 1); false: no law (a NaN, or a largest score that is not finite).
bool sampled_law(float* x, int64_t w, const SampleRule& rule, float* law);
// The column of law [w] (>= 0) that the uniform u in [0, 1) picks: the first whose float64
// cumulative mass (summed by blocks of 64 columns) exceeds u * the total (mass 0: never).
int64_t draw_column(const float* law, int64_t w, double u);

// ---- bf16 weights (amx/bf16.cpp: TDPBF16PS order; vec/linear.cpp: one fp32 FMA chain per output)
struct Bf16Args {
  const uint16_t* w;  // packed bf16 weights (the pair layout of amx/bf16.cpp)
  const uint16_t* x;  // [M, K] bf16 activations
  const float* xf;    // the same activations widened to fp32 (exactly), for the vector kernels
  const float* bias;  // [N] fp32, or null
  void* y;            // [M, N] fp32 or bf16
  int64_t M, N, K;
  bool out_bf16;
};
constexpr int kBf16Align = 32;  // K must be a multiple of this (one AMX step)
void bf16_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed, int64_t begin, int64_t end);
void bf16_linear_vec(const Bf16Args& a, int64_t begin, int64_t end);
void bf16_linear_amx(const Bf16Args& a, int64_t begin, int64_t end);
constexpr int kBf16GroupBlocks = 4;  // weight row blocks the AMX kernel multiplies together
// The AMX kernel on `blocks` (1..kBf16GroupBlocks) row blocks of packed bf16 weights at w (one
// after another, K * 16 values each) giving output row blocks nb .. nb + blocks - 1, every row of
// a (a.w unused); `configured`: the rows the tiles are configured with (0: none; the caller
// releases the tiles).
void bf16_blocks_amx(const Bf16Args& a, const uint16_t* w, int64_t nb, int blocks, int& configured);

// ---- int8 and Q4_K projections of a prompt's rows (amx/prefill.cpp, amx tier only): the weights
// dequantised to bf16 a group of row blocks at a time, then bf16.cpp's AMX kernel. a: the
// activations (bf16, K = the packed inputs), bias, y (bf16), M, N, K (a.w unused); row blocks [begin, end).
void q4k_prefill_amx(const uint8_t* q4k, const Bf16Args& a, int64_t begin, int64_t end);
void int8_prefill_amx(const uint8_t* codes, const float* scales, const Bf16Args& a, int64_t begin, int64_t end);

// ---- memory bandwidth probe (vec/pack.cpp): xor of every 8 bytes of [p, p + bytes)
uint64_t stream_xor(const uint8_t* p, int64_t bytes);

}  // namespace verispec
