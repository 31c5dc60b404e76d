// y = x @ w.T for a few rows of x: the linear layers of a decode step.
//
// At decode time x has one row per sequence and every weight byte is read once per step, so the
// step is bound by how fast the weights stream from memory. BLAS GEMV and inductor's GEMM kernels
// stream a [N, K] weight with K ~ 600 at well under the machine's read bandwidth; this kernel walks
// R weight rows at once, each as one sequential stream, dotting every row with all M rows of x
// (held in L1) so the weights are read exactly once whatever M is. bfloat16 products are summed
// in float32 and rounded once, as oneDNN does: through vdpbf16ps where the CPU has AVX512_BF16,
// else by widening the weights to float32 in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int kLanes = 16;

inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_lanes(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 widen(__m256i halves) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
inline __m512 load_lanes(const c10::BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load_lanes(const c10::BFloat16* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }

// Rows [n, n + R) of w against the M rows of x (float32, [M, K]); results to y[m * N + n + r].
template <typename T, int M, int R>
inline void row_block(const float* x, const T* w, int64_t K, int64_t N, int64_t n, T* y) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const T* rows = w + n * K;
  int64_t k = 0;
  // The next block's R rows are contiguous: fetch them while this block is summed, a share per
  // step. Without it each core keeps too few misses in flight (~12 GB/s per core in float32,
  // ~7 in bfloat16, where one 32-byte load covers half a line).
  const char* next = reinterpret_cast<const char*>(rows + R * K);
  constexpr int kLinesPerStep = (R * kLanes * sizeof(T) + 63) / 64;
  for (; k + kLanes <= K; k += kLanes) {
    for (int j = 0; j < kLinesPerStep; ++j)
        _mm_prefetch(next + (k * R * sizeof(T)) + 64 * j, _MM_HINT_T0);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_lanes(rows + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = load_lanes(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_lanes(rows + r * K + k, tail);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = load_lanes(x + m * K + k, tail);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) store(y + m * N + n + r, _mm512_reduce_add_ps(acc[m][r]));
}

template <typename T, int M>
void rows_of_x(const float* x, const T* w, int64_t K, int64_t N, T* y) {
  // Enough independent accumulators to hide FMA latency, within the 32 vector registers.
  constexpr int R = M <= 4 ? 4 : (M <= 6 ? 3 : 2);
  const int64_t blocks = N / R;
  // Each thread takes a contiguous run of row blocks; a block is R * K weights (~9 KiB).
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) row_block<T, M, R>(x, w, K, N, b * R, y);
  });
  for (int64_t n = blocks * R; n < N; ++n) row_block<T, M, 1>(x, w, K, N, n, y);
}

template <typename T>
void dispatch_rows(int64_t M, const float* x, const T* w, int64_t K, int64_t N, T* y) {
  switch (M) {
    case 1: return rows_of_x<T, 1>(x, w, K, N, y);
    case 2: return rows_of_x<T, 2>(x, w, K, N, y);
    case 3: return rows_of_x<T, 3>(x, w, K, N, y);
    case 4: return rows_of_x<T, 4>(x, w, K, N, y);
    case 5: return rows_of_x<T, 5>(x, w, K, N, y);
    case 6: return rows_of_x<T, 6>(x, w, K, N, y);
    case 7: return rows_of_x<T, 7>(x, w, K, N, y);
    default: return rows_of_x<T, 8>(x, w, K, N, y);
  }
}

// bfloat16 with AVX512_BF16: `vdpbf16ps` multiplies 32 weights by 32 activations (both
// bfloat16; the activation is bfloat16 already, so nothing is rounded on the way in) and adds
// the products pairwise into 16 float32 lanes: the widening kernel's float32 products and
// float32 sums, in half the instructions and from full 64-byte loads. That is what lets it
// take 8 rows of x where widening FMAs fell behind the memory from 5 rows on.
template <int M, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void bf16_row_block(
    const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N, int64_t n, c10::BFloat16* y) {
  constexpr int kPairs = 2 * kLanes;  // bfloat16 values per register
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const c10::BFloat16* rows = w + n * K;
  const char* next = reinterpret_cast<const char*>(rows + R * K);
  int64_t k = 0;
  for (; k + kPairs <= K; k += kPairs) {
    for (int j = 0; j < R; ++j) _mm_prefetch(next + k * R * 2 + 64 * j, _MM_HINT_T0);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(rows + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  if (k < K) {
    const __mmask32 tail = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, rows + r * K + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[m * N + n + r] = c10::BFloat16(_mm512_reduce_add_ps(acc[m][r]));
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void bf16_rows_of_x(
    const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N, c10::BFloat16* y) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 3 : 2);
  const int64_t blocks = N / R;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) bf16_row_block<M, R>(x, w, K, N, b * R, y);
  });
  for (int64_t n = blocks * R; n < N; ++n) bf16_row_block<M, 1>(x, w, K, N, n, y);
}

void bf16_dispatch_rows(int64_t M, const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t N,
                        c10::BFloat16* y) {
  switch (M) {
    case 1: return bf16_rows_of_x<1>(x, w, K, N, y);
    case 2: return bf16_rows_of_x<2>(x, w, K, N, y);
    case 3: return bf16_rows_of_x<3>(x, w, K, N, y);
    case 4: return bf16_rows_of_x<4>(x, w, K, N, y);
    case 5: return bf16_rows_of_x<5>(x, w, K, N, y);
    case 6: return bf16_rows_of_x<6>(x, w, K, N, y);
    case 7: return bf16_rows_of_x<7>(x, w, K, N, y);
    default: return bf16_rows_of_x<8>(x, w, K, N, y);
  }
}

bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

at::Tensor decode_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "decode_linear: weight must be 2-D, got ", weight.dim(), "-D");
  TORCH_CHECK(x.size(-1) == weight.size(1), "decode_linear: x has ", x.size(-1),
              " features, weight expects ", weight.size(1));
  const int64_t K = weight.size(1);
  const int64_t N = weight.size(0);
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  const auto dtype = weight.scalar_type();
  const bool supported = (dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype &&
                         M >= 1 && M <= kMaxRows && x.device().is_cpu() && weight.device().is_cpu();
  if (!supported) return at::linear(x, weight);
  const at::Tensor w = weight.contiguous();
  const at::Tensor rows = x.contiguous();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, weight.options());
  if (dtype == at::kFloat) {
    dispatch_rows<float>(M, rows.data_ptr<float>(), w.data_ptr<float>(), K, N, y.data_ptr<float>());
  } else if (has_avx512_bf16()) {
    bf16_dispatch_rows(M, rows.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), K, N,
                       y.data_ptr<c10::BFloat16>());
  } else {
    // x is a few KiB: widen it once here rather than in every row block.
    thread_local std::vector<float> widened;
    widened.resize(M * K);
    const c10::BFloat16* src = rows.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) widened[i] = static_cast<float>(src[i]);
    dispatch_rows<c10::BFloat16>(M, widened.data(), w.data_ptr<c10::BFloat16>(), K, N,
                                 y.data_ptr<c10::BFloat16>());
  }
  return y.view(out_sizes);
}

}  // namespace

TORCH_LIBRARY(genfn_kernels, m) { m.def("decode_linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) { m.impl("decode_linear", &decode_linear); }
