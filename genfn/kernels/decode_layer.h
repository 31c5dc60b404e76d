// The pieces of a Llama decoder layer's decode step that its ops are built from: the three kinds
// of linear a layer's weights take (DenseLinear, QuantLinear, KQuantLinear), the two halves of the
// layer around the KV-cache write (attention_input, layer_output; mlp_input between), and the checks
// of the tensors the ops take. decode_layer.cpp makes them one op per half of one layer;
// decode_stack.cpp runs a whole stack of layers, the cache writes included, in one call.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>
#include <omp.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "decode_kernels.h"
#include "kquant.h"
#include "row_ops.h"

namespace genfn_kernels {

// A coded bfloat16 matrix's four tensors (records, bases, raw, raw_start), checked against each
// other (coded_bf16.cpp); the tensors must outlive the call.
CodedWeight coded_weight_of(const at::Tensor& records, const at::Tensor& bases, const at::Tensor& raw,
                            const at::Tensor& raw_start, const char* op);

}  // namespace genfn_kernels

namespace genfn_kernels::layer {

// The most rows a layer call takes: the linears run them in even groups of at most kMaxDecodeRows
// (group_size), every group over each chunk of weights while it is in L1 (one weight stream). A
// row is one token; a cache row may hold several of them (a speculative verification's positions
// of one sequence), each attending its own visible slots, so that each gets the bits a step of
// that token alone gets.
inline constexpr int64_t kMaxLayerRows = 2 * kMaxDecodeRows;

// [begin, end) of `count` items for thread t of a team of T: even contiguous shares.
inline std::pair<int64_t, int64_t> share(int64_t count, int64_t t, int64_t T) {
  return {count * t / T, count * (t + 1) / T};
}

// out[m] = w * to_T(x[m] * rsqrt(mean(x[m]^2) + eps)), the model's _rms_norm: row_ops.h's, as the
// packed forward's, so a token gets the same bits in either.
template <typename T>
void rms_norm_rows(const T* x, const T* w, int64_t M, int64_t E, float eps, T* out) {
  for (int64_t m = 0; m < M; ++m) rows::norm_row(x + m * E, w, E, eps, out + m * E);
}

// The two kinds of weight a layer's linears read. Each is prepared before the parallel region,
// then called by every thread of it with the same arguments: y[M, N] = x[M, K] @ w.T.
// Rows of T, shared out balanced (past 8 rows, in groups: linear_balanced); or, bfloat16 only, a
// coded matrix (coded.records set: coded_bf16.cpp), its rows shared out alike and summed to the bits
// the plain rows give.
template <typename T>
struct DenseLinear {
  const T* w;
  CodedWeight coded{};
  RowQueue rows;
  void prepare(int64_t M, int64_t N, int64_t threads) {
    if (coded.records) rows.prepare_blocks(N, threads);
    else rows.prepare(M, N, threads, std::is_same_v<T, c10::BFloat16>);
  }
  void operator()(int64_t M, const T* x, int64_t K, int64_t N, T* y, int64_t t, int64_t, TeamBarrier&) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (coded.records) return coded_linear_share(M, x, coded, y, t, rows);
    }
    linear_balanced(M, x, w, K, N, y, t, rows);
  }
};

// Tiles of quantized rows against float32 activations: the threads quantize x (each all of a few
// rows for itself, row_queue.h's quantize_alone; else a share of the rows each, a group's rows into
// its own buffer, and meet), then sum the tiles shared out balanced. A matrix may stack up to
// kMaxParts parts of different tile kinds (a Q5_K_M file's Q5_1 q/k beside a Q8_0 v), row ranges
// of the output one after another: x is quantized once, and each part's tiles are shared out in
// turn (a thread done with its share of one part goes on to the next; they write other outputs).
struct QuantLinear {
  static constexpr int64_t kGroups = kMaxLayerRows / kMaxDecodeRows;
  static constexpr int64_t kMaxParts = 4;
  QuantWeight parts[kMaxParts];
  int64_t count = 1;
  genfn_kernels::QuantActivations x8[kGroups];
  int64_t per = 0, groups = 0, rows[kGroups] = {};  // prepare's split of the M rows (group_size)
  bool alone = false;
  // Set before prepare where each thread holds all of x itself (the norm of the residual it keeps):
  // then each quantizes one group's rows whole for itself, with no meeting, and no codes pass
  // between the threads (see arrange_layer_inputs).
  bool own_input = false;
  RowQueue tiles[kMaxParts];
  void prepare(int64_t M, int64_t, int64_t team) {
    per = genfn_kernels::group_size(M);
    groups = (M + per - 1) / per;
    alone = groups == 1 && (own_input || genfn_kernels::quantize_alone(M, team));
    for (int64_t g = 0; g < groups; ++g) {
      rows[g] = std::min(per, M - g * per);
      if (!alone) x8[g].resize(rows[g], parts[0].blocks * 32);
    }
    for (int64_t p = 0; p < count; ++p) tiles[p].prepare_blocks(parts[p].tiles, team);
  }
  // A gate/up matrix of one part (the gate's F rows, then the up's) run as two parts, so that each
  // thread's share of the tiles is the same columns of both and the SwiGLU after it (mlp_input,
  // share(F)) reads the gate and up its own thread wrote.
  void pair_gate_up(int64_t F) {
    if (count != 1 || F % 16 != 0 || parts[0].out_features != 2 * F) return;
    QuantWeight gate = parts[0], up = parts[0];
    const int64_t tiles = F / 16, skipped = tiles * up.blocks;
    gate.tiles = tiles;
    gate.out_features = F;
    up.tiles -= tiles;
    up.out_features = F;
    up.codes += skipped * genfn_kernels::tile_block_bytes(up.kind);
    up.scales += skipped * 16;
    if (up.mins != nullptr) up.mins += skipped * 16;
    parts[0] = gate;
    parts[1] = up;
    count = 2;
  }
  void operator()(int64_t, const float* x, int64_t K, int64_t N, float* y, int64_t t, int64_t team,
                  TeamBarrier& barrier) {
    const genfn_kernels::QuantActivations* codes = x8;
    if (alone) {  // the same codes in every thread: a row's quantization does not depend on who runs it
      thread_local genfn_kernels::QuantActivations own;
      own.resize(rows[0], parts[0].blocks * 32);
      genfn_kernels::quantize_rows_share(x, rows[0], K, own, 0, 1);
      codes = &own;
    } else {
      for (int64_t g = 0; g < groups; ++g)
        genfn_kernels::quantize_rows_share(x + g * per * K, rows[g], K, x8[g], t, team);
      barrier.wait(team);
    }
    float* out[kGroups];
    int64_t first = 0;  // the part's first output
    for (int64_t p = 0; p < count; first += parts[p].out_features, ++p) {
      for (int64_t g = 0; g < groups; ++g) out[g] = y + g * per * N + first;
      genfn_kernels::quant_linear_share_groups(groups, rows, codes, K, parts[p], out, t, tiles[p], nullptr, N);
    }
  }
};

// How a layer's tiles linears meet their inputs, set before prepare for M rows. Each thread keeps
// the residual whole, so it quantizes wqkv's and gate_up's x (the residual's norm) whole for itself
// (own_input); past kMaxDecodeRows / 2 rows the gate/up tiles run paired (pair_gate_up). Both keep
// lines of memory from passing between the threads: where this VM's two threads sit on different
// dies (its TeamBarrier then costs ~170-200 ns, against ~30 on one die), each line that one writes
// and the other reads costs several times what it does on one die, and SmolLM2 Q4_1's 8-row stack
// took 2.6-2.7 ms there against ~2.0 on one die. Alternated in one process where the threads sat
// on different dies: the own quantization 0.97x the stack's time at 4 rows and 0.975x at 8, the
// pairing 0.96x at 8 (1.006x at 4 and 1.008x at 1, within the rounds' spread, so not taken there).
// The same bits either way. Other kinds of linear read their inputs as they are.
template <typename Linear>
void arrange_layer_inputs(Linear&, Linear&, int64_t, int64_t) {}
inline void arrange_layer_inputs(QuantLinear& wqkv, QuantLinear& gate_up, int64_t F, int64_t M) {
  wqkv.own_input = true;
  gate_up.own_input = true;
  if (M > kMaxDecodeRows / 2) gate_up.pair_gate_up(F);
}

// GGUF K-quant rows (Q4_K, Q5_K, Q6_K, IQ4; a matrix may stack parts in several formats) against
// float32 activations: kquant_linear's row kernels, which live in the K-quant library
// (kquant_linear.cpp, its own ISA per function) and are reached through its entry table.
inline const genfn::kquant::LayerEntry& kquant_entry() {
  static const genfn::kquant::LayerEntry* entry = [] {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("genfn_kquant::kquant_layer_entry", "");
    const auto* found = reinterpret_cast<const genfn::kquant::LayerEntry*>(op.typed<int64_t()>().call());
    TORCH_CHECK(found->key == genfn::kquant::layer_entry_key(),
                "the K-quant kernels were built from another kquant.h than the decode kernels");
    return found;
  }();
  return *entry;
}

struct KQuantLinear {
  genfn::kquant::SharedLinear shared;
  void prepare(int64_t M, int64_t, int64_t team) { kquant_entry().prepare(shared, M, team); }
  void operator()(int64_t, const float* x, int64_t, int64_t, float* y, int64_t t, int64_t team,
                  TeamBarrier& barrier) {
    kquant_entry().linear_share(shared, x, y, t, team, barrier);
  }
};

// A linear of a layer whose linears mix the two quantized kinds: a Q4_K_M file of a 576-wide model
// keeps its Q5_0 matrices as tiles beside Q4_K/Q6_K rows. Each linear runs its own kind's
// code (every thread takes the same branch, so the kinds' barriers line up).
struct MixedLinear {
  bool tiles = true;
  QuantLinear quant;
  KQuantLinear kquant;
  void prepare(int64_t M, int64_t N, int64_t team) {
    if (tiles) quant.prepare(M, N, team);
    else kquant.prepare(M, N, team);
  }
  void operator()(int64_t M, const float* x, int64_t K, int64_t N, float* y, int64_t t, int64_t team,
                  TeamBarrier& barrier) {
    if (tiles) quant(M, x, K, N, y, t, team, barrier);
    else kquant(M, x, K, N, y, t, team, barrier);
  }
};
// A mixed layer's tiles linears meet their inputs as arrange_layer_inputs says. Only a linear that
// runs tiles reads its QuantLinear, so own_input may be set on any; gate_up's parts are paired only
// where they are tiles.
inline void arrange_layer_inputs(MixedLinear& wqkv, MixedLinear& gate_up, int64_t F, int64_t M) {
  if (gate_up.tiles) arrange_layer_inputs(wqkv.quant, gate_up.quant, F, M);
  else wqkv.quant.own_input = true;
}

// Inside a parallel region, thread t of `team`: qkv = rms_norm(x) @ wqkv.T with RoPE on q's and k's
// heads, each rotated head then handed to place(m, head, rotated) by the thread that rotated it (q's
// heads 0 .. heads - 1, then k's), so a caller can move it on without another pass. A barrier must
// follow before another thread reads qkv or what place wrote.
template <typename T, typename Linear, typename Place>
void attention_input_in(const T* x, const T* norm, Linear& wqkv, const T* cos, const T* sin, int64_t M, int64_t E,
                        int64_t N, int64_t heads, int64_t kv_heads, int64_t D, float eps, T* qkv, int64_t t,
                        int64_t team, TeamBarrier& barrier, const Place& place) {
  // Every thread normalizes the few rows itself: cheaper than a barrier.
  thread_local std::vector<T> h;
  h.resize(M * E);
  rms_norm_rows(x, norm, M, E, eps, h.data());
  wqkv(M, h.data(), E, N, qkv, t, team, barrier);
  barrier.wait(team);
  const int64_t rotated = heads + kv_heads;  // q's heads, then k's
  const auto [begin, end] = share(M * rotated, t, team);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t m = i / rotated, head = i % rotated;
    T* x_head = qkv + m * N + head * D;
    rows::rotate_head(x_head, cos + m * D, sin + m * D, D, x_head);  // in place
    place(m, head, x_head);
  }
}

// attention_input_in in a parallel region of its own (wqkv prepared here).
template <typename T, typename Linear>
void attention_input(const T* x, const T* norm, Linear& wqkv, const T* cos, const T* sin, int64_t M, int64_t E,
                     int64_t N, int64_t heads, int64_t kv_heads, int64_t D, float eps, T* qkv) {
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  wqkv.prepare(M, N, threads);
  TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  attention_input_in(x, norm, wqkv, cos, sin, M, E, N, heads, kv_heads, D, eps, qkv,
                     static_cast<int64_t>(omp_get_thread_num()), static_cast<int64_t>(omp_get_num_threads()), barrier,
                     [](int64_t, int64_t, const T*) {});
}

// Inside a parallel region, thread t of `team`: act = silu(g) * u for g, u = rms_norm(x1) @ w_gate_up.T
// (each thread normalizes the few rows itself: cheaper than a barrier). A barrier must follow
// before act is read.
template <typename T, typename Linear>
void mlp_input(const T* x1, const T* mlp_norm, Linear& w_gate_up, int64_t M, int64_t E, int64_t F, float eps,
               T* gate_up, T* act, int64_t t, int64_t team, TeamBarrier& barrier) {
  thread_local std::vector<T> h;
  h.resize(M * E);
  rms_norm_rows(x1, mlp_norm, M, E, eps, h.data());
  w_gate_up(M, h.data(), E, 2 * F, gate_up, t, team, barrier);
  barrier.wait(team);
  const auto [begin, end] = share(F, t, team);
  for (int64_t m = 0; m < M; ++m) {
    const T* gate = gate_up + m * 2 * F;
    rows::silu_mul_row(gate + begin, gate + F + begin, end - begin, act + m * F + begin);
  }
}

// Where token m's query heads find their keys and values, as layer_output asks for them: a dense
// cache (rows of slots, a visible mask per token; the static and growing caches) or a paged one
// (blocks through each token's table; continuous batching). Both walk the visible slots in
// position order with the same arithmetic (attend_rows_at), so equal caches give equal bits.
template <typename T>
struct DenseAttention {
  const T* keys;
  const T* values;
  const bool* visible;  // [M, span]
  int64_t span, per_cache_row, key_row, key_head, value_row, value_head, slot;
  int64_t D;
  float scale;
  // Token m's `groups` query heads q over kv head kv, into out.
  void operator()(int64_t m, int64_t kv, const T* q, int64_t groups, T* out) const {
    const int64_t c = m / per_cache_row;  // tokens c * per_cache_row .. attend cache row c
    attend_group(q, keys + c * key_row + kv * key_head, values + c * value_row + kv * value_head, visible + m * span,
                 span, slot, groups, D, scale, out);
  }
};

template <typename T>
struct PagedAttention {
  const T* keys;    // the layer's [blocks, Hkv, block_size, D]
  const T* values;
  // Token m's visible slots, as element offsets from its kv head's rows of block 0, in position
  // order: offsets[starts[m] .. starts[m + 1]).
  const int64_t* offsets;
  const int64_t* starts;
  int64_t head_stride, D;
  float scale;
  void operator()(int64_t m, int64_t kv, const T* q, int64_t groups, T* out) const {
    attend_group_at(q, keys + kv * head_stride, values + kv * head_stride, offsets + starts[m],
                    starts[m + 1] - starts[m], groups, D, scale, out);
  }
};

// The buffers the threads of a layer's output half share: the attention output, the o projection,
// the gate/up projection, the SwiGLU activation, the down projection.
template <typename T>
struct OutputBuffers {
  std::vector<T> data;
  T *attn = nullptr, *o = nullptr, *gate_up = nullptr, *act = nullptr, *down = nullptr;
  void resize(int64_t M, int64_t E, int64_t HD, int64_t F) {
    data.resize(M * (HD + E + 2 * F + F + E));
    attn = data.data();
    o = attn + M * HD;
    gate_up = o + M * E;
    act = gate_up + M * 2 * F;
    down = act + M * F;
  }
};

// Where layer_output_in writes out: a share of its columns by each thread into one buffer (a
// barrier must follow before another thread reads it), or all of it by each thread into a buffer
// of its own, which the thread reads on without waiting for the others (out may then be x).
enum class Out { kShared, kOwn };

// Inside a parallel region, thread t of `team`: out = x1 + down(silu(g) * u) for x1 = x +
// attention(q) @ wo.T, with b's buffers (sized for M, E, heads * D and F) shared by the team, written
// as `where` says. Thread 0, whose share of the attention is the smallest, calls
// after_attention() once it has attended its share: work of its own that fills its wait there.
template <typename T, typename Linear, typename Attention, typename AfterAttention>
void layer_output_in(const T* x, const T* q, const Attention& attend, Linear& wo, const T* mlp_norm,
                     Linear& w_gate_up, Linear& w_down, int64_t M, int64_t E, int64_t heads, int64_t kv_heads,
                     int64_t D, int64_t F, float eps, T* out, Out where, const OutputBuffers<T>& b, int64_t t,
                     int64_t team, TeamBarrier& barrier, const AfterAttention& after_attention) {
  const int64_t HD = heads * D, groups = heads / kv_heads;
  if ((M * kv_heads) % team == 0) {
    // One task per (row, kv head) where they split evenly: each kv head's keys and values are
    // read once for its whole query group (at 8 rows, a query head at a time read them three
    // times over, ~12 % of a Q4_1 step). The tasks go kv head by kv head, so a thread takes
    // every row of its kv heads: the rows of a lookup round attend the same slots, which the next
    // row finds in L2, and each thread reads its share of the kv heads, not all of them (by rows,
    // both threads read every head's keys and values). SmolLM2 Q4_1 over the copy task's span
    // (benchmarks/lookup_rounds.py's prompt, alternated in one process): the stack at 2 / 4 rows
    // 0.95x / 0.97x the time with the threads on two dies, at 4 rows 0.97x on one die (0.98x over a
    // short span), at 8 rows 1.00x. The same bits: a task's arithmetic does not depend on who runs it.
    const auto [begin, end] = share(M * kv_heads, t, team);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i % M, kv = i / M, first = m * heads + kv * groups;
      attend(m, kv, q + first * D, groups, b.attn + first * D);
    }
  } else {  // one task per (row, query head): 9 heads split 5/4 where 3 kv heads would split 2/1
    const auto [begin, end] = share(M * heads, t, team);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / heads, head = i % heads;
      attend(m, head / groups, q + i * D, int64_t{1}, b.attn + i * D);
    }
  }
  if (t == 0) after_attention();
  barrier.wait(team);
  wo(M, b.attn, HD, E, b.o, t, team, barrier);
  barrier.wait(team);
  // The residual after attention, by every thread for itself.
  thread_local std::vector<T> x1;
  x1.resize(M * E);
  rows::add_row(x, b.o, M * E, x1.data());
  mlp_input(x1.data(), mlp_norm, w_gate_up, M, E, F, eps, b.gate_up, b.act, t, team, barrier);
  barrier.wait(team);
  w_down(M, b.act, F, E, b.down, t, team, barrier);
  barrier.wait(team);
  const auto [begin, end] = where == Out::kOwn ? std::pair<int64_t, int64_t>{0, E} : share(E, t, team);
  for (int64_t m = 0; m < M; ++m)
    rows::add_row(x1.data() + m * E + begin, b.down + m * E + begin, end - begin, out + m * E + begin);
}

// layer_output_in in a parallel region of its own (the linears prepared here).
template <typename T, typename Linear, typename Attention>
void layer_output(const T* x, const T* q, const Attention& attend, Linear& wo, const T* mlp_norm, Linear& w_gate_up,
                  Linear& w_down, int64_t M, int64_t E, int64_t heads, int64_t kv_heads, int64_t D, int64_t F,
                  float eps, T* out) {
  thread_local OutputBuffers<T> own;
  OutputBuffers<T>& buffers = own;  // this thread's, which the region's threads share (by name each has its own)
  buffers.resize(M, E, heads * D, F);
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  wo.prepare(M, E, threads);
  w_gate_up.prepare(M, 2 * F, threads);
  w_down.prepare(M, E, threads);
  TeamBarrier barrier;
#pragma omp parallel num_threads(threads)
  layer_output_in(x, q, attend, wo, mlp_norm, w_gate_up, w_down, M, E, heads, kv_heads, D, F, eps, out, Out::kShared,
                  buffers, static_cast<int64_t>(omp_get_thread_num()), static_cast<int64_t>(omp_get_num_threads()),
                  barrier, [] {});
}

// The layer's weights: plain (float32 or bfloat16 x), tiles16 blocks (float32 x and VNNI), K-quant
// rows (float32 x; the K-quant kernels pick their own path).
enum class Weights { kPlain, kTiles, kKQuant };

inline void check_rows(const at::Tensor& x, const char* op, Weights weights) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxLayerRows, op,
              ": x must be [M, hidden] with 1 <= M <= ", kMaxLayerRows, ", got ", x.sizes());
  if (weights == Weights::kKQuant) {
    TORCH_CHECK(x.scalar_type() == at::kFloat, op, ": float32 activations; got ", x.scalar_type());
  } else if (weights == Weights::kTiles) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && genfn_kernels::quant_shares_run(), op,
                ": float32 activations on a CPU with AVX512_VNNI, or the AVX2 library; got ", x.scalar_type());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
                ": float32 or bfloat16 activations; got ", x.scalar_type());
  }
}

// A norm's weight: [hidden] in x's dtype.
inline void check_norm(const at::Tensor& norm, const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(norm.dim() == 1 && norm.size(0) == x.size(1) && norm.scalar_type() == x.scalar_type(), op, ": ", name,
              " must be [hidden] in x's dtype");
}

inline void check_weight(const at::Tensor& w, const at::Tensor& x, int64_t rows, int64_t cols, const char* op,
                         const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) == rows && w.size(1) == cols && w.scalar_type() == x.scalar_type(), op, ": ",
              name, " must be [", rows, ", ", cols, "] in ", x.scalar_type(), ", got ", w.sizes(), " ", w.scalar_type());
}

// A quantized weight of [rows, cols] as quant_linear takes it (codes [tiles, blocks, bytes] uint8,
// float16 scales and, for kinds 1 and 4, minimums), checked; the tensors must outlive the call.
inline QuantWeight quant_weight(const at::Tensor& codes, const at::Tensor& scales,
                                const c10::optional<at::Tensor>& mins, int64_t kind, int64_t rows, int64_t cols,
                                const char* op, const char* name) {
  TORCH_CHECK(valid_tile_kind(kind), op, ": ", name, "'s kind must be ", kTileKindNames, ", got ", kind);
  const int64_t tiles = (rows + 15) / 16, blocks = cols / 32, bytes = tile_block_bytes(kind);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) == tiles &&
                  codes.size(1) == blocks && codes.size(2) == bytes && cols % 32 == 0,
              op, ": ", name, "'s codes must be contiguous uint8 [", tiles, ", ", blocks, ", ", bytes, "] for [", rows,
              ", ", cols, "], got ", codes.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == tiles * blocks * 16,
              op, ": ", name, "'s scales must be contiguous float16, ", tiles * blocks * 16, " of them");
  const bool has_min = has_minimum(kind);
  TORCH_CHECK(!has_min || (mins.has_value() && mins->scalar_type() == at::kHalf && mins->is_contiguous() &&
                           mins->numel() == scales.numel()),
              op, ": ", name, " of kind 1 or 4 needs float16 minimums shaped like its scales");
  return {codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
          has_min ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr, kind, tiles, blocks,
          rows};
}

// What decode_attention_input checks of x, norm, cos and sin; returns head_dim.
// The sizes of an attention_input call, after checking x (check_rows), norm, cos and sin.
struct AttentionInputSizes {
  int64_t M, E, N, D;
};

inline AttentionInputSizes check_attention_input(const at::Tensor& x, const at::Tensor& norm, const at::Tensor& cos,
                                          const at::Tensor& sin, int64_t heads, int64_t kv_heads, const char* op,
                                          Weights weights) {
  check_rows(x, op, weights);
  const int64_t M = x.size(0), E = x.size(1), D = cos.size(-1);
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(0) == M && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              op, ": cos and sin must be [M, head_dim] in x's dtype, got ", cos.sizes());
  check_norm(norm, x, op, "norm");
  return {M, E, (heads + 2 * kv_heads) * D, D};
}


// What decode_layer_output checks of x, q, the cache, the mask and the MLP norm.
inline void check_layer_output(const at::Tensor& x, const at::Tensor& q, const at::Tensor& keys,
                               const at::Tensor& values, const at::Tensor& visible, const at::Tensor& mlp_norm,
                               const char* op) {
  const int64_t M = x.size(0);
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
  check_norm(mlp_norm, x, op, "mlp_norm");
}

// linear: a K-quant matrix of [rows, cols] from its parts (uint8 [part rows, row bytes] in
// formats[p]), checked; `keep` holds the contiguous parts the call reads.
inline void kquant_weight(KQuantLinear& linear, const std::vector<at::Tensor>& parts,
                          const std::vector<int64_t>& formats, int64_t rows, int64_t cols, const char* op,
                          const char* name, std::vector<at::Tensor>& keep) {
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
                "3 (iq4_nl), 4 (iq4_xs), 5 (q4_k_r8), 6 (q5_k_r8), 7 (q6_k_r8) or 8 (iq4_xs_r8), got ", f);
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

inline int64_t kquant_rows(const std::vector<at::Tensor>& parts) {
  int64_t rows = 0;
  for (const auto& part : parts) rows += part.size(0);
  return rows;
}

}  // namespace genfn_kernels::layer
