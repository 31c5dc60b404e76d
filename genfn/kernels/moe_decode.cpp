// A mixture-of-experts MLP's decode step that reads only the experts the router chose.
//
//   moe_decode(x [T, H], experts [T, k] int64, weights [T, k], gate_up [E, 2I, H], down [E, H, I])
//     -> (out [T, H], bytes_read [] int64)
//
// For each row t and each of its k chosen experts e (with weight w):
//   out[t] += w * down[e] @ (silu(gate_up[e][:I] @ x[t]) * gate_up[e][I:] @ x[t])
// accumulated in the order the router listed them, in float32. A decode step has a few rows, so
// the step is bound by streaming weights: torch's dense formulation (every expert on every row,
// zero-weighted where unchosen) reads all E experts, a gather copies the chosen ones first; this
// reads each chosen expert's 3 * I * H weights once per row that chose it and nothing else. The
// rows of an expert's matrices are split over the threads (at::parallel_for), so one row of x
// uses every core. ``bytes_read`` is the weight bytes the call read, so a test can count what a
// token touched. float32 only (the caller falls back to torch otherwise).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

std::tuple<at::Tensor, at::Tensor> moe_decode(const at::Tensor& x, const at::Tensor& experts,
                                              const at::Tensor& weights, const at::Tensor& gate_up,
                                              const at::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_decode: x must be [T, H] float32");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == at::kFloat &&
                  down.scalar_type() == at::kFloat,
              "moe_decode: gate_up [E, 2I, H] and down [E, H, I] must be float32");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == x.size(0),
              "moe_decode: experts must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == experts.sizes(), "moe_decode: weights must have experts' shape");
  const int64_t rows = x.size(0), hidden = x.size(1), top_k = experts.size(1);
  const int64_t num_experts = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(2) == hidden && down.size(1) == hidden && down.size(2) == inter &&
                  down.size(0) == num_experts,
              "moe_decode: expert shapes disagree with x");
  auto xc = x.contiguous();
  auto gu = gate_up.contiguous();
  auto dn = down.contiguous();
  auto ex = experts.contiguous();
  auto wt = weights.to(at::kFloat).contiguous();
  auto out = at::zeros({rows, hidden}, x.options());
  std::vector<float> act(inter);
  int64_t read = 0;
  for (int64_t t = 0; t < rows; ++t) {
    const float* xt = xc.data_ptr<float>() + t * hidden;
    float* ot = out.data_ptr<float>() + t * hidden;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ex.data_ptr<int64_t>()[t * top_k + j];
      TORCH_CHECK(e >= 0 && e < num_experts, "moe_decode: expert index ", e, " out of range");
      const float w = wt.data_ptr<float>()[t * top_k + j];
      const float* g = gu.data_ptr<float>() + e * 2 * inter * hidden;
      const float* u = g + inter * hidden;
      const float* d = dn.data_ptr<float>() + e * hidden * inter;
      float* a = act.data();
      at::parallel_for(0, inter, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          const float gate = dot(g + r * hidden, xt, hidden);
          const float up = dot(u + r * hidden, xt, hidden);
          a[r] = gate / (1.0f + std::exp(-gate)) * up;
        }
      });
      at::parallel_for(0, hidden, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) ot[r] += w * dot(d + r * inter, a, inter);
      });
      read += 3 * inter * hidden * static_cast<int64_t>(sizeof(float));
    }
  }
  return {out, at::scalar_tensor(read, x.options().dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("moe_decode(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, Tensor down) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) { m.impl("moe_decode", &moe_decode); }
