// y = x @ dequantize(W).T for block-quantized W (genfn/quant/weight.py's "tiles16" layout).
//
// Each row of x is quantized once per call to 8 bits per block of 32 inputs (scale max|x|/127,
// ties to even, and the block's code sum, as llama.cpp's Q8_1). Then per tile of 16 output rows
// and per block, `vpdpbusd` multiplies the weights' unsigned codes by the activation's signed
// bytes, four inputs per lane and one output row per lane; the integer sums are exact, and each
// block adds d_w * d_x * sum in float32. Minimums (Q4_1, Q5_1) and code offsets (8 for Q4_0, 16
// for Q5_0, 128 for the 8-bit formats; tile_kinds.h) fold into the activation block sums:
//   sum_k (d u_k + m) d_x q_k = d d_x sum(u q) + m d_x sum(q),   u - c offsets by c sum(q).
// The weight is streamed once per call: 9-15 rows of x run in even groups of at most 8 over a few
// tiles at a time while those are in L1 (the fused layer's share of a linear, run by the op in a
// region of its own); from 16 rows (with VNNI) quant_gemm.cpp's GEMM takes the product, with
// these bits.
//
// Each output is one float32 chain over the blocks in order (per block: the product's fma, then
// the minimum's). `init`, when given, is where the chains start instead of zero: a tensor-parallel
// rank holding blocks [k0, k1) of every row continues from the sum the ranks before it computed
// over [0, k0), so the ranks' chained result is this kernel's on the whole row, bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <omp.h>

#include "decode_kernels.h"
#include "tile_kinds.h"

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kBlock = 32;
using namespace genfn_kernels::tile_kinds;

// scaled_sum is scale * sum: what a minimum multiplies.
using Activations = genfn_kernels::QuantActivations;

// Rows [m0, m1) of x into a, sized for them already.
__attribute__((target("avx512f,avx512bw"))) void quantize_rows(const float* x, int64_t m0, int64_t m1, int64_t K,
                                                                Activations& a) {
  const int64_t nb = K / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + m * K + b * kBlock;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.0f;
      const float inverse = amax > 0.0f ? 1.0f / d : 0.0f;
      const __m512 s = _mm512_set1_ps(inverse);
      const __m512 lim = _mm512_set1_ps(127.0f);
      const __m512 r0 = _mm512_min_ps(_mm512_max_ps(
          _mm512_roundscale_ps(_mm512_mul_ps(v0, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), -lim), lim);
      const __m512 r1 = _mm512_min_ps(_mm512_max_ps(
          _mm512_roundscale_ps(_mm512_mul_ps(v1, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), -lim), lim);
      const __m512i q0 = _mm512_cvtps_epi32(r0), q1 = _mm512_cvtps_epi32(r1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.codes.data() + m * K + b * kBlock), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(a.codes.data() + m * K + b * kBlock + 16),
                       _mm512_cvtsepi32_epi8(q1));
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      a.scale[m * nb + b] = d;
      a.sum[m * nb + b] = total;
      a.scaled_sum[m * nb + b] = d * static_cast<float>(total);
    }
  }
}

void quantize_activations(const float* x, int64_t M, int64_t K, Activations& a) {
  a.resize(M, K);
  quantize_rows(x, 0, M, K, a);
}

// How far ahead of the block being summed its thread's stream is fetched. The tiles a thread
// takes are contiguous, so this runs on into its next tile. Two blocks (0.5-1 KiB) left each
// core short of misses in flight (~12 GB/s a core). With one to three rows of x the kernel waits
// on memory, and 4 KiB into L1 was capped by the core's L1 miss buffers: it fetches 16 KiB
// ahead into L2 (`prefetcht1`, which Zen 4 keeps out of L1): one 180 MB q8_0 weight, 2 threads,
// 1 row 28.9 GB/s against 32.4 (sum() 30.5). From four rows on it is bound by its arithmetic,
// and there loads that wait on L2 cost more than the miss buffers: q4_1 8 rows, SmolLM2's step,
// 10.6 GB/s through L2 against 11.7 at 4 KiB into L1, which it keeps.
// One row of x: genfn_kernels::one_row_window (on AMD cores 8 KiB into L1, the 8-bit tiles left
// to the hardware prefetchers, which streamed them fastest: Zen 4, Q8_0 batch 1 7.19 against 8.20
// ms a token with 16 KiB fetched into L2; on Intel cores 16 KiB into L2). Two or three rows:
// genfn_kernels::few_quantized_rows_window.
// From four rows on, 4 KiB is too short a lead for a weight that comes from memory (a step's
// layers, the LM head): the stream is also fetched 32 KiB ahead into L2, so the 4 KiB into L1
// finds it there. SmolLM2's 49152 x 576 Q8_0 head, one thread, 11 rows: 2.0-2.3 against 3.0-3.8
// ms; in cache the extra prefetches cost 0-3.5 %.
template <int M>
genfn_kernels::StreamWindow stream_window(int64_t kind) {
  if constexpr (M == 1)
    return genfn_kernels::one_row_window(kind == kQ8 ? genfn_kernels::StreamKind::kEightBitTiles
                                                     : genfn_kernels::StreamKind::kTiles);
  if constexpr (M < 4) return genfn_kernels::few_quantized_rows_window(genfn_kernels::StreamKind::kTiles);
  return {4096, true};
}
template <int M>
constexpr int64_t far_prefetch_bytes() { return M < 4 ? 0 : 32768; }

// Tiles [t0, t1) against M rows of quantized x; y is [M, N] float32, rows `ld` apart (as are
// init's), N where y is the whole output, wider where it is one part of a stacked linear's. The stream is fetched ahead
// up to tile `fetch_end` (past it lies another thread's share), its first window only if `first`.
template <int M, int64_t kind>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void run_tiles(
    int64_t t0, int64_t t1, int64_t fetch_end, bool first, int64_t nb, const uint8_t* codes, const uint16_t* scales,
    const uint16_t* mins, const Activations& a, int64_t K, int64_t N, int64_t ld, float* y, const float* init) {
  constexpr int64_t kBlockBytes = tile_block_bytes(kind);
  constexpr int kChunks = kBlockBytes / 64;
  constexpr int32_t kOffset = code_offset(kind);
  constexpr bool kMin = has_minimum(kind);
  // The scales (and minimums) stream beside the codes: 32 bytes a block against 256 or 512.
  const genfn_kernels::StreamWindow window = stream_window<M>(kind);
  const int64_t kPrefetchBytes = window.bytes, kScalePrefetchBytes = kPrefetchBytes / 8;
  constexpr int64_t kFarBytes = far_prefetch_bytes<M>(), kFarScaleBytes = kFarBytes / 8;
  const uint8_t* codes_end = codes + fetch_end * nb * kBlockBytes;
  if (kPrefetchBytes > 0 && first) {  // The first window of the stream: nothing fetched it ahead.
    const int64_t length = (t1 - t0) * nb * kBlockBytes;
    const char* start = reinterpret_cast<const char*>(codes + t0 * nb * kBlockBytes);
    const char* scale_start = reinterpret_cast<const char*>(scales + t0 * nb * kTile);
    const char* min_start = kMin ? reinterpret_cast<const char*>(mins + t0 * nb * kTile) : nullptr;
    for (int64_t off = 0; off < std::min(kPrefetchBytes, length); off += 64) window.fetch(start + off);
    for (int64_t off = 0; off < std::min(kScalePrefetchBytes, length / 8); off += 64) {
      window.fetch(scale_start + off);
      if constexpr (kMin) window.fetch(min_start + off);
    }
    for (int64_t off = kPrefetchBytes; off < std::min(kFarBytes, length); off += 64)
      _mm_prefetch(start + off, _MM_HINT_T1);
    for (int64_t off = kScalePrefetchBytes; off < std::min(kFarScaleBytes, length / 8); off += 64) {
      _mm_prefetch(scale_start + off, _MM_HINT_T1);
      if constexpr (kMin) _mm_prefetch(min_start + off, _MM_HINT_T1);
    }
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kTile;
    const __mmask16 keep = n0 + kTile <= N ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (N - n0)) - 1);
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = init ? _mm512_maskz_loadu_ps(keep, init + m * ld + n0) : _mm512_setzero_ps();
    const uint8_t* c = codes + t * nb * kBlockBytes;
    const uint16_t* sc = scales + t * nb * kTile;
    const uint16_t* mn = kMin ? mins + t * nb * kTile : nullptr;
    for (int64_t b = 0; b < nb; ++b, c += kBlockBytes) {
      // Nothing past the window's end: that is another thread's share.
      if (kPrefetchBytes > 0 && c + kPrefetchBytes + kBlockBytes <= codes_end) {
        for (int j = 0; j < kChunks; ++j) window.fetch(c + kPrefetchBytes + 64 * j);
        // Scales (and minimums): 32 bytes a block, a line every other block.
        if (b % 2 == 0) {
          window.fetch(reinterpret_cast<const char*>(sc + b * kTile) + kScalePrefetchBytes);
          if constexpr (kMin) window.fetch(reinterpret_cast<const char*>(mn + b * kTile) + kScalePrefetchBytes);
        }
      }
      if (kFarBytes > 0 && c + kFarBytes + kBlockBytes <= codes_end) {
        for (int j = 0; j < kChunks; ++j) _mm_prefetch(reinterpret_cast<const char*>(c + kFarBytes + 64 * j), _MM_HINT_T1);
        if (b % 2 == 0) {
          _mm_prefetch(reinterpret_cast<const char*>(sc + b * kTile) + kFarScaleBytes, _MM_HINT_T1);
          if constexpr (kMin)
            _mm_prefetch(reinterpret_cast<const char*>(mn + b * kTile) + kFarScaleBytes, _MM_HINT_T1);
        }
      }
      __m512i w[8];
      if constexpr (kind == kQ8) {
        for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(c + 64 * j);
      } else {
        for (int j = 0; j < 4; ++j) genfn_kernels::unpack_nibble_chunk<kind>(c, j, w[j], w[4 + j]);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + b * kTile)));
      __m512 mins_b;
      if constexpr (kMin)
        mins_b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + b * kTile)));
      for (int m = 0; m < M; ++m) {
        const int32_t* xb = reinterpret_cast<const int32_t*>(a.codes.data() + m * K + b * kBlock);
        // Two dot-product chains a row hide vpdpbusd's latency (the integer sum, and so the bits,
        // is the same). Zen 5 retires two a cycle: with one chain a row from four rows on (as
        // until session 9), calls of 8-11 rows took 4-13 % longer, prompt-lookup rounds 5-10 %.
        __m512i s0 = _mm512_set1_epi32(-kOffset * a.sum[m * nb + b]);
        __m512i s1 = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
          s0 = _mm512_dpbusd_epi32(s0, w[j], _mm512_set1_epi32(xb[j]));
          s1 = _mm512_dpbusd_epi32(s1, w[j + 1], _mm512_set1_epi32(xb[j + 1]));
        }
        s0 = _mm512_add_epi32(s0, s1);
        const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(a.scale[m * nb + b]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), dx, acc[m]);
        if constexpr (kMin)
          acc[m] = _mm512_fmadd_ps(mins_b, _mm512_set1_ps(a.scaled_sum[m * nb + b]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * ld + n0, keep, acc[m]);
  }
}

// The same arithmetic one lane at a time, for CPUs without VNNI (the same chain, the same bits).
void run_tiles_scalar(int64_t M, int64_t kind, int64_t tiles, int64_t nb, const uint8_t* codes,
                      const c10::Half* scales, const c10::Half* mins, const Activations& a, int64_t K, int64_t N,
                      float* y, const float* init) {
  const int64_t block_bytes = tile_block_bytes(kind);
  const int32_t offset = code_offset(kind);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t r = 0; r < kTile && t * kTile + r < N; ++r)
      for (int64_t m = 0; m < M; ++m) {
        float acc = init ? init[m * N + t * kTile + r] : 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* c = codes + (t * nb + b) * block_bytes;
          const int8_t* xq = a.codes.data() + m * K + b * kBlock;
          int32_t s = -offset * a.sum[m * nb + b];
          for (int64_t k = 0; k < kBlock; ++k) s += genfn_kernels::tile_code(c, kind, r, k) * xq[k];
          const float d = static_cast<float>(scales[(t * nb + b) * kTile + r]);
          acc = std::fma(static_cast<float>(s), d * a.scale[m * nb + b], acc);
          if (has_minimum(kind)) acc = std::fma(static_cast<float>(mins[(t * nb + b) * kTile + r]),
                                             a.scaled_sum[m * nb + b], acc);
        }
        y[m * N + t * kTile + r] = acc;
      }
}

template <int64_t kind>
void dispatch_rows(int64_t M, int64_t t0, int64_t t1, int64_t fetch_end, bool first, int64_t nb, const uint8_t* codes,
                   const uint16_t* scales, const uint16_t* mins, const Activations& a, int64_t K, int64_t N,
                   int64_t ld, float* y, const float* init) {
  genfn_kernels::with_rows(M, [&](auto rows) {
    run_tiles<decltype(rows)::value, kind>(t0, t1, fetch_end, first, nb, codes, scales, mins, a, K, N, ld, y, init);
  });
}

void run_share(int64_t M, int64_t kind, int64_t t0, int64_t t1, int64_t fetch_end, bool first, int64_t nb,
               const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const Activations& a, int64_t K,
               int64_t N, int64_t ld, float* y, const float* init) {
  switch (kind) {
    case kQ4: return dispatch_rows<kQ4>(M, t0, t1, fetch_end, first, nb, codes, scales, mins, a, K, N, ld, y, init);
    case kQ4Min: return dispatch_rows<kQ4Min>(M, t0, t1, fetch_end, first, nb, codes, scales, mins, a, K, N, ld, y, init);
    case kQ5: return dispatch_rows<kQ5>(M, t0, t1, fetch_end, first, nb, codes, scales, mins, a, K, N, ld, y, init);
    case kQ5Min: return dispatch_rows<kQ5Min>(M, t0, t1, fetch_end, first, nb, codes, scales, mins, a, K, N, ld, y, init);
    default: return dispatch_rows<kQ8>(M, t0, t1, fetch_end, first, nb, codes, scales, mins, a, K, N, ld, y, init);
  }
}

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return yes;
}

at::Tensor linear_from(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& mins, int64_t kind, int64_t out_features,
                       const c10::optional<at::Tensor>& init) {
  TORCH_CHECK(genfn_kernels::valid_tile_kind(kind), "quant_linear: kind must be ", genfn_kernels::kTileKindNames,
              ", got ", kind);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte, "quant_linear: codes must be uint8 [tiles, blocks, bytes]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "quant_linear: scales must be float16");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu(), "quant_linear: CPU tensors only");
  const int64_t K = x.size(-1);
  const int64_t tiles = codes.size(0), nb = codes.size(1);
  TORCH_CHECK(K == nb * kBlock, "quant_linear: x has ", K, " features, the weight expects ", nb * kBlock);
  TORCH_CHECK(codes.size(2) == tile_block_bytes(kind), "quant_linear: codes of ", codes.size(2),
              " bytes a block do not match kind ", kind);
  TORCH_CHECK(out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
              "quant_linear: ", out_features, " output rows do not fit ", tiles, " tiles");
  TORCH_CHECK(scales.numel() == tiles * nb * kTile, "quant_linear: scales do not match the codes");
  const bool has_min = has_minimum(kind);
  TORCH_CHECK(!has_min || (mins.has_value() && mins->numel() == scales.numel() && mins->scalar_type() == at::kHalf),
              "quant_linear: kinds 1 and 4 (with minimums) need float16 mins shaped like the scales");
  const int64_t N = out_features;
  const int64_t M = K == 0 ? 0 : x.numel() / K;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y.view(out_sizes).to(x.scalar_type());
  TORCH_CHECK(!init.has_value() || init->numel() == M * N, "quant_linear: init must hold the output's ", M, " x ", N,
              " values, got ", init.has_value() ? init->numel() : 0);
  const at::Tensor start = init.has_value() ? init->to(at::kFloat).contiguous() : at::Tensor();
  const float* ip = init.has_value() ? start.data_ptr<float>() : nullptr;
  const at::Tensor c = codes.contiguous(), s = scales.contiguous();
  const at::Tensor mn = has_min ? mins->contiguous() : at::Tensor();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const uint16_t* mp = has_min ? reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()) : nullptr;
  const bool vnni = has_vnni();
  float* yp = y.data_ptr<float>();
  if (vnni && genfn_kernels::quant_gemm_takes(M)) {  // a prefill or a large batch: the blocked GEMM
    const genfn_kernels::QuantWeight weight{cp, sp, mp, kind, tiles, nb, N};
    genfn_kernels::quant_gemm(xf.data_ptr<float>(), M, K, weight, yp, ip);
    return y.view(out_sizes).to(x.scalar_type());
  }
  // Groups of rows (group_size: as even as they split), each quantized once, in buffers reused
  // across calls (a decode step makes ~120 calls, each needing a few KiB). The region's threads
  // read the calling thread's buffers, so they are reached through these references (naming a
  // thread_local inside the region would reach each thread's own, empty, copy).
  thread_local std::vector<Activations> buffers;
  thread_local genfn_kernels::RowQueue queue;
  const int64_t per = genfn_kernels::group_size(M), groups = (M + per - 1) / per;
  if (static_cast<int64_t>(buffers.size()) < groups) buffers.resize(groups);
  std::vector<Activations>& acts = buffers;
  std::vector<int64_t> rows(groups);
  std::vector<float*> outs(groups);
  std::vector<const float*> starts(groups);
  for (int64_t g = 0; g < groups; ++g) {
    rows[g] = std::min(per, M - g * per);
    outs[g] = yp + g * per * N;
    starts[g] = ip ? ip + g * per * N : nullptr;
    quantize_activations(xf.data_ptr<float>() + g * per * K, rows[g], K, acts[g]);
  }
  if (!vnni) {
    for (int64_t g = 0; g < groups; ++g)
      run_tiles_scalar(rows[g], kind, tiles, nb, cp, reinterpret_cast<const c10::Half*>(sp),
                       reinterpret_cast<const c10::Half*>(mp), acts[g], K, N, outs[g], starts[g]);
    return y.view(out_sizes).to(x.scalar_type());
  }
  // The fused layer's share of a linear, with the op's own region around it: tiles balanced over
  // the threads, every group of rows over each claimed chunk, so the weight streams once.
  const genfn_kernels::QuantWeight weight{cp, sp, mp, kind, tiles, nb, N};
  genfn_kernels::RowQueue& shared = queue;
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  shared.prepare_blocks(tiles, threads);
#pragma omp parallel num_threads(threads)
  genfn_kernels::quant_linear_share_groups(groups, rows.data(), acts.data(), K, weight, outs.data(),
                                           omp_get_thread_num(), shared, starts.data());
  return y.view(out_sizes).to(x.scalar_type());
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& mins, int64_t kind, int64_t out_features) {
  return linear_from(x, codes, scales, mins, kind, out_features, c10::nullopt);
}

// quant_linear with every output's chain starting at init's value (see the top of this file).
at::Tensor quant_linear_from(const at::Tensor& init, const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& mins, int64_t kind,
                             int64_t out_features) {
  return linear_from(x, codes, scales, mins, kind, out_features, init);
}

}  // namespace

namespace genfn_kernels {

bool cpu_has_avx512_vnni() { return has_vnni(); }
bool quant_shares_run() { return has_vnni(); }


void quantize_rows_share(const float* x, int64_t M, int64_t K, QuantActivations& a, int64_t t, int64_t T) {
  quantize_rows(x, M * t / T, M * (t + 1) / T, K, a);
}


void quant_linear_share_groups(int64_t groups, const int64_t* M, const QuantActivations* a, int64_t K,
                               const QuantWeight& w, float* const* y, int64_t t, RowQueue& queue,
                               const float* const* init, int64_t ld) {
  if (ld == 0) ld = w.out_features;
  const int64_t chunk = tiles_chunk(w, groups);
  // Every group over the claimed tiles while they are in L1: the first fetches ahead, the others
  // read what it brought.
  auto tiles = [&](int64_t begin, int64_t end, int64_t fetch_end, bool first) {
    for (int64_t g = 0; g < groups; ++g)
      run_share(M[g], w.kind, begin, end, g == 0 ? fetch_end : end, g == 0 && first, w.blocks, w.codes, w.scales,
                w.mins, a[g], K, w.out_features, ld, y[g], init ? init[g] : nullptr);
  };
  run_balanced(
      queue, t, chunk,
      // The own run is one stream, fetched ahead up to its end.
      [&](int64_t begin, int64_t end, int64_t start, int64_t stop) { tiles(begin, end, stop, begin == start); },
      [&](int64_t begin, int64_t end) { tiles(begin, end, end, true); });
}

}  // namespace genfn_kernels

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, int out_features) -> Tensor");
  m.def("quant_linear_from(Tensor init, Tensor x, Tensor codes, Tensor scales, Tensor? mins, int kind, "
        "int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_from", &quant_linear_from);
}
