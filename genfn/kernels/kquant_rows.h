// The K-quant library's row-function dispatch and the row kernels' own fetch of their weight
// stream (StreamFetch), shared by its row kernels' sources (kquant_linear.cpp, kquant_q6k.cpp,
// iq4_linear.cpp, kquant_r8.cpp); apart from kquant.h, which the decode library includes too.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kquant.h"
#include "row_queue.h"

// The row function of a kernel template for `rows` rows of x (1..8; 8: any more), returned from
// the enclosing function; arguments after KERNEL follow the row count: GENFN_ROW_CASES(rows, row_avx512, F).
#define GENFN_ROW_CASES(rows, KERNEL, ...)     \
  switch (rows) {                              \
    case 1: return &KERNEL<1, ##__VA_ARGS__>;  \
    case 2: return &KERNEL<2, ##__VA_ARGS__>;  \
    case 3: return &KERNEL<3, ##__VA_ARGS__>;  \
    case 4: return &KERNEL<4, ##__VA_ARGS__>;  \
    case 5: return &KERNEL<5, ##__VA_ARGS__>;  \
    case 6: return &KERNEL<6, ##__VA_ARGS__>;  \
    case 7: return &KERNEL<7, ##__VA_ARGS__>;  \
    default: return &KERNEL<8, ##__VA_ARGS__>; \
  }

namespace genfn::kquant {

// Which scale each int16 lane of a 64-byte load takes, where the load covers four runs of 8
// lanes (16 bytes each): lane k of quarter q belongs to run 4q + k / 8. Q6_K's quarters map their
// dword sums to its 16 groups so; IQ4_XS's two halves (q = 0, 1) their pair sums to its 8 sub-blocks.
struct RunWords {
  alignas(64) uint16_t lanes[4][32];
  constexpr RunWords() : lanes() {
    for (int q = 0; q < 4; ++q)
      for (int k = 0; k < 32; ++k) lanes[q][k] = static_cast<uint16_t>(4 * q + k / 8);
  }
};
constexpr RunWords kRunWords;

// A row kernel's own weight stream fetched ahead, a line at a time as its reads reach each block:
// spread over the row, not all of a row's lines before it, which stalls the core on the fetches it has
// in flight (Q6_K 2048 x 8192 at one row, 2 threads, out of cache: 0.85x the time spread). At one row
// of x, genfn_kernels::one_row_window: every K-quant and IQ4 format is a 4- to 6-bit format that
// unpacks its codes (on Zen 5 8 KiB into L1, on Intel's cores and Zen 4 16 KiB into L2; before it, only
// q5_k_r8 and q6_k_r8, whose groups read several regions of a 1.4-1.7 KiB block at once, fetched there,
// 16 KiB into L2: 1.37-1.65x as fast as the prefetchers alone for q6_k_r8). At 2-8 rows
// genfn_kernels::few_quantized_rows_window (on Intel cores kStreamWindow into L2, where the rows
// fetched nothing before: the Xeon, 1B shapes out of cache, Q4_K 0.51-0.80x the time, Q6_K 0.61-0.75x,
// q4_k_r8 0.82-1.00x; on Zen 4 the same; on Zen 5 8 KiB into L1). Rows a thread reads one after another
// continue each other's fetches. The kernel does not know where its thread's run ends, so up to the
// window past it is fetched too (prefetches do not fault; another thread reads those bytes).
template <int M>
struct StreamFetch {
  genfn_kernels::StreamWindow window;
  const uint8_t* next;
  explicit StreamFetch(const uint8_t* w)
      : window(M == 1 ? genfn_kernels::one_row_window(genfn_kernels::StreamKind::kBlockRows)
                      : genfn_kernels::few_quantized_rows_window(genfn_kernels::StreamKind::kBlockRows)),
        next(w + window.bytes) {}
  // Every line up to a window past `end`, the end of the block about to be read.
  void through(const uint8_t* end) {
    if (window.bytes > 0)
      for (; next < end + window.bytes; next += 64) window.fetch(next);
  }
};

}  // namespace genfn::kquant
