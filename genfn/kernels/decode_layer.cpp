// A Llama decoder layer's decode step (a few rows, one token each) in two calls, one on each side
// of the KV-cache write, each a single parallel region.
//
// Run op by op, a layer of SmolLM2 at batch 1 is four linears, an attention, and five small
// elementwise kernels: ten calls through the dispatcher or inductor's wrapper, six thread-pool
// dispatches and a dozen buffers, around ~330 us of weight streaming. On two cores that overhead
// was ~1.5-2 ms of a ~12 ms bfloat16 step (perf: the main thread waited in libgomp's barrier ~13 %
// of its time). Here each half of the layer is one call and one parallel region whose phases meet
// at barriers: each thread streams its share of every weight's rows (linear_balanced), and the small
// elementwise work between linears (RMS norm, residual adds, RoPE, SwiGLU) is done in place.
//
// The arithmetic is the compiled step's: the linears and the attention are decode_linear's and
// dense_decode_attention's; elementwise work is float32 rounded once to the activation dtype
// wherever the model code converts (the norm's `.to(dtype)`, each op's output), as inductor
// rounds a fused kernel.
//
//   decode_attention_input: h = rms_norm(x) * w; qkv = h @ wqkv.T; RoPE on q and k.
//   decode_layer_output:    a = attention(q, cache); x1 = x + a @ wo.T; h = rms_norm(x1) * w;
//                           g, u = h @ w_gate_up.T; out = x1 + (silu(g) * u) @ w_down.T.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <cmath>
#include <vector>

#include "decode_kernels.h"

namespace {

using genfn_kernels::attend_group;
using genfn_kernels::linear_balanced;
using genfn_kernels::RowQueue;

using genfn_kernels::kMaxDecodeRows;

inline float wide(float v) { return v; }
inline float wide(c10::BFloat16 v) { return static_cast<float>(v); }
template <typename T>
inline T narrow(float v) { return static_cast<T>(v); }

// [begin, end) of `count` items for thread t of a team of T: even contiguous shares.
inline std::pair<int64_t, int64_t> share(int64_t count, int64_t t, int64_t T) {
  return {count * t / T, count * (t + 1) / T};
}

// out[m] = w * to_T(x[m] * rsqrt(mean(x[m]^2) + eps)), the model's _rms_norm.
template <typename T>
void rms_norm_rows(const T* x, const T* w, int64_t M, int64_t E, float eps, T* out) {
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * E;
    float squares = 0.f;
    for (int64_t e = 0; e < E; ++e) squares += wide(row[e]) * wide(row[e]);
    const float r = 1.f / std::sqrt(squares / static_cast<float>(E) + eps);
    for (int64_t e = 0; e < E; ++e)
      out[m * E + e] = narrow<T>(wide(w[e]) * wide(narrow<T>(wide(row[e]) * r)));
  }
}

// RoPE in place on one head x[0 .. D): x * cos + rotate_half(x) * sin.
template <typename T>
void rotate(T* x, const T* cos, const T* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = wide(x[i]), b = wide(x[i + half]);
    x[i] = narrow<T>(a * wide(cos[i]) - b * wide(sin[i]));
    x[i + half] = narrow<T>(b * wide(cos[i + half]) + a * wide(sin[i + half]));
  }
}

template <typename T>
void attention_input(const T* x, const T* norm, const T* wqkv, const T* cos, const T* sin, int64_t M, int64_t E,
                     int64_t N, int64_t heads, int64_t kv_heads, int64_t D, float eps, T* qkv) {
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  RowQueue rows;
  rows.prepare(M, N, threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    // Every thread normalizes the few rows itself: cheaper than a barrier.
    thread_local std::vector<T> h;
    h.resize(M * E);
    rms_norm_rows(x, norm, M, E, eps, h.data());
    linear_balanced(M, h.data(), wqkv, E, N, qkv, t, rows);
#pragma omp barrier
    const int64_t rotated = heads + kv_heads;  // q's heads, then k's
    const auto [begin, end] = share(M * rotated, t, team);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / rotated, head = i % rotated;
      rotate(qkv + m * N + head * D, cos + m * D, sin + m * D, D);
    }
  }
}

template <typename T>
void layer_output(const T* x, const T* q, const T* keys, const T* values, const bool* visible, const T* wo,
                  const T* mlp_norm, const T* w_gate_up, const T* w_down, int64_t M, int64_t E, int64_t heads,
                  int64_t kv_heads, int64_t D, int64_t span, int64_t key_row_stride, int64_t key_head_stride,
                  int64_t value_row_stride, int64_t value_head_stride, int64_t slot_stride, int64_t F, float eps,
                  float scale, T* out) {
  const int64_t HD = heads * D, groups = heads / kv_heads;
  // Buffers every thread reads: the attention output, the o projection, the gate/up projection,
  // the SwiGLU activation, the down projection.
  thread_local std::vector<T> shared;
  shared.resize(M * (HD + E + 2 * F + F + E));
  T* attn = shared.data();
  T* o = attn + M * HD;
  T* gate_up = o + M * E;
  T* act = gate_up + M * 2 * F;
  T* down = act + M * F;
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  RowQueue o_rows, gate_up_rows, down_rows;
  o_rows.prepare(M, E, threads);
  gate_up_rows.prepare(M, 2 * F, threads);
  down_rows.prepare(M, E, threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    {  // one task per (row, query head): 9 heads split 5/4 where 3 kv heads would split 2/1
      const auto [begin, end] = share(M * heads, t, team);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / heads, head = i % heads, kv = head / groups;
        attend_group(q + i * D, keys + m * key_row_stride + kv * key_head_stride,
                     values + m * value_row_stride + kv * value_head_stride, visible + m * span, span, slot_stride,
                     int64_t{1}, D, scale, attn + i * D);
      }
    }
#pragma omp barrier
    linear_balanced(M, attn, wo, HD, E, o, t, o_rows);
#pragma omp barrier
    // The residual after attention and the MLP's norm, by every thread for itself.
    thread_local std::vector<T> x1, h;
    x1.resize(M * E);
    h.resize(M * E);
    for (int64_t i = 0; i < M * E; ++i) x1[i] = narrow<T>(wide(x[i]) + wide(o[i]));
    rms_norm_rows(x1.data(), mlp_norm, M, E, eps, h.data());
    linear_balanced(M, h.data(), w_gate_up, E, 2 * F, gate_up, t, gate_up_rows);
#pragma omp barrier
    {
      const auto [begin, end] = share(F, t, team);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t f = begin; f < end; ++f) {
          const float g = wide(gate_up[m * 2 * F + f]), u = wide(gate_up[m * 2 * F + F + f]);
          act[m * F + f] = narrow<T>(g / (1.f + std::exp(-g)) * u);
        }
    }
#pragma omp barrier
    linear_balanced(M, act, w_down, F, E, down, t, down_rows);
#pragma omp barrier
    {
      const auto [begin, end] = share(E, t, team);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t e = begin; e < end; ++e) out[m * E + e] = narrow<T>(wide(x1[m * E + e]) + wide(down[m * E + e]));
    }
  }
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxDecodeRows, op,
              ": x must be [M, hidden] with 1 <= M <= ", kMaxDecodeRows, ", got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || (x.scalar_type() == at::kBFloat16 && genfn_kernels::cpu_has_avx512_bf16()),
              op, ": float32, or bfloat16 on a CPU with AVX512_BF16; got ", x.scalar_type());
}

void check_weight(const at::Tensor& w, const at::Tensor& x, int64_t rows, int64_t cols, const char* op, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols && w.scalar_type() == x.scalar_type(), op, ": ",
              name, " must be [", rows, ", ", cols, "] in ", x.scalar_type(), ", got ", w.sizes(), " ", w.scalar_type());
}

at::Tensor decode_attention_input(const at::Tensor& x, const at::Tensor& norm, const at::Tensor& wqkv,
                                  const at::Tensor& cos, const at::Tensor& sin, double eps, int64_t heads,
                                  int64_t kv_heads) {
  const char* op = "decode_attention_input";
  check_rows(x, op);
  const int64_t M = x.size(0), E = x.size(1), D = cos.size(-1), N = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(0) == M && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              op, ": cos and sin must be [M, head_dim] in x's dtype, got ", cos.sizes());
  TORCH_CHECK(norm.dim() == 1 && norm.size(0) == E && norm.scalar_type() == x.scalar_type(), op,
              ": norm must be [hidden] in x's dtype");
  check_weight(wqkv, x, N, E, op, "wqkv");
  const at::Tensor xc = x.contiguous(), nc = norm.contiguous(), wc = wqkv.contiguous(), cc = cos.contiguous(),
                   sc = sin.contiguous();
  at::Tensor qkv = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat)
    attention_input(xc.data_ptr<float>(), nc.data_ptr<float>(), wc.data_ptr<float>(), cc.data_ptr<float>(),
                    sc.data_ptr<float>(), M, E, N, heads, kv_heads, D, static_cast<float>(eps), qkv.data_ptr<float>());
  else
    attention_input(xc.data_ptr<c10::BFloat16>(), nc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(),
                    cc.data_ptr<c10::BFloat16>(), sc.data_ptr<c10::BFloat16>(), M, E, N, heads, kv_heads, D,
                    static_cast<float>(eps), qkv.data_ptr<c10::BFloat16>());
  return qkv;
}

at::Tensor decode_layer_output(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys,
                               const at::Tensor& values, const at::Tensor& visible, const at::Tensor& wo,
                               const at::Tensor& mlp_norm, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                               double eps, double scale) {
  const char* op = "decode_layer_output";
  check_rows(x, op);
  const int64_t M = x.size(0), E = x.size(1);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == M && q.scalar_type() == x.scalar_type(), op,
              ": q must be [M, heads, head_dim] in x's dtype, got ", q.sizes());
  const int64_t heads = q.size(1), D = q.size(2);
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.size(0) == M && keys.size(3) == D &&
                  keys.scalar_type() == x.scalar_type() && values.scalar_type() == x.scalar_type(),
              op, ": keys and values must be [M, kv_heads, slots, head_dim] in x's dtype, got ", keys.sizes());
  const int64_t kv_heads = keys.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && D % 16 == 0 && D <= 128, op, ": ", heads, " query heads over ", kv_heads,
              " kv heads of head_dim ", D, " (a multiple of 16 up to 128) are not supported");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.stride(2) == values.stride(2), op,
              ": keys and values must be contiguous along head_dim and share their slot stride");
  TORCH_CHECK(visible.dim() == 2 && visible.size(0) == M && visible.size(1) <= keys.size(2) &&
                  visible.scalar_type() == at::kBool,
              op, ": visible must be a bool [M, A] with A <= the cache's ", keys.size(2), " slots");
  TORCH_CHECK(mlp_norm.dim() == 1 && mlp_norm.size(0) == E && mlp_norm.scalar_type() == x.scalar_type(), op,
              ": mlp_norm must be [hidden] in x's dtype");
  const int64_t F = w_down.size(1);
  check_weight(wo, x, E, heads * D, op, "wo");
  check_weight(w_gate_up, x, 2 * F, E, op, "w_gate_up");
  check_weight(w_down, x, E, F, op, "w_down");
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), vis = visible.contiguous(), woc = wo.contiguous(),
                   nc = mlp_norm.contiguous(), guc = w_gate_up.contiguous(), dc = w_down.contiguous();
  at::Tensor out = at::empty({M, E}, x.options());
#define GENFN_LAYER_OUTPUT(T)                                                                                     \
  layer_output(xc.data_ptr<T>(), qc.data_ptr<T>(), keys.data_ptr<T>(), values.data_ptr<T>(), vis.data_ptr<bool>(), \
               woc.data_ptr<T>(), nc.data_ptr<T>(), guc.data_ptr<T>(), dc.data_ptr<T>(), M, E, heads, kv_heads, D, \
               vis.size(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), keys.stride(2), F, \
               static_cast<float>(eps), static_cast<float>(scale), out.data_ptr<T>())
  if (x.scalar_type() == at::kFloat)
    GENFN_LAYER_OUTPUT(float);
  else
    GENFN_LAYER_OUTPUT(c10::BFloat16);
#undef GENFN_LAYER_OUTPUT
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("decode_attention_input(Tensor x, Tensor norm, Tensor wqkv, Tensor cos, Tensor sin, float eps, int heads, "
        "int kv_heads) -> Tensor");
  m.def("decode_layer_output(Tensor x, Tensor q, Tensor keys, Tensor values, Tensor visible, Tensor wo, "
        "Tensor mlp_norm, Tensor w_gate_up, Tensor w_down, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("decode_attention_input", &decode_attention_input);
  m.impl("decode_layer_output", &decode_layer_output);
}
