// Work shared out to the threads of a parallel region so that they balance it (RowQueue,
// run_balanced): plain C++ with no ISA of its own, for both kernel libraries (the decode kernels'
// linears and fused layers, the K-quant row kernels).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace genfn_kernels {

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
  // Interleaved runs (prepare_interleaved): blocks per unit, and the span of run indices each
  // thread's run may fill; 0 where each run is one contiguous part of the blocks.
  int64_t unit = 0, span = 0, blocks = 0;
  void prepare(int64_t M, int64_t N, int64_t T);  // for linear_balanced (decode_linear.cpp)
  // Any unit of work: even runs of `blocks`.
  void prepare_blocks(int64_t count, int64_t T) {
    threads = std::min<int64_t>(T, kMaxThreads);
    unit = span = 0;
    blocks = count;
    for (int64_t t = 0; t < threads; ++t) {
      const uint64_t next = count * t / threads, end = count * (t + 1) / threads;
      runs[t].bounds.store((end << 32) | next, std::memory_order_relaxed);
    }
  }
  // The blocks dealt out in units of `per_unit`, in turn: thread t's run is units t, t + T, t + 2T...
  // in order, so that the threads' streams advance side by side through the weight, a unit or
  // two apart, where even runs put them half a weight apart. Run t holds run indices
  // [t * span, t * span + its blocks); block_of maps them back.
  void prepare_interleaved(int64_t count, int64_t per_unit, int64_t T) {
    threads = std::min<int64_t>(T, kMaxThreads);
    unit = std::max<int64_t>(1, per_unit);
    blocks = count;
    const int64_t units = (count + unit - 1) / unit;
    span = (units + threads - 1) / threads * unit;
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t owned_units = t < units ? (units - t + threads - 1) / threads : 0;
      // The last unit may be short: it is its owner's last.
      const int64_t short_by = units > 0 && (units - 1) % threads == t ? units * unit - count : 0;
      const uint64_t next = t * span, end = next + owned_units * unit - short_by;
      runs[t].bounds.store((end << 32) | next, std::memory_order_relaxed);
    }
  }
  // The block at run index i.
  int64_t block_of(int64_t i) const {
    if (unit == 0) return i;
    const int64_t run = i / span, offset = i % span;
    return ((offset / unit) * threads + run) * unit + offset % unit;
  }
  // Run indices [begin, end) as blocks: fn(first, last, stream_start, stream_stop) for each piece
  // that is contiguous in blocks, with the contiguous stream it lies in (the owner's run, or the
  // unit where runs are interleaved).
  template <typename Fn>
  void for_each_piece(int64_t begin, int64_t end, int64_t start, int64_t stop, Fn&& fn) const {
    if (unit == 0) return fn(begin, end, start, stop);
    while (begin < end) {
      const int64_t piece_end = std::min(end, (begin / unit + 1) * unit);
      const int64_t first = block_of(begin), unit_start = first - first % unit;
      fn(first, first + (piece_end - begin), unit_start, std::min(blocks, unit_start + unit));
      begin = piece_end;
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
// from the back of the other threads' runs. own(begin, end, start, stop) sums blocks [begin, end)
// of its own stream [start, stop) (the own run, or its unit where runs are interleaved: a stream
// it may fetch ahead in up to stop); stolen(begin, end) blocks taken from another's (past end
// lies that thread's stream).
template <typename Own, typename Stolen>
void run_balanced(RowQueue& queue, int64_t t, int64_t chunk, Own&& own, Stolen&& stolen) {
  const int64_t T = queue.threads;
  if (t >= T) return;
  const uint64_t first = queue.runs[t].bounds.load(std::memory_order_relaxed);
  const int64_t start = static_cast<int64_t>(first & 0xffffffffu), stop = static_cast<int64_t>(first >> 32);
  int64_t begin, end;
  while (claim_front(queue.runs[t].bounds, chunk, begin, end)) queue.for_each_piece(begin, end, start, stop, own);
  for (int64_t step = 1; step < T; ++step) {
    auto& other = queue.runs[(t + step) % T].bounds;
    while (claim_back(other, chunk, begin, end))
      queue.for_each_piece(begin, end, begin, end, [&](int64_t first, int64_t last, int64_t, int64_t) { stolen(first, last); });
  }
}

}  // namespace genfn_kernels
