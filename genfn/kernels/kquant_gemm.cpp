// y = x @ dequantize(W).T for many rows of x (prefill, large batches) and W in Q4_K, Q5_K, Q6_K or
// IQ4_XS: an int8 GEMM over the super-blocks as the file stores them (genfn/quant/kquants.py, iq4.py).
//
// The row kernels of kquant_linear.cpp decode a weight row once per 8 rows of x, so a 512-row
// prefill decodes every row 64 times and spends two multiply instructions (vpmaddubsw + vpmaddwd)
// per 64 products. Here each thread takes tiles of 16 weight rows; a tile is unpacked once per
// call into a scratch panel, its codes as bytes with four inputs of one row per 32-bit lane
// ([super-block][inputs / 4][16 rows][4]), its scales, minimums and d beside them; then every row
// of x runs over the panel, which stays in L1/L2:
// - AVX-512 VNNI: `vpdpbusd` (unsigned weight code x signed activation code, four products into
//   one int32 lane) against a broadcast of four activation codes gives one sub-block's sum for 16
//   weight rows; `vpmulld` by the sub-block scales adds it to the super-block's integer sum.
// - AVX2: `vpmaddubsw` products of several steps summed in 16 bits as far as they stay exact
//   (steps_per_sum: a Q4_K sub-block's eight, Q5_K's four, Q6_K's two), then `vpmaddwd` against the
//   sub-block scale (pairs of int16) widens and scales them at once, 8 weight rows per register.
//   One vpmaddwd a step (before session 47) cost a 512-row 1B-shaped Q4_K GEMM 1.5x its time,
//   Q5_K 1.2x (one Zen 4 core).
// The activations are quantized once per call as the row kernels quantize them (llama.cpp's Q8_K,
// natural order), so a super-block's integer sum is the row kernels' bit for bit, and it enters
// the output's float32 sum in their order too (add_block in kquant.h): the GEMM and the row kernels
// give an output the same bits. Minimums (Q4_K/Q5_K, one per 32 inputs) and Q6_K's offset of 32
// (as a minimum of 32 sc per 16 inputs) are one more integer sum, `vpdpwssd` against the
// activations' code sums per 32 or 16 inputs:
//   y = d d_x sum_g sc_g sum_g(u q) - dmin d_x sum_j m_j sum_j(q),   Q6_K: m_j = 32 sc_j, dmin = d
// (Q6_K's offset comes off the integer sum before its one multiply-add). IQ4_XS is the same sum with
// u its table value plus 128 and m_g = 128 ls_g per 32 inputs, so its integer is sum_g ls_g sum_g(w q)
// as iq4_linear.cpp's kernels reduce it (on AVX2, where the pairs of vpmaddubsw would overflow such
// codes, the values stay signed and the product takes w's sign onto q).
// The GEMM keeps no layout of its own: it reads the rows as the loader left them (as stored, or
// interleaved 8 to a group: q4_k_r8, q5_k_r8, q6_k_r8, iq4_xs_r8), and the panel (16 bytes per input, 32 KiB at
// K = 2048) is rebuilt per call: a 16-row product of an 8192 x 2048
// matrix, unpacking included, took 1.07 ms on two Zen 4 cores.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "kquant.h"
#include "kquant_panel.h"

namespace genfn::kquant {
namespace {

constexpr int kTile = kPanelRows;
constexpr int64_t kPanelBlock = 16 * 256;  // panel code bytes per super-block
constexpr int64_t kDefaultMinRows = 16;
// The rows the op kquant_gemm_min_rows set; 0: the default of each format and path (default_min_rows).
std::atomic<int64_t> min_rows{0};

// Where the GEMM's panel, unpacked once per call, pays for itself: from 16 rows, but on the AVX2 path
// the interleaved Q4_K and Q5_K rows' own kernels (kquant_r8.cpp) stay as fast or faster up to about
// 48 rows, and their times hold where the GEMM's swing. One Zen 4 core, 8192 x 2048, row kernels
// against the GEMM, two runs: q4_k_r8 16 rows 2.5-2.6 / 2.8-3.1 ms, 48 rows 7.3-7.8 / 7.0-8.0; q5_k_r8
// 16 rows 2.8-2.9 / 3.3-3.9, 64 rows 11.3-11.5 / 11.2-11.8
// (benchmarks/results/kquant-avx2-handover-2026-12-08-s47-zen4.log). As stored (q4_k, q5_k, q6_k) the
// GEMM wins from 16 rows on either path.
int64_t default_min_rows(int64_t format, Isa isa) {
  const bool vnni = isa == kAvx512 && has_vnni();
  return !vnni && (format == kQ4KR8 || format == kQ5KR8) ? 48 : kDefaultMinRows;
}

// Sub-blocks (one scale each) per super-block.
constexpr int groups_of(int64_t format) { return stored_format(format) == kQ6K ? 16 : 8; }
// Minimums per super-block, taken in int16 pairs against the activations' code sums: Q4_K/Q5_K
// have one per 32 inputs, Q6_K's offset one per 16, IQ4_XS's one per 32.
constexpr int pairs_of(int64_t format) { return stored_format(format) == kQ6K ? 8 : 4; }
// Formats whose "minimums" are an offset of the codes (Q6_K's 32, IQ4_XS's 128 on VNNI), taken off
// the integer sum before its one multiply-add; Q4_K/Q5_K's are a second term with their own dmin.
constexpr bool offset_of_codes(int64_t format) {
  return stored_format(format) == kQ6K || stored_format(format) == kIQ4XS;
}

// On AVX2, the steps (4 inputs of 16 rows) of one sub-block whose vpmaddubsw pairs one 16-bit sum
// holds exactly: a pair reaches 2 * 127 * the largest panel code (Q4_K 15, Q5_K 31, Q6_K 63, IQ4_XS's
// magnitudes 127), and the sum may not pass 2^15 - 1.
constexpr int steps_per_sum(int64_t format) {
  const int64_t stored = stored_format(format);
  const int largest = stored == kQ4K ? 15 : stored == kQ5K ? 31 : stored == kQ6K ? 63 : 127;
  const int fit = 32767 / (2 * 127 * largest);
  const int steps = 64 / groups_of(format);
  return fit >= steps ? steps : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
}

// One tile of the weight, unpacked (see the top of this file).
struct Panel {
  std::vector<uint8_t> codes;   // [nb][64][16][4], codes 0..63
  std::vector<int32_t> scales;  // [nb][groups][16]: the scale, or (AVX2) the scale in both int16 halves
  std::vector<int32_t> mins;    // [nb][pairs][16]: minimums 2p and 2p + 1 as int16
  std::vector<float> d, dmin;   // [nb][16]
};

inline int32_t int16_pair(int low, int high) {
  return static_cast<int32_t>((static_cast<uint32_t>(static_cast<uint16_t>(high)) << 16) |
                              static_cast<uint16_t>(low));
}

GENFN_AVX2_INLINE inline void store_group(uint8_t* codes, int group, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * group), v);
}

// Q6_K's two high bits of each code (at `shift` in qh's bytes), moved to bits 4-5.
GENFN_AVX2_INLINE inline __m256i q6_high_bits(__m256i high, int shift) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, shift), _mm256_set1_epi8(3)), 4);
}

// A row's super-block as 256 codes in natural order, its group scales and minimums (one per 32
// inputs for Q4_K/Q5_K, Q6_K's 32 sc per 16). IQ4_XS: its values moved up by 128 (0-255, for the
// unsigned side of vpdpbusd) with 128 ls per sub-block as the minimum; `signed_values` (AVX2, whose
// vpmaddubsw pairs would overflow int16 on such codes): the values themselves as int8, no minimum.
template <int64_t F>
GENFN_AVX2 void unpack_block(const uint8_t* w, uint8_t* codes, int* scale, int* minimum, float& d, float& dmin,
                             bool signed_values) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (F == kIQ4XS) {
    d = dmin = half_to_float(load_u16(w));
    int16_t ls[8];
    iq4xs_scales(w, ls);
    for (int g = 0; g < 8; ++g) {
      scale[g] = ls[g];
      minimum[g] = signed_values ? 0 : 128 * ls[g];
    }
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(
        signed_values ? static_cast<const void*>(kIQ4Values) : static_cast<const void*>(kIQ4ValuesPlus128))));
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c, 2c + 1: low nibbles inputs 0-15, high 16-31
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 8 + 32 * c));
      const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(packed, low4));
      const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4));
      store_group(codes, 2 * c, _mm256_permute2x128_si256(lo, hi, 0x20));
      store_group(codes, 2 * c + 1, _mm256_permute2x128_si256(lo, hi, 0x31));
    }
  } else if constexpr (F == kQ4K || F == kQ5K) {
    d = half_to_float(load_u16(w));
    dmin = half_to_float(load_u16(w + 2));
    uint64_t sc, mn;
    unpack_scales(w + 4, sc, mn);
    for (int g = 0; g < 8; ++g) {
      scale[g] = static_cast<int>((sc >> (8 * g)) & 0xFF);
      minimum[g] = static_cast<int>((mn >> (8 * g)) & 0xFF);
    }
    const uint8_t* qs = w + (F == kQ5K ? 48 : 16);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
    const __m256i one = _mm256_set1_epi8(1);
    for (int c = 0; c < 4; ++c) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      if constexpr (F == kQ5K) {  // bit g of qh's byte l: the fifth bit of input 32 g + l
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      store_group(codes, 2 * c, lo);
      store_group(codes, 2 * c + 1, hi);
    }
  } else {  // Q6_K
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    d = dmin = half_to_float(load_u16(w + 208));
    for (int j = 0; j < 16; ++j) {
      scale[j] = sc[j];
      minimum[j] = 32 * sc[j];
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i la = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
      const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
      store_group(codes, 4 * h, _mm256_or_si256(_mm256_and_si256(la, low4), q6_high_bits(high, 0)));
      store_group(codes, 4 * h + 1, _mm256_or_si256(_mm256_and_si256(lb, low4), q6_high_bits(high, 2)));
      const __m256i la_high = _mm256_and_si256(_mm256_srli_epi16(la, 4), low4);
      const __m256i lb_high = _mm256_and_si256(_mm256_srli_epi16(lb, 4), low4);
      store_group(codes, 4 * h + 2, _mm256_or_si256(la_high, q6_high_bits(high, 4)));
      store_group(codes, 4 * h + 3, _mm256_or_si256(lb_high, q6_high_bits(high, 6)));
    }
  }
}

// Weight rows n0 .. n0 + rows - 1 (rows <= 16; the rest of the tile is zeros) into p; for_avx2: the
// AVX2 kernel's panel (scales as int16 pairs, IQ4_XS's values signed). q4_k_r8, q5_k_r8,
// q6_k_r8 and iq4_xs_r8: a tile is two whole groups, each row's super-block put back as the file stores it first.
template <int64_t F>
GENFN_AVX2 void unpack_tile(const uint8_t* w, int64_t row_bytes, int rows, int64_t nb, bool for_avx2, Panel& p) {
  constexpr int kGroups = groups_of(F), kPairs = pairs_of(F);
  p.codes.resize(nb * kPanelBlock);
  p.scales.resize(nb * kGroups * kTile);
  p.mins.resize(nb * kPairs * kTile);
  p.d.resize(nb * kTile);
  p.dmin.resize(nb * kTile);
  alignas(64) uint8_t natural[kTile][kSuper];
  if (rows < kTile) {  // the last tile of a matrix whose rows are not a multiple of 16: zeros past them
    std::memset(natural, 0, sizeof(natural));
    std::fill(p.scales.begin(), p.scales.end(), 0);
    std::fill(p.mins.begin(), p.mins.end(), 0);
    std::fill(p.d.begin(), p.d.end(), 0.0f);
    std::fill(p.dmin.begin(), p.dmin.end(), 0.0f);
  }
  for (int64_t b = 0; b < nb; ++b) {
    for (int n = 0; n < rows; ++n) {
      int scale[16], minimum[16];
      const int64_t at = b * kTile + n;
      if constexpr (interleaved(F)) {
        uint8_t stored[block_bytes(F)];
        r8_load<F>(w + n / kR8Rows * kR8Rows * row_bytes + b * group_block_bytes(F), n % kR8Rows, stored);
        unpack_block<stored_format(F)>(stored, natural[n], scale, minimum, p.d[at], p.dmin[at], for_avx2);
      } else {
        unpack_block<F>(w + n * row_bytes + b * block_bytes(F), natural[n], scale, minimum, p.d[at], p.dmin[at],
                        for_avx2);
      }
      for (int g = 0; g < kGroups; ++g)
        p.scales[(b * kGroups + g) * kTile + n] = for_avx2 ? int16_pair(scale[g], scale[g]) : scale[g];
      for (int q = 0; q < kPairs; ++q)
        p.mins[(b * kPairs + q) * kTile + n] = int16_pair(minimum[2 * q], minimum[2 * q + 1]);
    }
    uint8_t* out = p.codes.data() + b * kPanelBlock;
    for (int g = 0; g < 8; ++g)  // inputs 32 g .. 32 g + 31 of rows 0-7, then of rows 8-15
      for (int h = 0; h < 2; ++h) transpose_8x8(&natural[8 * h][32 * g], kSuper, out + 8 * g * 64 + 32 * h);
  }
}

// The activations of M rows as the GEMM reads them: Q8_K in natural order (Q4_K/Q5_K's minimums
// take its code sums per 32 inputs).
struct GemmActivations {
  ActivationsK q8k;
};

// Where rows m0 .. m0 + R - 1 of the activations are; `sums`: the code sums the format's minimums
// pair with (2 * pairs of them per super-block).
struct Rows {
  const int8_t* codes[8];
  const int16_t* sums[8];
  const float* scale[8];
};

template <int R, int kPairs>
inline Rows rows_at(const GemmActivations& a, int64_t m0) {
  Rows rows;
  const int64_t K = a.q8k.K, per_row = K / kSuper * 2 * kPairs;
  const int16_t* sums = kPairs == 8 ? a.q8k.sums.data() : a.q8k.sums32.data();
  for (int r = 0; r < R; ++r) {
    rows.codes[r] = a.q8k.codes.data() + (m0 + r) * K;
    rows.sums[r] = sums + (m0 + r) * per_row;
    rows.scale[r] = a.q8k.scale.data() + (m0 + r) * (K / kSuper);
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: rows m0 .. m0 + R - 1 of x against one panel; writes `keep` of its 16 columns.

template <int R, int kGroups, int kPairs, bool kOffset>
GENFN_VNNI void panel_avx512(
    const Panel& p, int64_t nb, const GemmActivations& a, int64_t m0, float* y, int64_t N, __mmask16 keep) {
  constexpr int kSteps = 64 / kGroups;  // groups of four inputs per sub-block
  const Rows rows = rows_at<R, kPairs>(a, m0);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = p.codes.data() + b * kPanelBlock;
    const int32_t* sc = p.scales.data() + b * kGroups * kTile;
    __m512i total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_si512();
    for (int g = 0; g < kGroups; ++g) {
      __m512i sum[R];
      for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
      for (int s = 0; s < kSteps; ++s) {
        const int step = g * kSteps + s;
        const __m512i w = _mm512_loadu_si512(c + 64 * step);
        for (int r = 0; r < R; ++r)
          sum[r] = _mm512_dpbusd_epi32(sum[r], w, _mm512_set1_epi32(four_codes(rows.codes[r] + b * kSuper + 4 * step)));
      }
      const __m512i scale = _mm512_loadu_si512(sc + g * kTile);
      for (int r = 0; r < R; ++r) total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(sum[r], scale));
    }
    __m512i mins[R];
    for (int r = 0; r < R; ++r) mins[r] = _mm512_setzero_si512();
    for (int q = 0; q < kPairs; ++q) {
      const __m512i m = _mm512_loadu_si512(p.mins.data() + (b * kPairs + q) * kTile);
      for (int r = 0; r < R; ++r) {
        const int8_t* pair = reinterpret_cast<const int8_t*>(rows.sums[r] + (b * kPairs + q) * 2);
        mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(four_codes(pair)));
      }
    }
    const __m512 d = _mm512_loadu_ps(p.d.data() + b * kTile), dmin = _mm512_loadu_ps(p.dmin.data() + b * kTile);
    for (int r = 0; r < R; ++r) {  // kquant.h's add_block, a lane an output
      const __m512 dx = _mm512_set1_ps(rows.scale[r][b]);
      if constexpr (kOffset)  // the codes' offset comes off the integer
        acc[r] = add_block(acc[r], _mm512_sub_epi32(total[r], mins[r]), _mm512_mul_ps(d, dx));
      else
        acc[r] = add_block(acc[r], total[r], mins[r], _mm512_mul_ps(d, dx), _mm512_mul_ps(dmin, dx));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + (m0 + r) * N, keep, acc[r]);
}

// ---------------------------------------------------------------------------------------------
// AVX2: the same over two halves of 8 weight rows; the scales come as int16 pairs. kSigned (IQ4_XS):
// the codes are signed values, multiplied as |w| by x with w's sign (vpmaddubsw takes an unsigned
// side), and there is no offset to take off. kSumSteps: the steps of a sub-block whose vpmaddubsw
// pairs one 16-bit sum holds exactly (steps_per_sum), then one vpmaddwd by the scale for them all.

template <int R, int kGroups, int kPairs, bool kOffset, bool kSigned, int kSumSteps>
GENFN_AVX2 void panel_avx2(const Panel& p, int64_t nb, const GemmActivations& a, int64_t m0, float* y, int64_t N,
                           __mmask16 keep) {
  constexpr int kSteps = 64 / kGroups;
  static_assert(kSteps % kSumSteps == 0, "a sub-block's steps split into whole 16-bit sums");
  const Rows rows = rows_at<R, kPairs>(a, m0);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = p.codes.data() + b * kPanelBlock;
    const int32_t* sc = p.scales.data() + b * kGroups * kTile;
    __m256i total[R][2];
    for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < kGroups; ++g) {
      for (int s0 = 0; s0 < kSteps; s0 += kSumSteps) {
        __m256i part[R][2];
        for (int s = 0; s < kSumSteps; ++s) {
          const int step = g * kSteps + s0 + s;
          const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * step));
          const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * step + 32));
          const __m256i u0 = kSigned ? _mm256_abs_epi8(w0) : w0, u1 = kSigned ? _mm256_abs_epi8(w1) : w1;
          for (int r = 0; r < R; ++r) {
            const __m256i x = _mm256_set1_epi32(four_codes(rows.codes[r] + b * kSuper + 4 * step));
            const __m256i x0 = kSigned ? _mm256_sign_epi8(x, w0) : x, x1 = kSigned ? _mm256_sign_epi8(x, w1) : x;
            const __m256i p0 = _mm256_maddubs_epi16(u0, x0), p1 = _mm256_maddubs_epi16(u1, x1);
            part[r][0] = s == 0 ? p0 : _mm256_add_epi16(part[r][0], p0);
            part[r][1] = s == 0 ? p1 : _mm256_add_epi16(part[r][1], p1);
          }
        }
        for (int h = 0; h < 2; ++h) {
          const __m256i scale = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g * kTile + 8 * h));
          for (int r = 0; r < R; ++r) total[r][h] = _mm256_add_epi32(total[r][h], _mm256_madd_epi16(part[r][h], scale));
        }
      }
    }
    __m256i mins[R][2];
    for (int r = 0; r < R; ++r) mins[r][0] = mins[r][1] = _mm256_setzero_si256();
    for (int q = 0; q < (kSigned ? 0 : kPairs); ++q) {
      const int32_t* m = p.mins.data() + (b * kPairs + q) * kTile;
      const __m256i m0v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m));
      const __m256i m1v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8));
      for (int r = 0; r < R; ++r) {
        const __m256i s =
            _mm256_set1_epi32(four_codes(reinterpret_cast<const int8_t*>(rows.sums[r] + (b * kPairs + q) * 2)));
        mins[r][0] = _mm256_add_epi32(mins[r][0], _mm256_madd_epi16(m0v, s));
        mins[r][1] = _mm256_add_epi32(mins[r][1], _mm256_madd_epi16(m1v, s));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_loadu_ps(p.d.data() + b * kTile + 8 * h);
      const __m256 dmin = _mm256_loadu_ps(p.dmin.data() + b * kTile + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(rows.scale[r][b]);
        if constexpr (kOffset)
          acc[r][h] = add_block(acc[r][h], _mm256_sub_epi32(total[r][h], mins[r][h]), _mm256_mul_ps(d, dx));
        else
          acc[r][h] = add_block(acc[r][h], total[r][h], mins[r][h], _mm256_mul_ps(d, dx), _mm256_mul_ps(dmin, dx));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    for (int n = 0; n < kTile; ++n)
      if (keep >> n & 1) y[(m0 + r) * N + n] = out[n];
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch

using PanelFn = void (*)(const Panel&, int64_t, const GemmActivations&, int64_t, float*, int64_t, __mmask16);

// Rows of x one call of a panel kernel takes: AVX-512 keeps 8 rows' sums in its 32 registers,
// AVX2 4 in its 16.
constexpr int kRowsAvx512 = 8, kRowsAvx2 = 4;

template <int64_t F>
PanelFn pick_panel(bool vnni, int rows) {
  constexpr int kGroups = groups_of(F), kPairs = pairs_of(F);
  constexpr bool kOffset = offset_of_codes(F);
  if (vnni) {
    switch (rows) {
      case 1: return &panel_avx512<1, kGroups, kPairs, kOffset>;
      case 2: return &panel_avx512<2, kGroups, kPairs, kOffset>;
      case 3: return &panel_avx512<3, kGroups, kPairs, kOffset>;
      case 4: return &panel_avx512<4, kGroups, kPairs, kOffset>;
      case 5: return &panel_avx512<5, kGroups, kPairs, kOffset>;
      case 6: return &panel_avx512<6, kGroups, kPairs, kOffset>;
      case 7: return &panel_avx512<7, kGroups, kPairs, kOffset>;
      default: return &panel_avx512<8, kGroups, kPairs, kOffset>;
    }
  }
  constexpr bool kSigned = stored_format(F) == kIQ4XS;
  constexpr int kSum = steps_per_sum(F);
  switch (rows) {
    case 1: return &panel_avx2<1, kGroups, kPairs, kOffset, kSigned, kSum>;
    case 2: return &panel_avx2<2, kGroups, kPairs, kOffset, kSigned, kSum>;
    case 3: return &panel_avx2<3, kGroups, kPairs, kOffset, kSigned, kSum>;
    default: return &panel_avx2<4, kGroups, kPairs, kOffset, kSigned, kSum>;
  }
}

template <int64_t F>
void run_tiles(const GemmActivations& a, const uint8_t* w, int64_t N, float* y, bool vnni) {
  const int64_t M = a.q8k.M, K = a.q8k.K, nb = K / kSuper, row_bytes = nb * block_bytes(F);
  const int step = vnni ? kRowsAvx512 : kRowsAvx2;
  const PanelFn full = pick_panel<F>(vnni, step);
  const PanelFn tail = pick_panel<F>(vnni, static_cast<int>(M % step));
  over_tiles<Panel>(
      M, N, step, full, tail,
      [&](int64_t n0, int rows, Panel& panel) { unpack_tile<F>(w + n0 * row_bytes, row_bytes, rows, nb, !vnni, panel); },
      [&](PanelFn kernel, const Panel& panel, int64_t m0, int64_t n0, __mmask16 keep) {
        kernel(panel, nb, a, m0, y + n0, N, keep);
      });
}

}  // namespace

bool gemm_takes(int64_t format, int64_t rows, Isa isa) {
  const int64_t set = min_rows.load(std::memory_order_relaxed);
  return (format == kQ4K || format == kQ5K || format == kQ6K || format == kIQ4XS || format == kIQ4NL ||
          interleaved(format)) &&
         rows >= (set > 0 ? set : default_min_rows(format, isa));
}

int64_t set_gemm_min_rows(int64_t rows) {
  min_rows.store(rows > 0 ? rows : 0, std::memory_order_relaxed);
  return rows > 0 ? rows : kDefaultMinRows;
}

void kquant_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t format, int64_t N, float* y, Isa isa) {
  if (format == kIQ4NL) return iq4nl_gemm(x, M, K, w, N, y, isa);  // blocks of 32, activations per 32
  thread_local GemmActivations buffers;  // reused across calls; the workers read the caller's
  GemmActivations& a = buffers;
  quantize_for_gemm(x, M, K, kSuper, a.q8k, [](int64_t, int64_t) {});
  const bool vnni = isa == kAvx512 && has_vnni();
  if (format == kQ4K) run_tiles<kQ4K>(a, w, N, y, vnni);
  else if (format == kQ4KR8) run_tiles<kQ4KR8>(a, w, N, y, vnni);
  else if (format == kQ5KR8) run_tiles<kQ5KR8>(a, w, N, y, vnni);
  else if (format == kQ6KR8) run_tiles<kQ6KR8>(a, w, N, y, vnni);
  else if (format == kIQ4XSR8) run_tiles<kIQ4XSR8>(a, w, N, y, vnni);
  else if (format == kQ5K) run_tiles<kQ5K>(a, w, N, y, vnni);
  else if (format == kIQ4XS) run_tiles<kIQ4XS>(a, w, N, y, vnni);
  else run_tiles<kQ6K>(a, w, N, y, vnni);
}

}  // namespace genfn::kquant

TORCH_LIBRARY_FRAGMENT(genfn_kquant, m) {
  // The fewest rows of x that take the GEMM (0: the defaults); returns the count now in force (the
  // defaults: 16, which default_min_rows raises for interleaved Q4_K/Q5_K rows on the AVX2 path).
  m.def("kquant_gemm_min_rows", &genfn::kquant::set_gemm_min_rows);
}
