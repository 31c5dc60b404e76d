// What the GEMMs of many rows of x (kquant_gemm.cpp: the K-quants and IQ4_XS; iq4nl_gemm.cpp: IQ4_NL)
// share: the walk over tiles of weight rows, a panel's transposition and the broadcast of four
// activation codes.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "kquant.h"

namespace genfn::kquant {

// 8 rows of 8 dwords at `from` (stride `pitch` bytes) written as 8 columns at `to` (stride 64 bytes).
GENFN_AVX2_INLINE inline void transpose_8x8(const uint8_t* from, int64_t pitch, uint8_t* to) {
  __m256i r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i * pitch));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 64 * i), _mm256_permute2x128_si256(r[i], r[i + 4], 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 64 * (i + 4)), _mm256_permute2x128_si256(r[i], r[i + 4], 0x31));
  }
}

// The activations of M rows quantized once for a GEMM, per `block` inputs in natural order (as the
// row kernels quantize them, so a block's codes and scale are theirs), the rows shared out among the
// threads; then(m0, m1) runs on each share once it is quantized.
template <typename Then>
void quantize_for_gemm(const float* x, int64_t M, int64_t K, int64_t block, ActivationsK& a, const Then& then) {
  a.resize(M, K, block);
  at::parallel_for(0, M, std::max<int64_t>(1, 4096 / std::max<int64_t>(K / 64, 1)), [&](int64_t m0, int64_t m1) {
    quantize_rows_k(x, m0, m1, K, block, kNatural, a);
    then(m0, m1);
  });
}

// Weight rows per tile (a panel): one per 32-bit lane of a 512-bit register.
constexpr int kPanelRows = 16;

// The GEMMs' outer loop over an N-row weight and M rows of x: threads split the tiles of kPanelRows
// weight rows (output columns, never the inputs); each unpacks a tile into a panel of its own,
// unpack(n0, rows, panel), then runs the rows of x over it `step` at a time, run(kernel, panel, m0,
// n0, keep) with `full` (the last M % step rows with `tail`); keep: the tile's live columns.
template <typename Panel, typename Kernel, typename Unpack, typename Run>
void over_tiles(int64_t M, int64_t N, int step, Kernel full, Kernel tail, const Unpack& unpack, const Run& run) {
  const int64_t tiles = (N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    thread_local Panel panel;  // each worker its own
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kPanelRows;
      const int rows = static_cast<int>(std::min<int64_t>(kPanelRows, N - n0));
      unpack(n0, rows, panel);
      const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1);
      int64_t m0 = 0;
      for (; m0 + step <= M; m0 += step) run(full, panel, m0, n0, keep);
      if (m0 < M) run(tail, panel, m0, n0, keep);
    }
  });
}

inline int32_t four_codes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IQ4_NL products of many rows (iq4nl_gemm.cpp), which kquant_gemm hands them to.
void iq4nl_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, Isa isa);

}  // namespace genfn::kquant
