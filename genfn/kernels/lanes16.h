// Sixteen float32 lanes, the unit of the per-token arithmetic that the decode stack runs around its
// linears (row_ops.h: norms, RoPE, SwiGLU, residuals; attention_lanes.h and decode_attention.cpp:
// scores, softmax, weighted values): one __m512 where the library is built for AVX-512, two __m256
// where it is built for AVX2 (the stack's library for CPUs without AVX-512, native.py's DECODE_AVX2).
//
// Both forms give the same bits. Every lane runs the same instruction on the same inputs (AVX2 has
// the same IEEE operations, fused multiply-adds included); a sum or maximum over the lanes takes
// the pairs _mm512_reduce_add_ps takes (lane i with lane i + 8, those sums four apart, then two,
// then one); scalef is two exact power-of-two products, the second rounding as scalef's one does;
// bfloat16 widens exactly and rounds as c10::BFloat16(float) does. So a token run by either library gets the same
// numbers, and the tests hold the AVX2 stack to the AVX-512 one bit for bit.
//
// The AVX-512 form is the intrinsics themselves (F16 is __m512, M16 is __mmask16): code written
// against this header compiles to what it compiled to before there was an AVX2 form.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>

namespace genfn_kernels::simd {

#if defined(__AVX512F__)

using F16 = __m512;
using M16 = __mmask16;
// The F16s the vector registers hold: 32 zmm.
inline constexpr int kRegisters = 32;

inline F16 zero() { return _mm512_setzero_ps(); }
inline F16 set1(float v) { return _mm512_set1_ps(v); }
inline F16 loadu(const float* p) { return _mm512_loadu_ps(p); }
inline F16 load_kept(M16 keep, const float* p) { return _mm512_maskz_loadu_ps(keep, p); }
inline void storeu(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline void store_kept(float* p, M16 keep, F16 v) { _mm512_mask_storeu_ps(p, keep, v); }
inline F16 add(F16 a, F16 b) { return _mm512_add_ps(a, b); }
inline F16 sub(F16 a, F16 b) { return _mm512_sub_ps(a, b); }
inline F16 mul(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
inline F16 div(F16 a, F16 b) { return _mm512_div_ps(a, b); }
inline F16 max(F16 a, F16 b) { return _mm512_max_ps(a, b); }
inline F16 min(F16 a, F16 b) { return _mm512_min_ps(a, b); }
inline F16 fmadd(F16 a, F16 b, F16 c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
inline F16 fnmadd(F16 a, F16 b, F16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline F16 round_nearest(F16 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F16 scalef(F16 p, F16 n) { return _mm512_scalef_ps(p, n); }  // p * 2^n for integral n
inline F16 keep_only(M16 keep, F16 v) { return _mm512_maskz_mov_ps(keep, v); }
inline F16 select(M16 keep, F16 a, F16 b) { return _mm512_mask_blend_ps(keep, b, a); }  // keep ? a : b
inline float reduce_add(F16 v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(F16 v) { return _mm512_reduce_max_ps(v); }
// The kept lanes loaded, the others `fill`.
inline F16 load_kept_or(M16 keep, const float* p, F16 fill) { return _mm512_mask_loadu_ps(fill, keep, p); }
// Bit i set where lane i is NaN; where lane i of a equals lane i of b (-0 == +0, NaN equals nothing).
inline M16 unordered(F16 v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
inline M16 equal(F16 a, F16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }

// 16 bfloat16 values widened to float32 lanes (exact).
inline __m512 widen_bfloat16(__m256i halves) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
// 16 float32 lanes rounded to bfloat16 as c10::BFloat16(float) rounds: to nearest even, NaN quiet.
inline __m256i round_to_bfloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline F16 widen_bf16(const c10::BFloat16* p) {
  return widen_bfloat16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline F16 widen_bf16_kept(M16 keep, const c10::BFloat16* p) { return widen_bfloat16(_mm256_maskz_loadu_epi16(keep, p)); }
inline void store_bf16_kept(c10::BFloat16* p, M16 keep, F16 v) { _mm256_mask_storeu_epi16(p, keep, round_to_bfloat16(v)); }
inline F16 round_bf16(F16 v) { return widen_bfloat16(round_to_bfloat16(v)); }

#else  // AVX2: the low and high eight lanes

struct F16 {
  __m256 lo, hi;
};
using M16 = uint16_t;
// The F16s the vector registers hold: 16 ymm, two a F16.
inline constexpr int kRegisters = 8;

inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F16 loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// Lane i's all-ones mask where bit i of keep is set (vmaskmov reads only those lanes' memory).
inline __m256i lane_mask(M16 keep, int half) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i word = _mm256_set1_epi32((keep >> (8 * half)) & 0xFF);
  return _mm256_cmpeq_epi32(_mm256_and_si256(word, bits), bits);
}
// All sixteen kept (every chunk but a row's last) is a plain load or store: vmaskmov and its mask cost
// several instructions more, and on AMD's cores a masked load waits longer.
inline F16 load_kept(M16 keep, const float* p) {
  if (keep == 0xFFFF) return loadu(p);
  return {_mm256_maskload_ps(p, lane_mask(keep, 0)), _mm256_maskload_ps(p + 8, lane_mask(keep, 1))};
}
inline void storeu(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void store_kept(float* p, M16 keep, F16 v) {
  if (keep == 0xFFFF) return storeu(p, v);
  _mm256_maskstore_ps(p, lane_mask(keep, 0), v.lo);
  _mm256_maskstore_ps(p + 8, lane_mask(keep, 1), v.hi);
}
inline F16 add(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 sub(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 mul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 div(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 max(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 min(F16 a, F16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnmadd(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 round_nearest(F16 v) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, kMode), _mm256_round_ps(v.hi, kMode)};
}
// p * 2^n for integral n in [-252, 254] as p * 2^a * 2^b, a = floor(n / 2), b = n - a: each power
// a normal float, the first product exact for the |p| ~ 1 the exponentials scale, so the only
// rounding is the second product's, which is scalef's one rounding (to a subnormal, or to infinity,
// as it would).
inline __m256 power_of_two(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }
inline __m256 scalef8(__m256 p, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), a = _mm256_srai_epi32(k, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, power_of_two(a)), power_of_two(_mm256_sub_epi32(k, a)));
}
inline F16 scalef(F16 p, F16 n) { return {scalef8(p.lo, n.lo), scalef8(p.hi, n.hi)}; }
inline F16 keep_only(M16 keep, F16 v) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(lane_mask(keep, 0))),
          _mm256_and_ps(v.hi, _mm256_castsi256_ps(lane_mask(keep, 1)))};
}
inline F16 select(M16 keep, F16 a, F16 b) {  // keep ? a : b
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(lane_mask(keep, 0))),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(lane_mask(keep, 1)))};
}
// _mm512_reduce_add_ps's and _mm512_reduce_max_ps's tree, operands in its order.
inline float reduce_add(F16 v) {
  const __m256 eights = _mm256_add_ps(v.hi, v.lo);
  const __m128 fours = _mm_add_ps(_mm256_extractf128_ps(eights, 1), _mm256_castps256_ps128(eights));
  const __m128 twos = _mm_add_ps(fours, _mm_shuffle_ps(fours, fours, 0x4E));
  return _mm_cvtss_f32(twos) + _mm_cvtss_f32(_mm_shuffle_ps(twos, twos, 0x55));
}
inline float reduce_max(F16 v) {
  const __m256 eights = _mm256_max_ps(v.hi, v.lo);
  const __m128 fours = _mm_max_ps(_mm256_extractf128_ps(eights, 1), _mm256_castps256_ps128(eights));
  const __m128 twos = _mm_max_ps(fours, _mm_shuffle_ps(fours, fours, 0x4E));
  return _mm_cvtss_f32(_mm_max_ss(twos, _mm_shuffle_ps(twos, twos, 0x55)));
}

inline F16 load_kept_or(M16 keep, const float* p, F16 fill) { return select(keep, load_kept(keep, p), fill); }
template <int kPredicate>
inline M16 compare(F16 a, F16 b) {
  return static_cast<M16>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, kPredicate)) |
                          _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, kPredicate)) << 8);
}
inline M16 unordered(F16 v) { return compare<_CMP_UNORD_Q>(v, v); }
inline M16 equal(F16 a, F16 b) { return compare<_CMP_EQ_OQ>(a, b); }

inline __m256 widen8(__m128i halves) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)); }
// Eight float32 lanes rounded to bfloat16 (as the AVX-512 form rounds), each left in its lane's
// high half: the float32 value of the rounded bfloat16.
inline __m256i round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_and_si256(_mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan),
                          _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}
inline __m128i narrow8(__m256 v) {  // round8's bfloat16 values, packed
  const __m256i high = _mm256_srli_epi32(round8(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}
inline F16 widen_bf16(const c10::BFloat16* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {widen8(_mm256_castsi256_si128(halves)), widen8(_mm256_extracti128_si256(halves, 1))};
}
// A partial load or store goes through 16 values on the stack: AVX2 has no 16-bit masked moves (only
// a row's last few elements take this path).
inline F16 widen_bf16_kept(M16 keep, const c10::BFloat16* p) {
  if (keep == 0xFFFF) return widen_bf16(p);
  alignas(32) c10::BFloat16 kept[16] = {};
  for (int i = 0; i < 16; ++i)
    if (keep >> i & 1) kept[i] = p[i];
  return widen_bf16(kept);
}
inline void store_bf16_kept(c10::BFloat16* p, M16 keep, F16 v) {
  alignas(32) c10::BFloat16 rounded[16];
  c10::BFloat16* out = keep == 0xFFFF ? p : rounded;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), narrow8(v.lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), narrow8(v.hi));
  if (out == rounded)
    for (int i = 0; i < 16; ++i)
      if (keep >> i & 1) p[i] = rounded[i];
}
inline F16 round_bf16(F16 v) { return {_mm256_castsi256_ps(round8(v.lo)), _mm256_castsi256_ps(round8(v.hi))}; }

#endif

// The first n of 16 lanes (all 16 from n >= 16).
inline M16 lanes_below(int64_t n) { return n >= 16 ? static_cast<M16>(0xFFFF) : static_cast<M16>((1u << n) - 1); }

}  // namespace genfn_kernels::simd
