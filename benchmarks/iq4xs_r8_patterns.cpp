// What IQ4_XS rows interleaved 8 to a group would cost a decode step at one row of x, measured apart
// from the library before the format is built (docs/measurements/scale-sessions.md, *Session 43*).
//
// The layout tried (one group super-block, 8 rows x 256 inputs, 1104 bytes, 8 x 136 + 16):
//   0     the 8 rows' d (float16)
//   16    the 8 x 8 sub-block scales decoded to int8 (ls - 32), sub-block s of row r at 8 s + r
//   80    per sub-block s, two 64-byte runs t: the 8 rows' 8 bytes each, byte j of row r holding the
//         indices of inputs 32 s + 16 t + j (low nibble) and 32 s + 16 t + 8 + j (high nibble)
// so a qword broadcast of 8 consecutive activation codes meets 16 lanes, two a row, as q4_k_r8's
// runs do. The table's values plus 128 are the unsigned side of vpdpbusd and the codes the signed
// one; each lane starts from -128 times the codes it meets (inputs 0-3, 8-11, 16-19, 24-27 of the
// sub-block for lane 2r, 4-7, 12-15, 20-23, 28-31 for 2r + 1), which a quantization would keep per
// sub-block beside the codes. vpmulld applies the sub-block's scale; a row's two lanes add to the
// super-block's exact integer, which is what the file-layout kernels add (kquant.h's add_block), so
// the layout could keep their bits. Two ways to store the sub-block scales are timed:
//   decoded  int8 (ls - 32), sub-block s of row r at 16 + 8 s + r: 16 bytes a group super-block more
//            than the file's 8 x 136 (1.5 %), codes at 80
//   packed   the file's 6 bits, 8 x 136 bytes as the file and the other interleaved formats keep
//            (the repack op's rows keep their bytes): the rows' 4 bytes of low nibbles as dword r at
//            16, their 16-bit words of high bit pairs as word r at 48, codes at 64; unpacked in the
//            kernel, once a group super-block for every row of x
//
// Prints GB/s at one row of x, one thread: the whole matrix in L3 (8192 x 2048, the 1B shape's
// gate/up half), and copies of it past the caches; checks the integers against a scalar reference.
// Compare with the library's file-layout kernel in the same minute:
//   python benchmarks/kquant_kernels.py --threads 1 --rows 1
//
//   g++ -O2 -march=native -std=c++17 benchmarks/iq4xs_r8_patterns.cpp -o /tmp/iq4xs_r8 && /tmp/iq4xs_r8
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace {

constexpr int kSuper = 256, kRows = 8, kScales = 16;

// Where a layout puts a group super-block's fields.
struct Layout {
  bool packed;
  int group_bytes, codes;
};
constexpr Layout kDecoded{false, 1104, 80}, kPacked{true, 1088, 64};
// llama.cpp's kvalues_iq4nl, plus 128.
alignas(16) constexpr uint8_t kValuesPlus128[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

struct Matrix {
  Layout layout;
  int64_t n, k;
  std::vector<uint8_t> groups;  // n / 8 groups, k / 256 super-blocks each
  std::vector<uint8_t> index;   // [n, k] the 4-bit indices, for the reference
  std::vector<int8_t> scale;    // [n, k / 32] ls - 32
};

Matrix random_matrix(Layout layout, int64_t n, int64_t k, std::mt19937& rng) {
  Matrix m{layout, n, k, std::vector<uint8_t>(n / kRows * (k / kSuper) * layout.group_bytes),
           std::vector<uint8_t>(n * k), std::vector<int8_t>(n * (k / 32))};
  for (auto& v : m.index) v = static_cast<uint8_t>(rng() % 16);
  for (auto& s : m.scale) s = static_cast<int8_t>(static_cast<int>(rng() % 64) - 32);
  const int64_t nb = k / kSuper;
  for (int64_t g = 0; g < n / kRows; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = m.groups.data() + (g * nb + b) * layout.group_bytes;
      for (int r = 0; r < kRows; ++r) {
        const uint16_t one = 0x3C00;  // d = 1.0
        std::memcpy(blk + 2 * r, &one, 2);
        const int64_t row = g * kRows + r;
        uint16_t high = 0;
        for (int s = 0; s < 8; ++s) {
          const int8_t scale = m.scale[row * (k / 32) + b * 8 + s];
          if (layout.packed) {
            const int ls = scale + 32;
            blk[kScales + 4 * r + s / 2] |= static_cast<uint8_t>((ls & 0x0F) << (4 * (s % 2)));
            high |= static_cast<uint16_t>((ls >> 4) << (2 * s));
          } else {
            blk[kScales + 8 * s + r] = static_cast<uint8_t>(scale);
          }
          for (int t = 0; t < 2; ++t)
            for (int j = 0; j < 8; ++j) {
              const int64_t in = b * kSuper + 32 * s + 16 * t + j;
              blk[layout.codes + 128 * s + 64 * t + 8 * r + j] =
                  static_cast<uint8_t>(m.index[row * k + in] | (m.index[row * k + in + 8] << 4));
            }
        }
        if (layout.packed) std::memcpy(blk + kScales + 32 + 2 * r, &high, 2);
      }
    }
  return m;
}

// Per sub-block of x, the two lanes' starts (-128 times the codes each meets), as one int64.
std::vector<int64_t> lane_starts(const std::vector<int8_t>& x) {
  std::vector<int64_t> out(x.size() / 32);
  for (size_t s = 0; s < out.size(); ++s) {
    int32_t lane[2] = {0, 0};
    for (int i = 0; i < 32; ++i) lane[(i / 4) % 2] += x[32 * s + i];
    lane[0] *= -128;
    lane[1] *= -128;
    std::memcpy(&out[s], lane, 8);
  }
  return out;
}

// One group's 8 rows against one row of x: each super-block's exact integer into ints[b * 8 + r],
// and the float sums (d * d_x = 1 here) into y[r].
template <bool kPackedScales>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void group_row(
    const uint8_t* w, int64_t nb, const int8_t* x, const int64_t* starts, float* y, int32_t* ints) {
  constexpr Layout layout = kPackedScales ? kPacked : kDecoded;
  constexpr int kGroupBytes = layout.group_bytes, kCodes = layout.codes;
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kValuesPlus128)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += kGroupBytes, x += kSuper, starts += 8) {
    for (int line = 0; line < kGroupBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(w + 16384 + line), _MM_HINT_T1);
    __m512i sum = _mm512_setzero_si512();
    __m512i low_nibbles, high_pairs;  // packed: each row's scale words in its two lanes
    if constexpr (kPackedScales) {
      low_nibbles = _mm512_permutexvar_epi32(
          dup, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kScales))));
      high_pairs = _mm512_permutexvar_epi32(
          dup, _mm512_castsi256_si512(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kScales + 32)))));
    }
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      __m512i dot = _mm512_set1_epi64(starts[s]);
      for (int t = 0; t < 2; ++t) {
        const __m512i q = _mm512_loadu_si512(w + kCodes + 128 * s + 64 * t);
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low4));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
        int64_t x_lo, x_hi;
        std::memcpy(&x_lo, x + 32 * s + 16 * t, 8);
        std::memcpy(&x_hi, x + 32 * s + 16 * t + 8, 8);
        dot = _mm512_dpbusd_epi32(dot, lo, _mm512_set1_epi64(x_lo));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_set1_epi64(x_hi));
      }
      __m512i scale;
      if constexpr (kPackedScales) {
        const __m512i low = _mm512_and_si512(_mm512_srli_epi32(low_nibbles, 4 * s), _mm512_set1_epi32(0x0F));
        const __m512i high = _mm512_and_si512(_mm512_srli_epi32(high_pairs, 2 * s), _mm512_set1_epi32(0x03));
        scale = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
      } else {
        scale = _mm512_permutexvar_epi32(
            dup, _mm512_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + kScales + 8 * s))));
      }
      sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(dot, scale));
    }
    const __m512i pairs = _mm512_add_epi32(sum, _mm512_shuffle_epi32(sum, _MM_PERM_CDAB));
    const __m256i rows = _mm512_castsi512_si256(_mm512_permutexvar_epi32(evens, pairs));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(ints + 8 * b), rows);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), d, acc);
  }
  _mm256_storeu_ps(y, acc);
}

// Every group of a matrix against x, in its layout's kernel.
void run_matrix(const Matrix& m, const std::vector<int8_t>& x, const std::vector<int64_t>& starts, float* y,
                int32_t* ints) {
  const int64_t nb = m.k / kSuper, group = nb * m.layout.group_bytes;
  for (int64_t g = 0; g < m.n / kRows; ++g) {
    if (m.layout.packed) group_row<true>(m.groups.data() + g * group, nb, x.data(), starts.data(), y + 8 * g, ints);
    else group_row<false>(m.groups.data() + g * group, nb, x.data(), starts.data(), y + 8 * g, ints);
  }
}

double best_seconds(const std::vector<Matrix>& ms, const std::vector<int8_t>& x, const std::vector<int64_t>& starts,
                    std::vector<float>& y, std::vector<int32_t>& ints, int rounds) {
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const Matrix& m : ms) run_matrix(m, x, starts, y.data(), ints.data());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s < best) best = s;
  }
  return best;
}

}  // namespace

int main() {
  std::mt19937 rng(0);
  constexpr int64_t n = 8192, k = 2048, nb = k / kSuper;
  std::vector<int8_t> x(k);
  for (auto& v : x) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  const std::vector<int64_t> starts = lane_starts(x);
  std::vector<float> y(n);
  std::vector<int32_t> ints(8 * nb);
  float sink = 0;
  for (const Layout layout : {kDecoded, kPacked}) {
    const char* name = layout.packed ? "packed" : "decoded";
    std::vector<Matrix> copies;
    copies.push_back(random_matrix(layout, n, k, rng));
    // The integers against a scalar reference, every row's every super-block.
    const Matrix& m = copies[0];
    int64_t wrong = 0;
    for (int64_t g = 0; g < n / kRows; ++g) {
      const uint8_t* w = m.groups.data() + g * nb * layout.group_bytes;
      if (layout.packed) group_row<true>(w, nb, x.data(), starts.data(), y.data() + 8 * g, ints.data());
      else group_row<false>(w, nb, x.data(), starts.data(), y.data() + 8 * g, ints.data());
      for (int r = 0; r < kRows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t row = g * kRows + r;
          int64_t want = 0;
          for (int s = 0; s < 8; ++s) {
            int64_t dot = 0;
            for (int i = 0; i < 32; ++i) {
              const int64_t in = b * kSuper + 32 * s + i;
              dot += (static_cast<int>(kValuesPlus128[m.index[row * k + in]]) - 128) * x[in];
            }
            want += dot * m.scale[row * (k / 32) + b * 8 + s];
          }
          wrong += ints[8 * b + r] != want;
        }
    }
    std::printf("%s scales: integers against the scalar reference: %s\n", name, wrong ? "DIFFERENT" : "equal");
    const double bytes = static_cast<double>(n / kRows) * nb * layout.group_bytes;
    const double in_cache = best_seconds(copies, x, starts, y, ints, 200);
    std::printf("%s scales, one row of x, one thread, %lld x %lld (%.1f MB, in L3): %.1f GB/s\n", name,
                static_cast<long long>(n), static_cast<long long>(k), bytes / 1e6, bytes / in_cache / 1e9);
    while (copies.size() * bytes < 256e6) copies.push_back(random_matrix(layout, n, k, rng));
    const double out = best_seconds(copies, x, starts, y, ints, 7);
    std::printf("%s scales over %zu copies (%.0f MB, past the caches): %.1f GB/s\n", name, copies.size(),
                copies.size() * bytes / 1e6, copies.size() * bytes / out / 1e9);
    for (float v : y) sink += v;
  }
  std::printf("(sink %g)\n", sink);
}
