// The work of a packed forward outside its GEMMs and attention, one call per step of the layer,
// and the greedy pick over its logits.
//
// Continuous batching runs its forward eagerly over tens to hundreds of tokens: the linears are
// oneDNN GEMMs, and between them torch ran RMS norm as eight kernels (widen, square, mean, add,
// rsqrt, scale, narrow, weight), RoPE as ten (split, negate, cat, four products, two sums, per q
// and k), SwiGLU as a strided silu and a product. In a 32-token SmolLM2 bfloat16 step those ~250
// small calls cost ~15 ms of ~85 (torch profiler), most of it dispatch and bfloat16 round trips.
// Each op here is one pass over its rows, in float32, rounded once to the activation dtype where
// the model code converts (the norm's `.to(dtype)` and each op's output), as the compiled step's
// fused kernels round.
//
//   rms_norm(x, w):           w * to_T(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, d, w):    s = to_T(x + d); (s, rms_norm(s, w))        the residual and the norm
//   rope_qkv(qkv, cos, sin):  q, k rotated (rotate-half form), v copied: [T, heads, D] each
//   silu_mul(gate_up):        silu(gate) * up, gate and up the two halves of the last dimension
//   max_logsumexp(logits):    each row's argmax (torch.argmax's: the first maximum, a NaN first)
//                             and logsumexp, in one read of a [R, V] float32 row (torch's argmax
//                             and log_softmax took ~3 ms of a 32-row, 49152-token step)
//   argmax_rows(logits):      each row's argmax alone (the greedy pick without log-probabilities:
//                             torch.argmax took ~70-95 us of a one-row 49152-token step)
//
// Written against lanes16.h (row_ops.h), so both decode libraries build it with the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "row_ops.h"

namespace {

using namespace genfn_kernels::rows;
using genfn_kernels::lanes_below;

// Runs fn(T{}) for the tensor's element type (the ops check it is one of the two).
template <typename Fn>
void dispatch(at::ScalarType type, Fn&& fn) {
  if (type == at::kFloat) fn(float{});
  else fn(c10::BFloat16{});
}

// Rows per task: the parallel region costs ~10 us, a row of these a fraction of a microsecond.
constexpr int64_t kGrainRows = 64;

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), op, ": `", name,
              "` must be a contiguous 2-D CPU tensor, got shape ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": `", name,
              "` must be float32 or bfloat16, got ", x.scalar_type());
}

void check_norm_weight(const at::Tensor& w, const at::Tensor& x, const char* op) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              op, ": `weight` must be a contiguous [", x.size(1), "] tensor of x's dtype, got ", w.sizes(), " ",
              w.scalar_type());
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_norm_weight(weight, x, "rms_norm");
  at::Tensor out = at::empty_like(x);
  const int64_t E = x.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) norm_row(xp + t * E, wp, E, static_cast<float>(eps), op + t * E);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows(x, "add_rms_norm", "x");
  check_rows(delta, "add_rms_norm", "delta");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: `delta` must match x's shape and dtype, got ", delta.sizes(), " against ", x.sizes());
  check_norm_weight(weight, x, "add_rms_norm");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t E = x.size(1);
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *dp = delta.data_ptr<scalar_t>(), *wp = weight.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        add_row(xp + t * E, dp + t * E, E, sp + t * E);
        norm_row(sp + t * E, wp, E, static_cast<float>(eps), op + t * E);
      }
    });
  });
  return {sum, out};
}

// qkv [T, (heads + 2 kv_heads) D]; cos, sin [T, D] of qkv's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "rope_qkv", "qkv");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "rope_qkv: qkv's ", qkv.size(1), " columns are not (heads + 2 kv_heads) = ", heads + 2 * kv_heads,
              " heads of one size");
  const int64_t T = qkv.size(0), D = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(D % 2 == 0, "rope_qkv: head_dim must be even, got ", D);
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->dim() == 2 && table->size(0) == T && table->size(1) == D && table->is_contiguous() &&
                    table->scalar_type() == qkv.scalar_type(),
                "rope_qkv: cos and sin must be contiguous [", T, ", ", D, "] of qkv's dtype, got ", table->sizes());
  at::Tensor q = at::empty({T, heads, D}, qkv.options());
  at::Tensor k = at::empty({T, kv_heads, D}, qkv.options());
  at::Tensor v = at::empty({T, kv_heads, D}, qkv.options());
  const int64_t width = qkv.size(1);
  dispatch(qkv.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *xp = qkv.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, T, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* row = xp + t * width;
        for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * D, cp + t * D, sp + t * D, D, qp + (t * heads + h) * D);
        for (int64_t h = 0; h < kv_heads; ++h)
          rotate_head(row + (heads + h) * D, cp + t * D, sp + t * D, D, kp + (t * kv_heads + h) * D);
        std::copy(row + (heads + kv_heads) * D, row + width, vp + t * kv_heads * D);
      }
    });
  });
  return {q, k, v};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up's last dimension must be even, got ", gate_up.size(1));
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, F}, gate_up.options());
  dispatch(gate_up.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, kGrainRows / 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_mul_row(gp + t * 2 * F, gp + t * 2 * F + F, F, op + t * F);
    });
  });
  return out;
}

// The first maximum of a row, as torch.argmax picks it (the first NaN if it has one: top is then
// NaN), and its value in top. The index is found 16 lanes at a time: a scalar scan for it cost
// as much as the maximum's pass.
int64_t row_argmax(const float* x, int64_t V, float& top) {
  using namespace genfn_kernels::simd;
  const F16 minus_inf = set1(-INFINITY);
  F16 best = minus_inf;
  bool has_nan = false;
  for (int64_t i = 0; i < V; i += kLanes) {
    const F16 v = load_kept_or(lanes_below(V - i), x + i, minus_inf);
    has_nan |= unordered(v) != 0;
    best = max(best, v);
  }
  top = has_nan ? NAN : reduce_max(best);
  const F16 target = set1(top);
  for (int64_t i = 0; i < V; i += kLanes) {
    const M16 keep = lanes_below(V - i);
    const F16 v = load_kept(keep, x + i);
    // NaN: the first unordered lane; otherwise the first lane equal to the maximum (-0 == +0, as
    // torch.argmax's comparisons have it)
    const unsigned hit = keep & (has_nan ? unordered(v) : equal(v, target));
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the maximum is one of the row's values
}

// The first maximum of a row (the first NaN if it has one) and log(sum(exp(x - max))) + max.
std::pair<int64_t, float> row_max_logsumexp(const float* x, int64_t V) {
  using namespace genfn_kernels::simd;
  float top;
  const int64_t index = row_argmax(x, V, top);
  if (std::isnan(top) || top == -INFINITY || top == INFINITY) return {index, top};
  F16 sum = zero();
  const F16 shift = set1(top);
  for (int64_t i = 0; i < V; i += kLanes) {
    const M16 keep = lanes_below(V - i);
    sum = add(sum, keep_only(keep, genfn_kernels::exp16(sub(load_kept(keep, x + i), shift))));
  }
  return {index, top + std::log(reduce_add(sum))};
}

void check_logits(const at::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              op, ": `logits` must be a contiguous [rows, vocab] float32 CPU tensor with vocab > 0, got ",
              logits.sizes(), " ", logits.scalar_type());
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_logits(logits, "argmax_rows");
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor ids = at::empty({R}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    float top;
    for (int64_t r = begin; r < end; ++r) ip[r] = row_argmax(xp + r * V, V, top);
  });
  return ids;
}

std::tuple<at::Tensor, at::Tensor> max_logsumexp(const at::Tensor& logits) {
  check_logits(logits, "max_logsumexp");
  const int64_t R = logits.size(0), V = logits.size(1);
  at::Tensor ids = at::empty({R}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({R}, logits.options());
  const float* xp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::tie(ip[r], lp[r]) = row_max_logsumexp(xp + r * V, V);
  });
  return {ids, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("max_logsumexp(Tensor logits) -> (Tensor, Tensor)");
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_mul", &silu_mul);
  m.impl("max_logsumexp", &max_logsumexp);
  m.impl("argmax_rows", &argmax_rows);
}
