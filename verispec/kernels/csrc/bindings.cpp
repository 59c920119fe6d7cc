// torch glue of the kernels: argument checks, dtype handling, threading (at::parallel_for over
// 16-row weight blocks, so the kernels use torch's thread count) and the Python module. Compiled
// once per tier (VS_TIER names it; VS_TIER_AMX adds the tile engines), with the same functions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>  // not torch/extension.h: parsing its C++ frontend took 12 of this file's 33 s

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "common.h"

#define VS_STRING_OF(x) #x
#define VS_STRING(x) VS_STRING_OF(x)  // VS_TIER is the bare tier name (-DVS_TIER=avx2)

namespace verispec {

#ifdef VS_TIER_AMX
constexpr bool kHasAmx = true;  // (amx_permitted: amx/w8a8.cpp)
#else
constexpr bool kHasAmx = false;
bool amx_permitted() { return false; }
void w8a8_linear_amx(const W8A8Args&, int64_t, int64_t) { TORCH_CHECK(false, "this tier has no AMX"); }
void q4k_linear_amx(const W8A8Args&, int64_t, int64_t) { TORCH_CHECK(false, "this tier has no AMX"); }
void bf16_linear_amx(const Bf16Args&, int64_t, int64_t) { TORCH_CHECK(false, "this tier has no AMX"); }
void q4k_prefill_amx(const uint8_t*, const Bf16Args&, int64_t, int64_t) { TORCH_CHECK(false, "this tier has no AMX"); }
void int8_prefill_amx(const uint8_t*, const float*, const Bf16Args&, int64_t, int64_t) {
  TORCH_CHECK(false, "this tier has no AMX");
}
void attention_rows_amx(const AttnArgs& a, int64_t begin, int64_t end) { attention_rows(a, begin, end); }
void attention_scores_amx(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "this tier has no AMX");
}
#endif
#if VS_VEC_DPBF16
constexpr bool kHasDpbf16 = true;  // the avx512bf16 tier: its bf16 kernel multiplies bf16 pairs (VDPBF16PS)
#else
constexpr bool kHasDpbf16 = false;
#endif

namespace {

int64_t row_blocks(int64_t n) { return (n + kRows - 1) / kRows; }

// Whether a call of m rows runs on AMX tiles: forced by engine 2, or (engine 0) above the rows
// the vector kernels take on the amx tier. Checks the engine and that the tiles may be used.
bool tiles_for(int64_t m, int64_t engine, int vector_rows) {
  TORCH_CHECK(engine >= kEngineAuto && engine <= kEngineAmx, "engine must be 0 (auto), 1 (vectors) or 2 (AMX)");
  const bool amx = engine == kEngineAmx || (engine == kEngineAuto && kHasAmx && m > vector_rows);
  TORCH_CHECK(!amx || amx_permitted(), "AMX is not available on this tier, CPU or kernel");
  return amx;
}

void check_weights(const at::Tensor& t, at::ScalarType type, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(), what,
              " must be a contiguous CPU tensor of ", c10::toString(type));
  TORCH_CHECK(t.numel() == numel, what, " has ", t.numel(), " elements, expected ", numel);
}

const float* bias_pointer(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value()) return nullptr;
  check_weights(*bias, at::kFloat, n, "bias");
  return bias->data_ptr<float>();
}

// Values below which a layer op runs on one thread: waking the others (a few microseconds) would
// cost more than they save. The grain of an at::parallel_for over items of `per_item` values.
constexpr int64_t kSerialValues = 8192;
int64_t grain_for(int64_t per_item) { return std::max<int64_t>(1, kSerialValues / std::max<int64_t>(per_item, 1)); }

// One projection call on raw rows, shared by the tensor entries below and Layers' loop (which
// makes no torch call between kernels: a torch operation right after a projection has streamed
// megabytes of weights finds its code and data evicted and took ~20 us, a plain copy of the same
// bytes 2): x [m, x_cols] contiguous (bf16, or fp32 where the kind takes it) into y [m, n]
// contiguous (bf16, or fp32), the quantised activations and other temporaries in the caller's
// scratch (64-byte aligned, the kind's *_scratch_bytes).
struct RowsIO {
  const void* x;
  bool x_bf16;
  int64_t m, x_cols;
  void* y;
  bool y_bf16;
  uint8_t* scratch;
};

int64_t align64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// A scratch buffer of `bytes` for a tensor entry's RowsIO.
at::Tensor scratch_of(int64_t bytes) { return at::empty({std::max<int64_t>(bytes, 1)}, at::TensorOptions(at::kByte)); }

// x [m, x_cols] quantised as k inputs (zeros from x_cols on: a Q4_K input padded to whole
// super-blocks) into `scratch` as `layout` places it (Q4_K's mins when q4k; the interleaved
// copies the vector kernels read when interleave and m > 1), activation blocks split over threads
// when there are enough values.
ActivationBuffers quantize_at(const RowsIO& io, int64_t k, const ActivationLayout& layout) {
  const ActivationBuffers out = activation_buffers_at(io.scratch, layout);
  const int64_t nblk = (k + kW8A8Block - 1) / kW8A8Block;
  at::parallel_for(0, nblk, grain_for(io.m * kW8A8Block), [&](int64_t b0, int64_t b1) {
    quantize_activations(io.x, io.x_bf16, io.m, io.x_cols, k, out, b0, b1);
  });
  return out;
}

// The fields W8A8Args and Bf16Args share, for io's rows times weights [n, k] (+ bias) into y.
template <class Args>
Args rows_args(const RowsIO& io, int64_t n, int64_t k, const float* bias) {
  Args a{};
  a.bias = bias;
  a.y = io.y;
  a.M = io.m;
  a.N = n;
  a.K = k;
  a.out_bf16 = io.y_bf16;
  return a;
}

// io's x quantised (quantize_at) and the W8A8Args of x and y [m, n] (the weights' fields are the
// caller's).
// The 16-row weight blocks of an n-output int8 or Q4_K projection split among the threads, each
// range on `kernel` (the AMX tiles' or the vectors').
void over_row_blocks(const W8A8Args& a, int64_t n, void (*kernel)(const W8A8Args&, int64_t, int64_t)) {
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { kernel(a, b, e); });
}

W8A8Args quantized_args(const RowsIO& io, int64_t n, int64_t k, bool q4k, bool interleave, const float* bias) {
  const ActivationBuffers buffers = quantize_at(io, k, activation_layout(io.m, k, q4k, interleave));
  W8A8Args a = rows_args<W8A8Args>(io, n, k, bias);
  point_at_activations(buffers, io.m, k, a);
  return a;
}

void check_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.size(1) % 32 == 0, "x rows must have a multiple of 32 inputs, got ", x.size(1));
}

// The RowsIO of a tensor entry: x (made contiguous into xc) into y, scratch of `bytes` into keep.
RowsIO rows_io(const at::Tensor& x, at::Tensor& xc, at::Tensor& y, int64_t bytes, at::Tensor& keep) {
  xc = x.contiguous();
  keep = scratch_of(bytes);
  return {xc.data_ptr(), x.scalar_type() == at::kBFloat16, x.size(0), x.size(1), y.defined() ? y.data_ptr() : nullptr,
          y.defined() && y.scalar_type() == at::kBFloat16, keep.data_ptr<uint8_t>()};
}

// x [M, K] (fp32 or bf16) -> (int8 [M, K], scales fp32 [M, ceil(K / 64)], sums int32 [M, K / 32]):
// the activation quantisation the W8A8 kernels apply (exposed for tests and references).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x) {
  check_activations(x);
  const int64_t m = x.size(0), k = x.size(1), nblk = (k + kW8A8Block - 1) / kW8A8Block;
  const ActivationLayout layout = activation_layout(m, k, false, false);
  at::Tensor xc, none, buffer;
  quantize_at(rows_io(x, xc, none, layout.bytes, buffer), k, layout);
  auto part = [&](int64_t offset, int64_t bytes, at::ScalarType type, int64_t cols) {
    return buffer.narrow(0, offset, bytes).view(type).view({m, cols}).clone();
  };
  return {part(layout.xq, m * k, at::kChar, k), part(layout.scale, 4 * m * nblk, at::kFloat, nblk),
          part(layout.sum, 4 * m * (k / 32), at::kInt, k / 32)};
}

// ------------------------------------------------------------------------------------ Q4_K

void check_q4k_inputs(int64_t k) {
  TORCH_CHECK(k > 0 && k % kQ4KHalf == 0, "packed Q4_K rows must have a multiple of 128 inputs, got ", k);
}

// blocks: [N, ceil(k / 256) * 144]; k, the packed inputs, a multiple of 128 (when it is not one of
// 256, the blocks' last super-block must hold zero weights past k: its half is not stored).
at::Tensor q4k_pack_blocks(const at::Tensor& blocks, int64_t n, int64_t k) {
  check_q4k_inputs(k);
  const int64_t nsb = (k + kQ4KSuper - 1) / kQ4KSuper;
  check_weights(blocks, at::kByte, n * nsb * kQ4KBlock, "Q4_K blocks");
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  TORCH_CHECK(q4k_tail_is_zero(src, n, k), "Q4_K blocks hold nonzero weights past input ", k,
              ": pack them with K = ", nsb * kQ4KSuper);
  at::Tensor packed = at::empty({row_blocks(n) * q4k_row_block_bytes(k)}, blocks.options());
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q4k_pack(src, n, k, dst, b, e); });
  return packed;
}

at::Tensor q4k_dequantize_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  check_q4k_inputs(k);
  check_weights(packed, at::kByte, row_blocks(n) * q4k_row_block_bytes(k), "packed Q4_K");
  at::Tensor w = at::empty({row_blocks(n) * kRows, k}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q4k_dequantize(src, k, dst, b, e); });
  return w.narrow(0, 0, n).contiguous();
}

// Packed Q4_K weights of k = 256 s + 128 inputs (row blocks ending in a half record) in the
// whole-record layout of k + 128 inputs: each row block's bytes followed by the 1024 bytes of
// codes its half record leaves out, as zeros (those sub-blocks' scales and mins are zero: the
// weights are the same): the layout benchmarks/q4k_half_records_ab.py compares half records with.
at::Tensor q4k_whole_records(const at::Tensor& packed, int64_t n, int64_t k) {
  check_q4k_inputs(k);
  TORCH_CHECK(k % kQ4KSuper != 0, "Q4_K rows of ", k, " inputs are whole records already");
  check_weights(packed, at::kByte, row_blocks(n) * q4k_row_block_bytes(k), "packed Q4_K");
  const int64_t from = q4k_row_block_bytes(k), to = q4k_row_block_bytes(k + kQ4KHalf);
  at::Tensor whole = at::zeros({row_blocks(n) * to}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = whole.data_ptr<uint8_t>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) {
    for (; b < e; ++b) std::memcpy(dst + b * to, src + b * from, from);
  });
  return whole;
}

int64_t q4k_scratch_bytes(int64_t m, int64_t k, bool amx) { return activation_layout(m, k, true, !amx).bytes; }

// io's rows times the packed Q4_K weights w [n, k] (+ bias), on the AMX tiles or the vectors. x
// has k inputs, or fewer by less than 256 when the weights were padded with zeros (a requantised
// projection): x is quantised as if padded with zeros alike (without a padded copy), which adds
// nothing. Both engines read rows that end in a half record as they are.
void q4k_rows(const RowsIO& io, const uint8_t* w, int64_t n, int64_t k, const float* bias, bool amx) {
  W8A8Args a = quantized_args(io, n, k, true, !amx, bias);
  a.w = w;
  over_row_blocks(a, n, amx ? q4k_linear_amx : q4k_linear_vec);
}

at::Tensor q4k_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                      const c10::optional<at::Tensor>& bias, int64_t engine) {
  check_q4k_inputs(k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= k && x.size(1) > k - kQ4KSuper && x.size(1) % 32 == 0 && x.size(0) >= 1,
              "x must be [M, ", k, "] (or narrower by less than 256, a multiple of 32), got ", x.sizes());
  check_activations(x);
  check_weights(packed, at::kByte, row_blocks(n) * q4k_row_block_bytes(k), "packed Q4_K");
  const bool amx = tiles_for(x.size(0), engine, kQ4KVectorRows);
  at::Tensor y = at::empty({x.size(0), n}, x.options()), xc, scratch;
  q4k_rows(rows_io(x, xc, y, q4k_scratch_bytes(x.size(0), k, amx), scratch), packed.data_ptr<uint8_t>(), n, k,
           bias_pointer(bias, n), amx);
  return y;
}

// ------------------------------------------------------------------------------------ Q6_K

void check_q6k_inputs(int64_t k) {
  TORCH_CHECK(k > 0 && k % 256 == 0, "packed Q6_K rows must have a multiple of 256 inputs, got ", k);
}

at::Tensor q6k_pack_blocks(const at::Tensor& blocks, int64_t n, int64_t k) {
  check_q6k_inputs(k);
  check_weights(blocks, at::kByte, n * (k / 256) * kQ6KBlock, "Q6_K blocks");
  at::Tensor packed = at::empty({row_blocks(n) * (k / 256) * kQ6KRecord}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q6k_pack(src, n, k, dst, b, e); });
  return packed;
}

at::Tensor q6k_dequantize_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  check_q6k_inputs(k);
  check_weights(packed, at::kByte, row_blocks(n) * (k / 256) * kQ6KRecord, "packed Q6_K");
  at::Tensor w = at::empty({row_blocks(n) * kRows, k}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q6k_dequantize(src, k, dst, b, e); });
  return w.narrow(0, 0, n);
}

// Q6_K's scratch: the activations, then 32 x the sums of their codes over each 16 inputs (and,
// when m > 1, those interleaved by chunks as the other activation arrays).
int64_t q6k_scratch_bytes(int64_t m, int64_t k) {
  return align64(activation_layout(m, k, false, true).bytes) + 4 * (m > 1 ? 2 : 1) * m * (k / 16);
}

// io's rows [m, k] quantised as for int8 (per 64 inputs) times the packed Q6_K weights w [n, k] (+
// bias); every tier runs the vector kernels (amx included).
void q6k_rows(const RowsIO& io, const uint8_t* w, int64_t n, int64_t k, const float* bias) {
  const int64_t m = io.m, subs = k / 16;
  W8A8Args a = quantized_args(io, n, k, false, true, bias);
  int32_t* plain = reinterpret_cast<int32_t*>(io.scratch + align64(activation_layout(m, k, false, true).bytes));
  const int8_t* xq = a.xq;
  at::parallel_for(0, m, grain_for(k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < subs; ++j) {
        int32_t t = 0;
        for (int c = 0; c < 16; ++c) t += xq[r * k + 16 * j + c];
        plain[r * subs + j] = 32 * t;  // (the kernels subtract 32 x the sum: the codes' offset)
      }
  });
  if (m > 1) {
    uint32_t* rows = reinterpret_cast<uint32_t*>(plain + m * subs);
    interleave_rows(reinterpret_cast<const uint32_t*>(plain), m, subs, vector_chunk_rows(), rows, 0, subs);
    a.xsum16_rows = plain + m * subs;
  } else {
    a.xsum16_rows = plain;
  }
  a.w = w;
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q6k_linear_vec(a, b, e); });
}

// x [M, K] times the packed Q6_K weights (q6k_rows).
at::Tensor q6k_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                      const c10::optional<at::Tensor>& bias) {
  check_q6k_inputs(k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1, "x must be [M, ", k, "], got ", x.sizes());
  check_activations(x);
  check_weights(packed, at::kByte, row_blocks(n) * (k / 256) * kQ6KRecord, "packed Q6_K");
  at::Tensor y = at::empty({x.size(0), n}, x.options()), xc, scratch;
  q6k_rows(rows_io(x, xc, y, q6k_scratch_bytes(x.size(0), k), scratch), packed.data_ptr<uint8_t>(), n, k,
           bias_pointer(bias, n));
  return y;
}

// ------------------------------------------------------------------------------------ int8

at::Tensor w8a8_pack_codes(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "codes must be int8 [N, K]");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(k % 32 == 0, "int8 rows must have a multiple of 32 inputs, got ", k);
  const at::Tensor qc = q.contiguous();
  at::Tensor packed = at::empty({row_blocks(n) * kRows * k}, q.options());
  const int8_t* src = qc.data_ptr<int8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(packed.data_ptr<int8_t>());
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { w8a8_pack(src, n, k, dst, b, e); });
  return packed;
}

int64_t w8a8_scratch_bytes(int64_t m, int64_t k, bool amx) { return activation_layout(m, k, false, !amx).bytes; }

// io's rows [m, k] times the packed int8 weights w [n, k] with their scales (+ bias), on the AMX
// tiles or the vectors.
void w8a8_rows(const RowsIO& io, const uint8_t* w, const float* wscale, int64_t n, int64_t k, const float* bias,
               bool amx) {
  W8A8Args a = quantized_args(io, n, k, false, !amx, bias);
  a.w = w;
  a.wscale = wscale;
  over_row_blocks(a, n, amx ? w8a8_linear_amx : w8a8_linear_vec);
}

at::Tensor w8a8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n, int64_t k,
                       const c10::optional<at::Tensor>& bias, int64_t engine) {
  TORCH_CHECK(k % 32 == 0, "int8 rows must have a multiple of 32 inputs, got ", k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1, "x must be [M, ", k, "], got ", x.sizes());
  check_activations(x);
  check_weights(packed, at::kChar, row_blocks(n) * kRows * k, "packed int8");
  check_weights(scale, at::kFloat, row_blocks(n) * kRows, "int8 scales");
  const bool amx = tiles_for(x.size(0), engine, kW8A8VectorRows);
  at::Tensor y = at::empty({x.size(0), n}, x.options()), xc, scratch;
  w8a8_rows(rows_io(x, xc, y, w8a8_scratch_bytes(x.size(0), k, amx), scratch),
            reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()), scale.data_ptr<float>(), n, k,
            bias_pointer(bias, n), amx);
  return y;
}

// ------------------------------------------------------------------------------------ bf16

at::Tensor bf16_pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(), "weight must be bf16 [N, K] on the CPU");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kBf16Align == 0, "bf16 rows must have a multiple of 32 inputs, got ", k);
  const at::Tensor wc = w.contiguous();
  at::Tensor packed = at::empty({row_blocks(n) * kRows * k}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, row_blocks(n), 16, [&](int64_t b, int64_t e) { bf16_pack(src, n, k, dst, b, e); });
  return packed;
}

// [M, K]: the FMA kernels' broadcasts widen x to fp32 (amx and VDPBF16PS multiply the bf16 as they are)
constexpr bool kWidenX = !kHasAmx && !kHasDpbf16;

int64_t bf16_scratch_bytes(int64_t m, int64_t k) { return kWidenX ? 4 * m * k : 0; }

// io's bf16 rows [m, k] times the packed bf16 weights w [n, k] (+ bias), fp32 sums.
void bf16_rows(const RowsIO& io, const uint16_t* w, int64_t n, int64_t k, const float* bias) {
  Bf16Args a = rows_args<Bf16Args>(io, n, k, bias);
  a.w = w;
  a.x = static_cast<const uint16_t*>(io.x);
  float* xf = kWidenX ? reinterpret_cast<float*>(io.scratch) : nullptr;
  if (kWidenX)
    at::parallel_for(0, io.m, grain_for(k), [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * k; i < r1 * k; ++i) {
        const uint32_t bits = static_cast<uint32_t>(a.x[i]) << 16;  // (exact: bf16 is fp32's upper half)
        std::memcpy(xf + i, &bits, 4);
      }
    });
  a.xf = xf;
  // grain 4: a thread's range is whole groups of four row blocks (bf16.cpp's unit)
  at::parallel_for(0, row_blocks(n), 4, [&](int64_t b, int64_t e) {
    if (kHasAmx)
      bf16_linear_amx(a, b, e);
    else
      bf16_linear_vec(a, b, e);
  });
}

at::Tensor bf16_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                       const c10::optional<at::Tensor>& bias, bool out_fp32) {
  TORCH_CHECK(k % kBf16Align == 0, "bf16 rows must have a multiple of 32 inputs, got ", k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be bf16 [M, ", k, "] on the CPU, got ", x.sizes(), " ", x.scalar_type());
  check_weights(packed, at::kBFloat16, row_blocks(n) * kRows * k, "packed bf16");
  TORCH_CHECK(!kHasAmx || amx_permitted(), "AMX is not available on this CPU or kernel");
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16)), xc, scratch;
  bf16_rows(rows_io(x, xc, y, bf16_scratch_bytes(x.size(0), k), scratch),
            reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), n, k, bias_pointer(bias, n));
  return y;
}

// ------------------------------------------------------------------------------------ prefill

// The prefill kernels' arguments (amx/prefill.cpp) for io's bf16 rows [m, k] into y [m, n].
Bf16Args prefill_args(const RowsIO& io, int64_t n, int64_t k, const float* bias) {
  TORCH_CHECK(kHasAmx && amx_permitted(), "the prefill kernels need the amx tier and AMX permitted");
  Bf16Args a = rows_args<Bf16Args>(io, n, k, bias);
  a.x = static_cast<const uint16_t*>(io.x);
  return a;
}

void check_prefill_x(const at::Tensor& x, int64_t k, bool narrower) {
  const bool width = narrower ? x.size(1) <= k && x.size(1) > k - kQ4KSuper : x.size(1) == k;
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && width && x.size(1) % 32 == 0 && x.scalar_type() == at::kBFloat16 &&
                  x.device().is_cpu(),
              "x must be bf16 [M, ", k, "] on the CPU",
              narrower ? " (or narrower by less than 256, a multiple of 32)" : "", ", got ", x.sizes(), " ",
              x.scalar_type());
}

// Q4_K's prefill scratch: a copy of x padded with zeros to k inputs, when it is narrower.
int64_t q4k_prefill_scratch_bytes(int64_t m, int64_t x_cols, int64_t k) { return x_cols < k ? 2 * m * k : 0; }

// io's bf16 rows [m, x_cols] (x_cols = k, or narrower by less than 256 for a padded projection:
// zeros added) times the Q4_K weights w [n, k] dequantised to bf16, + bias (amx/prefill.cpp; amx
// tier only).
void q4k_prefill_rows(const RowsIO& io, const uint8_t* w, int64_t n, int64_t k, const float* bias) {
  Bf16Args a = prefill_args(io, n, k, bias);
  if (io.x_cols < k) {
    auto* padded = reinterpret_cast<uint16_t*>(io.scratch);
    const auto* x = static_cast<const uint16_t*>(io.x);
    for (int64_t r = 0; r < io.m; ++r) {
      std::memcpy(padded + r * k, x + r * io.x_cols, 2 * io.x_cols);
      std::memset(padded + r * k + io.x_cols, 0, 2 * (k - io.x_cols));
    }
    a.x = padded;
  }
  // grain: whole groups of row blocks (the unit dequantised at once)
  at::parallel_for(0, row_blocks(n), kBf16GroupBlocks, [&](int64_t b, int64_t e) { q4k_prefill_amx(w, a, b, e); });
}

at::Tensor q4k_prefill_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                              const c10::optional<at::Tensor>& bias) {
  check_q4k_inputs(k);
  check_prefill_x(x, k, true);
  check_weights(packed, at::kByte, row_blocks(n) * q4k_row_block_bytes(k), "packed Q4_K");
  at::Tensor y = at::empty({x.size(0), n}, x.options()), xc, scratch;
  q4k_prefill_rows(rows_io(x, xc, y, q4k_prefill_scratch_bytes(x.size(0), x.size(1), k), scratch),
                   packed.data_ptr<uint8_t>(), n, k, bias_pointer(bias, n));
  return y;
}

// io's bf16 rows [m, k] times the int8 weights w (wscale * codes) rounded to bf16, + bias
// (amx/prefill.cpp; amx tier only).
void int8_prefill_rows(const RowsIO& io, const uint8_t* w, const float* wscale, int64_t n, int64_t k,
                       const float* bias) {
  const Bf16Args a = prefill_args(io, n, k, bias);
  at::parallel_for(0, row_blocks(n), kBf16GroupBlocks,
                   [&](int64_t b, int64_t e) { int8_prefill_amx(w, wscale, a, b, e); });
}

at::Tensor int8_prefill_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n,
                               int64_t k, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(k % 32 == 0, "int8 rows must have a multiple of 32 inputs, got ", k);
  check_prefill_x(x, k, false);
  check_weights(packed, at::kChar, row_blocks(n) * kRows * k, "packed int8");
  check_weights(scale, at::kFloat, row_blocks(n) * kRows, "int8 scales");
  at::Tensor y = at::empty({x.size(0), n}, x.options()), xc, scratch;
  int8_prefill_rows(rows_io(x, xc, y, 0, scratch), reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()),
                    scale.data_ptr<float>(), n, k, bias_pointer(bias, n));
  return y;
}

// ------------------------------------------------------------------------------------ attention

// Attention one query row at a time (vec/attention.cpp; on the amx tier bf16 rows take their scores
// from AMX tiles, amx/attention_tiles.cpp), every tier's decoding steps and verification passes:
// q [B, T, H, D] (or [M, H, D], M = B T; contiguous), the keys and values of batch row b and kv
// head g at k + (rows[b]) * k_sb + g * k_sh (likewise v; rows null: b itself), D values per
// position, visible [B, T, span] contiguous -> out [B, T, H, D] in q's dtype (bf16 or fp32).
void attention_of_rows(const void* q, bool bf16, int64_t h, int64_t d, const void* k, int64_t k_sb, int64_t k_sh,
                       const void* v, int64_t v_sb, int64_t v_sh, const int64_t* rows, const bool* visible, int64_t b,
                       int64_t t, int64_t hkv, int64_t span, double scale, void* out) {
  AttnArgs a{};
  a.q = q;
  a.k = k;
  a.v = v;
  a.k_sb = k_sb;
  a.k_sh = k_sh;
  a.v_sb = v_sb;
  a.v_sh = v_sh;
  a.rows = rows;
  a.visible = reinterpret_cast<const uint8_t*>(visible);
  a.out = out;
  a.B = b;
  a.T = t;
  a.H = h;
  a.Hkv = hkv;
  a.D = d;
  a.span = span;
  a.scale = static_cast<float>(scale);
  a.bf16 = bf16;
  at::parallel_for(0, b * t * h, 1, [&](int64_t s, int64_t e) { attention_rows_amx(a, s, e); });
}

at::Tensor attention_by_row(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && visible.dim() == 3,
              "expected q [B, T, H, D], k and v [B, H_kv, span, D], visible [B, T, span]");
  const int64_t b = q.size(0), t = q.size(1), h = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), span = k.size(2);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "q, k and v must all be bf16 or all fp32");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && visible.device().is_cpu(),
              "attention_rows runs on the CPU");
  TORCH_CHECK(d % 16 == 0 && d <= 256, "head size must be a multiple of 16 up to 256, got ", d);
  TORCH_CHECK(hkv >= 1 && h % hkv == 0, "query heads (", h, ") must be a multiple of key/value heads (", hkv, ")");
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == hkv && v.size(2) == span && k.size(3) == d &&
                  v.size(3) == d,
              "k and v must be [", b, ", H_kv, span, ", d, "]");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == d && v.stride(3) == 1 && v.stride(2) == d,
              "k and v must have contiguous rows of D values");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.size(0) == b && visible.size(1) == t &&
                  visible.size(2) == span,
              "visible must be [B, T, span] bool");
  const at::Tensor qc = q.contiguous(), vis = visible.contiguous();
  at::Tensor out = at::empty({b, t, h, d}, q.options());
  attention_of_rows(qc.data_ptr(), q.scalar_type() == at::kBFloat16, h, d, k.data_ptr(), k.stride(0), k.stride(1),
                    v.data_ptr(), v.stride(0), v.stride(1), nullptr, vis.data_ptr<bool>(), b, t, hkv, span, scale,
                    out.data_ptr());
  return out;
}

// ------------------------------------------------------------------------------------ layer ops

const uint16_t* bf16_pointer(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bf16_pointer_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// The amx tier's attention scores alone (amx/attention_tiles.cpp), unscaled, for tests: q [M, D] and
// k [N, D] bf16, D = 32, 64, 96 or 128 -> [M, N] fp32.
at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(kHasAmx && amx_permitted(), "the AMX attention scores need the amx tier and AMX permitted");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  q.size(1) == k.size(1) && q.device().is_cpu() && k.device().is_cpu(),
              "expected q [M, D] and k [N, D] bf16 CPU tensors");
  const int64_t d = q.size(1);
  TORCH_CHECK(d % 32 == 0 && d >= 32 && d <= 128, "head size must be 32, 64, 96 or 128, got ", d);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous();
  at::Tensor out = at::empty({q.size(0), k.size(0)}, q.options().dtype(at::kFloat));
  attention_scores_amx(bf16_pointer(qc), q.size(0), bf16_pointer(kc), k.size(0), d, out.data_ptr<float>());
  return out;
}

void check_bf16_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), what, " must be a bf16 CPU tensor");
}

// h [m, c] (h += delta [m, c] in place first, unless null) -> y = RMSNorm(h) * w [c].
void rms_norm_at(uint16_t* h, const uint16_t* delta, const uint16_t* w, uint16_t* y, int64_t m, int64_t c, double eps) {
  const float e = static_cast<float>(eps);
  at::parallel_for(0, m, grain_for(c), [&](int64_t b, int64_t en) { rms_norm_rows(h, delta, w, y, c, e, b, en); });
}

// h [..., C] (contiguous; h += delta in place first when delta is given) -> RMSNorm(h) * weight.
at::Tensor rms_norm(at::Tensor& h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  check_bf16_cpu(h, "h");
  check_bf16_cpu(weight, "weight");
  TORCH_CHECK(h.is_contiguous(), "h must be contiguous");
  const int64_t c = h.size(-1), m = h.numel() / std::max<int64_t>(c, 1);
  TORCH_CHECK(weight.numel() == c && weight.is_contiguous(), "weight must be [", c, "]");
  at::Tensor d;
  if (delta.has_value()) {
    check_bf16_cpu(*delta, "delta");
    TORCH_CHECK(delta->numel() == h.numel(), "delta must have h's shape");
    d = delta->contiguous();
  }
  at::Tensor y = at::empty_like(h);
  rms_norm_at(bf16_pointer_mut(h), d.defined() ? bf16_pointer(d) : nullptr, bf16_pointer(weight), bf16_pointer_mut(y),
              m, c, eps);
  return y;
}

// x [m, heads * d] (rows `stride` apart), cos / sin [m, d] -> y [m, heads, d].
void rotary_at(const uint16_t* x, int64_t stride, const uint16_t* cos, const uint16_t* sin, uint16_t* y, int64_t m,
               int64_t heads, int64_t d) {
  at::parallel_for(0, m, grain_for(heads * d),
                   [&](int64_t b, int64_t e) { rotary_rows(x, stride, cos, sin, y, heads, d, b, e); });
}

// x [M, heads * d] (rows may be strided: a slice of a fused q/k/v output), cos / sin [M, d]
// -> [M, heads, d].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t d) {
  check_bf16_cpu(x, "x");
  check_bf16_cpu(cos, "cos");
  check_bf16_cpu(sin, "sin");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == heads * d && x.stride(1) == 1, "x must be [M, heads * d] with unit stride");
  TORCH_CHECK(d % 32 == 0, "head size must be a multiple of 32, got ", d);
  const int64_t m = x.size(0);
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(cc.numel() == m * d && sc.numel() == m * d, "cos and sin must be [M, d]");
  at::Tensor y = at::empty({m, heads, d}, x.options());
  rotary_at(bf16_pointer(x), x.stride(0), bf16_pointer(cc), bf16_pointer(sc), bf16_pointer_mut(y), m, heads, d);
  return y;
}

// SwiGLU's work split by columns, this many at a time, so that one row (a decoding step) has
// threads too.
constexpr int64_t kSiluColumns = 256;

// gate, up [m, f] (rows `stride` apart) -> y = silu(gate) * up [m, f].
void silu_mul_at(const uint16_t* gate, const uint16_t* up, int64_t stride, uint16_t* y, int64_t m, int64_t f) {
  const int64_t pieces = (f + kSiluColumns - 1) / kSiluColumns;
  at::parallel_for(0, pieces, grain_for(m * kSiluColumns), [&](int64_t b, int64_t e) {
    silu_mul_rows(gate, up, stride, y, f, 0, m, b * kSiluColumns, std::min(e * kSiluColumns, f));
  });
}

// gate, up [M, F] with the same row stride and unit column stride -> silu(gate) * up [M, F].
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_bf16_cpu(gate, "gate");
  check_bf16_cpu(up, "up");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1 &&
                  gate.stride(0) == up.stride(0),
              "gate and up must be [M, F] with the same strides");
  const int64_t m = gate.size(0), f = gate.size(1);
  at::Tensor y = at::empty({m, f}, gate.options());
  silu_mul_at(bf16_pointer(gate), bf16_pointer(up), gate.stride(0), bf16_pointer_mut(y), m, f);
  return y;
}

// ------------------------------------------------------------------------------------ decoder layers

// One packed projection as verispec.kernels.linear holds it: kind 0 bf16 (w: packed bf16), 1 int8
// (w: packed codes, scale: padded scales), 2 Q4_K (w: packed records), 3 Q6_K (w: packed records).
// Checked once when made (projection_of), so that Layers' loop runs its kernels on raw pointers.
struct Projection {
  int64_t kind, n, k;
  at::Tensor w, scale;
  c10::optional<at::Tensor> bias;
  const void* w_data;  // w's, scale's and bias's data (scale, bias: null when absent)
  const float* scale_data;
  const float* bias_data;

  // Whether a prompt's rows (prefill) run on the prefill kernels: int8 and Q4_K where the tier has AMX.
  bool on_prefill_kernels(bool prefill) const { return prefill && kHasAmx && (kind == 1 || kind == 2); }
  // Whether m rows of int8 or Q4_K run on the AMX tiles (by the number of rows).
  bool tiles(int64_t m) const {
    return (kind == 1 || kind == 2) && tiles_for(m, kEngineAuto, kind == 1 ? kW8A8VectorRows : kQ4KVectorRows);
  }
  // The scratch run() needs for m rows of x_cols inputs.
  int64_t scratch_bytes(int64_t m, int64_t x_cols, bool prefill) const {
    if (on_prefill_kernels(prefill)) return kind == 2 ? q4k_prefill_scratch_bytes(m, x_cols, k) : 0;
    if (kind == 0) return bf16_scratch_bytes(m, k);
    if (kind == 1) return w8a8_scratch_bytes(m, k, tiles(m));
    if (kind == 3) return q6k_scratch_bytes(m, k);
    return q4k_scratch_bytes(m, k, tiles(m));
  }
  // x [m, x_cols] bf16 -> y [m, n] bf16, the kernels the tensor entries run (bf16_linear,
  // w8a8_linear, q4k_linear, q6k_linear; a prompt's rows on int8_prefill_linear and
  // q4k_prefill_linear where the tier has AMX), with no torch call.
  void run(const uint16_t* x, int64_t m, int64_t x_cols, uint16_t* y, uint8_t* scratch, bool prefill) const {
    const RowsIO io{x, true, m, x_cols, y, true, scratch};
    const auto* bytes = static_cast<const uint8_t*>(w_data);
    if (on_prefill_kernels(prefill)) {
      if (kind == 1)
        int8_prefill_rows(io, bytes, scale_data, n, k, bias_data);
      else
        q4k_prefill_rows(io, bytes, n, k, bias_data);
    } else if (kind == 0) {
      bf16_rows(io, static_cast<const uint16_t*>(w_data), n, k, bias_data);
    } else if (kind == 1) {
      w8a8_rows(io, bytes, scale_data, n, k, bias_data, tiles(m));
    } else if (kind == 3) {
      q6k_rows(io, bytes, n, k, bias_data);
    } else {
      q4k_rows(io, bytes, n, k, bias_data, tiles(m));
    }
  }
  // Whether x rows of `cols` inputs fit it (Q4_K: narrower by less than 256 when it was padded).
  bool takes(int64_t cols) const { return kind == 2 ? cols <= k && cols > k - kQ4KSuper && cols % 32 == 0 : cols == k; }
};

Projection projection_of(int64_t kind, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias, int64_t n, int64_t k) {
  TORCH_CHECK(kind >= 0 && kind <= 3, "kind must be 0 (bf16), 1 (int8), 2 (Q4_K) or 3 (Q6_K)");
  TORCH_CHECK(n >= 1 && k >= 1, "a projection needs n, k >= 1");
  if (kind == 0) {
    TORCH_CHECK(k % kBf16Align == 0, "bf16 rows must have a multiple of 32 inputs, got ", k);
    check_weights(w, at::kBFloat16, row_blocks(n) * kRows * k, "packed bf16");
  } else if (kind == 1) {
    TORCH_CHECK(k % 32 == 0, "int8 rows must have a multiple of 32 inputs, got ", k);
    TORCH_CHECK(scale.has_value(), "an int8 projection needs its scales");
    check_weights(w, at::kChar, row_blocks(n) * kRows * k, "packed int8");
    check_weights(*scale, at::kFloat, row_blocks(n) * kRows, "int8 scales");
  } else if (kind == 2) {
    check_q4k_inputs(k);
    check_weights(w, at::kByte, row_blocks(n) * q4k_row_block_bytes(k), "packed Q4_K");
  } else {
    check_q6k_inputs(k);
    check_weights(w, at::kByte, row_blocks(n) * (k / 256) * kQ6KRecord, "packed Q6_K");
  }
  const at::Tensor sc = kind == 1 ? *scale : at::Tensor();
  return {kind, n, k, w, sc, bias, w.data_ptr(), sc.defined() ? sc.data_ptr<float>() : nullptr, bias_pointer(bias, n)};
}

// Attention of a prompt's chunk: torch's scaled_dot_product_attention (its CPU flash-attention
// kernel, blocked over queries and keys: 3.5-4.5x the row kernel's speed at 512 queries over 512 to
// 2048 keys, Intel Xeon with AMX, 2 threads), another order of the same sums than attention_rows.
// q [M, H, D] (M = B T), a layer's caches [slots, H_kv, positions, D], rows [B] (their slots),
// mask [B, 1, G T, span] additive (the visibility, stacked for a group's G query heads) -> [B, T,
// H, D]. A kv head's G query heads are stacked as G T rows against its keys: no copy of the keys.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& rows,
                             int64_t b, int64_t t, int64_t span, const at::Tensor& mask) {
  const int64_t hq = q.size(1), d = q.size(2), hkv = kc.size(1), g = hq / hkv;
  // [B, H_kv, span, D]: views of the caches for one row, else copies of the rows' first span positions
  const auto rows_of = [&](const at::Tensor& cache) {
    const at::Tensor first = cache.narrow(2, 0, span);
    return b == 1 ? first.select(0, rows[0].item<int64_t>()).unsqueeze(0) : first.index_select(0, rows);
  };
  const at::Tensor keys = rows_of(kc), values = rows_of(vc);
  const at::Tensor stacked = q.view({b, t, hkv, g, d}).permute({0, 2, 3, 1, 4}).reshape({b, hkv, g * t, d});
  const at::Tensor o = at::scaled_dot_product_attention(stacked, keys, values, mask, 0.0, false,
                                                        1.0 / std::sqrt(static_cast<double>(d)));  // [B, H_kv, G T, D]
  return o.reshape({b, hkv, g, t, d}).permute({0, 3, 1, 2, 4}).contiguous().view({b, t, hq, d});
}

// What a decoder layer on the kernels needs: q/k/v (one fused projection, or three) and gate/up
// (one, or two), o and down, the norm after attention and the norm that follows the layer (the
// next layer's input norm, or the final one).
struct Layer {
  std::vector<Projection> qkv, gate_up;
  Projection o, down;
  at::Tensor post_norm, next_norm;
  const uint16_t* post = nullptr;  // the norms' data (Layers::prepare)
  const uint16_t* next = nullptr;
};

// A pass's intermediate rows (bf16, M rows each) and the projections' scratch, the same for every
// layer of the pass. Separate blocks: a prompt's chunk needs ~36 MB in all, and glibc serves
// blocks of up to 32 MB again from its heap, where it maps a larger one afresh every pass.
struct PassBuffers {
  at::Tensor qkv, q_rot, k_rot, attn, o_out, gate_up, act, down_out, scratch;
};

// One pass of m rows of t new tokens each, appended in a chain of cache positions:
// KVCache.begin_step's plan for a pass of Transformer.forward_with_hidden that is not a prompt's
// chunk. Row r's token q is token[r t + q], real for q < real[r] (the rest padding: token 0, its
// keys to the cache's scratch column, its query seeing position 0), its keys at start[r] + q of
// cache row slot[r]; RoPE at that position too, or at position[r t + q] when given (a tree's
// nodes: length + depth). A real query sees the cached positions before start[r] and, among the
// pass's real tokens, those before it (causal); or, when within is given ([W] a query: a window
// of the last W - T cached positions and the pass's T tokens), every position before the window,
// itself, and what within[(r t + q) W + s] marks among the window's positions and the pass's
// real tokens (a tree: its ancestors, earlier levels cached). Attention reads span positions.
struct ChainPass {
  int64_t m = 0, t = 0, span = 0, width = 0;
  std::vector<int64_t> token, slot, real, start, position;
  const bool* within = nullptr;
};

// What every pass of a model in one call reads: the embedding [V, C] and the first layer's input norm
// [C], bf16; RoPE's cos and sin [P, D] bf16 of positions 0 .. P - 1 (P at least the cache's
// positions, padding's included), checked by chain_inputs.
struct ChainInputs {
  const uint16_t *embed, *first_norm, *cos, *sin;
  int64_t vocab, positions;
  at::TensorOptions bf16;
};

struct Layers {
  std::vector<Layer> layers;
  int64_t heads, kv_heads, head_dim, inter, hidden;
  double eps;
  // one projection of each (kind, k, input width) the layers hold (prepare): what the scratch of a
  // pass must fit, without scanning every layer every pass
  std::vector<std::pair<Projection, int64_t>> shapes;

  // Checks every layer against the shapes and points at its norms (once, when made: the loop
  // trusts them).
  void prepare() {
    const int64_t qw = heads * head_dim, kw = kv_heads * head_dim, c = hidden, f = inter;
    TORCH_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, "query heads must be a multiple of kv heads");
    TORCH_CHECK(hidden >= 1 && inter >= 1, "hidden and intermediate sizes must be positive");
    TORCH_CHECK(head_dim % 32 == 0 && head_dim <= 256, "head size must be a multiple of 32 up to 256, got ", head_dim);
    for (Layer& L : layers) {
      const auto fits = [](const Projection& p, int64_t n, int64_t cols, const char* what) {
        TORCH_CHECK(p.n == n && p.takes(cols), what, " must be [", n, " x ", cols, "], got [", p.n, " x ", p.k, "]");
      };
      if (L.qkv.size() == 1) {
        fits(L.qkv[0], qw + 2 * kw, c, "the fused q/k/v projection");
      } else {
        fits(L.qkv[0], qw, c, "q");
        fits(L.qkv[1], kw, c, "k");
        fits(L.qkv[2], kw, c, "v");
      }
      fits(L.o, c, qw, "o");
      if (L.gate_up.size() == 1) {
        fits(L.gate_up[0], 2 * f, c, "the fused gate/up projection");
      } else {
        fits(L.gate_up[0], f, c, "gate");
        fits(L.gate_up[1], f, c, "up");
      }
      fits(L.down, c, f, "down");
      for (const at::Tensor* norm : {&L.post_norm, &L.next_norm}) {
        check_bf16_cpu(*norm, "a norm's weight");
        TORCH_CHECK(norm->numel() == c && norm->is_contiguous(), "a norm's weight must be [", c, "]");
      }
      L.post = bf16_pointer(L.post_norm);
      L.next = bf16_pointer(L.next_norm);
      const auto keep = [&](const Projection& p, int64_t cols) {
        for (const auto& [q, q_cols] : shapes)
          if (q.kind == p.kind && q.k == p.k && q_cols == cols) return;
        shapes.emplace_back(p, cols);
      };
      for (const Projection& p : L.qkv) keep(p, c);
      for (const Projection& p : L.gate_up) keep(p, c);
      keep(L.o, qw);
      keep(L.down, f);
    }
  }

  PassBuffers buffers_for(int64_t m, bool prefill, const at::TensorOptions& bf16) const {
    const int64_t qw = heads * head_dim, kw = kv_heads * head_dim;
    int64_t scratch = 1;
    for (const auto& [p, cols] : shapes) scratch = std::max(scratch, p.scratch_bytes(m, cols, prefill));
    const auto rows = [&](int64_t width) { return at::empty({m, width}, bf16); };
    return {rows(qw + 2 * kw), rows(qw), rows(kw), rows(qw), rows(hidden), rows(2 * inter), rows(inter), rows(hidden),
            at::empty({scratch}, bf16.dtype(at::kByte))};
  }

  // h [M, C] bf16 (the residual stream, updated in place), x [M, C] = the first layer's input
  // norm of h, cos / sin [M, D], caches [L, S, H_kv, N, D] bf16, rows [B] and write_pos [B, T]
  // int64 (where this step's keys and values go), visible [B, T, span] -> the final norm of h
  // [M, C]. The same operations, in the same order, as Transformer's layer loop in Python:
  // one call per forward pass instead of ~12 per layer, and between the kernels no torch call (in
  // its buffers, allocated once per pass). `prefill`: a prompt's chunk, whose projections take
  // the prefill kernels (Projection::run) and whose attention is prefill_attention.
  at::Tensor forward(at::Tensor& h, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc,
                     at::Tensor& vc, const at::Tensor& rows, const at::Tensor& write_pos, int64_t span,
                     const at::Tensor& visible, bool prefill) const {
    const int64_t b = rows.size(0), t = write_pos.size(1), m = b * t, hq = heads, hkv = kv_heads, d = head_dim;
    const int64_t c = hidden, f = inter, qw = hq * d, kw = hkv * d;
    TORCH_CHECK(kc.dim() == 5 && kc.sizes() == vc.sizes() && kc.size(0) == static_cast<int64_t>(layers.size()) &&
                    kc.size(2) == hkv && kc.size(4) == d && kc.is_contiguous() && vc.is_contiguous() &&
                    kc.scalar_type() == at::kBFloat16 && vc.scalar_type() == at::kBFloat16,
                "caches must be contiguous bf16 [layers, slots, H_kv, positions, D]");
    TORCH_CHECK(rows.scalar_type() == at::kLong && write_pos.scalar_type() == at::kLong && write_pos.size(0) == b &&
                    span >= 0 && span <= kc.size(3),
                "rows [B] / write_pos [B, T] int64 must match h's M = B * T rows");
    for (const at::Tensor* t_mc : {static_cast<const at::Tensor*>(&h), &x}) {  // [M, C] each
      check_bf16_cpu(*t_mc, "h and x");
      TORCH_CHECK(t_mc->dim() == 2 && t_mc->size(0) == m && t_mc->size(1) == c && t_mc->is_contiguous(),
                  "h and x must be contiguous [M, ", c, "] with M = B * T = ", m);
    }
    check_bf16_cpu(cos, "cos");
    check_bf16_cpu(sin, "sin");
    const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
    TORCH_CHECK(cc.numel() == m * d && sc.numel() == m * d, "cos and sin must be [M, D]");
    TORCH_CHECK(visible.scalar_type() == at::kBool && visible.numel() == b * t * span,
                "visible must be [B, T, span] bool");
    const at::Tensor rc = rows.contiguous(), wc = write_pos.contiguous(), vis = visible.contiguous();
    const int64_t* rp = rc.data_ptr<int64_t>();
    const int64_t* wp = wc.data_ptr<int64_t>();
    for (int64_t i = 0; i < b; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < kc.size(1), "cache row out of range");
    for (int64_t i = 0; i < m; ++i) TORCH_CHECK(wp[i] >= 0 && wp[i] < kc.size(3), "cache position out of range");
    const int64_t l_stride = kc.stride(0), s_stride = kc.stride(1), h_stride = kc.stride(2);
    at::Tensor stacked_mask;  // prefill: [B, 1, G T, span] additive (0 / -inf), made once for every layer
    if (prefill) {
      const int64_t g = hq / hkv;
      const at::Tensor add = at::zeros({b, t, span}, h.options()).masked_fill_(vis.logical_not(), -INFINITY);
      stacked_mask = add.view({b, 1, 1, t, span}).expand({b, 1, g, t, span}).reshape({b, 1, g * t, span});
    }
    if (layers.empty()) return x;
    PassBuffers pb = buffers_for(m, prefill, h.options());
    at::Tensor out = at::empty({m, c}, h.options());  // x of every layer after the first, then the result
    uint8_t* scratch = pb.scratch.data_ptr<uint8_t>();
    uint16_t* hp = bf16_pointer_mut(h);
    uint16_t* xo = bf16_pointer_mut(out);
    const uint16_t* cp = bf16_pointer(cc);
    const uint16_t* sp = bf16_pointer(sc);
    auto* kcache = reinterpret_cast<uint16_t*>(kc.data_ptr<at::BFloat16>());
    auto* vcache = reinterpret_cast<uint16_t*>(vc.data_ptr<at::BFloat16>());
    uint16_t *qkv = bf16_pointer_mut(pb.qkv), *q_rot = bf16_pointer_mut(pb.q_rot), *k_rot = bf16_pointer_mut(pb.k_rot);
    uint16_t *attn_out = bf16_pointer_mut(pb.attn), *o_out = bf16_pointer_mut(pb.o_out);
    uint16_t *gate_up = bf16_pointer_mut(pb.gate_up), *act = bf16_pointer_mut(pb.act);
    uint16_t* down_out = bf16_pointer_mut(pb.down_out);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& L = layers[i];
      const uint16_t* xin = i == 0 ? bf16_pointer(x) : xo;
      // q, k, v [M, H D], [M, H_kv D] x 2: columns of one fused output, or three outputs
      uint16_t *qx = qkv, *kx = qx + qw, *vx = qx + qw + kw;
      int64_t q_stride = qw + 2 * kw, k_stride = q_stride, v_stride = q_stride;
      if (L.qkv.size() == 1) {
        L.qkv[0].run(xin, m, c, qx, scratch, prefill);
      } else {
        kx = qx + m * qw, vx = kx + m * kw, q_stride = qw, k_stride = kw, v_stride = kw;
        L.qkv[0].run(xin, m, c, qx, scratch, prefill);
        L.qkv[1].run(xin, m, c, kx, scratch, prefill);
        L.qkv[2].run(xin, m, c, vx, scratch, prefill);
      }
      rotary_at(qx, q_stride, cp, sp, q_rot, m, hq, d);  // [M, H, D]
      rotary_at(kx, k_stride, cp, sp, k_rot, m, hkv, d);  // [M, H_kv, D]
      uint16_t* kl = kcache + static_cast<int64_t>(i) * l_stride;
      uint16_t* vl = vcache + static_cast<int64_t>(i) * l_stride;
      for (int64_t r = 0; r < m; ++r)
        for (int64_t g = 0; g < hkv; ++g) {
          const int64_t dst = rp[r / t] * s_stride + g * h_stride + wp[r] * d;
          std::memcpy(kl + dst, k_rot + (r * hkv + g) * d, 2 * d);
          std::memcpy(vl + dst, vx + r * v_stride + g * d, 2 * d);
        }
      const uint16_t* attn = attn_out;  // [M, H, D]
      at::Tensor prompt_attn;  // (prefill: torch's output, read by o)
      if (prefill) {
        const at::Tensor q = at::from_blob(q_rot, {m, hq, d}, h.options());
        prompt_attn = prefill_attention(q, kc[i], vc[i], rc, b, t, span, stacked_mask);
        attn = bf16_pointer(prompt_attn);
      } else {
        attention_of_rows(q_rot, true, hq, d, kl, s_stride, h_stride, vl, s_stride, h_stride, rp,
                          vis.data_ptr<bool>(), b, t, hkv, span, scale, attn_out);
      }
      L.o.run(attn, m, qw, o_out, scratch, prefill);
      rms_norm_at(hp, o_out, L.post, xo, m, c, eps);
      // gate, up [M, F] each, rows `gu_stride` apart: halves of one fused output, or two outputs
      uint16_t *gate = gate_up, *up = gate + f;
      int64_t gu_stride = 2 * f;
      if (L.gate_up.size() == 1) {
        L.gate_up[0].run(xo, m, c, gate, scratch, prefill);
      } else {
        up = gate + m * f, gu_stride = f;
        L.gate_up[0].run(xo, m, c, gate, scratch, prefill);
        L.gate_up[1].run(xo, m, c, up, scratch, prefill);
      }
      silu_mul_at(gate, up, gu_stride, act, m, f);
      L.down.run(act, m, f, down_out, scratch, prefill);
      rms_norm_at(hp, down_out, L.next, xo, m, c, eps);
    }
    return out;
  }

  // One pass (ChainPass, below): the embedding, the first norm and every layer, its inputs built here.
  at::Tensor chain_pass(const ChainPass& p, const ChainInputs& in, at::Tensor& kc, at::Tensor& vc) const;

  // A pass of Transformer.forward_with_hidden in one call, a chain or a tree (defined below).
  std::tuple<at::Tensor, at::Tensor> chain(const at::Tensor& tokens, const at::Tensor& counts, const at::Tensor& slots,
                                           at::Tensor& lengths, at::Tensor& step_start, const at::Tensor& bounds,
                                           at::Tensor& kc, at::Tensor& vc, const at::Tensor& embed,
                                           const at::Tensor& first_norm, const at::Tensor& cos, const at::Tensor& sin,
                                           const Projection* head, const c10::optional<at::Tensor>& logits_at,
                                           const c10::optional<at::Tensor>& positions,
                                           const c10::optional<at::Tensor>& within) const;

  // The drafting loop (defined below the picks).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> draft(
      const at::Tensor& tokens, const at::Tensor& counts, const at::Tensor& slots, const at::Tensor& lengths,
      const at::Tensor& bounds, at::Tensor& kc, at::Tensor& vc, const at::Tensor& limits, const at::Tensor& embed,
      const at::Tensor& first_norm, const at::Tensor& cos, const at::Tensor& sin, const Projection& head,
      const at::Tensor& head_ids, const Projection* more, const c10::optional<at::Tensor>& more_ids,
      const c10::optional<at::Tensor>& blocked, const py::object& keep, const c10::optional<at::Tensor>& rules,
      const c10::optional<at::Tensor>& merge, const py::object& draw) const;
};

// ------------------------------------------------------------------------------------ greedy pick

// Checks a segment of scores greedy_pick reads: scores [A, W] bf16 or fp32, ids [W] int64 (or
// none), blocked [A, W] bool (or none), all contiguous.
void check_segment(const at::Tensor& scores, const at::Tensor* ids, const at::Tensor* blocked, const char* what) {
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 2 && scores.is_contiguous() &&
                  (scores.scalar_type() == at::kBFloat16 || scores.scalar_type() == at::kFloat),
              what, " must be contiguous [A, W] bf16 or fp32 CPU scores");
  if (ids)
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->is_contiguous() && ids->numel() == scores.size(1), what,
                "'s ids must be [", scores.size(1), "] int64");
  if (blocked)
    TORCH_CHECK(blocked->scalar_type() == at::kBool && blocked->is_contiguous() &&
                    blocked->numel() == scores.numel(),
                what, "'s blocked columns must be [A, W] bool like its scores");
}

// scores [A, W] bf16 or fp32 with the id of each column (ids [W] int64, ascending; None: the
// column), and optionally a second segment more [A, E] (more_ids [E], ascending; blocked [A, E]
// bool: columns counting as -inf) -> (id [A] int64, confidence [A] fp32, ok [A] bool):
// vec/pick.cpp's greedy token of each row.
std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_pick(const at::Tensor& scores,
                                                           const c10::optional<at::Tensor>& ids,
                                                           const c10::optional<at::Tensor>& more,
                                                           const c10::optional<at::Tensor>& more_ids,
                                                           const c10::optional<at::Tensor>& blocked) {
  check_segment(scores, ids ? &*ids : nullptr, nullptr, "scores");
  TORCH_CHECK(!blocked || more, "blocked columns belong to a second segment");
  const int64_t a = scores.size(0);
  if (more) {
    TORCH_CHECK(more_ids.has_value() && more->size(0) == a, "a second segment needs its ids and the same rows");
    check_segment(*more, &*more_ids, blocked ? &*blocked : nullptr, "the second segment");
  }
  at::Tensor id = at::empty({a}, at::kLong), conf = at::empty({a}, at::kFloat), ok = at::empty({a}, at::kBool);
  const bool bf16 = scores.scalar_type() == at::kBFloat16;
  const int64_t w = scores.size(1), e = more ? more->size(1) : 0;
  const auto* base = static_cast<const uint8_t*>(scores.data_ptr());
  const auto* more_base = more ? static_cast<const uint8_t*>(more->data_ptr()) : nullptr;
  const bool more_bf16 = more && more->scalar_type() == at::kBFloat16;
  for (int64_t r = 0; r < a; ++r) {
    const PickSegment parts[2] = {
        PickSegment{base + r * w * scores.element_size(), bf16, w, ids ? ids->data_ptr<int64_t>() : nullptr, nullptr},
        PickSegment{more ? more_base + r * e * more->element_size() : nullptr, more_bf16, e,
                    more ? more_ids->data_ptr<int64_t>() : nullptr,
                    blocked ? blocked->data_ptr<bool>() + r * e : nullptr}};
    const PickResult p = pick_greedy(parts, more ? 2 : 1);
    id.data_ptr<int64_t>()[r] = p.id;
    conf.data_ptr<float>()[r] = p.confidence;
    ok.data_ptr<bool>()[r] = p.ok;
  }
  return {id, conf, ok};
}

// rules [A, 4] float64 (temperature, top_k, top_p, min_p: a row's SamplingParams as
// verispec.sampling.build_laws reads them; temperature 0: greedy) -> the rule of each row.
std::vector<SampleRule> sample_rules(const at::Tensor& rules, int64_t a_rows) {
  TORCH_CHECK(rules.scalar_type() == at::kDouble && rules.is_contiguous() && rules.dim() == 2 &&
                  rules.size(0) == a_rows && rules.size(1) == 4,
              "the sampling rules must be contiguous [A, 4] float64 (temperature, top_k, top_p, min_p)");
  std::vector<SampleRule> out(a_rows);
  const double* r = rules.data_ptr<double>();
  for (int64_t a = 0; a < a_rows; ++a) {
    const double* v = r + 4 * a;
    TORCH_CHECK(v[0] >= 0.0 && v[1] >= 0.0 && v[2] > 0.0 && v[2] <= 1.0 && v[3] >= 0.0 && v[3] <= 1.0,
                "row ", a, "'s sampling rule is out of range (temperature >= 0, top_k >= 0, top_p in (0, 1], ",
                "min_p in [0, 1])");
    out[a] = SampleRule{static_cast<float>(v[0]), static_cast<int64_t>(v[1]), v[2], static_cast<float>(v[3])};
  }
  return out;
}

// scores [A, W] fp32 (ascending ids), rules [A, 4] float64 (sample_rules, temperature > 0),
// u [A] float64 in [0, 1) -> (column [A] int64, law [A, W] fp32, ok [A] bool): vec/pick.cpp's
// law of each row (the steps of verispec.sampling.build_laws) and the column its uniform picks
// (-1 and a zero law where the row has none).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sampled_pick(const at::Tensor& scores, const at::Tensor& rules,
                                                            const at::Tensor& u) {
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 2 && scores.scalar_type() == at::kFloat,
              "scores must be [A, W] fp32 CPU scores");
  const int64_t a = scores.size(0), w = scores.size(1);
  const std::vector<SampleRule> rule = sample_rules(rules, a);
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == a, "u must be [A] float64");
  at::Tensor x = scores.contiguous().clone(), law = at::zeros({a, w}, at::kFloat);
  at::Tensor col = at::full({a}, -1, at::kLong), ok = at::zeros({a}, at::kBool);
  for (int64_t r = 0; r < a; ++r) {
    TORCH_CHECK(rule[r].temperature > 0.0f, "sampled_pick samples: a row's temperature must be > 0");
    float* lr = law.data_ptr<float>() + r * w;
    if (!sampled_law(x.data_ptr<float>() + r * w, w, rule[r], lr)) {
      std::fill(lr, lr + w, 0.0f);
      continue;
    }
    col.data_ptr<int64_t>()[r] = draw_column(lr, w, u.data_ptr<double>()[r]);
    ok.data_ptr<bool>()[r] = true;
  }
  return {col, law, ok};
}

// ------------------------------------------------------------------------------------ chain passes

// Checks what every pass in one call reads (ChainInputs) for layers of hidden size c and head size d
// over caches of kc's positions.
ChainInputs chain_inputs(const at::Tensor& embed, const at::Tensor& first_norm, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t c, int64_t d, const at::Tensor& kc) {
  check_bf16_cpu(embed, "the embedding");
  check_bf16_cpu(first_norm, "the first norm");
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == c && embed.is_contiguous(), "the embedding must be [V, ", c, "]");
  TORCH_CHECK(first_norm.numel() == c && first_norm.is_contiguous(), "the first norm must be [", c, "]");
  const int64_t positions = cos.dim() == 2 ? cos.size(0) : 0;
  for (const at::Tensor* t : {&cos, &sin}) {
    check_bf16_cpu(*t, "cos and sin");
    TORCH_CHECK(t->dim() == 2 && t->size(0) == positions && t->size(1) == d && t->is_contiguous(),
                "cos and sin must be contiguous [P, ", d, "]");
  }
  TORCH_CHECK(kc.dim() == 5 && positions >= kc.size(3) - 1, "RoPE's tables must cover the cache's ", kc.size(3) - 1,
              " positions, got ", positions);
  return {bf16_pointer(embed), bf16_pointer(first_norm), bf16_pointer(cos), bf16_pointer(sin), embed.size(0),
          positions, embed.options()};
}

// The pass's inputs built row by row (the embedding's rows, RoPE's rows at each token's position,
// where its keys go, what each query sees), then the first norm and every layer (forward) -> the
// final norm [m t, C]: the same operations, in the same order, as Transformer.forward_with_hidden's
// pass on the kernels.
at::Tensor Layers::chain_pass(const ChainPass& p, const ChainInputs& in, at::Tensor& kc, at::Tensor& vc) const {
  const int64_t m = p.m, t = p.t, c = hidden, d = head_dim, max_len = kc.size(3) - 1;
  at::Tensor h = at::empty({m * t, c}, in.bf16), x = at::empty({m * t, c}, in.bf16);
  at::Tensor cs = at::empty({m * t, d}, in.bf16), sn = at::empty({m * t, d}, in.bf16);
  at::Tensor rows = at::empty({m}, at::kLong), write_pos = at::empty({m, t}, at::kLong);
  int64_t* wp = write_pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    rows.data_ptr<int64_t>()[r] = p.slot[r];
    for (int64_t q = 0; q < t; ++q) {
      const int64_t row = r * t + q, given = p.position.empty() ? p.start[r] + q : p.position[row];
      const int64_t position = std::clamp<int64_t>(given, 0, in.positions - 1);  // (padding's: unread)
      std::memcpy(bf16_pointer_mut(h) + row * c, in.embed + p.token[row] * c, 2 * c);
      std::memcpy(bf16_pointer_mut(cs) + row * d, in.cos + position * d, 2 * d);
      std::memcpy(bf16_pointer_mut(sn) + row * d, in.sin + position * d, 2 * d);
      wp[row] = q < p.real[r] ? p.start[r] + q : max_len;
    }
  }
  at::Tensor visible = at::empty({m, t, p.span}, at::kBool);  // a padding query sees position 0
  bool* vis = visible.data_ptr<bool>();
  for (int64_t row = 0; row < m * t; ++row) {
    const int64_t r = row / t, q = row % t, cached = p.width - t, first = p.start[r] - cached;
    const bool* seen = p.within ? p.within + row * p.width : nullptr;  // [W]: what query q sees in the window
    for (int64_t j = 0; j < p.span; ++j) {
      const int64_t s = j - first;  // (position s of the window)
      vis[row * p.span + j] = wp[row] == max_len ? j == 0
                              : !seen             ? j <= wp[row]
                                                  : s < 0 || (s < cached + p.real[r] && (s == cached + q || seen[s]));
    }
  }
  rms_norm_at(bf16_pointer_mut(h), nullptr, in.first_norm, bf16_pointer_mut(x), m * t, c, eps);
  return forward(h, x, cs, sn, kc, vc, rows, write_pos, p.span, visible, false);  // [m t, C]
}

// A pass in one call (ChainPass): Transformer.forward_with_hidden when it is not a prompt's chunk
// (a chain, a tree verified in one pass or grown level by level), without its ~0.6-1 ms of Python
// and torch calls around the layers. Row b appends tokens[b, :counts[b]] to
// cache row slots[b] at its length (lengths[slots[b]]; the rest of the row is padding, as KVCache
// pads it), then the head at the offsets logits_at [B, N] (None: every offset), widened to fp32;
// last, step_start[slot] = that length and lengths[slot] += count (KVCache.begin_step's and
// end_step's updates; nothing changes when a check fails).
//   tokens [B, T] int64, counts [B] in [0, T]; slots [B] distinct; lengths, step_start [S] int64;
//   bounds [B]: the host's bounds of the rows' lengths (they set the span as KVCache.begin_step
//   does); embed, first_norm, cos, sin: chain_inputs; head (or None); positions [B, T] int64 (or
//   None: length + offset), within [B, T, W] bool (or None: causal), as ChainPass reads them.
// -> (the final norm [B, T, C] bf16, logits [B, N, V] fp32: [0] without a head).
std::tuple<at::Tensor, at::Tensor> Layers::chain(const at::Tensor& tokens, const at::Tensor& counts,
                                                 const at::Tensor& slots, at::Tensor& lengths, at::Tensor& step_start,
                                                 const at::Tensor& bounds, at::Tensor& kc, at::Tensor& vc,
                                                 const at::Tensor& embed, const at::Tensor& first_norm,
                                                 const at::Tensor& cos, const at::Tensor& sin, const Projection* head,
                                                 const c10::optional<at::Tensor>& logits_at,
                                                 const c10::optional<at::Tensor>& positions,
                                                 const c10::optional<at::Tensor>& within) const {
  const ChainInputs in = chain_inputs(embed, first_norm, cos, sin, hidden, head_dim, kc);
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) >= 1 && tokens.size(1) >= 1, "tokens must be [B, T], B, T >= 1");
  const int64_t b = tokens.size(0), t = tokens.size(1), max_len = kc.size(3) - 1;
  for (const at::Tensor* v : std::initializer_list<const at::Tensor*>{&tokens, &counts, &slots, &lengths, &step_start,
                                                                      &bounds})
    TORCH_CHECK(v->scalar_type() == at::kLong && v->is_contiguous() && v->device().is_cpu(),
                "tokens, counts, slots, lengths, step_start and bounds must be contiguous int64 CPU tensors");
  for (const at::Tensor* v : {&counts, &slots, &bounds})
    TORCH_CHECK(v->numel() == b, "counts, slots and bounds need one value a row");
  TORCH_CHECK(step_start.numel() == lengths.numel(), "step_start must be as long as lengths");
  const int64_t *tok = tokens.data_ptr<int64_t>(), *count = counts.data_ptr<int64_t>();
  const int64_t *slot = slots.data_ptr<int64_t>(), *bound = bounds.data_ptr<int64_t>();
  int64_t* len = lengths.data_ptr<int64_t>();
  ChainPass p{b, t, 0, t, std::vector<int64_t>(b * t, 0), {}, {}, {}, {}};
  at::Tensor within_c;
  if (within) {
    within_c = within->contiguous();
    TORCH_CHECK(within_c.scalar_type() == at::kBool && within_c.dim() == 3 && within_c.size(0) == b &&
                    within_c.size(1) == t && within_c.size(2) >= t,
                "within must be [B, T, W] bool, W >= T");
    p.within = within_c.data_ptr<bool>();
    p.width = within_c.size(2);
  }
  const int64_t* pos = nullptr;
  at::Tensor positions_c;
  if (positions) {
    positions_c = positions->contiguous();
    TORCH_CHECK(positions_c.scalar_type() == at::kLong && positions_c.dim() == 2 && positions_c.size(0) == b &&
                    positions_c.size(1) == t,
                "positions must be [B, T] int64");
    pos = positions_c.data_ptr<int64_t>();
    p.position.assign(pos, pos + b * t);
  }
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < lengths.numel() && slot[r] < kc.size(1), "cache row out of range");
    for (int64_t o = 0; o < r; ++o) TORCH_CHECK(slot[o] != slot[r], "slots must be distinct");
    TORCH_CHECK(count[r] >= 0 && count[r] <= t, "each row's count must be in [0, T]");
    TORCH_CHECK(len[slot[r]] >= 0 && len[slot[r]] <= bound[r] && bound[r] + count[r] <= max_len,
                "the cache cannot hold ", count[r], " more tokens in row ", slot[r]);
    for (int64_t q = 0; q < count[r]; ++q) {
      const int64_t id = tok[r * t + q];
      TORCH_CHECK_INDEX(id >= 0 && id < in.vocab, "token ", id, " is outside the embedding of ", in.vocab);
      TORCH_CHECK(!pos || (pos[r * t + q] >= 0 && pos[r * t + q] < in.positions), "position ", pos ? pos[r * t + q] : 0,
                  " is outside RoPE's tables of ", in.positions);
      p.token[r * t + q] = id;
    }
    p.slot.push_back(slot[r]);
    p.real.push_back(count[r]);
    p.start.push_back(len[slot[r]]);
    p.span = std::max(p.span, std::min(max_len, bound[r] + count[r]));
  }
  const int64_t n = logits_at ? logits_at->size(1) : t;
  at::Tensor offsets_c;  // [B, N]: logits_at's offsets
  if (logits_at) {
    TORCH_CHECK(logits_at->scalar_type() == at::kLong && logits_at->dim() == 2 && logits_at->size(0) == b,
                "logits_at must be [B, N] int64");
    offsets_c = logits_at->contiguous();
    const int64_t* offsets = offsets_c.data_ptr<int64_t>();
    for (int64_t i = 0; i < b * n; ++i)
      TORCH_CHECK_INDEX(offsets[i] >= 0 && offsets[i] < t, "logits_at's offsets must be in [0, ", t, ")");
  }
  const at::Tensor out = chain_pass(p, in, kc, vc);  // [B T, C]
  at::Tensor logits = at::empty({0}, at::kFloat);
  if (head != nullptr) {
    TORCH_CHECK(head->takes(hidden), "the head must take ", hidden, " inputs");
    at::Tensor picked = out;  // [B N, C]: the rows at logits_at
    if (logits_at) {
      const int64_t* offsets = offsets_c.data_ptr<int64_t>();
      picked = at::empty({b * n, hidden}, in.bf16);
      for (int64_t i = 0; i < b * n; ++i)  // (row i / n's offset i)
        std::memcpy(bf16_pointer_mut(picked) + i * hidden, bf16_pointer(out) + ((i / n) * t + offsets[i]) * hidden,
                    2 * hidden);
    }
    at::Tensor scores = at::empty({b * n, head->n}, in.bf16);  // [B N, V]
    if (b * n > 0) {
      at::Tensor scratch = scratch_of(head->scratch_bytes(b * n, hidden, false));
      head->run(bf16_pointer(picked), b * n, hidden, bf16_pointer_mut(scores), scratch.data_ptr<uint8_t>(), false);
    }
    logits = scores.to(at::kFloat).view({b, n, head->n});
  }
  int64_t* start = step_start.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    start[slot[r]] = len[slot[r]];
    len[slot[r]] += count[r];
  }
  return {out.view({b, t, hidden}), logits};
}

// ------------------------------------------------------------------------------------ drafting

// The drafting loop of verispec.drafters.model: one call for a whole proposal. Pass
// 0 appends each row's pending tokens (tokens[a, :counts[a]]: the last committed one, and the last
// draft token when the target accepted the whole draft; the rows right-padded as KVCache pads
// them: padding keys to the scratch column, padding queries seeing position 0), every later pass
// the row's token of the pass before. Per pass: chain_pass (the embedding, the first layer's
// input norm, every layer), at each row's last token the restricted head (and the head of the
// request's own ids, `more`), its token and confidence, then `keep(a, i, confidence)` (None:
// always) says whether row a drafts on after its token of pass i.
// Greedy (rules None): the token is the greedy pick of the heads' scores (pick_greedy); the same
// operations in the same order as the drafter's Python loop with the model's forward, the heads
// and ops.greedy_pick, bit for bit; what it saves is their Python and torch calls (0.5-0.8 ms a pass).
// Sampled (rules [A, 4] float64, sample_rules; temperature 0: a greedy row): the heads' scores
// in ascending id order (merge [H + E]: the column of cat(head, more) each merged column takes;
// None: the head's alone) make the row's law (sampled_law; a greedy row's: the point mass at its
// greedy pick of the merged row, whose probability at temperature 1 is its confidence), then
// `draw(i, rows)` gives one uniform in [0, 1) per row of `rows` (the sampled rows of pass i with
// a law, in order: drawn from each request's generator as verispec.sampling.sample draws), and
// draw_column picks the token; its confidence is its probability under the law.
//   tokens [A, T0] int64, counts [A] in [1, T0]; slots [A]: the rows' cache rows; lengths: the
//   cache's lengths (read: the caller advances them by the result's fed); bounds [A]: the host's
//   bounds of those lengths (KVCache: they set the attention's span as a Python pass has it);
//   limits [A] >= 1: the most tokens each row may draft; embed, first_norm, cos, sin: chain_inputs
//   (RoPE's tables of every position); head over head_ids [H]; more (or None) over more_ids [E],
//   blocked [A, E] bool (or None).
// -> (drafted [A, L] int64, L the largest limit: the token of pass i, -1 where the row drafted
// none; fed [A] int64: the tokens each row appended to its cache; laws [A, L, W] fp32, W = H + E,
// in merged column order: the law each token was drawn from (zero where none; [0] when greedy)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> Layers::draft(
    const at::Tensor& tokens, const at::Tensor& counts, const at::Tensor& slots, const at::Tensor& lengths,
    const at::Tensor& bounds, at::Tensor& kc, at::Tensor& vc, const at::Tensor& limits, const at::Tensor& embed,
    const at::Tensor& first_norm, const at::Tensor& cos, const at::Tensor& sin, const Projection& head,
    const at::Tensor& head_ids, const Projection* more, const c10::optional<at::Tensor>& more_ids,
    const c10::optional<at::Tensor>& blocked, const py::object& keep, const c10::optional<at::Tensor>& rules,
    const c10::optional<at::Tensor>& merge, const py::object& draw) const {
  const int64_t c = hidden;
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(0) >= 1 && tokens.size(1) >= 1, "tokens must be [A, T0], A, T0 >= 1");
  const int64_t a_rows = tokens.size(0), t0 = tokens.size(1);
  for (const at::Tensor* t : {&tokens, &counts, &slots, &limits, &lengths, &bounds})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "tokens, counts, slots, limits, lengths and bounds must be contiguous int64 CPU tensors");
  for (const at::Tensor* t : {&counts, &slots, &limits, &bounds})
    TORCH_CHECK(t->numel() == a_rows, "counts, slots, bounds and limits need one value a row");
  const ChainInputs in = chain_inputs(embed, first_norm, cos, sin, c, head_dim, kc);
  TORCH_CHECK(head.k == c && head_ids.scalar_type() == at::kLong && head_ids.is_contiguous() &&
                  head_ids.numel() == head.n,
              "the head must take ", c, " inputs and name each of its outputs' ids (head_ids [", head.n, "])");
  const int64_t e = more ? more->n : 0;
  if (more) {
    TORCH_CHECK(more->k == c && more_ids && more_ids->scalar_type() == at::kLong && more_ids->is_contiguous() &&
                    more_ids->numel() == e,
                "the second head must take ", c, " inputs and name its outputs' ids");
    TORCH_CHECK(!blocked || (blocked->scalar_type() == at::kBool && blocked->is_contiguous() &&
                             blocked->numel() == a_rows * e),
                "blocked must be [A, E] bool");
  }
  const bool sampled = rules.has_value();
  const int64_t wide = head.n + e;  // the merged columns
  std::vector<SampleRule> rule;
  if (sampled) {
    rule = sample_rules(*rules, a_rows);
    TORCH_CHECK(!draw.is_none(), "sampled drafting needs draw(i, rows) -> uniforms");
    if (merge) {
      TORCH_CHECK(merge->scalar_type() == at::kLong && merge->is_contiguous() && merge->numel() == wide, "merge must "
                  "be [H + E] int64");
      const int64_t* mo = merge->data_ptr<int64_t>();
      for (int64_t j = 0; j < wide; ++j) TORCH_CHECK(mo[j] >= 0 && mo[j] < wide, "merge names a column out of range");
    } else {
      TORCH_CHECK(!more, "sampled drafting with a second head needs the merged order");
    }
  }
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* limit = limits.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t* bound = bounds.data_ptr<int64_t>();
  const int64_t max_len = kc.size(3) - 1;  // (the last position: padding's scratch column)
  int64_t most = 1;
  for (int64_t a = 0; a < a_rows; ++a) {
    TORCH_CHECK(count[a] >= 1 && count[a] <= t0, "each row's count must be in [1, T0]");
    for (int64_t q = 0; q < count[a]; ++q)
      TORCH_CHECK(tok[a * t0 + q] >= 0 && tok[a * t0 + q] < in.vocab, "token ", tok[a * t0 + q],
                  " is outside the embedding");
    TORCH_CHECK(slot[a] >= 0 && slot[a] < lengths.numel() && slot[a] < kc.size(1), "cache row out of range");
    TORCH_CHECK(limit[a] >= 1, "each row's limit must be >= 1");
    TORCH_CHECK(len[slot[a]] >= 0 && len[slot[a]] <= bound[a] && bound[a] + count[a] + limit[a] - 1 <= max_len,
                "the cache cannot hold ", count[a] + limit[a] - 1, " more tokens in row ", slot[a]);
    most = std::max(most, limit[a]);
  }
  const at::TensorOptions bf16 = embed.options(), longs = tokens.options();
  at::Tensor drafted = at::full({a_rows, most}, -1, longs), fed = at::zeros({a_rows}, longs);
  at::Tensor laws = sampled ? at::zeros({a_rows, most, wide}, at::kFloat) : at::empty({0}, at::kFloat);
  at::Tensor merged = at::empty({sampled ? a_rows : 0, wide}, at::kFloat);  // a pass's rows, merged
  // the id of merged column j
  const int64_t* merge_of = merge ? merge->data_ptr<int64_t>() : nullptr;
  const auto id_of = [&](int64_t j) {
    const int64_t src = merge_of ? merge_of[j] : j;
    return src < head.n ? head_ids.data_ptr<int64_t>()[src] : more_ids->data_ptr<int64_t>()[src - head.n];
  };
  int64_t* out_ids = drafted.data_ptr<int64_t>();
  int64_t* out_fed = fed.data_ptr<int64_t>();
  std::vector<int64_t> active(a_rows), last(a_rows);
  for (int64_t a = 0; a < a_rows; ++a) active[a] = a;
  // the heads' inputs, outputs and scratch, for the most rows a pass has (one a row)
  int64_t scratch_bytes = 1;
  for (int64_t m = 1; m <= a_rows; ++m) {
    scratch_bytes = std::max(scratch_bytes, head.scratch_bytes(m, c, false));
    if (more) scratch_bytes = std::max(scratch_bytes, more->scratch_bytes(m, c, false));
  }
  at::Tensor picked_rows = at::empty({a_rows, c}, bf16), scores = at::empty({a_rows, head.n}, bf16);
  at::Tensor more_scores = at::empty({a_rows, std::max<int64_t>(e, 1)}, bf16), scratch = scratch_of(scratch_bytes);
  // Sampled: row r (request a) of pass i's merged scores -> its law (laws[a, i]); a greedy row's
  // pick (id: the merged column) and its point mass; a sampled row's ok (its column comes later).
  const auto law_of_row = [&](int64_t r, int64_t a, int64_t i) -> PickResult {
    float* x = merged.data_ptr<float>() + r * wide;
    const uint16_t* hs = bf16_pointer(scores) + r * head.n;
    const uint16_t* ms = bf16_pointer(more_scores) + r * e;
    const bool* no = more && blocked ? blocked->data_ptr<bool>() + a * e : nullptr;
    for (int64_t j = 0; j < wide; ++j) {  // (bf16 -> fp32: the bits in the high half)
      const int64_t src = merge_of ? merge_of[j] : j, o = src - head.n;
      const uint32_t bits = static_cast<uint32_t>(src < head.n ? hs[src] : ms[o]) << 16;
      std::memcpy(x + j, &bits, 4);
      if (o >= 0 && no && no[o]) x[j] = -std::numeric_limits<float>::infinity();
    }
    float* law = laws.data_ptr<float>() + (a * most + i) * wide;
    if (rule[a].temperature == 0.0f) {
      const PickSegment row{x, false, wide, nullptr, nullptr};
      PickResult p = pick_greedy(&row, 1);
      if (p.ok) law[p.id] = 1.0f;
      return p;
    }
    return PickResult{-1, 0.0f, sampled_law(x, wide, rule[a], law)};
  };
  // Sampled: the uniforms of pass i's sampled rows with a law (one Python call), their columns;
  // then every pick's id from its column.
  const auto draw_tokens = [&](int64_t i, std::vector<PickResult>& picks) {
    py::list rows;
    for (size_t r = 0; r < picks.size(); ++r)
      if (picks[r].ok && rule[active[r]].temperature != 0.0f) rows.append(active[r]);
    std::vector<double> u;
    if (py::len(rows) > 0) {
      const py::sequence got = draw(i, rows);
      TORCH_CHECK(py::len(got) == py::len(rows), "draw must give one uniform a row");
      for (const py::handle v : got) {
        u.push_back(v.cast<double>());
        TORCH_CHECK(u.back() >= 0.0 && u.back() < 1.0, "draw must give uniforms in [0, 1)");
      }
    }
    size_t next_u = 0;
    for (size_t r = 0; r < picks.size(); ++r) {
      PickResult& p = picks[r];
      if (!p.ok) continue;
      const int64_t a = active[r];
      if (rule[a].temperature != 0.0f) {
        const float* law = laws.data_ptr<float>() + (a * most + i) * wide;
        p.id = draw_column(law, wide, u[next_u++]);
        p.confidence = law[p.id];
      }
      p.id = id_of(p.id);
    }
  };
  for (int64_t i = 0; i < most && !active.empty(); ++i) {
    const int64_t m = static_cast<int64_t>(active.size()), t = i == 0 ? t0 : 1;
    std::vector<PickResult> picks(m);
    {
      py::gil_scoped_release no_gil;  // (a server's event loop runs meanwhile; only keep needs Python)
      ChainPass p{m, t, 0, t, std::vector<int64_t>(m * t, 0), {}, {}, {}, {}};
      for (int64_t r = 0; r < m; ++r) {
        const int64_t a = active[r], first = i == 0 ? 0 : count[a] + i - 1;  // the pass's first offset
        p.slot.push_back(slot[a]);
        p.real.push_back(i == 0 ? count[a] : 1);
        p.start.push_back(len[slot[a]] + first);
        for (int64_t q = 0; q < p.real[r]; ++q) p.token[r * t + q] = i > 0 ? last[a] : tok[a * t0 + q];
        p.span = std::max(p.span, std::min(max_len, bound[a] + count[a] + i));  // (KVCache.begin_step's span)
      }
      const at::Tensor out = chain_pass(p, in, kc, vc);  // [m t, C]
      for (int64_t r = 0; r < m; ++r) {  // each row's last token's
        const int64_t q = i == 0 ? count[active[r]] - 1 : 0;
        std::memcpy(bf16_pointer_mut(picked_rows) + r * c, bf16_pointer(out) + (r * t + q) * c, 2 * c);
      }
      head.run(bf16_pointer(picked_rows), m, c, bf16_pointer_mut(scores), scratch.data_ptr<uint8_t>(), false);
      if (more)
        more->run(bf16_pointer(picked_rows), m, c, bf16_pointer_mut(more_scores), scratch.data_ptr<uint8_t>(), false);
      if (sampled)  // (rows apart: each its own merged row and law)
        at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) picks[r] = law_of_row(r, active[r], i);
        });
      for (int64_t r = 0; r < m; ++r) {
        const int64_t a = active[r];
        out_fed[a] += i == 0 ? count[a] : 1;
        if (sampled) continue;
        const PickSegment parts[2] = {
            PickSegment{bf16_pointer(scores) + r * head.n, true, head.n, head_ids.data_ptr<int64_t>(), nullptr},
            PickSegment{more ? bf16_pointer(more_scores) + r * e : nullptr, true, e,
                        more ? more_ids->data_ptr<int64_t>() : nullptr,
                        more && blocked ? blocked->data_ptr<bool>() + a * e : nullptr}};
        picks[r] = pick_greedy(parts, more ? 2 : 1);
      }
    }
    if (sampled) draw_tokens(i, picks);
    std::vector<int64_t> next;
    for (int64_t r = 0; r < m; ++r) {
      const int64_t a = active[r];
      const PickResult& p = picks[r];
      if (!p.ok) continue;  // no greedy token: the row's draft ends before this position
      out_ids[a * most + i] = p.id;
      last[a] = p.id;
      const bool goes_on = keep.is_none() || keep(a, i, p.confidence).cast<bool>();
      if (goes_on && i + 1 < limit[a]) next.push_back(a);
    }
    active.swap(next);
  }
  return {drafted, fed, laws};
}

// ------------------------------------------------------------------------------------ bandwidth

// Reads every byte of t once (all threads) and returns a checksum: the benchmarks time it to
// measure the memory read bandwidth the kernels can hope for.
int64_t stream_read(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "t must be a contiguous CPU tensor");
  constexpr int64_t kChunk = 1 << 20;
  const int64_t bytes = t.nbytes(), chunks = (bytes + kChunk - 1) / kChunk;
  const auto* base = static_cast<const uint8_t*>(t.data_ptr());
  std::vector<uint64_t> partial(chunks, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) partial[i] = stream_xor(base + i * kChunk, std::min(kChunk, bytes - i * kChunk));
  });
  uint64_t total = 0;
  for (uint64_t v : partial) total ^= v;
  return static_cast<int64_t>(total);
}

}  // namespace
}  // namespace verispec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "verispec CPU kernels, tier " VS_STRING(VS_TIER) "; see verispec/kernels/csrc/";
  // The projections, attention and the layer loops call no Python: other Python threads (a server's
  // event loop beside the engine's thread) run while they compute.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("tier", [] { return std::string(VS_STRING(VS_TIER)); }, "the instruction-set tier this module was built for");
  m.def("amx_available", &verispec::amx_permitted, "whether this process may use AMX tiles (amx tier only)");
  m.def("q4k_pack", &verispec::q4k_pack_blocks, "GGUF Q4_K blocks [N, ceil(K/256)*144] uint8 -> packed records (K a multiple of 128)");
  m.def("q4k_dequantize", &verispec::q4k_dequantize_packed, "packed Q4_K -> the exact fp32 weights [N, K]");
  m.def("q4k_whole_records", &verispec::q4k_whole_records,
        "packed Q4_K of K = 256 s + 128 inputs -> the same weights as K + 128 inputs in whole records (for AMX tiles)");
  m.def("q6k_pack", &verispec::q6k_pack_blocks, "GGUF Q6_K blocks [N, K/256*210] uint8 -> packed records (K a multiple of 256)");
  m.def("q6k_dequantize", &verispec::q6k_dequantize_packed, "packed Q6_K -> the exact fp32 weights [N, K]");
  m.def("q6k_linear", &verispec::q6k_matmul,
        "x [M, K] quantised to int8 per 64 inputs, times dequantise(packed Q6_K).T, + bias -> [M, N], x's dtype",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bias"), no_gil);
  m.def("q4k_linear", &verispec::q4k_matmul,
        "x [M, K] quantised to int8 per 64 inputs, times dequantise(packed Q4_K).T, + bias -> [M, N], x's dtype; "
        "engine 0 = by the number of rows, 1 = vectors, 2 = AMX (amx tier; the same result)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("engine") = 0, no_gil);
  m.def("w8a8_pack", &verispec::w8a8_pack_codes, "int8 codes [N, K] -> packed W8A8 layout (codes + 128)");
  m.def("w8a8_quantize", &verispec::w8a8_quantize_rows, "x [M, K] -> (int8 [M, K], scales per 64 inputs [M, ceil(K/64)], sums per 32 inputs [M, K/32])");
  m.def("w8a8_linear", &verispec::w8a8_matmul,
        "x [M, K] quantised to int8 per 64 inputs, times (scale * codes).T, + bias -> [M, N], x's dtype; engine 0 = "
        "by the number of rows, 1 = vectors, 2 = AMX (amx tier; the same result)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("n"), py::arg("k"), py::arg("bias"),
        py::arg("engine") = 0, no_gil);
  m.def("bf16_pack", &verispec::bf16_pack_weight, "bf16 weight [N, K] -> packed pair layout (N rounded up to 16)");
  m.def("bf16_linear", &verispec::bf16_matmul,
        "x [M, K] bf16 times unpack(packed).T (fp32 sums: TDPBF16PS order on amx, one FMA chain elsewhere), + bias -> [M, N] bf16 (fp32 when out_fp32)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("out_fp32") = false,
        no_gil);
  m.def("prefill_available", [] { return verispec::kHasAmx && verispec::amx_permitted(); },
        "whether the prefill kernels run here (the amx tier with AMX permitted)");
  m.def("int8_prefill_linear", &verispec::int8_prefill_matmul,
        "x [M, K] bf16 times the int8 weights (scale * codes) rounded to bf16 (nearest even), summed on AMX bf16 "
        "tiles as bf16_linear, + bias -> [M, N] bf16: the amx tier's path for a prompt's rows",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("n"), py::arg("k"), py::arg("bias"), no_gil);
  m.def("q4k_prefill_linear", &verispec::q4k_prefill_matmul,
        "x [M, K] bf16 times the Q4_K weights dequantised to bf16 (round to nearest even), summed on AMX bf16 "
        "tiles as bf16_linear, + bias -> [M, N] bf16: the amx tier's path for a prompt's rows",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bias"), no_gil);
  m.def("attention_scores", &verispec::attention_scores,
        "q [M, D], k [N, D] bf16 -> [M, N] fp32: the amx tier's attention scores, unscaled (tests)");
  m.def("attention_rows", &verispec::attention_by_row,
        "q [B, T, H, D], k/v [B, H_kv, span, D], visible [B, T, span] bool, scale -> [B, T, H, D]: softmax "
        "attention one query row at a time in a fixed order (batch-invariant)",
        no_gil);
  m.def("rms_norm", &verispec::rms_norm,
        "h [..., C] bf16 (h += delta in place first, when given) -> RMSNorm(h) * weight (batch-invariant)",
        py::arg("h"), py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("rotary", &verispec::rotary, "x [M, heads * d] bf16, cos/sin [M, d] -> rotate-half RoPE [M, heads, d]");
  m.def("silu_mul", &verispec::silu_mul, "gate, up [M, F] bf16 -> silu(gate) * up [M, F]");
  m.def("sampled_pick", &verispec::sampled_pick,
        "scores [A, W] fp32 (ascending ids), rules [A, 4] float64 (temperature > 0, top_k, top_p, min_p), u [A] "
        "float64 -> (column [A], law [A, W], ok [A]): each row's sampled law and the column its uniform draws",
        py::arg("scores"), py::arg("rules"), py::arg("u"));
  m.def("greedy_pick", &verispec::greedy_pick,
        "scores [A, W] (ids [W] or None), more [A, E] or None, more_ids [E], blocked [A, E] -> (id [A], "
        "confidence [A], ok [A]): each row's greedy token (ties to the smallest id) and its probability at "
        "temperature 1",
        py::arg("scores"), py::arg("ids") = py::none(), py::arg("more") = py::none(), py::arg("more_ids") = py::none(),
        py::arg("blocked") = py::none());
  m.def("stream_read", &verispec::stream_read, "read every byte of a tensor once (bandwidth probe)");
  py::class_<verispec::Projection>(m, "Projection")
      .def(py::init(&verispec::projection_of),
           py::arg("kind"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("n"), py::arg("k"));
  py::class_<verispec::Layers>(m, "Layers")
      .def(py::init([](const std::vector<std::tuple<std::vector<verispec::Projection>, verispec::Projection,
                                                    std::vector<verispec::Projection>, verispec::Projection,
                                                    at::Tensor, at::Tensor>>& specs,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t hidden, int64_t inter, double eps) {
             verispec::Layers out{{}, heads, kv_heads, head_dim, inter, hidden, eps};
             for (const auto& [qkv, o, gate_up, down, post, next] : specs) {
               TORCH_CHECK((qkv.size() == 1 || qkv.size() == 3) && (gate_up.size() == 1 || gate_up.size() == 2),
                           "q/k/v are 1 fused or 3 projections, gate/up 1 or 2");
               out.layers.push_back({qkv, gate_up, o, down, post, next});
             }
             out.prepare();
             return out;
           }),
           "[([qkv] or [q, k, v], o, [gate_up] or [gate, up], down, post_attention_norm, next_norm), ...] per "
           "layer, then the shapes: heads, kv_heads, head_dim, hidden, inter, eps")
      .def("forward", &verispec::Layers::forward,
           "h, x, cos, sin, k_cache, v_cache, rows, write_pos, span, visible, prefill -> the final norm of h (one "
           "call for every decoder layer; prefill: a prompt's chunk, int8 / Q4_K projections on the prefill kernels "
           "and attention by torch's scaled_dot_product_attention)",
           py::arg("h"), py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("rows"), py::arg("write_pos"), py::arg("span"), py::arg("visible"), py::arg("prefill") = false,
           no_gil)
      .def("chain", &verispec::Layers::chain,
           "tokens [B, T], counts [B], slots [B], lengths, step_start, bounds [B], k_cache, v_cache, embed, "
           "first_norm, cos [P, D], sin [P, D], head, logits_at, positions [B, T], within [B, T, W] -> (the final "
           "norm [B, T, C], logits [B, N, V] fp32): a pass in one call, a chain or a tree (lengths and step_start "
           "updated as KVCache.begin_step / end_step do)",
           py::arg("tokens"), py::arg("counts"), py::arg("slots"), py::arg("lengths"), py::arg("step_start"),
           py::arg("bounds"), py::arg("k_cache"), py::arg("v_cache"), py::arg("embed"), py::arg("first_norm"),
           py::arg("cos"), py::arg("sin"), py::arg("head"), py::arg("logits_at") = py::none(),
           py::arg("positions") = py::none(), py::arg("within") = py::none(), no_gil)
      .def("draft", &verispec::Layers::draft,
           "tokens, counts, slots, lengths, bounds, k_cache, v_cache, limits, embed, first_norm, cos, sin, head, "
           "head_ids, more, more_ids, blocked, keep, rules, merge, draw -> (drafted [A, L], fed [A], laws [A, L, W]): "
           "the drafting loop (one call for a whole proposal; greedy when rules is None)",
           py::arg("tokens"), py::arg("counts"), py::arg("slots"), py::arg("lengths"), py::arg("bounds"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("limits"), py::arg("embed"), py::arg("first_norm"),
           py::arg("cos"), py::arg("sin"), py::arg("head"), py::arg("head_ids"), py::arg("more"), py::arg("more_ids"),
           py::arg("blocked"), py::arg("keep"), py::arg("rules") = py::none(), py::arg("merge") = py::none(),
           py::arg("draw") = py::none());
}
