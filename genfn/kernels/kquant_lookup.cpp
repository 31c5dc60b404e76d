// An embedding lookup in a K-quant table: the float32 values of a few rows of a KQuantWeight, in
// any format the library holds (Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, and the 8-row groups q4_k_r8,
// q5_k_r8, q6_k_r8, iq4_xs_r8), so a model whose token table stays in the file's format never dequantizes
// more of it than the step's tokens.
//
//   kquant_lookup(data [rows, row bytes], format, out_features, index [n]) -> float32 [n, inputs]
//
// Why native: in torch, a tied head's q6_k_r8 table took a token's whole group, put its eight rows
// back and dequantized one, two dozen small ops: ~100 us a token eagerly, ~40 compiled, against a
// few here.
//
// The values are the gguf package's bit for bit: each is its float32 operations in its order, one
// rounding per operation (genfn.quant.kquants.dequantize_k, genfn.quant.iq4.dequantize_iq4). This
// library is built for baseline x86-64 outside its per-function ISA paths (kquant.h), and baseline
// x86-64 has no FMA, so a * b - c below is never fused into one.
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstring>

#include "kquant.h"

namespace genfn::kquant {
namespace {

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// Q4_K (176-byte Q5_K when five): d, dmin, 12 bytes of six-bit scales and minimums, (Q5_K: 32 bytes
// of fifth bits,) 128 bytes of codes; group j of 32 inputs: (d * scale_j) * q - dmin * min_j.
void dequantize_q4k_q5k(const uint8_t* block, bool five, float* out) {
  const float d = half_at(block), dmin = half_at(block + 2);
  const uint8_t* packed = block + 4;
  int scale[8], minimum[8];
  for (int j = 0; j < 4; ++j) {
    scale[j] = packed[j] & 0x3F;
    minimum[j] = packed[j + 4] & 0x3F;
    scale[j + 4] = (packed[j + 8] & 0x0F) | ((packed[j] >> 6) << 4);
    minimum[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4);
  }
  const uint8_t* high = block + 16;
  const uint8_t* codes = block + (five ? 48 : 16);
  for (int j = 0; j < 8; ++j) {  // group j: the low nibbles of run j / 2 where j is even, else the high
    const float s = d * static_cast<float>(scale[j]), m = dmin * static_cast<float>(minimum[j]);
    const uint8_t* run = codes + 32 * (j / 2);
    for (int i = 0; i < 32; ++i) {
      int q = j % 2 ? run[i] >> 4 : run[i] & 0x0F;
      if (five) q |= ((high[i] >> j) & 1) << 4;
      out[32 * j + i] = s * static_cast<float>(q) - m;
    }
  }
}

// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d; input 128 h + 32 k + i is
// (d * scale) * (low | high << 4) - 32), its low nibble from byte 64 h + 32 (k % 2) + i (the high
// nibble where k >= 2), its high pair bits 2k of byte 32 h + i.
void dequantize_q6k(const uint8_t* block, float* out) {
  const float d = half_at(block + 208);
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 4; ++k)
      for (int i = 0; i < 32; ++i) {
        const int at = 128 * h + 32 * k + i;
        const uint8_t byte = block[64 * h + 32 * (k % 2) + i];
        const int low = k < 2 ? byte & 0x0F : byte >> 4, high = (block[128 + 32 * h + i] >> (2 * k)) & 3;
        out[at] = d * static_cast<float>(scales[at / 16]) * static_cast<float>((low | high << 4) - 32);
      }
}

// 16 index bytes, input j in the low nibble of byte j and input j + 16 in the high one.
void iq4_group(const uint8_t* indices, float scale, float* out) {
  for (int i = 0; i < 16; ++i) {
    out[i] = scale * static_cast<float>(kIQ4Values[indices[i] & 0x0F]);
    out[i + 16] = scale * static_cast<float>(kIQ4Values[indices[i] >> 4]);
  }
}

void dequantize_iq4_xs(const uint8_t* block, float* out) {
  const float d = half_at(block);
  uint16_t high;
  uint32_t low;
  std::memcpy(&high, block + 2, 2);
  std::memcpy(&low, block + 4, 4);
  for (int j = 0; j < 8; ++j) {
    const int scale = ((low >> (4 * j)) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
    iq4_group(block + 8 + 16 * j, d * static_cast<float>(scale - 32), out + 32 * j);
  }
}

void dequantize_block(int64_t format, const uint8_t* block, float* out) {
  switch (format) {
    case kQ4K: return dequantize_q4k_q5k(block, false, out);
    case kQ5K: return dequantize_q4k_q5k(block, true, out);
    case kQ6K: return dequantize_q6k(block, out);
    case kIQ4NL: return iq4_group(block + 2, half_at(block), out);
    default: return dequantize_iq4_xs(block, out);
  }
}

// Row r of an interleaved table: each super-block put back as stored (r8_load), then dequantized.
template <int64_t F>
void interleaved_row(const uint8_t* data, int64_t row, int64_t nb, float* out) {
  const int64_t row_bytes = nb * block_bytes(F);
  const uint8_t* group = data + row / kR8Rows * kR8Rows * row_bytes;
  alignas(64) uint8_t block[256];
  for (int64_t b = 0; b < nb; ++b) {
    r8_load<F>(group + b * group_block_bytes(F), static_cast<int>(row % kR8Rows), block);
    dequantize_block(stored_format(F), block, out + b * kSuper);
  }
}

at::Tensor kquant_lookup(const at::Tensor& data, int64_t format, int64_t out_features, const at::Tensor& index) {
  TORCH_CHECK(format >= 0 && format <= kLastFormat, "kquant_lookup: format must be 0..", kLastFormat, ", got ", format);
  const int64_t block = block_bytes(format), inputs = block_inputs(format);
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous() && data.size(1) % block == 0,
              "kquant_lookup: data must be contiguous uint8 [rows, blocks * ", block, "]");
  TORCH_CHECK(data.size(0) == out_features && (!interleaved(format) || out_features % kR8Rows == 0),
              "kquant_lookup: data has ", data.size(0), " rows for ", out_features, " out_features");
  TORCH_CHECK(index.dim() == 1 && !at::isFloatingType(index.scalar_type()) && index.scalar_type() != at::kBool,
              "kquant_lookup: index must be a 1-D integer tensor");
  const at::Tensor rows = index.to(at::kLong).contiguous();
  const int64_t n = rows.size(0), nb = data.size(1) / block;
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK_INDEX(row[t] >= 0 && row[t] < out_features, "kquant_lookup: index ", row[t], " is out of range for ",
                      out_features, " rows");
  at::Tensor out = at::empty({n, nb * inputs}, data.options().dtype(at::kFloat));
  const uint8_t* d = data.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    float* values = o + t * nb * inputs;
    if (format == kQ4KR8) interleaved_row<kQ4KR8>(d, row[t], nb, values);
    else if (format == kQ5KR8) interleaved_row<kQ5KR8>(d, row[t], nb, values);
    else if (format == kQ6KR8) interleaved_row<kQ6KR8>(d, row[t], nb, values);
    else if (format == kIQ4XSR8) interleaved_row<kIQ4XSR8>(d, row[t], nb, values);
    else
      for (int64_t b = 0; b < nb; ++b) dequantize_block(format, d + (row[t] * nb + b) * block, values + b * inputs);
  }
  return out;
}

}  // namespace
}  // namespace genfn::kquant

TORCH_LIBRARY_FRAGMENT(genfn_kquant, m) {
  m.def("kquant_lookup(Tensor data, int format, int out_features, Tensor index) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kquant, CPU, m) { m.impl("kquant_lookup", &genfn::kquant::kquant_lookup); }
