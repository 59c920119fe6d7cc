// Every kernel of verispec/kernels/csrc/vec on fixed inputs, without torch: prints one line per
// case, "name fnv1a-64 of the output bytes", and first a line naming the vector branch vec.h took.
// tests/unit/test_kernel_neon.py builds it for the neon tier and for plain C++ (cross-compiled for
// AArch64, run under qemu-user) and for plain C++ on this machine, and compares the lines: every
// tier computes the same bits, whatever the architecture.
//
// The inputs come from a fixed xorshift generator (not <random>, whose distributions differ
// between standard libraries) and include the values where instruction sets disagree by default:
// NaN, infinities, huge and tiny values, ties of rounding to int8 and bf16.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "common.h"
#include "vec.h"

using namespace verispec;

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint32_t next_u32() {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return static_cast<uint32_t>(state >> 16);
}
float uniform() { return static_cast<float>(next_u32() >> 8) * (1.0f / 16777216.0f); }  // [0, 1), exact
float normalish() { return (uniform() + uniform() + uniform() - 1.5f) * 2.0f; }
uint16_t bf16_of(float f) { return vec::bf16_bits(f); }

template <typename T>
void report(const char* name, const std::vector<T>& out) {
  uint64_t h = 0xCBF29CE484222325ull;
  const auto* p = reinterpret_cast<const unsigned char*>(out.data());
  for (size_t i = 0; i < out.size() * sizeof(T); ++i) h = (h ^ p[i]) * 0x100000001B3ull;
  std::printf("%s %016" PRIx64 "\n", name, h);
}

// Activations of m rows x k inputs: mostly normal, 5% outliers x 40, and in row 1 (when there is
// one) an exact tie of the int8 rounding, a zero block and values near the bf16 rounding boundary.
std::vector<float> activations(int64_t m, int64_t k) {
  std::vector<float> x(m * k);
  for (auto& v : x) v = normalish() * (uniform() < 0.05f ? 40.0f : 1.0f);
  if (m > 1) {
    for (int64_t i = 0; i < 64 && i < k; ++i) x[k + i] = 0.0f;  // an all-zero activation block
    if (k > 128) {
      x[k + 64] = 127.0f;  // block scale 1: 2.5 and -0.5 are ties of the int8 rounding
      x[k + 65] = 2.5f;
      x[k + 66] = -0.5f;
      x[k + 67] = 1.0f + 1.0f / 256.0f;  // a tie of the bf16 rounding
    }
  }
  return x;
}

struct Quantized {
  std::vector<uint8_t> buffer;
  W8A8Args a{};
};

// bindings.cpp's quantized_args, without torch: x quantised, Q4_K's mins, the interleaved rows,
// the activation blocks in two calls (as two threads split them).
void quantize(const std::vector<float>& x, int64_t m, int64_t k, bool q4k, Quantized& z) {
  const int64_t nblk = (k + kW8A8Block - 1) / kW8A8Block;
  const ActivationLayout layout = activation_layout(m, k, q4k, true);
  z.buffer.resize(layout.bytes);
  const ActivationBuffers out = activation_buffers_at(z.buffer.data(), layout);
  quantize_activations(x.data(), false, m, k, k, out, 0, nblk / 2);
  quantize_activations(x.data(), false, m, k, k, out, nblk / 2, nblk);
  point_at_activations(out, m, k, z.a);
  z.a.M = m;
  z.a.K = k;
}

// A projection's output fields: y [M, n] (fp32, or bf16 where out_bf16), bias null or [n].
void set_output(W8A8Args& a, int64_t n, void* y, bool out_bf16, const float* bias) {
  a.bias = bias;
  a.y = y;
  a.N = n;
  a.out_bf16 = out_bf16;
}

// GGUF Q4_K blocks of n rows x k inputs: random codes and scale bytes, d and dmin small fp16.
std::vector<uint8_t> q4k_blocks(int64_t n, int64_t k) {
  std::vector<uint8_t> b(n * (k / kQ4KSuper) * kQ4KBlock);
  for (auto& v : b) v = static_cast<uint8_t>(next_u32());
  for (int64_t i = 0; i < n * (k / kQ4KSuper); ++i) {
    const uint16_t d = static_cast<uint16_t>(0x1800 | (next_u32() & 0x3FF));
    const uint16_t dmin = static_cast<uint16_t>(0x1400 | (next_u32() & 0x3FF));
    std::memcpy(&b[i * kQ4KBlock], &d, 2);
    std::memcpy(&b[i * kQ4KBlock + 2], &dmin, 2);
  }
  return b;
}

void projections() {
  const int64_t n = 72, k = 768, nb = (n + kRows - 1) / kRows;
  std::vector<float> bias(n);
  for (auto& v : bias) v = normalish();
  std::vector<int8_t> codes(n * k);
  for (auto& v : codes) v = static_cast<int8_t>(next_u32());
  std::vector<float> wscale(nb * kRows, 0.0f);
  for (int64_t i = 0; i < n; ++i) wscale[i] = uniform() / 64.0f;
  std::vector<uint8_t> int8(nb * kRows * k), q4k(nb * q4k_row_block_bytes(k));
  w8a8_pack(codes.data(), n, k, int8.data(), 0, nb);
  report("pack int8", int8);
  const std::vector<uint8_t> blocks = q4k_blocks(n, k);
  q4k_pack(blocks.data(), n, k, q4k.data(), 0, nb);
  report("pack q4k", q4k);
  std::vector<float> deq(nb * kRows * k);
  q4k_dequantize(q4k.data(), k, deq.data(), 0, nb);
  report("dequantize q4k", deq);
  std::vector<uint16_t> wb(n * k), bf16(nb * kRows * k);
  for (auto& v : wb) v = bf16_of(normalish());
  bf16_pack(wb.data(), n, k, bf16.data(), 0, nb);
  report("pack bf16", bf16);
  char name[64];
  for (int64_t m : {1, 2, 3, 4, 5, 7, 8, 9, 16, 21}) {
    const std::vector<float> x = activations(m, k);
    for (bool q : {false, true}) {
      Quantized z;
      quantize(x, m, k, q, z);
      // (the interleaved copies depend on the tier's chunk of rows; the values they hold do not)
      const int64_t nblk = (k + kW8A8Block - 1) / kW8A8Block, halves = k / 32;
      std::snprintf(name, sizeof name, "quantize m=%" PRId64 " q4k=%d codes", m, q);
      report(name, std::vector<int8_t>(z.a.xq, z.a.xq + m * k));
      std::snprintf(name, sizeof name, "quantize m=%" PRId64 " q4k=%d scales", m, q);
      report(name, std::vector<float>(z.a.xscale, z.a.xscale + m * nblk));
      std::snprintf(name, sizeof name, "quantize m=%" PRId64 " q4k=%d sums", m, q);
      report(name, std::vector<int32_t>(z.a.xsum, z.a.xsum + m * halves));
      std::snprintf(name, sizeof name, "quantize m=%" PRId64 " q4k=%d mins", m, q);
      report(name, q ? std::vector<float>(z.a.xmin, z.a.xmin + m * halves) : std::vector<float>(m * halves));
      for (bool out_bf16 : {false, true}) {
        std::vector<float> y(m * n);
        std::vector<uint16_t> yb(m * n);
        W8A8Args a = z.a;
        set_output(a, n, out_bf16 ? static_cast<void*>(yb.data()) : static_cast<void*>(y.data()), out_bf16,
                   out_bf16 ? bias.data() : nullptr);
        if (q) {
          a.w = q4k.data();
          q4k_linear_vec(a, 0, nb);
        } else {
          a.w = int8.data();
          a.wscale = wscale.data();
          w8a8_linear_vec(a, 0, nb);
        }
        std::snprintf(name, sizeof name, "%s m=%" PRId64 " bf16=%d", q ? "q4k" : "int8", m, out_bf16);
        if (out_bf16)
          report(name, yb);
        else
          report(name, y);
      }
    }
    std::vector<uint16_t> xb(m * k);
    std::vector<float> xf(m * k);
    for (int64_t i = 0; i < m * k; ++i) {
      xb[i] = bf16_of(x[i]);
      xf[i] = vec::bf16_float(xb[i]);
    }
    for (bool out_bf16 : {false, true}) {
      std::vector<float> y(m * n);
      std::vector<uint16_t> yb(m * n);
      Bf16Args a{bf16.data(), xb.data(), xf.data(), out_bf16 ? bias.data() : nullptr,
                 out_bf16 ? static_cast<void*>(yb.data()) : static_cast<void*>(y.data()), m, n, k, out_bf16};
      bf16_linear_vec(a, 0, nb);
      std::snprintf(name, sizeof name, "bf16 m=%" PRId64 " bf16=%d", m, out_bf16);
      if (out_bf16)
        report(name, yb);
      else
        report(name, y);
    }
  }
}

// The quantisation's edge cases: NaN, infinities, huge, tiny and denormal values in a block.
// A Q4_K matrix of 640 packed inputs: two whole records and a half one per row block (the blocks
// cover 768, their last 128 inputs zero: sub-blocks 4-7 of the last super-block scale 0 and min 0).
void q4k_half_record() {
  const int64_t n = 40, k = 640, kb = 768, nb = (n + kRows - 1) / kRows;
  std::vector<uint8_t> blocks = q4k_blocks(n, kb);
  for (int64_t r = 0; r < n; ++r) {
    uint8_t* q = &blocks[(r * (kb / kQ4KSuper) + kb / kQ4KSuper - 1) * kQ4KBlock + 4];
    for (int j = 0; j < 8; ++j) q[j] &= 0x3F;
    for (int j = 8; j < 12; ++j) q[j] = 0;
  }
  std::vector<uint8_t> q4k(nb * q4k_row_block_bytes(k));
  q4k_pack(blocks.data(), n, k, q4k.data(), 0, nb);
  report("pack q4k half", q4k);
  std::vector<float> deq(nb * kRows * k);
  q4k_dequantize(q4k.data(), k, deq.data(), 0, nb);
  report("dequantize q4k half", deq);
  char name[64];
  for (int64_t m : {1, 3, 8, 9}) {
    Quantized z;
    quantize(activations(m, k), m, k, true, z);
    std::vector<float> y(m * n);
    W8A8Args a = z.a;
    set_output(a, n, y.data(), false, nullptr);
    a.w = q4k.data();
    q4k_linear_vec(a, 0, nb);
    std::snprintf(name, sizeof name, "q4k half m=%" PRId64, m);
    report(name, y);
  }
}

// A Q6_K matrix: the packer, the exact dequantiser and the kernel at 1 to 21 rows, 32 x the
// 16-input sums interleaved as bindings.cpp's q6k_matmul makes them.
void q6k() {
  const int64_t n = 40, k = 512, nb = (n + kRows - 1) / kRows;
  std::vector<uint8_t> blocks(n * (k / 256) * kQ6KBlock);
  for (auto& v : blocks) v = static_cast<uint8_t>(next_u32());
  for (int64_t i = 0; i < n * (k / 256); ++i) {  // d: small fp16 of either sign
    const uint16_t d = static_cast<uint16_t>(0x1400 | (next_u32() & 0x83FF));
    std::memcpy(&blocks[i * kQ6KBlock + 208], &d, 2);
  }
  std::vector<uint8_t> packed(nb * (k / 256) * kQ6KRecord);
  q6k_pack(blocks.data(), n, k, packed.data(), 0, nb);
  report("pack q6k", packed);
  std::vector<float> deq(nb * kRows * k);
  q6k_dequantize(packed.data(), k, deq.data(), 0, nb);
  report("dequantize q6k", deq);
  char name[64];
  for (int64_t m : {1, 2, 3, 5, 8, 9, 16, 21}) {
    Quantized z;
    quantize(activations(m, k), m, k, false, z);
    std::vector<int32_t> sums(2 * m * (k / 16));
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < k / 16; ++j)
        for (int c = 0; c < 16; ++c) sums[r * (k / 16) + j] += 32 * z.a.xq[r * k + 16 * j + c];
    W8A8Args a = z.a;
    a.xsum16_rows = sums.data();
    if (m > 1) {
      auto* plain = reinterpret_cast<const uint32_t*>(sums.data());
      interleave_rows(plain, m, k / 16, vector_chunk_rows(), reinterpret_cast<uint32_t*>(sums.data() + m * (k / 16)), 0,
                      k / 16);
      a.xsum16_rows = sums.data() + m * (k / 16);
    }
    std::vector<float> y(m * n);
    set_output(a, n, y.data(), false, nullptr);
    a.w = packed.data();
    q6k_linear_vec(a, 0, nb);
    std::snprintf(name, sizeof name, "q6k m=%" PRId64, m);
    report(name, y);
  }
}

void quantize_edges() {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t k = 96;
  std::vector<float> x(4 * k, 0.5f);
  x[3] = nan;
  x[k + 5] = inf;
  x[k + 70] = -inf;
  x[2 * k + 1] = 3e38f;
  x[2 * k + 2] = -3e38f;
  x[3 * k + 7] = 1e-40f;
  for (int64_t i = 0; i < k; ++i) x[3 * k + i] *= 1e-30f;
  std::vector<int8_t> xq(4 * k);
  std::vector<float> scale(4 * 2);
  std::vector<int32_t> sum(4 * 3);
  w8a8_quantize(x.data(), false, k, k, xq.data(), scale.data(), sum.data(), 0, 4, 0, 2);
  report("quantize edges codes", xq);
  report("quantize edges scales", scale);
  report("quantize edges sums", sum);
}

void layer_ops() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t rows = 5, c = 200;
  std::vector<uint16_t> h(rows * c), delta(rows * c), w(c), y(rows * c);
  for (auto& v : h) v = bf16_of(3.0f * normalish());
  for (auto& v : delta) v = bf16_of(normalish());
  for (auto& v : w) v = bf16_of(normalish());
  h[4 * c + 3] = bf16_of(1e30f);
  rms_norm_rows(h.data(), delta.data(), w.data(), y.data(), c, 1e-6f, 0, rows);
  report("rms_norm y", y);
  report("rms_norm h", h);
  rms_norm_rows(h.data(), nullptr, w.data(), y.data(), c, 1e-6f, 0, rows);
  report("rms_norm no delta", y);
  const int64_t f = 136;
  std::vector<uint16_t> gate_up(6 * 2 * f), out(6 * f);
  for (auto& v : gate_up) v = bf16_of(4.0f * normalish());
  gate_up[0] = bf16_of(nan);
  gate_up[1] = bf16_of(-100.0f);
  gate_up[2] = bf16_of(100.0f);
  gate_up[3] = bf16_of(-88.0f);
  gate_up[2 * f + 4] = bf16_of(std::numeric_limits<float>::infinity());
  silu_mul_rows(gate_up.data(), gate_up.data() + f, 2 * f, out.data(), f, 0, 6, 0, f);
  report("silu_mul", out);
  const int64_t m = 7, heads = 3, d = 64;
  std::vector<uint16_t> x(m * heads * d), cs(m * d), sn(m * d), r(m * heads * d);
  for (auto& v : x) v = bf16_of(normalish());
  for (auto& v : cs) v = bf16_of(normalish());
  for (auto& v : sn) v = bf16_of(normalish());
  rotary_rows(x.data(), heads * d, cs.data(), sn.data(), r.data(), heads, d, 0, m);
  report("rotary", r);
}

// the greedy pick: bf16 and fp32 rows of 301 columns (a partial vector), a second segment with
// blocked columns, ties, and rows without a token (NaN in a whole vector, +inf)
void greedy_pick() {
  const int64_t w = 301, e = 21;
  std::vector<uint16_t> scores(4 * w);
  std::vector<float> scores32(4 * w), more(4 * e);
  std::vector<int64_t> ids(w), more_ids(e);
  for (int64_t j = 0; j < w; ++j) ids[j] = 2 * j;
  for (int64_t j = 0; j < e; ++j) more_ids[j] = 14 * j + 1;
  for (size_t i = 0; i < scores.size(); ++i) {
    scores32[i] = std::round(3.0f * normalish());  // ties
    scores[i] = bf16_of(scores32[i]);
  }
  for (auto& v : more) v = 3.0f * normalish();
  bool blocked[4 * e];
  for (auto& b : blocked) b = uniform() < 0.5f;
  scores[1 * w + 40] = bf16_of(std::numeric_limits<float>::quiet_NaN());
  scores32[2 * w + 7] = std::numeric_limits<float>::infinity();
  std::vector<int64_t> picked;
  std::vector<float> confidence;
  for (int64_t r = 0; r < 4; ++r)
    for (bool bf16 : {true, false}) {
      const PickSegment parts[2] = {
          {bf16 ? static_cast<const void*>(scores.data() + r * w) : scores32.data() + r * w, bf16, w, ids.data(),
           nullptr},
          {more.data() + r * e, false, e, more_ids.data(), blocked + r * e}};
      const PickResult one = pick_greedy(parts, 1), two = pick_greedy(parts, 2);
      for (const PickResult& p : {one, two}) {
        picked.push_back(p.ok ? p.id : -1);
        confidence.push_back(p.confidence);
      }
    }
  report("greedy_pick ids", picked);
  report("greedy_pick confidence", confidence);
}

// the sampled pick: laws of rows of 301 columns (a partial vector) under temperature, top-k, top-p
// and min-p (a -inf column, ties), and the columns uniforms draw from them
void sampled_pick() {
  const int64_t w = 301;
  const SampleRule rules[4] = {
      {0.8f, 0, 0.9, 0.0f}, {1.0f, 7, 1.0, 0.05f}, {1.3f, 0, 0.99, 0.0f}, {0.5f, 40, 0.7, 0.1f}};
  std::vector<float> laws;
  std::vector<int64_t> columns;
  for (const SampleRule& rule : rules) {
    std::vector<float> x(w), law(w);
    for (auto& v : x) v = std::round(8.0f * normalish()) * 0.5f;  // (ties)
    x[9] = -std::numeric_limits<float>::infinity();
    columns.push_back(sampled_law(x.data(), w, rule, law.data()) ? draw_column(law.data(), w, uniform()) : -1);
    laws.insert(laws.end(), law.begin(), law.end());
  }
  report("sampled_pick laws", laws);
  report("sampled_pick columns", columns);
}

// head sizes 64 (loops unrolled, 2 query heads per key/value head) and 48 (loops, 6 per head)
void attention(int64_t H, int64_t D, const char* name) {
  const int64_t B = 2, T = 3, Hkv = 2, span = 37;
  std::vector<float> q(B * T * H * D), k(B * Hkv * span * D), v(B * Hkv * span * D);
  for (auto& x : q) x = normalish();
  for (auto& x : k) x = normalish();
  for (auto& x : v) x = normalish();
  q[5] = 30.0f;  // a large score: exp's clamping
  std::vector<uint8_t> visible(B * T * span);
  for (auto& x : visible) x = uniform() < 0.7f;
  for (int64_t i = 0; i < B * T; ++i) visible[i * span] = 1;
  for (bool bf16 : {true, false}) {
    std::vector<uint16_t> qb(q.size()), kb(k.size()), vb(v.size()), ob(q.size());
    std::vector<float> of(q.size());
    for (size_t i = 0; i < q.size(); ++i) qb[i] = bf16_of(q[i]);
    for (size_t i = 0; i < k.size(); ++i) kb[i] = bf16_of(k[i]), vb[i] = bf16_of(v[i]);
    AttnArgs a{};
    a.q = bf16 ? static_cast<const void*>(qb.data()) : q.data();
    a.k = bf16 ? static_cast<const void*>(kb.data()) : k.data();
    a.v = bf16 ? static_cast<const void*>(vb.data()) : v.data();
    a.k_sb = a.v_sb = Hkv * span * D;
    a.k_sh = a.v_sh = span * D;
    a.rows = nullptr;
    a.visible = visible.data();
    a.out = bf16 ? static_cast<void*>(ob.data()) : of.data();
    a.B = B, a.T = T, a.H = H, a.Hkv = Hkv, a.D = D, a.span = span;
    a.scale = 0.125f;
    a.bf16 = bf16;
    attention_rows(a, 0, B * T * H);
    const std::string what = std::string(name) + (bf16 ? " bf16" : " fp32");
    if (bf16)
      report(what.c_str(), ob);
    else
      report(what.c_str(), of);
  }
}

}  // namespace

int main() {
#if VS_VEC_AVX512
  std::puts("branch avx512");
#elif VS_VEC_AVX2
  std::puts("branch avx2");
#elif VS_VEC_NEON
  std::puts("branch neon");
#else
  std::puts("branch portable");
#endif
  projections();
  q4k_half_record();
  q6k();
  quantize_edges();
  layer_ops();
  greedy_pick();
  sampled_pick();
  attention(4, 64, "attention");
  attention(12, 48, "attention d48");
  std::vector<uint8_t> bytes(4096 + 24);
  for (auto& b : bytes) b = static_cast<uint8_t>(next_u32());
  std::printf("stream_xor %016" PRIx64 "\n", stream_xor(bytes.data(), static_cast<int64_t>(bytes.size())));
  return 0;
}
