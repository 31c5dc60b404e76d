// The per-token work around a layer's linears and attention, one row at a time: RMS norm, the
// residual add, RoPE on one head, SwiGLU. Float32 inside, rounded to the activation type T where
// the model code converts (the norm's `.to(dtype)` and each op's output). One definition for
// every path that runs a token through a layer: the packed forward's ops (token_ops.cpp), the
// decode layer and the stack of layers (decode_layer.h), so that a token gets the same bits
// whichever of them runs it (continuous batching's mixed forwards against generate's step).
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "decode_kernels.h"

namespace genfn_kernels::rows {

inline constexpr int64_t kLanes = 16;

// The value a store then a load of T gives: the rounding the model code's `.to(dtype)` makes.
inline __m512 round_to(float*, __m512 v) { return v; }
inline __m512 round_to(c10::BFloat16*, __m512 v) { return widen_bfloat16(round_to_bfloat16(v)); }

// out = w * to_T(x * rsqrt(mean(x^2) + eps)), the squares summed in 16 lanes.
template <typename T>
void norm_row(const T* x, const T* w, int64_t E, float eps, T* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t e = 0; e < E; e += kLanes) {
    const __m512 v = load16(x + e, lanes_below(E - e));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(E) + eps));
  for (int64_t e = 0; e < E; e += kLanes) {
    const __mmask16 keep = lanes_below(E - e);
    const __m512 normed = round_to(out, _mm512_mul_ps(load16(x + e, keep), r));
    store16(out + e, _mm512_mul_ps(load16(w + e, keep), normed), keep);
  }
}

// out = x + d.
template <typename T>
void add_row(const T* x, const T* d, int64_t E, T* out) {
  for (int64_t e = 0; e < E; e += kLanes) {
    const __mmask16 keep = lanes_below(E - e);
    store16(out + e, _mm512_add_ps(load16(x + e, keep), load16(d + e, keep)), keep);
  }
}

// One head x[0 .. D) rotated into out (which may be x): x * cos + rotate_half(x) * sin,
// rotate_half(x) = (-x2, x1).
template <typename T>
void rotate_head(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const __mmask16 keep = lanes_below(half - i);
    const __m512 a = load16(x + i, keep), b = load16(x + half + i, keep);
    store16(out + i, _mm512_fnmadd_ps(b, load16(sin + i, keep), _mm512_mul_ps(a, load16(cos + i, keep))), keep);
    store16(out + half + i,
            _mm512_fmadd_ps(a, load16(sin + half + i, keep), _mm512_mul_ps(b, load16(cos + half + i, keep))), keep);
  }
}

// out = silu(gate) * up over F elements.
template <typename T>
void silu_mul_row(const T* gate, const T* up, int64_t F, T* out) {
  for (int64_t f = 0; f < F; f += kLanes) {
    const __mmask16 keep = lanes_below(F - f);
    store16(out + f, _mm512_mul_ps(silu16(load16(gate + f, keep)), load16(up + f, keep)), keep);
  }
}

}  // namespace genfn_kernels::rows
