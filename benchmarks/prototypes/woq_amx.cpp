// Weight-only-quantised linear layers for x86 CPUs: GGUF Q4_K and per-channel int8 weights,
// activations in bf16, fp32 accumulation. Prototype for verispec; the Python side is woq_amx.py.
//
// The one idea: the quantised weights are read and dequantised ONCE per call for all M <= 16
// activation rows, and the multiply runs on AMX (TDPBF16PS: 16 x 16 x 32 MACs per instruction),
// whose cost is small next to the dequantisation. So a pass over M = K + 1 tokens (speculative
// verification) costs about what a pass over one token costs.
//
// ---------------------------------------------------------------------------------------------
// Q4_K, exact weights ("vnni" layout; kernels q4k_amx and q4k_avx512)
//   A Q4_K super-block of 256 inputs has 8 sub-blocks of 32, each with a 6-bit scale sc and a
//   6-bit min mn; w = (d*sc)*q - (dmin*mn), q in 0..15. We never round w: the B tile holds the
//   raw codes q (exact in bf16; one VPERMW with a constant 16-entry table turns 32 codes into 32
//   bf16 values), A is the bf16 activation matrix itself (no packing), and each sub-block gets its
//   own C tile S[m][n] = sum_k x[m][k] q[n][k]. The epilogue applies the fp32 scales:
//       y[m][n] += (d*sc)[n] * S[m][n] - (dmin*mn)[n] * X[m],   X[m] = sum of the 32 bf16 inputs,
//   so the only rounding beyond fp32 arithmetic is that of the activations to bf16.
//   A C row holds 16 output columns, so the per-column scales are plain 16-lane vectors.
//   q4k_avx512 computes the same thing with VDPBF16PS (no AMX): fastest for M = 1, and the
//   fallback for AVX512-BF16 CPUs without AMX (Zen 4, Cooper Lake); its cost grows with M.
//
//   Packed layout, per (16 output rows, super-block): 2304 bytes = 16 x 144, the same bytes as
//   the GGUF blocks, permuted (nothing is re-quantised):
//     [0,32)     d    fp16 x 16 rows          [32,64)   dmin fp16 x 16 rows
//     [64,256)   the 12 scale bytes of each row as 3 u32 words, word-major: w0[16], w1[16], w2[16]
//     [256,2304) for each sub-block pair j (inputs 64j..64j+63): 16 chunks p of 32 bytes; byte i
//                of chunk p is the GGUF byte qs[32j + 2p + i%2] of row n = i/2, i.e. low nibble
//                q[n][64j + 2p + i%2], high nibble q[n][64j + 32 + 2p + i%2]: after zero-extension
//                to 16 bits, the low nibbles are exactly the AMX VNNI B tile of sub-block 2j and
//                the high nibbles that of sub-block 2j+1.
//
// Q4_K, bf16-rounded weights ("rows" layout; kernel q4k_amx_bf16w) - the alternative design
//   A = weights: each A row is 32 inputs of ONE output row, so one sub-block, so one (scale, min):
//   a 16-entry table bf16(d*sc*i - dmin*mn) is built in one vector and VPERMW looks the codes up.
//   The weights used are bit-identical to dequantise(Q4_K).to(bfloat16); C accumulates over K.
//   Layout per (16 rows, super-block): the same 256-byte header, then for j, for row r, the 32
//   GGUF bytes qs[32j..32j+32) of that row.
//
// int8 per output channel ("vnni8" layout; kernel int8_amx), w = scale[n] * q[n][k]
//   B tile = bf16(q) (exact: |q| <= 128), C accumulates over K, the scale is applied once.
//   Layout: per (16 rows, 32 inputs): 16 chunks p of 32 bytes, byte i = q[i/2][32t + 2p + i%2].
//
// All kernels compute every output element by the same sequence of operations whatever M is and
// whatever the other rows hold, so each kernel is batch-invariant: row i of an M-row call equals
// the 1-row call on row i, bit for bit. (q4k_avx512 and q4k_amx differ from each other in the
// order of fp32 additions.)
// ---------------------------------------------------------------------------------------------

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstring>
#include <vector>

// GCC 12's AMX intrinsics are inline asm that under-declare their memory effects: ldtilecfg is
// told it reads 8 of the config's 64 bytes and tileloadd that it reads no memory at all, so the
// optimiser may drop or sink the stores that fill a config or a tile buffer. These declare it.
#define VS_TILE_LOADCONFIG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(cfg)) : "memory")
#define VS_TILE_LOADD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(base)), "r"((long)(stride)) : "memory")

namespace {

constexpr int kRows = 16;         // output rows per tile
constexpr int kSuper = 256;       // Q4_K super-block
constexpr int kQ4KRecord = 2304;  // bytes per (16 rows, 1 super-block)

// Software prefetch of the packed weight stream, tunable at run time (set_prefetch) for
// experiments: mode 0 none (hardware prefetchers only), 1 two lines of the record `dist` records
// ahead into L1, 2 every line of that record into L1, 3 every line of that record into L2.
int g_pf_mode = 2;
int g_pf_dist = 8;

inline void prefetch_record(const uint8_t* rec, const uint8_t* end) {
  const char* p = reinterpret_cast<const char*>(rec + g_pf_dist * kQ4KRecord);
  if (g_pf_mode == 0 || p >= reinterpret_cast<const char*>(end)) return;
  if (g_pf_mode == 1) {
    _mm_prefetch(p, _MM_HINT_T0);
    _mm_prefetch(p + 1152, _MM_HINT_T0);
  } else if (g_pf_mode == 2) {
    for (int l = 0; l < kQ4KRecord; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
  } else {
    for (int l = 0; l < kQ4KRecord; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
  }
}

bool amx_permitted() {
  // Linux: a process must request the AMX tile-data state once (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0, tmm1: C [M x 16 fp32]; tmm2, tmm3: A [M x 32 bf16]; tmm4, tmm5: B [16 pairs x 16 x 2 bf16].
void configure_tiles_b_weights(int M) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = static_cast<uint8_t>(M); cfg.colsb[t] = 64; }
  for (int t = 4; t < 6; ++t) { cfg.rows[t] = kRows; cfg.colsb[t] = 64; }
  VS_TILE_LOADCONFIG(&cfg);
}

// bf16 of 0..15, twice (VPERMW reads index bits 0..4, so the low nibble of a zero-extended byte
// needs no masking).
inline __m512i code_table() {
  return _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
}

struct Q4KScales {
  alignas(64) float ds[8][16];  // d * scale, [sub-block][row]
  alignas(64) float dm[8][16];  // dmin * min
};

// The 16 rows' 8 (scale, min) pairs of one super-block, from the 256-byte header.
inline void decode_q4k_scales(const uint8_t* rec, Q4KScales& s) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
  const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
  const __m512i w0 = _mm512_loadu_si512(rec + 64);
  const __m512i w1 = _mm512_loadu_si512(rec + 128);
  const __m512i w2 = _mm512_loadu_si512(rec + 192);
  const __m512i six = _mm512_set1_epi32(0x3F3F3F3F), top = _mm512_set1_epi32(0x30303030),
                low = _mm512_set1_epi32(0x0F0F0F0F), byte = _mm512_set1_epi32(0xFF);
  // ggml get_scale_min_k4: bytes 0-3 scales 0-3 (+ top bits of 4-7), 4-7 mins, 8-11 low nibbles.
  const __m512i sc_lo = _mm512_and_si512(w0, six);
  const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(w2, low), _mm512_and_si512(_mm512_srli_epi32(w0, 2), top));
  const __m512i mn_lo = _mm512_and_si512(w1, six);
  const __m512i mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low),
                                        _mm512_and_si512(_mm512_srli_epi32(w1, 2), top));
#define VS_SUB(i, SC, MN, SH)                                                                      \
  _mm512_store_ps(s.ds[i], _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(SC, SH), byte)))); \
  _mm512_store_ps(s.dm[i], _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(MN, SH), byte))));
  VS_SUB(0, sc_lo, mn_lo, 0) VS_SUB(1, sc_lo, mn_lo, 8) VS_SUB(2, sc_lo, mn_lo, 16) VS_SUB(3, sc_lo, mn_lo, 24)
  VS_SUB(4, sc_hi, mn_hi, 0) VS_SUB(5, sc_hi, mn_hi, 8) VS_SUB(6, sc_hi, mn_hi, 16) VS_SUB(7, sc_hi, mn_hi, 24)
#undef VS_SUB
}

void check_linear_args(const at::Tensor& x, int64_t N, int64_t K, int64_t align_k, int64_t max_m) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_m, "M must be in 1..", max_m, " per call (the wrapper chunks)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(N % kRows == 0 && K % align_k == 0, "N % 16 and K % ", align_k, " must be 0");
}

const float* bias_ptr(const c10::optional<at::Tensor>& bias, at::Tensor& holder) {
  if (!bias.has_value()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

at::Tensor as_bf16(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kBFloat16).contiguous();
}

// X[m][sub]: the fp32 sum of each row's 32 bf16 inputs of every sub-block (fixed order).
std::vector<float> subblock_sums(const uint16_t* xp, int M, int64_t K) {
  const int64_t nsub = K / 32;
  std::vector<float> xs(M * nsub);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int m = 0; m < M; ++m)
    for (int64_t t = 0; t < nsub; ++t) {
      const __m512i v = _mm512_loadu_si512(xp + m * K + 32 * t);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask));
      xs[m * nsub + t] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
  return xs;
}

inline void store_out(void* yp, bool out_bf16, int64_t offset, __m512 v) {
  if (out_bf16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(yp) + offset), (__m256i)_mm512_cvtneps_pbh(v));
  else
    _mm512_storeu_ps(static_cast<float*>(yp) + offset, v);
}

#define VS_DISPATCH_M(M, FN, ...)                                                                   \
  switch (M) {                                                                                     \
    case 1: FN<1>(__VA_ARGS__); break; case 2: FN<2>(__VA_ARGS__); break;                          \
    case 3: FN<3>(__VA_ARGS__); break; case 4: FN<4>(__VA_ARGS__); break;                          \
    case 5: FN<5>(__VA_ARGS__); break; case 6: FN<6>(__VA_ARGS__); break;                          \
    case 7: FN<7>(__VA_ARGS__); break; case 8: FN<8>(__VA_ARGS__); break;                          \
    case 9: FN<9>(__VA_ARGS__); break; case 10: FN<10>(__VA_ARGS__); break;                        \
    case 11: FN<11>(__VA_ARGS__); break; case 12: FN<12>(__VA_ARGS__); break;                      \
    case 13: FN<13>(__VA_ARGS__); break; case 14: FN<14>(__VA_ARGS__); break;                      \
    case 15: FN<15>(__VA_ARGS__); break; case 16: FN<16>(__VA_ARGS__); break;                      \
    default: TORCH_CHECK(false, "M out of range");                                                 \
  }

struct Q4KArgs {
  const uint8_t* w;
  const uint16_t* x;   // bf16 [M, K]
  const float* xs;     // [M, K/32]
  int64_t N, K;
  const float* bias;   // [N] or null
  void* y;             // [M, N]
  bool out_bf16;
};

// ================================================================= Q4_K exact, AMX

template <int M>
void q4k_amx_range(int64_t begin, int64_t end, const Q4KArgs& a) {
  configure_tiles_b_weights(M);
  const __m512i table = code_table();
  alignas(64) uint16_t b0[kRows * 32], b1[kRows * 32];
  alignas(64) float c0[M * 16], c1[M * 16];
  Q4KScales s;
  const int64_t nsb = a.K / kSuper, nsub = a.K / 32;
  const uint8_t* w_end = a.w + end * nsb * kQ4KRecord;
  for (int64_t nb = begin; nb < end; ++nb) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* rec = a.w + nb * nsb * kQ4KRecord;
    for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
      prefetch_record(rec, w_end);
      decode_q4k_scales(rec, s);
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = rec + 256 + j * 512;
        for (int p = 0; p < kRows; ++p) {
          const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p)));
          _mm512_store_si512(b0 + 32 * p, _mm512_permutexvar_epi16(w, table));
          _mm512_store_si512(b1 + 32 * p, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
        }
        const int64_t k0 = sb * kSuper + 64 * j;
        VS_TILE_LOADD(2, a.x + k0, a.K * 2);
        VS_TILE_LOADD(3, a.x + k0 + 32, a.K * 2);
        VS_TILE_LOADD(4, b0, 64);
        VS_TILE_LOADD(5, b1, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_stored(0, c0, 64);
        _tile_stored(1, c1, 64);
        const int64_t sub = sb * 8 + 2 * j;
        const __m512 ds0 = _mm512_load_ps(s.ds[2 * j]), dm0 = _mm512_load_ps(s.dm[2 * j]);
        const __m512 ds1 = _mm512_load_ps(s.ds[2 * j + 1]), dm1 = _mm512_load_ps(s.dm[2 * j + 1]);
        for (int m = 0; m < M; ++m) {
          const float* xsm = a.xs + m * nsub + sub;
          __m512 t = _mm512_fmadd_ps(_mm512_load_ps(c0 + 16 * m), ds0, acc[m]);
          t = _mm512_fnmadd_ps(_mm512_set1_ps(xsm[0]), dm0, t);
          t = _mm512_fmadd_ps(_mm512_load_ps(c1 + 16 * m), ds1, t);
          acc[m] = _mm512_fnmadd_ps(_mm512_set1_ps(xsm[1]), dm1, t);
        }
      }
    }
    const int64_t n0 = nb * kRows;
    const __m512 bv = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store_out(a.y, a.out_bf16, m * a.N + n0, _mm512_add_ps(acc[m], bv));
  }
  _tile_release();
}

// ================================================================= Q4_K exact, AVX512-BF16

template <int M>
void q4k_avx512_range(int64_t begin, int64_t end, const Q4KArgs& a) {
  // Independent partial sums per (row, sub-block): VDPBF16PS has a long latency, and M = 1 alone
  // gives too few chains to fill the pipeline. (Fixed per M, so each M is batch-invariant with
  // itself; M = 1 and M = 2 use different counts, hence differ in the last bits.)
  constexpr int NA = M == 1 ? 4 : (M == 2 ? 2 : 1);
  const __m512i table = code_table();
  Q4KScales s;
  const int64_t nsb = a.K / kSuper, nsub = a.K / 32, K2 = a.K / 2;
  const auto* x32 = reinterpret_cast<const int32_t*>(a.x);
  const uint8_t* w_end = a.w + end * nsb * kQ4KRecord;
  for (int64_t nb = begin; nb < end; ++nb) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* rec = a.w + nb * nsb * kQ4KRecord;
    for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
      prefetch_record(rec, w_end);
      decode_q4k_scales(rec, s);
      for (int j = 0; j < 4; ++j) {
        const uint8_t* q = rec + 256 + j * 512;
        const int64_t kk0 = (sb * kSuper + 64 * j) / 2;
        __m512 plo[M][NA], phi[M][NA];
        for (int m = 0; m < M; ++m)
          for (int t = 0; t < NA; ++t) { plo[m][t] = _mm512_setzero_ps(); phi[m][t] = _mm512_setzero_ps(); }
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
          const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * p)));
          const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(w, table);
          const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m) {
            const int32_t* xm = x32 + m * K2 + kk0;
            plo[m][p % NA] = _mm512_dpbf16_ps(plo[m][p % NA], lo, (__m512bh)_mm512_set1_epi32(xm[p]));
            phi[m][p % NA] = _mm512_dpbf16_ps(phi[m][p % NA], hi, (__m512bh)_mm512_set1_epi32(xm[16 + p]));
          }
        }
        const int64_t sub = sb * 8 + 2 * j;
        const __m512 ds0 = _mm512_load_ps(s.ds[2 * j]), dm0 = _mm512_load_ps(s.dm[2 * j]);
        const __m512 ds1 = _mm512_load_ps(s.ds[2 * j + 1]), dm1 = _mm512_load_ps(s.dm[2 * j + 1]);
        for (int m = 0; m < M; ++m) {
          __m512 l = plo[m][0], h = phi[m][0];
          if (NA == 4) {
            l = _mm512_add_ps(_mm512_add_ps(l, plo[m][1 % NA]), _mm512_add_ps(plo[m][2 % NA], plo[m][3 % NA]));
            h = _mm512_add_ps(_mm512_add_ps(h, phi[m][1 % NA]), _mm512_add_ps(phi[m][2 % NA], phi[m][3 % NA]));
          } else if (NA == 2) {
            l = _mm512_add_ps(l, plo[m][1 % NA]);
            h = _mm512_add_ps(h, phi[m][1 % NA]);
          }
          const float* xsm = a.xs + m * nsub + sub;
          __m512 t = _mm512_fmadd_ps(l, ds0, acc[m]);
          t = _mm512_fnmadd_ps(_mm512_set1_ps(xsm[0]), dm0, t);
          t = _mm512_fmadd_ps(h, ds1, t);
          acc[m] = _mm512_fnmadd_ps(_mm512_set1_ps(xsm[1]), dm1, t);
        }
      }
    }
    const int64_t n0 = nb * kRows;
    const __m512 bv = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) store_out(a.y, a.out_bf16, m * a.N + n0, _mm512_add_ps(acc[m], bv));
  }
}

template <int M>
void q4k_avx512_range_limited(int64_t begin, int64_t end, const Q4KArgs& a) {
  if constexpr (M <= 8) q4k_avx512_range<M>(begin, end, a);
}

at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K,
                      const c10::optional<at::Tensor>& bias, bool amx) {
  check_linear_args(x, N, K, kSuper, amx ? 16 : 8);
  TORCH_CHECK(!amx || amx_permitted(), "AMX is not available on this CPU / kernel");
  TORCH_CHECK(packed.numel() == N / kRows * (K / kSuper) * kQ4KRecord, "packed size mismatch");
  const int M = static_cast<int>(x.size(0));
  const at::Tensor xb = as_bf16(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const std::vector<float> xs = subblock_sums(xp, M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  const Q4KArgs args{packed.data_ptr<uint8_t>(), xp, xs.data(), N, K, bias_ptr(bias, bias_f), y.data_ptr(),
                     y.scalar_type() == at::kBFloat16};
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    if (amx) {
      VS_DISPATCH_M(M, q4k_amx_range, begin, end, args)
    } else {
      VS_DISPATCH_M(M, q4k_avx512_range_limited, begin, end, args)
    }
  });
  return y;
}

// ================================================================= Q4_K bf16-rounded weights, AMX, weights as A

struct alignas(64) RowsScratch { uint16_t a0[kRows * 32], a1[kRows * 32]; float c[kRows * 16]; };

// bf16 values of one sub-block: table[i] = table[i+16] = bf16(ds*i - dm), i = 0..15.
inline __m512i q4k_table(float ds, float dm) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 f = _mm512_sub_ps(_mm512_mul_ps(iota, _mm512_set1_ps(ds)), _mm512_set1_ps(dm));
  return (__m512i)_mm512_cvtne2ps_pbh(f, f);
}

at::Tensor q4k_linear_amx_bf16w(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K,
                                const c10::optional<at::Tensor>& bias) {
  check_linear_args(x, N, K, kSuper, 16);
  TORCH_CHECK(amx_permitted(), "AMX is not available");
  const int M = static_cast<int>(x.size(0));
  // Activations as B tiles: [K/32][16 pairs][M][2] bf16 (a transpose of x viewed as [M, K/2] u32).
  const at::Tensor xb = as_bf16(x);
  at::Tensor xt = at::empty({K * M}, xb.options());
  {
    const auto* src = reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>());
    auto* dst = reinterpret_cast<uint32_t*>(xt.data_ptr<at::BFloat16>());
    for (int64_t kk = 0; kk < K / 2; ++kk)
      for (int m = 0; m < M; ++m) dst[kk * M + m] = src[m * (K / 2) + kk];
  }
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  const float* bptr = bias_ptr(bias, bias_f);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const auto* bp = reinterpret_cast<const uint8_t*>(xt.data_ptr<at::BFloat16>());
  void* yp = y.data_ptr();
  const bool out_bf16 = y.scalar_type() == at::kBFloat16;
  const int64_t nsb = K / kSuper, b_step = int64_t(kRows) * M * 4;
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    cfg.rows[0] = kRows; cfg.colsb[0] = static_cast<uint16_t>(M * 4);                    // C [16 x M]
    for (int t = 1; t <= 2; ++t) { cfg.rows[t] = kRows; cfg.colsb[t] = 64; }               // A weights
    for (int t = 3; t <= 4; ++t) { cfg.rows[t] = kRows; cfg.colsb[t] = static_cast<uint16_t>(M * 4); }  // B x
    VS_TILE_LOADCONFIG(&cfg);
    RowsScratch sc;
    Q4KScales s;
    for (int64_t nb = begin; nb < end; ++nb) {
      _tile_zero(0);
      const uint8_t* rec = wp + nb * nsb * kQ4KRecord;
      for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
        _mm_prefetch(reinterpret_cast<const char*>(rec + 4 * kQ4KRecord), _MM_HINT_T0);
        decode_q4k_scales(rec, s);
        for (int j = 0; j < 4; ++j) {
          const uint8_t* q = rec + 256 + j * 512;
          for (int r = 0; r < kRows; ++r) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * r)));
            _mm512_store_si512(sc.a0 + 32 * r, _mm512_permutexvar_epi16(w, q4k_table(s.ds[2 * j][r], s.dm[2 * j][r])));
            _mm512_store_si512(sc.a1 + 32 * r, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4),
                                                                       q4k_table(s.ds[2 * j + 1][r], s.dm[2 * j + 1][r])));
          }
          const int64_t kstep = sb * 8 + 2 * j;
          VS_TILE_LOADD(1, sc.a0, 64);
          VS_TILE_LOADD(2, sc.a1, 64);
          VS_TILE_LOADD(3, bp + kstep * b_step, M * 4);
          VS_TILE_LOADD(4, bp + (kstep + 1) * b_step, M * 4);
          _tile_dpbf16ps(0, 1, 3);
          _tile_dpbf16ps(0, 2, 4);
        }
      }
      _tile_stored(0, sc.c, 64);
      const int64_t n0 = nb * kRows;
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < kRows; ++r) {
          const float v = sc.c[r * 16 + m] + (bptr ? bptr[n0 + r] : 0.f);
          if (out_bf16) static_cast<at::BFloat16*>(yp)[m * N + n0 + r] = c10::BFloat16(v);
          else static_cast<float*>(yp)[m * N + n0 + r] = v;
        }
    }
    _tile_release();
  });
  return y;
}

// ================================================================= int8 per-channel, AMX

inline __m512i int8x32_to_bf16(const int8_t* q) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // exact: |q| <= 128 fits bf16's 8-bit significand
}

struct Int8Args {
  const int8_t* w;
  const uint16_t* x;
  const float* scale;
  int64_t N, K;
  const float* bias;
  void* y;
  bool out_bf16;
};

template <int M>
void int8_amx_range(int64_t begin, int64_t end, const Int8Args& a) {
  configure_tiles_b_weights(M);
  alignas(64) uint16_t b0[kRows * 32], b1[kRows * 32];
  alignas(64) float c0[M * 16], c1[M * 16];
  const int64_t nks = a.K / 32;
  const int8_t* w_end = a.w + end * nks * 512;
  for (int64_t nb = begin; nb < end; ++nb) {
    _tile_zero(0);
    _tile_zero(1);
    const int8_t* blk = a.w + nb * nks * 512;
    for (int64_t ks = 0; ks < nks; ks += 2, blk += 1024) {
      if (blk + 8192 < w_end)
        for (int l = 0; l < 1024; l += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + 8192 + l), _MM_HINT_T0);
      for (int p = 0; p < kRows; ++p) {
        _mm512_store_si512(b0 + 32 * p, int8x32_to_bf16(blk + 32 * p));
        _mm512_store_si512(b1 + 32 * p, int8x32_to_bf16(blk + 512 + 32 * p));
      }
      VS_TILE_LOADD(2, a.x + ks * 32, a.K * 2);
      VS_TILE_LOADD(3, a.x + ks * 32 + 32, a.K * 2);
      VS_TILE_LOADD(4, b0, 64);
      VS_TILE_LOADD(5, b1, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 5);
    }
    _tile_stored(0, c0, 64);
    _tile_stored(1, c1, 64);
    const int64_t n0 = nb * kRows;
    const __m512 sv = _mm512_loadu_ps(a.scale + n0);
    const __m512 bv = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m512 v = _mm512_add_ps(_mm512_load_ps(c0 + 16 * m), _mm512_load_ps(c1 + 16 * m));
      store_out(a.y, a.out_bf16, m * a.N + n0, _mm512_fmadd_ps(v, sv, bv));
    }
  }
  _tile_release();
}

at::Tensor int8_linear_amx(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias) {
  const int64_t N = scales.size(0), K = packed.numel() / N;
  check_linear_args(x, N, K, 64, 16);
  TORCH_CHECK(amx_permitted(), "AMX is not available");
  const int M = static_cast<int>(x.size(0));
  const at::Tensor xb = as_bf16(x);
  const at::Tensor sc = scales.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  const Int8Args args{packed.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()),
                      sc.data_ptr<float>(), N, K, bias_ptr(bias, bias_f), y.data_ptr(),
                      y.scalar_type() == at::kBFloat16};
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    VS_DISPATCH_M(M, int8_amx_range, begin, end, args)
  });
  return y;
}

// ================================================================= packing (offline, once) and checks

void copy_q4k_header(const uint8_t* src, int64_t nsb, int64_t nb, int64_t sb, uint8_t* rec) {
  for (int r = 0; r < kRows; ++r) {
    const uint8_t* b = src + ((nb * kRows + r) * nsb + sb) * 144;
    std::memcpy(rec + 2 * r, b, 2);           // d
    std::memcpy(rec + 32 + 2 * r, b + 2, 2);  // dmin
    for (int w = 0; w < 3; ++w) std::memcpy(rec + 64 + w * 64 + 4 * r, b + 4 + 4 * w, 4);
  }
}

void check_q4k_blocks(const at::Tensor& blocks, int64_t N, int64_t K) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "blocks must be contiguous uint8");
  TORCH_CHECK(N % kRows == 0 && K % kSuper == 0 && blocks.numel() == N * (K / kSuper) * 144,
              "Q4_K blocks of a [N, K] matrix with N % 16 == 0 and K % 256 == 0 expected");
}

// GGUF Q4_K blocks [N, K/256*144] uint8 -> "vnni" layout.
at::Tensor pack_q4k(const at::Tensor& blocks, int64_t N, int64_t K) {
  check_q4k_blocks(blocks, N, K);
  const int64_t nsb = K / kSuper;
  at::Tensor out = at::empty({N / kRows * nsb * kQ4KRecord}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t sb = 0; sb < nsb; ++sb) {
        uint8_t* rec = dst + (nb * nsb + sb) * kQ4KRecord;
        copy_q4k_header(src, nsb, nb, sb, rec);
        for (int j = 0; j < 4; ++j)
          for (int p = 0; p < 16; ++p)
            for (int i = 0; i < 32; ++i) {
              const uint8_t* qs = src + ((nb * kRows + i / 2) * nsb + sb) * 144 + 16 + 32 * j;
              rec[256 + j * 512 + 32 * p + i] = qs[2 * p + i % 2];
            }
      }
  });
  return out;
}

// GGUF Q4_K blocks -> "rows" layout (for q4k_linear_amx_bf16w).
at::Tensor pack_q4k_rows(const at::Tensor& blocks, int64_t N, int64_t K) {
  check_q4k_blocks(blocks, N, K);
  const int64_t nsb = K / kSuper;
  at::Tensor out = at::empty({N / kRows * nsb * kQ4KRecord}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t sb = 0; sb < nsb; ++sb) {
        uint8_t* rec = dst + (nb * nsb + sb) * kQ4KRecord;
        copy_q4k_header(src, nsb, nb, sb, rec);
        for (int r = 0; r < kRows; ++r) {
          const uint8_t* b = src + ((nb * kRows + r) * nsb + sb) * 144;
          for (int j = 0; j < 4; ++j) std::memcpy(rec + 256 + j * 512 + r * 32, b + 16 + 32 * j, 32);
        }
      }
  });
  return out;
}

// The exact fp32 weights [N, K] a "vnni"-packed tensor stands for: (d*sc)*q - (dmin*mn), computed
// as gguf-py / ggml do (fp32 multiply, then subtract) - to check the packing bit for bit.
at::Tensor q4k_dequant(const at::Tensor& packed, int64_t N, int64_t K) {
  at::Tensor w = at::empty({N, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* out = w.data_ptr<float>();
  const int64_t nsb = K / kSuper;
  at::parallel_for(0, N / kRows, 1, [&](int64_t begin, int64_t end) {
    Q4KScales s;
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint8_t* rec = wp + nb * nsb * kQ4KRecord;
      for (int64_t sb = 0; sb < nsb; ++sb, rec += kQ4KRecord) {
        decode_q4k_scales(rec, s);
        for (int j = 0; j < 4; ++j)
          for (int p = 0; p < 16; ++p)
            for (int i = 0; i < 32; ++i) {
              const int n = i / 2, k = 64 * j + 2 * p + i % 2;
              const uint8_t byte = rec[256 + j * 512 + 32 * p + i];
              float* row = out + (nb * kRows + n) * K + sb * kSuper;
              row[k] = s.ds[2 * j][n] * float(byte & 15) - s.dm[2 * j][n];
              row[k + 32] = s.ds[2 * j + 1][n] * float(byte >> 4) - s.dm[2 * j + 1][n];
            }
      }
    }
  });
  return w;
}

// int8 [N, K] -> "vnni8" layout.
at::Tensor pack_int8(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2, "w must be int8 [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % kRows == 0 && K % 64 == 0, "N % 16 and K % 64 must be 0");
  const at::Tensor wc = w.contiguous();
  at::Tensor out = at::empty({N * K}, w.options());
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  const int64_t nks = K / 32;
  for (int64_t nb = 0; nb < N / kRows; ++nb)
    for (int64_t t = 0; t < nks; ++t)
      for (int p = 0; p < 16; ++p)
        for (int i = 0; i < 32; ++i)
          dst[((nb * nks + t) * 16 + p) * 32 + i] = src[(nb * kRows + i / 2) * K + 32 * t + 2 * p + i % 2];
  return out;
}

bool amx_available() { return amx_permitted(); }

void set_prefetch(int64_t mode, int64_t dist) {
  TORCH_CHECK(mode >= 0 && mode <= 3 && dist >= 1 && dist <= 64, "bad prefetch setting");
  g_pf_mode = static_cast<int>(mode);
  g_pf_dist = static_cast<int>(dist);
}

at::Tensor q4k_linear_amx(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K,
                          const c10::optional<at::Tensor>& bias) {
  return q4k_linear(x, packed, N, K, bias, true);
}

at::Tensor q4k_linear_avx512(const at::Tensor& x, const at::Tensor& packed, int64_t N, int64_t K,
                             const c10::optional<at::Tensor>& bias) {
  return q4k_linear(x, packed, N, K, bias, false);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_available", &amx_available);
  m.def("set_prefetch", &set_prefetch);
  m.def("pack_q4k", &pack_q4k);
  m.def("pack_q4k_rows", &pack_q4k_rows);
  m.def("pack_int8", &pack_int8);
  m.def("q4k_dequant", &q4k_dequant);
  m.def("q4k_linear_amx", &q4k_linear_amx);
  m.def("q4k_linear_avx512", &q4k_linear_avx512);
  m.def("q4k_linear_amx_bf16w", &q4k_linear_amx_bf16w);
  m.def("int8_linear_amx", &int8_linear_amx);
}
