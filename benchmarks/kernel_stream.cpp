// The int8, Q4_K and bf16 projection kernels alone, without Python or torch: y = x @ W.T for M activation
// rows over `copies` different weight matrices [N, K] in turn (so that, past the last-level cache,
// the weights stream from memory as in a forward pass), split in row blocks over T OpenMP threads
// as bindings.cpp splits them. Prints the best of `reps` sweeps: ms, weight GB/s, and 64-product
// multiply-add groups per second (one VPDPBUSD on 512 bits; for bf16, four FMAs on 512 bits). Built
// and run by kernel_stream.py.
//
//   kernel_stream KIND N K M COPIES REPS THREADS     (KIND: int8, q4k or bf16; int8-amx, q4k-amx:
//                                                    the tile kernels, built for the amx tier only)
//   kernel_stream peak 0 0 0 0 REPS THREADS          (the tier's integer multiply alone, see peak())
//   kernel_stream peak-mixed 0 0 0 0 REPS THREADS    (the same with Q4_K's epilogue FMAs, see peak_mixed())
#include <omp.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "vec.h"

using namespace verispec;

// The most 64-product groups per second the tier's integer multiply instruction retires on each of
// `threads` threads: 12 independent accumulator chains (more than its latency x its throughput on
// the CPUs measured), registers only, nothing else in the loop. What the int8 and Q4_K kernels can
// at best reach with every other instruction free: VPDPBUSD on 512 bits (avx512) is one group,
// on 256 bits (avx2vnni) half of one, VPMADDUBSW on 256 bits (avx2, without the widening add) half
// of one, SDOT (neon) a quarter; the portable tier has no such instruction (0).
//
// `peak-mixed` times the same chains with the fp32 multiply-adds of the Q4_K kernel's epilogue
// interleaved, five per sixteen multiplies (per activation row and 64 inputs: q4k_add_pair's mul
// and four FMAs against 16 VPDPBUSD): where the two share execution pipes (Zen 5: VPDPBUSD and FMA
// both issue on the same two), this is the most the eight-row Q4_K kernel can reach with its
// arithmetic as it is. The avx512 tier only (0 elsewhere: the loop's 19 chains need its 32 registers).
#if VS_VEC_AVX512
using PeakReg = __m512i;
constexpr double kGroupsPerOp = 1.0;
inline void peak_op(PeakReg& acc, PeakReg w, PeakReg x) { __asm__ volatile("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x)); }
inline PeakReg peak_init(int i) { return _mm512_set1_epi32(i); }
#define VS_PEAK_MIXED 1
using FmaReg = __m512;
inline void fma_op(FmaReg& acc, FmaReg a, FmaReg b) { __asm__ volatile("vfmadd231ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b)); }
inline FmaReg fma_init(int i) { return _mm512_set1_ps(static_cast<float>(i)); }
#elif VS_VEC_AVX2 && defined(__AVXVNNI__)
using PeakReg = __m256i;
constexpr double kGroupsPerOp = 0.5;
inline void peak_op(PeakReg& acc, PeakReg w, PeakReg x) { __asm__ volatile("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x)); }
inline PeakReg peak_init(int i) { return _mm256_set1_epi32(i); }
#elif VS_VEC_AVX2
using PeakReg = __m256i;
constexpr double kGroupsPerOp = 0.5;
inline void peak_op(PeakReg& acc, PeakReg w, PeakReg x) { __asm__ volatile("vpmaddubsw %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x)); }
inline PeakReg peak_init(int i) { return _mm256_set1_epi32(i); }
#elif VS_VEC_NEON
using PeakReg = int32x4_t;
constexpr double kGroupsPerOp = 0.25;
inline void peak_op(PeakReg& acc, PeakReg w, PeakReg x) {
  acc = vdotq_s32(acc, vreinterpretq_s8_s32(w), vreinterpretq_s8_s32(x));
  __asm__ volatile("" : "+w"(acc));
}
inline PeakReg peak_init(int i) { return vdupq_n_s32(i); }
#endif

// The best of `reps` wall times of `body` run on `threads` threads at once.
template <typename Body>
double best_seconds(int reps, int threads, Body body) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    body();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  return best;
}

double peak(int reps, int threads) {
#if VS_VEC_AVX512 || VS_VEC_AVX2 || VS_VEC_NEON
  constexpr long kIters = 2000000;
  const double s = best_seconds(reps, threads, [] {
    PeakReg w = peak_init(3), x = peak_init(5);
    PeakReg a0 = peak_init(0), a1 = peak_init(1), a2 = peak_init(2), a3 = peak_init(3), a4 = peak_init(4),
            a5 = peak_init(5), a6 = peak_init(6), a7 = peak_init(7), a8 = peak_init(8), a9 = peak_init(9),
            a10 = peak_init(10), a11 = peak_init(11);
    for (long i = 0; i < kIters; ++i) {
      peak_op(a0, w, x), peak_op(a1, w, x), peak_op(a2, w, x), peak_op(a3, w, x), peak_op(a4, w, x);
      peak_op(a5, w, x), peak_op(a6, w, x), peak_op(a7, w, x), peak_op(a8, w, x), peak_op(a9, w, x);
      peak_op(a10, w, x), peak_op(a11, w, x);
    }
    // (the asm statements are volatile: the compiler keeps every one, in this order)
  });
  return 12.0 * kIters * threads * kGroupsPerOp / s / 1e9;
#else
  (void)reps, (void)threads;
  return 0.0;
#endif
}

// The multiplies of peak() with five FMAs per sixteen (see peak-mixed above), in G groups/s.
double peak_mixed(int reps, int threads) {
#if VS_PEAK_MIXED
  constexpr long kIters = 4000000;
  const double s = best_seconds(reps, threads, [] {
    PeakReg w = peak_init(3), x = peak_init(5);
    PeakReg a0 = peak_init(0), a1 = peak_init(1), a2 = peak_init(2), a3 = peak_init(3), a4 = peak_init(4),
            a5 = peak_init(5), a6 = peak_init(6), a7 = peak_init(7), a8 = peak_init(8), a9 = peak_init(9),
            a10 = peak_init(10), a11 = peak_init(11);
    FmaReg u = fma_init(1), v = fma_init(2), f0 = fma_init(0), f1 = fma_init(1), f2 = fma_init(2),
           f3 = fma_init(3), f4 = fma_init(4);
    for (long i = 0; i < kIters; ++i) {  // 16 multiplies (a0-a3 twice), then 5 FMAs
      peak_op(a0, w, x), peak_op(a1, w, x), peak_op(a2, w, x), peak_op(a3, w, x), peak_op(a4, w, x);
      peak_op(a5, w, x), peak_op(a6, w, x), peak_op(a7, w, x), peak_op(a8, w, x), peak_op(a9, w, x);
      peak_op(a10, w, x), peak_op(a11, w, x), peak_op(a0, w, x), peak_op(a1, w, x), peak_op(a2, w, x);
      peak_op(a3, w, x);
      fma_op(f0, u, v), fma_op(f1, u, v), fma_op(f2, u, v), fma_op(f3, u, v), fma_op(f4, u, v);
    }
  });
  return 16.0 * kIters * threads * kGroupsPerOp / s / 1e9;
#else
  (void)reps, (void)threads;
  return 0.0;
#endif
}

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: kernel_stream int8|q4k|bf16|peak|peak-mixed N K M COPIES REPS THREADS\n");
    return 2;
  }
  if (!std::strcmp(argv[1], "peak")) {
    std::printf("peak: %.2f G groups/s\n", peak(std::atoi(argv[6]), std::atoi(argv[7])));
    return 0;
  }
  if (!std::strcmp(argv[1], "peak-mixed")) {
    std::printf("peak: %.2f G groups/s\n", peak_mixed(std::atoi(argv[6]), std::atoi(argv[7])));
    return 0;
  }
  const bool q4amx = !std::strcmp(argv[1], "q4k-amx"), int8amx = !std::strcmp(argv[1], "int8-amx");
  const bool q4 = q4amx || !std::strcmp(argv[1], "q4k"), bf16 = !std::strcmp(argv[1], "bf16");
#if VS_TIER_AMX
  if ((q4amx || int8amx) && !amx_permitted()) {
    std::fprintf(stderr, "Linux refused this process the AMX tile state\n");
    return 2;
  }
#else
  if (q4amx || int8amx) {
    std::fprintf(stderr, "the tile kernels need the amx tier's build\n");
    return 2;
  }
#endif
  const int64_t n = std::atol(argv[2]), k = std::atol(argv[3]);
  const int m = std::atoi(argv[4]), copies = std::atoi(argv[5]), reps = std::atoi(argv[6]);
  const int threads = std::atoi(argv[7]);
  // (Q4_K: whole records, and a half record where K is 128 past a multiple of 256, as packed)
  const int64_t bytes = q4 ? n / kRows * q4k_row_block_bytes(k) : bf16 ? 2 * n * k : n * k;
  // On huge pages where the OS gives them (SMALL_PAGES=1 in the environment: 4 KiB pages), as the
  // runtime's weights are mapped from their packed cache files; 2 MiB aligned, so 64-byte aligned
  // as the tile kernel's loads want.
  const size_t w_size = static_cast<size_t>(bytes) * copies;
  const bool small_pages = std::getenv("SMALL_PAGES") && std::string(std::getenv("SMALL_PAGES")) == "1";
  const size_t map_size = w_size + (2u << 20);
  void* const area = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (area == MAP_FAILED) {
    std::fprintf(stderr, "cannot map %zu bytes\n", map_size);
    return 2;
  }
  constexpr uintptr_t kHuge = 2u << 20;
  uint8_t* const w = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(area) + kHuge - 1) & ~(kHuge - 1));
#ifdef MADV_HUGEPAGE  // (Linux)
  madvise(w, w_size, small_pages ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
#else
  (void)small_pages;
#endif
  for (size_t i = 0; i < w_size; ++i) w[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  if (bf16)  // finite bf16 weights: exponent bits of every value cleared to 2^-1 .. 2^0
    for (size_t i = 1; i < w_size; i += 2) w[i] = static_cast<uint8_t>((w[i] & 0x80) | 0x3F);
  if (q4)  // every record's fp16 d and dmin, the half record's too: 2^-10 (finite scales)
    for (int64_t blk = 0; blk < copies * n / kRows; ++blk)
      for (int64_t r = 0; r < (k + kQ4KSuper - 1) / kQ4KSuper; ++r)
        for (int j = 0; j < 32; ++j)
          reinterpret_cast<uint16_t*>(w + blk * q4k_row_block_bytes(k) + r * kQ4KRecord)[j] = 0x1400;
  std::vector<int32_t> xq(static_cast<size_t>(m) * k / 4), xsum(static_cast<size_t>(m) * k / 32, 7);
  for (size_t i = 0; i < xq.size(); ++i) xq[i] = static_cast<int32_t>(i * 2654435761u);
  std::vector<float> xscale(static_cast<size_t>(m) * ((k + 63) / 64), 0.01f), xmin(static_cast<size_t>(m) * k / 32, 0.5f);
  std::vector<float> wscale(n + kRows, 0.02f), y(static_cast<size_t>(m) * n);
  W8A8Args a{};
  a.wscale = wscale.data();
  a.xq_rows = xq.data(), a.xscale_rows = xscale.data(), a.xsum_rows = xsum.data(), a.xmin_rows = xmin.data();
  // (the tile kernel reads the same activations row by row)
  a.xq = reinterpret_cast<const int8_t*>(xq.data()), a.xscale = xscale.data(), a.xsum = xsum.data(), a.xmin = xmin.data();
  a.y = y.data(), a.M = m, a.N = n, a.K = k, a.out_bf16 = false;
  std::vector<float> xf(static_cast<size_t>(m) * k, 0.5f);
  std::vector<uint16_t> xb(static_cast<size_t>(m) * k, 0x3F00);  // the same activations in bf16
  Bf16Args b{};
  b.x = xb.data(), b.xf = xf.data(), b.y = y.data(), b.M = m, b.N = n, b.K = k, b.out_bf16 = false;
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int c = 0; c < copies; ++c) {
      a.w = w + c * bytes;
      b.w = reinterpret_cast<const uint16_t*>(w + c * bytes);
#pragma omp parallel for num_threads(threads)
      for (int t = 0; t < threads; ++t) {
        const int64_t blocks = n / kRows, b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        if (bf16)
          bf16_linear_vec(b, b0, b1);
#if VS_TIER_AMX
        else if (q4amx)
          q4k_linear_amx(a, b0, b1);
        else if (int8amx)
          w8a8_linear_amx(a, b0, b1);
#endif
        else if (q4)
          q4k_linear_vec(a, b0, b1);
        else
          w8a8_linear_vec(a, b0, b1);
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  std::printf("%s N=%ld K=%ld M=%d: %.3f ms, %.1f GB/s, %.2f G groups/s\n", argv[1], static_cast<long>(n),
              static_cast<long>(k), m, best * 1e3, bytes * copies / best / 1e9,
              static_cast<double>(n) * k * m * copies / 64 / best / 1e9);
  return 0;
}
