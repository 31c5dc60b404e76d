// Attention of many queries per row against the dense static cache (a prefill), skipping the
// tiles of keys the mask hides from every query of a tile.
//
// torch's CPU flash attention with an explicit mask computes every (query, key) pair and masks
// afterwards: a causal prefill from an empty cache pays twice the work it needs (its causal
// variant cannot take the mask the padding and the cache's slots need, and at 512 keys its key
// block is the whole span anyway). Here queries go in tiles of query_tile() positions, with all G
// query heads of a kv head together (they read the same keys), and keys in tiles of kKeyTile
// slots; a key tile that no query of the tile may see is never read. The rest is a flash
// attention (running maximum and sum per query, rescaled per key tile), in float32 whatever the
// element type (float32 or bfloat16: q, keys and values widened as they are read, the output
// rounded once):
//
//   scores  = (scale * q) . keys^T     keys transposed once per tile, 4 queries x 64 keys a step
//   weights = exp(scores - running max) where the mask is set, 0 elsewhere
//   out     = sum(weights . values) / sum(weights)
//
// Written against lanes16.h, so both decode libraries build it with the same bits: a block's shape
// (queries by key vectors, value vectors) is by the registers, and every score and output lane is
// one chain whatever the shape.
//
// Which tiles are skipped is read from the mask itself, so any mask (left padding, a cache
// filled before, a sliding window) gives softmax(masked scores) . values, equal to the library
// attention's within float32 rounding (bfloat16: within the output's rounding). A query that sees
// no slot gets zeros (the library's NaN).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_lanes.h"
#include "decode_kernels.h"

namespace {

using genfn_kernels::exp16;
using genfn_kernels::lanes::load_lanes;
using namespace genfn_kernels::simd;

constexpr int64_t kLanes = 16;
constexpr int64_t kTileRows = 96;         // queries (positions x grouped heads) per tile
constexpr int64_t kKeyTile = 64;          // cache slots per tile: four vectors of scores per query
constexpr int kKeyVectors = kKeyTile / kLanes;
constexpr int kRowBlock = kRegisters >= 32 ? 4 : 6;  // queries that share each loaded key vector
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The registers' blocks: key vectors a pass over head_dim scores (queries by key vectors accumulate,
// each key vector loaded once for the queries), value vectors a pass over the slots weighs. All at
// once in AVX-512's 32 registers; on AVX2's 16 (8 F16s) 2 x 2 scores and one value vector at a time.
constexpr int kScoreRows = kRowBlock;
constexpr int kScoreVectors = kRegisters >= 32 ? kKeyVectors : 1;
constexpr int kValueVectors = kRegisters >= 32 ? 4 : 1;

// Query positions per tile for G query heads a kv head: about kTileRows queries, which share each
// transposed key tile and mask scan (a 512-token prefill of 1B's 4 heads per kv head ran its
// attention ~1.2x faster at 96 queries a tile than at 48, SmolLM2's 3 about the same), and at most
// 32 positions, which keeps the causal mask's skipping fine-grained for one head per kv head.
int64_t query_tile(int64_t G) { return std::clamp<int64_t>(kTileRows / G, 4, 32); }

// Where one (batch row, kv head) reads and writes: element strides of the tensors it addresses.
struct Layout {
  int64_t groups, head_dim, span;
  int64_t q_head, q_pos;   // q [B, H, S, D] strides (its last dimension contiguous)
  int64_t kv_slot;         // keys/values: slots of one head `kv_slot` apart (last dimension contiguous)
  int64_t mask_pos;        // mask rows (one per query position), each `span` bytes
  int64_t out_pos, out_head;
};

// Per-thread buffers of one query tile: its queries (scaled), scores then weights, running
// maxima and sums, and the unnormalized outputs.
struct Scratch {
  std::vector<float> keys_t, queries, weights, outputs, maxima, sums;
  void resize(int64_t rows, int64_t D) {
    keys_t.resize(D * kKeyTile);
    queries.resize(rows * D);
    weights.resize(rows * kKeyTile);
    outputs.resize(rows * D);
    maxima.resize(rows);
    sums.resize(rows);
  }
};

// Bit j set where visible[j], j < count <= 64.
inline uint64_t seen_slots(const bool* visible, int64_t count) {
#if defined(__AVX512F__)
  const __mmask64 lanes = count >= 64 ? ~__mmask64(0) : (__mmask64(1) << count) - 1;
  const __m512i bytes = _mm512_maskz_loadu_epi8(lanes, visible);
  return _mm512_test_epi8_mask(bytes, bytes);
#else
  if (count < 64) {
    uint64_t seen = 0;
    for (int64_t j = 0; j < count; ++j) seen |= static_cast<uint64_t>(visible[j] != 0) << j;
    return seen;
  }
  const __m256i zero = _mm256_setzero_si256();
  const auto half = [&](int64_t at) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(visible + at));
    return static_cast<uint32_t>(~_mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, zero)));
  };
  return half(0) | static_cast<uint64_t>(half(32)) << 32;
#endif
}

// Whether any of the `positions` mask rows (from `mask`, rows `stride` bytes apart) sets a slot
// in [first, first + count).
bool tile_visible(const bool* mask, int64_t stride, int64_t positions, int64_t first, int64_t count) {
  for (int64_t i = 0; i < positions; ++i)
    if (seen_slots(mask + i * stride + first, count) != 0) return true;
  return false;
}

// keys_t[d * kKeyTile + j] = key j's element d (as float32), zeros past `count` keys.
template <typename T>
void transpose_keys(const T* keys, int64_t slot_stride, int64_t count, int64_t D, float* keys_t) {
  for (int64_t j = 0; j < count; ++j) {
    const T* k = keys + j * slot_stride;
    for (int64_t d = 0; d < D; ++d) keys_t[d * kKeyTile + j] = static_cast<float>(k[d]);
  }
  for (int64_t j = count; j < kKeyTile; ++j)
    for (int64_t d = 0; d < D; ++d) keys_t[d * kKeyTile + j] = 0.f;
}

// scores[r, c0 * 16 .. (c0 + kScoreVectors) * 16) = queries[r] . keys_t's columns there, kScoreRows rows.
// The AVX2 form's blocks out of line: inlined into attend_tile, g++ kept their accumulators in memory,
// storing them every step (a 512-token causal prefill's attention, 9 heads: 3.6 ms against 2.7 out of
// line; the AVX-512 form, whose accumulators stay in registers inlined, 1.0 against 1.7 out of line).
#if defined(__AVX512F__)
#define GENFN_BLOCK_LINKAGE inline
#else
#define GENFN_BLOCK_LINKAGE __attribute__((noinline))
#endif

GENFN_BLOCK_LINKAGE void score_block(const float* queries, const float* keys_t, int64_t D, int c0,
                                           float* scores) {
  F16 acc[kScoreRows][kScoreVectors];
  for (int r = 0; r < kScoreRows; ++r)
    for (int c = 0; c < kScoreVectors; ++c) acc[r][c] = zero();
  for (int64_t d = 0; d < D; ++d) {
    F16 k[kScoreVectors];
    for (int c = 0; c < kScoreVectors; ++c) k[c] = loadu(keys_t + d * kKeyTile + (c0 + c) * kLanes);
    for (int r = 0; r < kScoreRows; ++r) {
      const F16 q = set1(queries[r * D + d]);
      for (int c = 0; c < kScoreVectors; ++c) acc[r][c] = fmadd(q, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kScoreRows; ++r)
    for (int c = 0; c < kScoreVectors; ++c) storeu(scores + r * kKeyTile + (c0 + c) * kLanes, acc[r][c]);
}

// scores[r, 0 .. 64) = queries[r] . keys_t for kRowBlock rows.
inline void score_rows(const float* queries, const float* keys_t, int64_t D, float* scores) {
  for (int r = 0; r < kRowBlock; r += kScoreRows)
    for (int c = 0; c < kKeyVectors; c += kScoreVectors) score_block(queries + r * D, keys_t, D, c, scores + r * kKeyTile);
}

// One query's scores of a key tile into weights (in place), the running maximum and sum updated;
// returns the factor its earlier output must be scaled by.
inline float weigh_row(float* scores, const bool* visible, int64_t count, float& maximum, float& sum) {
  const uint64_t seen = seen_slots(visible, count);
  M16 keep[kKeyVectors];
  F16 top = set1(kNegInf);
  for (int c = 0; c < kKeyVectors; ++c) {
    keep[c] = static_cast<M16>(seen >> (c * kLanes));
    top = select(keep[c], max(top, loadu(scores + c * kLanes)), top);
  }
  const float tile_max = reduce_max(top);
  const float new_max = std::max(maximum, tile_max);
  if (new_max == kNegInf) {  // nothing seen yet: weights all zero, nothing to rescale
    for (int c = 0; c < kKeyVectors; ++c) storeu(scores + c * kLanes, zero());
    return 1.f;
  }
  const float rescale = maximum == kNegInf ? 0.f : std::exp(maximum - new_max);
  const F16 m = set1(new_max);
  F16 total = zero();
  for (int c = 0; c < kKeyVectors; ++c) {
    const F16 e = keep_only(keep[c], exp16(sub(loadu(scores + c * kLanes), m)));
    total = add(total, e);
    storeu(scores + c * kLanes, e);
  }
  maximum = new_max;
  sum = sum * rescale + reduce_add(total);
  return rescale;
}

// outputs[r, c0*16 .. (c0+W)*16) = outputs * rescale[r] + weights[r] . values, kRowBlock rows.
template <int W, typename T>
GENFN_BLOCK_LINKAGE void accumulate_values(const float* weights, const T* values, int64_t slot_stride, int64_t count,
                              const float* rescale, int64_t D, int64_t c0, float* outputs) {
  F16 acc[kRowBlock][W];
  for (int r = 0; r < kRowBlock; ++r) {
    const F16 s = set1(rescale[r]);
    for (int c = 0; c < W; ++c) acc[r][c] = mul(s, loadu(outputs + r * D + (c0 + c) * kLanes));
  }
  for (int64_t j = 0; j < count; ++j) {
    F16 v[W];
    // All sixteen lanes, with no mask to test: loaded through load16's keep test (a constant 0xFFFF),
    // g++ 12 left the stores of every AVX2 sum inside this loop (1.35x the attention's time).
    for (int c = 0; c < W; ++c) v[c] = load_lanes(values + j * slot_stride + (c0 + c) * kLanes);
    for (int r = 0; r < kRowBlock; ++r) {
      const F16 w = set1(weights[r * kKeyTile + j]);
      for (int c = 0; c < W; ++c) acc[r][c] = fmadd(w, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRowBlock; ++r)
    for (int c = 0; c < W; ++c) storeu(outputs + r * D + (c0 + c) * kLanes, acc[r][c]);
}

template <typename T>
void accumulate_block(const float* weights, const T* values, int64_t slot_stride, int64_t count,
                      const float* rescale, int64_t D, float* outputs) {
  const int64_t vectors = D / kLanes;
  int64_t c0 = 0;
  for (; c0 + kValueVectors <= vectors; c0 += kValueVectors)
    accumulate_values<kValueVectors, T>(weights, values, slot_stride, count, rescale, D, c0, outputs);
  switch (vectors - c0) {
    case 3: accumulate_values<3, T>(weights, values, slot_stride, count, rescale, D, c0, outputs); break;
    case 2: accumulate_values<2, T>(weights, values, slot_stride, count, rescale, D, c0, outputs); break;
    case 1: accumulate_values<1, T>(weights, values, slot_stride, count, rescale, D, c0, outputs); break;
    default: break;
  }
}

// Query positions [first, first + positions) of one batch row's kv head group: rows are
// position-major (row = i * groups + g), padded to whole blocks by repeating the last row. Key tiles
// start at `origin`, the row's first real slot: a query's sums group its keys by their place in its
// tiles, so tiles counted from the row's first key give a left-padded row (or a prompt gathered from
// paged blocks) the bits of the same prompt alone. Slots before it are read by no real query.
template <typename T>
void attend_tile(const T* q, const T* keys, const T* values, const bool* mask, T* out,
                 const Layout& L, float scale, int64_t first, int64_t positions, int64_t origin, Scratch& s) {
  const int64_t G = L.groups, D = L.head_dim;
  const int64_t rows = positions * G;
  const int64_t padded = (rows + kRowBlock - 1) / kRowBlock * kRowBlock;
  s.resize(padded, D);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t row = std::min(r, rows - 1), i = row / G, g = row % G;
    const T* src = q + g * L.q_head + (first + i) * L.q_pos;
    for (int64_t d = 0; d < D; ++d) s.queries[r * D + d] = static_cast<float>(src[d]) * scale;
  }
  std::fill(s.outputs.begin(), s.outputs.end(), 0.f);
  std::fill(s.maxima.begin(), s.maxima.end(), kNegInf);
  std::fill(s.sums.begin(), s.sums.end(), 0.f);
  const bool* tile_mask = mask + first * L.mask_pos;
  float rescale[kRowBlock];
  for (int64_t k0 = origin; k0 < L.span; k0 += kKeyTile) {
    const int64_t count = std::min(kKeyTile, L.span - k0);
    if (!tile_visible(tile_mask, L.mask_pos, positions, k0, count)) continue;
    transpose_keys(keys + k0 * L.kv_slot, L.kv_slot, count, D, s.keys_t.data());
    for (int64_t r0 = 0; r0 < padded; r0 += kRowBlock) {
      float* weights = s.weights.data() + r0 * kKeyTile;
      score_rows(s.queries.data() + r0 * D, s.keys_t.data(), D, weights);
      for (int r = 0; r < kRowBlock; ++r) {
        const int64_t i = std::min(r0 + r, rows - 1) / G;
        rescale[r] = weigh_row(weights + r * kKeyTile, tile_mask + i * L.mask_pos + k0, count, s.maxima[r0 + r],
                               s.sums[r0 + r]);
      }
      accumulate_block(weights, values + k0 * L.kv_slot, L.kv_slot, count, rescale, D, s.outputs.data() + r0 * D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, g = r % G;
    const float inv = s.sums[r] > 0.f ? 1.f / s.sums[r] : 0.f;
    T* dst = out + (first + i) * L.out_pos + g * L.out_head;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(s.outputs[r * D + d] * inv);
  }
}

// q [B, H, S, D] float32 or bfloat16 (any strides, the last dimension contiguous), keys/values
// [B, Hkv, A, D] of q's dtype (slots of a head equally spaced, the last dimension contiguous: a
// slice of the static cache), mask [B, 1, S, A] bool. Returns [B, H, S, D] of q's dtype, a view of
// [B, S, H, D] memory (so the model's transpose back to [B, S, H * D] is free).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                             const at::Tensor& mask, double scale, const c10::optional<at::Tensor>& first_slots) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "prefill_attention: q must be [B, H, S, D] and keys/values [B, kv_heads, A, D]");
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), A = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && D % kLanes == 0 && D <= 256,
              "prefill_attention: keys must match q's batch and head_dim, a multiple of 16 up to 256");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "prefill_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 && mask.size(2) == S && mask.size(3) == A &&
                  mask.scalar_type() == at::kBool,
              "prefill_attention: mask must be bool [B, 1, S, A]");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "prefill_attention: q, keys and values must be float32 or bfloat16, all one dtype; got ", q.scalar_type(),
              ", ", keys.scalar_type(), ", ", values.scalar_type());
  TORCH_CHECK(q.stride(3) == 1 && keys.stride(3) == 1 && values.stride(3) == 1 && keys.strides() == values.strides(),
              "prefill_attention: q, keys and values need a contiguous last dimension, keys and values one layout");
  const at::Tensor mc = mask.contiguous();
  at::Tensor out = at::empty({B, S, H, D}, q.options());
  const Layout L{H / Hkv, D, A, q.stride(1), q.stride(2), keys.stride(2), A, H * D, D};
  const int64_t positions = query_tile(H / Hkv);
  const int64_t tiles = (S + positions - 1) / positions;
  const bool* mp = mc.data_ptr<bool>();
  const float scalef = static_cast<float>(scale);
  // Where each row's key tiles start: its first real slot where given (a padding query sees its own
  // slot, before the row's first real key), else its first slot any query sees.
  std::vector<int64_t> origins(B, A);
  if (first_slots.has_value()) {
    TORCH_CHECK(first_slots->dim() == 1 && first_slots->size(0) == B && first_slots->scalar_type() == at::kLong,
                "prefill_attention: first_slots must be int64 [B]");
    const at::Tensor fc = first_slots->contiguous();
    for (int64_t b = 0; b < B; ++b) origins[b] = std::clamp<int64_t>(fc.data_ptr<int64_t>()[b], 0, A);
  } else {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < S; ++i) {
        const bool* row = mp + (b * S + i) * A;
        origins[b] = std::min<int64_t>(origins[b], std::find(row, row + origins[b], true) - row);
      }
  }
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = keys.data_ptr<scalar_t>();
    const scalar_t* vp = values.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // Tiles in the order first, last, second, second to last...: under a causal mask the late tiles
    // see the most keys, and each thread's contiguous share of the items then holds light and heavy
    // ones alike.
    at::parallel_for(0, B * Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t z = item % tiles, bh = item / tiles, b = bh / Hkv, h = bh % Hkv;
        const int64_t tile = z % 2 == 0 ? z / 2 : tiles - 1 - z / 2;
        const int64_t first = tile * positions;
        attend_tile(qp + b * q.stride(0) + h * L.groups * q.stride(1), kp + b * keys.stride(0) + h * keys.stride(1),
                    vp + b * values.stride(0) + h * values.stride(1), mp + b * S * A,
                    op + b * S * H * D + h * L.groups * D, L, scalef, first, std::min(positions, S - first),
                    origins[b], scratch);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return out.transpose(1, 2);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("prefill_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale, "
        "Tensor? first_slots=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
