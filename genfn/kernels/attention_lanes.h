// The 16-lane float32 arithmetic of the decode attention (decode_attention.cpp): loads that widen the
// cache's dtype, the softmax's exponentials and sums, soft-capping, and scores' dot products and
// their sums of lanes.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "decode_kernels.h"

namespace genfn_kernels::lanes {

constexpr int kLanes = 16;

inline void narrow(float* p, float v) { *p = v; }
inline void narrow(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_lanes(const c10::BFloat16* p) {
  return genfn_kernels::widen_bfloat16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x for x <= 0 (scores minus their maximum): 2^n * p(f) with a degree-6 polynomial on
// f in [-ln2/2, ln2/2] (relative error ~2e-7, about float32's own); -inf and very negative give 0.
inline __m512 exp_lanes(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, ln2_hi, x);
  f = _mm512_fnmadd_ps(n, ln2_lo, f);
  __m512 p = _mm512_set1_ps(1.3981999507e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), f);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// s[i] = e^(s[i] - max(s)) in place over s[0 .. n) (n >= 1); returns their sum.
inline float exponentiate(float* s, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) top = _mm512_max_ps(top, _mm512_loadu_ps(s + i));
  float m = _mm512_reduce_max_ps(top);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (i = 0; i < n; i += kLanes) {
    const __mmask16 k = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, e));
    _mm512_mask_storeu_ps(s + i, k, e);
  }
  return _mm512_reduce_add_ps(total);
}

// Softmax of s[0 .. n) in place (n >= 1).
inline void softmax(float* s, int64_t n) {
  const __m512 inv = _mm512_set1_ps(1.f / exponentiate(s, n));
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 k = n - i >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv));
  }
}

// s[i] = tanh(s[i] / cap) * cap over s[0 .. n) (Gemma 2's soft-capped scores), tanh(z) as
// 1 - 2 / (e^(2z) + 1) in 16 lanes (the tail masked): every score by the same arithmetic, wherever it sits.
inline void soft_cap(float* s, int64_t n, float cap) {
  const __m512 inv = _mm512_set1_ps(1.f / cap), capv = _mm512_set1_ps(cap), one = _mm512_set1_ps(1.f);
  const __m512 two = _mm512_set1_ps(2.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 k = genfn_kernels::lanes_below(n - i);
    const __m512 z = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + i), inv);
    const __m512 e = genfn_kernels::exp16(_mm512_mul_ps(z, two));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
    _mm512_mask_storeu_ps(s + i, k, _mm512_mul_ps(t, capv));
  }
}

// The lanes of each of d[0 .. 16) summed into lane s of the result for d[s], by the tree that
// _mm512_reduce_add_ps sums one vector with (lane i with lane i + 8, those sums four lanes apart,
// then two, then one): float addition commutes, so the same pairs give each sum its bits, in 15
// adds and 30 shuffles for 16 vectors where that took 64 of each. The shuffles leave the sum of
// input p in lane 4 (p % 4) + p / 4, so input p is d[4 (p % 4) + p / 4].
inline __m512 sum_lanes_of_16(const __m512* d) {
  __m512 eights[8], fours[4], twos[2];
  for (int k = 0; k < 8; ++k) {  // [a's lanes i + (i + 8) | b's]
    const int p = 2 * k, r = 2 * k + 1;
    const __m512 a = d[(p % 4) * 4 + p / 4], b = d[(r % 4) * 4 + r / 4];
    eights[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int k = 0; k < 4; ++k)  // four inputs' sums of lanes i, i + 4 (of the eights) in each quarter
    fours[k] = _mm512_add_ps(_mm512_shuffle_f32x4(eights[2 * k], eights[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(eights[2 * k], eights[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k) {  // lanes i, i + 2 of each quarter
    const __m512d a = _mm512_castps_pd(fours[2 * k]), b = _mm512_castps_pd(fours[2 * k + 1]);
    twos[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(twos[0], twos[1], 0x88), _mm512_shuffle_ps(twos[0], twos[1], 0xDD));
}

// q . k in 16 lanes: the products of head_dim's 16-wide slices chained in order.
template <typename T, int V>
inline __m512 dot_lanes(const __m512* q, const T* k) {
  __m512 dot = _mm512_mul_ps(q[0], load_lanes(k));
  for (int j = 1; j < V; ++j) dot = _mm512_fmadd_ps(q[j], load_lanes(k + j * kLanes), dot);
  return dot;
}

}  // namespace genfn_kernels::lanes
