// Q4_K, Q5_K and IQ4_XS rows interleaved 8 to a group at load ("q4_k_r8", "q5_k_r8", "iq4_xs_r8"),
// and the row kernels over them, for the decode steps' few rows of x (kquant_linear.cpp's
// SharedLinear runs them as it runs the other formats' rows); the repack and unpack ops serve Q6_K's
// groups too ("q6_k_r8", whose row kernel is in kquant_q6k.cpp). The layout of a group's super-block is in
// kquant.h (kR8*, kQ6R8*); the idea is ik_llama.cpp's q4_k_r8, the layout and the kernels are
// genfn's own.
//
// Why: the row kernels of the file's layout spend a vpmaddubsw + vpmaddwd pair and a scale
// shuffle per 64 weight bytes of one row, and at one row of x they compute only ~1.5x the bytes
// a core can read (a standalone harness measured it when this layout was built, 33f8384;
// benchmarks/kquant_kernels.py --stream measures the library's kernels now). Here a qword
// broadcast of 8 activation codes meets 16 lanes, two per weight row, of a 64-byte load, so one
// vpdpbusd does the work of that pair for 8 rows at once, and the scales of 8 rows unpack in one
// pass of 256-bit logic.
//
// The integers are the row kernels': per group of 32 inputs each lane's dot of 16 inputs (at
// most 16 x 15 x 127, an int16; of 8 inputs for Q5_K's codes, which the fifth bit, added as 16,
// takes up to 31) is scaled by vpdpwssd against the group's scale in the low word,
// the two lanes of a row added once per super-block, so a row's super-block sum is the same
// exact integer as in the file's layout; minimums likewise, against the activations' code sums
// per 32. The floats are every K-quant kernel's (add_block in kquant.h: one float32 accumulator
// per row, the super-block's sum times d * d_x added, its minimums' times dmin * d_x taken off,
// super-block after super-block), so the row kernels and the GEMM give a row these bits. The AVX2
// form computes the same integers and the same floats.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "kquant.h"
#include "kquant_rows.h"

namespace genfn::kquant {
namespace {

// Shuffles: byte g % 4 of each dword's scales into its low word (AVX-512: low byte only; AVX2:
// both int16 halves, for vpmaddwd against int16 pairs), and dword r of 8 into lanes 2r, 2r + 1.
struct R8Index {
  alignas(64) uint8_t scale_word[4][64];
  alignas(64) uint8_t scale_pair[4][32];
  alignas(64) uint32_t dup[16];
  constexpr R8Index() : scale_word(), scale_pair(), dup() {
    for (int g = 0; g < 4; ++g) {
      for (int k = 0; k < 64; ++k) scale_word[g][k] = k % 4 ? 0x80 : static_cast<uint8_t>(k % 16 + g);
      for (int k = 0; k < 32; ++k) scale_pair[g][k] = k % 2 ? 0x80 : static_cast<uint8_t>(k % 16 / 4 * 4 + g);
    }
    for (int l = 0; l < 16; ++l) dup[l] = static_cast<uint32_t>(l / 2);
  }
};
constexpr R8Index kR8Index;

// A group's super-block header: d and dmin of its 8 rows, and their 6-bit scales and minimums
// (kR8Scales: 3 runs of 8 dwords): dword r of sc[0] holds scales 0-3 of row r, of sc[1] scales
// 4-7; mn the minimums alike.
struct Header {
  __m256 d, dmin;
  __m256i sc[2], mn[2];
};
GENFN_AVX2_INLINE inline Header load_header(const uint8_t* w) {
  Header h;
  h.d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kR8D)));
  h.dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kR8DMin)));
  const uint8_t* p = w + kR8Scales;
  const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  const __m256i u2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64));
  const __m256i m3f = _mm256_set1_epi8(0x3F), m0f = _mm256_set1_epi8(0x0F), m03 = _mm256_set1_epi8(0x03);
  h.sc[0] = _mm256_and_si256(u0, m3f);
  h.mn[0] = _mm256_and_si256(u1, m3f);
  h.sc[1] = _mm256_or_si256(_mm256_and_si256(u2, m0f), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m03), 4));
  h.mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m0f),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m03), 4));
  return h;
}

// The activation row's code sums of a super-block's 8 groups of 32 (int16, ActivationsK::sums32),
// in the two 64-bit halves the minimums take them: low groups 0-3, high groups 4-7.
GENFN_AVX2_INLINE inline void group_sums(const int16_t* sums32, int64_t& low, int64_t& high) {
  std::memcpy(&low, sums32, 8);
  std::memcpy(&high, sums32 + 4, 8);
}

// A row's super-block sums (the two lanes of a row added) and minimum sums into its float32
// accumulator, rows 0-7 in order (kquant.h's add_block, a lane a weight row).
GENFN_AVX2_INLINE inline __m256 accumulate(__m256 acc, __m256i sum8, __m256i min8, __m256 d, __m256 dmin, float dx) {
  const __m256 scale = _mm256_set1_ps(dx);
  return add_block(acc, sum8, min8, _mm256_mul_ps(d, scale), _mm256_mul_ps(dmin, scale));
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI

GENFN_VNNI_INLINE inline __m512i pair_total(__m512i v) {  // lanes 2r and 2r + 1 both their sum
  return _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));
}

// One group of 8 weight rows (format F: q4_k_r8 or q5_k_r8) against rows m0 .. m0 + M - 1 of x:
// writes y[m * N + r], r < 8.
template <int M, int64_t F>
GENFN_VNNI void rows_r8_avx512(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t K = a.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i dup = _mm512_load_si512(kR8Index.dup);
  // Spread over the group's super-blocks (StreamFetch): fetched all at once before the group
  // (as the row kernels once did) the group's 144-576 lines cost 1.00-1.13x the time; spread,
  // 0.86-1.02x (1B shapes, 2 threads, out of cache).
  StreamFetch<M> fetch(w);
  constexpr int64_t group_bytes = group_block_bytes(F);
  for (int64_t b = 0; b < nb; ++b, w += group_bytes) {
    fetch.through(w + group_bytes);
    const Header hd = load_header(w);
    const __m256i* sc = hd.sc;
    const __m256i* mn = hd.mn;
    __m512i high[4];  // q5_k_r8: the fifth bits, run k as codes run k reads them
    if constexpr (F == kQ5KR8)
      for (int k = 0; k < 4; ++k) high[k] = _mm512_loadu_si512(w + kR8High + 64 * k);
    const __m512i scales[2] = {_mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(sc[0])),
                               _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(sc[1]))};
    // dword 2r: minimums (4h, 4h + 1) of row r as int16, 2r + 1: (4h + 2, 4h + 3)
    const __m512i mins[2] = {_mm512_cvtepu8_epi16(mn[0]), _mm512_cvtepu8_epi16(mn[1])};
    __m512i isum[M], imin[M];
    for (int m = 0; m < M; ++m) {
      int64_t low, high;
      group_sums(a.sums32.data() + (m0 + m) * (K / 32) + b * 8, low, high);
      imin[m] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins[0], _mm512_set1_epi64(low));
      imin[m] = _mm512_dpwssd_epi32(imin[m], mins[1], _mm512_set1_epi64(high));
      isum[m] = _mm512_setzero_si512();
    }
    const uint8_t* qs = w + kR8Codes;
    for (int j = 0; j < 4; ++j) {  // groups 2j (low nibbles) and 2j + 1 (high)
      const __m512i sc_low = _mm512_shuffle_epi8(scales[j / 2], _mm512_load_si512(kR8Index.scale_word[2 * j % 4]));
      const __m512i sc_high = _mm512_shuffle_epi8(scales[j / 2], _mm512_load_si512(kR8Index.scale_word[(2 * j + 1) % 4]));
      __m512i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        const __m512i packed = _mm512_loadu_si512(qs + 256 * j + 64 * k);
        lo[k] = _mm512_and_si512(packed, low4);
        hi[k] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
        if constexpr (F == kQ5KR8) {  // + 16 where the fifth bit of the code is set
          const __m512i sixteen = _mm512_set1_epi8(16);
          lo[k] = _mm512_mask_add_epi8(lo[k], _mm512_test_epi8_mask(high[k], _mm512_set1_epi8(1 << (2 * j))), lo[k], sixteen);
          hi[k] = _mm512_mask_add_epi8(hi[k], _mm512_test_epi8_mask(high[k], _mm512_set1_epi8(static_cast<char>(2 << (2 * j)))),
                                       hi[k], sixteen);
        }
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper + 64 * j;
        // A lane's dot of 16 inputs: at most 16 x 15 x 127 for Q4_K's codes, an int16 for vpdpwssd's
        // low word; Q5_K's (up to 31) fit for 8 inputs, so its lanes take the scale twice a group.
        constexpr int kPerScale = F == kQ5KR8 ? 2 : 4;
        for (int k0 = 0; k0 < 4; k0 += kPerScale) {
          __m512i dot_low = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[k0], _mm512_set1_epi64(load_i64(x + 8 * k0)));
          __m512i dot_high =
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[k0], _mm512_set1_epi64(load_i64(x + 32 + 8 * k0)));
          for (int k = k0 + 1; k < k0 + kPerScale; ++k) {
            dot_low = _mm512_dpbusd_epi32(dot_low, lo[k], _mm512_set1_epi64(load_i64(x + 8 * k)));
            dot_high = _mm512_dpbusd_epi32(dot_high, hi[k], _mm512_set1_epi64(load_i64(x + 32 + 8 * k)));
          }
          isum[m] = _mm512_dpwssd_epi32(isum[m], dot_low, sc_low);
          isum[m] = _mm512_dpwssd_epi32(isum[m], dot_high, sc_high);
        }
      }
    }
    for (int m = 0; m < M; ++m)
      acc[m] = accumulate(acc[m], _mm512_cvtepi64_epi32(pair_total(isum[m])), _mm512_cvtepi64_epi32(pair_total(imin[m])),
                          hd.d, hd.dmin, a.scale[(m0 + m) * nb + b]);
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * N, acc[m]);
}

// iq4_xs_r8 (kquant.h's kX8 layout) against rows m0 .. m0 + M - 1 of x: writes y[m * N + r], r < 8.
// The table's values plus 128 are the unsigned side of vpdpbusd, the codes the signed one, and each
// lane starts from -128 times the codes it meets (offsets8 in natural order: q6_k_r8's starts, -32
// times the same quads, taken four times over a sub-block's two 16-input groups), so it holds
// sum w x over its 16 inputs of the sub-block (at most 16 x 127 x 127: past an int16, so vpmulld
// applies the sub-block's scale). A row's two lanes then add to the super-block's exact integer,
// the file layout's, added as add_block adds it: the same bits as IQ4_XS's row kernels and GEMM.
// In a microbenchmark (benchmarks/iq4xs_r8_patterns.cpp, one thread, in L3) this reads about twice
// the file layout's bytes a second.
template <int M>
GENFN_VNNI void rows_iq4xs_r8(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t K = a.K;
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4ValuesPlus128)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i dup = _mm512_load_si512(kR8Index.dup);
  StreamFetch<M> fetch(w);
  constexpr int64_t group_bytes = group_block_bytes(kIQ4XSR8);
  for (int64_t b = 0; b < nb; ++b, w += group_bytes) {
    fetch.through(w + group_bytes);
    // Each row's scale fields in its two lanes.
    const __m512i low_nibbles = _mm512_permutexvar_epi32(
        dup, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kX8ScalesLow))));
    const __m512i high_pairs = _mm512_permutexvar_epi32(
        dup, _mm512_castsi256_si512(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kX8ScalesHigh)))));
    __m512i sum[M];
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      const __m512i low = _mm512_and_si512(_mm512_srli_epi32(low_nibbles, 4 * s), _mm512_set1_epi32(0x0F));
      const __m512i high = _mm512_and_si512(_mm512_srli_epi32(high_pairs, 2 * s), _mm512_set1_epi32(0x03));
      const __m512i scale = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
      __m512i values[4];  // runs 0 and 1, low then high nibbles
      for (int t = 0; t < 2; ++t) {
        const __m512i q = _mm512_loadu_si512(w + kX8Codes + 128 * s + 64 * t);
        values[2 * t] = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low4));
        values[2 * t + 1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper + 32 * s;
        // offsets8 [e, o, e', o'] of the sub-block's two 16-input groups: the lanes start at 4 (e + e'), 4 (o + o').
        const __m128i quads = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.offsets8.data() + (m0 + m) * (K / 8) +
                                                                               b * (kSuper / 8) + 4 * s));
        __m512i dot = _mm512_broadcastq_epi64(_mm_slli_epi32(_mm_add_epi32(quads, _mm_unpackhi_epi64(quads, quads)), 2));
        for (int j = 0; j < 4; ++j) {
          int64_t codes;
          std::memcpy(&codes, x + 8 * j, 8);
          dot = _mm512_dpbusd_epi32(dot, values[j], _mm512_set1_epi64(codes));
        }
        sum[m] = _mm512_add_epi32(sum[m], _mm512_mullo_epi32(dot, scale));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kX8D)));
    for (int m = 0; m < M; ++m)
      acc[m] = add_block(acc[m], _mm512_cvtepi64_epi32(pair_total(sum[m])),
                         _mm256_mul_ps(d, _mm256_set1_ps(a.scale[(m0 + m) * nb + b])));
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * N, acc[m]);
}

// ---------------------------------------------------------------------------------------------
// AVX2: each 64-byte run as two halves (rows 0-3, rows 4-7), vpmaddubsw then vpmaddwd against the
// group's scale in both int16 halves (the products of 16 inputs times the scale: the same integers)

GENFN_AVX2_INLINE inline __m256i even_lanes(__m256i rows03, __m256i rows47) {  // lane 2r of each -> row r
  const __m256i t0 = _mm256_add_epi32(rows03, _mm256_shuffle_epi32(rows03, 0xB1));
  const __m256i t1 = _mm256_add_epi32(rows47, _mm256_shuffle_epi32(rows47, 0xB1));
  const __m256 mixed = _mm256_shuffle_ps(_mm256_castsi256_ps(t0), _mm256_castsi256_ps(t1), 0x88);  // 0 1 4 5 | 2 3 6 7
  return _mm256_permute4x64_epi64(_mm256_castps_si256(mixed), 0xD8);
}

template <int M, int64_t F>
GENFN_AVX2 void rows_r8_avx2(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t K = a.K;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i dup_low = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), dup_high = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  StreamFetch<M> fetch(w);
  constexpr int64_t group_bytes = group_block_bytes(F);
  for (int64_t b = 0; b < nb; ++b, w += group_bytes) {
    fetch.through(w + group_bytes);
    const Header hd = load_header(w);
    const __m256i* sc = hd.sc;
    const __m256i* mn = hd.mn;
    // [s][h]: scales s (0-3 or 4-7) of rows 4h .. 4h + 3, two lanes a row
    const __m256i scales[2][2] = {{_mm256_permutevar8x32_epi32(sc[0], dup_low), _mm256_permutevar8x32_epi32(sc[0], dup_high)},
                                  {_mm256_permutevar8x32_epi32(sc[1], dup_low), _mm256_permutevar8x32_epi32(sc[1], dup_high)}};
    const __m256i mins[2][2] = {{_mm256_cvtepu8_epi16(_mm256_castsi256_si128(mn[0])), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mn[0], 1))},
                                {_mm256_cvtepu8_epi16(_mm256_castsi256_si128(mn[1])), _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mn[1], 1))}};
    __m256i isum[M][2], imin[M][2];
    for (int m = 0; m < M; ++m) {
      int64_t low, high;
      group_sums(a.sums32.data() + (m0 + m) * (K / 32) + b * 8, low, high);
      const __m256i bl = _mm256_set1_epi64x(low), bh = _mm256_set1_epi64x(high);
      for (int h = 0; h < 2; ++h) {
        imin[m][h] = _mm256_add_epi32(_mm256_madd_epi16(mins[0][h], bl), _mm256_madd_epi16(mins[1][h], bh));
        isum[m][h] = _mm256_setzero_si256();
      }
    }
    const uint8_t* qs = w + kR8Codes;
    for (int j = 0; j < 4; ++j) {
      for (int h = 0; h < 2; ++h) {
        const __m256i sc_low = _mm256_shuffle_epi8(scales[j / 2][h], _mm256_load_si256(reinterpret_cast<const __m256i*>(kR8Index.scale_pair[2 * j % 4])));
        const __m256i sc_high = _mm256_shuffle_epi8(scales[j / 2][h], _mm256_load_si256(reinterpret_cast<const __m256i*>(kR8Index.scale_pair[(2 * j + 1) % 4])));
        __m256i lo[4], hi[4];
        for (int k = 0; k < 4; ++k) {
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 256 * j + 64 * k + 32 * h));
          lo[k] = _mm256_and_si256(packed, low4);
          hi[k] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
          if constexpr (F == kQ5KR8) {  // bits 2j and 2j + 1 of the run's byte, moved to bit 4
            const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kR8High + 64 * k + 32 * h));
            const __m256i one = _mm256_set1_epi8(1);
            lo[k] = _mm256_or_si256(lo[k], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j), one), 4));
            hi[k] = _mm256_or_si256(hi[k], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * j + 1), one), 4));
          }
        }
        for (int m = 0; m < M; ++m) {
          const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper + 64 * j;
          __m256i sum = isum[m][h];
          for (int k = 0; k < 4; ++k) {
            // 2 x 31 x 127 per int16 at most: no saturation
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(lo[k], _mm256_set1_epi64x(load_i64(x + 8 * k))), sc_low));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(hi[k], _mm256_set1_epi64x(load_i64(x + 32 + 8 * k))), sc_high));
          }
          isum[m][h] = sum;
        }
      }
    }
    for (int m = 0; m < M; ++m)
      acc[m] = accumulate(acc[m], even_lanes(isum[m][0], isum[m][1]), even_lanes(imin[m][0], imin[m][1]), hd.d,
                          hd.dmin, a.scale[(m0 + m) * nb + b]);
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * N, acc[m]);
}

// Rows [r0, r1) of src (or the rows `order` names) written as 8-row groups of format F at out.
template <int64_t F>
void repack_rows(const uint8_t* src, const int64_t* order, int64_t r0, int64_t r1, int64_t nb, uint8_t* out) {
  constexpr int64_t block = block_bytes(F);
  const int64_t row_bytes = nb * block;
  for (int64_t g = r0 / 8; g < r1 / 8; ++g)
    for (int r = 0; r < 8; ++r) {
      const int64_t n = 8 * g + r;
      const uint8_t* row = src + (order ? order[n] : n) * row_bytes;
      for (int64_t b = 0; b < nb; ++b) r8_store<F>(row + b * block, r, out + 8 * g * row_bytes + b * group_block_bytes(F));
    }
}

int64_t check_interleaved_format(int64_t format, const char* op) {
  TORCH_CHECK(interleaved(format), op, ": format must be 5 (q4_k_r8), 6 (q5_k_r8), 7 (q6_k_r8) or 8 (iq4_xs_r8), got ",
              format);
  return block_bytes(format);
}

// out [N, row bytes] = the Q4_K (format 5), Q5_K (6), Q6_K (7) or IQ4_XS (8) rows of src [rows, row bytes] (its rows
// `rows` in order, or all of them) in 8-row groups, shared out over torch's threads.
void kquant_repack_r8(const at::Tensor& src, const c10::optional<at::Tensor>& rows, at::Tensor& out, int64_t format) {
  const int64_t block = check_interleaved_format(format, "kquant_repack_r8");
  TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kByte && src.is_contiguous() && src.size(1) % block == 0,
              "kquant_repack_r8: src must be contiguous uint8 [rows, super-blocks * ", block, "]");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kByte && out.is_contiguous() && out.size(1) == src.size(1),
              "kquant_repack_r8: out must be contiguous uint8 with src's row bytes");
  const int64_t N = out.size(0), nb = src.size(1) / block;
  TORCH_CHECK(N % 8 == 0, "kquant_repack_r8: out's rows must be a multiple of 8, got ", N);
  const int64_t* order = nullptr;
  at::Tensor index;
  if (rows.has_value()) {
    index = rows->to(at::kLong).contiguous();
    TORCH_CHECK(index.dim() == 1 && index.size(0) == N, "kquant_repack_r8: rows must be int64 [", N, "]");
    order = index.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; ++n)
      TORCH_CHECK(order[n] >= 0 && order[n] < src.size(0), "kquant_repack_r8: row index ", order[n], " out of range");
  } else {
    TORCH_CHECK(src.size(0) == N, "kquant_repack_r8: src has ", src.size(0), " rows, out ", N);
  }
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 8, 16, [&](int64_t g0, int64_t g1) {
    if (format == kQ4KR8) repack_rows<kQ4KR8>(s, order, 8 * g0, 8 * g1, nb, o);
    else if (format == kQ5KR8) repack_rows<kQ5KR8>(s, order, 8 * g0, 8 * g1, nb, o);
    else if (format == kQ6KR8) repack_rows<kQ6KR8>(s, order, 8 * g0, 8 * g1, nb, o);
    else repack_rows<kIQ4XSR8>(s, order, 8 * g0, 8 * g1, nb, o);
  });
}

template <int64_t F>
void unpack_rows(const uint8_t* src, int64_t n0, int64_t n1, int64_t nb, uint8_t* out) {
  const int64_t row_bytes = nb * block_bytes(F);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b)
      r8_load<F>(src + n / 8 * 8 * row_bytes + b * group_block_bytes(F), n % 8, out + n * row_bytes + b * block_bytes(F));
}

// The inverse: out [N, row bytes] the file's rows of the groups in src.
void kquant_unpack_r8(const at::Tensor& src, at::Tensor& out, int64_t format) {
  const int64_t block = check_interleaved_format(format, "kquant_unpack_r8");
  TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kByte && src.is_contiguous() && src.size(1) % block == 0 &&
                  src.size(0) % 8 == 0,
              "kquant_unpack_r8: src must be contiguous uint8 [8 n, super-blocks * ", block, "]");
  TORCH_CHECK(out.sizes() == src.sizes() && out.scalar_type() == at::kByte && out.is_contiguous(),
              "kquant_unpack_r8: out must be contiguous uint8 of src's shape");
  const int64_t nb = src.size(1) / block;
  const uint8_t* s = src.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, src.size(0), 64, [&](int64_t n0, int64_t n1) {
    if (format == kQ4KR8) unpack_rows<kQ4KR8>(s, n0, n1, nb, o);
    else if (format == kQ5KR8) unpack_rows<kQ5KR8>(s, n0, n1, nb, o);
    else if (format == kQ6KR8) unpack_rows<kQ6KR8>(s, n0, n1, nb, o);
    else unpack_rows<kIQ4XSR8>(s, n0, n1, nb, o);
  });
}

}  // namespace

RowFn pick_r8(Isa isa, int64_t format, int rows) {
  const bool vnni = isa == kAvx512 && has_vnni();
  if (format == kQ6KR8) {  // VNNI only: kquant_linear.cpp's pick takes it a row at a time elsewhere
    TORCH_CHECK(vnni, "q6_k_r8's group kernel needs AVX-512 VNNI");
    return pick_q6k_r8_vnni(rows);
  }
  if (format == kIQ4XSR8) {  // likewise
    TORCH_CHECK(vnni, "iq4_xs_r8's group kernel needs AVX-512 VNNI");
    GENFN_ROW_CASES(rows, rows_iq4xs_r8)
  }
  if (format == kQ5KR8) {
    if (vnni) { GENFN_ROW_CASES(rows, rows_r8_avx512, kQ5KR8) }
    GENFN_ROW_CASES(rows, rows_r8_avx2, kQ5KR8)
  }
  if (vnni) { GENFN_ROW_CASES(rows, rows_r8_avx512, kQ4KR8) }
  GENFN_ROW_CASES(rows, rows_r8_avx2, kQ4KR8)
}

}  // namespace genfn::kquant

TORCH_LIBRARY_FRAGMENT(genfn_kquant, m) {
  m.def("kquant_repack_r8(Tensor src, Tensor? rows, Tensor(a!) out, int format=5) -> ()", &genfn::kquant::kquant_repack_r8);
  m.def("kquant_unpack_r8(Tensor src, Tensor(a!) out, int format=5) -> ()", &genfn::kquant::kquant_unpack_r8);
}
