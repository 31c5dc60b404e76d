// The pieces of the decode kernels that other kernels of this library call from inside their own
// parallel regions (decode_layer.cpp): no thread pool of their own, only a thread's share.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "lanes16.h"
#include "row_queue.h"
#include "tile_kinds.h"

namespace genfn_kernels {

// f(std::integral_constant<int, M>) for M rows of x, 1 to kMaxDecodeRows (more run as
// kMaxDecodeRows): a kernel templated on its rows of x, called with a runtime count.
template <typename F>
void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

using simd::lanes_below;

// The kept lanes of 16 elements of T as float32, and back (bfloat16 rounded as c10::BFloat16(float)
// rounds: to nearest even, NaN quiet).
inline simd::F16 load16(const float* p, simd::M16 keep) { return simd::load_kept(keep, p); }
inline void store16(float* p, simd::F16 v, simd::M16 keep) { simd::store_kept(p, keep, v); }
inline simd::F16 load16(const c10::BFloat16* p, simd::M16 keep) { return simd::widen_bf16_kept(keep, p); }
inline void store16(c10::BFloat16* p, simd::F16 v, simd::M16 keep) { simd::store_bf16_kept(p, keep, v); }

// e^x in 16 float32 lanes: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to r^7
// (truncation ~5e-9 relative, under float32's 6e-8), scaled by 2^n. Within 2 ulp of expf.
inline simd::F16 exp16(simd::F16 x) {
  using namespace simd;
  x = max(min(x, set1(88.7f)), set1(-104.0f));
  const F16 n = round_nearest(mul(x, set1(1.44269504088896341f)));
  F16 r = fnmadd(n, set1(0.693145751953125f), x);  // ln 2 in two parts
  r = fnmadd(n, set1(1.428606765330187e-06f), r);
  F16 p = set1(1.f / 5040);
  p = fmadd(p, r, set1(1.f / 720));
  p = fmadd(p, r, set1(1.f / 120));
  p = fmadd(p, r, set1(1.f / 24));
  p = fmadd(p, r, set1(1.f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.f));
  p = fmadd(p, r, set1(1.f));
  return scalef(p, n);
}

// silu(g) = g / (1 + e^-g) in 16 float32 lanes, as every SwiGLU kernel computes it.
inline simd::F16 silu16(simd::F16 g) {
  using namespace simd;
  return div(g, add(set1(1.f), exp16(sub(zero(), g))));
}

// Whether the bfloat16 forms can run (they need AVX512_BF16).
bool cpu_has_avx512_bf16();
// Whether bfloat16 linears sum through vdpbf16ps (plain_rows.h's Bfloat16Dot): on a CPU with
// AVX512_BF16 unless the op bf16_linear_path chose the widening path; else they widen.
bool bf16_dot_in_use();

// The rows of one product shared out to T threads that balance their work: row_queue.h.
// prepare() before the parallel region, then every thread calls linear_balanced with it once:
// y[M, N] = x[M, K] @ w[N, K].T, summed as decode_linear sums it (M <= 2 * kMaxDecodeRows: past
// kMaxDecodeRows, groups of group_size(M) rows over each chunk, the weight streamed once).
void linear_balanced(int64_t M, const float* x, const float* w, int64_t K, int64_t N, float* y, int64_t t,
                     RowQueue& queue);
void linear_balanced(int64_t M, const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N,
                     c10::BFloat16* y, int64_t t, RowQueue& queue);

// A bfloat16 matrix [N, K] in 12.2 bits, every weight kept (genfn/quant/coded_bf16.py, coded_bf16.cpp):
// per row 96 bytes of records a group of 64 weights, a base byte a group, and the raw groups' high
// bytes (row n's from raw_start[n]).
struct CodedWeight {
  const uint8_t* records;
  const uint8_t* bases;
  const uint8_t* raw;
  const int64_t* raw_start;
  int64_t N, K;
};
// Thread t's share of y[M, N] = x[M, K] @ decode(w).T (any M, in groups of at most kMaxDecodeRows),
// rows shared out balanced (queue.prepare_blocks(w.N, T) before the region), summed as
// linear_balanced sums a plain bfloat16 weight: the same bits.
void coded_linear_share(int64_t M, const c10::BFloat16* x, const CodedWeight& w, c10::BFloat16* y, int64_t t,
                        RowQueue& queue);

// A block-quantized weight in genfn/quant/weight.py's "tiles16" layout, as quant_linear reads it:
// `tiles` tiles of 16 output rows, `blocks` blocks of 32 inputs each; `kind` a TileKind
// (tile_kinds.h): 0 (Q4_0), 1 (with minimums: Q4_1, int4), 2 (8-bit), 3 (Q5_0) or 4 (Q5_1).
struct QuantWeight {
  const uint8_t* codes;
  const uint16_t* scales;  // float16
  const uint16_t* mins;    // float16, kinds 1 and 4 only
  int64_t kind, tiles, blocks, out_features;
};
// Whether the quantized shares can run (they need AVX512_VNNI).
bool cpu_has_avx512_vnni();
// Whether quantize_rows_share and the quant_linear shares run here: the AVX-512 library's on a CPU
// with AVX512_VNNI, the AVX2 library's (decode_avx2.cpp) wherever it loads.
bool quant_shares_run();
// Thread t of T quantizes its share of the M rows of x [M, K] into a; a barrier must follow
// before any thread reads a.
void quantize_rows_share(const float* x, int64_t M, int64_t K, QuantActivations& a, int64_t t, int64_t T);
// quant_linear_share (below) for `groups` groups of rows (M[g] rows quantized in a[g], results to y[g]),
// every group over each claimed chunk of tiles: the weight streams once for all of them. Group g's
// chains start at init[g]'s values where init is given (quant_linear_from). y's (and init's) rows
// lie `ld` floats apart (0: w.out_features), wider where w is one part of a stacked linear.
void quant_linear_share_groups(int64_t groups, const int64_t* M, const QuantActivations* a, int64_t K,
                               const QuantWeight& w, float* const* y, int64_t t, RowQueue& queue,
                               const float* const* init = nullptr, int64_t ld = 0);
// The tiles one claim of a quant_linear share takes (a chunk, what one run of the tiles sums): ~32 KiB of
// codes for one group of rows. At ~8 KiB a 576-wide matrix took a call (and its share of a claim) per tile:
// where this VM's memory read ~70-90 GB/s, SmolLM2 Q4_1's stack took 0.95x that time at one row, 0.93x at
// two, 0.81x at four, 0.97x at eight (session 34, stack_ab.py, the same sums; ~16 KiB lost to 32, ~64 KiB
// gained nothing more); where it read ~46 GB/s, 0.99-1.01x (there the few-row steps ran 0.67x as long: 1.30
// ms at four rows against 1.94, so their per-call costs weighed less). 2048-wide tiles of 16-32 KiB are one
// or two a chunk either way. For several groups ~8 KiB, so that the chunk the first group fetched is still
// in L1 when the others read it.
inline int64_t tiles_chunk(const QuantWeight& w, int64_t groups) {
  const int64_t tile_bytes = w.blocks * tile_block_bytes(w.kind);
  return std::max<int64_t>(1, (groups == 1 ? 32768 : 8192) / tile_bytes);
}
// Thread t's share of y[M, N] = x[M, K] @ dequantize(w).T from x quantized in a (M <=
// kMaxDecodeRows), summed as quant_linear sums it: tiles shared out balanced as linear_balanced
// shares rows (queue.prepare_blocks(w.tiles, T) before the region).
inline void quant_linear_share(int64_t M, const QuantActivations& a, int64_t K, const QuantWeight& w, float* y,
                               int64_t t, RowQueue& queue) {
  quant_linear_share_groups(1, &M, &a, K, w, &y, t, queue);
}
// Whether quant_linear hands a product of this many rows of x to quant_gemm (from 16 rows unless
// the op quant_gemm_min_rows set another count).
bool quant_gemm_takes(int64_t rows);
// y[M, N] = x[M, K] @ dequantize(w).T for many rows (quant_gemm.cpp, needs AVX512_VNNI): the same
// bits as quant_linear's tiles; each output's chain starts at init's value where given.
void quant_gemm(const float* x, int64_t M, int64_t K, const QuantWeight& w, float* y, const float* init);

// A paged cache [blocks, Hkv, block_size, D]: where slot `slot` (block * block_size + offset) lies, as
// an element offset from a kv head's rows of block 0.
inline int64_t paged_slot_offset(int64_t slot, int64_t block_size, int64_t block_stride, int64_t D) {
  return slot / block_size * block_stride + slot % block_size * D;
}

// out[pos - first] = where positions first .. length - 1 of the request whose blocks are table[0 ..]
// lie, as paged_slot_offset gives them: the keys a query walks, in position order.
inline void paged_position_offsets(const int64_t* table, int64_t first, int64_t length, int64_t block_size,
                                   int64_t block_stride, int64_t D, int64_t* out) {
  for (int64_t pos = first; pos < length; ++pos)
    out[pos - first] = paged_slot_offset(table[pos / block_size] * block_size + pos % block_size, block_size,
                                         block_stride, D);
}

// One row's `groups` query heads q[groups, head_dim] that share a kv head, against that head's
// keys/values (slot s at s * slot_stride) where visible[s], s < span: dense_decode_attention's
// arithmetic and rounding, into out[groups, head_dim].
template <typename T>
void attend_group(const T* q, const T* keys, const T* values, const bool* visible, int64_t span,
                  int64_t slot_stride, int64_t groups, int64_t head_dim, float scale, T* out);
// The same against the n slots at element offsets offsets[0 .. n) from keys/values, in that order
// (a paged cache's positions through a block table): the same bits as attend_group where the
// offsets are its visible slots'.
template <typename T>
void attend_group_at(const T* q, const T* keys, const T* values, const int64_t* offsets, int64_t n, int64_t groups,
                     int64_t head_dim, float scale, T* out);

}  // namespace genfn_kernels
