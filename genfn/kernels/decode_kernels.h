// The pieces of the decode kernels that other kernels of this library call from inside their own
// parallel regions (decode_layer.cpp): no thread pool of their own, only a thread's share.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace genfn_kernels {

// 16 bfloat16 values widened to float32 lanes (exact).
inline __m512 widen_bfloat16(__m256i halves) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// 16 float32 lanes rounded to bfloat16 as c10::BFloat16(float) rounds: to nearest even, NaN quiet.
inline __m256i round_to_bfloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// The first n of 16 lanes (all 16 from n >= 16).
inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// The kept lanes of 16 elements of T as float32, and back (bfloat16 rounded as above).
inline __m512 load16(const float* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 keep) { return widen_bfloat16(_mm256_maskz_loadu_epi16(keep, p)); }
inline void store16(float* p, __m512 v, __mmask16 keep) { _mm512_mask_storeu_ps(p, keep, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 keep) { _mm256_mask_storeu_epi16(p, keep, round_to_bfloat16(v)); }

// e^x in 16 float32 lanes: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to r^7
// (truncation ~5e-9 relative, under float32's 6e-8), scaled by 2^n. Within 2 ulp of expf.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The most rows of x the decode kernels take (genfn.kernels.MAX_DECODE_ROWS); more is a GEMM.
constexpr int64_t kMaxDecodeRows = 8;

// Whether the bfloat16 forms can run (they need AVX512_BF16).
bool cpu_has_avx512_bf16();

// The rows of one product shared out to T threads that balance their work: each thread owns an
// even contiguous run of row blocks and streams it from the front in small chunks; one that
// finishes takes chunks from the back of another's run. On two cores the two halves of a
// weight do not stream equally fast (perf: each thread waited ~10 % of a static split's time at
// the barrier after each linear). prepare() before the parallel region, then every thread calls
// linear_balanced with it once: y[M, N] = x[M, K] @ w[N, K].T, summed as decode_linear sums it (M <=
// 2 * kMaxDecodeRows: groups of kMaxDecodeRows rows over each chunk, the weight streamed once).
struct RowQueue {
  static constexpr int kMaxThreads = 64;
  // (end << 32) | next, in row blocks; a cache line each, or every claim would pull the line
  // from the other core.
  struct alignas(64) Run {
    std::atomic<uint64_t> bounds;
  };
  Run runs[kMaxThreads];
  int64_t threads = 0;
  void prepare(int64_t M, int64_t N, int64_t T);  // for linear_balanced
  void prepare_blocks(int64_t blocks, int64_t T);  // any unit of work: even runs of `blocks`
};

// Claim up to `chunk` blocks from the front (own run) or the back (another's) of a run: [begin, end).
inline bool claim_front(std::atomic<uint64_t>& run, int64_t chunk, int64_t& begin, int64_t& end) {
  uint64_t seen = run.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t next = static_cast<int64_t>(seen & 0xffffffffu), last = static_cast<int64_t>(seen >> 32);
    if (next >= last) return false;
    begin = next;
    end = std::min(last, next + chunk);
    if (run.compare_exchange_weak(seen, (static_cast<uint64_t>(last) << 32) | static_cast<uint64_t>(end),
                                  std::memory_order_relaxed))
      return true;
  }
}

inline bool claim_back(std::atomic<uint64_t>& run, int64_t chunk, int64_t& begin, int64_t& end) {
  uint64_t seen = run.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t next = static_cast<int64_t>(seen & 0xffffffffu), last = static_cast<int64_t>(seen >> 32);
    if (next >= last) return false;
    begin = std::max(next, last - chunk);
    end = last;
    if (run.compare_exchange_weak(seen, (static_cast<uint64_t>(begin) << 32) | static_cast<uint64_t>(next),
                                  std::memory_order_relaxed))
      return true;
  }
}

// Thread t's share of queue's work: its own run front to back, `chunk` blocks a claim, then chunks
// from the back of the other threads' runs. own(begin, end, start, stop) sums a chunk [begin, end)
// of the own run [start, stop) (a stream it may fetch ahead in up to stop); stolen(begin, end) one
// taken from another's (past end lies that thread's stream).
template <typename Own, typename Stolen>
void run_balanced(RowQueue& queue, int64_t t, int64_t chunk, Own&& own, Stolen&& stolen) {
  const int64_t T = queue.threads;
  if (t >= T) return;
  const uint64_t first = queue.runs[t].bounds.load(std::memory_order_relaxed);
  const int64_t start = static_cast<int64_t>(first & 0xffffffffu), stop = static_cast<int64_t>(first >> 32);
  int64_t begin, end;
  while (claim_front(queue.runs[t].bounds, chunk, begin, end)) own(begin, end, start, stop);
  for (int64_t step = 1; step < T; ++step) {
    auto& other = queue.runs[(t + step) % T].bounds;
    while (claim_back(other, chunk, begin, end)) stolen(begin, end);
  }
}

void linear_balanced(int64_t M, const float* x, const float* w, int64_t K, int64_t N, float* y, int64_t t,
                     RowQueue& queue);
void linear_balanced(int64_t M, const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N,
                     c10::BFloat16* y, int64_t t, RowQueue& queue);

// A block-quantized weight in genfn/quant/weight.py's "tiles16" layout, as quant_linear reads it:
// `tiles` tiles of 16 output rows, `blocks` blocks of 32 inputs each; `kind` 0 (Q4_0), 1 (with
// minimums: Q4_1, int4) or 2 (8-bit).
struct QuantWeight {
  const uint8_t* codes;
  const uint16_t* scales;  // float16
  const uint16_t* mins;    // float16, kind 1 only
  int64_t kind, tiles, blocks, out_features;
};
// Rows of x quantized to 8 bits per block of 32 (quant_linear.cpp): codes, block scales, block
// code sums and scale * sum. resize() before the parallel region that fills it.
struct QuantActivations {
  std::vector<int8_t> codes;      // [M, K]
  std::vector<float> scale;       // [M, K / 32]
  std::vector<int32_t> sum;       // [M, K / 32]
  std::vector<float> scaled_sum;  // [M, K / 32]
  void resize(int64_t M, int64_t K);
};
// Whether the quantized shares can run (they need AVX512_VNNI).
bool cpu_has_avx512_vnni();
// Thread t of T quantizes its share of the M rows of x [M, K] into a; a barrier must follow
// before any thread reads a.
void quantize_rows_share(const float* x, int64_t M, int64_t K, QuantActivations& a, int64_t t, int64_t T);
// Thread t's share of y[M, N] = x[M, K] @ dequantize(w).T from x quantized in a (M <=
// kMaxDecodeRows), summed as quant_linear sums it: tiles shared out balanced as linear_balanced
// shares rows (queue.prepare_blocks(w.tiles, T) before the region).
void quant_linear_share(int64_t M, const QuantActivations& a, int64_t K, const QuantWeight& w, float* y, int64_t t,
                        RowQueue& queue);

// One row's `groups` query heads q[groups, head_dim] that share a kv head, against that head's
// keys/values (slot s at s * slot_stride) where visible[s], s < span: dense_decode_attention's
// arithmetic and rounding, into out[groups, head_dim].
template <typename T>
void attend_group(const T* q, const T* keys, const T* values, const bool* visible, int64_t span,
                  int64_t slot_stride, int64_t groups, int64_t head_dim, float scale, T* out);

}  // namespace genfn_kernels
