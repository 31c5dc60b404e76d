// How a batch-1 bfloat16 GEMV's way of walking its weight bounds the bytes it streams a second,
// apart from genfn's kernels: an AVX-512 read loop (4 independent integer adds, the read ceiling)
// against one weight row of x at a time with 1, 2 or 4 float32 accumulators (vdpbf16ps), 2 or 4
// rows at once, software prefetch into L2 ahead of the stream, and the threads' share of a matrix
// as even halves (genfn's runs) or as 16/64-row chunks taken in turn from one counter (llama.cpp's
// ggml_compute_forward_mul_mat at batch 1). ~400 MB of matrices, walked one after another with a
// barrier between (as a step's linears are); variants interleaved in a shuffled order each round.
// On a shared machine each round first waits (up to 100 s) until the cores were idle for 300 ms.
//
//   g++ -O2 -march=native -std=c++17 -pthread benchmarks/bf16_stream_patterns.cpp -o /tmp/bf16_stream
//   /tmp/bf16_stream K ROWS HUGE THREADS ROUNDS     # e.g. 2048 3072 1 2 9: the 1B qkv shape, huge pages
//
// Results of the session that wrote it: benchmarks/results/bf16-decode-2026-12-03.log.
#include <immintrin.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
#include <functional>
#include <random>
#include <sys/mman.h>
#include <pthread.h>

using u16 = uint16_t;
#include <unistd.h>
static void cpu_times(long long& idle, long long& total) {
  FILE* f = fopen("/proc/stat", "r"); long long v[10] = {0};
  fscanf(f, "cpu %lld %lld %lld %lld %lld %lld %lld %lld", v, v + 1, v + 2, v + 3, v + 4, v + 5, v + 6, v + 7);
  fclose(f); idle = v[3] + v[4]; total = 0; for (int i = 0; i < 8; ++i) total += v[i];
}
// wait until the other processes leave both cores idle for 300 ms
static double wait_quiet(double need, int max_s) {
  double frac = 0;
  for (int i = 0; i < max_s * 3; ++i) {
    long long i0, t0, i1, t1; cpu_times(i0, t0); usleep(300000); cpu_times(i1, t1);
    frac = double(i1 - i0) / double(std::max(1ll, t1 - t0));
    if (frac >= need) return frac;
  }
  return frac;
}
static int K = 2048;
static int64_t N;  // total rows in buffer
static u16* W;
static u16* X;
static float* Y;

template <int ACC, int R, int PF>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void rows(int64_t n0, int64_t n1, int64_t stop) {
  for (int64_t n = n0; n < n1; n += R) {
    __m512 acc[ACC * R];
    for (int i = 0; i < ACC * R; ++i) acc[i] = _mm512_setzero_ps();
    const u16* w = W + n * K;
    for (int k = 0; k < K; k += 32 * ACC) {
      if (PF) for (int r = 0; r < R; ++r) for (int a = 0; a < ACC; ++a) {
        const char* p = (const char*)(w + r * K + k + 32 * a) + PF;
        if (p < (const char*)(W + stop * K)) _mm_prefetch(p, _MM_HINT_T1);
      }
      for (int a = 0; a < ACC; ++a) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512(X + k + 32 * a);
        for (int r = 0; r < R; ++r)
          acc[r * ACC + a] = _mm512_dpbf16_ps(acc[r * ACC + a], (__m512bh)_mm512_loadu_si512(w + r * K + k + 32 * a), xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512 s = acc[r * ACC];
      for (int a = 1; a < ACC; ++a) s = _mm512_add_ps(s, acc[r * ACC + a]);
      Y[n + r] = _mm512_reduce_add_ps(s);
    }
  }
}

__attribute__((target("avx512f"))) void readsum(int64_t n0, int64_t n1, int64_t) {
  const __m512i* p = (const __m512i*)(W + n0 * K);
  const __m512i* e = (const __m512i*)(W + n1 * K);
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; p < e; p += 4) {
    a0 = _mm512_add_epi32(a0, _mm512_load_si512(p));
    a1 = _mm512_add_epi32(a1, _mm512_load_si512(p + 1));
    a2 = _mm512_add_epi32(a2, _mm512_load_si512(p + 2));
    a3 = _mm512_add_epi32(a3, _mm512_load_si512(p + 3));
  }
  Y[n0] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
}

using Fn = void (*)(int64_t, int64_t, int64_t);
static std::atomic<int64_t> counter;
static int64_t mat_rows;  // rows per matrix
// split: 0 = halves per matrix, 1 = interleaved chunks of `chunk` rows via counter
struct Job { Fn fn; int split; int64_t chunk; };

static Job job;
static int T = 2;
static int64_t mats;
// A spinning barrier between matrices, as between a step's linears.
static void bar(int& phase) {
  static std::atomic<int> cnt{0}, ph{0};
  int p = ph.load();
  if (cnt.fetch_add(1) == T - 1) { cnt = 0; ph.fetch_add(1); } else while (ph.load() == p) _mm_pause();
}
static std::atomic<int64_t> counters[4096];

void work(int t) {
  int phase = 0;
  for (int64_t m = 0; m < mats; ++m) {
    const int64_t base = m * mat_rows;
    if (job.split == 0) {
      int64_t a = base + mat_rows * t / T, b = base + mat_rows * (t + 1) / T;
      job.fn(a, b, b);
    } else {
      const int64_t chunks = mat_rows / job.chunk;
      for (int64_t c = counters[m].fetch_add(1); c < chunks; c = counters[m].fetch_add(1))
        job.fn(base + c * job.chunk, base + (c + 1) * job.chunk, base + mat_rows);
    }
    bar(phase);
  }
}

int main(int argc, char** argv) {
  K = argc > 1 ? atoi(argv[1]) : 2048;
  mat_rows = argc > 2 ? atoll(argv[2]) : 3072;
  int64_t total_bytes = 400ll << 20;
  mats = std::max<int64_t>(2, total_bytes / (mat_rows * K * 2));
  N = mats * mat_rows;
  size_t bytes = N * K * 2;
  W = (u16*)aligned_alloc(2 << 20, (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  bool huge = argc > 3 && atoi(argv[3]);
  madvise(W, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  for (size_t i = 0; i < bytes / 2; ++i) W[i] = 0x3c00 + (i & 7);
  X = (u16*)aligned_alloc(64, K * 2 * 4); for (int i = 0; i < K; ++i) X[i] = 0x3f80;
  Y = (float*)aligned_alloc(64, N * 4 + 64);
  struct V { const char* name; Job j; };
  std::vector<V> vs = {
    {"readsum halves", {readsum, 0, 0}},
    {"readsum chunk64", {readsum, 1, 64}},
    {"acc1 R1 halves (genfn)", {rows<1, 1, 0>, 0, 0}},
    {"acc2 R1 halves", {rows<2, 1, 0>, 0, 0}},
    {"acc4 R1 halves", {rows<4, 1, 0>, 0, 0}},
    {"acc1 R2 halves", {rows<1, 2, 0>, 0, 0}},
    {"acc1 R4 halves", {rows<1, 4, 0>, 0, 0}},
    {"acc1 R1 pf4k halves", {rows<1, 1, 4096>, 0, 0}},
    {"acc1 R1 pf16k halves", {rows<1, 1, 16384>, 0, 0}},
    {"acc2 R1 pf16k halves", {rows<2, 1, 16384>, 0, 0}},
    {"acc1 R1 chunk16", {rows<1, 1, 0>, 1, 16}},
    {"acc1 R1 chunk64", {rows<1, 1, 0>, 1, 64}},
    {"acc2 R1 chunk64 (llama.cpp)", {rows<2, 1, 0>, 1, 64}},
  };





  T = argc > 4 ? atoi(argv[4]) : 2;
  int reps = argc > 5 ? atoi(argv[5]) : 9;
  std::vector<std::vector<double>> times(vs.size());
  std::vector<size_t> order(vs.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937 shuffler(1);
  for (int rep = 0; rep < reps; ++rep) {
    std::shuffle(order.begin(), order.end(), shuffler);
    double q = wait_quiet(0.85, 100);
    fprintf(stderr, "rep %d idle %.2f\n", rep, q);
    for (size_t v : order) {
      job = vs[v].j;
      for (int64_t m = 0; m < mats; ++m) counters[m] = 0;
      auto s = std::chrono::steady_clock::now();
      std::vector<std::thread> th;
      for (int t = 1; t < T; ++t) th.emplace_back(work, t);
      work(0);
      for (auto& x : th) x.join();
      times[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
    }}
  double base = 0;
  for (size_t v = 0; v < vs.size(); ++v) {
    double best = *std::min_element(times[v].begin(), times[v].end());
    std::sort(times[v].begin(), times[v].end());
    double med = times[v][times[v].size() / 2];
    if (v == 0) base = best;
    printf("K %d rows %ld huge %d T %d  %-24s best %5.1f GB/s  median %5.1f GB/s  vs readsum %.2f\n", K, (long)mat_rows, huge, T, vs[v].name,
           bytes / best / 1e9, bytes / med / 1e9, base / best);
  }
}
