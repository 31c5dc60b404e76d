// What the K-quant library's sources share: kquant_linear.cpp (Q4_K/Q5_K/Q6_K rows, the activations'
// quantization, the ops and their dispatch), kquant_gemm.cpp (the GEMM for many rows),
// iq4_linear.cpp (IQ4_NL/IQ4_XS rows) and kquant_r8.cpp (Q4_K, Q5_K and Q6_K rows interleaved 8 to a group).
// No torch here:
// the row kernels are plain C++ over the blocks as GGUF stores them (genfn/quant/kquants.py).
//
// The library is built without global ISA flags; every SIMD function carries its own target
// attribute (an AVX-512 path and an AVX2 path, picked at run time), and helpers are forced inline
// into them, since a plain call from an ISA path would cross into baseline (SSE) code.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_queue.h"
#include "team_barrier.h"

#define GENFN_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define GENFN_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), always_inline))
#define GENFN_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline))
#define GENFN_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512 with VNNI (vpdpbusd, vpdpwssd): the q4_k_r8 and Q6_K rows, the GEMM's panels.
#define GENFN_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define GENFN_VNNI_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"), always_inline))

namespace genfn::kquant {

constexpr int64_t kSuper = 256;
// The op's format argument (genfn.quant.kquants.FORMAT_ID). kQ4KR8: Q4_K with its rows
// interleaved 8 to a group at load (below); a row of its data holds no one matrix row's blocks.
// kQ5KR8, kQ6KR8, kIQ4XSR8: Q5_K, Q6_K and IQ4_XS alike (below).
enum Format : int64_t {
  kQ4K = 0, kQ5K = 1, kQ6K = 2, kIQ4NL = 3, kIQ4XS = 4, kQ4KR8 = 5, kQ5KR8 = 6, kQ6KR8 = 7, kIQ4XSR8 = 8
};
constexpr int64_t kLastFormat = kIQ4XSR8;
constexpr bool interleaved(int64_t f) { return f == kQ4KR8 || f == kQ5KR8 || f == kQ6KR8 || f == kIQ4XSR8; }
// The file's format of an interleaved one.
constexpr int64_t stored_format(int64_t f) {
  return f == kQ4KR8 ? kQ4K : f == kQ5KR8 ? kQ5K : f == kQ6KR8 ? kQ6K : f == kIQ4XSR8 ? kIQ4XS : f;
}
constexpr int64_t block_bytes(int64_t f) {
  f = stored_format(f);
  return f == kQ4K ? 144 : f == kQ5K ? 176 : f == kQ6K ? 210 : f == kIQ4NL ? 18 : 136;
}
// Inputs per weight block; the activations get one scale per as many inputs.
constexpr int64_t block_inputs(int64_t f) { return f == kIQ4NL ? 32 : kSuper; }

// IQ4_NL / IQ4_XS: the one table of 16 int8 values their 4-bit indices point into (llama.cpp's kvalues_iq4nl).
alignas(16) inline constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                     1,    13,   25,  38,  53,  69,  89,  113};
// The same values moved up by 128: unsigned bytes, for the side of vpdpbusd that takes those.
alignas(16) inline constexpr uint8_t kIQ4ValuesPlus128[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                              129, 141, 153, 166, 181, 197, 217, 241};

// q4_k_r8: rows 8g .. 8g + 7 of a Q4_K matrix, super-block by super-block, each super-block of the
// group group_block_bytes bytes (8 x 144, no byte added; genfn/quant/kquants.py's repack_r8 is the same in
// torch):
//   kR8D      8 x d (float16)      kR8DMin  8 x dmin (float16)
//   kR8Scales the 12 packed scale bytes of each row as 3 runs of 8 dwords (dword w of row r at
//             32 w + 4 r), so 256-bit logic unpacks the 6-bit fields of 8 rows at once
//   kR8Codes  per 64 inputs j (groups 2j, 2j + 1) four 64-byte runs k, each the 8 rows' bytes
//             8k .. 8k + 7 of the row's 32-byte run j (row r at 8 r): 32-bit lane 2r + h holds
//             inputs 8k + 4h .. + 3 of group 2j (low nibbles) and of group 2j + 1 (high), so a
//             qword broadcast of 8 activation codes meets all 16 lanes (kquant_r8.cpp)
//
// q5_k_r8: Q5_K's rows alike, each group super-block 8 x 176 bytes: the four fields above from the
// rows' d, dmin, scales and 128 code bytes, then
//   kR8High   the rows' 32 bytes of fifth bits as four 64-byte runs k, each the 8 rows' bytes
//             8k .. 8k + 7 (row r at 8 r): byte b of lane 2r + h is the qh byte of the inputs that
//             byte b of lane 2r + h of every codes run k holds, its bit 2j that of group 2j's, bit
//             2j + 1 that of group 2j + 1's
//
// q6_k_r8: Q6_K's rows alike, each group super-block 8 x 210 bytes:
//   kQ6R8D       8 x d (float16)
//   kQ6R8Scales  the rows' int8 scales, group by group: scale g of row r at 8 g + r
//   kQ6R8Low     per half h of the 256 inputs, per j (0, 1) and k (0-3) one 64-byte run, the 8 rows'
//                ql bytes 64h + 32j + 8k .. + 7 (row r at 8 r): the low nibbles of lane 2r + e are
//                inputs 128h + 32j + 8k + 4e .. + 3, the high nibbles those plus 64
//   kQ6R8High    per half h and k one 64-byte run, the 8 rows' qh bytes 32h + 8k .. + 7: bit pair
//                2j (j = 0, 1) of a byte is the high pair of the low nibbles of low run (h, j, k) at
//                that byte, pair 2 + 2j of its high nibbles
//
// iq4_xs_r8: IQ4_XS's rows alike, each group super-block 8 x 136 bytes (benchmarks/iq4xs_r8_patterns.cpp
// measured this layout's kernel apart first):
//   kX8D          8 x d (float16)
//   kX8ScalesLow  the rows' 4 bytes of low scale nibbles as dword r, so sub-block s's is bits 4s .. 4s + 3
//   kX8ScalesHigh the rows' 16-bit words of high bit pairs as word r (sub-block s's at bits 2s, 2s + 1)
//   kX8Codes      per sub-block s two 64-byte runs t, each the 8 rows' 8 bytes (row r at 8 r): byte j
//                 holds the indices of inputs 32s + 16t + j (low nibble) and 32s + 16t + 8 + j (high),
//                 so a qword broadcast of 8 activation codes meets lane 2r (inputs 0-3 and 8-11 of each
//                 16) and 2r + 1 (4-7 and 12-15), the lanes offsets8's natural order starts
constexpr int64_t kR8Rows = 8;
constexpr int64_t kR8D = 0, kR8DMin = 16, kR8Scales = 32, kR8Codes = 128, kR8High = 1152;
constexpr int64_t kQ6R8D = 0, kQ6R8Scales = 16, kQ6R8Low = 144, kQ6R8High = 1168;
constexpr int64_t kX8D = 0, kX8ScalesLow = 16, kX8ScalesHigh = 48, kX8Codes = 64;
constexpr int64_t group_block_bytes(int64_t f) { return kR8Rows * block_bytes(f); }

// Row r's Q6_K super-block as GGUF stores it (ql, qh, scales, d: 210 bytes) into / out of its
// group's q6_k_r8 super-block.
__attribute__((always_inline)) inline void q6_r8_store(const uint8_t* block, int r, uint8_t* group) {
  std::memcpy(group + kQ6R8D + 2 * r, block + 208, 2);
  for (int g = 0; g < 16; ++g) group[kQ6R8Scales + 8 * g + r] = block[192 + g];
  for (int run = 0; run < 16; ++run)  // run 8h + 4j + k: ql bytes 64h + 32j + 8k
    std::memcpy(group + kQ6R8Low + 64 * run + 8 * r, block + 8 * run, 8);
  for (int run = 0; run < 8; ++run)  // run 4h + k: qh bytes 32h + 8k
    std::memcpy(group + kQ6R8High + 64 * run + 8 * r, block + 128 + 8 * run, 8);
}
__attribute__((always_inline)) inline void q6_r8_load(const uint8_t* group, int r, uint8_t* block) {
  std::memcpy(block + 208, group + kQ6R8D + 2 * r, 2);
  for (int g = 0; g < 16; ++g) block[192 + g] = group[kQ6R8Scales + 8 * g + r];
  for (int run = 0; run < 16; ++run) std::memcpy(block + 8 * run, group + kQ6R8Low + 64 * run + 8 * r, 8);
  for (int run = 0; run < 8; ++run) std::memcpy(block + 128 + 8 * run, group + kQ6R8High + 64 * run + 8 * r, 8);
}

// Bytes a, b as (low(a) | low(b) << 4, high(a) | high(b) << 4): an IQ4_XS sub-block's bytes j and
// 8 + j into iq4_xs_r8's runs 0 and 1, and, being its own inverse, back (genfn/quant/kquants.py's
// _pair_nibbles).
__attribute__((always_inline)) inline void pair_nibbles(uint8_t a, uint8_t b, uint8_t& low, uint8_t& high) {
  low = static_cast<uint8_t>((a & 0x0F) | (b << 4));
  high = static_cast<uint8_t>((a >> 4) | (b & 0xF0));
}

// Row r's IQ4_XS super-block as GGUF stores it (d, scales_h, scales_l, then 16 index bytes a
// sub-block: byte i's low nibble input i, its high one input 16 + i) into / out of its group's
// iq4_xs_r8 super-block: the nibbles of bytes i and 8 + i (i < 8) of a sub-block pair up anew.
__attribute__((always_inline)) inline void iq4xs_r8_store(const uint8_t* block, int r, uint8_t* group) {
  std::memcpy(group + kX8D + 2 * r, block, 2);
  std::memcpy(group + kX8ScalesHigh + 2 * r, block + 2, 2);
  std::memcpy(group + kX8ScalesLow + 4 * r, block + 4, 4);
  for (int s = 0; s < 8; ++s) {
    const uint8_t* q = block + 8 + 16 * s;
    uint8_t* run = group + kX8Codes + 128 * s + 8 * r;
    for (int j = 0; j < 8; ++j) pair_nibbles(q[j], q[8 + j], run[j], run[64 + j]);
  }
}
__attribute__((always_inline)) inline void iq4xs_r8_load(const uint8_t* group, int r, uint8_t* block) {
  std::memcpy(block, group + kX8D + 2 * r, 2);
  std::memcpy(block + 2, group + kX8ScalesHigh + 2 * r, 2);
  std::memcpy(block + 4, group + kX8ScalesLow + 4 * r, 4);
  for (int s = 0; s < 8; ++s) {
    const uint8_t* run = group + kX8Codes + 128 * s + 8 * r;
    uint8_t* q = block + 8 + 16 * s;
    for (int j = 0; j < 8; ++j) pair_nibbles(run[j], run[64 + j], q[j], q[8 + j]);
  }
}

// Row r's super-block as GGUF stores it (Q4_K: 144 bytes; Q5_K: 176, its qh before its codes;
// Q6_K: 210; IQ4_XS: 136) into / out of its group's super-block of format F.
template <int64_t F>
__attribute__((always_inline)) inline void r8_store(const uint8_t* block, int r, uint8_t* group) {
  if constexpr (F == kQ6KR8) {
    q6_r8_store(block, r, group);
  } else if constexpr (F == kIQ4XSR8) {
    iq4xs_r8_store(block, r, group);
  } else {
    constexpr int64_t codes = F == kQ5KR8 ? 48 : 16;
    std::memcpy(group + kR8D + 2 * r, block, 2);
    std::memcpy(group + kR8DMin + 2 * r, block + 2, 2);
    for (int w = 0; w < 3; ++w) std::memcpy(group + kR8Scales + 32 * w + 4 * r, block + 4 + 4 * w, 4);
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 4; ++k)
        std::memcpy(group + kR8Codes + 256 * j + 64 * k + 8 * r, block + codes + 32 * j + 8 * k, 8);
    if constexpr (F == kQ5KR8)
      for (int k = 0; k < 4; ++k) std::memcpy(group + kR8High + 64 * k + 8 * r, block + 16 + 8 * k, 8);
  }
}
template <int64_t F>
__attribute__((always_inline)) inline void r8_load(const uint8_t* group, int r, uint8_t* block) {
  if constexpr (F == kQ6KR8) {
    q6_r8_load(group, r, block);
  } else if constexpr (F == kIQ4XSR8) {
    iq4xs_r8_load(group, r, block);
  } else {
    constexpr int64_t codes = F == kQ5KR8 ? 48 : 16;
    std::memcpy(block, group + kR8D + 2 * r, 2);
    std::memcpy(block + 2, group + kR8DMin + 2 * r, 2);
    for (int w = 0; w < 3; ++w) std::memcpy(block + 4 + 4 * w, group + kR8Scales + 32 * w + 4 * r, 4);
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 4; ++k)
        std::memcpy(block + codes + 32 * j + 8 * k, group + kR8Codes + 256 * j + 64 * k + 8 * r, 8);
    if constexpr (F == kQ5KR8)
      for (int k = 0; k < 4; ++k) std::memcpy(block + 16 + 8 * k, group + kR8High + 64 * k + 8 * r, 8);
  }
}

enum Isa : int64_t { kNone = 0, kAvx2 = 1, kAvx512 = 2 };
// The best path this CPU runs (not a forced one): tiles_avx2.cpp asks whether it has AVX2 at all.
Isa best_isa();

// Whether the AVX-512 path may also use VNNI's vpdpbusd / vpdpwssd (the q4_k_r8 and Q6_K rows, the GEMM).
inline bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
}

// Whether format f's row kernel on path isa for `rows` rows of x (pick's) reads the activations'
// offsets8 (above): q6_k_r8's and iq4_xs_r8's (natural order), and one row of IQ4_XS on VNNI
// (iq4_linear.cpp, kIQ4Order).
inline bool reads_offsets(Isa isa, int64_t f, int64_t rows) {
  return f == kQ6KR8 || (f == kIQ4XSR8 && isa == kAvx512 && has_vnni()) ||
         (f == kIQ4XS && rows == 1 && isa == kAvx512 && has_vnni());
}

// How the activation codes of a row are laid out, so that one load meets the nibbles a weight
// register holds (each permutation applies per whole 128 inputs; a shorter tail stays natural):
//   kNatural
//   kQ4KOrder  0-31, 64-95, 32-63, 96-127 (Q4_K/Q5_K on AVX-512: a 64-byte load's low nibbles
//              are inputs 0-31 and 64-95 of a 128)
//   kIQ4Order  0-15, 32-47, 64-79, 96-111, 16-31, 48-63, 80-95, 112-127 (IQ4 on AVX-512: four
//              16-byte runs of indices, low nibbles then high nibbles)
enum Order : int { kNatural = 0, kQ4KOrder = 1, kIQ4Order = 2 };

// Q8_K-quantized activations of M rows: codes [M, K] (in one of the orders above), scales
// [M, K / block] (block = block_inputs of the weight's format), code sums per 16 inputs in natural
// order [M, K / 16], and per 32 [M, K / 32] (|sum| <= 4064: an int16; what Q4_K's minimums and
// q4_k_r8's groups multiply, read as they are rather than added up per weight row); where a reader
// asks for them (resize's with_offsets8: a layout whose row kernel reads them, reads_offsets),
// where the dot products of a kernel's 32-bit lanes start, one per lane of 8 inputs [M, K / 8]
// (offsets8), so that a code offset is off each lane's sum before its scale multiplies it:
//   natural order (q6_k_r8): -32 times the code sums of inputs 0-3 and 8-11 of each 16, then of 4-7
//                            and 12-15 (Q6_K's codes are u + 32)
//   kIQ4Order (one row of IQ4_XS on VNNI): per 128 inputs, lane i -128 times the sum of the codes
//                            stored at 4i .. 4i + 3 and 64 + 4i .. + 3 (iq4_linear.cpp's values w + 128)
// else offsets8 is empty and the quantization skips it.
struct ActivationsK {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int16_t> sums, sums32;
  std::vector<int32_t> offsets8;
  int64_t M = 0, K = 0;
  void resize(int64_t rows, int64_t inputs, int64_t block, bool with_offsets8 = false) {
    M = rows;
    K = inputs;
    codes.resize(M * K);
    scale.resize(M * (K / block));
    sums.resize(M * (K / 16));
    sums32.resize(M * (K / 32));
    offsets8.resize(with_offsets8 ? M * (K / 8) : 0);
  }
};

// One weight row (its nb blocks at w) against rows m0.. m0 + M - 1 of the activations: writes
// y[m * N] for each of them.
using RowFn = void (*)(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N);

// IQ4_NL / IQ4_XS rows (iq4_linear.cpp), for 1..8 rows of x (8: any more).
RowFn pick_iq4(Isa isa, int64_t format, int rows);
// Q6_K rows on AVX-512 VNNI (kquant_q6k.cpp), for 1..8 rows of x (8: any more).
RowFn pick_q6k_vnni(int rows);
// q4_k_r8 / q5_k_r8 / q6_k_r8 / iq4_xs_r8 (kquant_r8.cpp, kquant_q6k.cpp; `format`), for 1..8 rows of x: a
// call takes w at a group's first super-block and writes its 8 rows, y[m * N + r] for r < 8.
RowFn pick_r8(Isa isa, int64_t format, int rows);
// q6_k_r8 on AVX-512 VNNI (kquant_q6k.cpp); elsewhere its groups go through the Q6_K row kernels
// a row at a time (kquant_linear.cpp), as iq4_xs_r8's go through IQ4_XS's.
RowFn pick_q6k_r8_vnni(int rows);

// Rows m0..m1 of x [M, K] into a (sized for M rows already) as llama.cpp's quantize_row_q8_K_ref
// quantizes them, one scale per `block` inputs (256, or 32 for IQ4_NL), codes laid out in `order`
// (kquant_linear.cpp).
void quantize_rows_k(const float* x, int64_t m0, int64_t m1, int64_t K, int64_t block, Order order, ActivationsK& a);

// The GEMM for many rows of x (kquant_gemm.cpp): whether it takes `rows` rows of a matrix in
// `format` on path `isa`, and y [M, N] = x [M, K] @ W.T for W's rows (N of them, K / 256 super-blocks
// each) at w.
bool gemm_takes(int64_t format, int64_t rows, Isa isa);
void kquant_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t format, int64_t N, float* y, Isa isa);
// The fewest rows of x the GEMM takes (rows <= 0: the default); returns the count now in force.
int64_t set_gemm_min_rows(int64_t rows);

// A K-quant matrix multiplied inside a parallel region that another library opens: the decode
// library's fused layer (decode_layer.cpp) runs its linears through this, and kquant_linear's
// row-kernel path runs on it too, so a row's numbers are those of the row kernels either way.
// The matrix is up to kMaxParts row ranges stacked, each in its own format (a Q4_K_M file's q/k
// in Q4_K beside v in Q6_K): x is quantized once per layout the parts read (order, block), and the
// rows of all parts shared out together. The caller fills parts, count and K; then prepare before
// the region, and in it every thread calls linear_share (which quantizes x, by a share and a
// barrier or, for a few rows, each thread for itself, then sums the thread's claimed rows).
struct MatrixPart {
  const uint8_t* w;  // rows [rows, K / block_inputs(format) * block_bytes(format)], contiguous
  int64_t format, rows;
};
struct SharedLinear {
  static constexpr int kMaxParts = 4;
  MatrixPart parts[kMaxParts];
  int64_t count = 0, K = 0;
  // prepare's: M rows of x in `groups` groups of `per` (the last may hold fewer), the parts' first
  // output rows, each part's row functions and the layout of x it reads.
  int64_t M = 0, per = 0, groups = 0, chunk = 1, layouts = 0;
  int64_t first[kMaxParts + 1] = {}, row_bytes[kMaxParts] = {}, blocks[kMaxParts] = {}, layout_of[kMaxParts] = {};
  RowFn full[kMaxParts] = {}, last[kMaxParts] = {};
  int64_t block[kMaxParts] = {};
  Order order[kMaxParts] = {};
  ActivationsK x[kMaxParts];
  genfn_kernels::RowQueue queue;
};
// What a library's entry table was built as: sizeof(SharedLinear) and the revision of the entries'
// signatures (raise kLayerEntryRevision with any change to them), compared before any entry is
// called. Before revision 2 the key was sizeof(SharedLinear) alone, so an older decode library
// refuses a newer table too (benchmarks/stack_ab.py pairs a revision's decode library with this
// tree's K-quant library).
constexpr int64_t kLayerEntryRevision = 2;  // 2: linear_share meets at a TeamBarrier
constexpr int64_t layer_entry_key() { return static_cast<int64_t>(sizeof(SharedLinear)) << 8 | kLayerEntryRevision; }
// The K-quant library's entry points for SharedLinear. The decode library is built with AVX-512
// flags and these kernels without, and torch loads each library on its own (RTLD_LOCAL), so
// neither links the other: the decode library asks the op kquant_layer_entry for this table.
struct LayerEntry {
  int64_t key;  // layer_entry_key() in the K-quant library's build, which the caller checks
  void (*prepare)(SharedLinear& s, int64_t M, int64_t threads);
  // Thread t of `team`'s part of y [M, N] = x [M, K] @ W.T, inside the region (it may meet the team at
  // `barrier`: every thread of the team calls it).
  void (*linear_share)(SharedLinear& s, const float* x, float* y, int64_t t, int64_t team,
                       genfn_kernels::TeamBarrier& barrier);
};

__attribute__((target("f16c"), always_inline)) inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

__attribute__((always_inline)) inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// IQ4_XS's eight sub-block scales (ls - 32) as int16: scales_h (2 bytes at w + 2) holds bits 4-5 of
// sub-block i's at bits 2i, scales_l (4 bytes at w + 4) bits 0-3 at bits 4i.
__attribute__((always_inline)) inline void iq4xs_scales(const uint8_t* w, int16_t out[8]) {
  const uint32_t high = load_u16(w + 2);
  uint32_t low;
  std::memcpy(&low, w + 4, 4);
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<int16_t>((((low >> (4 * i)) & 0x0F) | (((high >> (2 * i)) & 0x03) << 4)) - 32);
}

// Eight bytes as one int64 (a qword that a vpbroadcastq meets all of a register's lanes with).
__attribute__((always_inline)) inline int64_t load_i64(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// The 8 six-bit scales and mins of a Q4_K/Q5_K super-block (12 bytes): scales in bytes 0-7 of sc,
// mins in bytes 0-7 of mn.
__attribute__((always_inline)) inline void unpack_scales(const uint8_t* p, uint64_t& sc, uint64_t& mn) {
  uint32_t u[3];
  std::memcpy(u, p, 12);
  const uint32_t sc_low = u[0] & 0x3F3F3F3Fu, mn_low = u[1] & 0x3F3F3F3Fu;
  const uint32_t sc_high = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
  const uint32_t mn_high = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
  sc = sc_low | (static_cast<uint64_t>(sc_high) << 32);
  mn = mn_low | (static_cast<uint64_t>(mn_high) << 32);
}

GENFN_AVX512_INLINE inline float reduce512(__m512 v) { return _mm512_reduce_add_ps(v); }

// Lane m (m < 8): the sum of v[m]'s int32 lanes (AVX-512: 16 of them; AVX2: 8). Integer sums,
// so exact in any order; eight rows' reductions share their shuffles.
GENFN_AVX512_INLINE inline __m256i sum_lanes8(const __m512i* v) {
  __m512i t[4];  // per 128-bit chunk: [v2i, v2i+1, v2i, v2i+1] partials
  for (int i = 0; i < 4; ++i)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  // per chunk: rows 0-3 (u0) and 4-7 (u1), one partial each
  const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
  const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
  // chunks [u0 0+1, u0 2+3, u1 0+1, u1 2+3]
  const __m512i w = _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_add_epi32(_mm512_castsi512_si256(_mm512_shuffle_i32x4(w, w, _MM_SHUFFLE(0, 0, 2, 0))),
                          _mm512_castsi512_si256(_mm512_shuffle_i32x4(w, w, _MM_SHUFFLE(0, 0, 3, 1))));
}

GENFN_AVX2_INLINE inline __m256i sum_lanes8(const __m256i* v) {
  __m256i t[4];
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  const __m256i u0 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
  const __m256i u1 = _mm256_add_epi32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// sum_lanes8 for the first M registers of v: at most four take half its shuffles (lanes 4-7 zero).
GENFN_AVX512_INLINE inline __m256i sum_lanes4(const __m512i* v, int M) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i t1 = M > 2 ? _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]))
                           : _mm512_setzero_si512();
  const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));  // a chunk: rows 0-3
  const __m512i s = _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm256_zextsi128_si256(_mm512_castsi512_si128(_mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)))));
}

GENFN_AVX2_INLINE inline __m256i sum_lanes4(const __m256i* v, int M) {
  const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
  const __m256i t1 = M > 2 ? _mm256_add_epi32(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]))
                           : _mm256_setzero_si256();
  const __m256i u = _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
  return _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

// v's 16 int32 lanes as 8: lane i plus lane i + 8 (exact). Reductions of 512-bit lanes fold first,
// then shuffle 256-bit registers, which cost half as much on Zen 4.
GENFN_AVX512_INLINE inline __m256i fold_lanes(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// Lane m < M: the sum of v[m]'s int32 lanes (v past M zeros), by the smaller network where it serves.
template <int M>
GENFN_AVX512_INLINE inline __m256i sum_rows(const __m512i* v) {
  __m256i halves[8];
  for (int m = 0; m < 8; ++m) halves[m] = m < M ? fold_lanes(v[m]) : _mm256_setzero_si256();
  if constexpr (M <= 4) return sum_lanes4(halves, M);
  else return sum_lanes8(halves);
}

template <int M>
GENFN_AVX2_INLINE inline __m256i sum_rows(const __m256i* v) {
  if constexpr (M <= 4) return sum_lanes4(v, M);
  else return sum_lanes8(v);
}

// Lane m: activation row m0 + m's scale of super-block b, for m < M (zero past them), loaded one by
// one: a gather (vgatherdps, slow on AMD) and the eight-row network for fewer rows cost the K-quant
// row kernels 4-16 % of their time at 2-4 rows (benchmarks/results/kquant-few-rows-2026-12-07-s42-zen4.log).
template <int M>
GENFN_AVX2_INLINE inline __m256 block_scales8(const ActivationsK& a, int64_t m0, int64_t nb, int64_t b) {
  const float* s = a.scale.data() + m0 * nb + b;
  auto at = [&](int m) { return m < M ? s[m * nb] : 0.0f; };
  return _mm256_setr_ps(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
}

// A super-block's part of an output, added in the one order every K-quant kernel adds it (the row
// kernels, q4_k_r8's and the GEMM's, AVX2 and AVX-512): the integer sum times scale (d * d_x), then
// the minimums' integer sum times min_scale (dmin * d_x) taken off, each one fused multiply-add on
// a float32 sum per output. So an output has the same bits whichever kernel ran it, with however
// many rows. Q6_K's offset of 32 (its minimums, with dmin = d) comes off the integer sum first:
// the one-term form. One output per float, per lane of the vector forms.
GENFN_AVX2_INLINE inline float add_block(float acc, int32_t sums, int32_t mins, float scale, float min_scale) {
  return std::fma(-static_cast<float>(mins), min_scale, std::fma(static_cast<float>(sums), scale, acc));
}

GENFN_AVX2_INLINE inline float add_block(float acc, int32_t sums, float scale) {
  return std::fma(static_cast<float>(sums), scale, acc);
}

GENFN_AVX2_INLINE inline __m256 add_block(__m256 acc, __m256i sums, __m256i mins, __m256 scale, __m256 min_scale) {
  return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), min_scale, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc));
}

GENFN_AVX2_INLINE inline __m256 add_block(__m256 acc, __m256i sums, __m256 scale) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}

GENFN_AVX512_INLINE inline __m512 add_block(__m512 acc, __m512i sums, __m512i mins, __m512 scale, __m512 min_scale) {
  return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), min_scale, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc));
}

GENFN_AVX512_INLINE inline __m512 add_block(__m512 acc, __m512i sums, __m512 scale) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc);
}

GENFN_AVX512_INLINE inline int32_t sum_lanes(__m512i v) { return _mm512_reduce_add_epi32(v); }

GENFN_AVX2_INLINE inline int32_t sum_lanes(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

// The float32 sums of rows m0 .. m0 + M - 1 against one weight row: lane m of `lanes`, or `one`
// where M is 1. A row kernel fills sum[m] and mins[m] (m < M; the rest zeros) per super-block.
struct RowSums {
  __m256 lanes;
  float one;
};

// Both forms (with the minimums; Q6_K's, the offset already off the sums) for the AVX-512 kernels'
// sums and for the AVX2 kernels': one text, stamped for the two targets.
#define GENFN_ADD_ROWS(TARGET, SUM)                                                                            \
  template <int M>                                                                                           \
  TARGET inline void add_rows(RowSums& acc, const SUM* sum, const __m256i* mins, float d, float dmin,         \
                              const ActivationsK& a, int64_t m0, int64_t nb, int64_t b) {                     \
    if constexpr (M == 1) {                                                                                  \
      const float dx = a.scale[m0 * nb + b];                                                                 \
      acc.one = add_block(acc.one, sum_lanes(sum[0]), sum_lanes(mins[0]), d * dx, dmin * dx);                \
    } else {                                                                                                 \
      const __m256 dx = block_scales8<M>(a, m0, nb, b);                                                      \
      acc.lanes = add_block(acc.lanes, sum_rows<M>(sum), sum_rows<M>(mins), _mm256_mul_ps(_mm256_set1_ps(d), dx), \
                            _mm256_mul_ps(_mm256_set1_ps(dmin), dx));                                        \
    }                                                                                                        \
  }                                                                                                          \
  template <int M>                                                                                           \
  TARGET inline void add_rows(RowSums& acc, const SUM* sum, float d, const ActivationsK& a, int64_t m0,       \
                              int64_t nb, int64_t b) {                                                       \
    if constexpr (M == 1)                                                                                    \
      acc.one = add_block(acc.one, sum_lanes(sum[0]), d * a.scale[m0 * nb + b]);                             \
    else                                                                                                     \
      acc.lanes = add_block(acc.lanes, sum_rows<M>(sum),                                                    \
                            _mm256_mul_ps(_mm256_set1_ps(d), block_scales8<M>(a, m0, nb, b)));               \
  }
GENFN_ADD_ROWS(GENFN_AVX512_INLINE, __m512i)
GENFN_ADD_ROWS(GENFN_AVX2_INLINE, __m256i)
#undef GENFN_ADD_ROWS

// One row of x, eight super-blocks at a time: lane i of `sums` (and `mins`) block i's integer sum,
// reduced for the eight by one shuffle network (sum_lanes8) where add_rows<1> runs one a block,
// then added block after block by add_block, so the output keeps add_rows<1>'s bits. Q6_K's row
// kernel at one row: 1.02-1.06x as fast out of cache (1B shapes, 2 threads), as in a decode step;
// in cache, compute-bound on one thread, within the noise or a few % slower, and Q4_K's file-layout
// kernel was 3-6 % slower out of cache this way (four blocks a network as well), so it stays a
// block at a time (benchmarks/results/q6k-eight-blocks-ab-2026-12-05-s21.log).
// The eight integers are converted as one vector (the same floats as add_block's one by one: each
// exact integer rounded to nearest), scale[i] is d * d_x of block i.
GENFN_AVX2_INLINE inline float add_eight_blocks(float acc, __m256i sums, const float* scale) {
  alignas(32) float s[8];
  _mm256_store_ps(s, _mm256_cvtepi32_ps(sums));
  for (int i = 0; i < 8; ++i) acc = std::fma(s[i], scale[i], acc);
  return acc;
}

template <int M>
GENFN_AVX2_INLINE inline void store_rows(const RowSums& acc, float* y, int64_t N) {
  if constexpr (M == 1) {
    y[0] = acc.one;
  } else {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc.lanes);
    for (int m = 0; m < M; ++m) y[m * N] = out[m];
  }
}

GENFN_AVX2_INLINE inline float reduce256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

}  // namespace genfn::kquant
