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

#include "decode_kernels.h"
#include "kquant.h"

namespace {

using genfn_kernels::attend_group;
using genfn_kernels::exp16;
using genfn_kernels::linear_balanced;
using genfn_kernels::QuantWeight;
using genfn_kernels::RowQueue;

using genfn_kernels::kMaxDecodeRows;

// The most rows a layer call takes: the linears run them in even groups of at most kMaxDecodeRows
// (group_size), every group over each chunk of weights while it is in L1 (one weight stream). A
// row is one token; a cache row may hold several of them (a speculative verification's positions
// of one sequence), each attending its own visible slots, so that each gets the bits a step of
// that token alone gets.
constexpr int64_t kMaxLayerRows = 2 * kMaxDecodeRows;

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

// act[f] = silu(gate[f]) * up[f] for f in [f0, f1): float32 16 lanes at a time (one std::exp an
// element cost ~5 % of an 8-row step), bfloat16 an element at a time.
inline void swiglu(const float* gate, const float* up, int64_t f0, int64_t f1, float* act) {
  for (int64_t f = f0; f < f1; f += 16) {
    const __mmask16 keep = genfn_kernels::lanes_below(f1 - f);
    const __m512 g = _mm512_maskz_loadu_ps(keep, gate + f), u = _mm512_maskz_loadu_ps(keep, up + f);
    _mm512_mask_storeu_ps(act + f, keep, _mm512_mul_ps(genfn_kernels::silu16(g), u));
  }
}

inline void swiglu(const c10::BFloat16* gate, const c10::BFloat16* up, int64_t f0, int64_t f1, c10::BFloat16* act) {
  for (int64_t f = f0; f < f1; ++f) {
    const float g = wide(gate[f]), u = wide(up[f]);
    act[f] = narrow<c10::BFloat16>(g / (1.f + std::exp(-g)) * u);
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

// The two kinds of weight a layer's linears read. Each is prepared before the parallel region,
// then called by every thread of it with the same arguments: y[M, N] = x[M, K] @ w.T.
template <typename T>
struct DenseLinear {  // rows of T, shared out balanced (past 8 rows, in groups: linear_balanced)
  const T* w;
  RowQueue rows;
  void prepare(int64_t M, int64_t N, int64_t threads) { rows.prepare(M, N, threads, std::is_same_v<T, c10::BFloat16>); }
  void operator()(int64_t M, const T* x, int64_t K, int64_t N, T* y, int64_t t, int64_t) {
    linear_balanced(M, x, w, K, N, y, t, rows);
  }
};

// Tiles of quantized rows against float32 activations: the threads quantize x a share of rows
// each (a group's rows into its own buffer), meet, and sum the tiles shared out balanced.
struct QuantLinear {
  static constexpr int64_t kGroups = kMaxLayerRows / kMaxDecodeRows;
  QuantWeight w;
  genfn_kernels::QuantActivations x8[kGroups];
  int64_t per = 0, groups = 0, rows[kGroups] = {};  // prepare's split of the M rows (group_size)
  RowQueue tiles;
  void prepare(int64_t M, int64_t, int64_t team) {
    per = genfn_kernels::group_size(M);
    groups = (M + per - 1) / per;
    for (int64_t g = 0; g < groups; ++g) {
      rows[g] = std::min(per, M - g * per);
      x8[g].resize(rows[g], w.blocks * 32);
    }
    tiles.prepare_blocks(w.tiles, team);
  }
  void operator()(int64_t, const float* x, int64_t K, int64_t N, float* y, int64_t t, int64_t team) {
    float* out[kGroups];
    for (int64_t g = 0; g < groups; ++g) {
      out[g] = y + g * per * N;
      genfn_kernels::quantize_rows_share(x + g * per * K, rows[g], K, x8[g], t, team);
    }
#pragma omp barrier
    genfn_kernels::quant_linear_share_groups(groups, rows, x8, K, w, out, t, tiles);
  }
};

// GGUF K-quant rows (Q4_K, Q5_K, Q6_K, IQ4; a matrix may stack parts in several formats) against
// float32 activations: kquant_linear's row kernels, which live in the K-quant library
// (kquant_linear.cpp, its own ISA per function) and are reached through its entry table.
const genfn::kquant::LayerEntry& kquant_entry() {
  static const genfn::kquant::LayerEntry* entry = [] {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("genfn_kquant::kquant_layer_entry", "");
    const auto* found = reinterpret_cast<const genfn::kquant::LayerEntry*>(op.typed<int64_t()>().call());
    TORCH_CHECK(found->size == static_cast<int64_t>(sizeof(genfn::kquant::SharedLinear)),
                "the K-quant kernels were built from another kquant.h than the decode kernels");
    return found;
  }();
  return *entry;
}

struct KQuantLinear {
  genfn::kquant::SharedLinear shared;
  void prepare(int64_t M, int64_t, int64_t team) { kquant_entry().prepare(shared, M, team); }
  void operator()(int64_t, const float* x, int64_t, int64_t, float* y, int64_t t, int64_t team) {
    kquant_entry().quantize_share(shared, x, t, team);
#pragma omp barrier
    kquant_entry().rows_share(shared, y, t);
  }
};

template <typename T, typename Linear>
void attention_input(const T* x, const T* norm, Linear& wqkv, const T* cos, const T* sin, int64_t M, int64_t E,
                     int64_t N, int64_t heads, int64_t kv_heads, int64_t D, float eps, T* qkv) {
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  wqkv.prepare(M, N, threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    // Every thread normalizes the few rows itself: cheaper than a barrier.
    thread_local std::vector<T> h;
    h.resize(M * E);
    rms_norm_rows(x, norm, M, E, eps, h.data());
    wqkv(M, h.data(), E, N, qkv, t, team);
#pragma omp barrier
    const int64_t rotated = heads + kv_heads;  // q's heads, then k's
    const auto [begin, end] = share(M * rotated, t, team);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / rotated, head = i % rotated;
      rotate(qkv + m * N + head * D, cos + m * D, sin + m * D, D);
    }
  }
}

// Inside a parallel region, thread t of `team`: act = silu(g) * u for g, u = rms_norm(x1) @ w_gate_up.T
// (each thread normalizes the few rows itself: cheaper than a barrier). A barrier must follow
// before act is read.
template <typename T, typename Linear>
void mlp_input(const T* x1, const T* mlp_norm, Linear& w_gate_up, int64_t M, int64_t E, int64_t F, float eps,
               T* gate_up, T* act, int64_t t, int64_t team) {
  thread_local std::vector<T> h;
  h.resize(M * E);
  rms_norm_rows(x1, mlp_norm, M, E, eps, h.data());
  w_gate_up(M, h.data(), E, 2 * F, gate_up, t, team);
#pragma omp barrier
  const auto [begin, end] = share(F, t, team);
  for (int64_t m = 0; m < M; ++m) swiglu(gate_up + m * 2 * F, gate_up + m * 2 * F + F, begin, end, act + m * F);
}

template <typename T, typename Linear>
void layer_output(const T* x, const T* q, const T* keys, const T* values, const bool* visible, Linear& wo,
                  const T* mlp_norm, Linear& w_gate_up, Linear& w_down, int64_t M, int64_t E, int64_t heads,
                  int64_t kv_heads, int64_t D, int64_t span, int64_t cache_rows, int64_t key_row_stride,
                  int64_t key_head_stride,
                  int64_t value_row_stride, int64_t value_head_stride, int64_t slot_stride, int64_t F, float eps,
                  float scale, T* out) {
  const int64_t HD = heads * D, groups = heads / kv_heads;
  const int64_t per_cache_row = M / cache_rows;  // tokens m * per_cache_row .. attend cache row m
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
  wo.prepare(M, E, threads);
  w_gate_up.prepare(M, 2 * F, threads);
  w_down.prepare(M, E, threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    if ((M * kv_heads) % team == 0) {
      // One task per (row, kv head) where they split evenly: each kv head's keys and values are
      // read once for its whole query group (at 8 rows, a query head at a time read them three
      // times over, ~12 % of a Q4_1 step).
      const auto [begin, end] = share(M * kv_heads, t, team);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / kv_heads, kv = i % kv_heads, first = m * heads + kv * groups, c = m / per_cache_row;
        attend_group(q + first * D, keys + c * key_row_stride + kv * key_head_stride,
                     values + c * value_row_stride + kv * value_head_stride, visible + m * span, span, slot_stride,
                     groups, D, scale, attn + first * D);
      }
    } else {  // one task per (row, query head): 9 heads split 5/4 where 3 kv heads would split 2/1
      const auto [begin, end] = share(M * heads, t, team);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t m = i / heads, head = i % heads, kv = head / groups, c = m / per_cache_row;
        attend_group(q + i * D, keys + c * key_row_stride + kv * key_head_stride,
                     values + c * value_row_stride + kv * value_head_stride, visible + m * span, span, slot_stride,
                     int64_t{1}, D, scale, attn + i * D);
      }
    }
#pragma omp barrier
    wo(M, attn, HD, E, o, t, team);
#pragma omp barrier
    // The residual after attention, by every thread for itself.
    thread_local std::vector<T> x1;
    x1.resize(M * E);
    for (int64_t i = 0; i < M * E; ++i) x1[i] = narrow<T>(wide(x[i]) + wide(o[i]));
    mlp_input(x1.data(), mlp_norm, w_gate_up, M, E, F, eps, gate_up, act, t, team);
#pragma omp barrier
    w_down(M, act, F, E, down, t, team);
#pragma omp barrier
    {
      const auto [begin, end] = share(E, t, team);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t e = begin; e < end; ++e) out[m * E + e] = narrow<T>(wide(x1[m * E + e]) + wide(down[m * E + e]));
    }
  }
}

// The layer's weights: plain (float32 or bfloat16 x), tiles16 blocks (float32 x and VNNI), K-quant
// rows (float32 x; the K-quant kernels pick their own path).
enum class Weights { kPlain, kTiles, kKQuant };

void check_rows(const at::Tensor& x, const char* op, Weights weights) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxLayerRows, op,
              ": x must be [M, hidden] with 1 <= M <= ", kMaxLayerRows, ", got ", x.sizes());
  if (weights == Weights::kKQuant) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": float32 activations; got ", x.scalar_type());
  } else if (weights == Weights::kTiles) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && genfn_kernels::cpu_has_avx512_vnni(), op,
                ": float32 activations on a CPU with AVX512_VNNI; got ", x.scalar_type());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat ||
                    (x.scalar_type() == at::kBFloat16 && genfn_kernels::cpu_has_avx512_bf16()),
                op, ": float32, or bfloat16 on a CPU with AVX512_BF16; got ", x.scalar_type());
  }
}

void check_weight(const at::Tensor& w, const at::Tensor& x, int64_t rows, int64_t cols, const char* op, const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols && w.scalar_type() == x.scalar_type(), op, ": ",
              name, " must be [", rows, ", ", cols, "] in ", x.scalar_type(), ", got ", w.sizes(), " ", w.scalar_type());
}

// A quantized weight of [rows, cols] as quant_linear takes it (codes [tiles, blocks, bytes] uint8,
// float16 scales and, for kind 1, minimums), checked; the tensors must outlive the call.
QuantWeight quant_weight(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                         int64_t kind, int64_t rows, int64_t cols, const char* op, const char* name) {
  TORCH_CHECK(kind >= 0 && kind <= 2, op, ": ", name, "'s kind must be 0, 1 or 2, got ", kind);
  const int64_t tiles = (rows + 15) / 16, blocks = cols / 32, bytes = (kind == 2 ? 8 : 4) * 64;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) == tiles &&
                  codes.size(1) == blocks && codes.size(2) == bytes && cols % 32 == 0,
              op, ": ", name, "'s codes must be contiguous uint8 [", tiles, ", ", blocks, ", ", bytes, "] for [", rows,
              ", ", cols, "], got ", codes.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == tiles * blocks * 16,
              op, ": ", name, "'s scales must be contiguous float16, ", tiles * blocks * 16, " of them");
  const bool has_min = kind == 1;
  TORCH_CHECK(!has_min || (mins.has_value() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                           mins->numel() == scales.numel()),
              op, ": ", name, " of kind 1 needs float16 minimums shaped like its scales");
  return {codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
          has_min ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr, kind, tiles, blocks,
          rows};
}

// What decode_attention_input checks of x, norm, cos and sin; returns head_dim.
// The sizes of an attention_input call, after checking x (check_rows), norm, cos and sin.
struct AttentionInputSizes {
  int64_t M, E, N, D;
};

AttentionInputSizes check_attention_input(const at::Tensor& x, const at::Tensor& norm, const at::Tensor& cos,
                                          const at::Tensor& sin, int64_t heads, int64_t kv_heads, const char* op,
                                          Weights weights) {
  check_rows(x, op, weights);
  const int64_t M = x.size(0), E = x.size(1), D = cos.size(-1);
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(0) == M && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              op, ": cos and sin must be [M, head_dim] in x's dtype, got ", cos.sizes());
  TORCH_CHECK(norm.dim() == 1 && norm.size(0) == E && norm.scalar_type() == x.scalar_type(), op,
              ": norm must be [hidden] in x's dtype");
  return {M, E, (heads + 2 * kv_heads) * D, D};
}

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

// What decode_layer_output checks of x, q, the cache, the mask and the MLP norm.
void check_layer_output(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                        const at::Tensor& visible, const at::Tensor& mlp_norm, const char* op) {
  const int64_t M = x.size(0), E = x.size(1);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == M && q.scalar_type() == x.scalar_type(), op,
              ": q must be [M, heads, head_dim] in x's dtype, got ", q.sizes());
  const int64_t heads = q.size(1), D = q.size(2);
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.size(0) >= 1 && M % keys.size(0) == 0 &&
                  keys.size(3) == D && keys.scalar_type() == x.scalar_type() && values.scalar_type() == x.scalar_type(),
              op, ": keys and values must be [B, kv_heads, slots, head_dim] in x's dtype with B dividing M = ", M,
              " (each cache row's tokens consecutive in x), got ", keys.sizes());
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
}

template <typename T, typename Linear>
at::Tensor run_layer_output(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& visible, Linear& wo,
                            const at::Tensor& mlp_norm, Linear& w_gate_up, Linear& w_down, int64_t F, double eps,
                            double scale) {
  const int64_t M = x.size(0), E = x.size(1);
  const at::Tensor xc = x.contiguous(), qc = q.contiguous(), vis = visible.contiguous(), nc = mlp_norm.contiguous();
  at::Tensor out = at::empty({M, E}, x.options());
  layer_output(xc.data_ptr<T>(), qc.data_ptr<T>(), keys.data_ptr<T>(), values.data_ptr<T>(), vis.data_ptr<bool>(), wo,
               nc.data_ptr<T>(), w_gate_up, w_down, M, E, q.size(1), keys.size(1), q.size(2), vis.size(1),
               keys.size(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), keys.stride(2), F,
               static_cast<float>(eps), static_cast<float>(scale), out.data_ptr<T>());
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
  TORCH_CHECK(mlp_norm.dim() == 1 && mlp_norm.size(0) == E && mlp_norm.scalar_type() == x.scalar_type(), op,
              ": mlp_norm must be [hidden] in x's dtype");
  QuantLinear gate_up{quant_weight(codes, scales, mins, kind, out_features, E, op, "w_gate_up")};
  const at::Tensor xc = x.contiguous(), nc = mlp_norm.contiguous();
  at::Tensor act = at::empty({M, F}, x.options());
  thread_local std::vector<float> gate_up_rows;
  gate_up_rows.resize(M * out_features);
  float* gu = gate_up_rows.data();
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  gate_up.prepare(M, out_features, threads);
#pragma omp parallel num_threads(threads)
  mlp_input(xc.data_ptr<float>(), nc.data_ptr<float>(), gate_up, M, E, F, static_cast<float>(eps), gu,
            act.data_ptr<float>(), static_cast<int64_t>(omp_get_thread_num()),
            static_cast<int64_t>(omp_get_num_threads()));
  return act;
}

// linear: a K-quant matrix of [rows, cols] from its parts (uint8 [part rows, row bytes] in
// formats[p]), checked; `keep` holds the contiguous parts the call reads.
void kquant_weight(KQuantLinear& linear, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& formats,
                   int64_t rows, int64_t cols, const char* op, const char* name, std::vector<at::Tensor>& keep) {
  using namespace genfn::kquant;
  TORCH_CHECK(!parts.empty() && parts.size() <= SharedLinear::kMaxParts && parts.size() == formats.size(), op, ": ",
              name, " must be 1 to ", SharedLinear::kMaxParts, " parts with a format each, got ", parts.size(),
              " parts and ", formats.size(), " formats");
  SharedLinear& s = linear.shared;
  s.K = cols;
  int64_t total = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    const int64_t f = formats[p];
    TORCH_CHECK(f >= kQ4K && f <= kLastFormat, op, ": ", name, "'s formats must be 0 (q4_k), 1 (q5_k), 2 (q6_k), ",
                "3 (iq4_nl), 4 (iq4_xs) or 5 (q4_k_r8), got ", f);
    const int64_t block = block_inputs(f), row_bytes = cols / block * block_bytes(f);
    const at::Tensor& part = parts[p];
    TORCH_CHECK(cols % block == 0 && part.dim() == 2 && part.scalar_type() == at::kByte && part.size(1) == row_bytes &&
                    part.device().is_cpu(),
                op, ": ", name, "'s part ", p, " must be uint8 [rows, ", row_bytes, "] (", cols,
                " inputs in format ", f, "), got ", part.sizes(), " ", part.scalar_type());
    keep.push_back(part.contiguous());
    s.parts[p] = {keep.back().data_ptr<uint8_t>(), f, part.size(0)};
    total += part.size(0);
  }
  s.count = static_cast<int64_t>(parts.size());
  TORCH_CHECK(total == rows, op, ": ", name, " must have ", rows, " rows in all, got ", total);
}

int64_t kquant_rows(const std::vector<at::Tensor>& parts) {
  int64_t rows = 0;
  for (const auto& part : parts) rows += part.size(0);
  return rows;
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
