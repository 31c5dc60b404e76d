// The decode stack's plain linears (float32 and bfloat16 weights), in both libraries: thread t's
// share of plain_rows.h's blocks, balanced through a RowQueue (row_queue.h).
#include <c10/util/BFloat16.h>

#include "decode_kernels.h"
#include "plain_rows.h"

namespace genfn_kernels {

using namespace plain_rows;

void RowQueue::prepare(int64_t M, int64_t N, int64_t T, bool bf16) {
  prepare_blocks(N / (bf16 ? rows_per_block<c10::BFloat16>(M) : rows_per_block<float>(M)), T);
}

void linear_balanced(int64_t M, const float* x, const float* w, int64_t K, int64_t N, float* y, int64_t t,
                     RowQueue& queue) {
  dispatch_balanced<Float32Fma>(M, x, w, K, N, y, t, queue);
}

void linear_balanced(int64_t M, const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N,
                     c10::BFloat16* y, int64_t t, RowQueue& queue) {
#if defined(__AVX512F__)
  if (bf16_dot_in_use()) return dispatch_balanced<Bfloat16Dot>(M, x, w, K, N, y, t, queue);
#endif
  dispatch_balanced<Bfloat16Widen>(M, widened(x, M * K), w, K, N, y, t, queue);
}

}  // namespace genfn_kernels
