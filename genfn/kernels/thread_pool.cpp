// How genfn's OpenMP threads wait: the calling thread's worker pool let go of, the spin counts at
// which the native kernels' own barrier (team_barrier.h) stops polling and sleeps, and what a
// meeting there costs.
//
// libgomp keeps a pool of worker threads per thread that started a parallel region. Once two
// threads of a process have run torch ops, the process holds two pools, more OpenMP threads than
// this machine's two cores, and libgomp then has idle workers spin only briefly before they sleep:
// every parallel region of either thread pays a wake-up. Continuous batching is exactly that
// (the model is loaded and its weights packed on the caller's thread, the loop runs on its own):
// a 32-row bfloat16 GEMM pair took 730-850 us on the loop's thread against 490-580 us once the
// caller's pool was released (same process, interleaved). The pool comes back, at its first
// parallel region, if the thread runs torch work again.
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "team_barrier.h"

namespace {

bool release_thread_pool() { return omp_pause_resource_all(omp_pause_soft) == 0; }

// [spin, throttled] for these settings (None: unset), as TeamBarrier reads them from the environment.
std::vector<int64_t> barrier_spin_limits(const std::optional<std::string>& wait_policy,
                                         const std::optional<std::string>& spin_count) {
  const genfn_kernels::SpinLimits limits = genfn_kernels::spin_limits_from(
      wait_policy ? wait_policy->c_str() : nullptr, spin_count ? spin_count->c_str() : nullptr);
  return {limits.spin, limits.throttled};
}

// Nanoseconds a meeting of torch's intra-op threads at a TeamBarrier takes, the best of three runs
// of `meetings`: how far apart the cores they run on sit (genfn.bench.decode.thread_meeting_ns).
double barrier_meeting_ns(int64_t meetings) {
  TORCH_CHECK(meetings >= 1, "barrier_meeting_ns: meetings must be at least 1, got ", meetings);
  const int64_t threads = at::get_num_threads();
  double best = std::numeric_limits<double>::infinity();
  for (int run = 0; run < 3; ++run) {
    genfn_kernels::TeamBarrier barrier;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      const int64_t team = omp_get_num_threads();
      for (int64_t i = 0; i < meetings; ++i) barrier.wait(team);
    }
    best = std::min(best, std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count());
  }
  return best / static_cast<double>(meetings);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("release_thread_pool() -> bool", &release_thread_pool);
  m.def("barrier_spin_limits(str? wait_policy, str? spin_count) -> int[]", &barrier_spin_limits);
  m.def("barrier_meeting_ns(int meetings) -> float", &barrier_meeting_ns);
}
