// y = x @ dequantize(W).T for many rows of x (prefill, large batches) and W in the "tiles16"
// layout (Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, genfn/quant/weight.py and tile_kinds.h): quant_linear.cpp's arithmetic, bit for bit,
// blocked for a GEMM.
//
// quant_linear.cpp's tiles run one row of x at a time against one tile of 16 weight rows: per
// block, one chain of eight `vpdpbusd`, then the block's float32 step. Built for a few rows of
// x, whose product waits on memory, it left a 512-row product at under half the core's
// `vpdpbusd` rate: the compiler kept one row's chain in flight and the accumulators in memory.
// Here a step takes 8 rows of x against 2 tiles (32 weight rows): 16 independent integer chains
// in registers, each chunk of weight codes loaded once for 8 rows and each broadcast of four
// activation codes used for both tiles. Per output and block the float32 step is quant_linear's
// (sum converted, times d_w * d_x, fused into the output's one chain over the blocks in order,
// then a minimum's term, d_x sum(q) times it), so every output has the row kernels' bits whatever the
// number of rows: batch-invariant, and `init` continues a tensor-parallel rank's chain as there.
//
// The activations are quantized once per call, each thread a share of the rows, as quant_linear
// quantizes them, then laid out group by group: a block's codes for the 8 rows are 256 bytes in a
// row, with their integer starting sums and scales beside them, all read through one pointer
// (rows at a stride of K took 8 pointers, which the compiler kept spilling: 15-40 % slower).
// Work is shared out in runs of tile pairs (genfn_kernels::run_balanced); within a run every
// group of 8 rows goes over the run's pairs, whose codes (~256 KiB) stay in L2 while the group's
// activations stay in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_kernels.h"
#include "tile_kinds.h"

namespace {

using genfn_kernels::QuantActivations;
using genfn_kernels::QuantWeight;

constexpr int64_t kTile = 16;
constexpr int64_t kBlock = 32;
constexpr int kRows = 8;   // rows of x per step
constexpr int kTiles = 2;  // tiles of W per step
using namespace genfn_kernels::tile_kinds;
// Weight code bytes a run of tile pairs holds: a few pairs' codes kept in L2 (1 MiB a Zen 4/5 core).
constexpr int64_t kRunBytes = 256 * 1024;

// From 16 rows the GEMM beat the row kernels' groups of 8 (each group streams the tiles again
// from L1/L2 with one chain in flight).
constexpr int64_t kDefaultMinRows = 16;
std::atomic<int64_t> min_rows{kDefaultMinRows};

// The op quant_gemm_min_rows: set the count (0: the default); returns the count now in force.
int64_t set_min_rows(int64_t rows) {
  min_rows.store(rows > 0 ? rows : kDefaultMinRows, std::memory_order_relaxed);
  return min_rows.load(std::memory_order_relaxed);
}

// Rows of x quantized as quant_linear quantizes them, laid out for the steps below: per group of
// kRows rows and block, the rows' 32 codes one after another, then per row the code sum times
// minus the weight's code offset (where the integer sums start), the scale and scale * sum.
struct GroupedActivations {
  std::vector<int8_t> codes;      // [groups][blocks][kRows][32]
  std::vector<int32_t> bias;      // [groups][blocks][kRows]
  std::vector<float> scale;       // [groups][blocks][kRows]
  std::vector<float> scaled_sum;  // [groups][blocks][kRows]
};

// Groups [g0, g1) of x's rows into a (sized already).
void quantize_groups(const float* x, int64_t M, int64_t K, int64_t kind, int64_t g0, int64_t g1,
                     GroupedActivations& a) {
  thread_local QuantActivations rows;  // one group, row by row
  const int64_t nb = K / kBlock;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t m0 = g * kRows, count = std::min<int64_t>(kRows, M - m0);
    rows.resize(count, K);
    genfn_kernels::quantize_rows_share(x + m0 * K, count, K, rows, 0, 1);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = (g * nb + b) * kRows;
      for (int64_t r = 0; r < count; ++r) {
        std::memcpy(a.codes.data() + (at + r) * kBlock, rows.codes.data() + r * K + b * kBlock, kBlock);
        a.bias[at + r] = -code_offset(kind) * rows.sum[r * nb + b];
        a.scale[at + r] = rows.scale[r * nb + b];
        a.scaled_sum[at + r] = rows.scaled_sum[r * nb + b];
      }
    }
  }
}

// Rows [g * kRows, g * kRows + R) of x against tiles [t0, t0 + T): y[m, n] for those outputs, over all blocks.
template <int R, int T, int64_t kind>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_against_tiles(
    const GroupedActivations& a, int64_t g, const QuantWeight& w, int64_t t0, float* y, int64_t N, const float* init) {
  constexpr int64_t kCodeBytes = tile_block_bytes(kind);
  constexpr bool kMin = has_minimum(kind);
  const int64_t nb = w.blocks, m0 = g * kRows;
  __mmask16 keep[T];
  for (int t = 0; t < T; ++t) keep[t] = genfn_kernels::lanes_below(N - (t0 + t) * kTile);
  // The accumulators live in L1 (16 integer sums take half the registers); each is read and
  // written once per block.
  alignas(64) float acc[R][T][kTile];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_store_ps(acc[r][t], init ? _mm512_maskz_loadu_ps(keep[t], init + (m0 + r) * N + (t0 + t) * kTile)
                                      : _mm512_setzero_ps());
  const int8_t* x = a.codes.data() + g * nb * kRows * kBlock;
  const int32_t* x_bias = a.bias.data() + g * nb * kRows;
  const float* x_scale = a.scale.data() + g * nb * kRows;
  const float* x_scaled_sum = a.scaled_sum.data() + g * nb * kRows;
  const uint8_t* codes = w.codes + t0 * nb * kCodeBytes;
  const uint16_t* scales = w.scales + t0 * nb * kTile;
  const uint16_t* mins = kMin ? w.mins + t0 * nb * kTile : nullptr;
  for (int64_t b = 0; b < nb; ++b, x += kRows * kBlock, x_bias += kRows, x_scale += kRows, x_scaled_sum += kRows) {
    __m512i s[R][T];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) s[r][t] = _mm512_set1_epi32(x_bias[r]);
    // Four inputs per lane a chunk: Q8_0 has 8 chunks a block; the 4- and 5-bit kinds 4, whose
    // 4 bytes a row hold inputs 4c..4c+3 and 16+4c..16+4c+3 (tile_kinds.h).
    if constexpr (kind == kQ8) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i wj[T];
        for (int t = 0; t < T; ++t) wj[t] = _mm512_loadu_si512(codes + (t * nb + b) * kCodeBytes + 64 * j);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xj = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * kBlock + 4 * j));
          for (int t = 0; t < T; ++t) s[r][t] = _mm512_dpbusd_epi32(s[r][t], wj[t], xj);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i low[T], high[T];
        for (int t = 0; t < T; ++t)
          genfn_kernels::unpack_nibble_chunk<kind>(codes + (t * nb + b) * kCodeBytes, j, low[t], high[t]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xb = reinterpret_cast<const int32_t*>(x + r * kBlock);
          const __m512i x_low = _mm512_set1_epi32(xb[j]), x_high = _mm512_set1_epi32(xb[4 + j]);
          for (int t = 0; t < T; ++t) {
            s[r][t] = _mm512_dpbusd_epi32(s[r][t], low[t], x_low);
            s[r][t] = _mm512_dpbusd_epi32(s[r][t], high[t], x_high);
          }
        }
      }
    }
    __m512 d[T], minimum[T];
    for (int t = 0; t < T; ++t) {
      d[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (t * nb + b) * kTile)));
      if constexpr (kMin)
        minimum[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + (t * nb + b) * kTile)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x_scale[r]);
      for (int t = 0; t < T; ++t) {
        // quant_linear's step: the same operations in the same order.
        __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][t]), _mm512_mul_ps(d[t], dx), _mm512_load_ps(acc[r][t]));
        if constexpr (kMin) sum = _mm512_fmadd_ps(minimum[t], _mm512_set1_ps(x_scaled_sum[r]), sum);
        _mm512_store_ps(acc[r][t], sum);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      _mm512_mask_storeu_ps(y + (m0 + r) * N + (t0 + t) * kTile, keep[t], _mm512_load_ps(acc[r][t]));
}

using StepFn = void (*)(const GroupedActivations&, int64_t, const QuantWeight&, int64_t, float*, int64_t,
                       const float*);

template <int T, int64_t kind>
StepFn step_for_rows(int64_t rows) {
  switch (rows) {
    case 1: return &rows_against_tiles<1, T, kind>;
    case 2: return &rows_against_tiles<2, T, kind>;
    case 3: return &rows_against_tiles<3, T, kind>;
    case 4: return &rows_against_tiles<4, T, kind>;
    case 5: return &rows_against_tiles<5, T, kind>;
    case 6: return &rows_against_tiles<6, T, kind>;
    case 7: return &rows_against_tiles<7, T, kind>;
    default: return &rows_against_tiles<8, T, kind>;
  }
}

template <int64_t kind>
StepFn step_for(int64_t rows, int64_t tiles) {
  return tiles == kTiles ? step_for_rows<kTiles, kind>(rows) : step_for_rows<1, kind>(rows);
}

StepFn pick_step(int64_t kind, int64_t rows, int64_t tiles) {
  switch (kind) {
    case kQ4: return step_for<kQ4>(rows, tiles);
    case kQ4Min: return step_for<kQ4Min>(rows, tiles);
    case kQ5: return step_for<kQ5>(rows, tiles);
    case kQ5Min: return step_for<kQ5Min>(rows, tiles);
    default: return step_for<kQ8>(rows, tiles);
  }
}

// Tile pairs [p0, p1) against every row of x: each group of rows over all the pairs in turn.
void run_pairs(int64_t p0, int64_t p1, int64_t M, const GroupedActivations& a, const QuantWeight& w, float* y,
               const float* init) {
  const int64_t N = w.out_features;
  for (int64_t g = 0; g * kRows < M; ++g) {
    const int64_t rows = std::min<int64_t>(kRows, M - g * kRows);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t0 = p * kTiles, tiles = std::min<int64_t>(kTiles, w.tiles - t0);
      pick_step(w.kind, rows, tiles)(a, g, w, t0, y, N, init);
    }
  }
}

}  // namespace

namespace genfn_kernels {

bool quant_gemm_takes(int64_t rows) { return rows >= min_rows.load(std::memory_order_relaxed); }

void quant_gemm(const float* x, int64_t M, int64_t K, const QuantWeight& w, float* y, const float* init) {
  // Reused across calls; the threads of the region below read the caller's.
  thread_local GroupedActivations buffer;
  thread_local RowQueue queue;
  GroupedActivations& a = buffer;
  RowQueue& pairs = queue;
  const int64_t groups = (M + kRows - 1) / kRows, slots = groups * (K / kBlock) * kRows;
  a.codes.resize(slots * kBlock);
  a.bias.resize(slots);
  a.scale.resize(slots);
  a.scaled_sum.resize(slots);
  const int64_t pair_count = (w.tiles + kTiles - 1) / kTiles;
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  pairs.prepare_blocks(pair_count, threads);
  // A run's codes stay in L2, and every thread claims a few runs (the last claim is short).
  const int64_t pair_bytes = kTiles * w.blocks * tile_block_bytes(w.kind);
  const int64_t chunk = std::max<int64_t>(1, std::min(kRunBytes / pair_bytes, pair_count / (4 * threads)));
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    quantize_groups(x, M, K, w.kind, groups * t / team, groups * (t + 1) / team, a);
#pragma omp barrier
    auto share = [&](int64_t begin, int64_t end) { run_pairs(begin, end, M, a, w, y, init); };
    run_balanced(pairs, t, chunk, [&](int64_t begin, int64_t end, int64_t, int64_t) { share(begin, end); }, share);
  }
}

}  // namespace genfn_kernels

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  // The fewest rows of x that take the GEMM (0: the default); returns the count now in force.
  m.def("quant_gemm_min_rows", &set_min_rows);
}
