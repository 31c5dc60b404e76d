// y = x @ w.T for a few rows of x: the linear layers of a decode step.
//
// At decode time x has one row per sequence and every weight byte is read once per step, so the
// step is bound by how fast the weights stream from memory. BLAS GEMV and inductor's GEMM kernels
// stream a [N, K] weight with K ~ 600 at well under the machine's read bandwidth; this kernel walks
// R weight rows at once, each as one sequential stream, dotting every row with all M rows of x
// (held in L1) so the weights are read exactly once whatever M is. bfloat16 products are summed
// in float32 and rounded once, as oneDNN does: through vdpbf16ps where the CPU has AVX512_BF16,
// else by widening the weights to float32 in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <type_traits>
#include <vector>

#include "decode_kernels.h"

namespace {

using genfn_kernels::kMaxDecodeRows;
using genfn_kernels::with_rows;
constexpr int kLanes = 16;

// How far ahead of the bytes being summed each thread's stream is fetched, into L2 (Zen 4 keeps
// `prefetcht1` out of L1). A thread's row blocks are contiguous, so the window runs on into its
// next block. Fetched into L1 (`prefetcht0`) a block ahead, as this kernel first did, the core's
// few L1 miss buffers capped each thread: 2 threads, one 226 MB weight, float32 8 rows 18.7 GB/s
// against 27.6 through L2; 4 rows 30.0 against 37.4; bfloat16 8 rows 24.2 against 33.7 (sum()
// over the same bytes 38-45). 4 and 16 KiB ahead measured alike. One row of x takes
// genfn_kernels::one_row_window: on Intel cores the same window (a 2-core Xeon with AMX, session
// 15, one row over the 1B shape's matrices out of cache, 2 threads: bfloat16 30.3 against 24.0
// GB/s, float32 31.4 against 28.7, tensor.sum 31-33); on Zen 5 8 KiB into L1, where 16 KiB into
// L2 cost a one-row step (and on a Zen 4 in session 11, SmolLM2 batch 1, in one process: float32
// 16.9 against 22.7 ms a token, bfloat16 11.7 against 12.6); on Zen 4 the prefetchers alone, which
// beat both there (session 36: the 1B bfloat16 step 0.86-0.95x the time of 8 KiB into L1). Bits
// unchanged (docs/guides/k-quants-and-scale.md, *One row fetched ahead on Intel*, *Session 26*,
// *Session 36*).
template <int M>
genfn_kernels::StreamWindow stream_window() {
  return M == 1 ? genfn_kernels::one_row_window(genfn_kernels::StreamKind::kFloatRows) : genfn_kernels::kFewRowsWindow;
}

inline __m512 widen(__m256i halves) { return genfn_kernels::widen_bfloat16(halves); }

// The three ways of multiplying a chunk of a weight row by the same chunk of a row of x and
// adding the products to float32 lanes. `Step` inputs per chunk; `Weight` what is stored; `Input`
// the element type of x as the kernel reads it.
struct Float32Fma {
  using Weight = float;
  using Input = float;
  using Chunk = __m512;
  static constexpr int Step = kLanes;
  static Chunk load(const float* p) { return _mm512_loadu_ps(p); }
  static Chunk load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
  static __m512 madd(__m512 acc, Chunk w, Chunk x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bfloat16 weights widened to float32 in registers (x widened once per call): CPUs without
// AVX512_BF16.
struct Bfloat16Widen {
  using Weight = c10::BFloat16;
  using Input = float;
  static constexpr int Step = kLanes;
  using Chunk = __m512;
  static Chunk load(const c10::BFloat16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Chunk load(const c10::BFloat16* p, int64_t n) {
    return widen(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
  }
  static Chunk load(const float* p) { return _mm512_loadu_ps(p); }
  static Chunk load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
  static __m512 madd(__m512 acc, Chunk w, Chunk x) { return _mm512_fmadd_ps(w, x, acc); }
};

// `vdpbf16ps` multiplies 32 weights by 32 activations (both bfloat16; the activation is bfloat16
// already, so nothing is rounded on the way in) and adds the products pairwise into 16 float32
// lanes: the widening kernel's float32 products and float32 sums, in half the instructions and
// from full 64-byte loads.
struct Bfloat16Dot {
  using Weight = c10::BFloat16;
  using Input = c10::BFloat16;
  static constexpr int Step = 2 * kLanes;
  using Chunk = __m512bh;
  __attribute__((target("avx512bw,avx512bf16"))) static Chunk load(const c10::BFloat16* p) {
    return (__m512bh)_mm512_loadu_si512(p);
  }
  __attribute__((target("avx512bw,avx512bf16"))) static Chunk load(const c10::BFloat16* p, int64_t n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  __attribute__((target("avx512bw,avx512bf16"))) static __m512 madd(__m512 acc, Chunk w, Chunk x) {
    return _mm512_dpbf16_ps(acc, w, x);
  }
};

// The 16 lane sums of v[0..15] in one register, sum(v[i]) at lane 4 * (i % 4) + i / 4: 45 shuffles
// and adds where sixteen separate reductions take ~130, which at 8 rows of x was a third of the
// kernel's arithmetic (K is only 576).
inline __m512 sum16(const __m512* v) {
  __m512 halves[8], quarters[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    // [a0+a2, a1+a3, b2+b0, b3+b1] in 128-bit quarters: [a0, a1, b2, b3] + [a2, a3, b0, b1], a blend
    // where a second shuffle would do (the sums are the same: addition commutes)
    halves[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 c = halves[2 * i], d = halves[2 * i + 1];
    // quarter j: four partial sums of v[4i + j]
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 p = _mm512_add_ps(_mm512_unpacklo_ps(quarters[0], quarters[1]),
                                 _mm512_unpackhi_ps(quarters[0], quarters[1]));
  const __m512 s = _mm512_add_ps(_mm512_unpacklo_ps(quarters[2], quarters[3]),
                                 _mm512_unpackhi_ps(quarters[2], quarters[3]));
  const __m512d pd = _mm512_castps_pd(p), sd = _mm512_castps_pd(s);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(pd, sd)), _mm512_castpd_ps(_mm512_unpackhi_pd(pd, sd)));
}

// sums[i] = the lane sum of acc[i], i < C (fewer than 8: one reduction each).
template <int C>
inline void lane_sums(const __m512* acc, float* sums) {
  for (int i = 0; i < C; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
}

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

// The lane sums of acc[c0 .. c0 + 16) (zero past C) by sum16, lane i = the sum of acc[c0 + i]: sum16's
// lanes put back in order by one permutation. _mm512_reduce_add_ps adds the lanes in the same tree
// (i + 8, then i + 4, i + 2, i + 1), so a sum is the same bits whichever of the two computed it.
template <int C>
inline __m512 ordered_sums(const __m512* acc, int c0) {
  __m512 group[16];
  for (int i = 0; i < 16; ++i) group[i] = c0 + i < C ? acc[c0 + i] : _mm512_setzero_ps();
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sum16(group));
}

inline void store_lanes(float* p, __mmask16 keep, __m512 v) { _mm512_mask_storeu_ps(p, keep, v); }
inline void store_lanes(c10::BFloat16* p, __mmask16 keep, __m512 v) {
  _mm256_mask_storeu_epi16(p, keep, genfn_kernels::round_to_bfloat16(v));
}

// y[m * N + n + r] = the lane sum of acc[m * R + r] for the M x R accumulators of a block (R divides 16,
// so a row's R sums never straddle two groups of 16): one sum16 per 16 accumulators and one masked
// store per row of x, in place of a scalar sum, rounding and store per element (by instruction
// count a fifth to a third of a bfloat16 block at K = 576, whose elements take 18 vdpbf16ps each).
template <int M, int R, typename Out>
inline void store_block(const __m512* acc, Out* y, int64_t N, int64_t n) {
  static_assert(16 % R == 0, "a row's sums must fall in one group of 16");
  for (int c0 = 0; c0 < M * R; c0 += 16) {
    const __m512 sums = ordered_sums<M * R>(acc, c0);
    for (int m = c0 / R; m < M && m * R < c0 + 16; ++m) {
      const int lane = m * R - c0;
      store_lanes(y + m * N + n - lane, static_cast<__mmask16>(((1u << R) - 1) << lane), sums);
    }
  }
}

// Lines to fetch (into L1 or L2) while a block is summed: `lines` cache lines from `at` on, spread
// over the block's steps a few at a time (none where lines is 0).
struct Fetch {
  const char* at = nullptr;
  int64_t lines = 0;
  bool into_l1 = false;
};

// The R-row block at weight row n fetches the same bytes `ahead.bytes` further on in its stream (0:
// nothing), into ahead's cache: the window a thread's one stream keeps in flight.
template <typename Weight>
Fetch stream_ahead(const Weight* w, int64_t K, int64_t n, int R, genfn_kernels::StreamWindow ahead) {
  if (ahead.bytes <= 0) return {};
  const int64_t bytes = R * K * static_cast<int64_t>(sizeof(Weight));
  return {reinterpret_cast<const char*>(w + n * K) + ahead.bytes, (bytes + 63) / 64, ahead.into_l1};
}

// One step of a block: chunk k of its R weight rows against chunk k of the M rows of x, into
// acc[m * R + r].
template <typename Dot, int M, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline)) inline void dot_step(
    const typename Dot::Input* x, const typename Dot::Weight* rows, int64_t K, int64_t k, __m512* acc) {
  typename Dot::Chunk wv[R];
  for (int r = 0; r < R; ++r) wv[r] = Dot::load(rows + r * K + k);
  for (int m = 0; m < M; ++m) {
    const auto xv = Dot::load(x + m * K + k);
    for (int r = 0; r < R; ++r) acc[m * R + r] = Dot::madd(acc[m * R + r], wv[r], xv);
  }
}

// Rows [n, n + R) of w against the M rows of x ([M, K]); results to y[m * N + n + r]; `fetch`: what
// to bring into L2 meanwhile.
// Compiled for AVX512_BF16 so that Bfloat16Dot's intrinsics inline (the float instantiations use
// none of it; the bfloat16 one runs only where the CPU has it).
template <typename Dot, int M, int R, typename Out>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void row_block(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                      int64_t n, Fetch fetch, Out* y) {
  // Past the 32 vector registers (accumulators, a chunk of each weight row, one of x): two tiles.
  if constexpr (M * R + R + 1 > 32) {
    constexpr int kFirst = (M + 1) / 2;
    row_block<Dot, kFirst, R>(x, w, K, N, n, fetch, y);
    row_block<Dot, M - kFirst, R>(x + kFirst * K, w, K, N, n, {}, y + kFirst * N);
    return;
  }
  using Weight = typename Dot::Weight;
  constexpr int S = Dot::Step;
  __m512 acc[M * R];
  for (int i = 0; i < M * R; ++i) acc[i] = _mm512_setzero_ps();
  const Weight* rows = w + n * K;
  // As many lines a step as the block consumes, so that a window ahead of the own stream keeps pace;
  // the steps past the last line run a loop of their own with no prefetch in it.
  constexpr int kLinesPerStep = (R * S * sizeof(Weight) + 63) / 64;
  const int64_t fetch_end = std::min(K / S, (fetch.lines + kLinesPerStep - 1) / kLinesPerStep) * S;
  int64_t k = 0;
  for (; k < fetch_end; k += S) {
    for (int j = 0; j < kLinesPerStep; ++j) genfn_kernels::fetch_line(fetch.at + 64 * j, fetch.into_l1);
    fetch.at += 64 * kLinesPerStep;
    dot_step<Dot, M, R>(x, rows, K, k, acc);
  }
  for (; k + S <= K; k += S) dot_step<Dot, M, R>(x, rows, K, k, acc);
  if (k < K) {
    typename Dot::Chunk wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Dot::load(rows + r * K + k, K - k);
    for (int m = 0; m < M; ++m) {
      const auto xv = Dot::load(x + m * K + k, K - k);
      for (int r = 0; r < R; ++r) acc[m * R + r] = Dot::madd(acc[m * R + r], wv[r], xv);
    }
  }
  if constexpr (M * R < 8) {
    float sums[M * R];
    lane_sums<M * R>(acc, sums);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) store(y + m * N + n + r, sums[m * R + r]);
  } else {
    store_block<M, R>(acc, y, N, n);
  }
}

// Weight rows a block takes, by rows of x. One row of x is far from the arithmetic limit, so it
// reads one weight row at a time: a thread's whole share is then a single sequential stream,
// which streamed as fast as sum() (float32 31.2 GB/s against 26.4 for four rows at once; one
// 226 MB weight, 2 threads, sum() 33.3). From two rows of x on, several weight rows give enough
// independent accumulators to hide the multiply-add latency, within the 32 vector registers.
// bfloat16 from 7 rows: 4 weight rows as two tiles of x (row_block), where 8 x 2 read all of x (16
// KiB a row at 8192 inputs) from L2 per 2 weight rows; float32's 8-row head ran 0.75-0.85x so.
template <typename Dot>
constexpr int rows_per_block(int64_t M) {
  return M <= 2 ? static_cast<int>(M) : (M <= 4 || (std::is_same_v<Dot, Bfloat16Dot> && M > 6) ? 4 : 2);
}

// The first `window` bytes of a stream of `length` bytes from `start`, which nothing fetched ahead.
inline void fetch_first_window(const void* start, int64_t length, genfn_kernels::StreamWindow window) {
  const char* bytes = static_cast<const char*>(start);
  for (int64_t off = 0; off < std::min(window.bytes, length); off += 64) window.fetch(bytes + off);
}

// Row blocks [b0, b1) of w against the M rows of x, as one sequential stream: the window ahead of
// the block being summed is fetched (stream_window), and blocks within a window of b1 fetch nothing (past
// it lies another thread's share).
template <typename Dot, int M, typename Out>
void stream_blocks(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y,
                   int64_t b0, int64_t b1) {
  constexpr int R = rows_per_block<Dot>(M);
  const int64_t block_bytes = R * K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  const int64_t length = (b1 - b0) * block_bytes;
  const genfn_kernels::StreamWindow window = stream_window<M>();
  fetch_first_window(w + b0 * R * K, length, window);
  for (int64_t b = b0; b < b1; ++b) {
    const bool ahead = window.bytes > 0 && (b - b0 + 1) * block_bytes + window.bytes <= length;
    row_block<Dot, M, R>(x, w, K, N, b * R,
                         stream_ahead(w, K, b * R, R, ahead ? window : genfn_kernels::StreamWindow{}), y);
  }
}

template <typename Dot, int M, typename Out>
void rows_of_x(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y) {
  constexpr int R = rows_per_block<Dot>(M);
  const int64_t blocks = N / R;
  // Each thread takes a contiguous run of row blocks, one sequential stream through the weight.
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) { stream_blocks<Dot, M>(x, w, K, N, y, b0, b1); });
  for (int64_t n = blocks * R; n < N; ++n) row_block<Dot, M, 1>(x, w, K, N, n, {}, y);
}

// Weight bytes a balanced share claims at a time: small enough that the last chunk of a run
// costs little waiting, large enough that the claim (one compare-and-swap) is noise.
constexpr int64_t kChunkBytes = 8192;

template <typename Dot, int M, typename Out>
void balanced_rows(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y,
                   int64_t t, genfn_kernels::RowQueue& queue) {
  constexpr int R = rows_per_block<Dot>(M);
  const int64_t block_bytes = R * K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / block_bytes);
  const genfn_kernels::StreamWindow window = stream_window<M>();
  genfn_kernels::run_balanced(
      queue, t, chunk,
      [&](int64_t begin, int64_t end, int64_t start, int64_t stop) {
        // The own run is one stream, fetched ahead up to its end.
        const int64_t length = (stop - start) * block_bytes;
        if (begin == start) fetch_first_window(w + start * R * K, length, window);
        for (int64_t b = begin; b < end; ++b) {
          const bool ahead = window.bytes > 0 && (b - start + 1) * block_bytes + window.bytes <= length;
          row_block<Dot, M, R>(x, w, K, N, b * R,
                               stream_ahead(w, K, b * R, R, ahead ? window : genfn_kernels::StreamWindow{}), y);
        }
      },
      [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) row_block<Dot, M, R>(x, w, K, N, b * R, {}, y);
      });
  if (t == 0)
    for (int64_t n = (N / R) * R; n < N; ++n) row_block<Dot, M, 1>(x, w, K, N, n, {}, y);
}

// Blocks [b0, b1) of R weight rows against a group of M rows of x (at most 8; M a runtime value).
template <typename Dot, int R, typename Out>
void group_blocks(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                  Out* y, int64_t b0, int64_t b1, int64_t ahead) {
  with_rows(M, [&](auto rows) {
    for (int64_t b = b0; b < b1; ++b)
      row_block<Dot, decltype(rows)::value, R>(x, w, K, N, b * R, stream_ahead(w, K, b * R, R, {ahead, false}), y);
  });
}

// More rows of x than a tile holds (up to kMaxDecodeRows a group): each claimed chunk of weight
// rows (8 KiB, in L1) passes under every group before the next chunk, so the weight streams once.
// A row's sums are those of a tile of it alone (the block size R changes none of them).
template <typename Dot, typename Out>
void balanced_groups(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                     Out* y, int64_t t, genfn_kernels::RowQueue& queue) {
  constexpr int R = rows_per_block<Dot>(kMaxDecodeRows);  // RowQueue::prepare's blocks past 8 rows
  const int64_t block_bytes = R * K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / block_bytes);
  const genfn_kernels::StreamWindow window = stream_window<kMaxDecodeRows>();
  const int64_t per = genfn_kernels::group_size(M);
  auto groups = [&](int64_t begin, int64_t end, int64_t ahead) {
    for (int64_t m0 = 0; m0 < M; m0 += per)
      group_blocks<Dot, R>(std::min(per, M - m0), x + m0 * K, w, K, N, y + m0 * N, begin, end, m0 == 0 ? ahead : 0);
  };
  genfn_kernels::run_balanced(
      queue, t, chunk,
      [&](int64_t begin, int64_t end, int64_t start, int64_t stop) {
        const int64_t length = (stop - start) * block_bytes;
        if (begin == start) fetch_first_window(w + start * R * K, length, window);
        // The window ahead of the chunk, if it lies within the own run.
        groups(begin, end, (end - start) * block_bytes + window.bytes <= length ? window.bytes : 0);
      },
      [&](int64_t begin, int64_t end) { groups(begin, end, 0); });
  if (t == 0)
    for (int64_t n = (N / R) * R; n < N; ++n)
      for (int64_t m0 = 0; m0 < M; m0 += per)
        group_blocks<Dot, 1>(std::min(per, M - m0), x + m0 * K, w, K, N, y + m0 * N, n, n + 1, 0);
}

template <typename Dot, typename Out>
void dispatch_balanced(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K,
                       int64_t N, Out* y, int64_t t, genfn_kernels::RowQueue& queue) {
  if (M > kMaxDecodeRows) return balanced_groups<Dot>(M, x, w, K, N, y, t, queue);
  with_rows(M, [&](auto rows) { balanced_rows<Dot, decltype(rows)::value>(x, w, K, N, y, t, queue); });
}

template <typename Dot, typename Out>
void dispatch_rows(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                   Out* y) {
  with_rows(M, [&](auto rows) { rows_of_x<Dot, decltype(rows)::value>(x, w, K, N, y); });
}

constexpr int64_t kPanelBytes = 64 * 1024;

// The register tile of a pass: up to kRows rows of x by block(M) weight rows, an accumulator each.
// Every multiply-add loads a chunk of x or of a weight row, so loads per multiply-add are
// 1/block + 1/rows: 8 x 2 (the decode kernel's blocks) loads 0.63 a multiply-add, 6 x 4 0.42,
// within the 32 vector registers (24 accumulators, 4 weight chunks, x from memory). Float32 at 32
// rows, SmolLM2's shapes, one thread, best of 9 interleaved rounds against the packed GEMM
// (oneDNN), 8 x 2 -> 6 x 4: gate/up 1.47x -> 1.07x, q/k/v 1.34x -> 1.15x, down 1.30x -> 1.22x
// (benchmarks/results/determinism-cost-wave3.log). A tile holds as many rows as fit in
// kTileBytes, so that it stays in L1 while the panel's weight rows pass (SmolLM2's down
// projection, 1536 inputs: 8 float32 rows of x are 48 KiB, and read from L2 the product ran at
// half the speed of oneDNN's). Past kGroupBytes of x (a prefill's hundreds of rows) the rows go
// in groups that stay in L2, each streaming the weight again.
template <typename Dot>
struct TileShape {
  static constexpr int kRows = 6;
  static constexpr int block(int) { return 4; }
  static constexpr int64_t kTileBytes = 24 * 1024;
  static constexpr int64_t kGroupBytes = 256 * 1024;
};
// vdpbf16ps does twice an FMA's work per load, so bfloat16 tiles read x from L2 at full speed:
// a tile is not cut to fit L1, where the 1B model's down projection (8192 inputs: 16 KiB a row
// of x) ran one row of x at a time, 1 x 1, at ~40 GFLOP/s a thread (6 x 4 tiles: 125-155), and
// a group holds a decode step's rows at the 1B shapes (33 x 8192 inputs: 528 KiB of x beside two
// panels in a 1 MiB L2). 6 x 4 against 8 x 2 and 4 x 4 at 16 and 32 rows of the 1B shapes, one
// thread: 8 x 2 0.8-0.85x at 2048 inputs, 4 x 4 alike within the noise (0.9-1.1x) and behind at
// 8192 (docs/guides/k-quants-and-scale.md, *bfloat16 decode at 9-33 rows*).
template <>
struct TileShape<Bfloat16Dot> {
  static constexpr int kRows = 6;
  static constexpr int block(int) { return 4; }
  static constexpr int64_t kTileBytes = 640 * 1024;
  static constexpr int64_t kGroupBytes = 640 * 1024;
};

// Weight rows [n0, n1) against the M rows of x; results to y[m * N + n]. Blocks of R weight rows
// (n0 is a multiple of 4), the odd rows at N one at a time. `next`: the lines this pass fetches
// for a later one, shared out evenly over its blocks.
template <typename Dot, int M, int R, typename Out>
void panel_pass(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y,
                int64_t n0, int64_t n1, Fetch next) {
  const int64_t blocks = (n1 - n0) / R + (n1 - n0) % R;
  const int64_t per_block = (next.lines + blocks - 1) / blocks;
  auto share = [&]() {
    const Fetch part{next.at, std::min(per_block, next.lines)};
    next.at += 64 * part.lines;
    next.lines -= part.lines;
    return part;
  };
  int64_t n = n0;
  for (; n + R <= n1; n += R) row_block<Dot, M, R>(x, w, K, N, n, share(), y);
  for (; n < n1; ++n) row_block<Dot, M, 1>(x, w, K, N, n, share(), y);
}

template <typename Dot, typename Out>
void dispatch_panel(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                    Out* y, int64_t n0, int64_t n1, Fetch next) {
  using Shape = TileShape<Dot>;
  static_assert(Shape::kRows <= 8, "tiles of up to 8 rows of x");
  TORCH_CHECK(M >= 1 && M <= Shape::kRows, "invariant_linear: a tile of ", M, " rows of x (at most ", Shape::kRows,
              ")");
  with_rows(M, [&](auto rows) {
    if constexpr (decltype(rows)::value <= Shape::kRows)
      panel_pass<Dot, decltype(rows)::value, Shape::block(decltype(rows)::value)>(x, w, K, N, y, n0, n1, next);
  });
}

// Any number of rows of x, each output element summed exactly as one row alone is summed above
// (one float32 accumulator of 16 lanes along k in steps of Dot::Step, then the same lane tree),
// whatever the row count, the row's place or the thread count: the batch-invariant mode's float
// linear (genfn/kernels/invariant.py), and decode_linear's past kMaxDecodeRows. Where the mode
// once ran tiles of 8 rows through the decode kernel one after another, each streaming the whole
// weight from memory, the weight here streams once: the output columns are cut into panels of
// weight rows small enough to stay in L2, each thread takes a contiguous run of panels (columns,
// never k), and every tile of rows of x passes over a panel before the next. The tiles' passes
// over a panel fetch the next panel of the run into L2, each pass a share: the weight's read
// then overlaps all of the panel's arithmetic, where a window ahead of the first pass alone
// (as stream_blocks fetches) left the memory idle while the other tiles summed from L2.
template <typename Dot, typename Out>
void panels_of_rows(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                    Out* y) {
  if (M <= kMaxDecodeRows) return dispatch_rows<Dot>(M, x, w, K, N, y);
  using Shape = TileShape<Dot>;
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  // A multiple of 4 weight rows, so that every block size the tiles take (1, 2, 4) divides it.
  const int64_t panel = std::max<int64_t>(4, kPanelBytes / std::max<int64_t>(row_bytes, 1) / 4 * 4);
  const int64_t panels = (N + panel - 1) / panel;
  const int64_t x_row_bytes = K * static_cast<int64_t>(sizeof(typename Dot::Input));
  const int64_t tile = std::clamp<int64_t>(Shape::kTileBytes / x_row_bytes, 1, Shape::kRows);
  const int64_t group = std::max<int64_t>(1, Shape::kGroupBytes / x_row_bytes / tile) * tile;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    const int64_t stream_end = std::min(N, p1 * panel);
    for (int64_t g0 = 0; g0 < M; g0 += group) {
      const int64_t rows = std::min(M, g0 + group) - g0;
      // Tiles as even as the rows split (32 rows as 6, 6, 5, 5, 5, 5, not 6 x 5 and 2).
      const int64_t tiles = (rows + tile - 1) / tile;
      fetch_first_window(w + p0 * panel * K, std::min(panel, stream_end - p0 * panel) * row_bytes,
                         {kPanelBytes, false});
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = p * panel, n1 = std::min(N, n0 + panel);
        const int64_t next_lines = (std::min(stream_end, n1 + panel) - n1) * row_bytes / 64;
        const char* next = reinterpret_cast<const char*>(w + n1 * K);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m0 = g0 + rows * t / tiles, m1 = g0 + rows * (t + 1) / tiles;
          const int64_t l0 = next_lines * t / tiles, l1 = next_lines * (t + 1) / tiles;
          dispatch_panel<Dot>(m1 - m0, x + m0 * K, w, K, N, y + m0 * N, n0, n1, Fetch{next + 64 * l0, l1 - l0});
        }
      }
    }
  });
}

bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// The bfloat16 path the linears take, set by the op bf16_linear_path (tests and benchmarks of the
// widening path on a CPU with vdpbf16ps): 0 the best this CPU has, 1 widening, 2 vdpbf16ps.
std::atomic<int64_t> forced_bf16_path{0};

bool bf16_dot_in_use() { return has_avx512_bf16() && forced_bf16_path.load(std::memory_order_relaxed) != 1; }

int64_t set_bf16_path(int64_t path) {
  TORCH_CHECK(path >= 0 && path <= 2, "bf16_linear_path: path must be 0, 1 or 2, got ", path);
  TORCH_CHECK(path != 2 || has_avx512_bf16(), "bf16_linear_path: this CPU has no AVX512_BF16 (vdpbf16ps)");
  forced_bf16_path.store(path, std::memory_order_relaxed);
  return bf16_dot_in_use() ? 2 : 1;
}

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight);

// Up to kMaxDecodeRows rows of x the decode kernel's blocks, past them every tile of rows over one
// L2-sized panel of the weight before the next, so the weight still streams from memory once
// (genfn.kernels.MAX_LINEAR_ROWS says up to where that beats the library's GEMM): invariant_linear,
// which does both, for what it takes.
at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "decode_linear: weight must be 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(x.size(-1) == weight.size(1), "decode_linear: x has ", x.size(-1),
              " features, weight expects ", weight.size(1));
  const int64_t K = weight.size(1);
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  const auto dtype = weight.scalar_type();
  const bool supported = (dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype &&
                         M >= 1 && x.device().is_cpu() && weight.device().is_cpu();
  return supported ? invariant_linear(x, weight) : at::linear(x, weight);
}

// decode_linear for any number of rows, each summed as it is alone (panels_of_rows); float32 or
// bfloat16 only: it refuses what it cannot sum that way rather than hand it to another kernel.
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "invariant_linear: weight must be 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(x.size(-1) == weight.size(1), "invariant_linear: x has ", x.size(-1),
              " features, weight expects ", weight.size(1));
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "invariant_linear: float32 or bfloat16 x and weight of one dtype, got ", x.scalar_type(), " and ", dtype);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "invariant_linear: CPU tensors only");
  const int64_t K = weight.size(1);
  const int64_t N = weight.size(0);
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  if (M == 0 || K == 0) return at::zeros(out_sizes, weight.options());
  const at::Tensor w = weight.contiguous();
  const at::Tensor rows = x.contiguous();
  at::Tensor y = at::empty({M, N}, weight.options());
  if (dtype == at::kFloat) {
    panels_of_rows<Float32Fma>(M, rows.data_ptr<float>(), w.data_ptr<float>(), K, N, y.data_ptr<float>());
  } else if (bf16_dot_in_use()) {
    panels_of_rows<Bfloat16Dot>(M, rows.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), K, N,
                                y.data_ptr<c10::BFloat16>());
  } else {
    // x is a few KiB at decode time: widened once here rather than in every row block.
    thread_local std::vector<float> widened;
    widened.resize(M * K);
    const c10::BFloat16* src = rows.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(src[i]);
    panels_of_rows<Bfloat16Widen>(M, widened.data(), w.data_ptr<c10::BFloat16>(), K, N, y.data_ptr<c10::BFloat16>());
  }
  return y.view(out_sizes);
}

}  // namespace

namespace genfn_kernels {

bool cpu_has_avx512_bf16() { return has_avx512_bf16(); }

void RowQueue::prepare(int64_t M, int64_t N, int64_t T, bool bf16) {
  prepare_blocks(N / (bf16 ? rows_per_block<Bfloat16Dot>(M) : rows_per_block<Float32Fma>(M)), T);
}

void linear_balanced(int64_t M, const float* x, const float* w, int64_t K, int64_t N, float* y, int64_t t,
                     RowQueue& queue) {
  dispatch_balanced<Float32Fma>(M, x, w, K, N, y, t, queue);
}

void linear_balanced(int64_t M, const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N,
                     c10::BFloat16* y, int64_t t, RowQueue& queue) {
  dispatch_balanced<Bfloat16Dot>(M, x, w, K, N, y, t, queue);
}

}  // namespace genfn_kernels

TORCH_LIBRARY(genfn_kernels, m) {
  m.def("decode_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("invariant_linear(Tensor x, Tensor weight) -> Tensor");
  // The bfloat16 path of both (0: the best this CPU has, 1: widening, 2: vdpbf16ps); returns the one in force.
  m.def("bf16_linear_path", &set_bf16_path);
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("decode_linear", &decode_linear);
  m.impl("invariant_linear", &invariant_linear);
}
