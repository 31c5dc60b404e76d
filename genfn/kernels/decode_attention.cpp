// Decode attention (one query per row) read in place from the KV cache: the paged cache of
// continuous batching, with the cache write that precedes it, and the dense static cache.
//
// A continuous-batching decode step has one query per request; its keys sit in the request's
// blocks of the paged cache. Gathering those blocks into a dense [rows, heads, span, D] tensor and
// calling scaled_dot_product_attention copies every key and value once per layer and pays the
// library's per-call set-up, which together cost more than the attention arithmetic itself at a
// few dozen rows. Here each (query, kv head) pair walks its block table and reads the keys and
// values where they lie (paged_query_attention): scores for the kv head's query group, a softmax,
// the weighted values. Arithmetic is float32 whatever the cache's dtype (bfloat16 is widened on
// load), as the reference paged attention computes.
//
// The dense cache's decode step is the same walk over the row's visible slots (a boolean mask),
// with the same arithmetic (attend_rows_at), so a query gets the same bits over the same keys from
// either cache. scaled_dot_product_attention's CPU flash kernel took 75 us a layer for one query of
// SmolLM2 against 256 slots (2.2 of a 14 ms bfloat16 step, torch.profiler), mostly set-up, where
// reading the ~100 visible keys and values takes a few. It follows that kernel's order of rounding
// so that a model's tokens stay those of transformers: scores = (q . k) * scale, e = exp(s - max),
// the weighted sum of values over the unnormalized e (rounded to bfloat16 first when the cache is
// bfloat16, as the flash kernel rounds its probabilities), divided by sum(e) at the end.
//
// Both soft-cap scores where softcap > 0 (Gemma 2): s = tanh(s / softcap) * softcap after the scale
// and before the softmax, as the reference paged attention (soft_capped) does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_lanes.h"
#include "decode_kernels.h"

namespace {

using namespace genfn_kernels::lanes;
namespace simd = genfn_kernels::simd;

constexpr int64_t kMaxGroups = 8;   // query heads per kv head held in registers
constexpr int64_t kMaxQueryVectors = 16;  // the per-query walk (attend_rows_at) takes head_dim <= 256 (Gemma)

void check_tables(const at::Tensor& tables, const at::Tensor& lengths, int64_t num_blocks, int64_t block_size) {
  const int64_t rows = tables.size(0), width = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= width * block_size, "paged_query_attention: length ", lp[r], " of row ", r,
                " is outside 1..", width * block_size, " (table width x block size)");
    const int64_t used = (lp[r] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tp[r * width + b] >= 0 && tp[r * width + b] < num_blocks, "paged_query_attention: block ",
                  tp[r * width + b], " of row ", r, " is outside the cache's ", num_blocks, " blocks");
  }
}

// Slots whose keys one pass scores for every head of the query group: 8 KiB at head_dim 64, so they
// stay in L1 while the group's heads take their turns.
constexpr int64_t kSlotRun = 32;

// How many heads of a query group weigh each loaded value row together, and how many of the row's
// V vectors a pass over the slots takes (the slice): the heads' chains of a slice and the slice
// itself in registers, each row loaded once for the heads. AVX-512 holds whole rows (up to 16 chains
// of its 32 F16s); AVX2's 8 F16s hold one vector of four heads and the vector, so it passes over the
// slots once per vector of the row. With whole rows there, two heads' chains and the row spilled to
// the stack every slot; sliced, a 4096-slot decode attention of 9 query heads (3 kv heads) takes 0.8x
// the time, of 32 (8) 0.75-1.07x, bound by the cache there (one Zen 4 core,
// benchmarks/results/avx2-decode-attention-trees-2026-12-08-s47-zen4.log). Every lane's chain still
// runs over the slots in order, so the slicing changes no bit.
constexpr int kValueChains = std::min(16, simd::kRegisters);
template <int V>
constexpr int kValueSlice = simd::kRegisters >= 32 ? V : 1;
template <int V>
constexpr int64_t kValueHeads = std::max(1, std::min(4, kValueChains / kValueSlice<V>));

// sums[h] = sum over i < n of weights[h * stride + i] * values[offsets[i]], one fma chain per lane in
// slot order, for H heads at once.
template <typename T, int V, int H>
void weigh_values(const T* values, const int64_t* offsets, int64_t n, const float* weights, int64_t stride,
                  F16 (*sums)[V]) {
  constexpr int S = kValueSlice<V>;
  for (int j0 = 0; j0 < V; j0 += S) {
    F16 acc[H][S];
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < S; ++j) acc[h][j] = simd::zero();
    for (int64_t i = 0; i < n; ++i) {
      const T* v = values + offsets[i] + j0 * kLanes;
      F16 rows[S];
      for (int j = 0; j < S; ++j) rows[j] = load_lanes(v + j * kLanes);
      for (int h = 0; h < H; ++h) {
        const F16 w = simd::set1(weights[h * stride + i]);
        for (int j = 0; j < S; ++j) acc[h][j] = simd::fmadd(w, rows[j], acc[h][j]);
      }
    }
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < S; ++j) sums[h][j0 + j] = acc[h][j];
  }
}

// G query heads that share a kv head against the n key/value rows at element offsets
// offsets[0 .. n) from keys/values, reduced in that order: the result depends on the query and
// those rows alone (not on how many other slots, rows or queries the call has), which is what the
// dense decode step and the batch-invariant mode's per-query attention (paged_query_attention)
// share, so the two give the same bits for the same keys. A score is its 16 lanes summed as one
// _mm512_reduce_add_ps (sum_lanes_of_16, 16 slots at a time), times the scale; a head's weighted
// values are one chain per lane over the slots in order, up to four heads' chains in registers
// (weigh_values; indexed by the run-time group count they had lived in memory, a store and reload
// per slot). With both, the walk of 11 tokens of a row over 136 slots took 0.71x the time.
template <typename T, int V>
void attend_rows_at(const T* q, const T* keys, const T* values, const int64_t* offsets, int64_t n, int64_t groups,
                    float scale, float softcap, T* out, std::vector<float>& scores) {
  constexpr int64_t D = V * kLanes;
  if (groups > kMaxGroups) {
    // More query heads share the kv head than the registers below hold (multi-query models): each head's
    // sums are its own, so kMaxGroups at a time give the same bits.
    for (int64_t g = 0; g < groups; g += kMaxGroups)
      attend_rows_at<T, V>(q + g * D, keys, values, offsets, n, std::min(kMaxGroups, groups - g), scale, softcap,
                           out + g * D, scores);
    return;
  }
  if (n == 0) {  // nothing visible: zeros, not the NaN of an empty softmax
    for (int64_t i = 0; i < groups * D; ++i) narrow(out + i, 0.f);
    return;
  }
  scores.resize(groups * n);
  const F16 sv = simd::set1(scale);
  for (int64_t run = 0; run < n; run += kSlotRun) {
    const int64_t stop = std::min(n, run + kSlotRun);
    for (int64_t g = 0; g < groups; ++g) {
      F16 qv[V];
      for (int j = 0; j < V; ++j) qv[j] = load_lanes(q + g * D + j * kLanes);
      for (int64_t i = run; i < stop; i += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, stop - i);
        F16 dots[kLanes];
        for (int64_t l = 0; l < kLanes; ++l)
          dots[l] = l < count ? dot_lanes<T, V>(qv, keys + offsets[i + l]) : simd::zero();
        simd::store_kept(scores.data() + g * n + i, simd::lanes_below(count), simd::mul(sum_lanes_of_16(dots), sv));
      }
    }
  }
  if (softcap > 0.f) soft_cap(scores.data(), groups * n, softcap);
  float totals[kMaxGroups];
  for (int64_t g = 0; g < groups; ++g) {
    float* s = scores.data() + g * n;
    totals[g] = exponentiate(s, n);
    if constexpr (!std::is_same_v<T, float>)
      for (int64_t i = 0; i < n; ++i) s[i] = static_cast<float>(T(s[i]));
  }
  F16 sums[kMaxGroups][V];
  for (int64_t g = 0; g < groups; g += kValueHeads<V>) {
    const int64_t heads = std::min<int64_t>(kValueHeads<V>, groups - g);
    if (heads == 1) weigh_values<T, V, 1>(values, offsets, n, scores.data() + g * n, n, sums + g);
    else if (heads == 2) weigh_values<T, V, 2>(values, offsets, n, scores.data() + g * n, n, sums + g);
    else if (heads == 3) weigh_values<T, V, 3>(values, offsets, n, scores.data() + g * n, n, sums + g);
    else weigh_values<T, V, 4>(values, offsets, n, scores.data() + g * n, n, sums + g);
  }
  alignas(64) float lanes[kLanes];
  for (int64_t g = 0; g < groups; ++g) {
    const F16 inv = simd::set1(1.f / totals[g]);
    for (int j = 0; j < V; ++j) {
      simd::storeu(lanes, simd::mul(sums[g][j], inv));
      for (int l = 0; l < kLanes; ++l) narrow(out + g * D + j * kLanes + l, lanes[l]);
    }
  }
}

// Row r's G query heads that share kv head h against the slots where visible[0 .. span) is set.
// keys/values point at the kv head's slot 0; slots are `slot_stride` elements apart.
template <typename T, int V>
void attend_visible(const T* q, const T* keys, const T* values, const bool* visible, int64_t span,
                    int64_t slot_stride, int64_t groups, float scale, float softcap, T* out,
                    std::vector<float>& scores, std::vector<int64_t>& offsets) {
  offsets.resize(span);
  int64_t n = 0;
  for (int64_t s = 0; s < span; ++s) {  // without a branch (push_back was ~3 % of an 11-token fused layer)
    offsets[n] = s * slot_stride;
    n += visible[s];
  }
  attend_rows_at<T, V>(q, keys, values, offsets.data(), n, groups, scale, softcap, out, scores);
}

template <typename T, int V>
void attend_dense_rows(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& visible, const int64_t* cache_rows, double scale, double softcap,
                       at::Tensor& out) {
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = keys.size(1), span = visible.size(1);
  const int64_t groups = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const bool* mp = visible.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  const int64_t kb = keys.stride(0), kh = keys.stride(1), ks = keys.stride(2);
  const int64_t vb = values.stride(0), vh = values.stride(1), vs = values.stride(2);
  TORCH_CHECK(ks == vs, "dense_decode_attention: keys and values must share their slot stride");
  // A task is one (row, kv head). At one row of SmolLM2 a task is ~1 us of arithmetic per hundred
  // visible slots: split across threads only where each gets several tasks' worth.
  const int64_t per_task = groups * span * V * kLanes;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(per_task, 1));
  at::parallel_for(0, rows * kv_heads, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> slots;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / kv_heads, h = i % kv_heads, c = cache_rows ? cache_rows[r] : r;
      const int64_t offset = (r * heads + h * groups) * V * kLanes;
      attend_visible<T, V>(qp + offset, kp + c * kb + h * kh, vp + c * vb + h * vh, mp + r * span, span, ks,
                           groups, static_cast<float>(scale), static_cast<float>(softcap), op + offset, scores, slots);
    }
  });
}

// q [N, H, D]; keys, values [B, Hkv, >= A, D] (any strides but a contiguous D); visible [N, A]
// bool: query n attends slot s < A of its cache row where visible[n, s]; cache_rows [N] (int64):
// query n's cache row (default n, with B == N: a decode step's one query a row; several queries of
// one row, a few-token forward's, share it without copies); softcap > 0: scores soft-capped,
// tanh(s / softcap) * softcap (Gemma 2). Returns [N, H, D] in q's dtype.
at::Tensor dense_decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& visible, double scale, double softcap,
                                  const std::optional<at::Tensor>& cache_rows) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "dense_decode_attention: q must be [N, H, D] and keys/values [B, kv_heads, slots, D]");
  TORCH_CHECK(keys.size(3) == q.size(2), "dense_decode_attention: keys ", keys.sizes(), " do not match q ",
              q.sizes());
  at::Tensor rows;
  if (cache_rows.has_value()) {
    rows = cache_rows->contiguous();
    TORCH_CHECK(rows.dim() == 1 && rows.size(0) == q.size(0) && rows.scalar_type() == at::kLong,
                "dense_decode_attention: cache_rows must be an int64 [N] (a cache row for each of q's ", q.size(0),
                " queries), got ", rows.sizes(), " ", rows.scalar_type());
    TORCH_CHECK(rows.numel() == 0 || (rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < keys.size(0)),
                "dense_decode_attention: cache_rows must lie in [0, ", keys.size(0), ")");
  } else {
    TORCH_CHECK(keys.size(0) == q.size(0), "dense_decode_attention: keys ", keys.sizes(), " do not match q ",
                q.sizes(), " (give cache_rows where queries share cache rows)");
  }
  TORCH_CHECK(keys.size(1) >= 1 && q.size(1) % keys.size(1) == 0,
              "dense_decode_attention: query heads (", q.size(1), ") must be a multiple of kv heads (",
              keys.size(1), ")");
  TORCH_CHECK(q.size(2) % kLanes == 0 && q.size(2) / kLanes <= kMaxQueryVectors,
              "dense_decode_attention: head_dim must be a multiple of 16 up to 256, got ", q.size(2));
  TORCH_CHECK(visible.dim() == 2 && visible.size(0) == q.size(0) && visible.size(1) <= keys.size(2) &&
                  visible.scalar_type() == at::kBool,
              "dense_decode_attention: visible must be a bool [B, A] with A <= the cache's ", keys.size(2), " slots");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "dense_decode_attention: q, keys and values must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "dense_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1,
              "dense_decode_attention: keys and values must be contiguous along head_dim");
  const at::Tensor qc = q.contiguous(), mc = visible.contiguous();
  const int64_t* row_data = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty_like(qc);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  switch (q.size(2) / kLanes) {
#define GENFN_DENSE(V)                                                                      \
  case V:                                                                                   \
    if (bf16)                                                                               \
      attend_dense_rows<c10::BFloat16, V>(qc, keys, values, mc, row_data, scale, softcap, out); \
    else                                                                                    \
      attend_dense_rows<float, V>(qc, keys, values, mc, row_data, scale, softcap, out);     \
    break;
    GENFN_DENSE(1)
    GENFN_DENSE(2)
    GENFN_DENSE(3)
    GENFN_DENSE(4)
    GENFN_DENSE(5)
    GENFN_DENSE(6)
    GENFN_DENSE(7)
    GENFN_DENSE(8)
    GENFN_DENSE(9)
    GENFN_DENSE(10)
    GENFN_DENSE(11)
    GENFN_DENSE(12)
    GENFN_DENSE(13)
    GENFN_DENSE(14)
    GENFN_DENSE(15)
    GENFN_DENSE(16)
#undef GENFN_DENSE
  }
  return out;
}

template <typename T, int V>
void attend_queries_paged(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                          const at::Tensor& tables, const at::Tensor& lengths, double scale, int64_t sliding_window,
                          double softcap, at::Tensor& out) {
  constexpr int64_t D = V * kLanes;
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = keys.size(1), block_size = keys.size(2);
  const int64_t width = tables.size(1), groups = heads / kv_heads, block_stride = kv_heads * block_size * D;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  // One task per (query, kv head), each reduced by one thread: the thread count changes who runs a
  // task, never the order of its sums.
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    thread_local std::vector<int64_t> offsets;
    int64_t offsets_of = -1;  // the query whose slots `offsets` holds: its kv heads share them
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / kv_heads, h = i % kv_heads, length = lp[r];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, length - sliding_window) : 0;
      if (r != offsets_of) {
        offsets.resize(length - first);
        genfn_kernels::paged_position_offsets(tp + r * width, first, length, block_size, block_stride, D,
                                              offsets.data());
        offsets_of = r;
      }
      const int64_t offset = (r * heads + h * groups) * D;
      attend_rows_at<T, V>(qp + offset, kp + h * block_size * D, vp + h * block_size * D, offsets.data(),
                           static_cast<int64_t>(offsets.size()), groups, static_cast<float>(scale),
                           static_cast<float>(softcap), op + offset, scores);
    }
  });
}

// The batch-invariant mode's attention over the paged cache: query n (q [N, H, D]) against
// positions 0 .. lengths[n] - 1 of its block table (tables [N, W]; the last sliding_window of them
// when sliding_window > 0), in position order, with the dense decode step's arithmetic
// (attend_rows_at): a prefill chunk's queries, a decode step's and a lone request's all reduce a
// query over the same keys in the same order; softcap as dense_decode_attention's. Returns
// [N, H, D] in q's dtype.
at::Tensor paged_query_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 const at::Tensor& tables, const at::Tensor& lengths, double scale,
                                 int64_t sliding_window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "paged_query_attention: q must be [N, H, D] and keys/values [blocks, kv_heads, block_size, D]");
  TORCH_CHECK(q.size(2) == keys.size(3) && q.size(2) % kLanes == 0 && q.size(2) / kLanes <= kMaxQueryVectors,
              "paged_query_attention: head_dim must match the cache's and be a multiple of 16 up to 256");
  TORCH_CHECK(keys.size(1) >= 1 && q.size(1) % keys.size(1) == 0,
              "paged_query_attention: query heads (", q.size(1), ") must be a multiple of kv heads (", keys.size(1),
              ")");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lengths.dim() == 1 && lengths.size(0) == q.size(0) &&
                  tables.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong,
              "paged_query_attention: tables must be int64 [N, W] and lengths int64 [N] for N queries");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_query_attention: q, keys and values must share a dtype, float32 or bfloat16");
  TORCH_CHECK(softcap >= 0, "paged_query_attention: softcap must be > 0 (or 0 for none), got ", softcap);
  const at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  const at::Tensor tc = tables.contiguous(), lc = lengths.contiguous();
  check_tables(tc, lc, kc.size(0), kc.size(2));
  at::Tensor out = at::empty_like(qc);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  switch (q.size(2) / kLanes) {
#define GENFN_QUERIES(V)                                                                        \
  case V:                                                                                       \
    if (bf16)                                                                                   \
      attend_queries_paged<c10::BFloat16, V>(qc, kc, vc, tc, lc, scale, sliding_window, softcap, out); \
    else                                                                                                \
      attend_queries_paged<float, V>(qc, kc, vc, tc, lc, scale, sliding_window, softcap, out);          \
    break;
    GENFN_QUERIES(1)
    GENFN_QUERIES(2)
    GENFN_QUERIES(3)
    GENFN_QUERIES(4)
    GENFN_QUERIES(5)
    GENFN_QUERIES(6)
    GENFN_QUERIES(7)
    GENFN_QUERIES(8)
    GENFN_QUERIES(9)
    GENFN_QUERIES(10)
    GENFN_QUERIES(11)
    GENFN_QUERIES(12)
    GENFN_QUERIES(13)
    GENFN_QUERIES(14)
    GENFN_QUERIES(15)
    GENFN_QUERIES(16)
#undef GENFN_QUERIES
  }
  return out;
}

template <typename T>
void write_rows(T* buffer, const T* rows, const int64_t* slots, int64_t count, int64_t sink_slot,
                int64_t kv_heads, int64_t block_size, int64_t head_dim) {
  const int64_t block_stride = kv_heads * block_size * head_dim;
  for (int64_t t = 0; t < count; ++t) {
    T* dst = buffer + genfn_kernels::paged_slot_offset(slots[t] < 0 ? sink_slot : slots[t], block_size, block_stride,
                                                       head_dim);
    const T* src = rows + t * kv_heads * head_dim;
    for (int64_t h = 0; h < kv_heads; ++h)
      std::copy(src + h * head_dim, src + (h + 1) * head_dim, dst + h * block_size * head_dim);
  }
}

// keys, values [L, num_blocks, Hkv, block_size, D] (written in place at `layer`); slots [T] int64
// (block * block_size + offset; negative: the last block, the sink); k, v [T, Hkv, D].
void paged_write(at::Tensor& keys, at::Tensor& values, int64_t layer, const at::Tensor& slots, const at::Tensor& k,
                 const at::Tensor& v) {
  TORCH_CHECK(keys.dim() == 5 && values.sizes() == keys.sizes() && keys.is_contiguous() && values.is_contiguous(),
              "paged_write: keys/values must be contiguous [layers, blocks, kv_heads, block_size, D]");
  TORCH_CHECK(layer >= 0 && layer < keys.size(0), "paged_write: layer ", layer, " outside 0..", keys.size(0) - 1);
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == slots.size(0) && k.size(1) == keys.size(2) &&
                  k.size(2) == keys.size(4),
              "paged_write: k/v must be [T, kv_heads, D] matching the cache and slots [T]");
  TORCH_CHECK(k.scalar_type() == keys.scalar_type() && v.scalar_type() == keys.scalar_type() &&
                  slots.scalar_type() == at::kLong,
              "paged_write: k/v must have the cache's dtype and slots int64");
  const int64_t blocks = keys.size(1), kv_heads = keys.size(2), block_size = keys.size(3), head_dim = keys.size(4);
  const at::Tensor sc = slots.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < sc.size(0); ++t)
    TORCH_CHECK(sp[t] < blocks * block_size, "paged_write: slot ", sp[t], " is outside the cache's ",
                blocks * block_size, " slots");
  const int64_t layer_stride = blocks * kv_heads * block_size * head_dim;
  const int64_t sink_slot = (blocks - 1) * block_size;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, keys.scalar_type(), "paged_write", [&] {
    write_rows<scalar_t>(keys.data_ptr<scalar_t>() + layer * layer_stride, kc.data_ptr<scalar_t>(), sp, sc.size(0),
                         sink_slot, kv_heads, block_size, head_dim);
    write_rows<scalar_t>(values.data_ptr<scalar_t>() + layer * layer_stride, vc.data_ptr<scalar_t>(), sp,
                         sc.size(0), sink_slot, kv_heads, block_size, head_dim);
  });
}

}  // namespace

namespace genfn_kernels {

template <typename T>
void attend_group_at(const T* q, const T* keys, const T* values, const int64_t* offsets, int64_t n, int64_t groups,
                     int64_t head_dim, float scale, T* out) {
  thread_local std::vector<float> scores;
  switch (head_dim / kLanes) {
#define GENFN_GROUP(V) \
  case V:                \
    return attend_rows_at<T, V>(q, keys, values, offsets, n, groups, scale, 0.f, out, scores);
    GENFN_GROUP(1)
    GENFN_GROUP(2)
    GENFN_GROUP(3)
    GENFN_GROUP(4)
    GENFN_GROUP(5)
    GENFN_GROUP(6)
    GENFN_GROUP(7)
    GENFN_GROUP(8)
#undef GENFN_GROUP
  }
}

template <typename T>
void attend_group(const T* q, const T* keys, const T* values, const bool* visible, int64_t span,
                  int64_t slot_stride, int64_t groups, int64_t head_dim, float scale, T* out) {
  thread_local std::vector<int64_t> offsets;
  offsets.resize(span);
  int64_t n = 0;
  for (int64_t s = 0; s < span; ++s) {  // without a branch, as attend_visible
    offsets[n] = s * slot_stride;
    n += visible[s];
  }
  attend_group_at(q, keys, values, offsets.data(), n, groups, head_dim, scale, out);
}

template void attend_group_at<float>(const float*, const float*, const float*, const int64_t*, int64_t, int64_t,
                                     int64_t, float, float*);
template void attend_group_at<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                             const int64_t*, int64_t, int64_t, int64_t, float, c10::BFloat16*);

template void attend_group<float>(const float*, const float*, const float*, const bool*, int64_t, int64_t, int64_t,
                                  int64_t, float, float*);
template void attend_group<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                          const bool*, int64_t, int64_t, int64_t, int64_t, float, c10::BFloat16*);

}  // namespace genfn_kernels

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  // Any layout: it reads keys and values through their strides and makes q and visible contiguous,
  // so a step's one mask feeds every layer's call (decode_layer.cpp says why that matters).
  m.def("dense_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor visible, float scale, "
        "float softcap=0.0, Tensor? cache_rows=None) -> Tensor",
        {at::Tag::flexible_layout});
  m.def("paged_query_attention(Tensor q, Tensor keys, Tensor values, Tensor tables, Tensor lengths, float scale, "
        "int sliding_window, float softcap=0.0) -> Tensor");
  m.def("paged_write(Tensor(a!) keys, Tensor(b!) values, int layer, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("dense_decode_attention", &dense_decode_attention);
  m.impl("paged_query_attention", &paged_query_attention);
  m.impl("paged_write", &paged_write);
}
