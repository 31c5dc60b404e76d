// Work shared out to the threads of a parallel region so that they balance it (RowQueue,
// run_balanced), the rows of x split into groups (group_size), and whether a thread's stream is
// fetched ahead at one row of x (fetch_ahead_at_one_row): plain C++ with no ISA of its own, for
// both kernel libraries (the decode kernels' linears and fused layers, the K-quant row kernels).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace genfn_kernels {

// The most rows of x the decode kernels take (genfn.kernels.MAX_DECODE_ROWS); more is a GEMM.
constexpr int64_t kMaxDecodeRows = 8;

// The rows of each group when M rows of x run in groups of at most kMaxDecodeRows: as even as they
// split (11 rows as 6 and 5, not 8 and 3, whose 3-row tile has too few accumulators to hide the
// multiply-add latency). A row's sums do not depend on its group.
inline int64_t group_size(int64_t M) {
  const int64_t groups = (M + kMaxDecodeRows - 1) / kMaxDecodeRows;
  return (M + groups - 1) / groups;
}

// Whether a product with one row of x fetches its thread's weight stream ahead into L2 (16 KiB, as
// products of more rows do in the decode library): on Intel cores, whose prefetchers alone left a
// one-row stream 10-20 % short of the read rate; not on AMD's, where the window cost a one-row
// step 7-30 % (decode_linear.cpp, quant_linear.cpp, kquant_linear.cpp). A kernel whose reads the
// prefetchers follow badly on AMD's cores too fetches there all the same (kquant_rows.h).
inline bool fetch_ahead_at_one_row() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// How far ahead of the bytes being summed a thread's stream is fetched, where it is fetched into L2.
constexpr int64_t kStreamWindow = 16384;

// The rows of one product shared out to T threads that balance their work: each thread owns an
// even contiguous run of row blocks and streams it from the front in small chunks; one that
// finishes takes chunks from the back of another's run. On two cores the two halves of a
// weight do not stream equally fast (perf: each thread waited ~10 % of a static split's time at
// the barrier after each linear).
struct RowQueue {
  static constexpr int kMaxThreads = 64;
  // (end << 32) | next, in row blocks; a cache line each, or every claim would pull the line
  // from the other core.
  struct alignas(64) Run {
    std::atomic<uint64_t> bounds;
  };
  Run runs[kMaxThreads];
  int64_t threads = 0;
  // For linear_balanced (decode_linear.cpp), whose blocks differ for bfloat16 weights.
  void prepare(int64_t M, int64_t N, int64_t T, bool bf16);
  // Any unit of work: even runs of `blocks`.
  void prepare_blocks(int64_t blocks, int64_t T) {
    threads = std::min<int64_t>(T, kMaxThreads);
    for (int64_t t = 0; t < threads; ++t) {
      const uint64_t next = blocks * t / threads, end = blocks * (t + 1) / threads;
      runs[t].bounds.store((end << 32) | next, std::memory_order_relaxed);
    }
  }
};

// Claim up to `chunk` blocks from the front (own run) or the back (another's) of a run: [begin, end).
inline bool claim_front(std::atomic<uint64_t>& run, int64_t chunk, int64_t& begin, int64_t& end) {
  uint64_t seen = run.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t next = static_cast<int64_t>(seen & 0xffffffffu), last = static_cast<int64_t>(seen >> 32);
    if (next >= last) return false;
    begin = next;
    end = std::min(last, next + chunk);
    if (run.compare_exchange_weak(seen, (static_cast<uint64_t>(last) << 32) | static_cast<uint64_t>(end),
                                  std::memory_order_relaxed))
      return true;
  }
}

inline bool claim_back(std::atomic<uint64_t>& run, int64_t chunk, int64_t& begin, int64_t& end) {
  uint64_t seen = run.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t next = static_cast<int64_t>(seen & 0xffffffffu), last = static_cast<int64_t>(seen >> 32);
    if (next >= last) return false;
    begin = std::max(next, last - chunk);
    end = last;
    if (run.compare_exchange_weak(seen, (static_cast<uint64_t>(begin) << 32) | static_cast<uint64_t>(next),
                                  std::memory_order_relaxed))
      return true;
  }
}

// Thread t's share of queue's work: its own run front to back, `chunk` blocks a claim, then chunks
// from the back of the other threads' runs. own(begin, end, start, stop) sums a chunk [begin, end)
// of the own run [start, stop) (a stream it may fetch ahead in up to stop); stolen(begin, end) one
// taken from another's (past end lies that thread's stream).
template <typename Own, typename Stolen>
void run_balanced(RowQueue& queue, int64_t t, int64_t chunk, Own&& own, Stolen&& stolen) {
  const int64_t T = queue.threads;
  if (t >= T) return;
  const uint64_t first = queue.runs[t].bounds.load(std::memory_order_relaxed);
  const int64_t start = static_cast<int64_t>(first & 0xffffffffu), stop = static_cast<int64_t>(first >> 32);
  int64_t begin, end;
  while (claim_front(queue.runs[t].bounds, chunk, begin, end)) own(begin, end, start, stop);
  for (int64_t step = 1; step < T; ++step) {
    auto& other = queue.runs[(t + step) % T].bounds;
    while (claim_back(other, chunk, begin, end)) stolen(begin, end);
  }
}

}  // namespace genfn_kernels
