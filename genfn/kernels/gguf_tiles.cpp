// A GGUF file's Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 blocks written into QuantizedWeight's tiles (genfn/quant/weight.py)
// in one pass: the GGUF loader's repack (genfn/models/loaders/gguf_blocks.py). And the same blocks
// dequantized to float32 rows in one pass (gguf_dequantize_rows), the float load's path; and rows
// of the tiles dequantized the same way (tiles_lookup), an embedding lookup in a tied head's blocks.
//
// numpy's version of this (QuantizedWeight.fill_from_blocks) copies each field out of the
// records, then gathers it into the tile order: two passes over the matrix. Here a tile's 16
// source rows are read block by block and the tile's bytes written in order, each 32-bit gather
// taking one word of each row's record: a whole chunk of the tile, or the 16 rows' scales.
//
// Built into both decode libraries: the AVX2 build writes a tile word by word and dequantizes through
// lanes16.h, the same bytes and values.
//
// Both fills run on torch's threads, which share the tiles or rows out as the decode kernels do (each_claimed).
//
// Tile layout, per tile of 16 output rows and block b of 32 inputs:
//   codes [tile, b, c * 64 + r * 4 + j] = code byte 4c + j of row r's block b (8-bit codes ^ 0x80;
//         a Q5 block's codes are its record's fifth bits, then its nibbles: tile_kinds.h)
//   scales[tile, b, r] = the block's float16 scale; mins[tile, b, r] = its float16 minimum (Q4_1, Q5_1)
// Rows of the last tile past out_features are written as zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "lanes16.h"
#include "row_queue.h"
#include "tile_kinds.h"

namespace {

using namespace genfn_kernels::tile_kinds;

// kind: QuantizedWeight.kind (KERNEL_KIND, tile_kinds.h).
struct BlockLayout {
  int64_t bytes;       // one block's record in the file
  int64_t code_bytes;  // its codes
  int64_t head;        // bytes before the codes: the scale, and the minimum for Q4_1
};

BlockLayout layout_of(const char* op, int64_t kind) {
  TORCH_CHECK(genfn_kernels::valid_tile_kind(kind), op, ": kind must be ", genfn_kernels::kTileKindNames, "; got ",
              kind);
  switch (kind) {
    case kQ4: return {18, 16, 2};
    case kQ4Min: return {20, 16, 4};
    case kQ5: return {22, 20, 2};
    case kQ5Min: return {24, 20, 4};
    default: return {34, 32, 2};
  }
}

constexpr int64_t kTile = 16;

// A QuantizedWeight's tiles (codes [tiles, blocks, width], float16 scales and, for Q4_1, minimums
// [tiles, blocks, 16]) as `op` takes them, holding `out_features` rows.
void check_tiles(const char* op, const BlockLayout& lay, int64_t kind, const at::Tensor& codes,
                 const at::Tensor& scales, const std::optional<at::Tensor>& mins, int64_t out_features) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(), op,
              ": codes must be contiguous uint8 [tiles, blocks, width]");
  const int64_t tiles = codes.size(0), nblocks = codes.size(1);
  TORCH_CHECK(codes.size(2) == lay.code_bytes * kTile, op, ": codes' width must be ", lay.code_bytes * kTile,
              " for kind ", kind);
  TORCH_CHECK(out_features > 0 && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile, op,
              ": out_features ", out_features, " does not fill ", tiles, " tiles");
  auto check_half = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == tiles &&
                    t.size(1) == nblocks && t.size(2) == kTile,
                op, ": ", name, " must be contiguous float16 [tiles, blocks, 16]");
  };
  check_half(scales, "scales");
  TORCH_CHECK(mins.has_value() == has_minimum(kind), op, ": mins are given for q4_1 and q5_1 and only for them");
  if (mins) check_half(*mins, "mins");
}

// The rows of blocks to read, in order, checked against the `available` rows; nullptr (rows 0..n-1)
// where none are given. `holder` keeps a contiguous copy of `rows` alive.
const int64_t* checked_rows(const char* op, const std::optional<at::Tensor>& rows, at::Tensor& holder, int64_t n,
                            int64_t available) {
  if (!rows) {
    TORCH_CHECK(available == n, op, ": ", available, " rows of blocks for ", n, " output rows");
    return nullptr;
  }
  holder = rows->contiguous();
  TORCH_CHECK(holder.scalar_type() == at::kLong && holder.dim() == 1 && holder.size(0) == n, op,
              ": rows must be int64 [", n, "]");
  const int64_t* order = holder.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(order[i] >= 0 && order[i] < available, op, ": row ", order[i], " is outside the ", available,
                " rows of blocks");
  return order;
}

// A tile of 16 rows, block by block: each 32-bit gather takes one word of each row's record, which
// is a whole chunk of the tile (16 rows' four code bytes) or the rows' scales (with the minimums
// above them for Q4_1).
void partial_tile(const uint8_t* src, const int64_t* row_offset, int64_t live, const BlockLayout& lay,
                  int64_t nblocks, uint32_t flip, uint8_t* code_tile, uint16_t* scale_tile, uint16_t* min_tile);

void full_tile(const uint8_t* src, const int64_t* row_offset, const BlockLayout& lay, int64_t nblocks, uint32_t flip,
               uint8_t* code_tile, uint16_t* scale_tile, uint16_t* min_tile) {
#if !defined(__AVX512F__)  // the AVX2 build: word by word, as the last tile's rows (the same bytes)
  return partial_tile(src, row_offset, kTile, lay, nblocks, flip, code_tile, scale_tile, min_tile);
#else
  const __m512i low = _mm512_loadu_si512(row_offset), high = _mm512_loadu_si512(row_offset + 8);
  const __m512i flip_words = _mm512_set1_epi32(static_cast<int>(flip));
  const int64_t width = lay.code_bytes * kTile, chunks = lay.code_bytes / 4;
  auto gather = [&](const uint8_t* base) {
    const __m256i a = _mm512_i64gather_epi32(low, base, 1), b = _mm512_i64gather_epi32(high, base, 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  };
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* block = src + b * lay.bytes;
    const __m512i head = gather(block);  // d in the low half of each lane, m (Q4_1) in the high half
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(scale_tile + b * kTile), _mm512_cvtepi32_epi16(head));
    if (min_tile)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(min_tile + b * kTile),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_si512(code_tile + b * width + c * 64,
                          _mm512_xor_si512(gather(block + lay.head + 4 * c), flip_words));
  }
#endif
}

// The last tile of a matrix whose rows do not fill it: the missing rows written as zeros.
void partial_tile(const uint8_t* src, const int64_t* row_offset, int64_t live, const BlockLayout& lay,
                  int64_t nblocks, uint32_t flip, uint8_t* code_tile, uint16_t* scale_tile, uint16_t* min_tile) {
  const int64_t width = lay.code_bytes * kTile, chunks = lay.code_bytes / 4;
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int64_t r = 0; r < kTile; ++r) {
      uint16_t scale = 0, minimum = 0;
      const uint8_t* record = r < live ? src + row_offset[r] + b * lay.bytes : nullptr;
      if (record) {
        std::memcpy(&scale, record, 2);
        std::memcpy(&minimum, record + 2, 2);
      }
      scale_tile[b * kTile + r] = scale;
      if (min_tile) min_tile[b * kTile + r] = minimum;
      for (int64_t c = 0; c < chunks; ++c) {
        uint32_t word = 0;
        if (record) {
          std::memcpy(&word, record + lay.head + 4 * c, 4);
          word ^= flip;
        }
        std::memcpy(code_tile + b * width + c * 64 + r * 4, &word, 4);
      }
    }
  }
}

// fill(i) for every i in [0, count) on torch's threads, balanced by the decode kernels' queue
// (row_queue.h's run_balanced, ~64 KiB of output a chunk): a thread the OS deschedules (a busy
// machine) holds the others up by its unfinished claim at most, and the rest of its run is taken
// from the back, where an even split left it half the work (session 8, on the shared 2-core VM at
// load average 21: 3.3-4.3 s on two threads against 1.07-1.15 s on one, each of a 1B model's 112
// matrices waiting for a descheduled thread).
template <typename Fill>
void each_claimed(int64_t count, int64_t item_bytes, const Fill& fill) {
  const int64_t chunk = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, item_bytes));
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (count + chunk - 1) / chunk);
  genfn_kernels::RowQueue queue;
  queue.prepare_blocks(count, threads);
  auto span = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fill(i);
  };
  at::parallel_for(0, queue.threads, 1, [&](int64_t t, int64_t) {
    genfn_kernels::run_balanced(queue, t, chunk, [&](int64_t begin, int64_t end, int64_t, int64_t) { span(begin, end); },
                                span);
  });
}

void gguf_blocks_to_tiles(const at::Tensor& blocks, const std::optional<at::Tensor>& rows, at::Tensor codes,
                          at::Tensor scales, const std::optional<at::Tensor>& mins, int64_t kind,
                          int64_t out_features) {
  const BlockLayout lay = layout_of("gguf_blocks_to_tiles", kind);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1,
              "gguf_blocks_to_tiles: blocks must be uint8 [rows, row bytes] with contiguous rows");
  check_tiles("gguf_blocks_to_tiles", lay, kind, codes, scales, mins, out_features);
  const int64_t tiles = codes.size(0), nblocks = codes.size(1);
  TORCH_CHECK(blocks.size(1) == nblocks * lay.bytes, "gguf_blocks_to_tiles: a row of blocks must be ",
              nblocks * lay.bytes, " bytes; got ", blocks.size(1));
  at::Tensor order_tensor;
  const int64_t* order = checked_rows("gguf_blocks_to_tiles", rows, order_tensor, out_features, blocks.size(0));

  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t row_stride = blocks.stride(0);
  uint8_t* code_out = codes.data_ptr<uint8_t>();
  uint16_t* scale_out = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* min_out = mins ? reinterpret_cast<uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  const int64_t width = lay.code_bytes * kTile;
  const uint32_t flip = kind == kQ8 ? 0x80808080u : 0u;  // 8-bit codes are stored offset by 128

  auto fill = [&](int64_t tile) {
    const int64_t live = std::min(kTile, out_features - tile * kTile);
    int64_t row_offset[kTile];
    for (int64_t r = 0; r < live; ++r) {
      const int64_t row = tile * kTile + r;
      row_offset[r] = (order ? order[row] : row) * row_stride;
    }
    uint8_t* code_tile = code_out + tile * nblocks * width;
    uint16_t* scale_tile = scale_out + tile * nblocks * kTile;
    uint16_t* min_tile = min_out ? min_out + tile * nblocks * kTile : nullptr;
    if (live == kTile) {
      full_tile(src, row_offset, lay, nblocks, flip, code_tile, scale_tile, min_tile);
    } else {
      partial_tile(src, row_offset, live, lay, nblocks, flip, code_tile, scale_tile, min_tile);
    }
  };
  each_claimed(tiles, nblocks * (width + 4 * kTile), fill);
}

// A block record's head: its float16 scale and minimum (Q4_1, Q5_1), its fifth bits (Q5) and where its
// codes start.
struct RecordHead {
  uint16_t scale = 0, minimum = 0;
  uint32_t high_bits = 0;
  bool with_min = false, fifth = false;
  const uint8_t* codes = nullptr;
};

inline RecordHead record_head(const uint8_t* record, int64_t kind) {
  RecordHead h;
  std::memcpy(&h.scale, record, 2);
  h.with_min = has_minimum(kind);
  h.fifth = genfn_kernels::has_fifth_bits(kind);
  if (h.with_min) std::memcpy(&h.minimum, record + 2, 2);
  const uint8_t* after_head = record + (h.with_min ? 4 : 2);
  if (h.fifth) std::memcpy(&h.high_bits, after_head, 4);
  h.codes = after_head + (h.fifth ? 4 : 0);
  return h;
}

// One block's 32 values, as the gguf package's numpy dequantization computes them (one rounding per
// operation, never fused: d * q for Q8_0, and for Q4_0 and Q5_0 with q = u - 8 or u - 16; (d * u) + m
// for Q4_1 and Q5_1). The _round_ intrinsics are compiler builtins, which -ffp-contract never merges
// into an FMA.
inline void dequantize_block(const uint8_t* record, int64_t kind, float* out) {
  const RecordHead h = record_head(record, kind);
#if !defined(__AVX512F__)
  // The AVX2 build: the codes as float32 values (exact) a block at a time, then the same products and
  // sums in 16 lanes (this library contracts nothing).
  using namespace genfn_kernels::simd;
  const F16 d = set1(c10::detail::fp16_ieee_to_fp32_value(h.scale));
  alignas(32) float values[32];
  if (kind == kQ8) {
    for (int i = 0; i < 32; ++i) values[i] = static_cast<float>(static_cast<int8_t>(h.codes[i]));
    for (int half = 0; half < 2; ++half) storeu(out + 16 * half, mul(loadu(values + 16 * half), d));
    return;
  }
  const int offset = h.with_min ? 0 : static_cast<int>(genfn_kernels::code_offset(kind));
  // Low nibbles are values 0..15, high nibbles 16..31; input k's fifth bit is bit k.
  const auto fifth_of = [&](int k) { return h.fifth ? static_cast<int>(h.high_bits >> k & 1) * 16 : 0; };
  for (int i = 0; i < 16; ++i) {
    values[i] = static_cast<float>((h.codes[i] & 0x0F) + fifth_of(i) - offset);
    values[16 + i] = static_cast<float>((h.codes[i] >> 4) + fifth_of(16 + i) - offset);
  }
  const F16 m = set1(c10::detail::fp16_ieee_to_fp32_value(h.minimum));
  for (int half = 0; half < 2; ++half) {
    const F16 scaled = mul(d, loadu(values + 16 * half));
    storeu(out + 16 * half, h.with_min ? add(scaled, m) : scaled);
  }
#else
  constexpr int kRound = _MM_FROUND_CUR_DIRECTION;
  const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(h.scale)));
  if (kind == kQ8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(h.codes);
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * half));
      const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
      _mm512_storeu_ps(out + 16 * half, _mm512_mul_round_ps(values, d, kRound));
    }
    return;
  }
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h.codes));
  const __m512i wide = _mm512_cvtepu8_epi32(packed);
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  __m512i codes[2] = {_mm512_and_si512(wide, nibble), _mm512_and_si512(_mm512_srli_epi32(wide, 4), nibble)};
  if (h.fifth)  // input k's fifth bit is bit k of the word: values 0..15, then 16..31
    for (int half = 0; half < 2; ++half)
      codes[half] = _mm512_mask_add_epi32(codes[half], static_cast<__mmask16>(h.high_bits >> (16 * half)),
                                          codes[half], _mm512_set1_epi32(16));
  const __m512 m = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(h.minimum)));
  for (int half = 0; half < 2; ++half) {  // low nibbles are values 0..15, high nibbles 16..31
    if (!h.with_min) {
      const __m512i offset = _mm512_set1_epi32(genfn_kernels::code_offset(kind));
      const __m512 values = _mm512_cvtepi32_ps(_mm512_sub_epi32(codes[half], offset));
      _mm512_storeu_ps(out + 16 * half, _mm512_mul_round_ps(d, values, kRound));
    } else {
      const __m512 scaled = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(codes[half]), kRound);
      _mm512_storeu_ps(out + 16 * half, _mm512_add_round_ps(scaled, m, kRound));
    }
  }
#endif
}

// out[i] = the float32 values of blocks' row rows[i] (or row i). One thread, as the tile fill.
void gguf_dequantize_rows(const at::Tensor& blocks, const std::optional<at::Tensor>& rows, int64_t kind,
                          at::Tensor out) {
  const BlockLayout lay = layout_of("gguf_dequantize_rows", kind);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1,
              "gguf_dequantize_rows: blocks must be uint8 [rows, row bytes] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1,
              "gguf_dequantize_rows: out must be float32 [rows, cols] with contiguous rows");
  const int64_t n = out.size(0), cols = out.size(1), nblocks = cols / 32;
  TORCH_CHECK(cols % 32 == 0 && blocks.size(1) == nblocks * lay.bytes, "gguf_dequantize_rows: a row of ", cols,
              " values is ", nblocks * lay.bytes, " bytes of blocks; got ", blocks.size(1));
  at::Tensor order_tensor;
  const int64_t* order = checked_rows("gguf_dequantize_rows", rows, order_tensor, n, blocks.size(0));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  each_claimed(n, cols * static_cast<int64_t>(sizeof(float)), [&](int64_t i) {
    const uint8_t* row = src + (order ? order[i] : i) * blocks.stride(0);
    float* values = dst + i * out.stride(0);
    for (int64_t b = 0; b < nblocks; ++b) dequantize_block(row + b * lay.bytes, kind, values + 32 * b);
  });
}

// Rows `index` of a QuantizedWeight's tiles as float32 [n, blocks * 32]: an embedding lookup in a tied
// head's own blocks (genfn.kernels.embedding). Each block of a row is put back into the file's record
// and dequantized by dequantize_block, so the values are QuantizedWeight.dequantize()'s bit for bit;
// eager, the torch form of this (QuantizedWeight.lookup) was ~15 small ops, ~80 us of a SmolLM2 step.
at::Tensor tiles_lookup(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                        int64_t kind, int64_t out_features, const at::Tensor& index) {
  const BlockLayout lay = layout_of("tiles_lookup", kind);
  check_tiles("tiles_lookup", lay, kind, codes, scales, mins, out_features);
  const int64_t nblocks = codes.size(1), width = lay.code_bytes * kTile;
  TORCH_CHECK(index.scalar_type() == at::kLong, "tiles_lookup: index must be int64");
  const at::Tensor rows = index.contiguous();
  const int64_t n = rows.numel(), cols = nblocks * 32;
  at::Tensor out = at::empty({n, cols}, codes.options().dtype(at::kFloat));
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const uint8_t* code_out = codes.data_ptr<uint8_t>();
  const uint16_t* scale_out = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* min_out = mins ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  const uint32_t flip = kind == kQ8 ? 0x80808080u : 0u;  // 8-bit codes are stored offset by 128
  float* values = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = row_of[i];
    TORCH_CHECK_INDEX(row >= 0 && row < out_features, "tiles_lookup: index ", row, " is outside the ", out_features,
                " rows");
    const int64_t tile = row / kTile, r = row % kTile;
    const uint8_t* code_tile = code_out + tile * nblocks * width;
    for (int64_t b = 0; b < nblocks; ++b) {
      uint8_t record[34];
      const int64_t at = (tile * nblocks + b) * kTile + r;
      std::memcpy(record, scale_out + at, 2);
      if (min_out) std::memcpy(record + 2, min_out + at, 2);
      for (int64_t c = 0; c < lay.code_bytes / 4; ++c) {
        uint32_t word;
        std::memcpy(&word, code_tile + b * width + c * 64 + r * 4, 4);
        word ^= flip;
        std::memcpy(record + lay.head + 4 * c, &word, 4);
      }
      dequantize_block(record, kind, values + i * cols + 32 * b);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("gguf_blocks_to_tiles(Tensor blocks, Tensor? rows, Tensor(a!) codes, Tensor(b!) scales, Tensor(c!)? mins, "
        "int kind, int out_features) -> ()");
  m.def("gguf_dequantize_rows(Tensor blocks, Tensor? rows, int kind, Tensor(a!) out) -> ()");
  m.def("tiles_lookup(Tensor codes, Tensor scales, Tensor? mins, int kind, int out_features, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("gguf_blocks_to_tiles", &gguf_blocks_to_tiles);
  m.impl("gguf_dequantize_rows", &gguf_dequantize_rows);
  m.impl("tiles_lookup", &tiles_lookup);
}
