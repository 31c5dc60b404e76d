// Row kernels of y = x @ dequantize(W).T for W in GGUF's IQ4_NL and IQ4_XS, read in place (the
// blocks row by row as the file stores them, genfn/quant/iq4.py); kquant_linear.cpp's ops quantize
// x and call these per weight row (kquant.h's RowFn), for up to 8 rows of x at a time.
//
// Both formats hold 4-bit indices into one table of 16 int8 values (llama.cpp's kvalues_iq4nl).
// The table fits one 128-bit lane, so a byte shuffle (vpshufb) of it by 64 (or 32) nibbles gives
// their signed values in one instruction. vpmaddubsw multiplies an unsigned by a signed byte, so
// the product w * x is taken as |w| * (x with w's sign), as llama.cpp does (the table has no zero,
// and Q8_K codes stay within [-127, 127], so neither side overflows: a pair sums to at most
// 2 * 127 * 127 in 16 bits). On AVX-512, |w| is a shuffle of the table's magnitudes and w < 0 where
// the index is below 8 (the table is sorted): one test gives the mask that negates x. Per block the
// dot product is an exact integer sum:
//   IQ4_XS  the eight sub-block scales (ls - 32, 6 bits) multiply their sub-blocks' sums, and the
//           super-block's lanes are summed into one exact integer, added to the output's float32
//           sum as every K-quant kernel adds one (kquant.h's add_block, x in Q8_K per 256), so the
//           GEMM (kquant_gemm.cpp), which takes IQ4_XS products of 16 rows and more, gives a row
//           the same bits as these kernels;
//   IQ4_NL  x is quantized per 32 inputs (the block), so each block's integer is scaled by its own
//           d_w * d_x; the AVX-512 path takes four blocks per 512-bit register, their scales lane
//           by lane.
// On the AVX-512 path a 64-byte load of indices holds four runs of 16 bytes (sub-blocks, or IQ4_NL
// blocks); its low nibbles are inputs 0-15 of each run and its high nibbles 16-31, which is the
// order the activation codes are laid out in (kquant.h's kIQ4Order), so each meets one plain load.
// The AVX2 path unpacks one run at a time into 32 values in natural order.
#include "kquant.h"
#include "kquant_rows.h"

namespace {

using namespace genfn::kquant;

// kIQ4Values' magnitudes; the table is sorted, so indices 0-7 are the negative values.
alignas(16) constexpr uint8_t kMagnitudes[16] = {127, 104, 83, 65, 49, 35, 22, 10, 1, 13, 25, 38, 53, 69, 89, 113};

// Four IQ4_NL blocks are 72 bytes: block j's scale is 16-bit word 9j, its 16 index bytes words
// 9j + 1 .. 9j + 8. Every field lies on a word, so one two-source word permute of the group's two
// loads places the four index runs in the four 128-bit lanes, and one permute of the first load
// the four scales in the low words.
struct GroupWords {
  alignas(64) uint16_t indices[32];
  alignas(64) uint16_t scales[32];
  constexpr GroupWords() : indices(), scales() {
    for (int k = 0; k < 32; ++k) indices[k] = static_cast<uint16_t>(9 * (k / 8) + 1 + k % 8);
    for (int j = 0; j < 4; ++j) scales[j] = static_cast<uint16_t>(9 * j);
  }
};
constexpr GroupWords kGroupWords;

// ---------------------------------------------------------------------------------------------
// AVX-512

struct Signed512 {
  __m512i magnitude;
  __mmask64 negative;
};

// The values of 64 indices (nibbles) as |w| (a shuffle of the magnitudes) and w's signs (index < 8).
GENFN_AVX512_INLINE inline Signed512 values512(__m512i magnitudes, __m512i nibbles) {
  return {_mm512_shuffle_epi8(magnitudes, nibbles), _mm512_testn_epi8_mask(nibbles, _mm512_set1_epi8(8))};
}

// IQ4_XS's eight sub-block scales (as iq4xs_scales) in SIMD: 8 int16.
GENFN_AVX512_INLINE inline __m256i iq4xs_scales_int32(const uint8_t* w) {
  uint32_t low;
  std::memcpy(&low, w + 4, 4);
  const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i bits_low = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(low)),
                                                              _mm256_slli_epi32(shifts, 2)), _mm256_set1_epi32(0x0F));
  const __m256i bits_high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(load_u16(w + 2)),
                                                               _mm256_slli_epi32(shifts, 1)), _mm256_set1_epi32(0x03));
  return _mm256_sub_epi32(_mm256_or_si256(bits_low, _mm256_slli_epi32(bits_high, 4)), _mm256_set1_epi32(32));
}

GENFN_AVX512_INLINE inline __m128i iq4xs_scales512(const uint8_t* w) {
  return _mm256_cvtepi32_epi16(iq4xs_scales_int32(w));
}

// w * x for 64 signed weight values and the 64 activation codes at x, adjacent pairs summed in 16 bits.
GENFN_AVX512_INLINE inline __m512i pairs512(const Signed512& w, const int8_t* x) {
  const __m512i v = _mm512_loadu_si512(x);
  return _mm512_maddubs_epi16(w.magnitude, _mm512_mask_sub_epi8(v, w.negative, _mm512_setzero_si512(), v));
}

template <int M>
GENFN_AVX512 void iq4xs_avx512(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  RowSums acc = {_mm256_setzero_ps(), 0.0f};
  __m512i sum[8];
  for (int m = M; m < 8; ++m) sum[m] = _mm512_setzero_si512();
  const int64_t K = a.K;
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kMagnitudes)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  // Half h of a super-block: sub-block 4h + k / 8 for int16 lane k.
  const __m512i run_index[2] = {_mm512_load_si512(kRunWords.lanes[0]), _mm512_load_si512(kRunWords.lanes[1])};
  StreamFetch<M> fetch(w);
  for (int64_t b = 0; b < nb; ++b, w += block_bytes(kIQ4XS)) {
    fetch.through(w + block_bytes(kIQ4XS));
    const float d = half_to_float(load_u16(w));
    const __m512i ls16 = _mm512_castsi128_si512(iq4xs_scales512(w));
    __m512i scales[2];
    Signed512 lo[2], hi[2];
    for (int h = 0; h < 2; ++h) {
      scales[h] = _mm512_permutexvar_epi16(run_index[h], ls16);
      const __m512i q = _mm512_loadu_si512(w + 8 + 64 * h);
      lo[h] = values512(table, _mm512_and_si512(q, low4));
      hi[h] = values512(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
    }
    for (int m = 0; m < M; ++m) {
      const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper;
      sum[m] = _mm512_madd_epi16(pairs512(lo[0], x), scales[0]);
      sum[m] = _mm512_add_epi32(sum[m], _mm512_madd_epi16(pairs512(hi[0], x + 64), scales[0]));
      sum[m] = _mm512_add_epi32(sum[m], _mm512_madd_epi16(pairs512(lo[1], x + 128), scales[1]));
      sum[m] = _mm512_add_epi32(sum[m], _mm512_madd_epi16(pairs512(hi[1], x + 192), scales[1]));
    }
    add_rows<M>(acc, sum, d, a, m0, nb, b);
  }
  store_rows<M>(acc, y, N);
}

// IQ4_XS on AVX-512 VNNI: the same lanes and the same integers, in fewer instructions. vpdpbusd
// multiplies an unsigned byte by a signed one, so here the activation code is the unsigned side,
// moved up by 128 (x xor 0x80 is x + 128 as a byte), and the weight value the signed one; a lane's
// dot starts from -128 times the sum of its 8 weight values (one per super-block, shared by the rows
// of x), so it is sum w x, and the low and high nibbles' products (the same sub-block) chain in one
// lane. One vpmulld then applies the sub-block's scale (|sum w x| <= 8 x 127 x 127 is past an int16,
// so vpdpwssd cannot), where the form above spends a sign fix, a vpmaddubsw and a vpmaddwd per 64
// products of each row of x. The lane's integer is the one above, bit for bit, and so is its float.

// -128 times the sum of each lane's 8 weight values (its 4 of lo and 4 of hi): where a lane's dot
// against codes moved up by 128 starts, so that it ends at sum w x.
GENFN_VNNI_INLINE inline __m512i weight_start(__m512i lo, __m512i hi) {
  const __m512i ones = _mm512_set1_epi8(1);
  const __m512i values = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lo), ones, hi);
  return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(values, 7));
}

// Each lane's sum w x: the 64 codes at x against lo and the 64 at x + 64 against hi, both moved up
// by 128 (x xor 0x80), from weight_start's start.
GENFN_VNNI_INLINE inline __m512i flipped_dot(__m512i start, __m512i lo, __m512i hi, const int8_t* x) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i x_lo = _mm512_xor_si512(_mm512_loadu_si512(x), flip), x_hi = _mm512_xor_si512(_mm512_loadu_si512(x + 64), flip);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, x_lo, lo), x_hi, hi);
}

// Sub-block scales for vpmulld: dword i of half h the scale of sub-block 4h + i / 4, from the eight as
// int32 (iq4xs_scales_int32) by one permute.
GENFN_VNNI_INLINE inline __m512i scales32(__m256i ls32, int h) {
  const __m512i index = h == 0 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                               : _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
  return _mm512_permutexvar_epi32(index, _mm512_castsi256_si512(ls32));
}

// d_w * d_x of eight super-blocks: their float16 d (gathered as the kernel reads the blocks) times the
// activations' eight scales at dx, as add_eight_blocks takes them.
GENFN_AVX512_INLINE inline void eight_scales(const uint16_t* d, const float* dx, float* scale) {
  _mm256_store_ps(scale, _mm256_mul_ps(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(d))),
                                       _mm256_loadu_ps(dx)));
}

// Super-block b (at w) against M rows of x: each row's lanes, sum w x with the sub-block scales applied.
template <int M>
GENFN_VNNI_INLINE inline void iq4xs_block_sums(const uint8_t* w, const ActivationsK& a, int64_t m0, int64_t b,
                                               __m512i* sum) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m256i ls32 = iq4xs_scales_int32(w);
  __m512i scales[2], lo[2], hi[2], start[2];
  for (int h = 0; h < 2; ++h) {
    scales[h] = scales32(ls32, h);
    const __m512i q = _mm512_loadu_si512(w + 8 + 64 * h);
    lo[h] = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low4));
    hi[h] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
    start[h] = weight_start(lo[h], hi[h]);
  }
  for (int m = 0; m < M; ++m) {
    const int8_t* x = a.codes.data() + (m0 + m) * a.K + b * kSuper;
    sum[m] = _mm512_add_epi32(_mm512_mullo_epi32(flipped_dot(start[0], lo[0], hi[0], x), scales[0]),
                              _mm512_mullo_epi32(flipped_dot(start[1], lo[1], hi[1], x + 128), scales[1]));
  }
}

template <int M>
GENFN_VNNI void iq4xs_vnni(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  RowSums acc = {_mm256_setzero_ps(), 0.0f};
  __m512i sum[8];
  for (int m = M; m < 8; ++m) sum[m] = _mm512_setzero_si512();
  StreamFetch<M> fetch(w);
  int64_t b = 0;
  if constexpr (M == 2) {
    // Two rows: as the one-row kernel, eight super-blocks at a time, each row's integers reduced by one
    // network, then added block after block (a row's lane of add_rows, the same operations): 2 rows'
    // reductions a block cost 1.05-1.12x the old time.
    float row_acc[2] = {0.0f, 0.0f};
    for (; b + 8 <= nb; b += 8) {
      __m256i halves[2][8];
      alignas(16) uint16_t d[8];
      for (int i = 0; i < 8; ++i, w += block_bytes(kIQ4XS)) {
        fetch.through(w + block_bytes(kIQ4XS));
        iq4xs_block_sums<M>(w, a, m0, b + i, sum);
        for (int m = 0; m < 2; ++m) halves[m][i] = fold_lanes(sum[m]);
        d[i] = load_u16(w);
      }
      for (int m = 0; m < 2; ++m) {
        alignas(32) float scale[8];
        eight_scales(d, a.scale.data() + (m0 + m) * nb + b, scale);
        row_acc[m] = add_eight_blocks(row_acc[m], sum_lanes8(halves[m]), scale);
      }
    }
    acc.lanes = _mm256_setr_ps(row_acc[0], row_acc[1], 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
  }
  for (; b < nb; ++b, w += block_bytes(kIQ4XS)) {
    fetch.through(w + block_bytes(kIQ4XS));
    iq4xs_block_sums<M>(w, a, m0, b, sum);
    add_rows<M>(acc, sum, half_to_float(load_u16(w)), a, m0, nb, b);
  }
  store_rows<M>(acc, y, N);
}

// One row of IQ4_XS on VNNI: the weight's values moved up by 128 are the unsigned side and the
// activation codes the signed one, each lane starting from the activations' offsets8 (-128 times its
// 8 codes, kquant.h), so no code is flipped and no weight summed: at one row those were as many
// instructions as the sign fix they replace. The same lane integers again.

// One super-block's lanes: sum w x per lane, each sub-block's scale applied (the same integers as
// iq4xs_vnni's lanes).
GENFN_VNNI_INLINE inline __m512i iq4xs_one_block(const uint8_t* w, const int8_t* x, const int32_t* start,
                                                 __m512i table, __m512i low4) {
  const __m256i ls32 = iq4xs_scales_int32(w);
  __m512i sum = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_loadu_si512(w + 8 + 64 * h);
    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low4));
    const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
    __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(start + 16 * h), lo, _mm512_loadu_si512(x + 128 * h));
    dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(x + 128 * h + 64));
    sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(dot, scales32(ls32, h)));
  }
  return sum;
}

GENFN_VNNI void iq4xs_vnni_one(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t) {
  float acc = 0.0f;
  const int64_t K = a.K;
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4ValuesPlus128)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int8_t* x = a.codes.data() + m0 * K;
  const int32_t* start = a.offsets8.data() + m0 * (K / 8);
  const float* dx = a.scale.data() + m0 * nb;
  StreamFetch<1> fetch(w);
  int64_t b = 0;
  // Eight super-blocks at a time: their lanes reduced by one network, their scales formed as one
  // vector, then added block after block as add_block adds them (add_eight_blocks, its bits).
  for (; b + 8 <= nb; b += 8) {
    __m256i halves[8];
    alignas(16) uint16_t d[8];
    for (int i = 0; i < 8; ++i, w += block_bytes(kIQ4XS), x += kSuper, start += kSuper / 8) {
      fetch.through(w + block_bytes(kIQ4XS));
      halves[i] = fold_lanes(iq4xs_one_block(w, x, start, table, low4));
      d[i] = load_u16(w);
    }
    alignas(32) float scale[8];
    eight_scales(d, dx + b, scale);
    acc = add_eight_blocks(acc, sum_lanes8(halves), scale);
  }
  for (; b < nb; ++b, w += block_bytes(kIQ4XS), x += kSuper, start += kSuper / 8) {
    fetch.through(w + block_bytes(kIQ4XS));
    acc = add_block(acc, sum_lanes(iq4xs_one_block(w, x, start, table, low4)), half_to_float(load_u16(w)) * dx[b]);
  }
  y[0] = acc;
}

// 16 index bytes at q (an IQ4_NL block's, an IQ4_XS sub-block's) as their 32 values in natural order.
GENFN_AVX2_INLINE inline __m256i values256(const uint8_t* q, __m256i table, __m256i low4) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4));
}

// w * x for 32 signed weight values w (|w| given) and the 32 activation codes at x, pairs summed in 16 bits.
GENFN_AVX2_INLINE inline __m256i pairs256(__m256i magnitude, __m256i w, const int8_t* x) {
  return _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), w));
}

// IQ4_NL's float32 sum of an output, the same for every kernel (these, on both paths, and the GEMM's,
// kquant_gemm.cpp): eight lanes, block b's exact integer times d_w * d_x (one float product) added
// into lane b % 8 by one fused multiply-add, the lanes then summed as reduce256 sums them. Eight
// lanes keep eight chains of fused multiply-adds in flight at one row of x; the GEMM keeps the
// eight as accumulators of its own. A lane whose block is absent (a row's last blocks) is left as
// it was, not added a zero to.

// Blocks b .. b + count - 1 (count <= 8, at w) of an IQ4_NL row against M rows of activations in
// natural order, into lanes lane .. lane + count - 1 of acc[m] (lane + count <= 8): the AVX2 path's
// every block, the AVX-512 path's last one to three. A block's 32 products are paired in 16 bits
// (|w| * x with w's sign) and summed in 8 int32 lanes, reduced to its integer by sum_lanes8.
template <int M>
GENFN_AVX2_INLINE inline void nl_blocks256(const uint8_t* w, int64_t b, int count, int lane, int64_t nb,
                                           const ActivationsK& a, int64_t m0, __m256 acc[M]) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i sums[M][8];
  alignas(32) float dw[8] = {};
  alignas(32) int32_t live[8] = {};
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < 8; ++i) sums[m][i] = _mm256_setzero_si256();
  for (int i = 0; i < count; ++i, w += block_bytes(kIQ4NL)) {
    const __m256i v = values256(w + 2, table, low4);
    const __m256i magnitude = _mm256_abs_epi8(v);
    dw[lane + i] = half_to_float(load_u16(w));
    live[lane + i] = -1;
    for (int m = 0; m < M; ++m)
      sums[m][lane + i] = _mm256_madd_epi16(pairs256(magnitude, v, a.codes.data() + (m0 + m) * a.K + (b + i) * 32), ones);
  }
  const __m256 mask = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(live)));
  for (int m = 0; m < M; ++m) {
    alignas(32) float dx[8] = {};
    for (int i = 0; i < count; ++i) dx[lane + i] = a.scale[(m0 + m) * nb + b + i];
    const __m256 scale = _mm256_mul_ps(_mm256_load_ps(dw), _mm256_load_ps(dx));
    const __m256 added = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes8(sums[m])), scale, acc[m]);
    acc[m] = _mm256_blendv_ps(acc[m], added, mask);
  }
}

// Four IQ4_NL blocks at w (72 bytes): their 128 indices as one 64-byte run group (a block a 128-bit
// lane, its low nibbles inputs 0-15) and their four scales.
GENFN_AVX512_INLINE inline void nl_group(const uint8_t* w, __m512i& indices, __m128& scales) {
  const __m512i first = _mm512_loadu_si512(w);
  // Only the group's last 8 bytes: a masked load reads nothing past the row.
  indices = _mm512_permutex2var_epi16(first, _mm512_load_si512(kGroupWords.indices), _mm512_maskz_loadu_epi8(0xFF, w + 64));
  scales = _mm_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(_mm512_load_si512(kGroupWords.scales), first)));
}

// Eight blocks' integers, lane j block j: `low` holds blocks 0-3 and `high` blocks 4-7, four lanes of
// partial sums each (block j in 128-bit lane j).
GENFN_AVX512_INLINE inline __m256i nl_block_sums(__m512i low, __m512i high) {
  const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi32(low, high), _mm512_unpackhi_epi32(low, high));
  const __m512i u = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, static_cast<_MM_PERM_ENUM>(0x4E)));  // lane 0 low's, 1 high's
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), u));
}

// Blocks b .. b + 7 (or b .. b + 3 where `keep` is 0x0F: high and dw_high are then zeros) into acc[m].
template <int M>
GENFN_AVX512_INLINE inline void nl_add_group(const __m512i* low, const __m512i* high, __m128 dw_low, __m128 dw_high,
                                             const ActivationsK& a, int64_t m0, int64_t nb, int64_t b, __mmask8 keep,
                                             __m256* acc) {
  const __m256 dw = _mm256_set_m128(dw_high, dw_low);
  for (int m = 0; m < M; ++m) {
    const __m256 scale = _mm256_mul_ps(dw, _mm256_maskz_loadu_ps(keep, a.scale.data() + (m0 + m) * nb + b));
    acc[m] = _mm256_mask3_fmadd_ps(_mm256_cvtepi32_ps(nl_block_sums(low[m], high[m])), scale, acc[m], keep);
  }
}

// Four blocks (128 inputs) at w per register, two registers a group of eight lanes: each row's
// partial sums (block j in 128-bit lane j) and the blocks' scales.
template <int M>
GENFN_AVX512_INLINE inline void nl_sums_avx512(const uint8_t* w, int64_t b, const ActivationsK& a, int64_t m0,
                                               __m512i* sum, __m128& dw) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kMagnitudes)));
  const __m512i low4 = _mm512_set1_epi8(0x0F), ones = _mm512_set1_epi16(1);
  __m512i q;
  nl_group(w, q, dw);
  const Signed512 lo = values512(table, _mm512_and_si512(q, low4));
  const Signed512 hi = values512(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
  for (int m = 0; m < M; ++m) {
    const int8_t* x = a.codes.data() + (m0 + m) * a.K + b * 32;
    sum[m] = _mm512_add_epi32(_mm512_madd_epi16(pairs512(lo, x), ones), _mm512_madd_epi16(pairs512(hi, x + 64), ones));
  }
}

// The IQ4_NL row kernel's text, stamped for AVX-512 (NAME iq4nl_avx512, SUMS nl_sums_avx512) and
// for VNNI (iq4nl_vnni, nl_sums_vnni): eight blocks a step in two registers of four, a last group of
// four, then the last one to three blocks (their codes in natural order) one at a time.
#define GENFN_IQ4NL_KERNEL(NAME, TARGET, SUMS)                                                               \
  template <int M>                                                                                           \
  TARGET void NAME(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {  \
    constexpr int64_t kBytes = block_bytes(kIQ4NL);                                                           \
    static_assert(4 * kBytes == 64 + 8, "four IQ4_NL blocks are one 64-byte load and 8 bytes more");         \
    __m256 acc[M];                                                                                           \
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();                                                \
    StreamFetch<M> fetch(w);                                                                                 \
    __m512i low[M], high[M];                                                                                 \
    __m128 dw_low, dw_high;                                                                                  \
    int64_t b = 0;                                                                                           \
    for (; b + 8 <= nb; b += 8, w += 8 * kBytes) {                                                           \
      fetch.through(w + 8 * kBytes);                                                                         \
      SUMS<M>(w, b, a, m0, low, dw_low);                                                                     \
      SUMS<M>(w + 4 * kBytes, b + 4, a, m0, high, dw_high);                                                  \
      nl_add_group<M>(low, high, dw_low, dw_high, a, m0, nb, b, 0xFF, acc);                                  \
    }                                                                                                        \
    if (b + 4 <= nb) {                                                                                       \
      fetch.through(w + 4 * kBytes);                                                                         \
      SUMS<M>(w, b, a, m0, low, dw_low);                                                                     \
      for (int m = 0; m < M; ++m) high[m] = _mm512_setzero_si512();                                          \
      nl_add_group<M>(low, high, dw_low, _mm_setzero_ps(), a, m0, nb, b, 0x0F, acc);                         \
      b += 4;                                                                                                \
      w += 4 * kBytes;                                                                                       \
    }                                                                                                        \
    if (b < nb) nl_blocks256<M>(w, b, static_cast<int>(nb - b), static_cast<int>(b % 8), nb, a, m0, acc);   \
    for (int m = 0; m < M; ++m) y[m * N] = reduce256(acc[m]);                                                \
  }

GENFN_IQ4NL_KERNEL(iq4nl_avx512, GENFN_AVX512, nl_sums_avx512)

template <int M>
GENFN_VNNI_INLINE inline void nl_sums_vnni(const uint8_t* w, int64_t b, const ActivationsK& a, int64_t m0,
                                           __m512i* sum, __m128& dw) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i q;
  nl_group(w, q, dw);
  const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(q, low4));
  const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), low4));
  const __m512i start = weight_start(lo, hi);
  for (int m = 0; m < M; ++m) sum[m] = flipped_dot(start, lo, hi, a.codes.data() + (m0 + m) * a.K + b * 32);
}

// IQ4_NL on AVX-512 VNNI, as iq4xs_vnni: four blocks' 8-input lanes from -128 times their weight
// values' sums, the codes moved up by 128; a lane's integer is iq4nl_avx512's (its pair sums added
// by vpmaddwd against ones), and so is each block's, so it gets the same float.
GENFN_IQ4NL_KERNEL(iq4nl_vnni, GENFN_VNNI, nl_sums_vnni)
#undef GENFN_IQ4NL_KERNEL

// ---------------------------------------------------------------------------------------------
// AVX2

template <int M>
GENFN_AVX2 void iq4xs_avx2(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  RowSums acc = {_mm256_setzero_ps(), 0.0f};
  __m256i sum[8];
  for (int m = M; m < 8; ++m) sum[m] = _mm256_setzero_si256();
  const int64_t K = a.K;
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  StreamFetch<M> fetch(w);
  for (int64_t b = 0; b < nb; ++b, w += block_bytes(kIQ4XS)) {
    fetch.through(w + block_bytes(kIQ4XS));
    const float d = half_to_float(load_u16(w));
    int16_t ls[8];
    iq4xs_scales(w, ls);
    for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {  // sub-block i: inputs 32i..32i+31
      const __m256i v = values256(w + 8 + 16 * i, table, low4);
      const __m256i magnitude = _mm256_abs_epi8(v), scale = _mm256_set1_epi16(ls[i]);
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper + 32 * i;
        sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(pairs256(magnitude, v, x), scale));
      }
    }
    add_rows<M>(acc, sum, d, a, m0, nb, b);
  }
  store_rows<M>(acc, y, N);
}

template <int M>
GENFN_AVX2 void iq4nl_avx2(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  StreamFetch<M> fetch(w);
  for (int64_t b = 0; b < nb; b += 8, w += 8 * block_bytes(kIQ4NL)) {
    fetch.through(w + 8 * block_bytes(kIQ4NL));
    nl_blocks256<M>(w, b, static_cast<int>(std::min<int64_t>(8, nb - b)), 0, nb, a, m0, acc);
  }
  for (int m = 0; m < M; ++m) y[m * N] = reduce256(acc[m]);
}

}  // namespace

namespace genfn::kquant {

RowFn pick_iq4(Isa isa, int64_t format, int rows) {
  if (isa == kAvx512) {
    if (format == kIQ4NL) {
      if (has_vnni()) { GENFN_ROW_CASES(rows, iq4nl_vnni) }
      GENFN_ROW_CASES(rows, iq4nl_avx512)
    }
    if (has_vnni()) {
      if (rows == 1) return &iq4xs_vnni_one;  // reads offsets8: kquant.h's reads_offsets names it
      GENFN_ROW_CASES(rows, iq4xs_vnni)
    }
    GENFN_ROW_CASES(rows, iq4xs_avx512)
  }
  if (format == kIQ4NL) { GENFN_ROW_CASES(rows, iq4nl_avx2) }
  GENFN_ROW_CASES(rows, iq4xs_avx2)
}

}  // namespace genfn::kquant
