// The blocks of y = x @ w.T that float32 and bfloat16 weights are summed in, for a few rows of x: the
// decode kernel (decode_linear.cpp) and the decode stack's plain linears (plain_linear.cpp, in both
// libraries: written against lanes16.h, so the AVX2 build sums every output as the AVX-512 one does).
//
// At decode time x has one row per sequence and every weight byte is read once per step, so the
// step is bound by how fast the weights stream from memory. BLAS GEMV and inductor's GEMM kernels
// stream a [N, K] weight with K ~ 600 at well under the machine's read bandwidth; a block walks R
// weight rows at once, each as one sequential stream, dotting every row with all M rows of x (held
// in L1) so the weights are read exactly once whatever M is.
//
// Every output is one accumulator of 16 float32 lanes along k, in steps of 16 inputs (32 for
// vdpbf16ps), its lanes summed in _mm512_reduce_add_ps's tree at the end: the block's shape (M, R),
// the row's place and the thread count change none of its bits. bfloat16 products are summed in
// float32 and rounded once, as oneDNN does: through vdpbf16ps where the CPU has AVX512_BF16, else by
// widening the weights to float32 in registers.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "decode_kernels.h"

// dot_step and row_block are compiled for AVX512_BF16 in the AVX-512 library, so that Bfloat16Dot's
// intrinsics inline (the other dots use none of it; the bfloat16 one runs only where the CPU has it).
#if defined(__AVX512F__)
#define GENFN_PLAIN_ROWS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define GENFN_PLAIN_ROWS_TARGET
#endif

namespace genfn_kernels::plain_rows {

using simd::F16;
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
StreamWindow stream_window() {
  return M == 1 ? one_row_window(StreamKind::kFloatRows) : kFewRowsWindow;
}

// The ways of multiplying a chunk of a weight row by the same chunk of a row of x and adding the
// products to float32 lanes. `Step` inputs per chunk; `Weight` what is stored; `Input` the element
// type of x as the kernel reads it.
struct Float32Fma {
  using Weight = float;
  using Input = float;
  using Chunk = F16;
  static constexpr int Step = kLanes;
  static Chunk load(const float* p) { return simd::loadu(p); }
  static Chunk load(const float* p, int64_t n) { return simd::load_kept(simd::lanes_below(n), p); }
  static F16 madd(F16 acc, Chunk w, Chunk x) { return simd::fmadd(w, x, acc); }
};

// bfloat16 weights widened to float32 in registers, x widened once per call (plain_linear.cpp,
// decode_linear.cpp): CPUs without AVX512_BF16.
struct Bfloat16Widen {
  using Weight = c10::BFloat16;
  using Input = float;
  using Chunk = F16;
  static constexpr int Step = kLanes;
  static Chunk load(const c10::BFloat16* p) { return simd::widen_bf16(p); }
  static Chunk load(const c10::BFloat16* p, int64_t n) { return simd::widen_bf16_kept(simd::lanes_below(n), p); }
  static Chunk load(const float* p) { return simd::loadu(p); }
  static Chunk load(const float* p, int64_t n) { return simd::load_kept(simd::lanes_below(n), p); }
  static F16 madd(F16 acc, Chunk w, Chunk x) { return simd::fmadd(w, x, acc); }
};

#if defined(__AVX512F__)
// `vdpbf16ps` multiplies 32 weights by 32 activations (both bfloat16; the activation is bfloat16
// already, so nothing is rounded on the way in) and adds the products pairwise into 16 float32
// lanes: the widening kernel's float32 products, in half the instructions and from full 64-byte
// loads (the pairwise sums are its own bits).
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
      store16(y + m * N + n - lane, sums, static_cast<__mmask16>(((1u << R) - 1) << lane));
    }
  }
}
#endif

// The `count` values of x as float32, in this thread's buffer (valid until its next call): x is a few
// KiB at decode time, widened once a call rather than in every row block.
inline const float* widened(const c10::BFloat16* x, int64_t count) {
  thread_local std::vector<float> buffer;
  buffer.resize(count);
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) simd::storeu(buffer.data() + i, simd::widen_bf16(x + i));
  for (; i < count; ++i) buffer[i] = static_cast<float>(x[i]);
  return buffer.data();
}

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

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
Fetch stream_ahead(const Weight* w, int64_t K, int64_t n, int R, StreamWindow ahead) {
  if (ahead.bytes <= 0) return {};
  const int64_t bytes = R * K * static_cast<int64_t>(sizeof(Weight));
  return {reinterpret_cast<const char*>(w + n * K) + ahead.bytes, (bytes + 63) / 64, ahead.into_l1};
}

// One step of a block: chunk k of its R weight rows against chunk k of the M rows of x, into
// acc[m * R + r].
template <typename Dot, int M, int R>
GENFN_PLAIN_ROWS_TARGET __attribute__((always_inline)) inline void dot_step(const typename Dot::Input* x,
                                                                            const typename Dot::Weight* rows,
                                                                            int64_t K, int64_t k, F16* acc) {
  typename Dot::Chunk wv[R];
  for (int r = 0; r < R; ++r) wv[r] = Dot::load(rows + r * K + k);
  for (int m = 0; m < M; ++m) {
    const auto xv = Dot::load(x + m * K + k);
    for (int r = 0; r < R; ++r) acc[m * R + r] = Dot::madd(acc[m * R + r], wv[r], xv);
  }
}

// Rows [n, n + R) of w against the M rows of x ([M, K]); results to y[m * N + n + r]; `fetch`: what
// to bring into L2 meanwhile.
template <typename Dot, int M, int R, typename Out>
GENFN_PLAIN_ROWS_TARGET void row_block(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K,
                                       int64_t N, int64_t n, Fetch fetch, Out* y) {
  // Past the vector registers (accumulators, a chunk of each weight row, one of x): two tiles.
  if constexpr (M > 1 && M * R + R + 1 > simd::kRegisters) {
    constexpr int kFirst = (M + 1) / 2;
    row_block<Dot, kFirst, R>(x, w, K, N, n, fetch, y);
    row_block<Dot, M - kFirst, R>(x + kFirst * K, w, K, N, n, {}, y + kFirst * N);
    return;
  }
  using Weight = typename Dot::Weight;
  constexpr int S = Dot::Step;
  F16 acc[M * R];
  for (int i = 0; i < M * R; ++i) acc[i] = simd::zero();
  const Weight* rows = w + n * K;
  // As many lines a step as the block consumes, so that a window ahead of the own stream keeps pace;
  // the steps past the last line run a loop of their own with no prefetch in it.
  constexpr int kLinesPerStep = (R * S * sizeof(Weight) + 63) / 64;
  const int64_t fetch_end = std::min(K / S, (fetch.lines + kLinesPerStep - 1) / kLinesPerStep) * S;
  int64_t k = 0;
  for (; k < fetch_end; k += S) {
    for (int j = 0; j < kLinesPerStep; ++j) fetch_line(fetch.at + 64 * j, fetch.into_l1);
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
#if defined(__AVX512F__)
  if constexpr (M * R >= 8) return store_block<M, R>(acc, y, N, n);
#endif
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) store(y + m * N + n + r, simd::reduce_add(acc[m * R + r]));
}

// Weight rows a block takes, by rows of x. One row of x is far from the arithmetic limit, so it
// reads one weight row at a time: a thread's whole share is then a single sequential stream,
// which streamed as fast as sum() (float32 31.2 GB/s against 26.4 for four rows at once; one
// 226 MB weight, 2 threads, sum() 33.3). From two rows of x on, several weight rows give enough
// independent accumulators to hide the multiply-add latency, within the vector registers.
// AVX-512: bfloat16 from 7 rows 4 weight rows as two tiles of x (row_block), where 8 x 2 read all
// of x (16 KiB a row at 8192 inputs) from L2 per 2 weight rows; float32's 8-row head ran 0.75-0.85x
// so. AVX2's 16 registers hold 2 x 2 (each F16 two of them): from 3 rows one weight row, every
// accumulator still its own chain.
template <typename Weight>
constexpr int rows_per_block(int64_t M) {
#if defined(__AVX512F__)
  return M <= 2 ? static_cast<int>(M) : (M <= 4 || (std::is_same_v<Weight, c10::BFloat16> && M > 6) ? 4 : 2);
#else
  return M <= 2 ? static_cast<int>(M) : 1;
#endif
}

// The first `window` bytes of a stream of `length` bytes from `start`, which nothing fetched ahead.
inline void fetch_first_window(const void* start, int64_t length, StreamWindow window) {
  const char* bytes = static_cast<const char*>(start);
  for (int64_t off = 0; off < std::min(window.bytes, length); off += 64) window.fetch(bytes + off);
}

// Weight bytes a balanced share claims at a time: small enough that the last chunk of a run
// costs little waiting, large enough that the claim (one compare-and-swap) is noise.
constexpr int64_t kChunkBytes = 8192;

// Thread t's share of y[M, N] = x[M, K] @ w.T (M <= kMaxDecodeRows): queue's row blocks
// (RowQueue::prepare), each thread's own run one stream fetched ahead up to its end.
template <typename Dot, int M, typename Out>
void balanced_rows(const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N, Out* y,
                   int64_t t, RowQueue& queue) {
  constexpr int R = rows_per_block<typename Dot::Weight>(M);
  const int64_t block_bytes = R * K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / block_bytes);
  const StreamWindow window = stream_window<M>();
  run_balanced(
      queue, t, chunk,
      [&](int64_t begin, int64_t end, int64_t start, int64_t stop) {
        const int64_t length = (stop - start) * block_bytes;
        if (begin == start) fetch_first_window(w + start * R * K, length, window);
        for (int64_t b = begin; b < end; ++b) {
          const bool ahead = window.bytes > 0 && (b - start + 1) * block_bytes + window.bytes <= length;
          row_block<Dot, M, R>(x, w, K, N, b * R, stream_ahead(w, K, b * R, R, ahead ? window : StreamWindow{}), y);
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

// More rows of x than a tile holds (up to 2 * kMaxDecodeRows, in groups): each claimed chunk of
// weight rows (8 KiB, in L1) passes under every group before the next chunk, so the weight streams
// once. A row's sums are those of a tile of it alone (the block size R changes none of them).
template <typename Dot, typename Out>
void balanced_groups(int64_t M, const typename Dot::Input* x, const typename Dot::Weight* w, int64_t K, int64_t N,
                     Out* y, int64_t t, RowQueue& queue) {
  constexpr int R = rows_per_block<typename Dot::Weight>(kMaxDecodeRows);  // RowQueue::prepare's blocks
  const int64_t block_bytes = R * K * static_cast<int64_t>(sizeof(typename Dot::Weight));
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / block_bytes);
  const StreamWindow window = stream_window<kMaxDecodeRows>();
  const int64_t per = group_size(M);
  auto groups = [&](int64_t begin, int64_t end, int64_t ahead) {
    for (int64_t m0 = 0; m0 < M; m0 += per)
      group_blocks<Dot, R>(std::min(per, M - m0), x + m0 * K, w, K, N, y + m0 * N, begin, end, m0 == 0 ? ahead : 0);
  };
  run_balanced(
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
                       int64_t N, Out* y, int64_t t, RowQueue& queue) {
  if (M > kMaxDecodeRows) return balanced_groups<Dot>(M, x, w, K, N, y, t, queue);
  with_rows(M, [&](auto rows) { balanced_rows<Dot, decltype(rows)::value>(x, w, K, N, y, t, queue); });
}

}  // namespace genfn_kernels::plain_rows
