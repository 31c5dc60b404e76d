// y = x @ dequantize(W).T for W in GGUF's K-quant formats (Q4_K, Q5_K, Q6_K), read in place: the
// super-blocks row by row as the file stores them (genfn/quant/kquants.py).
//
// As llama.cpp does for these formats, each row of x is quantized once per call to llama.cpp's
// Q8_K (one float scale per 256 inputs, int8 codes, code sums per 16). Per weight row and super-
// block, the codes are unpacked in registers, multiplied by the activation codes in 16-bit pairs
// (vpmaddubsw: unsigned weight code x signed activation code), the pairs summed in 32 bits with
// the group scales as multipliers (vpmaddwd), so a super-block's dot product is one exact integer
// sum, scaled once by d_w * d_x; Q4_K/Q5_K's minimums and Q6_K's offset of 32 fold into the
// activation's code sums. Every weight row is decoded once for all rows of x (up to 8 at a time
// in registers; the row stays in L1 for the next 8), so a step of a few rows streams the weight
// once, like one row.
//
// The ops here also run IQ4_NL and IQ4_XS weights, whose row kernels live in iq4_linear.cpp (IQ4_NL's
// activations are quantized per 32 inputs, its block).
//
// Built as its own library without global ISA flags: an AVX-512 (BW) path and an AVX2 path are
// compiled per function and chosen at run time, so it loads on every x86-64 CPU and refuses,
// with a message, where neither runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kquant.h"
#include "kquant_rows.h"
#include "kquant_quantize.h"
#include "row_queue.h"

namespace {

using namespace genfn::kquant;

Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return kAvx2;
  return kNone;
}
const Isa kBestIsa = detect_isa();
Isa forced_isa = kNone;  // tests pin the AVX2 path on an AVX-512 machine

}  // namespace

bool genfn::kquant::quantize_avx512() { return kBestIsa == kAvx512; }
genfn::kquant::Isa genfn::kquant::best_isa() { return kBestIsa; }

namespace {

// The order a format's row kernel on path isa reads the activation codes in (kquant.h).
Order activation_order(Isa isa, int64_t format) {
  if (isa != kAvx512 || format == kQ6K || interleaved(format)) return kNatural;
  return format == kQ4K || format == kQ5K ? kQ4KOrder : kIQ4Order;
}


// ---------------------------------------------------------------------------------------------
// AVX-512

// Q4_K/Q5_K: which byte of a super-block's 8 scales (broadcast to every 8 bytes of a register) each
// byte of a vpshufb result takes, for the int16 multipliers of vpmaddwd. scales[p]: the four code
// registers (lo[0], hi[0], lo[1], hi[1]) hold groups (a, b) = (0, 2), (1, 3), (4, 6), (5, 7), so
// int16 lanes 0-15 take scale a and 16-31 scale b; mins: the 8 mins twice each, one per 16-input
// code sum. An index byte of 0x80 zeroes the high byte of each int16.
struct Q4Index {
  alignas(64) uint8_t scales[4][64];
  alignas(32) uint8_t mins[32];
  constexpr Q4Index() : scales(), mins() {
    constexpr int kPairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int p = 0; p < 4; ++p)
      for (int k = 0; k < 64; ++k) scales[p][k] = k % 2 ? 0x80 : static_cast<uint8_t>(kPairs[p][k / 32]);
    for (int k = 0; k < 32; ++k) mins[k] = k % 2 ? 0x80 : static_cast<uint8_t>(k / 4);
  }
};
constexpr Q4Index kQ4Index;

GENFN_AVX512_INLINE inline __m512i q4_scales512(__m512i scales8, int pair) {
  return _mm512_shuffle_epi8(scales8, _mm512_load_si512(kQ4Index.scales[pair]));
}

GENFN_AVX512_INLINE inline __m512i dot512(__m512i w, const int8_t* x, __m512i scales) {
  return _mm512_madd_epi16(_mm512_maddubs_epi16(w, _mm512_loadu_si512(x)), scales);
}

// One Q4_K or Q5_K weight row against M rows of x: writes y[m * N]. (Q6_K on AVX-512 takes the VNNI
// kernel of kquant_q6k.cpp; an AVX-512 CPU without VNNI runs Q6_K on the AVX2 path.)
template <int M, int64_t F>
GENFN_AVX512 void row_avx512(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  RowSums acc = {_mm256_setzero_ps(), 0.0f};
  __m512i sum[8];
  __m256i mins[8];
  for (int m = M; m < 8; ++m) {
    sum[m] = _mm512_setzero_si512();
    mins[m] = _mm256_setzero_si256();
  }
  const int64_t K = a.K;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  StreamFetch<M> fetch(w);
  for (int64_t b = 0; b < nb; ++b, w += block_bytes(F)) {
    fetch.through(w + block_bytes(F));
    const float d = half_to_float(load_u16(w)), dmin = half_to_float(load_u16(w + 2));
    uint64_t sc, mn;
    unpack_scales(w + 4, sc, mn);
    const __m512i scales8 = _mm512_set1_epi64(static_cast<long long>(sc));
    const __m256i mins16 = _mm256_shuffle_epi8(_mm256_set1_epi64x(static_cast<long long>(mn)),
                                               _mm256_load_si256(reinterpret_cast<const __m256i*>(kQ4Index.mins)));
    const uint8_t* qs = w + (F == kQ5K ? 48 : 16);
    __m512i lo[2], hi[2];
    for (int j = 0; j < 2; ++j) {
      const __m512i packed = _mm512_loadu_si512(qs + 64 * j);
      lo[j] = _mm512_and_si512(packed, low4);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4);
    }
    if constexpr (F == kQ5K) {
      // Fifth bits: byte l of qh holds input l of group i in bit i.
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)));
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int j = 0; j < 2; ++j) {
        const int g = 4 * j;  // lo holds groups g (bytes 0-31) and g + 2; hi groups g + 1 and g + 3
        const __m512i sel_lo = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << g)),
                                                  _mm256_set1_epi8(static_cast<char>(1 << (g + 2))), 1);
        const __m512i sel_hi = _mm512_add_epi8(sel_lo, sel_lo);
        lo[j] = _mm512_mask_add_epi8(lo[j], _mm512_test_epi8_mask(qh, sel_lo), lo[j], sixteen);
        hi[j] = _mm512_mask_add_epi8(hi[j], _mm512_test_epi8_mask(qh, sel_hi), hi[j], sixteen);
      }
    }
    const __m512i s_lo0 = q4_scales512(scales8, 0), s_hi0 = q4_scales512(scales8, 1);
    const __m512i s_lo1 = q4_scales512(scales8, 2), s_hi1 = q4_scales512(scales8, 3);
    for (int m = 0; m < M; ++m) {
      const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper;
      sum[m] = dot512(lo[0], x, s_lo0);
      sum[m] = _mm512_add_epi32(sum[m], dot512(hi[0], x + 64, s_hi0));
      sum[m] = _mm512_add_epi32(sum[m], dot512(lo[1], x + 128, s_lo1));
      sum[m] = _mm512_add_epi32(sum[m], dot512(hi[1], x + 192, s_hi1));
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums.data() + (m0 + m) * (K / 16) + b * 16));
      mins[m] = _mm256_madd_epi16(sums, mins16);
    }
    add_rows<M>(acc, sum, mins, d, dmin, a, m0, nb, b);
  }
  store_rows<M>(acc, y, N);
}

// ---------------------------------------------------------------------------------------------
// AVX2

GENFN_AVX2_INLINE inline __m256i dot256(__m256i w, const int8_t* x, int16_t scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                           _mm256_set1_epi16(scale));
}
GENFN_AVX2_INLINE inline __m256i dot256_pair(__m256i w, const int8_t* x, int16_t first, int16_t second) {
  const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(second), _mm_set1_epi16(first));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), scales);
}
GENFN_AVX2_INLINE inline __m256i q6_bits(__m256i high, int shift, __m256i three) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, shift), three), 4);
}

template <int M, int64_t F>
GENFN_AVX2 void row_avx2(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  RowSums acc = {_mm256_setzero_ps(), 0.0f};
  __m256i sum[8], mins[8];
  for (int m = M; m < 8; ++m) sum[m] = mins[m] = _mm256_setzero_si256();
  const int64_t K = a.K;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  StreamFetch<M> fetch(w);
  for (int64_t b = 0; b < nb; ++b, w += block_bytes(F)) {
    fetch.through(w + block_bytes(F));
    if constexpr (F == kQ4K || F == kQ5K) {
      const float d = half_to_float(load_u16(w)), dmin = half_to_float(load_u16(w + 2));
      uint64_t sc, mn;
      unpack_scales(w + 4, sc, mn);
      uint8_t scale[8];
      std::memcpy(scale, &sc, 8);
      const __m128i mn8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
      const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
      const uint8_t* qs = w + (F == kQ5K ? 48 : 16);
      __m256i codes[8];  // group g: inputs 32g..32g+31
      for (int c = 0; c < 4; ++c) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        codes[2 * c] = _mm256_and_si256(packed, low4);
        codes[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      }
      if constexpr (F == kQ5K) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
        const __m256i one = _mm256_set1_epi8(1);
        for (int g = 0; g < 8; ++g)
          codes[g] = _mm256_or_si256(codes[g], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, g), one), 4));
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper;
        sum[m] = dot256(codes[0], x, scale[0]);
        for (int g = 1; g < 8; ++g) sum[m] = _mm256_add_epi32(sum[m], dot256(codes[g], x + 32 * g, scale[g]));
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums.data() + (m0 + m) * (K / 16) + b * 16));
        mins[m] = _mm256_madd_epi16(sums, mins16);
      }
      add_rows<M>(acc, sum, mins, d, dmin, a, m0, nb, b);
    } else {
      const uint8_t* ql = w;
      const uint8_t* qh = w + 128;
      const int8_t* scale = reinterpret_cast<const int8_t*>(w + 192);
      const float d = half_to_float(load_u16(w + 208));
      const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale)));
      const __m256i three = _mm256_set1_epi8(3);
      __m256i codes[8];  // group g (of 32 inputs, natural order)
      for (int h = 0; h < 2; ++h) {
        const __m256i la = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h));
        const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32));
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
        codes[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(la, low4), q6_bits(high, 0, three));
        codes[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(lb, low4), q6_bits(high, 2, three));
        codes[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4), q6_bits(high, 4, three));
        codes[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4), q6_bits(high, 6, three));
      }
      for (int m = 0; m < M; ++m) {
        const int8_t* x = a.codes.data() + (m0 + m) * K + b * kSuper;
        sum[m] = dot256_pair(codes[0], x, scale[0], scale[1]);
        for (int g = 1; g < 8; ++g)
          sum[m] = _mm256_add_epi32(sum[m], dot256_pair(codes[g], x + 32 * g, scale[2 * g], scale[2 * g + 1]));
        const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums.data() + (m0 + m) * (K / 16) + b * 16));
        sum[m] = _mm256_sub_epi32(sum[m], _mm256_slli_epi32(_mm256_madd_epi16(sums, scales16), 5));  // the offset
      }
      add_rows<M>(acc, sum, d, a, m0, nb, b);
    }
  }
  store_rows<M>(acc, y, N);
}

// ---------------------------------------------------------------------------------------------
// Dispatch

template <int64_t F>
RowFn pick_row(Isa isa, int rows) {
  if constexpr (F != kQ6K)
    if (isa == kAvx512) { GENFN_ROW_CASES(rows, row_avx512, F) }
  GENFN_ROW_CASES(rows, row_avx2, F)
}

// q6_k_r8 or iq4_xs_r8 (F) where its VNNI kernel cannot run (AVX2, or AVX-512 without VNNI: where
// the loader keeps Q6_K and IQ4_XS as stored, so only for a weight repacked elsewhere): each of the
// group's rows put back as stored, then the stored format's AVX2 row kernel (which reads the codes in
// natural order, as activation_order lays them out for an interleaved format), so the same integers
// and floats, the same bits.
template <int M, int64_t F>
void r8_by_rows(const uint8_t* w, int64_t nb, const ActivationsK& a, int64_t m0, float* y, int64_t N) {
  constexpr int64_t stored = stored_format(F);
  const RowFn row_kernel = stored == kQ6K ? &row_avx2<M, kQ6K> : pick_iq4(kAvx2, stored, M);
  thread_local std::vector<uint8_t> row;
  row.resize(nb * block_bytes(stored));
  for (int r = 0; r < kR8Rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) r8_load<F>(w + b * group_block_bytes(F), r, row.data() + b * block_bytes(stored));
    row_kernel(row.data(), nb, a, m0, y + r, N);
  }
}

// Whether a format's rows take its own kernel on path `isa`: q6_k_r8's and iq4_xs_r8's group kernels
// need AVX-512 VNNI, and elsewhere pick() takes their groups a row at a time through the stored
// format's kernel (the same bits, slower than the format as stored), so the GGUF loader asks this
// (kquant_own_kernel_runs) before it interleaves Q6_K or IQ4_XS.
bool own_kernel_runs(Isa isa, int64_t format) {
  return (format != kQ6KR8 && format != kIQ4XSR8) || (isa == kAvx512 && has_vnni());
}

RowFn pick(Isa isa, int64_t format, int rows) {
  if (format == kIQ4NL || format == kIQ4XS) return pick_iq4(isa, format, rows);
  if (!own_kernel_runs(isa, format)) {
    if (format == kQ6KR8) { GENFN_ROW_CASES(rows, r8_by_rows, kQ6KR8) }
    GENFN_ROW_CASES(rows, r8_by_rows, kIQ4XSR8)
  }
  if (interleaved(format)) return pick_r8(isa, format, rows);
  if (format == kQ4K) return pick_row<kQ4K>(isa, rows);
  if (format == kQ5K) return pick_row<kQ5K>(isa, rows);
  if (isa == kAvx512 && has_vnni()) return pick_q6k_vnni(rows);
  return pick_row<kQ6K>(isa, rows);
}

Isa active_isa() { return forced_isa != kNone ? forced_isa : kBestIsa; }

// ---------------------------------------------------------------------------------------------
// SharedLinear (kquant.h): the row kernels inside a parallel region, the op's and the fused layer's

// The most rows of x a row function takes at once.
constexpr int64_t kMaxRowsAtOnce = genfn_kernels::kMaxDecodeRows;

void prepare_shared(SharedLinear& s, int64_t M, int64_t threads) {
  const Isa isa = active_isa();
  TORCH_CHECK(isa != kNone, "the K-quant kernels need an x86-64 CPU with AVX2, FMA and F16C (or AVX-512)");
  TORCH_CHECK(s.count >= 1 && s.count <= SharedLinear::kMaxParts, "a K-quant matrix of 1 to ",
              SharedLinear::kMaxParts, " parts, got ", s.count);
  s.M = M;
  s.per = genfn_kernels::group_size(M);
  s.groups = (M + s.per - 1) / s.per;
  const int rows_last = static_cast<int>(M - (s.groups - 1) * s.per);
  s.layouts = 0;
  int64_t widest = 1;
  bool starts[SharedLinear::kMaxParts] = {};  // per layout: whether a part's kernels read its offsets8
  for (int64_t p = 0; p < s.count; ++p) {
    const int64_t f = s.parts[p].format, block = block_inputs(f);
    TORCH_CHECK(f >= kQ4K && f <= kLastFormat && s.K % block == 0, "a K-quant part of format ", f, " over ", s.K,
                " inputs");
    TORCH_CHECK(!interleaved(f) || s.parts[p].rows % kR8Rows == 0, "an interleaved part of ", s.parts[p].rows,
                " rows: whole groups of ", kR8Rows, " only");
    s.first[p + 1] = s.first[p] + s.parts[p].rows;
    s.blocks[p] = s.K / block;
    s.row_bytes[p] = s.blocks[p] * block_bytes(f);
    widest = std::max(widest, s.row_bytes[p]);
    s.full[p] = pick(isa, f, static_cast<int>(s.per));
    s.last[p] = pick(isa, f, rows_last);
    // Parts that read x in the same layout share its quantized rows.
    const Order order = activation_order(isa, f);
    int64_t l = 0;
    while (l < s.layouts && !(s.block[l] == block && s.order[l] == order)) ++l;
    if (l == s.layouts) {
      s.block[l] = block;
      s.order[l] = order;
      ++s.layouts;
    }
    s.layout_of[p] = l;
    starts[l] = starts[l] || reads_offsets(isa, f, s.per) || reads_offsets(isa, f, rows_last);
  }
  for (int64_t l = 0; l < s.layouts; ++l) s.x[l].resize(M, s.K, s.block[l], starts[l]);
  s.queue.prepare_blocks(s.first[s.count], threads);
  // ~8 KiB of weight a claim (per group of rows), as the decode kernels' balanced linears claim.
  s.chunk = std::max<int64_t>(1, 8192 / (widest * s.groups));
}

// Thread t of team quantizes its even share of x's spans (quantize_unit inputs of a row each) in
// every layout: a single row is shared out too.
void quantize_share(SharedLinear& s, const float* x, int64_t t, int64_t team) {
  const bool avx512 = quantize_avx512();
  for (int64_t l = 0; l < s.layouts; ++l) {
    const int64_t unit = quantize_unit(s.block[l]), per_row = (s.K + unit - 1) / unit, spans = s.M * per_row;
    for (int64_t i = spans * t / team; i < spans * (t + 1) / team; ++i) {
      const int64_t m = i / per_row, k0 = i % per_row * unit;
      quantize_span_k(x, m, k0, std::min(k0 + unit, s.K), s.block[l], s.order[l], avx512, s.x[l]);
    }
  }
}

// All of x in every layout of s into `into` (one per layout), by one thread: its own copy, the same
// codes a share gives.
void quantize_all(SharedLinear& s, const float* x, ActivationsK* into) {
  const bool avx512 = quantize_avx512();
  for (int64_t l = 0; l < s.layouts; ++l) {
    into[l].resize(s.M, s.K, s.block[l], !s.x[l].offsets8.empty());
    const int64_t unit = quantize_unit(s.block[l]);
    for (int64_t m = 0; m < s.M; ++m)
      for (int64_t k0 = 0; k0 < s.K; k0 += unit)
        quantize_span_k(x, m, k0, std::min(k0 + unit, s.K), s.block[l], s.order[l], avx512, into[l]);
  }
}

// Thread t's claimed rows of every part against x (one per layout): each weight row decoded once per
// group of x's rows, and still in L1 for the next group; y [M, N] with N all parts' rows.
void rows_share(SharedLinear& s, const ActivationsK* x, float* y, int64_t t) {
  const int64_t N = s.first[s.count];
  auto rows = [&](int64_t n0, int64_t n1) {
    int64_t p = 0;
    for (int64_t n = n0; n < n1; ++n) {
      while (n >= s.first[p + 1]) ++p;
      // An interleaved group's rows are written by the call that claims its first row.
      const bool r8 = interleaved(s.parts[p].format);
      if (r8 && (n - s.first[p]) % kR8Rows) continue;
      const uint8_t* w = s.parts[p].w + (n - s.first[p]) * s.row_bytes[p];
      const ActivationsK& a = x[s.layout_of[p]];
      for (int64_t m0 = 0; m0 < s.M; m0 += s.per)
        (m0 + s.per <= s.M ? s.full[p] : s.last[p])(w, s.blocks[p], a, m0, y + m0 * N + n, N);
    }
  };
  genfn_kernels::run_balanced(
      s.queue, t, s.chunk, [&](int64_t begin, int64_t end, int64_t, int64_t) { rows(begin, end); }, rows);
}

// Thread t of `team`'s part of y = x @ W.T inside a parallel region, s prepared: a few rows of x
// quantized by every thread for itself (quantize_alone, the same for every thread of the team), else
// a share of x by each and a barrier; then its claimed rows (LayerEntry::linear_share).
void linear_share(SharedLinear& s, const float* x, float* y, int64_t t, int64_t team,
                  genfn_kernels::TeamBarrier& barrier) {
  if (s.groups == 1 && genfn_kernels::quantize_alone(s.M, team)) {
    thread_local ActivationsK own[SharedLinear::kMaxParts];
    quantize_all(s, x, own);
    rows_share(s, own, y, t);
    return;
  }
  quantize_share(s, x, t, team);
  barrier.wait(team);
  rows_share(s, s.x, y, t);
}

constexpr LayerEntry kLayerEntry{layer_entry_key(), &prepare_shared, &linear_share};

// row_kernels: every row count through the row kernels (whose per-row result is the same at any row
// count, as is the GEMM's, but not the same as the GEMM's), for the batch-invariant mode.
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& data, int64_t format, int64_t out_features,
                         bool row_kernels) {
  TORCH_CHECK(format >= kQ4K && format <= kLastFormat,
              "kquant_linear: format must be 0 (q4_k), 1 (q5_k), 2 (q6_k), 3 (iq4_nl), 4 (iq4_xs), 5 (q4_k_r8), 6 (q5_k_r8), "
              "7 (q6_k_r8) or 8 (iq4_xs_r8), got ",
              format);
  const Isa isa = active_isa();
  TORCH_CHECK(isa != kNone, "kquant_linear: the K-quant kernels need an x86-64 CPU with AVX2, FMA and F16C (or AVX-512); "
              "this CPU has neither. Load the model without quantize='gguf' to dequantize its weights instead.");
  TORCH_CHECK(x.device().is_cpu() && data.device().is_cpu(), "kquant_linear: CPU tensors only");
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.size(0) == out_features,
              "kquant_linear: data must be uint8 [out_features, row bytes]");
  const int64_t K = x.size(-1), block = block_inputs(format);
  TORCH_CHECK(K % block == 0, "kquant_linear: x's features (", K, ") must be a multiple of ", block);
  const int64_t nb = K / block, row_bytes = nb * block_bytes(format);
  TORCH_CHECK(data.size(1) == row_bytes, "kquant_linear: x has ", K, " features, the weight rows hold ", data.size(1),
              " bytes, not ", row_bytes);
  const int64_t N = out_features, M = K == 0 ? 0 : x.numel() / K;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.view(out_sizes).to(x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor w = data.contiguous();
  if (!row_kernels && gemm_takes(format, M, isa)) {  // many rows: kquant_gemm.cpp
    kquant_gemm(xf.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), format, N, y.data_ptr<float>(), isa);
    return y.view(out_sizes).to(x.scalar_type());
  }
  // Reused across calls (a decode step makes dozens); the workers read the caller's buffers
  // through this reference.
  thread_local SharedLinear buffers;
  SharedLinear& s = buffers;
  s.parts[0] = {w.data_ptr<uint8_t>(), format, N};
  s.count = 1;
  s.K = K;
  const int64_t threads = omp_in_parallel() ? 1 : at::get_num_threads();
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t passes = (M + kMaxRowsAtOnce - 1) / kMaxRowsAtOnce;
  genfn_kernels::TeamBarrier barrier;
  if (threads == 1 || N * row_bytes * passes <= 16384) {  // too little work to share out
    prepare_shared(s, M, 1);
    linear_share(s, xp, yp, 0, 1, barrier);
    return y.view(out_sizes).to(x.scalar_type());
  }
  prepare_shared(s, M, threads);
#pragma omp parallel num_threads(threads)
  linear_share(s, xp, yp, static_cast<int64_t>(omp_get_thread_num()), static_cast<int64_t>(omp_get_num_threads()),
               barrier);
  return y.view(out_sizes).to(x.scalar_type());
}

// A mixture-of-experts MLP's decode step over K-quant experts (genfn/quant/experts.py: each
// projection's E matrices stacked as the file stores them, gate_up [E, 2I, row bytes], down
// [E, H, row bytes]), reading only the chosen experts: per row t and each of its k experts e (weight
// w), out[t] += w * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), the products as kquant_linear
// computes them (x[t] and the SwiGLU quantized to Q8_K), summed in the router's order. Returns the
// bytes of weights read (each chosen expert's three matrices once per row that chose it), so a test
// can count what a token touched.
std::tuple<at::Tensor, at::Tensor> kquant_moe_decode(const at::Tensor& x, const at::Tensor& experts,
                                                     const at::Tensor& weights, const at::Tensor& gate_up,
                                                     int64_t gate_up_format, const at::Tensor& down,
                                                     int64_t down_format) {
  const Isa isa = active_isa();
  TORCH_CHECK(isa != kNone, "kquant_moe_decode: the K-quant kernels need an x86-64 CPU with AVX2, FMA and F16C");
  for (const int64_t f : {gate_up_format, down_format})
    TORCH_CHECK(f >= kQ4K && f <= kIQ4XS, "kquant_moe_decode: formats must be 0 (q4_k), 1 (q5_k), 2 (q6_k), "
                "3 (iq4_nl) or 4 (iq4_xs), got ", f);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "kquant_moe_decode: x must be [T, H] float32");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.dim() == 2 && experts.size(0) == x.size(0),
              "kquant_moe_decode: experts must be [T, k] int64");
  TORCH_CHECK(weights.sizes() == experts.sizes(), "kquant_moe_decode: weights must have experts' shape");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.scalar_type() == at::kByte &&
                  down.scalar_type() == at::kByte && gate_up.is_contiguous() && down.is_contiguous() &&
                  gate_up.size(0) == down.size(0),
              "kquant_moe_decode: gate_up and down must be contiguous uint8 [E, rows, row bytes]");
  const int64_t rows = x.size(0), hidden = x.size(1), top_k = experts.size(1), num_experts = gate_up.size(0);
  const int64_t inter = gate_up.size(1) / 2;
  const int64_t gu_block = block_inputs(gate_up_format), dn_block = block_inputs(down_format);
  TORCH_CHECK(hidden % gu_block == 0 && inter % dn_block == 0 && gate_up.size(1) == 2 * inter && down.size(1) == hidden,
              "kquant_moe_decode: hidden and expert sizes must be multiples of their formats' blocks "
              "(gate_up [E, 2I, H], down [E, H, I])");
  const int64_t gu_blocks = hidden / gu_block, gu_row = gu_blocks * block_bytes(gate_up_format);
  const int64_t dn_blocks = inter / dn_block, dn_row = dn_blocks * block_bytes(down_format);
  TORCH_CHECK(gate_up.size(2) == gu_row && down.size(2) == dn_row, "kquant_moe_decode: row bytes disagree with x");
  auto ex = experts.contiguous();
  auto wt = weights.to(at::kFloat).contiguous();
  auto xc = x.contiguous();
  auto out = at::zeros({rows, hidden}, x.options());
  // Reused across calls; the workers read them through these references (naming the
  // thread_locals inside the lambdas would reach each worker's own, empty, copies).
  thread_local ActivationsK x_buffer, act_buffer;
  ActivationsK& xa = x_buffer;
  ActivationsK& aa = act_buffer;
  xa.resize(1, hidden, gu_block, reads_offsets(isa, gate_up_format, 1));
  aa.resize(1, inter, dn_block, reads_offsets(isa, down_format, 1));
  std::vector<float> gu(2 * inter), act(inter), dn(hidden);
  const RowFn gu_fn = pick(isa, gate_up_format, 1), dn_fn = pick(isa, down_format, 1);
  const uint8_t* gp = gate_up.data_ptr<uint8_t>();
  const uint8_t* dp = down.data_ptr<uint8_t>();
  for (int64_t t = 0; t < rows; ++t) {
    quantize_rows_k(xc.data_ptr<float>() + t * hidden, 0, 1, hidden, gu_block, activation_order(isa, gate_up_format), xa);
    float* ot = out.data_ptr<float>() + t * hidden;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t e = ex.data_ptr<int64_t>()[t * top_k + j];
      TORCH_CHECK(e >= 0 && e < num_experts, "kquant_moe_decode: expert index ", e, " out of range");
      const float w = wt.data_ptr<float>()[t * top_k + j];
      const uint8_t* ge = gp + e * 2 * inter * gu_row;
      const uint8_t* de = dp + e * hidden * dn_row;
      at::parallel_for(0, 2 * inter, std::max<int64_t>(1, 16384 / gu_row), [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) gu_fn(ge + n * gu_row, gu_blocks, xa, 0, gu.data() + n, 2 * inter);
      });
      for (int64_t i = 0; i < inter; ++i) act[i] = gu[i] / (1.0f + std::exp(-gu[i])) * gu[inter + i];
      quantize_rows_k(act.data(), 0, 1, inter, dn_block, activation_order(isa, down_format), aa);
      at::parallel_for(0, hidden, std::max<int64_t>(1, 16384 / dn_row), [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) dn_fn(de + n * dn_row, dn_blocks, aa, 0, dn.data() + n, hidden);
      });
      for (int64_t h = 0; h < hidden; ++h) ot[h] += w * dn[h];
    }
  }
  const int64_t read = rows * top_k * (2 * inter * gu_row + hidden * dn_row);
  return {out, at::scalar_tensor(read, x.options().dtype(at::kLong))};
}

// The address of kLayerEntry, for the decode library's fused layer (decode_layer.cpp) alone.
int64_t kquant_layer_entry() { return reinterpret_cast<int64_t>(&kLayerEntry); }

// 2 (AVX-512), 1 (AVX2) or 0 (neither): the path kquant_linear takes.
int64_t kquant_isa() { return active_isa(); }

// Whether format's rows take its own kernel on the active path (own_kernel_runs).
bool kquant_own_kernel_runs(int64_t format) {
  TORCH_CHECK(format >= 0 && format <= kLastFormat, "kquant_own_kernel_runs: unknown format ", format);
  return own_kernel_runs(active_isa(), format);
}

// Pin the path (1: AVX2, 2: AVX-512, 0: the best this CPU has); returns the path now active.
int64_t kquant_force_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "kquant_force_isa: isa must be 0, 1 or 2, got ", isa);
  TORCH_CHECK(isa <= kBestIsa, "kquant_force_isa: this CPU cannot run path ", isa, " (best: ", kBestIsa, ")");
  forced_isa = static_cast<Isa>(isa);
  return active_isa();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kquant, m) {
  m.def("kquant_linear(Tensor x, Tensor data, int format, int out_features, bool row_kernels=False) -> Tensor");
  m.def("kquant_moe_decode(Tensor x, Tensor experts, Tensor weights, Tensor gate_up, int gate_up_format, "
        "Tensor down, int down_format) -> (Tensor, Tensor)");
  m.def("kquant_isa", &kquant_isa);
  m.def("kquant_own_kernel_runs", &kquant_own_kernel_runs);
  m.def("kquant_force_isa", &kquant_force_isa);
  m.def("kquant_layer_entry", &kquant_layer_entry);
}

TORCH_LIBRARY_IMPL(genfn_kquant, CPU, m) {
  m.impl("kquant_linear", &kquant_linear);
  m.impl("kquant_moe_decode", &kquant_moe_decode);
}
