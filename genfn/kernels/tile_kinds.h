// The block formats of genfn/quant/weight.py's "tiles16" layout (QuantizedWeight.kind), as every
// kernel that reads those tiles (quant_linear.cpp, quant_gemm.cpp, moe_decode.cpp, the fused layers,
// gguf_tiles.cpp) understands them, and the one place a tile's block is unpacked into the unsigned
// codes `vpdpbusd` multiplies.
//
// Per tile of 16 output rows and block of 32 inputs, chunk c is 64 bytes: four bytes of each row.
//   Q8_0 (kind 2): 8 chunks, byte 4c + i of row r the code of input 4c + i, stored + 128.
//   Q4_0, Q4_1 (0, 1): 4 chunks of GGUF's nibble bytes: chunk c holds inputs 4c..4c+3 in the low
//     nibbles and 16+4c..16+4c+3 in the high ones.
//   Q5_0, Q5_1 (3, 4): first one chunk of each row's 32 fifth bits (GGUF's `qh` word, bit j that of
//     input j), then the 4 nibble chunks of Q4: the file's record after its scales, word for word.
//     Kept so, a Q5 matrix takes the file's 5.5 or 6 bits a weight, where the Q8_0 tiles it was
//     widened to until session 32 took 8.5.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace genfn_kernels {
// Inline: genfn_kernels::kQ4 as well, and `using namespace genfn_kernels::tile_kinds` takes only these.
inline namespace tile_kinds {

enum TileKind : int64_t { kQ4 = 0, kQ4Min = 1, kQ8 = 2, kQ5 = 3, kQ5Min = 4 };

inline constexpr const char* kTileKindNames = "0 (q4_0), 1 (q4_1), 2 (q8_0), 3 (q5_0) or 4 (q5_1)";

constexpr bool valid_tile_kind(int64_t kind) { return kind >= kQ4 && kind <= kQ5Min; }
// Whether a block has a float16 minimum beside its scale (w = d u + m).
constexpr bool has_minimum(int64_t kind) { return kind == kQ4Min || kind == kQ5Min; }
constexpr bool has_fifth_bits(int64_t kind) { return kind == kQ5 || kind == kQ5Min; }
// What a stored code is offset by (w = d (u - offset)): the kernels subtract offset * sum(x codes).
constexpr int32_t code_offset(int64_t kind) {
  return kind == kQ4 ? 8 : kind == kQ5 ? 16 : kind == kQ8 ? 128 : 0;
}
// Bytes of codes per block of a tile (16 rows x 32 inputs).
constexpr int64_t tile_block_bytes(int64_t kind) {
  return kind == kQ8 ? 512 : has_fifth_bits(kind) ? 320 : 256;
}

// Chunk j (0..3) of a 4- or 5-bit block of a tile: the unsigned codes of inputs 4j..4j+3 (`low`)
// and 16+4j..16+4j+3 (`high`) of the 16 rows, four bytes a row. `block` points at the block's codes.
template <int64_t kind>
inline void unpack_nibble_chunk(const uint8_t* block, int j, __m512i& low, __m512i& high) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  constexpr int64_t kNibbles = has_fifth_bits(kind) ? 64 : 0;
  const __m512i packed = _mm512_loadu_si512(block + kNibbles + 64 * j);
  low = _mm512_and_si512(packed, low_nibbles);
  high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
  if constexpr (has_fifth_bits(kind)) {
    // Input k's fifth bit is bit k % 8 of byte k / 8 of its row's word: the chunk's four inputs of
    // a row share a byte (j / 2, or 2 + j / 2 for the high nibbles), broadcast to the row's four
    // bytes, where byte i tests bit 4 (j % 2) + i. Each set bit adds 16 to its code.
    const __m512i words = _mm512_loadu_si512(block);
    // Byte 4q + i of each 128-bit lane takes byte 4q + p of the lane's word q (its row's).
    const __m512i row_byte = _mm512_broadcast_i32x4(_mm_setr_epi32(0x00000000, 0x04040404, 0x08080808, 0x0C0C0C0C));
    const __m512i low_pick = _mm512_add_epi8(row_byte, _mm512_set1_epi8(static_cast<char>(j / 2)));
    const __m512i high_pick = _mm512_add_epi8(row_byte, _mm512_set1_epi8(static_cast<char>(2 + j / 2)));
    const __m512i bit = _mm512_set1_epi32(j % 2 ? static_cast<int>(0x80402010) : 0x08040201);
    const __m512i sixteen = _mm512_set1_epi8(16);
    low = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(_mm512_shuffle_epi8(words, low_pick), bit), low, sixteen);
    high = _mm512_mask_add_epi8(high, _mm512_test_epi8_mask(_mm512_shuffle_epi8(words, high_pick), bit), high,
                                sixteen);
  }
}

// Input k's unsigned code in row r of a tile's block (`block` its codes), one at a time: the scalar
// kernels' read of what the chunks above hold.
inline int32_t tile_code(const uint8_t* block, int64_t kind, int64_t r, int64_t k) {
  if (kind == kQ8) return block[(k / 4) * 64 + r * 4 + k % 4];
  const int64_t nibbles = has_fifth_bits(kind) ? 64 : 0, j = k % 16;
  const uint8_t byte = block[nibbles + (j / 4) * 64 + r * 4 + j % 4];
  int32_t u = k < 16 ? byte & 0x0F : byte >> 4;
  if (has_fifth_bits(kind)) u |= ((block[r * 4 + k / 8] >> (k % 8)) & 1) << 4;
  return u;
}

}  // namespace tile_kinds

// Rows of x quantized to 8 bits per block of 32 inputs, as every tiles kernel reads them (VNNI's,
// quant_linear.cpp; AVX2's, tiles_avx2.h): codes, block scales, block code sums and scale * sum.
// resize() before the parallel region that fills it.
struct QuantActivations {
  std::vector<int8_t> codes;      // [M, K]
  std::vector<float> scale;       // [M, K / 32]
  std::vector<int32_t> sum;       // [M, K / 32]
  std::vector<float> scaled_sum;  // [M, K / 32]
  void resize(int64_t M, int64_t K) {
    codes.resize(M * K);
    scale.resize(M * (K / 32));
    sum.resize(M * (K / 32));
    scaled_sum.resize(M * (K / 32));
  }
};

}  // namespace genfn_kernels
