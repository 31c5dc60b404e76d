// A plain read of a model's layer matrices in one parallel region, for benchmarks/stream_split.py:
// each thread adds up its share of every matrix (its tiles' codes and their side data, as a
// kernel's thread reads them) with AVX-512 integer adds, and the threads meet after each matrix, as
// a step's linears do. No arithmetic beyond the adds, no per-call overhead of an op per matrix:
// what streaming these bytes in this order costs any reader.
#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <vector>

namespace {

__attribute__((target("avx512f"))) __m512i add_bytes(const uint8_t* p, int64_t n, __m512i acc) {
  __m512i a1 = _mm512_setzero_si512(), a2 = _mm512_setzero_si512(), a3 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 256 <= n; i += 256) {  // four independent chains: the loads, not the adds, bound it
    acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi32(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_loadu_si512(p + i + 192));
  }
  for (; i + 64 <= n; i += 64) acc = _mm512_add_epi32(acc, _mm512_loadu_si512(p + i));
  return _mm512_add_epi32(_mm512_add_epi32(acc, a1), _mm512_add_epi32(a2, a3));
}

}  // namespace

// matrices[i] is one matrix's tensors, each split along its first dimension: thread t reads its
// share [rows * t / T, rows * (t + 1) / T) of each, the tensors side by side (with each tile of the
// first, the rows of the others up to the same fraction of theirs).
__attribute__((target("avx512f"))) int64_t read_matrices(const std::vector<std::vector<torch::Tensor>>& matrices,
                                                         int64_t threads) {
  std::vector<int64_t> sums(threads, 0);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    __m512i acc = _mm512_setzero_si512();
    for (const auto& tensors : matrices) {
      const int64_t tiles = tensors[0].size(0);
      std::vector<int64_t> done(tensors.size());
      for (size_t i = 0; i < tensors.size(); ++i) done[i] = tensors[i].size(0) * t / T;
      for (int64_t tile = tiles * t / T; tile < tiles * (t + 1) / T; ++tile)
        for (size_t i = 0; i < tensors.size(); ++i) {
          const int64_t rows = tensors[i].size(0), row_bytes = tensors[i].numel() * tensors[i].element_size() / rows;
          const int64_t until = rows * (tile + 1) / tiles;
          acc = add_bytes(static_cast<const uint8_t*>(tensors[i].data_ptr()) + done[i] * row_bytes,
                          (until - done[i]) * row_bytes, acc);
          done[i] = until;
        }
#pragma omp barrier
    }
    sums[t] = _mm512_reduce_add_epi32(acc);
  }
  int64_t total = 0;
  for (int64_t s : sums) total += s;
  return total;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("read_matrices", &read_matrices); }
