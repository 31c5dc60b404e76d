// A Llama decoder layer's decode step (a few tokens: one per row, or a row's several drafts) in
// two calls, one on each side of the KV-cache write, each a single parallel region.
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
//
// The `_quant` forms take block-quantized weights with float32 activations: each linear is
// quant_linear's, every thread quantizing the linear's input itself and summing an even run of
// the weight's tiles.
//
// The `_kquant` forms take GGUF K-quant rows (Q4_K, Q5_K, Q6_K, IQ4; a linear may stack parts in
// several formats, as a Q4_K_M file's q/k beside a Q6_K v) with float32 activations: each linear is
// kquant_linear's row kernels on the same Q8_K-quantized input, so a token gets their bits. The
// split sits at the row kernels: this layer (its attention and elementwise work, AVX-512 like the
// rest of this library) is the one layer of all weight kinds, while the K-quant kernels stay in
// their own library, whose per-function AVX-512/AVX2 paths and forced path (kquant.force_isa) the
// op-by-op linear takes too; it hands this library its per-thread entry points (kquant.h's
// LayerEntry: prepare, quantize a share of x, sum a share of the rows).
//
//   decode_mlp_input_quant: h = rms_norm(x1) * w; g, u = h @ w_gate_up.T; act = silu(g) * u: the
//                           middle of decode_layer_output, the same code, for a tensor-parallel
//                           rank, which sums the o and down projections over the ranks between.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "decode_layer.h"

namespace {

using namespace genfn_kernels::layer;
using genfn_kernels::TeamBarrier;

at::Tensor decode_attention_input(const at::Tensor& x, const at::Tensor& norm, const at::Tensor& wqkv,
                                  const at::Tensor& cos, const at::Tensor& sin, double eps, int64_t heads,
                                  int64_t kv_heads) {
  const char* op = "decode_attention_input";
  const auto [M, E, N, D] = check_attention_input(x, norm, cos, sin, heads, kv_heads, op, Weights::kPlain);
  check_weight(wqkv, x, N, E, op, "wqkv");
  const at::Tensor xc = x.contiguous(), nc = norm.contiguous(), wc = wqkv.contiguous(), cc = cos.contiguous(),
                   sc = sin.contiguous();
  at::Tensor qkv = at::empty({M, N}, x.options());
#define GENFN_ATTENTION_INPUT(T)                                                                                 \
  {                                                                                                              \
    DenseLinear<T> linear{wc.data_ptr<T>()};                                                                     \
    attention_input(xc.data_ptr<T>(), nc.data_ptr<T>(), linear, cc.data_ptr<T>(), sc.data_ptr<T>(), M, E, N,    \
                    heads, kv_heads, D, static_cast<float>(eps), qkv.data_ptr<T>());                             \
  }
  if (x.scalar_type() == at::kFloat)
    GENFN_ATTENTION_INPUT(float)
  else
    GENFN_ATTENTION_INPUT(c10::BFloat16)
#undef GENFN_ATTENTION_INPUT
  return qkv;
}

at::Tensor decode_attention_input_quant(const at::Tensor& x, const at::Tensor& norm, const at::Tensor& codes,
                                        const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t kind,
                                        const at::Tensor& cos, const at::Tensor& sin, double eps, int64_t heads,
                                        int64_t kv_heads) {
  const char* op = "decode_attention_input_quant";
  const auto [M, E, N, D] = check_attention_input(x, norm, cos, sin, heads, kv_heads, op, Weights::kTiles);
  QuantLinear linear{quant_weight(codes, scales, mins, kind, N, E, op, "wqkv")};
  const at::Tensor xc = x.contiguous(), nc = norm.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor qkv = at::empty({M, N}, x.options());
  attention_input(xc.data_ptr<float>(), nc.data_ptr<float>(), linear, cc.data_ptr<float>(), sc.data_ptr<float>(), M,
                  E, N, heads, kv_heads, D, static_cast<float>(eps), qkv.data_ptr<float>());
  return qkv;
}

template <typename T, typename Linear>
at::Tensor run_layer_output(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& visible, Linear& wo,
                            const at::Tensor& mlp_norm, Linear& w_gate_up, Linear& w_down, int64_t F, double eps,
                            double scale) {
  const int64_t M = x.size(0), E = x.size(1);
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), vis = visible.contiguous(), nc = mlp_norm.contiguous();
  at::Tensor out = at::empty({M, E}, x.options());
  const DenseAttention<T> attend{keys.data_ptr<T>(), values.data_ptr<T>(), vis.data_ptr<bool>(), vis.size(1),
                                 M / keys.size(0), keys.stride(0), keys.stride(1), values.stride(0),
                                 values.stride(1), keys.stride(2), q.size(2), static_cast<float>(scale)};
  layer_output(xc.data_ptr<T>(), qc.data_ptr<T>(), attend, wo, nc.data_ptr<T>(), w_gate_up, w_down, M, E, q.size(1),
               keys.size(1), q.size(2), F, static_cast<float>(eps), out.data_ptr<T>());
  return out;
}

at::Tensor decode_layer_output(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys,
                               const at::Tensor& values, const at::Tensor& visible, const at::Tensor& wo,
                               const at::Tensor& mlp_norm, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                               double eps, double scale) {
  const char* op = "decode_layer_output";
  check_rows(x, op, Weights::kPlain);
  check_layer_output(x, q, keys, values, visible, mlp_norm, op);
  const int64_t E = x.size(1), F = w_down.size(1);
  check_weight(wo, x, E, q.size(1) * q.size(2), op, "wo");
  check_weight(w_gate_up, x, 2 * F, E, op, "w_gate_up");
  check_weight(w_down, x, E, F, op, "w_down");
  const at::Tensor woc = wo.contiguous(), guc = w_gate_up.contiguous(), dc = w_down.contiguous();
  if (x.scalar_type() == at::kFloat) {
    DenseLinear<float> o{woc.data_ptr<float>()}, gate_up{guc.data_ptr<float>()}, down{dc.data_ptr<float>()};
    return run_layer_output<float>(x, q, keys, values, visible, o, mlp_norm, gate_up, down, F, eps, scale);
  }
  using B = c10::BFloat16;
  DenseLinear<B> o{woc.data_ptr<B>()}, gate_up{guc.data_ptr<B>()}, down{dc.data_ptr<B>()};
  return run_layer_output<B>(x, q, keys, values, visible, o, mlp_norm, gate_up, down, F, eps, scale);
}

at::Tensor decode_layer_output_quant(
    const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const at::Tensor& visible, const at::Tensor& wo_codes, const at::Tensor& wo_scales,
    const c10::optional<at::Tensor>& wo_mins, int64_t wo_kind, const at::Tensor& mlp_norm,
    const at::Tensor& gate_up_codes, const at::Tensor& gate_up_scales, const c10::optional<at::Tensor>& gate_up_mins,
    int64_t gate_up_kind, const at::Tensor& down_codes, const at::Tensor& down_scales,
    const c10::optional<at::Tensor>& down_mins, int64_t down_kind, double eps, double scale) {
  const char* op = "decode_layer_output_quant";
  check_rows(x, op, Weights::kTiles);
  check_layer_output(x, q, keys, values, visible, mlp_norm, op);
  const int64_t E = x.size(1);
  TORCH_CHECK(down_codes.dim() == 3, op, ": w_down's codes must be [tiles, blocks, bytes]");
  const int64_t F = down_codes.size(1) * 32;
  QuantLinear o{quant_weight(wo_codes, wo_scales, wo_mins, wo_kind, E, q.size(1) * q.size(2), op, "wo")};
  QuantLinear gate_up{quant_weight(gate_up_codes, gate_up_scales, gate_up_mins, gate_up_kind, 2 * F, E, op,
                                   "w_gate_up")};
  QuantLinear down{quant_weight(down_codes, down_scales, down_mins, down_kind, E, F, op, "w_down")};
  return run_layer_output<float>(x, q, keys, values, visible, o, mlp_norm, gate_up, down, F, eps, scale);
}

at::Tensor decode_mlp_input_quant(const at::Tensor& x, const at::Tensor& mlp_norm, const at::Tensor& codes,
                                  const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t kind,
                                  int64_t out_features, double eps) {
  const char* op = "decode_mlp_input_quant";
  check_rows(x, op, Weights::kTiles);
  const int64_t M = x.size(0), E = x.size(1), F = out_features / 2;
  TORCH_CHECK(out_features > 0 && out_features % 2 == 0, op, ": w_gate_up's rows must be even, got ", out_features);
  check_norm(mlp_norm, x, op, "mlp_norm");
  QuantLinear gate_up{quant_weight(codes, scales, mins, kind, out_features, E, op, "w_gate_up")};
  const at::Tensor xc = x.contiguous(), nc = mlp_norm.contiguous();
  at::Tensor act = at::empty({M, F}, x.options());
  thread_local std::vector<float> gate_up_rows;
  gate_up_rows.resize(M * out_features);
  float* gu = gate_up_rows.data();
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  gate_up.prepare(M, out_features, threads);
  TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  mlp_input(xc.data_ptr<float>(), nc.data_ptr<float>(), gate_up, M, E, F, static_cast<float>(eps), gu,
            act.data_ptr<float>(), static_cast<int64_t>(omp_get_thread_num()),
            static_cast<int64_t>(omp_get_num_threads()), barrier);
  return act;
}

at::Tensor decode_attention_input_kquant(const at::Tensor& x, const at::Tensor& norm,
                                         const std::vector<at::Tensor>& wqkv, const std::vector<int64_t>& formats,
                                         const at::Tensor& cos, const at::Tensor& sin, double eps, int64_t heads,
                                         int64_t kv_heads) {
  const char* op = "decode_attention_input_kquant";
  const auto [M, E, N, D] = check_attention_input(x, norm, cos, sin, heads, kv_heads, op, Weights::kKQuant);
  std::vector<at::Tensor> keep;
  keep.reserve(genfn::kquant::SharedLinear::kMaxParts);
  KQuantLinear linear;
  kquant_weight(linear, wqkv, formats, N, E, op, "wqkv", keep);
  const at::Tensor xc = x.contiguous(), nc = norm.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor qkv = at::empty({M, N}, x.options());
  attention_input(xc.data_ptr<float>(), nc.data_ptr<float>(), linear, cc.data_ptr<float>(), sc.data_ptr<float>(), M,
                  E, N, heads, kv_heads, D, static_cast<float>(eps), qkv.data_ptr<float>());
  return qkv;
}

at::Tensor decode_layer_output_kquant(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys,
                                      const at::Tensor& values, const at::Tensor& visible,
                                      const std::vector<at::Tensor>& wo, const std::vector<int64_t>& wo_formats,
                                      const at::Tensor& mlp_norm, const std::vector<at::Tensor>& w_gate_up,
                                      const std::vector<int64_t>& gate_up_formats,
                                      const std::vector<at::Tensor>& w_down, const std::vector<int64_t>& down_formats,
                                      double eps, double scale) {
  const char* op = "decode_layer_output_kquant";
  check_rows(x, op, Weights::kKQuant);
  check_layer_output(x, q, keys, values, visible, mlp_norm, op);
  const int64_t E = x.size(1), F = kquant_rows(w_gate_up) / 2;
  std::vector<at::Tensor> keep;
  keep.reserve(3 * genfn::kquant::SharedLinear::kMaxParts);  // no reallocation: the linears point into it
  KQuantLinear o, gate_up, down;
  kquant_weight(o, wo, wo_formats, E, q.size(1) * q.size(2), op, "wo", keep);
  kquant_weight(gate_up, w_gate_up, gate_up_formats, 2 * F, E, op, "w_gate_up", keep);
  kquant_weight(down, w_down, down_formats, E, F, op, "w_down", keep);
  return run_layer_output<float>(x, q, keys, values, visible, o, mlp_norm, gate_up, down, F, eps, scale);
}

}  // namespace

// Any layout (flexible_layout): each op makes contiguous what it reads as rows and reads the cache
// through its strides, so inductor may hand a step's cos, sin and mask, computed once, to every
// layer's call as one buffer. Under the default (exact strides) it realized a copy of each for
// every call: SmolLM2's step computed its RoPE tables and mask 30 times in its first kernel.
TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  const std::vector<at::Tag> any_layout{at::Tag::flexible_layout};
  m.def("decode_attention_input(Tensor x, Tensor norm, Tensor wqkv, Tensor cos, Tensor sin, float eps, int heads, "
        "int kv_heads) -> Tensor",
        any_layout);
  m.def("decode_layer_output(Tensor x, Tensor q, Tensor keys, Tensor values, Tensor visible, Tensor wo, "
        "Tensor mlp_norm, Tensor w_gate_up, Tensor w_down, float eps, float scale) -> Tensor",
        any_layout);
  m.def("decode_attention_input_quant(Tensor x, Tensor norm, Tensor codes, Tensor scales, Tensor? mins, int kind, "
        "Tensor cos, Tensor sin, float eps, int heads, int kv_heads) -> Tensor",
        any_layout);
  m.def("decode_mlp_input_quant(Tensor x, Tensor mlp_norm, Tensor codes, Tensor scales, Tensor? mins, int kind, "
        "int out_features, float eps) -> Tensor",
        any_layout);
  m.def("decode_layer_output_quant(Tensor x, Tensor q, Tensor keys, Tensor values, Tensor visible, "
        "Tensor wo_codes, Tensor wo_scales, Tensor? wo_mins, int wo_kind, Tensor mlp_norm, Tensor gate_up_codes, "
        "Tensor gate_up_scales, Tensor? gate_up_mins, int gate_up_kind, Tensor down_codes, Tensor down_scales, "
        "Tensor? down_mins, int down_kind, float eps, float scale) -> Tensor",
        any_layout);
  m.def("decode_attention_input_kquant(Tensor x, Tensor norm, Tensor[] wqkv, int[] formats, Tensor cos, "
        "Tensor sin, float eps, int heads, int kv_heads) -> Tensor",
        any_layout);
  m.def("decode_layer_output_kquant(Tensor x, Tensor q, Tensor keys, Tensor values, Tensor visible, Tensor[] wo, "
        "int[] wo_formats, Tensor mlp_norm, Tensor[] w_gate_up, int[] gate_up_formats, Tensor[] w_down, "
        "int[] down_formats, float eps, float scale) -> Tensor",
        any_layout);
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("decode_attention_input", &decode_attention_input);
  m.impl("decode_layer_output", &decode_layer_output);
  m.impl("decode_attention_input_quant", &decode_attention_input_quant);
  m.impl("decode_layer_output_quant", &decode_layer_output_quant);
  m.impl("decode_mlp_input_quant", &decode_mlp_input_quant);
  m.impl("decode_attention_input_kquant", &decode_attention_input_kquant);
  m.impl("decode_layer_output_kquant", &decode_layer_output_kquant);
}
