// A GGUF file's Q4_0 / Q4_1 / Q8_0 blocks written into QuantizedWeight's tiles (genfn/quant/weight.py)
// in one pass, on all of torch's threads: the GGUF loader's repack (genfn/models/loaders/gguf_blocks.py).
//
// numpy's version of this (QuantizedWeight.fill_from_blocks) copies each field out of the
// records, then gathers it into the tile order: two passes over the matrix on one thread, and the
// second one also takes the first-write faults of the destination's fresh pages. That was most of
// a 1B model's load (7.3 of 10.9 s for a Q4_0 file). Here each thread takes whole tiles, reads the
// 16 source rows of a tile block by block and writes the tile's bytes in order, so the faults of
// the file mapping and of the destination are spread over the threads too.
//
// Tile layout, per tile of 16 output rows and block b of 32 inputs:
//   codes [tile, b, c * 64 + r * 4 + j] = code byte 4c + j of row r's block b (8-bit codes ^ 0x80)
//   scales[tile, b, r] = the block's float16 scale; mins[tile, b, r] = its float16 minimum (Q4_1)
// Rows of the last tile past out_features are written as zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

// kind: QuantizedWeight.kind (KERNEL_KIND): 0 = Q4_0, 1 = Q4_1, 2 = Q8_0.
struct BlockLayout {
  int64_t bytes;       // one block's record in the file
  int64_t code_bytes;  // its codes
  int64_t head;        // bytes before the codes: the scale, and the minimum for Q4_1
};

BlockLayout layout_of(int64_t kind) {
  TORCH_CHECK(kind >= 0 && kind <= 2, "gguf_blocks_to_tiles: kind must be 0 (q4_0), 1 (q4_1) or 2 (q8_0); got ", kind);
  if (kind == 0) return {18, 16, 2};
  if (kind == 1) return {20, 16, 4};
  return {34, 32, 2};
}

void gguf_blocks_to_tiles(const at::Tensor& blocks, const std::optional<at::Tensor>& rows, at::Tensor codes,
                          at::Tensor scales, const std::optional<at::Tensor>& mins, int64_t kind,
                          int64_t out_features) {
  const BlockLayout lay = layout_of(kind);
  constexpr int64_t kTile = 16;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.stride(1) == 1,
              "gguf_blocks_to_tiles: blocks must be uint8 [rows, row bytes] with contiguous rows");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous(),
              "gguf_blocks_to_tiles: codes must be contiguous uint8 [tiles, blocks, width]");
  const int64_t tiles = codes.size(0), nblocks = codes.size(1);
  TORCH_CHECK(codes.size(2) == lay.code_bytes * kTile, "gguf_blocks_to_tiles: codes' width must be ",
              lay.code_bytes * kTile, " for kind ", kind);
  TORCH_CHECK(blocks.size(1) == nblocks * lay.bytes, "gguf_blocks_to_tiles: a row of blocks must be ",
              nblocks * lay.bytes, " bytes; got ", blocks.size(1));
  TORCH_CHECK(out_features > 0 && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "gguf_blocks_to_tiles: out_features ", out_features, " does not fill ", tiles, " tiles");
  auto check_half = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == tiles &&
                    t.size(1) == nblocks && t.size(2) == kTile,
                "gguf_blocks_to_tiles: ", name, " must be contiguous float16 [tiles, blocks, 16]");
  };
  check_half(scales, "scales");
  TORCH_CHECK(mins.has_value() == (kind == 1), "gguf_blocks_to_tiles: mins are given for q4_1 and only for it");
  if (mins) check_half(*mins, "mins");
  const int64_t* order = nullptr;
  at::Tensor order_tensor;
  if (rows) {
    order_tensor = rows->contiguous();
    TORCH_CHECK(order_tensor.scalar_type() == at::kLong && order_tensor.dim() == 1 &&
                    order_tensor.size(0) == out_features,
                "gguf_blocks_to_tiles: rows must be int64 [out_features]");
    order = order_tensor.data_ptr<int64_t>();
    for (int64_t i = 0; i < out_features; ++i)
      TORCH_CHECK(order[i] >= 0 && order[i] < blocks.size(0), "gguf_blocks_to_tiles: row ", order[i],
                  " is outside the ", blocks.size(0), " rows of blocks");
  } else {
    TORCH_CHECK(blocks.size(0) == out_features, "gguf_blocks_to_tiles: ", blocks.size(0), " rows of blocks for ",
                out_features, " output rows");
  }

  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const int64_t row_stride = blocks.stride(0);
  uint8_t* code_out = codes.data_ptr<uint8_t>();
  uint16_t* scale_out = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  uint16_t* min_out = mins ? reinterpret_cast<uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  const int64_t width = lay.code_bytes * kTile, chunks = lay.code_bytes / 4;
  const uint32_t flip = kind == 2 ? 0x80808080u : 0u;  // 8-bit codes are stored offset by 128

  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    const uint8_t* row_start[kTile];
    for (int64_t tile = first; tile < last; ++tile) {
      const int64_t live = std::min(kTile, out_features - tile * kTile);
      for (int64_t r = 0; r < live; ++r) {
        const int64_t row = tile * kTile + r;
        row_start[r] = src + (order ? order[row] : row) * row_stride;
      }
      for (int64_t b = 0; b < nblocks; ++b) {
        const int64_t at = tile * nblocks + b;
        uint8_t* code_tile = code_out + at * width;
        uint16_t* scale_tile = scale_out + at * kTile;
        for (int64_t r = 0; r < kTile; ++r) {
          if (r >= live) {
            for (int64_t c = 0; c < chunks; ++c) std::memset(code_tile + c * 64 + r * 4, 0, 4);
            scale_tile[r] = 0;
            if (min_out) min_out[at * kTile + r] = 0;
            continue;
          }
          const uint8_t* record = row_start[r] + b * lay.bytes;
          std::memcpy(scale_tile + r, record, 2);
          if (min_out) std::memcpy(min_out + at * kTile + r, record + 2, 2);
          const uint8_t* code_in = record + lay.head;
          for (int64_t c = 0; c < chunks; ++c) {
            uint32_t word;
            std::memcpy(&word, code_in + c * 4, 4);
            word ^= flip;
            std::memcpy(code_tile + c * 64 + r * 4, &word, 4);
          }
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("gguf_blocks_to_tiles(Tensor blocks, Tensor? rows, Tensor(a!) codes, Tensor(b!) scales, Tensor(c!)? mins, "
        "int kind, int out_features) -> ()");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) { m.impl("gguf_blocks_to_tiles", &gguf_blocks_to_tiles); }
