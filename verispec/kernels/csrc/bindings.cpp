// torch glue of the kernels: argument checks, dtype handling, threading (at::parallel_for over
// 16-row weight blocks, so the kernels use torch's thread count) and the Python module.
#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include "common.h"

namespace verispec {

bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

namespace {

int64_t row_blocks(int64_t n) { return (n + kRows - 1) / kRows; }

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

// x [M, K] (fp32 or bf16) -> (int8 [M, K], scales fp32 [M, ceil(K / 64)], sums int32 [M, K / 32]):
// the activation quantisation the W8A8 kernels apply (exposed for tests and references).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, "x must be [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "x rows must have a multiple of 32 inputs, got ", k);
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  const int64_t blocks = (k + kW8A8Block - 1) / kW8A8Block;
  at::Tensor scale = at::empty({m, blocks}, x.options().dtype(at::kFloat));
  at::Tensor sum = at::empty({m, k / 32}, x.options().dtype(at::kInt));
  w8a8_quantize(xc.data_ptr(), x.scalar_type() == at::kBFloat16, k, xq.data_ptr<int8_t>(), scale.data_ptr<float>(),
                sum.data_ptr<int32_t>(), 0, m);
  return {xq, scale, sum};
}

// The W8A8Args of x and y (the weights' fields are the caller's).
W8A8Args quantized_args(const at::Tensor& x, at::Tensor& y, int64_t n, int64_t k, const c10::optional<at::Tensor>& bias,
                        std::tuple<at::Tensor, at::Tensor, at::Tensor>& xqs) {
  xqs = w8a8_quantize_rows(x);
  W8A8Args a{};
  a.xq = std::get<0>(xqs).data_ptr<int8_t>();
  a.xscale = std::get<1>(xqs).data_ptr<float>();
  a.xsum = std::get<2>(xqs).data_ptr<int32_t>();
  a.bias = bias_pointer(bias, n);
  a.y = y.data_ptr();
  a.M = x.size(0);
  a.N = n;
  a.K = k;
  a.out_bf16 = y.scalar_type() == at::kBFloat16;
  return a;
}

// ------------------------------------------------------------------------------------ Q4_K

at::Tensor q4k_pack_blocks(const at::Tensor& blocks, int64_t n, int64_t k) {
  TORCH_CHECK(k % kQ4KSuper == 0, "Q4_K rows must have a multiple of 256 inputs, got ", k);
  check_weights(blocks, at::kByte, n * (k / kQ4KSuper) * kQ4KBlock, "Q4_K blocks");
  at::Tensor packed = at::empty({row_blocks(n) * (k / kQ4KSuper) * kQ4KRecord}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q4k_pack(src, n, k, dst, b, e); });
  return packed;
}

at::Tensor q4k_dequantize_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  check_weights(packed, at::kByte, row_blocks(n) * (k / kQ4KSuper) * kQ4KRecord, "packed Q4_K");
  at::Tensor w = at::empty({row_blocks(n) * kRows, k}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = w.data_ptr<float>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q4k_dequantize(src, k, dst, b, e); });
  return w.narrow(0, 0, n).contiguous();
}

at::Tensor q4k_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t k,
                      const c10::optional<at::Tensor>& bias, int64_t engine) {
  TORCH_CHECK(k % kQ4KSuper == 0, "Q4_K rows must have a multiple of 256 inputs, got ", k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1, "x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(engine >= kEngineAuto && engine <= kEngineAmx, "engine must be 0 (auto), 1 (VNNI) or 2 (AMX)");
  check_weights(packed, at::kByte, row_blocks(n) * (k / kQ4KSuper) * kQ4KRecord, "packed Q4_K");
  const int eng = static_cast<int>(engine);
  TORCH_CHECK(!q4k_uses_amx(x.size(0), eng) || amx_permitted(), "AMX is not available on this CPU or kernel");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  std::tuple<at::Tensor, at::Tensor, at::Tensor> xqs;
  W8A8Args a = quantized_args(x, y, n, k, bias, xqs);
  // a_j = float(P_j) * scale_x of its block of 64 (two sub-blocks of 32 per block)
  const at::Tensor xmin = std::get<2>(xqs).to(at::kFloat) * std::get<1>(xqs).repeat_interleave(2, 1);
  a.w = packed.data_ptr<uint8_t>();
  a.xmin = xmin.data_ptr<float>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { q4k_linear(a, b, e, eng); });
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

at::Tensor w8a8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n, int64_t k,
                       const c10::optional<at::Tensor>& bias, int64_t engine) {
  TORCH_CHECK(k % 32 == 0, "int8 rows must have a multiple of 32 inputs, got ", k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1, "x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(engine >= kEngineAuto && engine <= kEngineAmx, "engine must be 0 (auto), 1 (VNNI) or 2 (AMX)");
  check_weights(packed, at::kChar, row_blocks(n) * kRows * k, "packed int8");
  check_weights(scale, at::kFloat, row_blocks(n) * kRows, "int8 scales");
  const int eng = static_cast<int>(engine);
  TORCH_CHECK(!w8a8_uses_amx(x.size(0), eng) || amx_permitted(), "AMX is not available on this CPU or kernel");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  std::tuple<at::Tensor, at::Tensor, at::Tensor> xqs;
  W8A8Args a = quantized_args(x, y, n, k, bias, xqs);
  a.w = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  a.wscale = scale.data_ptr<float>();
  at::parallel_for(0, row_blocks(n), 1, [&](int64_t b, int64_t e) { w8a8_linear(a, b, e, eng); });
  return y;
}

// ------------------------------------------------------------------------------------ bandwidth

// Reads every byte of t once (64-byte vector loads, all threads) and returns a checksum: the
// benchmarks time it to measure the memory read bandwidth the kernels can hope for.
int64_t stream_read(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "t must be a contiguous CPU tensor");
  const int64_t lines = t.nbytes() / 256;
  const auto* base = static_cast<const uint8_t*>(t.data_ptr());
  std::vector<int64_t> partial(at::get_num_threads() + 1, 0);
  at::parallel_for(0, lines, 4096, [&](int64_t b, int64_t e) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = b; i < e; ++i) {
      const uint8_t* p = base + 256 * i;
      s0 = _mm512_xor_si512(s0, _mm512_loadu_si512(p));
      s1 = _mm512_xor_si512(s1, _mm512_loadu_si512(p + 64));
      s2 = _mm512_xor_si512(s2, _mm512_loadu_si512(p + 128));
      s3 = _mm512_xor_si512(s3, _mm512_loadu_si512(p + 192));
    }
    const __m512i s = _mm512_xor_si512(_mm512_xor_si512(s0, s1), _mm512_xor_si512(s2, s3));
    partial[at::get_thread_num()] ^= _mm512_reduce_add_epi64(s);
  });
  int64_t total = 0;
  for (int64_t v : partial) total ^= v;
  return total;
}

}  // namespace
}  // namespace verispec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "verispec weight-only-quantised linear kernels (AMX); see verispec/kernels/csrc/*.cpp";
  m.def("amx_available", &verispec::amx_permitted, "whether this process may use AMX tiles");
  m.def("q4k_pack", &verispec::q4k_pack_blocks, "GGUF Q4_K blocks [N, K/256*144] uint8 -> packed records");
  m.def("q4k_dequantize", &verispec::q4k_dequantize_packed, "packed Q4_K -> the exact fp32 weights [N, K]");
  m.def("q4k_linear", &verispec::q4k_matmul,
        "x [M, K] quantised to int8 per 64 inputs, times dequantise(packed Q4_K).T, + bias -> [M, N], x's dtype; "
        "engine 0 = by the number of rows, 1 = VNNI, 2 = AMX (the same result)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bias"), py::arg("engine") = 0);
  m.def("w8a8_pack", &verispec::w8a8_pack_codes, "int8 codes [N, K] -> packed W8A8 layout (codes + 128)");
  m.def("w8a8_quantize", &verispec::w8a8_quantize_rows, "x [M, K] -> (int8 [M, K], scales per 64 inputs [M, ceil(K/64)], sums per 32 inputs [M, K/32])");
  m.def("w8a8_linear", &verispec::w8a8_matmul,
        "x [M, K] quantised to int8 per 64 inputs, times (scale * codes).T, + bias -> [M, N], x's dtype; engine 0 = "
        "by the number of rows, 1 = VNNI, 2 = AMX (the same result)",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("n"), py::arg("k"), py::arg("bias"),
        py::arg("engine") = 0);
  m.def("stream_read", &verispec::stream_read, "read every byte of a tensor once (bandwidth probe)");
}
