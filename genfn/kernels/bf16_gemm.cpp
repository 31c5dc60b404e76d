// y = x @ w.T for bfloat16 x with tens to hundreds of rows: continuous batching's linears.
//
// oneDNN's GEMM on a pre-packed weight reached ~45 % of this Zen 4's bfloat16 peak at 32 rows
// (~180-200 GFLOP/s on two cores against ~370 at 512 rows). This kernel is the textbook
// outer-product micro-kernel on `vdpbf16ps`: the weight is packed once into panels of 48 output
// columns with each pair of k interleaved ([N/48][K/2][48][2]), so one step of k-pairs loads three
// 64-byte vectors of the panel, broadcasts a pair of x values per row, and issues 3 x 8
// dot-products into 24 float32 accumulators. Products are summed in float32 and rounded once.
// Threads take contiguous runs of panels; within a panel, row blocks of 8 reuse it from L1/L2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdlib>
#include <memory>
#include <type_traits>
#include <utility>

#include "decode_kernels.h"

namespace {

constexpr int64_t kPanel = 48;    // output columns per packed panel: three vectors of 16
constexpr int64_t kRowBlock = 8;  // rows of x per micro-kernel call

inline int64_t panels_of(int64_t N) { return (N + kPanel - 1) / kPanel; }
inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }

// The next panel's weight: K2 * 192 contiguous bytes at `first` (a packed panel, or a plain
// weight's 48 rows), or two halves of K2 * 96 at `first` and `second` (the SwiGLU panel's 24 gate
// rows and their 24 up rows); first null: nothing to fetch.
struct Ahead {
  static constexpr int64_t kStepBytes = kPanel * 4;  // a step's words
  const char* first = nullptr;
  const char* second = nullptr;
};

// Rows [0, R) of x (row stride K, K2 pairs read as 32-bit words) against one packed panel; hands
// each row's 48 float32 sums to store(row, sums).
// `ahead`: the weight the next panel is made of, fetched into L2 a step at a time while this one
// is summed, so that it streams from memory under the arithmetic (few row blocks a panel) or is
// in L2 when the next panel is packed from it (a plain weight, whose rows the transposes would
// otherwise read at memory latency, 16 at a time).
template <int R, typename Store>
__attribute__((target("avx512bw,avx512bf16"))) void micro_kernel(const uint32_t* x, int64_t x_words,
                                                                  const __m512bh* panel, int64_t K2,
                                                                  const Ahead& ahead, const Store& store) {
  __m512 acc[R][3];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 3; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    if (ahead.first && !ahead.second) {
      const char* step = ahead.first + k2 * Ahead::kStepBytes;
      _mm_prefetch(step, _MM_HINT_T1);
      _mm_prefetch(step + 64, _MM_HINT_T1);
      _mm_prefetch(step + 128, _MM_HINT_T1);
    } else if (ahead.first) {
      const int64_t at = k2 * Ahead::kStepBytes / 2;
      _mm_prefetch(ahead.first + at, _MM_HINT_T1);
      _mm_prefetch(ahead.first + at + 64, _MM_HINT_T1);
      _mm_prefetch(ahead.second + at, _MM_HINT_T1);
      _mm_prefetch(ahead.second + at + 64, _MM_HINT_T1);
    }
    const __m512bh b0 = panel[k2 * 3], b1 = panel[k2 * 3 + 1], b2 = panel[k2 * 3 + 2];
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_words + k2]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
    }
  }
  for (int r = 0; r < R; ++r) store(r, acc[r]);
}

// A linear's panel: columns [n0, n0 + width) of y (row stride N), plus the bias.
template <typename Out>
struct LinearStore {
  Out* y;  // y + n0 of the block's first row
  int64_t N, width;
  const float* bias;  // bias + n0, or null
  void operator()(int64_t row, const __m512* sums) const {
    for (int v = 0; v < 3; ++v) {
      const int64_t c = v * 16;
      if (c >= width) break;
      const __mmask16 keep = genfn_kernels::lanes_below(width - c);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + c) : _mm512_setzero_ps();
      genfn_kernels::store16(y + row * N + c, _mm512_add_ps(sums[v], b), keep);
    }
  }
  LinearStore rows_down(int64_t m) const { return {y + m * N, N, width, bias}; }
};

// A SwiGLU panel (gate features [f0, f0 + 24) in columns 0-23, their up features in 24-47):
// silu(gate) * up in float32, rounded once into features [f0, f0 + width) of act (row stride F).
struct SwigluStore {
  c10::BFloat16* act;  // act + f0 of the block's first row
  int64_t F, width;
  void operator()(int64_t row, const __m512* sums) const {
    // sums: gate 0-15 | gate 16-23, up 0-7 | up 8-23: line the up features up under their gates.
    const __m512i up_low = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i up_high = _mm512_setr_epi32(24, 25, 26, 27, 28, 29, 30, 31, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 up0 = _mm512_permutex2var_ps(sums[1], up_low, sums[2]);
    const __m512 up1 = _mm512_permutex2var_ps(sums[1], up_high, sums[2]);
    c10::BFloat16* out = act + row * F;
    genfn_kernels::store16(out, _mm512_mul_ps(genfn_kernels::silu16(sums[0]), up0), genfn_kernels::lanes_below(width));
    if (width > 16)
      genfn_kernels::store16(out + 16, _mm512_mul_ps(genfn_kernels::silu16(sums[1]), up1),
                             genfn_kernels::lanes_below(std::min<int64_t>(width - 16, 8)));
  }
  SwigluStore rows_down(int64_t m) const { return {act + m * F, F, width}; }
};

// Compiled for the micro-kernel's ISA so that its calls inline here: GCC inlines a function only
// into callers with at least its target features. Out of line, the 1B shapes' 512-row GEMMs ran
// 2.5-4 % slower on the Zen 4, the 1B BF16 prefill ~1 % (docs/guides/k-quants-and-scale.md, Session 37).
template <typename Store>
__attribute__((target("avx512bw,avx512bf16"))) void rows_against_panel(const uint32_t* x, int64_t x_words, int64_t M,
                                                                       const __m512bh* panel, int64_t K2, Ahead ahead,
                                                                       const Store& store) {
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock, ahead = Ahead{})
    micro_kernel<kRowBlock>(x + m * x_words, x_words, panel, K2, ahead, store.rows_down(m));
  switch (M - m) {
#define GENFN_TAIL(R) \
  case R: return micro_kernel<R>(x + m * x_words, x_words, panel, K2, ahead, store.rows_down(m));
    GENFN_TAIL(1)
    GENFN_TAIL(2)
    GENFN_TAIL(3)
    GENFN_TAIL(4)
    GENFN_TAIL(5)
    GENFN_TAIL(6)
    GENFN_TAIL(7)
#undef GENFN_TAIL
    default: return;
  }
}

// The 16 x 16 block of 32-bit words rows[i][0..15] written transposed to out (row stride
// `out_stride` words): 16 k-pairs of 16 weight rows become 16 panel steps of 16 columns.
void transpose_words_16x16(const uint32_t* const* rows, uint32_t* out, int64_t out_stride) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows[i]);
  // A transpose swaps the off-diagonal b x b blocks of every 2b x 2b block, b = 8, 4, 2, 1: rows
  // i and i + b trade the words whose column has bit b set in row i and clear in row i + b.
  // Unrolled whole, so that r stays in registers and the index vectors are constants.
#pragma GCC unroll 4
  for (int b = 8; b >= 1; b /= 2) {
    alignas(64) int32_t upper[16], lower[16];  // sources for row i and row i + b (16 + c: row i + b's)
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      upper[c] = c & b ? 16 + c - b : c;
      lower[c] = c & b ? 16 + c : c + b;
    }
    const __m512i to_upper = _mm512_load_si512(upper), to_lower = _mm512_load_si512(lower);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      if (!(i & b)) {
        const __m512i top = r[i];
        r[i] = _mm512_permutex2var_epi32(top, to_upper, r[i + b]);
        r[i + b] = _mm512_permutex2var_epi32(top, to_lower, r[i + b]);
      }
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + i * out_stride, r[i]);
}

// One panel ([K2][48] words) packed from plain bfloat16 weight rows, rows[c] the row of column c
// (length K) or null for a column of zeros; pack_bf16_gemm_weight keeps what it packs.
void pack_panel(const uint16_t* const* rows, int64_t K, uint32_t* panel) {
  const int64_t K2 = pairs_of(K);
  // With K even a row's pairs are its 32-bit words; an odd K's rows start mid-word: pair by pair.
  const int64_t blocked_pairs = K % 2 == 0 ? K / 2 / 16 * 16 : 0;
  bool blocked[kPanel / 16] = {};
  for (int64_t c0 = 0; c0 < kPanel && blocked_pairs; c0 += 16) {
    const uint32_t* words[16];
    bool whole = true;
    for (int i = 0; i < 16; ++i) {
      whole = whole && rows[c0 + i];
      words[i] = reinterpret_cast<const uint32_t*>(rows[c0 + i]);
    }
    if (!whole) continue;
    blocked[c0 / 16] = true;
    for (int64_t k2 = 0; k2 < blocked_pairs; k2 += 16) {
      transpose_words_16x16(words, panel + k2 * kPanel + c0, kPanel);
      for (auto& w : words) w += 16;
    }
  }
  for (int64_t c = 0; c < kPanel; ++c) {
    const uint16_t* row = rows[c];
    for (int64_t k2 = blocked[c / 16] ? blocked_pairs : 0; k2 < K2; ++k2) {
      uint32_t word = 0;
      if (row) word = row[2 * k2] | (2 * k2 + 1 < K ? static_cast<uint32_t>(row[2 * k2 + 1]) << 16 : 0u);
      panel[k2 * kPanel + c] = word;
    }
  }
}

// panel p's weight rows of a plain [N, K] weight, null past its last row (a column of zeros)
void panel_rows(const uint16_t* w, int64_t p, int64_t N, int64_t K, const uint16_t** rows) {
  for (int64_t c = 0; c < kPanel; ++c) rows[c] = p * kPanel + c < N ? w + (p * kPanel + c) * K : nullptr;
}

// packed[p][k2][c][j] = w[p * 48 + c][2 * k2 + j], zero outside w: every panel as bf16_gemm_plain
// packs it on the fly, kept.
at::Tensor pack_bf16_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_bf16_gemm_weight: `weight` must be a 2-D bfloat16 CPU tensor, got ", weight.sizes(), " ",
              weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = panels_of(N), K2 = pairs_of(K);
  at::Tensor packed = at::empty({P, K2, kPanel, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    const uint16_t* rows[kPanel];
    for (int64_t p = begin; p < end; ++p) {
      panel_rows(src, p, N, K, rows);
      pack_panel(rows, K, dst + p * K2 * kPanel);
    }
  });
  return packed;
}

// A thread's buffer for the panel it packs, 64-byte aligned for the kernel's loads.
class PanelBuffer {
 public:
  uint32_t* get(int64_t K2) {
    if (!words_) {
      words_.reset(static_cast<uint32_t*>(std::aligned_alloc(64, K2 * kPanel * sizeof(uint32_t))));
      TORCH_CHECK(words_, "bf16_gemm: out of memory for a weight panel");
    }
    return words_.get();
  }

 private:
  std::unique_ptr<uint32_t, decltype(&std::free)> words_{nullptr, &std::free};
};

// x [M, K] bfloat16 (checked) as the kernel reads it: whole 32-bit pairs, an odd K padded with a zero.
struct Rows {
  at::Tensor padded;
  const uint32_t* words;
  int64_t M, K, K2;
};

Rows prepare_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(genfn_kernels::cpu_has_avx512_bf16(), op, ": needs a CPU with AVX512_BF16");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16, op,
              ": `x` must be a 2-D bfloat16 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  const int64_t K = x.size(1);
  at::Tensor padded = K % 2 ? at::constant_pad_nd(x, {0, 1}) : x.contiguous();
  const auto* words = reinterpret_cast<const uint32_t*>(padded.data_ptr<c10::BFloat16>());
  return {padded, words, x.size(0), K, pairs_of(K)};
}

at::Tensor plain_weight(const char* op, const at::Tensor& weight, int64_t K) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, op,
              ": `weight` must be a 2-D bfloat16 CPU tensor, got ", weight.sizes(), " ", weight.scalar_type());
  TORCH_CHECK(weight.size(1) == K, op, ": `weight` has ", weight.size(1), " columns, `x` has ", K);
  return weight.contiguous();
}

at::Tensor float_bias(const char* op, const c10::optional<at::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": `bias` must be [", N, "], got ", bias->sizes());
  return bias->to(at::kFloat).contiguous();
}

// Threads take contiguous runs of `panels`; panel p's words come from panel_of(p, buffer) (a
// packed weight's, or packed into the thread's buffer) and its sums go to store_of(p).
template <typename PanelOf, typename StoreOf>
void over_panels(const Rows& x, int64_t panels, const PanelOf& panel_of, const StoreOf& store_of) {
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    PanelBuffer buffer;
    for (int64_t p = begin; p < end; ++p) {
      const auto [panel, ahead] = panel_of(p, p + 1 < end, buffer);
      rows_against_panel(x.words, x.K2, x.M, panel, x.K2, ahead, store_of(p));
    }
  });
}

// y [M, N] (float32 or bfloat16) = x @ w.T + bias, one panel of 48 columns at a time.
template <typename PanelOf>
at::Tensor linear_over_panels(const Rows& x, int64_t N, const at::Tensor& bias_f, bool out_float32,
                              const at::TensorOptions& options, const PanelOf& panel_of) {
  at::Tensor y = at::empty({x.M, N}, options.dtype(out_float32 ? at::kFloat : at::kBFloat16));
  if (x.M == 0 || N == 0) return y;
  const float* bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto run = [&](auto* out) {
    using Out = std::remove_pointer_t<decltype(out)>;
    over_panels(x, panels_of(N), panel_of, [&](int64_t p) {
      const int64_t n0 = p * kPanel;
      return LinearStore<Out>{out + n0, N, std::min<int64_t>(kPanel, N - n0), bias ? bias + n0 : nullptr};
    });
  };
  if (out_float32) run(y.data_ptr<float>());
  else run(y.data_ptr<c10::BFloat16>());
  return y;
}

// x [M, K] bfloat16; packed from pack_bf16_gemm_weight of an [N, K] weight; bias [N] float32 or
// bfloat16. Returns [M, N] float32 (out_float32) or bfloat16.
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                     bool out_float32) {
  const Rows rows = prepare_rows("bf16_gemm", x);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == panels_of(N) && packed.size(1) == rows.K2 &&
                  packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "bf16_gemm: `packed` is not pack_bf16_gemm_weight's packing of an [", N, ", ", rows.K, "] weight");
  const auto* pp = reinterpret_cast<const __m512bh*>(packed.data_ptr<c10::BFloat16>());
  const int64_t vectors = rows.K2 * 3;
  return linear_over_panels(rows, N, float_bias("bf16_gemm", bias, N), out_float32, x.options(),
                            [&](int64_t p, bool more, PanelBuffer&) {
                              const char* next = reinterpret_cast<const char*>(pp + (p + 1) * vectors);
                              return std::pair{pp + p * vectors, more ? Ahead{next} : Ahead{}};
                            });
}

// bf16_gemm on a plain [N, K] bfloat16 weight: each thread packs one panel at a time into its own
// buffer (L2-sized) and runs every row block against it, so no packed copy of the weight is kept;
// at prefill row counts a panel's packing (one 32-bit transpose) is small against its M / 8
// passes. The same values and sums as bf16_gemm on pack_bf16_gemm_weight(weight): the same bits.
at::Tensor bf16_gemm_plain(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           bool out_float32) {
  const Rows rows = prepare_rows("bf16_gemm_plain", x);
  const at::Tensor w = plain_weight("bf16_gemm_plain", weight, rows.K);
  const int64_t N = w.size(0), K = rows.K;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  return linear_over_panels(rows, N, float_bias("bf16_gemm_plain", bias, N), out_float32, x.options(),
                            [&](int64_t p, bool more, PanelBuffer& buffer) {
                              const uint16_t* columns[kPanel];
                              panel_rows(wp, p, N, K, columns);
                              uint32_t* panel = buffer.get(rows.K2);
                              pack_panel(columns, K, panel);
                              const char* next = reinterpret_cast<const char*>(wp + (p + 1) * kPanel * K);
                              return std::pair{reinterpret_cast<const __m512bh*>(panel), more ? Ahead{next} : Ahead{}};
                            });
}

// silu(x @ gate.T) * (x @ up.T) for gate_up = [gate; up] ([2F, K] bfloat16, plain): [M, F]
// bfloat16. Each panel packs 24 gate rows beside their 24 up rows, so a row block's sums hold
// both halves of its features and SwiGLU runs on them in float32 before the one rounding (the
// unfused path rounds gate and up to bfloat16 first: within that rounding of it).
at::Tensor bf16_gemm_swiglu(const at::Tensor& x, const at::Tensor& gate_up) {
  const Rows rows = prepare_rows("bf16_gemm_swiglu", x);
  const at::Tensor w = plain_weight("bf16_gemm_swiglu", gate_up, rows.K);
  TORCH_CHECK(w.size(0) % 2 == 0, "bf16_gemm_swiglu: `gate_up` must have an even number of rows, got ", w.size(0));
  const int64_t F = w.size(0) / 2, K = rows.K, half = kPanel / 2;
  at::Tensor act = at::empty({rows.M, F}, x.options());
  if (rows.M == 0 || F == 0) return act;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  c10::BFloat16* out = act.data_ptr<c10::BFloat16>();
  over_panels(
      rows, (F + half - 1) / half,
      [&](int64_t p, bool more, PanelBuffer& buffer) {
        const uint16_t* columns[kPanel];
        for (int64_t c = 0; c < half; ++c) {
          const int64_t f = p * half + c;
          columns[c] = f < F ? wp + f * K : nullptr;
          columns[half + c] = f < F ? wp + (F + f) * K : nullptr;
        }
        uint32_t* panel = buffer.get(rows.K2);
        pack_panel(columns, K, panel);
        const int64_t next = (p + 1) * half * K;  // the next panel's gate rows, and its up rows
        return std::pair{reinterpret_cast<const __m512bh*>(panel),
                         more ? Ahead{reinterpret_cast<const char*>(wp + next),
                                      reinterpret_cast<const char*>(wp + F * K + next)}
                              : Ahead{}};
      },
      [&](int64_t p) { return SwigluStore{out + p * half, F, std::min<int64_t>(half, F - p * half)}; });
  return act;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genfn_kernels, m) {
  m.def("pack_bf16_gemm_weight(Tensor weight) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor packed, int N, Tensor? bias, bool out_float32) -> Tensor");
  m.def("bf16_gemm_plain(Tensor x, Tensor weight, Tensor? bias, bool out_float32) -> Tensor");
  m.def("bf16_gemm_swiglu(Tensor x, Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(genfn_kernels, CPU, m) {
  m.impl("pack_bf16_gemm_weight", &pack_bf16_gemm_weight);
  m.impl("bf16_gemm", &bf16_gemm);
  m.impl("bf16_gemm_plain", &bf16_gemm_plain);
  m.impl("bf16_gemm_swiglu", &bf16_gemm_swiglu);
}
