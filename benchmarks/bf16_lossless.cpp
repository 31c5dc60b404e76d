// Whether a bfloat16 model can be read in fewer bytes with no change to a single weight: each
// weight's low byte (the exponent's last bit and the 7 mantissa bits) kept as is, and its high byte
// (sign and the exponent's top 7 bits) as a 4-bit code against a base shared by 64 weights. That is
// 12.1 bits a weight where bfloat16 takes 16, so a batch-1 decode, which waits on memory, could
// stream a token's weights in ~0.76x the time if unpacking keeps up with the memory. Here a one-row
// (or few-row) GEMV over the 1B shape's matrices (16 layers of qkv 3072 x 2048, o 2048 x 2048,
// gate/up 16384 x 2048, down 2048 x 8192, then the 49152 x 2048 head: 1.24 B weights), walked one
// after another as a step walks them, plain bfloat16 against the packed form, both summed the same
// way (vdpbf16ps, four accumulators a row of x), so their outputs must agree bit for bit.
//
// The packed form, per row of a matrix, groups of 64 weights:
//   base   one byte a group: the largest (high byte & 0x7F) of its weights; bit 7 set where a weight
//          lies more than 7 below it (the group is "raw": its 64 high bytes are stored whole in the
//          row's exception list, in group order).
//   record 192 bytes per two groups: group a's 64 low bytes, group b's, then 64 code bytes (a's 32,
//          b's 32). The low bytes are in `packus(W0 & 0xFF, W1 & 0xFF)` order (W0 the group's words
//          0-31, W1 32-63), so `unpacklo/hi(low, high)` gives back words 0-31 and 32-63 in order.
//          Code byte j holds position j's code in its low nibble and position 32 + j's in its high
//          one; a code is sign << 3 | (base - (high & 0x7F)).
// Unpacking a group: split the code nibbles, one vpshufb through a 16-entry table (base - offset,
// the sign's 0x80) gives the 64 high bytes, and vpunpcklbw / vpunpckhbw pair them with the low ones.
//
//   g++ -O2 -march=native -fopenmp -std=c++17 benchmarks/bf16_lossless.cpp -o /tmp/bf16_lossless
//   OMP_NUM_THREADS=2 /tmp/bf16_lossless ROWS_OF_X ROUNDS DISTRIBUTION PACKED_AHEAD PLAIN_AHEAD
//   e.g. 1 8 normal 4096 0; IN_CACHE=1 in the environment: one 2048 x 2048 matrix 64 times over
//   (from L2/L3), which times the unpacking itself.
// DISTRIBUTION: normal (std 0.02, as benchmarks/make_model.py writes), laplace or t3 (heavier
// tails: more groups are raw). PACKED_AHEAD / PLAIN_AHEAD: bytes each form's stream is fetched
// ahead into L1 (0: left to the hardware prefetchers; on the Zen 4 of session 38 the packed form
// wanted 4096, its unpacking otherwise stalling the stream, and the plain one gained nothing).
// Prints the bytes a token reads in each form, the share of raw groups, each round's time of both
// (alternating which goes first) and their ratio, and whether every output agreed bit for bit.
// Results of the session that wrote it: benchmarks/results/bf16-lossless-2026-12-07-s38-zen4.log.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kMaxRows = 8;
static int64_t kAhead = 0, kAheadPlain = 0;

// Memory on huge pages where the kernel gives them (as genfn's arena), zero-filled.
template <typename T>
T* huge_alloc(size_t count) {
  const size_t bytes = ((count * sizeof(T) + (2u << 20) - 1) / (2u << 20)) * (2u << 20);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); std::exit(1); }
  madvise(p, bytes, MADV_HUGEPAGE);
  return static_cast<T*>(p);
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

struct Matrix {
  int64_t N, K;
  uint16_t* plain;             // [N, K]
  uint8_t* records;            // [N, K / 128, 192]
  uint8_t* bases;              // [N, K / 64]
  std::vector<uint8_t> raw;    // the raw groups' high bytes, row after row
  std::vector<int64_t> raw_at; // [N + 1]: where each row's raw groups start in `raw`
};

// Packs m.plain into the records, bases and exceptions (scalar: a benchmark's one-off).
int64_t pack(Matrix& m) {
  const int64_t groups = m.K / 64;
  m.raw_at.assign(m.N + 1, 0);
  int64_t raw_groups = 0;
  for (int64_t n = 0; n < m.N; ++n) {
    m.raw_at[n] = static_cast<int64_t>(m.raw.size());
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* w = m.plain + n * m.K + g * 64;
      uint8_t* record = m.records + (n * (m.K / 128) + g / 2) * 192;
      uint8_t* low = record + (g % 2) * 64;
      uint8_t* code = record + 128 + (g % 2) * 32;
      uint8_t high[64];
      int base = 0;
      for (int p = 0; p < 64; ++p) {
        // byte position p of lane l = p / 16: k = p % 16 < 8 -> word 8l + k, else word 32 + 8l + (k - 8)
        const int l = p / 16, k = p % 16, word = k < 8 ? 8 * l + k : 32 + 8 * l + (k - 8);
        low[p] = static_cast<uint8_t>(w[word] & 0xFF);
        high[p] = static_cast<uint8_t>(w[word] >> 8);
        base = std::max(base, high[p] & 0x7F);
      }
      bool fits = true;
      for (int p = 0; p < 64; ++p) fits = fits && base - (high[p] & 0x7F) <= 7;
      m.bases[n * groups + g] = static_cast<uint8_t>(base | (fits ? 0 : 0x80));
      for (int j = 0; j < 32; ++j) {
        auto nibble = [&](int p) { return ((high[p] >> 7) << 3) | (fits ? base - (high[p] & 0x7F) : 0); };
        code[j] = static_cast<uint8_t>(nibble(j) | nibble(32 + j) << 4);
      }
      if (!fits) {
        m.raw.insert(m.raw.end(), high, high + 64);
        ++raw_groups;
      }
    }
  }
  m.raw_at[m.N] = static_cast<int64_t>(m.raw.size());
  return raw_groups;
}

// y[r * N + n] = the sum of row r's four accumulators, ((a0 + a1) + (a2 + a3)), reduced.
template <int R>
__attribute__((target("avx512f"))) inline void store_sums(const __m512 (*acc)[4], float* y, int64_t N, int64_t n) {
  for (int r = 0; r < R; ++r)
    y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

// y[r, n] for rows n of w against R rows of x: four accumulators a row of x (32-weight chunks
// round-robin), then summed as ((a0 + a1) + (a2 + a3)) and reduced.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void plain_rows(const Matrix& m, const uint16_t* x, float* y) {
  const int64_t K = m.K;
#pragma omp for schedule(static)
  for (int64_t n = 0; n < m.N; ++n) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint16_t* w = m.plain + n * K;
    for (int64_t k = 0; k < K; k += 128) {
      if (kAheadPlain)
        for (int j = 0; j < 4; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + k) + kAheadPlain + 64 * j, _MM_HINT_T0);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * j);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, (__m512bh)_mm512_loadu_si512(x + r * K + k + 32 * j));
      }
    }
    store_sums<R>(acc, y, m.N, n);
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void packed_rows(const Matrix& m, const uint16_t* x, float* y) {
  const int64_t K = m.K;
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  const __m512i offsets = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7));
  const __m512i signs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, -128, -128, -128, -128, -128,
                                                              -128, -128, -128));
#pragma omp for schedule(static)
  for (int64_t n = 0; n < m.N; ++n) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint8_t* record = m.records + n * (K / 128) * 192;
    const uint8_t* base = m.bases + n * (K / 64);
    const uint8_t* raw = m.raw.data() + m.raw_at[n];
    for (int64_t k = 0; k < K; k += 128, record += 192, base += 2) {
      if (kAhead) for (int j = 0; j < 3; ++j) _mm_prefetch(reinterpret_cast<const char*>(record + kAhead + 64 * j), _MM_HINT_T0);
      const __m512i codes = _mm512_loadu_si512(record + 128);
      const __m512i lo = _mm512_and_si512(codes, nibbles), hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibbles);
      __m512i high[2];
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
        if (__builtin_expect(base[g] & 0x80, 0)) {
          high[g] = _mm512_loadu_si512(raw);
          raw += 64;
        } else {
          const __m512i c = g == 0 ? _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0))
                                   : _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
          const __m512i table = _mm512_or_si512(_mm512_sub_epi8(_mm512_set1_epi8(static_cast<char>(base[g])), offsets), signs);
          high[g] = _mm512_shuffle_epi8(table, c);
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i low = _mm512_loadu_si512(record + 64 * (j / 2));
        const __m512bh wv = (__m512bh)(j % 2 ? _mm512_unpackhi_epi8(low, high[j / 2]) : _mm512_unpacklo_epi8(low, high[j / 2]));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv, (__m512bh)_mm512_loadu_si512(x + r * K + k + 32 * j));
      }
    }
    store_sums<R>(acc, y, m.N, n);
  }
}

template <int R>
double step(std::vector<Matrix>& ms, const std::vector<uint16_t>& x, std::vector<std::vector<float>>& ys, bool packed) {
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
  for (size_t i = 0; i < ms.size(); ++i) {  // the `omp for`'s barrier ends each matrix, as a step's linears
    if (packed) packed_rows<R>(ms[i], x.data(), ys[i].data());
    else plain_rows<R>(ms[i], x.data(), ys[i].data());
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <int R>
void run(std::vector<Matrix>& ms, int rounds, double plain_gb, double packed_gb) {
  const int64_t kmax = 8192;
  std::vector<uint16_t> x(R * kmax);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto& v : x) v = to_bf16(normal(rng));
  std::vector<std::vector<float>> plain_y, packed_y;
  for (auto& m : ms) {
    plain_y.emplace_back(R * m.N);
    packed_y.emplace_back(R * m.N);
  }
  std::vector<double> ratios;
  for (int round = 0; round < rounds; ++round) {
    double t_plain, t_packed;
    if (round % 2 == 0) {
      t_plain = step<R>(ms, x, plain_y, false);
      t_packed = step<R>(ms, x, packed_y, true);
    } else {
      t_packed = step<R>(ms, x, packed_y, true);
      t_plain = step<R>(ms, x, plain_y, false);
    }
    ratios.push_back(t_packed / t_plain);
    std::printf("  round %d: plain %.1f ms (%.1f GB/s), packed %.1f ms (%.1f GB/s of its bytes); packed / plain %.3f\n",
                round + 1, t_plain * 1e3, plain_gb / t_plain, t_packed * 1e3, packed_gb / t_packed, t_packed / t_plain);
  }
  int64_t differing = 0, outputs = 0;
  for (size_t i = 0; i < ms.size(); ++i) {
    outputs += static_cast<int64_t>(plain_y[i].size());
    for (size_t j = 0; j < plain_y[i].size(); ++j) differing += std::memcmp(&plain_y[i][j], &packed_y[i][j], 4) != 0;
  }
  std::sort(ratios.begin(), ratios.end());
  std::printf("%d row(s) of x: median packed / plain %.3f (range %.3f-%.3f); outputs differing bit for bit: %lld of %lld\n", R,
              ratios[ratios.size() / 2], ratios.front(), ratios.back(), static_cast<long long>(differing),
              static_cast<long long>(outputs));
}

}  // namespace

int main(int argc, char** argv) {
  const int rows_of_x = argc > 1 ? std::atoi(argv[1]) : 1;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 6;
  const std::string distribution = argc > 3 ? argv[3] : "normal";
  kAhead = argc > 4 ? std::atol(argv[4]) : 0;
  kAheadPlain = argc > 5 ? std::atol(argv[5]) : 0;
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw")) {
    std::printf("this CPU has no AVX512_BF16: nothing to measure\n");
    return 0;
  }
  // The 1B shape's matrices, [N, K], layer after layer, then the head.
  std::vector<std::pair<int64_t, int64_t>> shapes;
  if (std::getenv("IN_CACHE")) {
    shapes.push_back({2048, 2048});
  } else {
    for (int layer = 0; layer < 16; ++layer)
      for (auto s : {std::pair<int64_t, int64_t>{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}}) shapes.push_back(s);
    shapes.push_back({49152, 2048});
  }
  // Weights drawn once into a pool of 2^22 values and spread over the matrices by a hash: drawing
  // 1.24 B values one by one takes minutes, and the stream's speed does not depend on which values.
  std::mt19937 rng(1);
  std::vector<uint16_t> pool(1 << 22);
  std::normal_distribution<float> normal(0.f, 0.02f);
  std::exponential_distribution<float> exponential(1.f / 0.014f);
  std::student_t_distribution<float> t3(3.f);
  for (auto& v : pool) {
    float f = normal(rng);
    if (distribution == "laplace") f = (rng() & 1 ? 1.f : -1.f) * exponential(rng);
    else if (distribution == "t3") f = 0.0115f * t3(rng);
    else if (distribution != "normal") { std::printf("DISTRIBUTION must be normal, laplace or t3\n"); return 1; }
    v = to_bf16(f);
  }
  std::vector<Matrix> ms;
  double plain_bytes = 0, packed_bytes = 0;
  int64_t groups = 0, raw_groups = 0;
  uint64_t h = 0x9E3779B97F4A7C15ull;
  for (auto [N, K] : shapes) {
    Matrix m{N, K, huge_alloc<uint16_t>(N * K), huge_alloc<uint8_t>(N * K / 128 * 192), huge_alloc<uint8_t>(N * K / 64),
             {}, {}};
    for (int64_t i = 0; i < N * K; ++i) {
      h ^= h >> 29;
      h *= 0xBF58476D1CE4E5B9ull;
      m.plain[i] = pool[(h >> 40) & (pool.size() - 1)];
    }
    raw_groups += pack(m);
    groups += N * K / 64;
    plain_bytes += 2.0 * N * K;
    packed_bytes += N * K / 128 * 192 + N * K / 64 + static_cast<double>(m.raw.size());
    ms.push_back(std::move(m));
  }
  // IN_CACHE: the one 8 MB matrix 64 times over (from L2/L3): the unpacking's own rate.
  if (std::getenv("IN_CACHE"))
    for (int i = 0; i < 63; ++i) ms.push_back(ms[0]);
  std::printf("bfloat16 weights in 12 bits, losslessly: %s weights, %d thread(s), %d row(s) of x\n", distribution.c_str(),
              omp_get_max_threads(), rows_of_x);
  std::printf("a token reads %.2f GB as bfloat16, %.2f GB packed (%.3fx: %.2f bits a weight); raw groups %.3f%%\n",
              plain_bytes / 1e9, packed_bytes / 1e9, packed_bytes / plain_bytes, 16.0 * packed_bytes / plain_bytes,
              100.0 * raw_groups / groups);
  switch (rows_of_x) {
    case 1: run<1>(ms, rounds, plain_bytes / 1e9, packed_bytes / 1e9); break;
    case 2: run<2>(ms, rounds, plain_bytes / 1e9, packed_bytes / 1e9); break;
    case 4: run<4>(ms, rounds, plain_bytes / 1e9, packed_bytes / 1e9); break;
    case 8: run<kMaxRows>(ms, rounds, plain_bytes / 1e9, packed_bytes / 1e9); break;
    default: std::printf("ROWS_OF_X must be 1, 2, 4 or 8\n"); return 1;
  }
  return 0;
}
