// Q6_K rows on AVX-512 VNNI, in the file's layout and interleaved 8 to a group (q6_k_r8)
// (kquant_linear.cpp runs Q6_K on AVX2 elsewhere, an AVX-512 CPU without VNNI included).
//
// A Q6_K super-block is 256 six-bit codes as 128 bytes of low nibbles (ql) and 64 of high bit pairs
// (qh), 16 int8 scales (one per 16 inputs) and d. Per 128 weights the codes cost 7 instructions: a
// bit select (vpternlogd) merges the nibbles with the high bits shifted into place, and an and
// clears bits 6-7; per 64 weights the dot product 2: vpdpbusd sums 4 code x activation products
// per dword (at most 4 x 63 x 127 = 32004, an int16 in the dword's low word), and vpdpwssd
// multiplies that low word by its group's scale (the high word's multiplier is 0). The 32 offset
// folds into the activations' code sums. These are the integers, in the same lanes, of the
// vpmaddubsw / vpmaddwd form this replaced (11 and 3 instructions), and the floats are the same
// operations in the same order: the same bits (benchmarks/kquant_linear_ab.py checks it against
// a revision before this kernel).
#include <ATen/ATen.h>

#include "kquant.h"
#include "kquant_rows.h"

namespace genfn::kquant {
namespace {

// The int16 lanes of a quarter's 16 dword sums (4 inputs each): the low word of dword i takes the
// scale of the quarter's group i / 4 (of 16 inputs; kRunWords), the high word 0 (a zeroing mask).
constexpr __mmask32 kLowWords = 0x55555555u;

GENFN_VNNI_INLINE inline __m512i quarter_scales(__m256i scales16, int quarter) {
  return _mm512_maskz_permutexvar_epi16(kLowWords, _mm512_load_si512(kRunWords.lanes[quarter]),
                                        _mm512_castsi256_si512(scales16));
}

// (nibbles & 0x0F) | (high & 0xF0): vpternlogd's bit select, low4 ? nibbles : high
GENFN_VNNI_INLINE inline __m512i select_nibbles(__m512i nibbles, __m512i high, __m512i low4) {
  return _mm512_ternarylogic_epi32(low4, nibbles, high, 0xCA);
}

// A super-block's codes (va: inputs 0-63 and 128-191 of its 256, vb: 64-127 and 192-255, per
// 64-input quarter in the order the activations are read), its scales placed for vpdpwssd, d.
struct Q6Block {
  __m512i va[2], vb[2], s[4];
  __m256i scales16;
  float d;
};

GENFN_VNNI_INLINE inline Q6Block load_block(const uint8_t* w) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F);
  // Inputs 0-31 of a 64 take bits 0-1 of their qh byte, 32-63 bits 2-3 (for va); 64-95 bits 4-5,
  // 96-127 bits 6-7 (for vb): shifted into bits 4-5 of each byte.
  const __m512i up_a = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i down_b = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const uint8_t* ql = w;
  const uint8_t* qh = w + 128;
  Q6Block q;
  q.scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
  q.d = half_to_float(load_u16(w + 208));
  for (int quarter = 0; quarter < 4; ++quarter) q.s[quarter] = quarter_scales(q.scales16, quarter);
  for (int h = 0; h < 2; ++h) {
    const __m512i low = _mm512_loadu_si512(ql + 64 * h);
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h)));
    // The select takes bits 4-7 from the shifted high bits; bits 6-7 are cleared after.
    q.va[h] = _mm512_and_si512(select_nibbles(low, _mm512_sllv_epi16(high, up_a), low4), six);
    q.vb[h] = _mm512_and_si512(select_nibbles(_mm512_srli_epi16(low, 4), _mm512_srlv_epi16(high, down_b), low4), six);
  }
  return q;
}

// The super-block's integer sum against one row's 256 codes x and their sums per 16 (x16), in
// 16 lanes; the offset of 32 taken off.
GENFN_VNNI_INLINE inline __m512i block_sum(const Q6Block& q, const int8_t* x, const int16_t* x16) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i sum = _mm512_dpwssd_epi32(zero, _mm512_dpbusd_epi32(zero, q.va[0], _mm512_loadu_si512(x)), q.s[0]);
  sum = _mm512_dpwssd_epi32(sum, _mm512_dpbusd_epi32(zero, q.vb[0], _mm512_loadu_si512(x + 64)), q.s[1]);
  sum = _mm512_dpwssd_epi32(sum, _mm512_dpbusd_epi32(zero, q.va[1], _mm512_loadu_si512(x + 128)), q.s[2]);
  sum = _mm512_dpwssd_epi32(sum, _mm512_dpbusd_epi32(zero, q.vb[1], _mm512_loadu_si512(x + 192)), q.s[3]);
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16));
  const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sums, q.scales16), 5);  // 32 sc per 16 inputs
  return _mm512_sub_epi32(sum, _mm512_zextsi256_si512(offset));
}

template <int M>
GENFN_VNNI void row_q6k_vnni(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  RowSums acc = {_mm256_setzero_ps(), 0.0f};
  __m512i sum[8];
  for (int m = M; m < 8; ++m) sum[m] = _mm512_setzero_si512();
  const int64_t K = a.K;
  StreamFetch<M> fetch(w);
  int64_t b = 0;
  if constexpr (M == 1) {  // eight super-blocks at a time (add_eight_blocks), the rest below
    const int8_t* x = a.codes.data() + m0 * K;
    const int16_t* x16 = a.sums.data() + m0 * (K / 16);
    const float* dx = a.scale.data() + m0 * nb;
    for (; b + 8 <= nb; b += 8) {
      alignas(32) float scale[8];
      for (int i = 0; i < 8; ++i, w += block_bytes(kQ6K)) {
        fetch.through(w + block_bytes(kQ6K));
        const Q6Block q = load_block(w);
        sum[i] = block_sum(q, x + (b + i) * kSuper, x16 + (b + i) * 16);
        scale[i] = q.d * dx[b + i];
      }
      acc.one = add_eight_blocks(acc.one, sum_lanes8(sum), scale);
    }
  }
  for (; b < nb; ++b, w += block_bytes(kQ6K)) {
    fetch.through(w + block_bytes(kQ6K));
    const Q6Block q = load_block(w);
    for (int m = 0; m < M; ++m)
      sum[m] = block_sum(q, a.codes.data() + (m0 + m) * K + b * kSuper, a.sums.data() + (m0 + m) * (K / 16) + b * 16);
    add_rows<M>(acc, sum, q.d, a, m0, nb, b);
  }
  store_rows<M>(acc, y, N);
}

// ---------------------------------------------------------------------------------------------
// q6_k_r8 (kquant.h's layout): a 64-byte run of low nibbles holds 8 inputs of each of the 8 rows,
// lanes 2r and 2r + 1 four each, so a qword broadcast of 8 activation codes meets all 16 lanes, as
// in q4_k_r8 (kquant_r8.cpp); the bit pairs of a high run shift into bits 4-5 of the codes of four
// low runs. The file-layout kernel above spends its permutes and a horizontal sum per super-block
// of one row; here they serve 8 rows. One row of x, 512 x 2048 in L2, one thread: 1.6-1.7x the
// file layout's speed, at 2-8 rows alike.
//
// The integers are the file layout's: a lane's dot of 8 inputs (two runs of 4, the group's 8 and
// 8 more of its 16, in two chained vpdpbusd) starts from -32 times their activation sum (offsets8),
// so it is sum (u - 32) x, at most 8 x 32 x 127 = 32512 (an int16), and vpdpwssd multiplies its low
// word by the group's scale (16 inputs; the high word's is 0): one vpdpwssd for two vpdpbusd, where
// a lane of 4 inputs took one for each (at 8 rows of x 0.8x the instructions). The two lanes of a
// row are added once per super-block. The float is add_block's, as every Q6_K kernel's.

// Word l of a scale vector: the group's scale of row l / 4 in the low word of each dword lane
// (words 4r and 4r + 2: lanes 2r, 2r + 1), from 4 groups' 32 words (group q of them at 8 q).
struct Q6R8ScaleIndex {
  alignas(64) uint16_t lanes[4][32];
  constexpr Q6R8ScaleIndex() : lanes() {
    for (int q = 0; q < 4; ++q)
      for (int l = 0; l < 32; ++l) lanes[q][l] = static_cast<uint16_t>(8 * q + l / 4);
  }
};
constexpr Q6R8ScaleIndex kQ6R8ScaleIndex;

template <int M>
GENFN_VNNI void rows_q6k_r8(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  // Two dpwssd chains at one row of x (its latency, not its throughput, bound one chain); from
  // two rows the rows' chains run side by side.
  constexpr int kChains = M == 1 ? 2 : 1;
  __m256 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t K = a.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi8(0x3F);
  StreamFetch<M> fetch(w);
  constexpr int64_t group_bytes = group_block_bytes(kQ6KR8);
  for (int64_t b = 0; b < nb; ++b, w += group_bytes) {
    fetch.through(w + group_bytes);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kQ6R8D)));
    __m512i scales[16];  // group g's, placed for vpdpwssd
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512i words =
          _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kQ6R8Scales + 32 * q)));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
        scales[4 * q + i] =
            _mm512_maskz_permutexvar_epi16(kLowWords, _mm512_load_si512(kQ6R8ScaleIndex.lanes[i]), words);
    }
    __m512i sum[M][kChains];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c) sum[m][c] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
      for (int k = 0; k < 4; k += 2) {  // runs k and k + 1: inputs 0-7 and 8-15 of a group's 16
        const __m512i qh[2] = {_mm512_loadu_si512(w + kQ6R8High + 64 * (4 * h + k)),
                               _mm512_loadu_si512(w + kQ6R8High + 64 * (4 * h + k + 1))};
#pragma GCC unroll 2
        for (int j = 0; j < 2; ++j) {
          __m512i codes[2][2];  // [e][run]
#pragma GCC unroll 2
          for (int r = 0; r < 2; ++r) {
            // bit pair j of each byte into bits 4-5 for the low nibbles, pair 2 + j for the high
            // (bits above are cleared after the select)
            const __m512i pair_low = j == 0 ? _mm512_slli_epi16(qh[r], 4) : _mm512_slli_epi16(qh[r], 2);
            const __m512i pair_high = j == 0 ? qh[r] : _mm512_srli_epi16(qh[r], 2);
            const __m512i ql = _mm512_loadu_si512(w + kQ6R8Low + 64 * (8 * h + 4 * j + k + r));
            codes[0][r] = _mm512_and_si512(select_nibbles(ql, pair_low, low4), six);
            codes[1][r] = _mm512_and_si512(select_nibbles(_mm512_srli_epi16(ql, 4), pair_high, low4), six);
          }
#pragma GCC unroll 2
          for (int e = 0; e < 2; ++e) {  // low nibbles, then high: inputs 64 on, group 4 on
            const int input = 128 * h + 64 * e + 32 * j + 8 * k, group = 8 * h + 4 * e + 2 * j + k / 2;
            const int chain = (2 * j + e) % kChains;
#pragma GCC unroll 8
            for (int m = 0; m < M; ++m) {
              const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper + input;
              const int32_t* start = a.offsets8.data() + (m0 + m) * (K / 8) + (b * kSuper + input) / 8;
              __m512i dot = _mm512_dpbusd_epi32(_mm512_set1_epi64(load_i64(start)), codes[e][0],
                                                _mm512_set1_epi64(load_i64(x)));
              dot = _mm512_dpbusd_epi32(dot, codes[e][1], _mm512_set1_epi64(load_i64(x + 8)));
              sum[m][chain] = _mm512_dpwssd_epi32(sum[m][chain], dot, scales[group]);
            }
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512i total = sum[m][0];
      if constexpr (kChains == 2) total = _mm512_add_epi32(total, sum[m][1]);
      const __m512i rows = _mm512_add_epi32(total, _mm512_shuffle_epi32(total, _MM_PERM_CDAB));  // lane pairs
      acc[m] = add_block(acc[m], _mm512_cvtepi64_epi32(rows), _mm256_mul_ps(d, _mm256_set1_ps(a.scale[(m0 + m) * nb + b])));
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(y + m * N, acc[m]);
}

}  // namespace

RowFn pick_q6k_vnni(int rows) { GENFN_ROW_CASES(rows, row_q6k_vnni) }

RowFn pick_q6k_r8_vnni(int rows) { GENFN_ROW_CASES(rows, rows_q6k_r8) }

}  // namespace genfn::kquant
