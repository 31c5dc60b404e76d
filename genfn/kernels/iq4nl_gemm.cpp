// y = x @ dequantize(W).T for many rows of x (prefill, large batches) and W in IQ4_NL: an int8 GEMM
// over the blocks of 32 as the file stores them (genfn/quant/iq4.py), which kquant_gemm.cpp hands
// IQ4_NL products of gemm_min_rows rows and more to.
//
// The row kernels (iq4_linear.cpp) decode a weight row once per 8 rows of x. Here each thread takes
// tiles of 16 weight rows and decodes a tile once per call into a panel: the table's signed values
// with four inputs of one row per 32-bit lane ([block][8][16 rows][4]), each row's d per block, and
// -128 times each row's sum of values per block. Then every row of x runs over the panel:
// - AVX-512 VNNI: `vpdpbusd` of the activation codes moved up by 128 (a copy made once per call) against
//   the signed values, from the -128 sum w start, gives sum w x of one block for 16 weight rows;
// - AVX2: `vpmaddubsw` of |w| against x with w's sign, then `vpmaddwd` against ones, 8 weight rows
//   per register.
// The activations are quantized as the row kernels quantize them (per 32 inputs), so a block's
// integer is theirs, and it enters the output's float32 sum as theirs does (iq4_linear.cpp): times
// d_w * d_x, by one fused multiply-add, into lane b % 8 of eight, the lanes summed as reduce256
// sums them. Here the eight lanes are eight passes over the blocks (b = j, j + 8, ...), their sums
// kept per output and added in that tree at the end: the GEMM and the row kernels give an output
// the same bits.
#include <ATen/Parallel.h>

#include <algorithm>

#include "kquant_panel.h"

namespace genfn::kquant {
namespace {

constexpr int kTile = kPanelRows;
constexpr int64_t kBlock = 32;           // inputs per IQ4_NL block
constexpr int64_t kPanelBlock = kTile * kBlock;  // panel bytes per block
constexpr int kLanes = 8;                // the float32 sum's lanes (block b into lane b % 8)

struct Panel {
  std::vector<int8_t> codes;   // [nb][8][16][4]
  std::vector<float> d;        // [nb][16]
  std::vector<int32_t> start;  // [nb][16]: -128 sum w
};

// Weight rows n0 .. n0 + rows - 1 (rows <= 16; the rest of the tile zeros) at w into p.
GENFN_AVX2 void unpack_tile(const uint8_t* w, int64_t row_bytes, int rows, int64_t nb, Panel& p) {
  p.codes.resize(nb * kPanelBlock);
  p.d.assign(nb * kTile, 0.0f);
  p.start.assign(nb * kTile, 0);
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  alignas(64) int8_t natural[kTile][kBlock] = {};
  for (int64_t b = 0; b < nb; ++b) {
    for (int n = 0; n < rows; ++n) {
      const uint8_t* block = w + n * row_bytes + b * block_bytes(kIQ4NL);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
      const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4));  // inputs 0-15
      const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4));  // 16-31
      _mm_store_si128(reinterpret_cast<__m128i*>(natural[n]), lo);
      _mm_store_si128(reinterpret_cast<__m128i*>(natural[n] + 16), hi);
      int sum = 0;
      for (int i = 0; i < kBlock; ++i) sum += natural[n][i];
      p.d[b * kTile + n] = half_to_float(load_u16(block));
      p.start[b * kTile + n] = -128 * sum;
    }
    uint8_t* out = reinterpret_cast<uint8_t*>(p.codes.data() + b * kPanelBlock);
    for (int h = 0; h < 2; ++h) transpose_8x8(reinterpret_cast<const uint8_t*>(natural[8 * h]), kBlock, out + 32 * h);
  }
}

// The activations of M rows as the GEMM reads them: per 32 inputs in natural order, and (VNNI) their
// codes moved up by 128.
struct Activations {
  ActivationsK q8;
  std::vector<int8_t> flipped;
};

// The eight lanes of an output, summed as reduce256 sums a row kernel's (kquant.h):
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
GENFN_AVX512_INLINE inline __m512 lanes_tree(const __m512* l) {
  return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(l[0], l[4]), _mm512_add_ps(l[2], l[6])),
                       _mm512_add_ps(_mm512_add_ps(l[1], l[5]), _mm512_add_ps(l[3], l[7])));
}

GENFN_AVX2_INLINE inline __m256 lanes_tree(const __m256* l) {
  return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),
                       _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7])));
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI: rows m0 .. m0 + R - 1 of x against one panel; writes `keep` of its 16 columns.

template <int R>
GENFN_VNNI void panel_vnni(const Panel& p, int64_t nb, const Activations& a, int64_t m0, float* y, int64_t N,
                           __mmask16 keep) {
  const int64_t K = a.q8.K;
  __m512 lanes[R][kLanes];
  for (int j = 0; j < kLanes; ++j) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = j; b < nb; b += kLanes) {
      const int8_t* c = p.codes.data() + b * kPanelBlock;
      const __m512i start = _mm512_loadu_si512(p.start.data() + b * kTile);
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = start;
      for (int s = 0; s < 8; ++s) {
        const __m512i w = _mm512_loadu_si512(c + 64 * s);
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(four_codes(a.flipped.data() + (m0 + r) * K + b * kBlock + 4 * s)), w);
      }
      const __m512 d = _mm512_loadu_ps(p.d.data() + b * kTile);
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(a.q8.scale[(m0 + r) * nb + b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), scale, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) lanes[r][j] = acc[r];
  }
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(y + (m0 + r) * N, keep, lanes_tree(lanes[r]));
}

// ---------------------------------------------------------------------------------------------
// AVX2: the same over two halves of 8 weight rows, from the unmoved codes.

template <int R>
GENFN_AVX2 void panel_avx2(const Panel& p, int64_t nb, const Activations& a, int64_t m0, float* y, int64_t N,
                           __mmask16 keep) {
  const int64_t K = a.q8.K;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 lanes[R][2][kLanes];
  for (int j = 0; j < kLanes; ++j) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = j; b < nb; b += kLanes) {
      const int8_t* c = p.codes.data() + b * kPanelBlock;
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * s));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * s + 32));
        const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(four_codes(a.q8.codes.data() + (m0 + r) * K + b * kBlock + 4 * s));
          dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(x, w0)), ones));
          dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(x, w1)), ones));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_loadu_ps(p.d.data() + b * kTile + 8 * h);
        for (int r = 0; r < R; ++r) {
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(a.q8.scale[(m0 + r) * nb + b]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), scale, acc[r][h]);
        }
      }
    }
    for (int r = 0; r < R; ++r) lanes[r][0][j] = acc[r][0], lanes[r][1][j] = acc[r][1];
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kTile];
    for (int h = 0; h < 2; ++h)
      _mm256_store_ps(out + 8 * h, lanes_tree(lanes[r][h]));
    for (int n = 0; n < kTile; ++n)
      if (keep >> n & 1) y[(m0 + r) * N + n] = out[n];
  }
}

using PanelFn = void (*)(const Panel&, int64_t, const Activations&, int64_t, float*, int64_t, __mmask16);

// Rows of x one call of a panel kernel takes: AVX-512 keeps 8 rows' dot products and sums in its 32
// registers, AVX2 2 in its 16.
constexpr int kRowsVnni = 8, kRowsAvx2 = 2;

PanelFn pick_panel(bool vnni, int rows) {
  if (vnni) {
    switch (rows) {
      case 1: return &panel_vnni<1>;
      case 2: return &panel_vnni<2>;
      case 3: return &panel_vnni<3>;
      case 4: return &panel_vnni<4>;
      case 5: return &panel_vnni<5>;
      case 6: return &panel_vnni<6>;
      case 7: return &panel_vnni<7>;
      default: return &panel_vnni<8>;
    }
  }
  return rows == 1 ? &panel_avx2<1> : &panel_avx2<2>;
}

}  // namespace

void iq4nl_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, Isa isa) {
  thread_local Activations buffers;  // reused across calls; the workers read the caller's
  Activations& a = buffers;
  const bool vnni = isa == kAvx512 && has_vnni();
  if (vnni) a.flipped.resize(M * K);
  quantize_for_gemm(x, M, K, kBlock, a.q8, [&](int64_t m0, int64_t m1) {
    if (vnni)
      for (int64_t i = m0 * K; i < m1 * K; ++i) a.flipped[i] = static_cast<int8_t>(a.q8.codes[i] ^ 0x80);
  });
  const int64_t nb = K / kBlock, row_bytes = nb * block_bytes(kIQ4NL);
  const int step = vnni ? kRowsVnni : kRowsAvx2;
  const PanelFn full = pick_panel(vnni, step), tail = pick_panel(vnni, static_cast<int>(M % step));
  over_tiles<Panel>(
      M, N, step, full, tail,
      [&](int64_t n0, int rows, Panel& panel) { unpack_tile(w + n0 * row_bytes, row_bytes, rows, nb, panel); },
      [&](PanelFn kernel, const Panel& panel, int64_t m0, int64_t n0, __mmask16 keep) {
        kernel(panel, nb, a, m0, y + n0, N, keep);
      });
}

}  // namespace genfn::kquant
