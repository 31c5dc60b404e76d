// The kernels of the tiles16 block formats on AVX2 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; tile_kinds.h):
// tiles_avx2.cpp's op in the K-quant library, and the decode stack's tiles linears in the library
// built for CPUs without AVX-512 (native.py's DECODE_AVX2, decode_avx2.cpp).
//
// The arithmetic is quant_linear.cpp's, so the bits are the same as its VNNI kernel's: each row of x
// quantized per block of 32 inputs (d = max|x| / 127, ties to even, the block's code sum); per block
// and output row an exact integer sum of codes times weight codes, less the kind's code offset times
// the code sum; then the block's float steps, lane by lane as there: d_w * d_x in one product, the
// integer's fused multiply-add into the output's one chain over the blocks, and the minimum's.
//
// AVX2 has no vpdpbusd. vpmaddubsw multiplies unsigned weight bytes by signed activation bytes and
// adds pairs into 16 bits with saturation, so the integers stay exact only where no pair can reach
// 2^15: 4-bit codes (at most 2 * 15 * 127 a pair) sum eight products' pairs in 16 bits, 5-bit codes
// (2 * 31 * 127) two; an 8-bit code (stored + 128) is taken as |code| times x with the code's sign
// (at most 2 * 128 * 127), as llama.cpp's AVX2 kernels do. vpmaddwd against ones then widens a row's
// pairs into its 32-bit lane. A 256-bit register holds half a tile's chunk: 8 rows of 4 bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kquant.h"
#include "row_queue.h"
#include "tile_kinds.h"

namespace genfn_kernels::tiles_avx2 {

using namespace genfn_kernels::tile_kinds;

constexpr int64_t kTile = 16;
constexpr int64_t kBlock = 32;
// Rows of x a pass over a tile takes. Each row holds two accumulators and a chunk's unpacked codes
// four registers, so past 6 rows they spill. 512 rows of 2048 x 2048 on two Zen 4 cores (session 47,
// two alternated runs) ran Q4_0 and Q4_1 1.08-1.15x as fast in passes of 6 as of 4, Q8_0 and Q5_0
// the same.
constexpr int kMaxRows = 6;

GENFN_AVX2_INLINE inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Rows [m0, m1) of x [M, K]: quant_linear.cpp's quantize_rows, eight lanes at a time.
GENFN_AVX2 inline void quantize_rows(const float* x, int64_t m0, int64_t m1, int64_t K, QuantActivations& a) {
  const int64_t nb = K / kBlock;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 lim = _mm256_set1_ps(127.0f), neg_lim = _mm256_set1_ps(-127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * K + b * kBlock;
      __m256 f[4];
      for (int i = 0; i < 4; ++i) f[i] = _mm256_loadu_ps(v + 8 * i);
      __m256 largest = _mm256_and_ps(f[0], magnitude);
      for (int i = 1; i < 4; ++i) largest = _mm256_max_ps(largest, _mm256_and_ps(f[i], magnitude));
      const float amax = max8(largest);
      const float d = amax / 127.0f;
      const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(f[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, neg_lim), lim));
      }
      // Packing works within 128-bit lanes: the dword permute puts the 32 bytes back in order.
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.codes.data() + m * K + b * kBlock), bytes);
      const int32_t total =
          genfn::kquant::sum_lanes(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      a.scale[m * nb + b] = d;
      a.sum[m * nb + b] = total;
      a.scaled_sum[m * nb + b] = d * static_cast<float>(total);
    }
  }
}

// Half h of a 4- or 5-bit block's chunk j (tile_kinds.h's unpack_nibble_chunk for rows 8h .. 8h + 7):
// the unsigned codes of inputs 4j .. 4j + 3 (`low`) and 16 + 4j .. 16 + 4j + 3 (`high`), four bytes a row.
template <int64_t kind>
GENFN_AVX2_INLINE inline void unpack_half(const uint8_t* block, int h, int j, __m256i& low, __m256i& high) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  constexpr int64_t kNibbles = has_fifth_bits(kind) ? 64 : 0;
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kNibbles + 64 * j + 32 * h));
  low = _mm256_and_si256(packed, low_nibbles);
  high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
  if constexpr (has_fifth_bits(kind)) {
    // As there: byte i of a row's four takes bit 4 (j % 2) + i of its word's byte j / 2 (low) or
    // 2 + j / 2 (high); a set bit adds 16. AVX2 tests a bit by comparing the masked byte with it.
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * h));
    const __m256i row_byte = _mm256_broadcastsi128_si256(_mm_setr_epi32(0x00000000, 0x04040404, 0x08080808, 0x0C0C0C0C));
    const __m256i low_pick = _mm256_add_epi8(row_byte, _mm256_set1_epi8(static_cast<char>(j / 2)));
    const __m256i high_pick = _mm256_add_epi8(row_byte, _mm256_set1_epi8(static_cast<char>(2 + j / 2)));
    const __m256i bit = _mm256_set1_epi32(j % 2 ? static_cast<int>(0x80402010) : 0x08040201);
    const __m256i sixteen = _mm256_set1_epi8(16);
    const __m256i low_set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(words, low_pick), bit), bit);
    const __m256i high_set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(words, high_pick), bit), bit);
    low = _mm256_add_epi8(low, _mm256_and_si256(low_set, sixteen));
    high = _mm256_add_epi8(high, _mm256_and_si256(high_set, sixteen));
  }
}

// The exact integers of rows m of x over one block, both halves of the tile (8 output rows each,
// one a lane): s[m][h] = sum of codes times x, less the code offset's share for the 4- and 5-bit kinds
// (quant_linear.cpp's s0 + s1). xb[m]: row m's block as 8 dwords of 4 codes, x_sum[m] its code sum.
//
// The chunk loop is outside the rows: a chunk's codes are unpacked once and stay in registers while
// every row takes them, and each row holds only its two accumulators. With the rows outside (the
// form before session 47) a half's unpacked codes took 8 registers (Q8_0: 16, the codes and their
// magnitudes) beside the rows' accumulators, more than AVX2's 16. So, 512 rows of 2048 x 2048 on one
// Zen 4 core run Q8_0 1.1-1.3x as fast, Q4_0 1.4x, Q4_1 1.5x, Q5_0 1.1-1.3x
// (benchmarks/results/avx2-prefill-kernels-trees-2026-12-08-s47-zen4.log), and 2-8 rows out of cache
// 1.1-1.3x. The integers
// are exact in any order (the 16-bit sums' bounds hold for every partial sum): the order changes no bit.
template <int M, int64_t kind>
GENFN_AVX2_INLINE inline void block_integers(const uint8_t* block, const int32_t* const* xb, const int32_t* x_sum,
                                             __m256i (&s)[M][2]) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kind == kQ8) {
    // An 8-bit code (stored + 128) times x as |code| times x with the code's sign; the signed
    // products hold no offset.
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int m = 0; m < M; ++m) s[m][0] = s[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      __m256i w[2], w_abs[2];
      for (int h = 0; h < 2; ++h) {
        w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * h)), flip);
        w_abs[h] = _mm256_abs_epi8(w[h]);
      }
      for (int m = 0; m < M; ++m) {
        const __m256i x = _mm256_set1_epi32(xb[m][j]);
        for (int h = 0; h < 2; ++h)
          s[m][h] = _mm256_add_epi32(s[m][h], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs[h], _mm256_sign_epi8(x, w[h])), ones));
      }
    }
    return;
  } else {
    // A chunk's low and high pairs, summed: a pair of 4-bit products reaches 2 * 15 * 127, so a block's
    // eight pairs a lane fit 16 bits and widen once; a pair of 5-bit products 2 * 31 * 127, so a
    // chunk's two pairs widen every chunk.
    __m256i p[M][2];
    for (int m = 0; m < M; ++m) p[m][0] = p[m][1] = s[m][0] = s[m][1] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i low[2], high[2];
      for (int h = 0; h < 2; ++h) unpack_half<kind>(block, h, j, low[h], high[h]);
      for (int m = 0; m < M; ++m) {
        const __m256i x_low = _mm256_set1_epi32(xb[m][j]), x_high = _mm256_set1_epi32(xb[m][4 + j]);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs =
              _mm256_add_epi16(_mm256_maddubs_epi16(low[h], x_low), _mm256_maddubs_epi16(high[h], x_high));
          if constexpr (has_fifth_bits(kind))
            s[m][h] = _mm256_add_epi32(s[m][h], _mm256_madd_epi16(pairs, ones));
          else
            p[m][h] = _mm256_add_epi16(p[m][h], pairs);
        }
      }
    }
    if constexpr (!has_fifth_bits(kind))
      for (int m = 0; m < M; ++m)
        for (int h = 0; h < 2; ++h) s[m][h] = _mm256_madd_epi16(p[m][h], ones);
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) s[m][h] = _mm256_sub_epi32(s[m][h], _mm256_set1_epi32(code_offset(kind) * x_sum[m]));
}

// Tile t against rows m0 .. m0 + M - 1 of x: y[m, 16t .. 16t + 15], y's (and init's) rows ld floats
// apart, the outputs past N masked.
template <int M, int64_t kind>
GENFN_AVX2 void tile_rows(int64_t t, int64_t m0, int64_t nb, const uint8_t* codes, const uint16_t* scales,
                          const uint16_t* mins, const QuantActivations& a, int64_t K, int64_t N, int64_t ld, float* y,
                          const float* init) {
  constexpr int64_t kBlockBytes = tile_block_bytes(kind);
  constexpr bool kMin = has_minimum(kind);
  const int64_t n0 = t * kTile;
  __m256i keep[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i lane =
        _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(n0 + 8 * h)));
    keep[h] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(N)), lane);
  }
  __m256 acc[M][2];
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h)
      acc[m][h] = init ? _mm256_maskload_ps(init + (m0 + m) * ld + n0 + 8 * h, keep[h]) : _mm256_setzero_ps();
  const uint8_t* c = codes + t * nb * kBlockBytes;
  const uint16_t* sc = scales + t * nb * kTile;
  const uint16_t* mn = kMin ? mins + t * nb * kTile : nullptr;
  // The stream fetched ahead as quant_linear.cpp's 4-bit tiles fetch theirs (one row: one_row_window,
  // 8 KiB into L1 on AMD's cores; more: few_quantized_rows_window), the scales (and minimums) an eighth
  // as far. The 8-bit tiles too, which the prefetchers alone stream fastest for the VNNI kernel: this
  // one, slower per byte, read 1B-shaped Q8_0 matrices out of cache at one row 1.15x as fast with the
  // window (Zen 4, three alternated runs of builds with and without it), Q4_1 1.2-1.5x, two rows of
  // any kind 1.1-1.3x, Q4_0 at one row the same.
  const genfn_kernels::StreamWindow window =
      M == 1 ? genfn_kernels::one_row_window(genfn_kernels::StreamKind::kTiles)
             : genfn_kernels::few_quantized_rows_window(genfn_kernels::StreamKind::kTiles);
  for (int64_t b = 0; b < nb; ++b, c += kBlockBytes) {
    if (window.bytes > 0) {
      for (int64_t j = 0; j < kBlockBytes; j += 64) window.fetch(c + window.bytes + j);
      if (b % 2 == 0) {  // 32 bytes of scales a block: a line every other block
        window.fetch(reinterpret_cast<const char*>(sc + b * kTile) + window.bytes / 8);
        if constexpr (kMin) window.fetch(reinterpret_cast<const char*>(mn + b * kTile) + window.bytes / 8);
      }
    }
    const int32_t* xb[M];
    int32_t x_sum[M];
    for (int m = 0; m < M; ++m) {
      xb[m] = reinterpret_cast<const int32_t*>(a.codes.data() + (m0 + m) * K + b * kBlock);
      x_sum[m] = a.sum[(m0 + m) * nb + b];
    }
    __m256i s[M][2];
    block_integers<M, kind>(c, xb, x_sum, s);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * kTile + 8 * h)));
      __m256 mins_b;
      if constexpr (kMin)
        mins_b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b * kTile + 8 * h)));
      for (int m = 0; m < M; ++m) {
        const int64_t row = m0 + m;
        const __m256 dx = _mm256_mul_ps(d, _mm256_set1_ps(a.scale[row * nb + b]));
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][h]), dx, acc[m][h]);
        if constexpr (kMin) acc[m][h] = _mm256_fmadd_ps(mins_b, _mm256_set1_ps(a.scaled_sum[row * nb + b]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_maskstore_ps(y + (m0 + m) * ld + n0 + 8 * h, keep[h], acc[m][h]);
}

using TileFn = void (*)(int64_t, int64_t, int64_t, const uint8_t*, const uint16_t*, const uint16_t*,
                        const QuantActivations&, int64_t, int64_t, int64_t, float*, const float*);

template <int64_t kind>
TileFn pick_for(int rows) {
  switch (rows) {
    case 1: return &tile_rows<1, kind>;
    case 2: return &tile_rows<2, kind>;
    case 3: return &tile_rows<3, kind>;
    case 4: return &tile_rows<4, kind>;
    case 5: return &tile_rows<5, kind>;
    default: return &tile_rows<6, kind>;
  }
}

// The kernel for `rows` (1 to kMaxRows) rows of x against tiles of `kind`.
inline TileFn pick(int64_t kind, int rows) {
  switch (kind) {
    case kQ4: return pick_for<kQ4>(rows);
    case kQ4Min: return pick_for<kQ4Min>(rows);
    case kQ5: return pick_for<kQ5>(rows);
    case kQ5Min: return pick_for<kQ5Min>(rows);
    default: return pick_for<kQ8>(rows);
  }
}

// Tiles [t0, t1) against the M rows of x quantized in a: over each tile, passes of at most kMaxRows
// rows, as even as they go (8 rows: two passes of 4, not 6 and 2).
void tiles_rows(int64_t t0, int64_t t1, int64_t M, int64_t kind, int64_t nb, const uint8_t* codes, const uint16_t* scales,
                const uint16_t* mins, const QuantActivations& a, int64_t K, int64_t N, int64_t ld, float* y,
                const float* init) {
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t p = 0; p < passes; ++p) {
      const int64_t m0 = M * p / passes, m1 = M * (p + 1) / passes;
      pick(kind, static_cast<int>(m1 - m0))(t, m0, nb, codes, scales, mins, a, K, N, ld, y, init);
    }
}

}  // namespace genfn_kernels::tiles_avx2
