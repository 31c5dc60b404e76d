// Whether a row-interleaved layout of Q4_K pays for batch-1 (and few-row) decode on this CPU, apart
// from genfn's library: the AVX-512 Q4_K row kernel as genfn/kernels/kquant_linear.cpp runs it (the
// super-blocks of one weight row as GGUF stores them, vpmaddubsw/vpmaddwd, the scales by vpshufb)
// against the same matrices repacked 8 rows to a group ("r8", the idea of ik_llama.cpp's q4_k_r8;
// the layout and kernel are this file's own) and read by vpdpbusd, one activation broadcast serving
// 8 weight rows. Both against an AVX-512 loop that only adds the bytes (the read ceiling).
//
// The r8 layout is genfn's q4_k_r8 (genfn/kernels/kquant.h, whose r8_store this file repacks with;
// the kernels here are the measurement's own, written before the library's kquant_r8.cpp).
// Per group the 16-input lane dots (|dot| <= 16 * 15 * 127, an int16) are scaled by vpdpwssd
// against the group's scale in the low word, the lane pairs of a row added once per super-block:
// each row's super-block sum is the same exact integer as the row kernel's, scaled once by
// d * d_x; the minimums are one vpdpwssd per 4 groups against the activation's 32-input code sums.
// The float accumulation differs (a float per row here, 16 lanes reduced at the end there).
//
//   g++ -O2 -march=native -std=c++17 -pthread benchmarks/q4k_r8_patterns.cpp -o /tmp/q4k_r8
//   /tmp/q4k_r8 K ROWS THREADS ROUNDS MB [XROWS [WAIT]]   # e.g. 2048 8192 2 9 256 1: gate/up, 256 MB of copies
//   (WAIT: the most seconds a round waits for idle cores, default 60; 0: no wait)
//
// Results of the session that wrote it: benchmarks/results/q4k-r8-2026-12-03.log.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>

#include "../genfn/kernels/kquant.h"

using genfn::kquant::r8_store;
using genfn::kquant::unpack_scales;

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"), always_inline))

constexpr int kSuper = 256, kBlock = 144, kGroup = genfn::kquant::kR8Block;

static void cpu_times(long long& idle, long long& total) {
  FILE* f = fopen("/proc/stat", "r");
  long long v[8] = {0};
  if (fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", v, v + 1, v + 2, v + 3, v + 4, v + 5, v + 6, v + 7) != 8) v[3] = 1;
  fclose(f);
  idle = v[3] + v[4];
  total = 0;
  for (int i = 0; i < 8; ++i) total += v[i];
}
// Wait (up to max_s) until the other processes leave the cores idle for 300 ms.
static double wait_quiet(double need, int max_s) {
  double frac = 0;
  for (int i = 0; i < max_s * 3; ++i) {
    long long i0, t0, i1, t1;
    cpu_times(i0, t0);
    usleep(300000);
    cpu_times(i1, t1);
    frac = double(i1 - i0) / double(std::max(1ll, t1 - t0));
    if (frac >= need) return frac;
  }
  return frac;
}

// Q8_K activations of XROWS rows: codes natural and in the row kernel's order (0-31, 64-95, 32-63,
// 96-127 per 128), a scale per super-block, code sums per 16 (the row kernel's) and per 32 (r8's).
struct Acts {
  std::vector<int8_t> natural, q4k;
  std::vector<float> scale;
  std::vector<int16_t> sums16, sums32;
  int K = 0;
};


// ---------------------------------------------------------------------------------------------
// The row kernel as kquant_linear.cpp runs Q4_K on AVX-512 (row_avx512<M, kQ4K>)

struct Q4Index {
  alignas(64) uint8_t scales[4][64];
  alignas(32) uint8_t mins[32];
  constexpr Q4Index() : scales(), mins() {
    constexpr int kPairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int p = 0; p < 4; ++p)
      for (int k = 0; k < 64; ++k) scales[p][k] = k % 2 ? 0x80 : static_cast<uint8_t>(kPairs[p][k / 32]);
    for (int k = 0; k < 32; ++k) mins[k] = k % 2 ? 0x80 : static_cast<uint8_t>(k / 4);
  }
};
constexpr Q4Index kQ4Index;

template <int M>
AVX512 void rows_file(const uint8_t* w, int nb, const Acts& a, float* y) {
  __m512 acc[M];
  __m256 acc_min[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps(), acc_min[m] = _mm256_setzero_ps();
  const int K = a.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int b = 0; b < nb; ++b, w += kBlock) {
    uint16_t h[2];
    memcpy(h, w, 4);
    const float d = _cvtsh_ss(h[0]), dmin = _cvtsh_ss(h[1]);
    uint64_t sc, mn;
    unpack_scales(w + 4, sc, mn);
    const __m512i scales8 = _mm512_set1_epi64((long long)sc);
    const __m256i mins16 = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)mn), _mm256_load_si256((const __m256i*)kQ4Index.mins));
    __m512i lo[2], hi[2];
    for (int j = 0; j < 2; ++j) {
      const __m512i packed = _mm512_loadu_si512(w + 16 + 64 * j);
      lo[j] = _mm512_and_si512(packed, low4);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    }
    __m512i s[4];
    for (int p = 0; p < 4; ++p) s[p] = _mm512_shuffle_epi8(scales8, _mm512_load_si512(kQ4Index.scales[p]));
    for (int m = 0; m < M; ++m) {
      const int8_t* x = a.q4k.data() + m * K + b * kSuper;
      __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(lo[0], _mm512_loadu_si512(x)), s[0]);
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(hi[0], _mm512_loadu_si512(x + 64)), s[1]));
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(lo[1], _mm512_loadu_si512(x + 128)), s[2]));
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(hi[1], _mm512_loadu_si512(x + 192)), s[3]));
      const float dx = a.scale[m * nb + b];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx), acc[m]);
      const __m256i sums = _mm256_loadu_si256((const __m256i*)(a.sums16.data() + m * (K / 16) + b * 16));
      acc_min[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, mins16)), _mm256_set1_ps(dmin * dx), acc_min[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    const __m128 lo = _mm256_castps256_ps128(acc_min[m]), hi = _mm256_extractf128_ps(acc_min[m], 1);
    __m128 t = _mm_add_ps(lo, hi);
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    y[m] = _mm512_reduce_add_ps(acc[m]) - _mm_cvtss_f32(t);
  }
}

// ---------------------------------------------------------------------------------------------
// r8

struct R8Index {
  alignas(64) uint8_t byte_of[4][64];  // group g % 4's scale byte of each dword into its low word
  alignas(64) uint32_t dup[16];        // dword r of 8 into lanes 2r and 2r + 1
  constexpr R8Index() : byte_of(), dup() {
    for (int g = 0; g < 4; ++g)
      for (int k = 0; k < 64; ++k) byte_of[g][k] = k % 4 ? 0x80 : static_cast<uint8_t>((k % 16) + g);
    for (int l = 0; l < 16; ++l) dup[l] = l / 2;
  }
};
constexpr R8Index kR8;

static void repack_r8(const uint8_t* src, int nb, uint8_t* dst) {  // 8 rows of nb super-blocks
  for (int b = 0; b < nb; ++b, dst += kGroup)
    for (int r = 0; r < 8; ++r) r8_store(src + (int64_t(r) * nb + b) * kBlock, r, dst);
}

AVX512_INLINE inline __m512i bcast8(const int8_t* p) {
  long long v;
  memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

template <int M>
AVX512 void rows_r8(const uint8_t* w, int nb, const Acts& a, float* y, int64_t N) {
  __m256 acc[M], acc_min[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), acc_min[m] = _mm256_setzero_ps();
  const int K = a.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m256i m3f = _mm256_set1_epi8(0x3F), m0f = _mm256_set1_epi8(0x0F), m03 = _mm256_set1_epi8(0x03);
  const __m512i dup = _mm512_load_si512(kR8.dup);
  for (int b = 0; b < nb; ++b, w += kGroup) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 16)));
    const __m256i u0 = _mm256_loadu_si256((const __m256i*)(w + 32)), u1 = _mm256_loadu_si256((const __m256i*)(w + 64)),
                  u2 = _mm256_loadu_si256((const __m256i*)(w + 96));
    const __m256i sc_lo = _mm256_and_si256(u0, m3f), mn_lo = _mm256_and_si256(u1, m3f);
    const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(u2, m0f),
                                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m03), 4));
    const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m0f),
                                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m03), 4));
    const __m512i scd[2] = {_mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(sc_lo)),
                            _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(sc_hi))};
    const __m512i mins_lo = _mm512_cvtepu8_epi16(mn_lo), mins_hi = _mm512_cvtepu8_epi16(mn_hi);
    __m512i isum[M], imin[M];
    for (int m = 0; m < M; ++m) {
      const int16_t* s32 = a.sums32.data() + m * (K / 32) + b * 8;
      long long q0, q1;
      memcpy(&q0, s32, 8);
      memcpy(&q1, s32 + 4, 8);
      imin[m] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins_lo, _mm512_set1_epi64(q0));
      imin[m] = _mm512_dpwssd_epi32(imin[m], mins_hi, _mm512_set1_epi64(q1));
      isum[m] = _mm512_setzero_si512();
    }
    const uint8_t* qs = w + 128;
    for (int j = 0; j < 4; ++j) {
      const __m512i sc_a = _mm512_shuffle_epi8(scd[j / 2], _mm512_load_si512(kR8.byte_of[(2 * j) % 4]));
      const __m512i sc_b = _mm512_shuffle_epi8(scd[j / 2], _mm512_load_si512(kR8.byte_of[(2 * j + 1) % 4]));
      __m512i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        const __m512i packed = _mm512_loadu_si512(qs + 256 * j + 64 * k);
        lo[k] = _mm512_and_si512(packed, low4);
        hi[k] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.natural.data() + m * K + b * kSuper + 64 * j;
        __m512i dl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], bcast8(x));
        __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], bcast8(x + 32));
        for (int k = 1; k < 4; ++k) {
          dl = _mm512_dpbusd_epi32(dl, lo[k], bcast8(x + 8 * k));
          dh = _mm512_dpbusd_epi32(dh, hi[k], bcast8(x + 32 + 8 * k));
        }
        isum[m] = _mm512_dpwssd_epi32(isum[m], dl, sc_a);
        isum[m] = _mm512_dpwssd_epi32(isum[m], dh, sc_b);
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m512i s = _mm512_add_epi32(isum[m], _mm512_shuffle_epi32(isum[m], _MM_PERM_CDAB));
      const __m512i mn = _mm512_add_epi32(imin[m], _mm512_shuffle_epi32(imin[m], _MM_PERM_CDAB));
      const __m256 dx = _mm256_set1_ps(a.scale[m * nb + b]);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_cvtepi64_epi32(s)), _mm256_mul_ps(d, dx), acc[m]);
      acc_min[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_cvtepi64_epi32(mn)), _mm256_mul_ps(dmin, dx), acc_min[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * N, _mm256_sub_ps(acc[m], acc_min[m]));
}

// ---------------------------------------------------------------------------------------------
// The walk: the copies of a matrix called in turn, each thread an even run of 8-row groups, a
// spinning barrier between calls (as between a step's linears).

static int K, T, XR;
static int64_t ROWS, mats;
static uint8_t *Wfile, *Wr8;
static Acts A;
static float* Y;
static int variant;

AVX512 static void readsum(const uint8_t* p, int64_t bytes, float* y) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < bytes; i += 256) {
    a0 = _mm512_add_epi32(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(p + i + 192));
  }
  *y = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}

template <int M>
static void run_rows(int64_t g0, int64_t g1, int64_t mat) {
  const int nb = K / kSuper;
  const int64_t row_bytes = int64_t(nb) * kBlock;
  float* y = Y + mat * ROWS;
  if (variant == 0) {
    readsum(Wfile + (mat * ROWS + 8 * g0) * row_bytes, (g1 - g0) * 8 * row_bytes, y + 8 * g0);
  } else if (variant == 1) {
    float out[M];
    for (int64_t n = 8 * g0; n < 8 * g1; ++n) {
      rows_file<M>(Wfile + (mat * ROWS + n) * row_bytes, nb, A, out);
      for (int m = 0; m < M; ++m) y[m * mats * ROWS + n] = out[m];
    }
  } else {
    for (int64_t g = g0; g < g1; ++g) rows_r8<M>(Wr8 + (mat * ROWS + 8 * g) * row_bytes, nb, A, y + 8 * g, mats * ROWS);
  }
}

static void bar() {
  static std::atomic<int> cnt{0}, ph{0};
  const int p = ph.load();
  if (cnt.fetch_add(1) == T - 1) {
    cnt = 0;
    ph.fetch_add(1);
  } else {
    while (ph.load() == p) _mm_pause();
  }
}

static void work(int t) {
  const int64_t groups = ROWS / 8;
  for (int64_t m = 0; m < mats; ++m) {
    const int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
    switch (XR) {
      case 1: run_rows<1>(g0, g1, m); break;
      case 2: run_rows<2>(g0, g1, m); break;
      case 4: run_rows<4>(g0, g1, m); break;
      default: run_rows<8>(g0, g1, m); break;
    }
    bar();
  }
}

static uint16_t half(float f) { return _cvtss_sh(f, 0); }

int main(int argc, char** argv) {
  K = argc > 1 ? atoi(argv[1]) : 2048;
  ROWS = argc > 2 ? atoll(argv[2]) : 8192;
  T = argc > 3 ? atoi(argv[3]) : 2;
  const int rounds = argc > 4 ? atoi(argv[4]) : 9;
  const int64_t mb = argc > 5 ? atoll(argv[5]) : 256;
  XR = argc > 6 ? atoi(argv[6]) : 1;
  const int max_wait = argc > 7 ? atoi(argv[7]) : 60;  // seconds a round waits for idle cores
  if (K % kSuper || ROWS % 8 || (XR != 1 && XR != 2 && XR != 4 && XR != 8)) {
    fprintf(stderr, "K must be a multiple of 256, ROWS of 8, XROWS 1, 2, 4 or 8\n");
    return 2;
  }
  const int nb = K / kSuper;
  const int64_t mat_bytes = ROWS * nb * kBlock;
  mats = std::max<int64_t>(2, (mb << 20) / mat_bytes);
  const int64_t bytes = mats * mat_bytes;
  Wfile = (uint8_t*)aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  Wr8 = (uint8_t*)aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte(0, 255), code(-127, 127);
  std::uniform_real_distribution<float> scale(1e-3f, 4e-3f);
  for (int64_t blk = 0; blk < bytes / kBlock; ++blk) {
    uint8_t* p = Wfile + blk * kBlock;
    const uint16_t h[2] = {half(scale(rng)), half(scale(rng))};
    memcpy(p, h, 4);
    for (int i = 4; i < kBlock; ++i) p[i] = (uint8_t)byte(rng);
  }
  for (int64_t g = 0; g < bytes / (int64_t(nb) * kGroup); ++g)
    repack_r8(Wfile + g * nb * kGroup, nb, Wr8 + g * nb * kGroup);
  A.K = K;
  A.natural.resize(int64_t(XR) * K);
  A.q4k.resize(A.natural.size());
  A.scale.resize(XR * nb);
  A.sums16.resize(XR * K / 16);
  A.sums32.resize(XR * K / 32);
  for (int64_t i = 0; i < int64_t(XR) * K; ++i) A.natural[i] = (int8_t)code(rng);
  for (int m = 0; m < XR; ++m) {
    for (int b = 0; b < nb; ++b) A.scale[m * nb + b] = scale(rng);
    const int8_t* x = A.natural.data() + m * K;
    for (int i = 0; i < K; ++i) {
      const int c = i % 128, base = i - c;
      const int src = c < 32 ? c : c < 64 ? c + 32 : c < 96 ? c - 32 : c;
      A.q4k[m * K + i] = x[base + src];
      A.sums16[m * K / 16 + i / 16] += x[i];
      A.sums32[m * K / 32 + i / 32] += x[i];
    }
  }
  Y = (float*)aligned_alloc(64, (mats * ROWS * XR * 4 + 63) / 64 * 64);
  const char* names[3] = {"read loop", "row kernel (file layout)", "r8 vpdpbusd"};
  // Check: both kernels against an exact reference on the first matrix.
  std::vector<float> ref(ROWS * XR), got[2];
  for (int m = 0; m < XR; ++m)
    for (int64_t n = 0; n < ROWS; ++n) {
      double total = 0;
      for (int b = 0; b < nb; ++b) {
        const uint8_t* p = Wfile + (n * nb + b) * kBlock;
        uint16_t h[2];
        memcpy(h, p, 4);
        uint64_t sc, mn;
        unpack_scales(p + 4, sc, mn);
        int64_t s = 0, mins = 0;
        for (int i = 0; i < kSuper; ++i) {
          const int g = i / 32, j = i / 64, l = i % 32;
          const int q = g % 2 ? p[16 + 32 * j + l] >> 4 : p[16 + 32 * j + l] & 15;
          const int xi = A.natural[m * K + b * kSuper + i];
          s += int64_t((sc >> (8 * g)) & 0xFF) * q * xi;
          mins += int64_t((mn >> (8 * g)) & 0xFF) * xi;
        }
        total += double(A.scale[m * nb + b]) * (_cvtsh_ss(h[0]) * double(s) - _cvtsh_ss(h[1]) * double(mins));
      }
      ref[m * ROWS + n] = (float)total;
    }
  for (int v = 1; v <= 2; ++v) {
    variant = v;
    std::vector<std::thread> th;
    for (int t = 1; t < T; ++t) th.emplace_back(work, t);
    work(0);
    for (auto& x : th) x.join();
    double worst = 0, scale_ref = 0;
    for (int m = 0; m < XR; ++m)
      for (int64_t n = 0; n < ROWS; ++n) scale_ref = std::max(scale_ref, (double)std::fabs(ref[m * ROWS + n]));
    for (int m = 0; m < XR; ++m)
      for (int64_t n = 0; n < ROWS; ++n)
        worst = std::max(worst, std::fabs(double(Y[m * mats * ROWS + n]) - ref[m * ROWS + n]));
    printf("%-26s max |y - exact| %.3g (max |y| %.3g)\n", names[v], worst, scale_ref);
    if (worst > 1e-4 * scale_ref) {
      printf("MISMATCH\n");
      return 1;
    }
  }
  std::vector<std::vector<double>> times(3);
  std::vector<int> order = {0, 1, 2};
  std::mt19937 shuffler(1);
  for (int rep = 0; rep < rounds; ++rep) {
    std::shuffle(order.begin(), order.end(), shuffler);
    const double idle = max_wait > 0 ? wait_quiet(0.85, max_wait) : 0.0;
    fprintf(stderr, "round %d idle %.2f\n", rep, idle);
    for (int v : order) {
      variant = v;
      const auto start = std::chrono::steady_clock::now();
      std::vector<std::thread> th;
      for (int t = 1; t < T; ++t) th.emplace_back(work, t);
      work(0);
      for (auto& x : th) x.join();
      times[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  for (int v = 0; v < 3; ++v) {
    std::vector<double> t = times[v];
    std::sort(t.begin(), t.end());
    printf("K %d rows %ld T %d x-rows %d %-26s best %6.1f GB/s  median %6.1f GB/s\n", K, (long)ROWS, T, XR, names[v],
           bytes / t[0] / 1e9, bytes / t[t.size() / 2] / 1e9);
  }
  std::vector<double> ratio;
  for (int r = 0; r < rounds; ++r) ratio.push_back(times[2][r] / times[1][r]);
  std::sort(ratio.begin(), ratio.end());
  printf("r8 / row kernel time per round: min %.2f median %.2f max %.2f\n", ratio[0], ratio[rounds / 2], ratio[rounds - 1]);
}
