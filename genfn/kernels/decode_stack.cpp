// A decode step through a whole stack of Llama decoder layers in one call: for each layer its
// attention input, its keys and values written into the cache at the rows' slots, and its output
// (decode_layer.h's two halves, the same code the per-layer ops run, so the same bits).
//
// Run layer by layer, each layer cost its two native calls and what lay between them: eagerly ~70 us
// of Python and dispatch (the checks, the split of q/k/v, the cache write's views and copies), on
// SmolLM2's 30 Q4_1 layers ~2 ms of a ~5.9 ms step, as much as the layers' own arithmetic; compiled,
// inductor's wrapper calls and the cache writes' kernels between the calls. Inside a compiled step
// the op's in-place cache write is functionalized and then reinplaced: inductor hands it the state's
// own cache buffers.
//
//   decode_stack_table(weights, layout, dtype, hidden, heads, kv_heads, head_dim) -> table
//   decode_stack(x [M, E], table, layers, cos, sin [M, D], keys, values [L, B, Hkv, T, D],
//                slots [B, S], visible [M, A], eps, scale) -> x after the first `layers` layers
//
// The table: stack_table.h.
//
// x's rows are the B cache rows' S tokens each (M = B * S, a row's tokens consecutive); token s of
// row b writes its keys and values at slot slots[b, s] of every layer it runs, then attends the
// first A slots where its line of visible is set. The layers run are the table's first `layers`
// (the cache may hold more: an early exit runs the first few).
//
//   decode_stack_paged(x [M, E], table, layers, cos, sin [M, D], keys, values [L, NB, Hkv, bs, D],
//                      slot_mapping [M], block_tables [R, W], request_index [M], positions [M], eps,
//                      scale, sliding_window) -> x after the layers
//
// The same over continuous batching's paged cache: token m (any request's decode token, drafts or
// a short prompt chunk) writes at slot slot_mapping[m] (block * bs + offset; negative: the sink,
// the last block) and attends positions 0 .. positions[m] of its request's block table (the last
// sliding_window of them where sliding_window > 0), in position order: a decode token gets the
// bits a static-cache step gives it over the same keys.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "decode_layer.h"
#include "stack_table.h"

namespace {

using namespace genfn_kernels::layer;
using namespace genfn_kernels::stack;
using genfn_kernels::TeamBarrier;

constexpr const char* kOp = "decode_stack";
constexpr const char* kPagedOp = "decode_stack_paged";

// A linear pointed at the table's weights for linear i of layer w, of `cols` inputs.
template <typename T>
void point_linear(DenseLinear<T>& l, const TableLayer& w, int i, int64_t) {
  l.w = static_cast<const T*>(w.plain[i]);
  l.coded = w.coded[i];
}

void point_linear(QuantLinear& l, const TableLayer& w, int i, int64_t) {
  l.count = w.tile_count[i];
  for (int64_t p = 0; p < l.count; ++p) l.parts[p] = w.tiles[i][p];
}

void point_linear(KQuantLinear& l, const TableLayer& w, int i, int64_t cols) {
  genfn::kquant::SharedLinear& s = l.shared;
  s.count = w.part_count[i];
  s.K = cols;
  for (int64_t p = 0; p < s.count; ++p) s.parts[p] = w.parts[i][p];
}

void point_linear(MixedLinear& l, const TableLayer& w, int i, int64_t cols) {
  l.tiles = w.linear_kind[i] == kTiles;
  if (l.tiles) point_linear(l.quant, w, i, cols);
  else point_linear(l.kquant, w, i, cols);
}

// The four linears of a layer of one kind, pointed at a table layer's weights in turn: their
// buffers (activations' codes, work queues) serve every layer of a call.
template <typename Linear>
struct LayerLinears {
  Linear wqkv, wo, gate_up, down;
  int64_t F = 0;
  // Pointed at table layer w (linear i reads what the table holds for it, of inputs cols[i]) and
  // prepared for M rows of x on `threads` threads.
  void ready(const TableLayer& w, int64_t M, int64_t E, int64_t N, int64_t HD, int64_t threads) {
    Linear* linears[] = {&wqkv, &wo, &gate_up, &down};
    const int64_t cols[] = {E, HD, E, w.F};
    for (int i = 0; i < 4; ++i) point_linear(*linears[i], w, i, cols[i]);
    F = w.F;
    arrange_layer_inputs(wqkv, gate_up, F, M);
    wqkv.prepare(M, N, threads);
    wo.prepare(M, E, threads);
    gate_up.prepare(M, 2 * F, threads);
    down.prepare(M, E, threads);
  }
};

// What the stack shares between its layers, checked once.
struct StackShape {
  int64_t M, E, D, heads, kv_heads, N, HD;
};

// x, cos and sin against the table, and a 5-D cache with its kv heads at dim 2 and head_dim at dim 4
// (both layouts) holding at least the `layers` the call runs, of the table's.
StackShape check_stack(const StackTable& table, int64_t layers, const at::Tensor& x, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& keys, const at::Tensor& values, const char* op,
                       const char* layout) {
  check_rows(x, op, Weights::kPlain);
  const auto dtype = x.scalar_type();
  const int64_t M = x.size(0), E = x.size(1), D = table.D, heads = table.heads, kv_heads = table.kv_heads;
  TORCH_CHECK(dtype == table.dtype && E == table.E, op, ": x must be [M, ", table.E, "] in ", table.dtype,
              " as the table's weights, got ", x.sizes(), " ", dtype);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == M && cos.size(1) == D && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              op, ": cos and sin must be [M, ", D, "] in x's dtype, got ", cos.sizes(), " ", cos.scalar_type());
  TORCH_CHECK(keys.dim() == 5 && values.sizes() == keys.sizes() && keys.scalar_type() == dtype &&
                  values.scalar_type() == dtype && keys.size(2) == kv_heads && keys.size(4) == D,
              op, ": keys and values must be ", layout, " with ", kv_heads, " kv heads of ", D,
              " in x's dtype, got ", keys.sizes(), " ", keys.scalar_type());
  const int64_t held = static_cast<int64_t>(table.layers.size());
  TORCH_CHECK(layers >= 1 && layers <= held && layers <= keys.size(0), op, ": layers must be 1 to ",
              std::min(held, keys.size(0)), " (the table's ", held, ", the cache's ", keys.size(0), "), got ",
              layers);
  return {M, E, D, heads, kv_heads, (heads + 2 * kv_heads) * D, heads * D};
}

// The static or growing cache [L, B, Hkv, T, D]: token m is token m % S of cache row m / S, writes
// at slots[m] of its row and attends its row's slots where visible[m] is set.
template <typename T>
struct DenseCache {
  at::Tensor& keys;
  at::Tensor& values;
  const int64_t* slots;
  const bool* visible;
  int64_t per_row, span;

  // Token m's keys and values of kv head h (in its row of qkv, after q) into its slot of its cache row.
  void write(const StackShape& s, int64_t layer, const T* qkv, int64_t m, int64_t h) const {
    const int64_t b = m / per_row, slot = slots[m];
    const T* src = qkv + m * s.N + s.HD + h * s.D;
    std::memcpy(keys.data_ptr<T>() + layer * keys.stride(0) + b * keys.stride(1) + h * keys.stride(2) +
                    slot * keys.stride(3),
                src, s.D * sizeof(T));
    std::memcpy(values.data_ptr<T>() + layer * values.stride(0) + b * values.stride(1) + h * values.stride(2) +
                    slot * values.stride(3),
                src + s.kv_heads * s.D, s.D * sizeof(T));
  }
  DenseAttention<T> attention(const StackShape& s, int64_t layer, float scale) const {
    return {keys.data_ptr<T>() + layer * keys.stride(0), values.data_ptr<T>() + layer * values.stride(0), visible,
            span, per_row, keys.stride(1), keys.stride(2), values.stride(1), values.stride(2), keys.stride(3), s.D,
            scale};
  }
};

template <typename T>
DenseCache<T> dense_cache(const StackShape& s, at::Tensor& keys, at::Tensor& values, const at::Tensor& slots,
                              const at::Tensor& visible) {
  TORCH_CHECK(keys.stride(4) == 1 && values.stride(4) == 1 && keys.stride(3) == values.stride(3), kOp,
              ": keys and values must be contiguous along head_dim and share their slot stride");
  const int64_t rows = keys.size(1);
  TORCH_CHECK(rows >= 1 && s.M % rows == 0 && slots.dim() == 2 && slots.size(0) == rows &&
                  slots.size(1) == s.M / rows && slots.scalar_type() == at::kLong,
              kOp, ": slots must be int64 [B, M / B] for the cache's B = ", rows, " rows, got ", slots.sizes());
  TORCH_CHECK(visible.dim() == 2 && visible.size(0) == s.M && visible.size(1) <= keys.size(3) &&
                  visible.scalar_type() == at::kBool,
              kOp, ": visible must be a bool [M, A] with A <= the cache's ", keys.size(3), " slots");
  TORCH_CHECK(slots.is_contiguous() && visible.is_contiguous(), kOp, ": slots and visible must be contiguous");
  const int64_t* slot_of = slots.data_ptr<int64_t>();
  for (int64_t m = 0; m < s.M; ++m)
    TORCH_CHECK(slot_of[m] >= 0 && slot_of[m] < keys.size(3), kOp, ": slot ", slot_of[m], " is outside the cache's ",
                keys.size(3), " slots");
  return {keys, values, slot_of, visible.data_ptr<bool>(), s.M / rows, visible.size(1)};
}

// Continuous batching's paged cache [L, NB, Hkv, bs, D] (contiguous; block NB - 1 is the sink):
// token m writes at slot_mapping[m] and attends its request's positions through its block table.
template <typename T>
struct PagedCache {
  at::Tensor& keys;
  at::Tensor& values;
  std::vector<int64_t> writes;   // [M]: each token's slot row, an element offset within a layer's kv head 0
  std::vector<int64_t> offsets;  // every token's visible slots in position order, offsets as writes'
  std::vector<int64_t> starts;   // [M + 1]: token m's are offsets[starts[m] .. starts[m + 1])
  int64_t head_stride;

  void write(const StackShape& s, int64_t layer, const T* qkv, int64_t m, int64_t h) const {
    const T* src = qkv + m * s.N + s.HD + h * s.D;
    const int64_t at = layer * keys.stride(0) + writes[m] + h * head_stride;
    std::memcpy(keys.data_ptr<T>() + at, src, s.D * sizeof(T));
    std::memcpy(values.data_ptr<T>() + at, src + s.kv_heads * s.D, s.D * sizeof(T));
  }
  PagedAttention<T> attention(const StackShape& s, int64_t layer, float scale) const {
    return {keys.data_ptr<T>() + layer * keys.stride(0), values.data_ptr<T>() + layer * values.stride(0),
            offsets.data(), starts.data(), head_stride, s.D, scale};
  }
};

template <typename T>
PagedCache<T> paged_cache(const StackShape& s, at::Tensor& keys, at::Tensor& values, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& request_index, const at::Tensor& positions,
                          int64_t sliding_window) {
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous(), kPagedOp, ": the paged keys and values must be contiguous");
  const auto index = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == s.M && t.scalar_type() == at::kLong && t.is_contiguous(), kPagedOp, ": ",
                name, " must be contiguous int64 [M], got ", t.sizes(), " ", t.scalar_type());
    return t.data_ptr<int64_t>();
  };
  const int64_t* slot_of = index(slot_mapping, "slot_mapping");
  const int64_t* request_of = index(request_index, "request_index");
  const int64_t* position_of = index(positions, "positions");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), kPagedOp,
              ": block_tables must be contiguous int64 [R, W], got ", block_tables.sizes());
  const int64_t blocks = keys.size(1), block_size = keys.size(3), rows = block_tables.size(0),
                width = block_tables.size(1), D = s.D;
  const int64_t head_stride = block_size * D, block_stride = s.kv_heads * head_stride;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  PagedCache<T> cache{keys, values, {}, {}, {0}, head_stride};
  cache.writes.resize(s.M);
  for (int64_t m = 0; m < s.M; ++m) {
    const int64_t slot = slot_of[m] < 0 ? (blocks - 1) * block_size : slot_of[m];
    TORCH_CHECK(slot < blocks * block_size, kPagedOp, ": slot ", slot, " is outside the cache's ", blocks * block_size,
                " slots");
    cache.writes[m] = genfn_kernels::paged_slot_offset(slot, block_size, block_stride, D);
    const int64_t r = request_of[m], length = position_of[m] + 1;
    TORCH_CHECK(r >= 0 && r < rows && length >= 1 && length <= width * block_size, kPagedOp, ": token ", m,
                " (request ", r, ", position ", position_of[m], ") is outside the ", rows, " block tables of ", width,
                " blocks of ", block_size);
    const int64_t* table = tables + r * width;
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, length - sliding_window) : 0;
    for (int64_t b = first / block_size; b <= (length - 1) / block_size; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < blocks, kPagedOp, ": block ", table[b], " of request ", r,
                  " is outside the cache's ", blocks);
    const int64_t start = cache.starts.back();
    cache.offsets.resize(start + length - first);
    genfn_kernels::paged_position_offsets(table, first, length, block_size, block_stride, D,
                                          cache.offsets.data() + start);
    cache.starts.push_back(start + length - first);
  }
  return cache;
}

// Layer `layer` inside the stack's parallel region, thread t of `team`: its attention input, each
// rotated q head copied to q and each k head's keys and values written into the cache by the thread
// that rotated it, then its output, all of it into the thread's own `out` (which may be x).
// after_attention as layer_output_in's.
template <typename T, typename Linear, typename Cache, typename AfterAttention>
void run_layer(const StackShape& s, LayerLinears<Linear>& l, const T* x, const TableLayer& w, const T* cos,
               const T* sin, const Cache& cache, int64_t layer, float eps, float scale, T* qkv, T* q,
               const OutputBuffers<T>& buffers, T* out, int64_t t, int64_t team, TeamBarrier& barrier,
               const AfterAttention& after_attention) {
  const auto place = [&](int64_t m, int64_t head, const T* rotated) {
    if (head < s.heads) std::memcpy(q + (m * s.heads + head) * s.D, rotated, s.D * sizeof(T));
    else cache.write(s, layer, qkv, m, head - s.heads);
  };
  attention_input_in(x, static_cast<const T*>(w.attn_norm), l.wqkv, cos, sin, s.M, s.E, s.N, s.heads, s.kv_heads,
                     s.D, eps, qkv, t, team, barrier, place);
  barrier.wait(team);
  layer_output_in(x, q, cache.attention(s, layer, scale), l.wo, static_cast<const T*>(w.mlp_norm), l.gate_up, l.down,
                  s.M, s.E, s.heads, s.kv_heads, s.D, l.F, eps, out, Out::kOwn, buffers, t, team, barrier,
                  after_attention);
}

// Each kind of layer's linears, two sets: layer i runs set i % 2 while one thread readies the other
// for layer i + 1 (set (i + 1) % 2 is free once every thread has met in layer i, and the barrier
// after layer i's attention publishes it).
template <typename Linear>
using LinearSets = std::array<LayerLinears<Linear>, 2>;

// The whole stack in one parallel region: its threads meet only where data passes between them
// (after a linear's products, the rotated heads and cache writes, the attention, the SwiGLU): 7
// times a layer where a one-row layer of Q4_1 tiles met 14 times in two regions of its own, the
// cache writes on one thread between them. SmolLM2 Q4_1, fresh processes alternated: 1.05x the
// tokens a second eager, 1.07x compiled (at 8 meetings); the 1B shape within its noise. Each thread
// adds a layer's whole output to a residual stream of its own (E adds, not E / team), so no meeting
// ends a layer, and thread 0 readies the next layer's linears beside the attention, where it has
// the fewest heads and waited.
template <typename T, typename Cache>
at::Tensor run_stack(const StackShape& s, const StackTable& table, int64_t layers, const at::Tensor& x,
                     const at::Tensor& cos, const at::Tensor& sin, const Cache& cache, double eps, double scale) {
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor result = at::empty({s.M, s.E}, x.options());
  at::Tensor qkv = at::empty({s.M, s.N}, x.options()), q = at::empty({s.M, s.HD}, x.options());
  const at::Tensor xc = x.contiguous();
  LinearSets<DenseLinear<T>> plain;
  std::unique_ptr<LinearSets<QuantLinear>> tiles;  // made for a table that has such layers
  std::unique_ptr<LinearSets<KQuantLinear>> kquants;
  std::unique_ptr<LinearSets<MixedLinear>> mixed;
  int64_t F = 0;  // the widest MLP, which the shared buffers must hold
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t kind = table.layers[layer].kind;
    constexpr bool kBfloat16 = std::is_same_v<T, c10::BFloat16>;
    TORCH_INTERNAL_ASSERT(kind == kPlain || (kind == kCoded) == kBfloat16,
                          "decode_stack_table lets only plain and coded layers take bfloat16 x, and coded ones only it");
    if (kind == kTiles && !tiles) tiles = std::make_unique<LinearSets<QuantLinear>>();
    if (kind == kKQuant && !kquants) kquants = std::make_unique<LinearSets<KQuantLinear>>();
    if (kind == kMixed && !mixed) mixed = std::make_unique<LinearSets<MixedLinear>>();
    F = std::max(F, table.layers[layer].F);
  }
  thread_local OutputBuffers<T> own;
  OutputBuffers<T>& buffers = own;  // this thread's, which the region's threads share
  buffers.resize(s.M, s.E, s.HD, F);
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  // Calls f with layer's set of linears of its kind.
  const auto with_linears = [&](int64_t layer, auto&& f) {
    const int64_t kind = table.layers[layer].kind;
    if (kind == kPlain || kind == kCoded) {
      f(plain[layer % 2]);
    } else if constexpr (std::is_same_v<T, float>) {
      if (kind == kTiles) f((*tiles)[layer % 2]);
      else if (kind == kKQuant) f((*kquants)[layer % 2]);
      else f((*mixed)[layer % 2]);
    }
  };
  const auto ready = [&](int64_t layer) {
    with_linears(layer, [&](auto& l) { l.ready(table.layers[layer], s.M, s.E, s.N, s.HD, threads); });
  };
  ready(0);
  const T* first = xc.data_ptr<T>();
  const T* cos_rows = cc.data_ptr<T>();
  const T* sin_rows = sc.data_ptr<T>();
  T* result_rows = result.data_ptr<T>();
  T* qkv_rows = qkv.data_ptr<T>();
  T* q_rows = q.data_ptr<T>();
  const float e = static_cast<float>(eps), a = static_cast<float>(scale);
  TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    thread_local std::vector<T> residual;  // this thread's residual stream
    residual.resize(s.M * s.E);
    for (int64_t layer = 0; layer < layers; ++layer) {
      const auto ready_next = [&] {
        if (layer + 1 < layers) ready(layer + 1);
      };
      with_linears(layer, [&](auto& l) {
        run_layer<T>(s, l, layer == 0 ? first : residual.data(), table.layers[layer], cos_rows, sin_rows, cache,
                     layer, e, a, qkv_rows, q_rows, buffers, residual.data(), t, team, barrier,
                     ready_next);
      });
    }
    if (t == 0) std::copy(residual.begin(), residual.end(), result_rows);
  }
  return result;
}

at::Tensor decode_stack(const at::Tensor& x, const at::Tensor& table, int64_t layers, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, const at::Tensor& slots,
                        const at::Tensor& visible, double eps, double scale) {
  const StackTable& t = table_of(table, kOp);
  const StackShape s = check_stack(t, layers, x, cos, sin, keys, values, kOp, "[layers, B, kv_heads, slots, D]");
  const at::Tensor slot_list = slots.contiguous(), vis = visible.contiguous();
  if (x.scalar_type() == at::kFloat)
    return run_stack<float>(s, t, layers, x, cos, sin, dense_cache<float>(s, keys, values, slot_list, vis), eps,
                            scale);
  return run_stack<c10::BFloat16>(s, t, layers, x, cos, sin,
                                  dense_cache<c10::BFloat16>(s, keys, values, slot_list, vis), eps, scale);
}

at::Tensor decode_stack_paged(const at::Tensor& x, const at::Tensor& table, int64_t layers, const at::Tensor& cos,
                              const at::Tensor& sin, at::Tensor& keys, at::Tensor& values,
                              const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& request_index, const at::Tensor& positions, double eps, double scale,
                              int64_t sliding_window) {
  const StackTable& t = table_of(table, kPagedOp);
  const StackShape s = check_stack(t, layers, x, cos, sin, keys, values, kPagedOp,
                                   "[layers, blocks, kv_heads, block_size, D]");
  const at::Tensor mapping = slot_mapping.contiguous(), tables = block_tables.contiguous(),
                   requests = request_index.contiguous(), where = positions.contiguous();
  if (x.scalar_type() == at::kFloat)
    return run_stack<float>(s, t, layers, x, cos, sin,
                            paged_cache<float>(s, keys, values, mapping, tables, requests, where, sliding_window),
                            eps, scale);
  return run_stack<c10::BFloat16>(
      s, t, layers, x, cos, sin,
      paged_cache<c10::BFloat16>(s, keys, values, mapping, tables, requests, where, sliding_window), eps, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("decode_stack(Tensor x, Tensor table, int layers, Tensor cos, Tensor sin, Tensor(a!) keys, "
        "Tensor(b!) values, Tensor slots, Tensor visible, float eps, float scale) -> Tensor");
  m.def("decode_stack_paged(Tensor x, Tensor table, int layers, Tensor cos, Tensor sin, Tensor(a!) keys, "
        "Tensor(b!) values, Tensor slot_mapping, Tensor block_tables, Tensor request_index, Tensor positions, "
        "float eps, float scale, int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("decode_stack", &decode_stack);
  m.impl("decode_stack_paged", &decode_stack_paged);
}
