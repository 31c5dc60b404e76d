// The activations' Q8_K quantization (kquant.h's quantize_rows_k, kquant_quantize.h's spans), as
// llama.cpp's quantize_row_q8_K_ref computes it: per block, the input of largest magnitude (the
// first, on ties) maps to -127, codes round half to even and are capped at 127, the scale is the
// reciprocal of -127 / that input; code sums per 16 inputs in natural order; then the codes are
// laid out in the row kernels' order.
//
// Two forms with the same bits: plain C++ (baseline x86-64) and AVX-512, 16 inputs a register,
// which a decode step's row of 8192 inputs takes in a fraction of the plain loop's time. Each
// span of whole blocks is independent of the others, which lets the threads of a region share one
// row out (kquant_linear.cpp's quantize_share).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kquant_quantize.h"

namespace {

using namespace genfn::kquant;

// Where each 16 inputs of a whole 128 go in an order (kquant.h), in units of 16: kQ4KOrder moves
// runs of 32 from 0, 64, 32, 96; kIQ4Order runs of 16 from 0, 32, 64, 96, 16, 48, 80, 112.
constexpr int kDestination[3][8] = {
    {0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 4, 5, 2, 3, 6, 7}, {0, 4, 1, 5, 2, 6, 3, 7}};

// Where natural input o (a multiple of 16) of a row of K goes: permuted within whole 128s; a
// shorter tail stays natural.
inline int64_t destination(int64_t o, int64_t K, Order order) {
  const int64_t base = o & ~int64_t{127};
  if (base + 128 > K) return o;
  return base + 16 * kDestination[order][(o & 127) / 16];
}

void quantize_span_plain(const float* x, int64_t m, int64_t k0, int64_t k1, int64_t block, Order order,
                         ActivationsK& a) {
  const int64_t K = a.K, nb = K / block;
  const float* row = x + m * K;
  int8_t* out = a.codes.data() + m * K;
  int8_t natural[256];  // a block's codes before the order moves them
  for (int64_t start = k0; start < k1; start += block) {
    const float* v = row + start;
    float amax = 0.0f, extreme = 0.0f;
    for (int j = 0; j < block; ++j) {
      const float ax = std::fabs(v[j]);
      if (ax > amax) { amax = ax; extreme = v[j]; }
    }
    float& scale = a.scale[m * nb + start / block];
    if (amax == 0.0f) {
      scale = 0.0f;
      std::fill(natural, natural + block, 0);
    } else {
      const float inverse = -127.0f / extreme;
      for (int j = 0; j < block; ++j) {
        // Rounded half to even as nearbyint rounds (|inverse * v| <= 127: adding 1.5 * 2^23 leaves no
        // fraction bits), without a call to nearbyintf per input (this code is baseline x86-64: no
        // SSE4.1 round, and no FMA to fuse the product into the sum).
        const int q = static_cast<int>((inverse * v[j] + 12582912.0f) - 12582912.0f);
        natural[j] = static_cast<int8_t>(std::min(127, q));
      }
      scale = 1.0f / inverse;
    }
    for (int g = 0; g < block / 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += natural[16 * g + j];
      a.sums[m * (K / 16) + start / 16 + g] = static_cast<int16_t>(s);
      std::memcpy(out + destination(start + 16 * g, K, order), natural + 16 * g, 16);
    }
  }
}

GENFN_AVX512 void quantize_span_avx512(const float* x, int64_t m, int64_t k0, int64_t k1, int64_t block, Order order,
                                       ActivationsK& a) {
  const int64_t K = a.K, nb = K / block;
  const float* row = x + m * K;
  int8_t* out = a.codes.data() + m * K;
  const __m512i most = _mm512_set1_epi32(127);
  for (int64_t start = k0; start < k1; start += block) {
    const float* v = row + start;
    __m512 top = _mm512_setzero_ps();
    for (int j = 0; j < block; j += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(v + j)));
    const float amax = _mm512_reduce_max_ps(top);
    float& scale = a.scale[m * nb + start / block];
    int16_t* sums = a.sums.data() + m * (K / 16) + start / 16;
    if (amax == 0.0f) {
      scale = 0.0f;
      for (int j = 0; j < block; j += 16) {
        std::memset(out + destination(start + j, K, order), 0, 16);
        sums[j / 16] = 0;
      }
      continue;
    }
    // The first input of that magnitude: the one the plain loop's strict '>' keeps.
    int first = 0;
    for (int j = 0; j < block; j += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(v + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
      if (hit) {
        first = j + __builtin_ctz(hit);
        break;
      }
    }
    const float inverse = -127.0f / v[first];
    const __m512 times = _mm512_set1_ps(inverse);
    for (int j = 0; j < block; j += 16) {
      // nearbyint of the product, as the plain loop's sum and difference with 1.5 * 2^23 round it
      const __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(times, _mm512_loadu_ps(v + j)),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i q = _mm512_min_epi32(_mm512_cvttps_epi32(rounded), most);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + destination(start + j, K, order)), _mm512_cvtepi32_epi8(q));
      sums[j / 16] = static_cast<int16_t>(_mm512_reduce_add_epi32(q));
    }
    scale = 1.0f / inverse;
  }
}

}  // namespace

void genfn::kquant::quantize_span_k(const float* x, int64_t m, int64_t k0, int64_t k1, int64_t block, Order order,
                                    bool avx512, ActivationsK& a) {
  if (avx512) quantize_span_avx512(x, m, k0, k1, block, order, a);
  else quantize_span_plain(x, m, k0, k1, block, order, a);
  // The span's code sums per 32 inputs, from its sums per 16 (either form wrote those).
  const int16_t* sums = a.sums.data() + m * (a.K / 16) + k0 / 16;
  int16_t* pairs = a.sums32.data() + m * (a.K / 32) + k0 / 32;
  for (int64_t g = 0; g < (k1 - k0) / 32; ++g) pairs[g] = static_cast<int16_t>(sums[2 * g] + sums[2 * g + 1]);
  if (!a.offsets8.empty()) {  // where the kernels' lanes start (kquant.h's offsets8)
    const int8_t* codes = a.codes.data() + m * a.K + k0;
    int32_t* starts = a.offsets8.data() + m * (a.K / 8) + k0 / 8;
    const auto quad = [codes](int64_t i) { return codes[i] + codes[i + 1] + codes[i + 2] + codes[i + 3]; };
    if (order == kIQ4Order) {
      for (int64_t run = 0; run < (k1 - k0) / 128; ++run)
        for (int64_t i = 0; i < 16; ++i)
          starts[16 * run + i] = -128 * (quad(128 * run + 4 * i) + quad(128 * run + 64 + 4 * i));
    } else {
      for (int64_t g = 0; g < (k1 - k0) / 16; ++g) {
        starts[2 * g] = -32 * (quad(16 * g) + quad(16 * g + 8));
        starts[2 * g + 1] = -32 * (quad(16 * g + 4) + quad(16 * g + 12));
      }
    }
  }
}

void genfn::kquant::quantize_rows_k(const float* x, int64_t m0, int64_t m1, int64_t K, int64_t block, Order order,
                                    ActivationsK& a) {
  for (int64_t m = m0; m < m1; ++m) quantize_span_k(x, m, 0, K, block, order, quantize_avx512(), a);
}

namespace {

// For tests: x [M, K] quantized span by span (quantize_unit(block) inputs each) in the plain or
// the AVX-512 form: codes [M, K] laid out in `order` (0 natural, 1 Q4_K's, 2 IQ4's), scales
// [M, K / block], sums [M, K / 16].
std::tuple<at::Tensor, at::Tensor, at::Tensor> kquant_quantize_activations(const at::Tensor& x, int64_t block,
                                                                           int64_t order, bool avx512) {
  TORCH_CHECK(block == 32 || block == 256, "kquant_quantize_activations: block must be 32 or 256, got ", block);
  TORCH_CHECK(order >= kNatural && order <= kIQ4Order, "kquant_quantize_activations: order must be 0, 1 or 2, got ",
              order);
  TORCH_CHECK(!avx512 || quantize_avx512(), "kquant_quantize_activations: this CPU has no AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % block == 0,
              "kquant_quantize_activations: x must be float32 [M, K] with K a multiple of ", block);
  const at::Tensor xc = x.contiguous();
  ActivationsK a;
  a.resize(x.size(0), x.size(1), block);
  const int64_t unit = quantize_unit(block);
  for (int64_t m = 0; m < a.M; ++m)
    for (int64_t k0 = 0; k0 < a.K; k0 += unit)
      quantize_span_k(xc.data_ptr<float>(), m, k0, std::min(k0 + unit, a.K), block, static_cast<Order>(order), avx512,
                      a);
  auto codes = at::empty({a.M, a.K}, x.options().dtype(at::kChar));
  auto scale = at::empty({a.M, a.K / block}, x.options());
  auto sums = at::empty({a.M, a.K / 16}, x.options().dtype(at::kShort));
  std::memcpy(codes.data_ptr<int8_t>(), a.codes.data(), a.codes.size());
  std::memcpy(scale.data_ptr<float>(), a.scale.data(), a.scale.size() * sizeof(float));
  std::memcpy(sums.data_ptr<int16_t>(), a.sums.data(), a.sums.size() * sizeof(int16_t));
  return {codes, scale, sums};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kquant, m) {
  m.def("kquant_quantize_activations(Tensor x, int block, int order, bool avx512) -> (Tensor, Tensor, Tensor)",
        &kquant_quantize_activations);
}
