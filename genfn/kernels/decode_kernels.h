// The pieces of the decode kernels that other kernels of this library call from inside their own
// parallel regions (decode_layer.cpp): no thread pool of their own, only a thread's share.
#pragma once

#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstdint>

namespace genfn_kernels {

// The most rows of x the decode kernels take (genfn.kernels.MAX_DECODE_ROWS); more is a GEMM.
constexpr int64_t kMaxDecodeRows = 8;

// Whether the bfloat16 forms can run (they need AVX512_BF16).
bool cpu_has_avx512_bf16();

// The rows of one product shared out to T threads that balance their work: each thread owns an
// even contiguous run of row blocks and streams it from the front in small chunks; one that
// finishes takes chunks from the back of another's run. On two cores the two halves of a
// weight do not stream equally fast (perf: each thread waited ~10 % of a static split's time at
// the barrier after each linear). prepare() before the parallel region, then every thread calls
// linear_balanced with it once: y[M, N] = x[M, K] @ w[N, K].T (M <= kMaxDecodeRows), summed as decode_linear
// sums it.
struct RowQueue {
  static constexpr int kMaxThreads = 64;
  // (end << 32) | next, in row blocks; a cache line each, or every claim would pull the line
  // from the other core.
  struct alignas(64) Run {
    std::atomic<uint64_t> bounds;
  };
  Run runs[kMaxThreads];
  int64_t threads = 0;
  void prepare(int64_t M, int64_t N, int64_t T);
};
void linear_balanced(int64_t M, const float* x, const float* w, int64_t K, int64_t N, float* y, int64_t t,
                     RowQueue& queue);
void linear_balanced(int64_t M, const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N,
                     c10::BFloat16* y, int64_t t, RowQueue& queue);

// One row's `groups` query heads q[groups, head_dim] that share a kv head, against that head's
// keys/values (slot s at s * slot_stride) where visible[s], s < span: dense_decode_attention's
// arithmetic and rounding, into out[groups, head_dim].
template <typename T>
void attend_group(const T* q, const T* keys, const T* values, const bool* visible, int64_t span,
                  int64_t slot_stride, int64_t groups, int64_t head_dim, float scale, T* out);

}  // namespace genfn_kernels
