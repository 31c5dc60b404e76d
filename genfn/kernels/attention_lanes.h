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

using simd::F16;
using simd::M16;

inline F16 load_lanes(const float* p) { return simd::loadu(p); }
inline F16 load_lanes(const c10::BFloat16* p) { return simd::widen_bf16(p); }

// e^x for x <= 0 (scores minus their maximum): 2^n * p(f) with a degree-6 polynomial on
// f in [-ln2/2, ln2/2] (relative error ~2e-7, about float32's own); -inf and very negative give 0.
inline F16 exp_lanes(F16 x) {
  using namespace simd;
  const F16 log2e = set1(1.44269504088896341f);
  const F16 ln2_hi = set1(0.693359375f), ln2_lo = set1(-2.12194440e-4f);
  x = max(x, set1(-87.3f));
  const F16 n = round_nearest(mul(x, log2e));
  F16 f = fnmadd(n, ln2_hi, x);
  f = fnmadd(n, ln2_lo, f);
  F16 p = set1(1.3981999507e-3f);
  p = fmadd(p, f, set1(8.3334519073e-3f));
  p = fmadd(p, f, set1(4.1665795894e-2f));
  p = fmadd(p, f, set1(1.6666665459e-1f));
  p = fmadd(p, f, set1(5.0000001201e-1f));
  p = fmadd(p, mul(f, f), f);
  p = add(p, set1(1.f));
  return scalef(p, n);
}

// s[i] = e^(s[i] - max(s)) in place over s[0 .. n) (n >= 1); returns their sum.
inline float exponentiate(float* s, int64_t n) {
  using namespace simd;
  F16 top = set1(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) top = max(top, loadu(s + i));
  float m = reduce_max(top);
  for (; i < n; ++i) m = std::max(m, s[i]);
  const F16 mv = set1(m);
  F16 total = zero();
  for (i = 0; i < n; i += kLanes) {
    const M16 k = lanes_below(n - i);
    const F16 e = exp_lanes(sub(load_kept(k, s + i), mv));
    total = add(total, keep_only(k, e));
    store_kept(s + i, k, e);
  }
  return reduce_add(total);
}

// Softmax of s[0 .. n) in place (n >= 1).
inline void softmax(float* s, int64_t n) {
  using namespace simd;
  const F16 inv = set1(1.f / exponentiate(s, n));
  for (int64_t i = 0; i < n; i += kLanes) {
    const M16 k = lanes_below(n - i);
    store_kept(s + i, k, mul(load_kept(k, s + i), inv));
  }
}

// s[i] = tanh(s[i] / cap) * cap over s[0 .. n) (Gemma 2's soft-capped scores), tanh(z) as
// 1 - 2 / (e^(2z) + 1) in 16 lanes (the tail masked): every score by the same arithmetic, wherever it sits.
inline void soft_cap(float* s, int64_t n, float cap) {
  using namespace simd;
  const F16 inv = set1(1.f / cap), capv = set1(cap), one = set1(1.f);
  const F16 two = set1(2.f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const M16 k = lanes_below(n - i);
    const F16 z = mul(load_kept(k, s + i), inv);
    const F16 e = genfn_kernels::exp16(mul(z, two));
    const F16 t = sub(one, div(two, add(e, one)));
    store_kept(s + i, k, mul(t, capv));
  }
}

// The lanes of each of d[0 .. 16) summed into lane s of the result for d[s], by the tree that
// _mm512_reduce_add_ps sums one vector with (lane i with lane i + 8, those sums four lanes apart,
// then two, then one): float addition commutes, so the same pairs give each sum its bits.
#if defined(__AVX512F__)
// In 15 adds and 30 shuffles for 16 vectors where that took 64 of each. The shuffles leave the sum
// of input p in lane 4 (p % 4) + p / 4, so input p is d[4 (p % 4) + p / 4].
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
#else
// Eight vectors at a time, as a transpose's adds: each vector's halves (lanes i, i + 8), then
// pairs of those in one register's 128-bit halves (four apart), then two apart, then one. The
// shuffles leave the sum of input k in lane k / 2 + 4 (k % 2), so input k is d[kOrder[k]].
inline __m256 sum_lanes_of_8(const F16* d) {
  constexpr int kOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};
  __m256 e[8];
  for (int k = 0; k < 8; ++k) e[k] = _mm256_add_ps(d[kOrder[k]].hi, d[kOrder[k]].lo);
  __m256 f[4];  // [e[2k]'s lanes i + (i + 4) | e[2k + 1]'s]
  for (int k = 0; k < 4; ++k)
    f[k] = _mm256_add_ps(_mm256_permute2f128_ps(e[2 * k], e[2 * k + 1], 0x31),
                         _mm256_permute2f128_ps(e[2 * k], e[2 * k + 1], 0x20));
  __m256 g[2];  // lanes i, i + 2 of each quarter, two inputs a 128-bit half
  for (int k = 0; k < 2; ++k)
    g[k] = _mm256_add_ps(_mm256_shuffle_ps(f[2 * k], f[2 * k + 1], 0x44), _mm256_shuffle_ps(f[2 * k], f[2 * k + 1], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(g[0], g[1], 0x88), _mm256_shuffle_ps(g[0], g[1], 0xDD));
}
inline F16 sum_lanes_of_16(const F16* d) { return {sum_lanes_of_8(d), sum_lanes_of_8(d + 8)}; }
#endif

// q . k in 16 lanes: the products of head_dim's 16-wide slices chained in order.
template <typename T, int V>
inline F16 dot_lanes(const F16* q, const T* k) {
  F16 dot = simd::mul(q[0], load_lanes(k));
  for (int j = 1; j < V; ++j) dot = simd::fmadd(q[j], load_lanes(k + j * kLanes), dot);
  return dot;
}

}  // namespace genfn_kernels::lanes
