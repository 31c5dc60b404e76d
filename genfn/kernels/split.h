// How a decode kernel shares the units of one weight (row blocks, tiles) among the threads.
//
// A static split waits for the last thread: between two linears of a decode step OpenMP's worker
// often sleeps (genfn's bounded spin), and its wake-up, tens of microseconds on these machines,
// is added to every call. Here the threads pair up: in each pair one takes units from the front of
// its segment upwards and the other from the back downwards, each claiming a guided share
// (an eighth of what is left, at least `min_chunk`) of one counter. The calling thread starts at
// once; a late worker takes only what is left when it arrives. Each thread's units stay one
// contiguous stream, and the two streams meet wherever the work ran out.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace genfn_split {

// body(begin, end, from_back, first): units [begin, end), walked downwards when from_back;
// `first` on a side's first claim (its stream starts there, nothing fetched it ahead).
template <typename Body>
void from_both_ends(int64_t n, int64_t min_chunk, const Body& body) {
  if (n <= 0) return;
  const int threads = std::max(1, at::get_num_threads());
  const int64_t pairs = std::max<int64_t>(1, std::min<int64_t>((threads + 1) / 2, n));
  // One counter per segment, each on its own cache line.
  struct alignas(64) Counter { std::atomic<int64_t> claimed{0}; };
  std::unique_ptr<Counter[]> counters(new Counter[pairs]);
  at::parallel_for(0, 2 * pairs, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t segment = i / 2;
      const bool from_back = i % 2 == 1;
      const int64_t lo = n * segment / pairs, hi = n * (segment + 1) / pairs, size = hi - lo;
      std::atomic<int64_t>& claimed = counters[segment].claimed;
      int64_t taken = 0;  // by this side, from its end
      for (;;) {
        int64_t start = claimed.load(std::memory_order_relaxed), take;
        do {
          if (start >= size) break;
          take = std::min(size - start, std::max(min_chunk, (size - start) / 8));
        } while (!claimed.compare_exchange_weak(start, start + take, std::memory_order_relaxed));
        if (start >= size) break;
        if (from_back) body(hi - taken - take, hi - taken, true, taken == 0);
        else body(lo + taken, lo + taken + take, false, taken == 0);
        taken += take;
      }
    }
  });
}

}  // namespace genfn_split
