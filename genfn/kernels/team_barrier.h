// Where the threads of a parallel region meet between the phases of a layer (TeamBarrier): spun on
// as long as libgomp would spin at its own barriers (its settings read the way it reads them), then
// slept on. Plain C++ with no vector ISA of its own, for both kernel libraries (the decode stack
// and layers, the K-quant row kernels).
#pragma once

#include <sched.h>
#include <strings.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <thread>

namespace genfn_kernels {

// How many times a thread waiting at a barrier polls, a `pause` each, before it sleeps: libgomp's
// count, from the settings it reads once when it loads. GOMP_SPINCOUNT=N[k|M|G|T] or
// "infinite" where set; else OMP_WAIT_POLICY=ACTIVE: without end, PASSIVE: none, unset: 300 000.
// A team larger than the CPUs the process may run on polls at most libgomp's throttled count (1000
// under ACTIVE, else 100). genfn's command line sets these for the machine's load
// (genfn/wait_policy.py); a program that imports genfn sets them as for any OpenMP code.
struct SpinLimits {
  int64_t spin = 300000, throttled = 100;
};

inline SpinLimits spin_limits_from(const char* policy, const char* count) {
  constexpr int64_t kUnbounded = INT64_MAX;
  const int wait_policy = policy == nullptr ? -1 : strcasecmp(policy, "active") == 0 ? 1
                                                 : strcasecmp(policy, "passive") == 0 ? 0 : -1;
  SpinLimits limits;
  limits.spin = wait_policy > 0 ? kUnbounded : wait_policy == 0 ? 0 : 300000;
  if (count != nullptr) {
    if (strcasecmp(count, "infinite") == 0 || strcasecmp(count, "infinity") == 0) {
      limits.spin = kUnbounded;
    } else {
      char* rest = nullptr;
      const unsigned long long n = std::strtoull(count, &rest, 10);
      if (rest != count) {
        const char suffix = static_cast<char>(std::tolower(static_cast<unsigned char>(*rest)));
        const int64_t scale = suffix == 'k' ? 1000LL : suffix == 'm' ? 1000000LL : suffix == 'g' ? 1000000000LL
                            : suffix == 't' ? 1000000000000LL : 1;
        limits.spin = n > static_cast<unsigned long long>(kUnbounded / scale) ? kUnbounded
                                                                              : static_cast<int64_t>(n) * scale;
      }
    }
  }
  limits.throttled = std::min<int64_t>(wait_policy > 0 ? 1000 : wait_policy < 0 ? 100 : 0, limits.spin);
  return limits;
}

// The CPUs this process may run on, as libgomp counts them (its affinity mask, not every online CPU).
inline int64_t available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

inline int64_t spin_limit(int64_t team) {
  static const SpinLimits limits = spin_limits_from(std::getenv("OMP_WAIT_POLICY"), std::getenv("GOMP_SPINCOUNT"));
  static const int64_t cpus = available_cpus();
  return team > cpus ? limits.throttled : limits.spin;
}

// A barrier for the threads of one parallel region, each calling wait(team) with the region's
// team size. libgomp's `omp barrier` costs ~190 ns between this VM's two cores where both arrive
// together; this one ~30 (two cache lines pass between the cores, and no task scheduling is checked).
// The decode stack's threads meet 7 times a layer: 210 meetings a SmolLM2 step.
class TeamBarrier {
 public:
  void wait(int64_t team) {
    const uint32_t seen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == team - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      // seq_cst, as a sleeper's count and load below: either this load sees a thread counted
      // asleep, or that thread's next load of the generation sees this store and it does not sleep.
      generation_.store(seen + 1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();
      return;
    }
    const int64_t limit = spin_limit(team);
    for (int64_t i = 0; i < limit; ++i) {
      if (generation_.load(std::memory_order_acquire) != seen) return;
      _mm_pause();
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (generation_.load(std::memory_order_seq_cst) == seen) generation_.wait(seen, std::memory_order_seq_cst);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<int32_t> sleepers_{0};
};

}  // namespace genfn_kernels
