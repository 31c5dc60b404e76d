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
using simd::F16;
using simd::M16;

// The value a store then a load of T gives: the rounding the model code's `.to(dtype)` makes.
inline F16 round_to(float*, F16 v) { return v; }
inline F16 round_to(c10::BFloat16*, F16 v) { return simd::round_bf16(v); }

// out = w * to_T(x * rsqrt(mean(x^2) + eps)), the squares summed in 16 lanes.
template <typename T>
void norm_row(const T* x, const T* w, int64_t E, float eps, T* out) {
  using namespace simd;
  F16 squares = zero();
  for (int64_t e = 0; e < E; e += kLanes) {
    const F16 v = load16(x + e, lanes_below(E - e));
    squares = fmadd(v, v, squares);
  }
  const F16 r = set1(1.f / std::sqrt(reduce_add(squares) / static_cast<float>(E) + eps));
  for (int64_t e = 0; e < E; e += kLanes) {
    const M16 keep = lanes_below(E - e);
    const F16 normed = round_to(out, mul(load16(x + e, keep), r));
    store16(out + e, mul(load16(w + e, keep), normed), keep);
  }
}

// out = x + d.
template <typename T>
void add_row(const T* x, const T* d, int64_t E, T* out) {
  for (int64_t e = 0; e < E; e += kLanes) {
    const M16 keep = simd::lanes_below(E - e);
    store16(out + e, simd::add(load16(x + e, keep), load16(d + e, keep)), keep);
  }
}

// One head x[0 .. D) rotated into out (which may be x): x * cos + rotate_half(x) * sin,
// rotate_half(x) = (-x2, x1).
template <typename T>
void rotate_head(const T* x, const T* cos, const T* sin, int64_t D, T* out) {
  using namespace simd;
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const M16 keep = lanes_below(half - i);
    const F16 a = load16(x + i, keep), b = load16(x + half + i, keep);
    store16(out + i, fnmadd(b, load16(sin + i, keep), mul(a, load16(cos + i, keep))), keep);
    store16(out + half + i, fmadd(a, load16(sin + half + i, keep), mul(b, load16(cos + half + i, keep))), keep);
  }
}

// out = silu(gate) * up over F elements.
template <typename T>
void silu_mul_row(const T* gate, const T* up, int64_t F, T* out) {
  for (int64_t f = 0; f < F; f += kLanes) {
    const M16 keep = simd::lanes_below(F - f);
    store16(out + f, simd::mul(silu16(load16(gate + f, keep)), load16(up + f, keep)), keep);
  }
}

}  // namespace genfn_kernels::rows
