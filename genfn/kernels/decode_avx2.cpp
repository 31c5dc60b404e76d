// The decode kernels' linear pieces in the library built for CPUs without AVX-512 (native.py's
// DECODE_AVX2: decode_stack.cpp, decode_attention.cpp and their tables, compiled for AVX2).
//
// A stack of tiles16 layers (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) runs its linears with tiles_avx2.h's
// kernels, which give quant_linear.cpp's VNNI bits: x quantized as there, each output's chain over
// the blocks as there. K-quant layers reach the K-quant library's own AVX2 kernels through its entry
// table, as they do from the AVX-512 library. Plain float32 and bfloat16 layers run plain_linear.cpp's
// blocks, and decode_linear.cpp's ops are built here too (bfloat16 widened, as the AVX-512 library
// sums it on a CPU without AVX512_BF16). Coded bfloat16 weights (coded_bf16.cpp, vdpbf16ps) have no AVX2 form: stack_table
// refuses them here, and genfn.kernels.decode_layer does not hand them to this library.
#include <ATen/ATen.h>

#include "decode_kernels.h"
#include "decode_layer.h"
#include "tiles_avx2.h"

namespace genfn_kernels {

namespace {

constexpr const char* kNoCoded =
    "the decode kernels built for AVX2 have no coded bfloat16 linears; coded weights need the AVX-512 library "
    "on a CPU with AVX512_BF16";

}  // namespace

bool quant_shares_run() { return true; }

void coded_linear_share(int64_t, const c10::BFloat16*, const CodedWeight&, c10::BFloat16*, int64_t, RowQueue&) {
  TORCH_CHECK(false, kNoCoded);
}
CodedWeight coded_weight_of(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const char* op) {
  TORCH_CHECK(false, op, ": ", kNoCoded);
}

void quantize_rows_share(const float* x, int64_t M, int64_t K, QuantActivations& a, int64_t t, int64_t T) {
  tiles_avx2::quantize_rows(x, M * t / T, M * (t + 1) / T, K, a);
}

// quant_linear.cpp's sharing (tiles_chunk's chunks, every group over a chunk while it is in L1), each
// tile by tiles_avx2.h's kernels.
void quant_linear_share_groups(int64_t groups, const int64_t* M, const QuantActivations* a, int64_t K,
                               const QuantWeight& w, float* const* y, int64_t t, RowQueue& queue,
                               const float* const* init, int64_t ld) {
  if (ld == 0) ld = w.out_features;
  const int64_t chunk = tiles_chunk(w, groups);
  auto tiles = [&](int64_t begin, int64_t end) {
    for (int64_t g = 0; g < groups; ++g)
      tiles_avx2::tiles_rows(begin, end, M[g], w.kind, w.blocks, w.codes, w.scales, w.mins, a[g], K, w.out_features,
                             ld, y[g], init ? init[g] : nullptr);
  };
  run_balanced(
      queue, t, chunk, [&](int64_t begin, int64_t end, int64_t, int64_t) { tiles(begin, end); },
      [&](int64_t begin, int64_t end) { tiles(begin, end); });
}

}  // namespace genfn_kernels
