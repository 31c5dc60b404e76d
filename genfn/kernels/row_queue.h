// Work shared out to the threads of a parallel region so that they balance it (RowQueue,
// run_balanced), the rows of x split into groups (group_size), and how far ahead, into which
// cache, a thread's weight stream is fetched (StreamWindow, one_row_window): plain C++ with no
// vector ISA of its own, for both kernel libraries (the decode kernels' linears and fused layers,
// the K-quant row kernels).
#pragma once

#include <cpuid.h>
#include <xmmintrin.h>

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

// Whether each thread of a team quantizes all M rows of x for itself instead of a share of them: where
// its share would be about as many rows (of one row, one thread's share is the row and the others'
// nothing), so the barrier that shares need costs more than the rows it saves. SmolLM2 Q4_1's
// one-row stack, alternated in one process: 0.92x the time without the four barriers a layer.
inline bool quantize_alone(int64_t M, int64_t team) { return M <= (M + team - 1) / team + 1; }

// How far ahead of the bytes being summed a thread's stream is fetched into L2 (products of 2-8 rows
// of x on every CPU, one row on Intel's).
constexpr int64_t kStreamWindow = 16384;
// How far ahead a one-row stream is fetched into L1 on AMD's cores (one_row_window).
constexpr int64_t kL1StreamWindow = 8192;

// One line of a stream fetched into L1 (`prefetcht0`) or L2 (`prefetcht1`).
inline void fetch_line(const void* p, bool into_l1) {
  if (into_l1) _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  else _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}

// A thread's weight stream fetched `bytes` ahead of what it sums (0: left to the hardware
// prefetchers), into L1 or L2.
struct StreamWindow {
  int64_t bytes = 0;
  bool into_l1 = false;
  void fetch(const void* p) const { fetch_line(p, into_l1); }
};

// The window of a float32 or bfloat16 product with 2-8 rows of x, on every CPU (kStreamWindow into
// L2; decode_linear.cpp). Quantized products take few_quantized_rows_window.
constexpr StreamWindow kFewRowsWindow{kStreamWindow, false};

// Whether this CPU is Intel's: the stream windows below differ between its cores and AMD's.
inline bool intel_cores() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

// Whether this CPU's family is 0x1A or later (AMD's Zen 5): its cores and Zen 4's (family 0x19) want
// different windows for the same streams.
inline bool zen5_or_later() {
  static const bool later = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xf;
    return (base == 0xf ? base + ((eax >> 20) & 0xff) : base) >= 0x1a;
  }();
  return later;
}

// What a thread's weight stream holds: the window that streams it fastest depends on the kernel that
// reads it as much as on the core.
enum class StreamKind {
  kFloatRows,      // float32 / bfloat16 rows (decode_linear.cpp)
  kTiles,          // 4-bit tiles (Q4_0, Q4_1, int4, Q5_0, Q5_1; quant_linear.cpp)
  kEightBitTiles,  // Q8_0 / int8 tiles
  kBlockRows,      // K-quant and IQ4 rows, plain or interleaved (kquant_rows.h)
};

// The window of a product with one row of x. On Intel cores 16 KiB into L2 for every stream, whose
// prefetchers alone left a one-row stream 10-20 % short of the read rate (session 15's Xeon). The
// 8-bit tiles keep the prefetchers alone on AMD's: fetched, they read 0.93-0.97x as fast (Zen 5) and
// 0.91-0.92x (Zen 4, 1B Q8_0 step, session 36). On Zen 5, 8 KiB into L1 for the rest: there, once the
// memory is fast, the prefetchers alone leave a one-row kernel's stream well short of a plain read of
// the same bytes (one thread: Q4_0 tiles 82-87 % of it, 94 % fetched; 1B shapes' layer matrices, 2
// threads, in stretches where `tensor.sum` read 80-90 GB/s: Q4_0 tiles 63-67 -> 76-77 GB/s, Q4_K_M's
// 62-68 -> 72-76, Q5_K_M's 70-71 -> 72-74, bfloat16 66-71 -> 75-76; in slow stretches the same within
// a few per cent). Into L2 it did not pay there (Q4_K_M 0.99-1.01x), nor 4 KiB ahead into L1 (Q4_0
// tiles 1.00-1.07x, against 1.09-1.17x at 8 KiB). Zen 4 (session 36, a 1B step of each format in one
// process, the windows alternated call by call; benchmarks/results/stream-windows-2026-12-06-s36-zen4.log):
// the K-quant rows stream fastest 16 KiB into L2 (Q4_K_M 0.83-0.84x the time of 8 KiB into L1, which
// gains nothing over the prefetchers alone there; SmolLM2's Q4_K_M 0.91x), the float rows with the
// prefetchers alone (bfloat16 0.86-0.95x; into L2 0.98x), the 4-bit tiles about alike every way
// (into L2 0.97-0.99x, 4 KiB into L1 0.96-0.97x), so they keep Zen 5's.
inline StreamWindow one_row_window(StreamKind kind) {
  if (intel_cores()) return {kStreamWindow, false};
  if (kind == StreamKind::kEightBitTiles) return {};
  if (zen5_or_later() || kind == StreamKind::kTiles) return {kL1StreamWindow, true};
  if (kind == StreamKind::kBlockRows) return {kStreamWindow, false};
  return {};
}

// The window of a quantized product with 2-8 rows of x (the tiles kernels' 2-3 rows, the K-quant and
// IQ4 rows' 2-8; the tiles take a window of their own from four rows, quant_linear.cpp). On Intel
// cores kFewRowsWindow. On Zen 5, 8 KiB into L1 as one row fetches, where 16 KiB into L2 left these
// products short of their stream too (session 30, one stack call alternated between the windows in
// one process: SmolLM2 Q4_1 2-3 rows 0.94-0.96x the time, 1B Q4_0 0.98x, 1B Q4_K_M and Q5_K_M 0.94x at
// 2 rows, Q4_K_M 0.96-0.97x at 8, IQ4_XS 0.98x). The 8-bit tiles too: at one row the prefetchers alone
// stream them fastest, at 2-3 the window does (1B Q8_0 0.81-0.84x). On Zen 4 the K-quant rows 16 KiB
// into L2 here too (SmolLM2 Q4_K_M's 4-row round 0.93x the time), the tiles 8 KiB into L1 (the
// prefetchers alone 1.06x, into L2 1.00x at 3 rows). float32 and bfloat16 rows (decode_linear.cpp)
// were not measured this way and keep kFewRowsWindow.
inline StreamWindow few_quantized_rows_window(StreamKind kind) {
  if (intel_cores()) return kFewRowsWindow;
  if (!zen5_or_later() && kind == StreamKind::kBlockRows) return {kStreamWindow, false};
  return {kL1StreamWindow, true};
}

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

// How many chunks an owner claims from its own run at once (at most; see claim_front). A claim is a
// locked compare-and-swap, which orders the core's memory accesses around it: claimed a chunk (~8 KiB
// of weight) at a time, `perf` put ~16 % of SmolLM2 Q4_K_M's one-row stack samples on that instruction
// (~2 % claimed this way). The stack took 0.83-0.87x the time where the memory read 80-90 GB/s, the same
// where it read ~55 (the stream bounds it there); the 1B Q4_0 stack, with 16 KiB chunks, 0.99x.
constexpr int64_t kOwnChunks = 16;

// Claim blocks from the front of a thread's own run: half of what is left of it in whole chunks (the
// other half stays for the threads that finish first), at least one chunk and at most kOwnChunks.
// [begin, end).
inline bool claim_front(std::atomic<uint64_t>& run, int64_t chunk, int64_t& begin, int64_t& end) {
  uint64_t seen = run.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t next = static_cast<int64_t>(seen & 0xffffffffu), last = static_cast<int64_t>(seen >> 32);
    if (next >= last) return false;
    begin = next;
    end = std::min(last, next + chunk * std::clamp<int64_t>((last - next) / (2 * chunk), 1, kOwnChunks));
    if (run.compare_exchange_weak(seen, (static_cast<uint64_t>(last) << 32) | static_cast<uint64_t>(end),
                                  std::memory_order_relaxed))
      return true;
  }
}

// Claim up to `chunk` blocks from the back of another thread's run: [begin, end).
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

// Thread t's share of queue's work: its own run front to back (claim_front's claims, each summed
// `chunk` blocks at a time, so a call's L1 reuse is what a chunk a claim gave), then chunks from the back of
// the other threads' runs. own(begin, end, start, stop) sums a chunk [begin, end)
// of the own run [start, stop) (a stream it may fetch ahead in up to stop); stolen(begin, end) one
// taken from another's (past end lies that thread's stream).
template <typename Own, typename Stolen>
void run_balanced(RowQueue& queue, int64_t t, int64_t chunk, Own&& own, Stolen&& stolen) {
  const int64_t T = queue.threads;
  if (t >= T) return;
  const uint64_t first = queue.runs[t].bounds.load(std::memory_order_relaxed);
  const int64_t start = static_cast<int64_t>(first & 0xffffffffu), stop = static_cast<int64_t>(first >> 32);
  int64_t begin, end;
  while (claim_front(queue.runs[t].bounds, chunk, begin, end))
    for (int64_t b = begin; b < end; b += chunk) own(b, std::min(end, b + chunk), start, stop);
  for (int64_t step = 1; step < T; ++step) {
    auto& other = queue.runs[(t + step) % T].bounds;
    while (claim_back(other, chunk, begin, end)) stolen(begin, end);
  }
}

}  // namespace genfn_kernels
