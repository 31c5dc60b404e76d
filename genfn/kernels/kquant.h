// What the K-quant library's sources share: kquant_linear.cpp (Q4_K/Q5_K/Q6_K rows, the activations'
// quantization, the ops and their dispatch), kquant_gemm.cpp (the GEMM for many rows),
// iq4_linear.cpp (IQ4_NL/IQ4_XS rows) and kquant_r8.cpp (Q4_K rows interleaved 8 to a group). No torch here:
// the row kernels are plain C++ over the blocks as GGUF stores them (genfn/quant/kquants.py).
//
// The library is built without global ISA flags; every SIMD function carries its own target
// attribute (an AVX-512 path and an AVX2 path, picked at run time), and helpers are forced inline
// into them, since a plain call from an ISA path would cross into baseline (SSE) code.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "row_queue.h"

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
enum Format : int64_t { kQ4K = 0, kQ5K = 1, kQ6K = 2, kIQ4NL = 3, kIQ4XS = 4, kQ4KR8 = 5 };
constexpr int64_t kLastFormat = kQ4KR8;
constexpr int64_t block_bytes(int64_t f) {
  return f == kQ4K || f == kQ4KR8 ? 144 : f == kQ5K ? 176 : f == kQ6K ? 210 : f == kIQ4NL ? 18 : 136;
}
// Inputs per weight block; the activations get one scale per as many inputs.
constexpr int64_t block_inputs(int64_t f) { return f == kIQ4NL ? 32 : kSuper; }

// q4_k_r8: rows 8g .. 8g + 7 of a Q4_K matrix, super-block by super-block, each super-block of the
// group kR8Block bytes (8 x 144, no byte added; genfn/quant/kquants.py's repack_r8 is the same in
// torch):
//   kR8D      8 x d (float16)      kR8DMin  8 x dmin (float16)
//   kR8Scales the 12 packed scale bytes of each row as 3 runs of 8 dwords (dword w of row r at
//             32 w + 4 r), so 256-bit logic unpacks the 6-bit fields of 8 rows at once
//   kR8Codes  per 64 inputs j (groups 2j, 2j + 1) four 64-byte runs k, each the 8 rows' bytes
//             8k .. 8k + 7 of the row's 32-byte run j (row r at 8 r): 32-bit lane 2r + h holds
//             inputs 8k + 4h .. + 3 of group 2j (low nibbles) and of group 2j + 1 (high), so a
//             qword broadcast of 8 activation codes meets all 16 lanes (kquant_r8.cpp)
constexpr int64_t kR8Rows = 8, kR8Block = kR8Rows * 144;
constexpr int64_t kR8D = 0, kR8DMin = 16, kR8Scales = 32, kR8Codes = 128;

// Row r's Q4_K super-block (144 bytes as GGUF stores it) into / out of its group's super-block.
__attribute__((always_inline)) inline void r8_store(const uint8_t* block, int r, uint8_t* group) {
  std::memcpy(group + kR8D + 2 * r, block, 2);
  std::memcpy(group + kR8DMin + 2 * r, block + 2, 2);
  for (int w = 0; w < 3; ++w) std::memcpy(group + kR8Scales + 32 * w + 4 * r, block + 4 + 4 * w, 4);
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) std::memcpy(group + kR8Codes + 256 * j + 64 * k + 8 * r, block + 16 + 32 * j + 8 * k, 8);
}
__attribute__((always_inline)) inline void r8_load(const uint8_t* group, int r, uint8_t* block) {
  std::memcpy(block, group + kR8D + 2 * r, 2);
  std::memcpy(block + 2, group + kR8DMin + 2 * r, 2);
  for (int w = 0; w < 3; ++w) std::memcpy(block + 4 + 4 * w, group + kR8Scales + 32 * w + 4 * r, 4);
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) std::memcpy(block + 16 + 32 * j + 8 * k, group + kR8Codes + 256 * j + 64 * k + 8 * r, 8);
}

enum Isa : int64_t { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

// Whether the AVX-512 path may also use VNNI's vpdpbusd / vpdpwssd (the q4_k_r8 and Q6_K rows, the GEMM).
inline bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return yes;
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
// q4_k_r8's groups multiply, read as they are rather than added up per weight row).
struct ActivationsK {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int16_t> sums, sums32;
  int64_t M = 0, K = 0;
  void resize(int64_t rows, int64_t inputs, int64_t block) {
    M = rows;
    K = inputs;
    codes.resize(M * K);
    scale.resize(M * (K / block));
    sums.resize(M * (K / 16));
    sums32.resize(M * (K / 32));
  }
};

// One weight row (its nb blocks at w) against rows m0.. m0 + M - 1 of the activations: writes
// y[m * N] for each of them.
using RowFn = void (*)(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N);

// IQ4_NL / IQ4_XS rows (iq4_linear.cpp), for 1..8 rows of x (8: any more).
RowFn pick_iq4(Isa isa, int64_t format, int rows);
// Q6_K rows on AVX-512 VNNI (kquant_q6k.cpp), for 1..8 rows of x (8: any more).
RowFn pick_q6k_vnni(int rows);
// q4_k_r8 (kquant_r8.cpp), for 1..8 rows of x: a call takes w at a group's first super-block and
// writes its 8 rows, y[m * N + r] for r < 8.
RowFn pick_q4k_r8(Isa isa, int rows);

// Rows m0..m1 of x [M, K] into a (sized for M rows already) as llama.cpp's quantize_row_q8_K_ref
// quantizes them, one scale per `block` inputs (256, or 32 for IQ4_NL), codes laid out in `order`
// (kquant_linear.cpp).
void quantize_rows_k(const float* x, int64_t m0, int64_t m1, int64_t K, int64_t block, Order order, ActivationsK& a);

// The GEMM for many rows of x (kquant_gemm.cpp): whether it takes `rows` rows of a matrix in
// `format`, and y [M, N] = x [M, K] @ W.T for W's rows (N of them, K / 256 super-blocks each) at w.
bool gemm_takes(int64_t format, int64_t rows);
void kquant_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t format, int64_t N, float* y, Isa isa);
// The fewest rows of x the GEMM takes (rows <= 0: the default); returns the count now in force.
int64_t set_gemm_min_rows(int64_t rows);

// A K-quant matrix multiplied inside a parallel region that another library opens: the decode
// library's fused layer (decode_layer.cpp) runs its linears through this, and kquant_linear's
// row-kernel path runs on it too, so a row's numbers are those of the row kernels either way.
// The matrix is up to kMaxParts row ranges stacked, each in its own format (a Q4_K_M file's q/k
// in Q4_K beside v in Q6_K): x is quantized once per layout the parts read (order, block), and the
// rows of all parts shared out together. The caller fills parts, count and K; then prepare before
// the region, and in it every thread calls quantize_share, meets the others at a barrier, and
// calls rows_share.
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
// The K-quant library's entry points for SharedLinear. The decode library is built with AVX-512
// flags and these kernels without, and torch loads each library on its own (RTLD_LOCAL), so
// neither links the other: the decode library asks the op kquant_layer_entry for this table.
struct LayerEntry {
  int64_t size;  // sizeof(SharedLinear) in the K-quant library's build, which the caller checks
  void (*prepare)(SharedLinear& s, int64_t M, int64_t threads);
  void (*quantize_share)(SharedLinear& s, const float* x, int64_t t, int64_t team);
  void (*rows_share)(SharedLinear& s, float* y, int64_t t);
};

__attribute__((target("f16c"), always_inline)) inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

__attribute__((always_inline)) inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
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

GENFN_AVX2_INLINE inline float reduce256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

}  // namespace genfn::kquant
