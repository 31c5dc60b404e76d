// bfloat16 weights in 12.2 bits, every weight kept: genfn/quant/coded_bf16.py's format, its encoder,
// its decoder and its linear.
//
// A batch-1 decode step waits on memory, and a bfloat16 weight's high byte (sign and the exponent's
// top 7 bits) carries little: within 64 weights of a row the exponents lie close together. Each
// weight keeps its low byte (the exponent's last bit, 7 mantissa bits) as it is, and its high byte
// becomes a 4-bit code, sign << 3 | (base - (high & 0x7F)), against the group's base, the largest
// (high & 0x7F) of its 64 weights. A group where some weight lies more than 7 below the base
// (~0.5 % of a normal matrix's groups, ~1 % with heavier tails; any exact zero) is "raw": its 64
// high bytes are kept whole in the row's exception list.
//
// Layout of a [N, K] matrix (K a multiple of 64; G = K / 64 groups a row):
//   records   uint8 [N, G * 96]: per pair of groups 192 bytes: group a's 64 low bytes, group b's,
//             then a's 32 code bytes and b's; an odd last group 96 (its low bytes, then its codes).
//             Low bytes lie in `packus(W0 & 0xFF, W1 & 0xFF)` order (W0 the group's words 0-31, W1
//             32-63), so that `unpacklo/hi_epi8(low, high)` gives back words 0-31 and 32-63 in order.
//             Code byte j holds the code of position j in its low nibble, of 32 + j in its high one.
//   bases     uint8 [N, G]: the group's base, bit 7 set where the group is raw.
//   raw       uint8 [R, 64]: the raw groups' high bytes, row by row, group by group.
//   raw_start int64 [N + 1]: row n's raw groups are raw[raw_start[n] .. raw_start[n + 1]).
// 1.5 bytes a weight plus one a group and 64 a raw group: 0.76x bfloat16's bytes.
//
// The linear sums every output as the plain bfloat16 decode kernel does (decode_linear.cpp: one
// float32 accumulator along k, 32 weights a vdpbf16ps, the lanes summed by _mm512_reduce_add_ps's
// tree, rounded once to bfloat16), so a coded matrix gives the plain one's bits for any rows of x.
// On session 38's Zen 4 the 1B shape's one-row GEMV took 0.75-0.89x plain bfloat16's time
// (benchmarks/bf16_lossless.cpp, benchmarks/results/bf16-lossless-2026-12-07-s38-zen4.log).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "decode_kernels.h"

namespace {

using genfn_kernels::CodedWeight;
constexpr int64_t kGroup = 64;
constexpr int64_t kGroupBytes = 96;  // a group's low bytes and codes in a record
constexpr uint8_t kRaw = 0x80;
constexpr const char* kEncodeOp = "coded_bf16_encode";
constexpr const char* kLinearOp = "coded_bf16_linear";

// Where group g of a row of G groups keeps its low bytes and its codes, from the row's records.
inline int64_t low_at(int64_t g) { return (g / 2) * 2 * kGroupBytes + (g % 2) * kGroup; }
inline int64_t codes_at(int64_t g, int64_t G) {
  const bool paired = (g | 1) < G;
  return (g / 2) * 2 * kGroupBytes + (paired ? 2 * kGroup : kGroup) + (g % 2) * (kGroup / 2);
}

// The largest byte of v.
__attribute__((target("avx512f,avx512bw"))) inline uint8_t max_byte(__m512i v) {
  __m256i a = _mm256_max_epu8(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  __m128i b = _mm_max_epu8(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  b = _mm_max_epu8(b, _mm_srli_si128(b, 8));
  b = _mm_max_epu8(b, _mm_srli_si128(b, 4));
  b = _mm_max_epu8(b, _mm_srli_si128(b, 2));
  b = _mm_max_epu8(b, _mm_srli_si128(b, 1));
  return static_cast<uint8_t>(_mm_cvtsi128_si32(b));
}

// Group g of row w (64 bfloat16 words): its low bytes and codes into the row's records, its base;
// returns whether it is raw, its high bytes then into `raw`.
__attribute__((target("avx512f,avx512bw"))) bool encode_group(const uint16_t* w, int64_t g, int64_t G,
                                                                uint8_t* records, uint8_t* base, uint8_t* raw) {
  const __m512i byte = _mm512_set1_epi16(0xFF);
  const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32);
  const __m512i low = _mm512_packus_epi16(_mm512_and_si512(w0, byte), _mm512_and_si512(w1, byte));
  const __m512i high = _mm512_packus_epi16(_mm512_srli_epi16(w0, 8), _mm512_srli_epi16(w1, 8));
  const __m512i magnitude = _mm512_and_si512(high, _mm512_set1_epi8(0x7F));
  const uint8_t top = max_byte(magnitude);
  const bool fits = top < 7 || !_mm512_cmplt_epu8_mask(magnitude, _mm512_set1_epi8(static_cast<char>(top - 7)));
  _mm512_storeu_si512(records + low_at(g), low);
  // sign << 3 | (top - magnitude): the sign bit moved from 7 to 3 within each byte.
  const __m512i codes = fits ? _mm512_or_si512(_mm512_sub_epi8(_mm512_set1_epi8(static_cast<char>(top)), magnitude),
                                               _mm512_srli_epi16(_mm512_and_si512(high, _mm512_set1_epi8(-128)), 4))
                             : _mm512_setzero_si512();
  const __m256i packed = _mm256_or_si256(_mm512_castsi512_si256(codes),
                                         _mm256_slli_epi16(_mm512_extracti64x4_epi64(codes, 1), 4));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(records + codes_at(g, G)), packed);
  *base = static_cast<uint8_t>(top | (fits ? 0 : kRaw));
  if (!fits) _mm512_storeu_si512(raw, high);
  return !fits;
}

// Group g's 64 high bytes in the low bytes' order: the raw list's next 64 (advancing it) or the
// codes through the base's table.
__attribute__((target("avx512f,avx512bw"))) inline __m512i high_bytes(const uint8_t* row, int64_t g, int64_t G,
                                                                      uint8_t base, const uint8_t*& raw) {
  if (__builtin_expect(base & kRaw, 0)) {
    const __m512i high = _mm512_loadu_si512(raw);
    raw += kGroup;
    return high;
  }
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + codes_at(g, G)));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, nibble)),
                                           _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), 1);
  // code c -> (base - (c & 7)) | (c & 8 ? 0x80 : 0)
  const __m512i offsets = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7));
  const __m512i signs = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, -128, -128, -128, -128, -128, -128, -128, -128));
  const __m512i table = _mm512_or_si512(_mm512_sub_epi8(_mm512_set1_epi8(static_cast<char>(base)), offsets), signs);
  return _mm512_shuffle_epi8(table, codes);
}

// How far ahead of the group being summed a row's records are fetched into L1: unpacking costs the
// stream its lead where the hardware prefetchers alone fetch it (Zen 4, one row: 0.79 against 0.82
// of plain bfloat16's time, benchmarks/bf16_lossless.cpp).
constexpr int64_t kAheadBytes = 4096;

// Rows [n0, n1) of w against the M rows of x (M <= 8): y[m * N + n], the plain kernel's sums. Records
// are fetched ahead up to row fetch_stop's (>= n1): the end of the thread's stream, not of this call's rows.
template <int M>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void coded_rows(const c10::BFloat16* x, const CodedWeight& w,
                                                                       int64_t n0, int64_t n1, c10::BFloat16* y,
                                                                       int64_t ld, int64_t fetch_stop) {
  const int64_t K = w.K, G = K / kGroup, row_bytes = G * kGroupBytes;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  const char* end = reinterpret_cast<const char*>(w.records + fetch_stop * row_bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.records + n * row_bytes;
    const uint8_t* bases = w.bases + n * G;
    const uint8_t* raw = w.raw + w.raw_start[n] * kGroup;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const char* ahead = reinterpret_cast<const char*>(row + low_at(g)) + kAheadBytes;
      if (ahead + 2 * kGroupBytes <= end && g % 2 == 0)
        for (int j = 0; j < 3; ++j) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
      const __m512i low = _mm512_loadu_si512(row + low_at(g));
      const __m512i high = high_bytes(row, g, G, bases[g], raw);
      const __m512bh first = (__m512bh)_mm512_unpacklo_epi8(low, high), second = (__m512bh)_mm512_unpackhi_epi8(low, high);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const uint16_t* xm = xs + m * K + g * kGroup;
        acc[m] = _mm512_dpbf16_ps(acc[m], first, (__m512bh)_mm512_loadu_si512(xm));
        acc[m] = _mm512_dpbf16_ps(acc[m], second, (__m512bh)_mm512_loadu_si512(xm + 32));
      }
    }
    for (int m = 0; m < M; ++m) y[m * ld + n] = c10::BFloat16(_mm512_reduce_add_ps(acc[m]));
  }
}

// Rows [n0, n1) against any M rows of x, in groups of at most 8 rows (genfn_kernels::group_size),
// every group over each chunk of rows while its records are in L1/L2; the stream is fetched ahead up
// to row fetch_stop (the thread's run: a claim of the stack's queue is a few rows of it).
void coded_share(int64_t M, const c10::BFloat16* x, const CodedWeight& w, int64_t n0, int64_t n1, c10::BFloat16* y,
                 int64_t fetch_stop) {
  constexpr int64_t kChunkRows = 16;
  const int64_t per = genfn_kernels::group_size(M);
  for (int64_t c0 = n0; c0 < n1; c0 += kChunkRows) {
    const int64_t c1 = std::min(n1, c0 + kChunkRows);
    for (int64_t m0 = 0; m0 < M; m0 += per) {
      const int64_t rows = std::min(per, M - m0);
      const c10::BFloat16* xg = x + m0 * w.K;
      c10::BFloat16* yg = y + m0 * w.N;
      genfn_kernels::with_rows(rows, [&](auto m) { coded_rows<decltype(m)::value>(xg, w, c0, c1, yg, w.N, fetch_stop); });
    }
  }
}

}  // namespace

namespace genfn_kernels {

CodedWeight coded_weight_of(const at::Tensor& records, const at::Tensor& bases, const at::Tensor& raw,
                            const at::Tensor& raw_start, const char* op) {
  TORCH_CHECK(records.dim() == 2 && records.scalar_type() == at::kByte && records.is_contiguous(), op,
              ": records must be a contiguous uint8 [N, K / 64 * 96] tensor, got ", records.sizes());
  const int64_t N = records.size(0), G = records.size(1) / kGroupBytes;
  TORCH_CHECK(records.size(1) == G * kGroupBytes && G >= 1, op, ": records' rows must hold 96 bytes a group of 64, got ",
              records.size(1));
  TORCH_CHECK(bases.scalar_type() == at::kByte && bases.is_contiguous() && bases.numel() == N * G, op,
              ": bases must be a contiguous uint8 [", N, ", ", G, "] tensor, got ", bases.sizes());
  TORCH_CHECK(raw_start.scalar_type() == at::kLong && raw_start.is_contiguous() && raw_start.numel() == N + 1, op,
              ": raw_start must be a contiguous int64 [", N + 1, "] tensor, got ", raw_start.sizes());
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() % kGroup == 0, op,
              ": raw must be a contiguous uint8 [R, 64] tensor, got ", raw.sizes());
  const int64_t* start = raw_start.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[N] * kGroup == raw.numel(), op, ": raw_start must run from 0 to raw's ",
              raw.numel() / kGroup, " groups, got ", start[0], " .. ", start[N]);
  TORCH_CHECK(records.device().is_cpu() && bases.device().is_cpu() && raw.device().is_cpu(), op, ": CPU tensors only");
  return {records.data_ptr<uint8_t>(), bases.data_ptr<uint8_t>(), raw.data_ptr<uint8_t>(), start, N, G * kGroup};
}

}  // namespace genfn_kernels

namespace {

using genfn_kernels::coded_weight_of;

std::tuple<at::Tensor, at::Tensor> coded_bf16_encode(const at::Tensor& weight, at::Tensor& records,
                                                     at::Tensor& bases) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(), kEncodeOp,
              ": weight must be a bfloat16 [N, K] CPU tensor, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % kGroup == 0 && K > 0, kEncodeOp, ": K (", K, ") must be a positive multiple of 64");
  TORCH_CHECK(genfn_kernels::cpu_has_avx512_bf16(), kEncodeOp,
              ": this CPU has no AVX512_BF16, which the coded weights' kernels need (vdpbf16ps)");
  const int64_t G = K / kGroup;
  TORCH_CHECK(records.scalar_type() == at::kByte && records.is_contiguous() && records.dim() == 2 &&
                  records.size(0) == N && records.size(1) == G * kGroupBytes,
              kEncodeOp, ": records must be a contiguous uint8 [", N, ", ", G * kGroupBytes, "] tensor, got ",
              records.sizes());
  TORCH_CHECK(bases.scalar_type() == at::kByte && bases.is_contiguous() && bases.numel() == N * G, kEncodeOp,
              ": bases must be a contiguous uint8 [", N, ", ", G, "] tensor, got ", bases.sizes());
  const at::Tensor w = weight.contiguous();
  at::Tensor start = at::empty({N + 1}, at::kLong);
  // Each span of rows lists its raw groups apart (few: ~0.5-1 % of the groups), then they go into
  // place once every row's count is known.
  constexpr int64_t kSpanRows = 64;
  const int64_t spans = (N + kSpanRows - 1) / kSpanRows;
  std::vector<std::vector<uint8_t>> spilled(spans);
  std::vector<int64_t> count(N);
  const uint16_t* words = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint8_t* rec = records.data_ptr<uint8_t>();
  uint8_t* base = bases.data_ptr<uint8_t>();
  at::parallel_for(0, spans, 1, [&](int64_t s0, int64_t s1) {
    alignas(64) uint8_t high[kGroup];
    for (int64_t span = s0; span < s1; ++span)
      for (int64_t n = span * kSpanRows; n < std::min(N, (span + 1) * kSpanRows); ++n) {
        count[n] = 0;
        for (int64_t g = 0; g < G; ++g)
          if (encode_group(words + n * K + g * kGroup, g, G, rec + n * G * kGroupBytes, base + n * G + g, high)) {
            spilled[span].insert(spilled[span].end(), high, high + kGroup);
            ++count[n];
          }
      }
  });
  int64_t* s = start.data_ptr<int64_t>();
  s[0] = 0;
  for (int64_t n = 0; n < N; ++n) s[n + 1] = s[n] + count[n];
  at::Tensor raw = at::empty({s[N], kGroup}, at::kByte);
  uint8_t* out = raw.data_ptr<uint8_t>();
  for (int64_t span = 0; span < spans; ++span)
    if (!spilled[span].empty())
      std::memcpy(out + s[span * kSpanRows] * kGroup, spilled[span].data(), spilled[span].size());
  return {raw, start};
}

// Rows rows[i] of w (row i itself where rows is null), i < n, decoded into out [n, K].
void decode_rows(const CodedWeight& w, const int64_t* rows, int64_t n, at::BFloat16* out) {
  const int64_t G = w.K / kGroup;
  __m512i* dst = reinterpret_cast<__m512i*>(out);
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = rows ? rows[i] : i;
      const uint8_t* row = w.records + r * G * kGroupBytes;
      const uint8_t* raw_row = w.raw + w.raw_start[r] * kGroup;
      for (int64_t g = 0; g < G; ++g) {
        const __m512i low = _mm512_loadu_si512(row + low_at(g)), high = high_bytes(row, g, G, w.bases[r * G + g], raw_row);
        _mm512_storeu_si512(dst + (i * G + g) * 2, _mm512_unpacklo_epi8(low, high));
        _mm512_storeu_si512(dst + (i * G + g) * 2 + 1, _mm512_unpackhi_epi8(low, high));
      }
    }
  });
}

at::Tensor coded_bf16_decode(const at::Tensor& records, const at::Tensor& bases, const at::Tensor& raw,
                             const at::Tensor& raw_start) {
  const CodedWeight w = coded_weight_of(records, bases, raw, raw_start, "coded_bf16_decode");
  at::Tensor out = at::empty({w.N, w.K}, at::kBFloat16);
  decode_rows(w, nullptr, w.N, out.data_ptr<at::BFloat16>());
  return out;
}

// Rows `index` of the coded matrix, bfloat16 [len(index), K]: an embedding lookup in a tied head's
// table, which reads only the rows it gives.
at::Tensor coded_bf16_rows(const at::Tensor& records, const at::Tensor& bases, const at::Tensor& raw,
                           const at::Tensor& raw_start, const at::Tensor& index) {
  const CodedWeight w = coded_weight_of(records, bases, raw, raw_start, "coded_bf16_rows");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.dim() == 1, "coded_bf16_rows: index must be int64 [n], got ",
              index.scalar_type(), " ", index.sizes());
  const at::Tensor rows = index.contiguous();
  const int64_t* at_row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(at_row[i] >= 0 && at_row[i] < w.N, "coded_bf16_rows: index ", at_row[i], " is outside the ", w.N,
                " rows");
  at::Tensor out = at::empty({rows.numel(), w.K}, at::kBFloat16);
  decode_rows(w, at_row, rows.numel(), out.data_ptr<at::BFloat16>());
  return out;
}

// A prefill's x @ decode(w).T (or SwiGLU of it, `swiglu`) through the bfloat16 GEMM ops
// (bf16_gemm.cpp's bf16_gemm_plain / bf16_gemm_swiglu), the matrix decoded into this thread's
// scratch: the plain matrix's bits. Decoded into a fresh tensor each call, the 1B shape's 512-token
// prefill ran 0.79x the plain model's: its 2.2 GB of new pages a prefill, not the decoding, cost it.
at::Tensor coded_bf16_gemm(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bases,
                           const at::Tensor& raw, const at::Tensor& raw_start, bool swiglu) {
  const CodedWeight w = coded_weight_of(records, bases, raw, raw_start, "coded_bf16_gemm");
  thread_local std::vector<at::BFloat16> scratch;  // the largest matrix decoded so far
  scratch.resize(std::max<size_t>(scratch.size(), static_cast<size_t>(w.N * w.K)));
  decode_rows(w, nullptr, w.N, scratch.data());
  const at::Tensor plain = at::from_blob(scratch.data(), {w.N, w.K}, at::TensorOptions().dtype(at::kBFloat16));
  auto& dispatcher = c10::Dispatcher::singleton();
  if (swiglu) {
    static const auto op = dispatcher.findSchemaOrThrow("genfn_kernels::bf16_gemm_swiglu", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(x, plain);
  }
  static const auto op =
      dispatcher.findSchemaOrThrow("genfn_kernels::bf16_gemm_plain", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, bool)>();
  return op.call(x, plain, c10::nullopt, false);
}

at::Tensor coded_bf16_linear(const at::Tensor& x, const at::Tensor& records, const at::Tensor& bases,
                             const at::Tensor& raw, const at::Tensor& raw_start) {
  const CodedWeight w = coded_weight_of(records, bases, raw, raw_start, kLinearOp);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == w.K, kLinearOp,
              ": x must be bfloat16 [..., ", w.K, "] on the CPU, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(genfn_kernels::cpu_has_avx512_bf16(), kLinearOp, ": this CPU has no AVX512_BF16 (vdpbf16ps)");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.numel() / w.K;
  auto sizes = x.sizes().vec();
  sizes.back() = w.N;
  at::Tensor y = at::empty({M, w.N}, x.options());
  if (M > 0) {
    const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) { coded_share(M, xp, w, n0, n1, yp, n1); });
  }
  return y.view(sizes);
}

}  // namespace

namespace genfn_kernels {

void coded_linear_share(int64_t M, const c10::BFloat16* x, const CodedWeight& w, c10::BFloat16* y, int64_t t,
                        RowQueue& queue) {
  // ~8 KiB of records a claim, as the plain kernel's chunks.
  const int64_t chunk = std::max<int64_t>(1, 8192 / (w.K / kGroup * kGroupBytes));
  run_balanced(
      queue, t, chunk,
      [&](int64_t begin, int64_t end, int64_t, int64_t stop) { coded_share(M, x, w, begin, end, y, stop); },
      [&](int64_t begin, int64_t end) { coded_share(M, x, w, begin, end, y, end); });
}

}  // namespace genfn_kernels

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  // Fills records and bases (allocated where the weight is to live); returns raw and raw_start.
  m.def("coded_bf16_encode(Tensor weight, Tensor(a!) records, Tensor(b!) bases) -> (Tensor, Tensor)");
  m.def("coded_bf16_decode(Tensor records, Tensor bases, Tensor raw, Tensor raw_start) -> Tensor");
  m.def("coded_bf16_rows(Tensor records, Tensor bases, Tensor raw, Tensor raw_start, Tensor index) -> Tensor");
  m.def("coded_bf16_linear(Tensor x, Tensor records, Tensor bases, Tensor raw, Tensor raw_start) -> Tensor");
  m.def("coded_bf16_gemm(Tensor x, Tensor records, Tensor bases, Tensor raw, Tensor raw_start, bool swiglu) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("coded_bf16_encode", &coded_bf16_encode);
  m.impl("coded_bf16_decode", &coded_bf16_decode);
  m.impl("coded_bf16_rows", &coded_bf16_rows);
  m.impl("coded_bf16_linear", &coded_bf16_linear);
  m.impl("coded_bf16_gemm", &coded_bf16_gemm);
}
