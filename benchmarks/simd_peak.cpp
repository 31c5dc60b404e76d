// The arithmetic ceiling of one core, against which a few-row decode step's kernels are measured
// (docs/guides/k-quants-and-scale.md, "Steps of a few rows"): how many 512-bit vpdpbusd (int8,
// 64 multiply-adds each: the quantized kernels) and vfmadd231ps (float32, 16 each: the float
// kernels) one core retires a second, with 12 independent chains so that latency is hidden; and
// vdpbf16ps (bfloat16 pairs, 32 multiply-adds each: genfn's bfloat16 GEMM, bf16_gemm.cpp) where
// the CPU has AVX512_BF16; and vpdpbusd each fed by its own qword broadcast from memory, as the
// K-quant group kernels feed it, and one such broadcast for every two; and the tiles kernel's
// eight-row block, with and without its float steps, and with them but no minimum (Q4_0's and Q8_0's
// tiles; tile_block_rate).
// Zen 4 splits a 512-bit operation into two 256-bit halves, Zen 5 and Intel's AVX-512 cores do
// not: the ceiling differs by ~2x between the VMs this project runs on, so measure it on the
// machine whose steps you explain.
//
//   g++ -O2 -march=native -std=c++17 benchmarks/simd_peak.cpp -o /tmp/simd_peak && /tmp/simd_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <class Body>
double best_seconds(Body body, int rounds) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto start = std::chrono::steady_clock::now();
    body();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  return best;
}

// The best of `rounds` runs of `iterations` x 12 chains of vdpbf16ps, compiled for AVX512_BF16
// alone so that the rest builds (and runs) on a CPU without it.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) double dpbf16_seconds(long iterations, int rounds, float* sink) {
  constexpr int kMaxChains = 12;
  __m512 acc[kMaxChains];
  for (int i = 0; i < kMaxChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512bh pair = (__m512bh)_mm512_set1_epi32(0x3F803F80);         // (1.0, 1.0)
  const __m512bh small = (__m512bh)_mm512_set1_epi32(0x33D633D6);  // ~1e-7 each
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (long n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < kMaxChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], pair, small);
      asm volatile("" : "+v"(pair));
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  for (int i = 0; i < kMaxChains; ++i) *sink += _mm512_reduce_add_ps(acc[i]);
  return best;
}

// The tiles kernel's block for eight rows of x (quant_linear.cpp's run_tiles, a Q4_1 tile): per row,
// eight vpdpbusd in two chains, their sum, its conversion to float, the block's scale times the
// row's (vmulps) and two fmas into the row's float chain (the product, then the minimum's term;
// kMinimum = false: a Q4_0 or Q8_0 tile, the product's fma alone).
// The float steps run on the pipes vpdpbusd runs on, so this is the kernel's ceiling at eight rows
// with its bits (each output one float chain over the blocks). kFloat = false: the integer part alone.
// Returns vpdpbusd a second.
template <bool kFloat, bool kMinimum = true>
double tile_block_rate(long iterations, float* sink) {
  __m512i w[8];
  for (int j = 0; j < 8; ++j) w[j] = _mm512_set1_epi8(static_cast<char>(j + 1));
  __m512 acc[8];
  __m512i kept[8];
  for (int m = 0; m < 8; ++m) acc[m] = _mm512_set1_ps(static_cast<float>(m)), kept[m] = _mm512_setzero_si512();
  alignas(64) static int32_t x_codes[64];
  alignas(64) static float x_scales[8];
  for (int i = 0; i < 64; ++i) x_codes[i] = i * 3;
  for (int m = 0; m < 8; ++m) x_scales[m] = 1.0f + m;
  __m512 d = _mm512_set1_ps(0.5f);
  const __m512 minimum = _mm512_set1_ps(0.25f);
  double best = 1e30;
  // Timed inline, not through best_seconds' lambda: captured by reference, the registers would
  // go through memory at every block.
  for (int r = 0; r < 7; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (long n = 0; n < iterations; ++n) {
      // Every weight register opaque each block, so no chain is hoisted out of the loop.
      asm volatile("" : "+v"(w[0]), "+v"(w[1]), "+v"(w[2]), "+v"(w[3]), "+v"(w[4]), "+v"(w[5]), "+v"(w[6]),
                   "+v"(w[7]), "+v"(d));
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) {
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 8; j += 2) {
          s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(x_codes[m * 8 + j]));
          s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(x_codes[m * 8 + j + 1]));
        }
        s0 = _mm512_add_epi32(s0, s1);
        if constexpr (kFloat) {
          const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(x_scales[m]));
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), dx, acc[m]);
          if constexpr (kMinimum) acc[m] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x_scales[m] * 0.5f), acc[m]);
        } else {
          kept[m] = _mm512_xor_si512(kept[m], s0);
        }
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  for (int m = 0; m < 8; ++m) *sink += _mm512_reduce_add_ps(acc[m]) + static_cast<float>(_mm512_reduce_add_epi32(kept[m]));
  return static_cast<double>(iterations) * 64 / best;
}

int main() {
  constexpr long kIterations = 20000000;
  constexpr int kChains = 12;
  __m512i sums[kChains];
  for (int i = 0; i < kChains; ++i) sums[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3);
  const __m512i x = _mm512_set1_epi8(5);
  const double int8_s = best_seconds([&] {
    for (long n = 0; n < kIterations; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) sums[i] = _mm512_dpbusd_epi32(sums[i], w, x);
      asm volatile("" : "+v"(w));  // keeps the loop from being folded away
    }
  }, 15);
  long long int_sink = 0;
  for (int i = 0; i < kChains; ++i) int_sink += _mm512_reduce_add_epi32(sums[i]);

  // The K-quant group kernels' form (kquant_r8.cpp): each vpdpbusd takes 8 activation bytes that
  // a vpbroadcastq brings from memory (L1) for it alone.
  alignas(64) static int8_t codes[64 * 32];
  for (int i = 0; i < 64 * 32; ++i) codes[i] = static_cast<int8_t>(i % 7);
  for (int i = 0; i < kChains; ++i) sums[i] = _mm512_set1_epi32(i);
  const double broadcast_s = best_seconds([&] {
    for (long n = 0; n < kIterations; ++n) {
      const int8_t* c = codes + (n & 31) * 64;
      asm volatile("" : "+r"(c));  // an address the compiler cannot hoist the loads from
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) {
        long long q;
        __builtin_memcpy(&q, c + 8 * i, 8);
        sums[i] = _mm512_dpbusd_epi32(sums[i], w, _mm512_set1_epi64(q));
      }
    }
  }, 15);
  for (int i = 0; i < kChains; ++i) int_sink += _mm512_reduce_add_epi32(sums[i]);
  // One broadcast for two vpdpbusd against different weights (two groups of 8 rows at once).
  __m512i w2 = _mm512_set1_epi8(4);
  for (int i = 0; i < kChains; ++i) sums[i] = _mm512_set1_epi32(i);
  const double shared_s = best_seconds([&] {
    for (long n = 0; n < kIterations; ++n) {
      const int8_t* c = codes + (n & 31) * 64;
      asm volatile("" : "+r"(c));
#pragma GCC unroll 6
      for (int i = 0; i < kChains; i += 2) {
        long long q;
        __builtin_memcpy(&q, c + 4 * i, 8);
        const __m512i x8 = _mm512_set1_epi64(q);
        sums[i] = _mm512_dpbusd_epi32(sums[i], w, x8);
        sums[i + 1] = _mm512_dpbusd_epi32(sums[i + 1], w2, x8);
      }
    }
  }, 15);
  for (int i = 0; i < kChains; ++i) int_sink += _mm512_reduce_add_epi32(sums[i]);

  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 scale = _mm512_set1_ps(1.0000001f);
  const __m512 add = _mm512_set1_ps(1e-7f);
  const double fma_s = best_seconds([&] {
    for (long n = 0; n < kIterations; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], scale, add);
      asm volatile("" : "+v"(scale));
    }
  }, 15);
  float float_sink = 0;
  for (int i = 0; i < kChains; ++i) float_sink += _mm512_reduce_add_ps(acc[i]);

  double bf16_s = 0;
  float bf16_sink = 0;
  if (__builtin_cpu_supports("avx512bf16")) bf16_s = dpbf16_seconds(kIterations, 15, &bf16_sink);

  const double ops = static_cast<double>(kIterations) * kChains;
  std::printf("vpdpbusd zmm: %.2f G/s = %.0f G int8 multiply-adds/s a core\n", ops / int8_s / 1e9,
              ops * 64 / int8_s / 1e9);
  std::printf("vpdpbusd zmm, each with a qword broadcast from memory: %.2f G/s\n", ops / broadcast_s / 1e9);
  std::printf("vpdpbusd zmm, a qword broadcast from memory for every two: %.2f G/s\n", ops / shared_s / 1e9);
  std::printf("vfmadd231ps zmm: %.2f G/s = %.0f G float32 multiply-adds/s a core\n", ops / fma_s / 1e9,
              ops * 16 / fma_s / 1e9);
  if (bf16_s > 0)
    std::printf("vdpbf16ps zmm: %.2f G/s = %.0f G bfloat16 multiply-adds/s a core (%.0f GFLOP/s)\n",
                ops / bf16_s / 1e9, ops * 32 / bf16_s / 1e9, ops * 64 / bf16_s / 1e9);
  float tile_sink = 0;
  const double tile_int = tile_block_rate<false>(kIterations / 4, &tile_sink);
  const double tile_float = tile_block_rate<true>(kIterations / 4, &tile_sink);
  const double tile_no_minimum = tile_block_rate<true, false>(kIterations / 4, &tile_sink);
  std::printf("vpdpbusd in the tiles kernel's eight-row block: %.2f G/s, %.2f G/s with its float steps (%.2fx the time)\n",
              tile_int / 1e9, tile_float / 1e9, tile_int / tile_float);
  std::printf("  the same without a minimum (Q4_0, Q8_0 tiles): %.2f G/s with its float steps (%.2fx the time)\n",
              tile_no_minimum / 1e9, tile_int / tile_no_minimum);
  std::printf("(sinks %lld %g %g %g)\n", int_sink, float_sink, bf16_sink, tile_sink);
}
