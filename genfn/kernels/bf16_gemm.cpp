// y = x @ w.T for bfloat16 x with tens to hundreds of rows: continuous batching's linears.
//
// oneDNN's GEMM on a pre-packed weight reached ~45 % of this Zen 4's bfloat16 peak at 32 rows
// (~180-200 GFLOP/s on two cores against ~370 at 512 rows). This kernel is the textbook
// outer-product micro-kernel on `vdpbf16ps`: the weight is packed once into panels of 48 output
// columns with each pair of k interleaved ([N/48][K/2][48][2]), so one step of k-pairs loads three
// 64-byte vectors of the panel, broadcasts a pair of x values per row, and issues 3 x 8
// dot-products into 24 float32 accumulators. Products are summed in float32 and rounded once.
// Threads take contiguous runs of panels; within a panel, row blocks of 8 reuse it from L1/L2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include "decode_kernels.h"

namespace {

constexpr int64_t kPanel = 48;    // output columns per packed panel: three vectors of 16
constexpr int64_t kRowBlock = 8;  // rows of x per micro-kernel call

inline int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }
inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }

// packed[p][k2][c][j] = w[p * 48 + c][2 * k2 + j], zero outside w.
at::Tensor pack_bf16_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_gemm_weight: `weight` must be a 2-D bfloat16 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = panels_of(N), K2 = pairs_of(K);
  at::Tensor packed = at::zeros({P, K2, kPanel, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c) {
        const uint16_t* row = src + (p * kPanel + c) * K;
        uint16_t* out = dst + p * K2 * kPanel * 2 + c * 2;
        for (int64_t k = 0; k < K; ++k) out[(k / 2) * kPanel * 2 + (k % 2)] = row[k];
      }
  });
  return packed;
}

// Rows [0, R) of x (row stride K, K2 pairs read as 32-bit words) against one packed panel;
// writes columns [n0, n0 + width) of y (row stride N).
// `ahead` (or null): the next panel, fetched into L2 a step at a time while this one is summed, so
// the weight streams from memory under the arithmetic when few row blocks share each panel.
template <int R, typename Out>
__attribute__((target("avx512bw,avx512bf16"))) void micro_kernel(const uint32_t* x, int64_t x_words,
                                                                  const __m512bh* panel, int64_t K2,
                                                                  const float* bias, Out* y, int64_t N,
                                                                  int64_t width, const __m512bh* ahead) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k2 * 3), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k2 * 3 + 1), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k2 * 3 + 2), _MM_HINT_T1);
    }
    const __m512bh b0 = panel[k2 * 3], b1 = panel[k2 * 3 + 1], b2 = panel[k2 * 3 + 2];
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_words + k2]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
    }
  }
  for (int v = 0; v < 3; ++v) {
    const int64_t c = v * 16;
    if (c >= width) break;
    const __mmask16 keep = genfn_kernels::lanes_below(width - c);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + c) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) genfn_kernels::store16(y + r * N + c, _mm512_add_ps(acc[r][v], b), keep);
  }
}

template <typename Out>
void rows_against_panel(const uint32_t* x, int64_t x_words, int64_t M, const __m512bh* panel, int64_t K2,
                        const float* bias, Out* y, int64_t N, int64_t width, const __m512bh* ahead) {
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock, ahead = nullptr)
    micro_kernel<kRowBlock, Out>(x + m * x_words, x_words, panel, K2, bias, y + m * N, N, width, ahead);
  switch (M - m) {
#define GENFN_TAIL(R) \
  case R: return micro_kernel<R, Out>(x + m * x_words, x_words, panel, K2, bias, y + m * N, N, width, ahead);
    GENFN_TAIL(1)
    GENFN_TAIL(2)
    GENFN_TAIL(3)
    GENFN_TAIL(4)
    GENFN_TAIL(5)
    GENFN_TAIL(6)
    GENFN_TAIL(7)
#undef GENFN_TAIL
    default: return;
  }
}

// x [M, K] bfloat16; packed from pack_bf16_gemm_weight of an [N, K] weight; bias [N] float32 or
// bfloat16. Returns [M, N] float32 (out_float32) or bfloat16.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                     bool out_float32) {
  TORCH_CHECK(genfn_kernels::cpu_has_avx512_bf16(), "bf16_gemm: needs a CPU with AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "bf16_gemm: `x` must be a 2-D bfloat16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), K2 = pairs_of(K), P = panels_of(N);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == P && packed.size(1) == K2 && packed.size(2) == kPanel &&
                  packed.size(3) == 2 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
              "bf16_gemm: `packed` is not pack_bf16_gemm_weight's packing of an [", N, ", ", K, "] weight");
  // An odd K reads its last pair's second half from one element of zero padding per row.
  at::Tensor xc = K % 2 ? at::constant_pad_nd(x, {0, 1}) : x.contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_gemm: `bias` must be [", N, "], got ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  if (M == 0 || N == 0) return y;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.data_ptr<c10::BFloat16>());
  const __m512bh* pp = reinterpret_cast<const __m512bh*>(packed.data_ptr<c10::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t panel_vectors = K2 * 3;
  auto run = [&](auto* out) {
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, width = std::min<int64_t>(kPanel, N - n0);
        rows_against_panel(xp, K2, M, pp + p * panel_vectors, K2, bp ? bp + n0 : nullptr, out + n0, N, width,
                           p + 1 < end ? pp + (p + 1) * panel_vectors : nullptr);
      }
    });
  };
  if (out_float32) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("pack_bf16_gemm_weight(Tensor weight) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor packed, int N, Tensor? bias, bool out_float32) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("pack_bf16_gemm_weight", &pack_bf16_gemm_weight);
  m.impl("bf16_gemm", &bf16_gemm);
}
